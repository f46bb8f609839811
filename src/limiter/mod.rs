//! The [`Limiter`]: limits plus a backend, usable on its own (a job queue, a CLI, an
//! interceptor) or through the tower middleware.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::backend::Outcome;
use crate::backend::{Backend, BackendError, BucketTx, TransactionError};
use crate::config::Limits;
use crate::key::{BucketKey, IdError, LimitName};
use crate::mode::Mode;

mod bans;
mod decision;
mod limits;
mod overrides;
mod renewals;
mod step;
mod transaction;

pub(crate) use bans::FallbackBans;
pub use bans::PenaltyPage;
pub use decision::{BatchDecision, Decision, Inspection, Lease};
pub(crate) use decision::{Strictest, strictest};
pub use limits::ReloadError;
pub use overrides::OverrideError;
pub(crate) use renewals::{Hold, third_of_lease};
use std::time::Duration;
use step::Op;
pub(crate) use step::{Entry, Pending, Step, Verdict};
pub(crate) use transaction::PenaltyPart;
pub use transaction::Transaction;

/// Why the limiter could not decide.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum LimiterError {
    /// A limit name the configuration does not define.
    #[error("unknown limit {0:?}")]
    UnknownName(String),
    /// The same bucket appears twice in one batch.
    #[error("bucket {0} appears twice in one batch")]
    DuplicateKey(String),
    /// A limit with a penalty ladder on a backend that decides none (today: every backend but
    /// memory; `docs/penalties.md`): refused rather than decided without its penalty.
    #[error("limit {0} has a penalty, which this backend does not decide")]
    NoPenalties(LimitName),
    /// A limit that keeps one state for all its ids (a fair share) appears twice in one
    /// batch, for two ids: each id's request is a batch of its own.
    #[error("limit {0} (one state for all its ids) appears twice in one batch")]
    LimitTwice(LimitName),
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
    /// A list of penalties ([`Limiter::penalties`]) of a limit without a penalty ladder.
    #[error("limit {0} has no penalty ladder")]
    NoPenaltyLadder(LimitName),
    /// A page's cursor ([`Limiter::penalties`]) that is not one the store gave.
    #[error("not a cursor of this store's pages: {0:?}")]
    BadCursor(String),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

readable_debug!(LimiterError { UnknownName(name), DuplicateKey(key), LimitTwice(name), NoPenalties(name), NoPenaltyLadder(name), BadCursor(cursor), CostAboveBurst { name, cost, burst }, EmptyCostRange { name, min, max }, RangeOnConcurrency { name }, RenewWithoutSlots { name }, InvalidId { name, source }, Backend(error) });

/// The first key that appears twice in `batch`: pairwise for a request's few rules (no
/// allocation), through a hash set beyond that, so a batch of any size costs linear time.
pub(crate) fn first_duplicate(batch: &[Transaction]) -> Option<&BucketKey> {
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
    /// Names that rules of layers built on this limiter use: a reload may not remove them; with
    /// whether a rule counts a stream's messages of it (a reload may not make those hold slots).
    pinned: Mutex<Vec<(LimitName, bool)>>,
    /// Serialises reloads (the check of the pinned names and the swap are one step).
    reloading: Mutex<()>,
    /// The next lease id, from a random start: unique among the leases of this limiter, and
    /// (with 2^64 starts) apart from other instances' on a shared store.
    next_lease: AtomicU64,
    /// The backend's store of overrides set at run time, if it keeps one.
    store: Option<Arc<dyn crate::backend::OverrideStore>>,
    /// The slots of requests in flight, renewed together.
    renewals: renewals::Renewals,
    /// Whether a limit that sets `prefetch` is warned of (at the start, and when a reload
    /// brings it): the backend ignores it, and this is not the layer's fallback.
    warns_of_prefetch: bool,
    /// How the limits marked `across_regions` are decided.
    regions: Regions,
}

/// How a limiter decides the limits marked `across_regions` (`docs/regions.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Regions {
    /// As a limit per region, warned of once per limit: the backend has no regional mode.
    PerRegion,
    /// As the region's share bucket: the backend is regional ([`Backend::regional`]), and
    /// each such transaction carries its floor.
    Shares,
    /// Denied (fail-closed, retry in a second): the in-memory fallback of a regional
    /// limiter, which knows no share and must never grant the whole limit in one region.
    Closed,
}

