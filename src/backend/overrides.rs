//! Where a backend keeps the overrides set at run time, and how it tells every limiter on it
//! (in this process: at once; in others: through the store's notifications) that they changed.

use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;

use super::BackendError;
use crate::key::BucketKey;
use crate::overrides::StoredOverride;
use crate::time::Clock;

/// What a store tells the limiters watching it.
pub(crate) enum StoreEvent<'a> {
    /// The overrides in force now (all of them).
    Overrides(&'a Arc<[StoredOverride]>),
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

/// A backend's store of overrides.
#[async_trait]
pub(crate) trait OverrideStore: Send + Sync {
    /// The overrides last known (the store may be unreachable: these stay in force).
    fn current(&self) -> Arc<[StoredOverride]>;
    /// Reads the store, and tells the watchers when what it holds changed.
    async fn refresh(&self) -> Result<Arc<[StoredOverride]>, BackendError>;
    /// Stores `o` (replacing the one of its limit and id) and tells every instance: the
    /// watchers of this one before it returns.
    async fn put(&self, o: &StoredOverride) -> Result<(), BackendError>;
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

/// The list in force and the watchers: the part every store shares.
#[derive(Default)]
pub(crate) struct Watched {
    /// Held from a change to the end of telling it, so watchers hear changes in their order.
    changing: Mutex<()>,
    current: Mutex<Arc<[StoredOverride]>>,
    watchers: Mutex<Vec<Watcher>>,
}

impl Watched {
    pub(crate) fn current(&self) -> Arc<[StoredOverride]> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Changes the list in force with `f` (kept sorted by limit and id) and tells the watchers
    /// if it changed, before any other change is made. Returns what `f` returned.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut Vec<StoredOverride>) -> R) -> R {
        let _in_order = self.changing.lock().unwrap_or_else(PoisonError::into_inner);
        let mut list = self.current().to_vec();
        let r = f(&mut list);
        list.sort_by(|a, b| (&a.limit, &a.id).cmp(&(&b.limit, &b.id)));
        let list: Arc<[StoredOverride]> = list.into();
        let changed = {
            let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            let changed = *current != list;
            *current = list.clone();
            changed
        };
        if changed {
            self.tell(&StoreEvent::Overrides(&list));
        }
        r
    }

    /// Puts `o` in place of its limit's and id's override; whether one was there.
    pub(crate) fn put(&self, o: &StoredOverride) -> bool {
        self.update(|list| {
            let had = Self::take(list, &o.limit, &o.id);
            list.push(o.clone());
            had
        })
    }

    /// Removes `limit`'s and `id`'s override; whether one was there.
    pub(crate) fn remove(&self, limit: &str, id: &str) -> bool {
        self.update(|list| Self::take(list, limit, id))
    }

    fn take(list: &mut Vec<StoredOverride>, limit: &str, id: &str) -> bool {
        let before = list.len();
        list.retain(|x| x.limit != limit || x.id != id);
        list.len() != before
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
}

impl MemoryOverrides {
    /// The store of a memory backend whose clock is `clock` (`None`: the system's).
    pub(crate) fn new(clock: Option<Arc<dyn Clock>>) -> Self {
        Self {
            watched: Watched::default(),
            clock: clock.unwrap_or_else(|| Arc::new(crate::time::SystemClock)),
        }
    }
}

#[async_trait]
impl OverrideStore for MemoryOverrides {
    fn current(&self) -> Arc<[StoredOverride]> {
        self.watched.current()
    }

    async fn refresh(&self) -> Result<Arc<[StoredOverride]>, BackendError> {
        // Nothing to read: drop what ended.
        let now_ms = self.now_ms();
        self.watched
            .update(|list| list.retain(|o| !o.expired(now_ms)));
        Ok(self.watched.current())
    }

    async fn put(&self, o: &StoredOverride) -> Result<(), BackendError> {
        self.watched.put(o);
        Ok(())
    }

    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError> {
        Ok(self.watched.remove(limit, id))
    }

    fn watch(&self, w: Watcher) {
        self.watched.watch(w);
    }

    fn forget_local(&self, _key: &BucketKey) {}

    fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }
}
