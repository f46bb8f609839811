//! The Generic Cell Rate Algorithm, as pure functions of `(limit, stored TAT, now, cost)`.
//!
//! No I/O and no clock: every backend (memory, Redis) computes exactly these values, and the
//! Redis Lua script mirrors this file line by line. The contract is `docs/gcra.md`.
//!
//! A bucket's whole state is its theoretical arrival time (TAT) in microseconds. A missing
//! bucket is passed as `None`; a TAT at or before `now` means the same thing (a full bucket).
//! Arithmetic is done in `i128`, so no input can overflow or panic; a result that would not fit
//! in a `u64` TAT is reported as [`GcraError::TimeOverflow`].

use std::fmt;
use std::time::Duration;

use crate::time::duration_us;

/// The largest burst offset (`burst * period / count`) a limit may have: 100 years.
///
/// A TAT is at most `now + burst offset`; keeping it under 2^53 microseconds keeps every value
/// exact in a Redis Lua number (a double) until the year 2200.
pub const MAX_BURST_OFFSET_US: u64 = 100 * 365 * 86_400 * 1_000_000;

/// How far beyond what the crate writes a stored time may run before it is foreign: one
/// minute, for clocks that disagree (instances deciding on their own clocks, a server clock
/// stepped back). A TAT more than the larger of `BO + EI * max_debt` (this limit's bound) and
/// its writer's bound (the limit that wrote it, recorded with it: `docs/gcra.md`, "Changing a
/// limit") plus this ahead of now, or a lease deadline more than the lease time plus this, was
/// not written by the crate (another program's data, a corrupted value, a clock stepped
/// back): it is read as drained under the limit in force (a lease ending one lease time from
/// now) and replaced by that state. The Redis script holds the same value (`SLACK`).
pub const FOREIGN_SLACK_US: u64 = 60_000_000;

/// The default time to live of prefetched tokens ([`Limit::with_prefetch`]): one second.
pub(crate) const DEFAULT_PREFETCH_TTL_US: u32 = 1_000_000;

/// Why a limit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    /// `period / count` is not a whole number of microseconds, and the nearest emission
    /// interval that never admits more than configured (`period / count` rounded up) would
    /// admit more than 0.1% less.
    #[error(
        "period/count = {period_us}us/{count} is not a whole number of microseconds: rounded up to {emission_interval_us}us (never more than configured), it would admit {shortfall_permille}\u{2030} fewer than {count} per period; use a count that divides the period within 0.1%"
    )]
    Inexact {
        /// The period in microseconds.
        period_us: u64,
        /// The count.
        count: u64,
        /// `period / count` rounded up.
        emission_interval_us: u64,
        /// How much slower the rounded interval is, in thousandths (rounded down).
        shortfall_permille: u64,
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
    /// `(burst + max_debt) * period / count`, how far a bucket in full debt runs ahead of now,
    /// overflows or exceeds [`MAX_BURST_OFFSET_US`].
    #[error(
        "max_debt {max_debt} with burst {burst}: (burst+max_debt)*{emission_interval_us}us is larger than 100 years"
    )]
    DebtTooLarge {
        /// The burst.
        burst: u64,
        /// The most units of debt asked for.
        max_debt: u64,
        /// The emission interval in microseconds.
        emission_interval_us: u64,
    },
    /// `prefetch` above the burst: an instance cannot hold more tokens than the bucket has.
    #[error("prefetch {prefetch} is above the burst of {burst}")]
    PrefetchAboveBurst {
        /// The prefetch asked for.
        prefetch: u64,
        /// The burst.
        burst: u64,
    },
    /// A `prefetch_ttl` outside 1 ms ..= 1 h.
    #[error("prefetch_ttl {ttl_us}us is outside 1ms..=1h")]
    PrefetchTtl {
        /// The time to live asked for, in microseconds.
        ttl_us: u64,
    },
}

/// The longest [`Limit::with_prefetch`] time to live: one hour (tokens held longer than that
/// are capacity other instances cannot use for as long).
pub(crate) const MAX_PREFETCH_TTL_US: u64 = 3_600_000_000;