/// Warns once of each limit in `now` but not in `before` (the names that set `prefetch`): the
/// limiter's backend decides every request itself.
fn warn_ignored_prefetch(now: &[LimitName], before: &[LimitName]) {
    for name in now.iter().filter(|n| !before.contains(n)) {
        tracing::warn!(
            target: crate::telemetry::target::BACKEND,
            limit = name.as_str(),
            "limit {name} sets prefetch, which this backend ignores: only the Redis backend \
             prefetches tokens (in one process there is no round trip to save); every request \
             is decided by the backend"
        );
    }
}

/// Warns once of each limit in `now` but not in `before` (the names marked `across_regions`):
/// the limiter's backend has no regional mode, so each decides as a limit per region.
fn warn_not_regional(now: &[LimitName], before: &[LimitName]) {
    for name in now.iter().filter(|n| !before.contains(n)) {
        tracing::warn!(
            target: crate::telemetry::target::BACKEND,
            limit = name.as_str(),
            "limit {name} is marked across_regions, but this backend is not in regional mode: \
             it decides as a limit per region (each region grants the whole limit)"
        );
    }
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

impl Limiter {
    /// A limiter over `limits` storing state in `backend`.
    pub fn new(limits: Limits, backend: impl Backend) -> Self {
        Self::with_shared_backend(limits, Arc::new(backend))
    }

    /// A limiter over `limits` deciding in this process's memory
    /// ([`RateLimitLayer::per_client_ip`](crate::RateLimitLayer::per_client_ip)).
    pub(crate) fn in_memory(limits: Limits) -> Self {
        Self::new(limits, crate::backend::MemoryBackend::new())
    }

    /// A limiter over a backend shared with others. A limit that sets `prefetch` on a backend
    /// that does not prefetch (memory, a backend outside the crate, Redis with
    /// `RedisBackendBuilder::prefetch(false)`) is decided as if it had none,
    /// and a warning says so once, here, or at the reload that sets it (target
    /// `tower_ratelimits::backend`).
    pub fn with_shared_backend(limits: Limits, backend: Arc<dyn Backend>) -> Self {
        let warns_of_prefetch = !backend.prefetches();
        if warns_of_prefetch {
            warn_ignored_prefetch(&limits.prefetching_names(), &[]);
        }
        let regions = if backend.regional() {
            Regions::Shares
        } else {
            warn_not_regional(&limits.across_regions_names(), &[]);
            Regions::PerRegion
        };
        let store = backend.override_store().map(|s| s.0);
        let limiter = Self::build(
            limits,
            Arc::clone(&backend),
            store,
            warns_of_prefetch,
            regions,
        );
        if regions == Regions::Shares {
            let inner = Arc::downgrade(&limiter.inner);
            backend.follow_limits(Arc::new(move || {
                inner.upgrade().map(|i| i.limits.load_full())
            }));
        }
        limiter
    }

    /// A limiter deciding in memory what `limits` say, stored overrides included, without
    /// following a store of its own (the layer's fallback: it follows the main limiter's). It
    /// says nothing of `prefetch`: the limits are the main limiter's, whose backend may
    /// prefetch. It decides by `clock` (the main backend's), or the system clock. When the main
    /// backend is `regional`, it denies every limit marked `across_regions` (it knows no
    /// share).
    /// Its memory comes with it, to start a key banned in ([`FallbackBans`]).
    pub(crate) fn fallback(
        limits: Limits,
        clock: Option<Arc<dyn crate::time::Clock>>,
        regional: bool,
    ) -> (Self, FallbackBans) {
        let memory = match clock {
            Some(clock) => crate::backend::MemoryBackend::builder()
                .clock(clock)
                .build(),
            None => crate::backend::MemoryBackend::new(),
        };
        let regions = if regional {
            Regions::Closed
        } else {
            Regions::PerRegion
        };
        let bans = FallbackBans(memory.clone());
        (
            Self::build(limits, Arc::new(memory), None, false, regions),
            bans,
        )
    }

    fn build(
        limits: Limits,
        backend: Arc<dyn Backend>,
        store: Option<Arc<dyn crate::backend::OverrideStore>>,
        warns_of_prefetch: bool,
        regions: Regions,
    ) -> Self {
        let limits = match &store {
            Some(store) => overrides::applied(&limits, store.as_ref(), &store.in_force(&limits)),
            None => limits,
        };
        let limiter = Self {
            inner: Arc::new(Inner {
                limits: ArcSwap::from_pointee(limits),
                backend,
                generation: AtomicU64::new(0),
                pinned: Mutex::new(Vec::new()),
                reloading: Mutex::new(()),
                next_lease: AtomicU64::new(crate::time::random_u64()),
                store,
                renewals: renewals::Renewals::default(),
                warns_of_prefetch,
                regions,
            }),
        };
        limiter.watch_store();
        limiter
    }

    /// Whether the limiter decides with all it must know: its backend is ready
    /// ([`Backend::ready`]; on Redis, the stored overrides were read whole once). Until then a
    /// spend fails and the layer's failure policy answers: give it to a load balancer as the
    /// instance's readiness, so that no traffic reaches an instance before it knows every
    /// block.
    ///
    /// ```
    /// # use tower_ratelimits::{Limiter, Limits, MemoryBackend};
    /// # let limits = Limits::from_yaml_str("A: {burst: 1, count: 1, period: 1s}", None).unwrap();
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// assert!(limiter.is_ready()); // memory keeps its overrides itself
    /// // axum: .route("/ready", get(move || async move {
    /// //     if limiter.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE } }))
    /// ```
    pub fn is_ready(&self) -> bool {
        self.inner.backend.ready()
    }

    /// Waits until the backend is ready, within the backend's bound (a lazy Redis backend
    /// waits for its first read of the stored overrides while its store answers:
    /// [`ready_wait`](crate::RedisBackendBuilder::ready_wait)), and says whether it is.
    pub(crate) async fn until_ready(&self) -> bool {
        self.inner.backend.until_ready().await
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
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
        // Not through `run`: a spend's future then holds no refund's working storage (its
        // transactions, 80 bytes each of eight, and what they resolved to): it stays small.
        self.refund_in(&self.load(), batch).await
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
        self.give_back(leases, None).await
    }

    /// [`release`](Self::release)s `leases` with what their request showed: a limit that
    /// learns from its requests (an [`AdaptiveConcurrency`](crate::AdaptiveConcurrency)
    /// limit) records it in the key's window in the store; the others ignore it. The layer
    /// calls it when a request that held slots ends (its latency to the response's head or
    /// body's end, whether it failed).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimits::{Completion, Id, Limiter, Limits, MemoryBackend, Transaction};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str(
    ///     "Search: {concurrency: {adaptive: {min: 1, initial: 4, max: 50}}}",
    ///     None,
    /// )?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let search = Transaction::new(limiter.key("Search", Id::from(7u64))?);
    /// let d = limiter.spend(&[search]).await?;
    /// let leases: Vec<_> = d.decisions().iter().filter_map(|d| d.lease()).collect();
    /// let done = Completion::new(Duration::from_millis(12), false);
    /// assert_eq!(limiter.complete(&leases, done).await?, 1);
    /// # Ok(()) }
    /// ```
    pub async fn complete(
        &self,
        leases: &[Lease],
        completion: crate::completion::Completion,
    ) -> Result<usize, LimiterError> {
        self.give_back(leases, Some(completion)).await
    }

    async fn give_back(
        &self,
        leases: &[Lease],
        completion: Option<crate::completion::Completion>,
    ) -> Result<usize, LimiterError> {
        let mut txs = lease_txs(leases, Mode::CheckAndSpend)?;
        if let Some(c) = completion.as_ref() {
            for tx in &mut txs {
                *tx = tx.with_completion(c);
            }
        }
        if txs.is_empty() {
            return Ok(0);
        }
        let outcomes = self.inner.backend.refund(&txs).await?;
        if completion.is_some() {
            // The numbers the completions left their keys at, on limits that learn.
            for (l, o) in leases.iter().zip(&outcomes) {
                if let Some(slots) = l.quota.slots_learned(o.shape_number).filter(|_| o.allowed) {
                    crate::telemetry::adaptive_slots(l.key.name(), slots);
                }
            }
        }
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
        // One transaction per key, naming all of its leases: a store call renews every key at
        // once, whatever the number of requests holding them. A batch never names a key twice
        // (a reload between two leases of one key once made two transactions of it, and the
        // memory backend locked that key's slot twice). Leases taken before and after
        // a change of the limit are renewed under the newest lease's limit (ids only grow): the
        // lease time in force.
        let mut groups: Vec<(&Lease, Vec<u64>)> = Vec::new();
        let mut index: std::collections::HashMap<&BucketKey, usize, foldhash::fast::RandomState> =
            std::collections::HashMap::default();
        for l in leases {
            match index.get(&l.key) {
                Some(&i) => {
                    let (newest, ids) = &mut groups[i];
                    ids.push(l.id);
                    if l.id > newest.id {
                        *newest = l;
                    }
                }
                None => {
                    index.insert(&l.key, groups.len());
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
                quota.holds_leases().then(|| Lease {
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
            let floor = self.load().across_regions(key.name());
            let region_share = match (&limit, floor, self.inner.regions) {
                (Some(quota), Some(floor), Regions::Shares) => {
                    self.inner.backend.region_share(key, quota, floor).await?
                }
                _ => None,
            };
            return Ok(Inspection {
                banned_for: d.banned.then(|| d.retry_after()),
                slots: d.slots(),
                limit,
                source,
                blocked,
                remaining,
                reset_after,
                region_share,
            });
        }
    }

    /// Forgets what buckets spent: they become full. A concurrency key keeps the leases of its
    /// requests in flight (a reset never lets more run at once than the limit: they end when
    /// their requests do, or, for an instance that died, at their deadlines).
    ///
    /// A reset also lifts a key's ban and forgets its penalty level (`docs/penalties.md`).
    pub async fn reset(&self, keys: &[BucketKey]) -> Result<(), LimiterError> {
        // A key's penalty state, where a store keeps it at a key of its own (memory: the
        // limit's name with `:pen`; Redis deletes it with the key's, by its suffix).
        let penalties: Vec<BucketKey> = {
            let limits = self.load();
            keys.iter()
                .filter_map(|k| {
                    let p = limits.entry(k.name())?.penalty.as_ref()?;
                    Some(BucketKey::new(p.state, k.id().clone()))
                })
                .collect()
        };
        let refs: Vec<&BucketKey> = keys.iter().chain(&penalties).collect();
        self.inner.backend.reset(&refs).await?;
        Ok(())
    }

    /// A spend or a check (a refund takes [`refund_in`](Self::refund_in)).
    async fn run(&self, batch: &[Transaction], op: Op) -> Result<BatchDecision, LimiterError> {
        let pending = {
            let limits = self.load();
            let mut verdict = Verdict::new(batch);
            match self.step(&limits, &mut verdict, op) {
                Ok(Step::Ready) => return verdict.decision(),
                Ok(Step::Pending(p)) => Some(p),
                // A backend still reading what it must know (out of line: nothing else pays).
                Err(LimiterError::Backend(BackendError::NotReady)) => None,
                Err(e) => return Err(e),
            }
        };
        match pending {
            Some(pending) => pending.decided(batch).await,
            None => Box::pin(self.run_when_ready(batch, op)).await,
        }
    }

    /// [`run`](Self::run) once the backend is ready (a fresh lazy Redis backend reading the
    /// stored overrides): the batch resolved again under the limits then in force. Not ready
    /// within the backend's bound (or not ready again): the store's failure.
    #[cold]
    async fn run_when_ready(
        &self,
        batch: &[Transaction],
        op: Op,
    ) -> Result<BatchDecision, LimiterError> {
        let not_read = || LimiterError::Backend(BackendError::not_read());
        if !self.until_ready().await {
            return Err(not_read());
        }
        let pending = {
            let limits = self.load();
            let mut verdict = Verdict::new(batch);
            match self.step(&limits, &mut verdict, op) {
                Ok(Step::Ready) => return verdict.decision(),
                Ok(Step::Pending(p)) => p,
                Err(LimiterError::Backend(BackendError::NotReady)) => return Err(not_read()),
                Err(e) => return Err(e),
            }
        };
        pending.decided(batch).await
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

/// The waiting rule, for [`Limiter::spend_or_wait`] and the layer's [`Wait`](crate::Wait): a
/// denial whose `retry_after` (`wait`, above zero) ends within `bound` of the first denial
/// (`waited` ago) waits.
pub(crate) fn may_wait(waited: Duration, wait: Duration, bound: Duration) -> bool {
    !wait.is_zero() && waited.saturating_add(wait) <= bound
}
