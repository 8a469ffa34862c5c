//! What the affinity map and the engine index share: a slot of fixed-size records in one
//! shared-data value, and the search for the deepest key held along a prefix chain.

/// The records of a slot value: a format `version` byte, then at most `ways` records of
/// `record_len` bytes. Anything malformed (another version, a torn value) has none.
pub fn records(value: &[u8], version: u8, record_len: usize, ways: usize) -> &[u8] {
    match value.split_first() {
        Some((&v, body))
            if v == version && body.len() % record_len == 0 && body.len() / record_len <= ways =>
        {
            body
        }
        _ => &[],
    }
}

/// Every record of a slot value (see [`records`]), each decoded by `record`.
pub fn decode<T>(
    value: &[u8],
    version: u8,
    record_len: usize,
    ways: usize,
    record: impl Fn(&[u8]) -> Option<T>,
) -> Vec<T> {
    records(value, version, record_len, ways)
        .chunks_exact(record_len)
        .filter_map(record)
        .collect()
}

/// `count` little-endian u32s of a record, from byte `at`.
pub fn u32s(record: &[u8], at: usize, count: usize) -> Option<Vec<u32>> {
    (0..count)
        .map(|i| {
            let start = at + 4 * i;
            record
                .get(start..start + 4)?
                .try_into()
                .ok()
                .map(u32::from_le_bytes)
        })
        .collect()
}

/// The deepest index in `from..n` for which `probe` finds something, as a count (index + 1),
/// with what it found, for a presence that is monotone (found at i implies found below i), as
/// chained prefix keys are: probes the last index, then 2, 4, 8, ... back from it (the newest keys
/// of a conversation are the ones its next turn finds), then bisects between the deepest hit and
/// the shallowest miss above it. About 2·log2(n - from) probes.
pub fn longest<T>(
    n: usize,
    from: usize,
    mut probe: impl FnMut(usize) -> Option<T>,
) -> Option<(usize, T)> {
    if from >= n {
        return None;
    }
    let (mut miss, mut step) = (n, 1usize);
    let (mut lo, mut best) = loop {
        let i = n.saturating_sub(step).max(from);
        if let Some(found) = probe(i) {
            break (i, found);
        }
        if i == from {
            return None;
        }
        miss = i;
        step = step.saturating_mul(2);
    };
    while miss - lo > 1 {
        let mid = lo + (miss - lo) / 2;
        match probe(mid) {
            Some(found) => (lo, best) = (mid, found),
            None => miss = mid,
        }
    }
    Some((lo + 1, best))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_finds_the_boundary_of_a_monotone_presence() {
        for n in 0..40 {
            for held in 0..=n {
                let found = longest(n, 0, |i| (i < held).then_some(i));
                let want = (held > 0).then(|| (held, held - 1));
                assert_eq!(found, want, "n {n} held {held}");
            }
        }
        assert_eq!(longest(10, 4, |i| (i < 3).then_some(i)), None);
        assert_eq!(longest(10, 4, |i| (i < 7).then_some(i)), Some((7, 6)));
    }

    #[test]
    fn a_malformed_slot_has_no_records() {
        assert!(records(&[], 1, 4, 2).is_empty());
        assert!(
            records(&[2, 0, 0, 0, 0], 1, 4, 2).is_empty(),
            "another version"
        );
        assert!(records(&[1, 0, 0, 0], 1, 4, 2).is_empty(), "torn");
        assert!(records(&[1; 13], 1, 4, 2).is_empty(), "more than `ways`");
        assert_eq!(records(&[1, 7, 7, 7, 7], 1, 4, 2), &[7, 7, 7, 7]);
        assert_eq!(u32s(&[1, 0, 0, 0, 2, 0, 0, 0], 0, 2), Some(vec![1, 2]));
        assert_eq!(u32s(&[1, 0, 0], 0, 1), None);
    }
}
