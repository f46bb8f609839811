//! The kit's burst tiers: a tiered key's state as a limit reads it ([`crate::algo::tiers`]
//! holds the state machine).

use std::borrow::Cow;

use super::{BackendError, BucketTx, Decided, Read, Refunded, Stored};
use crate::algo::tiers::{self, TierState, TieredLimit};
use crate::backend::Outcome;

/// A tiered key's state as `limit` reads it at `now`: as stored, fresh when none is (or one of
/// another shape), drained ([`tiers::drained`]) when it holds a time further ahead than the
/// crate writes (then an owned, non-empty state: the caller writes it whatever it decides).
pub(super) fn read_tiers<'s>(
    limit: &TieredLimit,
    stored: Option<Read<'s>>,
    now: u64,
) -> Cow<'s, TierState> {
    match stored {
        Some(Read::Tiers(s)) if !s.is_foreign(now) => Cow::Borrowed(s),
        Some(Read::Tiers(_)) => Cow::Owned(tiers::drained(limit, now)),
        _ => Cow::Owned(TierState::new()),
    }
}

/// A tiered transaction of a batch the kit decides ([`super::spend`]): decided on its state
/// (a drained foreign one written whatever the batch decides), its grant per tier beside.
pub(super) fn tiers_spend(
    tx: &BucketTx<'_>,
    limit: &TieredLimit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<Decided, BackendError> {
    let read = read_tiers(limit, stored, now);
    let repair = match &read {
        Cow::Owned(drained) if !drained.is_empty() => Some(Stored::Tiers(drained.clone())),
        _ => None,
    };
    let state = &*read;
    let (d, plan) = tiers::decide(limit, state, now, tx.min_cost, tx.cost)?;
    let write = (d.allowed && tx.mode.spends()).then(|| {
        let mut next = state.clone();
        tiers::apply(limit, &mut next, now, &plan);
        Stored::Tiers(next)
    });
    let (outcome, grant) = Outcome::tiered(&d, limit);
    Ok(Decided {
        outcome,
        write,
        repair,
        grant: Some(grant),
    })
}

/// A tiered refund: the newest grants taken back, its grant per tier beside.
pub(super) fn tiers_refund(
    tx: &BucketTx<'_>,
    limit: &TieredLimit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Refunded {
    let mut state = read_tiers(limit, stored, now).into_owned();
    let d = tiers::refund(limit, &mut state, now, tx.cost);
    let (outcome, grant) = Outcome::tiered(&d, limit);
    Refunded {
        outcome,
        tiers: Some(grant),
        write: Some(Stored::Tiers(state)),
    }
}
