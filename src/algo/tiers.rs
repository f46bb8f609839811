//! Burst tiers: tiered sliding windows with active and cooldown periods, as a pure state
//! machine (no I/O, no clock). The contract is `docs/burst-tiers.md`; the Redis Lua script
//! mirrors this file.
//!
//! A [`TieredLimit`] is an ordered list of [`Tier`]s. A client fills tier 1; when it is full
//! the client may *burst* into tier 2 (which then stays active for its `active` period and
//! afterwards cannot be entered again for its `cooldown`), and so on. The state of one key is
//! a [`TierState`]: per tier, the time it was last entered and a log of `(time, units)`
//! grants. Every time is an integer number of microseconds.
//!
//! ```
//! use std::time::Duration;
//! use tower_ratelimits::__private::tiers::{self, Tier, TieredLimit, TierState};
//!
//! let s = Duration::from_secs;
//! // "penalty": 5 per second, may burst to 50 per 5 s, and burst again 20 s after entering.
//! let limit = TieredLimit::new([
//!     Tier::new(5, s(1), s(1), s(0)),
//!     Tier::new(50, s(5), s(5), s(15)),
//! ])
//! .unwrap();
//! let mut state = TierState::new();
//! for i in 0..5 {
//!     assert!(tiers::spend(&limit, &mut state, i * 100_000, 1, 1).unwrap().allowed);
//! }
//! let burst = tiers::spend(&limit, &mut state, 500_000, 1, 1).unwrap();
//! assert!(burst.allowed && burst.burst);
//! assert_eq!((burst.tier, burst.units(&limit)), (2, &[0, 1][..]));
//! ```

use std::fmt;
use std::time::Duration;

use crate::time::duration_us;

/// The most tiers a tiered limit may have.
pub const MAX_TIERS: usize = 8;

/// The largest `limit` of one tier (2^32), so that every count stays exact in a Redis Lua
/// number.
pub const MAX_TIER_LIMIT: u64 = 1 << 32;

/// The longest `window`, `active` or `cooldown` of a tier: 100 years (as
/// [`MAX_BURST_OFFSET_US`](crate::algo::gcra::MAX_BURST_OFFSET_US)).
pub const MAX_TIER_DURATION_US: u64 = crate::algo::gcra::MAX_BURST_OFFSET_US;

/// Why a tiered limit was refused. Tiers are numbered from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    /// The list of tiers is empty.
    #[error("a tiered limit needs at least one tier")]
    NoTiers,
    /// More than [`MAX_TIERS`] tiers.
    #[error("{0} tiers given; at most {MAX_TIERS} are supported")]
    TooManyTiers(usize),
    /// `window` or `active` was zero.
    #[error("tier {tier}: {field} must be greater than zero")]
    Zero {
        /// The tier, from 1.
        tier: usize,
        /// The field.
        field: &'static str,
    },
    /// A field above its maximum.
    #[error("tier {tier}: {field} {value} is larger than the maximum {max}")]
    TooLarge {
        /// The tier, from 1.
        tier: usize,
        /// The field.
        field: &'static str,
        /// The value (microseconds for durations).
        value: u64,
        /// The maximum.
        max: u64,
    },
    /// Every tier has limit 0: nothing could ever be granted.
    #[error("every tier has limit 0: nothing could ever be granted")]
    NoCapacity,
}

/// Why a request could not be decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TierRequestError {
    /// `min` is larger than `max`.
    #[error("the smallest acceptable grant {min} is larger than the largest {max}")]
    MinAboveMax {
        /// The smallest acceptable number of units.
        min: u64,
        /// The most units asked for.
        max: u64,
    },
    /// `min` is larger than the sum of all tiers' limits: it could never be granted.
    #[error("the smallest acceptable grant {min} exceeds the capacity {capacity} of all tiers")]
    MinAboveCapacity {
        /// The smallest acceptable number of units.
        min: u64,
        /// The sum of the tiers' limits.
        capacity: u64,
    },
}

