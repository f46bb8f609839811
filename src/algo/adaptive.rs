//! Adaptive concurrency per key, the controller (issue 58, part 2; not yet a limit shape): how
//! a key's number of slots moves between `min` and `max` from what its own requests showed in
//! one window, as pure integer functions, so that every store (and the script) can run it on
//! the samples all instances merged.
//!
//! Two algorithms, as Netflix's concurrency-limits names them:
//! - **gradient** (after Gradient2): the window's mean latency (`short`) against the key's
//!   best recent latency (`long`: the least window's, drifting up 1/[`DRIFT`] a window, so a
//!   lasting slowdown becomes the new best): the limit is multiplied
//!   by `tolerance * long / short` (between 1/2 and 1), plus a queue of `sqrt(limit)` slots, and
//!   smoothed; a window whose requests never filled half the limit leaves it as it is (the key
//!   was not limited by it, so its latency says nothing about it);
//! - **aimd**: a window with a failure multiplies the limit by `backoff`; one without that
//!   filled the limit adds `increase` slots.
//!
//! The limit is kept in thousandths of a slot, so that smoothing keeps what one window moves.

use std::fmt;

/// The best recent latency drifts up by 1/`DRIFT` a window.
pub const DRIFT: u64 = 500;

/// How the limit moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Netflix's Gradient2: latency against the key's long-run latency.
    Gradient {
        /// How much of a window's new limit is taken, in thousandths (Netflix: 200).
        smoothing_pm: u64,
        /// How much slower than the long run a window may be before the limit falls, in
        /// thousandths (Netflix: 1,500: half as slow again).
        tolerance_pm: u64,
    },
    /// Additive increase, multiplicative decrease on failures.
    Aimd {
        /// What a window with a failure keeps of the limit, in thousandths (Netflix: 900).
        backoff_pm: u64,
        /// Slots a full window without a failure adds.
        increase: u64,
    },
}

/// Why an adaptive limit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdaptiveError {
    /// `min`, `initial` and `max` out of order, or `min` of 0.
    #[error("min ({min}) <= initial ({initial}) <= max ({max}), min at least 1")]
    Bounds {
        /// The least.
        min: u64,
        /// The start.
        initial: u64,
        /// The most.
        max: u64,
    },
    /// A parameter out of its range.
    #[error("{0} is out of range")]
    Parameter(&'static str),
}

/// A concurrency limit that finds its number: `min` to `max` slots, starting at `initial`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Adaptive {
    min: u64,
    max: u64,
    initial: u64,
    algorithm: Algorithm,
}

/// What one window of a key's completions showed, summed over every instance (windows
/// merge by adding: [`Window::merge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    /// Requests that completed.
    pub completions: u64,
    /// Of them, failures (a 5xx, a gRPC `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or
    /// `DEADLINE_EXCEEDED`, a timeout).
    pub failures: u64,
    /// Their latencies, summed (microseconds).
    pub latency_sum_us: u64,
    /// The most requests in flight at once.
    pub max_in_flight: u64,
}

impl Window {
    /// Two instances' windows as one.
    pub fn merge(self, other: Window) -> Window {
        Window {
            completions: self.completions.saturating_add(other.completions),
            failures: self.failures.saturating_add(other.failures),
            latency_sum_us: self.latency_sum_us.saturating_add(other.latency_sum_us),
            max_in_flight: self.max_in_flight.saturating_add(other.max_in_flight),
        }
    }

    /// One completion added.
    pub fn record(&mut self, latency_us: u64, failed: bool, in_flight: u64) {
        self.completions = self.completions.saturating_add(1);
        self.failures = self.failures.saturating_add(u64::from(failed));
        self.latency_sum_us = self.latency_sum_us.saturating_add(latency_us);
        self.max_in_flight = self.max_in_flight.max(in_flight);
    }
}

/// A key's controller: its limit in thousandths of a slot, and its best recent latency (0:
/// none yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Controller {
    /// The limit, in thousandths of a slot.
    pub limit_milli: u64,
    /// The best recent latency (microseconds; 0: no window yet).
    pub long_us: u64,
}

