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
//! ([`MemoryBackendBuilder::sweep_interval`]); nothing needs to be started.
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

use super::{Backend, BackendError, BucketTx, Outcomes, Spend, kit};
use crate::algo::calendar::CalendarState;
use crate::algo::tiers::TierState;
use crate::algo::{concurrency, gcra};
use crate::backend::Outcome;
use crate::key::BucketKey;
use crate::quota::Quota;
use crate::time::{Clock, SystemClock};

/// The transactions of a batch whose working vectors stay on the stack: on the general road
/// (any shape; larger vectors cost its one-transaction calls of other shapes), and on the
/// road of GCRA words (a request's rules).
const BATCH: usize = 4;
const WORDS: usize = 8;

/// The default cap on live buckets: ten million (about 0.3 GiB of address ids at the measured
/// cost per key; see the module's notes for other ids).
pub const DEFAULT_MAX_KEYS: usize = 10_000_000;

/// The state of a key that is not a GCRA word (a tiered key, a concurrency key's leases, any
/// shape the kit keeps as a [`kit::Stored`]), and when it will equal a fresh one.
#[derive(Default)]
struct TierSlot {
    /// As the kit wrote it (`None`: fresh).
    state: Option<kit::Stored>,
    /// The first instant at which the state equals a fresh one (`kit::fresh_at`; 0: it
    /// already does).
    expires_at: u64,
    /// Set when the slot left the map (sweep, reset): whoever holds it must look again.
    removed: bool,
}

impl TierSlot {
    /// Keeps what the kit wrote for a key under `quota`.
    fn write(&mut self, quota: &Quota, state: kit::Stored, now: u64) {
        self.expires_at = kit::fresh_at(quota, &state, now);
        self.state = Some(state);
    }
}

type SharedSlot = Arc<Mutex<TierSlot>>;

fn lock(slot: &SharedSlot) -> MutexGuard<'_, TierSlot> {
    // The critical sections only do arithmetic on the slot; a panic there leaves a state that
    // is still valid, so a poisoned lock is used as it is.
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a GCRA bucket lives: in the table of one-word keys or in the general one.
#[derive(Clone, Copy)]
enum Place<'a> {
    Packed(u64),
    Wide(&'a BucketKey),
}

/// The GCRA buckets, one `AtomicU64` (the TAT) each. Keys whose id fits one word with its
/// name (`BucketKey::packed`: IPv4 addresses, IPv6 /48 ranges, numbers below 2^48) live in a
/// table keyed by that word (an entry of 16 bytes), the rest in a table keyed by the
/// `BucketKey` (40 bytes and the text of a text id). A key has one place, found without a
/// lookup, so the two tables never hold the same key.
struct Buckets {
    packed: DashMap<u64, AtomicU64, foldhash::fast::RandomState>,
    wide: DashMap<BucketKey, AtomicU64, foldhash::fast::RandomState>,
}

impl Buckets {
    fn new() -> Self {
        Self {
            packed: DashMap::with_hasher(foldhash::fast::RandomState::default()),
            wide: DashMap::with_hasher(foldhash::fast::RandomState::default()),
        }
    }

