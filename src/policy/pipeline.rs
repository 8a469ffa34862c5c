//! A policy as stages, in the shape of the endpoint pickers: filters drop candidates, scorers give
//! each kept candidate a score in [0, 1], and the picker takes the highest weighted sum, ties
//! going to the earliest in the request's order. The decision is named by the scorer whose
//! weighted score counted most for the pick; when the filters keep no candidate, the policy's
//! fallback decides. Revisers come last: each may send the request elsewhere, weighing its signal
//! against the pick itself rather than scoring candidates alone.

use super::{Candidate, Decision, Input};
use crate::holders::Held;

/// What the stages see of one request.
pub struct Scoring<'a> {
    pub candidates: &'a [Candidate<'a>],
    pub input: &'a Input<'a>,
    /// Candidate indices in the order ties break in (the request's group order, its home first).
    pub order: &'a [usize],
    /// The longest prefix of the request some endpoint holds, from the policy's prefix index.
    pub matched: Option<&'a Held>,
    /// Who the engines report holding the request's longest prefix (precise mode).
    pub engine: Option<&'a Held>,
    /// The candidates' mean load.
    pub mean_load: f64,
}

/// Drops candidates the request must not go to.
pub trait Filter {
    /// Whether candidate `i` stays.
    fn keeps(&self, s: &Scoring, i: usize) -> bool;
}

/// Scores candidates for one signal.
pub trait Scorer {
    /// The weight of this scorer's scores in the sum.
    fn weight(&self) -> f64;
    /// Candidate `i`'s score, in [0, 1].
    fn score(&self, s: &Scoring, i: usize) -> f64;
    /// The decision to count when this scorer's weighted score counted most for picking `i`.
    fn decision(&self, s: &Scoring, i: usize) -> Decision;
}

/// Weighs a signal against the pick the scorers (or the fallback) made.
pub trait Reviser {
    /// Where the request goes instead of `picked`, and why; `None` keeps the pick.
    fn revise(&self, s: &Scoring, picked: usize) -> Option<(usize, Decision)>;
}

/// The pick after each reviser in turn had its say.
pub fn revise(
    s: &Scoring,
    picked: (usize, Decision),
    revisers: &[Box<dyn Reviser>],
) -> (usize, Decision) {
    revisers
        .iter()
        .fold(picked, |pick, r| r.revise(s, pick.0).unwrap_or(pick))
}

/// The candidate the stages pick and why; `None` when the filters keep none.
pub fn pick(
    s: &Scoring,
    filters: &[Box<dyn Filter>],
    scorers: &[Box<dyn Scorer>],
) -> Option<(usize, Decision)> {
    let weighted = |i: usize| scorers.iter().map(move |sc| sc.weight() * sc.score(s, i));
    let mut best: Option<(usize, f64)> = None;
    for &i in s.order {
        if !filters.iter().all(|f| f.keeps(s, i)) {
            continue;
        }
        let total: f64 = weighted(i).sum();
        if best.is_none_or(|(_, top)| total > top) {
            best = Some((i, total));
        }
    }
    let (i, _) = best?;
    let mut decider: Option<(&dyn Scorer, f64)> = None;
    for (sc, part) in scorers.iter().zip(weighted(i)) {
        if decider.is_none_or(|(_, top)| part > top) {
            decider = Some((sc.as_ref(), part));
        }
    }
    Some((
        i,
        decider.map_or(Decision::Balance, |(sc, _)| sc.decision(s, i)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input, keys};
    use crate::store::MemoryStore;

    /// Scores the candidates its table lists, naming `decision`.
    struct Table(Vec<f64>, f64, Decision);

    impl Scorer for Table {
        fn weight(&self) -> f64 {
            self.1
        }
        fn score(&self, _s: &Scoring, i: usize) -> f64 {
            self.0[i]
        }
        fn decision(&self, _s: &Scoring, _i: usize) -> Decision {
            self.2
        }
    }

    struct Not(usize);

    impl Filter for Not {
        fn keeps(&self, _s: &Scoring, i: usize) -> bool {
            i != self.0
        }
    }

    #[test]
    fn the_highest_weighted_sum_of_a_kept_candidate_wins_and_its_main_scorer_names_it() {
        let (c, k, store) = (candidates(&[0, 0, 0]), keys("x"), MemoryStore::new());
        let input = input(&k, &store);
        let s = Scoring {
            candidates: &c,
            input: &input,
            order: &[2, 0, 1],
            matched: None,
            engine: None,
            mean_load: 0.0,
        };
        let a: Box<dyn Scorer> = Box::new(Table(vec![0.0, 1.0, 0.0], 2.0, Decision::Affinity));
        let b: Box<dyn Scorer> = Box::new(Table(vec![0.5, 0.5, 1.0], 1.0, Decision::Home));
        let scorers = [a, b];
        assert_eq!(pick(&s, &[], &scorers), Some((1, Decision::Affinity)));
        let without_1: Vec<Box<dyn Filter>> = vec![Box::new(Not(1))];
        assert_eq!(pick(&s, &without_1, &scorers), Some((2, Decision::Home)));
        // Ties go to the earliest in the order.
        let even: Box<dyn Scorer> = Box::new(Table(vec![1.0; 3], 1.0, Decision::Home));
        assert_eq!(pick(&s, &[], &[even]), Some((2, Decision::Home)));
        let none: Vec<Box<dyn Filter>> = vec![Box::new(Not(0)), Box::new(Not(1)), Box::new(Not(2))];
        assert_eq!(pick(&s, &none, &scorers), None);
    }
}
