//! A prefetching batch's road: planned from the pools, waiting for a refill under way, finished
//! from the store's answer, undone when dropped; the sweeper that gives idle pools back.

use super::*;

/// One step per transaction of a batch (inline for the commonest batch, one rule).
pub(super) type Steps = smallvec::SmallVec<[Step; 1]>;

/// What goes to the store: every transaction but those served from a pool, a refill as the
/// range it asks.
pub(super) fn remote_of<'a>(batch: &[BucketTx<'a>], steps: &[Step]) -> Vec<BucketTx<'a>> {
    batch
        .iter()
        .zip(steps)
        .filter_map(|(tx, step)| match *step {
            Step::Take(..) => None,
            Step::Refill { lo, hi, .. } => Some(BucketTx {
                cost: hi,
                min_cost: lo,
                ..*tx
            }),
            _ => Some(*tx),
        })
        .collect()
}

impl Pools {
    /// Gives back what the steps of a batch that was not decided took from the pools.
    pub(super) fn undo_all(&self, batch: &[BucketTx<'_>], steps: &[Step]) {
        for (tx, step) in batch.iter().zip(steps) {
            self.undo(tx.key, step);
        }
    }

    /// The batch's outcomes from the store's `remote` outcomes (none when every transaction
    /// was served from a pool), with the pools updated: the tokens a refill brought in, or
    /// what a denied batch took back.
    pub(super) fn finish(
        &self,
        batch: &[BucketTx<'_>],
        steps: &[Step],
        remote: Outcomes,
        now: u64,
    ) -> Outcomes {
        let allowed = batch_allowed(remote_of(batch, steps).iter().zip(&remote));
        let mut remote = remote.into_tiered();
        let skip = || (Outcome::skip(), None);
        let mut outcomes = Outcomes::with_capacity(batch.len());
        for (tx, step) in batch.iter().zip(steps) {
            let outcome = match step {
                Step::Take(_, view) => {
                    if allowed {
                        crate::telemetry::prefetch_local_decision(tx.key.name(), true);
                    } else {
                        self.undo(tx.key, step);
                    }
                    (*view, None)
                }
                Step::Plain | Step::Refill { .. } => {
                    let (o, grant) = remote.next().unwrap_or_else(skip);
                    (self.finish_one(tx.key, step, o, allowed, now), grant)
                }
                _ => remote.next().unwrap_or_else(skip),
            };
            outcomes.push_tiered(outcome.0, outcome.1);
        }
        outcomes
    }
}

/// A prefetching batch on its way to the store: its own copy of the batch (the future
/// outlives the one it was asked for) and the steps it took from the pools, given back when
/// dropped unless finished (a failed or abandoned call takes nothing).
pub(super) struct Sent {
    backend: RedisBackend,
    owned: Vec<OwnedTx>,
    steps: Steps,
    done: bool,
}

impl Drop for Sent {
    fn drop(&mut self) {
        if !self.done {
            let batch: Vec<BucketTx<'_>> = self.owned.iter().map(OwnedTx::tx).collect();
            self.backend.inner.pools.undo_all(&batch, &self.steps);
        }
    }
}

impl Sent {
    /// One call with the batch's other transactions and its refills; the batch's outcomes.
    pub(super) async fn send(mut self) -> Result<Outcomes, BackendError> {
        let (now, local_now) = self.backend.now_arg()?;
        let batch: Vec<BucketTx<'_>> = self.owned.iter().map(OwnedTx::tx).collect();
        let remote = remote_of(&batch, &self.steps);
        let answer = self.backend.spend_remote(&remote, now, local_now).await?;
        let outcomes = self
            .backend
            .inner
            .pools
            .finish(&batch, &self.steps, answer, local_now);
        self.done = true;
        Ok(outcomes)
    }
}

/// A prefetching batch, planned from the pools: decided here, waiting for a refill under way
/// (nothing taken), or for the store (its steps took from the pools: hand them to a [`Sent`]
/// at once).
pub(super) enum Planned {
    Decided(Result<Outcomes, BackendError>),
    /// Waits for the refill of the key of transaction `i`, of generation `g`, to end.
    Wait(usize, Arc<Notify>, u64),
    Remote(Steps),
}

impl RedisBackend {
    /// A batch with a prefetching transaction (or a charge that drops a pool): decided from
    /// the pools when they can (no copy of the batch, no box), else one call that also
    /// refills them.
    pub(in crate::backend::redis) fn spend_prefetching(
        &self,
        batch: &[BucketTx<'_>],
        local_now: u64,
    ) -> Spend {
        // The batch is copied (owned by the future) only when it goes to the store or waits.
        let owned = || -> Vec<OwnedTx> { batch.iter().map(OwnedTx::of).collect() };
        match self.plan(batch, local_now) {
            Planned::Decided(r) => Spend::Ready(r),
            Planned::Remote(steps) => {
                let sent = self.sent(owned(), steps);
                Spend::Pending(Box::pin(sent.send()))
            }
            Planned::Wait(i, notify, generation) => {
                let (this, owned) = (self.clone(), owned());
                Spend::Pending(Box::pin(async move {
                    this.after_refill(owned, i, notify, generation).await
                }))
            }
        }
    }

    pub(super) fn sent(&self, owned: Vec<OwnedTx>, steps: Steps) -> Sent {
        Sent {
            backend: self.clone(),
            owned,
            steps,
            done: false,
        }
    }

    /// Waits for the refill under way on `owned[i]`'s key, then plans the batch again.
    pub(super) async fn after_refill(
        &self,
        owned: Vec<OwnedTx>,
        mut i: usize,
        mut notify: Arc<Notify>,
        mut generation: u64,
    ) -> Result<Outcomes, BackendError> {
        loop {
            {
                let notified = notify.notified();
                let mut notified = std::pin::pin!(notified);
                notified.as_mut().enable();
                if self.inner.pools.generation(&owned[i].key) == Some(generation) {
                    notified.await;
                }
            }
            let (_, local_now) = self.now_arg()?;
            let planned = {
                let batch: Vec<BucketTx<'_>> = owned.iter().map(OwnedTx::tx).collect();
                self.plan(&batch, local_now)
            };
            match planned {
                Planned::Decided(r) => return r,
                Planned::Remote(steps) => return self.sent(owned, steps).send().await,
                Planned::Wait(next, n, g) => (i, notify, generation) = (next, n, g),
            }
        }
    }

    /// Each transaction's step from its key's pool at `local_now`, and what follows.
    pub(super) fn plan(&self, batch: &[BucketTx<'_>], local_now: u64) -> Planned {
        let pools = &self.inner.pools;
        let steps: Steps = batch
            .iter()
            .enumerate()
            .map(|(i, tx)| {
                if drops_pool(tx) {
                    pools.drop_units(tx.key);
                }
                // A key twice in one batch (two rules of one limit) is decided by the store
                // after its first transaction: one step per pool and batch.
                let again = batch[..i].iter().any(|earlier| earlier.key == tx.key);
                match eligible(tx) {
                    Some(limit) if !again => pools.step(tx, limit, local_now),
                    _ => Step::Store,
                }
            })
            .collect();
        // The table's idle keys leave it (and expired tokens go back) by the sweeper's hand.
        if !pools.sweeping.load(Ordering::Relaxed) && !pools.is_empty() {
            self.ensure_sweeper();
        }
        // A local denial decides the batch (all or nothing), as the deny cache's does.
        if steps.iter().any(|s| matches!(s, Step::Deny(_))) {
            pools.undo_all(batch, &steps);
            let outcomes = batch
                .iter()
                .zip(&steps)
                .map(|(tx, step)| match step {
                    Step::Deny(o) => {
                        crate::telemetry::prefetch_local_decision(tx.key.name(), false);
                        *o
                    }
                    _ => Outcome::skip(),
                })
                .collect();
            return Planned::Decided(Ok(outcomes));
        }
        let waiting = steps.iter().enumerate().find_map(|(i, s)| match s {
            Step::Wait(notify, generation) => Some((i, notify.clone(), *generation)),
            _ => None,
        });
        if let Some((i, notify, generation)) = waiting {
            pools.undo_all(batch, &steps);
            return Planned::Wait(i, notify, generation);
        }
        if steps.iter().all(|s| matches!(s, Step::Take(..))) {
            return Planned::Decided(Ok(pools.finish(batch, &steps, Outcomes::new(), local_now)));
        }
        if let Some(cache) = &self.inner.cache
            && let Some(answer) = cache.answer(&remote_of(batch, &steps), local_now)
        {
            pools.undo_all(batch, &steps);
            return Planned::Decided(answer.map(|remote| {
                let mut remote = remote.into_tiered();
                steps
                    .iter()
                    .map(|s| match s {
                        Step::Take(..) => (Outcome::skip(), None),
                        _ => {
                            let (mut o, grant) = remote.next().unwrap_or((Outcome::skip(), None));
                            o.granted = None;
                            (o, grant)
                        }
                    })
                    .collect()
            }));
        }
        Planned::Remote(steps)
    }

    /// Starts the task that gives back expired prefetched tokens, unless it runs.
    pub(super) fn ensure_sweeper(&self) {
        let pools = &self.inner.pools;
        if pools.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            pools.sweeping.store(false, Ordering::Release);
            return;
        };
        let weak = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                let Some(inner) = weak.upgrade() else { return };
                let backend = RedisBackend { inner };
                let _ = backend.give_back(false).await;
                let pools = &backend.inner.pools;
                if pools.is_empty() {
                    pools.sweeping.store(false, Ordering::Release);
                    // A pool made since found the task running: look once more.
                    if pools.is_empty() || pools.sweeping.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
            }
        });
    }

    /// Gives back prefetched tokens: the expired ones, or all (`all`); the units given back.
    pub(super) async fn give_back(&self, all: bool) -> Result<u64, BackendError> {
        let (_, local_now) = self.now_arg()?;
        let returned = self.inner.pools.returned(local_now, all);
        if returned.is_empty() {
            return Ok(0);
        }
        let quotas: Vec<Quota> = returned.iter().map(|(_, l, _)| Quota::Gcra(*l)).collect();
        let txs: Vec<BucketTx<'_>> = returned
            .iter()
            .zip(&quotas)
            .map(|((key, _, units), quota)| BucketTx {
                completion: None,
                key,
                quota,
                cost: *units,
                min_cost: *units,
                mode: Mode::CheckAndSpend,
                lease: 0,
                leases: &[],
                floor: None,
                penalty: None,
            })
            .collect();
        match self.refund_batch(&txs).await {
            Ok(_) => Ok(returned
                .iter()
                .map(|(key, _, units)| {
                    crate::telemetry::prefetch_returned(key.name(), *units);
                    units
                })
                .sum()),
            Err(e) => {
                tracing::warn!(target: crate::telemetry::target::BACKEND,
                    error = %e,
                    "could not give back prefetched tokens; they are lost until the buckets refill"
                );
                Err(e)
            }
        }
    }

    /// Gives every prefetched token this backend holds back to the store (call it when the
    /// app shuts down, after the server stopped taking requests): the units given back.
    /// Expired tokens go back by themselves, within 50 ms of their time to live; tokens of an
    /// instance that stops without this are lost to every instance until the buckets refill
    /// (fewer admissions, never more).
    pub async fn return_prefetched(&self) -> Result<u64, BackendError> {
        self.give_back(true).await
    }
}
