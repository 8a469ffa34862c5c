//! The cascade's decisions, pinned: the picks the stages make for given inputs.

use super::*;
use crate::eviction;
use crate::holders::affinity::AffinityMap;
use crate::placement::leader;
use crate::policy::testing::{candidates, input, keys, overload};
use crate::policy::{Candidate, Decision, Input, Pick, Policy};
use crate::prefix::PrefixKeys;
use crate::store::MemoryStore;

fn policy() -> CacheAware {
    CacheAware::new(1024, 0.3, overload(), 1000, 0)
}

/// What the pick's lookup found in the affinity map.
fn matched(pick: &Pick) -> Option<&Held> {
    pick.ticket.0.as_ref()?.found.matched.as_ref()
}

/// Picks for `keys` and records the pick, as the router does.
fn route(p: &mut CacheAware, c: &[Candidate], keys: &PrefixKeys, store: &MemoryStore) -> Pick {
    let input = input(keys, store);
    let pick = p.pick(c, &input).unwrap();
    p.routed(c, &input, &pick);
    pick
}

/// Sends one request of each group in `groups` (asking `question`) through `p` at `now`, as
/// the router does: the endpoints picked.
fn send_each(
    p: &mut CacheAware,
    c: &[Candidate],
    store: &MemoryStore,
    groups: &[String],
    question: &str,
    now: u64,
) -> Vec<usize> {
    groups
        .iter()
        .map(|g| {
            let keys = ask(g, question);
            let input = Input {
                now_ms: now,
                ..input(&keys, store)
            };
            let pick = p.pick(c, &input).unwrap();
            p.routed(c, &input, &pick);
            pick.index
        })
        .collect()
}

fn eight_groups() -> Vec<String> {
    (0..8).map(|g| format!("group {g}")).collect()
}

/// Two workers of one gateway (one store) on 4 endpoints, past the warm-up with
/// [`eight_groups`] seen twice each: the first has ticked since, so it leads.
fn two_workers() -> (MemoryStore, Vec<Candidate<'static>>, CacheAware, CacheAware) {
    let (store, c) = (MemoryStore::new(), candidates(&[0, 0, 0, 0]));
    let (mut first, mut second) = (policy(), policy());
    first.tick(&store, 0, &[]);
    second.tick(&store, 0, &[]);
    for now in [10, 20] {
        send_each(&mut first, &c, &store, &eight_groups(), "the question", now);
    }
    first.tick(&store, 2000, &[]);
    (store, c, first, second)
}

fn order(c: &[Candidate], keys: &PrefixKeys) -> Vec<usize> {
    rendezvous_order(c, keys.group)
}

/// A first-turn request of a group: the group's system prompt, then a question.
fn ask(group: &str, question: &str) -> PrefixKeys {
    turn(group, question, false)
}

/// A later turn: the group's system prompt, then earlier turns and a new question.
fn follow_up(group: &str, turns: &str) -> PrefixKeys {
    turn(group, turns, true)
}

fn turn(group: &str, after_head: &str, history: bool) -> PrefixKeys {
    behind(&format!("{group} ").repeat(40), after_head, history)
}

/// A turn behind the head `system`, in chunks of 10 bytes.
fn behind(system: &str, after_head: &str, history: bool) -> PrefixKeys {
    let shape = crate::prefix::Shape {
        chunk_size: 10,
        max_chunks: 64,
        group_bytes: 40,
    };
    PrefixKeys::new(
        "m",
        &format!("{system}{after_head}"),
        system.len(),
        history,
        shape,
    )
}

#[test]
fn a_group_goes_home_whatever_this_gateway_remembers() {
    let c = candidates(&[0, 0, 0, 0]);
    let home = order(&c, &ask("g", ""))[0];
    let (fresh, used) = (MemoryStore::new(), MemoryStore::new());
    for q in 0..3 {
        route(
            &mut policy(),
            &c,
            &ask("g", &format!("question {q}")),
            &used,
        );
    }
    let restarted = route(&mut policy(), &c, &ask("g", "question 9"), &fresh);
    assert_eq!(
        (restarted.index, restarted.decision),
        (home, Decision::Home)
    );
    let remembered = route(&mut policy(), &c, &ask("g", "question 9"), &used);
    assert_eq!(
        (remembered.index, remembered.decision),
        (home, Decision::Home)
    );
    assert!(
        matched(&remembered).is_none(),
        "a first turn looks nothing up: its place is its group's"
    );
}

