//! What the layer does when the store fails: the policy (fail open, fail closed, or decide
//! in memory at a share of the limits), and the in-memory fallback itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::observe::WarnGate;
use crate::limiter::Limiter;

/// What to do when the backend fails or does not answer within the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Let the request through and log a warning (the default: a rate limiter outage should not
    /// become a service outage).
    #[default]
    FailOpen,
    /// Answer `503 Service Unavailable` with a JSON body.
    FailClosed,
    /// Decide with an in-memory limiter of this instance, at `percent` (1 to 100) of every
    /// limit's rate and burst: an outage neither opens the gates nor closes the shop. With N
    /// instances, `100 / N` keeps the whole fleet near the configured limits. Buckets start
    /// full when the fallback begins, and what it spends is not carried back to the store,
    /// except concurrency slots still in use: those are recorded in the store within a second
    /// of its return, so every instance counts them until they end.
    FallbackToMemory {
        /// The share of each limit every instance grants on its own, from 1 to 100.
        percent: u8,
    },
}

/// The in-memory limiter of `FailurePolicy::FallbackToMemory`: the main limiter's limits at
/// `percent`, scaled again after each reload.
pub(crate) struct Fallback {
    percent: u8,
    limiter: Limiter,
    /// The main limiter's generation the scaled limits were made from.
    generation: AtomicU64,
}

impl Fallback {
    /// A fallback deciding `scaled` (the main limits at `percent`) in memory, made from the
    /// main limiter's `generation`.
    pub(crate) fn new(percent: u8, scaled: crate::config::Limits, generation: u64) -> Self {
        Self {
            percent,
            limiter: Limiter::fallback(scaled),
            generation: AtomicU64::new(generation),
        }
    }

    /// The fallback limiter, following a reload of `main` first if there was one.
    pub(crate) fn limiter(&self, main: &Limiter) -> &Limiter {
        let current = main.generation();
        if self.generation.load(Ordering::Acquire) != current {
            self.generation.store(current, Ordering::Release);
            match main.limits().scaled(self.percent) {
                Ok(scaled) => {
                    if let Err(e) = self.limiter.reload(scaled) {
                        tracing::warn!(target: crate::telemetry::target::RELOAD, error = %e, "in-memory fallback keeps its previous limits");
                    }
                }
                Err(e) => {
                    tracing::warn!(target: crate::telemetry::target::RELOAD, error = %e, "reloaded limits do not scale; the in-memory fallback keeps its previous limits");
                }
            }
        }
        &self.limiter
    }
}

/// The layer's failure handling: its policy, the fallback limiter of
/// [`FailurePolicy::FallbackToMemory`], the backend timeout, and the gate that lets one warning
/// through per interval.
pub(crate) struct OnFailure {
    pub(crate) policy: FailurePolicy,
    pub(crate) fallback: Option<Fallback>,
    pub(crate) timeout: Duration,
    pub(crate) warn_gate: Arc<WarnGate>,
}
