//! The tokio driver: a replica's requests end, abort and report as the core says, in tokio time.

use super::*;

fn spec_at(time_scale: f64) -> Arc<FleetSpec> {
    Arc::new(FleetSpec {
        time_scale,
        ..FleetSpec::default()
    })
}

/// A replica running one request at a time.
fn one_slot(time_scale: f64) -> Replica {
    let spec = FleetSpec {
        max_num_seqs: 1,
        ..FleetSpec::clone(&spec_at(time_scale))
    };
    Replica::new(0, Arc::new(spec), None)
}

/// How long one request takes on `replica`, and how it ends.
async fn timed(replica: &Replica, prompt: &[u32], output: &[u32]) -> (Duration, Outcome) {
    let start = Instant::now();
    let outcome = replica.generate(prompt, None, output, |_| true).await;
    (start.elapsed(), outcome.unwrap())
}

// Paused time throughout: the clock moves only when every task waits, so a loaded machine
// cannot change what happens when.
#[tokio::test(start_paused = true)]
async fn second_identical_prompt_hits_cache_and_prefills_faster() {
    let replica = Replica::new(0, spec_at(0.01), None);
    let prompt: Vec<u32> = (0..6000).collect();
    let (cold_time, cold) = timed(&replica, &prompt, &[5]).await;
    let (warm_time, warm) = timed(&replica, &prompt, &[5]).await;
    assert_eq!(cold.cached_tokens, 0);
    assert_eq!(warm.cached_tokens, 5984);
    // 42.5 ms vs 6 ms at time_scale 0.01 (tokio's timers round up to the millisecond).
    assert!(cold_time >= Duration::from_millis(42), "{cold_time:?}");
    assert!(warm_time <= Duration::from_millis(7), "{warm_time:?}");
    let snap = replica.snapshot();
    assert_eq!(snap.prefix_queries_tokens, 12000);
    assert_eq!(snap.prefix_hits_tokens, 5984);
    assert_eq!(snap.ttft_seconds.count(), 2);
}

#[tokio::test(start_paused = true)]
async fn emits_every_output_token_in_order_and_releases_blocks() {
    let replica = Replica::new(0, spec_at(0.001), None);
    let mut seen = Vec::new();
    replica
        .generate(&[1, 2, 3], None, &[9; 40], |e| {
            seen.push(e);
            true
        })
        .await
        .unwrap();
    let mut expected = vec![Emit::First { cached_tokens: 0 }];
    expected.extend((2..=40).map(|upto| Emit::Tokens { upto }));
    assert_eq!(seen, expected);
    let snap = replica.snapshot();
    assert_eq!((snap.running, snap.waiting, snap.kv_usage), (0, 0, 0.0));
    assert_eq!(snap.generation_tokens_total, 40);
    assert_eq!(snap.success_total, 1);
}

#[tokio::test(start_paused = true)]
async fn requests_beyond_max_num_seqs_wait_in_fifo_order() {
    // Each request takes 12.5 ms here: 9.5 ms prefill plus one 3 ms decode step.
    let replica = Arc::new(one_slot(0.1));
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3u32 {
        let (r, o) = (replica.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            r.generate(&[i; 64], None, &[1, 2], |_| true).await.unwrap();
            o.lock().unwrap().push(i);
        }));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(3)).await;
    let snap = replica.snapshot();
    assert_eq!((snap.running, snap.waiting), (1, 2));
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
}

#[tokio::test(start_paused = true)]
async fn aborting_releases_the_slot_and_pins() {
    let replica = Replica::new(0, spec_at(0.001), None);
    let err = replica
        .generate(&[7; 100], None, &[1; 10], |_| false)
        .await
        .unwrap_err();
    assert_eq!(err, GenError::Aborted);
    let snap = replica.snapshot();
    assert_eq!((snap.running, snap.kv_usage), (0, 0.0));
    assert!(snap.cached_blocks >= 6);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_request_frees_its_slot_for_the_next() {
    let replica = one_slot(0.01);
    // The client goes away while its request prefills: the future is dropped.
    let gone = tokio::time::timeout(
        Duration::from_millis(1),
        replica.generate(&[7; 1000], None, &[1; 10], |_| true),
    )
    .await;
    assert!(gone.is_err());
    let snap = replica.snapshot();
    assert_eq!((snap.running, snap.waiting, snap.kv_usage), (0, 0, 0.0));
    let next = replica.generate(&[8; 100], None, &[1], |_| true).await;
    assert_eq!(next, Ok(Outcome { cached_tokens: 0 }));
}

#[tokio::test]
async fn prompts_larger_than_the_pool_are_rejected_not_queued_forever() {
    let spec = Arc::new(FleetSpec {
        kv_capacity_tokens: 64,
        ..FleetSpec::default()
    });
    let replica = Replica::new(0, spec, None);
    let err = replica
        .generate(&[1; 100], None, &[1], |_| true)
        .await
        .unwrap_err();
    assert!(matches!(err, GenError::TooLong(_)));
}

#[tokio::test(start_paused = true)]
async fn slow_factor_stretches_prefill() {
    let replica = Replica::new(0, spec_at(0.01), None);
    replica.set_faults(Faults {
        slow_factor: 4.0,
        ..Faults::default()
    });
    let (took, _) = timed(&replica, &[3; 1000], &[1]).await;
    // 750 ms simulated * 4 * 0.01 = 30 ms.
    assert_eq!(took, Duration::from_millis(30));
}

#[tokio::test(start_paused = true)]
async fn kv_events_reach_the_publisher() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let replica = Replica::new(0, spec_at(0.001), Some(tx));
    replica.set_faults(Faults {
        drop_kv_events: 1,
        ..Faults::default()
    });
    replica
        .generate(&[4; 40], None, &[1; 30], |_| true)
        .await
        .unwrap();
    let first = rx.try_recv().unwrap();
    assert!(first.dropped);
    assert!(!first.events.is_empty());
    assert!(!rx.try_recv().unwrap().dropped);
    assert_eq!(replica.faults().drop_kv_events, 0);
}

#[test]
fn fail_rate_is_respected_roughly() {
    let replica = Replica::new(0, spec_at(0.001), None);
    assert!(!(0..100).any(|_| replica.roll_failure()));
    replica.set_faults(Faults {
        fail_rate: 0.5,
        ..Faults::default()
    });
    let fails = (0..1000).filter(|_| replica.roll_failure()).count();
    assert!((350..650).contains(&fails), "{fails}");
    replica.set_faults(Faults {
        fail_rate: 1.0,
        ..Faults::default()
    });
    assert!((0..100).all(|_| replica.roll_failure()));
}
