//! Baseline: sticky sessions, by rendezvous hashing of the session header's value.

use super::load::rendezvous_order;
use super::{Candidate, Decision, Input, Pick};

pub fn pick(candidates: &[Candidate], input: &Input) -> Option<Pick> {
    let session = input.session?;
    let index = *rendezvous_order(candidates, session).first()?;
    Some(Pick {
        index,
        decision: Decision::Session,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input};
    use crate::prefix::PrefixKeys;

    #[test]
    fn a_session_always_lands_on_the_same_endpoint_whatever_the_load() {
        let keys = PrefixKeys::new("m", "x", 8, 8);
        let first = pick(
            &candidates(&[0, 0, 0]),
            &Input {
                session: Some(7),
                ..input(&keys, None)
            },
        );
        let later = pick(
            &candidates(&[0, 90, 90]),
            &Input {
                session: Some(7),
                ..input(&keys, None)
            },
        );
        assert_eq!(first.map(|p| p.index), later.map(|p| p.index));
        assert!(pick(&candidates(&[0]), &input(&keys, None)).is_none());
    }
}