/// One tier: at most `limit` grants inside any sliding `window`; once entered it stays
/// active for `active`, then cannot be entered for `cooldown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tier {
    limit: u64,
    window_us: u64,
    active_us: u64,
    cooldown_us: u64,
}

impl Tier {
    /// A tier (validated when put into a [`TieredLimit`]).
    pub fn new(limit: u64, window: Duration, active: Duration, cooldown: Duration) -> Self {
        Self::from_micros(
            limit,
            duration_us(window),
            duration_us(active),
            duration_us(cooldown),
        )
    }

    /// A tier from durations in microseconds (validated when put into a [`TieredLimit`]).
    pub fn from_micros(limit: u64, window_us: u64, active_us: u64, cooldown_us: u64) -> Self {
        Self {
            limit,
            window_us,
            active_us,
            cooldown_us,
        }
    }

    /// The most grants inside one window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window, in microseconds.
    pub fn window_us(&self) -> u64 {
        self.window_us
    }

    /// How long the tier stays active once entered, in microseconds.
    pub fn active_us(&self) -> u64 {
        self.active_us
    }

    /// How long after its active period the tier cannot be entered, in microseconds.
    pub fn cooldown_us(&self) -> u64 {
        self.cooldown_us
    }

    fn validate(&self, tier: usize) -> Result<(), TierError> {
        for (field, v) in [("window", self.window_us), ("active", self.active_us)] {
            if v == 0 {
                return Err(TierError::Zero { tier, field });
            }
        }
        let checks = [
            ("limit", self.limit, MAX_TIER_LIMIT),
            ("window", self.window_us, MAX_TIER_DURATION_US),
            ("active", self.active_us, MAX_TIER_DURATION_US),
            ("cooldown", self.cooldown_us, MAX_TIER_DURATION_US),
        ];
        for (field, value, max) in checks {
            if value > max {
                return Err(TierError::TooLarge {
                    tier,
                    field,
                    value,
                    max,
                });
            }
        }
        Ok(())
    }

    /// The phase at `now` of a tier last entered at `entry`.
    fn phase(&self, entry: Option<u64>, now: u64) -> Phase {
        let Some(e) = entry else {
            return Phase::Inactive;
        };
        let active_end = e.saturating_add(self.active_us);
        if now > active_end.saturating_add(self.cooldown_us) {
            Phase::Inactive
        } else if now <= active_end {
            Phase::Active
        } else {
            Phase::Cooldown
        }
    }
}

/// A validated list of 1 to [`MAX_TIERS`] tiers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TieredLimit {
    tiers: Box<[Tier]>,
    capacity: u64,
}

impl TieredLimit {
    /// Validates tiers: `window > 0`, `active > 0`, every value within its maximum, and at
    /// least one tier with a limit above 0. Errors name the tier (from 1) and the field.
    pub fn new(tiers: impl IntoIterator<Item = Tier>) -> Result<Self, TierError> {
        let tiers: Box<[Tier]> = tiers.into_iter().collect();
        if tiers.is_empty() {
            return Err(TierError::NoTiers);
        }
        if tiers.len() > MAX_TIERS {
            return Err(TierError::TooManyTiers(tiers.len()));
        }
        for (i, t) in tiers.iter().enumerate() {
            t.validate(i + 1)?;
        }
        let capacity = tiers.iter().map(|t| t.limit).sum();
        if capacity == 0 {
            return Err(TierError::NoCapacity);
        }
        Ok(Self { tiers, capacity })
    }

    /// The tiers, tier 1 first.
    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }

    /// Tier `number` (from 1).
    pub fn tier(&self, number: usize) -> Option<&Tier> {
        number.checked_sub(1).and_then(|i| self.tiers.get(i))
    }

    /// The sum of the tiers' limits: the most units one request can ever be granted.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl fmt::Display for TieredLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tiers [")?;
        for (i, t) in self.tiers.iter().enumerate() {
            if i > 0 {
                f.write_str(" | ")?;
            }
            write!(
                f,
                "{} per {}, active {}, cooldown {}",
                t.limit,
                crate::time::format_duration_us(t.window_us),
                crate::time::format_duration_us(t.active_us),
                crate::time::format_duration_us(t.cooldown_us)
            )?;
        }
        f.write_str("]")
    }
}

