//! The filter's chat template rendering against a real vLLM's: the template conformance corpus
//! (tests/common/template_corpus.rs) rendered by kvroute (`kvroute::template`) and by a vLLM
//! engine started with `--trust-request-chat-template`, which renders a request's own
//! `chat_template` on `POST /tokenize`. The token ids it returns, decoded to bytes with the
//! model's tokenizer (as the indexer decodes the engines' blocks), are the prompt vLLM rendered.
//! Byte for byte, under every template the transformers conformance covers, with the model's
//! special tokens (`eos_token` `<|im_end|>`, `pad_token`, no `bos_token`).
//!
//! Requests with images are not compared: the engine serves a text-only model, which refuses
//! them, and the filter writes its own marker where an engine puts a model-specific placeholder
//! (src/template/messages.rs); they are counted apart.

use super::SERVED_MODEL;
use crate::common::template_corpus::{corpus, PACKAGED, WRITTEN};
use kvroute::template::Templates;
use kvroute_harness::vllm::{vllm_model, VllmFleet, VllmOptions};
use kvroute_indexer::token_bytes::TokenBytes;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Requests to `/tokenize` in flight at once.
const IN_FLIGHT: usize = 4;

/// What vLLM or kvroute made of one request: the rendered bytes, or why not.
type Rendering = Result<Vec<u8>, String>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs real vLLM (about 3 GB): make test-real"]
async fn kvroute_renders_every_request_as_vllm_does() {
    if let Some(missing) = kvroute_harness::vllm::vllm_missing() {
        panic!("{missing}");
    }
    let packaged = PathBuf::from(
        std::env::var_os("KVROUTE_TEMPLATES")
            .unwrap_or_else(|| panic!("KVROUTE_TEMPLATES is unset: run through `make test-real`")),
    );
    let mut templates: Vec<(String, String)> = PACKAGED
        .iter()
        .map(|name| {
            let path = packaged.join(name);
            let source = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (`make template-deps`)", path.display()));
            (name.to_string(), source)
        })
        .collect();
    templates.extend(WRITTEN.iter().map(|(n, s)| (n.to_string(), s.to_string())));
    let corpus = corpus();
    assert!(corpus.len() >= 200, "{} requests", corpus.len());

    let opts = VllmOptions {
        extra_args: vec!["--trust-request-chat-template".into()],
        ..VllmOptions::default()
    };
    let started = Instant::now();
    let fleet = VllmFleet::start(&opts)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("engine serving after {:.0?}", started.elapsed());
    let base = fleet.engines[0].url.clone();
    let tokens = Arc::new(
        TokenBytes::load(&vllm_model().join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}")),
    );
    let model_config: Value = serde_json::from_str(
        &std::fs::read_to_string(vllm_model().join("tokenizer_config.json"))
            .expect("tokenizer_config.json"),
    )
    .expect("tokenizer_config.json parses");

    let (mut differences, mut summary) = (Vec::new(), Vec::new());
    let (mut compared, mut media) = (0, 0);
    let started = Instant::now();
    for (name, source) in &templates {
        let mut spec = model_config.clone();
        spec["chat_template"] = json!(source);
        let mut ours = Templates::default();
        ours.set_default(&spec)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let theirs = vllm_renderings(&base, source, &corpus, &tokens).await;
        let (mut equal, mut both_refused, mut media_here) = (0, 0, 0);
        for ((what, body), vllm) in corpus.iter().zip(theirs) {
            if body.to_string().contains("image_url") {
                media_here += 1;
                continue;
            }
            let kvroute: Rendering = ours
                .render(body.to_string().as_bytes())
                .map(|p| p.text)
                .map_err(|e| format!("{e:?}"));
            match (&kvroute, &vllm) {
                (Ok(a), Ok(b)) if a == b => equal += 1,
                (Err(_), Err(_)) => both_refused += 1,
                _ => differences.push(format!(
                    "{name} ({what}):\n  kvroute {}\n  vLLM    {}\n  request {body}",
                    show(&kvroute),
                    show(&vllm)
                )),
            }
            compared += 1;
        }
        media += media_here;
        summary.push(format!(
            "{name}: {equal} rendered alike, {both_refused} refused by both, {media_here} with \
             images not compared"
        ));
    }
    eprintln!(
        "{} requests × {} templates ({compared} compared, {media} with images apart) in {:.0?}:\n{}",
        corpus.len(),
        templates.len(),
        started.elapsed(),
        summary.join("\n")
    );
    let all = std::env::temp_dir().join(format!(
        "kvroute-vllm-conformance-{}.txt",
        std::process::id()
    ));
    if !differences.is_empty() && std::fs::write(&all, differences.join("\n\n")).is_ok() {
        eprintln!("every difference: {}", all.display());
    }
    let shown: Vec<&String> = differences.iter().take(30).collect();
    assert!(
        differences.is_empty(),
        "{} differences (the first {}):\n{}",
        differences.len(),
        shown.len(),
        shown
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

/// Bytes as text (lossy) for a message, or the error.
fn show(r: &Rendering) -> String {
    match r {
        Ok(bytes) => format!("{:?}", String::from_utf8_lossy(bytes)),
        Err(e) => format!("refused: {}", &e[..e.len().min(300)]),
    }
}

/// The `/tokenize` request for a chat request under `template`: the fields a chat completion
/// request passes to the template.
fn tokenize_request(template: &str, body: &Value) -> Value {
    let mut req = json!({"model": SERVED_MODEL, "messages": body["messages"],
                         "chat_template": template});
    for field in [
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    ] {
        if let Some(v) = body.get(field) {
            req[field] = v.clone();
        }
    }
    req
}

/// vLLM's rendering of every request of `corpus` under `template`, in order.
async fn vllm_renderings(
    base: &str,
    template: &str,
    corpus: &[(&'static str, Value)],
    tokens: &Arc<TokenBytes>,
) -> Vec<Rendering> {
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = Vec::new();
    for (_, body) in corpus {
        let req = tokenize_request(template, body);
        let (base, tokens, gate) = (base.to_string(), tokens.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await.expect("semaphore");
            let ids = super::precise::tokenize(&base, &req)
                .await
                .unwrap_or_else(|e| panic!("{e}"))?;
            let mut out = Vec::new();
            tokens.decode(&ids, &mut out)?;
            Ok(out)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}
