//! The in-memory backend: one process, no set-up.
//!
//! State is a [`DashMap`] from bucket key to the bucket's TAT in an [`AtomicU64`] (two of
//! them: keys whose id fits one word with its limit, keyed by that word, and the rest). A
//! one-transaction batch is a compare-and-swap loop on that atomic, made while holding the
//! map's shard read guard (so a sweep can never drop a bucket between the read and the write).
//! A batch of several transactions reads every bucket, decides, then writes each with a
//! compare-and-swap; if one of them lost a race, the writes already made are rolled back and
//! the batch is decided again. Every write is therefore a valid transition from the value it
//! replaced: concurrent batches never admit more than the spec allows, and a denied batch
//! writes nothing. (During a rollback other requests may briefly see the batch's spend, so
//! under contention a request can be denied that a serial order would have allowed; never the
//! reverse.)
//!
//! # Memory
//!
//! A bucket whose TAT is at or before now is the same as a missing one, so [`sweep`] drops
//! those without changing any decision, and runs it in the background every 10 s by default
//! ([`MemoryBackendBuilder::sweep_interval`]), on a thread of its own; nothing needs to be
//! started.
//! At most `max_keys` buckets are held. **When full**, a transaction that needs a *new* bucket
//! fails with [`BackendError::Full`] (counted by [`MemoryBackend::full_refusals`]), and the
//! background sweep is woken (at most once a second) to make room; buckets already held keep
//! working, and no request ever runs the sweep itself. The middleware answers such a request
//! `503` with `Retry-After: 1`, whatever its failure policy: a full table is the limiter
//! protecting its memory, and letting new keys through unlimited is exactly what a flood of new
//! keys would aim for (so would dropping live buckets, which hands their owners a fresh burst).
//!
//! What the cap costs: about 36 bytes per bucket whose id is an IPv4 address, an IPv6 /48
//! range or a number below 2^48 (28 at ten million: the table's fill varies with its size);
//! about 90 bytes plus the id's length for any other id (a full IPv6 address, a larger number,
//! text: a 256-byte account id costs about 350 bytes). The default cap of 10,000,000 is about
//! 0.3 GiB of addresses, or 3.5 GiB of 256-byte ids: size `max_keys` by the ids you key on.
//! (`bash benches/memory.sh` measures it.)
//!
//! [`sweep`]: MemoryBackend::sweep

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use smallvec::SmallVec;

use super::regions::MemoryRegion;
use super::{Backend, BackendError, BucketTx, Outcomes, Spend, kit};
use crate::algo::calendar::{CalendarQuota, CalendarState};
use crate::algo::penalty::PenaltyState;
use crate::algo::tiers::{TierGrant, TierState};
use crate::algo::{concurrency, gcra};
use crate::backend::Outcome;
use crate::key::BucketKey;
use crate::quota::Quota;
use crate::time::{Clock, SystemClock};

mod buckets;
mod roads;

use buckets::*;

/// The transactions of a batch whose working vectors stay on the stack: on the general road
/// (any shape; larger vectors cost its one-transaction calls of other shapes), and on the
/// road of GCRA words (a request's rules).
const BATCH: usize = 4;
const WORDS: usize = 8;

/// The default cap on live buckets: ten million (about 0.3 GiB of address ids at the measured
/// cost per key; see the module's notes for other ids).
pub const DEFAULT_MAX_KEYS: usize = 10_000_000;

struct Inner {
    map: Buckets,
    /// Tiered keys: a separate map, so a GCRA bucket stays one `AtomicU64`.
    tiers: DashMap<BucketKey, SharedSlot, foldhash::fast::RandomState>,
    len: AtomicUsize,
    max_keys: usize,
    /// The time source; `None`: the system clock (read inline, not through a `dyn` call).
    clock: Option<Arc<dyn Clock>>,
    last_full_sweep: AtomicU64,
    /// New keys refused because the table was full.
    full_refusals: AtomicU64,
    /// Wakes a sweeper thread (a message: sweep now; dropped with the backend: end).
    thread_sweeper: Mutex<Option<std::sync::mpsc::Sender<()>>>,
    /// Overrides set at run time (this process only).
    overrides: Arc<super::MemoryOverrides>,
    /// Regional mode (`backend/regions/memory.rs`): the regions of one simulation.
    region: Option<MemoryRegion>,
}

