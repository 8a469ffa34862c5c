//! Baseline: the endpoint with the fewest requests in flight, ties broken per request.

use super::load::least_loaded;
use super::{Candidate, Decision, Input, Pick};

pub fn pick(candidates: &[Candidate], input: &Input) -> Pick {
    Pick {
        index: least_loaded(candidates, input.ticket),
        decision: Decision::LeastRequest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{candidates, input};
    use crate::prefix::PrefixKeys;

    #[test]
    fn the_least_loaded_endpoint_wins() {
        let c = candidates(&[4, 1, 7]);
        let keys = PrefixKeys::new("m", "x", 8, 8);
        assert_eq!(pick(&c, &input(&keys, None)).index, 1);
    }
}
