//! Wait instead of reject: a request that would be denied, whose wait is short enough, sleeps
//! exactly that wait and is decided again. The rule of when a request waits lives once, in
//! `Rules::wait_for` (`rule.rs`), which takes places here; the response future only sleeps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::key::{BucketKey, LimitName};

/// The default cap on requests waiting at once for one rule.
const DEFAULT_MAX_WAITING: usize = 1024;

/// The default cap on requests waiting at once for one key of a rule.
const DEFAULT_MAX_WAITING_PER_KEY: usize = 32;

/// How long a rule's requests may wait instead of being refused ([`Rule::wait`]).
///
/// A request the rule would deny, whose `retry_after` is within `up_to` (counted from its
/// first denial), sleeps exactly that `retry_after` (the GCRA or tier arithmetic's, with no
/// polling) and is then decided again, against whatever arrived meanwhile. While it sleeps it
/// holds no lock, no connection and nothing of the store: it has spent nothing, so a client
/// that goes away while waiting costs nothing. Beyond the bound, or when `max_waiting`
/// requests of the rule are already waiting, it is refused as it would have been.
///
/// **Order**: the waiters of one key wake one per unit that frees, in the order they arrived
/// (per instance): the first when its own wait ends, each next one when the units it needs
/// after the one before it have come back (on a GCRA limit; on a tiered limit each wakes when
/// its own wait ends). A waiter that wakes while the line knows its units are not back yet
/// (the store's last answer to the line, or another waiter gone to the store for them) sleeps
/// on without a call: the waiters of one instance never race each other to the store. So each
/// waiter goes to the store about once more, when its units are there. One that still loses
/// them (to a request that did not wait, or to another instance) waits again behind the key's
/// line, for as long as its bound allows. A wait the line would
/// stretch beyond the bound is refused at once. At most
/// [`max_waiting_per_key`](Self::max_waiting_per_key) requests of one key wait at once (32 by
/// default), so one client cannot take every place of the rule.
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
    pub(crate) max_waiting_per_key: usize,
}

impl Wait {
    /// Waits of at most `max` in all (a request may be decided several times within it); at
    /// most 1,024 requests of the rule waiting at once.
    pub fn up_to(max: Duration) -> Self {
        Self {
            up_to: max,
            max_waiting: DEFAULT_MAX_WAITING,
            max_waiting_per_key: DEFAULT_MAX_WAITING_PER_KEY,
        }
    }

    /// At most `n` requests of one key (one client, one account) waiting at once; the next
    /// one of that key is refused (default 32).
    pub fn max_waiting_per_key(mut self, n: usize) -> Self {
        self.max_waiting_per_key = n;
        self
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

/// A rule's waiting requests: how many wait now, counted against its [`Wait::max_waiting`],
/// and each key's line (its waiters and when the last of them wakes).
pub(crate) struct Waiting {
    name: LimitName,
    count: AtomicUsize,
    /// The keys with waiters. Held only to read or change a line, never across an await.
    lines: Mutex<HashMap<BucketKey, Line>>,
}

/// One key's waiting requests.
struct Line {
    waiters: usize,
    /// When the last waiter scheduled wakes.
    last_wake: Instant,
    /// Before this, the key's next unit is not free on this instance's latest word: the store's
    /// last answer to a waiter of the line, or a waiter's claim as it goes to the store (its
    /// unit, then one more interval). A waiter that wakes before it sleeps until it, without a
    /// call: the waiters of one instance never race each other to the store for one unit.
    free_at: Instant,
    /// The time the units of one waiter take to come back (zero when unknown: a tiered limit).
    interval: Duration,
}

/// Why a request may not wait after all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The rule has its most waiting requests.
    Full,
    /// Its key has its most waiting requests.
    KeyFull,
    /// The key's line would wake it beyond its bound.
    TooLong,
}

impl Refused {
    pub(crate) fn outcome(self) -> &'static str {
        match self {
            Refused::Full => "full",
            Refused::KeyFull => "key_full",
            Refused::TooLong => "too_long",
        }
    }
}

/// When a request joins a key's line: its own wait (`delay`, the store's), the units it
/// needs after the waiter before it (`interval`: the time they take to come back; zero when
/// unknown), and the most it may sleep (`room`, what is left of its bound).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Join {
    pub(crate) delay: Duration,
    pub(crate) interval: Duration,
    pub(crate) room: Duration,
}

