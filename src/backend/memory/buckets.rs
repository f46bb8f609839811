//! Where the memory backend keeps its buckets: GCRA words in two maps (one keyed by a
//! one-word key, one by `BucketKey`), every other shape's state in a slot under its lock.

use super::*;

/// The state of a key that is not a GCRA word (a tiered key, a concurrency key's leases, any
/// shape the kit keeps as a [`kit::Stored`]), and when it will equal a fresh one.
#[derive(Default)]
pub(super) struct TierSlot {
    /// As the kit wrote it (`None`: fresh).
    pub(super) state: Option<kit::Stored>,
    /// The first instant at which the state equals a fresh one (`kit::fresh_at`; 0: it
    /// already does).
    pub(super) expires_at: u64,
    /// Set when the slot left the map (sweep, reset): whoever holds it must look again.
    pub(super) removed: bool,
}

impl TierSlot {
    /// Keeps what the kit wrote for the key of `tx`.
    pub(super) fn write(&mut self, tx: &BucketTx<'_>, state: kit::Stored, now: u64) {
        let expires_at = kit::fresh_at(tx.quota, tx.penalty, &state, now);
        self.put(expires_at, state);
    }

    /// Keeps `state`, fresh from `expires_at` on.
    pub(super) fn put(&mut self, expires_at: u64, state: kit::Stored) {
        self.expires_at = expires_at;
        match (&mut self.state, state) {
            // A calendar state over a calendar state (its every decision): plain data, nothing
            // to drop (`ours_calendar_spend` 727 -> 711 instructions, `benches/instructions.sh`).
            (Some(kit::Stored::Calendar(old)), kit::Stored::Calendar(new)) => *old = new,
            (slot, state) => *slot = Some(state),
        }
    }
}

pub(super) type SharedSlot = Arc<Mutex<TierSlot>>;

pub(super) fn lock(slot: &SharedSlot) -> MutexGuard<'_, TierSlot> {
    // The critical sections only do arithmetic on the slot; a panic there leaves a state that
    // is still valid, so a poisoned lock is used as it is.
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a GCRA bucket lives: in the table of one-word keys or in the general one.
#[derive(Clone, Copy)]
pub(super) enum Place<'a> {
    Packed(u64),
    Wide(&'a BucketKey),
}

impl Place<'_> {
    /// Whether two places are one key's: one word each, or both keys (a key has one place).
    #[inline]
    pub(super) fn same(self, other: Place<'_>) -> bool {
        match (self, other) {
            (Place::Packed(a), Place::Packed(b)) => a == b,
            (Place::Wide(a), Place::Wide(b)) => a == b,
            _ => false,
        }
    }
}

/// The GCRA buckets, one `AtomicU64` (the TAT) each. Keys whose id fits one word with its
/// name (`BucketKey::packed`: IPv4 addresses, IPv6 /48 ranges, numbers below 2^48) live in a
/// table keyed by that word (an entry of 16 bytes), the rest in a table keyed by the
/// `BucketKey` (40 bytes and the text of a text id). A key has one place, found without a
/// lookup, so the two tables never hold the same key.
pub(super) struct Buckets {
    pub(super) packed: DashMap<u64, AtomicU64, foldhash::fast::RandomState>,
    pub(super) wide: DashMap<BucketKey, AtomicU64, foldhash::fast::RandomState>,
}

impl Buckets {
    pub(super) fn new() -> Self {
        Self {
            packed: DashMap::with_hasher(foldhash::fast::RandomState::default()),
            wide: DashMap::with_hasher(foldhash::fast::RandomState::default()),
        }
    }

    #[inline]
    pub(super) fn place(key: &BucketKey) -> Place<'_> {
        match key.packed() {
            Some(word) => Place::Packed(word),
            None => Place::Wide(key),
        }
    }

    /// The bucket's TAT under its shard's read guard (held until the answer is dropped), if the
    /// bucket is held.
    #[inline]
    pub(super) fn get(&self, place: Place<'_>) -> Option<Held<'_>> {
        match place {
            Place::Packed(word) => self.packed.get(&word).map(Held::Packed),
            Place::Wide(key) => self.wide.get(key).map(Held::Wide),
        }
    }

    /// Inserts the bucket holding `tat` unless it is held: whether it was inserted.
    pub(super) fn insert_new(&self, place: Place<'_>, tat: u64) -> bool {
        fn vacant<K: Eq + std::hash::Hash>(entry: Entry<'_, K, AtomicU64>, tat: u64) -> bool {
            match entry {
                Entry::Vacant(slot) => {
                    slot.insert(AtomicU64::new(tat));
                    true
                }
                Entry::Occupied(_) => false,
            }
        }
        match place {
            Place::Packed(word) => vacant(self.packed.entry(word), tat),
            Place::Wide(key) => vacant(self.wide.entry(key.clone()), tat),
        }
    }

    /// Removes the bucket: whether one was held.
    pub(super) fn remove(&self, key: &BucketKey) -> bool {
        match Self::place(key) {
            Place::Packed(word) => self.packed.remove(&word).is_some(),
            Place::Wide(key) => self.wide.remove(key).is_some(),
        }
    }

    /// Keeps the buckets whose TAT `keep` accepts.
    pub(super) fn retain(&self, mut keep: impl FnMut(&AtomicU64) -> bool) {
        self.packed.retain(|_, tat| keep(tat));
        self.wide.retain(|_, tat| keep(tat));
    }

    pub(super) fn capacity(&self) -> usize {
        self.packed.capacity() + self.wide.capacity()
    }

    /// Gives a table's memory back when it is less than a quarter full.
    pub(super) fn shrink_if_sparse(&self) {
        if self.packed.len().saturating_mul(4) < self.packed.capacity() {
            self.packed.shrink_to_fit();
        }
        if self.wide.len().saturating_mul(4) < self.wide.capacity() {
            self.wide.shrink_to_fit();
        }
    }
}

/// A held bucket: its shard's read guard, dereferencing to the TAT.
pub(super) enum Held<'a> {
    Packed(dashmap::mapref::one::Ref<'a, u64, AtomicU64>),
    Wide(dashmap::mapref::one::Ref<'a, BucketKey, AtomicU64>),
}

impl std::ops::Deref for Held<'_> {
    type Target = AtomicU64;

    #[inline]
    fn deref(&self) -> &AtomicU64 {
        match self {
            Held::Packed(r) => r.value(),
            Held::Wide(r) => r.value(),
        }
    }
}
