//! The batch kit: what a backend decides, written once, for any store.
//!
//! A backend reads the stored states of a batch's buckets, hands them to [`spend`] (or one of
//! them to [`refund`]), and writes back the states the kit returns, **if they are unchanged
//! since it read them** (one transaction, a lock, or a compare-and-swap per key). Everything a
//! decision follows lives here: the GCRA rule (`docs/gcra.md`), burst tiers
//! (`docs/burst-tiers.md`), concurrency leases (`docs/concurrency.md`), the batch rule (a batch
//! is allowed when every transaction that counts is allowed), the write rule (what an allowed
//! transaction of an allowed batch writes, by its [`Mode`](crate::Mode)) and what a denied batch reports
//! (each transaction's own decision; nothing is written). The memory backend is a store plus
//! this kit; the Redis script mirrors it function for function in Lua.
//!
//! A store of one process behind a mutex, in full (each state at [`state_key`]: a
//! transaction's own key, or its limit's for a shape kept per limit, a fair share, whose ids
//! share one budget):
//!
//! ```
//! use std::collections::HashMap;
//! use std::sync::Mutex;
//! use tower_ratelimits::kit::{self, Stored};
//! use tower_ratelimits::{Backend, BackendError, BucketKey, BucketTx, Outcomes, Spend};
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
//!         let read: Vec<_> = batch
//!             .iter()
//!             .map(|tx| states.get(&*kit::state_key(tx)).map(Stored::read))
//!             .collect();
//!         let spent = match kit::spend(batch, &read, now) {
//!             Ok(spent) => spent,
//!             Err(e) => return Spend::Ready(Err(e)),
//!         };
//!         for (tx, write) in batch.iter().zip(spent.writes) {
//!             if let Some(state) = write {
//!                 states.insert(kit::state_key(tx).into_owned(), state);
//!             }
//!         }
//!         Spend::Ready(Ok(spent.outcomes))
//!     }
//!     async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
//!         let now = tower_ratelimits::Clock::now_us(&self.clock);
//!         let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
//!         let mut outcomes = Outcomes::with_capacity(batch.len());
//!         for tx in batch {
//!             let key = kit::state_key(tx);
//!             let r = kit::refund(tx, states.get(&*key).map(Stored::read), now)?;
//!             if let Some(state) = r.write {
//!                 states.insert(key.into_owned(), state);
//!             }
//!             outcomes.push_tiered(r.outcome, r.tiers);
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

mod adaptive;
mod calendar;
mod concurrency;
mod fair_share;
mod gcra;
mod penalty;
mod shared_map;
mod tiers;

use crate::algo::calendar::CalendarState;
use crate::algo::concurrency as concurrency_rule;
use crate::algo::tiers::{self as tiers_rule, TierGrant, TierState};
use crate::quota::Quota;

pub use crate::algo::adaptive::{AdaptiveState, Controller, Window};
pub use crate::algo::fair_share::{Member, Pool, ShareOf, Waiter};
pub use adaptive::{AdaptivePool, MAX_POOL_KEYS, MAX_POOL_WAITERS};
use adaptive::{adaptive_decide, adaptive_fresh_at, adaptive_refund, pool_fresh_at};
#[cfg(feature = "redis")]
pub(crate) use calendar::calendar_outcome;
pub(crate) use calendar::calendar_spend_one;
use calendar::{calendar_decide, calendar_refund};
use concurrency::{concurrency_refund, concurrency_spend};
pub(crate) use concurrency::{release_in, renew, takes_lease};
pub use fair_share::{FairPool, state_key};
use fair_share::{fair_share_decide, fair_share_fresh_at, fair_share_refund};
#[cfg(all(feature = "replay", feature = "redis"))]
pub(crate) use gcra::gcra_word_bound;
#[cfg(feature = "redis")]
pub(crate) use gcra::trusted;
pub(crate) use gcra::{
    GcraDecision, gcra_decide, gcra_step, gcra_tat, gcra_unword, gcra_word, gcra_write,
};
use gcra::{gcra_refund, gcra_spend};
pub(crate) use penalty::penalty_fresh_at;
use penalty::{penalty_settle, penalty_spend};
use tiers::{tiers_refund, tiers_spend};

use super::{BackendError, BucketTx, Outcome, Outcomes};

