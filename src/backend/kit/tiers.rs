//! The kit's burst tiers: a tiered key's state as a limit reads it ([`crate::algo::tiers`]
//! holds the state machine).

use std::borrow::Cow;

use super::{BackendError, BucketTx, Decided, Read, Refunded, Stored};
use crate::algo::tiers::{self, TierGrant, TierState, TieredLimit};
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
) -> Result<(Decided, TierGrant), BackendError> {
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
    let decided = Decided {
        outcome,
        write,
        repair,
    };
    Ok((decided, grant))
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

/// A tiered key's written form (a snapshot line's `tiers`): per tier, when it was entered and
/// its grants, `[time, units]`.
pub(super) mod line {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::algo::tiers::{TierLog, TierState};

    #[derive(Serialize, Deserialize)]
    struct TierLine {
        entered_us: Option<u64>,
        grants: Vec<(u64, u64)>,
    }

    pub(crate) fn serialize<S: Serializer>(state: &TierState, s: S) -> Result<S::Ok, S::Error> {
        let lines: Vec<TierLine> = state
            .tiers()
            .iter()
            .map(|t| TierLine {
                entered_us: t.entry(),
                grants: t.grants().to_vec(),
            })
            .collect();
        lines.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TierState, D::Error> {
        let lines = Vec::<TierLine>::deserialize(d)?;
        Ok(TierState::from_tiers(
            lines
                .into_iter()
                .map(|t| TierLog::new(t.entered_us, t.grants))
                .collect(),
        ))
    }
}