#[test]
fn once_warm_a_gateway_gives_the_groups_it_has_seen_balanced_homes() {
    let (mut p, store, c) = (policy(), MemoryStore::new(), candidates(&[0, 0, 0, 0]));
    p.tick(&store, 0, &[]);
    let groups = eight_groups();
    let home = |p: &mut CacheAware, now| {
        send_each(p, &c, &store, &groups, &format!("question at {now}"), now)
    };
    home(&mut p, 10);
    home(&mut p, 20); // each group seen twice
    p.tick(&store, 2000, &[]); // counts written, past the warm-up
    assert_eq!(
        p.tick(&store, 2001, &[]),
        8,
        "all 8 groups placed by balance"
    );
    let homes = home(&mut p, 2002);
    for e in 0..4 {
        let n = homes.iter().filter(|&&h| h == e).count();
        assert_eq!(n, 2, "endpoint {e} has {n} of 8 groups: {homes:?}");
    }
    assert_eq!(home(&mut p, 2003), homes, "stable");
}

#[test]
fn a_gateways_workers_give_every_group_the_same_home() {
    let (store, c, mut first, mut second) = two_workers();
    let groups = eight_groups();
    // The question is the same at every call: a split group's home depends on it.
    let homes =
        |p: &mut CacheAware, now: u64| send_each(p, &c, &store, &groups, "the question", now);
    // The second worker alone then sees group 0 turn hot: its own weights would differ.
    for n in 0..40 {
        send_each(
            &mut second,
            &c,
            &store,
            &groups[..1],
            "the question",
            2100 + n,
        );
    }
    second.tick(&store, 2500, &[]);
    assert_eq!(homes(&mut second, 2600), homes(&mut first, 2600));
    first.tick(&store, 3000, &[]); // the leader weighs the hot group too
    second.tick(&store, 3100, &[]);
    let by_first = homes(&mut first, 3200);
    assert_eq!(homes(&mut second, 3200), by_first);
    // A worker that starts now (a reloaded VM) needs no warm-up of its own.
    let mut late = policy();
    assert_eq!(
        late.tick(&store, 3200, &[]),
        8,
        "places by the assignment at once"
    );
    assert_eq!(homes(&mut late, 3201), by_first);
}

#[test]
fn a_worker_that_routes_nothing_while_homes_move_holds_them_where_the_leader_does() {
    // Homes hold a second before they move. The first worker leads and routes everything;
    // the second only ticks, until the end.
    let (store, c) = (MemoryStore::new(), candidates(&[0, 0, 0, 0]));
    let holding = || CacheAware::new(1024, 0.3, overload(), 1000, 1000);
    let (mut first, mut second) = (holding(), holding());
    let groups = eight_groups();
    let homes =
        |p: &mut CacheAware, now: u64| send_each(p, &c, &store, &groups, "the question", now);
    let hot = |p: &mut CacheAware, group: usize, now: u64| {
        for n in 0..40 {
            send_each(
                p,
                &c,
                &store,
                &groups[group..=group],
                "the question",
                now + n,
            );
        }
    };
    first.tick(&store, 0, &[]);
    second.tick(&store, 0, &[]);
    homes(&mut first, 10);
    homes(&mut first, 20);
    first.tick(&store, 2000, &[]);
    second.tick(&store, 2100, &[]);
    let before = homes(&mut second, 2200);
    assert_eq!(homes(&mut first, 2200), before);
    // Group 0 turns hot: the next assignment moves groups, which hold from 3000 on.
    hot(&mut first, 0, 2300);
    first.tick(&store, 3000, &[]);
    second.tick(&store, 3100, &[]);
    let moved = homes(&mut first, 4500);
    assert_ne!(
        moved, before,
        "the hot group moved others once their homes held"
    );
    // Group 1 turns hot too; the second worker's next request comes after that assignment.
    hot(&mut first, 1, 4600);
    first.tick(&store, 5000, &[]);
    second.tick(&store, 5100, &[]);
    assert_eq!(
        homes(&mut second, 5200),
        homes(&mut first, 5200),
        "the homes that held by 4000 moved at the second worker too, though none of their \
         requests came by it"
    );
}

