//! Hash maps whose iteration order depends only on what was put in them and
//! the process's seed: random per process in production (so nobody can
//! pick keys that collide), the same in every run of the simulation, so a
//! seed replays exactly. The cores use these, never `std`'s `RandomState`.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// A `HashMap` keyed by the process's seed.
pub type HashMap<K, V> = std::collections::HashMap<K, V, SeededState>;
/// A `HashSet` keyed by the process's seed.
pub type HashSet<K> = std::collections::HashSet<K, SeededState>;

/// 0: not chosen yet.
static SEED: AtomicU64 = AtomicU64::new(0);

/// Fix the seed (the simulation): every map made from now on iterates in
/// the same order for the same insertions.
pub fn set_deterministic() {
    SEED.store(0x5EED_0F5E_11CE, Ordering::Relaxed);
}

fn seed() -> u64 {
    let seed = SEED.load(Ordering::Relaxed);
    if seed != 0 {
        return seed;
    }
    // Random per process: std's RandomState keys come from the OS.
    let random = std::collections::hash_map::RandomState::new().hash_one(0x51_1CE_u64) | 1;
    match SEED.compare_exchange(0, random, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => random,
        Err(chosen) => chosen,
    }
}

/// The `BuildHasher` of `HashMap` and `HashSet`.
#[derive(Clone, Debug)]
pub struct SeededState(foldhash::fast::FixedState);

impl Default for SeededState {
    fn default() -> Self {
        SeededState(foldhash::fast::FixedState::with_seed(seed()))
    }
}

impl BuildHasher for SeededState {
    type Hasher = foldhash::fast::FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_maps_with_the_same_insertions_iterate_alike() {
        let fill = || {
            let mut map: HashMap<String, u32> = HashMap::default();
            for index in 0..200 {
                map.insert(format!("job-{index}"), index);
            }
            map.into_keys().collect::<Vec<_>>()
        };
        assert_eq!(fill(), fill());
    }
}
