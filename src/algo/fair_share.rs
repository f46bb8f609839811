//! Fair shares of one budget (`docs/fair-share.md`): one GCRA budget for a whole limit, split
//! by weight among the ids active now, idle share lent to whoever wants it.
//!
//! The budget is an ordinary GCRA bucket (`gcra.rs` decides it); what this file adds is who
//! may spend from it. An id's **share** is its weight over the weights of the ids active in
//! the current refresh period (the requesting id included), or its guaranteed
//! minimum over the budget's count when that is larger (the minimums scaled down together when
//! the active ids' minimums exceed the count). An id whose own bucket at its share of the rate
//! and burst holds the request is **under its share**; one whose own bucket was at least half
//! full too asks **below** it, and the units it asks so are held for it ([`Pool::hold`]). An
//! id below its share spends from the budget; any other spends only beyond the **reserve**
//! (the units held for the other ids below their share, and, over its share, the units that
//! refused under-share ids are waiting for), at most the burst less its request. So an id
//! asking below its share is served whatever the others ask, a hog never takes what a refused
//! under-share id needs, and no rate is idle: what is held back is a level of the budget.
//!
//! Everything here is integers in, integers out: the state of a limit ([`Pool`]: the budget's
//! TAT, the active weights by refresh period, the waiters) and of one id in it ([`Member`]).
//! Counting the active weights by period, not by each id's last request, keeps a decision
//! O(1) in the ids (no scan of who went idle): an id counts in the shares from its first
//! request in a period to the end of that period, and is kept to the end of the next. The kit (`backend/kit/fair_share.rs`) decides a
//! transaction with these functions and the GCRA rule; the Redis script mirrors them.

use std::fmt;
use std::time::Duration;

use crate::algo::gcra::Limit;
use crate::key::Id;
use crate::time::duration_us;

/// The refresh period a fair share is written without: the active ids are those seen in the
/// current second.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(1);

/// The part of the budget's rate, in percent, that the ids first seen in the current refresh
/// period may take together while a known id is refused ([`FairShare::with_new_ids`]).
pub const DEFAULT_NEW_IDS_PERCENT: u64 = 10;

/// The largest weight an id may have.
pub const MAX_WEIGHT: u64 = 10_000;

/// The largest count per period of a shared budget (2^28): with [`MAX_WEIGHT`] and
/// [`MAX_MEMBERS`], every product a decision compares stays below 2^52, exact in the Redis
/// script's numbers.
pub const MAX_SHARED_COUNT: u64 = 1 << 28;

/// The furthest a member's own bucket runs (2^52 µs): beyond, it saturates, on every store.
const MAX_MEMBER_TAT: u64 = 1 << 52;

/// The most ids one fair-share limit counts at once (those seen in the current or the previous
/// refresh period): an id beyond it is decided as over its share and not counted, so the
/// memory and the work of one limit stay bounded whatever the number of ids.
pub const MAX_MEMBERS: usize = 1024;

/// The most refused under-share ids one limit holds the reserve for at once: a waiter beyond
/// it is refused as any other, without a reserve.
pub const MAX_WAITERS: usize = 64;

/// The shortest and the longest refresh period.
const REFRESH_RANGE_US: std::ops::RangeInclusive<u64> = 1_000..=3_600_000_000;

/// Why a fair share was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FairShareError {
    /// A weight of 0 or above [`MAX_WEIGHT`].
    #[error("weight {0} is not between 1 and {MAX_WEIGHT}")]
    Weight(u64),
    /// A guaranteed minimum above the budget's count.
    #[error("the guaranteed minimum {min} is above the budget's count {count}")]
    MinAboveCount {
        /// The minimum.
        min: u64,
        /// The budget's count per period.
        count: u64,
    },
    /// A refresh period under a millisecond or over an hour.
    #[error("the refresh period must be between 1ms and 1h")]
    Refresh,
    /// A budget with prefetched tokens (a fair share is decided in the store, every time).
    #[error("a fair-share budget cannot prefetch tokens")]
    Prefetch,
    /// A part for new ids above 100%.
    #[error("new_ids is a percentage from 0 to 100, not {0}")]
    NewIds(u64),
    /// A budget's count above [`MAX_SHARED_COUNT`].
    #[error("a fair-share budget counts at most {MAX_SHARED_COUNT} a period, not {0}")]
    CountTooLarge(u64),
}

