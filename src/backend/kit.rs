//! The batch kit: what a backend decides, written once, for any store.
//!
//! A backend reads the stored states of a batch's buckets, hands them to [`spend`] (or one of
//! them to [`refund`]), and writes back the states the kit returns, **if they are unchanged
//! since it read them** (one transaction, a lock, or a compare-and-swap per key). Everything a
//! decision follows lives here: the GCRA rule (`docs/gcra.md`), burst tiers
//! (`docs/burst-tiers.md`), concurrency leases (`docs/concurrency.md`), the batch rule (a batch
//! is allowed when every transaction that counts is allowed), the write rule (what an allowed
//! transaction of an allowed batch writes, by its [`Mode`]) and what a denied batch reports
//! (each transaction's own decision; nothing is written). The memory backend is a store plus
//! this kit; the Redis script mirrors it function for function in Lua.
//!
//! A store of one process behind a mutex, in full:
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::Mutex;
//! use tower_ratelimits::kit::{self, Stored};
//! use tower_ratelimits::{Backend, BackendError, BucketKey, BucketTx, Outcome, Spend};
//!
//! #[derive(Default)]
//! struct Store {
//!     clock: tower_ratelimits::ManualClock,
//!     states: Mutex<HashMap<BucketKey, Stored>>,
//! }
//!
//! #[async_trait::async_trait]
//! impl Backend for Store {
//!     fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
//!         let now = tower_ratelimits::Clock::now_us(&self.clock);
//!         let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
//!         let read: Vec<_> = batch.iter().map(|tx| states.get(tx.key()).map(Stored::read)).collect();
//!         let spent = match kit::spend(batch, &read, now) {
//!             Ok(spent) => spent,
//!             Err(e) => return Spend::Ready(Err(e)),
//!         };
//!         for (tx, write) in batch.iter().zip(spent.writes) {
//!             if let Some(state) = write {
//!                 states.insert(tx.key().clone(), state);
//!             }
//!         }
//!         Spend::Ready(Ok(spent.outcomes))
//!     }
//!     async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
//!         let now = tower_ratelimits::Clock::now_us(&self.clock);
//!         let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
//!         let mut outcomes = Vec::with_capacity(batch.len());
//!         for tx in batch {
//!             let (outcome, write) = kit::refund(tx, states.get(tx.key()).map(Stored::read), now)?;
//!             if let Some(state) = write {
//!                 states.insert(tx.key().clone(), state);
//!             }
//!             outcomes.push(outcome);
//!         }
//!         Ok(outcomes)
//!     }
//!     async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
//!         let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
//!         for key in keys {
//!             states.remove(*key);
//!         }
//!         Ok(())
//!     }
//! }
//! ```
//!
//! A state of another shape than the transaction's quota (a limit that changed shape in a
//! reload) is read as a fresh one of the right shape, and replaced by the first write.

use crate::algo::concurrency::{self, ConcurrencyLimit};
use crate::algo::gcra::{self, GcraError, GcraOutcome, Limit};
use crate::algo::tiers::{self, TierState};
use crate::mode::Mode;
use crate::quota::Quota;

use super::{BackendError, BucketTx, Outcome, Outcomes};

/// The stored state of one bucket, as a backend keeps it (in any encoding it likes: the kit
/// needs only these values back).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stored {
    /// A GCRA bucket: its theoretical arrival time, in microseconds.
    Tat(u64),
    /// A tiered key: its grants per tier.
    Tiers(TierState),
    /// A concurrency key: its leases, `(lease id, deadline in microseconds)`; ended leases may
    /// still be listed (they do not count).
    Leases(Vec<(u64, u64)>),
}

/// A bucket's state as the kit reads it: borrowed from the store (`None` in [`spend`]'s
/// `read`: nothing stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Read<'a> {
    /// A GCRA bucket's theoretical arrival time (0: none).
    Tat(u64),
    /// A tiered key's grants per tier.
    Tiers(&'a TierState),
    /// A concurrency key's leases, `(lease id, deadline)`.
    Leases(&'a [(u64, u64)]),
}

impl Stored {
    /// The state as the kit reads it.
    pub fn read(&self) -> Read<'_> {
        match self {
            Stored::Tat(t) => Read::Tat(*t),
            Stored::Tiers(s) => Read::Tiers(s),
            Stored::Leases(l) => Read::Leases(l),
        }
    }
}

