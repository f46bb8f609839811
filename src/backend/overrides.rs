//! Where a backend keeps the overrides set at run time, and how it tells every limiter on it
//! (in this process: at once; in others: through the store's notifications) what changed.
//!
//! A change is told as what it changes ([`Delta`]: overrides set, overrides gone), never as the
//! whole list: a limiter applies it to its snapshot in time that grows with the change, not
//! with the number of overrides (`docs/design.md`, "Stored overrides at scale").

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use super::BackendError;
use crate::key::BucketKey;
use crate::overrides::{Delta, Interned, Shared, StoredOverride};
use crate::time::Clock;

/// The most overrides a store keeps unless told otherwise: a million (measured in
/// `BENCHMARKS.md`, "Stored overrides at scale": the memory each instance holds, and what a
/// change costs the store).
pub const DEFAULT_MAX_OVERRIDES: usize = 1_000_000;

/// What a store tells the limiters watching it.
pub(crate) enum StoreEvent<'a> {
    /// The overrides in force changed by this much.
    Changed(&'a Delta),
    /// A bucket changed elsewhere (only a shared store says so) (its override, or a reset): what this instance remembers of it
    /// (denials, prefetched tokens) is stale. Named by text: the limiter knows the id's kind.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Forget {
        /// The limit's name.
        limit: &'a str,
        /// The id's canonical text.
        id: &'a str,
    },
}

/// A limiter's callback.
pub(crate) type Watcher = Box<dyn Fn(&StoreEvent<'_>) + Send + Sync>;

/// Why an override could not be stored.
#[derive(Debug)]
pub(crate) enum PutError {
    /// The store holds its most overrides and this one is new.
    Full {
        /// The cap.
        max: usize,
    },
    /// The store could not be reached or refused the change.
    Store(BackendError),
}

impl From<BackendError> for PutError {
    fn from(e: BackendError) -> Self {
        Self::Store(e)
    }
}

/// A backend's store of overrides.
#[async_trait]
pub(crate) trait OverrideStore: Send + Sync {
    /// The overrides last known, sorted by limit and id (the store may be unreachable: these
    /// stay in force). A copy: for listing and for applying them whole (a reload), not for
    /// the request path.
    fn current(&self) -> Vec<StoredOverride>;
    /// The overrides in force under `limits` (a limiter applying them whole: at its start, at
    /// a reload). Every override but a store that keeps some limits' elsewhere (regional
    /// mode: a limit marked `across_regions` has its overrides in the global store).
    fn in_force(&self, _limits: &crate::config::Limits) -> Vec<StoredOverride> {
        self.current()
    }
    /// Whether an override of `limit` is known (a limit the configuration no longer defines
    /// may still have some to remove).
    fn has_limit(&self, limit: &str) -> bool;
    /// Reads the store, and tells the watchers what changed.
    async fn refresh(&self) -> Result<Vec<StoredOverride>, BackendError>;
    /// Stores `o` (replacing the one of its limit and id) and tells every instance: the
    /// watchers of this one before it returns.
    async fn put(&self, o: &StoredOverride) -> Result<(), PutError>;
    /// Removes the override of `limit` and `id`; whether there was one.
    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError>;
    /// Calls `w` on every change from now on.
    fn watch(&self, w: Watcher);
    /// Drops what this instance remembers of `key` (the deny cache, prefetched tokens).
    fn forget_local(&self, key: &BucketKey);
    /// The clock expiries are read against (the backend's).
    fn clock(&self) -> Arc<dyn Clock>;
    /// Now on [`clock`](Self::clock), in Unix milliseconds.
    fn now_ms(&self) -> u64 {
        self.clock().now_us() / 1_000
    }
}

/// A backend's store of run-time overrides, for its limiters ([`Backend::override_store`]):
/// opaque, made by the crate's backends only.
///
/// [`Backend::override_store`]: super::Backend::override_store
#[derive(Clone)]
pub struct OverrideStoreRef(pub(crate) Arc<dyn OverrideStore>);

impl std::fmt::Debug for OverrideStoreRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OverrideStoreRef(..)")
    }
}

