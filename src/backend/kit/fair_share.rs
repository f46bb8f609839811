//! Fair shares in the kit (`docs/fair-share.md`): a transaction decided on its limit's pool
//! (the budget, the active weights, the waiters) and its id's member state, both kept at the
//! limit's own key ([`state_key`]): one state per limit, which every id of it reads.

use super::gcra::{gcra_step, gcra_unword, gcra_word, gcra_word_bound, reading};
use super::{Read, Stored};
use crate::algo::fair_share::{self as rule, FairShare, MAX_MEMBERS, Member, Pool};
use crate::algo::gcra;
use crate::backend::{BackendError, BucketTx, Outcome};
use crate::key::{BucketKey, Id};
use crate::mode::Mode;

/// The ids one fair-share limit keeps, by id: a decision on memory copies the map's shard of
/// its id, not the map.
type Members = super::shared_map::SharedMap<Id, Member>;

/// A fair-share limit's whole state: its pool and the members not yet equal to fresh ones
/// (counted in the last two refresh periods, or over their share; some that became fresh may
/// be kept until the map holds twice [`MAX_MEMBERS`] and is swept). The pool's `tat` is a GCRA
/// word (the TAT and its writer's bound, as [`Stored::Tat`]).
#[derive(Debug, Clone, Default)]
pub struct FairPool {
    /// What the limit keeps for all its ids.
    pub pool: Pool,
    members: Members,
    /// The latest instant a member kept is fresh at (0: not known, computed when needed).
    members_fresh_at: u64,
}

impl PartialEq for FairPool {
    fn eq(&self, other: &Self) -> bool {
        self.pool == other.pool && self.members == other.members
    }
}

impl Eq for FairPool {}

impl FairPool {
    /// A limit's state from its pool and its members.
    pub fn new(pool: Pool, members: impl IntoIterator<Item = (Id, Member)>) -> Self {
        Self {
            pool,
            members: members.into_iter().collect(),
            members_fresh_at: 0,
        }
    }

    /// What the limit keeps for `id`, if anything.
    pub fn member(&self, id: &Id) -> Option<&Member> {
        self.members.get(id)
    }

    /// Every id the limit keeps, with what it keeps.
    pub fn members(&self) -> impl Iterator<Item = (&Id, &Member)> {
        self.members.iter()
    }

    /// How many ids it keeps.
    pub fn members_len(&self) -> usize {
        self.members.len()
    }

    /// The budget's TAT (0: none), without its writer's bound.
    pub fn budget_tat(&self) -> u64 {
        gcra_unword(self.pool.tat).0
    }

    /// The weights of the ids active now: those seen in this refresh period or the one before.
    pub fn active_weight(&self) -> u64 {
        self.pool.weights.0.saturating_add(self.pool.weights.1)
    }

    /// The latest instant a member kept is fresh at.
    fn members_fresh_at(&self, share: &FairShare) -> u64 {
        if self.members_fresh_at != 0 || self.members.is_empty() {
            return self.members_fresh_at;
        }
        self.members
            .values()
            .map(|m| m.fresh_at(share))
            .max()
            .unwrap_or(0)
    }
}

/// The key a transaction's state is kept at: its own, or for a shape that keeps one state
/// per limit (a fair share), the limit's ([`BucketKey::limit_wide`]).
///
/// A penalty's companion keeps its key's penalty state at the id under the limit's name with
/// `:pen` (a name no limit can have): beside the limit's bucket, never it.
pub fn state_key<'k>(tx: &BucketTx<'k>) -> std::borrow::Cow<'k, BucketKey> {
    if let Some(penalty) = tx.penalty {
        std::borrow::Cow::Owned(BucketKey::new(penalty.state, tx.key.id().clone()))
    } else if tx.quota.state_per_limit() {
        std::borrow::Cow::Owned(BucketKey::limit_wide(tx.key.name()))
    } else {
        std::borrow::Cow::Borrowed(tx.key)
    }
}

/// Who asks in a fair-share decision: the id's member (counted when it spends), whether it
/// is new, held to the new ids' part, counted, active, its share and where it stands.
struct Asker {
    member: Member,
    newcomer: bool,
    gated: bool,
    counted: bool,
    active: bool,
    s: rule::ShareOf,
    under: bool,
    below: bool,
}

