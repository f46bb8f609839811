//! The kit's adaptive concurrency keys: a concurrency key's leases, decided against the key's
//! own number of slots now, and the completions that move it
//! ([`crate::algo::adaptive`] holds the rule); for a limit whose keys share a capacity, all
//! its keys kept together ([`AdaptivePool`]) and decided with the capacity's rule too
//! ([`crate::algo::adaptive::capacity`]).

use std::borrow::Cow;

use super::concurrency::{live_leases, read_leases};
use super::{BucketTx, Read, Stored};
use crate::algo::adaptive::capacity::{self, Capacity, Held, MAX_CAPACITY};
use crate::algo::adaptive::{AdaptiveConcurrency, AdaptiveState};
use crate::algo::concurrency as concurrency_rule;
use crate::backend::Outcome;
use crate::key::Id;
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
    outcome.shape_number = u32::try_from(slots).unwrap_or(u32::MAX);
    outcome
}

/// A spend, check, charge or renewal on an adaptive key: its outcome (with the key's slots
/// now), what to write when allowed, and what a cut lease (or, under a shared capacity, a key
/// refused under its share) makes written whatever the batch.
pub(super) fn adaptive_decide(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>, Option<Stored>) {
    if let Some(capacity) = limit.shared() {
        return pooled_decide(tx, limit, capacity, stored, now);
    }
    let (state, cut) = read_state(limit, stored, now);
    let (outcome, write, repair) = decide_read(tx, limit, state, cut, None, now);
    let boxed = |s| Stored::Adaptive(Box::new(s));
    (outcome, write.map(boxed), repair.map(boxed))
}

/// [`adaptive_decide`] on a key's state as read (`cut`: its leases were cut), under `shared`
/// (the capacity and what the limit's keys hold) if the keys share one: the outcome, the
/// key's state to write when allowed, and the state to write whatever the batch decides.
fn decide_read(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    mut state: AdaptiveState,
    cut: bool,
    shared: Option<(Capacity, &Held)>,
    now: u64,
) -> (Outcome, Option<AdaptiveState>, Option<AdaptiveState>) {
    let slots = limit.slots_at(&state, now);
    let repair = cut.then(|| state.clone());
    let live = live_leases(&state.leases, now);
    if tx.mode == Mode::Renew {
        let (renewed, next) = super::renew(&slots, &state.leases, tx.renewed(), now);
        let outcome = Outcome {
            granted: Some(renewed),
            ..Outcome::new(renewed > 0, slots.max().saturating_sub(live), 0, 0)
        };
        let write = (renewed > 0).then(|| {
            state.leases = next;
            state
        });
        return (with_slots(outcome, slots.max()), write, repair);
    }
    let d = if tx.mode == Mode::Charge {
        concurrency_rule::charge(&slots, live, tx.cost == 1)
    } else if let Some((capacity, held)) = shared {
        // Its own number, and no more than the capacity leaves it: with no room, refused as
        // a key whose slots are all held.
        let take = tx.cost == 1;
        let room = capacity::room(capacity, held);
        let mut d = concurrency_rule::decide(&slots, live, take);
        if take && room == 0 {
            d = concurrency_rule::decide(&slots, slots.max(), true);
        } else {
            d.remaining = d.remaining.min(room - u64::from(take));
        }
        d
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
        state
    });
    // The number shown: its own, held to its share of the capacity and what is lent to it
    // now (at least its share, so at least 1).
    let shown = match shared {
        Some((capacity, held)) if tx.mode != Mode::Charge => {
            let lent = live.saturating_add(capacity::room(capacity, held));
            slots
                .max()
                .min(lent.max(capacity::share(capacity.slots, held.active)))
        }
        _ => slots.max(),
    };
    (with_slots(Outcome::from(d), shown), write, repair)
}

/// A lease given back: released, and what its request showed (if known) recorded in the
/// key's window, with the slots in flight when it ended.
pub(super) fn adaptive_refund(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>) {
    if limit.shared_capacity().is_some() {
        return pooled_refund(tx, limit, stored, now);
    }
    let (state, _) = read_state(limit, stored, now);
    let (outcome, state) = refund_read(tx, limit, state, now);
    (outcome, Some(Stored::Adaptive(Box::new(state))))
}

fn refund_read(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    mut state: AdaptiveState,
    now: u64,
) -> (Outcome, AdaptiveState) {
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
        state,
    )
}