/// One GCRA budget shared by the ids of a limit: each id's weight (1 unless an override says
/// otherwise), its guaranteed minimum (units per budget period, 0: none) and how long an id
/// counts as active (`refresh`).
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{FairShare, Limit};
///
/// // 1,000 a second for the whole API, split among the tenants active now.
/// let budget = Limit::new(1000, 1000, Duration::from_secs(1)).unwrap();
/// let share = FairShare::new(budget).unwrap().with_min(50).unwrap();
/// assert_eq!((share.weight(), share.min()), (1, 50));
/// // A tenant that pays for three shares: an override of the same budget.
/// let gold = share.clone().with_weight(3).unwrap();
/// assert!(gold.same_budget(&share));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FairShare {
    budget: Limit,
    weight: u64,
    min: u64,
    refresh_us: u64,
    new_ids_pct: u64,
}

impl FairShare {
    /// `budget` shared with weight 1, no minimum, refreshed every second.
    pub fn new(budget: Limit) -> Result<Self, FairShareError> {
        if budget.prefetch() > 0 {
            return Err(FairShareError::Prefetch);
        }
        if budget.count() > MAX_SHARED_COUNT {
            return Err(FairShareError::CountTooLarge(budget.count()));
        }
        Ok(Self {
            budget,
            weight: 1,
            min: 0,
            refresh_us: duration_us(DEFAULT_REFRESH),
            new_ids_pct: DEFAULT_NEW_IDS_PERCENT,
        })
    }

    /// The same budget with the id's weight `weight` (1 to [`MAX_WEIGHT`]).
    pub fn with_weight(mut self, weight: u64) -> Result<Self, FairShareError> {
        if weight == 0 || weight > MAX_WEIGHT {
            return Err(FairShareError::Weight(weight));
        }
        self.weight = weight;
        Ok(self)
    }

    /// The same budget with a guaranteed minimum of `min` units per budget period for the id
    /// (at most the budget's count).
    pub fn with_min(mut self, min: u64) -> Result<Self, FairShareError> {
        if min > self.budget.count() {
            return Err(FairShareError::MinAboveCount {
                min,
                count: self.budget.count(),
            });
        }
        self.min = min;
        Ok(self)
    }

    /// The same budget with the active ids counted over `refresh` (1 ms to 1 hour).
    pub fn with_refresh(self, refresh: Duration) -> Result<Self, FairShareError> {
        self.with_refresh_us(duration_us(refresh))
    }

    pub(crate) fn with_refresh_us(mut self, refresh_us: u64) -> Result<Self, FairShareError> {
        if !REFRESH_RANGE_US.contains(&refresh_us) {
            return Err(FairShareError::Refresh);
        }
        self.refresh_us = refresh_us;
        Ok(self)
    }

    /// The same budget with the ids first seen in the current refresh period taking together
    /// at most `percent` of the budget's rate (units admitted or held for them in the period)
    /// while an id seen before is refused: a client minting ids takes no more (0 to 100,
    /// [`DEFAULT_NEW_IDS_PERCENT`] by default; 100 leaves new ids the whole rate).
    pub fn with_new_ids(mut self, percent: u64) -> Result<Self, FairShareError> {
        if percent > 100 {
            return Err(FairShareError::NewIds(percent));
        }
        self.new_ids_pct = percent;
        Ok(self)
    }

    /// The part of the budget's rate, in percent, new ids may take together while an id seen
    /// before is refused.
    pub fn new_ids(&self) -> u64 {
        self.new_ids_pct
    }

    /// The units new ids may take together in a refresh period while an id seen before is
    /// refused: `new_ids` percent of what the budget refills in a refresh period, rounded up.
    pub(crate) fn new_ids_cap(&self) -> u64 {
        let refill = u128::from(self.budget.count()) * u128::from(self.refresh_us);
        let den = u128::from(self.budget.period_us().max(1)) * 100;
        let cap = (refill * u128::from(self.new_ids_pct)).div_ceil(den);
        u64::try_from(cap).unwrap_or(u64::MAX)
    }

