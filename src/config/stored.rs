//! Stored overrides as they apply to one [`Limits`] snapshot: keyed by bucket, checked against
//! the limits' names and kinds, ended by their expiry.
//!
//! The set is split in shards, each behind its own `Arc`: a change copies the shards it
//! touches (about a thousandth of the set each) and shares the rest with the snapshot before
//! it, so applying one change costs the same at a thousand overrides as at a million.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use super::{ConfigErrorKind, Limits, NameEntry};
use crate::algo::gcra::Limit;
use crate::key::BucketKey;
use crate::overrides::{BLOCK_WITHOUT_END, Delta, Interned, OverrideKind, Shared, StoredOverride};
use crate::quota::Quota;
use crate::time::Clock;

/// The shards of a set: enough that one holds about a thousand overrides at a million.
const SHARDS: usize = 1024;

/// One stored override, applied: 24 bytes beside its key (a limit shared by the overrides
/// that give the same one).
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    what: Shared,
    /// Microseconds since the Unix epoch on the limiter's clock (`u64::MAX`: no end).
    expires_at_us: u64,
}

/// The policy a block of a name without a default reports: one per second.
static BLOCK_POLICY: std::sync::LazyLock<Quota> = std::sync::LazyLock::new(|| {
    Quota::Gcra(Limit::from_micros(1, 1, 1_000_000).unwrap_or_else(|_| unreachable!()))
});

type Shard = HashMap<BucketKey, Applied, foldhash::fast::RandomState>;

/// The stored overrides that apply to a [`Limits`] snapshot.
#[derive(Clone)]
pub(crate) struct StoredSet {
    shards: Box<[Arc<Shard>]>,
    len: usize,
    /// What expiries are read against (the store's clock).
    clock: Arc<dyn Clock>,
    interned: Arc<Interned>,
}

impl std::fmt::Debug for StoredSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.shards.iter().flat_map(|s| s.iter()))
            .finish()
    }
}

/// How a stored override resolves one bucket.
pub(crate) struct StoredResolution<'a> {
    pub(crate) quota: Option<&'a Quota>,
    /// Seconds until a block ends, rounded up (0: not blocked).
    pub(crate) block_s: u32,
}

/// The shard a key lives in: a fixed hash, the same in every snapshot.
fn shard_of(key: &BucketKey) -> usize {
    let hash = foldhash::fast::FixedState::with_seed(0x5eed).hash_one(key);
    // The high bits: the low ones also pick the slot inside the shard's table.
    (hash >> (64 - SHARDS.trailing_zeros())) as usize
}

impl StoredSet {
    /// The overrides of `list` that apply to `limits` at the clock's now. One that names a limit
    /// `limits` lacks, an id its kind refuses, or a limit its requests' cost exceeds is left out
    /// (logged): it applies again when a reload makes it valid.
    pub(crate) fn build(
        limits: &Limits,
        list: &[StoredOverride],
        clock: Arc<dyn Clock>,
    ) -> Option<Arc<Self>> {
        let empty = Self {
            shards: (0..SHARDS).map(|_| Arc::new(Shard::default())).collect(),
            len: 0,
            clock,
            interned: Arc::default(),
        };
        empty.changed(limits, list, &[])
    }

    /// This set with `delta` applied (`limits`: the snapshot it applies to; `this`: the set
    /// before, `None` for none): only the shards the change touches are copied. `None` when no
    /// override is left.
    pub(crate) fn apply(
        this: Option<&Arc<Self>>,
        limits: &Limits,
        delta: &Delta,
        clock: Arc<dyn Clock>,
    ) -> Option<Arc<Self>> {
        match this {
            Some(set) => set.changed(limits, &delta.set, &delta.gone),
            None => Self::build(limits, &delta.set, clock),
        }
    }

