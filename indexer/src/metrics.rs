//! `/metrics` (Prometheus text) and `/health` (JSON): what the index holds and how its streams
//! are doing.

use crate::index::Index;
use crate::state::Serving;
use serde_json::json;
use std::fmt::Write;
use std::time::Duration;

/// Prometheus exposition of every stream's and endpoint's counters at `now`.
pub fn render(index: &Index, serving: Serving, now: Duration) -> String {
    let mut out = String::new();
    let endpoints = index.holders.endpoints();
    type Get = fn(&crate::index::StreamEntry) -> u64;
    let per_stream: [(&str, &str, &str, Get); 18] = [
        ("events_total", "counter", "Events received", |e| {
            e.stream.counts.events
        }),
        (
            "blocks_stored_total",
            "counter",
            "Blocks stored (BlockStored)",
            |e| e.stream.counts.blocks_stored,
        ),
        (
            "blocks_removed_total",
            "counter",
            "Known blocks removed (BlockRemoved)",
            |e| e.stream.counts.blocks_removed,
        ),
        ("clears_total", "counter", "AllBlocksCleared events", |e| {
            e.stream.counts.clears
        }),
        (
            "orphan_blocks_total",
            "counter",
            "Blocks whose parent was never seen, not indexed",
            |e| e.stream.counts.orphan_blocks,
        ),
        (
            "multimodal_blocks_total",
            "counter",
            "Blocks with multimodal or embedding inputs (and their descendants), not indexed",
            |e| e.stream.counts.multimodal_blocks,
        ),
        (
            "other_medium_blocks_total",
            "counter",
            "Blocks on another medium than the GPU, ignored",
            |e| e.stream.counts.other_medium_blocks,
        ),
        (
            "other_group_blocks_total",
            "counter",
            "Blocks of a KV-cache group other than the full-attention one, ignored",
            |e| e.stream.counts.other_group_blocks,
        ),
        (
            "malformed_events_total",
            "counter",
            "Events whose tokens did not fit their blocks or vocabulary",
            |e| e.stream.counts.malformed,
        ),
        (
            "content_hash_blocks_total",
            "counter",
            "SGLang blocks named by a content hash (SGLang up to 0.5.5), not indexed",
            |e| e.stream.counts.content_hash_blocks,
        ),
        ("blocks", "gauge", "Cached blocks known", |e| {
            e.stream.blocks() as u64
        }),
        (
            "undecodable_messages_total",
            "counter",
            "Messages that were not KV-event batches",
            |e| e.health.undecodable,
        ),
        ("gaps_total", "counter", "Sequence gaps", |e| e.health.gaps),
        (
            "resyncs_total",
            "counter",
            "Gaps filled from the replay socket",
            |e| e.health.resyncs,
        ),
        (
            "drops_total",
            "counter",
            "Gaps not filled: the stream's blocks were dropped",
            |e| e.health.drops,
        ),
        (
            "restarts_total",
            "counter",
            "Engine restarts (sequence started over)",
            |e| e.health.restarts,
        ),
        (
            "probes_total",
            "counter",
            "Probes of a silent engine its replay socket answered",
            |e| e.health.probes,
        ),
        (
            "unanswered_probes_total",
            "counter",
            "Probes of a silent engine left unanswered: it is stale until heard again",
            |e| e.health.unanswered,
        ),
    ];
    for (name, kind, help, get) in per_stream {
        let _ = writeln!(
            out,
            "# HELP kvroute_indexer_{name} {help}.\n# TYPE kvroute_indexer_{name} {kind}"
        );
        for entry in &index.streams {
            let endpoint = &endpoints[entry.stream.endpoint() as usize];
            let _ = writeln!(
                out,
                "kvroute_indexer_{name}{{endpoint=\"{endpoint}\",stream=\"{}\"}} {}",
                entry.url,
                get(entry)
            );
        }
    }
    let stale = index.stale_endpoints(now, serving.staleness);
    let _ = writeln!(out, "# HELP kvroute_indexer_keys_held Prefix keys the endpoint holds.\n# TYPE kvroute_indexer_keys_held gauge");
    for (e, name) in endpoints.iter().enumerate() {
        let _ = writeln!(
            out,
            "kvroute_indexer_keys_held{{endpoint=\"{name}\"}} {}",
            index.holders.held(e as u32)
        );
    }
    let _ = writeln!(out, "# HELP kvroute_indexer_stale 1 while the endpoint's events cannot be trusted (an unfilled gap, an unanswered probe, disconnected, or silent without a replay socket).\n# TYPE kvroute_indexer_stale gauge");
    for (e, name) in endpoints.iter().enumerate() {
        let s = u8::from(stale.contains(&(e as u32)));
        let _ = writeln!(out, "kvroute_indexer_stale{{endpoint=\"{name}\"}} {s}");
    }
    let _ = writeln!(out, "# HELP kvroute_indexer_stale_endpoints Endpoints stale now.\n# TYPE kvroute_indexer_stale_endpoints gauge\nkvroute_indexer_stale_endpoints {}", stale.len());
    let _ = writeln!(out, "# HELP kvroute_indexer_version Changes published since start.\n# TYPE kvroute_indexer_version counter\nkvroute_indexer_version {}", index.holders.version());
    let memory = index.memory() + serving.tokens.memory();
    let _ = writeln!(out, "# HELP kvroute_indexer_memory_bytes Heap the index takes, estimated.\n# TYPE kvroute_indexer_memory_bytes gauge\nkvroute_indexer_memory_bytes {memory}");
    out
}

/// `/health`: the epoch, the version and each stream's state at `now`.
pub fn health(index: &Index, serving: Serving, now: Duration) -> String {
    let endpoints = index.holders.endpoints();
    let streams: Vec<_> = index
        .streams
        .iter()
        .enumerate()
        .map(|(s, entry)| {
            let e = entry.stream.endpoint();
            json!({
                "endpoint": endpoints[e as usize],
                "stream": entry.url,
                "kind": entry.stream.dialect().name(),
                "connected": entry.health.connected,
                "stale": index.stream_stale(s, now, serving.staleness),
                "events": entry.stream.counts.events,
                "next_seq": entry.next_seq(),
                "probes": entry.health.probes,
                "unreachable": entry.health.unreachable,
                "blocks": entry.stream.blocks(),
                "keys": index.holders.held(e),
            })
        })
        .collect();
    json!({
        "status": "ok",
        "epoch": serving.epoch,
        "version": index.holders.version(),
        "streams": streams,
    })
    .to_string()
}
