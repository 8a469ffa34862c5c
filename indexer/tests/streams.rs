//! A stream's sequence, over real ZeroMQ sockets from a stand-in publisher: a gap without a
//! replay socket drops the engine's keys and marks it stale; a gap the replay socket fills
//! does not; an engine that starts its sequence over starts over in the index; silence makes
//! an engine without a replay socket stale until it speaks again. An engine with one is probed
//! after a silence: it stays fresh while the probes are answered, goes stale when they are not
//! or when it is gone, gets what its stream lost, and shows a restart it did not publish.

use crate::common;

use bytes::Bytes;
use common::{get_json, indexer, tokenizer_file, Deadline, FeedClient};
use kvroute::prefix::{PrefixKeys, Shape};
use kvroute_sim::bpe::Vocab;
use kvroute_sim::kv_events::{encode_batch, Format};
use kvroute_sim::prefix_cache::CacheEvent;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BLOCK: usize = 16;
const CHUNK: usize = 64;
const ENDPOINT: &str = "127.0.0.1:8000";

/// Every message sent, for the replay socket.
type Sent = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A stand-in engine: a PUB socket, and optionally a replay ROUTER.
struct Engine {
    publisher: PubSocket,
    events: String,
    replay: Option<String>,
    sent: Sent,
    /// While set, the replay socket takes requests and answers none (a wedged engine).
    mute: Arc<AtomicBool>,
    router: Option<tokio::task::JoinHandle<()>>,
}

impl Engine {
    async fn start(with_replay: bool) -> Engine {
        let mut publisher = PubSocket::new();
        let events = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let sent: Sent = Arc::default();
        let mute: Arc<AtomicBool> = Arc::default();
        let (replay, router) = if with_replay {
            let mut router = RouterSocket::new();
            let url = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let task = tokio::spawn(serve_replay(router, sent.clone(), mute.clone()));
            (Some(url), Some(task))
        } else {
            (None, None)
        };
        Engine {
            publisher,
            events,
            replay,
            sent,
            mute,
            router,
        }
    }

    /// A restart: the replay buffer starts over, empty (the sockets stay, as a subscriber that
    /// reconnected to the new process would see them).
    fn restart(&mut self) {
        self.sent.lock().unwrap().clear();
    }

    /// The engine is gone: its sockets close.
    fn stop(self) {
        if let Some(router) = &self.router {
            router.abort();
        }
        drop(self.publisher);
    }

    /// Publishes message `seq` (and keeps it for replay).
    async fn publish(&mut self, seq: u64, events: &[CacheEvent]) {
        self.remember(seq, events);
        let payload = self.sent.lock().unwrap().last().unwrap().1.clone();
        self.send(seq, payload).await;
    }

    /// Keeps message `seq` for replay without publishing it (it is lost on the way).
    fn remember(&mut self, seq: u64, events: &[CacheEvent]) {
        let payload = encode_batch(0.0, events, BLOCK, Format::Map);
        self.sent.lock().unwrap().push((seq, payload));
    }

    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        let frames = vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        let message = ZmqMessage::try_from(frames).unwrap();
        self.publisher.send(message).await.unwrap();
    }
}

