//! Per-key concurrency limits: at most `max` requests of one key in flight at once.
//!
//! A request in flight holds a **lease**: an id and a deadline. A lease is live while its
//! deadline is after now (`deadline > now`); the request gives it back when it ends, and a
//! lease nobody gave back (its process died) stops counting at its deadline. The rule below is
//! the whole decision, as a pure function of the live leases' count; every backend counts them
//! its own way (a vector per key in memory, a sorted set per key in Redis) and decides with it
//! (the script mirrors it). The contract is `docs/concurrency.md`.

use std::fmt;
use std::time::Duration;

use crate::algo::gcra::MAX_BURST_OFFSET_US;
use crate::time::duration_us;

/// The most requests one key may have in flight under a [`ConcurrencyLimit`]: every live
/// lease of a key is held (a vector in memory, a sorted set in Redis), so the bound is the
/// memory one key can take.
pub const MAX_CONCURRENCY: u64 = 100_000;

/// The lease of a concurrency limit written without one (YAML, the admin API): a request
/// holding its slot longer than a minute (or whose instance died) stops counting.
pub(crate) const DEFAULT_LEASE_US: u64 = 60_000_000;

/// The `retry_after` a denial reports by default (a hint: when a slot frees is not known).
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Why a concurrency limit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// `max` or the lease time was zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The field that was zero.
        field: &'static str,
    },
    /// `max` above [`MAX_CONCURRENCY`].
    #[error("concurrency {max} is above the most a key can hold ({MAX_CONCURRENCY})")]
    TooMany {
        /// The requested maximum.
        max: u64,
    },
    /// A lease time or a retry hint longer than 100 years.
    #[error("{field} is longer than 100 years")]
    TooLong {
        /// The field.
        field: &'static str,
    },
}

/// At most `max` requests of one key in flight at once, each holding a lease that expires
/// after `lease` if it is never given back (a crashed instance), and a `retry_after` hint for
/// denied requests.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::ConcurrencyLimit;
///
/// let limit = ConcurrencyLimit::new(10, Duration::from_secs(60))
///     .unwrap()
///     .retry_after(Duration::from_millis(250))
///     .unwrap();
/// assert_eq!((limit.max(), limit.lease_us(), limit.retry_after_us()), (10, 60_000_000, 250_000));
/// assert!(ConcurrencyLimit::new(0, Duration::from_secs(60)).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConcurrencyLimit {
    max: u64,
    lease_us: u64,
    retry_after_us: u64,
}

impl ConcurrencyLimit {
    /// `max` requests in flight per key, each lease expiring after `lease` (whole
    /// microseconds), with the default `retry_after` hint of one second.
    pub fn new(max: u64, lease: Duration) -> Result<Self, ConcurrencyError> {
        Self::from_micros(max, duration_us(lease))
    }

    /// [`new`](Self::new) with the lease time in microseconds.
    pub fn from_micros(max: u64, lease_us: u64) -> Result<Self, ConcurrencyError> {
        if max == 0 {
            return Err(ConcurrencyError::Zero {
                field: "concurrency",
            });
        }
        if max > MAX_CONCURRENCY {
            return Err(ConcurrencyError::TooMany { max });
        }
        if lease_us == 0 {
            return Err(ConcurrencyError::Zero { field: "lease" });
        }
        if lease_us > MAX_BURST_OFFSET_US {
            return Err(ConcurrencyError::TooLong { field: "lease" });
        }
        Ok(Self {
            max,
            lease_us,
            retry_after_us: duration_us(DEFAULT_RETRY_AFTER),
        })
    }

    /// The `retry_after` a denial reports (a hint; zero is allowed).
    pub fn retry_after(mut self, hint: Duration) -> Result<Self, ConcurrencyError> {
        let us = duration_us(hint);
        if us > MAX_BURST_OFFSET_US {
            return Err(ConcurrencyError::TooLong {
                field: "retry_after",
            });
        }
        self.retry_after_us = us;
        Ok(self)
    }

    /// The most requests of one key in flight at once.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// How long a lease lives when it is never given back, in microseconds.
    pub fn lease_us(&self) -> u64 {
        self.lease_us
    }

    /// The `retry_after` a denial reports, in microseconds.
    pub fn retry_after_us(&self) -> u64 {
        self.retry_after_us
    }

    /// `max` slots (cut to 1..=[`MAX_CONCURRENCY`]) with the default lease and hint.
    pub(crate) fn with_defaults(max: u64) -> Self {
        Self {
            max: max.clamp(1, MAX_CONCURRENCY),
            lease_us: DEFAULT_LEASE_US,
            retry_after_us: duration_us(DEFAULT_RETRY_AFTER),
        }
    }

    /// The same lease and hint with `max` slots (an adaptive limit's number now; at least 1).
    pub(crate) fn with_max(mut self, max: u64) -> Self {
        self.max = max.clamp(1, MAX_CONCURRENCY);
        self
    }
}

impl fmt::Display for ConcurrencyLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in flight (lease {}, retry after {})",
            self.max,
            crate::time::format_duration_us(self.lease_us),
            crate::time::format_duration_us(self.retry_after_us)
        )
    }
}

/// The decision of one transaction on a concurrency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyOutcome {
    /// Allowed: a slot was free (or nothing was asked).
    pub allowed: bool,
    /// Slots left after this transaction.
    pub remaining: u64,
    /// The hint a denial reports (0 when allowed).
    pub retry_after_us: u64,
    /// Reported as `reset_after`: the same as `retry_after_us` (when every slot is free again
    /// is not known).
    pub reset_after_us: u64,
}