/// When a key's state equals a fresh one: its last lease ended and it was idle long enough.
pub(super) fn adaptive_fresh_at(limit: &AdaptiveConcurrency, state: &AdaptiveState) -> u64 {
    let deadline = state.leases.iter().map(|&(_, d)| d).max().unwrap_or(0);
    deadline.max(state.last_us.saturating_add(limit.idle_reset_us()))
}

/// The most keys a pool keeps: beyond it, keys equal to fresh ones go, then the idle keys
/// longest idle (what they learned goes with them: they start again at `initial`).
pub const MAX_POOL_KEYS: usize = 2 * MAX_CAPACITY as usize;

/// The most keys waiting under their share a pool keeps (a key refused beyond them is not
/// kept a slot: the capacity still holds, only its fairness to that key waits).
pub const MAX_POOL_WAITERS: usize = 64;

/// The keys of an adaptive limit whose keys share a capacity, kept once per limit at
/// [`state_key`](super::state_key): each key's state, and the keys refused under their share
/// with the time they wait until.
#[derive(Debug, Clone, Default)]
pub struct AdaptivePool {
    keys: super::shared_map::SharedMap<Id, AdaptiveState>,
    waiters: Vec<(Id, u64)>,
    /// The keys whose states list leases (live or ended since): the only ones a decision
    /// counts, so that its cost follows the slots held, not the keys kept.
    holding: Vec<Id>,
    /// An instant from which the pool equals a fresh one, kept as it is written (0: not
    /// known, found when asked): a key's end may only come sooner than it says.
    fresh_at: u64,
}

impl PartialEq for AdaptivePool {
    fn eq(&self, other: &Self) -> bool {
        self.keys == other.keys && self.waiters == other.waiters
    }
}

impl Eq for AdaptivePool {}

impl AdaptivePool {
    /// A pool of `keys` and `waiters` (`(key, until)`).
    pub fn new(
        keys: impl IntoIterator<Item = (Id, AdaptiveState)>,
        waiters: Vec<(Id, u64)>,
    ) -> Self {
        let keys: super::shared_map::SharedMap<Id, AdaptiveState> = keys.into_iter().collect();
        let holding = keys
            .iter()
            .filter(|(_, s)| !s.leases.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        Self {
            keys,
            waiters,
            holding,
            fresh_at: 0,
        }
    }

    /// The state kept for `id`, if any.
    pub fn key(&self, id: &Id) -> Option<&AdaptiveState> {
        self.keys.get(id)
    }

    /// Every key kept, with its state.
    pub fn keys(&self) -> impl Iterator<Item = (&Id, &AdaptiveState)> {
        self.keys.iter()
    }

    /// The keys waiting under their share, with the time they wait until.
    pub fn waiters(&self) -> &[(Id, u64)] {
        &self.waiters
    }

    /// What the limit's keys hold at `now`, for `id`'s decision (it holds `own`).
    fn held(&self, capacity: u64, id: &Id, own: u64, now: u64) -> Held {
        let live = |s: &AdaptiveState| live_leases(&s.leases, now);
        let mut held = Held {
            total: own,
            own,
            active: 1,
            reserve: 0,
        };
        for s in self
            .holding
            .iter()
            .filter(|k| *k != id)
            .filter_map(|k| self.keys.get(k))
        {
            let n = live(s);
            held.total = held.total.saturating_add(n);
            held.active += u64::from(n > 0);
        }
        let waiting = || {
            self.waiters
                .iter()
                .filter(move |(w, until)| *until > now && w != id)
                .map(|(w, _)| self.keys.get(w).map_or(0, live))
        };
        held.active += waiting().filter(|&n| n == 0).count() as u64;
        held.reserve = waiting()
            .map(|n| capacity::kept_for(capacity, held.active, n))
            .fold(0u64, u64::saturating_add);
        held
    }

    /// This pool with `id`'s state `state` (`None`: as it is), `id` waiting until `wait` or,
    /// when `served`, waiting no more; swept when it holds too many keys.
    fn with(
        &self,
        limit: &AdaptiveConcurrency,
        id: &Id,
        state: Option<AdaptiveState>,
        wait: Option<u64>,
        served: bool,
        now: u64,
    ) -> Stored {
        let mut next = self.clone();
        next.fresh_at = pool_fresh_at(limit, self);
        if let Some(state) = &state {
            next.fresh_at = next.fresh_at.max(adaptive_fresh_at(limit, state));
        }
        if let Some(until) = wait {
            next.fresh_at = next.fresh_at.max(until);
        }
        if let Some(state) = state {
            let at = next.holding.iter().position(|k| k == id);
            match (at, state.leases.is_empty()) {
                (None, false) => next.holding.push(id.clone()),
                (Some(i), true) => {
                    next.holding.swap_remove(i);
                }
                _ => {}
            }
            next.keys.insert(id.clone(), state);
        }
        next.waiters
            .retain(|(w, until)| *until > now && !(served && w == id));
        if let Some(until) = wait {
            let room = next.waiters.len() < MAX_POOL_WAITERS;
            match next.waiters.iter_mut().find(|(w, _)| w == id) {
                Some(w) => w.1 = w.1.max(until),
                None if room => next.waiters.push((id.clone(), until)),
                None => {}
            }
        }
        if next.keys.len() > MAX_POOL_KEYS {
            next.sweep(limit, now);
        }
        Stored::AdaptivePool(Box::new(next))
    }

    /// Drops the keys equal to fresh ones, then, while more than three quarters of
    /// [`MAX_POOL_KEYS`] are kept, the keys holding no slot that were idle longest.
    fn sweep(&mut self, limit: &AdaptiveConcurrency, now: u64) {
        let fresh: Vec<Id> = self
            .keys
            .iter()
            .filter(|(_, s)| adaptive_fresh_at(limit, s) <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &fresh {
            self.keys.remove(k);
        }
        let keep = MAX_POOL_KEYS * 3 / 4;
        if self.keys.len() <= keep {
            let keys = &self.keys;
            self.holding.retain(|k| keys.contains_key(k));
            return;
        }
        let mut idle: Vec<(u64, Id)> = self
            .keys
            .iter()
            .filter(|(_, s)| live_leases(&s.leases, now) == 0)
            .map(|(k, s)| (s.last_us, k.clone()))
            .collect();
        idle.sort_unstable_by_key(|(last, _)| *last);
        let over = self.keys.len() - keep;
        for (_, k) in idle.into_iter().take(over) {
            self.keys.remove(&k);
        }
        let keys = &self.keys;
        self.holding.retain(|k| keys.contains_key(k));
    }
}

fn pool_of<'s>(stored: Option<Read<'s>>) -> Option<&'s AdaptivePool> {
    match stored {
        Some(Read::AdaptivePool(p)) => Some(p),
        _ => None,
    }
}

