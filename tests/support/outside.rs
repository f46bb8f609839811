//! A backend written outside the crate, as a user would write one for another store: a
//! `Mutex<HashMap>` of states, deciding with the public batch kit (`tower_ratelimits::kit`)
//! only. It reads a batch's states, lets the kit decide, and writes what the kit says, all under
//! one lock (so a batch is atomic). `tests/conformance.rs` holds it to memory's decisions.

use std::collections::HashMap;
use std::sync::Mutex;

use tower_ratelimits::kit::{self, Stored};
use tower_ratelimits::{Backend, BackendError, BucketKey, BucketTx, Clock, Outcomes, Quota, Spend};

/// A bucket's key in the map: where the kit keeps its state (its limit and id, or the limit's
/// own key for a shape kept per limit, `kit::state_key`), and the shape of its state (a limit
/// that changes shape in a reload starts afresh, as the Redis backend's suffixed keys do).
type Slot = (BucketKey, u8);

fn slot(tx: &BucketTx<'_>) -> Slot {
    let shape = match tx.quota() {
        Quota::Gcra(_) => 0,
        Quota::Tiered(_) => 1,
        Quota::Concurrency(_) => 2,
        Quota::FairShare(_) => 4,
        _ => 3,
    };
    (kit::state_key(tx).into_owned(), shape)
}

pub struct Outside<C> {
    clock: C,
    states: Mutex<HashMap<Slot, Stored>>,
}

impl<C: Clock> Outside<C> {
    pub fn new(clock: C) -> Self {
        Self {
            clock,
            states: Mutex::new(HashMap::new()),
        }
    }

    fn states(&self) -> std::sync::MutexGuard<'_, HashMap<Slot, Stored>> {
        self.states.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[tower_ratelimits::async_trait]
impl<C: Clock> Backend for Outside<C> {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        let now = self.clock.now_us();
        let mut states = self.states();
        let slots: Vec<Slot> = batch.iter().map(slot).collect();
        let read: Vec<_> = slots
            .iter()
            .map(|s| states.get(s).map(Stored::read))
            .collect();
        let spent = match kit::spend(batch, &read, now) {
            Ok(spent) => spent,
            Err(e) => return Spend::Ready(Err(e)),
        };
        for (s, write) in slots.into_iter().zip(spent.writes) {
            if let Some(state) = write {
                states.insert(s, state);
            }
        }
        Spend::Ready(Ok(spent.outcomes))
    }

    /// The kit decides a penalty's companions at their own `kit::state_key`.
    fn decides_penalties(&self) -> bool {
        true
    }

    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        let now = self.clock.now_us();
        let mut states = self.states();
        let mut outcomes = Outcomes::with_capacity(batch.len());
        for tx in batch {
            let s = slot(tx);
            let r = kit::refund(tx, states.get(&s).map(Stored::read), now)?;
            if let Some(state) = r.write {
                states.insert(s, state);
            }
            outcomes.push_tiered(r.outcome, r.tiers);
        }
        Ok(outcomes)
    }

    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        // What a reset keeps (a concurrency key's live leases: requests in flight) stays.
        let now = self.clock.now_us();
        let mut states = self.states();
        let hit: Vec<Slot> = states
            .keys()
            .filter(|(key, _)| keys.contains(&key))
            .cloned()
            .collect();
        for s in hit {
            if let Some(state) = states.remove(&s)
                && let Some((kept, _)) = kit::after_reset(state, now)
            {
                states.insert(s, kept);
            }
        }
        Ok(())
    }
}