/// A batch the kit decided ([`spend`]): one outcome and one write per transaction, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spent {
    /// Whether the batch is allowed: every transaction that counts was allowed (the batch
    /// rule, applied once by [`spend`]).
    pub allowed: bool,
    /// What each transaction reports.
    pub outcomes: Outcomes,
    /// What to store for each transaction's bucket (`None`: leave it as it is). All `None`
    /// when the batch is denied: a denied batch writes nothing.
    pub writes: smallvec::SmallVec<[Option<Stored>; 4]>,
}

/// The batch rule (`docs/gcra.md`): a batch is allowed when every transaction that counts was
/// allowed. Every backend applies it through this function (the script's `counts` in Lua).
pub(crate) fn batch_allowed<'t, 'b: 't, 'o>(
    decided: impl IntoIterator<Item = (&'t BucketTx<'b>, &'o Outcome)>,
) -> bool {
    decided
        .into_iter()
        .all(|(tx, o)| !tx.mode.counts() || o.allowed)
}

/// Decides a spend (or, in a check mode, a check) of `batch` from the states read for it
/// (`read[i]` for `batch[i]`; `None`: nothing stored) at `now`: each transaction's outcome,
/// and, when the batch is allowed, what to write. The backend writes the writes only if the
/// states are unchanged since it read them (else it reads and decides again).
pub fn spend(
    batch: &[BucketTx<'_>],
    read: &[Option<Read<'_>>],
    now: u64,
) -> Result<Spent, BackendError> {
    let mut outcomes = Outcomes::with_capacity(batch.len());
    let mut writes = smallvec::SmallVec::with_capacity(batch.len());
    for (i, tx) in batch.iter().enumerate() {
        let stored = read.get(i).copied().flatten();
        let (outcome, write) = match tx.quota {
            Quota::Gcra(limit) => {
                let tat = match stored {
                    Some(Read::Tat(t)) => t,
                    _ => 0,
                };
                let d = gcra_decide(tx, limit, (tat != 0).then_some(tat), now)?;
                let write = gcra_write(tx.mode, &d.out, tat, now).map(Stored::Tat);
                (d.outcome(), write)
            }
            Quota::Tiered(limit) => {
                let fresh = TierState::new();
                let state = match stored {
                    Some(Read::Tiers(s)) if !s.is_foreign(now) => s,
                    _ => &fresh,
                };
                let (d, plan) = tiers::decide(limit, state, now, tx.min_cost, tx.cost)?;
                let write = (d.allowed && tx.mode.spends()).then(|| {
                    let mut next = state.clone();
                    tiers::apply(limit, &mut next, now, &plan);
                    Stored::Tiers(next)
                });
                (Outcome::tiered(&d, limit), write)
            }
            Quota::Concurrency(limit) if tx.mode == Mode::Renew => {
                let leases = match stored {
                    Some(Read::Leases(l)) => l,
                    _ => &[],
                };
                let (renewed, next) = renew(limit, leases, tx.lease, now);
                let live = live_leases(limit, leases, now);
                (
                    Outcome::new(renewed, limit.max().saturating_sub(live), 0, 0),
                    renewed.then_some(Stored::Leases(next)),
                )
            }
            Quota::Concurrency(limit) => {
                let leases = match stored {
                    Some(Read::Leases(l)) => l,
                    _ => &[],
                };
                let live = live_leases(limit, leases, now);
                let d = if tx.mode == Mode::Charge {
                    concurrency::charge(limit, live, tx.cost == 1)
                } else {
                    concurrency::decide(limit, live, tx.cost == 1)
                };
                let write = (d.allowed && takes_lease(tx))
                    .then(|| Stored::Leases(with_lease(leases, limit, tx.lease, now)));
                (Outcome::from(d), write)
            }
        };
        outcomes.push(outcome);
        writes.push(write);
    }
    let allowed = batch_allowed(batch.iter().zip(&outcomes));
    if !allowed {
        writes.iter_mut().for_each(|w| *w = None);
    }
    Ok(Spent {
        allowed,
        outcomes,
        writes,
    })
}

/// Decides a refund of `tx` (its cost; on a concurrency key, the release of its lease) from the
/// state read (`None`: nothing stored) at `now`: its outcome, and what to write.
pub fn refund(
    tx: &BucketTx<'_>,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<(Outcome, Option<Stored>), BackendError> {
    Ok(match tx.quota {
        Quota::Gcra(limit) => {
            let tat = match stored {
                Some(Read::Tat(t)) if t != 0 => Some(t),
                _ => None,
            };
            let out = gcra::refund(limit, tat, now, tx.cost)?;
            (out.into(), out.new_tat.map(Stored::Tat))
        }
        Quota::Tiered(limit) => {
            let mut state = match stored {
                Some(Read::Tiers(s)) if !s.is_foreign(now) => s.clone(),
                _ => TierState::new(),
            };
            let d = tiers::refund(limit, &mut state, now, tx.cost);
            (Outcome::tiered(&d, limit), Some(Stored::Tiers(state)))
        }
        Quota::Concurrency(limit) => {
            let leases = match stored {
                Some(Read::Leases(l)) => l,
                _ => &[],
            };
            let (released, left) = release(limit, leases, tx.lease, now);
            let live = left.len() as u64;
            (
                Outcome::new(released, limit.max().saturating_sub(live), 0, 0),
                Some(Stored::Leases(left)),
            )
        }
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

/// Whether a transaction on a concurrency key takes a lease when it and its batch are allowed:
/// a spend of one slot with a lease id.
pub(crate) fn takes_lease(tx: &BucketTx<'_>) -> bool {
    tx.mode.spends() && tx.cost == 1 && tx.lease != 0
}

/// Renews lease `id` at `now`: whether it still held its slot, and the key's live leases with
/// its deadline moved to now plus the lease time (as the script: ended and foreign leases go).
/// A lease that no longer holds a slot is not taken again.
pub(crate) fn renew(
    limit: &ConcurrencyLimit,
    leases: &[(u64, u64)],
    id: u64,
    now: u64,
) -> (bool, Vec<(u64, u64)>) {
    let mut renewed = false;
    let next = leases
        .iter()
        .filter(|&&(_, deadline)| concurrency::holds(limit, deadline, now))
        .map(|&(l, deadline)| {
            if l == id && id != 0 {
                renewed = true;
                (l, concurrency::deadline(limit, now))
            } else {
                (l, deadline)
            }
        })
        .collect();
    (renewed, next)
}

/// The leases of a key that hold a slot at `now` ([`concurrency::holds`]).
pub(crate) fn live_leases(limit: &ConcurrencyLimit, leases: &[(u64, u64)], now: u64) -> u64 {
    leases
        .iter()
        .filter(|&&(_, deadline)| concurrency::holds(limit, deadline, now))
        .count() as u64
}

/// A key's live leases with lease `id` taken at `now` (the ended and foreign ones dropped).
pub(crate) fn with_lease(
    leases: &[(u64, u64)],
    limit: &ConcurrencyLimit,
    id: u64,
    now: u64,
) -> Vec<(u64, u64)> {
    let mut next: Vec<(u64, u64)> = leases
        .iter()
        .copied()
        .filter(|&(_, deadline)| concurrency::holds(limit, deadline, now))
        .collect();
    next.push((id, concurrency::deadline(limit, now)));
    next
}

/// Gives back lease `id`: whether it was held (a live lease of that id), and the live leases
/// left (as the script: ended and foreign leases go first, then it).
pub(crate) fn release(
    limit: &ConcurrencyLimit,
    leases: &[(u64, u64)],
    id: u64,
    now: u64,
) -> (bool, Vec<(u64, u64)>) {
    let holds = |deadline| concurrency::holds(limit, deadline, now);
    let held = id != 0
        && leases
            .iter()
            .any(|&(l, deadline)| l == id && holds(deadline));
    let left = leases
        .iter()
        .copied()
        .filter(|&(l, deadline)| l != id && holds(deadline))
        .collect();
    (held, left)
}
