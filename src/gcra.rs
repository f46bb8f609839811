//! The Generic Cell Rate Algorithm, as pure functions of `(limit, stored TAT, now, cost)`.
//!
//! No I/O and no clock: every backend (memory, Redis) computes exactly these values, and the
//! Redis Lua script mirrors this file line by line. The contract is `spec/gcra.md`.
//!
//! A bucket's whole state is its theoretical arrival time (TAT) in microseconds. A missing
//! bucket is passed as `None`; a TAT at or before `now` means the same thing (a full bucket).
//! Arithmetic is done in `i128`, so no input can overflow or panic; a result that would not fit
//! in a `u64` TAT is reported as [`GcraError::TimeOverflow`].

use crate::limit::Limit;

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
pub enum GcraError {
    /// The cost is larger than the limit's burst: such a request could never be allowed.
    #[error("cost {cost} exceeds the burst of {burst}")]
    CostAboveBurst {
        /// The requested cost.
        cost: u64,
        /// The limit's burst.
        burst: u64,
    },
    /// The new TAT would not fit in 64-bit microseconds.
    #[error("theoretical arrival time overflows 64-bit microseconds")]
    TimeOverflow,
}

/// `max(v, 0) / ei` with the division in 64 bits (`v` is at most a burst offset plus slack).
fn tokens(v: i128, ei: u64) -> u64 {
    clamp_u64(v) / ei
}

fn clamp_u64(v: i128) -> u64 {
    if v <= 0 {
        0
    } else {
        u64::try_from(v).unwrap_or(u64::MAX)
    }
}

/// Spends `cost` tokens if they are available.
///
/// On a denial the store must stay unchanged (`new_tat` is `None`). A cost of 0 is a probe: it
/// reports the bucket without consuming anything.
///
/// ```
/// use tower_ratelimits::{Limit, gcra};
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
pub fn check(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<GcraOutcome, GcraError> {
    if cost > limit.burst() {
        return Err(GcraError::CostAboveBurst {
            cost,
            burst: limit.burst(),
        });
    }
    let ei_u = limit.emission_interval_us();
    let bo_u = limit.burst_offset_us();
    let tat_u = stored_tat.unwrap_or(0).max(now);
    // The same computation in u64 when nothing overflows (every realistic input); the i128
    // path below is the reference and handles the rest.
    if let (Some(incr), Some(horizon)) = (ei_u.checked_mul(cost), now.checked_add(bo_u))
        && let Some(new_tat) = tat_u.checked_add(incr)
    {
        // `horizon - new_tat` is the spec's `difference` (now - (new_tat - burst offset)).
        return Ok(if new_tat <= horizon {
            let difference = horizon - new_tat;
            GcraOutcome {
                allowed: true,
                remaining: difference / ei_u,
                retry_after_us: incr.saturating_sub(difference),
                reset_after_us: new_tat - now,
                new_tat: Some(new_tat),
            }
        } else {
            GcraOutcome {
                allowed: false,
                remaining: horizon.saturating_sub(tat_u) / ei_u,
                retry_after_us: new_tat - horizon,
                reset_after_us: tat_u - now,
                new_tat: None,
            }
        });
    }
    check_wide(limit, tat_u, now, cost)
}

/// [`check`] in `i128`, where no input overflows: the reference the u64 path must equal.
fn check_wide(limit: &Limit, tat_u: u64, now: u64, cost: u64) -> Result<GcraOutcome, GcraError> {
    let ei_u = limit.emission_interval_us();
    let ei = i128::from(ei_u);
    let bo = i128::from(limit.burst_offset_us());
    let now_i = i128::from(now);
    let tat = i128::from(tat_u);
    let incr = ei * i128::from(cost);
    let new_tat = tat + incr;
    let difference = now_i - (new_tat - bo);
    if difference < 0 {
        return Ok(GcraOutcome {
            allowed: false,
            remaining: tokens(now_i - (tat - bo), ei_u),
            retry_after_us: clamp_u64(-difference),
            reset_after_us: clamp_u64(tat - now_i),
            new_tat: None,
        });
    }
    let new_tat_u64 = u64::try_from(new_tat).map_err(|_| GcraError::TimeOverflow)?;
    Ok(GcraOutcome {
        allowed: true,
        remaining: tokens(difference, ei_u),
        retry_after_us: if difference < incr {
            clamp_u64(incr - difference)
        } else {
            0
        },
        reset_after_us: clamp_u64(new_tat - now_i),
        new_tat: Some(new_tat_u64),
    })
}

/// Gives back `cost` tokens, never above a full bucket.
///
/// `allowed` tells whether anything was refunded. A missing bucket or one whose TAT is in the
/// past is full already: nothing changes.
pub fn refund(
    limit: &Limit,
    stored_tat: Option<u64>,
    now: u64,
    cost: u64,
) -> Result<GcraOutcome, GcraError> {
    if cost > limit.burst() {
        return Err(GcraError::CostAboveBurst {
            cost,
            burst: limit.burst(),
        });
    }
    let stored = match stored_tat {
        Some(t) if t >= now => t,
        _ => {
            return Ok(GcraOutcome {
                allowed: false,
                remaining: limit.burst(),
                retry_after_us: 0,
                reset_after_us: 0,
                new_tat: None,
            });
        }
    };
    let ei_u = limit.emission_interval_us();
    let ei = i128::from(ei_u);
    let bo = i128::from(limit.burst_offset_us());
    let now_i = i128::from(now);
    let new_tat = (i128::from(stored) - ei * i128::from(cost)).max(now_i);
    let changed = new_tat != i128::from(stored);
    Ok(GcraOutcome {
        allowed: changed,
        remaining: tokens(now_i - (new_tat - bo), ei_u),
        retry_after_us: 0,
        reset_after_us: clamp_u64(new_tat - now_i),
        // new_tat lies between now and stored, both u64.
        new_tat: if changed {
            u64::try_from(new_tat).ok()
        } else {
            None
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    proptest! {
        /// The u64 fast path decides exactly as the i128 reference, near the edges of u64 too.
        #[test]
        fn fast_path_equals_the_wide_reference(
            burst in 1u64..2_000_000,
            count in 1u64..2_000_000,
            period_us in 1u64..10_000_000_000,
            tat in prop_oneof![0u64..4_000_000_000_000_000, (u64::MAX - 1_000_000_000_000)..=u64::MAX],
            now in prop_oneof![0u64..4_000_000_000_000_000, (u64::MAX - 1_000_000_000_000)..=u64::MAX],
            cost_frac in 0.0f64..=1.0,
        ) {
            let Ok(limit) = Limit::new(burst, count, Duration::from_micros(period_us)) else {
                return Ok(());
            };
            let cost = (cost_frac * limit.burst() as f64) as u64;
            let stored = tat.max(now);
            prop_assert_eq!(check(&limit, Some(tat), now, cost), check_wide(&limit, stored, now, cost));
        }
    }
}