/// One tier's state: when it was last entered and its grants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierLog {
    entry: Option<u64>,
    grants: Vec<(u64, u64)>,
}

impl TierLog {
    /// A tier state from its parts; `grants` are `(time, units)` pairs sorted by time.
    pub fn new(entry: Option<u64>, grants: Vec<(u64, u64)>) -> Self {
        Self { entry, grants }
    }

    /// When the tier was last entered.
    pub fn entry(&self) -> Option<u64> {
        self.entry
    }

    /// The recorded `(time, units)` grants, oldest first.
    pub fn grants(&self) -> &[(u64, u64)] {
        &self.grants
    }

    /// Units granted at or after `start`.
    fn sum_since(&self, start: u64) -> u64 {
        let first = self.grants.partition_point(|&(t, _)| t < start);
        self.grants[first..].iter().map(|&(_, c)| c).sum()
    }
}

/// The state of one key: one [`TierLog`] per tier. A missing tier is an empty one, so a state
/// written under other tiers (a configuration change) is read safely.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierState {
    tiers: Vec<TierLog>,
}

impl TierState {
    /// A fresh state.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state from its tiers, tier 1 first.
    pub fn from_tiers(tiers: Vec<TierLog>) -> Self {
        Self { tiers }
    }

    /// The tiers' states, tier 1 first (possibly fewer than the limit has).
    pub fn tiers(&self) -> &[TierLog] {
        &self.tiers
    }

    /// Whether nothing is recorded (the same as a fresh state).
    pub fn is_empty(&self) -> bool {
        self.tiers
            .iter()
            .all(|t| t.entry.is_none() && t.grants.is_empty())
    }

    fn entry(&self, i: usize) -> Option<u64> {
        self.tiers.get(i).and_then(|t| t.entry)
    }

    /// Whether the state holds a time further ahead of `now` than the crate writes (any time
    /// beyond [`FOREIGN_SLACK_US`](crate::algo::gcra::FOREIGN_SLACK_US) ahead): not a state of
    /// ours, read as [`drained`] and replaced by it.
    pub(crate) fn is_foreign(&self, now: u64) -> bool {
        let far = now.saturating_add(crate::algo::gcra::FOREIGN_SLACK_US);
        self.tiers
            .iter()
            .any(|t| t.entry.is_some_and(|e| e > far) || t.grants.iter().any(|&(at, _)| at > far))
    }

    /// The grants that count for tier `i` (0-based) at `now` in `phase`.
    fn used(&self, limit: &TieredLimit, i: usize, now: u64, phase: Phase) -> u64 {
        let Some(log) = self.tiers.get(i) else {
            return 0;
        };
        let mut start = now.saturating_sub(limit.tiers[i].window_us);
        if i > 0 {
            match (phase, log.entry) {
                (Phase::Inactive, _) | (_, None) => return 0,
                (_, Some(e)) => start = start.max(e),
            }
        }
        log.sum_since(start)
    }
}

/// A tier's phase at an instant (`docs/burst-tiers.md`, "Derived at time `now`").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Never entered, or its cooldown is over.
    Inactive,
    /// Entered at most `active` ago: it can serve the client.
    Active,
    /// Its active period is over and its cooldown is not: it blocks any burst through it.
    Cooldown,
}

/// Tier `i` (0-based) of a key at `now`: its phase and the grants its window counts (the
/// spec's `phase_i` and `used_i`, as decisions derive them). For diagnostics and the
/// simulator's timeline; a tier the limit does not have is inactive and empty.
pub fn tier_at(limit: &TieredLimit, state: &TierState, i: usize, now: u64) -> (Phase, u64) {
    let Some(tier) = limit.tiers.get(i) else {
        return (Phase::Inactive, 0);
    };
    let phase = tier.phase(state.entry(i), now);
    (phase, state.used(limit, i, now, phase))
}

