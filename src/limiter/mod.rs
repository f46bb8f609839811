//! The [`Limiter`]: limits plus a backend, usable on its own (a job queue, a CLI, an
//! interceptor) or through the tower middleware.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::{ArcSwap, Guard};

use crate::backend::Outcome;
use crate::backend::{Backend, BackendError, BucketTx, Outcomes, Spend, TransactionError};
use crate::config::{Limits, LimitsChange};
use crate::mode::Mode;

pub(crate) use decision::Strictest;
pub use decision::{BatchDecision, Decision, Inspection, Lease};

pub use transaction::Transaction;

mod decision;
mod overrides;
mod renewals;
mod transaction;

pub(crate) use renewals::{Hold, third_of_lease};

use crate::key::{BucketKey, Id, IdError, LimitName};
use crate::quota::Quota;
use crate::time::us;
pub use overrides::OverrideError;
use std::time::Duration;

/// Why the limiter could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LimiterError {
    /// A limit name the configuration does not define.
    #[error("unknown limit {0:?}")]
    UnknownName(String),
    /// The same bucket appears twice in one batch.
    #[error("bucket {0} appears twice in one batch")]
    DuplicateKey(String),
    /// A transaction's cost is larger than its limit's burst (for a tiered limit: its smallest
    /// acceptable grant is larger than the sum of the tiers' limits): it could never be
    /// allowed.
    #[error("limit {name}: cost {cost} exceeds the burst of {burst}")]
    CostAboveBurst {
        /// The limit name.
        name: LimitName,
        /// The cost.
        cost: u64,
        /// The burst.
        burst: u64,
    },
    /// A cost range whose lower end is above its upper end.
    #[error("limit {name}: the cost range {min}..={max} is empty")]
    EmptyCostRange {
        /// The limit name.
        name: LimitName,
        /// The lower end.
        min: u64,
        /// The upper end.
        max: u64,
    },
    /// A cost range on a concurrency limit (a request holds one slot, or probes with cost 0).
    #[error("limit {name}: a concurrency limit takes a cost of 0 or 1, not a range")]
    RangeOnConcurrency {
        /// The limit name.
        name: LimitName,
    },
    /// A renewal ([`Mode::Renew`]) on a limit that holds no slots.
    #[error("limit {name}: only a concurrency limit's leases can be renewed")]
    RenewWithoutSlots {
        /// The limit name.
        name: LimitName,
    },
    /// An id that does not fit the limit's id kind.
    #[error("limit {name}: {source}")]
    InvalidId {
        /// The limit name.
        name: LimitName,
        /// Why the id was refused.
        source: IdError,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The first key that appears twice in `batch`: pairwise for a request's few rules (no
/// allocation), through a hash set beyond that, so a batch of any size costs linear time.
fn first_duplicate(batch: &[Transaction]) -> Option<&BucketKey> {
    const PAIRWISE_UP_TO: usize = 16;
    if batch.len() <= PAIRWISE_UP_TO {
        return batch
            .iter()
            .enumerate()
            .find(|(i, tx)| batch[..*i].iter().any(|other| other.key() == tx.key()))
            .map(|(_, tx)| tx.key());
    }
    let mut seen = std::collections::HashSet::with_capacity_and_hasher(
        batch.len(),
        foldhash::fast::RandomState::default(),
    );
    batch
        .iter()
        .map(Transaction::key)
        .find(|&key| !seen.insert(key))
}

impl LimiterError {
    fn from_transaction(name: LimitName, e: TransactionError) -> Self {
        match e {
            TransactionError::CostAboveBurst { cost, burst } => {
                Self::CostAboveBurst { name, cost, burst }
            }
            TransactionError::EmptyCostRange { min, max } => {
                Self::EmptyCostRange { name, min, max }
            }
            TransactionError::RangeOnConcurrency => Self::RangeOnConcurrency { name },
            TransactionError::RenewWithoutSlots => Self::RenewWithoutSlots { name },
        }
    }
}

struct Inner {
    /// The current limits: read without a lock on the request path, replaced whole by
    /// [`Limiter::reload`].
    limits: ArcSwap<Limits>,
    backend: Arc<dyn Backend>,
    /// Bumped by every reload: what derives from the limits (the fallback's scaled copy)
    /// knows when to follow.
    generation: AtomicU64,
    /// Names that rules of layers built on this limiter use: a reload may not remove them.
    pinned: Mutex<Vec<LimitName>>,
    /// Serialises reloads (the check of the pinned names and the swap are one step).
    reloading: Mutex<()>,
    /// The next lease id, from a random start: unique among the leases of this limiter, and
    /// (with 2^64 starts) apart from other instances' on a shared store.
    next_lease: AtomicU64,
    /// The backend's store of overrides set at run time, if it keeps one.
    store: Option<Arc<dyn crate::backend::OverrideStore>>,
    /// The slots of requests in flight, renewed together.
    renewals: renewals::Renewals,
}

/// A random 64-bit start for lease ids: the standard library's per-process random hash keys,
/// mixed with the time and the process id (no dependency for 8 random bytes).
fn random_start() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Why [`Limiter::reload`] refused new limits; the old ones stay in force.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The new configuration does not define a limit that a rule of a layer built on this
    /// limiter uses.
    #[error("limit {0:?} is used by a rate limit rule and the new configuration removes it")]
    LimitInUse(String),
    /// The new configuration could not be loaded (its location and limit are in the error).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// Decides transactions against a [`Limits`] snapshot, storing state in a [`Backend`].
/// Cheap to clone.
///
/// ```
/// use tower_ratelimits::{Id, Limiter, Limits, Limit, ManualClock, MemoryBackend, Transaction};
/// use std::time::Duration;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let limits = Limits::builder()
///     .limit("Api", Limit::new(2, 2, Duration::from_secs(1)).unwrap())
///     .build()
///     .unwrap();
/// let clock = ManualClock::new(1_000_000);
/// let limiter = Limiter::new(limits, MemoryBackend::builder().clock(clock.clone()).build());
/// let key = limiter.key("Api", Id::new("client-1").unwrap()).unwrap();
/// for _ in 0..2 {
///     assert!(limiter.spend(&[Transaction::new(key.clone())]).await.unwrap().allowed());
/// }
/// let denied = limiter.spend(&[Transaction::new(key.clone())]).await.unwrap();
/// assert!(!denied.allowed());
/// assert_eq!(denied.strictest().unwrap().retry_after(), Duration::from_millis(500));
/// # });
/// ```
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// A batch's per-transaction working data: on the stack for up to 4 transactions (a request's
/// rules), so the request path does not allocate for it.
type Batch<T> = smallvec::SmallVec<[T; 4]>;

/// One transaction of a batch, resolved: its quota (`Q`: borrowed from the limits while the
/// batch is decided at once, owned by a spend under way), mode, cost and lease id (0: none).
struct Resolved<Q> {
    quota: Option<Q>,
    mode: Mode,
    cost: u64,
    lease: u64,
    /// A stored block: seconds until it ends (0: not blocked). Not sent to the backend: denied
    /// here ([`with_blocks`]). In the padding after `mode`: the struct stays 32 bytes.
    block_s: u32,
}

/// Where a batch stands once sent: decided (its [`Verdict`] holds the outcomes), or waiting
/// for a backend spend under way.
pub(crate) enum Step {
    /// Decided: the verdict holds the outcomes, not yet turned into [`Decision`]s
    /// ([`Verdict::decision`]).
    Ready,
    /// The backend must wait: [`Pending::decided`] turns its outcomes into the decision.
    Pending(Pending),
}

/// A batch the backend decided at once, kept as the backend answered it (stack storage, the
/// quotas borrowed from the limits snapshot): read by reference where nothing more is needed
/// (an allowed request's fields and counters), turned into a [`BatchDecision`] otherwise.
pub(crate) struct Verdict<'a> {
    batch: &'a [Transaction],
    resolved: Batch<Resolved<&'a Quota>>,
    outcomes: Outcomes,
    /// The batch rule's answer, taken when the outcomes came.
    allowed: bool,
    op: Op,
    counted: Counted,
}