    /// A copy with `set` put in and `gone` taken out.
    fn changed(
        &self,
        limits: &Limits,
        set: &[StoredOverride],
        gone: &[(String, String)],
    ) -> Option<Arc<Self>> {
        let mut next = self.clone();
        let take = |next: &mut Self, key: &BucketKey| {
            let shard = &mut next.shards[shard_of(key)];
            if shard.contains_key(key) && Arc::make_mut(shard).remove(key).is_some() {
                next.len -= 1;
            }
        };
        for (limit, id) in gone {
            if let Some(key) = Self::key(limits, limit, id) {
                take(&mut next, &key);
            }
        }
        let now_ms = self.clock.now_us() / 1_000;
        for o in set {
            let applied = if o.expired(now_ms) {
                Err(NotApplied::Expired)
            } else {
                Self::applied(limits, o, &self.interned)
            };
            match applied {
                Ok((key, applied)) => {
                    if Arc::make_mut(&mut next.shards[shard_of(&key)])
                        .insert(key, applied)
                        .is_none()
                    {
                        next.len += 1;
                    }
                }
                Err(why) => {
                    // What it replaces no longer applies either.
                    if let Some(key) = Self::key(limits, &o.limit, &o.id) {
                        take(&mut next, &key);
                    }
                    if !o.expired(now_ms) {
                        tracing::warn!(
                            limit = %o.limit, id = %o.id,
                            "a stored override does not apply to these limits: {why}"
                        );
                    }
                }
            }
        }
        (next.len > 0).then(|| Arc::new(next))
    }

    /// The bucket of `limit` and `id` under `limits`, if it names one.
    fn key(limits: &Limits, limit: &str, id: &str) -> Option<BucketKey> {
        let name = limits.name(limit)?;
        let entry = limits.entry(name)?;
        Some(BucketKey::new(name, entry.kind.parse(id).ok()?))
    }

    fn applied(
        limits: &Limits,
        o: &StoredOverride,
        interned: &Interned,
    ) -> Result<(BucketKey, Applied), NotApplied> {
        let name = limits.name(&o.limit).ok_or(NotApplied::NotDefined)?;
        let entry = limits.entry(name).ok_or(NotApplied::NotDefined)?;
        let id = entry.kind.parse(&o.id)?;
        check_override(entry, &o.kind)?;
        let what = Shared::of(&o.kind, interned);
        let expires_at_us = o
            .expires_at_ms
            .map_or(u64::MAX, |ms| ms.saturating_mul(1_000));
        Ok((
            BucketKey::new(name, id),
            Applied {
                what,
                expires_at_us,
            },
        ))
    }

    /// Replaces each limit with `f` of it (the fallback's scaled copy).
    pub(crate) fn try_map_quotas<E>(
        &mut self,
        mut f: impl FnMut(&BucketKey, &Quota) -> Result<Quota, E>,
    ) -> Result<(), E> {
        for shard in self.shards.iter_mut() {
            for (key, a) in Arc::make_mut(shard).iter_mut() {
                if let Shared::Quota(q) = &a.what {
                    a.what = Shared::Quota(Arc::new(f(key, q)?));
                }
            }
        }
        Ok(())
    }

    /// How many apply.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The stored override of `key` in force now, if any (`default`: the name's default, what
    /// a block's policy says).
    #[inline]
    pub(crate) fn resolve<'a>(
        &'a self,
        key: &BucketKey,
        default: Option<&'a Quota>,
    ) -> Option<StoredResolution<'a>> {
        let a = self.shards[shard_of(key)].get(key)?;
        let block = matches!(a.what, Shared::Block);
        let now = if a.expires_at_us == u64::MAX && !block {
            0
        } else {
            self.clock.now_us()
        };
        if now >= a.expires_at_us {
            return None;
        }
        let (quota, block_s) = match &a.what {
            Shared::Quota(q) => (Some(&**q), 0),
            Shared::Unlimited => (None, 0),
            Shared::Block => {
                let s = match a.expires_at_us {
                    u64::MAX => BLOCK_WITHOUT_END.as_secs(),
                    at => (at - now).div_ceil(1_000_000),
                };
                (
                    Some(default.unwrap_or(&BLOCK_POLICY)),
                    u32::try_from(s).unwrap_or(u32::MAX),
                )
            }
        };
        Some(StoredResolution { quota, block_s })
    }
}

