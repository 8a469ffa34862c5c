//! Telling SGLang's old content hashes apart: up to 0.5.5 SGLang named a page by CPython's
//! `hash(tuple(page_token_ids))`, which depends on the page's tokens alone, not on what comes
//! before them.
//!
//! CPython (3.8 and later, 64-bit) hashes a tuple with an xxHash-style mix of its items'
//! hashes, and a non-negative integer below 2^61 - 1 hashes to itself, so a token tuple's hash
//! is computed here exactly. A position-aware hash (vLLM's, SGLang's since 0.5.6: the first 8
//! bytes of a SHA-256 chain) equals it only by a 2^-64 chance.

const PRIME_1: u64 = 11_400_714_785_074_694_791;
const PRIME_2: u64 = 14_029_467_366_897_019_727;
const PRIME_5: u64 = 2_870_177_450_012_600_261;
/// CPython's `_PyHASH_MODULUS`: integers hash modulo this Mersenne prime.
const MODULUS: u64 = (1 << 61) - 1;

/// CPython's `hash(tuple(ids))`, as the unsigned 64 bits of its signed result.
pub fn python_tuple_hash(ids: &[u32]) -> u64 {
    let mut acc = PRIME_5;
    for &id in ids {
        let lane = u64::from(id) % MODULUS;
        acc = acc.wrapping_add(lane.wrapping_mul(PRIME_2));
        acc = acc.rotate_left(31);
        acc = acc.wrapping_mul(PRIME_1);
    }
    acc = acc.wrapping_add(ids.len() as u64 ^ (PRIME_5 ^ 3_527_539));
    // -1 is CPython's error value; a hash that would be -1 is this constant instead.
    if acc == u64::MAX {
        1_546_275_796
    } else {
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_python_hashes() {
        // `hash(())`, `hash((1,))`, `hash((1, 2, 3))`, `hash((100000, 7, 151643))` in CPython 3.11.
        assert_eq!(python_tuple_hash(&[]) as i64, 5_740_354_900_026_072_187);
        assert_eq!(python_tuple_hash(&[1]) as i64, -6_644_214_454_873_602_895);
        assert_eq!(
            python_tuple_hash(&[1, 2, 3]) as i64,
            529_344_067_295_497_451
        );
        assert_eq!(
            python_tuple_hash(&[100_000, 7, 151_643]) as i64,
            -7_438_486_395_601_510_201
        );
    }
}