/// The in-memory backend. Cheap to clone (an `Arc`).
///
/// ```
/// use tower_ratelimits::{MemoryBackend, ManualClock};
/// let backend = MemoryBackend::builder()
///     .clock(ManualClock::new(0))
///     .max_keys(1_000)
///     .build();
/// assert_eq!(backend.len(), 0);
/// ```
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("len", &self.len())
            .field("max_keys", &self.inner.max_keys)
            .finish()
    }
}

/// How often the background sweep runs by default.
const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// Builds a [`MemoryBackend`].
pub struct MemoryBackendBuilder {
    clock: Option<Arc<dyn Clock>>,
    max_keys: usize,
    max_overrides: usize,
    sweep_interval: Option<Duration>,
    region: Option<MemoryRegion>,
}

impl MemoryBackendBuilder {
    /// Regional mode: this backend is one region of a simulation (`SimulatedRegions`).
    pub(crate) fn regional(mut self, region: MemoryRegion) -> Self {
        self.region = Some(region);
        self
    }

    /// The time source (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// The most live buckets held at once (default 10,000,000).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The most overrides set at run time this backend keeps
    /// ([`Limiter::set_override`](crate::Limiter::set_override); default
    /// [`DEFAULT_MAX_OVERRIDES`](crate::DEFAULT_MAX_OVERRIDES), a million): a new one past it is
    /// refused ([`OverrideError::TooMany`](crate::OverrideError::TooMany)).
    pub fn max_overrides(mut self, max: usize) -> Self {
        self.max_overrides = max;
        self
    }

    /// How often idle buckets are swept away in the background (default 10 s). The sweep
    /// is lossless (it drops only buckets equal to fresh ones) and runs off the request path.
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = Some(interval);
        self
    }

    /// No background sweep: you call [`MemoryBackend::sweep`] yourself. Without it, idle
    /// buckets are dropped only when the table reaches `max_keys`.
    pub fn no_background_sweep(mut self) -> Self {
        self.sweep_interval = None;
        self
    }

    /// Builds the backend and starts its background sweep, on a thread of its own (inside a
    /// tokio runtime too: none of the runtime's workers or timers), which ends by itself when
    /// the backend's last clone is dropped.
    pub fn build(self) -> MemoryBackend {
        let backend = MemoryBackend {
            inner: Arc::new(Inner {
                map: Buckets::new(),
                tiers: DashMap::with_hasher(foldhash::fast::RandomState::default()),
                len: AtomicUsize::new(0),
                max_keys: self.max_keys,
                overrides: Arc::new(super::MemoryOverrides::new(
                    self.clock.clone(),
                    self.max_overrides,
                )),
                clock: self.clock,
                last_full_sweep: AtomicU64::new(0),
                full_refusals: AtomicU64::new(0),
                thread_sweeper: Mutex::new(None),
                region: self.region,
            }),
        };
        if let Some(interval) = self.sweep_interval.filter(|i| !i.is_zero()) {
            backend.start_sweeper(interval);
        }
        backend
    }
}

