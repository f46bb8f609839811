//! Stored overrides as they apply to one [`Limits`] snapshot: keyed by bucket, checked against
//! the limits' names and kinds, ended by their expiry.

use std::collections::HashMap;
use std::sync::Arc;

use super::Limits;
use crate::algo::gcra::Limit;
use crate::key::BucketKey;
use crate::overrides::{BLOCK_WITHOUT_END, OverrideKind, StoredOverride};
use crate::quota::Quota;
use crate::time::Clock;

/// One stored override, applied.
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    /// The limit in force: the override's own, or for a block the name's default (what its
    /// `RateLimit-Policy` says; a name without one says a limit of one per second). `None`:
    /// unlimited.
    quota: Option<Quota>,
    block: bool,
    /// Microseconds since the Unix epoch on the limiter's clock (`u64::MAX`: no end).
    expires_at_us: u64,
}

/// The stored overrides that apply to a [`Limits`] snapshot.
#[derive(Clone)]
pub(crate) struct StoredSet {
    map: HashMap<BucketKey, Applied, foldhash::fast::RandomState>,
    /// What expiries are read against (the store's clock).
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for StoredSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.map.iter()).finish()
    }
}

/// How a stored override resolves one bucket.
pub(crate) struct StoredResolution<'a> {
    pub(crate) quota: Option<&'a Quota>,
    /// Seconds until a block ends, rounded up (0: not blocked).
    pub(crate) block_s: u32,
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
        let now_ms = clock.now_us() / 1_000;
        let mut map = HashMap::default();
        for o in list.iter().filter(|o| !o.expired(now_ms)) {
            match Self::apply(limits, o) {
                Ok((key, applied)) => {
                    map.insert(key, applied);
                }
                Err(why) => tracing::warn!(
                    limit = %o.limit, id = %o.id,
                    "a stored override does not apply to these limits: {why}"
                ),
            }
        }
        (!map.is_empty()).then(|| Arc::new(Self { map, clock }))
    }

    fn apply(limits: &Limits, o: &StoredOverride) -> Result<(BucketKey, Applied), String> {
        let not_defined = || "the limit is not defined".to_owned();
        let name = limits.name(&o.limit).ok_or_else(not_defined)?;
        let entry = limits.entry(name).ok_or_else(not_defined)?;
        let id = entry.kind.parse(&o.id).map_err(|e| e.to_string())?;
        let (quota, block) = match &o.kind {
            OverrideKind::Limit(l) => {
                check_limit(entry.cost, entry.default.as_ref(), l)?;
                (Some(Quota::Gcra(*l)), false)
            }
            OverrideKind::Unlimited => (None, false),
            OverrideKind::Block => {
                let policy = match &entry.default {
                    Some(q) => q.clone(),
                    None => {
                        Quota::Gcra(Limit::from_micros(1, 1, 1_000_000).map_err(|e| e.to_string())?)
                    }
                };
                (Some(policy), true)
            }
        };
        let expires_at_us = o
            .expires_at_ms
            .map_or(u64::MAX, |ms| ms.saturating_mul(1_000));
        Ok((
            BucketKey::new(name, id),
            Applied {
                quota,
                block,
                expires_at_us,
            },
        ))
    }

    /// Replaces each limit with `f` of it (the fallback's scaled copy).
    pub(crate) fn try_map_quotas<E>(
        &mut self,
        mut f: impl FnMut(&BucketKey, &Quota) -> Result<Quota, E>,
    ) -> Result<(), E> {
        for (key, a) in &mut self.map {
            if let Some(q) = &a.quota {
                a.quota = Some(f(key, q)?);
            }
        }
        Ok(())
    }

    /// How many apply.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The stored override of `key` in force now, if any.
    #[inline]
    pub(crate) fn resolve(&self, key: &BucketKey) -> Option<StoredResolution<'_>> {
        let a = self.map.get(key)?;
        let now = if a.expires_at_us == u64::MAX && !a.block {
            0
        } else {
            self.clock.now_us()
        };
        if now >= a.expires_at_us {
            return None;
        }
        let block_s = match (a.block, a.expires_at_us) {
            (false, _) => 0,
            (true, u64::MAX) => u32::try_from(BLOCK_WITHOUT_END.as_secs()).unwrap_or(u32::MAX),
            (true, at) => u32::try_from((at - now).div_ceil(1_000_000)).unwrap_or(u32::MAX),
        };
        Some(StoredResolution {
            quota: a.quota.as_ref(),
            block_s,
        })
    }
}

/// Whether a stored GCRA limit may replace a name's limit: the name's requests fit its burst,
/// and the name is GCRA (or has no default): tiers and concurrency keep their own kind.
pub(crate) fn check_limit(cost: u64, default: Option<&Quota>, l: &Limit) -> Result<(), String> {
    if cost > l.burst() {
        return Err(format!(
            "a request costs {cost}, more than the burst {}",
            l.burst()
        ));
    }
    if default.is_some_and(|q| q.as_gcra().is_none()) {
        return Err(
            "the limit is not a GCRA limit (burst, count, period): only unlimited or block \
             replace it"
                .to_owned(),
        );
    }
    Ok(())
}
