//! Wait instead of reject: a request that would be denied, whose wait is short enough, sleeps
//! exactly that wait and is decided again. The rule of when a request waits lives here, once
//! (`Shared::wait_for`); the response future only sleeps.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::rate_limit_layer::Shared;
use crate::limiter::BatchDecision;

/// The default cap on requests waiting at once for one rule.
const DEFAULT_MAX_WAITING: usize = 1024;

/// How long a rule's requests may wait instead of being refused ([`Rule::wait`]).
///
/// A request the rule would deny, whose `retry_after` is within `up_to` (counted from its
/// first denial), sleeps exactly that `retry_after` (the GCRA or tier arithmetic's, with no
/// polling) and is then decided again, against whatever arrived meanwhile. While it sleeps it
/// holds no lock, no connection and nothing of the store: it has spent nothing, so a client
/// that goes away while waiting costs nothing. Beyond the bound, or when `max_waiting`
/// requests of the rule are already waiting, it is refused as it would have been.
///
/// **Fairness**: waiters are not queued. Each wakes when its own wait ends and competes with
/// every request decided at that instant; one that loses waits again, for as long as its bound
/// still allows. Several requests denied together are told the same wait, wake together, and
/// the units that came back go to the first decided: roughly first come, first served, never
/// guaranteed.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{ClientIp, Rule, Wait};
/// // Webhook deliveries are slowed by up to 2 s rather than refused; at most 100 wait at once.
/// let rule = Rule::new("WebhooksPerIp", ClientIp::new())
///     .wait(Wait::up_to(Duration::from_secs(2)).max_waiting(100));
/// ```
///
/// [`Rule::wait`]: crate::Rule::wait
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    pub(crate) up_to: Duration,
    pub(crate) max_waiting: usize,
}

impl Wait {
    /// Waits of at most `max` in all (a request may be decided several times within it); at
    /// most 1,024 requests of the rule waiting at once.
    pub fn up_to(max: Duration) -> Self {
        Self {
            up_to: max,
            max_waiting: DEFAULT_MAX_WAITING,
        }
    }

    /// At most `n` requests of the rule waiting at once; the next one is refused (`0`: none
    /// ever waits).
    pub fn max_waiting(mut self, n: usize) -> Self {
        self.max_waiting = n;
        self
    }

    /// The longest a request waits in all.
    pub fn max_wait(&self) -> Duration {
        self.up_to
    }
}

/// A place among a rule's waiting requests, given back when dropped (the request was decided
/// again, answered, or went away).
pub(crate) struct WaitPermit {
    shared: Arc<Shared>,
    rule: usize,
}

impl Drop for WaitPermit {
    fn drop(&mut self) {
        if let Some(r) = self.shared.rules.get(self.rule) {
            let left = r.waiting.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
            crate::telemetry::waiting(r.name, left);
        }
    }
}

impl Shared {
    /// Whether a denied `batch` waits, and how long: every counting rule that denied has a
    /// [`Wait`], the batch's `retry_after` (its strictest denial's, the longest) is above zero
    /// and within what is left of each such rule's bound (`since`: the request's first
    /// denial), and the strictest rule has room for one more waiting request. The place is
    /// taken (or kept: `held`, from an earlier wait of the same request) and returned with the
    /// wait.
    pub(crate) fn wait_for(
        self: &Arc<Self>,
        batch: &BatchDecision,
        since: Option<Instant>,
        held: Option<WaitPermit>,
    ) -> Option<(Duration, WaitPermit)> {
        let strictest = batch.strictest()?;
        let delay = strictest.retry_after;
        // Sleeping needs tokio's timer; with no runtime the request is refused as before.
        if strictest.allowed || delay.is_zero() || tokio::runtime::Handle::try_current().is_err() {
            return None;
        }
        let waited = since.map_or(Duration::ZERO, |s| s.elapsed());
        let mut rule_of_strictest = None;
        for d in batch.decisions() {
            if d.allowed || !d.counts() {
                continue;
            }
            // A slot frees when a request ends, which no wait can know: never waited for.
            if d.limit
                .as_ref()
                .is_some_and(|l| l.as_concurrency().is_some())
            {
                return None;
            }
            let i = self.rules.iter().position(|r| r.name == d.name)?;
            let wait = self.rules[i].rule.wait?;
            if !crate::limiter::may_wait(waited, delay, wait.up_to) {
                crate::telemetry::wait_refused(d.name, "too_long");
                return None;
            }
            if std::ptr::eq(d, strictest) {
                rule_of_strictest = Some((i, wait));
            }
        }
        let (rule, wait) = rule_of_strictest?;
        if let Some(permit) = held.filter(|p| p.rule == rule) {
            crate::telemetry::waited(strictest.name);
            return Some((delay, permit));
        }
        let r = &self.rules[rule];
        let taken = r
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < wait.max_waiting).then_some(n + 1)
            });
        match taken {
            Ok(before) => {
                crate::telemetry::waited(strictest.name);
                crate::telemetry::waiting(r.name, before + 1);
                Some((
                    delay,
                    WaitPermit {
                        shared: self.clone(),
                        rule,
                    },
                ))
            }
            Err(_) => {
                crate::telemetry::wait_refused(strictest.name, "full");
                None
            }
        }
    }
}
