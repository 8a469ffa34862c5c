//! Where the Envoy binary, the built filter and the shipped bootstrap live.

use crate::HarnessError;
use std::path::{Path, PathBuf};

/// The workspace root (this crate's parent directory).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The bootstrap the project ships, which every harness Envoy starts from.
pub fn shipped_bootstrap() -> PathBuf {
    workspace_root().join("envoy/kvroute.yaml")
}

/// The shipped precise-mode bootstrap: the same, with kvroute polling kvroute-indexer.
pub fn precise_bootstrap() -> PathBuf {
    workspace_root().join("envoy/kvroute-precise.yaml")
}

/// The shipped bootstrap of plain Envoy asking kvroute-epp over ext_proc.
pub fn epp_bootstrap() -> PathBuf {
    workspace_root().join("envoy/kvroute-epp.yaml")
}

/// Envoy: `$ENVOY_BIN`, else `<workspace>/.venv/bin/envoy` (what `make deps` installs), else `envoy`
/// on `PATH`. Never silently skipped: missing means an error telling how to install it.
pub fn envoy_bin() -> Result<PathBuf, HarnessError> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        return if is_file(&p) {
            Ok(p)
        } else {
            Err(HarnessError::Missing(format!(
                "ENVOY_BIN={} does not exist; run `make deps wasm`",
                p.display()
            )))
        };
    }
    let venv = workspace_root().join(".venv/bin/envoy");
    if is_file(&venv) {
        return Ok(venv);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("envoy"))
        .find(|p| is_file(p))
        .ok_or_else(|| {
            HarnessError::Missing(
                "envoy not found (ENVOY_BIN unset, no .venv/bin/envoy, none on PATH); run `make deps wasm`"
                    .into(),
            )
        })
}

/// The filter: `$KVROUTE_WASM`, else `<workspace>/target/wasm32-wasip1/release/kvroute.wasm`.
pub fn kvroute_wasm() -> Result<PathBuf, HarnessError> {
    let p = std::env::var_os("KVROUTE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/wasm32-wasip1/release/kvroute.wasm"));
    if is_file(&p) {
        Ok(p)
    } else {
        Err(HarnessError::Missing(format!(
            "kvroute.wasm not found at {}; run `make deps wasm`",
            p.display()
        )))
    }
}

/// The floor filter: `$KVROUTE_FLOOR_WASM`, else
/// `<workspace>/target/wasm32-wasip1/release/floor_filter.wasm` (built by `make build`).
pub fn floor_wasm() -> Result<PathBuf, HarnessError> {
    let p = std::env::var_os("KVROUTE_FLOOR_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/wasm32-wasip1/release/floor_filter.wasm"));
    if is_file(&p) {
        Ok(p)
    } else {
        Err(HarnessError::Missing(format!(
            "floor_filter.wasm not found at {}; run `make build`",
            p.display()
        )))
    }
}

fn is_file(p: &Path) -> bool {
    p.is_file()
}