/// What a tiered decision granted, per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TierGrant {
    /// Units granted in total (for a refund: units taken back).
    pub granted: u64,
    /// Units per tier (tier 1 first); the first [`TieredLimit::tiers`]`.len()` are meaningful.
    pub units: [u64; MAX_TIERS],
    /// How many tiers the limit has.
    pub tier_count: u8,
    /// Whether the request burst into a tier above the one serving it before.
    pub burst: bool,
    /// The tier serving the client after the decision (from 1); on a denial, the tier that
    /// refused.
    pub tier: u8,
}

impl TierGrant {
    /// Units per tier, tier 1 first.
    pub fn units(&self) -> &[u64] {
        &self.units[..usize::from(self.tier_count).min(MAX_TIERS)]
    }
}

/// A tiered decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierDecision {
    /// Whether at least `min` units were granted (for a refund: whether anything was taken
    /// back).
    pub allowed: bool,
    /// Units granted (0 on a denial).
    pub granted: u64,
    /// Units per tier (tier 1 first).
    pub units: [u64; MAX_TIERS],
    /// Whether the request burst into a tier above the one serving it before.
    pub burst: bool,
    /// The tier serving the client after the decision (from 1); on a denial, the tier that
    /// refused.
    pub tier: usize,
    /// Units left in the serving tier's window.
    pub remaining: u64,
    /// Microseconds until a request of the same `min` would be granted (0 when allowed).
    pub retry_after_us: u64,
    /// Microseconds until the state equals a fresh one.
    pub reset_after_us: u64,
}

impl TierDecision {
    /// Units per tier, tier 1 first.
    pub fn units<'a>(&'a self, limit: &TieredLimit) -> &'a [u64] {
        &self.units[..limit.tiers.len()]
    }

    /// The per-tier part of the decision.
    pub fn grant(&self, limit: &TieredLimit) -> TierGrant {
        TierGrant {
            granted: self.granted,
            units: self.units,
            tier_count: limit.tiers.len() as u8,
            burst: self.burst,
            tier: self.tier as u8,
        }
    }
}

/// What a granted request changes: per tier, the units and whether the tier is entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    units: [u64; MAX_TIERS],
    /// Bit `i`: tier `i` (0-based) is entered.
    enter: u8,
    /// The highest tier (0-based) the plan visited.
    last: Option<u8>,
    allowed: bool,
}

/// The highest active tier at `now` (0-based), or tier 1 when none is.
fn current(limit: &TieredLimit, state: &TierState, now: u64) -> usize {
    (0..limit.tiers.len())
        .rev()
        .find(|&i| limit.tiers[i].phase(state.entry(i), now) == Phase::Active)
        .unwrap_or(0)
}

/// The spec's plan for `min..max` units at `now`, and the serving tier before it.
fn plan(limit: &TieredLimit, state: &TierState, now: u64, min: u64, max: u64) -> (Plan, usize) {
    let cur = current(limit, state, now);
    let mut want = max;
    let mut need = min;
    let mut p = Plan {
        units: [0; MAX_TIERS],
        enter: 0,
        last: None,
        allowed: false,
    };
    for i in cur..limit.tiers.len() {
        if want == 0 {
            break;
        }
        let tier = &limit.tiers[i];
        let phase = tier.phase(state.entry(i), now);
        if phase == Phase::Cooldown {
            break;
        }
        let free = tier.limit.saturating_sub(state.used(limit, i, now, phase));
        let d = free.min(want);
        p.units[i] = d;
        p.last = Some(i as u8);
        if phase == Phase::Inactive {
            p.enter |= 1 << i;
        }
        want -= d;
        need = need.saturating_sub(d);
    }
    p.allowed = need == 0;
    (p, cur)
}

fn check_request(limit: &TieredLimit, min: u64, max: u64) -> Result<(), TierRequestError> {
    if min > max {
        return Err(TierRequestError::MinAboveMax { min, max });
    }
    if min > limit.capacity {
        return Err(TierRequestError::MinAboveCapacity {
            min,
            capacity: limit.capacity,
        });
    }
    Ok(())
}

