//! What limits one bucket: a GCRA [`Limit`], burst tiers ([`TieredLimit`]) or a concurrency
//! limit ([`ConcurrencyLimit`]).

use std::fmt;
use std::sync::Arc;

use crate::algo::concurrency::ConcurrencyLimit;
use crate::algo::gcra::Limit;
use crate::algo::tiers::TieredLimit;

/// What limits one bucket: a GCRA [`Limit`], a [`TieredLimit`] (burst tiers) or a
/// [`ConcurrencyLimit`] (requests in flight).
///
/// Anything that takes a quota takes any of them, through `Into<Quota>`:
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{Limit, Limits, Quota};
/// use tower_ratelimits::{Tier, TieredLimit};
///
/// let s = Duration::from_secs;
/// let tiers = TieredLimit::new([Tier::new(5, s(1), s(1), s(0)), Tier::new(50, s(5), s(5), s(15))])
///     .unwrap();
/// let limits = Limits::builder()
///     .limit("PerIp", Limit::new(20, 20, s(1)).unwrap())
///     .limit("PerAccount", tiers)
///     .build()
///     .unwrap();
/// let quota = limits.default_limit(limits.name("PerAccount").unwrap()).unwrap();
/// assert!(matches!(quota, Quota::Tiered(_)));
/// assert_eq!(quota.max_cost(), 55);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Quota {
    /// A GCRA bucket.
    Gcra(Limit),
    /// Burst tiers (`docs/burst-tiers.md`).
    Tiered(Arc<TieredLimit>),
    /// Requests in flight per key (`docs/concurrency.md`).
    Concurrency(ConcurrencyLimit),
}

impl Quota {
    /// The GCRA limit, if this is one.
    pub fn as_gcra(&self) -> Option<&Limit> {
        match self {
            Quota::Gcra(l) => Some(l),
            Quota::Tiered(_) | Quota::Concurrency(_) => None,
        }
    }

    /// The tiers, if this is a tiered limit.
    pub fn as_tiered(&self) -> Option<&TieredLimit> {
        match self {
            Quota::Tiered(t) => Some(t),
            Quota::Gcra(_) | Quota::Concurrency(_) => None,
        }
    }

    /// The concurrency limit, if this is one.
    pub fn as_concurrency(&self) -> Option<&ConcurrencyLimit> {
        match self {
            Quota::Concurrency(c) => Some(c),
            Quota::Gcra(_) | Quota::Tiered(_) => None,
        }
    }

    /// The largest cost a request can ever be granted: the burst, the sum of the tiers'
    /// limits, or 1 for a concurrency limit (a request holds one slot).
    pub fn max_cost(&self) -> u64 {
        match self {
            Quota::Gcra(l) => l.burst(),
            Quota::Tiered(t) => t.capacity(),
            Quota::Concurrency(_) => 1,
        }
    }
}

impl From<Limit> for Quota {
    fn from(l: Limit) -> Self {
        Quota::Gcra(l)
    }
}

impl From<TieredLimit> for Quota {
    fn from(t: TieredLimit) -> Self {
        Quota::Tiered(Arc::new(t))
    }
}

impl From<Arc<TieredLimit>> for Quota {
    fn from(t: Arc<TieredLimit>) -> Self {
        Quota::Tiered(t)
    }
}

impl From<ConcurrencyLimit> for Quota {
    fn from(c: ConcurrencyLimit) -> Self {
        Quota::Concurrency(c)
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Quota::Gcra(l) => l.fmt(f),
            Quota::Tiered(t) => t.fmt(f),
            Quota::Concurrency(c) => c.fmt(f),
        }
    }
}
