//! A validated GCRA limit: `burst` requests at once, refilled at `count` per `period`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::tiers::TieredLimit;

use crate::time::duration_us;

/// The largest burst offset (`burst * period / count`) a limit may have: 100 years.
///
/// A TAT is at most `now + burst offset`; keeping it under 2^53 microseconds keeps every value
/// exact in a Redis Lua number (a double) until the year 2200.
pub const MAX_BURST_OFFSET_US: u64 = 100 * 365 * 86_400 * 1_000_000;

/// Why a limit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// `burst`, `count` or `period` was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field that was zero.
        field: &'static str,
    },
    /// `period / count` is below one microsecond.
    #[error(
        "emission interval period/count = {period_us}us/{count} is below 1us: at most one request per microsecond per key"
    )]
    TooFast {
        /// The period in microseconds.
        period_us: u64,
        /// The count.
        count: u64,
    },
    /// `burst * period / count` overflows or exceeds [`MAX_BURST_OFFSET_US`].
    #[error(
        "burst offset burst*period/count = {burst}*{emission_interval_us}us is larger than 100 years"
    )]
    BurstOffsetTooLarge {
        /// The burst.
        burst: u64,
        /// The emission interval in microseconds.
        emission_interval_us: u64,
    },
}

/// A GCRA limit: a bucket of `burst` tokens refilled at `count` tokens per `period`.
///
/// Its derived values are the emission interval `EI = period / count` (truncated to whole
/// microseconds) and the burst offset `BO = EI * burst`. A limit is always valid: the
/// constructor refuses zeros, an `EI` below one microsecond and a `BO` above
/// [`MAX_BURST_OFFSET_US`].
///
/// ```
/// use tower_ratelimits::Limit;
/// use std::time::Duration;
///
/// let limit = Limit::new(20, 20, Duration::from_secs(1)).unwrap();
/// assert_eq!(limit.emission_interval_us(), 50_000);
/// assert_eq!(limit.burst_offset_us(), 1_000_000);
/// assert!(Limit::new(0, 20, Duration::from_secs(1)).is_err());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    burst: u64,
    count: u64,
    period_us: u64,
    emission_interval_us: u64,
    burst_offset_us: u64,
}

impl Limit {
    /// Builds a limit, validating it.
    pub fn new(burst: u64, count: u64, period: Duration) -> Result<Self, LimitError> {
        Self::from_micros(burst, count, duration_us(period))
    }

    /// Builds a limit from a period in microseconds, validating it.
    pub fn from_micros(burst: u64, count: u64, period_us: u64) -> Result<Self, LimitError> {
        for (field, v) in [("burst", burst), ("count", count), ("period", period_us)] {
            if v == 0 {
                return Err(LimitError::Zero { field });
            }
        }
        let emission_interval_us = period_us / count;
        if emission_interval_us == 0 {
            return Err(LimitError::TooFast { period_us, count });
        }
        let burst_offset_us = emission_interval_us
            .checked_mul(burst)
            .filter(|bo| *bo <= MAX_BURST_OFFSET_US)
            .ok_or(LimitError::BurstOffsetTooLarge {
                burst,
                emission_interval_us,
            })?;
        Ok(Self {
            burst,
            count,
            period_us,
            emission_interval_us,
            burst_offset_us,
        })
    }

    /// The most tokens the bucket holds: the largest burst of cost-1 requests.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Tokens added per period.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The period, in microseconds.
    pub fn period_us(&self) -> u64 {
        self.period_us
    }

    /// The period.
    pub fn period(&self) -> Duration {
        Duration::from_micros(self.period_us)
    }

    /// `period / count` in whole microseconds: one token is added every emission interval.
    pub fn emission_interval_us(&self) -> u64 {
        self.emission_interval_us
    }

    /// `emission interval * burst`: how far the TAT may run ahead of now.
    pub fn burst_offset_us(&self) -> u64 {
        self.burst_offset_us
    }
}

impl fmt::Debug for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limit")
            .field("burst", &self.burst)
            .field("count", &self.count)
            .field("period_us", &self.period_us)
            .finish()
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} per {}us (burst {})",
            self.count, self.period_us, self.burst
        )
    }
}

/// What limits one bucket: a GCRA [`Limit`] or a [`TieredLimit`] (burst tiers).
///
/// Anything that takes a quota takes either, through `Into<Quota>`:
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{Limit, Limits, Quota};
/// use tower_ratelimits::tiers::{Tier, TieredLimit};
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
pub enum Quota {
    /// A GCRA bucket.
    Gcra(Limit),
    /// Burst tiers (`spec/burst-tiers.md`).
    Tiered(Arc<TieredLimit>),
}

impl Quota {
    /// The GCRA limit, if this is one.
    pub fn as_gcra(&self) -> Option<&Limit> {
        match self {
            Quota::Gcra(l) => Some(l),
            Quota::Tiered(_) => None,
        }
    }

    /// The tiers, if this is a tiered limit.
    pub fn as_tiered(&self) -> Option<&TieredLimit> {
        match self {
            Quota::Gcra(_) => None,
            Quota::Tiered(t) => Some(t),
        }
    }

    /// The largest cost a request can ever be granted: the burst, or the sum of the tiers'
    /// limits.
    pub fn max_cost(&self) -> u64 {
        match self {
            Quota::Gcra(l) => l.burst(),
            Quota::Tiered(t) => t.capacity(),
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

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Quota::Gcra(l) => l.fmt(f),
            Quota::Tiered(t) => t.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates() {
        assert_eq!(
            Limit::from_micros(0, 1, 1),
            Err(LimitError::Zero { field: "burst" })
        );
        assert_eq!(
            Limit::from_micros(1, 0, 1),
            Err(LimitError::Zero { field: "count" })
        );
        assert_eq!(
            Limit::from_micros(1, 1, 0),
            Err(LimitError::Zero { field: "period" })
        );
        assert!(matches!(
            Limit::from_micros(1, 1001, 1000),
            Err(LimitError::TooFast { .. })
        ));
        assert!(matches!(
            Limit::from_micros(u64::MAX, 1, 2),
            Err(LimitError::BurstOffsetTooLarge { .. })
        ));
        assert!(matches!(
            Limit::from_micros(2, 1, MAX_BURST_OFFSET_US),
            Err(LimitError::BurstOffsetTooLarge { .. })
        ));
        let l = Limit::from_micros(1, 1, MAX_BURST_OFFSET_US).unwrap();
        assert_eq!(l.burst_offset_us(), MAX_BURST_OFFSET_US);
        // EI truncates: 1s / 3 = 333_333us.
        let l = Limit::from_micros(3, 3, 1_000_000).unwrap();
        assert_eq!(l.emission_interval_us(), 333_333);
        assert_eq!(l.burst_offset_us(), 999_999);
    }
}
