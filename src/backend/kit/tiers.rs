//! The kit's burst tiers: a tiered key's state as a limit reads it ([`crate::algo::tiers`]
//! holds the state machine).

use std::borrow::Cow;

use super::Read;
use crate::algo::tiers::{self, TierState, TieredLimit};

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