/// Whether a stored override of `kind` may replace `default` (a request costing `cost`): a
/// limit of its own has the default's shape (any shape where the name has no default: the
/// state each shape keeps is its own, and a limit of another shape would meet a default's
/// state it cannot read) and fits a request; unlimited and block replace anything.
pub(crate) fn check_override(
    entry: &NameEntry,
    kind: &OverrideKind,
) -> Result<(), OverrideRefusal> {
    let OverrideKind::Quota(q) = kind else {
        return Ok(());
    };
    if let Some(d) = &entry.default
        && std::mem::discriminant(d) != std::mem::discriminant(q)
    {
        return Err(OverrideRefusal::OtherShape {
            limit: d.shape_name(),
            given: q.shape_name(),
        });
    }
    entry.admits(q).map_err(|e| match e {
        ConfigErrorKind::CostAboveBurst { cost, burst } => {
            OverrideRefusal::CostAbove { cost, size: burst }
        }
        other => OverrideRefusal::Limit(other),
    })
}

/// Why a limit of its own cannot replace a limit's for an id (`OverrideError::Refused`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverrideRefusal {
    /// The override's shape is not the limit's: the state each shape keeps is its own.
    #[error(
        "the limit is {limit}, the override {given}: only unlimited, block or a limit of the \
         limit's own shape replace it"
    )]
    OtherShape {
        /// The limit's shape, as an error names it (`a GCRA limit`, ...).
        limit: &'static str,
        /// The override's.
        given: &'static str,
    },
    /// A request of the limit costs more than the override's largest grant.
    #[error("a request costs {cost}, more than the override's {size}")]
    CostAbove {
        /// The limit's cost per request.
        cost: u64,
        /// The most the override grants at once.
        size: u64,
    },
    /// What the limit's name asks of any limit it is given: what an override keeps (a fair
    /// share's budget), one limit across regions.
    #[error("{0}")]
    Limit(ConfigErrorKind),
}

/// Why a stored override does not apply to the limits loaded (it is left out, with a warning).
#[derive(Debug, thiserror::Error)]
enum NotApplied {
    #[error("it has expired")]
    Expired,
    #[error("the limit is not defined")]
    NotDefined,
    #[error(transparent)]
    Id(#[from] crate::key::IdError),
    #[error(transparent)]
    Refused(#[from] OverrideRefusal),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::ManualClock;

    fn o(id: &str, burst: u64) -> StoredOverride {
        StoredOverride {
            limit: "Api".into(),
            id: id.into(),
            kind: OverrideKind::Quota(Limit::from_micros(burst, burst, 1_000_000).unwrap().into()),
            expires_at_ms: None,
        }
    }

    /// A change copies only the shards it touches: the snapshot before it keeps its own, and
    /// every other shard is the same allocation in both.
    #[test]
    fn a_change_copies_the_shards_it_touches_and_shares_the_rest() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(5, 5, 1_000_000).unwrap())
            .build()
            .unwrap();
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
        let list: Vec<_> = (0..5_000).map(|i| o(&i.to_string(), 9)).collect();
        let before = StoredSet::build(&limits, &list, clock.clone()).unwrap();
        assert_eq!(before.len(), 5_000);
        let delta = Delta {
            set: vec![o("7", 3), o("new", 4)],
            gone: vec![("Api".into(), "8".into())],
        };
        let after = StoredSet::apply(Some(&before), &limits, &delta, clock).unwrap();
        assert_eq!(after.len(), 5_000);
        let shared = before
            .shards
            .iter()
            .zip(after.shards.iter())
            .filter(|(a, b)| Arc::ptr_eq(a, b))
            .count();
        assert!(shared >= SHARDS - 3, "{shared} of {SHARDS} shared");
        let key = |id: &str| {
            let name = limits.name("Api").unwrap();
            BucketKey::new(name, crate::key::Id::new(id).unwrap())
        };
        let burst = |set: &StoredSet, id| {
            set.resolve(&key(id), None)
                .and_then(|r| r.quota.and_then(Quota::as_gcra).map(Limit::burst))
        };
        assert_eq!(
            (burst(&before, "7"), burst(&after, "7")),
            (Some(9), Some(3))
        );
        assert_eq!((burst(&before, "8"), burst(&after, "8")), (Some(9), None));
        assert_eq!(burst(&after, "new"), Some(4));
    }
}