/// A GCRA limit: a bucket of `burst` tokens refilled at `count` tokens per `period`.
///
/// Its derived values are the emission interval `EI = period / count`, in whole microseconds
/// and **rounded up**, so a limit never admits more than configured, and the burst offset
/// `BO = EI * burst`. A limit is always valid: the constructor refuses zeros, more than one
/// request per microsecond, a rate that whole microseconds cannot express within 0.1%
/// ([`LimitError::Inexact`]: 600,000 per second would be 1 every 2 us, a third less) and a
/// `BO` above [`MAX_BURST_OFFSET_US`].
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
///
/// A limit also bounds **debt**: units charged after the fact ([`Mode::Charge`], what a
/// [`Settle`](crate::Settle) overrun is charged with) may take the bucket up to
/// [`max_debt`](Self::max_debt) units below empty; the key is then denied until time repays
/// them. The default is the burst (or, for a burst offset above 50 years, as much as keeps the
/// bucket within 100 years); [`with_max_debt`](Self::with_max_debt) sets it, and 0 forgives
/// every unit that does not fit.
///
/// ```
/// use tower_ratelimits::Limit;
/// use std::time::Duration;
///
/// let limit = Limit::new(100, 100, Duration::from_secs(3600)).unwrap();
/// assert_eq!(limit.max_debt(), 100);
/// assert_eq!(limit.with_max_debt(0).unwrap().max_debt(), 0);
/// ```
///
/// A limit may let instances of a shared store **prefetch** tokens of a hot key
/// ([`with_prefetch`](Self::with_prefetch)): the Redis backend then takes up to that many
/// tokens in one call and answers the key's next requests from them, locally (`docs/gcra.md`,
/// "Prefetched tokens"). It never changes what a limit admits in total; the in-memory backend
/// ignores it.
///
/// ```
/// use tower_ratelimits::Limit;
/// use std::time::Duration;
///
/// let limit = Limit::new(500, 300, Duration::from_secs(1)).unwrap()
///     .with_prefetch(50, Duration::from_secs(1)).unwrap();
/// assert_eq!((limit.prefetch(), limit.prefetch_ttl()), (50, Duration::from_secs(1)));
/// assert!(limit.with_prefetch(501, Duration::from_secs(1)).is_err());
/// ```
///
/// [`Mode::Charge`]: crate::Mode::Charge
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    burst: u64,
    count: u64,
    period_us: u64,
    emission_interval_us: u64,
    burst_offset_us: u64,
    /// `EI * max_debt`: how far beyond the burst offset a charge may take the TAT.
    debt_offset_us: u64,
    /// A stored TAT further ahead of now is foreign (read on every decision): this limit's
    /// bound `BO + EI * max_debt` plus [`FOREIGN_SLACK_US`], or the bound of the limit that
    /// wrote the TAT when that is larger ([`Limit::reading`], for one decision).
    foreign_after_us: u64,
    /// Tokens an instance may prefetch (0: none); at most the burst.
    prefetch: u32,
    /// How long prefetched tokens live, in microseconds (at most one hour).
    prefetch_ttl_us: u32,
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
        if period_us < count {
            return Err(LimitError::TooFast { period_us, count });
        }
        // Rounded up: the limit may only ever admit less than configured, and by at most 0.1%
        // (EI * count <= 1.001 * period).
        let emission_interval_us = period_us.div_ceil(count);
        let rounded = u128::from(emission_interval_us) * u128::from(count);
        if rounded * 1000 > u128::from(period_us) * 1001 {
            let shortfall = (rounded - u128::from(period_us)) * 1000 / rounded;
            return Err(LimitError::Inexact {
                period_us,
                count,
                emission_interval_us,
                shortfall_permille: u64::try_from(shortfall).unwrap_or(u64::MAX),
            });
        }
        Self::with_interval(burst, count, period_us, emission_interval_us)
    }

    /// A region's share of a limit across regions (`docs/regions.md`): `burst` tokens and
    /// `count` per `period_us`, never admitting more. The emission interval is rounded up
    /// without the 0.1% rule (a share's rate is whatever the split gave: a slower interval
    /// only admits less), the rate is at most one a microsecond, and the burst at most what
    /// keeps the burst offset within 100 years. `None`: no burst or no rate, nothing can be
    /// admitted (the region is closed to the key).
    pub(crate) fn share(burst: u64, count: u64, period_us: u64) -> Option<Limit> {
        if burst == 0 || count == 0 || period_us == 0 {
            return None;
        }
        let count = count.min(period_us);
        let emission_interval_us = period_us.div_ceil(count);
        let burst = burst.min(MAX_BURST_OFFSET_US / emission_interval_us);
        Self::with_interval(burst, count, period_us, emission_interval_us).ok()
    }

    /// The limit of an emission interval already chosen (`EI >= period / count`).
    fn with_interval(
        burst: u64,
        count: u64,
        period_us: u64,
        emission_interval_us: u64,
    ) -> Result<Self, LimitError> {
        let burst_offset_us = emission_interval_us
            .checked_mul(burst)
            .filter(|bo| *bo <= MAX_BURST_OFFSET_US)
            .ok_or(LimitError::BurstOffsetTooLarge {
                burst,
                emission_interval_us,
            })?;
        // The default debt: the burst, or as much of it as keeps the bucket within 100 years.
        let max_debt = burst.min((MAX_BURST_OFFSET_US - burst_offset_us) / emission_interval_us);
        Ok(Self {
            burst,
            count,
            period_us,
            emission_interval_us,
            burst_offset_us,
            debt_offset_us: max_debt * emission_interval_us,
            foreign_after_us: burst_offset_us + max_debt * emission_interval_us + FOREIGN_SLACK_US,
            prefetch: 0,
            prefetch_ttl_us: DEFAULT_PREFETCH_TTL_US,
        })
    }

    /// How far ahead of `now` the stored TAT `stored` runs (0: none, or in the past); for a
    /// foreign one (further than the crate writes, see [`FOREIGN_SLACK_US`]), the burst
    /// offset: the bucket drained under this limit, which is what it is replaced with
    /// ([`Limit::repair`]).
    #[inline(always)]
    pub(crate) fn ahead_of(&self, stored: Option<u64>, now: u64) -> u64 {
        let ahead = stored.unwrap_or(0).saturating_sub(now);
        if ahead > self.foreign_after_us {
            self.burst_offset_us()
        } else {
            ahead
        }
    }

    /// Whether `stored` runs further ahead of `now` than the crate writes (as this limit reads
    /// it): foreign, read as drained ([`ahead_of`](Self::ahead_of)).
    #[inline]
    pub(crate) fn is_foreign(&self, stored: Option<u64>, now: u64) -> bool {
        stored.unwrap_or(0).saturating_sub(now) > self.foreign_after_us
    }

    /// The TAT that replaces a foreign `stored` at `now`: the bucket drained under this limit
    /// (`now + BO`), whatever the decision that read it (a denial writes it too: left in place,
    /// a foreign TAT would be read as drained for ever). `None` when `stored` is not foreign.
    pub(crate) fn repair(&self, stored: Option<u64>, now: u64) -> Option<u64> {
        self.is_foreign(stored, now)
            .then(|| now.saturating_add(self.burst_offset_us()))
    }

    /// The furthest ahead of now a write under this limit sets the TAT: `BO + EI * max_debt`
    /// (recorded with every write as the writer's bound: `docs/gcra.md`, "Changing a limit").
    #[inline]
    pub(crate) fn bound_us(&self) -> u64 {
        self.burst_offset_us() + self.debt_offset_us
    }

    /// This limit reading a TAT written under a limit whose bound was `writer_bound_us` (the
    /// limit the bucket had before a change): a TAT up to that far ahead (plus the slack) is
    /// the crate's, not foreign. For one decision; what it writes is this limit's.
    #[inline]
    pub(crate) fn reading(&self, writer_bound_us: u64) -> Self {
        Self {
            foreign_after_us: self
                .foreign_after_us
                .max(writer_bound_us.saturating_add(FOREIGN_SLACK_US)),
            ..*self
        }
    }

    /// This limit with at most `max_debt` units of debt (0: none, every overrun that does not
    /// fit is forgiven); refused when `(burst + max_debt) * EI` exceeds
    /// [`MAX_BURST_OFFSET_US`].
    pub fn with_max_debt(self, max_debt: u64) -> Result<Self, LimitError> {
        let fits = max_debt
            .checked_mul(self.emission_interval_us)
            .and_then(|d| d.checked_add(self.burst_offset_us()))
            .is_some_and(|ahead| ahead <= MAX_BURST_OFFSET_US);
        if !fits {
            return Err(LimitError::DebtTooLarge {
                burst: self.burst,
                max_debt,
                emission_interval_us: self.emission_interval_us,
            });
        }
        Ok(Self {
            debt_offset_us: max_debt * self.emission_interval_us,
            foreign_after_us: self.burst_offset_us()
                + max_debt * self.emission_interval_us
                + FOREIGN_SLACK_US,
            ..self
        })
    }

    /// This limit with prefetched tokens: an instance of a shared store may take up to
    /// `units` tokens of a key in one call and use them for up to `ttl` (0 units: none, the
    /// default). Refused above the burst, above `u32::MAX` units, or for a `ttl` outside
    /// 1 ms ..= 1 h.
    pub fn with_prefetch(self, units: u64, ttl: Duration) -> Result<Self, LimitError> {
        let ttl_us = duration_us(ttl);
        if units > self.burst {
            return Err(LimitError::PrefetchAboveBurst {
                prefetch: units,
                burst: self.burst,
            });
        }
        let Some(ttl) = u32::try_from(ttl_us)
            .ok()
            .filter(|t| (1_000..=MAX_PREFETCH_TTL_US).contains(&u64::from(*t)))
        else {
            return Err(LimitError::PrefetchTtl { ttl_us });
        };
        let prefetch = u32::try_from(units).map_err(|_| LimitError::PrefetchAboveBurst {
            prefetch: units,
            burst: u64::from(u32::MAX),
        })?;
        Ok(Self {
            prefetch,
            prefetch_ttl_us: ttl,
            ..self
        })
    }

    /// The most tokens an instance prefetches (0: none); see
    /// [`with_prefetch`](Self::with_prefetch).
    pub fn prefetch(&self) -> u64 {
        u64::from(self.prefetch)
    }

    /// How long prefetched tokens live (1 s unless set).
    pub fn prefetch_ttl(&self) -> Duration {
        Duration::from_micros(self.prefetch_ttl_us())
    }

    /// [`prefetch_ttl`](Self::prefetch_ttl) in microseconds.
    pub(crate) fn prefetch_ttl_us(&self) -> u64 {
        u64::from(self.prefetch_ttl_us)
    }

    /// The most units a charge may take the bucket below empty ([`Mode::Charge`]).
    ///
    /// [`Mode::Charge`]: crate::Mode::Charge
    pub fn max_debt(&self) -> u64 {
        self.debt_offset_us / self.emission_interval_us
    }

    /// `EI * max_debt`: how far beyond the burst offset a charge may take the TAT.
    pub fn debt_offset_us(&self) -> u64 {
        self.debt_offset_us
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

    /// `period / count` in whole microseconds, rounded up: one token is added every emission
    /// interval.
    pub fn emission_interval_us(&self) -> u64 {
        self.emission_interval_us
    }

    /// The effective window (draft-11 `t`) of a bucket that is full again in
    /// `reset_after_us` and holds `remaining` units: the time until one more unit is
    /// available, `ahead + (r + 1)·EI − BO` (with `r = 0`, the wait before a request of cost 1
    /// passes; on a full bucket, one emission interval). The one window function.
    pub(crate) fn window_us(&self, reset_after_us: u64, remaining: u64) -> u64 {
        reset_after_us
            .saturating_add(
                remaining
                    .saturating_add(1)
                    .saturating_mul(self.emission_interval_us()),
            )
            .saturating_sub(self.burst_offset_us())
    }

    /// `emission interval * burst`: how far the TAT may run ahead of now.
    #[inline(always)]
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
            .field("max_debt", &self.max_debt())
            .field("prefetch", &self.prefetch)
            .field("prefetch_ttl_us", &self.prefetch_ttl_us)
            .finish()
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} per {} (burst {})",
            self.count,
            crate::time::format_duration_us(self.period_us),
            self.burst
        )
    }
}