    #[inline]
    fn place(key: &BucketKey) -> Place<'_> {
        match key.packed() {
            Some(word) => Place::Packed(word),
            None => Place::Wide(key),
        }
    }

    /// The bucket's TAT under its shard's read guard (held until the answer is dropped), if the
    /// bucket is held.
    #[inline]
    fn get(&self, place: Place<'_>) -> Option<Held<'_>> {
        match place {
            Place::Packed(word) => self.packed.get(&word).map(Held::Packed),
            Place::Wide(key) => self.wide.get(key).map(Held::Wide),
        }
    }

    /// Inserts the bucket holding `tat` unless it is held: whether it was inserted.
    fn insert_new(&self, place: Place<'_>, tat: u64) -> bool {
        fn vacant<K: Eq + std::hash::Hash>(entry: Entry<'_, K, AtomicU64>, tat: u64) -> bool {
            match entry {
                Entry::Vacant(slot) => {
                    slot.insert(AtomicU64::new(tat));
                    true
                }
                Entry::Occupied(_) => false,
            }
        }
        match place {
            Place::Packed(word) => vacant(self.packed.entry(word), tat),
            Place::Wide(key) => vacant(self.wide.entry(key.clone()), tat),
        }
    }

    /// Removes the bucket: whether one was held.
    fn remove(&self, key: &BucketKey) -> bool {
        match Self::place(key) {
            Place::Packed(word) => self.packed.remove(&word).is_some(),
            Place::Wide(key) => self.wide.remove(key).is_some(),
        }
    }

    /// Keeps the buckets whose TAT `keep` accepts.
    fn retain(&self, mut keep: impl FnMut(&AtomicU64) -> bool) {
        self.packed.retain(|_, tat| keep(tat));
        self.wide.retain(|_, tat| keep(tat));
    }

    fn capacity(&self) -> usize {
        self.packed.capacity() + self.wide.capacity()
    }

    /// Gives a table's memory back when it is less than a quarter full.
    fn shrink_if_sparse(&self) {
        if self.packed.len().saturating_mul(4) < self.packed.capacity() {
            self.packed.shrink_to_fit();
        }
        if self.wide.len().saturating_mul(4) < self.wide.capacity() {
            self.wide.shrink_to_fit();
        }
    }
}

/// A held bucket: its shard's read guard, dereferencing to the TAT.
enum Held<'a> {
    Packed(dashmap::mapref::one::Ref<'a, u64, AtomicU64>),
    Wide(dashmap::mapref::one::Ref<'a, BucketKey, AtomicU64>),
}

impl std::ops::Deref for Held<'_> {
    type Target = AtomicU64;

    #[inline]
    fn deref(&self) -> &AtomicU64 {
        match self {
            Held::Packed(r) => r.value(),
            Held::Wide(r) => r.value(),
        }
    }
}

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
    /// Wakes the background sweep when the table is full (a tokio task's).
    sweep_now: Arc<tokio::sync::Notify>,
    /// Wakes a sweeper thread (a message: sweep now; dropped with the backend: end).
    thread_sweeper: Mutex<Option<std::sync::mpsc::Sender<()>>>,
    /// Overrides set at run time (this process only).
    overrides: Arc<super::MemoryOverrides>,
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
}

impl MemoryBackendBuilder {
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

    /// Builds the backend and starts its background sweep: a tokio task when built inside a
    /// tokio runtime, a thread otherwise. Either ends by itself when the backend's last clone
    /// is dropped.
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
                sweep_now: Arc::new(tokio::sync::Notify::new()),
                thread_sweeper: Mutex::new(None),
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