/// The overrides in force, keyed by their field (`<limit>:<id>`: a limit's name holds no `:`),
/// each in 32 bytes beside its key (a limit shared by the overrides that give the same one) (`BENCHMARKS.md`, "Stored overrides at scale").
type Map = HashMap<Box<str>, Entry, foldhash::fast::RandomState>;

/// One override as a store keeps it.
#[derive(Debug, Clone)]
struct Entry {
    kind: Shared,
    /// Unix milliseconds; `u64::MAX`: no end.
    expires_at_ms: u64,
    /// The last read of the whole store that found it, or during which it was set.
    pass: u32,
}

impl Entry {
    fn of(o: &StoredOverride, pass: u32, interned: &Interned) -> Self {
        Self {
            kind: Shared::of(&o.kind, interned),
            expires_at_ms: o.expires_at_ms.unwrap_or(u64::MAX),
            pass,
        }
    }

    fn same(&self, o: &StoredOverride) -> bool {
        self.kind.is(&o.kind) && self.expires_at_ms == o.expires_at_ms.unwrap_or(u64::MAX)
    }

    /// The override of `field` this entry keeps.
    fn read(&self, field: &str) -> Option<StoredOverride> {
        let (limit, id) = field.split_once(':')?;
        Some(StoredOverride {
            limit: limit.to_owned(),
            id: id.to_owned(),
            kind: self.kind.kind(),
            expires_at_ms: (self.expires_at_ms != u64::MAX).then_some(self.expires_at_ms),
        })
    }
}

/// The field of `limit` and `id` (the map's key).
fn field(limit: &str, id: &str) -> Box<str> {
    StoredOverride::field(limit, id).into_boxed_str()
}

/// The limit and id of a field.
fn split(field: &str) -> (String, String) {
    let (l, i) = field.split_once(':').unwrap_or((field, ""));
    (l.to_owned(), i.to_owned())
}

/// The list in force and the watchers: the part every store shares.
pub(crate) struct Watched {
    /// Held from a change to the end of telling it, so watchers hear changes in their order.
    changing: Mutex<()>,
    current: Mutex<Map>,
    watchers: Mutex<Vec<Watcher>>,
    /// The read of the whole store under way (or the last one).
    pass: AtomicU32,
    /// No override here expires before this (Unix ms), so that finding the expired ones walks
    /// the list only once one has.
    earliest_expiry_ms: AtomicU64,
    /// The limits the overrides give, one allocation per distinct limit.
    interned: Interned,
}

impl Default for Watched {
    fn default() -> Self {
        Self {
            changing: Mutex::default(),
            current: Mutex::default(),
            watchers: Mutex::default(),
            pass: AtomicU32::new(0),
            earliest_expiry_ms: AtomicU64::new(u64::MAX),
            interned: Interned::default(),
        }
    }
}

impl Watched {
    fn map(&self) -> std::sync::MutexGuard<'_, Map> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The overrides in force, sorted by limit and id.
    pub(crate) fn current(&self) -> Vec<StoredOverride> {
        let mut list: Vec<StoredOverride> = self
            .map()
            .iter()
            .filter_map(|(field, e)| e.read(field))
            .collect();
        list.sort_by(|a, b| (&a.limit, &a.id).cmp(&(&b.limit, &b.id)));
        list
    }

