//! Regional mode in memory (`docs/regions.md`): the regions of one process and their global
//! store, each region a [`MemoryBackend`] whose limiter decides a marked limit by the region's
//! share buckets, as the Redis backend's script does (`share.lua`), with the protocol's
//! own functions: a key's limit in force is `RegionKey::bucket`, and when it changed, its
//! tokens are kept (`gcra::keep_tokens`) from `RegionKey::changed_at`. The global store answers
//! with `global::answer` and registers with `global::register`, the functions the Redis
//! backend's instances run on the records they read.
//!
//! [`SimulatedRegions`] moves the shares on a [`ManualClock`], at the instants the Redis
//! backend's task would (each period's demand taken at its end, the rebalance 15% into the
//! next, the keys whose answer may change asked again half and three quarters in): what the
//! simulator's `--regions` runs. Nothing here is for production: memory does not span
//! regions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::RegionShare;
use super::global::{self, Asked, KeyRecord, RegistryRecord, Stored};
use super::{
    ASK_AGAIN_QUARTERS, REBALANCE_AT_PERCENT, RegionalSettings, SURGE_QUARTER, demand_above_floor,
    marked,
};
use crate::algo::gcra;
use crate::algo::gcra::Limit;
use crate::algo::regions::{Grant, RegionKey, Request, Share};
use crate::backend::memory::MemoryBackend;
use crate::backend::{BackendError, BucketTx, FollowedLimits, Outcomes};
use crate::config::{Limits, RegionFloor};
use crate::key::BucketKey;
use crate::quota::Quota;
use crate::time::{Clock, ManualClock};

/// The global store of regions simulated in one process: the registry and each key's record,
/// as the Redis global store keeps them, on its own clock. Cheap to clone.
#[derive(Clone)]
pub(crate) struct MemoryGlobal {
    inner: Arc<GlobalInner>,
}

struct GlobalInner {
    clock: Arc<dyn Clock>,
    state: Mutex<GlobalState>,
}

#[derive(Default)]
struct GlobalState {
    /// `None` until the first region registers (a new store: quiet for one hold).
    registry: Option<RegistryRecord>,
    /// Each key's record and when it expires (global clock).
    keys: HashMap<BucketKey, (KeyRecord, u64)>,
}

impl std::fmt::Debug for MemoryGlobal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryGlobal").finish_non_exhaustive()
    }
}