    /// Sweeps every `interval` until the backend is gone: on the current tokio runtime if
    /// there is one (so tokio's paused time drives it in tests), else on a thread of its own.
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
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let sweep_now = self.inner.sweep_now.clone();
            runtime.spawn(async move {
                loop {
                    // An interval's wait, cut short when a full table asks for room.
                    let _ = tokio::time::timeout(interval, sweep_now.notified()).await;
                    if !sweep_once() {
                        return;
                    }
                }
            });
            return;
        }
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
            inner.sweep_now.notify_one();
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

    /// Reads a bucket's raw TAT (0 when missing).
    fn load(&self, key: &BucketKey) -> u64 {
        self.inner
            .map
            .get(Buckets::place(key))
            .map_or(0, |v| v.load(Ordering::Acquire))
    }

    /// Replaces `expected` (0: missing) by `new` if the bucket still holds `expected`.
    fn compare_and_set(
        &self,
        key: &BucketKey,
        expected: u64,
        new: u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        let place = Buckets::place(key);
        if let Some(v) = self.inner.map.get(place) {
            return Ok(v
                .compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire)
                .is_ok());
        }
        self.insert_new(place, expected, new, now)
    }

    /// Inserts a bucket found missing, holding `new`, if `expected` (the TAT read, 0: missing)
    /// still describes it: whether it was written.
    fn insert_new(
        &self,
        place: Place<'_>,
        expected: u64,
        new: u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        if kit::gcra_unword(expected).0 > now {
            // We read a live bucket that has since gone: someone reset it. Decide again.
            return Ok(false);
        }
        self.reserve(now)?;
        let inserted = self.inner.map.insert_new(place, new);
        if inserted {
            self.inner.len.fetch_add(1, Ordering::Relaxed);
        }
        Ok(inserted)
    }

    /// Takes back a write this batch made (words), as a refund of the time it added (none for
    /// a foreign value it replaced: that changed no decision).
    fn roll_back(&self, key: &BucketKey, before: u64, written: u64, now: u64) {
        let (tat_before, _) = kit::gcra_unword(before);
        let (tat_written, _) = kit::gcra_unword(written);
        let added = tat_written.saturating_sub(tat_before.max(now));
        if let Some(v) = self.inner.map.get(Buckets::place(key)) {
            let _ = v.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                Some(if cur == written {
                    before
                } else {
                    // The same bits less the time: a TAT field never borrows from the bound.
                    let (tat, _) = kit::gcra_unword(cur);
                    cur - (tat - tat.saturating_sub(added))
                })
            });
        }
    }

    /// Decides and spends one transaction without an allocation: the path
    /// [`Backend::spend`] takes for a one-transaction batch, answering with the `Spend` itself
    /// (built where it is returned: no copy of the outcome on the way out).
    ///
    /// A compare-and-swap loop on the bucket's word, made under the map's shard read guard.
    fn spend_one_at(&self, tx: &BucketTx<'_>, now: u64) -> Spend {
        let Quota::Gcra(limit) = tx.quota else {
            return Spend::Ready(self.spend_mixed(std::slice::from_ref(tx), now));
        };
        let answer = |d: &kit::GcraDecision| Spend::Ready(Ok(Outcomes::from_buf([d.outcome()])));
        let place = Buckets::place(tx.key);
        loop {
            let held = self.inner.map.get(place);
            let mut cur = held
                .as_ref()
                .map_or(0, |entry| entry.load(Ordering::Acquire));
            loop {
                // The kit's step (`kit::gcra_step`), written out for the common case: a TAT
                // within what this limit writes. One beyond it (a bucket drained under a larger
                // limit, or foreign) takes a road of its own, out of line.
                let tat = kit::gcra_tat(cur);
                let stored = (tat != 0).then_some(tat);
                if limit.is_foreign(stored, now) {
                    drop(held);
                    return self.spend_one_beyond(tx, limit, now);
                }
                let decision = match super::gcra_decide(tx, limit, stored, now) {
                    Ok(d) => d,
                    Err(e) => return Spend::Ready(Err(e.into())),
                };
                let new = match super::gcra_write(tx.mode, &decision.out, tat, now) {
                    None => return answer(&decision),
                    Some(t) => match kit::gcra_word(t, limit) {
                        Ok(w) => w,
                        Err(e) => return Spend::Ready(Err(e.into())),
                    },
                };
                let Some(entry) = &held else {
                    match self.insert_new(place, 0, new, now) {
                        Ok(true) => return answer(&decision),
                        Ok(false) => break,
                        Err(e) => return Spend::Ready(Err(e)),
                    }
                };
                match entry.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return answer(&decision),
                    Err(actual) => cur = actual,
                }
            }
        }
    }

    /// [`spend_one_at`](Self::spend_one_at) on a bucket whose TAT runs beyond what `limit`
    /// writes: the kit's step, which reads it under its writer's bound or as foreign (then the
    /// drained TAT it is read as replaces it, whatever the decision).
    #[cold]
    #[inline(never)]
    fn spend_one_beyond(&self, tx: &BucketTx<'_>, limit: &gcra::Limit, now: u64) -> Spend {
        let place = Buckets::place(tx.key);
        loop {
            let held = self.inner.map.get(place);
            let mut cur = held
                .as_ref()
                .map_or(0, |entry| entry.load(Ordering::Acquire));
            loop {
                let step = match kit::gcra_step(tx, limit, cur, now) {
                    Ok(step) => step,
                    Err(e) => return Spend::Ready(Err(e.into())),
                };
                let answer = Spend::Ready(Ok(Outcomes::from_buf([step.decision.outcome()])));
                let Some(new) = step.write.or(step.repair) else {
                    return answer;
                };
                let Some(entry) = &held else {
                    match self.insert_new(place, 0, new, now) {
                        Ok(true) => return answer,
                        Ok(false) => break,
                        Err(e) => return Spend::Ready(Err(e)),
                    }
                };
                match entry.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return answer,
                    Err(actual) => cur = actual,
                }
            }
        }
    }

    /// The tier slot of a key, inserted when missing unless `create` is false.
    fn tier_slot(
        &self,
        key: &BucketKey,
        create: bool,
        now: u64,
    ) -> Result<Option<SharedSlot>, BackendError> {
        if let Some(s) = self.inner.tiers.get(key) {
            return Ok(Some(s.clone()));
        }
        if !create {
            return Ok(None);
        }
        self.reserve(now)?;
        let slot = self
            .inner
            .tiers
            .entry(key.clone())
            .or_insert_with(|| {
                self.inner.len.fetch_add(1, Ordering::Relaxed);
                SharedSlot::default()
            })
            .clone();
        Ok(Some(slot))
    }

    /// Any batch: GCRA buckets by compare-and-swap (rolled back and decided again when a race
    /// is lost), tiered keys under their slot's lock, taken in address order (so two batches
    /// never wait for each other) and held until the batch is written. A key named twice is
    /// locked once (for its first transaction) and decided in order by the kit.
    fn spend_mixed(&self, batch: &[BucketTx<'_>], now: u64) -> Result<Outcomes, BackendError> {
        // A batch of GCRA buckets only (a request's usual rules) locks nothing: no slots, and
        // it is decided from the words alone unless one of them needs a repair.
        if batch.iter().all(|tx| tx.quota.as_gcra().is_some()) {
            if let Some(decided) = self.spend_words(batch, now) {
                return decided;
            }
            return self.decide_mixed(batch, now, &mut []);
        }
        // The working vectors of a batch live on the stack up to `BATCH` transactions.
        let mut slots: SmallVec<[Option<SharedSlot>; BATCH]> = SmallVec::with_capacity(batch.len());
        'slots: loop {
            slots.clear();
            for (i, tx) in batch.iter().enumerate() {
                slots.push(match tx.quota.as_gcra() {
                    Some(_) => None,
                    // A key named again is under its first transaction's lock: a second
                    // lock of the same mutex on this thread would never return (issue 53).
                    None if kit::earlier(batch, i).is_some() => None,
                    None => self.tier_slot(tx.key, kit::may_write(tx), now)?,
                });
            }
            let mut order: SmallVec<[usize; BATCH]> =
                (0..batch.len()).filter(|&i| slots[i].is_some()).collect();
            order.sort_by_key(|&i| slots[i].as_ref().map(Arc::as_ptr));
            let mut guards: SmallVec<[(usize, MutexGuard<'_, TierSlot>); BATCH]> =
                SmallVec::with_capacity(order.len());
            for &i in &order {
                if let Some(slot) = &slots[i] {
                    let g = lock(slot);
                    if g.removed {
                        continue 'slots;
                    }
                    guards.push((i, g));
                }
            }
            return self.decide_mixed(batch, now, &mut guards);
        }
    }

    /// Decides a batch with the kit from the states read (GCRA TATs loaded, tiered and
    /// concurrency states under their locked slots) and writes what it says: GCRA buckets by
    /// compare-and-swap (a lost race rolls back what was written and decides again), the rest
    /// under their locks, which cannot fail.
    fn decide_mixed(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
        guards: &mut [(usize, MutexGuard<'_, TierSlot>)],
    ) -> Result<Outcomes, BackendError> {
        'retry: loop {
            let mut tats: SmallVec<[u64; BATCH]> = SmallVec::with_capacity(batch.len());
            // The GCRA buckets held (their shards' read guards) from the read to the write: one
            // lookup per key. Read guards of one shard may be held together (the lock lets
            // readers in while a writer waits), but no bucket may be inserted while any is held.
            let mut held: SmallVec<[Option<Held<'_>>; BATCH]> =
                SmallVec::with_capacity(batch.len());
            let spent = {
                let mut read: SmallVec<[Option<kit::Read<'_>>; BATCH]> =
                    SmallVec::with_capacity(batch.len());
                for (i, tx) in batch.iter().enumerate() {
                    if let Some(k) = kit::earlier(batch, i) {
                        // A key named again: the kit reads what its earlier transaction
                        // leaves, and its write is compared with what the first one read.
                        held.push(None);
                        tats.push(tats[k]);
                        read.push(None);
                        continue;
                    }
                    let slot = guards.iter().find(|(j, _)| *j == i).map(|(_, g)| &**g);
                    let bucket = match tx.quota.as_gcra() {
                        Some(_) => self.inner.map.get(Buckets::place(tx.key)),
                        None => None,
                    };
                    let cur = bucket.as_ref().map_or(0, |b| b.load(Ordering::Acquire));
                    held.push(bucket);
                    tats.push(cur);
                    read.push(match (tx.quota.as_gcra(), slot) {
                        (Some(_), _) => Some(kit::Read::Tat(stored(cur).unwrap_or(0))),
                        (None, Some(g)) => g.state.as_ref().map(kit::Stored::read),
                        (None, None) => None,
                    });
                }
                kit::spend(batch, &read, now)?
            };
            if !spent.allowed {
                // Nothing spent; what replaces a foreign value is written all the same.
                if spent.writes.iter().any(Option::is_some) {
                    drop(held);
                    self.write_repairs(batch, &tats, spent.writes, guards, now);
                }
                return Ok(spent.outcomes);
            }
            let word = |i: usize| match spent.writes[i] {
                Some(kit::Stored::Tat(new)) => new,
                _ => 0,
            };
            if !self.write_words(batch, &mut held, &tats, word, now)? {
                continue 'retry;
            }
            // The GCRA part is written; the tiered and concurrency parts cannot fail (their
            // slots are locked).
            for (i, write) in spent.writes.into_iter().enumerate() {
                if let Some(state) = write.filter(|w| !matches!(w, kit::Stored::Tat(_)))
                    && let Some(g) = guard_of(batch, guards, i)
                {
                    g.write(batch[i].quota, state, now);
                }
            }
            return Ok(spent.outcomes);
        }
    }
}

/// The locked slot of `batch[i]`'s key: its first transaction's.
fn guard_of<'g, 'm>(
    batch: &[BucketTx<'_>],
    guards: &'g mut [(usize, MutexGuard<'m, TierSlot>)],
    mut i: usize,
) -> Option<&'g mut MutexGuard<'m, TierSlot>> {
    while let Some(k) = kit::earlier(batch, i) {
        i = k;
    }
    guards.iter_mut().find(|(j, _)| *j == i).map(|(_, g)| g)
}

impl MemoryBackend {
    /// A batch of GCRA buckets, each within what its limit writes or drained under a larger
    /// one (a request's usual rules): decided by the kit's GCRA step and batch rule from the
    /// words read, written by [`write_words`](Self::write_words), with no state of the kit's
    /// built on the way. `None` when a bucket holds a foreign value: the general road
    /// ([`decide_mixed`](Self::decide_mixed)) writes what replaces it.
    fn spend_words(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Option<Result<Outcomes, BackendError>> {
        loop {
            let mut held: SmallVec<[Option<Held<'_>>; WORDS]> =
                SmallVec::with_capacity(batch.len());
            let mut read: SmallVec<[u64; WORDS]> = SmallVec::with_capacity(batch.len());
            let mut words: SmallVec<[u64; WORDS]> = SmallVec::with_capacity(batch.len());
            let mut outcomes = Outcomes::with_capacity(batch.len());
            for (i, tx) in batch.iter().enumerate() {
                let limit = tx.quota.as_gcra()?;
                // A key named twice: the general road decides it in order.
                if i > 0 && kit::earlier(batch, i).is_some() {
                    return None;
                }
                let bucket = self.inner.map.get(Buckets::place(tx.key));
                let cur = bucket.as_ref().map_or(0, |b| b.load(Ordering::Acquire));
                let step = match kit::gcra_step(tx, limit, cur, now) {
                    Ok(step) => step,
                    Err(e) => return Some(Err(e.into())),
                };
                if step.repair.is_some() {
                    return None;
                }
                held.push(bucket);
                read.push(cur);
                words.push(step.write.unwrap_or(0));
                outcomes.push(step.decision.outcome());
            }
            if !kit::batch_allowed(batch.iter().zip(&outcomes)) {
                return Some(Ok(outcomes));
            }
            match self.write_words(batch, &mut held, &read, |i| words[i], now) {
                Ok(true) => return Some(Ok(outcomes)),
                Ok(false) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }

    /// Writes the GCRA words of an allowed batch: `word(i)` (0: nothing) over `read[i]`, the
    /// word read, by compare-and-swap on the bucket `held[i]` still holds (or, where a bucket
    /// must be inserted, after letting go of every bucket: an insert takes its shard's write
    /// lock). `Ok(false)`: a race was lost, and what was written is rolled back (decide again).
    fn write_words(
        &self,
        batch: &[BucketTx<'_>],
        held: &mut [Option<Held<'_>>],
        read: &[u64],
        word: impl Fn(usize) -> u64,
        now: u64,
    ) -> Result<bool, BackendError> {
        if (0..batch.len()).any(|i| word(i) != 0 && held[i].is_none()) {
            held.fill_with(|| None);
        }
        let mut written: SmallVec<[(usize, u64); WORDS]> = SmallVec::new();
        for (i, tx) in batch.iter().enumerate() {
            let new = word(i);
            if new == 0 {
                continue;
            }
            let swapped = match held.get(i).and_then(Option::as_ref) {
                Some(tat) => Ok(tat
                    .compare_exchange(read[i], new, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()),
                None => self.compare_and_set(tx.key, read[i], new, now),
            };
            if let Ok(true) = swapped {
                written.push((i, new));
                continue;
            }
            for &(j, new_j) in &written {
                self.roll_back(batch[j].key, read[j], new_j, now);
            }
            return swapped;
        }
        Ok(true)
    }

    /// Writes what replaces the foreign values a denied batch read (each GCRA word only if the
    /// bucket still holds what was read: a lost race leaves the newer state, which the next
    /// read judges again; leases under their locked slots).
    #[cold]
    fn write_repairs(
        &self,
        batch: &[BucketTx<'_>],
        read: &[u64],
        mut writes: smallvec::SmallVec<[Option<kit::Stored>; 4]>,
        guards: &mut [(usize, MutexGuard<'_, TierSlot>)],
        now: u64,
    ) {
        for (i, tx) in batch.iter().enumerate() {
            match writes[i].take() {
                Some(kit::Stored::Tat(new)) => {
                    let _ = self.compare_and_set(tx.key, read[i], new, now);
                }
                Some(state) => {
                    if let Some(g) = guard_of(batch, guards, i) {
                        g.write(tx.quota, state, now);
                    }
                }
                None => {}
            }
        }
    }

    /// Refunds one transaction with the kit: a GCRA bucket by compare-and-swap, a tiered or
    /// concurrency key under its slot's lock (a key never stored is refunded as a fresh one and
    /// nothing is written).
    fn refund_one(&self, tx: &BucketTx<'_>, now: u64) -> Result<Outcome, BackendError> {
        if tx.quota.as_gcra().is_some() {
            loop {
                let cur = self.load(tx.key);
                let (out, write) = kit::refund(tx, Some(kit::Read::Tat(cur)), now)?;
                match write {
                    Some(kit::Stored::Tat(new))
                        if !self.compare_and_set(tx.key, cur, new, now)? =>
                    {
                        continue;
                    }
                    _ => return Ok(out),
                }
            }
        }
        loop {
            let Some(slot) = self.tier_slot(tx.key, false, now)? else {
                return Ok(kit::refund(tx, None, now)?.0);
            };
            let mut g = lock(&slot);
            if g.removed {
                continue;
            }
            let (out, write) = kit::refund(tx, g.state.as_ref().map(kit::Stored::read), now)?;
            if let Some(state) = write {
                g.write(tx.quota, state, now);
            }
            return Ok(out);
        }
    }

    /// The live leases of a concurrency key (for tests and diagnostics).
    pub fn leases(&self, key: &BucketKey) -> usize {
        let now = self.now();
        self.inner.tiers.get(key).map_or(0, |slot| {
            let s = lock(&slot);
            match &s.state {
                Some(kit::Stored::Leases(leases)) if !s.removed => leases
                    .iter()
                    .filter(|&&(_, d)| concurrency::live(d, now))
                    .count(),
                _ => 0,
            }
        })
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
        Spend::Ready(self.spend_mixed(batch, now))
    }

    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        let now = self.now();
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

    fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.inner.clock.clone()
    }
}
