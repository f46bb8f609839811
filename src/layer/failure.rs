//! What the layer does when the store fails: the policy (fail open, fail closed, or decide
//! in memory at a share of the limits), and the in-memory fallback itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::charge::Ledger;
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
    /// instances, `100 / N` keeps the whole fleet near the configured limits. A calendar quota
    /// and a GCRA limit of an hour or longer start from `percent`% of what the store last told
    /// this instance was left, and what the fallback grants them is charged to the store once
    /// it answers again, before it decides another request of that key from this instance
    /// (docs/operating.md, "What an outage grants"); other limits start full, and what they
    /// spend is not carried back. Concurrency slots still in use are recorded in the store
    /// within a second of its return, so every instance counts them until they end.
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
    /// What the store last said of the keys whose units outlive an outage, and what this
    /// fallback granted them, owed to the store (`charge.rs`).
    pub(crate) ledger: Arc<Ledger>,
    /// The main limiter's generation the scaled limits were made from.
    generation: AtomicU64,
}

impl Fallback {
    /// A fallback deciding `scaled` (the main limits at `percent`) in memory by `main`'s
    /// clock, made from its `generation`; a charge to its store waits at most `timeout`.
    pub(crate) fn new(
        percent: u8,
        scaled: crate::config::Limits,
        main: &Limiter,
        timeout: Duration,
    ) -> Self {
        let clock = main.backend().clock();
        let (limiter, bans) = Limiter::fallback(scaled, clock.clone(), main.backend().regional());
        Self {
            percent,
            limiter,
            ledger: Arc::new(Ledger::new(percent, clock, timeout, bans)),
            generation: AtomicU64::new(main.generation()),
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

impl OnFailure {
    /// The fallback's ledger, when the layer has a fallback.
    #[inline]
    pub(crate) fn ledger(&self) -> Option<&Arc<Ledger>> {
        self.fallback.as_ref().map(|f| &f.ledger)
    }
}
