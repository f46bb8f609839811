//! The slots this limiter's requests hold, renewed together: one task per limiter renews every
//! lease held, at every third of the shortest lease time, in one batch (one transaction per
//! key, naming all of its leases): the store's calls grow with the keys held, not with the
//! requests holding them (2,000 long requests made about 2,000 calls a second, one
//! task each).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError, Weak};
use std::time::Duration;

use super::{Inner, Lease, Limiter};

/// The leases held, by id, and whether the task renewing them runs.
#[derive(Default)]
pub(super) struct Renewals {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    held: HashMap<u64, Lease, foldhash::fast::RandomState>,
    running: bool,
}

/// Leases kept renewed while it lives ([`Limiter::hold`]).
pub(crate) struct Hold {
    limiter: Weak<Inner>,
    ids: smallvec::SmallVec<[u64; 1]>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(inner) = self.limiter.upgrade() {
            let mut state = inner.renewals.lock();
            for id in &self.ids {
                state.held.remove(id);
            }
        }
    }
}

impl Renewals {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A third of the shortest lease time of `leases`, at least a millisecond.
pub(crate) fn third_of_lease<'l>(leases: impl IntoIterator<Item = &'l Lease>) -> Duration {
    let lease_us = leases
        .into_iter()
        .filter_map(|l| l.quota.lease_us())
        .min()
        .unwrap_or(u64::MAX);
    Duration::from_micros((lease_us / 3).max(1_000))
}

impl Limiter {
    /// Keeps `leases` (slots of a request in flight) renewed until the returned guard is
    /// dropped: with every lease this limiter holds, every third of the shortest lease time
    /// (needs a tokio runtime; without one they end at their lease time).
    pub(crate) fn hold(&self, leases: &[Lease]) -> Hold {
        let start = {
            let mut state = self.inner.renewals.lock();
            for l in leases {
                state.held.insert(l.id, l.clone());
            }
            !std::mem::replace(&mut state.running, true)
        };
        if start {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let start = tokio::time::Instant::now();
                    runtime.spawn(renew_held(std::sync::Arc::downgrade(&self.inner), start));
                }
                Err(_) => self.inner.renewals.lock().running = false,
            }
        }
        Hold {
            limiter: std::sync::Arc::downgrade(&self.inner),
            ids: leases.iter().map(|l| l.id).collect(),
        }
    }
}

/// Renews the leases held every third of their shortest lease time, until none is held (or the
/// limiter is gone). A renewal the store cannot make is tried again at the next tick: the
/// leases run to their deadlines meanwhile (warned once until one succeeds).
async fn renew_held(weak: Weak<Inner>, start: tokio::time::Instant) {
    let mut warned = false;
    // Ticks counted from when the first lease was held (not from when the task first runs).
    let mut last = start;
    loop {
        let every = {
            let Some(inner) = weak.upgrade() else { return };
            let mut state = inner.renewals.lock();
            if state.held.is_empty() {
                state.running = false;
                return;
            }
            third_of_lease(state.held.values())
        };
        last += every;
        tokio::time::sleep_until(last).await;
        let Some(inner) = weak.upgrade() else { return };
        let leases: Vec<Lease> = inner.renewals.lock().held.values().cloned().collect();
        if leases.is_empty() {
            continue;
        }
        let renewed = (Limiter { inner }).renew(&leases).await;
        // A tick missed (a busy runtime, a slow store) is not made up in a burst.
        last = last.max(tokio::time::Instant::now() - every);
        match renewed {
            Ok(_) => warned = false,
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e, "could not renew concurrency slots; they end at their lease time unless a later renewal succeeds");
            }
            Err(_) => {}
        }
    }
}
