//! One model, two drivers: a recorded request sequence run through the tokio `Replica` under
//! paused time and through `EngineCore` alone, stepped from event to event, gives each request
//! the same first token, tokens, completion, times and cached tokens.

use kvroute_sim::engine::{Emit, EngineCore, Happened, Replica, RequestId};
use kvroute_sim::spec::FleetSpec;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every cost a whole number of milliseconds, so each event falls on one of tokio's millisecond
/// timer ticks and the tokio run's callbacks can be timed exactly. Three slots and a small pool,
/// so requests queue for both.
fn spec() -> Arc<FleetSpec> {
    Arc::new(FleetSpec {
        max_num_seqs: 3,
        kv_capacity_tokens: 800,
        prefill_base_ms: 20.0,
        prefill_ms_per_token: 1.0,
        // One millisecond per cached block of 16.
        cached_token_ms: 0.0625,
        decode_ms_per_token: 10.0,
        decode_batch_slope: 1.0,
        time_scale: 1.0,
        ..FleetSpec::default()
    })
}

struct Arrival {
    at: Duration,
    prompt: Vec<u32>,
    output: Vec<u32>,
}

/// Twenty requests at fixed, distinct offsets: three shared system prompts with their own
/// suffixes, outputs of 1 to 13 tokens.
fn arrivals() -> Vec<Arrival> {
    (0..20u32)
        .map(|i| {
            let mut prompt: Vec<u32> = (0..64).map(|t| t + 1000 * (i % 3)).collect();
            prompt.extend((0..20 + (i * 13) % 90).map(|t| t + 100_000 * (i + 1)));
            Arrival {
                at: Duration::from_millis(u64::from(i * 17 + (i * i) % 11)),
                prompt,
                output: vec![7; 1 + (i as usize * 5) % 13],
            }
        })
        .collect()
}

type Record = Vec<(Duration, Emit)>;

async fn through_the_replica(arrivals: Vec<Arrival>) -> Vec<Record> {
    let replica = Arc::new(Replica::new(0, spec(), None));
    let epoch = replica.epoch();
    let tasks: Vec<_> = arrivals
        .into_iter()
        .map(|a| {
            let replica = replica.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(epoch + a.at).await;
                let record = Mutex::new(Vec::new());
                let outcome = replica
                    .generate(&a.prompt, None, &a.output, |what| {
                        record.lock().unwrap().push((epoch.elapsed(), what));
                        true
                    })
                    .await
                    .unwrap();
                let mut record = record.into_inner().unwrap();
                let cached_tokens = outcome.cached_tokens;
                record.push((epoch.elapsed(), Emit::Done { cached_tokens }));
                record
            })
        })
        .collect();
    let mut records = Vec::new();
    for t in tasks {
        records.push(t.await.unwrap());
    }
    records
}

fn through_the_core(arrivals: &[Arrival]) -> Vec<Record> {
    let mut core = EngineCore::new(0, spec());
    let mut happened: Vec<Happened> = Vec::new();
    let mut next = 0;
    loop {
        let arrival = arrivals.get(next).map(|a| a.at);
        let Some(now) = [arrival, core.next_event()].into_iter().flatten().min() else {
            break;
        };
        core.advance(now, &mut happened);
        while let Some(a) = arrivals.get(next).filter(|a| a.at == now) {
            let id = next as RequestId;
            let (prompt, output) = (a.prompt.clone(), a.output.clone());
            core.submit(now, id, prompt, None, output).unwrap();
            next += 1;
        }
    }
    (0..arrivals.len() as RequestId)
        .map(|id| {
            let mine = happened.iter().filter(|h| h.id == id);
            mine.map(|h| (h.at, h.what)).collect()
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn the_tokio_replica_and_the_bare_core_agree_on_every_request() {
    let expected = through_the_core(&arrivals());
    let seen = through_the_replica(arrivals()).await;
    for (i, (seen, expected)) in seen.iter().zip(&expected).enumerate() {
        assert_eq!(seen, expected, "request {i}");
    }
    assert_eq!(seen.len(), 20);
    // The sequence exercises what it is meant to: cache hits, and requests that queued.
    let firsts: Vec<(Duration, usize)> = expected
        .iter()
        .map(|r| match r[0] {
            (at, Emit::First { cached_tokens }) => (at, cached_tokens),
            other => panic!("began with {other:?}"),
        })
        .collect();
    assert!(firsts.iter().filter(|(_, c)| *c > 0).count() >= 10);
    let arrivals = arrivals();
    let slowest = firsts
        .iter()
        .zip(&arrivals)
        .map(|((at, _), a)| *at - a.at)
        .max()
        .unwrap();
    assert!(slowest > Duration::from_millis(300), "{slowest:?}");
}
