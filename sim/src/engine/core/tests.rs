//! The engine core alone: admission, the prefill lane, decode steps, the cache, aborts, ties.

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn core_with(change: impl FnOnce(&mut FleetSpec)) -> EngineCore {
    let mut spec = FleetSpec::default();
    change(&mut spec);
    EngineCore::new(0, Arc::new(spec))
}

/// Real time of `simulated_ms` under the default spec (time_scale 1, no slow_factor).
fn real(simulated_ms: f64) -> Duration {
    time_model::real(&FleetSpec::default(), simulated_ms, 1.0)
}

/// Runs the core from event to event until nothing is pending.
fn drain(core: &mut EngineCore) -> Vec<Happened> {
    let mut out = Vec::new();
    while let Some(t) = core.next_event() {
        core.advance(t, &mut out);
    }
    out
}

/// When request `id` had its first token.
fn first_at(happened: &[Happened], id: RequestId) -> Duration {
    happened
        .iter()
        .find(|h| h.id == id && matches!(h.what, Emit::First { .. }))
        .map(|h| h.at)
        .unwrap()
}

/// What happened to request `id`, in order.
fn of(happened: &[Happened], id: RequestId) -> Vec<(Duration, Emit)> {
    happened
        .iter()
        .filter(|h| h.id == id)
        .map(|h| (h.at, h.what))
        .collect()
}

#[test]
fn requests_beyond_max_num_seqs_wait_in_fifo_order() {
    let mut core = core_with(|s| s.max_num_seqs = 1);
    for i in 0..3u32 {
        core.submit(ms(i.into()), i.into(), vec![i; 64], None, vec![1, 2])
            .unwrap();
    }
    let snap = core.snapshot();
    assert_eq!((snap.running, snap.waiting), (1, 2));
    let happened = drain(&mut core);
    let firsts: Vec<RequestId> = happened
        .iter()
        .filter(|h| matches!(h.what, Emit::First { .. }))
        .map(|h| h.id)
        .collect();
    assert_eq!(firsts, vec![0, 1, 2]);
    // The next one is admitted when the previous is done: its prefill starts then.
    let done_0 = of(&happened, 0).last().unwrap().0;
    assert_eq!(first_at(&happened, 1), done_0 + real(50.0 + 64.0 * 0.7));
    let snap = core.snapshot();
    assert_eq!((snap.running, snap.waiting, snap.success_total), (0, 0, 3));
    assert_eq!(snap.generation_tokens_total, 6);
}

#[test]
fn the_head_of_the_queue_waits_for_kv_and_nobody_passes_it() {
    // 10 blocks: the first request holds 9, the second needs 6, the third 1.
    let mut core = core_with(|s| s.kv_capacity_tokens = 160);
    core.submit(ms(0), 0, vec![1; 128], None, vec![1]).unwrap();
    core.submit(ms(0), 1, vec![2; 96], None, vec![1]).unwrap();
    core.submit(ms(0), 2, vec![3; 16], None, vec![1]).unwrap();
    let snap = core.snapshot();
    assert_eq!((snap.running, snap.waiting), (1, 2));
    let happened = drain(&mut core);
    assert!(first_at(&happened, 0) < first_at(&happened, 1));
    assert!(first_at(&happened, 1) < first_at(&happened, 2));
}

#[test]
fn second_identical_prompt_hits_cache_and_prefills_faster() {
    let mut core = core_with(|_| {});
    let prompt: Vec<u32> = (0..6000).collect();
    core.submit(ms(0), 0, prompt.clone(), None, vec![5])
        .unwrap();
    let cold = drain(&mut core);
    core.submit(ms(10_000), 1, prompt, None, vec![5]).unwrap();
    let warm = drain(&mut core);
    assert_eq!(
        of(&cold, 0),
        vec![
            (real(4250.0), Emit::First { cached_tokens: 0 }),
            (real(4250.0), Emit::Done { cached_tokens: 0 }),
        ]
    );
    let warm_ttft = first_at(&warm, 1) - ms(10_000);
    assert_eq!(warm_ttft, real(50.0 + 16.0 * 0.7 + 5984.0 * 0.09));
    assert_eq!(
        warm[0].what,
        Emit::First {
            cached_tokens: 5984
        }
    );
    let snap = core.snapshot();
    assert_eq!(snap.prefix_queries_tokens, 12000);
    assert_eq!(snap.prefix_hits_tokens, 5984);
    assert_eq!(snap.ttft_seconds.count(), 2);
}

#[test]
fn prompts_larger_than_the_pool_and_empty_outputs_are_rejected() {
    let mut core = core_with(|s| s.kv_capacity_tokens = 64);
    let long = core.submit(ms(0), 0, vec![1; 100], None, vec![1]);
    assert!(matches!(long, Err(GenError::TooLong(_))));
    let empty = core.submit(ms(0), 1, vec![1; 10], None, vec![]);
    assert!(matches!(empty, Err(GenError::TooLong(_))));
    assert_eq!(core.snapshot().waiting, 0);
    assert_eq!(core.next_event(), None);
}