/// The asker of `tx` in the rolled `pool` (`known`: its live member), counted in it when its
/// request spends.
fn asker(
    tx: &BucketTx<'_>,
    share: &FairShare,
    pool: &mut Pool,
    known: Option<Member>,
    now: u64,
) -> Asker {
    let budget = share.budget();
    let mut member = known.unwrap_or_default();
    // A new id past the new ids' part while an id seen before is refused: refused, and not
    // counted (a client minting ids takes no more, and pushes no one out of the count).
    let newcomer = member.newcomer(pool.epoch);
    let gated = newcomer && tx.mode != Mode::Charge && pool.gates_newcomers(share);
    let counted = known.is_some() || (!gated && pool.has_room());
    // Only a request that spends makes an id active (a check, an inspection, does not).
    let active = tx.mode.spends() && !gated;
    if counted && active {
        pool.count(share, &mut member);
    }
    let s = pool.share_of(share);
    member.tat = rule::member_owed(budget, s, member.tat, tx.min_cost, now);
    let under = counted && !gated && rule::under_share(budget, s, member.tat, tx.min_cost, now);
    let below = under && rule::below_share(budget, member.tat, now);
    Asker {
        member,
        newcomer,
        gated,
        counted,
        active,
        s,
        under,
        below,
    }
}

/// `tx` decided on the budget beyond `reserve`: its request decided as if the reserve were
/// part of it, the reserve then not written (`shift`: its microseconds on the budget).
fn on_budget(
    tx: &BucketTx<'_>,
    budget: &gcra::Limit,
    word: u64,
    reserve: u64,
    now: u64,
) -> Result<(Outcome, super::gcra::GcraStep, u64), BackendError> {
    let asked = BucketTx {
        cost: tx.cost.saturating_add(reserve),
        min_cost: tx.min_cost.saturating_add(reserve),
        ..*tx
    };
    let step = gcra_step(&asked, budget, word, now)?;
    let shift = budget.emission_interval_us().saturating_mul(reserve);
    let mut outcome = step.decision.outcome();
    if let Some(g) = &mut outcome.granted {
        *g = g.saturating_sub(reserve);
    }
    if outcome.allowed {
        outcome.reset_after_us = outcome.reset_after_us.saturating_sub(shift);
    } else {
        // What the budget holds beyond the reserve: what this id could have.
        outcome.remaining = outcome.remaining.saturating_sub(reserve);
    }
    Ok((outcome, step, shift))
}

/// What a refusal of a counting request leaves in `pool`: an id seen before refused presses
/// the new ids to their part; an id under its share refused below it has its units held
/// (once a period, however often it asks again), so its next request finds them however
/// long it waits (and it is not also a waiter); any other under its share waits for a
/// refresh period at least (a backlogged id under its share wants the next units too: held
/// for its `retry_after` alone, the reserve would lapse between its grants and a hog would
/// take every other unit).
fn refused(
    tx: &BucketTx<'_>,
    share: &FairShare,
    pool: &mut Pool,
    a: &mut Asker,
    retry_us: u64,
    now: u64,
) {
    if !a.active || !tx.mode.counts() {
        return;
    }
    if !a.newcomer {
        pool.pressed = pool.epoch;
    }
    if a.below {
        let more = pool.hold_refused(&mut a.member, tx.min_cost);
        if a.newcomer {
            pool.took_new(more, false);
        }
    } else if a.under {
        let held_us = retry_us.max(share.refresh_us());
        pool.wait(tx.key.id(), now.saturating_add(held_us), tx.min_cost);
    }
}

