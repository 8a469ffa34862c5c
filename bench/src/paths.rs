//! Where things live: the workspace root and the peers' venvs.

use std::path::{Path, PathBuf};

/// The Cargo workspace root: the nearest ancestor of the current directory whose Cargo.toml has
/// `[workspace]`, else the one this crate was built in.
pub fn workspace_root() -> PathBuf {
    if let Ok(cwd) = std::env::current_dir() {
        for dir in cwd.ancestors() {
            let toml = dir.join("Cargo.toml");
            if std::fs::read_to_string(&toml).is_ok_and(|t| t.contains("[workspace]")) {
                return dir.to_path_buf();
            }
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The peers' venvs (`make peers`): `$KVROUTE_PEERS`, else `.work/peers` under the workspace root.
pub fn peers_dir() -> PathBuf {
    std::env::var_os("KVROUTE_PEERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".work/peers"))
}
