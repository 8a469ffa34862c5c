//! Baseline: the endpoint with the fewest requests in flight, ties broken per request.

use super::load::least_loaded;
use super::{Candidate, Decision, Input, Needs, Pick, Policy};

pub struct LeastRequest;

impl Policy for LeastRequest {
    fn needs(&self) -> Needs {
        Needs {
            request_id: true,
            ..Needs::default()
        }
    }

    fn pick(&mut self, candidates: &[Candidate], input: &Input) -> Option<Pick> {
        let index = least_loaded(candidates, input.nonce);
        Some(Pick::new(index, Decision::LeastRequest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input, keys};
    use crate::store::MemoryStore;

    #[test]
    fn the_least_loaded_endpoint_wins() {
        let (k, store) = (keys("x"), MemoryStore::new());
        let pick = LeastRequest.pick(&candidates(&[4, 1, 7]), &input(&k, &store));
        assert_eq!(pick.map(|p| p.index), Some(1));
    }
}
