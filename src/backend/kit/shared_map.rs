//! A map that is cheap to copy and to change after a copy, for the kit's states kept once per
//! limit (a fair share's ids, an adaptive pool's keys): every decision copies the state and
//! changes one entry. The entries are spread over [`SHARDS`] shards by hash, each behind its
//! own `Arc`: a copy counts references, and a change after a copy copies the one shard it
//! touches (a 64th of the entries). Std only: the persistent map it replaces (rpds, with
//! archery and triomphe) cost three crates in every build of the crate.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use foldhash::fast::FixedState;

/// How many shards: a change copies about `len / SHARDS` entries.
const SHARDS: usize = 64;

type Shard<K, V> = HashMap<K, V, FixedState>;

/// The map: a shard is `None` until it holds an entry, so an empty map allocates nothing.
pub(crate) struct SharedMap<K, V> {
    shards: [Option<Arc<Shard<K, V>>>; SHARDS],
    len: usize,
}

impl<K, V> Default for SharedMap<K, V> {
    fn default() -> Self {
        Self {
            shards: [const { None }; SHARDS],
            len: 0,
        }
    }
}

impl<K, V> Clone for SharedMap<K, V> {
    fn clone(&self) -> Self {
        Self {
            shards: self.shards.clone(),
            len: self.len,
        }
    }
}

impl<K: Hash + Eq, V> SharedMap<K, V> {
    fn shard_of(key: &K) -> usize {
        // The hash's top bits: the shard's own table indexes by its low ones.
        (FixedState::default().hash_one(key) >> (64 - SHARDS.trailing_zeros())) as usize
    }

    /// The value kept for `key`.
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.shards[Self::shard_of(key)].as_ref()?.get(key)
    }

    /// Whether `key` is kept.
    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// How many entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry, in no stated order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.shards.iter().flatten().flat_map(|shard| shard.iter())
    }

    /// Every value, in no stated order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }
}

impl<K: Hash + Eq + Clone, V: Clone> SharedMap<K, V> {
    /// Keeps `value` for `key`, copying its shard first if a copy of the map shares it.
    pub(crate) fn insert(&mut self, key: K, value: V) {
        let shard = self.shards[Self::shard_of(&key)].get_or_insert_with(Default::default);
        if Arc::make_mut(shard).insert(key, value).is_none() {
            self.len += 1;
        }
    }

    /// Forgets `key`, copying its shard first if a copy of the map shares it (and only if it
    /// holds `key`).
    pub(crate) fn remove(&mut self, key: &K) {
        let Some(shard) = self.shards[Self::shard_of(key)].as_mut() else {
            return;
        };
        if shard.contains_key(key) && Arc::make_mut(shard).remove(key).is_some() {
            self.len -= 1;
        }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> FromIterator<(K, V)> for SharedMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(entries: I) -> Self {
        let mut map = Self::default();
        for (k, v) in entries {
            map.insert(k, v);
        }
        map
    }
}

impl<K: Hash + Eq, V: PartialEq> PartialEq for SharedMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().all(|(k, v)| other.get(k) == Some(v))
    }
}

impl<K: Hash + Eq, V: Eq> Eq for SharedMap<K, V> {}

impl<K: Hash + Eq + std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for SharedMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_changed_leaves_the_original_as_it_was() {
        let original: SharedMap<u32, u32> = (0..100).map(|i| (i, i)).collect();
        let mut copy = original.clone();
        copy.insert(7, 70);
        copy.insert(1000, 1);
        copy.remove(&8);
        copy.remove(&5000);
        assert_eq!((original.len(), copy.len()), (100, 100));
        assert_eq!((original.get(&7), copy.get(&7)), (Some(&7), Some(&70)));
        assert_eq!((original.get(&8), copy.get(&8)), (Some(&8), None));
        assert!(!original.contains_key(&1000) && copy.contains_key(&1000));
        assert_ne!(original, copy);
        let mut entries: Vec<_> = original.iter().map(|(k, v)| (*k, *v)).collect();
        entries.sort();
        assert_eq!(entries, (0..100).map(|i| (i, i)).collect::<Vec<_>>());
    }

    #[test]
    fn a_change_copies_only_the_shard_it_touches() {
        let original: SharedMap<u32, u32> = (0..1000).map(|i| (i, i)).collect();
        let mut copy = original.clone();
        copy.insert(3, 4);
        let shared = (0..SHARDS)
            .filter(|&s| match (&original.shards[s], &copy.shards[s]) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            })
            .count();
        assert_eq!(shared, SHARDS - 1);
    }

    #[test]
    fn equal_maps_are_equal_whatever_their_history() {
        let a: SharedMap<u32, u32> = [(1, 1), (2, 2)].into_iter().collect();
        let mut b: SharedMap<u32, u32> = [(2, 2), (3, 3)].into_iter().collect();
        b.remove(&3);
        b.insert(1, 1);
        assert_eq!(a, b);
        assert!(SharedMap::<u32, u32>::default().is_empty());
    }
}
