//! The lab's kvroute-indexer: the indexer's own decoding, chains, feed and API, fed the
//! replicas' KV events and asked for its change feed in virtual time.
//!
//! Each replica publishes as the simulator's publisher does (`kv_events::encode_batch`, numbered
//! from 0, the fleet's default format, or SGLang's for a replica that plays SGLang), and the index takes each message as kvroute-indexer's
//! subscriber does: decoded by its wire module and applied by `Index::receive`. The fleet's
//! replicas have a replay socket (the fleet default), so:
//! - a message the stream lost (`Published::dropped`) is still numbered and kept, as the
//!   publisher keeps its last `buffer_steps` messages, and the next message shows the gap, which
//!   is filled from those kept messages (`Index::repair`), as the subscriber fills it from the
//!   replay socket: a gap reaching further back than what is kept drops the replica's keys and
//!   keeps it stale for the indexer's `--gap-hold`;
//! - a replica silent for the indexer's `--stale-after` is probed, as the subscriber probes it:
//!   the kept messages from the last one applied on are applied (`Index::answered`), so a lost
//!   last message shows up then.
//!
//! Messages are kept from when they reach the lab (after the transport's lag). The index starts
//! as the bench's indexer does after its warm-up: every replica heard from at time 0, its
//! messages numbered from 0. Times are virtual: nothing here reads a clock.

use kvroute_indexer::api;
use kvroute_indexer::config::Config;
use kvroute_indexer::dialect::Dialect;
use kvroute_indexer::index::{Index, Received, Staleness};
use kvroute_indexer::state::Serving;
use kvroute_indexer::subscriber::shows_restart;
use kvroute_indexer::token_bytes::TokenBytes;
use kvroute_indexer::wire::{self, Batch};
use kvroute_sim::kv_events::{self, Format, Options, Published};
use kvroute_sim::spec::{EngineKind, FleetSpec};
use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::Duration;

/// The epoch the lab's indexer answers in: fixed, so that runs repeat, and not 0, which a
/// client that has no version yet sends.
pub const EPOCH: u64 = 1;

/// One replica's publisher and the subscriber's view of it.
#[derive(Debug, Default)]
struct Replica {
    /// Whether it plays SGLang: it publishes SGLang's events, read in SGLang's dialect.
    sglang: bool,
    next_seq: u64,
    /// The last messages published, oldest first, as its replay socket keeps them.
    kept: VecDeque<Batch>,
    /// When the subscriber last heard from it or probed it: its silence runs from here.
    quiet_since: Duration,
}

/// kvroute-indexer following a lab's replicas.
#[derive(Debug)]
pub struct LabIndex {
    index: Index,
    tokens: TokenBytes,
    staleness: Staleness,
    /// How the replicas publish (topic, block size, format, messages kept for replay).
    publishing: Options,
    /// Whether the replicas have a replay socket.
    replay: bool,
    replicas: Vec<Replica>,
}

impl LabIndex {
    /// An indexer following `endpoints` (their `ip:port` names, replica `r` being
    /// `endpoints[r]`) that serve `model` with blocks of `block_size` tokens: keyed as
    /// kvroute-indexer's defaults key (chunk size, feed capacity, staleness), decoding token ids
    /// with the simulator's byte-level BPE (the tokenizer the fleet uses in precise mode), the
    /// replicas publishing as the fleet's defaults have them, replica `r` playing `kinds[r]`
    /// (vLLM past the list's end): an SGLang replica publishes SGLang's events and is read in
    /// SGLang's dialect.
    pub fn new(
        endpoints: &[String],
        model: &str,
        block_size: usize,
        kinds: &[EngineKind],
    ) -> Result<LabIndex, String> {
        // The indexer's defaults, as its command line gives them (the file is not read).
        let config = <Config as clap::Parser>::try_parse_from([
            "kvroute-indexer",
            "--tokenizer",
            "tokenizer.json",
            "--model",
            model,
        ])
        .map_err(|e| e.to_string())?;
        let tokens = sim_tokens()?;
        let fleet = FleetSpec::default();
        let publishing = Options {
            topic: fleet.kv_events_topic,
            block_size,
            format: Format::from_name(&fleet.kv_events_format),
            buffer_steps: fleet.kv_events_buffer_steps,
        };
        let mut index = Index::new(config.chunk_size, config.events.feed_capacity);
        let sglang = |r: usize| kinds.get(r) == Some(&EngineKind::Sglang);
        for (r, endpoint) in endpoints.iter().enumerate() {
            let events = format!("lab://{endpoint}/events");
            let replay = fleet
                .kv_events_replay
                .then(|| format!("lab://{endpoint}/replay"));
            let dialect = if sglang(r) {
                Dialect::Sglang
            } else {
                Dialect::Vllm
            };
            let s = index.add_stream_as(endpoint, model, &events, replay.as_deref(), dialect);
            let health = &mut index.streams[s].health;
            health.connected = true;
            health.last_heard = Some(Duration::ZERO);
        }
        Ok(LabIndex {
            index,
            tokens,
            staleness: config.events.staleness()?,
            publishing,
            replay: fleet.kv_events_replay,
            replicas: (0..endpoints.len())
                .map(|r| Replica {
                    sglang: sglang(r),
                    ..Replica::default()
                })
                .collect(),
        })
    }

