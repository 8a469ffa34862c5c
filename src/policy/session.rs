//! Baseline: sticky sessions, by rendezvous hashing of the session header's value.

use super::load::rendezvous_order;
use super::{Candidate, Decision, Input, Needs, Pick, Policy};

pub struct Session;

impl Policy for Session {
    fn needs(&self) -> Needs {
        Needs {
            session: true,
            ..Needs::default()
        }
    }

    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick> {
        let index = *rendezvous_order(candidates, input.session?).first()?;
        Some(Pick::new(index, Decision::Session))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input, keys};
    use crate::store::MemoryStore;

    #[test]
    fn a_session_always_lands_on_the_same_endpoint_whatever_the_load() {
        let (k, store) = (keys("x"), MemoryStore::new());
        let with_session = Input {
            session: Some(7),
            ..input(&k, &store)
        };
        let first = Session.pick(&candidates(&[0, 0, 0]), &with_session);
        let later = Session.pick(&candidates(&[0, 90, 90]), &with_session);
        assert_eq!(first.map(|p| p.index), later.map(|p| p.index));
        assert!(Session
            .pick(&candidates(&[0]), &input(&k, &store))
            .is_none());
    }
}
