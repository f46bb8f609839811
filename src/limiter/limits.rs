//! The limits a limiter holds: the snapshot in force (read without a lock on the request
//! path), reloads (atomic, refused when they drop a limit a rule uses), and names and keys
//! looked up in them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use arc_swap::Guard;

use crate::config::{Limits, LimitsChange};
use crate::key::{BucketKey, Id, LimitName};

use super::{Limiter, LimiterError, overrides};

/// Why [`Limiter::reload`] refused new limits; the old ones stay in force.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The new configuration does not define a limit that a rule of a layer built on this
    /// limiter uses.
    #[error("limit {0:?} is used by a rate limit rule and the new configuration removes it")]
    LimitInUse(String),
    /// The new configuration makes a limit that a rule per message counts
    /// ([`Rule::per`](crate::Rule::per)) one that holds slots (a concurrency or an adaptive
    /// limit), which cannot count messages: its streams' meters could not be built.
    #[error("limit {0:?} counts a stream's messages and the new configuration makes it hold slots")]
    HoldsSlots(String),
    /// The new configuration could not be loaded (its location and limit are in the error).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

readable_debug!(ReloadError { LimitInUse(name), HoldsSlots(name), Config(error) });

impl Limiter {
    /// The limits in force now (a snapshot: a later [`reload`](Self::reload) does not change
    /// it).
    pub fn limits(&self) -> Arc<Limits> {
        self.inner.limits.load_full()
    }

    /// The limits in force now, without touching a reference count (the request path).
    pub(crate) fn load(&self) -> Guard<Arc<Limits>> {
        self.inner.limits.load()
    }

    /// How many reloads replaced the limits since the limiter was built.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// Replaces the limits, atomically: every batch is decided entirely under the old limits
    /// or entirely under the new ones, and the request path takes no lock. Bucket state is
    /// kept (it is keyed by limit name and id, never by position): a drained bucket stays
    /// drained, and a changed limit applies to existing buckets from their next request (a
    /// GCRA bucket's stored TAT is read under the new emission interval and burst; a tiered
    /// bucket's recorded grants tier by tier under the new tiers, tiers the new limit lacks
    /// dropped and new ones empty: `docs/gcra.md`, "Changing a limit").
    ///
    /// Refused, keeping the old limits, when the new ones drop a limit that a rule of a layer
    /// built on this limiter uses ([`ReloadError::LimitInUse`]), or make one that a rule per
    /// message counts hold slots ([`ReloadError::HoldsSlots`]). A limit the reload makes set
    /// `prefetch` on a backend that does not prefetch is warned of, as at the start
    /// ([`Limiter::with_shared_backend`]).
    ///
    /// ```
    /// use tower_ratelimits::{Limiter, Limits, MemoryBackend};
    /// let limiter = Limiter::new(
    ///     Limits::from_yaml_str("Api: {burst: 5, count: 5, period: 1s}\n", None).unwrap(),
    ///     MemoryBackend::new(),
    /// );
    /// let change = limiter
    ///     .reload(Limits::from_yaml_str("Api: {burst: 9, count: 9, period: 1s}\n", None).unwrap())
    ///     .unwrap();
    /// assert_eq!(change.to_string(), "changed: Api");
    /// ```
    pub fn reload(&self, limits: Limits) -> Result<LimitsChange, ReloadError> {
        self.replace_limits(|current| {
            {
                let pinned = self
                    .inner
                    .pinned
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some((name, _)) = pinned.iter().find(|(n, _)| !limits.contains(*n)) {
                    return Err(ReloadError::LimitInUse(name.to_string()));
                }
                let holds =
                    |n: LimitName| limits.default_limit(n).is_some_and(|q| q.holds_leases());
                if let Some((name, _)) = pinned.iter().find(|(n, units)| *units && holds(*n)) {
                    return Err(ReloadError::HoldsSlots(name.to_string()));
                }
            }
            let change = current.change_to(&limits);
            if self.inner.warns_of_prefetch {
                let before = current.prefetching_names();
                super::warn_ignored_prefetch(&limits.prefetching_names(), &before);
            }
            if self.inner.regions == super::Regions::PerRegion {
                super::warn_not_regional(
                    &limits.across_regions_names(),
                    &current.across_regions_names(),
                );
            }
            let limits = match &self.inner.store {
                Some(store) => {
                    overrides::applied(&limits, store.as_ref(), &store.in_force(&limits))
                }
                None => limits,
            };
            Ok((limits, change))
        })
    }

    /// The one tail of every change of the limits in force (a reload: a file, SIGHUP or code;
    /// a change of the stored overrides: an admin call or another instance's, told by the
    /// store): one change at a time, `next` of the limits in force swapped in whole (a batch is
    /// decided under the old or the new, never both), the generation counted.
    pub(super) fn replace_limits<T, E>(
        &self,
        next: impl FnOnce(&Limits) -> Result<(Limits, T), E>,
    ) -> Result<T, E> {
        let _one_at_a_time = self
            .inner
            .reloading
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (limits, out) = next(&self.load())?;
        self.inner.limits.store(Arc::new(limits));
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        Ok(out)
    }

    /// Marks `name` as used by a rule: a reload may not remove it, nor, when a rule counts its
    /// units per message (`units`), make it hold slots.
    pub(crate) fn pin(&self, name: LimitName, units: bool) {
        let mut pinned = self
            .inner
            .pinned
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match pinned.iter_mut().find(|(n, _)| *n == name) {
            Some((_, counted)) => *counted |= units,
            None => pinned.push((name, units)),
        }
    }

    /// A limit's name, when the configuration defines it (look it up once, at set-up).
    pub fn name(&self, name: &str) -> Result<LimitName, LimiterError> {
        self.load()
            .name(name)
            .ok_or_else(|| LimiterError::UnknownName(name.to_owned()))
    }

    /// The bucket key of a name and an id.
    pub fn key(&self, name: &str, id: Id) -> Result<BucketKey, LimiterError> {
        Ok(BucketKey::new(self.name(name)?, id))
    }

    /// The bucket key of a name and an id given as text, checked against the name's id kind.
    pub fn parse_key(&self, name: &str, id: &str) -> Result<BucketKey, LimiterError> {
        let limits = self.load();
        let name = limits
            .name(name)
            .ok_or_else(|| LimiterError::UnknownName(name.to_owned()))?;
        let kind = limits.id_kind(name).unwrap_or_default();
        let id = kind
            .parse(id)
            .map_err(|source| LimiterError::InvalidId { name, source })?;
        Ok(BucketKey::new(name, id))
    }
}
