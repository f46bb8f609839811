//! The kit's adaptive concurrency keys: a concurrency key's leases, decided against the key's
//! own number of slots now, and the completions that move it
//! ([`crate::algo::adaptive`] holds the rule).

use std::borrow::Cow;

use super::concurrency::read_leases;
use super::{BucketTx, Read, Stored};
use crate::algo::adaptive::{AdaptiveConcurrency, AdaptiveState};
use crate::algo::concurrency as concurrency_rule;
use crate::backend::Outcome;
use crate::mode::Mode;

/// A key's state as `limit` reads it at `now` (back at its start once idle), and whether its
/// leases were cut (then it is written whatever the decision).
fn read_state<'s>(
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'s>>,
    now: u64,
) -> (AdaptiveState, bool) {
    let fresh = AdaptiveState::default();
    let state = match stored {
        Some(Read::Adaptive(s)) => s,
        _ => &fresh,
    };
    let mut state = limit.rolled(state, now);
    let (leases, cut) = read_leases(limit.slots(), Some(Read::Leases(&state.leases)), now);
    if let Cow::Owned(l) = leases {
        state.leases = l;
    }
    (state, cut)
}

fn with_slots(mut outcome: Outcome, slots: u64) -> Outcome {
    outcome.slots = u16::try_from(slots).unwrap_or(u16::MAX);
    outcome
}

/// A spend, check, charge or renewal on an adaptive key: its outcome (with the key's slots
/// now), what to write when allowed, and what a cut lease makes written whatever the batch.
pub(super) fn adaptive_decide(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>, Option<Stored>) {
    let (mut state, cut) = read_state(limit, stored, now);
    let slots = limit.slots_at(&state, now);
    let repair = cut.then(|| Stored::Adaptive(Box::new(state.clone())));
    let live = super::live_leases(&state.leases, now);
    if tx.mode == Mode::Renew {
        let (renewed, next) = super::renew(&slots, &state.leases, tx.renewed(), now);
        let outcome = Outcome {
            granted: Some(renewed),
            ..Outcome::new(renewed > 0, slots.max().saturating_sub(live), 0, 0)
        };
        let write = (renewed > 0).then(|| {
            state.leases = next;
            Stored::Adaptive(Box::new(state))
        });
        return (with_slots(outcome, slots.max()), write, repair);
    }
    let d = if tx.mode == Mode::Charge {
        concurrency_rule::charge(&slots, live, tx.cost == 1)
    } else {
        concurrency_rule::decide(&slots, live, tx.cost == 1)
    };
    // The lease taken into the state as read (its ended leases dropped, as `with_lease`).
    let write = (d.allowed && super::takes_lease(tx)).then(|| {
        state
            .leases
            .retain(|&(_, deadline)| concurrency_rule::holds(deadline, now));
        state
            .leases
            .push((tx.lease, concurrency_rule::deadline(&slots, now)));
        state.last_us = state.last_us.max(now);
        Stored::Adaptive(Box::new(state))
    });
    (with_slots(Outcome::from(d), slots.max()), write, repair)
}

/// A lease given back: released, and what its request showed (if known) recorded in the
/// key's window, with the slots in flight when it ended.
pub(super) fn adaptive_refund(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>) {
    let (mut state, _) = read_state(limit, stored, now);
    let released = super::release_in(&mut state.leases, tx.lease, now);
    let in_flight = state.leases.len() as u64 + u64::from(released);
    if released && let Some(c) = tx.completion {
        limit.complete(&mut state, c.latency_us, c.failed, in_flight, now);
    }
    let slots = limit.slots_at(&state, now).max();
    let live = state.leases.len() as u64;
    (
        with_slots(
            Outcome::new(released, slots.saturating_sub(live), 0, 0),
            slots,
        ),
        Some(Stored::Adaptive(Box::new(state))),
    )
}

/// When a key's state equals a fresh one: its last lease ended and it was idle long enough.
pub(super) fn adaptive_fresh_at(limit: &AdaptiveConcurrency, state: &AdaptiveState) -> u64 {
    let deadline = state.leases.iter().map(|&(_, d)| d).max().unwrap_or(0);
    deadline.max(state.last_us.saturating_add(limit.idle_reset_us()))
}