/// Decides a request for `min..=max` units at `now` without changing the state, returning the
/// decision (as if the grant were recorded) and the plan [`apply`] records.
pub fn decide(
    limit: &TieredLimit,
    state: &TierState,
    now: u64,
    min: u64,
    max: u64,
) -> Result<(TierDecision, Plan), TierRequestError> {
    check_request(limit, min, max)?;
    let (p, cur) = plan(limit, state, now, min, max);
    let n = limit.tiers.len();
    if !p.allowed {
        let phase = limit.tiers[cur].phase(state.entry(cur), now);
        let used = state.used(limit, cur, now, phase);
        let decision = TierDecision {
            allowed: false,
            granted: 0,
            units: [0; MAX_TIERS],
            burst: false,
            tier: cur + 1,
            remaining: limit.tiers[cur].limit.saturating_sub(used),
            retry_after_us: retry_after(limit, state, now, min),
            reset_after_us: fresh_at(limit, state, now, None).saturating_sub(now),
        };
        return Ok((decision, p));
    }
    // After the grant every tier the plan visited is active: the highest one serves.
    let last = p.last.map_or(cur, usize::from);
    let phase = limit.tiers[last].phase(state.entry(last), now);
    let used = state.used(limit, last, now, phase);
    let granted: u64 = p.units[..n].iter().sum();
    let decision = TierDecision {
        allowed: true,
        granted,
        units: p.units,
        burst: p.units[cur + 1..n].iter().any(|&d| d > 0),
        tier: last + 1,
        remaining: limit.tiers[last]
            .limit
            .saturating_sub(used.saturating_add(p.units[last])),
        retry_after_us: 0,
        reset_after_us: fresh_at(limit, state, now, Some(&p)).saturating_sub(now),
    };
    Ok((decision, p))
}

/// Records a granted plan made by [`decide`] at the same `now`, and drops what can no longer
/// count (grants outside their window, tiers whose cooldown is over), so the state stays
/// within the spec's memory bound (`|log_i| <= limit_i`).
pub fn apply(limit: &TieredLimit, state: &mut TierState, now: u64, plan: &Plan) {
    if !plan.allowed {
        return;
    }
    let n = limit.tiers.len();
    state.tiers.resize_with(n, TierLog::default);
    for (i, (tier, log)) in limit.tiers.iter().zip(&mut state.tiers).enumerate() {
        if plan.enter & (1 << i) != 0 {
            log.entry = Some(now);
            if i > 0 {
                log.grants.clear();
            }
        }
        let d = plan.units[i];
        if d > 0 {
            match log.grants.last_mut() {
                Some((t, c)) if *t == now => *c += d,
                _ => log.grants.push((now, d)),
            }
        }
        normalize(tier, i, log, now);
    }
}

/// Drops what can no longer count at `now` or later.
fn normalize(tier: &Tier, i: usize, log: &mut TierLog, now: u64) {
    if tier.phase(log.entry, now) == Phase::Inactive {
        log.entry = None;
        if i > 0 {
            log.grants.clear();
        }
    }
    let mut start = now.saturating_sub(tier.window_us);
    if i > 0
        && let Some(e) = log.entry
    {
        start = start.max(e);
    }
    let keep_from = log.grants.partition_point(|&(t, _)| t < start);
    if keep_from > 0 {
        log.grants.drain(..keep_from);
    }
}

/// Decides and, when granted, records a request for `min..=max` units at `now`.
pub fn spend(
    limit: &TieredLimit,
    state: &mut TierState,
    now: u64,
    min: u64,
    max: u64,
) -> Result<TierDecision, TierRequestError> {
    let (decision, p) = decide(limit, state, now, min, max)?;
    apply(limit, state, now, &p);
    Ok(decision)
}

/// The state of a key drained under `limit` at `now`: what a fresh key holds after a request
/// of the limit's whole capacity was granted (every tier entered and used up). A tier state the
/// crate could not have written is read as this, and replaced by it (`docs/gcra.md`, "Foreign
/// values"): a key never waits longer for it than the limit itself can make it wait, and never
/// gets a fresh burst.
pub fn drained(limit: &TieredLimit, now: u64) -> TierState {
    let mut state = TierState::new();
    let capacity = limit.capacity();
    if let Ok((d, plan)) = decide(limit, &state, now, capacity, capacity)
        && d.allowed
    {
        apply(limit, &mut state, now, &plan);
    }
    state
}

