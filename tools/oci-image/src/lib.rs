//! Reproducible OCI image layouts: a Wasm module in the form Istio's agent pulls for a `WasmPlugin`
//! with an `oci://` URL, and a statically linked Linux executable as a container image.
//!
//! Wasm: the "compat" variant of the Wasm image spec, as istio's `pkg/wasm/imagefetcher.go` reads
//! it (`extractOCIStandardImage`): an ordinary OCI image whose last (here only) layer is a
//! `application/vnd.oci.image.layer.v1.tar+gzip` holding `plugin.wasm`. Unlike the artifact
//! variant (custom media types), every registry and tool (skopeo, crane, docker) handles it.
//!
//! Executable: one layer holding the file at `/usr/local/bin/<name>`, the image's entrypoint,
//! run as an unprivileged user; nothing else (a static binary needs no libc, shell or CA files).
//!
//! Same input, same bytes out: tar entries have fixed owner, mode and time, the gzip header no
//! time or name, the JSON documents sorted keys; so the manifest digest names the content.

use std::io::Write;
use std::path::Path;

use flate2::{Compression, GzBuilder};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Name of the module inside the layer, fixed by the Wasm image spec.
pub const PLUGIN_FILE: &str = "plugin.wasm";
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// A content-addressed blob.
pub struct Blob {
    /// `sha256:<hex>`.
    pub digest: String,
    pub bytes: Vec<u8>,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Blob {
        Blob {
            digest: sha256(&bytes),
            bytes,
        }
    }

    fn descriptor(&self, media_type: &str) -> serde_json::Value {
        json!({ "mediaType": media_type, "digest": self.digest, "size": self.bytes.len() })
    }
}

/// An image: its blobs (layer, config, manifest) and the layout's `index.json`.
pub struct Image {
    pub layer: Blob,
    pub config: Blob,
    pub manifest: Blob,
    pub index: Vec<u8>,
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// Where an executable image keeps its executable.
pub const EXECUTABLE_DIR: &str = "usr/local/bin";
/// The user (and group) an executable image runs as: not root ("nonroot" in distroless images).
pub const EXECUTABLE_USER: &str = "65532:65532";

/// The image of `wasm`, referenced in the layout's index as `tag`.
pub fn build(wasm: &[u8], tag: &str) -> std::io::Result<Image> {
    let tar = plugin_tar(wasm)?;
    // `wasi/wasm` is the platform Docker gives Wasm images.
    image(
        tar,
        json!({ "architecture": "wasm", "os": "wasi", "config": {} }),
        tag,
    )
}

/// The image of `binary`, a statically linked x86-64 Linux executable, as `/usr/local/bin/<name>`
/// and the image's entrypoint, referenced in the layout's index as `tag`.
pub fn build_executable(binary: &[u8], name: &str, tag: &str) -> std::io::Result<Image> {
    let path = format!("/{EXECUTABLE_DIR}/{name}");
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Entrypoint": [path], "User": EXECUTABLE_USER, "WorkingDir": "/" },
    });
    image(executable_tar(binary, name)?, config, tag)
}

/// The image of one layer (`tar`, uncompressed) with `config` (its `rootfs` added).
fn image(tar: Vec<u8>, mut config: serde_json::Value, tag: &str) -> std::io::Result<Image> {
    let diff_id = sha256(&tar);
    let layer = Blob::new(gzip(&tar)?);
    config["rootfs"] = json!({ "type": "layers", "diff_ids": [diff_id] });
    let config = Blob::new(to_vec(&config));
    let manifest = Blob::new(to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config.descriptor(CONFIG_MEDIA_TYPE),
        "layers": [layer.descriptor(LAYER_MEDIA_TYPE)],
    })));
    let mut entry = manifest.descriptor(MANIFEST_MEDIA_TYPE);
    entry["annotations"] = json!({ "org.opencontainers.image.ref.name": tag });
    let index = to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [entry],
    }));
    Ok(Image {
        layer,
        config,
        manifest,
        index,
    })
}

/// Writes `image` as an OCI image layout at `dir`, replacing whatever was there.
pub fn write_layout(dir: &Path, image: &Image) -> std::io::Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    for blob in [&image.layer, &image.config, &image.manifest] {
        let hex = blob.digest.trim_start_matches("sha256:");
        std::fs::write(blobs.join(hex), &blob.bytes)?;
    }
    std::fs::write(dir.join("index.json"), &image.index)?;
    std::fs::write(
        dir.join("oci-layout"),
        to_vec(&json!({ "imageLayoutVersion": "1.0.0" })),
    )
}

/// A tar holding `plugin.wasm` alone, with nothing that depends on the machine or the time.
fn plugin_tar(wasm: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut header = fixed_header(0o644, tar::EntryType::Regular);
    header.set_size(wasm.len() as u64);
    let mut builder = tar::Builder::new(Vec::new());
    builder.append_data(&mut header, PLUGIN_FILE, wasm)?;
    builder.into_inner()
}

/// A tar holding `usr/local/bin/<name>` (executable by all) and its directories, with nothing
/// that depends on the machine or the time.
fn executable_tar(binary: &[u8], name: &str) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut dir = String::new();
    for part in EXECUTABLE_DIR.split('/') {
        dir.push_str(part);
        dir.push('/');
        let mut header = fixed_header(0o755, tar::EntryType::Directory);
        header.set_size(0);
        builder.append_data(&mut header, &dir, std::io::empty())?;
    }
    let mut header = fixed_header(0o755, tar::EntryType::Regular);
    header.set_size(binary.len() as u64);
    builder.append_data(&mut header, format!("{dir}{name}"), binary)?;
    builder.into_inner()
}