    /// The budget the ids share.
    pub fn budget(&self) -> &Limit {
        &self.budget
    }

    /// The id's weight.
    pub fn weight(&self) -> u64 {
        self.weight
    }

    /// The id's guaranteed minimum, units per budget period (0: none).
    pub fn min(&self) -> u64 {
        self.min
    }

    /// How long an id counts as active.
    pub fn refresh(&self) -> Duration {
        Duration::from_micros(self.refresh_us)
    }

    pub(crate) fn refresh_us(&self) -> u64 {
        self.refresh_us
    }

    /// Whether `other` shares the same budget (an id's override may change its weight and
    /// minimum, never the budget all ids share, its refresh period or its part for new ids).
    pub fn same_budget(&self, other: &FairShare) -> bool {
        self.budget == other.budget
            && self.refresh_us == other.refresh_us
            && self.new_ids_pct == other.new_ids_pct
    }

    /// The refresh period holding `now`, numbered from 1 (0: none).
    pub(crate) fn epoch(&self, now: u64) -> u64 {
        now / self.refresh_us + 1
    }
}

impl fmt::Display for FairShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} shared fairly (weight {}", self.budget, self.weight)?;
        if self.min > 0 {
            write!(f, ", minimum {}", self.min)?;
        }
        f.write_str(")")
    }
}

/// A refused under-share id the reserve is kept for, until `until_us`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// The id.
    pub id: Id,
    /// The end of its refusal's `retry_after` (inclusive).
    pub until_us: u64,
    /// The units it asked for.
    pub cost: u64,
}

/// What a fair-share limit keeps for all its ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pool {
    /// The budget's GCRA bucket (0: none): its TAT, or, as the kit keeps it, the stored word
    /// (the TAT and its writer's bound, as [`kit::Stored::Tat`](crate::kit::Stored::Tat)).
    pub tat: u64,
    /// The refresh period the weights below were counted in (0: none).
    pub epoch: u64,
    /// The weights of the ids seen in `epoch`, and of those seen in the period before only.
    pub weights: (u64, u64),
    /// Their guaranteed minimums, likewise.
    pub mins: (u64, u64),
    /// How many ids, likewise (at most [`MAX_MEMBERS`] are counted).
    pub ids: (u64, u64),
    /// The refused under-share ids, at most [`MAX_WAITERS`].
    pub waiting: Vec<Waiter>,
    /// The units admitted to ids asking below their share ([`Pool::hold`]) in `epoch`, in
    /// the period before and in the one before that: the most of them is held for those ids.
    pub held: [u64; 3],
    /// The last refresh period an id seen before was refused in (0: none): new ids are held
    /// to their part ([`FairShare::with_new_ids`]) until the period after it ends.
    pub pressed: u64,
    /// The units admitted to, or held for, ids first seen in `epoch` ([`Member::newcomer`]).
    pub fresh: u64,
}

/// What a fair-share limit keeps for one id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Member {
    /// The TAT of its own bucket at its share (0: none).
    pub tat: u64,
    /// The refresh period it was last counted in (0: never).
    pub epoch: u64,
    /// The weight and minimum it was counted with then.
    pub weight: u64,
    /// Its minimum then.
    pub min: u64,
    /// The units it was admitted below its share ([`Pool::hold`]) in `below_at`, in the
    /// period before and in the one before that.
    pub below: [u64; 3],
    /// The refresh period of `below[0]` (0: none).
    pub below_at: u64,
    /// The refresh period it was first counted in since it was last forgotten (0: before
    /// this was kept, an id seen before).
    pub since: u64,
}

/// `units` by period rolled from period `at` to period `e` (a period ended moves one place,
/// three ended are forgotten; a clock behind keeps them).
fn rolled_units(units: [u64; 3], at: u64, e: u64) -> [u64; 3] {
    match e.saturating_sub(at) {
        0 => units,
        1 => [0, units[0], units[1]],
        2 => [0, 0, units[0]],
        _ => [0; 3],
    }
}