/// One slot; request 0 (`prompt_len` tokens of 7, `output_len` tokens out) runs, request 1
/// (`prompt_len` tokens of 8, one token out) waits for it.
fn two_on_one_slot(prompt_len: usize, output_len: usize) -> EngineCore {
    let mut core = core_with(|s| s.max_num_seqs = 1);
    core.submit(ms(0), 0, vec![7; prompt_len], None, vec![1; output_len])
        .unwrap();
    core.submit(ms(0), 1, vec![8; prompt_len], None, vec![1])
        .unwrap();
    core
}

#[test]
fn abort_releases_the_slot_and_blocks() {
    let mut core = two_on_one_slot(100, 10);
    core.abort(ms(10), 0);
    let snap = core.snapshot();
    assert_eq!((snap.running, snap.waiting), (1, 0));
    let happened = drain(&mut core);
    assert!(of(&happened, 0).is_empty());
    // The lane stays booked for the aborted prefill (120 ms); the next one follows it.
    assert_eq!(first_at(&happened, 1), real(120.0) + real(120.0));
    let snap = core.snapshot();
    assert_eq!((snap.running, snap.kv_usage), (0, 0.0));
    // The aborted prompt's full blocks stay cached.
    assert_eq!(core.cached_tokens(&[7; 100], None), 96);
    assert_eq!(snap.success_total, 1);
}

#[test]
fn aborting_a_decoding_request_admits_the_next() {
    let mut core = two_on_one_slot(16, 100);
    let mut out = Vec::new();
    core.advance(ms(1000), &mut out);
    assert!(!out.is_empty());
    core.abort(ms(1000), 0);
    let happened = drain(&mut core);
    assert!(of(&happened, 0).is_empty());
    assert_eq!(first_at(&happened, 1), ms(1000) + real(50.0 + 16.0 * 0.7));
}

#[test]
fn slow_factor_stretches_prefill() {
    let mut fast = core_with(|_| {});
    let mut slow = core_with(|_| {});
    slow.set_faults(Faults {
        slow_factor: 4.0,
        ..Faults::default()
    });
    for core in [&mut fast, &mut slow] {
        core.submit(ms(0), 0, vec![3; 1000], None, vec![1]).unwrap();
    }
    assert_eq!(first_at(&drain(&mut fast), 0), real(750.0));
    assert_eq!(first_at(&drain(&mut slow), 0), real(3000.0));
}

#[test]
fn decode_steps_batch_the_requests_decoding_together() {
    let mut core = core_with(|_| {});
    core.submit(ms(0), 0, vec![1; 16], None, vec![1; 20])
        .unwrap();
    core.submit(ms(0), 1, vec![2; 16], None, vec![1; 5])
        .unwrap();
    let happened = drain(&mut core);
    let a = of(&happened, 0);
    let b = of(&happened, 1);
    let prefill = real(50.0 + 16.0 * 0.7);
    let step = real(time_model::decode_step_ms(&FleetSpec::default(), 2));
    assert_eq!(a[0].0, prefill);
    assert_eq!(a[1], (prefill + step, Emit::Tokens { upto: 2 }));
    // B's first token comes mid-step; it joins at the next boundary, so its second token
    // comes a step after that, with A's.
    assert_eq!(b[0].0, prefill + prefill);
    assert!(a[2].0 < b[0].0 && b[0].0 < a[3].0);
    assert_eq!(b[1], (a[4].0, Emit::Tokens { upto: 2 }));
    for (at, _) in &b[1..] {
        assert!(
            a.iter().any(|(t, _)| t == at),
            "{at:?} is not one of A's steps"
        );
    }
    // Alone, A's steps are shorter.
    let alone = real(time_model::decode_step_ms(&FleetSpec::default(), 1));
    let n = a.len();
    assert_eq!(a[n - 2].0 - a[n - 3].0, alone);
}

/// A mixed run: shared prefixes, a salt, one-token outputs, queueing, an abort.
fn mixed_run() -> Vec<Happened> {
    let mut core = core_with(|s| {
        s.max_num_seqs = 3;
        s.kv_capacity_tokens = 1024;
    });
    let mut out = Vec::new();
    for i in 0..12u64 {
        let mut prompt: Vec<u32> = (0..100).collect();
        prompt.extend(std::iter::repeat_n(i as u32, 20 + i as usize * 7));
        let salt = (i % 5 == 4).then(|| "s".to_string());
        let output = vec![3; 1 + (i as usize * 5) % 9];
        let at = ms(i * 37);
        core.advance(at, &mut out);
        core.submit(at, i, prompt, salt, output).unwrap();
        if i == 7 {
            core.abort(at + ms(5), 6);
        }
    }
    out.extend(drain(&mut core));
    out
}

