//! What the in-memory fallback grants during an outage, charged back to the store once it
//! answers again, so that an outage cannot hand out a fresh quota (`docs/operating.md`, "When
//! the store fails").
//!
//! Only units that outlive an outage are carried (the seam's `charge_back`): a calendar quota's,
//! which count until their period ends, and a GCRA limit's of an hour or longer, which count
//! until time repays them. For those the layer keeps two bounded tables:
//!
//! - **known**: what the store last answered this instance about a key (the units left, and
//!   until when they hold). When an outage begins the fallback starts the key from the policy's
//!   share of what was left, not from a full count.
//! - **owed**: what the fallback granted each key, charged to the store ([`Mode::Charge`]:
//!   taken even above the limit) once it answers again. A request of an owed key charges it
//!   first, so the store never decides a request of this instance before the charge; a task
//!   charges the keys no request names, every second and as soon as a request finds the store
//!   back. A calendar quota's units are charged to the period they were granted in, dropped
//!   once it has ended; a GCRA limit's what time has not repaid yet, in whole units (rounded
//!   up).
//!
//! A limit with a penalty ladder (`docs/penalties.md`) carries its bans both ways:
//!
//! - **bans**: a key the store answered banned (its ban's end) starts banned until that end in
//!   the fallback, at level 1 (the answer carries no level). An answer that is not a ban
//!   forgets it (an operator may have lifted it).
//! - what the fallback counted toward a ban (the units it granted, each weighing for the
//!   ladder's `within` after the last one) is **owed** as above: the charge counts it in the
//!   store's ladder, which bans the key there when the units reach `after` (from the charge's
//!   time: a ban the fallback decided lasts at least as long in the store). A request of a
//!   rule that settles on its outcome is not owed: the fallback settles nothing, so its count
//!   is an estimate the store must not take for failures.
//!
//! The bound this leaves: per instance and outage, the policy's share of what was left; grants
//! of an instance that crashes before it charges them are lost (at most what it granted), and
//! another instance may decide a key between the store's return and this instance's charge
//! (at most a second, or a round trip after the first request that finds the store back). A
//! charge whose answer comes after the timeout may have reached the store: it stays owed and is
//! sent again (units lost, never granted twice).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use quick_cache::sync::Cache;

use crate::config::Limits;
use crate::key::BucketKey;
use crate::limiter::{
    BatchDecision, FallbackBans, Limiter, LimiterError, PenaltyPart, Transaction,
};
use crate::mode::Mode;
use crate::quota::ChargeBack;
use crate::time::{Clock, SystemClock};

/// Keys whose last answer from the store an instance keeps for the fallback's start.
pub(crate) const KNOWN_KEYS: usize = 100_000;

/// Keys whose fallback grants an instance keeps until it charges them; a grant to a key beyond
/// them is not carried back (it counts as an instance that crashed would).
pub(crate) const OWED_KEYS: usize = 100_000;

/// Keys charged in one store call by the task (a request's own keys always go in its call).
const CHARGED_AT_ONCE: usize = 256;

/// How often the task tries to charge what is owed while the store is down.
pub(crate) const CHARGE_EVERY: Duration = Duration::from_secs(1);

/// Units of a key as they stand at some time: `units` that hold until `until_us` (a calendar
/// quota: its period's end; `every_us` 0), or that time repays one every `every_us` (a GCRA
/// limit: `until_us` is when the last of them is repaid, `units` unused), or that weigh for
/// `within_us` after the last of them (a penalty ladder's window; `every_us` 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Units {
    units: u64,
    until_us: u64,
    every_us: u64,
    within_us: u64,
    /// Charged without the key's ladder: a quota's units of requests whose outcome settles,
    /// which the fallback never settled (the ladder would count them as failures).
    bare: bool,
}

impl Units {
    /// The units that still weigh at `now`: a calendar quota's until its period ends, a GCRA
    /// limit's what time has not repaid (whole units, rounded up: never fewer than weigh).
    fn at(&self, now: u64) -> u64 {
        if self.every_us == 0 {
            if now < self.until_us { self.units } else { 0 }
        } else {
            self.until_us.saturating_sub(now).div_ceil(self.every_us)
        }
    }

    /// `cost` more units granted at `now`, in the period ending `end_us` (a calendar quota):
    /// units of an earlier period are dropped.
    fn add(&mut self, cost: u64, end_us: u64, now: u64) {
        if self.within_us != 0 {
            self.units = self.units.saturating_add(cost);
            self.until_us = self.until_us.max(now.saturating_add(self.within_us));
        } else if self.every_us == 0 {
            if same_period(end_us, self.until_us) {
                self.units = self.units.saturating_add(cost);
                self.until_us = self.until_us.max(end_us);
            } else if end_us > self.until_us {
                *self = Units {
                    units: cost,
                    until_us: end_us,
                    every_us: 0,
                    within_us: 0,
                    bare: self.bare,
                };
            }
        } else {
            self.until_us = self
                .until_us
                .max(now)
                .saturating_add(cost.saturating_mul(self.every_us));
        }
    }

