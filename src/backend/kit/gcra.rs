//! The kit's GCRA buckets: the stored word (a TAT and its writer's bound), one transaction's
//! step on it, its decision and what it writes ([`crate::algo::gcra`] holds the rule).

use super::{BackendError, BucketTx, Decided, Outcome, Read, Refunded, Stored};
use crate::algo::gcra::{self, GcraError, GcraOutcome, Limit};
use crate::mode::Mode;

/// How a GCRA bucket is kept in one word ([`Stored::Tat`]): the bit length of the writer's
/// bound in the top 6 bits, the TAT below (microseconds, so until the year 11,100).
const WRITER_SHIFT: u32 = 58;
const TAT_MASK: u64 = (1 << WRITER_SHIFT) - 1;

/// The stored word of a TAT written under `limit` (its bound, [`Limit::bound_us`], is at most
/// 100 years, so its bit length is at most 52). A TAT beyond the word's 58 bits is
/// [`GcraError::TimeOverflow`].
#[inline]
pub(crate) fn gcra_word(tat: u64, limit: &Limit) -> Result<u64, GcraError> {
    gcra_word_bound(tat, limit.bound_us())
}

/// [`gcra_word`] for a writer's bound given in microseconds (a refund keeps the larger of its
/// limit's and the writer's).
#[inline]
pub(crate) fn gcra_word_bound(tat: u64, bound_us: u64) -> Result<u64, GcraError> {
    if tat > TAT_MASK {
        return Err(GcraError::TimeOverflow);
    }
    let length = u64::from(u64::BITS - bound_us.leading_zeros());
    Ok(tat | (length << WRITER_SHIFT))
}

/// A stored word's TAT.
#[inline(always)]
pub(crate) fn gcra_tat(word: u64) -> u64 {
    word & TAT_MASK
}

/// A stored word's TAT, and its writer's bound: `2^length` (above the bound itself), 0 when
/// none is recorded (a plain TAT) or the length is not one the crate writes.
pub(crate) fn gcra_unword(word: u64) -> (u64, u64) {
    let length = word >> WRITER_SHIFT;
    let bound = if (1..=52).contains(&length) {
        1 << length
    } else {
        0
    };
    (word & TAT_MASK, bound)
}

/// `limit` widened to read TATs its writer set up to `writer_bound_us` ahead, when that is
/// further than `limit` itself writes (`None`: `limit` as it is). The one place a decision
/// learns that a bucket was drained under a larger limit (`docs/gcra.md`, "Changing a limit").
#[inline]
pub(crate) fn reading(limit: &Limit, writer_bound_us: u64) -> Option<Limit> {
    (writer_bound_us > limit.bound_us()).then(|| limit.reading(writer_bound_us))
}

/// `limit` reading a TAT a store already judged to be the crate's (the Redis script's answer,
/// what an instance remembers of one): widened only when the TAT runs beyond `limit`'s own
/// bound, so that the decision is the store's (`None`: `limit` as it is).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
#[inline]
pub(crate) fn trusted(limit: &Limit, tat: Option<u64>, now: u64) -> Option<Limit> {
    limit.is_foreign(tat, now).then(|| limit.reading(u64::MAX))
}

/// One GCRA transaction on a stored word: its decision ([`gcra_decide`]), the word it writes
/// when its batch is allowed ([`gcra_write`], under this limit's bound), and the word that
/// replaces a foreign value whatever the batch decides (the bucket drained under this limit).
pub(crate) struct GcraStep {
    pub(crate) decision: GcraDecision,
    pub(crate) write: Option<u64>,
    pub(crate) repair: Option<u64>,
}

/// The word a GCRA bucket read holds (0: none, or a state of another shape).
#[inline]
fn stored_word(stored: Option<Read<'_>>) -> u64 {
    match stored {
        Some(Read::Tat(t)) => t,
        _ => 0,
    }
}

