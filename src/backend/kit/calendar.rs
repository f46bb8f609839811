//! The kit's calendar quotas: a key's period end and units used, read, decided and reported
//! ([`crate::algo::calendar`] holds the rule).

use super::{BucketTx, Outcome, Read, Stored};
use crate::algo::calendar::{self, CalendarQuota, CalendarState};

/// A calendar key's state as the kit reads it (another shape's: none).
pub(super) fn calendar_read(stored: Option<Read<'_>>) -> Option<CalendarState> {
    match stored {
        Some(Read::Calendar(s)) => Some(s),
        _ => None,
    }
}

/// The calendar decision of a transaction ([`calendar::decide`], in the period in force at
/// `now`), what it writes, and what replaces the state read ([`calendar::read`]: a foreign
/// value, or an end past the period in force), written whatever the batch decides.
pub(super) fn calendar_decide(
    tx: &BucketTx<'_>,
    quota: &CalendarQuota,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>, Option<Stored>) {
    let (start, end) = quota.period_at(now);
    let state = calendar_read(stored);
    let out = calendar::decide(quota, state, end, now, tx.min_cost, tx.cost, tx.mode);
    // What replaces the state read: only a state ending after the period in force can need it.
    let repair = state
        .filter(|s| s.end_us > end)
        .and_then(|_| calendar::read(quota, state, end, now).1);
    (
        calendar_outcome(&out, end - start),
        out.write.map(Stored::Calendar),
        repair.map(Stored::Calendar),
    )
}

/// One calendar transaction alone in its batch: its outcome and what to write, as
/// [`spend`](super::spend) decides a batch of one (the batch rule applied: a denied spend
/// writes only what replaces the state read).
pub(crate) fn calendar_spend_one(
    tx: &BucketTx<'_>,
    quota: &CalendarQuota,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>) {
    let (outcome, write, repair) = calendar_decide(tx, quota, stored, now);
    let allowed = super::batch_allowed([(tx, &outcome)]);
    let write = if allowed { write.or(repair) } else { repair };
    (outcome, write)
}

/// A calendar decision as an outcome, with the length of the period it was made in
/// (microseconds).
pub(crate) fn calendar_outcome(out: &calendar::CalendarOutcome, length_us: u64) -> Outcome {
    Outcome {
        granted: Some(out.granted),
        shape_number: calendar::period_seconds(length_us),
        ..Outcome::new(
            out.allowed,
            out.remaining,
            out.retry_after_us,
            out.reset_after_us,
        )
    }
}

/// A calendar refund in the period holding `now`; what the read replaces is written when the
/// refund writes nothing.
pub(super) fn calendar_refund(
    tx: &BucketTx<'_>,
    quota: &CalendarQuota,
    stored: Option<Read<'_>>,
    now: u64,
) -> super::Refunded {
    let (start, end) = quota.period_at(now);
    let state = calendar_read(stored);
    let out = calendar::refund(quota, state, end, now, tx.cost);
    let write = out.write.or(calendar::read(quota, state, end, now).1);
    (
        calendar_outcome(&out, end - start),
        write.map(Stored::Calendar),
    )
        .into()
}

/// A calendar key's written form (a snapshot line's `calendar`): its period's end and the
/// units used.
pub(super) mod line {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::algo::calendar::CalendarState;

    #[derive(Serialize, Deserialize)]
    struct CalendarLine {
        end_us: u64,
        used: u64,
    }

    pub(crate) fn serialize<S: Serializer>(c: &CalendarState, s: S) -> Result<S::Ok, S::Error> {
        CalendarLine {
            end_us: c.end_us,
            used: c.used,
        }
        .serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CalendarState, D::Error> {
        let c = CalendarLine::deserialize(d)?;
        Ok(CalendarState {
            end_us: c.end_us,
            used: c.used,
        })
    }
}