/// One transaction of a [`Verdict`], by reference.
pub(crate) struct Entry<'v> {
    pub(crate) tx: &'v Transaction,
    /// `None`: the limit is disabled for this id (allowed, nothing stored).
    pub(crate) quota: Option<&'v Quota>,
    pub(crate) mode: Mode,
    pub(crate) outcome: &'v Outcome,
}

impl Entry<'_> {
    /// Whether it takes part in choosing the batch decision (as [`Decision::counts`]).
    pub(crate) fn counts(&self) -> bool {
        self.mode.counts() && self.quota.is_some() && !self.outcome.skipped
    }
}

/// The outcome of a transaction whose limit is disabled for its id.
const DISABLED: Outcome = Outcome {
    allowed: true,
    remaining: u64::MAX,
    retry_after_us: 0,
    reset_after_us: 0,
    tiers: None,
    granted: None,
    skipped: false,
};

impl<'a> Verdict<'a> {
    /// The verdict of `batch`, to be decided by [`Limiter::spend_step`]: built where it will be
    /// read (the caller's stack), so nothing is moved on the way.
    #[inline]
    pub(crate) fn new(batch: &'a [Transaction]) -> Self {
        Self {
            batch,
            resolved: Batch::new(),
            outcomes: Outcomes::new(),
            allowed: true,
            op: Op::Spend,
            counted: Counted::default(),
        }
    }

    /// Whether the verdict can be read by reference alone: a spend with no cost range and no
    /// concurrency limit (whose counters and leases need the decisions).
    #[inline]
    pub(crate) fn plain(&self) -> bool {
        self.op == Op::Spend && !self.counted.ranges && !self.counted.concurrency
    }

    /// Each transaction with its quota, mode and outcome, in order.
    #[inline]
    pub(crate) fn entries(&self) -> impl Iterator<Item = Entry<'_>> + Clone {
        let mut outcomes = self.outcomes.iter();
        self.batch
            .iter()
            .zip(&self.resolved)
            .map(move |(tx, r)| Entry {
                tx,
                quota: r.quota,
                mode: r.mode,
                outcome: match r.quota {
                    Some(_) => outcomes.next().unwrap_or(&DISABLED),
                    None => &DISABLED,
                },
            })
    }

    /// Whether the batch is allowed: no counting transaction was denied.
    pub(crate) fn allowed(&self) -> bool {
        self.allowed
    }

    /// The decisions.
    pub(crate) fn decision(self) -> Result<BatchDecision, LimiterError> {
        finish(
            self.batch,
            &self.resolved,
            self.outcomes,
            self.op,
            self.counted,
        )
    }
}