    /// Replica `r` published `batch` and it reaches the indexer at `now`: numbered, encoded as
    /// the simulator's publisher encodes it, kept for replay, and (unless the stream lost it)
    /// decoded and applied as the subscriber applies it, a gap filled from what the replica
    /// kept. A replica the lab does not have is ignored.
    pub fn publish(&mut self, now: Duration, r: usize, batch: &Published) {
        self.probe_silent(now);
        let (Some(replica), Some(stream)) =
            (self.replicas.get_mut(r), self.index.streams.get_mut(r))
        else {
            return;
        };
        let seq = replica.next_seq;
        replica.next_seq += 1;
        let o = &self.publishing;
        let (format, dialect) = match replica.sglang {
            true => (Format::Sglang, Dialect::Sglang),
            false => (o.format, Dialect::Vllm),
        };
        let payload =
            kv_events::encode_batch(now.as_secs_f64(), &batch.events, o.block_size, format);
        let frames = kv_events::frames(&o.topic, seq, payload);
        let message = match wire::decode_message_as(&frames, dialect) {
            Ok(message) => message,
            Err(_) => {
                stream.health.undecodable += 1;
                return;
            }
        };
        if self.replay && o.buffer_steps > 0 {
            if replica.kept.len() == o.buffer_steps {
                replica.kept.pop_front();
            }
            replica.kept.push_back(message.clone());
        }
        if batch.dropped {
            return;
        }
        replica.quiet_since = now;
        if let Received::Gap { from } = self.index.receive(r, &message, &self.tokens, now) {
            let replayed = kept_from(&replica.kept, from, message.seq);
            let hold = self.staleness.after_gap;
            self.index
                .repair(r, &replayed, &message, &self.tokens, now, hold);
        }
    }

    /// The answer kvroute-indexer's HTTP API gives to `GET path_and_query` at `now` (after the
    /// probes of replicas silent until then): its status and body.
    pub fn answer(&mut self, now: Duration, path_and_query: &str) -> (u16, Vec<u8>) {
        self.probe_silent(now);
        let (path, query) = path_and_query
            .split_once('?')
            .unwrap_or((path_and_query, ""));
        let serving = Serving {
            epoch: EPOCH,
            staleness: self.staleness,
            tokens: &self.tokens,
        };
        let (status, _, body) = api::get(|| &self.index, serving, path, query, now);
        (status.as_u16(), body.into_bytes())
    }

    /// Probes every replica silent for the indexer's `--stale-after` by `now`, at the times the
    /// subscriber would (each silence after the last message or probe), with what it kept
    /// from the last message applied on.
    fn probe_silent(&mut self, now: Duration) {
        let silence = self.staleness.silence;
        if !self.replay || silence.is_zero() {
            return;
        }
        for (s, replica) in self.replicas.iter_mut().enumerate() {
            while replica.quiet_since + silence <= now {
                let at = replica.quiet_since + silence;
                let last = self.index.streams[s].last_applied();
                let from = last.map_or(0, |(seq, _)| seq);
                let mut answer = kept_from(&replica.kept, from, u64::MAX);
                let restarted = shows_restart(&answer, last);
                if restarted {
                    answer = kept_from(&replica.kept, 0, u64::MAX);
                }
                let hold = self.staleness.after_gap;
                self.index
                    .answered(s, restarted, &answer, &self.tokens, at, hold);
                replica.quiet_since = at;
            }
        }
    }
}