/// vLLM 0.32's replay protocol: `[id, "", start]` in, `[id, "", topic, seq, payload]`... then
/// `[id, "", "", -1, ""]` out.
async fn serve_replay(mut router: RouterSocket, sent: Sent, mute: Arc<AtomicBool>) {
    while let Ok(request) = router.recv().await {
        if mute.load(Ordering::SeqCst) {
            continue;
        }
        let frames = request.into_vec();
        let id = frames[0].clone();
        let start = u64::from_be_bytes(frames.last().unwrap()[..8].try_into().unwrap());
        let replies: Vec<(u64, Vec<u8>)> = sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let end = (u64::MAX, Vec::new());
        for (seq, payload) in replies.into_iter().chain([end]) {
            let topic = if seq == u64::MAX { "" } else { "kv" };
            let message = ZmqMessage::try_from(vec![
                id.clone(),
                Bytes::new(),
                Bytes::from_static(topic.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ])
            .unwrap();
            if router.send(message).await.is_err() {
                break;
            }
        }
    }
}

/// A prompt's tokens, cut to whole blocks, with its block hashes (`tag` tells chains apart).
fn chain(text: &str, tag: u64) -> (Vec<u32>, Vec<u64>) {
    let mut ids = Vocab::load(&tokenizer_file()).unwrap().tokenize(text);
    ids.truncate(ids.len() / BLOCK * BLOCK);
    let hashes = (0..ids.len() / BLOCK)
        .map(|i| tag * 1000 + i as u64)
        .collect();
    (ids, hashes)
}

/// Blocks `from..to` of a chain as a BlockStored.
fn stored(chain: &(Vec<u32>, Vec<u64>), from: usize, to: usize) -> CacheEvent {
    CacheEvent::Stored {
        hashes: chain.1[from..to].to_vec(),
        parent: from.checked_sub(1).map(|p| chain.1[p]),
        token_ids: chain.0[from * BLOCK..to * BLOCK].to_vec(),
        salt: None,
    }
}

/// kvroute's keys for the whole chunks of blocks `..to` of a chain.
fn keys(chain: &(Vec<u32>, Vec<u64>), to: usize) -> BTreeSet<u64> {
    let tokens = kvroute_indexer::token_bytes::TokenBytes::load(&tokenizer_file()).unwrap();
    let mut bytes = Vec::new();
    tokens.decode(&chain.0[..to * BLOCK], &mut bytes).unwrap();
    let shape = Shape {
        chunk_size: CHUNK,
        max_chunks: usize::MAX,
        group_bytes: 4096,
    };
    let all = PrefixKeys::new("m", &bytes, 0, false, shape).keys;
    all[..bytes.len() / CHUNK].iter().copied().collect()
}

const TEXT_A: &str = "The first conversation, about caches and blocks and keys, long enough to \
    fill several chunks of sixty-four bytes: ünïcödé, 漢字, and emoji 🙂 included on purpose.";
const TEXT_B: &str = "A second conversation that shares nothing with the first one, also long \
    enough to fill a few chunks; it goes on and on for a while to make sure of that, really.";

/// Starts an indexer on `engine` and publishes empty batches until it has taken one; returns
/// the indexer's base URL and the next sequence number.
async fn connect(engine: &mut Engine, stale_after: f64) -> (String, u64, kvroute_indexer::Running) {
    let spec = [(
        ENDPOINT.to_owned(),
        engine.events.clone(),
        engine.replay.clone(),
    )];
    let idx = indexer(&spec, CHUNK, stale_after).await;
    let base = format!("http://{}", idx.addr);
    let deadline = Deadline::start();
    let mut seq = 0;
    loop {
        engine.publish(seq, &[]).await;
        seq += 1;
        let health = get_json(&format!("{base}/health")).await;
        if !health["streams"][0]["next_seq"].is_null() {
            break;
        }
        deadline
            .tick(|| format!("the indexer to subscribe: {health}"))
            .await;
    }
    let health = get_json(&format!("{base}/health")).await;
    let next = health["streams"][0]["next_seq"].as_u64().unwrap();
    // Messages published after the one it took, before it answered, are not lost either.
    assert!(next <= seq);
    (base, seq, idx)
}

/// Polls until `check` holds for the client's view.
async fn until(base: &str, what: &str, check: impl Fn(&FeedClient) -> bool) -> FeedClient {
    let mut client = FeedClient::default();
    let deadline = Deadline::start();
    loop {
        client.poll(base).await;
        if check(&client) {
            return client;
        }
        deadline
            .tick(|| {
                format!(
                    "{what}: held {}, stale {:?}",
                    client.held(ENDPOINT).len(),
                    client.stale
                )
            })
            .await;
    }
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(&format!("kvroute_indexer_{name}{{")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

async fn metrics(base: &str) -> String {
    common::http(hyper::Method::GET, &format!("{base}/metrics"), "")
        .await
        .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_replay_drops_the_engines_keys_and_marks_it_stale() {
    let mut engine = Engine::start(false).await;
    let (base, mut seq, _idx) = connect(&mut engine, 3600.0).await;
    let a = chain(TEXT_A, 1);
    let b = chain(TEXT_B, 2);
    let n = a.1.len();
    engine.publish(seq, &[stored(&a, 0, n)]).await;
    seq += 1;
    let want = keys(&a, n);
    assert!(!want.is_empty());
    until(&base, "chain A held, fresh", |c| {
        c.held(ENDPOINT) == want && c.stale.is_empty()
    })
    .await;
    // Message `seq` is lost; the next carries chain B.
    seq += 1;
    engine.publish(seq, &[stored(&b, 0, b.1.len())]).await;
    let want_b = keys(&b, b.1.len());
    until(&base, "A dropped, B held, stale", |c| {
        c.held(ENDPOINT) == want_b && c.stale == [ENDPOINT]
    })
    .await;
    let m = metrics(&base).await;
    assert_eq!(
        (metric(&m, "gaps_total"), metric(&m, "drops_total")),
        (1, 1)
    );
    assert_eq!(metric(&m, "stale"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_the_replay_socket_fills_loses_nothing() {
    let mut engine = Engine::start(true).await;
    let (base, mut seq, _idx) = connect(&mut engine, 3600.0).await;
    let a = chain(TEXT_A, 1);
    let n = a.1.len();
    engine.publish(seq, &[stored(&a, 0, 2)]).await;
    seq += 1;
    // The rest of chain A is lost on the way, but the replay socket has it.
    engine.remember(seq, &[stored(&a, 2, n)]);
    seq += 1;
    engine.publish(seq, &[]).await;
    let want = keys(&a, n);
    until(&base, "all of chain A, fresh", |c| {
        c.held(ENDPOINT) == want && c.stale.is_empty()
    })
    .await;
    let m = metrics(&base).await;
    assert_eq!(
        (metric(&m, "gaps_total"), metric(&m, "resyncs_total")),
        (1, 1)
    );
    assert_eq!(metric(&m, "drops_total"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_starts_its_sequence_over_starts_over_in_the_index() {
    let mut engine = Engine::start(false).await;
    let (base, seq, _idx) = connect(&mut engine, 3600.0).await;
    let a = chain(TEXT_A, 1);
    let b = chain(TEXT_B, 2);
    engine.publish(seq, &[stored(&a, 0, a.1.len())]).await;
    let want = keys(&a, a.1.len());
    until(&base, "chain A", |c| c.held(ENDPOINT) == want).await;
    // Restarted: numbering from 0 again, an empty cache, then chain B.
    engine.publish(0, &[stored(&b, 0, b.1.len())]).await;
    let want_b = keys(&b, b.1.len());
    until(&base, "only chain B, fresh", |c| {
        c.held(ENDPOINT) == want_b && c.stale.is_empty()
    })
    .await;
    let m = metrics(&base).await;
    assert_eq!(metric(&m, "restarts_total"), 1);
    assert_eq!(metric(&m, "gaps_total"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_engine_is_stale_until_it_speaks() {
    let mut engine = Engine::start(false).await;
    let (base, seq, _idx) = connect(&mut engine, 1.0).await;
    let a = chain(TEXT_A, 1);
    until(&base, "stale after a second of silence", |c| {
        c.stale == [ENDPOINT]
    })
    .await;
    engine.publish(seq, &[stored(&a, 0, a.1.len())]).await;
    let want = keys(&a, a.1.len());
    // Keep speaking (empty batches) so a slow poll still finds it fresh.
    let mut client = FeedClient::default();
    let deadline = Deadline::start();
    for seq in seq + 1.. {
        engine.publish(seq, &[]).await;
        client.poll(&base).await;
        if client.stale.is_empty() && client.held(ENDPOINT) == want {
            break;
        }
        deadline
            .tick(|| format!("fresh again: stale {:?}", client.stale))
            .await;
    }
}

/// Waits until `/metrics` shows `name` at `at_least` or more.
async fn until_metric(base: &str, name: &str, at_least: u64) {
    let deadline = Deadline::start();
    loop {
        let m = metrics(base).await;
        if metric(&m, name) >= at_least {
            return;
        }
        deadline
            .tick(|| format!("{name} at {at_least}: {}", metric(&m, name)))
            .await;
    }
}

/// An engine with a replay socket, connected, holding chain A: the indexer's base URL, the
/// next sequence number, the keys, and the indexer.
async fn holding_a(
    stale_after: f64,
) -> (Engine, String, u64, BTreeSet<u64>, kvroute_indexer::Running) {
    let mut engine = Engine::start(true).await;
    let (base, seq, idx) = connect(&mut engine, stale_after).await;
    let a = chain(TEXT_A, 1);
    engine.publish(seq, &[stored(&a, 0, a.1.len())]).await;
    let want = keys(&a, a.1.len());
    until(&base, "chain A held, fresh", |c| {
        c.held(ENDPOINT) == want && c.stale.is_empty()
    })
    .await;
    (engine, base, seq + 1, want, idx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_stays_fresh_while_its_replay_socket_answers() {
    let (_engine, base, _, want, _idx) = holding_a(1.0).await;
    let events = metric(&metrics(&base).await, "events_total");
    // Three answered probes: three seconds and more of silence, three times `--stale-after`.
    until_metric(&base, "probes_total", 3).await;
    until(&base, "chain A held, fresh after the silence", |c| {
        c.held(ENDPOINT) == want && c.stale.is_empty()
    })
    .await;
    let m = metrics(&base).await;
    assert_eq!(
        metric(&m, "events_total"),
        events,
        "the engine said nothing"
    );
    assert_eq!(
        (metric(&m, "gaps_total"), metric(&m, "restarts_total")),
        (0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_stops_answering_is_stale_until_it_answers_again() {
    let (engine, base, _, want, _idx) = holding_a(1.0).await;
    engine.mute.store(true, Ordering::SeqCst);
    until(&base, "stale, chain A still held", |c| {
        c.stale == [ENDPOINT] && c.held(ENDPOINT) == want
    })
    .await;
    assert!(metric(&metrics(&base).await, "unanswered_probes_total") >= 1);
    engine.mute.store(false, Ordering::SeqCst);
    until(&base, "fresh again, chain A held", |c| {
        c.stale.is_empty() && c.held(ENDPOINT) == want
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_publisher_is_gone_goes_stale() {
    let (engine, base, _, _, _idx) = holding_a(1.0).await;
    engine.stop();
    until(&base, "stale", |c| c.stale == [ENDPOINT]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_gets_what_the_stream_lost() {
    let (mut engine, base, seq, want, _idx) = holding_a(1.0).await;
    let b = chain(TEXT_B, 2);
    // The engine's last message is lost on the way, and it goes idle.
    engine.remember(seq, &[stored(&b, 0, b.1.len())]);
    let mut both = want.clone();
    both.extend(keys(&b, b.1.len()));
    until(&base, "chains A and B held, fresh", |c| {
        c.held(ENDPOINT) == both && c.stale.is_empty()
    })
    .await;
    let m = metrics(&base).await;
    assert_eq!(
        (metric(&m, "resyncs_total"), metric(&m, "drops_total")),
        (1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_while_idle_starts_over_in_the_index() {
    let (mut engine, base, seq, _, _idx) = holding_a(1.0).await;
    // Restarted, it publishes as many messages as before, the last with chain B, all lost on
    // the way: the one numbered as the last applied is another message.
    engine.restart();
    let b = chain(TEXT_B, 2);
    for n in 0..seq - 1 {
        engine.remember(n, &[]);
    }
    engine.remember(seq - 1, &[stored(&b, 0, b.1.len())]);
    let want_b = keys(&b, b.1.len());
    until(&base, "only chain B, fresh", |c| {
        c.held(ENDPOINT) == want_b && c.stale.is_empty()
    })
    .await;
    assert_eq!(metric(&metrics(&base).await, "restarts_total"), 1);
}