#[test]
fn when_the_leading_worker_is_gone_another_takes_over_and_nobody_moves() {
    let (store, c, mut first, mut second) = two_workers();
    let groups = eight_groups();
    let homes =
        |p: &mut CacheAware, now: u64| send_each(p, &c, &store, &groups, "the question", now);
    second.tick(&store, 2100, &[]);
    let before = homes(&mut second, 2200);
    assert_eq!(homes(&mut first, 2200), before);
    let author = |store: &MemoryStore| leader::read(store).0.map(|p| p.author);
    let led_by_first = author(&store);
    // The first stops ticking (its VM is gone): until the lease runs out the second follows.
    second.tick(&store, 2000 + leader::LEAD_TTL_MS - 1, &[]);
    assert_eq!(author(&store), led_by_first);
    second.tick(&store, 2000 + leader::LEAD_TTL_MS, &[]);
    assert_ne!(author(&store), led_by_first, "the second took over");
    assert_eq!(homes(&mut second, 2000 + leader::LEAD_TTL_MS + 1), before);
}

#[test]
fn once_warm_a_lone_groups_conversations_spread_and_each_keeps_its_home() {
    let (mut p, store, c) = (policy(), MemoryStore::new(), candidates(&[0, 0, 0, 0]));
    p.tick(&store, 0, &[]);
    let pick = |p: &mut CacheAware, conversation: usize, now| {
        let opener = format!("conversation {conversation}");
        let keys = ask("app", &format!("{opener} at {now}")).opened_by(&opener);
        let input = Input {
            now_ms: now,
            ..input(&keys, &store)
        };
        let pick = p.pick(&c, &input).unwrap();
        p.routed(&c, &input, &pick);
        (pick.index, pick.decision)
    };
    pick(&mut p, 0, 10);
    pick(&mut p, 1, 20);
    p.tick(&store, 2000, &[]);
    assert_eq!(p.tick(&store, 2001, &[]), 1);
    let homes: Vec<usize> = (0..40).map(|n| pick(&mut p, n, 2002).0).collect();
    let used: std::collections::HashSet<_> = homes.iter().collect();
    assert_eq!(
        used.len(),
        4,
        "one group, all the traffic, every endpoint: {homes:?}"
    );
    for (n, &home) in homes.iter().enumerate() {
        assert_eq!(
            pick(&mut p, n, 2003),
            (home, Decision::Home),
            "conversation {n}"
        );
    }
}

#[test]
fn groups_spread_over_endpoints_by_their_key() {
    let c = candidates(&[0, 0, 0, 0]);
    let store = MemoryStore::new();
    let homes: std::collections::HashSet<usize> = (0..40)
        .map(|g| route(&mut policy(), &c, &keys(&format!("group {g} ")), &store).index)
        .collect();
    assert_eq!(homes.len(), 4);
}

#[test]
fn an_overloaded_home_spills_to_the_next_in_order_and_the_group_comes_back() {
    let o = order(&candidates(&[0, 0, 0, 0]), &ask("hot", ""));
    let store = MemoryStore::new();
    let mut loads = [1u64; 4];
    loads[o[0]] = 20;
    let hot = candidates(&loads);
    for q in 0..3 {
        let spilled = route(&mut policy(), &hot, &ask("hot", &format!("q{q}")), &store);
        assert_eq!((spilled.index, spilled.decision), (o[1], Decision::Spread));
    }
    loads[o[1]] = 20;
    let hotter = route(&mut policy(), &candidates(&loads), &ask("hot", "q"), &store);
    assert_eq!((hotter.index, hotter.decision), (o[2], Decision::Spread));
    // Drained: home again, although this gateway saw only the spill replicas serve it.
    let calm = route(
        &mut policy(),
        &candidates(&[1, 1, 1, 1]),
        &ask("hot", "q9"),
        &store,
    );
    assert_eq!((calm.index, calm.decision), (o[0], Decision::Home));
}

#[test]
fn a_queueing_engine_takes_no_group_even_at_low_load() {
    let k = ask("g", "q");
    let mut c = candidates(&[0, 0, 0, 0]);
    let home = order(&c, &k)[0];
    c[home].queueing = true;
    let p = route(&mut policy(), &c, &k, &MemoryStore::new());
    assert_ne!(p.index, home);
    assert_eq!(p.decision, Decision::Spread);
}

