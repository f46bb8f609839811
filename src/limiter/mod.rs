//! The [`Limiter`]: limits plus a backend, usable on its own (a job queue, a CLI, an
//! interceptor) or through the tower middleware.

use std::sync::Arc;

use crate::backend::{Backend, BackendError, BucketTx, TransactionError};
use crate::backend::{Mode, Outcome};
use crate::config::Limits;

pub use decision::{BatchDecision, Decision};
pub use transaction::Transaction;

mod decision;
mod transaction;
use crate::key::{BucketKey, Id, IdError, LimitName};
use crate::quota::Quota;
use crate::time::us;

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
    /// A cost range (`min..=max` with `min < max`) for a GCRA limit, which grants all or
    /// nothing; only tiered limits grant part of a request.
    #[error("limit {name}: a cost range needs a tiered limit (GCRA grants all or nothing)")]
    CostRangeOnGcra {
        /// The limit name.
        name: LimitName,
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
            TransactionError::CostRangeOnGcra => Self::CostRangeOnGcra { name },
            TransactionError::EmptyCostRange { min, max } => {
                Self::EmptyCostRange { name, min, max }
            }
        }
    }
}

struct Inner {
    limits: Limits,
    backend: Arc<dyn Backend>,
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
/// assert_eq!(denied.strictest().unwrap().retry_after, Duration::from_millis(500));
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

/// One transaction of a batch, resolved.
struct Resolved<'a> {
    quota: Option<&'a Quota>,
    mode: Mode,
    cost: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Spend,
    Check,
    Refund,
}

impl Limiter {
    /// A limiter over `limits` storing state in `backend`.
    pub fn new(limits: Limits, backend: impl Backend) -> Self {
        Self::with_shared_backend(limits, Arc::new(backend))
    }

    /// A limiter over a backend shared with others.
    pub fn with_shared_backend(limits: Limits, backend: Arc<dyn Backend>) -> Self {
        Self {
            inner: Arc::new(Inner { limits, backend }),
        }
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// A limit's name, when the configuration defines it (look it up once, at set-up).
    pub fn name(&self, name: &str) -> Result<LimitName, LimiterError> {
        self.inner
            .limits
            .name(name)
            .ok_or_else(|| LimiterError::UnknownName(name.to_owned()))
    }

    /// The bucket key of a name and an id.
    pub fn key(&self, name: &str, id: Id) -> Result<BucketKey, LimiterError> {
        Ok(BucketKey::new(self.name(name)?, id))
    }

    /// The bucket key of a name and an id given as text, checked against the name's id kind.
    pub fn parse_key(&self, name: &str, id: &str) -> Result<BucketKey, LimiterError> {
        let name = self.name(name)?;
        let kind = self.inner.limits.id_kind(name).unwrap_or_default();
        let id = kind
            .parse(id)
            .map_err(|source| LimiterError::InvalidId { name, source })?;
        Ok(BucketKey::new(name, id))
    }

    /// Decides a batch and spends it if it is allowed (all or nothing).
    pub async fn spend(&self, batch: &[Transaction]) -> Result<BatchDecision, LimiterError> {
        self.run(batch, Op::Spend).await
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

    /// Deletes buckets: they become full.
    pub async fn reset(&self, keys: &[BucketKey]) -> Result<(), LimiterError> {
        let refs: Vec<&BucketKey> = keys.iter().collect();
        self.inner.backend.reset(&refs).await?;
        Ok(())
    }

    /// Decides and spends a batch without waiting, when the backend can (see
    /// [`Backend::spend_now`]); `None` means "call [`spend`](Self::spend)".
    pub fn try_spend_now(
        &self,
        batch: &[Transaction],
    ) -> Option<Result<BatchDecision, LimiterError>> {
        let (resolved, txs) = match self.resolve(batch, Op::Spend) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let outcomes = if txs.is_empty() {
            Vec::new()
        } else {
            match self.inner.backend.spend_now(&txs)? {
                Ok(o) => o,
                Err(e) => return Some(Err(e.into())),
            }
        };
        Some(self.finish(batch, resolved, txs.len(), outcomes, Op::Spend))
    }

    async fn run(&self, batch: &[Transaction], op: Op) -> Result<BatchDecision, LimiterError> {
        let (resolved, txs) = self.resolve(batch, op)?;
        let outcomes = if txs.is_empty() {
            Vec::new()
        } else if op == Op::Refund {
            self.inner.backend.refund(&txs).await?
        } else {
            self.inner.backend.spend(&txs).await?
        };
        self.finish(batch, resolved, txs.len(), outcomes, op)
    }

    /// Checks a batch and resolves each transaction's limit and cost.
    #[allow(clippy::type_complexity)]
    fn resolve<'a>(
        &'a self,
        batch: &'a [Transaction],
        op: Op,
    ) -> Result<(Batch<Resolved<'a>>, Batch<BucketTx<'a>>), LimiterError> {
        let limits = &self.inner.limits;
        if let Some(key) = first_duplicate(batch) {
            return Err(LimiterError::DuplicateKey(key.to_string()));
        }
        let mut resolved: Batch<Resolved<'a>> = Batch::with_capacity(batch.len());
        let mut txs: Batch<BucketTx<'_>> = Batch::with_capacity(batch.len());
        for tx in batch {
            let name = tx.key().name();
            let Some(entry) = limits.entry(name) else {
                return Err(LimiterError::UnknownName(name.to_string()));
            };
            let mode = if op == Op::Check {
                Mode::CheckOnly
            } else {
                tx.get_mode()
            };
            let quota = limits.resolve_in(entry, tx.key());
            let default_cost = entry.cost;
            let cost = tx.cost_or(default_cost);
            if let Some(quota) = quota {
                let costs = tx.min_cost_or(default_cost)..=cost;
                let checked = if op == Op::Refund {
                    BucketTx::for_refund(tx.key(), quota, costs, mode)
                } else {
                    BucketTx::new(tx.key(), quota, costs, mode)
                };
                txs.push(checked.map_err(|e| LimiterError::from_transaction(name, e))?);
            }
            resolved.push(Resolved { quota, mode, cost });
        }
        Ok((resolved, txs))
    }

    /// Turns the backend's outcomes into decisions.
    fn finish(
        &self,
        batch: &[Transaction],
        resolved: Batch<Resolved<'_>>,
        sent: usize,
        outcomes: Vec<Outcome>,
        op: Op,
    ) -> Result<BatchDecision, LimiterError> {
        if outcomes.len() != sent {
            return Err(BackendError::Unavailable(format!(
                "backend returned {} outcomes for {} transactions",
                outcomes.len(),
                sent
            ))
            .into());
        }
        let mut outcomes = outcomes.into_iter();
        let decisions = batch
            .iter()
            .zip(resolved)
            .map(|(tx, r)| {
                let o = match r.quota {
                    Some(_) => outcomes.next().unwrap_or_default(),
                    None => Outcome::new(true, u64::MAX, 0, 0),
                };
                let granted = match (&o.tiers, o.allowed, op) {
                    (Some(t), _, _) => t.granted,
                    (None, true, Op::Spend | Op::Check) => r.cost,
                    _ => 0,
                };
                Decision {
                    allowed: o.allowed,
                    granted,
                    remaining: o.remaining,
                    retry_after: us(o.retry_after_us),
                    reset_after: us(o.reset_after_us),
                    limit: r.quota.cloned(),
                    tiers: o.tiers,
                    name: tx.key().name(),
                    key: tx.key().clone(),
                    mode: r.mode,
                    skipped: o.skipped,
                }
            })
            .collect();
        Ok(BatchDecision::new(decisions))
    }
}