/// The stored state of one bucket, as a backend keeps it (in any encoding it likes: the kit
/// needs only these values back).
///
/// It serializes (serde) as one field named for its shape (`gcra`, `tiers`, `leases`,
/// `calendar`, `fair_share`, `adaptive`, `adaptive_pool`) holding the state's written form,
/// each written and read by the shape's own file: a replay snapshot's line
/// (`docs/replay.md`, "Starting warm"); reading one checks what the shape keeps (a bound's
/// length, how many ids).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Stored {
    /// A GCRA bucket: one word, its theoretical arrival time in microseconds in the low 58
    /// bits and, in the top 6, the bound of the limit that wrote it (how far ahead of its
    /// writing that limit could set the TAT, as a bit length: `docs/gcra.md`, "Changing a
    /// limit"). Keep the word as it is; a plain TAT (the top bits 0) is read as written by the
    /// limit in force.
    #[serde(rename = "gcra", with = "gcra::line")]
    Tat(u64),
    /// A tiered key: its grants per tier.
    #[serde(with = "tiers::line")]
    Tiers(TierState),
    /// A concurrency key: its leases, `(lease id, deadline in microseconds)`; ended leases may
    /// still be listed (they do not count).
    Leases(Vec<(u64, u64)>),
    /// A calendar key: the end of the period its units were counted in, and the units used.
    #[serde(with = "calendar::line")]
    Calendar(CalendarState),
    /// A fair-share limit's whole state (its pool and members), kept once per limit at
    /// [`state_key`].
    #[serde(with = "fair_share::line")]
    FairShare(Box<FairPool>),
    /// An adaptive concurrency key: its leases, its controller and the window being filled.
    #[serde(with = "adaptive::line")]
    Adaptive(Box<AdaptiveState>),
    /// The keys of an adaptive limit that share a capacity, kept once per limit at
    /// [`state_key`].
    #[serde(with = "adaptive::line::pool")]
    AdaptivePool(Box<AdaptivePool>),
    /// A key's penalty state (`docs/penalties.md`): its level, its ban's end, the window's
    /// counted units and its requests in flight, kept beside its limit's bucket.
    #[serde(with = "penalty::line")]
    Penalty(Box<crate::algo::penalty::PenaltyState>),
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
    /// A fair-share limit's state.
    FairShare(&'a FairPool),
    /// An adaptive concurrency key's state.
    Adaptive(&'a AdaptiveState),
    /// The keys of an adaptive limit that share a capacity.
    AdaptivePool(&'a AdaptivePool),
    /// A key's penalty state.
    Penalty(&'a crate::algo::penalty::PenaltyState),
}

impl Stored {
    /// The state as the kit reads it.
    pub fn read(&self) -> Read<'_> {
        match self {
            Stored::Tat(t) => Read::Tat(*t),
            Stored::Tiers(s) => Read::Tiers(s),
            Stored::Leases(l) => Read::Leases(l),
            Stored::Calendar(c) => Read::Calendar(*c),
            Stored::FairShare(p) => Read::FairShare(p),
            Stored::Adaptive(a) => Read::Adaptive(a),
            Stored::AdaptivePool(p) => Read::AdaptivePool(p),
            Stored::Penalty(p) => Read::Penalty(p),
        }
    }

    /// Whether this is a state of `quota`'s shape: what a store keeps for a bucket under it
    /// (a state of another shape is another key's in a store, never read by this limit).
    #[cfg(feature = "replay")]
    pub(crate) fn is_shape_of(&self, quota: &Quota) -> bool {
        self.kept() == Kept::of(quota)
    }

    /// Which state this is.
    #[cfg(feature = "replay")]
    fn kept(&self) -> Kept {
        match self {
            Stored::Tat(_) => Kept::Word,
            Stored::Tiers(_) => Kept::Tiers,
            Stored::Leases(_) => Kept::Leases,
            Stored::Calendar(_) => Kept::Calendar,
            Stored::FairShare(_) => Kept::FairShare,
            Stored::Adaptive(_) => Kept::Adaptive,
            Stored::AdaptivePool(_) => Kept::AdaptivePool,
            Stored::Penalty(_) => Kept::Penalty,
        }
    }
}

/// The state a limit keeps, one for each of [`Stored`]'s variants: a shape's, and for an
/// adaptive limit whose keys share a capacity, the pool all its keys are kept in. The one place
/// that tells the pooled adaptive limit apart ([`Kept::of`]); the Redis key suffix and a
/// snapshot's seeding ([`Stored::is_shape_of`]) and how a snapshot reads a key back
/// (`redis::keys::reading_of`) match on it, so the compiler lists them for a new state; the
/// kit's `fresh_at` and `after_reset` name every `Stored` variant. The memory backend's
/// accessors (one state each, for inspection) still end in a catch-all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(any(feature = "redis", feature = "replay")), allow(dead_code))]
pub(crate) enum Kept {
    Word,
    Tiers,
    Leases,
    Calendar,
    FairShare,
    Adaptive,
    AdaptivePool,
    /// A key's penalty state: a penalty's companion, never a limit's own shape.
    Penalty,
}

#[cfg_attr(not(any(feature = "redis", feature = "replay")), allow(dead_code))]
impl Kept {
    /// Every state, in the order of [`index`](Self::index) (which the compiler holds to the
    /// variants: a new one is added there and here).
    pub(crate) const ALL: [Kept; 8] = [
        Kept::Word,
        Kept::Tiers,
        Kept::Leases,
        Kept::Calendar,
        Kept::FairShare,
        Kept::Adaptive,
        Kept::AdaptivePool,
        Kept::Penalty,
    ];

    /// Its place in [`ALL`](Self::ALL) (held to it as the crate builds).
    pub(crate) const fn index(self) -> usize {
        match self {
            Kept::Word => 0,
            Kept::Tiers => 1,
            Kept::Leases => 2,
            Kept::Calendar => 3,
            Kept::FairShare => 4,
            Kept::Adaptive => 5,
            Kept::AdaptivePool => 6,
            Kept::Penalty => 7,
        }
    }

    /// The state `quota` keeps.
    #[inline]
    pub(crate) fn of(quota: &Quota) -> Kept {
        match quota {
            Quota::Gcra(_) => Kept::Word,
            Quota::Tiered(_) => Kept::Tiers,
            Quota::Concurrency(_) => Kept::Leases,
            Quota::Calendar(_) => Kept::Calendar,
            Quota::FairShare(_) => Kept::FairShare,
            Quota::Adaptive(a) => match a.shared_capacity() {
                Some(_) => Kept::AdaptivePool,
                None => Kept::Adaptive,
            },
        }
    }
}

// Every entry of `Kept::ALL` is at its own index: a state listed twice or out of place does
// not build.
const _: () = {
    let mut i = 0;
    while i < Kept::ALL.len() {
        assert!(Kept::ALL[i].index() == i);
        i += 1;
    }
};

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

/// The last transaction before `batch[i]` on the same state, if any (the same key, or for a
/// shape kept per limit, the same limit: [`state_key`]): pairwise, for a batch's few
/// transactions.
#[inline]
pub(crate) fn earlier(batch: &[BucketTx<'_>], i: usize) -> Option<usize> {
    let this = &batch[i];
    batch[..i].iter().rposition(|tx| {
        (tx.key == this.key && tx.penalty.is_none() == this.penalty.is_none())
            || (tx.key.name() == this.key.name()
                && tx.quota.state_per_limit()
                && this.quota.state_per_limit())
    })
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
    let mut writes: Writes = smallvec::SmallVec::with_capacity(batch.len());
    // What replaces a foreign value, written whatever the batch decides.
    let mut repairs: Writes = smallvec::SmallVec::with_capacity(batch.len());
    let mut twice = false;
    for (i, tx) in batch.iter().enumerate() {
        let carried;
        let stored = match earlier(batch, i) {
            None => read.get(i).copied().flatten(),
            Some(k) => {
                // Where a key is named again, the state its earlier transaction leaves (rare:
                // the limiter refuses such a batch; the lease calls may send one).
                twice = true;
                let first;
                (carried, first) = left_by_earlier(batch, &writes, &repairs, k);
                match &carried {
                    Some(state) => Some(state.read()),
                    None => read.get(first).copied().flatten(),
                }
            }
        };
        decide(tx, stored, now, (&mut outcomes, &mut writes, &mut repairs))?;
    }
    let allowed = batch_allowed(batch.iter().zip(&outcomes));
    last_writes(batch, allowed, &mut writes, repairs, twice);
    Ok(Spent {
        allowed,
        outcomes,
        writes,
    })
}

/// What a batch writes, one entry per transaction.
type Writes = smallvec::SmallVec<[Option<Stored>; 4]>;

/// One transaction decided on the state it read ([`decide`]): small, as every transaction
/// returns one (a tiered limit's grant per tier goes straight to the outcomes).
pub(crate) struct Decided {
    /// What it reports.
    pub(crate) outcome: Outcome,
    /// What it writes if its batch is allowed.
    pub(crate) write: Option<Stored>,
    /// What it writes whatever its batch decides: a foreign value replaced, what a fair share
    /// saw.
    pub(crate) repair: Option<Stored>,
}

impl From<(Outcome, Option<Stored>, Option<Stored>)> for Decided {
    fn from((outcome, write, repair): (Outcome, Option<Stored>, Option<Stored>)) -> Self {
        Self {
            outcome,
            write,
            repair,
        }
    }
}

/// One transaction of a batch decided on `stored`: one call to its shape's own file, its
/// outcome (a tiered limit's with its grant per tier), write and repair pushed where the batch
/// keeps them (pushed here, not returned: a transaction's road stays short).
#[inline]
fn decide(
    tx: &BucketTx<'_>,
    stored: Option<Read<'_>>,
    now: u64,
    (outcomes, writes, repairs): (&mut Outcomes, &mut Writes, &mut Writes),
) -> Result<(), BackendError> {
    if let Some(penalty) = tx.penalty {
        let d = penalty_spend(tx, penalty, stored, now);
        outcomes.push(d.outcome);
        writes.push(d.write);
        repairs.push(d.repair);
        return Ok(());
    }
    let d = match tx.quota {
        Quota::Gcra(limit) => gcra_spend(tx, limit, stored, now)?,
        Quota::Tiered(limit) => {
            let (decided, grant) = tiers_spend(tx, limit, stored, now)?;
            outcomes.put_grant(outcomes.len(), grant);
            decided
        }
        Quota::Concurrency(limit) => concurrency_spend(tx, limit, stored, now),
        Quota::Calendar(quota) => calendar_decide(tx, quota, stored, now).into(),
        // What it saw (the id active, a wait) is written whatever the batch decides.
        Quota::FairShare(share) => fair_share_decide(tx, share, stored, now)?.into(),
        Quota::Adaptive(limit) => adaptive_decide(tx, limit, stored, now).into(),
    };
    outcomes.push(d.outcome);
    writes.push(d.write);
    repairs.push(d.repair);
    Ok(())
}

/// The latest state the transactions of a key before `batch[k]` (and `batch[k]` itself) leave,
/// and the key's first transaction, whose read stands when none of them writes.
fn left_by_earlier(
    batch: &[BucketTx<'_>],
    writes: &[Option<Stored>],
    repairs: &[Option<Stored>],
    mut k: usize,
) -> (Option<Stored>, usize) {
    loop {
        if let Some(state) = writes[k].as_ref().or(repairs[k].as_ref()) {
            return (Some(state.clone()), k);
        }
        match earlier(batch, k) {
            Some(j) => k = j,
            None => return (None, k),
        }
    }
}

/// What a decided batch writes: an allowed one its writes, a denied one none, and either the
/// repairs where nothing else is written; a key named twice only at its last transaction (which
/// holds what its earlier ones wrote).
fn last_writes(
    batch: &[BucketTx<'_>],
    allowed: bool,
    writes: &mut Writes,
    repairs: Writes,
    twice: bool,
) {
    for (write, repair) in writes.iter_mut().zip(repairs) {
        if !allowed {
            *write = None;
        }
        if write.is_none() {
            *write = repair;
        }
    }
    if twice {
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
}

/// A transaction the kit refunded ([`refund`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refunded {
    /// What the refund reports.
    pub outcome: Outcome,
    /// A tiered key's units taken back, per tier (for [`Outcomes::push_tiered`]).
    pub tiers: Option<TierGrant>,
    /// What to store for the bucket (`None`: leave it as it is).
    pub write: Option<Stored>,
}

/// Decides a refund of `tx` (its cost; on a concurrency key, the release of its lease) from the
/// state read (`None`: nothing stored) at `now`: its outcome, and what to write.
pub fn refund(
    tx: &BucketTx<'_>,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<Refunded, BackendError> {
    if let Some(penalty) = tx.penalty {
        return Ok(penalty_settle(tx, penalty, stored, now));
    }
    Ok(match tx.quota {
        Quota::Gcra(limit) => gcra_refund(tx, limit, stored, now)?,
        Quota::Tiered(limit) => tiers_refund(tx, limit, stored, now),
        Quota::Concurrency(limit) => concurrency_refund(tx, limit, stored, now),
        Quota::Calendar(quota) => calendar_refund(tx, quota, stored, now),
        Quota::FairShare(share) => fair_share_refund(tx, share, stored, now)?.into(),
        Quota::Adaptive(limit) => adaptive_refund(tx, limit, stored, now).into(),
    })
}

impl From<(Outcome, Option<Stored>)> for Refunded {
    fn from((outcome, write): (Outcome, Option<Stored>)) -> Self {
        Self {
            outcome,
            tiers: None,
            write,
        }
    }
}

/// Whether a transaction may write a state kept apart from GCRA words (a backend that keeps
/// such states in slots of their own need make one only then): a spend of a tiered key, a
/// lease taken on a concurrency key.
pub(crate) fn may_write(tx: &BucketTx<'_>) -> bool {
    if tx.quota.holds_leases() {
        takes_lease(tx)
    } else {
        tx.mode.spends()
    }
}

/// The first instant at which `state`, kept under `quota`, equals a fresh one: from then on a
/// store may forget it.
///
/// Every state is an arm (no catch-all: a new one does not build until it says); a state
/// kept under a limit of another shape is fresh at once (0).
/// A penalty's state (`penalty`: its companion's entry; `None`: a state kept under no penalty
/// now) is fresh when its ban and level are over and its window is empty.
pub(crate) fn fresh_at(
    quota: &Quota,
    penalty: Option<&crate::config::PenaltyEntry>,
    state: &Stored,
    now: u64,
) -> u64 {
    match state {
        Stored::Tat(word) => gcra_tat(*word),
        Stored::Tiers(s) => match quota {
            Quota::Tiered(limit) => tiers_rule::fresh_at(limit, s, now, None),
            _ => 0,
        },
        Stored::Leases(leases) => leases.iter().map(|&(_, d)| d).max().unwrap_or(0),
        Stored::Calendar(c) => c.end_us,
        Stored::FairShare(p) => match quota {
            Quota::FairShare(share) => fair_share_fresh_at(share, p),
            _ => 0,
        },
        Stored::Adaptive(a) => match quota {
            Quota::Adaptive(limit) => adaptive_fresh_at(limit, a),
            _ => 0,
        },
        Stored::AdaptivePool(p) => match quota {
            Quota::Adaptive(limit) => pool_fresh_at(limit, p),
            _ => 0,
        },
        Stored::Penalty(p) => penalty.map_or(0, |e| penalty_fresh_at(&e.ladder, p)),
    }
}

/// What a reset leaves of a key's state at `now`, and when that equals a fresh one (from then
/// on the store may forget it): a concurrency key's live leases (requests in flight:
/// forgetting them would admit more at once than the limit); nothing of the rest (`None`:
/// remove the key).
pub fn after_reset(state: Stored, now: u64) -> Option<(Stored, u64)> {
    match state {
        Stored::Leases(mut leases) => {
            leases.retain(|&(_, d)| concurrency_rule::live(d, now));
            let last = leases.iter().map(|&(_, d)| d).max()?;
            Some((Stored::Leases(leases), last))
        }
        // What it learned goes; its requests in flight stay.
        Stored::Adaptive(mut state) => {
            state
                .leases
                .retain(|&(_, d)| concurrency_rule::live(d, now));
            let last = state.leases.iter().map(|&(_, d)| d).max()?;
            let leases = std::mem::take(&mut state.leases);
            Some((
                Stored::Adaptive(Box::new(AdaptiveState {
                    leases,
                    ..AdaptiveState::default()
                })),
                last,
            ))
        }
        // What each key learned goes; its requests in flight stay, and no one waits.
        Stored::AdaptivePool(pool) => {
            let keys: Vec<_> = pool
                .keys()
                .filter_map(|(id, s)| {
                    let leases: Vec<(u64, u64)> = s
                        .leases
                        .iter()
                        .copied()
                        .filter(|&(_, d)| concurrency_rule::live(d, now))
                        .collect();
                    (!leases.is_empty()).then(|| {
                        let state = AdaptiveState {
                            leases,
                            ..AdaptiveState::default()
                        };
                        (id.clone(), state)
                    })
                })
                .collect();
            let last = keys
                .iter()
                .flat_map(|(_, s)| s.leases.iter().map(|&(_, d)| d))
                .max()?;
            Some((
                Stored::AdaptivePool(Box::new(AdaptivePool::new(keys, Vec::new()))),
                last,
            ))
        }
        // Nothing of the rest is kept (each named: a new state says what a reset leaves): a
        // reset lifts a key's ban and forgets its level.
        Stored::Tat(_)
        | Stored::Tiers(_)
        | Stored::Calendar(_)
        | Stored::FairShare(_)
        | Stored::Penalty(_) => None,
    }
}
