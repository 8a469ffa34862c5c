//! README.md's layout table names what the repository holds: every top-level folder under git,
//! and every module of the filter's crate (`src/*.rs` and `src/*/`), so a newcomer reading it
//! finds each one and a module added without a line there fails here.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The README's `## Layout` section, up to the next `## ` heading.
fn layout_section() -> String {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).expect("README.md");
    let start = readme
        .find("\n## Layout")
        .expect("README.md has a `## Layout` section");
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3);
    rest[..end].to_string()
}

/// Top-level folders holding files git tracks; every non-hidden folder but `target` outside git.
fn top_level_dirs() -> BTreeSet<String> {
    let tracked = Command::new("git")
        .args(["-C", ROOT, "ls-files"])
        .output()
        .ok()
        .filter(|o| o.status.success() && !o.stdout.is_empty());
    match tracked {
        Some(out) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|p| p.split_once('/').map(|(dir, _)| dir.to_string()))
            .filter(|d| !d.starts_with('.'))
            .collect(),
        None => std::fs::read_dir(ROOT)
            .expect("the repository")
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|d| !d.starts_with('.') && d != "target")
            .collect(),
    }
}

/// The crate's modules: `src/NAME.rs` and `src/NAME/`, the crate root aside.
fn src_modules() -> BTreeSet<String> {
    std::fs::read_dir(Path::new(ROOT).join("src"))
        .expect("src/")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                Some(name)
            } else {
                name.strip_suffix(".rs").map(str::to_string)
            }
        })
        .filter(|m| m != "lib" && m != "main")
        .collect()
}

#[test]
fn the_layout_table_names_every_top_level_folder() {
    let layout = layout_section();
    let dirs = top_level_dirs();
    assert!(dirs.contains("src") && dirs.contains("tests"), "{dirs:?}");
    let missing: Vec<_> = dirs
        .iter()
        .filter(|d| !layout.contains(&format!("`{d}/`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's layout table does not name these top-level folders (as `name/`): {missing:?}"
    );
}

#[test]
fn the_layout_table_names_every_module_of_the_filter() {
    let layout = layout_section();
    let missing: Vec<_> = src_modules()
        .into_iter()
        .filter(|m| !layout.contains(&format!("`{m}`")) && !layout.contains(&format!("`{m}/`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's layout table does not name these src/ modules (as `name` or `name/`): {missing:?}"
    );
}