impl Adaptive {
    /// `min` to `max` slots, starting at `initial`, moved by `algorithm`.
    pub fn new(
        min: u64,
        initial: u64,
        max: u64,
        algorithm: Algorithm,
    ) -> Result<Self, AdaptiveError> {
        if min == 0
            || min > initial
            || initial > max
            || max > crate::algo::concurrency::MAX_CONCURRENCY
        {
            return Err(AdaptiveError::Bounds { min, initial, max });
        }
        match algorithm {
            Algorithm::Gradient {
                smoothing_pm,
                tolerance_pm,
            } => {
                if smoothing_pm == 0 || smoothing_pm > 1000 {
                    return Err(AdaptiveError::Parameter("smoothing"));
                }
                if !(1000..=10_000).contains(&tolerance_pm) {
                    return Err(AdaptiveError::Parameter("tolerance"));
                }
            }
            Algorithm::Aimd {
                backoff_pm,
                increase,
            } => {
                if !(1..1000).contains(&backoff_pm) {
                    return Err(AdaptiveError::Parameter("backoff"));
                }
                if increase == 0 || increase > max {
                    return Err(AdaptiveError::Parameter("increase"));
                }
            }
        }
        Ok(Self {
            min,
            max,
            initial,
            algorithm,
        })
    }

    /// The gradient with Netflix's defaults (smoothing 0.2, tolerance 1.5).
    pub fn gradient(min: u64, initial: u64, max: u64) -> Result<Self, AdaptiveError> {
        Self::new(
            min,
            initial,
            max,
            Algorithm::Gradient {
                smoothing_pm: 200,
                tolerance_pm: 1500,
            },
        )
    }

    /// AIMD with Netflix's defaults (backoff 0.9, one slot more a window).
    pub fn aimd(min: u64, initial: u64, max: u64) -> Result<Self, AdaptiveError> {
        Self::new(
            min,
            initial,
            max,
            Algorithm::Aimd {
                backoff_pm: 900,
                increase: 1,
            },
        )
    }

    /// A key's controller before any window (and after it was idle long enough).
    pub fn start(&self) -> Controller {
        Controller {
            limit_milli: self.initial * 1000,
            long_us: 0,
        }
    }

    /// The slots a controller gives now: its limit, whole, within `min..=max`.
    pub fn slots(&self, c: &Controller) -> u64 {
        (c.limit_milli / 1000).clamp(self.min, self.max)
    }

    /// The controller after a window of `w`.
    pub fn update(&self, c: &Controller, w: &Window) -> Controller {
        if w.completions == 0 {
            return *c;
        }
        let (lo, hi) = (self.min * 1000, self.max * 1000);
        let limit = c.limit_milli.clamp(lo, hi);
        match self.algorithm {
            Algorithm::Aimd {
                backoff_pm,
                increase,
            } => {
                let next = if w.failures > 0 {
                    limit / 1000 * backoff_pm
                } else if w.max_in_flight >= limit / 1000 {
                    limit + increase * 1000
                } else {
                    limit
                };
                Controller {
                    limit_milli: next.clamp(lo, hi),
                    long_us: c.long_us,
                }
            }
            Algorithm::Gradient {
                smoothing_pm,
                tolerance_pm,
            } => {
                let short = (w.latency_sum_us / w.completions).max(1);
                // The key's best recent latency: the least window, drifting up 1/DRIFT a
                // window so that a lasting slowdown (a capacity change) becomes the new best.
                let long = if c.long_us == 0 {
                    short
                } else {
                    short.min(c.long_us.saturating_add((c.long_us / DRIFT).max(1)))
                };
                let long = long.max(1);
                // Not limited by the limit: its latency says nothing about it.
                if w.max_in_flight.saturating_mul(2000) < limit {
                    return Controller {
                        limit_milli: limit,
                        long_us: long,
                    };
                }
                let gradient_pm = (u128::from(tolerance_pm) * u128::from(long) / u128::from(short))
                    .clamp(500, 1000) as u64;
                let queue_milli = (limit / 1000).isqrt().max(1) * 1000;
                let target = limit / 1000 * gradient_pm + queue_milli;
                let next = (u128::from(limit) * u128::from(1000 - smoothing_pm)
                    + u128::from(target) * u128::from(smoothing_pm))
                    / 1000;
                Controller {
                    limit_milli: (next as u64).clamp(lo, hi),
                    long_us: long,
                }
            }
        }
    }
}

impl fmt::Display for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.algorithm {
            Algorithm::Gradient { .. } => "gradient",
            Algorithm::Aimd { .. } => "aimd",
        };
        write!(
            f,
            "{}..{} slots from {} ({name})",
            self.min, self.max, self.initial
        )
    }
}

#[cfg(test)]
mod tests;