/// The rule: a request asking for a slot (`take`; `false` is a probe of cost 0, which takes
/// nothing and is always allowed) on a key with `live` live leases is allowed when fewer than
/// `max` are live. `remaining` counts the slots left after it; a denial reports the limit's
/// hint as `retry_after`. `live` may exceed `max` (the limit was lowered by a reload): then
/// nothing is free until enough leases end.
pub fn decide(limit: &ConcurrencyLimit, live: u64, take: bool) -> ConcurrencyOutcome {
    let used = live.saturating_add(u64::from(take));
    if used <= limit.max || !take {
        return ConcurrencyOutcome {
            allowed: true,
            remaining: limit.max.saturating_sub(used),
            retry_after_us: 0,
            reset_after_us: 0,
        };
    }
    ConcurrencyOutcome {
        allowed: false,
        remaining: 0,
        retry_after_us: limit.retry_after_us,
        reset_after_us: limit.retry_after_us,
    }
}

/// A slot already in use recorded after the fact (a charge, `take`; `false` is a probe):
/// always allowed, even beyond `max` (then nothing is free until enough leases end).
pub fn charge(limit: &ConcurrencyLimit, live: u64, take: bool) -> ConcurrencyOutcome {
    ConcurrencyOutcome {
        allowed: true,
        remaining: limit
            .max
            .saturating_sub(live.saturating_add(u64::from(take))),
        retry_after_us: 0,
        reset_after_us: 0,
    }
}

/// The deadline of a lease taken at `now`.
pub fn deadline(limit: &ConcurrencyLimit, now: u64) -> u64 {
    now.saturating_add(limit.lease_us)
}

/// Whether a lease with this deadline has not ended at `now`.
pub fn live(deadline: u64, now: u64) -> bool {
    deadline > now
}

/// Whether a lease with this deadline holds a slot at `now`: it has not ended. (A deadline
/// further ahead than the crate writes holds one too, cut to one lease time: [`read`].)
pub fn holds(deadline: u64, now: u64) -> bool {
    live(deadline, now)
}

/// A stored deadline as `limit` reads it at `now`: as it is when it is no further ahead than
/// the crate writes (the lease time, plus
/// [`FOREIGN_SLACK_US`](crate::algo::gcra::FOREIGN_SLACK_US) for clocks that disagree); a
/// deadline beyond that was not written by this crate under this limit (another program's
/// data, a corrupted value, a clock stepped back): it is cut to a lease taken now, which holds
/// a slot for one lease time (never for ever, never nothing), and the key's next write stores
/// it so (`docs/gcra.md`, "Foreign values").
pub fn read(limit: &ConcurrencyLimit, deadline: u64, now: u64) -> u64 {
    let furthest = limit
        .lease_us
        .saturating_add(crate::algo::gcra::FOREIGN_SLACK_US);
    if deadline.saturating_sub(now) > furthest {
        self::deadline(limit, now)
    } else {
        deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease whose deadline is further ahead than a lease runs (plus the slack for clocks)
    /// is cut to a lease taken now: it holds a slot for one lease time, not for ever and not
    /// nothing; one at the lease time is read as it is.
    #[test]
    fn a_deadline_beyond_the_lease_time_is_cut_to_one_lease() {
        let l = limit(3);
        let now = 5_000_000_000;
        let furthest = now + 1_000_000 + crate::algo::gcra::FOREIGN_SLACK_US;
        assert_eq!(read(&l, furthest, now), furthest);
        assert_eq!(read(&l, furthest + 1, now), now + 1_000_000);
        assert_eq!(read(&l, 1_000_000_000_000_000_000, now), now + 1_000_000);
        assert!(holds(read(&l, u64::MAX, now), now));
        assert!(!holds(now, now), "ended");
    }

    fn limit(max: u64) -> ConcurrencyLimit {
        ConcurrencyLimit::from_micros(max, 1_000_000).unwrap()
    }

    #[test]
    fn a_key_admits_exactly_max_in_flight() {
        let l = limit(3);
        let admitted: Vec<bool> = (0..5).map(|live| decide(&l, live, true).allowed).collect();
        assert_eq!(admitted, [true, true, true, false, false]);
        assert_eq!(decide(&l, 0, true).remaining, 2);
        assert_eq!(decide(&l, 2, true).remaining, 0);
        let denied = decide(&l, 3, true);
        assert_eq!((denied.remaining, denied.retry_after_us), (0, 1_000_000));
    }

    #[test]
    fn a_probe_takes_nothing_and_is_always_allowed() {
        let l = limit(2);
        assert_eq!(decide(&l, 1, false).remaining, 1);
        assert!(decide(&l, 2, false).allowed);
        assert!(decide(&l, 9, false).allowed);
        assert_eq!(decide(&l, 9, false).remaining, 0);
    }

    #[test]
    fn a_lease_counts_until_its_deadline() {
        let l = limit(1);
        let d = deadline(&l, 5);
        assert_eq!(d, 1_000_005);
        assert!(live(d, d - 1));
        assert!(!live(d, d));
    }

    #[test]
    fn limits_are_validated() {
        assert_eq!(
            ConcurrencyLimit::from_micros(0, 1),
            Err(ConcurrencyError::Zero {
                field: "concurrency"
            })
        );
        assert_eq!(
            ConcurrencyLimit::from_micros(1, 0),
            Err(ConcurrencyError::Zero { field: "lease" })
        );
        assert_eq!(
            ConcurrencyLimit::from_micros(MAX_CONCURRENCY + 1, 1),
            Err(ConcurrencyError::TooMany {
                max: MAX_CONCURRENCY + 1
            })
        );
        assert!(ConcurrencyLimit::from_micros(1, MAX_BURST_OFFSET_US + 1).is_err());
        assert!(limit(1).retry_after(Duration::from_secs(u64::MAX)).is_err());
    }
}