#[test]
fn the_same_inputs_give_the_same_happenings_in_per_request_order() {
    let run = mixed_run();
    assert_eq!(run, mixed_run());
    assert!(run.windows(2).all(|w| w[0].at <= w[1].at));
    for id in (0..12).filter(|id| *id != 6) {
        let whats: Vec<Emit> = of(&run, id).into_iter().map(|(_, w)| w).collect();
        let n = 1 + (id as usize * 5) % 9;
        let cached_tokens = match whats[0] {
            Emit::First { cached_tokens } => cached_tokens,
            other => panic!("{id} began with {other:?}"),
        };
        let mut expected = vec![Emit::First { cached_tokens }];
        expected.extend((2..=n).map(|upto| Emit::Tokens { upto }));
        expected.push(Emit::Done { cached_tokens });
        assert_eq!(whats, expected, "request {id}");
    }
    // Later requests find the shared 96-token prefix cached (unless salted).
    assert_eq!(of(&run, 5)[0].1, Emit::First { cached_tokens: 96 });
    assert_eq!(of(&run, 4)[0].1, Emit::First { cached_tokens: 0 });
}

#[test]
fn kv_events_are_published_and_dropped_while_the_knob_counts_down() {
    let mut core = core_with(|_| {});
    core.set_faults(Faults {
        drop_kv_events: 1,
        ..Faults::default()
    });
    core.submit(ms(0), 0, vec![4; 40], None, vec![1; 30])
        .unwrap();
    drain(&mut core);
    let published = core.take_published();
    assert!(published.len() >= 2);
    assert!(published[0].dropped);
    assert!(published[1..].iter().all(|p| !p.dropped));
    assert!(core.take_published().is_empty());
    core.reset_prefix_cache();
    assert_eq!(core.take_published().len(), 1);
}

#[test]
fn ties_run_prefill_ends_then_the_step_end_then_admissions_then_the_next_step() {
    // Whole milliseconds: prefill 20 + 1 per token, decode steps of 10.
    let mut core = core_with(|s| {
        s.max_num_seqs = 2;
        s.prefill_base_ms = 20.0;
        s.prefill_ms_per_token = 1.0;
        s.decode_ms_per_token = 10.0;
        s.decode_batch_slope = 0.0;
    });
    core.submit(ms(0), 0, vec![1; 10], None, vec![1; 4])
        .unwrap();
    core.submit(ms(0), 1, vec![2; 10], None, vec![1; 2])
        .unwrap();
    core.submit(ms(0), 2, vec![3; 10], None, vec![1]).unwrap();
    let first = Emit::First { cached_tokens: 0 };
    let done = Emit::Done { cached_tokens: 0 };
    let tokens = |upto| Emit::Tokens { upto };
    let expected = [
        (30, 0, first),
        (40, 0, tokens(2)),
        (50, 0, tokens(3)),
        // At 60: 1's prefill ends, then 0's last step; 0's slot goes to 2, whose prefill
        // starts at 60; then 1 decodes in the step beginning at 60.
        (60, 1, first),
        (60, 0, tokens(4)),
        (60, 0, done),
        (70, 1, tokens(2)),
        (70, 1, done),
        (90, 2, first),
        (90, 2, done),
    ];
    let expected: Vec<Happened> = expected
        .into_iter()
        .map(|(at, id, what)| Happened {
            at: ms(at),
            id,
            what,
        })
        .collect();
    assert_eq!(drain(&mut core), expected);
}

#[test]
fn the_backlog_counts_queued_prompts_less_their_cached_prefix_and_the_prefills_left() {
    let mut core = core_with(|s| s.max_num_seqs = 1);
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..1000).collect(), (5000..6000).collect());
    core.submit(ms(0), 0, a.clone(), None, vec![1]).unwrap();
    core.submit(ms(0), 1, b, None, vec![1]).unwrap();
    // a's blocks are cached once it is admitted: its second copy waits for 8 tokens only
    // (the last, partial block of 1000 = 62 x 16 + 8).
    core.submit(ms(0), 2, a, None, vec![1]).unwrap();
    let before = core.backlog();
    assert_eq!(before.queued_prompt_tokens, 2000);
    assert_eq!(before.uncached_tokens, 1000 + 1000 + 8);
    // Halfway through a's prefill (50 + 1000 x 0.7 ms), half of its work is left.
    let mut out = Vec::new();
    core.advance(real(375.0), &mut out);
    assert_eq!(core.backlog().uncached_tokens, 500 + 1008);
    drain(&mut core);
    assert_eq!(core.backlog(), Backlog::default());
}

#[test]
fn an_sglang_replica_keeps_sglangs_ttft_buckets() {
    let core = core_with(|s| s.engine_kind = crate::spec::EngineKinds::All(EngineKind::Sglang));
    let mut page = String::new();
    core.snapshot()
        .ttft_seconds
        .render(&mut page, "t", "a=\"b\"");
    assert!(page.contains("le=\"400.0\""), "{page}");
    assert!(!page.contains("le=\"0.001\""), "{page}");
}
