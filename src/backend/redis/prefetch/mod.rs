//! Prefetched tokens (`docs/gcra.md`, "Prefetched tokens"): an instance takes up to
//! [`Limit::prefetch`] tokens of a hot key from the store in one call and answers the key's
//! next requests from them, locally, for up to [`Limit::prefetch_ttl`]; what it did not use
//! goes back (a refund) when they expire or when it shuts down.
//!
//! Tokens are spent in the store before they are used, so all instances together never admit
//! more than the bucket allows from a full bucket; what prefetching trades is timing (a pool
//! of at most `prefetch` tokens is used for up to one TTL after its refill) and capacity one
//! instance holds while another is denied. The rules, each in one place below:
//!
//! - **Who prefetches**: a check-and-spend of one cost above 0 on a GCRA limit with
//!   `prefetch > 0` ([`eligible`]). Ranges, checks, spend-only, shadow and charges go to the
//!   store as they are; a charge (a settle's overrun) also drops the key's local tokens, which
//!   go back to the store.
//! - **How many** ([`Pool::ask`]): the demand this instance saw on the key in the last TTL,
//!   at most `prefetch`, on top of what the request needs. A key seen for the first time in a
//!   TTL is sent as it is (a cold key costs what it always did: one call, nothing to give
//!   back).
//! - **At saturation**: a refill asks for a range, at least the request's need plus half the
//!   target (the smallest useful refill; no more than the bucket refills in one TTL), so a
//!   nearly empty bucket is not taken one token per call. While that least refill is not
//!   expected to fit (the store's last reported state, plus the others' part of what the
//!   bucket refills meanwhile: the part of the key's recent spends that were not this
//!   instance's, as the store's answers show them; `Pool::expected_tat`), the key's requests
//!   are denied here, without a call, with the wait before it is expected to fit (never
//!   earlier than the store said: at least the request's own cost must fit, and the state is
//!   the store's).
//!   Without the others' part, every instance called when the store's last word alone said
//!   its refill fitted, when the others had usually taken those tokens: most calls were
//!   denied, more with every instance added.
//! - **One refill per key at a time**: a request that finds the pool empty while a refill is
//!   under way waits for it, then decides again.
//! - **All or nothing**: tokens taken for a request whose batch the store denies go back to
//!   the pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dashmap::DashMap;
use tokio::sync::Notify;

use super::{OwnedTx, RedisBackend};
use crate::algo::gcra::{self, Limit};
use crate::backend::{BackendError, BucketTx, Mode, Outcome, Outcomes, Spend, batch_allowed, kit};
use crate::key::BucketKey;
use crate::quota::Quota;

mod road;

/// Keys tracked at most (pools and the demand of keys seen recently). A key that finds the
/// table full is sent to the store as it is, as without prefetching; idle entries leave the
/// table within two TTLs.
pub(super) const MAX_POOLS: usize = 100_000;

/// How often expired tokens are looked for and given back, while any are held.
pub(super) const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// The largest part of the refill other clients are assumed to take (31/32): a waiting
/// instance expects at least 1/32 of what the bucket refills to be left for it, so it waits at
/// most 32 times as long as the store's last word alone says (and at most one TTL longer).
const MAX_OTHERS: u32 = 65_536 / 32 * 31;

/// Whether a transaction may be answered from prefetched tokens.
#[inline]
pub(super) fn eligible<'a>(tx: &BucketTx<'a>) -> Option<&'a Limit> {
    let limit = tx.quota.as_gcra()?;
    (limit.prefetch() > 0
        && tx.mode == Mode::CheckAndSpend
        && tx.min_cost == tx.cost
        && tx.cost > 0)
        .then_some(limit)
}

/// Whether a transaction drops the key's local tokens: a charge (a settle's overrun, perhaps
/// into debt), after which the store's state, not the pool, must decide the key.
#[inline]
pub(super) fn drops_pool(tx: &BucketTx<'_>) -> bool {
    tx.mode == Mode::Charge && tx.quota.as_gcra().is_some_and(|l| l.prefetch() > 0)
}

