//! The kit's concurrency keys: leases read, taken, renewed and given back
//! ([`crate::algo::concurrency`] holds the rule).

use std::borrow::Cow;

use super::{BucketTx, Decided, Read, Refunded, Stored};
use crate::algo::concurrency::{self, ConcurrencyLimit};
use crate::backend::Outcome;
use crate::mode::Mode;

/// A concurrency key's leases as `limit` reads them at `now` ([`concurrency::read`]: a
/// deadline beyond what the crate writes is cut to one lease from now), and whether one was
/// cut (then the key is written so, whatever the decision).
pub(super) fn read_leases<'s>(
    limit: &ConcurrencyLimit,
    stored: Option<Read<'s>>,
    now: u64,
) -> (Cow<'s, [(u64, u64)]>, bool) {
    let leases: &[(u64, u64)] = match stored {
        Some(Read::Leases(l)) => l,
        _ => &[],
    };
    let cut = leases
        .iter()
        .any(|&(_, d)| concurrency::read(limit, d, now) != d);
    if !cut {
        return (Cow::Borrowed(leases), false);
    }
    let read = leases
        .iter()
        .map(|&(id, d)| (id, concurrency::read(limit, d, now)))
        .filter(|&(_, d)| concurrency::holds(d, now))
        .collect();
    (Cow::Owned(read), true)
}

/// Whether a transaction on a concurrency key takes a lease when it and its batch are allowed:
/// a spend of one slot with a lease id.
pub(crate) fn takes_lease(tx: &BucketTx<'_>) -> bool {
    tx.mode.spends() && tx.cost == 1 && tx.lease != 0
}

/// Renews the leases `ids` at `now`: how many still held their slots, and the key's live
/// leases with their deadlines moved to now plus the lease time (as the script: ended leases
/// go; `leases` as [`read_leases`] gives them). A lease that no longer holds a slot is not
/// taken again.
pub(crate) fn renew(
    limit: &ConcurrencyLimit,
    leases: &[(u64, u64)],
    ids: &[u64],
    now: u64,
) -> (u64, Vec<(u64, u64)>) {
    let mut renewed = 0;
    // Many leases of one key (an instance's requests in flight): looked up in a set.
    let set: Option<std::collections::HashSet<u64>> =
        (ids.len() > 16).then(|| ids.iter().copied().collect());
    let asked = |l: u64| {
        set.as_ref()
            .map_or_else(|| ids.contains(&l), |s| s.contains(&l))
    };
    let next = leases
        .iter()
        .filter(|&&(_, deadline)| concurrency::holds(deadline, now))
        .map(|&(l, deadline)| {
            if l != 0 && asked(l) {
                renewed += 1;
                (l, concurrency::deadline(limit, now))
            } else {
                (l, deadline)
            }
        })
        .collect();
    (renewed, next)
}

/// The leases of a key that hold a slot at `now` ([`concurrency::holds`]; `leases` as
/// [`read_leases`] gives them).
pub(crate) fn live_leases(leases: &[(u64, u64)], now: u64) -> u64 {
    leases
        .iter()
        .filter(|&&(_, deadline)| concurrency::holds(deadline, now))
        .count() as u64
}

/// A key's live leases with lease `id` taken at `now` (the ended ones dropped).
pub(crate) fn with_lease(
    leases: &[(u64, u64)],
    limit: &ConcurrencyLimit,
    id: u64,
    now: u64,
) -> Vec<(u64, u64)> {
    let mut next: Vec<(u64, u64)> = leases
        .iter()
        .copied()
        .filter(|&(_, deadline)| concurrency::holds(deadline, now))
        .collect();
    next.push((id, concurrency::deadline(limit, now)));
    next
}

/// Gives back lease `id`: whether it was held (a live lease of that id), and the live leases
/// left (as the script: ended leases go first, then it).
pub(crate) fn release(leases: &[(u64, u64)], id: u64, now: u64) -> (bool, Vec<(u64, u64)>) {
    let left = leases
        .iter()
        .copied()
        .filter(|&lease| stays(lease, id, now))
        .collect();
    (holds_lease(leases, id, now), left)
}

/// [`release`] in place: `leases` keeps those still live other than `id`; whether `id` was
/// one of them.
pub(crate) fn release_in(leases: &mut Vec<(u64, u64)>, id: u64, now: u64) -> bool {
    let held = holds_lease(leases, id, now);
    leases.retain(|&lease| stays(lease, id, now));
    held
}

/// Whether lease `id` is among the live `leases`.
fn holds_lease(leases: &[(u64, u64)], id: u64, now: u64) -> bool {
    id != 0
        && leases
            .iter()
            .any(|&(l, deadline)| l == id && concurrency::holds(deadline, now))
}

/// Whether `lease` stays when `id` is given back: live, and not `id`.
fn stays((l, deadline): (u64, u64), id: u64, now: u64) -> bool {
    l != id && concurrency::holds(deadline, now)
}

/// A concurrency transaction of a batch the kit decides ([`super::spend`]): a renewal of its
/// leases, or a spend, check or charge of one slot (a lease taken when allowed); leases cut
/// on reading are written whatever the batch decides.
pub(super) fn concurrency_spend(
    tx: &BucketTx<'_>,
    limit: &ConcurrencyLimit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Decided {
    let (leases, cut) = read_leases(limit, stored, now);
    let repair = cut.then(|| Stored::Leases(leases.to_vec()));
    let live = live_leases(&leases, now);
    let (outcome, write) = if tx.mode == Mode::Renew {
        let (renewed, next) = renew(limit, &leases, tx.renewed(), now);
        let outcome = Outcome {
            granted: Some(renewed),
            ..Outcome::new(renewed > 0, limit.max().saturating_sub(live), 0, 0)
        };
        (outcome, (renewed > 0).then_some(Stored::Leases(next)))
    } else {
        let d = if tx.mode == Mode::Charge {
            concurrency::charge(limit, live, tx.cost == 1)
        } else {
            concurrency::decide(limit, live, tx.cost == 1)
        };
        let write = (d.allowed && takes_lease(tx))
            .then(|| Stored::Leases(with_lease(&leases, limit, tx.lease, now)));
        (Outcome::from(d), write)
    };
    Decided {
        outcome,
        write,
        repair,
    }
}

/// A concurrency refund: its lease given back (a refund there is a release).
pub(super) fn concurrency_refund(
    tx: &BucketTx<'_>,
    limit: &ConcurrencyLimit,
    stored: Option<Read<'_>>,
    now: u64,
) -> Refunded {
    let (leases, _) = read_leases(limit, stored, now);
    let (released, left) = release(&leases, tx.lease, now);
    let live = left.len() as u64;
    (
        Outcome::new(released, limit.max().saturating_sub(live), 0, 0),
        Some(Stored::Leases(left)),
    )
        .into()
}