    /// `charged` of these units (as they stood in `taken`) are now in the store.
    fn sub(&mut self, taken: &Units, charged: u64) {
        if self.within_us != 0 {
            self.units = self.units.saturating_sub(charged);
        } else if self.every_us == 0 {
            if same_period(self.until_us, taken.until_us) {
                self.units = self.units.saturating_sub(charged);
            }
        } else {
            self.until_us = self
                .until_us
                .saturating_sub(charged.saturating_mul(self.every_us));
        }
    }
}

/// Whether two ends of a calendar quota's period, each read as a decision's time plus its
/// `reset_after`, are the same period's: the two times are two readings of a clock (on a real
/// clock they differ by the microseconds between them), and a period lasts a day at least, so
/// ends within an hour are one end. (Compared exactly, a grant whose end read one microsecond
/// later replaced what was owed before it: 3 granted during an outage, 1 charged.)
fn same_period(a_us: u64, b_us: u64) -> bool {
    const READINGS_APART_US: u64 = 3_600_000_000;
    a_us.abs_diff(b_us) < READINGS_APART_US
}

/// The units `key` owes the store when the fallback grants it some, as none yet: its quota's,
/// when they outlive an outage (charged without its ladder for a request whose outcome
/// settles, `reserved`: the fallback settles nothing), else its penalty ladder's (not for such
/// a request). `None`: nothing of it is carried.
fn owed_from(limits: &Limits, key: &BucketKey, reserved: bool, now: u64) -> Option<Units> {
    if let Some(shape) = limits.resolve(key).and_then(|q| q.charge_back()) {
        let every_us = shape.repaid_every_us;
        return Some(Units {
            units: 0,
            until_us: if every_us == 0 { 0 } else { now },
            every_us,
            within_us: 0,
            bare: reserved,
        });
    }
    let penalty = limits.entry(key.name())?.penalty.as_ref()?;
    (!reserved).then(|| Units {
        units: 0,
        until_us: 0,
        every_us: 0,
        within_us: penalty.ladder.within_us(),
        bare: false,
    })
}

/// What the store last said of a key: `left` units at `at_us`.
#[derive(Debug, Clone, Copy)]
struct Known {
    left: u64,
    at_us: u64,
    /// The quota's size and how its units are repaid.
    shape: ChargeBack,
    /// When what was known stops holding: a calendar period's end; when a GCRA bucket is full.
    until_us: u64,
}

impl Known {
    /// The units left at `now`: `None` once the period has ended or the bucket is full again.
    fn left_at(&self, now: u64) -> Option<u64> {
        if now >= self.until_us {
            return None;
        }
        let repaid = match self.shape.repaid_every_us {
            0 => 0,
            every => now.saturating_sub(self.at_us) / every,
        };
        Some(self.left.saturating_add(repaid).min(self.shape.count))
    }
}

/// The two tables of a layer with an in-memory fallback (module docs).
pub(crate) struct Ledger {
    percent: u8,
    /// The main backend's clock, which the fallback decides by too (`None`: the system's).
    clock: Option<Arc<dyn Clock>>,
    /// The layer's backend timeout: the longest a charge may take.
    timeout: Duration,
    known: Cache<BucketKey, Known>,
    /// The keys the store last answered banned, each with its ban's end.
    bans: Cache<BucketKey, u64>,
    /// The fallback's memory, where those start banned.
    fallback_bans: FallbackBans,
    owed: Mutex<HashMap<BucketKey, Units>>,
    /// `owed`'s length, read on every request without the lock.
    owing: AtomicUsize,
    /// One charge at a time: a request of a key being charged waits for that charge.
    line: tokio::sync::Mutex<()>,
    /// Whether the task that charges what is owed runs.
    charging: AtomicBool,
    /// Wakes the task: a request found the store back.
    back: tokio::sync::Notify,
    /// Whether a grant beyond [`OWED_KEYS`] was warned of.
    warned_full: AtomicBool,
}

impl Ledger {
    pub(crate) fn new(
        percent: u8,
        clock: Option<Arc<dyn Clock>>,
        timeout: Duration,
        fallback_bans: FallbackBans,
    ) -> Self {
        Self {
            percent: percent.clamp(1, 100),
            clock,
            timeout,
            known: Cache::new(KNOWN_KEYS),
            bans: Cache::new(KNOWN_KEYS),
            fallback_bans,
            owed: Mutex::new(HashMap::new()),
            owing: AtomicUsize::new(0),
            line: tokio::sync::Mutex::new(()),
            charging: AtomicBool::new(false),
            back: tokio::sync::Notify::new(),
            warned_full: AtomicBool::new(false),
        }
    }

