//! The layout `oci-image` writes for the built kvroute.wasm is one that skopeo (containers/image,
//! the same kind of client as istio-agent's go-containerregistry) reads: copied out of it, the
//! layer gives the module back byte for byte, and the manifest digest is the one printed.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The built filter: `$KVROUTE_WASM` (the Makefile exports it), else the release build's path.
fn kvroute_wasm() -> PathBuf {
    let path = std::env::var_os("KVROUTE_WASM").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/wasm32-wasip1/release/kvroute.wasm")
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "{} missing: run `make wasm`",
        path.display()
    );
    path
}

/// Runs `oci-image` and returns the digest it printed.
fn oci_image(wasm: &Path, dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_oci-image"))
        .arg(wasm)
        .arg(dir)
        .arg("kvroute")
        .output()
        .expect("oci-image runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn skopeo(args: &[&str]) -> String {
    let out = Command::new("skopeo")
        .arg("--insecure-policy")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("skopeo: {e} (install it: `make deps`, Debian package skopeo)"));
    assert!(
        out.status.success(),
        "skopeo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The file `name` inside a tar+gzip blob.
fn file_in_layer(layer: &[u8], name: &str) -> Option<Vec<u8>> {
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    for entry in tar.entries().ok()? {
        let mut entry = entry.ok()?;
        if entry.path().ok()?.to_str() == Some(name) {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).ok()?;
            return Some(bytes);
        }
    }
    None
}

/// An image packed twice into `<tmp>/oci` and `<tmp>/again` by `pack` (which prints the digest)
/// and copied by skopeo into `<tmp>/out`: both packings gave one digest, and skopeo sees it.
struct Copied {
    tmp: PathBuf,
    out: PathBuf,
    /// The image as skopeo names it, `oci:<layout>:<tag>`.
    src: String,
    manifest: serde_json::Value,
}

impl Copied {
    fn of(name: &str, tag: &str, pack: impl Fn(&Path) -> String) -> Copied {
        let tmp = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let digest = pack(&tmp.join("oci"));
        assert!(
            digest.starts_with("sha256:") && digest.len() == 71,
            "{digest}"
        );
        assert_eq!(pack(&tmp.join("again")), digest, "same input, same digest");
        let src = format!("oci:{}:{tag}", tmp.join("oci").display());
        let out = tmp.join("out");
        skopeo(&["copy", &src, &format!("dir:{}", out.display())]);
        let manifest_path = out.join("manifest.json");
        let copied = skopeo(&["manifest-digest", manifest_path.to_str().unwrap()]);
        assert_eq!(copied.trim(), digest, "skopeo sees the printed digest");
        let manifest = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
        Copied {
            tmp,
            out,
            src,
            manifest,
        }
    }
}

#[test]
fn skopeo_copies_the_module_back_byte_for_byte() {
    let wasm = kvroute_wasm();
    let module = std::fs::read(&wasm).unwrap();
    let copy = Copied::of("oci-image-skopeo", "kvroute", |dir| oci_image(&wasm, dir));
    let (tmp, out, src) = (&copy.tmp, &copy.out, &copy.src);
    let layers = copy.manifest["layers"].as_array().expect("layers");
    let last = layers.last().expect("a layer");
    assert_eq!(last["mediaType"], oci_image::LAYER_MEDIA_TYPE);
    let hex = last["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:");
    let layer = std::fs::read(out.join(hex)).unwrap();
    let plugin = file_in_layer(&layer, oci_image::PLUGIN_FILE).expect("plugin.wasm in the layer");
    assert!(
        plugin == module,
        "plugin.wasm differs from {}",
        wasm.display()
    );

    let inspect: serde_json::Value =
        serde_json::from_str(&skopeo(&["inspect", "--config", src])).unwrap();
    assert_eq!(inspect["os"], "wasi");
    std::fs::remove_dir_all(tmp).unwrap();
}

/// kvroute-indexer built for x86_64-unknown-linux-musl: `$KVROUTE_INDEXER_STATIC` (the Makefile
/// exports it), else that build's path.
fn static_indexer() -> PathBuf {
    let path = std::env::var_os("KVROUTE_INDEXER_STATIC").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/x86_64-unknown-linux-musl/release/kvroute-indexer")
        },
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "{} missing: run `make indexer-image`",
        path.display()
    );
    path
}

/// Runs `oci-image --executable` and returns the digest it printed.
fn oci_executable(binary: &Path, dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_oci-image"))
        .arg("--executable")
        .arg(binary)
        .arg(dir)
        .output()
        .expect("oci-image runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The indexer's image: the same digest from two packings, skopeo reads it with the printed
/// digest, its entrypoint is the binary byte for byte, and that binary is static (it runs in an
/// image with nothing else in it).
#[test]
#[ignore = "needs the musl build of kvroute-indexer: `make test-indexer-image`"]
fn skopeo_reads_the_indexer_image_and_its_entrypoint_is_the_static_binary() {
    let binary = static_indexer();
    let bytes = std::fs::read(&binary).unwrap();
    let copy = Copied::of("oci-indexer-skopeo", "kvroute-indexer", |dir| {
        oci_executable(&binary, dir)
    });
    let (tmp, out, src) = (&copy.tmp, &copy.out, &copy.src);

    let inspect: serde_json::Value =
        serde_json::from_str(&skopeo(&["inspect", "--config", src])).unwrap();
    assert_eq!(inspect["os"], "linux");
    assert_eq!(inspect["architecture"], "amd64");
    assert_eq!(inspect["config"]["User"], oci_image::EXECUTABLE_USER);
    let entrypoint = inspect["config"]["Entrypoint"][0]
        .as_str()
        .expect("an entrypoint");
    let hex = copy.manifest["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:");
    let layer = std::fs::read(out.join(hex)).unwrap();
    let file = file_in_layer(&layer, entrypoint.trim_start_matches('/')).expect("the entrypoint");
    assert!(
        file == bytes,
        "the entrypoint differs from {}",
        binary.display()
    );

    // Static: no program interpreter (PT_INTERP) in its ELF program headers.
    let u16_at = |at: usize| u16::from_le_bytes([file[at], file[at + 1]]) as usize;
    let u64_at = |at: usize| u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize;
    assert_eq!(&file[..4], b"\x7fELF");
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    let interp = (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        u32::from_le_bytes(file[at..at + 4].try_into().unwrap()) == 3
    });
    assert!(!interp, "{} asks for a dynamic loader", binary.display());
    std::fs::remove_dir_all(tmp).unwrap();
}