/// [`adaptive_decide`] for a limit whose keys share `capacity`: the key's own number and the
/// capacity's rule, on the limit's pool.
fn pooled_decide(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    capacity: Capacity,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>, Option<Stored>) {
    let empty = AdaptivePool::default();
    let pool = pool_of(stored).unwrap_or(&empty);
    let id = tx.key.id();
    let (state, cut) = read_state(limit, pool.key(id).map(Read::Adaptive), now);
    let held = pool.held(capacity.slots, id, live_leases(&state.leases, now), now);
    let learned = limit.slots_at(&state, now).max();
    let (outcome, write, repair) = decide_read(tx, limit, state, cut, Some((capacity, &held)), now);
    // Refused by the capacity, not by its own number, while under its share: it waits, and
    // the keys over their share keep its share free for it.
    let waits = !outcome.allowed
        && tx.mode.counts()
        && tx.mode.spends()
        && held.own < learned
        && capacity::under_share(capacity.slots, &held);
    let hint = limit.slots().retry_after_us().max(1);
    let wait = waits.then(|| now.saturating_add(hint.saturating_mul(2)));
    // A key waits until it holds its share (or its wait lapses).
    let taken = Held {
        own: held.own + 1,
        ..held
    };
    let served = !capacity::under_share(capacity.slots, &taken) && super::takes_lease(tx);
    let write = write.map(|s| pool.with(limit, id, Some(s), None, served, now));
    let repair = (repair.is_some() || wait.is_some())
        .then(|| pool.with(limit, id, repair, wait, false, now));
    (outcome, write, repair)
}

/// [`adaptive_refund`] for a limit whose keys share a capacity: the key's lease given back in
/// the limit's pool.
fn pooled_refund(
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    stored: Option<Read<'_>>,
    now: u64,
) -> (Outcome, Option<Stored>) {
    let empty = AdaptivePool::default();
    let pool = pool_of(stored).unwrap_or(&empty);
    let id = tx.key.id();
    let (state, _) = read_state(limit, pool.key(id).map(Read::Adaptive), now);
    let (outcome, state) = refund_read(tx, limit, state, now);
    (
        outcome,
        Some(pool.with(limit, id, Some(state), None, false, now)),
    )
}