/// Takes back up to `units` of the most recent grants that still count, newest first (the
/// higher tier first among equal times). Entry times do not change: a tier entered stays
/// entered. `allowed` is whether anything was taken back; `granted` and `units` say how much.
pub fn refund(limit: &TieredLimit, state: &mut TierState, now: u64, units: u64) -> TierDecision {
    let n = limit.tiers.len();
    state.tiers.resize_with(n, TierLog::default);
    for (i, (tier, log)) in limit.tiers.iter().zip(&mut state.tiers).enumerate() {
        normalize(tier, i, log, now);
    }
    let mut taken = [0u64; MAX_TIERS];
    let mut left = units;
    while left > 0 {
        // The newest grant still recorded (normalized logs hold only grants that count).
        let newest = (0..n)
            .rev()
            .filter_map(|i| state.tiers[i].grants.last().map(|&(t, _)| (t, i)))
            .max_by_key(|&(t, i)| (t, i));
        let Some((_, i)) = newest else { break };
        let log = &mut state.tiers[i].grants;
        let Some(last) = log.last_mut() else { break };
        let d = last.1.min(left);
        last.1 -= d;
        if last.1 == 0 {
            log.pop();
        }
        taken[i] += d;
        left -= d;
    }
    let cur = current(limit, state, now);
    let phase = limit.tiers[cur].phase(state.entry(cur), now);
    let used = state.used(limit, cur, now, phase);
    let refunded = units - left;
    TierDecision {
        allowed: refunded > 0,
        granted: refunded,
        units: taken,
        burst: false,
        tier: cur + 1,
        remaining: limit.tiers[cur].limit.saturating_sub(used),
        retry_after_us: 0,
        reset_after_us: fresh_at(limit, state, now, None).saturating_sub(now),
    }
}

/// The first instant at which `state` (with `plan` recorded at `now`, if given) equals a fresh
/// state: after every tier's cooldown and tier 1's last grant's window. `now` or earlier when
/// it already does.
pub fn fresh_at(limit: &TieredLimit, state: &TierState, now: u64, plan: Option<&Plan>) -> u64 {
    let mut at = 0u64;
    for (i, tier) in limit.tiers.iter().enumerate() {
        let entered = plan.is_some_and(|p| p.enter & (1 << i) != 0);
        let entry = if entered { Some(now) } else { state.entry(i) };
        if let Some(e) = entry {
            let end = e
                .saturating_add(tier.active_us)
                .saturating_add(tier.cooldown_us)
                .saturating_add(1);
            at = at.max(end);
        }
    }
    let tier1 = &limit.tiers[0];
    let mut last = state
        .tiers
        .first()
        .and_then(|l| l.grants.last())
        .map(|&(t, _)| t);
    if plan.is_some_and(|p| p.units[0] > 0) {
        last = Some(now);
    }
    if let Some(t) = last {
        at = at.max(t.saturating_add(tier1.window_us).saturating_add(1));
    }
    at
}

/// Whether `state` equals a fresh one at `now` (it can be dropped).
pub fn is_fresh(limit: &TieredLimit, state: &TierState, now: u64) -> bool {
    fresh_at(limit, state, now, None) <= now
}

/// The exact time until a request of `need` units would be granted: the request is evaluated
/// at every instant a decision can change (a grant leaving its window, an active period or a
/// cooldown ending), in order. Allocation-free; each tier's window sum is kept incrementally.
fn retry_after(limit: &TieredLimit, state: &TierState, now: u64, need: u64) -> u64 {
    let n = limit.tiers.len();
    let empty = TierLog::default();
    let logs: [&TierLog; MAX_TIERS] = std::array::from_fn(|i| {
        if i < n {
            state.tiers.get(i).unwrap_or(&empty)
        } else {
            &empty
        }
    });
    let mut next_grant = [0usize; MAX_TIERS];
    let mut sums = WindowSums::of(&logs, n);
    let mut at = now;
    loop {
        let next = next_event(limit, &logs, at, &mut next_grant);
        if next == u64::MAX {
            // Nothing left to change: the state is fresh-equivalent and can grant `capacity`.
            return fresh_at(limit, state, now, None).saturating_sub(now);
        }
        at = next;
        if sums.grants_at(limit, &logs, at, need) {
            return at - now;
        }
    }
}