/// The first instant from which `units` by period, the latest of them in period `at`, are all
/// forgotten (0: none to forget).
fn units_fresh_at(units: &[u64; 3], at: u64, refresh_us: u64) -> u64 {
    (units.iter().enumerate())
        .filter(|(_, u)| **u > 0)
        .map(|(age, _)| (at + 2).saturating_sub(age as u64))
        .max()
        .map_or(0, |e| e.saturating_mul(refresh_us))
}

/// An id's share of the budget, as a fraction `num / den`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareOf {
    /// The numerator (a weight, or a minimum).
    pub num: u64,
    /// The denominator (the active weights, or the larger of the count and the minimums).
    pub den: u64,
}

impl Pool {
    /// The pool at `now`: its counts moved on to the refresh period holding `now` (a period
    /// ended moves to "previous", two ended are forgotten). A clock behind the stored period
    /// counts in the stored one.
    pub fn rolled(self, share: &FairShare, now: u64) -> Pool {
        let e = share.epoch(now);
        let mut p = self;
        if e > p.epoch {
            (p.weights.1, p.mins.1, p.ids.1) = if e == p.epoch + 1 {
                (p.weights.0, p.mins.0, p.ids.0)
            } else {
                (0, 0, 0)
            };
            (p.weights.0, p.mins.0, p.ids.0) = (0, 0, 0);
            p.held = rolled_units(p.held, p.epoch, e);
            p.fresh = 0;
            p.epoch = e;
        }
        p.waiting.retain(|w| w.until_us >= now);
        p
    }

    /// Counts `member` (an id requesting now) in the rolled pool with `share`'s weight and
    /// minimum, once per period: moved from the previous period's count, or its weight changed
    /// within this one.
    pub fn count(&mut self, share: &FairShare, member: &mut Member) {
        let e = self.epoch;
        if member.epoch == e {
            self.weights.0 = self.weights.0.saturating_sub(member.weight);
            self.mins.0 = self.mins.0.saturating_sub(member.min);
        } else {
            if member.epoch + 1 == e {
                self.weights.1 = self.weights.1.saturating_sub(member.weight);
                self.mins.1 = self.mins.1.saturating_sub(member.min);
                self.ids.1 = self.ids.1.saturating_sub(1);
            }
            self.ids.0 = self.ids.0.saturating_add(1);
        }
        self.weights.0 = self.weights.0.saturating_add(share.weight);
        self.mins.0 = self.mins.0.saturating_add(share.min);
        *member = Member {
            epoch: e,
            weight: share.weight,
            min: share.min,
            since: if member.epoch == 0 { e } else { member.since },
            ..*member
        };
    }

    /// The share of an id counted in this pool with `share`'s weight and minimum: its weight
    /// over the weights of the ids seen in this period, or its minimum over the larger of the
    /// count and their minimums, whichever is larger. The ids seen in the period before only
    /// are in no share: counted, an id that left kept its share a period more, lent to
    /// whoever asked first (weights 3 and 1 split 80/20 over the second after three ids left).
    pub fn share_of(&self, share: &FairShare) -> ShareOf {
        let weights = self.weights.0.max(share.weight);
        let by_weight = ShareOf {
            num: share.weight,
            den: weights,
        };
        if share.min == 0 {
            return by_weight;
        }
        let mins = self.mins.0;
        let by_min = ShareOf {
            num: share.min,
            den: share.budget.count().max(mins),
        };
        if u128::from(by_min.num) * u128::from(by_weight.den)
            > u128::from(by_weight.num) * u128::from(by_min.den)
        {
            by_min
        } else {
            by_weight
        }
    }

    /// `member` was refused `units` below its share (nothing was held for it yet): at least
    /// that many are held for it in this period, however often it asks again refused. The
    /// units newly held.
    pub fn hold_refused(&mut self, member: &mut Member, units: u64) -> u64 {
        member.below = rolled_units(member.below, member.below_at, self.epoch);
        member.below_at = self.epoch;
        let more = units.saturating_sub(member.below[0]);
        member.below[0] += more;
        self.held[0] = self.held[0].saturating_add(more);
        more
    }

