//! The slots an allowed request holds on concurrency limits, given back when it ends.
//!
//! A [`Release`] owns the request's leases. The response future holds it until the inner
//! service answers, then the response body holds it until its end; whichever way the request
//! ends (the body's end or error, a client that went away, a handler that panicked, a
//! cancelled future) the guard is dropped and the leases are released. A lease that cannot be
//! released (no runtime, the store down) still stops counting at its deadline.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};

use smallvec::SmallVec;

use crate::limiter::{BatchDecision, Lease, Limiter};

/// The leases of one request, released when dropped.
pub(crate) struct Release {
    limiter: Limiter,
    leases: SmallVec<[Lease; 1]>,
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
        Some(Box::new(Self {
            limiter: limiter.clone(),
            leases,
        }))
    }
}

impl Drop for Release {
    /// Releases the leases: at once when the backend answers at once (in memory), else on the
    /// tokio runtime. Without a runtime they stop counting at their deadlines.
    fn drop(&mut self) {
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