#[test]
fn a_conversation_follows_its_history_to_where_it_was_served() {
    let store = MemoryStore::new();
    let history = "first question, first answer. ".repeat(4);
    let turn1 = ask("g", &history);
    let o = order(&candidates(&[0, 0, 0, 0]), &turn1);
    let mut loads = [0u64; 4];
    loads[o[0]] = 30; // home overloaded when turn 1 came
    let first = route(&mut policy(), &candidates(&loads), &turn1, &store);
    assert_eq!(first.index, o[1]);
    let turn2 = follow_up("g", &format!("{history}next question"));
    assert_eq!(turn2.group, turn1.group);
    let second = route(&mut policy(), &candidates(&[0, 0, 0, 0]), &turn2, &store);
    assert_eq!((second.index, second.decision), (o[1], Decision::Affinity));
}

#[test]
fn a_first_turn_shorter_than_a_chunk_is_found_from_the_chunk_that_crosses_the_head() {
    // A head of 85 bytes in chunks of 10: chunk 8 holds its last 5 bytes and the first
    // message's first 5; a first message of 12 bytes fills no chunk after that one.
    let system = "s".repeat(85);
    let turn = |after: &str, history| behind(&system, after, history);
    let store = MemoryStore::new();
    let turn1 = turn("question one", false);
    let o = order(&candidates(&[0, 0, 0, 0]), &turn1);
    let mut loads = [0u64; 4];
    loads[o[0]] = 30; // home overloaded when turn 1 came
    let first = route(&mut policy(), &candidates(&loads), &turn1, &store);
    assert_eq!(first.index, o[1]);
    let turn2 = turn("question one, its answer. next", true);
    let second = route(&mut policy(), &candidates(&[0, 0, 0, 0]), &turn2, &store);
    assert_eq!((second.index, second.decision), (o[1], Decision::Affinity));
}

/// Routes `turn1` through `p` while its group's home is overloaded, so it goes to the next in
/// the group's order: that order.
fn spilled(p: &mut CacheAware, turn1: &PrefixKeys, store: &MemoryStore) -> Vec<usize> {
    let o = order(&candidates(&[0, 0, 0, 0]), turn1);
    let mut loads = [0u64; 4];
    loads[o[0]] = 30; // home overloaded when turn 1 came
    assert_eq!(route(p, &candidates(&loads), turn1, store).index, o[1]);
    o
}

#[test]
fn a_history_its_engine_evicted_no_longer_draws_the_conversation() {
    let (mut p, store) = (policy(), MemoryStore::new());
    let history = "first question, first answer. ".repeat(4);
    let o = spilled(&mut p, &ask("g", &history), &store);
    let c = candidates(&[0, 0, 0, 0]);
    // Its engine reported an eviction of what it last used at the record's stamp.
    eviction::raise(&store, c[o[1]].id, 1);
    let turn2 = follow_up("g", &format!("{history}next question"));
    let second = route(&mut p, &c, &turn2, &store);
    assert_eq!((second.index, second.decision), (o[0], Decision::Home));
    // The rewritten record names where it was served now, not the holder that lost it.
    let depth = matched(&second).map(|m| m.depth).unwrap();
    let record = AffinityMap::new(&store, 1024).get(turn2.keys[depth - 1]);
    assert_eq!(record.map(|r| r.holders), Some(vec![c[o[0]].id]));
    let turn3 = follow_up("g", &format!("{history}next question, its answer. third"));
    let third = route(&mut p, &c, &turn3, &store);
    assert_eq!((third.index, third.decision), (o[0], Decision::Affinity));
}

#[test]
fn a_history_older_than_its_engine_keeps_what_nobody_uses_goes_home() {
    let (mut p, store) = (policy(), MemoryStore::new());
    let history = "first question, first answer. ".repeat(4);
    let o = spilled(&mut p, &ask("g", &history), &store);
    // Each engine writes its free cache over in 2 s (its metrics say so).
    let mut churned = candidates(&[0, 0, 0, 0]);
    for c in churned.iter_mut() {
        c.retention_ms = Some(2000);
    }
    let turn2 = follow_up("g", &format!("{history}next question"));
    let soon = Input {
        now_ms: 1500,
        ..input(&turn2, &store)
    };
    let pick = p.pick(&churned, &soon).unwrap();
    assert_eq!((pick.index, pick.decision), (o[1], Decision::Affinity));
    let late = Input {
        now_ms: 3001,
        ..input(&turn2, &store)
    };
    let pick = p.pick(&churned, &late).unwrap();
    assert_eq!((pick.index, pick.decision), (o[0], Decision::Home));
}