    /// How many are in force.
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }

    /// Whether `limit` and `id` has one in force.
    pub(crate) fn contains(&self, limit: &str, id: &str) -> bool {
        self.map().contains_key(&field(limit, id))
    }

    /// Whether an override of `limit` is in force.
    pub(crate) fn has_limit(&self, limit: &str) -> bool {
        self.map()
            .keys()
            .any(|f| f.split_once(':').is_some_and(|(l, _)| l == limit))
    }

    /// The limits and ids of those ended at `now_ms` (a walk of the list only once one has).
    pub(crate) fn expired(&self, now_ms: u64) -> Vec<(String, String)> {
        if now_ms < self.earliest_expiry_ms.load(Ordering::Acquire) {
            return Vec::new();
        }
        let map = self.map();
        let mut earliest = u64::MAX;
        let mut ended = Vec::new();
        for (f, e) in map.iter() {
            if e.expires_at_ms <= now_ms {
                ended.push(split(f));
            } else {
                earliest = earliest.min(e.expires_at_ms);
            }
        }
        // The ended ones stay until the store removes them: looked at again next time.
        if ended.is_empty() {
            self.earliest_expiry_ms.store(earliest, Ordering::Release);
        }
        ended
    }

    /// Applies `delta` (what is already so is left out) and tells the watchers what changed,
    /// before any other change is made. Returns what changed.
    pub(crate) fn apply(&self, delta: Delta) -> Delta {
        let _in_order = self.changing.lock().unwrap_or_else(PoisonError::into_inner);
        let mut changed = Delta::default();
        {
            let pass = self.pass.load(Ordering::Acquire);
            let mut map = self.map();
            for (limit, id) in delta.gone {
                if map.remove(&field(&limit, &id)).is_some() {
                    changed.gone.push((limit, id));
                }
            }
            for o in delta.set {
                match map.get_mut(&*StoredOverride::field(&o.limit, &o.id)) {
                    Some(e) if e.same(&o) => e.pass = pass,
                    _ => {
                        if let Some(at) = o.expires_at_ms {
                            self.earliest_expiry_ms.fetch_min(at, Ordering::AcqRel);
                        }
                        map.insert(field(&o.limit, &o.id), Entry::of(&o, pass, &self.interned));
                        changed.set.push(o);
                    }
                }
            }
        }
        if !changed.is_empty() {
            self.tell(&StoreEvent::Changed(&changed));
        }
        changed
    }

    /// Starts a read of the whole store: what is [applied](Self::apply) from now on is marked
    /// as found (one read at a time), and what is not by its [end](Self::end_pass) is gone from
    /// the store.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn begin_pass(&self) -> u32 {
        self.pass.fetch_add(1, Ordering::AcqRel).wrapping_add(1)
    }

    /// The overrides held here that the read `pass` did not find, nor was any set during it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn end_pass(&self, pass: u32) -> Vec<(String, String)> {
        self.map()
            .iter()
            .filter(|(_, e)| e.pass != pass)
            .map(|(f, _)| split(f))
            .collect()
    }

    pub(crate) fn tell(&self, event: &StoreEvent<'_>) {
        for w in self
            .watchers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            w(event);
        }
    }

    pub(crate) fn watch(&self, w: Watcher) {
        self.watchers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(w);
    }
}

/// The in-memory backend's store: this process only.
pub(crate) struct MemoryOverrides {
    watched: Watched,
    clock: Arc<dyn Clock>,
    max: usize,
}

impl MemoryOverrides {
    /// The store of a memory backend whose clock is `clock` (`None`: the system's), keeping at
    /// most `max` overrides.
    pub(crate) fn new(clock: Option<Arc<dyn Clock>>, max: usize) -> Self {
        Self {
            watched: Watched::default(),
            clock: clock.unwrap_or_else(|| Arc::new(crate::time::SystemClock)),
            max,
        }
    }
}

#[async_trait]
impl OverrideStore for MemoryOverrides {
    fn current(&self) -> Vec<StoredOverride> {
        self.watched.current()
    }

    fn has_limit(&self, limit: &str) -> bool {
        self.watched.has_limit(limit)
    }

    async fn refresh(&self) -> Result<Vec<StoredOverride>, BackendError> {
        // Nothing to read: drop what ended.
        let gone = self.watched.expired(self.now_ms());
        self.watched.apply(Delta {
            set: Vec::new(),
            gone,
        });
        Ok(self.watched.current())
    }

    async fn put(&self, o: &StoredOverride) -> Result<(), PutError> {
        if self.watched.len() >= self.max && !self.watched.contains(&o.limit, &o.id) {
            return Err(PutError::Full { max: self.max });
        }
        self.watched.apply(Delta {
            set: vec![o.clone()],
            gone: Vec::new(),
        });
        Ok(())
    }

    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError> {
        let changed = self.watched.apply(Delta {
            set: Vec::new(),
            gone: vec![(limit.to_owned(), id.to_owned())],
        });
        Ok(!changed.gone.is_empty())
    }

    fn watch(&self, w: Watcher) {
        self.watched.watch(w);
    }

    fn forget_local(&self, _key: &BucketKey) {}

    fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }
}
