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
//! #[tower_ratelimits::async_trait]
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
//!         let now = tower_ratelimits::Clock::now_us(&self.clock);
//!         let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
//!         for key in keys {
//!             // What a reset keeps (a concurrency key's requests in flight) stays.
//!             if let Some(state) = states.remove(*key)
//!                 && let Some((kept, _)) = kit::after_reset(state, now)
//!             {
//!                 states.insert((*key).clone(), kept);
//!             }
//!         }
//!         Ok(())
//!     }
//! }
//! ```
//!
//! A state of another shape than the transaction's quota (a limit that changed shape in a
//! reload) is read as a fresh one of the right shape, and replaced by the first write.

use crate::algo::calendar::{self, CalendarQuota, CalendarState};
use crate::algo::concurrency::{self, ConcurrencyLimit};
use crate::algo::gcra::{self, GcraError, GcraOutcome, Limit};
use crate::algo::tiers::{self, TierState, TieredLimit};
use crate::mode::Mode;
use crate::quota::Quota;
use std::borrow::Cow;

use super::{BackendError, BucketTx, Outcome, Outcomes};

/// The stored state of one bucket, as a backend keeps it (in any encoding it likes: the kit
/// needs only these values back).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stored {
    /// A GCRA bucket: one word, its theoretical arrival time in microseconds in the low 58
    /// bits and, in the top 6, the bound of the limit that wrote it (how far ahead of its
    /// writing that limit could set the TAT, as a bit length: `docs/gcra.md`, "Changing a
    /// limit"). Keep the word as it is; a plain TAT (the top bits 0) is read as written by the
    /// limit in force.
    Tat(u64),
    /// A tiered key: its grants per tier.
    Tiers(TierState),
    /// A concurrency key: its leases, `(lease id, deadline in microseconds)`; ended leases may
    /// still be listed (they do not count).
    Leases(Vec<(u64, u64)>),
    /// A calendar key: the end of the period its units were counted in, and the units used.
    Calendar(CalendarState),
}

