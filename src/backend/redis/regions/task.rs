//! The rebalancing task every regional instance runs (`docs/regions.md`), once a period, a
//! twentieth of a period after each period's end on the instance's clock:
//!
//! 1. its demand: the units its requests asked of each marked key in the period that ended
//!    (admitted and refused), added to the region's demand hash of that period (`HINCRBY`, its
//!    busiest keys only);
//! 2. the lock (`SET NX PX`, in the region's store): the one instance that holds it registers
//!    the region in the global store (a lost registry made again with the registrations it
//!    and the region's earlier holders saw), says in the region's store whether the
//!    registration is confirmed and what the registry holds, and, 15% into the period in
//!    every region (every instance's demand is in), rebalances the busiest keys of that
//!    period's demand (above their floors), with every key that held a part at the last
//!    rebalance (demand 0: it gives it back);
//! 3. the others read whether the registration is confirmed (until then their floors are 0);
//! 4. every instance, 45% into the period, adds its demand so far to the period's half hash,
//!    which the holder reads half way for the keys whose demand surged (`regions::surging`).
//!
//! Nothing here is on a request's path: a request only counts its units in memory.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use fred::prelude::{Client, HashesInterface, KeysInterface, Value};

use super::{Regional, Round};
use crate::backend::BackendError;
use crate::backend::redis::RedisBackend;
use crate::backend::regions::global::RegistryRecord;
use crate::backend::regions::{
    ASK_AGAIN_QUARTERS, REBALANCE_AT_PERCENT, SURGE_QUARTER, demand_above_floor, marked, surging,
    with_surges,
};
use crate::config::Limits;
use crate::key::BucketKey;

impl Regional {
    /// Counts `units` asked of `key` in this period (a request's path: no await, one short
    /// lock).
    pub(crate) fn count_demand(&self, key: &BucketKey, units: u64) {
        let mut demand = self.demand.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = demand.get_mut(key) {
            *n = n.saturating_add(units);
        } else if demand.len() < self.settings.demand_cap() {
            demand.insert(key.clone(), units);
        }
    }

    /// This period's demand so far (left counting) at `now`, scaled to `window` µs: a tick
    /// that ran late counted over less.
    fn demand_so_far(&self, now: u64, window: u64) -> Vec<(BucketKey, u64)> {
        let demand = self.demand.lock().unwrap_or_else(PoisonError::into_inner);
        let counted = now.saturating_sub(self.demand_since.load(Ordering::Acquire));
        if counted == 0 {
            return Vec::new();
        }
        let scaled = |units: u64| {
            u64::try_from(u128::from(units) * u128::from(window) / u128::from(counted))
                .unwrap_or(u64::MAX)
        };
        demand
            .iter()
            .map(|(k, u)| (k.clone(), scaled(*u)))
            .collect()
    }

    /// This period's demand, taken at `now` (the count starts again).
    fn take_demand(&self, now: u64) -> HashMap<BucketKey, u64> {
        let mut demand = self.demand.lock().unwrap_or_else(PoisonError::into_inner);
        self.demand_since.store(now, Ordering::Release);
        std::mem::take(&mut *demand)
    }
}

/// A failed call to the region's store.
fn unavailable(e: fred::error::Error) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

/// A demand hash's field: the limit's name and the id's text, apart by a byte neither holds.
fn field(key: &BucketKey) -> String {
    format!("{}\u{1f}{}", key.name().as_str(), key.id())
}

/// The key a demand hash's field names, under `limits` (`None`: a name or an id it does not
/// know).
fn key_of(field: &str, limits: &Limits) -> Option<BucketKey> {
    let (name, id) = field.split_once('\u{1f}')?;
    let name = limits.name(name)?;
    let id = limits.id_kind(name)?.parse(id).ok()?;
    Some(BucketKey::new(name, id))
}

/// How long an instance's demand so far has counted when it adds it to the half hash: from its
/// tick (a twentieth of a period in) to a twentieth before half way.
fn half_window(period: u64) -> u64 {
    (period / 4 * SURGE_QUARTER - period / 20).saturating_sub(period / 20)
}

