//! Precise mode on real vLLM: three engines publishing their KV events on Unix sockets,
//! kvroute-indexer subscribed to them and keying their blocks with the model's `tokenizer.json`,
//! and Envoy with kvroute rendering prompts with the model's chat template.
//!
//! First the two ends meet: the keys the indexer derives from a prompt an engine cached are the
//! filter's keys for that request, exactly as far as the engine's full blocks reach. Then one
//! sequence of requests runs under approximate mode and again, from emptied caches, under precise
//! mode. For each group: its first request through the gateway; its prefix cached on another
//! replica by traffic the gateway does not see (another gateway's, say); the first replica made
//! to evict it by such traffic; then the group's next request through the gateway. Approximate
//! mode's history names the first replica, which holds nothing of it any more; precise mode knows
//! where the prefix is. One group's prefix is held nowhere: precise mode places it as approximate
//! mode does. Idle engines, probed through their replay sockets, stay fresh.

use super::{chat, counters, post, system, usage_of, BLOCKS, BLOCK_SIZE};
use crate::common;
use kvroute::prefix::PrefixKeys;
use kvroute::template::Templates;
use kvroute_harness::vllm::{vllm_model, VllmFleet, VllmOptions, SERVED_MODEL};
use kvroute_harness::Envoy;
use kvroute_indexer::config::EngineSpec;
use kvroute_indexer::token_bytes::TokenBytes;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How long the indexer may take to reflect what an engine did (engines publish as they
/// schedule; a loaded machine delays everything).
const INDEX_WAIT: Duration = Duration::from_secs(180);
/// Groups whose prefix another replica also holds, then the one held nowhere.
const GROUPS: usize = 4;
/// Words of each group's system prompt: about 900 tokens, seven full blocks.
const SYSTEM_WORDS: usize = 900;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs real vLLM (about 3 GB): make test-real"]
async fn precise_mode_sends_a_prefix_where_the_engines_hold_it() {
    if let Some(missing) = kvroute_harness::vllm::vllm_missing() {
        panic!("{missing}");
    }
    let opts = VllmOptions {
        replicas: 3,
        num_gpu_blocks: Some(BLOCKS),
        max_num_seqs: 8,
        ..VllmOptions::default()
    };
    let started = Instant::now();
    let fleet = VllmFleet::start(&opts)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("engines serving after {:.0?}", started.elapsed());
    let tokenizer_config = model_file("tokenizer_config.json");
    let spec: Value = serde_json::from_str(&tokenizer_config).expect("tokenizer_config.json");
    let indexer = start_indexer(&fleet).await;
    let index_url = format!("http://{}", indexer.addr);
    every_stream_heard(&fleet, &index_url).await;

    keys_meet(&fleet, &index_url, &spec)
        .await
        .unwrap_or_else(|e| panic!("the indexer's keys and the filter's do not meet: {e}"));
    eprintln!("the indexer's keys for a cached prompt are the filter's");

    let backends = fleet.engines.iter().map(|e| super::addr(&e.url)).collect();
    let config = json!({"debug_header": true, "stats_interval_ms": 200, "chat_template": spec});
    let approximate = common::kvroute_envoy_with(backends, config.clone(), |o| {
        o.name_upstream = true;
    })
    .await;
    let approx = sequence(&fleet, &approximate, &index_url, &spec, false)
        .await
        .unwrap_or_else(|e| panic!("approximate mode: {e}"));
    drop(approximate);

    let mut config = config;
    config["index_cluster"] = json!("kvroute_indexer");
    let backends = fleet.engines.iter().map(|e| super::addr(&e.url)).collect();
    let precise_envoy = common::kvroute_with_indexer(backends, indexer.addr, config).await;
    let precise = sequence(&fleet, &precise_envoy, &index_url, &spec, true)
        .await
        .unwrap_or_else(|e| panic!("precise mode: {e}"));

    idle_engines_stay_fresh(&index_url)
        .await
        .unwrap_or_else(|e| panic!("idle engines: {e}"));
    eprintln!("{}", approx.table("approximate"));
    eprintln!("{}", precise.table("precise"));
    for (g, (a, p)) in approx.next.iter().zip(&precise.next).enumerate() {
        if g + 1 < GROUPS {
            assert_eq!(
                (p.decision.as_str(), p.replica),
                ("engine", p.holder),
                "group {g}: precise mode did not send the request where the prefix is: {p:?}"
            );
            assert!(
                p.cached >= 4 * BLOCK_SIZE,
                "group {g}: precise mode's replica had {} tokens cached: {p:?}",
                p.cached
            );
        } else {
            assert_ne!(
                p.decision, "engine",
                "group {g}'s prefix is held nowhere, yet precise mode named an engine: {p:?}"
            );
        }
        eprintln!(
            "group {g}: approximate {} cached on replica {} ({}), precise {} on {} ({})",
            a.cached, a.replica, a.decision, p.cached, p.replica, p.decision
        );
    }
    assert!(
        precise.next_cached() >= approx.next_cached(),
        "precise mode cached {} tokens of the groups' next requests, approximate mode {}",
        precise.next_cached(),
        approx.next_cached()
    );
}

/// A file of the model directory `make vllm` builds.
fn model_file(name: &str) -> String {
    let path = vllm_model().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// kvroute-indexer in-process, subscribed to every engine's Unix sockets, events and replay.
/// Engines publish only when their cache changes (vLLM sends no heartbeat) and the sequence
/// leaves replicas idle for seconds to minutes: with a `--stale-after` of 2 s, an engine idle
/// that long is probed through its replay socket, again and again, and stays fresh.
async fn start_indexer(fleet: &VllmFleet) -> kvroute_indexer::Running {
    let engines = fleet.engines.iter().map(|e| EngineSpec {
        endpoint: endpoint(&e.url),
        events: e.kv_events.clone(),
        replay: Some(e.replay.clone()),
        ..EngineSpec::default()
    });
    let tokenizer = vllm_model().join("tokenizer.json");
    let mut config =
        common::precise::following(tokenizer, SERVED_MODEL, engines.collect(), 1 << 18);
    config.events.stale_after = 2.0;
    kvroute_indexer::start(config)
        .await
        .expect("indexer starts")
}

/// The engines, idle now, say nothing: each is probed after the silence (its probes answered
/// rise) and stays fresh, where without a replay socket it would turn stale.
async fn idle_engines_stay_fresh(index_url: &str) -> Result<(), String> {
    let url = format!("{index_url}/health");
    let probes = |h: &Value| -> Vec<u64> {
        let streams = h["streams"].as_array().into_iter().flatten();
        streams.map(|s| s["probes"].as_u64().unwrap_or(0)).collect()
    };
    let before = probes(&get_json(&url).await?);
    let start = Instant::now();
    loop {
        let health = get_json(&url).await?;
        let probed = probes(&health).iter().zip(&before).all(|(n, b)| n > b);
        let streams = health["streams"].as_array().cloned().unwrap_or_default();
        if probed && streams.iter().all(|s| s["stale"] == false) {
            for s in &streams {
                eprintln!(
                    "{}: idle, {} probes answered, fresh",
                    s["endpoint"], s["probes"]
                );
            }
            return Ok(());
        }
        if start.elapsed() > INDEX_WAIT {
            return Err(format!("not probed and fresh: {streams:?}"));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `ip:port` of an engine's URL: the name Envoy and the indexer know it by.
fn endpoint(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

async fn get_json(url: &str) -> Result<Value, String> {
    let resp = common::client().get(url).send().await;
    let resp = resp.map_err(|e| format!("{url}: {e}"))?;
    resp.json().await.map_err(|e| format!("{url}: {e}"))
}

/// A publisher drops what it sends before a subscription reaches it: sends distinct prompts to
/// every engine until each stream has been heard, then empties every cache.
async fn every_stream_heard(fleet: &VllmFleet, index_url: &str) {
    let start = Instant::now();
    for probe in 0.. {
        for e in &fleet.engines {
            let body = chat(&system(900 + probe, 300), "probe", false);
            post(&e.url, &body).await.expect("probe answered");
        }
        let health = get_json(&format!("{index_url}/health")).await;
        let streams = health.map(|h| h["streams"].clone()).unwrap_or_default();
        let heard = streams.as_array().is_some_and(|s| {
            s.len() == fleet.engines.len() && s.iter().all(|s| !s["next_seq"].is_null())
        });
        if heard {
            break;
        }
        assert!(
            start.elapsed() < INDEX_WAIT,
            "the indexer never heard every engine: {streams}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    reset_and_publish(fleet).await.expect("caches emptied");
}

/// Empties every engine's prefix cache, then has each run a step: vLLM publishes the events of
/// a reset (`AllBlocksCleared`) with the next step's batch, so an idle engine's subscribers hear
/// of it only when it next serves. The nudge is shorter than a block: it stores none.
async fn reset_and_publish(fleet: &VllmFleet) -> Result<(), String> {
    super::reset(fleet).await?;
    for e in &fleet.engines {
        let mut body = chat("Hi.", "Hi.", false);
        body["max_tokens"] = json!(1);
        let (status, text) = post(&e.url, &body).await?;
        if status != 200 {
            return Err(format!("{status}: {text}"));
        }
    }
    Ok(())
}

/// Every key the indexer says each endpoint holds (a full snapshot of its change feed).
async fn held(index_url: &str) -> Result<BTreeMap<String, BTreeSet<u64>>, String> {
    let feed = get_json(&format!("{index_url}/v1/changes")).await?;
    let endpoints: Vec<String> = feed["endpoints"]
        .as_array()
        .ok_or_else(|| format!("no endpoints in {feed}"))?
        .iter()
        .filter_map(|e| e.as_str().map(str::to_string))
        .collect();
    let mut out: BTreeMap<String, BTreeSet<u64>> = endpoints
        .iter()
        .map(|e| (e.clone(), BTreeSet::new()))
        .collect();
    for c in feed["changes"].as_array().into_iter().flatten() {
        let (Some(e), Some(on), Some(key)) = (c[0].as_u64(), c[1].as_u64(), c[2].as_u64()) else {
            return Err(format!("change {c}"));
        };
        let keys = out
            .get_mut(endpoints.get(e as usize).ok_or("endpoint out of range")?)
            .ok_or("no such endpoint")?;
        match on {
            1 => keys.insert(key),
            _ => keys.remove(&key),
        };
    }
    Ok(out)
}

/// The filter's rendering of a chat request under the model's template, and its prefix keys
/// (as `kvroute-bench keys` prints them).
fn filter_keys(spec: &Value, body: &Value) -> Result<(Vec<u8>, Vec<u64>), String> {
    let mut templates = Templates::default();
    templates.set_default(spec)?;
    let prompt = templates
        .render(body.to_string().as_bytes())
        .map_err(|e| format!("not rendered: {e:?}"))?;
    let keys = PrefixKeys::of(&prompt, kvroute::config::Config::default().shape()).keys;
    Ok((prompt.text, keys))
}

/// The token ids vLLM renders a chat request to (`POST /tokenize`).
pub async fn tokenize(base: &str, body: &Value) -> Result<Result<Vec<u32>, String>, String> {
    let url = format!("{base}/tokenize");
    let resp = common::client().post(&url).json(body).send().await;
    let resp = resp.map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| format!("{url}: {e}"))?;
    if !status.is_success() {
        return Ok(Err(format!("HTTP {status}: {text}")));
    }
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{url}: {e}: {text}"))?;
    let tokens = v["tokens"]
        .as_array()
        .ok_or_else(|| format!("{url}: {text}"))?;
    Ok(Ok(tokens
        .iter()
        .filter_map(Value::as_u64)
        .map(|t| t as u32)
        .collect()))
}

/// Waits until `check` holds of the indexer's snapshot, for [`INDEX_WAIT`] at most; the error
/// says what it last saw.
async fn until_indexed<F>(index_url: &str, what: &str, mut check: F) -> Result<(), String>
where
    F: FnMut(&BTreeMap<String, BTreeSet<u64>>) -> Result<(), String>,
{
    let start = Instant::now();
    loop {
        let last = check(&held(index_url).await?);
        match last {
            Ok(()) => return Ok(()),
            Err(e) if start.elapsed() > INDEX_WAIT => {
                return Err(format!("{what}, after {INDEX_WAIT:?}: {e}"))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// How many of a chat request's chunks lie within the full blocks of its prompt as vLLM
/// tokenizes it: the chunks whose keys an engine that served it holds.
async fn full_block_chunks(base: &str, body: &Value) -> Result<usize, String> {
    let ids = tokenize(base, body).await??;
    let tokens = TokenBytes::load(&vllm_model().join("tokenizer.json"))?;
    let mut cached = Vec::new();
    let full = ids.len() / BLOCK_SIZE as usize * BLOCK_SIZE as usize;
    tokens.decode(&ids[..full], &mut cached)?;
    Ok(cached.len() / kvroute::config::Config::default().chunk_size)
}

/// The keys the indexer derives from a prompt engine 0 cached are the filter's first keys for
/// that request: all of those whose chunk lies in the engine's full blocks, and none after.
async fn keys_meet(fleet: &VllmFleet, index_url: &str, spec: &Value) -> Result<(), String> {
    let mut body = chat(
        &system(60, SYSTEM_WORDS),
        "Which block holds the café's keys?",
        false,
    );
    body["max_tokens"] = json!(1);
    let (rendered, keys) = filter_keys(spec, &body)?;
    let engine = &fleet.engines[0];
    let ids = tokenize(&engine.url, &body).await??;
    let tokens = TokenBytes::load(&vllm_model().join("tokenizer.json"))?;
    let mut decoded = Vec::new();
    tokens.decode(&ids, &mut decoded)?;
    if decoded != rendered {
        return Err(format!(
            "vLLM's rendering differs from the filter's: {:?} against {:?}",
            String::from_utf8_lossy(&decoded),
            String::from_utf8_lossy(&rendered)
        ));
    }
    let full_blocks = ids.len() / BLOCK_SIZE as usize;
    let mut cached = Vec::new();
    tokens.decode(&ids[..full_blocks * BLOCK_SIZE as usize], &mut cached)?;
    let expected = full_block_chunks(&engine.url, &body).await?;
    if expected < 2 {
        return Err(format!("the prompt fills only {expected} chunks"));
    }
    let (status, text) = post(&engine.url, &body).await?;
    if status != 200 {
        return Err(format!("engine answered {status}: {text}"));
    }
    let name = endpoint(&engine.url);
    until_indexed(index_url, "the cached prompt's keys", |held| {
        let mine = held.get(&name).cloned().unwrap_or_default();
        let flags: Vec<bool> = keys.iter().map(|k| mine.contains(k)).collect();
        let want: Vec<bool> = (0..keys.len()).map(|i| i < expected).collect();
        match flags == want {
            true => Ok(()),
            false => Err(format!(
                "of the filter's {} keys the indexer holds {flags:?} for {name}, expected the \
                 first {expected} ({} tokens, {} full blocks = {} bytes); {} keys held in all",
                keys.len(),
                ids.len(),
                full_blocks,
                cached.len(),
                mine.len()
            )),
        }
    })
    .await?;
    eprintln!(
        "  {} tokens, {full_blocks} full blocks = {} of {} rendered bytes: the filter's first \
         {expected} of {} keys held",
        ids.len(),
        cached.len(),
        rendered.len(),
        keys.len()
    );
    reset_and_publish(fleet).await
}

/// One request through the gateway: where it went and what the engine had cached of it.
#[derive(Debug, Clone, Default)]
struct Routed {
    decision: String,
    replica: usize,
    /// The replica that held the group's prefix when it was sent (its first replica when none).
    holder: usize,
    cached: u64,
    prompt: u64,
}

async fn through(fleet: &VllmFleet, envoy: &Envoy, body: &Value) -> Result<Routed, String> {
    let url = format!("{}/v1/chat/completions", envoy.url());
    let resp = common::client().post(&url).json(body).send().await;
    let resp = resp.map_err(|e| format!("{url}: {e}"))?;
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let decision = header("x-kvroute-decision");
    let upstream = header(kvroute_harness::bootstrap::UPSTREAM_HEADER);
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(|e| format!("{url}: {e}"))?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    let replica = fleet
        .engines
        .iter()
        .position(|e| endpoint(&e.url) == upstream)
        .ok_or_else(|| format!("answered by {upstream:?}, no engine"))?;
    let usage = usage_of(&text).ok_or_else(|| format!("no usage: {text}"))?;
    Ok(Routed {
        decision,
        replica,
        holder: replica,
        cached: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        prompt: usage["prompt_tokens"].as_u64().unwrap_or(0),
    })
}

/// What one mode did with the sequence.
#[derive(Debug, Default)]
struct Run {
    first: Vec<Routed>,
    next: Vec<Routed>,
    /// The engines' own prefix-cache counters over the whole sequence (tokens).
    hits: f64,
    queries: f64,
}

impl Run {
    fn next_cached(&self) -> u64 {
        self.next.iter().map(|r| r.cached).sum()
    }

    fn table(&self, mode: &str) -> String {
        let sum = |rs: &[Routed]| {
            (
                rs.iter().map(|r| r.cached).sum::<u64>(),
                rs.iter().map(|r| r.prompt).sum::<u64>(),
            )
        };
        let (nc, np) = sum(&self.next);
        let (fc, fp) = sum(&self.first);
        format!(
            "{mode}: groups' next requests {nc}/{np} prompt tokens cached ({:.1}%); all routed \
             requests {}/{} ({:.1}%); the engines' prefix cache over the sequence {:.0}/{:.0} \
             ({:.1}%)",
            pct(nc as f64, np as f64),
            nc + fc,
            np + fp,
            pct((nc + fc) as f64, (np + fp) as f64),
            self.hits,
            self.queries,
            pct(self.hits, self.queries)
        )
    }
}

fn pct(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        100.0 * a / b
    } else {
        0.0
    }
}

/// The sequence, from emptied caches, through `envoy`. The indexer (subscribed in either mode)
/// confirms each step's effect on the engines before the group's next request is sent, so both
/// modes face the same caches: in precise mode the gateway has applied it too.
async fn sequence(
    fleet: &VllmFleet,
    envoy: &Envoy,
    index_url: &str,
    spec: &Value,
    precise: bool,
) -> Result<Run, String> {
    reset_and_publish(fleet).await?;
    until_indexed(index_url, "the caches emptied", |held| {
        match held.values().all(BTreeSet::is_empty) {
            true => Ok(()),
            false => Err(format!(
                "{:?}",
                held.values().map(BTreeSet::len).collect::<Vec<_>>()
            )),
        }
    })
    .await?;
    let names = [
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ];
    let before = [
        counters(fleet, names[0]).await?,
        counters(fleet, names[1]).await?,
    ];
    let n = fleet.engines.len();
    let mut run = Run::default();
    for g in 0..GROUPS {
        let prefix = system(70 + g, SYSTEM_WORDS);
        let ask = |q: &str| {
            let mut body = chat(&prefix, q, false);
            body["max_tokens"] = json!(1);
            body
        };
        let first = through(fleet, envoy, &ask("What changed in the first release?")).await?;
        let home = first.replica;
        let next = ask("And in the second release?");
        let (_, keys) = filter_keys(spec, &next)?;
        // The keys of the prefix the next request shares with what other traffic sends.
        let shared = ask("Who else asks about it?");
        let (_, shared_keys) = filter_keys(spec, &shared)?;
        let common_keys: Vec<u64> = keys
            .iter()
            .zip(&shared_keys)
            .take_while(|(a, b)| a == b)
            .map(|(a, _)| *a)
            .collect();
        if common_keys.len() < 2 {
            return Err(format!("group {g} shares {} keys", common_keys.len()));
        }
        let copy = (g + 1 < GROUPS).then_some((home + 1) % n);
        // What the copy holds of them: the chunks within the full blocks of its prompt.
        let held_there = full_block_chunks(&fleet.engines[0].url, &shared).await?;
        let copied = &common_keys[..held_there.min(common_keys.len())];
        if let Some(other) = copy {
            let (status, text) = post(&fleet.engines[other].url, &shared).await?;
            if status != 200 {
                return Err(format!("{status}: {text}"));
            }
        }
        // Distinct prompts of about 900 tokens each straight to the group's replica: 70 blocks
        // allocated, more than its 48, so every block it held before is evicted.
        for i in 0..10 {
            let body = chat(&system(300 + 10 * g + i, 900), "flood", false);
            let (status, text) = post(&fleet.engines[home].url, &body).await?;
            if status != 200 {
                return Err(format!("{status}: {text}"));
            }
        }
        let (home_name, copy_name) = (
            endpoint(&fleet.engines[home].url),
            copy.map(|c| endpoint(&fleet.engines[c].url)),
        );
        until_indexed(index_url, "the group's prefix evicted and copied", |held| {
            let holds = |name: &str| {
                let mine = held.get(name);
                common_keys
                    .iter()
                    .filter(|k| mine.is_some_and(|m| m.contains(*k)))
                    .count()
            };
            let on_home = holds(&home_name);
            let elsewhere = copy_name.as_deref().map_or(0, holds);
            let want = copy_name.as_ref().map_or(0, |_| copied.len());
            let copy_holds = copy_name.as_deref().is_none_or(|c| {
                copied
                    .iter()
                    .all(|k| held.get(c).is_some_and(|m| m.contains(k)))
            });
            match on_home == 0 && copy_holds {
                true => Ok(()),
                false => Err(format!(
                    "group {g}: replica {home} holds {on_home} of {} shared keys, the copy \
                     {elsewhere} of the {want} in its full blocks",
                    common_keys.len()
                )),
            }
        })
        .await?;
        if precise {
            common::index_applied(envoy, 3).await;
        }
        let mut routed = through(fleet, envoy, &next).await?;
        routed.holder = copy.unwrap_or(home);
        run.first.push(first);
        run.next.push(routed);
    }
    let after = [
        counters(fleet, names[0]).await?,
        counters(fleet, names[1]).await?,
    ];
    run.hits = (0..n).map(|i| after[0][i] - before[0][i]).sum();
    run.queries = (0..n).map(|i| after[1][i] - before[1][i]).sum();
    Ok(run)
}