#[test]
fn a_match_covering_too_little_of_the_request_does_not_count_as_affinity() {
    let store = MemoryStore::new();
    let c = candidates(&[0, 0, 0, 0]);
    // 6 of 26 chunks in common, past the 4-chunk head: under the 0.3 threshold.
    let shared = "x".repeat(60);
    route(
        &mut policy(),
        &c,
        &keys(&format!("{shared}{}", "a".repeat(200))),
        &store,
    );
    let other = keys(&format!("{shared}{}", "b".repeat(200)));
    let p = route(&mut policy(), &c, &other, &store);
    assert_eq!(matched(&p).map(|m| m.depth), Some(6));
    assert_eq!(p.decision, Decision::Home);
}

#[test]
fn everything_overloaded_balances() {
    let mut c = candidates(&[5, 3, 9, 4]);
    c.iter_mut().for_each(|c| c.queueing = true);
    let p = route(&mut policy(), &c, &keys("q"), &MemoryStore::new());
    assert_eq!((p.index, p.decision), (1, Decision::Balance));
}

/// Four idle candidates, the home of `keys`'s group and the candidate after it.
fn home_and_next(keys: &PrefixKeys) -> (Vec<Candidate<'static>>, usize, usize) {
    let c = candidates(&[0, 0, 0, 0]);
    let home = order(&c, keys)[0];
    let next = (home + 1) % c.len();
    (c, home, next)
}

/// A policy reading an engine index, and an index where `holder` (a candidate's address) holds
/// the first `depth` keys of `keys`, as the indexer answered at `now`.
fn indexed(
    store: &MemoryStore,
    keys: &PrefixKeys,
    holder: &str,
    depth: usize,
    now: u64,
) -> CacheAware {
    let feed = crate::holders::engine::Feed {
        epoch: 1,
        version: 1,
        full: true,
        endpoints: vec![holder.to_string()],
        stale: Vec::new(),
        changes: keys.keys[..depth].iter().map(|&k| (0, 1, k)).collect(),
    };
    crate::holders::engine::EngineIndex::new(store, 64)
        .apply(&feed, now)
        .unwrap();
    policy().with_engine_index(EngineHolders::new(64, 1000, 0.3))
}

#[test]
fn the_endpoint_whose_engine_holds_the_prefix_wins_over_the_home() {
    let keys = follow_up("g", "an earlier turn and a new question");
    let (c, home, other) = home_and_next(&keys);
    let store = MemoryStore::new();
    let mut p = indexed(&store, &keys, c[other].addr, keys.keys.len() - 1, 1);
    let pick = p.pick(&c, &input(&keys, &store)).unwrap();
    assert_eq!((pick.index, pick.decision), (other, Decision::Engine));
    // Overloaded, it is passed over: the request goes home as without the index.
    let mut busy = c.clone();
    busy[other].load = 50;
    let pick = p.pick(&busy, &input(&keys, &store)).unwrap();
    assert_eq!((pick.index, pick.decision), (home, Decision::Home));
}

#[test]
fn a_stale_index_or_a_shallow_match_leaves_the_request_to_its_home() {
    let keys = ask(
        "g",
        "a question long enough to span several chunks of its own",
    );
    let (c, home, other) = home_and_next(&keys);
    let store = MemoryStore::new();
    // A shared preamble: one chunk of many.
    let mut shallow = indexed(&store, &keys, c[other].addr, 1, 1);
    let pick = shallow.pick(&c, &input(&keys, &store)).unwrap();
    assert_eq!((pick.index, pick.decision), (home, Decision::Home));
    let store = MemoryStore::new();
    let mut deep = indexed(&store, &keys, c[other].addr, keys.keys.len(), 1);
    let at = |now_ms| Input {
        now_ms,
        ..input(&keys, &store)
    };
    assert_eq!(deep.pick(&c, &at(1001)).unwrap().decision, Decision::Engine);
    let late = deep.pick(&c, &at(1002)).unwrap();
    assert_eq!((late.index, late.decision), (home, Decision::Home));
}