/// A bucket's state as the kit reads it: borrowed from the store (`None` in [`spend`]'s
/// `read`: nothing stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Read<'a> {
    /// A GCRA bucket's stored word ([`Stored::Tat`]; 0: none).
    Tat(u64),
    /// A tiered key's grants per tier.
    Tiers(&'a TierState),
    /// A concurrency key's leases, `(lease id, deadline)`.
    Leases(&'a [(u64, u64)]),
    /// A calendar key's period end and units used.
    Calendar(CalendarState),
}

impl Stored {
    /// The state as the kit reads it.
    pub fn read(&self) -> Read<'_> {
        match self {
            Stored::Tat(t) => Read::Tat(*t),
            Stored::Tiers(s) => Read::Tiers(s),
            Stored::Leases(l) => Read::Leases(l),
            Stored::Calendar(c) => Read::Calendar(*c),
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
    /// What to store for each transaction's bucket (`None`: leave it as it is). When the batch
    /// is denied, only the states that replace foreign ones (a value the crate could not have
    /// written, read as drained: `docs/gcra.md`, "Foreign values"): a denied batch spends
    /// nothing.
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

/// The last transaction before `batch[i]` on the same key, if any: pairwise, for a batch's
/// few transactions.
#[inline]
pub(crate) fn earlier(batch: &[BucketTx<'_>], i: usize) -> Option<usize> {
    let key = batch[i].key;
    batch[..i].iter().rposition(|tx| tx.key == key)
}

/// Decides a spend (or, in a check mode, a check) of `batch` from the states read for it
/// (`read[i]` for `batch[i]`; `None`: nothing stored) at `now`: each transaction's outcome,
/// and, when the batch is allowed, what to write. The backend writes the writes only if the
/// states are unchanged since it read them (else it reads and decides again).
///
/// A key named twice is decided in order: the later transaction reads what the earlier one
/// writes (or, writing nothing, read), and only the key's last write is returned, so a backend
/// writes each key at most once (it reads such a key's state for its first transaction).
pub fn spend(
    batch: &[BucketTx<'_>],
    read: &[Option<Read<'_>>],
    now: u64,
) -> Result<Spent, BackendError> {
    let mut outcomes = Outcomes::with_capacity(batch.len());
    let mut writes: smallvec::SmallVec<[Option<Stored>; 4]> =
        smallvec::SmallVec::with_capacity(batch.len());
    // What replaces a foreign value, written whatever the batch decides.
    let mut repairs: smallvec::SmallVec<[Option<Stored>; 4]> =
        smallvec::SmallVec::with_capacity(batch.len());
    // Where a key is named again, the state its earlier transaction leaves (rare: the
    // limiter refuses such a batch; the lease calls may send one).
    let mut carried: Option<Stored>;
    let mut twice = false;
    for (i, tx) in batch.iter().enumerate() {
        let mut stored = read.get(i).copied().flatten();
        if let Some(mut k) = earlier(batch, i) {
            twice = true;
            // The latest state an earlier transaction of the key leaves, else what its first
            // one read.
            carried = loop {
                if let Some(state) = writes[k].as_ref().or(repairs[k].as_ref()) {
                    break Some(state.clone());
                }
                match earlier(batch, k) {
                    Some(j) => k = j,
                    None => break None,
                }
            };
            stored = match &carried {
                Some(state) => Some(state.read()),
                None => read.get(k).copied().flatten(),
            };
        }
        let mut repair = None;
        let (outcome, write) = match tx.quota {
            Quota::Gcra(limit) => {
                let word = match stored {
                    Some(Read::Tat(t)) => t,
                    _ => 0,
                };
                let step = gcra_step(tx, limit, word, now)?;
                repair = step.repair.map(Stored::Tat);
                (step.decision.outcome(), step.write.map(Stored::Tat))
            }
            Quota::Tiered(limit) => {
                let read = read_tiers(limit, stored, now);
                if let Cow::Owned(drained) = &read
                    && !drained.is_empty()
                {
                    repair = Some(Stored::Tiers(drained.clone()));
                }
                let state = &*read;
                let (d, plan) = tiers::decide(limit, state, now, tx.min_cost, tx.cost)?;
                let write = (d.allowed && tx.mode.spends()).then(|| {
                    let mut next = state.clone();
                    tiers::apply(limit, &mut next, now, &plan);
                    Stored::Tiers(next)
                });
                (Outcome::tiered(&d, limit), write)
            }
            Quota::Concurrency(limit) => {
                let (leases, cut) = read_leases(limit, stored, now);
                if cut {
                    repair = Some(Stored::Leases(leases.to_vec()));
                }
                let live = live_leases(&leases, now);
                if tx.mode == Mode::Renew {
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
                }
            }
            Quota::Calendar(quota) => {
                let (outcome, write, fix) = calendar_decide(tx, quota, stored, now);
                repair = fix;
                (outcome, write)
            }
        };
        outcomes.push(outcome);
        writes.push(write);
        repairs.push(repair);
    }
    let allowed = batch_allowed(batch.iter().zip(&outcomes));
    for (write, repair) in writes.iter_mut().zip(repairs) {
        if !allowed {
            *write = None;
        }
        if write.is_none() {
            *write = repair;
        }
    }
    if twice {
        // A key's last write holds what its earlier transactions wrote.
        for i in (0..batch.len()).rev() {
            if writes[i].is_some() {
                let mut k = i;
                while let Some(j) = earlier(batch, k) {
                    writes[j] = None;
                    k = j;
                }
            }
        }
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
            let word = match stored {
                Some(Read::Tat(t)) => t,
                _ => 0,
            };
            let (tat, writer) = gcra_unword(word);
            let wide = reading(limit, writer);
            let limit = wide.as_ref().unwrap_or(limit);
            let out = gcra::refund(limit, (tat != 0).then_some(tat), now, tx.cost)?;
            // What a refund leaves may still be as far ahead as the writer set it: keep its
            // bound with it.
            let bound = limit.bound_us().max(writer);
            let write = out.new_tat.map(|t| gcra_word_bound(t, bound)).transpose()?;
            (out.into(), write.map(Stored::Tat))
        }
        Quota::Tiered(limit) => {
            let mut state = read_tiers(limit, stored, now).into_owned();
            let d = tiers::refund(limit, &mut state, now, tx.cost);
            (Outcome::tiered(&d, limit), Some(Stored::Tiers(state)))
        }
        Quota::Concurrency(limit) => {
            let (leases, _) = read_leases(limit, stored, now);
            let (released, left) = release(&leases, tx.lease, now);
            let live = left.len() as u64;
            (
                Outcome::new(released, limit.max().saturating_sub(live), 0, 0),
                Some(Stored::Leases(left)),
            )
        }
        Quota::Calendar(quota) => {
            let (start, end) = quota.period_at(now);
            let state = calendar_read(stored);
            let out = calendar::refund(quota, state, end, now, tx.cost);
            // What the read replaces is written when the refund writes nothing.
            let write = out.write.or(calendar::read(quota, state, end, now).1);
            (
                calendar_outcome(&out, end - start),
                write.map(Stored::Calendar),
            )
        }
    })
}

/// A calendar key's state as the kit reads it (another shape's: none).
fn calendar_read(stored: Option<Read<'_>>) -> Option<CalendarState> {
    match stored {
        Some(Read::Calendar(s)) => Some(s),
        _ => None,
    }
}

/// The calendar decision of a transaction ([`calendar::decide`], in the period in force at
/// `now`), what it writes, and what replaces the state read ([`calendar::read`]: a foreign
/// value, or an end past the period in force), written whatever the batch decides.
fn calendar_decide(
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

/// A calendar decision as an outcome, with the length of the period it was made in
/// (microseconds).
fn calendar_outcome(out: &calendar::CalendarOutcome, length_us: u64) -> Outcome {
    Outcome {
        granted: Some(out.granted),
        period_s: calendar::period_seconds(length_us),
        ..Outcome::new(
            out.allowed,
            out.remaining,
            out.retry_after_us,
            out.reset_after_us,
        )
    }
}

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

/// A tiered key's state as `limit` reads it at `now`: as stored, fresh when none is (or one of
/// another shape), drained ([`tiers::drained`]) when it holds a time further ahead than the
/// crate writes (then an owned, non-empty state: the caller writes it whatever it decides).
fn read_tiers<'s>(limit: &TieredLimit, stored: Option<Read<'s>>, now: u64) -> Cow<'s, TierState> {
    match stored {
        Some(Read::Tiers(s)) if !s.is_foreign(now) => Cow::Borrowed(s),
        Some(Read::Tiers(_)) => Cow::Owned(tiers::drained(limit, now)),
        _ => Cow::Owned(TierState::new()),
    }
}

/// A concurrency key's leases as `limit` reads them at `now` ([`concurrency::read`]: a
/// deadline beyond what the crate writes is cut to one lease from now), and whether one was
/// cut (then the key is written so, whatever the decision).
fn read_leases<'s>(
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

/// Whether a transaction may write a state kept apart from GCRA words (a backend that keeps
/// such states in slots of their own need make one only then): a spend of a tiered key, a
/// lease taken on a concurrency key.
pub(crate) fn may_write(tx: &BucketTx<'_>) -> bool {
    match tx.quota {
        Quota::Concurrency(_) => takes_lease(tx),
        _ => tx.mode.spends(),
    }
}

/// The first instant at which `state`, kept under `quota`, equals a fresh one: from then on a
/// store may forget it.
pub(crate) fn fresh_at(quota: &Quota, state: &Stored, now: u64) -> u64 {
    match (quota, state) {
        (_, Stored::Tat(word)) => gcra_tat(*word),
        (Quota::Tiered(limit), Stored::Tiers(s)) => tiers::fresh_at(limit, s, now, None),
        (_, Stored::Leases(leases)) => leases.iter().map(|&(_, d)| d).max().unwrap_or(0),
        (_, Stored::Calendar(c)) => c.end_us,
        _ => 0,
    }
}

/// What a reset leaves of a key's state at `now`, and when that equals a fresh one (from then
/// on the store may forget it): a concurrency key's live leases (requests in flight:
/// forgetting them would admit more at once than the limit); nothing of the rest (`None`:
/// remove the key).
pub fn after_reset(state: Stored, now: u64) -> Option<(Stored, u64)> {
    match state {
        Stored::Leases(mut leases) => {
            leases.retain(|&(_, d)| concurrency::live(d, now));
            let last = leases.iter().map(|&(_, d)| d).max()?;
            Some((Stored::Leases(leases), last))
        }
        _ => None,
    }
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
    let holds = |deadline| concurrency::holds(deadline, now);
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