/// The outcome of one GCRA computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcraOutcome {
    /// Whether the request fits (spend/check) or something was refunded (refund).
    pub allowed: bool,
    /// Tokens left in the bucket after this request.
    pub remaining: u64,
    /// Microseconds until an equal request would be allowed (0 when it would be now).
    pub retry_after_us: u64,
    /// Microseconds until the bucket is full again.
    pub reset_after_us: u64,
    /// The TAT to store, when the computation changes the bucket; `None` leaves it unchanged.
    pub new_tat: Option<u64>,
}

/// Why a GCRA computation could not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GcraError {
    /// The new TAT would not fit in 64-bit microseconds (a clock or a stored value near the
    /// end of `u64` time; never a real clock).
    #[error("theoretical arrival time overflows 64-bit microseconds")]
    TimeOverflow,
}

/// Spends `cost` tokens if they are available.
///
/// On a denial the store must stay unchanged (`new_tat` is `None`). A cost of 0 is a probe: it
/// reports the bucket without consuming anything. Costs are checked against the burst once,
/// when a transaction is built ([`BucketTx::new`](crate::BucketTx::new)); a cost above the
/// burst is simply never allowed here.
///
/// ```
/// use tower_ratelimits::Limit;
/// use tower_ratelimits::__private::gcra;
/// use std::time::Duration;
///
/// let limit = Limit::new(20, 20, Duration::from_secs(1)).unwrap();
/// let t0 = 1_000_000_000;
/// let d = gcra::spend(&limit, None, t0, 1).unwrap();
/// assert!(d.allowed);
/// assert_eq!(d.remaining, 19);
/// assert_eq!(d.new_tat, Some(t0 + 50_000));
/// ```
pub fn spend(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<GcraOutcome, GcraError> {
    // `check` already leaves `new_tat` empty on a denial; a spend writes what it computes.
    check(limit, stored_tat, now, cost)
}

/// Computes what [`spend`] would decide. `new_tat` is the TAT a spend would store; a caller
/// that only checks must not write it.
///
/// This is the GCRA rule of `docs/gcra.md`, written once for every backend (the Redis script's
/// `gcra` function mirrors it). The spec's quantities are measured from `now`, so nothing
/// overflows: `ahead = tat - now`, `need = ahead + EI * cost` (the new TAT's distance from now),
/// and the request fits when `need <= BO`; then `difference = BO - need`.
pub fn check(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<GcraOutcome, GcraError> {
    let ei = limit.emission_interval_us();
    let bo = limit.burst_offset_us();
    // A TAT in the past cannot bank capacity: max(stored, now) - now; a foreign one is none.
    let ahead = limit.ahead_of(stored_tat, now);
    let incr = ei.saturating_mul(cost);
    // `None`: beyond u64, which only a TAT stored near the end of u64 time can cause; a
    // denial whose wait saturates.
    let need = ahead.checked_add(incr).filter(|&n| n <= bo);
    let Some(need) = need else {
        return Ok(GcraOutcome {
            allowed: false,
            remaining: bo.saturating_sub(ahead) / ei,
            retry_after_us: ahead.checked_add(incr).map_or(u64::MAX, |n| n - bo),
            reset_after_us: ahead,
            new_tat: None,
        });
    };
    let difference = bo - need;
    Ok(GcraOutcome {
        allowed: true,
        remaining: difference / ei,
        retry_after_us: incr.saturating_sub(difference),
        reset_after_us: need,
        new_tat: Some(now.checked_add(need).ok_or(GcraError::TimeOverflow)?),
    })
}

/// Decides a spend of **as many units as fit** between `min` and `max` (a partial grant, as
/// go-redis/redis_rate's `AllowAtMost` and Envoy's partial token consumption): the most units
/// `k <= max` the bucket holds at `now`, when `k >= min`. Returns the outcome and `k`.
///
/// The outcome is exactly [`check`]'s for a spend of `k` units (so `remaining`, `retry_after`
/// and `reset_after` follow from what was granted); when fewer than `min` units fit, it is the
/// denial of `min` units (its `retry_after` is the wait before `min` units fit) and `k` is 0.
/// `max` may exceed the burst; `min` is checked against it when a transaction is built. With
/// `min == max` this is [`check`] of that cost.
///
/// ```
/// use tower_ratelimits::Limit;
/// use tower_ratelimits::__private::gcra;
/// use std::time::Duration;
///
/// let limit = Limit::new(10, 10, Duration::from_secs(1)).unwrap();
/// let t0 = 1_000_000_000;
/// // 10 fit: asked for 1..=25, granted 10.
/// let (d, granted) = gcra::check_range(&limit, None, t0, 1, 25).unwrap();
/// assert!(d.allowed);
/// assert_eq!((granted, d.remaining), (10, 0));
/// // Now none fits: denied, with the wait before one unit does.
/// let (d, granted) = gcra::check_range(&limit, d.new_tat, t0, 1, 25).unwrap();
/// assert!(!d.allowed);
/// assert_eq!((granted, d.retry_after_us), (0, 100_000));
/// ```
pub fn check_range(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    min: u64,
    max: u64,
) -> Result<(GcraOutcome, u64), GcraError> {
    // Whole units that fit under the burst offset now (0 when a lowered limit leaves the TAT
    // beyond it); then the most of them the range takes, or `min` when too few fit.
    let ahead = limit.ahead_of(stored_tat, now);
    let fits = limit.burst_offset_us().saturating_sub(ahead) / limit.emission_interval_us();
    let cost = fits.min(max).max(min);
    let out = check(limit, stored_tat, now, cost)?;
    Ok((out, if out.allowed { cost } else { 0 }))
}

/// Charges `cost` units after the fact ([`Mode::Charge`](crate::Mode::Charge): a settle's
/// overrun): as many whole units as fit between the TAT and `BO + EI * max_debt` ahead of
/// `now`, so the bucket may go up to `max_debt` units below empty; the rest is forgiven. Never
/// denied. Returns the outcome and the units charged.
///
/// The outcome reports the bucket after the charge: `remaining` (0 in debt), `reset_after`,
/// and `retry_after`, the wait before one unit fits again (in debt: until time has repaid the
/// debt and one unit more).
///
/// ```
/// use tower_ratelimits::Limit;
/// use tower_ratelimits::__private::gcra;
/// use std::time::Duration;
///
/// // 10 per second, burst 10, up to 10 units of debt.
/// let limit = Limit::new(10, 10, Duration::from_secs(1)).unwrap();
/// let t0 = 1_000_000_000;
/// // 25 units on a full bucket: 20 are charged (10 of them debt), 5 forgiven.
/// let (d, charged) = gcra::charge(&limit, None, t0, 25).unwrap();
/// assert_eq!((charged, d.remaining), (20, 0));
/// // One unit fits again once the debt and one unit are repaid: 1.1 s.
/// assert_eq!(d.retry_after_us, 1_100_000);
/// assert!(!gcra::check(&limit, d.new_tat, t0 + 1_099_999, 1).unwrap().allowed);
/// assert!(gcra::check(&limit, d.new_tat, t0 + 1_100_000, 1).unwrap().allowed);
/// ```
pub fn charge(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<(GcraOutcome, u64), GcraError> {
    let ei = limit.emission_interval_us();
    let bo = limit.burst_offset_us();
    let ahead = limit.ahead_of(stored_tat, now);
    // Whole units that fit before the debt bound (`BO + EI * max_debt` is within 100 years).
    let fits = (bo + limit.debt_offset_us()).saturating_sub(ahead) / ei;
    let charged = fits.min(cost);
    // At most the debt bound ahead of now, so no overflow below it.
    let after = ahead + ei * charged;
    let new_tat = (charged > 0)
        .then(|| now.checked_add(after).ok_or(GcraError::TimeOverflow))
        .transpose()?;
    Ok((
        GcraOutcome {
            allowed: true,
            remaining: bo.saturating_sub(after) / ei,
            retry_after_us: after.saturating_add(ei).saturating_sub(bo),
            reset_after_us: after,
            new_tat,
        },
        charged,
    ))
}

/// Gives back `cost` tokens, never above a full bucket.
///
/// `allowed` tells whether anything was refunded. A missing bucket or one whose TAT is in the
/// past is full already: nothing changes. A foreign TAT is read as drained (as every
/// computation reads it), so the refund gives back from a drained bucket and its `new_tat`
/// replaces the foreign value.
pub fn refund(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<GcraOutcome, GcraError> {
    let ahead = limit.ahead_of(stored_tat, now);
    if ahead == 0 {
        return Ok(GcraOutcome {
            allowed: false,
            remaining: limit.burst(),
            retry_after_us: 0,
            reset_after_us: 0,
            new_tat: None,
        });
    }
    let ei = limit.emission_interval_us();
    let bo = limit.burst_offset_us();
    // new_tat = max(tat - EI * cost, now), measured from now.
    let after = ahead.saturating_sub(ei.saturating_mul(cost));
    let new_tat = now.checked_add(after).ok_or(GcraError::TimeOverflow)?;
    Ok(GcraOutcome {
        allowed: after < ahead,
        remaining: bo.saturating_sub(after) / ei,
        retry_after_us: 0,
        reset_after_us: after,
        // Written when it changes the store: a refund, or a foreign value replaced.
        new_tat: (Some(new_tat) != stored_tat).then_some(new_tat),
    })
}

/// A regional share bucket's TAT after its limit changes from `old` to `new` at `now`
/// (`docs/regions.md`): the bucket keeps its whole tokens under `old`, capped at the new burst
/// (a debt stays the same number of units owed), never its TAT. A region giving up rate gains
/// no token, and burst given to it arrives empty. `None`: the bucket is full under `new`.
///
/// The one exception to the change rule of `docs/gcra.md` (which keeps the TAT): for the
/// shares of a limit across regions only. A partly refilled token is not kept (never more
/// than before). A foreign TAT is read as drained, as every computation reads it.
///
/// ```
/// use tower_ratelimits::Limit;
/// use tower_ratelimits::__private::gcra;
///
/// let s = 1_000_000;
/// let now = 1_700_000_000 * s;
/// // 10 a second, burst 10, 4 tokens spent: 6 left.
/// let old = Limit::from_micros(10, 10, s).unwrap();
/// let tat = now + 4 * 100_000;
/// // The region gives up half its rate and burst: 5 tokens (capped), at the new interval.
/// let new = Limit::from_micros(5, 5, s).unwrap();
/// assert_eq!(gcra::keep_tokens(&old, &new, Some(tat), now), Ok(None));
/// // It is given twice the burst instead: still 6 tokens, 14 to refill.
/// let new = Limit::from_micros(20, 10, s).unwrap();
/// assert_eq!(gcra::keep_tokens(&old, &new, Some(tat), now), Ok(Some(now + 14 * 100_000)));
/// ```
pub fn keep_tokens(
    old: &Limit,
    new: &Limit,
    stored_tat: Option<u64>,
    now: u64,
) -> Result<Option<u64>, GcraError> {
    let ahead = i128::from(old.ahead_of(stored_tat, now));
    let ei = i128::from(old.emission_interval_us());
    // Whole tokens, rounded down (a debt rounded up): never more than the bucket held.
    let tokens = (i128::from(old.burst_offset_us()) - ahead).div_euclid(ei);
    let kept = tokens.min(i128::from(new.burst()));
    let after = i128::from(new.emission_interval_us()) * (i128::from(new.burst()) - kept);
    if after <= 0 {
        return Ok(None);
    }
    u64::try_from(i128::from(now) + after)
        .map(Some)
        .map_err(|_| GcraError::TimeOverflow)
}

#[cfg(test)]
mod limit_tests;
