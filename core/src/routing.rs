//! Shard routing: jump consistent hash (Lamping & Veach, 2014) of the 64-bit FNV-1a hash of the
//! UTF-8 key `Broker/TradeRef`. Both are fully specified, so a trade lands on the same shard on
//! every version and machine; a randomly seeded hasher must never be used here.

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// 64-bit FNV-1a.
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    let mut hash = FNV_OFFSET_BASIS;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Jump consistent hash of `key` over `buckets` buckets (`buckets` ≥ 1).
pub fn jump_consistent_hash(mut key: u64, buckets: u32) -> u32 {
    let buckets = i64::from(buckets.max(1));
    let mut bucket: i64 = -1;
    let mut next: i64 = 0;
    while next < buckets {
        bucket = next;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        next = (((bucket + 1) as f64) * ((1_u64 << 31) as f64 / (((key >> 33) + 1) as f64))) as i64;
    }
    bucket as u32
}

/// The shard of the trade `broker/trade_ref`, hashing the parts without building the key.
pub fn shard_of_parts(broker: &str, trade_ref: &str, shards: u32) -> u32 {
    shard_of_byte_parts(broker.as_bytes(), trade_ref.as_bytes(), shards)
}

/// [`shard_of_parts`] of the two texts as a message's bytes spell them (a gateway's scan).
pub fn shard_of_byte_parts(broker: &[u8], trade_ref: &[u8], shards: u32) -> u32 {
    let mut hash = FNV_OFFSET_BASIS;
    for byte in broker.iter().chain(b"/").chain(trade_ref) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    jump_consistent_hash(hash, shards)
}

/// The shard of a trade key over `shards` shards.
pub fn shard_of(trade_key: &str, shards: u32) -> u32 {
    shard_of_bytes(trade_key.as_bytes(), shards)
}

/// The shard of a trade key given as bytes (`Broker/TradeRef`, as a message's bytes spell it).
pub fn shard_of_bytes(trade_key: &[u8], shards: u32) -> u32 {
    jump_consistent_hash(fnv1a_64(trade_key), shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn jump_hash_reference_values() {
        // Values from the reference implementation of the paper.
        assert_eq!(jump_consistent_hash(1, 1), 0);
        assert_eq!(jump_consistent_hash(0, 10), 0);
        assert_eq!(
            jump_consistent_hash(0xdead_beef, 10),
            jump_consistent_hash(0xdead_beef, 10)
        );
        for key in 0..1000_u64 {
            let before = jump_consistent_hash(key, 7);
            let after = jump_consistent_hash(key, 8);
            // Growing from 7 to 8 buckets only moves keys into the new bucket.
            assert!(after == before || after == 7);
        }
    }

    #[test]
    fn pinned_shards_of_fixed_keys() {
        // Computed by an independent implementation of FNV-1a 64 and the paper's jump hash; a
        // change here moves trades between database shards, so it must never happen.
        let pinned: [(&str, [u32; 5]); 5] = [
            ("BRKAAU21XXX/H00000000001", [0, 0, 3, 4, 4]),
            ("BRKAAU21XXX/T00000000001", [0, 0, 0, 0, 8]),
            ("BAAAFR25XXX/T00000000042", [0, 0, 0, 5, 5]),
            ("BZZZUS23XXX/T99999999999", [0, 1, 3, 3, 3]),
            ("B/1", [0, 0, 0, 6, 8]),
        ];
        for (key, shards) in pinned {
            for (count, expected) in [1, 2, 4, 8, 16].into_iter().zip(shards) {
                assert_eq!(shard_of(key, count), expected, "{key} over {count}");
            }
        }
    }

    #[test]
    fn parts_hash_like_the_key() {
        for index in 0..100 {
            let trade_ref = format!("T{index:011}");
            assert_eq!(
                shard_of_parts("BRKAAU21XXX", &trade_ref, 8),
                shard_of(&format!("BRKAAU21XXX/{trade_ref}"), 8)
            );
        }
    }

    #[test]
    fn shards_are_spread() {
        let mut counts = [0_u32; 4];
        for index in 0..40_000 {
            let key = format!("BRKAAU21XXX/T{index:011}");
            counts[shard_of(&key, 4) as usize] += 1;
        }
        for count in counts {
            assert!((9_000..11_000).contains(&count), "{counts:?}");
        }
    }
}
