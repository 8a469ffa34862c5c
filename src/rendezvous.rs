//! Rendezvous (highest-random-weight) hashing: every party that knows the same endpoints ranks them
//! the same way for a key, with no shared state, and removing one endpoint moves only its keys.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Stable identity of an endpoint address, the same in every Envoy and on every platform.
pub fn endpoint_id(addr: &str) -> u32 {
    xxhash_rust::xxh3::xxh3_64(addr.as_bytes()) as u32
}

/// The weight of endpoint `id` for `key`: higher ranks first.
pub fn weight(key: u64, id: u32) -> u64 {
    xxh3_64_with_seed(&id.to_le_bytes(), key)
}

/// Indices of `ids` ordered by descending weight for `key`.
pub fn order(key: u64, ids: &[u32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..ids.len()).collect();
    idx.sort_by_key(|&i| std::cmp::Reverse((weight(key, ids[i]), ids[i])));
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_independent_of_the_listing_order() {
        let ids = [endpoint_id("a:1"), endpoint_id("b:1"), endpoint_id("c:1")];
        let reversed = [ids[2], ids[1], ids[0]];
        for key in 0..50u64 {
            let a: Vec<u32> = order(key, &ids).into_iter().map(|i| ids[i]).collect();
            let b: Vec<u32> = order(key, &reversed)
                .into_iter()
                .map(|i| reversed[i])
                .collect();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn removing_an_endpoint_moves_only_its_keys() {
        let all: Vec<u32> = (0..5)
            .map(|i| endpoint_id(&format!("10.0.0.{i}:80")))
            .collect();
        let fewer = &all[..4];
        for key in 0..500u64 {
            let before = all[order(key, &all)[0]];
            let after = fewer[order(key, fewer)[0]];
            if before != all[4] {
                assert_eq!(before, after);
            }
        }
    }

    #[test]
    fn keys_spread_over_endpoints() {
        let ids: Vec<u32> = (0..4)
            .map(|i| endpoint_id(&format!("127.0.0.1:{}", 8000 + i)))
            .collect();
        let mut counts = [0; 4];
        for key in 0..4000u64 {
            counts[order(key.wrapping_mul(0x9e37_79b9_7f4a_7c15), &ids)[0]] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
