//! The kit's penalty states: a penalty's companion transaction ([`BucketTx::penalty`], sent by
//! the limiter after its limit's transaction) decided on its key's penalty state
//! ([`crate::algo::penalty`] holds the rule, `docs/penalties.md` the contract).
//!
//! A companion that spends counts what its limit counts (its cost, at admission) and bans the
//! key when the window's units reach `after`; while the key is banned it is denied, and with it
//! the batch. One that only checks reads the key's standing. What it writes is written only
//! when its batch is allowed (a request its limit refused counts nothing).

use super::{BucketTx, Decided, Outcome, Read, Stored};
use crate::algo::penalty::{Admission, Ladder, PenaltyState, Standing, Tally};
use crate::config::PenaltyEntry;
use crate::key::KeyText;

/// A penalty state as the kit reads it (another shape's, or none: a fresh one).
fn penalty_read(stored: Option<Read<'_>>) -> PenaltyState {
    match stored {
        Some(Read::Penalty(s)) => s.clone(),
        _ => PenaltyState::default(),
    }
}

/// A penalty companion of a batch the kit decides ([`super::spend`]): denied while its key is
/// banned; a spend counts its cost (and may start a ban: that request is still let through,
/// as the event that made it), written if the batch is allowed.
pub(super) fn penalty_spend(
    tx: &BucketTx<'_>,
    penalty: &PenaltyEntry,
    stored: Option<Read<'_>>,
    now: u64,
) -> Decided {
    let ladder = &penalty.ladder;
    let mut state = penalty_read(stored);
    if let Standing::Banned { until, .. } = state.standing(ladder, now) {
        return (Outcome::banned(until - now), None, None).into();
    }
    if !tx.mode.spends() || tx.cost == 0 {
        let left = ladder.after().saturating_sub(state.units_at(ladder, now));
        return (Outcome::new(true, left, 0, 0), None, None).into();
    }
    if tx.lease != 0 {
        return penalty_admit(tx, ladder, state, now);
    }
    let key = KeyText::canonical(tx.key);
    let outcome = tallied(state.count(ladder, key.bytes(), tx.cost, now), ladder, now);
    (outcome, Some(Stored::Penalty(Box::new(state))), None).into()
}

/// The admission of a request whose outcome settles later (its reservation's id in
/// `tx.lease`): it reserves its cost, refused while the window's units, counted and reserved,
/// are at `after` (told when the oldest leave it).
fn penalty_admit(tx: &BucketTx<'_>, ladder: &Ladder, mut state: PenaltyState, now: u64) -> Decided {
    let outcome = match state.admit(ladder, (tx.lease, tx.cost), now) {
        Admission::Admitted => {
            let held = state.units() + state.reservations.iter().map(|r| r.units).sum::<u64>();
            Outcome::new(true, ladder.after().saturating_sub(held), 0, 0)
        }
        Admission::Banned { until, .. } => {
            return (Outcome::banned(until - now), None, None).into();
        }
        Admission::Full { until } => {
            let wait = until.saturating_sub(now);
            return (Outcome::new(false, 0, wait, wait), None, None).into();
        }
    };
    (outcome, Some(Stored::Penalty(Box::new(state))), None).into()
}

/// A penalty companion's refund: the settle of its reservation (`tx.lease`), counting its
/// cost (what the outcome counted, at most the reservation); a ban it brings starts now.
pub(super) fn penalty_settle(
    tx: &BucketTx<'_>,
    penalty: &PenaltyEntry,
    stored: Option<Read<'_>>,
    now: u64,
) -> super::Refunded {
    let ladder = &penalty.ladder;
    let mut state = penalty_read(stored);
    let key = KeyText::canonical(tx.key);
    match state.settle(ladder, key.bytes(), tx.lease, tx.cost, now) {
        // Nothing in flight under this id (it left the window, a ban cleared it, or it was
        // settled already): nothing changes.
        Tally::Ignored => (Outcome::new(true, 0, 0, 0), None).into(),
        tally => {
            let outcome = tallied(tally, ladder, now);
            (outcome, Some(Stored::Penalty(Box::new(state)))).into()
        }
    }
}

/// What counting units reports: the units left before a ban, or a ban started now (its
/// length, and its level in the outcome's own number, which the limiter counts).
fn tallied(tally: Tally, ladder: &Ladder, now: u64) -> Outcome {
    match tally {
        Tally::Counted(units) => Outcome::new(true, ladder.after().saturating_sub(units), 0, 0),
        Tally::Banned { until, level } => Outcome {
            shape_number: level,
            ..Outcome::new(true, 0, 0, until - now)
        },
        // Not banned a moment ago, or nothing in flight to settle.
        Tally::Ignored => Outcome::new(true, 0, 0, 0),
    }
}

/// The first instant at which `state` equals a fresh one under `ladder`: its ban over, its
/// level decayed to 0, and its window's units and reservations gone.
pub(crate) fn penalty_fresh_at(ladder: &Ladder, state: &PenaltyState) -> u64 {
    let decayed = state
        .since
        .saturating_add(u64::from(state.level).saturating_mul(ladder.forget_after_us()));
    let window = state
        .events
        .iter()
        .map(|&(at, _)| at)
        .chain(state.reservations.iter().map(|r| r.at))
        .max()
        .map_or(0, |at| at.saturating_add(ladder.within_us()));
    let level = if state.level > 0 { decayed } else { 0 };
    state.banned_until.max(level).max(window)
}

/// A penalty state's written form (a snapshot line's `penalty`): its level, when its next step
/// down counts from, its ban's end, the window's counted units `[time, units]` and its
/// reservations `[id, time, units]`, at most [`MAX_AFTER`](crate::algo::penalty::MAX_AFTER)
/// of each (a longer list is refused: no ladder keeps more).
pub(super) mod line {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::algo::penalty::{MAX_AFTER, PenaltyState, Reservation};

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PenaltyLine {
        level: u32,
        since: u64,
        banned_until: u64,
        events: Vec<(u64, u64)>,
        reservations: Vec<(u64, u64, u64)>,
    }

    pub(crate) fn serialize<S: Serializer>(p: &PenaltyState, s: S) -> Result<S::Ok, S::Error> {
        PenaltyLine {
            level: p.level,
            since: p.since,
            banned_until: p.banned_until,
            events: p.events.iter().copied().collect(),
            reservations: p
                .reservations
                .iter()
                .map(|r| (r.id, r.at, r.units))
                .collect(),
        }
        .serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Box<PenaltyState>, D::Error> {
        let p = PenaltyLine::deserialize(d)?;
        let most = usize::try_from(MAX_AFTER).unwrap_or(usize::MAX);
        if p.events.len() > most || p.reservations.len() > most {
            return Err(serde::de::Error::custom(format!(
                "a penalty keeps at most {MAX_AFTER} units and reservations"
            )));
        }
        let mut events = p.events;
        events.sort_unstable();
        Ok(Box::new(PenaltyState {
            level: p.level,
            since: p.since,
            banned_until: p.banned_until,
            events: events.into(),
            reservations: p
                .reservations
                .into_iter()
                .map(|(id, at, units)| Reservation { id, at, units })
                .collect(),
        }))
    }
}