    /// The time by the main backend's clock.
    pub(crate) fn now(&self) -> u64 {
        match &self.clock {
            Some(clock) => clock.now_us(),
            None => SystemClock.now_us(),
        }
    }

    fn owed(&self) -> MutexGuard<'_, HashMap<BucketKey, Units>> {
        self.owed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers what the store answered (`batch`, decided at `now`) of keys whose units
    /// outlive an outage; a request found the store back, so the task charges at once.
    pub(crate) fn know(&self, batch: &BatchDecision, now: u64) {
        for d in batch.decisions() {
            if d.banned() {
                let until = now.saturating_add(crate::time::duration_us(d.retry_after()));
                self.bans.insert(d.key().clone(), until);
            } else if !self.bans.is_empty() && !d.skipped() {
                self.bans.remove(d.key());
            }
            let Some(shape) = d.limit().and_then(|q| q.charge_back()) else {
                continue;
            };
            if d.skipped() {
                continue;
            }
            let until_us = now.saturating_add(crate::time::duration_us(d.reset_after()));
            self.known.insert(
                d.key().clone(),
                Known {
                    left: d.remaining(),
                    at_us: now,
                    shape,
                    until_us,
                },
            );
        }
        if self.owing.load(Ordering::Relaxed) != 0 {
            self.back.notify_one();
        }
    }

    /// Starts each of `txs`' keys the store last answered of, once per outage, from the
    /// policy's share of the units that were left (the fallback's own state of it forgotten).
    /// A key the store last answered banned starts banned until the ban's end (once per
    /// outage too).
    pub(crate) fn seed(&self, fallback: &Limiter, txs: &[Transaction], now: u64) {
        if !self.bans.is_empty() {
            for tx in txs {
                if let Some((key, until)) = self.bans.remove(tx.key())
                    && until > now
                {
                    self.fallback_bans.start(&fallback.load(), &key, until, now);
                }
            }
        }
        if self.known.is_empty() {
            return;
        }
        for tx in txs {
            let Some((_, known)) = self.known.remove(tx.key()) else {
                continue;
            };
            if !fallback.reset_now(&[tx.key()]) {
                continue;
            }
            let Some(left) = known.left_at(now) else {
                continue;
            };
            let limits = fallback.load();
            let Some(size) = limits.resolve(tx.key()).map(|q| q.max_cost()) else {
                continue;
            };
            let share = left.saturating_mul(u64::from(self.percent)) / 100;
            let used = size.saturating_sub(share);
            if used > 0 {
                let charge = [Transaction::of(tx.key().clone(), Mode::Charge, Some(used))];
                if let Some(Err(e)) = fallback.spend_now(&charge) {
                    tracing::debug!(target: crate::telemetry::target::BACKEND, error = %e, "could not start the in-memory fallback from the store's last answer");
                }
            }
        }
    }

    /// Records what the fallback granted (`batch`, allowed, at `now`) of keys whose units
    /// outlive an outage under the main `limits`.
    pub(crate) fn record(
        self: &Arc<Self>,
        limits: &Limits,
        batch: &BatchDecision,
        now: u64,
        main: &Limiter,
    ) {
        let mut recorded = false;
        {
            let mut owed = self.owed();
            for d in batch.decisions() {
                if !d.allowed() || !d.mode().spends() || d.granted() == 0 {
                    continue;
                }
                let reserved = d.reservation().is_some();
                let Some(mut units) = owed_from(limits, d.key(), reserved, now) else {
                    continue;
                };
                let end_us = now.saturating_add(crate::time::duration_us(d.reset_after()));
                let len = owed.len();
                match owed.get_mut(d.key()) {
                    Some(units) => units.add(d.granted(), end_us, now),
                    None if len >= OWED_KEYS => {
                        if !self.warned_full.swap(true, Ordering::Relaxed) {
                            tracing::warn!(target: crate::telemetry::target::BACKEND, keys = OWED_KEYS, "the in-memory fallback owes the store for as many keys as it keeps; later grants are not charged back");
                        }
                        continue;
                    }
                    None => {
                        units.add(d.granted(), end_us, now);
                        owed.insert(d.key().clone(), units);
                    }
                }
                recorded = true;
            }
            self.owing.store(owed.len(), Ordering::Relaxed);
        }
        if recorded {
            self.start_charging(main);
        }
    }

    /// Whether one of `txs`' keys is owed to the store: then the request charges it first.
    #[inline]
    pub(crate) fn owes(&self, txs: &[Transaction]) -> bool {
        self.owing.load(Ordering::Relaxed) != 0 && self.owes_any(txs)
    }