/// The next tick at `now` (instance clock) with periods of `period` µs: the period whose end it
/// follows (its demand is added), and how long to wait for it, a twentieth of a period after
/// that end. `next`: the period whose end the last tick expected next (`None` at start). A
/// tick that comes late (the last one ran long: a rebalance that asked again half a period
/// in, slow calls) runs at once, for its own period, so no period's demand is added to
/// another's hash; one more than a whole period late waits for the next end.
fn tick(next: Option<u64>, now: u64, period: u64) -> (u64, Duration) {
    let at = |end: u64| end.saturating_mul(period).saturating_add(period / 20);
    let current = now / period;
    let end = match next {
        // Late by less than a period: at once. On time: when it comes (unless the clock went
        // back by more than a period: from now, as at start).
        Some(end) if at(end) <= now && at(end + 1) > now => end,
        Some(end) if at(end) > now && at(end) <= now.saturating_add(period) => end,
        _ if at(current) > now => current,
        _ => current + 1,
    };
    (
        end.saturating_sub(1),
        Duration::from_micros(at(end).saturating_sub(now)),
    )
}

impl RedisBackend {
    /// Starts the rebalancing task of a regional backend, following `limits` until they are
    /// gone (the limiter dropped). Nothing when the backend is not regional.
    pub(crate) fn start_rebalancing(&self, limits: crate::backend::FollowedLimits) {
        let Some(regional) = self.regional_mode().cloned() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::error!(target: crate::telemetry::target::BACKEND,
                "a regional backend needs a tokio runtime to rebalance; marked limits stay closed");
            return;
        };
        let backend = Arc::downgrade(&self.inner);
        let instance = format!("{:016x}", crate::time::random_u64());
        runtime.spawn(async move {
            let period = regional.settings.period_us.max(1_000);
            // Keys with a part or a demand after the last rebalance, asked again (demand 0 when
            // they have none): a part given back, a demand that stopped no longer counted.
            let mut asked_next: Vec<BucketKey> = Vec::new();
            let mut next: Option<u64> = None;
            loop {
                // Every instance ticks just after each period's end on its clock (a twentieth
                // of a period: clock differences between instances), so that each period's
                // demand is added once, whole, before the holder reads it.
                let Some(now) = Weak::upgrade(&backend).map(|inner| inner.local.now_us()) else {
                    return;
                };
                let (ended, wait) = tick(next, now, period);
                tokio::time::sleep(wait).await;
                next = Some(ended + 2);
                let (Some(inner), Some(limits)) = (Weak::upgrade(&backend), limits()) else {
                    return;
                };
                let backend = RedisBackend { inner };
                match backend
                    .rebalance_period(&regional, &limits, &instance, &asked_next, ended)
                    .await
                {
                    Ok(Some((round, held))) => {
                        crate::telemetry::region_rebalance(&regional.region, true);
                        crate::telemetry::region_keys(
                            &regional.region,
                            round.asked,
                            held.len(),
                            round.conflicts,
                        );
                        asked_next = held;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        crate::telemetry::region_rebalance(&regional.region, false);
                        tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e,
                            region = regional.region.as_str(),
                            "rebalancing the shares of the limits across regions failed; \
                             the region keeps what it holds until its leases end");
                    }
                }
            }
        });
    }

    /// One period of the task: the demand added, the lock tried; for the holder, the
    /// registration and the rebalance (its round, and the keys to ask at the next).
    async fn rebalance_period(
        &self,
        regional: &Regional,
        limits: &Limits,
        instance: &str,
        asked_next: &[BucketKey],
        ended: u64,
    ) -> Result<Option<(Round, Vec<BucketKey>)>, BackendError> {
        let client: Client = self.client_for_key(&self.regions_key("lock"))?;
        let period = regional.settings.period_us.max(1);
        // 1. This instance's demand, into the period's hash (its busiest keys only).
        let mut demand: Vec<(BucketKey, u64)> = regional
            .take_demand(self.inner.local.now_us())
            .into_iter()
            .collect();
        demand.sort_by_key(|d| std::cmp::Reverse(d.1));
        demand.truncate(regional.settings.max_keys);
        self.add_demand(&client, &format!("demand:{ended}"), &demand, period)
            .await?;
        // 2. The lock: taken, or kept by its holder.
        if !self.hold_lock(&client, instance, period).await? {
            self.follow_holder(regional, &client, ended).await?;
            return Ok(None);
        }
        self.merge_kept_registry(regional, &client).await?;
        // The period that ended, 15% into the next in every region: every instance has added
        // its demand (they tick a twentieth of a period in; their clocks agree to well within
        // the rest), and a region giving up a part and one taking it ask in the same instant,
        // the later compare-and-set retried after the other's (measured in `BENCHMARKS.md`:
        // rebalancing at random points cost up to two periods more). Above each key's floor,
        // in requests per its limit's period.
        let at = (ended + 1).saturating_mul(period) + period / 100 * REBALANCE_AT_PERCENT;
        self.sleep_until(at).await;
        let demands = self
            .period_demands(&client, limits, ended, period, asked_next)
            .await?;
        let mut round = self.rebalance(limits, &demands).await?;
        self.ask_again_in_period(
            regional,
            limits,
            &client,
            (ended, period),
            &demands,
            &mut round,
        )
        .await?;
        self.keep_registration(regional, &client).await?;
        let held = round.asked_next.clone();
        Ok(Some((round, held)))
    }

    /// Whether this instance holds the region's lock for the next three periods: taken, or
    /// kept by its holder (and extended).
    async fn hold_lock(
        &self,
        client: &Client,
        instance: &str,
        period: u64,
    ) -> Result<bool, BackendError> {
        let lock = self.regions_key("lock");
        let ttl_ms = i64::try_from(period.saturating_mul(3) / 1_000 + 1).unwrap_or(i64::MAX);
        let taken: Option<String> = client
            .set(
                &lock,
                instance,
                Some(fred::types::Expiration::PX(ttl_ms)),
                Some(fred::types::SetOptions::NX),
                false,
            )
            .await
            .map_err(unavailable)?;
        let holder = taken.is_some() || {
            let current: Option<String> = client.get(&lock).await.map_err(unavailable)?;
            current.as_deref() == Some(instance)
        };
        if holder {
            let _: bool = client
                .pexpire(&lock, ttl_ms, None)
                .await
                .map_err(unavailable)?;
        }
        Ok(holder)
    }

    /// An instance that does not hold the lock: whether the registration is confirmed, as the
    /// holder last said (no record, never written or lost by the region's store: as it was);
    /// then its demand so far in this period, for the holder's surge.
    async fn follow_holder(
        &self,
        regional: &Regional,
        client: &Client,
        ended: u64,
    ) -> Result<(), BackendError> {
        let confirmed: Option<String> = client
            .get(self.regions_key("confirmed"))
            .await
            .map_err(unavailable)?;
        if let Some(confirmed) = confirmed {
            regional.set_confirmed(confirmed == "1");
        }
        self.add_half_demand(regional, client, ended + 1).await
    }

    /// The demands of period `ended` every instance added, above each key's floor (keys with
    /// none left out), and the keys asked at the last rebalance with demand 0 (their parts
    /// given back).
    async fn period_demands(
        &self,
        client: &Client,
        limits: &Limits,
        ended: u64,
        period: u64,
        asked_next: &[BucketKey],
    ) -> Result<Vec<(BucketKey, u64)>, BackendError> {
        let last = self.regions_key(&format!("demand:{ended}"));
        let counted: HashMap<String, u64> = client.hgetall(&last).await.map_err(unavailable)?;
        let mut demands: Vec<(BucketKey, u64)> = Vec::with_capacity(counted.len());
        for (f, units) in counted {
            let Some(key) = key_of(&f, limits) else {
                continue;
            };
            if let Some((_, limit, floor)) = marked(limits, &key) {
                demands.push((key, demand_above_floor(units, limit, floor, period)));
            }
        }
        demands.retain(|(_, d)| *d > 0);
        let with_demand: std::collections::HashSet<BucketKey> =
            demands.iter().map(|(k, _)| k.clone()).collect();
        for key in asked_next.iter().filter(|k| !with_demand.contains(*k)) {
            demands.push((key.clone(), 0));
        }
        Ok(demands)
    }

    /// Keys whose answer may change once the other regions have reported and confirmed
    /// (they decide at the same instant, and confirm what they give up a few round trips
    /// later): asked again half a period in, and three quarters in if still so, so a
    /// transfer completes in the period it starts (`BENCHMARKS.md`: 2.5 to 2.9 periods to
    /// converge, from 3.1 to 3.2). Half a period in, with them, the keys whose demand surged
    /// since the period began (`surging`: one idle that bursts reports it a period sooner).
    async fn ask_again_in_period(
        &self,
        regional: &Regional,
        limits: &Limits,
        client: &Client,
        (ended, period): (u64, u64),
        demands: &[(BucketKey, u64)],
        round: &mut Round,
    ) -> Result<(), BackendError> {
        let mut again = std::mem::take(&mut round.ask_again);
        for quarter in ASK_AGAIN_QUARTERS {
            let surge = quarter == SURGE_QUARTER;
            if surge {
                self.add_half_demand(regional, client, ended + 1).await?;
            } else if again.is_empty() {
                break;
            }
            self.sleep_until((ended + 1).saturating_mul(period) + period / 4 * quarter)
                .await;
            if surge {
                let half = self.regions_key(&format!("demand:{}:half", ended + 1));
                let counted: HashMap<String, u64> =
                    client.hgetall(&half).await.map_err(unavailable)?;
                let units =
                    (counted.into_iter()).filter_map(|(f, u)| Some((key_of(&f, limits)?, u)));
                let reported: HashMap<BucketKey, u64> = demands.iter().cloned().collect();
                let surged = surging(units, limits, half_window(period), &reported);
                with_surges(&mut again, surged);
            }
            if again.is_empty() {
                continue;
            }
            let Ok(mut later) = self
                .answer_keys(regional, limits, &again, super::Pass::Later)
                .await
            else {
                break;
            };
            again = std::mem::take(&mut later.ask_again);
            round.absorb(later);
        }
        Ok(())
    }

    /// Sleeps until `at` (microseconds, the instance's clock).
    async fn sleep_until(&self, at: u64) {
        tokio::time::sleep(Duration::from_micros(
            at.saturating_sub(self.inner.local.now_us()),
        ))
        .await;
    }

    /// The registry as the region's holders last read it (`keep_registration`), merged into
    /// this instance's own, which it may never have read (it never held the lock): a lost
    /// registry is made again with every region any of them saw. Made again from one
    /// instance's own, a region cut off from the global store could lose its floor to the
    /// others' parts (`regions::model`, "a lost registry made again").
    pub(crate) async fn merge_kept_registry(
        &self,
        regional: &Regional,
        client: &Client,
    ) -> Result<(), crate::backend::BackendError> {
        let kept: Option<String> = client
            .get(self.regions_key("registry"))
            .await
            .map_err(|e| crate::backend::BackendError::Unavailable(e.to_string()))?;
        if let Some(kept) = kept.as_deref().and_then(RegistryRecord::parse) {
            regional.merge_seen(&kept);
        }
        Ok(())
    }

    /// Whether the registration is confirmed, for the region's other instances, kept until
    /// the next answer says otherwise (it never expires: an instance that starts while the
    /// global store is unreachable decides on the floors the region holds); with it, the
    /// registry as this holder read it, for the next (`merge_kept_registry`).
    pub(crate) async fn keep_registration(
        &self,
        regional: &Regional,
        client: &Client,
    ) -> Result<(), crate::backend::BackendError> {
        let confirmed = if regional.confirmed() { "1" } else { "0" };
        let writes = vec![
            (self.regions_key("confirmed"), confirmed.to_owned()),
            (self.regions_key("registry"), regional.seen().text()),
        ];
        client
            .mset(writes)
            .await
            .map_err(|e| crate::backend::BackendError::Unavailable(e.to_string()))
    }

    /// Adds this instance's demand so far in period `current` (counted since its tick, a
    /// twentieth of a period in) to the period's half hash, 45% into it: what the holder reads
    /// half way for the keys whose demand surged.
    async fn add_half_demand(
        &self,
        regional: &Regional,
        client: &Client,
        current: u64,
    ) -> Result<(), crate::backend::BackendError> {
        let period = regional.settings.period_us.max(1);
        let at = current.saturating_mul(period) + period / 4 * SURGE_QUARTER - period / 20;
        tokio::time::sleep(Duration::from_micros(
            at.saturating_sub(self.inner.local.now_us()),
        ))
        .await;
        let mut demand: Vec<(BucketKey, u64)> =
            regional.demand_so_far(self.inner.local.now_us(), half_window(period));
        demand.sort_by_key(|d| std::cmp::Reverse(d.1));
        demand.truncate(regional.settings.max_keys);
        self.add_demand(client, &format!("demand:{current}:half"), &demand, period)
            .await
    }

    /// Adds `demand` (each key's units) to the region's hash `what` (`regions_key`), which
    /// expires three periods later: one pipeline.
    async fn add_demand(
        &self,
        client: &Client,
        what: &str,
        demand: &[(BucketKey, u64)],
        period: u64,
    ) -> Result<(), crate::backend::BackendError> {
        if demand.is_empty() {
            return Ok(());
        }
        let hash = self.regions_key(what);
        let pipeline = client.pipeline();
        for (key, units) in demand {
            let _: () = pipeline
                .hincrby(&hash, field(key), i64::try_from(*units).unwrap_or(i64::MAX))
                .await
                .map_err(unavailable)?;
        }
        let ttl = i64::try_from(period.saturating_mul(3) / 1_000 + 1).unwrap_or(i64::MAX);
        let _: () = pipeline
            .pexpire(&hash, ttl, None)
            .await
            .map_err(unavailable)?;
        let _: Vec<Value> = pipeline.all().await.map_err(unavailable)?;
        Ok(())
    }

    /// A key of the region's own records in its store: `<prefix>{regions}:<what>`.
    fn regions_key(&self, what: &str) -> String {
        format!("{}{{regions}}:{what}", self.prefix())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    /// The schedule of the ticks: a twentieth of a period after each end; a tick that comes
    /// late runs at once for its own period (before, a rebalance that ran past the next tick
    /// skipped it, and two periods' demand went into one hash: read as 0, then twice); a clock
    /// gone back by more than a period starts again from now.
    #[test]
    fn every_period_ends_in_one_tick_late_or_not() {
        let ms = |n: u64| Duration::from_millis(n);
        // At start: the next end.
        assert_eq!(tick(None, 10 * S + S / 2, S), (10, ms(550)));
        assert_eq!(tick(None, 10 * S + S / 100, S), (9, ms(40)));
        // On time.
        assert_eq!(tick(Some(12), 11 * S + 990_000, S), (11, ms(60)));
        // Late (the last tick ran past 12.05 s): at once, for period 11.
        assert_eq!(tick(Some(12), 12 * S + S / 2, S), (11, ms(0)));
        // More than a period late: the next end.
        assert_eq!(tick(Some(12), 13 * S + S / 2, S), (13, ms(550)));
        // The clock went back 7 s: from now.
        assert_eq!(tick(Some(12), 5 * S, S), (4, ms(50)));
        // At the clock's start.
        assert_eq!(tick(None, 0, S), (0, ms(50)));
    }
}