impl MemoryGlobal {
    /// A global store that knows no region, on `clock`.
    pub(crate) fn new(clock: impl Clock) -> Self {
        Self {
            inner: Arc::new(GlobalInner {
                clock: Arc::new(clock),
                state: Mutex::default(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, GlobalState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `region` (kept when it is), and says whether it is confirmed: registered at
    /// least one hold ago.
    fn register(&self, region: &str, hold_us: u64, floor_bp: u16) -> Result<bool, BackendError> {
        let now = self.inner.clock.now_us();
        let mut state = self.state();
        let changed = global::register(
            state.registry.as_ref(),
            &[],
            region,
            now,
            hold_us,
            floor_bp,
            0,
        )
        .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        if let Some(record) = changed {
            state.registry = Some(record);
        }
        Ok(state
            .registry
            .as_ref()
            .and_then(|r| r.registered_at(region))
            .is_some_and(|at| now.saturating_sub(at) >= hold_us))
    }

    /// The answer to `region`'s `request` for `key`, its record written as the Redis global
    /// store's compare-and-set writes it.
    fn answer(
        &self,
        key: &BucketKey,
        region: &str,
        request: Request,
        asked: Asked,
        settings: &crate::algo::regions::Settings,
    ) -> global::Answered {
        let now = self.inner.clock.now_us();
        let mut state = self.state();
        state.keys.retain(|_, (_, until)| *until > now);
        let stored = match state.keys.get(key) {
            Some((record, _)) => Stored::Ours(record.clone()),
            None => Stored::None,
        };
        let registry = state.registry.clone().unwrap_or_default();
        let answered = global::answer(stored, &registry, region, request, asked, settings, now);
        match &answered.record {
            Some(record) => {
                let until = now.saturating_add(answered.ttl_ms.saturating_mul(1_000));
                state.keys.insert(key.clone(), (record.clone(), until));
            }
            None => {
                state.keys.remove(key);
            }
        }
        answered
    }
}

/// A region's side in memory: its name, its global store, its share records and the demand
/// counted.
pub(crate) struct MemoryRegion {
    name: String,
    global: MemoryGlobal,
    settings: RegionalSettings,
    /// Whether this region's registration is confirmed: until then its floors are 0.
    confirmed: AtomicBool,
    /// The share records and the demand; held across a batch that names a share bucket, so
    /// its keys' limits and words change together.
    state: Mutex<RegionState>,
    /// The limits in force on the limiter served.
    followed: Mutex<Option<FollowedLimits>>,
}

#[derive(Default)]
pub(crate) struct RegionState {
    /// Each share bucket's record beside its word (`share.lua`'s record, less the TAT).
    records: HashMap<BucketKey, ShareRecord>,
    /// The units asked of each marked key since the period's demand was last taken.
    demand: HashMap<BucketKey, u64>,
    /// The keys whose part or reported demand was not zero after the last rebalance: asked
    /// again at the next (demand 0 when they have none), as the Redis task does.
    asked_next: Vec<BucketKey>,
    /// The keys whose answer may change this period, with their demands.
    ask_again: Vec<(BucketKey, u64)>,
    /// The demands asked for at the period's rebalance (a surge is measured against them).
    reported: HashMap<BucketKey, u64>,
}

/// A share bucket's record: the region's record of the key, and the limit its word was last
/// written under and when (`None`: never written, full under the floor).
#[derive(Debug, Clone, Copy, Default)]
struct ShareRecord {
    key: RegionKey,
    written: Option<(Option<Limit>, u64)>,
}

impl MemoryRegion {
    pub(crate) fn new(name: String, global: MemoryGlobal, settings: RegionalSettings) -> Self {
        Self {
            name,
            global,
            settings,
            confirmed: AtomicBool::new(false),
            state: Mutex::default(),
            followed: Mutex::default(),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, RegionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn follow(&self, limits: FollowedLimits) {
        *self.followed.lock().unwrap_or_else(PoisonError::into_inner) = Some(limits);
    }

    fn limits(&self) -> Option<Arc<Limits>> {
        let followed = self.followed.lock().unwrap_or_else(PoisonError::into_inner);
        followed.as_ref().and_then(|f| f())
    }

    /// The floor this region holds of `limit` now (0 until its registration is confirmed).
    fn floor(&self, limit: &Limit, floor: RegionFloor) -> Share {
        if self.confirmed.load(Ordering::Acquire) {
            Share {
                rate: floor.of(limit.count()),
                burst: floor.of(limit.burst()),
            }
        } else {
            Share::ZERO
        }
    }
}

/// Whether two limits of a share bucket decide alike (the script compares the interval and
/// the burst it stored).
fn same(a: &Limit, b: &Limit) -> bool {
    a.emission_interval_us() == b.emission_interval_us() && a.burst() == b.burst()
}

/// What a share bucket's next read finds at `now` (`share.lua`'s `read_share`): its
/// limit in force (`RegionKey::bucket`: the floor, and the part while its lease runs; `None`:
/// closed) and its TAT under it. When the limit changed since the word was written, the
/// bucket's tokens are kept (`gcra::keep_tokens`) from when it changed
/// (`RegionKey::changed_at`); a bucket never written is full under the floor, so a part
/// arrives empty; a closed one is decided on no token and left as it is (`on_shares`).
fn read_share(
    record: &ShareRecord,
    tat: Option<u64>,
    floor: Share,
    period: u64,
    now: u64,
) -> Result<(Option<Limit>, Option<u64>), BackendError> {
    let in_force = record.key.bucket(floor, period, now);
    let (written, at) = match record.written {
        Some((written, written_at)) => (written, record.key.changed_at(written_at, now)),
        None => (Limit::share(floor.burst, floor.rate, period), now),
    };
    let tat = match (written, in_force) {
        (_, None) => closed(period).map(|c| now.saturating_add(c.burst_offset_us())),
        (Some(old), Some(new)) if same(&old, &new) => tat,
        (Some(old), Some(new)) => gcra::keep_tokens(&old, &new, tat, at)?,
        (None, Some(new)) => Some(at.saturating_add(new.burst_offset_us())),
    };
    Ok((in_force, tat))
}

/// A share bucket as the simulator draws it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareNow {
    /// The region's floor: its rate (per the limit's period) and burst (0 until confirmed).
    pub floor: (u64, u64),
    /// The part granted above it while its lease runs.
    pub part: (u64, u64),
    /// The tokens the bucket holds.
    pub tokens: u64,
}

/// A closed share bucket's limit (no rate or no burst): one token a period, held drained, so
/// every cost is denied and its wait is a period.
fn closed(period_us: u64) -> Option<Limit> {
    Limit::share(1, 1, period_us)
}

impl MemoryBackend {
    /// Brings `key`'s share bucket (a marked `limit` with `floor`) to its limit in force at
    /// `now`, its word converted by the change rule of shares (`read_share`), and says that
    /// limit (`None`: the key is closed here, its word drained).
    fn settle_share(
        &self,
        region: &MemoryRegion,
        state: &mut RegionState,
        key: &BucketKey,
        limit: &Limit,
        floor: RegionFloor,
        now: u64,
    ) -> Result<Option<Limit>, BackendError> {
        let period = limit.period_us();
        let floor = region.floor(limit, floor);
        let record = state.records.entry(key.clone()).or_default();
        let tat = self.tat(key);
        let (in_force, new_tat) = read_share(record, tat, floor, period, now)?;
        if in_force.is_none() {
            // Closed here: the bucket is left as it is (`share.lua`'s `write_share`).
            return Ok(None);
        }
        record.written = Some((in_force, now));
        if new_tat != tat
            && let Some(word_limit) = in_force.or(closed(period))
        {
            self.put_tat(key, new_tat.filter(|&t| t > now), &word_limit, now)?;
        }
        Ok(in_force)
    }

    /// What `key`'s share bucket holds now, as its next decision reads it (for the simulator's
    /// drawing): `None` when the backend is not regional or `key` is not of a marked GCRA limit
    /// of the limits it follows.
    #[doc(hidden)]
    pub fn share_now(&self, key: &BucketKey) -> Option<ShareNow> {
        let (region, limits) = self.region_limits()?;
        let (_, &limit, floor) = marked(&limits, key)?;
        let floor = region.floor(&limit, floor);
        let now = self.now_us();
        let record = region.lock().records.get(key).copied().unwrap_or_default();
        let tat = self.tat(key);
        let (in_force, tat) = read_share(&record, tat, floor, limit.period_us(), now).ok()?;
        let part = record.key.in_use(now);
        Some(ShareNow {
            floor: (floor.rate, floor.burst),
            part: (part.rate, part.burst),
            tokens: in_force
                .and_then(|l| gcra::check(&l, tat, now, 0).ok())
                .map_or(0, |o| o.remaining),
        })
    }

    /// A batch that names a marked limit's share bucket (regional mode in memory): each share
    /// bucket brought to its limit in force (its units counted in the period's demand), then
    /// the batch decided on the one road with those limits, under the region's lock.
    pub(crate) fn spend_shares(
        &self,
        region: &MemoryRegion,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Result<Outcomes, BackendError> {
        self.on_shares(region, batch, now, true, |decided| {
            self.spend_mixed(decided, now)
        })
    }

    /// A refund naming a share bucket: refunded under the share's limit in force, as the
    /// script refunds it.
    pub(crate) fn refund_shares(
        &self,
        region: &MemoryRegion,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Result<Outcomes, BackendError> {
        self.on_shares(region, batch, now, false, |decided| {
            decided.iter().map(|tx| self.refund_one(tx, now)).collect()
        })
    }

    /// `batch` with each share bucket brought to its limit in force and sent as a GCRA
    /// transaction of that limit (a closed one: drained), to `then`, under the region's lock;
    /// `demand`: its units counted in the period's demand (a spend's, not a refund's).
    fn on_shares<T>(
        &self,
        region: &MemoryRegion,
        batch: &[BucketTx<'_>],
        now: u64,
        demand: bool,
        then: impl FnOnce(&[BucketTx<'_>]) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let mut state = region.lock();
        let mut quotas: Vec<Option<Quota>> = Vec::with_capacity(batch.len());
        // The words of the keys closed here: decided drained, then put back as they were.
        let mut closed_words: Vec<(&BucketKey, u64)> = Vec::new();
        for tx in batch {
            quotas.push(match (tx.floor, tx.quota.as_gcra()) {
                (Some(floor), Some(limit)) => {
                    let in_force =
                        self.settle_share(region, &mut state, tx.key, limit, floor, now)?;
                    if demand {
                        if let Some(units) = state.demand.get_mut(tx.key) {
                            *units = units.saturating_add(tx.cost);
                        } else if state.demand.len() < region.settings.demand_cap() {
                            state.demand.insert(tx.key.clone(), tx.cost);
                        }
                    }
                    if in_force.is_none()
                        && let Some(c) = closed(limit.period_us())
                    {
                        closed_words.push((tx.key, self.word(tx.key)));
                        self.put_tat(
                            tx.key,
                            Some(now.saturating_add(c.burst_offset_us())),
                            &c,
                            now,
                        )?;
                    }
                    in_force.or(closed(limit.period_us())).map(Quota::Gcra)
                }
                _ => None,
            });
        }
        let decided: Vec<BucketTx<'_>> = batch
            .iter()
            .zip(&quotas)
            .map(|(tx, quota)| match quota {
                Some(quota) => BucketTx {
                    quota,
                    floor: None,
                    ..*tx
                },
                None => *tx,
            })
            .collect();
        let decided = then(&decided);
        for (key, word) in closed_words.into_iter().rev() {
            self.put_word(key, word, now)?;
        }
        decided
    }

    /// This region's share of `key` (`limit` its quota, with `floor`), as its record holds it.
    pub(crate) fn memory_share_of(
        &self,
        region: &MemoryRegion,
        key: &BucketKey,
        limit: &Limit,
        floor: RegionFloor,
    ) -> RegionShare {
        let now = self.now_us();
        let record = region.lock().records.get(key).copied().unwrap_or_default();
        let part = record.key.in_use(now);
        let floor = region.floor(limit, floor);
        RegionShare {
            region: region.name.clone(),
            confirmed: region.confirmed.load(Ordering::Acquire),
            floor: (floor.rate, floor.burst),
            part: (part.rate, part.burst),
            lease_left: std::time::Duration::from_micros(if part == Share::ZERO {
                0
            } else {
                record.key.lease_end.saturating_sub(now)
            }),
        }
    }

    /// One pass over `demands` (at most `max_keys`, the busiest first): each key's request
    /// numbered in the region's records, answered by the global store, the grant applied. The
    /// keys whose part it made smaller, with their demands, are returned to confirm at once.
    fn memory_pass(
        &self,
        region: &MemoryRegion,
        limits: &Limits,
        demands: &[(BucketKey, u64)],
        report_again: bool,
        parts: &mut Vec<Moved>,
    ) -> Result<Vec<(BucketKey, u64)>, BackendError> {
        let mut busiest: Vec<&(BucketKey, u64)> = demands.iter().collect();
        busiest.sort_by_key(|d| std::cmp::Reverse(d.1));
        busiest.truncate(region.settings.max_keys);
        let mut smaller = Vec::new();
        let mut state = region.lock();
        for (key, demand) in busiest {
            let Some((_, limit, floor)) = marked(limits, key) else {
                continue;
            };
            let now = self.now_us();
            self.settle_share(region, &mut state, key, limit, floor, now)?;
            let Some(record) = state.records.get_mut(key) else {
                continue;
            };
            let in_use = record.key.in_use(now);
            let request = record.key.request(0, *demand, now);
            let settings = region.settings.protocol(limit);
            let asked = Asked::of(limit, floor);
            let answer = region
                .global
                .answer(key, &region.name, request, asked, &settings);
            let Some(grant) = answer.grant else {
                continue;
            };
            if answer.ask_again && report_again {
                state.ask_again.push((key.clone(), *demand));
            }
            if !in_use.within(grant.share) {
                smaller.push((key.clone(), *demand));
            }
            if grant.share != Share::ZERO || *demand > 0 {
                // Once per key when taken (a key a later pass left with nothing is asked once
                // more, answered nothing, and not kept).
                state.asked_next.push(key.clone());
            }
            // The grant applied: the bucket's tokens kept under the new limit from now (from
            // none when it was closed here: a part that opens it arrives empty, as the
            // script's closed read holds no token).
            let closed = (self.settle_share(region, &mut state, key, limit, floor, now)?).is_none();
            if let Some(record) = state.records.get_mut(key) {
                let before = record.key.applied;
                record
                    .key
                    .on_grant(&Grant { region: 0, ..grant }, &settings);
                let opens = record
                    .key
                    .bucket(region.floor(limit, floor), limit.period_us(), now);
                if closed && opens.is_some() {
                    record.written = None;
                }
                if record.key.applied != before {
                    parts.push(Moved {
                        at_us: now,
                        key: key.clone(),
                        part: (grant.share.rate, grant.share.burst),
                        lease_end_us: record.key.lease_end,
                    });
                }
            }
            self.settle_share(region, &mut state, key, limit, floor, now)?;
        }
        Ok(smaller)
    }

    /// `demands` answered, and the parts made smaller confirmed at once (as the Redis
    /// backend's `answer_keys`).
    fn memory_answer_keys(
        &self,
        region: &MemoryRegion,
        limits: &Limits,
        demands: &[(BucketKey, u64)],
        parts: &mut Vec<Moved>,
    ) -> Result<(), BackendError> {
        let smaller = self.memory_pass(region, limits, demands, true, parts)?;
        if !smaller.is_empty() {
            self.memory_pass(region, limits, &smaller, false, parts)?;
        }
        Ok(())
    }
}

/// A part that moved: a grant applied in a region's records.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// When it was applied (the clock's microseconds).
    pub at_us: u64,
    /// The key.
    pub key: BucketKey,
    /// The part granted above the floor: its rate (per the limit's period) and burst.
    pub part: (u64, u64),
    /// When its lease ends.
    pub lease_end_us: u64,
}

/// Regions simulated in one process on one [`ManualClock`] (the simulator's `--regions`): a
/// [`MemoryBackend`] per region, in regional mode over one [`MemoryGlobal`], and their shares
/// moved at the instants the Redis backend's task moves them. Build a limiter over each
/// region's backend, then call [`start`](Self::start) before the first request and
/// [`advance`](Self::advance) before each later one.
#[doc(hidden)]
pub struct SimulatedRegions {
    clock: ManualClock,
    regions: Vec<(String, MemoryBackend)>,
    settings: RegionalSettings,
    /// The period whose end comes next, and each region's demand taken at the last end.
    next_end: u64,
    taken: Vec<Vec<(BucketKey, u64)>>,
    /// The events of the period under way not yet run: (at, what), in time order.
    pending: Vec<(u64, Step)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Rebalance,
    /// The keys asked again; with the surges of the `elapsed` µs of the period so far.
    AskAgain(Option<u64>),
}

impl std::fmt::Debug for SimulatedRegions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulatedRegions")
            .field("regions", &self.regions.len())
            .finish_non_exhaustive()
    }
}

impl SimulatedRegions {
    /// A region per name (1 to 32 ASCII letters, digits, `-` or `_`, each once), on `clock`
    /// (the global store's and every region's), with the default settings (a period of 1 s, a
    /// lease of 3 s and a margin of 1 s).
    pub fn new(clock: &ManualClock, names: &[&str]) -> Result<Self, String> {
        let settings = RegionalSettings::default();
        let global = MemoryGlobal::new(clock.clone());
        let mut regions = Vec::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            if !global::is_region_name(name) {
                return Err(format!(
                    "region {name:?}: a region is named by 1 to 32 ASCII letters, digits, '-' or '_'"
                ));
            }
            if names[..i].contains(name) {
                return Err(format!("region {name:?} is named twice"));
            }
            let backend = MemoryBackend::builder()
                .clock(clock.clone())
                .no_background_sweep()
                .regional(MemoryRegion::new(
                    (*name).to_owned(),
                    global.clone(),
                    settings,
                ))
                .build();
            regions.push(((*name).to_owned(), backend));
        }
        Ok(Self {
            clock: clock.clone(),
            taken: vec![Vec::new(); regions.len()],
            regions,
            settings,
            next_end: 0,
            pending: Vec::new(),
        })
    }

    /// Each region's name and backend, in the order named.
    pub fn regions(&self) -> &[(String, MemoryBackend)] {
        &self.regions
    }

    /// The rebalance period, in microseconds.
    pub fn period_us(&self) -> u64 {
        self.settings.period_us
    }

    /// Registers every region one lease and the margin before the clock's now, so each is
    /// confirmed (its floors in use) and the new global store's quiet period is over at now;
    /// the clock is left at now. Call it once the limiters are built (the regions register
    /// under their marked limits' floors).
    pub fn start(&mut self) -> Result<(), BackendError> {
        let now = self.clock.now_us();
        let hold = self
            .settings
            .lease_us
            .saturating_add(self.settings.margin_us);
        for at in [now.saturating_sub(hold), now] {
            self.clock.set(at);
            for (_, backend) in &self.regions {
                backend.memory_register()?;
            }
        }
        let period = self.settings.period_us;
        self.next_end = now / period + 1;
        Ok(())
    }

    /// The next instant at which [`advance`](Self::advance) runs a step: a period's end, or
    /// a rebalance in the period under way.
    pub fn next_at(&self) -> u64 {
        let end = self.next_end.saturating_mul(self.settings.period_us);
        self.pending.first().map_or(end, |p| p.0.min(end))
    }

    /// Runs every step of the protocol due at or before `to` (microseconds on the clock), in
    /// time order, the clock set to each step's instant, and leaves the clock at `to`: the
    /// parts it applied, by region (positions as named).
    pub fn advance(&mut self, to: u64) -> Result<Vec<(usize, Moved)>, BackendError> {
        let period = self.settings.period_us;
        let mut moved = Vec::new();
        loop {
            let end = self.next_end.saturating_mul(period);
            let next_pending = self.pending.first().map(|p| p.0);
            match next_pending {
                Some(at) if at <= to && at < end => {
                    let (at, step) = self.pending.remove(0);
                    self.clock.set(at);
                    self.run(step, &mut moved)?;
                }
                _ if end <= to => {
                    // A period ends: its demand taken; the steps of the next scheduled (the
                    // ones of the period before, not run yet, are dropped as the task's would
                    // be, a period late).
                    self.clock.set(end);
                    self.taken = self
                        .regions
                        .iter()
                        .map(|(_, b)| b.memory_take_demand(period))
                        .collect();
                    self.pending = std::iter::once((
                        end + period / 100 * REBALANCE_AT_PERCENT,
                        Step::Rebalance,
                    ))
                    .chain(ASK_AGAIN_QUARTERS.iter().map(|&q| {
                        // Half a period in, the surges too.
                        let surge = (q == SURGE_QUARTER).then_some(period / 4 * q);
                        (end + period / 4 * q, Step::AskAgain(surge))
                    }))
                    .collect();
                    self.next_end += 1;
                }
                _ => break,
            }
        }
        self.clock.set(to);
        Ok(moved)
    }

    fn run(&mut self, step: Step, moved: &mut Vec<(usize, Moved)>) -> Result<(), BackendError> {
        for (i, (_, backend)) in self.regions.iter().enumerate() {
            let mut parts = Vec::new();
            match step {
                Step::Rebalance => {
                    backend.memory_register()?;
                    backend.memory_rebalance(&self.taken[i], &mut parts)?;
                }
                Step::AskAgain(surge) => backend.memory_ask_again(surge, &mut parts)?,
            }
            moved.extend(parts.into_iter().map(|p| (i, p)));
        }
        Ok(())
    }
}

impl MemoryBackend {
    /// This backend's region and the limits in force on its limiter, when it is regional and
    /// serves one.
    fn region_limits(&self) -> Option<(&MemoryRegion, Arc<Limits>)> {
        let region = self.region()?;
        Some((region, region.limits()?))
    }

    /// Registers this region under the largest floor of its marked limits.
    fn memory_register(&self) -> Result<(), BackendError> {
        let Some((region, limits)) = self.region_limits() else {
            return Ok(());
        };
        let floor_bp = limits
            .across_regions_names()
            .into_iter()
            .filter_map(|n| limits.across_regions(n))
            .map(RegionFloor::basis_points)
            .max()
            .unwrap_or(0);
        let hold = region
            .settings
            .lease_us
            .saturating_add(region.settings.margin_us);
        let confirmed = region.global.register(&region.name, hold, floor_bp)?;
        region.confirmed.store(confirmed, Ordering::Release);
        Ok(())
    }

    /// The demand counted since it was last taken: each marked key's above its floor, per its
    /// limit's period, over a rebalance `period_us` (keys with none left out).
    fn memory_take_demand(&self, period_us: u64) -> Vec<(BucketKey, u64)> {
        let Some((region, limits)) = self.region_limits() else {
            return Vec::new();
        };
        let counted = std::mem::take(&mut region.lock().demand);
        counted
            .into_iter()
            .filter_map(|(key, units)| {
                let (_, limit, floor) = marked(&limits, &key)?;
                let demand = demand_above_floor(units, limit, floor, period_us);
                (demand > 0).then_some((key, demand))
            })
            .collect()
    }

    /// A period's rebalance: `demands` and the keys asked at the last with a part or a demand
    /// (demand 0 when they have none now).
    fn memory_rebalance(
        &self,
        demands: &[(BucketKey, u64)],
        parts: &mut Vec<Moved>,
    ) -> Result<(), BackendError> {
        let Some((region, limits)) = self.region_limits() else {
            return Ok(());
        };
        let mut all = demands.to_vec();
        {
            let mut state = region.lock();
            let mut seen: std::collections::HashSet<BucketKey> =
                all.iter().map(|(k, _)| k.clone()).collect();
            for key in std::mem::take(&mut state.asked_next) {
                if seen.insert(key.clone()) {
                    all.push((key, 0));
                }
            }
            state.ask_again.clear();
            state.reported = all.iter().cloned().collect();
            // Records that hold nothing the floor does not (their lease over, their word full)
            // are forgotten: no record reads the same.
            let now = self.now_us();
            let full = |key: &BucketKey| self.tat(key).is_none_or(|t| t <= now);
            state
                .records
                .retain(|key, r| r.key.lease_end > now || !full(key));
        }
        self.memory_answer_keys(region, &limits, &all, parts)
    }

    /// The keys whose answer may change this period, asked again; half a period in (`surge`:
    /// `elapsed_us` into it), with the keys whose demand surged since it began.
    fn memory_ask_again(
        &self,
        surge: Option<u64>,
        parts: &mut Vec<Moved>,
    ) -> Result<(), BackendError> {
        let Some((region, limits)) = self.region_limits() else {
            return Ok(());
        };
        let again = {
            let mut state = region.lock();
            let mut again = std::mem::take(&mut state.ask_again);
            if let Some(elapsed) = surge {
                let counted = state.demand.iter().map(|(k, u)| (k.clone(), *u));
                let surged = super::surging(counted, &limits, elapsed, &state.reported);
                super::with_surges(&mut again, surged);
            }
            again
        };
        if again.is_empty() {
            return Ok(());
        }
        self.memory_answer_keys(region, &limits, &again, parts)
    }
}

#[cfg(test)]
mod tests;