/// One key's prefetched tokens and what this instance knows of its bucket.
struct Pool {
    /// The limit the tokens were last taken under (they go back under it).
    limit: Limit,
    /// Tokens held, usable until `expires_at` (local microseconds).
    units: u64,
    expires_at: u64,
    /// Tokens no longer usable (expired, or dropped by a charge), to give back.
    stale: u64,
    /// The bucket's TAT as the store last reported it, on the local clock: a lower bound of
    /// the real one (0: unknown), and when it was reported.
    store_tat: u64,
    seen_at: u64,
    /// What the key's other clients took and what this instance was granted, in
    /// microseconds of the TAT, between the store's answers here (each halved at every
    /// answer: the recent ones weigh most).
    theirs_us: u64,
    own_us: u64,
    /// The others' part of what was taken, `theirs / (theirs + own)` in 1/65,536ths, at most
    /// [`MAX_OTHERS`]: the part of what the bucket refills while this instance waits that is
    /// expected to be gone when it calls.
    others: u32,
    /// Demand: units asked in the current window (one TTL long, from `window_start`) and in
    /// the window before.
    window_start: u64,
    window_units: u64,
    prev_units: u64,
    /// A refill is under way; `generation` counts the refills that ended.
    refilling: bool,
    generation: u64,
    /// Wakes the requests waiting for the refill under way (made by the first one).
    notify: Option<Arc<Notify>>,
}

/// What one transaction's pool decided.
pub(super) enum Step {
    /// Not a prefetching transaction: to the store as it is.
    Store,
    /// Sent as it is (a cold key, or the table is full); its answer updates the pool.
    Plain,
    /// Served from the pool (`units` taken), with the outcome it reports: this instance's
    /// view of the bucket (the store's state as last reported, plus what the pool holds).
    Take(u64, Outcome),
    /// A refill: the store is asked for `lo..=hi`, of which `need` is the request's; `took`
    /// units came from the pool.
    Refill {
        lo: u64,
        hi: u64,
        need: u64,
        took: u64,
    },
    /// Denied here: the least refill does not fit the store's last reported state.
    Deny(Outcome),
    /// A refill is under way: wait for `generation` to end.
    Wait(Arc<Notify>, u64),
}

/// The pools of one backend.
pub(super) struct Pools {
    map: DashMap<BucketKey, Pool>,
    /// A task gives back expired tokens while any pool holds some.
    pub(super) sweeping: AtomicBool,
}

/// Tokens to give back: a key, the limit they were taken under, how many.
pub(super) type Returned = Vec<(BucketKey, Limit, u64)>;