    /// Whether a new id ([`Member::newcomer`]) is refused without being counted: an id seen
    /// before was refused in this refresh period or the one before, and the new ids have
    /// taken their part of this one ([`FairShare::with_new_ids`]).
    pub fn gates_newcomers(&self, share: &FairShare) -> bool {
        self.pressed != 0
            && self.pressed.saturating_add(1) >= self.epoch
            && self.fresh >= share.new_ids_cap()
    }

    /// `units` admitted to, or held for, a new id in this period (`back`: given back).
    pub fn took_new(&mut self, units: u64, back: bool) {
        self.fresh = if back {
            self.fresh.saturating_sub(units)
        } else {
            self.fresh.saturating_add(units)
        };
    }

    /// Whether an id not counted yet may be: fewer than [`MAX_MEMBERS`] ids are.
    pub fn has_room(&self) -> bool {
        self.ids.0.saturating_add(self.ids.1) < MAX_MEMBERS as u64
    }

    /// Counts `units` admitted to `member` asking below its share (`below`) in this period,
    /// or gives them back (`back`: a refund of them, the id below its share again once
    /// refunded).
    pub fn hold(&mut self, member: &mut Member, below: bool, units: u64, back: bool) {
        member.below = rolled_units(member.below, member.below_at, self.epoch);
        member.below_at = self.epoch;
        if !below {
            return;
        }
        let units = if back {
            units.min(member.below[0])
        } else {
            units
        };
        if back {
            member.below[0] -= units;
            self.held[0] = self.held[0].saturating_sub(units);
        } else {
            member.below[0] = member.below[0].saturating_add(units);
            self.held[0] = self.held[0].saturating_add(units);
        }
    }

    /// The reserve `id` (`member`) must leave in the budget for a request of `cost` units:
    /// none when it asks below its share (`below`); else the units held for the other ids
    /// that do (the most admitted to them in one of the last three refresh periods), and,
    /// over its share (`over`), the units the other waiters asked for too; at most the burst
    /// less `cost`, so a full budget admits any request (with more held back, ids over their
    /// share were never admitted while the waiters' units sat idle).
    pub fn reserve_for(
        &self,
        share: &FairShare,
        (id, member): (&Id, &Member),
        cost: u64,
        (below, over): (bool, bool),
    ) -> u64 {
        if below {
            return 0;
        }
        let burst = share.budget.burst();
        let own = rolled_units(member.below, member.below_at, self.epoch);
        let held = (self.held.iter().zip(own))
            .map(|(all, own)| all.saturating_sub(own))
            .max()
            .unwrap_or(0);
        let waiting = if over {
            self.waiting
                .iter()
                .filter(|w| w.id != *id)
                .fold(0u64, |r, w| r.saturating_add(w.cost))
        } else {
            0
        };
        held.saturating_add(waiting).min(burst.saturating_sub(cost))
    }

    /// Records `id` as refused under its share until `until_us`, for `cost` units (its entry
    /// replaced); none past [`MAX_WAITERS`].
    pub fn wait(&mut self, id: &Id, until_us: u64, cost: u64) {
        self.waiting.retain(|w| w.id != *id);
        if self.waiting.len() < MAX_WAITERS {
            self.waiting.push(Waiter {
                id: id.clone(),
                until_us,
                cost,
            });
        }
    }

    /// `id` was admitted: it waits no more.
    pub fn served(&mut self, id: &Id) {
        self.waiting.retain(|w| w.id != *id);
    }

    /// The first instant from which the pool equals a fresh one (the store may forget it).
    pub fn fresh_at(&self, share: &FairShare) -> u64 {
        let counted = self
            .epoch
            .saturating_add(1)
            .saturating_mul(share.refresh_us);
        let waiting = self
            .waiting
            .iter()
            .map(|w| w.until_us + 1)
            .max()
            .unwrap_or(0);
        let held = units_fresh_at(&self.held, self.epoch, share.refresh_us);
        self.tat.max(counted).max(waiting).max(held)
    }
}