#[test]
fn a_holder_off_home_wins_only_within_the_homes_load_band() {
    let keys = follow_up("g", "an earlier turn and a new question");
    let (c, home, other) = home_and_next(&keys);
    let store = MemoryStore::new();
    let mut p = indexed(&store, &keys, c[other].addr, keys.keys.len() - 1, 1);
    let mut pick_at = |loads: &[(usize, u64)], queueing: usize| {
        let mut c = c.clone();
        for &(i, load) in loads {
            c[i].load = load;
        }
        if let Some(q) = c.get_mut(queueing) {
            q.queueing = true;
        }
        let pick = p.pick(&c, &input(&keys, &store)).unwrap();
        (pick.index, pick.decision)
    };
    let nobody = c.len();
    // Within 1.5 × the home's load + 2: the holder saves the prefill.
    assert_eq!(pick_at(&[(other, 2)], nobody), (other, Decision::Engine));
    assert_eq!(
        pick_at(&[(home, 3), (other, 5)], nobody),
        (other, Decision::Engine)
    );
    // Beyond, though not overloaded: the group goes home, where placement puts it.
    assert_eq!(pick_at(&[(other, 3)], nobody), (home, Decision::Home));
    // A holder that queues still takes the request within the band: its queue is in its load.
    assert_eq!(pick_at(&[(other, 2)], other), (other, Decision::Engine));
    // A queueing home takes nothing: the band is the endpoint the stages pick instead.
    let (spread, decision) = pick_at(&[(other, 9)], home);
    assert_eq!((spread != home, decision), (true, Decision::Spread));
}

#[test]
fn with_every_endpoint_overloaded_a_holder_near_the_least_load_takes_the_request() {
    let keys = follow_up("g", "an earlier turn and a new question");
    let (c, _, holder) = home_and_next(&keys);
    let store = MemoryStore::new();
    let mut p = indexed(&store, &keys, c[holder].addr, keys.keys.len() - 1, 1);
    let mut pick_at = |holder_load: u64| {
        let mut c = c.clone();
        for (i, e) in c.iter_mut().enumerate() {
            e.queueing = true;
            e.load = if i == holder {
                holder_load
            } else {
                8 + i as u64
            };
        }
        let pick = p.pick(&c, &input(&keys, &store)).unwrap();
        (pick.index, pick.decision)
    };
    // Within 1.5 × 8 + 2 of the least loaded (8): its hit saves the prefill.
    assert_eq!(pick_at(14), (holder, Decision::Engine));
    // Further: the least loaded, as without the index.
    let least = (0..c.len()).find(|&i| i != holder).unwrap();
    assert_eq!(pick_at(15), (least, Decision::Balance));
}

#[test]
fn where_the_home_holds_the_prefix_too_the_home_keeps_it_however_busy_the_others_are_not() {
    let keys = follow_up("g", "an earlier turn and a new question");
    let (mut c, home, other) = home_and_next(&keys);
    let store = MemoryStore::new();
    let held = |e: usize| keys.keys.iter().map(move |&k| (e, 1, k));
    let feed = crate::holders::engine::Feed {
        epoch: 1,
        version: 1,
        full: true,
        endpoints: vec![c[home].addr.to_string(), c[other].addr.to_string()],
        stale: Vec::new(),
        changes: held(0).chain(held(1)).collect(),
    };
    crate::holders::engine::EngineIndex::new(&store, 64)
        .apply(&feed, 1)
        .unwrap();
    let mut p = policy().with_engine_index(EngineHolders::new(64, 1000, 0.3));
    c[home].load = 2;
    let pick = p.pick(&c, &input(&keys, &store)).unwrap();
    assert_eq!((pick.index, pick.decision), (home, Decision::Engine));
}

#[test]
fn a_groups_head_held_off_home_keeps_requests_only_within_abs_of_the_home() {
    let keys = ask("g", "a new question");
    let (c, home, other) = home_and_next(&keys);
    let store = MemoryStore::new();
    let mut p = indexed(&store, &keys, c[other].addr, keys.head_chunks, 1);
    let mut pick_at = |home_load: u64, other_load: u64| {
        let mut c = c.clone();
        c[home].load = home_load;
        c[other].load = other_load;
        let pick = p.pick(&c, &input(&keys, &store)).unwrap();
        (pick.index, pick.decision)
    };
    assert_eq!(pick_at(4, 6), (other, Decision::Engine));
    // 4 + 2 < 7 ≤ 1.5 × 4 + 2: a history's holder would keep it, the head's goes home.
    assert_eq!(pick_at(4, 7), (home, Decision::Home));
}