impl Pools {
    pub(super) fn new() -> Self {
        Self {
            map: DashMap::new(),
            sweeping: AtomicBool::new(false),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Decides one eligible transaction from its key's pool at `now`.
    pub(super) fn step(&self, tx: &BucketTx<'_>, limit: &Limit, now: u64) -> Step {
        let mut pool = match self.map.get_mut(tx.key) {
            Some(p) => p,
            None if self.map.len() >= MAX_POOLS => return Step::Plain,
            None => self
                .map
                .entry(tx.key.clone())
                .or_insert_with(|| Pool::new(*limit, now)),
        };
        pool.step(limit, tx.cost, now)
    }

    /// Gives back what `Take` and `Refill` steps took from the pool of `key` (their batch
    /// was denied or failed), and ends a refill.
    pub(super) fn undo(&self, key: &BucketKey, step: &Step) {
        let Some(mut pool) = self.map.get_mut(key) else {
            return;
        };
        match *step {
            Step::Take(units, _) => pool.give_back(units),
            Step::Refill { took, .. } => {
                pool.give_back(took);
                pool.end_refill();
            }
            _ => {}
        }
    }

    /// Records the store's answer `outcome` (at local time `now`) to a `Plain` or `Refill`
    /// step of an allowed (`batch_allowed`) or denied batch; the outcome the request reports.
    fn finish_one(
        &self,
        key: &BucketKey,
        step: &Step,
        mut outcome: Outcome,
        batch_allowed: bool,
        now: u64,
    ) -> Outcome {
        let Some(mut pool) = self.map.get_mut(key) else {
            outcome.granted = None;
            return outcome;
        };
        let tat = now.saturating_add(outcome.reset_after_us).max(1);
        if let Step::Refill { hi, need, took, .. } = *step {
            // A range of one size (`lo == hi`) is a single cost: granted whole when allowed.
            let whole = if outcome.allowed { hi } else { 0 };
            let granted = outcome.granted.take().unwrap_or(whole);
            let written = batch_allowed && outcome.allowed;
            pool.seen(tat, if written { granted } else { 0 }, now);
            if written {
                pool.expires_at = now.saturating_add(pool.limit.prefetch_ttl_us());
                pool.give_back(granted.saturating_sub(need));
                crate::telemetry::prefetch_refill(key.name());
            } else {
                pool.give_back(took);
            }
            pool.end_refill();
            // This instance's view: the store's bucket plus what the pool holds.
            outcome.remaining = outcome
                .remaining
                .saturating_add(pool.units)
                .min(pool.limit.burst());
        } else {
            // A plain call (a cold key): the store's word, too soon to tell the others' part.
            pool.store_tat = tat;
            pool.seen_at = now;
        }
        outcome
    }

    /// The generation of `key`'s refills, to know whether the one waited for ended.
    pub(super) fn generation(&self, key: &BucketKey) -> Option<u64> {
        self.map.get(key).map(|p| p.generation)
    }

    /// A charge on `key`: its local tokens go back to the store (the key's state must decide
    /// it now, debt included).
    pub(super) fn drop_units(&self, key: &BucketKey) {
        if let Some(mut pool) = self.map.get_mut(key) {
            pool.stale += std::mem::take(&mut pool.units);
            pool.store_tat = 0;
        }
    }

    /// A reset of `key`: its bucket is full again, so its local tokens are worth nothing
    /// (giving them back to a full bucket changes nothing).
    pub(super) fn forget(&self, key: &BucketKey) {
        if let Some(mut pool) = self.map.get_mut(key) {
            pool.units = 0;
            pool.stale = 0;
            pool.store_tat = 0;
        }
    }

    /// Every key's tokens forgotten (see [`forget`](Self::forget)).
    pub(super) fn forget_all(&self) {
        for mut pool in self.map.iter_mut() {
            pool.units = 0;
            pool.stale = 0;
            pool.store_tat = 0;
        }
    }

    /// Takes out the tokens to give back at `now` (all of them when `all`: a shutdown), and
    /// drops the keys idle for two TTLs.
    pub(super) fn returned(&self, now: u64, all: bool) -> Returned {
        let mut out = Vec::new();
        self.map.retain(|key, pool| {
            if pool.units > 0 && (all || pool.expires_at <= now) {
                pool.stale += std::mem::take(&mut pool.units);
            }
            if pool.stale > 0 {
                out.push((key.clone(), pool.limit, std::mem::take(&mut pool.stale)));
            }
            let idle_since = pool
                .window_start
                .saturating_add(2 * pool.limit.prefetch_ttl_us());
            pool.units > 0 || pool.refilling || now < idle_since
        });
        out
    }
}

impl Pool {
    fn new(limit: Limit, now: u64) -> Self {
        Self {
            limit,
            units: 0,
            expires_at: 0,
            stale: 0,
            store_tat: 0,
            seen_at: now,
            theirs_us: 0,
            own_us: 0,
            others: 0,
            window_start: now,
            window_units: 0,
            prev_units: 0,
            refilling: false,
            generation: 0,
            notify: None,
        }
    }

    /// Tokens into the pool (a refill's, or those a denied batch took), which never holds
    /// more than `prefetch`: the rest goes back to the store.
    fn give_back(&mut self, units: u64) {
        let room = self.limit.prefetch().saturating_sub(self.units);
        self.units += units.min(room);
        self.stale += units.saturating_sub(room);
    }

    /// This instance's view of the bucket at `now`: the store's bucket as last reported
    /// (refilled since), plus the tokens the pool holds.
    fn view(&self, now: u64) -> Outcome {
        let store = (self.store_tat != 0).then_some(self.store_tat);
        let wide = kit::trusted(&self.limit, store, now);
        let bucket = gcra::check(wide.as_ref().unwrap_or(&self.limit), store, now, 0)
            .map_or(Outcome::new(true, 0, 0, 0), Outcome::from);
        Outcome::new(
            true,
            bucket
                .remaining
                .saturating_add(self.units)
                .min(self.limit.burst()),
            0,
            bucket.reset_after_us,
        )
    }

    /// The store's answer to a refill: the bucket's TAT `tat` at `now`, after `own` units it
    /// wrote for this instance. What the TAT moved beyond them since the last answer the
    /// key's other clients took. (A spend moves the TAT from itself or from the time of the
    /// spend, whichever is later, so the move counted starts no earlier than `now`: a full
    /// bucket's idle time is not taken for the others' spends. It is a lower bound of what
    /// they took.)
    fn seen(&mut self, tat: u64, own: u64, now: u64) {
        let own_us = own.saturating_mul(self.limit.emission_interval_us());
        if self.store_tat != 0 {
            let theirs = tat
                .saturating_sub(own_us)
                .saturating_sub(self.store_tat.max(now));
            self.theirs_us = self.theirs_us / 2 + theirs / 2;
            self.own_us = self.own_us / 2 + own_us / 2;
            let all = u128::from(self.theirs_us) + u128::from(self.own_us);
            if let Some(part) = (u128::from(self.theirs_us) << 16).checked_div(all) {
                self.others = u32::try_from(part).unwrap_or(u32::MAX).min(MAX_OTHERS);
            }
        }
        self.store_tat = tat;
        self.seen_at = now;
    }

    /// The bucket's TAT expected at `now`: the store's last word plus the others' part of
    /// what the bucket refilled since, over one TTL at most (the time over which the
    /// demand is measured; an estimate older than that is not stretched further).
    fn expected_tat(&self, now: u64) -> u64 {
        let since = now.saturating_sub(self.seen_at);
        let since = u128::from(since.min(self.limit.prefetch_ttl_us()));
        let theirs = (since * u128::from(self.others)) >> 16;
        self.store_tat
            .saturating_add(u64::try_from(theirs).unwrap_or(u64::MAX))
    }

    fn end_refill(&mut self) {
        self.refilling = false;
        self.generation = self.generation.wrapping_add(1);
        if let Some(n) = &self.notify {
            n.notify_waiters();
        }
    }

    /// Counts `cost` units of demand at `now`; the demand seen before them (the larger of
    /// this window's and the last one's).
    fn observe(&mut self, cost: u64, ttl: u64, now: u64) -> u64 {
        if now >= self.window_start.saturating_add(ttl) {
            let next = now < self.window_start.saturating_add(2 * ttl);
            self.prev_units = if next { self.window_units } else { 0 };
            self.window_start = now;
            self.window_units = 0;
        }
        let seen = self.window_units.max(self.prev_units);
        self.window_units = self.window_units.saturating_add(cost);
        seen
    }

    fn step(&mut self, limit: &Limit, cost: u64, now: u64) -> Step {
        // A change of the key's limit (a reload, an override) applies from here: the tokens
        // taken under the old one are dropped, not used (they would add to what the new limit
        // admits) and not given back (a refund under the new limit would give back another
        // time than was taken): fewer admissions, at most `prefetch` per key, never more.
        if *limit != self.limit {
            self.units = 0;
            self.stale = 0;
            self.limit = *limit;
            // What was taken is counted in the old limit's emission intervals.
            (self.theirs_us, self.own_us, self.others) = (0, 0, 0);
        }
        let seen = self.observe(cost, limit.prefetch_ttl_us(), now);
        if self.units > 0 && self.expires_at <= now {
            self.stale += std::mem::take(&mut self.units);
        }
        if self.units >= cost {
            self.units -= cost;
            return Step::Take(cost, self.view(now));
        }
        if self.refilling {
            let notify = self.notify.get_or_insert_with(Default::default).clone();
            return Step::Wait(notify, self.generation);
        }
        let Some((lo, hi, need)) = self.ask(cost, seen) else {
            return Step::Plain;
        };
        if self.store_tat != 0 {
            // The least refill against the store's last word and what the key's other
            // clients are expected to have taken since: denied here while it does not fit,
            // with the wait before it does (never earlier than the store's word alone says).
            let store = Some(self.expected_tat(now));
            let wide = kit::trusted(&self.limit, store, now);
            if let Ok((out, _)) =
                gcra::check_range(wide.as_ref().unwrap_or(&self.limit), store, now, lo, hi)
                && !out.allowed
            {
                return Step::Deny(self.waiting(Outcome::from(out), lo, now));
            }
        }
        let took = std::mem::take(&mut self.units);
        self.refilling = true;
        Step::Refill { lo, hi, need, took }
    }

    /// A local denial `out` of the least refill `lo`, its wait stretched by the others'
    /// part: while this instance waits, they take that part of what the bucket refills, so
    /// `lo` is expected to fit when the rest has covered what was missing at `now`.
    /// Until one TTL after the store's last answer, only that part is left to cover what is
    /// missing; after it, the whole refill ([`expected_tat`](Self::expected_tat) stops
    /// there), so the wait is at most one TTL longer than the store's last word alone says.
    fn waiting(&self, mut out: Outcome, lo: u64, now: u64) -> Outcome {
        let missing = u128::from(
            self.expected_tat(now)
                .saturating_add(lo.saturating_mul(self.limit.emission_interval_us()))
                .saturating_sub(now.saturating_add(self.limit.burst_offset_us())),
        );
        let left = u128::from(65_536 - self.others);
        let horizon = self
            .seen_at
            .saturating_add(self.limit.prefetch_ttl_us())
            .saturating_sub(now);
        // What the part left covers before the horizon, in microseconds of the TAT.
        let covered = (u128::from(horizon) * left) >> 16;
        let wait = if missing <= covered {
            (missing << 16).div_ceil(left)
        } else {
            u128::from(horizon) + (missing - covered)
        };
        out.retry_after_us = out
            .retry_after_us
            .max(u64::try_from(wait).unwrap_or(u64::MAX));
        out
    }

    /// A refill for a request of `cost` units when the key's demand in a TTL was `seen`:
    /// `(lo, hi, need)`, the least and most units to ask the store for and the request's part
    /// of them; `None` for a key too cold to prefetch (sent as it is).
    fn ask(&self, cost: u64, seen: u64) -> Option<(u64, u64, u64)> {
        let target = seen.min(self.limit.prefetch());
        if target == 0 {
            return None;
        }
        let need = cost - self.units;
        let hi = need.saturating_add(target);
        // Worth waiting for: half the target, or what the bucket refills in one TTL if less
        // (a slow limit's last tokens are not held back for a refill that takes longer).
        let per_ttl = self.limit.prefetch_ttl_us() / self.limit.emission_interval_us();
        let lo = need
            .saturating_add(target.div_ceil(2).min(per_ttl))
            .min(self.limit.burst())
            .max(need);
        Some((lo, hi, need))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{Id, LimitName};
    use crate::quota::Quota;
    use std::time::Duration;

    fn hot() -> Limit {
        Limit::new(500, 300, Duration::from_secs(1))
            .unwrap()
            .with_prefetch(50, Duration::from_secs(1))
            .unwrap()
    }

    fn key(i: u64) -> BucketKey {
        BucketKey::new(LimitName::intern("Hot"), Id::from(i))
    }

    fn spend<'a>(key: &'a BucketKey, quota: &'a Quota) -> BucketTx<'a> {
        BucketTx::new(key, quota, 1..=1, Mode::CheckAndSpend).unwrap()
    }

    /// The demand rule: a key's first request in a TTL is sent as it is, the next ones ask
    /// for what the key used, at most `prefetch`, and at least half of it.
    #[test]
    fn refills_follow_the_demand_up_to_prefetch() {
        let pools = Pools::new();
        let quota = Quota::Gcra(hot());
        let k = key(1);
        let now = 1_000_000_000;
        assert!(matches!(
            pools.step(&spend(&k, &quota), &hot(), now),
            Step::Plain
        ));
        let Step::Refill { lo, hi, need, took } = pools.step(&spend(&k, &quota), &hot(), now)
        else {
            panic!("a second request refills");
        };
        assert_eq!((lo, hi, need, took), (2, 2, 1, 0));
        // A refill under way: the next request waits for it.
        assert!(matches!(
            pools.step(&spend(&k, &quota), &hot(), now),
            Step::Wait(..)
        ));
        let step = Step::Refill { lo, hi, need, took };
        let o = pools.finish_one(&k, &step, Outcome::new(true, 497, 0, 10_002), true, now);
        assert_eq!(
            o.remaining, 498,
            "the store's bucket plus the one token held"
        );
        let Step::Take(1, view) = pools.step(&spend(&k, &quota), &hot(), now) else {
            panic!("the pool holds one token");
        };
        assert_eq!(
            (view.allowed, view.remaining, view.reset_after_us),
            (true, 497, 10_002),
            "this instance's view: the store's bucket, the pool now empty"
        );
        // Demand 4 so far: the next refill asks for 1 + 4, at least 1 + 2.
        let Step::Refill { lo, hi, .. } = pools.step(&spend(&k, &quota), &hot(), now) else {
            panic!("the pool is empty");
        };
        assert_eq!((lo, hi), (3, 5));
    }

    /// The others' part: read from what the store's TAT moved between two answers beyond
    /// this instance's own grants, it stretches a local denial's wait (the others take half
    /// of what is spent: twice the store's wait) and moves the expected TAT, and a TAT that
    /// jumped (foreign data, a flood) stretches it at most 32 times, and never more than one
    /// TTL beyond the store's word.
    #[test]
    fn the_others_share_stretches_the_wait_for_a_refill() {
        let limit = hot();
        let (ei, bo) = (limit.emission_interval_us(), limit.burst_offset_us());
        let t0 = 1_000_000_000;
        let mut pool = Pool::new(limit, t0);
        pool.seen(t0 + bo, 15, t0);
        assert_eq!(pool.others, 0, "one answer says nothing of the others");
        // Every 100 ms (30 units refilled) this instance is granted 15 and the others take
        // 15: the bucket stays empty.
        let mut t = t0;
        for _ in 0..20 {
            t += 100_000;
            pool.seen(t + bo, 15, t);
        }
        let share = f64::from(pool.others) / 65_536.0;
        assert!((share - 0.5).abs() < 0.01, "{share}");
        // Right after the last answer, 26 units are missing; the store alone would say 26
        // emission intervals, half of the refill is left for this instance: twice that.
        let store_wait = 26 * ei;
        let told = pool.waiting(Outcome::new(false, 0, store_wait, 0), 26, t);
        let ratio = told.retry_after_us as f64 / store_wait as f64;
        assert!((ratio - 2.0).abs() < 0.02, "{ratio}");
        // When the store alone says 26 fit, the others are expected to have taken half.
        let then = t + store_wait;
        let expected = pool.expected_tat(then) - (t + bo);
        assert!((expected as f64 / (13 * ei) as f64 - 1.0).abs() < 0.02);
        // Never earlier than the store's own wait.
        let late = pool.waiting(Outcome::new(false, 0, u64::MAX / 2, 0), 26, t);
        assert_eq!(late.retry_after_us, u64::MAX / 2);
        // A TAT that jumped by an hour in 100 ms: the share is capped.
        for _ in 0..20 {
            t += 100_000;
            pool.seen(t + bo + 3_600_000_000, 0, t);
        }
        assert!(pool.others <= MAX_OTHERS);
        let capped = pool.waiting(Outcome::new(false, 0, 0, 0), 26, t);
        let missing = pool.expected_tat(t) + store_wait - (t + bo);
        assert!(capped.retry_after_us <= 32 * missing);
        // A slow limit (one unit a minute, so the store alone says 26 minutes): the others'
        // part stretches the wait by one TTL at most, and the expected TAT stops growing one
        // TTL after the last answer.
        let slow = Limit::new(500, 1, Duration::from_secs(60))
            .unwrap()
            .with_prefetch(50, Duration::from_secs(1))
            .unwrap();
        let (ei, bo, ttl) = (60_000_000, slow.burst_offset_us(), 1_000_000);
        let mut pool = Pool::new(slow, t0);
        pool.seen(t0 + bo, 1, t0);
        // Every two minutes, one unit here and one for the others: the bucket stays empty.
        let mut t = t0;
        for _ in 0..20 {
            t += 2 * ei;
            pool.seen(t + bo, 1, t);
        }
        assert!(pool.others > 65_536 / 3, "{}", pool.others);
        let store_wait = 26 * ei;
        let told = pool.waiting(Outcome::new(false, 0, store_wait, 0), 26, t);
        assert!(told.retry_after_us > store_wait, "stretched");
        assert!(
            told.retry_after_us <= store_wait + ttl,
            "{}",
            told.retry_after_us
        );
        assert_eq!(pool.expected_tat(t + 10 * ttl), pool.expected_tat(t + ttl));
    }

    /// A key the table has no room for is sent as it is; idle keys leave the table within
    /// two TTLs, so it never holds more than `MAX_POOLS` keys however many ids come.
    #[test]
    fn the_table_is_bounded_and_idle_keys_leave_it() {
        let pools = Pools::new();
        let quota = Quota::Gcra(hot());
        let now = 1_000_000_000;
        for i in 0..MAX_POOLS as u64 {
            let k = key(i);
            assert!(matches!(
                pools.step(&spend(&k, &quota), &hot(), now),
                Step::Plain
            ));
        }
        let k = key(u64::MAX);
        assert!(matches!(
            pools.step(&spend(&k, &quota), &hot(), now),
            Step::Plain
        ));
        assert_eq!(pools.map.len(), MAX_POOLS);
        assert!(pools.returned(now + 1_000_000, false).is_empty());
        assert_eq!(pools.map.len(), MAX_POOLS, "seen within two TTLs: kept");
        assert!(pools.returned(now + 2_000_000, false).is_empty());
        assert!(pools.is_empty());
    }
}
