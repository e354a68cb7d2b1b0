//! Sluice's own partitioner for internal topics. Every producer of an internal
//! message uses it, so a key's partition — and so its owner — does not depend
//! on which client library wrote the message. Internal topics' partition
//! counts never change after creation (the topic setup refuses it).

/// 64-bit FNV-1a: small, stable across languages and releases.
pub fn stable_hash(parts: &[&[u8]]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    for (index, part) in parts.iter().enumerate() {
        if index > 0 {
            // A separator no valid key contains (keys refuse control characters).
            hash ^= 0x1f;
            hash = hash.wrapping_mul(PRIME);
        }
        for byte in *part {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hash
}

fn bucket(hash: u64, partitions: i32) -> i32 {
    debug_assert!(partitions > 0, "partition count must be positive");
    let count = u64::try_from(partitions.max(1)).unwrap_or(1);
    // The remainder is below `partitions`, which fits in i32.
    i32::try_from(hash % count).unwrap_or(0)
}

/// Partition of a (tenant, key) pair: limit commands, rate commands, refresh-due events.
pub fn key_partition(tenant: &str, key: &str, partitions: i32) -> i32 {
    bucket(stable_hash(&[tenant.as_bytes(), key.as_bytes()]), partitions)
}

/// Partition of a rate window: rate commands. Inline windows hash
/// (tenant, "i", name, unique_key); stored resources (tenant, "r", key).
pub fn rate_key_partition(key: &sluice_proto::v1::RateKeyRef, partitions: i32) -> i32 {
    use sluice_proto::v1::rate_key_ref::Kind;
    let hash = match &key.kind {
        Some(Kind::Inline(inline)) => stable_hash(&[
            key.tenant.as_bytes(),
            b"i",
            inline.name.as_bytes(),
            inline.unique_key.as_bytes(),
        ]),
        Some(Kind::ResourceKey(resource_key)) => stable_hash(&[key.tenant.as_bytes(), b"r", resource_key.as_bytes()]),
        None => stable_hash(&[key.tenant.as_bytes()]),
    };
    bucket(hash, partitions)
}

/// Partition of a job: grant events, admitted jobs.
pub fn job_partition(job_id: &str, partitions: i32) -> i32 {
    bucket(stable_hash(&[job_id.as_bytes()]), partitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_known() {
        // Pinned values: changing the hash would move every key to another owner.
        assert_eq!(stable_hash(&[b""]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(key_partition("acme", "k1", 12), key_partition("acme", "k1", 12));
    }

    #[test]
    fn tenant_and_key_boundary_matters() {
        assert_ne!(
            stable_hash(&[b"ab".as_slice(), b"c".as_slice()]),
            stable_hash(&[b"a".as_slice(), b"bc".as_slice()])
        );
    }

    #[test]
    fn partitions_spread() {
        let mut counts = [0u32; 12];
        for index in 0..12_000 {
            let partition = key_partition("tenant", &format!("key-{index}"), 12);
            counts[usize::try_from(partition).unwrap()] += 1;
        }
        assert!(counts.iter().all(|count| (700..1300).contains(count)), "{counts:?}");
    }
}