impl Member {
    /// Whether the id is new in refresh period `e`: not kept before it, or first counted in
    /// it.
    pub fn newcomer(&self, e: u64) -> bool {
        self.epoch == 0 || self.since == e
    }

    /// The first instant from which the member equals a fresh one (counted no more, its
    /// bucket full).
    pub fn fresh_at(&self, share: &FairShare) -> u64 {
        let counted = self
            .epoch
            .saturating_add(1)
            .saturating_mul(share.refresh_us);
        let below = units_fresh_at(&self.below, self.below_at, share.refresh_us);
        self.tat.max(counted).max(below)
    }
}

/// The emission interval (microseconds a unit) of an id's own bucket at share `s` of the
/// budget `limit`: rounded up, at most 2^52.
pub fn share_interval_us(limit: &Limit, s: ShareOf) -> u64 {
    let ei = u128::from(limit.emission_interval_us()) * u128::from(s.den);
    let ei = ei.div_ceil(u128::from(s.num.max(1)));
    u64::try_from(ei.min(u128::from(MAX_MEMBER_TAT))).unwrap_or(MAX_MEMBER_TAT)
}

/// Whether an id whose own bucket's TAT is `member_tat` is under share `s` for `cost` units at
/// `now`: its own bucket, at the share of the budget's rate and burst (the share's burst
/// offset is the budget's: `s * burst` units of `interval / s`), holds them (a unit at least,
/// however small the share: then only a bucket that is full).
pub fn under_share(limit: &Limit, s: ShareOf, member_tat: u64, cost: u64, now: u64) -> bool {
    let need = u128::from(share_interval_us(limit, s)) * u128::from(cost);
    let ahead = member_tat.saturating_sub(now);
    let bo = u128::from(limit.burst_offset_us());
    if need >= bo {
        return ahead == 0;
    }
    u128::from(ahead) + need <= bo
}

/// An id's own bucket as it asks for `cost` units at share `s`: its TAT at most the budget's
/// burst offset ahead of `now`, or the request's own length at the share when that is longer
/// (what an admission under its share leaves). What it was lent over its share is not owed:
/// with the debt kept, two backlogged ids swung between the whole budget and nothing for
/// seconds after a third id left.
pub fn member_owed(limit: &Limit, s: ShareOf, member_tat: u64, cost: u64, now: u64) -> u64 {
    let need = u128::from(share_interval_us(limit, s)) * u128::from(cost);
    let most = need.max(u128::from(limit.burst_offset_us()));
    if u128::from(member_tat.saturating_sub(now)) > most {
        // Below the TAT, itself at most 2^52.
        now + u64::try_from(most).unwrap_or(0)
    } else {
        member_tat
    }
}

/// Whether an id whose own bucket's TAT is `member_tat` asks below its share at `now`, for a
/// request under its share: its own bucket at least half full before the request (an id
/// asking at its share or faster drains it).
pub fn below_share(limit: &Limit, member_tat: u64, now: u64) -> bool {
    u128::from(member_tat.saturating_sub(now)) * 2 <= u128::from(limit.burst_offset_us())
}

/// An id's own bucket after it was granted `units` at share `s` at `now`: its TAT moved on by
/// the units at the share's rate, at most 2^52.
pub fn member_spent(limit: &Limit, s: ShareOf, member_tat: u64, units: u64, now: u64) -> u64 {
    let add = u128::from(share_interval_us(limit, s)) * u128::from(units);
    let tat = u128::from(member_tat.max(now)) + add;
    u64::try_from(tat.min(u128::from(MAX_MEMBER_TAT))).unwrap_or(MAX_MEMBER_TAT)
}

/// An id's own bucket after `units` were given back: its TAT moved back (0 once it is not
/// ahead of `now`).
pub fn member_refunded(limit: &Limit, s: ShareOf, member_tat: u64, units: u64, now: u64) -> u64 {
    let back = share_interval_us(limit, s).saturating_mul(units);
    let tat = member_tat.saturating_sub(back);
    if tat <= now { 0 } else { tat }
}

#[cfg(test)]
mod tests;
