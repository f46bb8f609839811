//! The slots an allowed request holds on concurrency limits, given back when it ends.
//!
//! A [`Release`] owns the request's leases. The response future holds it until the inner
//! service answers, then the response body holds it until its end; whichever way the request
//! ends (the body's end or error, a client that went away, a handler that panicked, a
//! cancelled future) the guard is dropped and the leases are released. While it lives, a task
//! renews the leases every third of their lease time ([`Limiter::renew`]), so a request longer
//! than the lease time keeps its slots; the lease time bounds only the slots of an instance
//! that died. A lease that cannot be released (no runtime, the store down) still stops
//! counting at its deadline.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};
use std::time::Duration;

use smallvec::SmallVec;

use crate::limiter::{BatchDecision, Lease, Limiter};

/// The leases of one request, renewed while it lives and released when dropped.
pub(crate) struct Release {
    limiter: Limiter,
    leases: SmallVec<[Lease; 1]>,
    /// The task renewing the leases (none without a runtime: they end at their lease time).
    renewer: Option<tokio::task::AbortHandle>,
}

impl Release {
    /// The leases `batch` (allowed, decided by `limiter`) holds; `None` when it holds none.
    pub(crate) fn of(limiter: &Limiter, batch: &BatchDecision) -> Option<Box<Self>> {
        // Most requests hold no slot: one pass over the ids, nothing built.
        if batch.decisions().iter().all(|d| d.lease_id.is_none()) {
            return None;
        }
        let leases: SmallVec<[Lease; 1]> =
            batch.decisions().iter().filter_map(|d| d.lease()).collect();
        if leases.is_empty() {
            return None;
        }
        let renewer = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            runtime
                .spawn(renew(limiter.clone(), leases.clone()))
                .abort_handle()
        });
        Some(Box::new(Self {
            limiter: limiter.clone(),
            leases,
            renewer,
        }))
    }
}

/// Renews `leases` every third of their shortest lease time (at least every millisecond),
/// until aborted. A renewal the store cannot make is warned about (once, until one succeeds
/// again) and tried again at the next tick: the leases run to their deadlines meanwhile.
async fn renew(limiter: Limiter, leases: SmallVec<[Lease; 1]>) {
    let lease_us = leases
        .iter()
        .filter_map(|l| l.limit().map(|c| c.lease_us()))
        .min()
        .unwrap_or(u64::MAX);
    let every = Duration::from_micros((lease_us / 3).max(1_000));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    loop {
        ticks.tick().await;
        match limiter.renew(&leases).await {
            Ok(_) => warned = false,
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(error = %e, "could not renew concurrency slots; they end at their lease time unless a later renewal succeeds");
            }
            Err(_) => {}
        }
    }
}

impl Drop for Release {
    /// Releases the leases: at once when the backend answers at once (in memory), else on the
    /// tokio runtime. Without a runtime they stop counting at their deadlines.
    fn drop(&mut self) {
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
        let limiter = self.limiter.clone();
        let leases = std::mem::take(&mut self.leases);
        let mut release: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
            if let Err(e) = limiter.release(&leases).await {
                tracing::warn!(error = %e, "could not release concurrency slots; they end at their lease time");
            }
        });
        if release
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready()
        {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(release);
            }
            Err(_) => tracing::warn!(
                "concurrency slots released with no runtime to release them on; they end at their lease time"
            ),
        }
    }
}

/// A request's leases, if it holds any.
pub(crate) type Held = Option<Box<Release>>;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Release;
    use crate::{Id, Limiter, Limits, ManualClock, MemoryBackend, Transaction};

    /// Three streams of 8 s on a limit of 3 with a lease of 3 s keep their three slots the whole
    /// time: at 3.7 s (and at every 100 ms step) a fourth request is denied. Before, the slots
    /// ended at 3 s under live streams and three more requests were admitted (six in flight).
    /// Once the streams end their slots are free at once.
    #[tokio::test(start_paused = true)]
    async fn a_live_request_keeps_its_slots_past_the_lease_time() {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = MemoryBackend::builder().clock(clock.clone()).build();
        let limits = Limits::from_yaml_str("Streams: {concurrency: 3, lease: 3s}", None).unwrap();
        let limiter = Limiter::new(limits, backend.clone());
        let key = limiter.key("Streams", Id::from(7u64)).unwrap();
        let tx = || Transaction::new(key.clone());
        let mut streams = Vec::new();
        for _ in 0..3 {
            let batch = limiter.spend(&[tx()]).await.unwrap();
            assert!(batch.allowed());
            streams.push(Release::of(&limiter, &batch).unwrap());
        }
        let step = Duration::from_millis(100);
        for n in 1..=80 {
            clock.advance(step);
            tokio::time::advance(step).await;
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            assert_eq!(backend.leases(&key), 3, "at {} ms", n * 100);
            let fourth = limiter.check(&[tx()]).await.unwrap();
            assert!(
                !fourth.allowed(),
                "at {} ms a fourth request passed",
                n * 100
            );
        }
        drop(streams);
        assert_eq!(backend.leases(&key), 0);
        assert!(limiter.check(&[tx()]).await.unwrap().allowed());
    }

    /// A renewal never takes a slot: a lease that ended (or was released) stays ended.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_never_brings_back_an_ended_lease() {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = MemoryBackend::builder().clock(clock.clone()).build();
        let limits = Limits::from_yaml_str("Streams: {concurrency: 1, lease: 3s}", None).unwrap();
        let limiter = Limiter::new(limits, backend.clone());
        let key = limiter.key("Streams", Id::from(7u64)).unwrap();
        let batch = limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        let leases: Vec<_> = batch.decisions().iter().filter_map(|d| d.lease()).collect();
        clock.advance(Duration::from_secs(3));
        assert_eq!(limiter.renew(&leases).await.unwrap(), 0);
        assert_eq!(backend.leases(&key), 0);
    }
}