/// The next instant after `at` at which a tiered decision can change: a grant leaving its
/// window, an active period or a cooldown ending. `next_grant`: per tier, the first grant whose
/// expiry is still ahead (moved on as they pass).
fn next_event(
    limit: &TieredLimit,
    logs: &[&TierLog; MAX_TIERS],
    at: u64,
    next_grant: &mut [usize; MAX_TIERS],
) -> u64 {
    let mut next = u64::MAX;
    for (i, tier) in limit.tiers.iter().enumerate() {
        let log = logs[i];
        while let Some(&(t, _)) = log.grants.get(next_grant[i]) {
            let ev = t.saturating_add(tier.window_us).saturating_add(1);
            if ev > at {
                next = next.min(ev);
                break;
            }
            next_grant[i] += 1;
        }
        if let Some(e) = log.entry {
            let active_end = e.saturating_add(tier.active_us).saturating_add(1);
            let cool_end = active_end.saturating_add(tier.cooldown_us);
            for ev in [active_end, cool_end] {
                if ev > at {
                    next = next.min(ev);
                }
            }
        }
    }
    next
}

/// Each tier's units in its window, kept incrementally as the window moves on: the first grant
/// in it, the units of the grants before it (`dropped`) and of the whole log (`total`).
struct WindowSums {
    window_first: [usize; MAX_TIERS],
    dropped: [u64; MAX_TIERS],
    total: [u64; MAX_TIERS],
}

impl WindowSums {
    fn of(logs: &[&TierLog; MAX_TIERS], n: usize) -> Self {
        let mut total = [0u64; MAX_TIERS];
        for i in 0..n {
            total[i] = logs[i].grants.iter().map(|&(_, c)| c).sum();
        }
        Self {
            window_first: [0; MAX_TIERS],
            dropped: [0; MAX_TIERS],
            total,
        }
    }

    /// Whether a request of `need` units would be granted at `at`: from the tier serving then,
    /// up through the tiers it may burst into (none in cooldown).
    fn grants_at(
        &mut self,
        limit: &TieredLimit,
        logs: &[&TierLog; MAX_TIERS],
        at: u64,
        need: u64,
    ) -> bool {
        let n = limit.tiers.len();
        let cur = (0..n)
            .rev()
            .find(|&i| limit.tiers[i].phase(logs[i].entry, at) == Phase::Active)
            .unwrap_or(0);
        let mut need_left = need;
        for (i, tier) in limit.tiers.iter().enumerate().skip(cur) {
            let phase = tier.phase(logs[i].entry, at);
            if phase == Phase::Cooldown {
                break;
            }
            let used = if i > 0 && phase == Phase::Inactive {
                0
            } else {
                self.used(tier, logs[i], i, at)
            };
            need_left = need_left.saturating_sub(tier.limit.saturating_sub(used));
            if need_left == 0 {
                return true;
            }
        }
        false
    }

    /// Tier `i`'s units in its window at `at` (a higher tier's window starts no earlier than
    /// its entry).
    fn used(&mut self, tier: &Tier, log: &TierLog, i: usize, at: u64) -> u64 {
        let mut start = at.saturating_sub(tier.window_us);
        if i > 0
            && let Some(e) = log.entry
        {
            start = start.max(e);
        }
        while let Some(&(t, c)) = log.grants.get(self.window_first[i]) {
            if t >= start {
                break;
            }
            self.dropped[i] += c;
            self.window_first[i] += 1;
        }
        self.total[i] - self.dropped[i]
    }
}

#[cfg(test)]
mod tests;
