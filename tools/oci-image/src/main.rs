//! `oci-image WASM DIR [TAG]`: writes WASM as an OCI image layout at DIR (tag TAG, default
//! `kvroute`) and prints the manifest digest, the value of a WasmPlugin's `sha256` field.
//! `oci-image --executable BINARY DIR [TAG]`: the same for a statically linked Linux executable,
//! run as the image's entrypoint (tag default: the file's name).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "usage: oci-image [--executable] FILE DIR [TAG]";

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let executable = args.first().map(String::as_str) == Some("--executable");
    if executable {
        args.remove(0);
    }
    let (file, dir, tag) = match args.as_slice() {
        [file, dir] => (PathBuf::from(file), dir, None),
        [file, dir, tag] => (PathBuf::from(file), dir, Some(tag.as_str())),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = if executable {
        run_executable(&file, Path::new(dir), tag)
    } else {
        run(&file, Path::new(dir), tag.unwrap_or("kvroute"))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oci-image: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(wasm: &Path, dir: &Path, tag: &str) -> Result<(), String> {
    let module = std::fs::read(wasm).map_err(|e| format!("{}: {e}", wasm.display()))?;
    let image = oci_image::build(&module, tag).map_err(|e| e.to_string())?;
    oci_image::write_layout(dir, &image).map_err(|e| format!("{}: {e}", dir.display()))?;
    eprintln!(
        "{}: OCI image layout, tag `{tag}`, {} in one tar+gzip layer ({} bytes)",
        dir.display(),
        oci_image::PLUGIN_FILE,
        image.layer.bytes.len()
    );
    eprintln!("manifest digest (WasmPlugin `sha256` is the hex after `sha256:`):");
    println!("{}", image.manifest.digest);
    Ok(())
}

fn run_executable(binary: &Path, dir: &Path, tag: Option<&str>) -> Result<(), String> {
    let name = binary
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{}: no file name", binary.display()))?;
    let bytes = std::fs::read(binary).map_err(|e| format!("{}: {e}", binary.display()))?;
    let tag = tag.unwrap_or(name);
    let image = oci_image::build_executable(&bytes, name, tag).map_err(|e| e.to_string())?;
    oci_image::write_layout(dir, &image).map_err(|e| format!("{}: {e}", dir.display()))?;
    eprintln!(
        "{}: OCI image layout, tag `{tag}`, /{}/{name} as the entrypoint ({} bytes compressed)",
        dir.display(),
        oci_image::EXECUTABLE_DIR,
        image.layer.bytes.len()
    );
    eprintln!("manifest digest:");
    println!("{}", image.manifest.digest);
    Ok(())
}