/// A fair-share transaction decided on `stored` (its limit's state) at `now`: its outcome,
/// what an allowed batch writes, and what is written whatever the batch decides (the id seen
/// active, a refused under-share id's wait; `None` for a transaction that does not spend, a
/// check, unless a foreign budget is replaced).
pub(crate) fn fair_share_decide(
    tx: &BucketTx<'_>,
    share: &FairShare,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<(Outcome, Option<Stored>, Option<Stored>), BackendError> {
    let held = match stored {
        Some(Read::FairShare(p)) => Some(p),
        _ => None,
    };
    let budget = share.budget();
    let id = tx.key.id();
    let mut pool = held
        .map_or_else(Pool::default, |h| h.pool.clone())
        .rolled(share, now);
    let live = |m: &&Member| m.fresh_at(share) > now;
    let known = held.and_then(|h| h.member(id)).filter(live).copied();
    let mut a = asker(tx, share, &mut pool, known, now);
    // An id spends only beyond the reserve (none when it asks below its share). A charge is
    // never refused.
    let reserve = if tx.mode == Mode::Charge {
        0
    } else {
        pool.reserve_for(share, (id, &a.member), tx.min_cost, (a.below, !a.under))
    };
    let (mut outcome, step, shift) = on_budget(tx, budget, pool.tat, reserve, now)?;
    let repaired = step.repair.is_some();
    if let Some(word) = step.repair {
        pool.tat = word;
    }
    if a.gated {
        outcome = gated_outcome(share, &outcome, &pool, now);
    }
    if !outcome.allowed {
        refused(tx, share, &mut pool, &mut a, outcome.retry_after_us, now);
    }
    let members = |member: Option<Member>| members_with(held, share, id, member, now);
    let kept = |m: Member| a.counted.then_some(m);
    let write = match step.write {
        Some(word) if outcome.allowed && a.active => {
            let (tat, _) = gcra_unword(word);
            let mut spent = pool.clone();
            spent.tat = gcra_word(tat.saturating_sub(shift), budget)?;
            if !a.under {
                // Over its share: it has had its share, and waits no more.
                spent.served(id);
            }
            let units = outcome.granted.unwrap_or(tx.cost);
            let mut m = Member {
                tat: rule::member_spent(budget, a.s, a.member.tat, units, now),
                ..a.member
            };
            spent.hold(&mut m, a.below, units, false);
            if a.newcomer {
                spent.took_new(units, false);
            }
            Some(fair(spent, members(kept(m))))
        }
        _ => None,
    };
    let seen = (a.active || repaired).then(|| fair(pool, members(kept(a.member))));
    Ok((outcome, write, seen))
}

/// A refund of `tx` on its limit's state: the budget given back (the GCRA refund) and the id's
/// own bucket moved back at its share.
pub(crate) fn fair_share_refund(
    tx: &BucketTx<'_>,
    share: &FairShare,
    stored: Option<Read<'_>>,
    now: u64,
) -> Result<(Outcome, Option<Stored>), BackendError> {
    let held = match stored {
        Some(Read::FairShare(p)) => Some(p),
        _ => None,
    };
    let budget = share.budget();
    let mut pool = held
        .map_or_else(Pool::default, |h| h.pool.clone())
        .rolled(share, now);
    let (tat, writer) = gcra_unword(pool.tat);
    let wide = reading(budget, writer);
    let limit = wide.as_ref().unwrap_or(budget);
    let out = gcra::refund(limit, (tat != 0).then_some(tat), now, tx.cost)?;
    if let Some(t) = out.new_tat {
        pool.tat = gcra_word_bound(t, limit.bound_us().max(writer))?;
    }
    let s = pool.share_of(share);
    let id = tx.key.id();
    let mut member = held.and_then(|h| h.member(id)).map(|m| Member {
        tat: rule::member_refunded(budget, s, m.tat, tx.cost, now),
        ..*m
    });
    if let Some(m) = &mut member {
        // Below its share once refunded (as when it was admitted, for a batch taken back):
        // the units held for it given back too.
        let below = rule::under_share(budget, s, m.tat, tx.min_cost, now)
            && rule::below_share(budget, m.tat, now);
        pool.hold(m, below, tx.cost, true);
        if m.newcomer(pool.epoch) {
            pool.took_new(tx.cost, true);
        }
    }
    let members = members_with(held, share, id, member, now);
    Ok((out.into(), Some(fair(pool, members))))
}

/// A new id's refusal past the new ids' part (`decided`: its request decided on the budget):
/// nothing remains for it until the next refresh period, when the part is whole again.
fn gated_outcome(share: &FairShare, decided: &Outcome, pool: &Pool, now: u64) -> Outcome {
    let next = pool.epoch.saturating_mul(share.refresh_us());
    Outcome {
        allowed: false,
        remaining: 0,
        retry_after_us: next.saturating_sub(now).max(1),
        reset_after_us: gcra_unword(pool.tat).0.saturating_sub(now),
        granted: decided.granted.map(|_| 0),
        ..*decided
    }
}

/// The members `held` keeps with `id`'s replaced by `member` (removed when `None` or fresh),
/// swept of those fresh at `now` once they are twice [`MAX_MEMBERS`], and the latest instant
/// one of them is fresh at.
fn members_with(
    held: Option<&FairPool>,
    share: &FairShare,
    id: &Id,
    member: Option<Member>,
    now: u64,
) -> (Members, u64) {
    let mut members = held.map(|h| h.members.clone()).unwrap_or_default();
    let mut fresh_at = held.map_or(0, |h| h.members_fresh_at(share));
    match member.filter(|m| m.fresh_at(share) > now) {
        Some(m) => {
            fresh_at = fresh_at.max(m.fresh_at(share));
            members.insert(id.clone(), m);
        }
        None => {
            members.remove(id);
        }
    }
    if members.len() > 2 * MAX_MEMBERS {
        members = members
            .iter()
            .filter(|(_, m)| m.fresh_at(share) > now)
            .map(|(k, m)| (k.clone(), *m))
            .collect();
        fresh_at = members
            .values()
            .map(|m| m.fresh_at(share))
            .max()
            .unwrap_or(0);
    }
    (members, fresh_at)
}

fn fair(pool: Pool, (members, members_fresh_at): (Members, u64)) -> Stored {
    Stored::FairShare(Box::new(FairPool {
        pool,
        members,
        members_fresh_at,
    }))
}

/// The first instant at which a fair-share limit's state equals a fresh one.
pub(crate) fn fair_share_fresh_at(share: &FairShare, state: &FairPool) -> u64 {
    let pool = Pool {
        tat: gcra_unword(state.pool.tat).0,
        ..state.pool.clone()
    };
    pool.fresh_at(share).max(state.members_fresh_at(share))
}

/// A fair-share limit's written form (a snapshot line's `fair_share`): its pool and members.
pub(super) mod line {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::FairPool;
    use crate::key::Id;

    /// A fair-share limit's state as a snapshot line writes it (its `id` is empty: the limit's
    /// own key).
    #[derive(Serialize, Deserialize)]
    struct FairLine {
        /// The budget's stored word (its TAT and its writer's bound).
        word: u64,
        epoch: u64,
        weights: (u64, u64),
        mins: (u64, u64),
        #[serde(default)]
        ids: (u64, u64),
        /// `(id, until_us, cost)`.
        waiting: Vec<(String, u64, u64)>,
        /// `(id, tat_us, epoch, weight, min)`.
        members: Vec<(String, u64, u64, u64, u64)>,
        /// The units admitted below their share by period (`Pool::held`; none before it was kept).
        #[serde(default)]
        held: [u64; 3],
        /// `(id, units by period, the latest's period)` of the members admitted below their share
        /// (`Member::below`).
        #[serde(default)]
        below: Vec<(String, [u64; 3], u64)>,
        /// The last period an id seen before was refused in, and the units new ids took in
        /// `epoch` (`Pool::pressed`, `Pool::fresh`; none before they were kept).
        #[serde(default)]
        pressed: u64,
        #[serde(default)]
        fresh: u64,
        /// `(id, period)` of the members first counted since they were last forgotten
        /// (`Member::since`).
        #[serde(default)]
        since: Vec<(String, u64)>,
    }

    impl FairLine {
        fn of(p: &FairPool) -> FairLine {
            let pool = &p.pool;
            FairLine {
                word: pool.tat,
                epoch: pool.epoch,
                weights: pool.weights,
                mins: pool.mins,
                ids: pool.ids,
                waiting: pool
                    .waiting
                    .iter()
                    .map(|w| (w.id.to_string(), w.until_us, w.cost))
                    .collect(),
                members: p
                    .members()
                    .map(|(id, m)| (id.to_string(), m.tat, m.epoch, m.weight, m.min))
                    .collect(),
                held: pool.held,
                below: p
                    .members()
                    .filter(|(_, m)| m.below != [0; 3])
                    .map(|(id, m)| (id.to_string(), m.below, m.below_at))
                    .collect(),
                pressed: pool.pressed,
                fresh: pool.fresh,
                since: p
                    .members()
                    .filter(|(_, m)| m.since != 0)
                    .map(|(id, m)| (id.to_string(), m.since))
                    .collect(),
            }
        }

        fn into_pool(self) -> Result<FairPool, String> {
            use crate::algo::fair_share::{MAX_MEMBERS, MAX_WAITERS, Member, Pool, Waiter};
            if self.waiting.len() > MAX_WAITERS || self.members.len() > 2 * MAX_MEMBERS {
                return Err("fair_share: more waiters or members than a limit keeps".into());
            }
            let id = |text: &str| Id::new(text).map_err(|e| format!("fair_share: {e}"));
            let mut waiting = Vec::with_capacity(self.waiting.len());
            for (w, until_us, cost) in &self.waiting {
                waiting.push(Waiter {
                    id: id(w)?,
                    until_us: *until_us,
                    cost: *cost,
                });
            }
            let mut members = std::collections::HashMap::with_capacity(self.members.len());
            for (m, tat, epoch, weight, min) in &self.members {
                let member = Member {
                    tat: *tat,
                    epoch: *epoch,
                    weight: *weight,
                    min: *min,
                    ..Member::default()
                };
                members.insert(id(m)?, member);
            }
            for (m, below, below_at) in &self.below {
                if let Some(member) = members.get_mut(&id(m)?) {
                    (member.below, member.below_at) = (*below, *below_at);
                }
            }
            for (m, since) in &self.since {
                if let Some(member) = members.get_mut(&id(m)?) {
                    member.since = *since;
                }
            }
            let pool = Pool {
                tat: self.word,
                epoch: self.epoch,
                weights: self.weights,
                mins: self.mins,
                ids: self.ids,
                waiting,
                held: self.held,
                pressed: self.pressed,
                fresh: self.fresh,
            };
            Ok(FairPool::new(pool, members))
        }
    }

    pub(crate) fn serialize<S: Serializer>(p: &FairPool, s: S) -> Result<S::Ok, S::Error> {
        FairLine::of(p).serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Box<FairPool>, D::Error> {
        let line = FairLine::deserialize(d)?;
        line.into_pool().map(Box::new).map_err(D::Error::custom)
    }
}