fn fixed_header(mode: u32, kind: tar::EntryType) -> tar::Header {
    let mut header = tar::Header::new_ustar();
    header.set_mode(mode);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(kind);
    header
}

/// Gzip without a time or file name in its header.
fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut gz = GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), Compression::best());
    gz.write_all(bytes)?;
    gz.finish()
}

fn to_vec(value: &serde_json::Value) -> Vec<u8> {
    // serde_json's maps are sorted by key, so the bytes depend on the content alone.
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn unpack(layer: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(layer));
        tar.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let name = e.path().unwrap().display().to_string();
                let mut bytes = Vec::new();
                e.read_to_end(&mut bytes).unwrap();
                (name, bytes)
            })
            .collect()
    }

    #[test]
    fn the_layer_holds_the_module_as_plugin_wasm() {
        let wasm = b"\0asm\x01\0\0\0 a module".to_vec();
        let image = build(&wasm, "kvroute").unwrap();
        assert_eq!(
            unpack(&image.layer.bytes),
            vec![(PLUGIN_FILE.to_string(), wasm)]
        );
    }

    #[test]
    fn same_module_same_digest_and_a_changed_module_changes_it() {
        let a = build(b"module a", "kvroute").unwrap();
        let again = build(b"module a", "kvroute").unwrap();
        let b = build(b"module b", "kvroute").unwrap();
        assert_eq!(a.manifest.digest, again.manifest.digest);
        assert_eq!(a.layer.bytes, again.layer.bytes);
        assert_eq!(a.index, again.index);
        assert_ne!(a.manifest.digest, b.manifest.digest);
    }

    #[test]
    fn documents_reference_their_blobs_by_digest_and_size() {
        let image = build(b"module", "v1").unwrap();
        for blob in [&image.layer, &image.config, &image.manifest] {
            assert_eq!(blob.digest, sha256(&blob.bytes));
        }
        let manifest: serde_json::Value = serde_json::from_slice(&image.manifest.bytes).unwrap();
        assert_eq!(manifest["layers"][0]["mediaType"], LAYER_MEDIA_TYPE);
        assert_eq!(manifest["layers"][0]["digest"], image.layer.digest.as_str());
        assert_eq!(manifest["layers"][0]["size"], image.layer.bytes.len());
        assert_eq!(manifest["config"]["digest"], image.config.digest.as_str());
        let config: serde_json::Value = serde_json::from_slice(&image.config.bytes).unwrap();
        let tar = {
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&image.layer.bytes[..])
                .read_to_end(&mut out)
                .unwrap();
            out
        };
        assert_eq!(config["rootfs"]["diff_ids"][0], sha256(&tar).as_str());
        let index: serde_json::Value = serde_json::from_slice(&image.index).unwrap();
        let entry = &index["manifests"][0];
        assert_eq!(entry["digest"], image.manifest.digest.as_str());
        assert_eq!(
            entry["annotations"]["org.opencontainers.image.ref.name"],
            "v1"
        );
    }

    #[test]
    fn an_executable_image_runs_its_file_as_a_user_and_names_its_content() {
        let image = build_executable(b"\x7fELF a binary", "tool", "tool").unwrap();
        let files = unpack(&image.layer.bytes);
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/tool"]
        );
        assert_eq!(files[3].1, b"\x7fELF a binary");
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(&image.layer.bytes[..]));
        for entry in tar.entries().unwrap() {
            assert_eq!(entry.unwrap().header().mode().unwrap(), 0o755);
        }
        let config: serde_json::Value = serde_json::from_slice(&image.config.bytes).unwrap();
        assert_eq!(config["os"], "linux");
        assert_eq!(config["architecture"], "amd64");
        assert_eq!(
            config["config"]["Entrypoint"],
            json!(["/usr/local/bin/tool"])
        );
        assert_eq!(config["config"]["User"], EXECUTABLE_USER);
        let again = build_executable(b"\x7fELF a binary", "tool", "tool").unwrap();
        assert_eq!(again.manifest.digest, image.manifest.digest);
        let other = build_executable(b"\x7fELF another", "tool", "tool").unwrap();
        assert_ne!(other.manifest.digest, image.manifest.digest);
    }

    #[test]
    fn the_gzip_header_carries_no_time_or_name() {
        let image = build(b"module", "kvroute").unwrap();
        let gz = &image.layer.bytes;
        assert_eq!(&gz[..3], &[0x1f, 0x8b, 8]);
        assert_eq!(gz[3], 0, "no FNAME or other optional fields");
        assert_eq!(&gz[4..8], &[0, 0, 0, 0], "MTIME zero");
    }

    #[test]
    fn writing_the_layout_replaces_stale_blobs() {
        let dir = std::env::temp_dir().join(format!("oci-image-test-{}", std::process::id()));
        write_layout(&dir, &build(b"old", "kvroute").unwrap()).unwrap();
        let image = build(b"new", "kvroute").unwrap();
        write_layout(&dir, &image).unwrap();
        let mut blobs: Vec<String> = std::fs::read_dir(dir.join("blobs/sha256"))
            .unwrap()
            .map(|e| format!("sha256:{}", e.unwrap().file_name().to_string_lossy()))
            .collect();
        blobs.sort();
        let mut want = vec![
            image.layer.digest.clone(),
            image.config.digest.clone(),
            image.manifest.digest.clone(),
        ];
        want.sort();
        assert_eq!(blobs, want);
        assert_eq!(std::fs::read(dir.join("index.json")).unwrap(), image.index);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
