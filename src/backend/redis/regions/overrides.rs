//! Stored overrides in regional mode (`docs/regions.md`, "Overrides"): a marked limit's are
//! kept in the global store, one set for every region; every other limit's in the region's
//! own store, as without regional mode. The limiter sees one store: each override is set,
//! removed, listed and followed where its limit's marking puts it, and an override found in
//! the other store (one set before the limit was marked, or unmarked) is not in force.

use std::sync::{Arc, PoisonError, Weak};

use async_trait::async_trait;

use super::Regional;
use crate::backend::redis::overrides::RedisOverrides;
use crate::backend::{BackendError, OverrideStore, PutError, StoreEvent, Watcher};
use crate::config::Limits;
use crate::key::BucketKey;
use crate::overrides::{Delta, StoredOverride};
use crate::time::Clock;

/// Whether `limits` mark `limit` `across_regions`.
fn marked(limits: &Limits, limit: &str) -> bool {
    limits
        .name(limit)
        .and_then(|n| limits.across_regions(n))
        .is_some()
}

impl Regional {
    /// The limits in force on the limiter this backend serves (`None` before it started, or
    /// once it is gone).
    fn limits(&self) -> Option<Arc<Limits>> {
        let followed = self.followed.lock().unwrap_or_else(PoisonError::into_inner);
        followed.as_ref().and_then(|f| f())
    }

    /// Whether `limit` is marked in the limits in force.
    fn marks(&self, limit: &str) -> bool {
        self.limits().is_some_and(|l| marked(&l, limit))
    }
}

/// The two stores behind one.
pub(in crate::backend::redis) struct RegionalOverrides {
    pub(in crate::backend::redis) region: RedisOverrides,
    pub(in crate::backend::redis) global: RedisOverrides,
    pub(in crate::backend::redis) regional: Arc<Regional>,
}

impl RegionalOverrides {
    /// The store that keeps `limit`'s overrides.
    fn store_of(&self, limit: &str) -> &RedisOverrides {
        if self.regional.marks(limit) {
            &self.global
        } else {
            &self.region
        }
    }

    /// Each store's overrides that are in force by `marks`, sorted by limit and id.
    fn merged(&self, marks: impl Fn(&str) -> bool) -> Vec<StoredOverride> {
        let mut all: Vec<StoredOverride> = self
            .region
            .current()
            .into_iter()
            .filter(|o| !marks(&o.limit))
            .chain(
                self.global
                    .current()
                    .into_iter()
                    .filter(|o| marks(&o.limit)),
            )
            .collect();
        all.sort_by(|a, b| (&a.limit, &a.id).cmp(&(&b.limit, &b.id)));
        all
    }
}

/// `delta` without what `keep` leaves out.
fn kept(delta: &Delta, keep: impl Fn(&str) -> bool) -> Delta {
    Delta {
        set: delta
            .set
            .iter()
            .filter(|o| keep(&o.limit))
            .cloned()
            .collect(),
        gone: delta
            .gone
            .iter()
            .filter(|(limit, _)| keep(limit))
            .cloned()
            .collect(),
    }
}

/// A watcher of one of the two stores, told that store's changes of the limits it keeps
/// (`global`: the marked ones) and every bucket it says to forget.
fn side(regional: Weak<Regional>, w: Arc<Watcher>, global: bool) -> Watcher {
    Box::new(move |event| match event {
        StoreEvent::Changed(delta) => {
            let Some(regional) = regional.upgrade() else {
                return;
            };
            let limits = regional.limits();
            let delta = kept(delta, |limit| {
                limits.as_ref().is_some_and(|l| marked(l, limit)) == global
            });
            if !delta.is_empty() {
                w(&StoreEvent::Changed(&delta));
            }
        }
        StoreEvent::Forget { .. } => w(event),
    })
}

#[async_trait]
impl OverrideStore for RegionalOverrides {
    fn current(&self) -> Vec<StoredOverride> {
        match self.regional.limits() {
            Some(limits) => self.in_force(&limits),
            None => self.merged(|_| false),
        }
    }

    fn in_force(&self, limits: &Limits) -> Vec<StoredOverride> {
        self.merged(|limit| marked(limits, limit))
    }

    fn has_limit(&self, limit: &str) -> bool {
        self.region.has_limit(limit) || self.global.has_limit(limit)
    }

    async fn refresh(&self) -> Result<Vec<StoredOverride>, BackendError> {
        self.region.refresh().await?;
        self.global.refresh().await?;
        Ok(self.current())
    }

    async fn put(&self, o: &StoredOverride) -> Result<(), PutError> {
        self.store_of(&o.limit).put(o).await
    }

    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError> {
        let defined = self.regional.limits().and_then(|l| l.name(limit)).is_some();
        if defined {
            return self.store_of(limit).remove(limit, id).await;
        }
        // A limit the configuration no longer defines: wherever it was kept.
        let here = self.region.remove(limit, id).await?;
        let there = self.global.remove(limit, id).await?;
        Ok(here || there)
    }

    fn watch(&self, w: Watcher) {
        let w = Arc::new(w);
        let regional = Arc::downgrade(&self.regional);
        self.region
            .watch(side(regional.clone(), Arc::clone(&w), false));
        self.global.watch(side(regional, w, true));
    }

    fn forget_local(&self, key: &BucketKey) {
        self.region.forget_local(key);
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.region.clock()
    }
}
