//! A limit's penalty in its request's one batch (`docs/penalties.md`): after the batch's own
//! transactions, the step sends one companion per transaction of a limit with a penalty ladder
//! (the same key, cost and mode, deciding the key's penalty state: `backend/kit/penalty.rs`),
//! and folds each companion's outcome into its limit's before anything reads the outcomes. So
//! a banned key's request is denied with its limit, the batch rule makes the two all or
//! nothing, and a decision reports one outcome per transaction, as ever.

use super::{Batch, Op, Resolved};
use crate::backend::{BackendError, BucketTx, Outcome, Outcomes};
use crate::config::Limits;
use crate::limiter::transaction::PenaltyPart;
use crate::limiter::{LimiterError, Transaction};
use crate::mode::Mode;
use crate::quota::Quota;

/// Whether `tx`, of a limit with a penalty (sent to the backend), sends a companion in `op`,
/// and its lease id (`lease` as it was, or the id its companion names its reservation by).
/// A spend or a check always sends one; a refund only when it settles a reservation (what
/// counted at admission is not given back). The id: a fresh one (`fresh`) for the admission
/// of a settling rule's spend, the settled one for its settle, else 0 (a count at admission).
fn part(
    tx: &Transaction,
    (op, mode): (Op, Mode),
    lease: u64,
    fresh: &dyn Fn() -> u64,
) -> (bool, u64) {
    let takes_part = match tx.penalty() {
        PenaltyPart::Skip => false,
        PenaltyPart::Settle { .. } => true,
        PenaltyPart::Count | PenaltyPart::Reserve => op != Op::Refund,
    };
    if !takes_part || lease != 0 {
        return (takes_part, lease);
    }
    let id = match (tx.penalty(), op) {
        (PenaltyPart::Reserve, Op::Spend) if mode.spends() => fresh(),
        (PenaltyPart::Settle { id, .. }, Op::Refund) => id.get(),
        _ => 0,
    };
    (true, id)
}

/// Pushes the companions of `batch`'s transactions sent of limits with a penalty (each told
/// whether it takes part in `op` and its lease id by [`part`], marked `r.penalty` when it
/// does), in order, after the transactions sent (`txs`, one per sent transaction). Refused when the backend decides no
/// penalty (`decides`: [`Backend::decides_penalties`]); `fresh` makes a new reservation id.
///
/// [`Backend::decides_penalties`]: crate::Backend::decides_penalties
#[cold]
#[inline(never)]
pub(super) fn push_companions<'a>(
    limits: &'a Limits,
    (batch, op): (&'a [Transaction], Op),
    resolved: &mut [Resolved<&'a Quota>],
    txs: &mut Batch<BucketTx<'a>>,
    (decides, fresh): (bool, &dyn Fn() -> u64),
) -> Result<(), LimiterError> {
    let mut sent = 0;
    for (tx, r) in batch.iter().zip(resolved.iter_mut()) {
        if !r.sent() {
            continue;
        }
        let name = tx.key().name();
        let penalty = limits.entry(name).and_then(|e| e.penalty.as_ref());
        if penalty.is_some() {
            (r.penalty, r.lease) = part(tx, (op, r.mode), r.lease, fresh);
        }
        if r.penalty {
            let (Some(penalty), true) = (penalty, decides) else {
                return Err(LimiterError::NoPenalties(name));
            };
            let companion = txs[sent].penalty_of(penalty).with_lease(r.lease);
            // A settle counts what its outcome counted.
            let companion = match tx.penalty() {
                PenaltyPart::Settle { counted, .. } => companion.with_cost(counted),
                _ => companion,
            };
            txs.push(companion);
        }
        sent += 1;
    }
    Ok(())
}

/// Folds the companions' outcomes (after the sent transactions' in `outcomes`) into their
/// limits' ([`folded`]), leaving one outcome per transaction sent.
/// A ban one of them started is counted (`tower_ratelimits_bans_total`). Out of line: a
/// batch without a ladder never calls it.
#[cold]
#[inline(never)]
pub(super) fn fold<Q>(
    batch: &[Transaction],
    resolved: &[Resolved<Q>],
    outcomes: &mut Outcomes,
) -> Result<(), LimiterError> {
    let sent = resolved.iter().filter(|r| r.sent()).count();
    let companions = resolved.iter().filter(|r| r.sent() && r.penalty).count();
    if outcomes.len() != sent + companions {
        return Err(BackendError::outcome_count(outcomes.len(), sent + companions).into());
    }
    let rules = batch.iter().zip(resolved).filter(|(_, r)| r.sent());
    let with_penalty = rules.enumerate().filter(|(_, (_, r))| r.penalty);
    for (c, (i, (tx, _))) in with_penalty.enumerate() {
        let penalty = outcomes[sent + c];
        if penalty.shape_number > 0 && penalty.allowed {
            crate::telemetry::banned(tx.key().name(), penalty.shape_number);
        }
        outcomes[i] = folded(outcomes[i], &penalty);
    }
    outcomes.truncate(sent);
    Ok(())
}

/// A limit's outcome with its penalty's: denied if either is (told to wait the longer of the
/// two), otherwise what is left before the penalty bans (when that is less) and the later
/// reset (a ban just started: its end).
pub(super) fn folded(mut o: Outcome, penalty: &Outcome) -> Outcome {
    if penalty.skipped {
        // Not evaluated (the batch was denied without it: a deny cache's answer).
        return o;
    }
    if !penalty.allowed {
        o.allowed = false;
        o.remaining = 0;
        o.retry_after_us = o.retry_after_us.max(penalty.retry_after_us);
        o.banned = penalty.banned;
    } else {
        o.remaining = o.remaining.min(penalty.remaining);
    }
    o.reset_after_us = o.reset_after_us.max(penalty.reset_after_us);
    o
}
