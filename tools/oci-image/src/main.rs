//! `oci-image WASM DIR [TAG]`: writes WASM as an OCI image layout at DIR (tag TAG, default
//! `kvroute`) and prints the manifest digest, the value of a WasmPlugin's `sha256` field.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (wasm, dir, tag) = match args.as_slice() {
        [wasm, dir] => (wasm, dir, "kvroute"),
        [wasm, dir, tag] => (wasm, dir, tag.as_str()),
        _ => {
            eprintln!("usage: oci-image WASM DIR [TAG]");
            return ExitCode::from(2);
        }
    };
    match run(PathBuf::from(wasm), PathBuf::from(dir), tag) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oci-image: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(wasm: PathBuf, dir: PathBuf, tag: &str) -> Result<(), String> {
    let module = std::fs::read(&wasm).map_err(|e| format!("{}: {e}", wasm.display()))?;
    let image = oci_image::build(&module, tag).map_err(|e| e.to_string())?;
    oci_image::write_layout(&dir, &image).map_err(|e| format!("{}: {e}", dir.display()))?;
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
