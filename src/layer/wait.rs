//! Wait instead of reject: a request that would be denied, whose wait is short enough, sleeps
//! exactly that wait and is decided again. The rule of when a request waits lives once, in
//! `Rules::wait_for` (`rule.rs`), which takes places here; the response future only sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::key::LimitName;

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

/// A rule's waiting requests: how many wait now, counted against its [`Wait::max_waiting`].
pub(crate) struct Waiting {
    name: LimitName,
    count: AtomicUsize,
}

impl Waiting {
    pub(crate) fn new(name: LimitName) -> Arc<Self> {
        Arc::new(Self {
            name,
            count: AtomicUsize::new(0),
        })
    }

    /// A place among the rule's waiting requests, when fewer than `max` wait.
    pub(crate) fn take(self: &Arc<Self>, max: usize) -> Option<WaitPermit> {
        let before = self
            .count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        crate::telemetry::waiting(self.name, before + 1);
        Some(WaitPermit {
            places: self.clone(),
        })
    }
}

/// A place among a rule's waiting requests, given back when dropped (the request was decided
/// again, answered, or went away).
pub(crate) struct WaitPermit {
    places: Arc<Waiting>,
}

impl WaitPermit {
    /// Whether this is a place among `places`.
    pub(crate) fn is_among(&self, places: &Arc<Waiting>) -> bool {
        Arc::ptr_eq(&self.places, places)
    }
}

impl Drop for WaitPermit {
    fn drop(&mut self) {
        let left = self
            .places
            .count
            .fetch_sub(1, Ordering::AcqRel)
            .saturating_sub(1);
        crate::telemetry::waiting(self.places.name, left);
    }
}