fn stored(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

impl MemoryBackend {
    /// A backend on the system clock holding at most 10,000,000 buckets.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder.
    pub fn builder() -> MemoryBackendBuilder {
        MemoryBackendBuilder {
            clock: None,
            max_keys: DEFAULT_MAX_KEYS,
            max_overrides: super::DEFAULT_MAX_OVERRIDES,
            sweep_interval: Some(DEFAULT_SWEEP_INTERVAL),
            region: None,
        }
    }

    /// Live buckets held.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// How many buckets the tables have room for without growing (for diagnostics: after a
    /// [`sweep`](Self::sweep) that leaves them mostly empty, the room is given back).
    pub fn capacity(&self) -> usize {
        self.inner.map.capacity() + self.inner.tiers.capacity()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored TAT of a bucket, if one is held (for tests and diagnostics).
    pub fn tat(&self, key: &BucketKey) -> Option<u64> {
        self.inner
            .map
            .get(Buckets::place(key))
            .and_then(|v| stored(kit::gcra_unword(v.load(Ordering::Acquire)).0))
    }

    /// Holds `state` for `key` as if the kit had written it under `quota` at `now` (a replay
    /// started from a snapshot, `docs/replay.md`): a GCRA word as a bucket, any other state in
    /// a slot, each read by the next decision under the limit then in force (the change rule);
    /// a penalty state (`penalty`: its ladder) at its ladder's key, kept until it is fresh.
    /// A key already held is left as it is. Whether it was put.
    #[cfg(feature = "replay")]
    pub(crate) fn restore(
        &self,
        key: &BucketKey,
        quota: &Quota,
        penalty: Option<&crate::config::PenaltyEntry>,
        state: kit::Stored,
        now: u64,
    ) -> Result<bool, BackendError> {
        match state {
            kit::Stored::Tat(word) => self.insert_new(Buckets::place(key), 0, word, now),
            state => {
                let Some(slot) = self.tier_slot(key, true, now)? else {
                    return Ok(false);
                };
                let mut slot = lock(&slot);
                if slot.state.is_some() {
                    return Ok(false);
                }
                slot.put(kit::fresh_at(quota, penalty, &state, now), state);
                Ok(true)
            }
        }
    }

    /// Starts `key`'s penalty state (`penalty`: its limit's ladder) banned
    /// until `until`, whatever it held: the layer's in-memory fallback started from a ban the
    /// store answered (`layer/charge.rs`). Whether it was put (not in a full table).
    pub(crate) fn start_banned(
        &self,
        key: &BucketKey,
        penalty: &crate::config::PenaltyEntry,
        until: u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        let state_key = BucketKey::new(penalty.state, key.id().clone());
        let Some(slot) = self.tier_slot(&state_key, true, now)? else {
            return Ok(false);
        };
        let state = PenaltyState::banned_until(until);
        // Not `kit::fresh_at`: a second caller would take it out of line on every spend
        // (`ours_calendar_spend` 664 -> 674 instructions, `benches/instructions.sh`).
        let fresh = kit::penalty_fresh_at(&penalty.ladder, &state);
        lock(&slot).put(fresh, kit::Stored::Penalty(Box::new(state)));
        Ok(true)
    }

    /// Drops every bucket that equals a fresh one (TAT at or before now) and returns how many
    /// were dropped. No decision changes.
    pub fn sweep(&self) -> usize {
        let now = self.now();
        let mut dropped = 0;
        self.inner.map.retain(|word| {
            let keep = kit::gcra_unword(word.load(Ordering::Acquire)).0 > now;
            if !keep {
                dropped += 1;
            }
            keep
        });
        self.inner.tiers.retain(|_, slot| {
            // A slot in use is kept (and never waited for while the shard is locked).
            let Ok(mut s) = slot.try_lock() else {
                return true;
            };
            if s.expires_at > now {
                return true;
            }
            s.removed = true;
            dropped += 1;
            false
        });
        self.inner.len.fetch_sub(dropped, Ordering::Relaxed);
        // Give the memory back once most of the table is empty (after a flood of one-off keys,
        // say); a table still mostly in use keeps its room to grow.
        self.inner.map.shrink_if_sparse();
        if self.inner.tiers.len().saturating_mul(4) < self.inner.tiers.capacity() {
            self.inner.tiers.shrink_to_fit();
        }
        crate::telemetry::memory_swept(dropped, self.inner.len.load(Ordering::Relaxed));
        dropped
    }

    /// A page of the penalty states kept under `state` ([`Backend::penalty_page`]): the
    /// `count` least ids (by their text's bytes) after the id `after`, the last of them the
    /// next page's cursor when more were left out. One pass over the map, `count` states held.
    fn penalty_states(
        &self,
        state: crate::key::LimitName,
        after: Option<&str>,
        count: usize,
    ) -> super::StatesPage {
        let mut page = std::collections::BTreeMap::<String, PenaltyState>::new();
        let mut more = false;
        // Each id's text written into one buffer: a key allocates only if it joins the page.
        let mut text = String::new();
        for entry in self.inner.tiers.iter() {
            if entry.key().name() != state {
                continue;
            }
            text.clear();
            let _ = std::fmt::Write::write_fmt(&mut text, format_args!("{}", entry.key().id()));
            if after.is_some_and(|c| text.as_str() <= c) {
                continue;
            }
            let slot = lock(entry.value());
            let (Some(kit::Stored::Penalty(p)), false) = (&slot.state, slot.removed) else {
                continue;
            };
            // A full page of lesser ids: this one is on a later page.
            if page.len() >= count && page.last_key_value().is_some_and(|(last, _)| text > *last) {
                more = true;
                continue;
            }
            page.insert(text.clone(), (**p).clone());
            if page.len() > count {
                page.pop_last();
                more = true;
            }
        }
        let next = more
            .then(|| page.keys().next_back().map(|id| format!("m:{id}")))
            .flatten();
        super::StatesPage {
            states: page.into_iter().collect(),
            now_us: self.now(),
            next,
        }
    }

    /// `key`'s standing under its limit's penalty ladder in `limits` at `now_us` (its level
    /// decayed, its ban), when its ladder's state holds a level or a ban (for the simulator's
    /// drawing, tests and diagnostics; [`Limiter::penalties`](crate::Limiter::penalties) lists
    /// them on any store).
    pub fn penalty_standing(
        &self,
        limits: &crate::config::Limits,
        key: &BucketKey,
        now_us: u64,
    ) -> Option<crate::algo::penalty::PenaltyStanding> {
        let penalty = limits.entry(key.name())?.penalty.as_ref()?;
        let state_key = BucketKey::new(penalty.state, key.id().clone());
        let slot = self.inner.tiers.get(&state_key)?.clone();
        let mut state = match &*lock(&slot) {
            s if s.removed => return None,
            s => match &s.state {
                Some(kit::Stored::Penalty(p)) => (**p).clone(),
                _ => return None,
            },
        };
        state.standing_of(&penalty.ladder, key.id().to_string(), now_us)
    }

    /// The state of a tiered key, if one is held (for tests and diagnostics).
    pub fn tier_state(&self, key: &BucketKey) -> Option<TierState> {
        let slot = self.inner.tiers.get(key)?.clone();
        let s = lock(&slot);
        match &s.state {
            Some(kit::Stored::Tiers(state)) if !s.removed => Some(state.clone()),
            _ => None,
        }
    }

    /// The state of a calendar key, if one is held (the units used and the end of the period
    /// they were counted in; for the simulator's drawing, tests and diagnostics).
    pub fn calendar_state(&self, key: &BucketKey) -> Option<CalendarState> {
        let slot = self.inner.tiers.get(key)?.clone();
        let s = lock(&slot);
        match &s.state {
            Some(kit::Stored::Calendar(state)) if !s.removed => Some(*state),
            _ => None,
        }
    }

    /// The state of a fair-share limit (its budget, active weights, waiters and members), if
    /// one is held (for the simulator's drawing, tests and diagnostics).
    pub fn fair_share_state(&self, name: crate::key::LimitName) -> Option<kit::FairPool> {
        let slot = self.inner.tiers.get(&BucketKey::limit_wide(name))?.clone();
        let s = lock(&slot);
        match &s.state {
            Some(kit::Stored::FairShare(state)) if !s.removed => Some((**state).clone()),
            _ => None,
        }
    }

    /// The state of an adaptive concurrency key (its leases, its controller, the window being
    /// filled), if one is held (for the simulator's drawing, tests and diagnostics); for a
    /// limit whose keys share a capacity, the key's state in the limit's pool.
    pub fn adaptive_state(&self, key: &BucketKey) -> Option<crate::algo::adaptive::AdaptiveState> {
        let own = self.inner.tiers.get(key).map(|slot| slot.clone());
        // A limit whose keys share a capacity keeps them with the limit's.
        let slot = match own {
            Some(slot) => slot,
            None => self
                .inner
                .tiers
                .get(&BucketKey::limit_wide(key.name()))?
                .clone(),
        };
        let s = lock(&slot);
        match &s.state {
            Some(kit::Stored::Adaptive(state)) if !s.removed => Some((**state).clone()),
            Some(kit::Stored::AdaptivePool(pool)) if !s.removed => pool.key(key.id()).cloned(),
            _ => None,
        }
    }

    /// Sweeps every `interval`, and when a full table asks for room, until the backend is
    /// gone: on a thread of its own.
    fn start_sweeper(&self, interval: Duration) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let sweep_once = move || -> bool {
            let Some(inner) = weak.upgrade() else {
                return false;
            };
            let backend = MemoryBackend { inner };
            let dropped = backend.sweep();
            tracing::trace!(target: crate::telemetry::target::BACKEND, dropped, live = backend.len(), "memory backend sweep");
            true
        };
        // A thread of its own, inside a tokio runtime too: a timer of the runtime's would make
        // its time driver work on every park (about 180 instructions a request of a server that
        // has no other timer, `bash benches/socket_instructions.sh 5000`), and a sweep of
        // millions of keys, which never yields, would hold one of its workers.
        let (wake, woken) = std::sync::mpsc::channel::<()>();
        *self
            .inner
            .thread_sweeper
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(wake);
        let spawned = std::thread::Builder::new()
            .name("tower-ratelimits-sweep".into())
            .spawn(move || {
                // A timeout is the next tick, a message a full table; a closed channel means
                // the backend is gone.
                while !matches!(
                    woken.recv_timeout(interval),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
                ) {
                    if !sweep_once() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e, "could not start the memory backend's sweep thread; idle buckets are dropped only when the table is full");
        }
    }

    /// A batch not decided on the one-transaction road: one that names a share bucket
    /// (regional mode, a simulation: `spend_shares`), or any other on the general road.
    pub(super) fn spend_batch(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Result<Outcomes, BackendError> {
        if let Some(region) = &self.inner.region
            && batch.iter().any(|tx| tx.floor.is_some())
        {
            return self.spend_shares(region, batch, now);
        }
        self.spend_mixed(batch, now)
    }

    /// Its region, in regional mode.
    pub(crate) fn region(&self) -> Option<&MemoryRegion> {
        self.inner.region.as_ref()
    }

    /// Now, on its clock.
    pub(crate) fn now_us(&self) -> u64 {
        self.now()
    }

    /// Writes `key`'s word: `tat` under `limit` (`None`: full), whatever it held.
    pub(crate) fn put_tat(
        &self,
        key: &BucketKey,
        tat: Option<u64>,
        limit: &crate::algo::gcra::Limit,
        now: u64,
    ) -> Result<(), BackendError> {
        let new = match tat {
            Some(tat) => kit::gcra_word(tat, limit)?,
            None => 0,
        };
        self.put_word(key, new, now)
    }

    /// `key`'s word as stored (0: none).
    pub(crate) fn word(&self, key: &BucketKey) -> u64 {
        (self.inner.map.get(Buckets::place(key))).map_or(0, |word| word.load(Ordering::Acquire))
    }

    /// Writes `key`'s word (`word`, as [`word`](Self::word) read it), whatever it held.
    pub(crate) fn put_word(&self, key: &BucketKey, new: u64, now: u64) -> Result<(), BackendError> {
        loop {
            let cur = (self.inner.map.get(Buckets::place(key)))
                .map_or(0, |word| word.load(Ordering::Acquire));
            if cur == new || self.compare_and_set(key, cur, new, now)? {
                return Ok(());
            }
        }
    }

    #[inline]
    fn now(&self) -> u64 {
        match &self.inner.clock {
            None => SystemClock.now_us(),
            Some(clock) => clock.now_us(),
        }
    }

    /// Room for one new bucket, or `Full`; when full, wakes the background sweep (at most
    /// once a second). Never sweeps on the caller's (a request's) time.
    fn reserve(&self, now: u64) -> Result<(), BackendError> {
        let inner = &self.inner;
        if inner.len.load(Ordering::Relaxed) < inner.max_keys {
            return Ok(());
        }
        inner.full_refusals.fetch_add(1, Ordering::Relaxed);
        crate::telemetry::memory_full();
        let last = inner.last_full_sweep.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1_000_000
            && inner
                .last_full_sweep
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(target: crate::telemetry::target::BACKEND,
                max_keys = inner.max_keys,
                "the in-memory rate limiter is full: new keys are refused until a sweep makes room"
            );
            if let Some(wake) = inner
                .thread_sweeper
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_ref()
            {
                let _ = wake.send(());
            }
        }
        Err(BackendError::Full {
            max_keys: inner.max_keys,
        })
    }

    /// New keys refused because the table was full, since the backend was built.
    pub fn full_refusals(&self) -> u64 {
        self.inner.full_refusals.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        let now = self.now();
        // One transaction (a request with one rule): its outcome written straight into the
        // answer, no batch machinery.
        if let [one] = batch {
            return self.spend_one_at(one, now);
        }
        Spend::Ready(self.spend_batch(batch, now))
    }

    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        let now = self.now();
        if let Some(region) = &self.inner.region
            && batch.iter().any(|tx| tx.floor.is_some())
        {
            return self.refund_shares(region, batch, now);
        }
        batch.iter().map(|tx| self.refund_one(tx, now)).collect()
    }

    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        let now = self.now();
        for key in keys {
            if self.inner.map.remove(key) {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
            }
            // A concurrency key's live leases are requests in flight: kept (forgetting them
            // would admit more at once than the limit). The rest of the slot is forgotten.
            let removed = self.inner.tiers.remove_if(*key, |_, slot| {
                let mut s = lock(slot);
                (s.state, s.expires_at) = s
                    .state
                    .take()
                    .and_then(|state| kit::after_reset(state, now))
                    .map_or((None, 0), |(state, fresh)| (Some(state), fresh));
                let gone = s.state.is_none();
                s.removed = gone;
                gone
            });
            if removed.is_some() {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn override_store(&self) -> Option<super::OverrideStoreRef> {
        Some(super::OverrideStoreRef(self.inner.overrides.clone()))
    }

    fn decides_penalties(&self) -> bool {
        true
    }

    async fn penalty_page(
        &self,
        _limit: crate::key::LimitName,
        state: crate::key::LimitName,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<Option<super::StatesPage>, BackendError> {
        // A cursor is `m:` and the last id a page gave.
        let after = match cursor.map(|c| c.strip_prefix("m:")) {
            Some(None) => return Ok(None),
            Some(Some(id)) => Some(id),
            None => None,
        };
        Ok(Some(self.penalty_states(state, after, count)))
    }

    fn regional(&self) -> bool {
        self.inner.region.is_some()
    }

    fn follow_limits(&self, limits: super::FollowedLimits) {
        if let Some(region) = &self.inner.region {
            region.follow(limits);
        }
    }

    async fn region_share(
        &self,
        key: &BucketKey,
        quota: &Quota,
        floor: crate::config::RegionFloor,
    ) -> Result<Option<crate::backend::regions::RegionShare>, BackendError> {
        Ok(match (&self.inner.region, quota.as_gcra()) {
            (Some(region), Some(limit)) => Some(self.memory_share_of(region, key, limit, floor)),
            _ => None,
        })
    }

    fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.inner.clock.clone()
    }
}