/// A GCRA transaction of a batch the kit decides ([`super::spend`]), on its stored word.
#[inline]
pub(super) fn gcra_spend(
    tx: &BucketTx<'_>,
    limit: &Limit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<Decided, BackendError> {
    let word = stored_word(stored);
    let step = gcra_step(tx, limit, word, now)?;
    Ok(Decided {
        outcome: step.decision.outcome(),
        write: step.write.map(Stored::Tat),
        repair: step.repair.map(Stored::Tat),
    })
}

/// The GCRA step of `tx` on the bucket stored as `word` (0: none) at `now`: every backend that
/// keeps words (memory, the kit's users) decides a GCRA transaction through it.
#[inline(always)]
pub(crate) fn gcra_step(
    tx: &BucketTx<'_>,
    limit: &Limit,
    word: u64,
    now: u64,
) -> Result<GcraStep, GcraError> {
    let tat = gcra_tat(word);
    let stored = (tat != 0).then_some(tat);
    // The common case: a TAT within what this limit writes (or none). Its writer's bound does
    // not matter, and nothing is foreign.
    if limit.is_foreign(stored, now) {
        return gcra_step_beyond(tx, limit, word, now);
    }
    let decision = gcra_decide(tx, limit, stored, now)?;
    let write = match gcra_write(tx.mode, &decision.out, tat, now) {
        Some(t) => Some(gcra_word(t, limit)?),
        None => None,
    };
    Ok(GcraStep {
        decision,
        write,
        repair: None,
    })
}

/// [`gcra_step`] for a TAT beyond what the limit in force writes: the crate's when its writer's
/// bound reaches it (a bucket drained under a larger limit), else foreign (read as drained, and
/// replaced). Out of line: the request path of buckets within their limit does not carry it.
#[cold]
#[inline(never)]
fn gcra_step_beyond(
    tx: &BucketTx<'_>,
    limit: &Limit,
    word: u64,
    now: u64,
) -> Result<GcraStep, GcraError> {
    let (tat, writer) = gcra_unword(word);
    let wide = reading(limit, writer);
    let read = wide.as_ref().unwrap_or(limit);
    let stored = (tat != 0).then_some(tat);
    let decision = gcra_decide(tx, read, stored, now)?;
    let write = gcra_write(tx.mode, &decision.out, tat, now)
        .map(|t| gcra_word(t, limit))
        .transpose()?;
    let repair = match read.repair(stored, now) {
        Some(t) => Some(gcra_word(t, limit)?),
        None => None,
    };
    Ok(GcraStep {
        decision,
        write,
        repair,
    })
}

/// The GCRA decision of a transaction on a bucket whose stored TAT is `stored`: its single cost
/// ([`gcra::check`]), for a range the most units that fit ([`gcra::check_range`]), for a charge
/// the most units that fit within the debt bound ([`gcra::charge`]), with the units granted.
/// Every backend decides a GCRA transaction through this function only (the script's
/// `gcra_grant` and `gcra_charge` in Lua); [`GcraDecision::outcome`] is what it reports.
#[inline(always)]
pub(crate) fn gcra_decide(
    tx: &BucketTx<'_>,
    limit: &Limit,
    stored: Option<u64>,
    now: u64,
) -> Result<GcraDecision, GcraError> {
    if tx.mode == Mode::Charge {
        let (out, charged) = gcra::charge(limit, stored, now, tx.cost)?;
        return Ok(GcraDecision {
            out,
            granted: Some(charged),
        });
    }
    if tx.min_cost == tx.cost {
        return Ok(GcraDecision {
            out: gcra::check(limit, stored, now, tx.cost)?,
            granted: None,
        });
    }
    let (out, granted) = gcra::check_range(limit, stored, now, tx.min_cost, tx.cost)?;
    Ok(GcraDecision {
        out,
        granted: Some(granted),
    })
}

/// A GCRA transaction's decision ([`gcra_decide`]).
#[derive(Clone, Copy)]
pub(crate) struct GcraDecision {
    pub(crate) out: GcraOutcome,
    /// For a range: the units granted.
    pub(crate) granted: Option<u64>,
}

impl GcraDecision {
    /// The outcome a backend reports.
    #[inline(always)]
    pub(crate) fn outcome(&self) -> Outcome {
        Outcome {
            granted: self.granted,
            ..Outcome::from(self.out)
        }
    }
}

/// The TAT an allowed GCRA transaction of an allowed batch writes (`docs/gcra.md`): its new TAT
/// when its mode spends, the TAT is in the future and it changes the bucket (`stored`: the TAT
/// read, 0 for none); `None` writes nothing. The backends apply it through this function only
/// (the script's `gcra_writes` in Lua).
pub(crate) fn gcra_write(mode: Mode, out: &GcraOutcome, stored: u64, now: u64) -> Option<u64> {
    out.new_tat
        .filter(|&new| out.allowed && mode.spends() && new > now && new != stored)
}

/// A GCRA refund on its stored word, read under the limit widened to its writer's bound; what it
/// leaves may still be as far ahead as the writer set it, so the bound is kept with it.
pub(super) fn gcra_refund(
    tx: &BucketTx<'_>,
    limit: &Limit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<Refunded, BackendError> {
    let word = stored_word(stored);
    let (tat, writer) = gcra_unword(word);
    let wide = reading(limit, writer);
    let limit = wide.as_ref().unwrap_or(limit);
    let out = gcra::refund(limit, (tat != 0).then_some(tat), now, tx.cost)?;
    let bound = limit.bound_us().max(writer);
    let write = out.new_tat.map(|t| gcra_word_bound(t, bound)).transpose()?;
    Ok((out.into(), write.map(Stored::Tat)).into())
}

/// A GCRA bucket's written form (a snapshot line's `gcra`): its TAT and its writer's bound as
/// a bit length (0: none recorded).
pub(super) mod line {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct GcraLine {
        tat_us: u64,
        bound_bits: u32,
    }

    pub(crate) fn serialize<S: Serializer>(word: &u64, s: S) -> Result<S::Ok, S::Error> {
        let (tat_us, bound) = super::gcra_unword(*word);
        let bound_bits = if bound == 0 {
            0
        } else {
            bound.trailing_zeros()
        };
        GcraLine { tat_us, bound_bits }.serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let g = GcraLine::deserialize(d)?;
        if g.bound_bits > 52 {
            return Err(D::Error::custom(format!(
                "bound_bits {} is above 52",
                g.bound_bits
            )));
        }
        let bound = (1u64 << g.bound_bits) - 1;
        super::gcra_word_bound(g.tat_us, bound)
            .map_err(|e| D::Error::custom(format!("tat_us {}: {e}", g.tat_us)))
    }
}