/// A spend under way on the backend, with what its outcomes need to become decisions: the
/// batch was resolved and validated once, before it was sent.
pub(crate) struct Pending {
    spend: crate::backend::PendingSpend,
    resolved: Vec<Resolved<Quota>>,
    counted: Counted,
    op: Op,
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl Pending {
    /// A spend under way, owning what its decision needs of `verdict` (out of line: the step
    /// of a batch decided at once stays small).
    #[inline(never)]
    fn new(spend: crate::backend::PendingSpend, verdict: &Verdict<'_>, op: Op) -> Self {
        Pending {
            spend,
            resolved: verdict
                .resolved
                .iter()
                .map(|r| Resolved {
                    quota: r.quota.cloned(),
                    mode: r.mode,
                    cost: r.cost,
                    lease: r.lease,
                    block_s: r.block_s,
                })
                .collect(),
            counted: verdict.counted,
            op,
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }

    /// Waits for the backend and decides `batch` (the transactions the step was made of).
    pub(crate) async fn decided(
        self,
        batch: &[Transaction],
    ) -> Result<BatchDecision, LimiterError> {
        let outcomes = self.spend.await;
        #[cfg(feature = "metrics")]
        crate::telemetry::backend_duration(self.op.label(), self.started.elapsed().as_secs_f64());
        let mut outcomes = outcomes?;
        if self.counted.blocks {
            outcomes = with_blocks(&self.resolved, outcomes)?;
        }
        finish(batch, &self.resolved, outcomes, self.op, self.counted)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Spend,
    Check,
    Refund,
}

/// One transaction's decision from its outcome: the one place a `Decision` is made.
fn decision(
    key: BucketKey,
    quota: Option<&Quota>,
    mode: Mode,
    cost: u64,
    o: Outcome,
    op: Op,
    lease: u64,
) -> Decision {
    let lease_id = std::num::NonZeroU64::new(lease).filter(|_| o.allowed && op == Op::Spend);
    let granted = match (&o.tiers, o.granted, o.allowed, op) {
        (Some(t), _, _, _) => t.granted,
        (None, Some(g), _, Op::Spend | Op::Check) => g,
        (None, None, true, Op::Spend | Op::Check) => cost,
        _ => 0,
    };
    Decision {
        allowed: o.allowed,
        granted,
        remaining: o.remaining,
        retry_after: us(o.retry_after_us),
        reset_after: us(o.reset_after_us),
        limit: quota.cloned(),
        tiers: o.tiers.map(|t| *t),
        name: key.name(),
        key,
        mode,
        skipped: o.skipped,
        lease_id,
    }
}

impl Op {
    #[cfg(feature = "metrics")]
    fn label(self) -> &'static str {
        match self {
            Op::Spend => "spend",
            Op::Check => "check",
            Op::Refund => "refund",
        }
    }
}

impl Limiter {
    /// A limiter over `limits` storing state in `backend`.
    pub fn new(limits: Limits, backend: impl Backend) -> Self {
        Self::with_shared_backend(limits, Arc::new(backend))
    }

    /// A limiter over `limits` deciding in this process's memory (the layer's in-memory
    /// fallback).
    pub(crate) fn in_memory(limits: Limits) -> Self {
        Self::new(limits, crate::backend::MemoryBackend::new())
    }

    /// A limiter over a backend shared with others.
    pub fn with_shared_backend(limits: Limits, backend: Arc<dyn Backend>) -> Self {
        let store = backend.override_store().map(|s| s.0);
        Self::build(limits, backend, store)
    }

    /// A limiter deciding in memory what `limits` say, stored overrides included, without
    /// following a store of its own (the layer's fallback: it follows the main limiter's).
    pub(crate) fn fallback(limits: Limits) -> Self {
        Self::build(limits, Arc::new(crate::backend::MemoryBackend::new()), None)
    }

    fn build(
        limits: Limits,
        backend: Arc<dyn Backend>,
        store: Option<Arc<dyn crate::backend::OverrideStore>>,
    ) -> Self {
        let limits = match &store {
            Some(store) => overrides::applied(&limits, store.as_ref(), &store.current()),
            None => limits,
        };
        let limiter = Self {
            inner: Arc::new(Inner {
                limits: ArcSwap::from_pointee(limits),
                backend,
                generation: AtomicU64::new(0),
                pinned: Mutex::new(Vec::new()),
                reloading: Mutex::new(()),
                next_lease: AtomicU64::new(random_start()),
                store,
                renewals: renewals::Renewals::default(),
            }),
        };
        limiter.watch_store();
        limiter
    }

    /// The limits in force now (a snapshot: a later [`reload`](Self::reload) does not change
    /// it).
    pub fn limits(&self) -> Arc<Limits> {
        self.inner.limits.load_full()
    }

    /// The limits in force now, without touching a reference count (the request path).
    pub(crate) fn load(&self) -> Guard<Arc<Limits>> {
        self.inner.limits.load()
    }

    /// How many reloads replaced the limits since the limiter was built.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// Replaces the limits, atomically: every batch is decided entirely under the old limits
    /// or entirely under the new ones, and the request path takes no lock. Bucket state is
    /// kept (it is keyed by limit name and id, never by position): a drained bucket stays
    /// drained, and a changed limit applies to existing buckets from their next request (a
    /// GCRA bucket's stored TAT is read under the new emission interval and burst; a tiered
    /// bucket's recorded grants tier by tier under the new tiers, tiers the new limit lacks
    /// dropped and new ones empty: `docs/gcra.md`, "Changing a limit").
    ///
    /// Refused, keeping the old limits, when the new ones drop a limit that a rule of a layer
    /// built on this limiter uses ([`ReloadError::LimitInUse`]).
    ///
    /// ```
    /// use tower_ratelimits::{Limiter, Limits, MemoryBackend};
    /// let limiter = Limiter::new(
    ///     Limits::from_yaml_str("Api: {burst: 5, count: 5, period: 1s}\n", None).unwrap(),
    ///     MemoryBackend::new(),
    /// );
    /// let change = limiter
    ///     .reload(Limits::from_yaml_str("Api: {burst: 9, count: 9, period: 1s}\n", None).unwrap())
    ///     .unwrap();
    /// assert_eq!(change.to_string(), "changed: Api");
    /// ```
    pub fn reload(&self, limits: Limits) -> Result<LimitsChange, ReloadError> {
        let _one_at_a_time = self
            .inner
            .reloading
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        {
            let pinned = self
                .inner
                .pinned
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(name) = pinned.iter().find(|n| !limits.contains(**n)) {
                return Err(ReloadError::LimitInUse(name.to_string()));
            }
        }
        let change = self.inner.limits.load().change_to(&limits);
        let limits = match &self.inner.store {
            Some(store) => overrides::applied(&limits, store.as_ref(), &store.current()),
            None => limits,
        };
        self.inner.limits.store(Arc::new(limits));
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        Ok(change)
    }

    /// Marks `name` as used by a rule: a reload may not remove it.
    pub(crate) fn pin(&self, name: LimitName) {
        let mut pinned = self
            .inner
            .pinned
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !pinned.contains(&name) {
            pinned.push(name);
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// A limit's name, when the configuration defines it (look it up once, at set-up).
    pub fn name(&self, name: &str) -> Result<LimitName, LimiterError> {
        self.load()
            .name(name)
            .ok_or_else(|| LimiterError::UnknownName(name.to_owned()))
    }

    /// The bucket key of a name and an id.
    pub fn key(&self, name: &str, id: Id) -> Result<BucketKey, LimiterError> {
        Ok(BucketKey::new(self.name(name)?, id))
    }

    /// The bucket key of a name and an id given as text, checked against the name's id kind.
    pub fn parse_key(&self, name: &str, id: &str) -> Result<BucketKey, LimiterError> {
        let limits = self.load();
        let name = limits
            .name(name)
            .ok_or_else(|| LimiterError::UnknownName(name.to_owned()))?;
        let kind = limits.id_kind(name).unwrap_or_default();
        let id = kind
            .parse(id)
            .map_err(|source| LimiterError::InvalidId { name, source })?;
        Ok(BucketKey::new(name, id))
    }

    /// Decides a batch and spends it if it is allowed (all or nothing).
    pub async fn spend(&self, batch: &[Transaction]) -> Result<BatchDecision, LimiterError> {
        self.run(batch, Op::Spend).await
    }

    /// Spends a batch, waiting instead of being denied when the wait is short enough: a
    /// batch denied with a `retry_after` within what is left of `max_wait` sleeps exactly that
    /// long (tokio's timer, no polling) and is spent again; a denial beyond it is returned as
    /// [`spend`](Self::spend) would return it. For job queues and internal callers that would
    /// rather be slowed than refused.
    ///
    /// Nothing is held while waiting, and a denied batch spent nothing: dropping the future
    /// (a cancelled job) costs nothing. Waiters are not queued: each is decided again when its
    /// wait ends, against what arrived meanwhile, and waits again (within `max_wait`) if it
    /// lost. The number of waiting callers is the caller's to bound (the layer's
    /// [`Wait::max_waiting`](crate::Wait::max_waiting) does it for requests). Needs a tokio
    /// runtime with its timer.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_ratelimits::{Id, Limiter, Limits, MemoryBackend, Transaction};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str("Jobs: {burst: 1, count: 10, period: 1s}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let job = Transaction::new(limiter.key("Jobs", Id::from(7u64))?);
    /// assert!(limiter.spend_or_wait(&[job.clone()], Duration::from_secs(1)).await?.allowed());
    /// // The second waits for the next token (100 ms), then passes.
    /// assert!(limiter.spend_or_wait(&[job], Duration::from_secs(1)).await?.allowed());
    /// # Ok(()) }
    /// ```
    pub async fn spend_or_wait(
        &self,
        batch: &[Transaction],
        max_wait: Duration,
    ) -> Result<BatchDecision, LimiterError> {
        let start = tokio::time::Instant::now();
        loop {
            let decided = self.run(batch, Op::Spend).await?;
            let wait = match decided.strictest() {
                Some(d) if !d.allowed => d.retry_after,
                _ => return Ok(decided),
            };
            if !may_wait(start.elapsed(), wait, max_wait) {
                return Ok(decided);
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// Decides a batch without spending anything.
    pub async fn check(&self, batch: &[Transaction]) -> Result<BatchDecision, LimiterError> {
        self.run(batch, Op::Check).await
    }

    /// Refunds each transaction's cost, never above a full bucket. A decision is `allowed` when
    /// something was refunded.
    pub async fn refund(&self, batch: &[Transaction]) -> Result<BatchDecision, LimiterError> {
        self.run(batch, Op::Refund).await
    }

    /// Gives back slots held on concurrency limits ([`Decision::lease`]); returns how many
    /// were still held (a lease already given back, or past its deadline, is not). Each is
    /// released under the limit it was taken under, whatever a reload changed since.
    ///
    /// ```
    /// # use tower_ratelimits::{Id, Limiter, Limits, MemoryBackend, Transaction};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str("Exports: {concurrency: 1, lease: 10m}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let export = Transaction::new(limiter.key("Exports", Id::from(7u64))?);
    /// let first = limiter.spend(&[export.clone()]).await?;
    /// assert!(first.allowed());
    /// assert!(!limiter.spend(&[export.clone()]).await?.allowed()); // one in flight already
    /// let leases: Vec<_> = first.decisions().iter().filter_map(|d| d.lease()).collect();
    /// assert_eq!(limiter.release(&leases).await?, 1);
    /// assert!(limiter.spend(&[export]).await?.allowed());
    /// # Ok(()) }
    /// ```
    pub async fn release(&self, leases: &[Lease]) -> Result<usize, LimiterError> {
        let txs = lease_txs(leases, Mode::CheckAndSpend)?;
        if txs.is_empty() {
            return Ok(0);
        }
        let outcomes = self.inner.backend.refund(&txs).await?;
        Ok(count_allowed(leases, &outcomes, "released"))
    }

    /// Keeps slots of work still under way: each lease that still holds its slot gets a new
    /// deadline, now plus its limit's lease time; an ended or released lease is not taken
    /// again (renewing never takes a slot). Returns how many were renewed. The layer renews a
    /// request's leases every third of their lease time while its response future or body
    /// lives, so the lease time bounds only the slots of an instance that died; call it the
    /// same way for work tracked through [`Limiter::spend`].
    ///
    /// ```
    /// use tower_ratelimits::{Id, Limiter, Limits, ManualClock, MemoryBackend, Transaction};
    /// use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = ManualClock::new(1_700_000_000_000_000);
    /// let limits = Limits::from_yaml_str("Exports: {concurrency: 1, lease: 10s}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::builder().clock(clock.clone()).build());
    /// let export = Transaction::new(limiter.key("Exports", Id::from(7u64))?);
    /// let first = limiter.spend(&[export.clone()]).await?;
    /// let leases: Vec<_> = first.decisions().iter().filter_map(|d| d.lease()).collect();
    /// clock.advance(Duration::from_secs(9));
    /// assert_eq!(limiter.renew(&leases).await?, 1);
    /// clock.advance(Duration::from_secs(9)); // 18 s in: the slot is still held
    /// assert!(!limiter.spend(&[export.clone()]).await?.allowed());
    /// assert_eq!(limiter.release(&leases).await?, 1);
    /// assert_eq!(limiter.renew(&leases).await?, 0); // released: nothing to renew
    /// # Ok(()) }
    /// ```
    pub async fn renew(&self, leases: &[Lease]) -> Result<usize, LimiterError> {
        // One transaction per key (and lease time), naming all of its leases: a store call
        // renews every key at once, whatever the number of requests holding them.
        let mut groups: Vec<(&Lease, Vec<u64>)> = Vec::new();
        let mut index: std::collections::HashMap<(&BucketKey, &Quota), usize> =
            std::collections::HashMap::new();
        for l in leases {
            match index.get(&(&l.key, &l.quota)) {
                Some(&i) => groups[i].1.push(l.id),
                None => {
                    index.insert((&l.key, &l.quota), groups.len());
                    groups.push((l, vec![l.id]));
                }
            }
        }
        let txs = groups
            .iter()
            .map(|(l, ids)| {
                BucketTx::new(&l.key, &l.quota, 1..=1, Mode::Renew)
                    .map(|tx| tx.with_leases(ids))
                    .map_err(|e| LimiterError::from_transaction(l.key.name(), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if txs.is_empty() {
            return Ok(0);
        }
        let outcomes = self.inner.backend.spend(&txs).outcomes().await?;
        let mut renewed = 0;
        for ((l, _), o) in groups.iter().zip(&outcomes) {
            // A backend of its own that reports no count renewed the one lease it was given.
            let n = o.granted.unwrap_or(u64::from(o.allowed));
            crate::telemetry::leases(l.key.name(), "renewed", n);
            renewed += n as usize;
        }
        Ok(renewed)
    }

    /// Records slots already in use that this store has not seen (taken by the in-memory
    /// fallback during an outage) as leases of its own: each lease's key under this limiter's
    /// limits, with the same lease id, taken even above the limit (a charge: the work is under
    /// way). Returns the leases now held here, to renew and release. A key that is no longer
    /// a concurrency limit here is skipped.
    pub(crate) async fn adopt(&self, leases: &[Lease]) -> Result<Vec<Lease>, LimiterError> {
        let limits = self.load();
        let mine: Vec<Lease> = leases
            .iter()
            .filter_map(|l| {
                let quota = limits.resolve(&l.key)?;
                quota.as_concurrency().map(|_| Lease {
                    key: l.key.clone(),
                    quota: quota.clone(),
                    id: l.id,
                })
            })
            .collect();
        let txs = lease_txs(&mine, Mode::Charge)?;
        if txs.is_empty() {
            return Ok(mine);
        }
        let outcomes = self.inner.backend.spend(&txs).outcomes().await?;
        Ok(mine
            .into_iter()
            .zip(&outcomes)
            .filter(|(_, o)| o.allowed)
            .map(|(l, _)| l)
            .collect())
    }

    /// A bucket seen without spending from it: the limit in force for the key, where that
    /// limit comes from, the tokens a request could take now and when the bucket is full
    /// again. It is a check of cost 0 (one backend call; nothing is spent on any backend, and
    /// only a foreign value is written over: `docs/gcra.md`, "Foreign values"),
    /// resolved under one snapshot of the limits (a reload in between is looked at again).
    /// On Redis with prefetched tokens ([`Limit::with_prefetch`](crate::Limit::with_prefetch)),
    /// tokens an instance holds count as spent.
    ///
    /// ```
    /// # use tower_ratelimits::{Id, LimitSource, Limiter, Limits, ManualClock, MemoryBackend, Transaction};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str(
    ///     "Api: {kind: account, burst: 3, count: 3, period: 1h}",
    ///     Some("Api:42: {burst: 10, count: 10, period: 1h}"),
    /// )?;
    /// let backend = MemoryBackend::builder().clock(ManualClock::new(0)).build();
    /// let limiter = Limiter::new(limits, backend);
    /// let key = limiter.key("Api", Id::from(7u64))?;
    /// limiter.spend(&[Transaction::new(key.clone())]).await?;
    /// let seen = limiter.inspect(&key).await?;
    /// assert_eq!((seen.source, seen.remaining), (LimitSource::Default, 2));
    /// assert_eq!(seen.reset_after, Duration::from_secs(20 * 60));
    /// assert_eq!(limiter.inspect(&key).await?.remaining, 2); // nothing was spent
    /// let vip = limiter.inspect(&limiter.key("Api", Id::from(42u64))?).await?;
    /// assert_eq!((vip.source, vip.remaining), (LimitSource::Override, 10));
    /// # Ok(()) }
    /// ```
    pub async fn inspect(&self, key: &BucketKey) -> Result<Inspection, LimiterError> {
        let probe = [Transaction::new(key.clone()).cost(0)];
        let mut tries = 0;
        loop {
            tries += 1;
            let generation = self.generation();
            let (source, blocked) = {
                let limits = self.load();
                let Some(entry) = limits.entry(key.name()) else {
                    return Err(LimiterError::UnknownName(key.name().to_string()));
                };
                let r = limits.resolve_in(entry, key);
                (r.source, r.block_s != 0)
            };
            let decided = self.check(&probe).await?;
            // A reload between resolving and deciding: look again (at most three times; the
            // last answer stands if reloads keep coming).
            if self.generation() != generation && tries < 3 {
                continue;
            }
            let Some(d) = decided.decisions().first() else {
                return Err(LimiterError::Backend(BackendError::outcome_count(0, 1)));
            };
            let limit = d.limit().cloned();
            let (remaining, reset_after) = match limit {
                Some(_) => (d.remaining(), d.reset_after()),
                None => (0, Duration::ZERO),
            };
            return Ok(Inspection {
                limit,
                source,
                blocked,
                remaining,
                reset_after,
            });
        }
    }

    /// Forgets what buckets spent: they become full. A concurrency key keeps the leases of its
    /// requests in flight (a reset never lets more run at once than the limit: they end when
    /// their requests do, or, for an instance that died, at their deadlines).
    pub async fn reset(&self, keys: &[BucketKey]) -> Result<(), LimiterError> {
        let refs: Vec<&BucketKey> = keys.iter().collect();
        self.inner.backend.reset(&refs).await?;
        Ok(())
    }

    async fn run(&self, batch: &[Transaction], op: Op) -> Result<BatchDecision, LimiterError> {
        if op == Op::Refund {
            return self.refund_in(&self.load(), batch).await;
        }
        let pending = {
            let limits = self.load();
            let mut verdict = Verdict::new(batch);
            match self.step(&limits, &mut verdict, op)? {
                Step::Ready => return verdict.decision(),
                Step::Pending(p) => p,
            }
        };
        pending.decided(batch).await
    }

    /// Spends `verdict`'s batch under `limits` (a snapshot the caller holds): resolved and
    /// validated once and sent to the backend once, decided into `verdict` when the backend
    /// answers at once.
    pub(crate) fn spend_step<'a>(
        &self,
        limits: &'a Limits,
        verdict: &mut Verdict<'a>,
    ) -> Result<Step, LimiterError> {
        self.step(limits, verdict, Op::Spend)
    }

    /// A spend or a check: the one road every batch takes to the backend.
    fn step<'a>(
        &self,
        limits: &'a Limits,
        verdict: &mut Verdict<'a>,
        op: Op,
    ) -> Result<Step, LimiterError> {
        // Resolved in place: the verdict is decided where it will be read, not moved into.
        verdict.op = op;
        let mut txs: Batch<BucketTx<'a>> = Batch::new();
        self.resolve(
            limits,
            verdict.batch,
            op,
            &mut verdict.resolved,
            &mut txs,
            &mut verdict.counted,
        )?;
        if verdict.counted.blocks {
            return self.blocked_step(verdict, txs, op);
        }
        if txs.is_empty() {
            return Ok(Step::Ready);
        }
        match self.inner.backend.spend(&txs) {
            Spend::Ready(outcomes) => {
                let outcomes = outcomes?;
                let sent = txs.len();
                if outcomes.len() != sent {
                    return Err(BackendError::outcome_count(outcomes.len(), sent).into());
                }
                // The batch rule, once (a disabled limit sent nothing and allows).
                verdict.allowed = crate::backend::kit::batch_allowed(txs.iter().zip(&outcomes));
                verdict.outcomes = outcomes;
                Ok(Step::Ready)
            }
            // The backend's time is measured for a spend it could not decide at once (the
            // README's `backend_duration_seconds`), from when its future exists (it works when
            // polled): a decision in memory or from the deny cache reads no clock for it.
            Spend::Pending(spend) => Ok(Step::Pending(Pending::new(spend, verdict, op))),
        }
    }

    /// [`step`](Self::step) for a batch with transactions a stored block denies (out of line:
    /// the road of other batches does not carry it). The blocked ones are not sent; if one of
    /// them counts, the others are only looked at (checked, not spent) and the batch is denied.
    #[inline(never)]
    fn blocked_step(
        &self,
        verdict: &mut Verdict<'_>,
        mut txs: Batch<BucketTx<'_>>,
        op: Op,
    ) -> Result<Step, LimiterError> {
        if verdict.counted.blocked {
            for tx in &mut txs {
                if tx.mode.spends() {
                    tx.mode = Mode::CheckOnly;
                }
            }
        }
        let outcomes = if txs.is_empty() {
            Outcomes::new()
        } else {
            match self.inner.backend.spend(&txs) {
                Spend::Ready(outcomes) => {
                    let outcomes = outcomes?;
                    if outcomes.len() != txs.len() {
                        return Err(BackendError::outcome_count(outcomes.len(), txs.len()).into());
                    }
                    verdict.allowed = crate::backend::kit::batch_allowed(txs.iter().zip(&outcomes));
                    outcomes
                }
                // `Pending::decided` joins the denials in.
                Spend::Pending(spend) => {
                    return Ok(Step::Pending(Pending::new(spend, verdict, op)));
                }
            }
        };
        verdict.allowed &= !verdict.counted.blocked;
        verdict.outcomes = with_blocks(&verdict.resolved, outcomes)?;
        Ok(Step::Ready)
    }

    async fn refund_in(
        &self,
        limits: &Limits,
        batch: &[Transaction],
    ) -> Result<BatchDecision, LimiterError> {
        let (mut resolved, mut txs, mut counted) = (Batch::new(), Batch::new(), Counted::default());
        self.resolve(
            limits,
            batch,
            Op::Refund,
            &mut resolved,
            &mut txs,
            &mut counted,
        )?;
        let outcomes = if txs.is_empty() {
            Vec::new()
        } else {
            #[cfg(feature = "metrics")]
            let started = std::time::Instant::now();
            let outcomes = self.inner.backend.refund(&txs).await;
            #[cfg(feature = "metrics")]
            crate::telemetry::backend_duration(Op::Refund.label(), started.elapsed().as_secs_f64());
            outcomes?
        };
        let mut outcomes = Outcomes::from_vec(outcomes);
        if counted.blocks {
            outcomes = with_blocks(&resolved, outcomes)?;
        }
        finish(batch, &resolved, outcomes, Op::Refund, counted)
    }

    /// Checks a batch and resolves each transaction's limit, mode and cost into `resolved`
    /// (one per transaction), the transactions to send into `txs` (one per enabled limit,
    /// validated by `BucketTx::new`) and what its decisions are counted by into `counted`:
    /// in place, into the caller's storage, so nothing is moved on the way to the backend.
    /// Inlined into the step (its seven arguments passed in registers and on the stack cost a
    /// request about 50 instructions; three rules +21).
    #[inline]
    fn resolve<'a>(
        &self,
        limits: &'a Limits,
        batch: &'a [Transaction],
        op: Op,
        resolved: &mut Batch<Resolved<&'a Quota>>,
        txs: &mut Batch<BucketTx<'a>>,
        counted: &mut Counted,
    ) -> Result<(), LimiterError> {
        if batch.len() > 1
            && let Some(key) = first_duplicate(batch)
        {
            return Err(LimiterError::DuplicateKey(key.to_string()));
        }
        for tx in batch {
            let name = tx.key().name();
            let Some(entry) = limits.entry(name) else {
                return Err(LimiterError::UnknownName(name.to_string()));
            };
            // A check writes nothing: what spends only checks, what counts still counts.
            let mode = match (op, tx.get_mode()) {
                (Op::Check, m) if m.counts() => Mode::CheckOnly,
                (Op::Check, _) => Mode::Observe,
                (_, m) => m,
            };
            let resolution = limits.resolve_in(entry, tx.key());
            let quota = resolution.quota;
            let default_cost = entry.cost;
            let cost = tx.cost_or(default_cost);
            let mut lease = 0;
            if resolution.block_s != 0 {
                // Denied here, not sent (`with_blocks`); a counting one denies the batch.
                counted.blocks = true;
                counted.blocked |= mode.counts();
            } else if let Some(quota) = quota {
                let min_cost = tx.min_cost_or(default_cost);
                counted.ranges |= min_cost != cost;
                let costs = min_cost..=cost;
                let checked = if op == Op::Refund {
                    BucketTx::for_refund(tx.key(), quota, costs, mode)
                } else {
                    BucketTx::new(tx.key(), quota, costs, mode)
                };
                let mut checked = checked.map_err(|e| LimiterError::from_transaction(name, e))?;
                // A spend of a slot takes a lease of its own.
                if op == Op::Spend && quota.as_concurrency().is_some() && cost == 1 && mode.spends()
                {
                    lease = self.lease_id();
                    checked = checked.with_lease(lease);
                }
                counted.concurrency |= quota.as_concurrency().is_some();
                txs.push(checked);
            }
            resolved.push(Resolved {
                quota,
                mode,
                cost,
                lease,
                block_s: resolution.block_s,
            });
        }
        Ok(())
    }
}

/// What a spend's decisions are counted by beyond the decisions themselves: cost ranges (the
/// partial-grant counter) and concurrency limits (the lease counter). A batch with neither
/// skips both passes.
#[derive(Clone, Copy, Default)]
struct Counted {
    ranges: bool,
    concurrency: bool,
    /// A transaction is blocked by a stored override ([`with_blocks`]).
    blocks: bool,
    /// One of them counts: the batch is denied.
    blocked: bool,
}

/// The outcomes of a batch with blocked transactions: the backend's (`sent`, one per
/// transaction sent) with each blocked one's denial in its place (nothing left, allowed again
/// when the block ends).
fn with_blocks<Q>(resolved: &[Resolved<Q>], sent: Outcomes) -> Result<Outcomes, LimiterError> {
    let expected = resolved
        .iter()
        .filter(|r| r.quota.is_some() && r.block_s == 0)
        .count();
    if sent.len() != expected {
        return Err(BackendError::outcome_count(sent.len(), expected).into());
    }
    let mut sent = sent.into_iter();
    let mut out = Outcomes::new();
    for r in resolved.iter().filter(|r| r.quota.is_some()) {
        out.push(if r.block_s != 0 {
            let us = u64::from(r.block_s) * 1_000_000;
            Outcome::new(false, 0, us, us)
        } else {
            sent.next().unwrap_or_default()
        });
    }
    Ok(out)
}

/// Turns the backend's outcomes (one per resolved transaction with a limit) into decisions.
fn finish<Q: std::borrow::Borrow<Quota>>(
    batch: &[Transaction],
    resolved: &[Resolved<Q>],
    outcomes: Outcomes,
    op: Op,
    counted: Counted,
) -> Result<BatchDecision, LimiterError> {
    let sent = resolved.iter().filter(|r| r.quota.is_some()).count();
    if outcomes.len() != sent {
        return Err(BackendError::outcome_count(outcomes.len(), sent).into());
    }
    let mut outcomes = outcomes.into_iter();
    let mut decisions = Vec::with_capacity(batch.len());
    for (tx, r) in batch.iter().zip(resolved) {
        let quota = r.quota.as_ref().map(std::borrow::Borrow::borrow);
        let o = match quota {
            Some(_) => outcomes.next().unwrap_or_default(),
            None => Outcome::new(true, u64::MAX, 0, 0),
        };
        decisions.push(decision(
            tx.key().clone(),
            quota,
            r.mode,
            r.cost,
            o,
            op,
            r.lease,
        ));
    }
    let batch_decision = concluded(decisions, op);
    if op == Op::Spend {
        if counted.ranges {
            count_partial_grants(batch, &batch_decision);
        }
        if counted.concurrency {
            count_leases(&batch_decision);
        }
    }
    Ok(batch_decision)
}

/// Counts the leases a spend batch took on concurrency limits, and its concurrency denials
/// that counted.
fn count_leases(decided: &BatchDecision) {
    for d in decided.decisions() {
        if !matches!(d.limit, Some(Quota::Concurrency(_))) || d.skipped {
            continue;
        }
        let outcome = match d.lease_id {
            Some(_) => "acquired",
            None if !d.allowed && d.mode.counts() => "denied",
            None => continue,
        };
        crate::telemetry::lease(d.name, outcome);
    }
}

impl Limiter {
    /// A new lease id (never 0).
    fn lease_id(&self) -> u64 {
        loop {
            let id = self.inner.next_lease.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }
}

/// One transaction per lease, in `mode`, each naming its lease (a release is a refund of it).
fn lease_txs(leases: &[Lease], mode: Mode) -> Result<Vec<BucketTx<'_>>, LimiterError> {
    leases
        .iter()
        .map(|l| {
            BucketTx::new(&l.key, &l.quota, 1..=1, mode)
                .map(|tx| tx.with_lease(l.id))
                .map_err(|e| LimiterError::from_transaction(l.key.name(), e))
        })
        .collect()
}

/// How many of `leases` their `outcomes` allowed, each counted as `what` in
/// `tower_ratelimits_leases_total`.
fn count_allowed(leases: &[Lease], outcomes: &[Outcome], what: &'static str) -> usize {
    let mut allowed = 0;
    for (l, _) in leases.iter().zip(outcomes).filter(|(_, o)| o.allowed) {
        crate::telemetry::lease(l.key.name(), what);
        allowed += 1;
    }
    allowed
}

/// Counts the partial grants (cost ranges) of a spend batch: `whole` (the range's upper end
/// granted), `partial` (less, at least its lower end) or `denied` (nothing: the range or its
/// batch was denied), with the units granted.
fn count_partial_grants(batch: &[Transaction], decided: &BatchDecision) {
    for (tx, d) in batch.iter().zip(decided.decisions()) {
        let max = tx.cost_or(0);
        if tx.min_cost_or(max) == max || d.limit.is_none() {
            continue;
        }
        let outcome = match (decided.allowed() && d.allowed, d.granted == max) {
            (false, _) => "denied",
            (true, true) => "whole",
            (true, false) => "partial",
        };
        crate::telemetry::partial_grant(d.name, outcome, d.granted);
    }
}

/// The waiting rule, for [`Limiter::spend_or_wait`] and the layer's [`Wait`](crate::Wait): a
/// denial whose `retry_after` (`wait`, above zero) ends within `bound` of the first denial
/// (`waited` ago) waits.
pub(crate) fn may_wait(waited: Duration, wait: Duration, bound: Duration) -> bool {
    !wait.is_zero() && waited.saturating_add(wait) <= bound
}

/// The batch decision of `decisions`: a denied spend reports its buckets unspent (nothing of
/// a denied batch was written).
fn concluded(decisions: Vec<Decision>, op: Op) -> BatchDecision {
    let mut batch = BatchDecision::new(decisions);
    if op == Op::Spend && !batch.allowed() {
        batch.unspend();
    }
    batch
}