    #[cold]
    fn owes_any(&self, txs: &[Transaction]) -> bool {
        let owed = self.owed();
        txs.iter().any(|tx| owed.contains_key(tx.key()))
    }

    /// Charges what is owed for `txs`' keys (and others, up to [`CHARGED_AT_ONCE`]) to
    /// `main`'s store, after any charge under way, within the layer's timeout from now: what
    /// the store took is no longer owed. An error: the store failed (or the charge before it
    /// did not end in time), and everything stays owed.
    pub(crate) async fn charge(
        &self,
        main: &Limiter,
        txs: &[Transaction],
    ) -> Result<(), ChargeError> {
        tokio::time::timeout(self.timeout, self.charge_in_line(main, txs))
            .await
            .map_err(|_| ChargeError::Timeout)?
            .map_err(ChargeError::Limiter)
    }

    async fn charge_in_line(
        &self,
        main: &Limiter,
        txs: &[Transaction],
    ) -> Result<(), LimiterError> {
        let _line = self.line.lock().await;
        let now = self.now();
        let limits = main.load();
        let mut taken: Vec<(BucketKey, Units, u64)> = Vec::new();
        {
            let mut owed = self.owed();
            let take = |key: &BucketKey, units: Units, taken: &mut Vec<_>| {
                let n = units.at(now);
                // A limit that no longer carries its units back (removed, or changed by a
                // reload) is owed nothing.
                let carried = owed_from(&limits, key, false, now).is_some();
                if n == 0 || !carried {
                    return false;
                }
                taken.push((key.clone(), units, n));
                true
            };
            for tx in txs {
                if let Some(units) = owed.get(tx.key()).copied()
                    && !taken.iter().any(|(k, _, _)| k == tx.key())
                    && !take(tx.key(), units, &mut taken)
                {
                    owed.remove(tx.key());
                }
            }
            let mut done = Vec::new();
            for (key, units) in owed.iter() {
                if taken.len() >= CHARGED_AT_ONCE.max(txs.len()) {
                    break;
                }
                if taken.iter().any(|(k, _, _)| k == key) {
                    continue;
                }
                if !take(key, *units, &mut taken) {
                    done.push(key.clone());
                }
            }
            for key in done {
                owed.remove(&key);
            }
            self.owing.store(owed.len(), Ordering::Relaxed);
        }
        if taken.is_empty() {
            return Ok(());
        }
        let charges: Vec<Transaction> = taken
            .iter()
            .map(|(key, units, n)| {
                let tx = Transaction::of(key.clone(), Mode::Charge, Some(*n));
                match units.bare {
                    true => tx.with_penalty(PenaltyPart::Skip),
                    false => tx,
                }
            })
            .collect();
        drop(limits);
        let charged = main.spend(&charges).await?;
        let mut owed = self.owed();
        // Every unit sent is the store's now: a GCRA charge beyond the limit's debt is forgiven
        // by the store's rule, a key a stored block denies was not sent (the block denies it).
        debug_assert_eq!(charged.decisions().len(), taken.len());
        for (key, units, n) in &taken {
            if let Some(now_owed) = owed.get_mut(key) {
                now_owed.sub(units, *n);
                if now_owed.at(now) == 0 {
                    owed.remove(key);
                }
            }
        }
        self.owing.store(owed.len(), Ordering::Relaxed);
        Ok(())
    }

    /// Starts the task that charges what is owed, unless it runs (not without a runtime: then
    /// the requests of owed keys charge them).
    fn start_charging(self: &Arc<Self>, main: &Limiter) {
        if self.charging.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.charging.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(charge_owed(self.clone(), main.clone()));
    }
}

/// The task that charges what the fallback granted: every [`CHARGE_EVERY`], or at once when a
/// request finds the store back, until nothing is owed.
async fn charge_owed(ledger: Arc<Ledger>, main: Limiter) {
    loop {
        let _ = tokio::time::timeout(CHARGE_EVERY, ledger.back.notified()).await;
        let _ = ledger.charge(&main, &[]).await;
        if ledger.owing.load(Ordering::Relaxed) == 0 {
            ledger.charging.store(false, Ordering::Release);
            // A grant recorded since is charged by this task again, unless another one runs.
            if ledger.owing.load(Ordering::Relaxed) == 0
                || ledger.charging.swap(true, Ordering::AcqRel)
            {
                return;
            }
        }
    }
}

/// Why what is owed could not be charged: the store failed, or did not answer in time.
#[derive(Debug)]
pub(crate) enum ChargeError {
    Limiter(LimiterError),
    Timeout,
}

#[cfg(test)]
mod tests;