/// When a pool equals a fresh one: each key's, and its last waiter's.
pub(super) fn pool_fresh_at(limit: &AdaptiveConcurrency, pool: &AdaptivePool) -> u64 {
    if pool.fresh_at != 0 {
        return pool.fresh_at;
    }
    let keys = pool.keys.values().map(|s| adaptive_fresh_at(limit, s));
    let waiters = pool.waiters.iter().map(|&(_, until)| until);
    keys.chain(waiters).max().unwrap_or(0)
}

/// An adaptive key's written form (a snapshot line's `adaptive`: its leases, controller and
/// window) and a pooled limit's (`adaptive_pool`: every key's, and the waiters).
pub(super) mod line {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{AdaptivePool, MAX_POOL_KEYS, MAX_POOL_WAITERS};
    use crate::algo::adaptive::AdaptiveState;
    use crate::key::Id;

    /// The keys of an adaptive limit that share a capacity (its `id` is empty: the limit's own
    /// key): each key's state, and the keys waiting under their share.
    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PoolLine {
        keys: Vec<(String, AdaptiveLine)>,
        /// `(id, until_us)`.
        waiting: Vec<(String, u64)>,
    }

    impl PoolLine {
        fn of(p: &AdaptivePool) -> PoolLine {
            PoolLine {
                keys: p
                    .keys()
                    .map(|(id, s)| (id.to_string(), AdaptiveLine::of(s)))
                    .collect(),
                waiting: p
                    .waiters()
                    .iter()
                    .map(|(id, until)| (id.to_string(), *until))
                    .collect(),
            }
        }

        fn into_pool(self) -> Result<AdaptivePool, String> {
            if self.keys.len() > MAX_POOL_KEYS || self.waiting.len() > MAX_POOL_WAITERS {
                return Err("adaptive_pool: more keys or waiters than a limit keeps".into());
            }
            let id = |text: &str| Id::new(text).map_err(|e| format!("adaptive_pool: {e}"));
            let mut keys = Vec::with_capacity(self.keys.len());
            for (k, line) in self.keys {
                keys.push((id(&k)?, line.into_adaptive()));
            }
            let mut waiting = Vec::with_capacity(self.waiting.len());
            for (w, until) in self.waiting {
                waiting.push((id(&w)?, until));
            }
            Ok(AdaptivePool::new(keys, waiting))
        }
    }

    /// An adaptive concurrency key's state: its leases, its controller, its window.
    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct AdaptiveLine {
        leases: Vec<(u64, u64)>,
        limit_milli: u64,
        long_us: u64,
        /// `(completions, failures, latency_sum_us, max_in_flight)`.
        window: (u64, u64, u64, u64),
        window_start_us: u64,
        last_us: u64,
    }

    impl AdaptiveLine {
        fn of(a: &AdaptiveState) -> Self {
            let w = &a.window;
            AdaptiveLine {
                leases: a.leases.clone(),
                limit_milli: a.controller.limit_milli,
                long_us: a.controller.long_us,
                window: (w.completions, w.failures, w.latency_sum_us, w.max_in_flight),
                window_start_us: a.window_start_us,
                last_us: a.last_us,
            }
        }

        fn into_adaptive(self) -> AdaptiveState {
            use crate::algo::adaptive::{Controller, Window};
            let (completions, failures, latency_sum_us, max_in_flight) = self.window;
            AdaptiveState {
                leases: self.leases,
                controller: Controller {
                    limit_milli: self.limit_milli,
                    long_us: self.long_us,
                },
                window: Window {
                    completions,
                    failures,
                    latency_sum_us,
                    max_in_flight,
                },
                window_start_us: self.window_start_us,
                last_us: self.last_us,
            }
        }
    }

    pub(crate) fn serialize<S: Serializer>(a: &AdaptiveState, s: S) -> Result<S::Ok, S::Error> {
        AdaptiveLine::of(a).serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Box<AdaptiveState>, D::Error> {
        Ok(Box::new(AdaptiveLine::deserialize(d)?.into_adaptive()))
    }

    /// The pooled limit's form, `adaptive_pool`.
    pub(crate) mod pool {
        use super::*;

        pub(crate) fn serialize<S: Serializer>(p: &AdaptivePool, s: S) -> Result<S::Ok, S::Error> {
            PoolLine::of(p).serialize(s)
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Box<AdaptivePool>, D::Error> {
            let line = PoolLine::deserialize(d)?;
            line.into_pool().map(Box::new).map_err(D::Error::custom)
        }
    }
}