/// The byte table of the simulator's byte-level BPE, checked as kvroute-indexer checks a
/// tokenizer it loads (trained once per process: training is deterministic).
fn sim_tokens() -> Result<TokenBytes, String> {
    static TOKENS: OnceLock<Result<TokenBytes, String>> = OnceLock::new();
    let table = TOKENS.get_or_init(|| {
        let tokenizer = kvroute_sim::bpe::train()?;
        let tokens = TokenBytes::from_tokenizer(&tokenizer)?;
        tokens.self_check(&tokenizer)?;
        Ok(tokens)
    });
    table.clone()
}

/// The kept messages numbered `from..until`, as the replay socket gives them.
fn kept_from(kept: &VecDeque<Batch>, from: u64, until: u64) -> Vec<Batch> {
    let first = kept.partition_point(|b| b.seq < from);
    kept.range(first..)
        .take_while(|b| b.seq < until)
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::prompt_keys;
    use crate::precise::SIM_CHAT_TEMPLATE;
    use kvroute::template::Templates;
    use kvroute_sim::bpe::Vocab;
    use kvroute_sim::prefix_cache::PrefixCache;
    use kvroute_sim::request::{prompt_tokens_in, Endpoint};
    use serde_json::{json, Value};
    use std::collections::BTreeSet;

    const MODEL: &str = "m";
    const BLOCK: usize = 16;
    const SNAPSHOT: &str = "/v1/changes?epoch=0&since=0";

    fn endpoints() -> Vec<String> {
        vec!["127.0.0.1:8001".into(), "127.0.0.1:8002".into()]
    }

    fn lab() -> LabIndex {
        LabIndex::new(&endpoints(), MODEL, BLOCK, &[]).unwrap()
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// The simulator's tokenizer (trained once for every test).
    fn vocab() -> &'static Vocab {
        static VOCAB: OnceLock<Vocab> = OnceLock::new();
        VOCAB.get_or_init(|| Vocab::from_tokenizer(kvroute_sim::bpe::train().unwrap()).unwrap())
    }

    /// A chat of several chunks, its system prompt and question told apart by `tag`.
    fn chat(tag: &str) -> Value {
        let system: String = (0..60)
            .map(|i| format!("Rule {i} of {tag}: the garden is kept tidy, the gate shut. "))
            .collect();
        json!({"model": MODEL, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("What does {tag} say about the gate?")}]})
    }

    /// The chat's prompt tokens, as the simulator renders and tokenizes it.
    fn tokens(body: &Value) -> Vec<u32> {
        prompt_tokens_in(vocab(), Endpoint::Chat, body).unwrap().0
    }

    /// A request for `tokens` served by the replica with `cache`: the events it publishes.
    fn served(cache: &mut PrefixCache, tokens: &[u32]) -> Published {
        let lease = cache.admit(tokens, None).unwrap();
        cache.release(lease, tokens);
        Published {
            events: cache.take_events(),
            dropped: false,
        }
    }

    /// A lab, and replica `r`'s cache after it served `chat("a")`, published at 1 s.
    fn served_a(r: usize) -> (LabIndex, PrefixCache) {
        let mut lab = lab();
        let mut cache = PrefixCache::new(BLOCK, 1 << 20);
        lab.publish(secs(1), r, &served(&mut cache, &tokens(&chat("a"))));
        (lab, cache)
    }

    fn dropped(mut batch: Published) -> Published {
        batch.dropped = true;
        batch
    }

    /// The keys kvroute's filter computes for the chat, over the whole chunks of what the
    /// engine caches of it (its full blocks).
    fn filter_keys(body: &Value) -> BTreeSet<u64> {
        let mut templates = Templates::default();
        templates.set_default(&json!(SIM_CHAT_TEMPLATE)).unwrap();
        let chunk = kvroute::config::Config::default().chunk_size;
        let (prompt, keys) =
            prompt_keys(&templates, body.to_string().as_bytes(), chunk, None).unwrap();
        let ids = tokens(body);
        let mut cached = Vec::new();
        let full = ids.len() / BLOCK * BLOCK;
        sim_tokens()
            .unwrap()
            .decode(&ids[..full], &mut cached)
            .unwrap();
        assert!(
            prompt.text.starts_with(&cached),
            "the filter renders as the engine"
        );
        assert!(cached.len() >= 3 * chunk, "several whole chunks are cached");
        keys.keys[..cached.len() / chunk].iter().copied().collect()
    }

    fn get(lab: &mut LabIndex, now: Duration, path: &str) -> Value {
        let (status, body) = lab.answer(now, path);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }

    /// The keys a full answer lists for endpoint `name`.
    fn held(answer: &Value, name: &str) -> BTreeSet<u64> {
        assert_eq!(answer["full"], true);
        let e = answer["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .position(|n| n == name)
            .unwrap();
        answer["changes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c[0] == e && c[1] == 1)
            .map(|c| c[2].as_u64().unwrap())
            .collect()
    }

    fn stale(answer: &Value) -> Vec<String> {
        serde_json::from_value(answer["stale"].clone()).unwrap()
    }

    #[test]
    fn an_sglang_replicas_prompt_is_held_under_the_same_keys() {
        let mut lab = LabIndex::new(
            &endpoints(),
            MODEL,
            BLOCK,
            &[EngineKind::Vllm, EngineKind::Sglang],
        )
        .unwrap();
        let mut cache = PrefixCache::new(BLOCK, 1 << 20);
        lab.publish(secs(1), 1, &served(&mut cache, &tokens(&chat("a"))));
        let answer = get(&mut lab, secs(2), SNAPSHOT);
        assert_eq!(held(&answer, "127.0.0.1:8002"), filter_keys(&chat("a")));
        let stream = &lab.index.streams[1];
        assert_eq!(stream.stream.dialect(), Dialect::Sglang);
        assert!(stream.stream.counts.events > 1, "one event per page");
    }

    #[test]
    fn a_served_prompt_is_held_under_the_filters_keys() {
        let (mut lab, _) = served_a(0);
        let body = chat("a");
        let answer = get(&mut lab, secs(2), SNAPSHOT);
        assert_eq!(answer["epoch"], EPOCH);
        assert_eq!(answer["endpoints"], json!(endpoints()));
        assert_eq!(held(&answer, "127.0.0.1:8001"), filter_keys(&body));
        assert!(held(&answer, "127.0.0.1:8002").is_empty());
        assert!(stale(&answer).is_empty());
        // The gateway's next poll, from the version it got, has nothing new.
        let version = answer["version"].as_u64().unwrap();
        let next = get(
            &mut lab,
            secs(3),
            &format!("/v1/changes?epoch={EPOCH}&since={version}"),
        );
        assert_eq!(
            (&next["full"], &next["changes"]),
            (&json!(false), &json!([]))
        );
        assert_eq!(lab.answer(secs(3), "/v1/changes?since=x").0, 400);
        assert_eq!(lab.answer(secs(3), "/nowhere").0, 404);
    }

    #[test]
    fn a_lost_message_is_filled_from_the_replay_when_the_next_shows_the_gap() {
        let (mut lab, mut cache) = served_a(0);
        let (a, b, c) = (chat("a"), chat("b"), chat("c"));
        lab.publish(secs(2), 0, &dropped(served(&mut cache, &tokens(&b))));
        let before = held(&get(&mut lab, secs(3), SNAPSHOT), "127.0.0.1:8001");
        assert_eq!(
            before,
            filter_keys(&a),
            "the lost message is not applied yet"
        );
        lab.publish(secs(4), 0, &served(&mut cache, &tokens(&c)));
        let answer = get(&mut lab, secs(5), SNAPSHOT);
        let all: BTreeSet<u64> = [a, b, c].iter().flat_map(filter_keys).collect();
        assert_eq!(held(&answer, "127.0.0.1:8001"), all);
        assert!(stale(&answer).is_empty());
        let (_, metrics) = lab.answer(secs(5), "/metrics");
        let metrics = String::from_utf8(metrics).unwrap();
        let stream = r#"{endpoint="127.0.0.1:8001",stream="lab://127.0.0.1:8001/events"}"#;
        assert!(metrics.contains(&format!("kvroute_indexer_gaps_total{stream} 1")));
        assert!(metrics.contains(&format!("kvroute_indexer_resyncs_total{stream} 1")));
    }

    #[test]
    fn a_gap_past_what_the_replica_keeps_drops_its_keys_and_holds_it_stale() {
        let (mut lab, mut cache) = served_a(0);
        let c = chat("c");
        let steps = FleetSpec::default().kv_events_buffer_steps;
        let lost = Published {
            events: Vec::new(),
            dropped: true,
        };
        for _ in 0..=steps {
            lab.publish(secs(2), 0, &lost);
        }
        lab.publish(secs(3), 0, &served(&mut cache, &tokens(&c)));
        let answer = get(&mut lab, secs(4), SNAPSHOT);
        assert_eq!(held(&answer, "127.0.0.1:8001"), filter_keys(&c));
        assert_eq!(stale(&answer), ["127.0.0.1:8001"]);
        let hold = lab.staleness.after_gap;
        let held_stale = get(&mut lab, secs(3) + hold - secs(1), SNAPSHOT);
        assert_eq!(stale(&held_stale), ["127.0.0.1:8001"]);
        assert_eq!(
            stale(&get(&mut lab, secs(3) + hold, SNAPSHOT)),
            [] as [String; 0]
        );
    }

    #[test]
    fn a_silent_replicas_lost_last_message_comes_with_the_probe() {
        let (mut lab, mut cache) = served_a(1);
        let (a, b) = (chat("a"), chat("b"));
        lab.publish(secs(2), 1, &dropped(served(&mut cache, &tokens(&b))));
        // Silent since it was heard at 1 s: probed a silence later.
        let probe = secs(1) + lab.staleness.silence;
        let before = get(&mut lab, probe - secs(1), SNAPSHOT);
        assert_eq!(held(&before, "127.0.0.1:8002"), filter_keys(&a));
        let after = get(&mut lab, probe, SNAPSHOT);
        let both: BTreeSet<u64> = [a, b].iter().flat_map(filter_keys).collect();
        assert_eq!(held(&after, "127.0.0.1:8002"), both);
        assert!(stale(&after).is_empty(), "probes keep idle replicas fresh");
    }

    /// Every answer of one run: prompts on both replicas, a lost message, evictions from a
    /// small cache, a cleared cache, snapshots and increments.
    fn run() -> Vec<(u16, Vec<u8>)> {
        let mut lab = lab();
        let mut caches = [0, 1].map(|_| PrefixCache::new(BLOCK, 2048));
        let mut answers = Vec::new();
        let mut since = 0;
        for (i, tag) in ["a", "b", "c", "d", "e", "f"].iter().enumerate() {
            let r = i % 2;
            let mut batch = served(&mut caches[r], &tokens(&chat(tag)));
            batch.dropped = i == 2;
            lab.publish(secs(i as u64), r, &batch);
            let feed = format!("/v1/changes?epoch={EPOCH}&since={since}");
            let (status, body) = lab.answer(secs(i as u64), &feed);
            since = serde_json::from_slice::<Value>(&body).unwrap()["version"]
                .as_u64()
                .unwrap();
            answers.push((status, body));
            answers.push(lab.answer(secs(i as u64), SNAPSHOT));
        }
        caches[0].clear();
        let cleared = Published {
            events: caches[0].take_events(),
            dropped: false,
        };
        lab.publish(secs(10), 0, &cleared);
        answers.push(lab.answer(
            secs(10),
            &format!("/v1/changes?epoch={EPOCH}&since={since}"),
        ));
        answers.push(lab.answer(secs(100), SNAPSHOT));
        answers.push(lab.answer(secs(100), "/metrics"));
        answers.push(lab.answer(secs(100), "/health"));
        answers
    }

    #[test]
    fn the_same_inputs_give_the_same_bytes() {
        // The heap estimate depends on how the tables grew, not on what they hold.
        let held = |answers: Vec<(u16, Vec<u8>)>| -> Vec<(u16, Vec<u8>)> {
            let estimate = "kvroute_indexer_memory_bytes ";
            answers
                .into_iter()
                .map(|(status, body)| {
                    let text = String::from_utf8_lossy(&body);
                    let kept: Vec<&str> =
                        text.lines().filter(|l| !l.starts_with(estimate)).collect();
                    (status, kept.join("\n").into_bytes())
                })
                .collect()
        };
        let (first, second) = (held(run()), held(run()));
        assert_eq!(first.len(), second.len());
        for (i, (x, y)) in first.iter().zip(&second).enumerate() {
            assert!(
                x == y,
                "answer {i} differs: {}",
                String::from_utf8_lossy(&x.1)
            );
        }
        let after_clear: Value = serde_json::from_slice(&first[first.len() - 4].1).unwrap();
        let changes = after_clear["changes"].as_array().unwrap();
        assert!(
            !changes.is_empty() && changes.iter().all(|c| c[1] == 0),
            "{after_clear}"
        );
    }
}