impl Waiting {
    pub(crate) fn new(name: LimitName) -> Arc<Self> {
        Arc::new(Self {
            name,
            count: AtomicUsize::new(0),
            lines: Mutex::new(HashMap::new()),
        })
    }

    /// A place in `key`'s line, and how long to sleep: the first waiter of a key its own
    /// `delay`; a later one until its units are back after the waiter before it. `held`: the
    /// place of this request from an earlier wait (it lost its units and joins again, behind
    /// the line). Refused when the rule has `wait.max_waiting` waiters, the key
    /// `wait.max_waiting_per_key`, or the sleep would exceed `join.room`.
    pub(crate) fn join(
        self: &Arc<Self>,
        wait: &super::Wait,
        key: &BucketKey,
        join: Join,
        held: Option<WaitPermit>,
    ) -> Result<(Duration, WaitPermit), Refused> {
        // A place from another rule or key is given back first (its drop takes its lock).
        let held = held.filter(|p| Arc::ptr_eq(&p.places, self) && p.key == *key);
        let is_new = held.is_none();
        let now = Instant::now();
        let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        let line = lines.get(key);
        // The waiters before this one (a held place is one of the line's).
        let ahead = line.map_or(0, |l| l.waiters) - usize::from(!is_new);
        let own = now + join.delay;
        // A new waiter queues behind the line; one that woke and lost its unit (to a request
        // that did not wait, or another instance) keeps its place at the front: it wakes when
        // the store says, and the gate below keeps the line's waiters from racing it.
        let wake = match line {
            Some(l) if ahead > 0 => own.max(l.last_wake + join.interval),
            _ => own,
        };
        let refused = if is_new && ahead >= wait.max_waiting_per_key {
            Some(Refused::KeyFull)
        } else if wake - now > join.room {
            Some(Refused::TooLong)
        } else if is_new
            && self
                .count
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < wait.max_waiting).then_some(n + 1)
                })
                .is_err()
        {
            Some(Refused::Full)
        } else {
            None
        };
        if let Some(refused) = refused {
            // Unlocked before a held place is dropped: its drop takes the lock.
            drop(lines);
            drop(held);
            return Err(refused);
        }
        let line = lines.entry(key.clone()).or_insert(Line {
            waiters: 0,
            last_wake: wake,
            free_at: own,
            interval: join.interval,
        });
        line.last_wake = line.last_wake.max(wake);
        // The store's word on this key: its next unit is not free before `own`.
        line.free_at = line.free_at.max(own);
        line.interval = join.interval;
        let permit = match held {
            Some(permit) => permit,
            None => {
                line.waiters += 1;
                crate::telemetry::waiting(self.name, self.count.load(Ordering::Acquire));
                WaitPermit {
                    places: self.clone(),
                    key: key.clone(),
                }
            }
        };
        Ok((wake - now, permit))
    }
}

/// A place among a rule's waiting requests and in its key's line, given back when dropped
/// (the request was decided again, answered, or went away).
pub(crate) struct WaitPermit {
    places: Arc<Waiting>,
    key: BucketKey,
}

impl WaitPermit {
    /// A waiter woke: `None` when it goes to the store now (and claims the line's next unit:
    /// the line's other waiters wait one interval more, or for the store's answer); else how
    /// long to sleep first, without a call (the line knows its unit is not free yet).
    pub(crate) fn turn(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut lines = self
            .places
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let line = lines.get_mut(&self.key)?;
        if line.free_at > now {
            return Some(line.free_at - now);
        }
        line.free_at = now + line.interval;
        None
    }

    /// A waiter of the line was allowed: the key's next unit is free `retry_after` from now
    /// (the store's word).
    pub(crate) fn admitted(&self, retry_after: Duration) {
        let mut lines = self
            .places
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(line) = lines.get_mut(&self.key) {
            line.free_at = Instant::now() + retry_after;
        }
    }

    /// The key of the line.
    pub(crate) fn key(&self) -> &BucketKey {
        &self.key
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
        let mut lines = self
            .places
            .lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(line) = lines.get_mut(&self.key) {
            line.waiters = line.waiters.saturating_sub(1);
            if line.waiters == 0 {
                lines.remove(&self.key);
            }
        }
    }
}
