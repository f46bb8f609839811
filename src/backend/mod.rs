//! Storage backends: where bucket state lives.
//!
//! A [`Backend`] applies a batch of [`BucketTx`] atomically and returns one [`Outcome`] per
//! transaction. Every backend produces the same outcomes for the same inputs and times
//! (`docs/gcra.md`); the shared conformance tests hold them to it.

use std::ops::RangeInclusive;

use async_trait::async_trait;

use crate::algo::concurrency::ConcurrencyOutcome;
use crate::algo::gcra::{GcraError, GcraOutcome};
use crate::algo::tiers::{TierDecision, TierGrant, TierRequestError, TieredLimit};
use crate::key::{BucketKey, LimitName};
use crate::quota::Quota;

pub mod kit;
pub mod memory;
mod overrides;
#[cfg(feature = "redis")]
pub mod redis;
pub(crate) mod regions;

pub use crate::mode::Mode;
#[cfg(feature = "redis")]
pub(crate) use kit::batch_allowed;
pub(crate) use kit::{gcra_decide, gcra_write};
pub use memory::{MemoryBackend, MemoryBackendBuilder};
pub use overrides::DEFAULT_MAX_OVERRIDES;
pub use overrides::OverrideStoreRef;
pub(crate) use overrides::{MemoryOverrides, OverrideStore, PutError, StoreEvent};
#[cfg(feature = "redis")]
pub(crate) use overrides::{Watched, Watcher};
#[cfg(feature = "redis")]
pub use redis::{CoalesceStats, RedisBackend, RedisBackendBuilder, RedisSetupError, RegionalError};

/// The limits a limiter holds now, while it lives (`None` once it is gone): what a regional
/// backend follows ([`Backend::follow_limits`]).
#[doc(hidden)]
pub type FollowedLimits =
    std::sync::Arc<dyn Fn() -> Option<std::sync::Arc<crate::config::Limits>> + Send + Sync>;

/// What a backend decided for one transaction of a batch. Plain data (`Copy`, nothing to
/// drop): a tiered transaction's grant per tier travels beside it, in its batch's [`Outcomes`]
/// ([`Outcomes::tier_grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Outcome {
    /// Allowed (spend, check) or refunded something (refund).
    pub allowed: bool,
    /// Tokens left.
    pub remaining: u64,
    /// Microseconds until an equal request would be allowed.
    pub retry_after_us: u64,
    /// Microseconds until the bucket is full again.
    pub reset_after_us: u64,
    /// For a GCRA transaction asked for a range of units (a partial grant,
    /// [`Transaction::cost_range`](crate::Transaction::cost_range)): the units granted, 0 on a
    /// denial. `None` for a single cost, which is granted whole when allowed. A custom
    /// backend that decides a range ([`BucketTx::min_cost`] below [`BucketTx::cost`]) sets it.
    pub granted: Option<u64>,
    /// A number of the limit's own shape, which only the shape's answers read (what a
    /// decision shows of it): for a calendar quota, the length in whole seconds of the period
    /// the decision was made in, by the store's clock (the `w` of its policy,
    /// [`CalendarQuota::length_of_period_ending`](crate::CalendarQuota::length_of_period_ending));
    /// for an adaptive concurrency limit, the key's number of slots when decided (the `q` of
    /// its policy, at most [`MAX_ADAPTIVE_SLOTS`](crate::MAX_ADAPTIVE_SLOTS)); 0 for every
    /// other shape. The kit sets it. Four bytes beside the flags: an outcome is moved on
    /// every request's road.
    pub shape_number: u32,
    /// Not evaluated: another counting transaction of the batch was already known to be denied
    /// (the Redis backend's local deny cache), so this one was never looked at. A skipped
    /// outcome is not allowed and all its numbers are zero; nothing was spent.
    pub skipped: bool,
    /// Denied because its key is banned by its limit's penalty ladder (`docs/penalties.md`):
    /// set on a penalty's companion and folded into its limit's outcome, for the answer.
    pub(crate) banned: bool,
    /// Always zero: the number and the flags then fill one word, which a copy moves at once
    /// (with padding there, the flags were copied byte by byte: 11 more instructions a
    /// calendar spend, `benches/instructions.sh`).
    pub(crate) filled: u8,
}

impl Outcome {
    /// An outcome from its fields.
    pub fn new(allowed: bool, remaining: u64, retry_after_us: u64, reset_after_us: u64) -> Self {
        Self {
            allowed,
            remaining,
            retry_after_us,
            reset_after_us,
            granted: None,
            shape_number: 0,
            skipped: false,
            banned: false,
            filled: 0,
        }
    }

    /// The denial of a banned key's request, `wait_us` before the ban ends.
    pub(crate) fn banned(wait_us: u64) -> Self {
        Self {
            banned: true,
            ..Self::new(false, 0, wait_us, wait_us)
        }
    }

    /// The outcome of a transaction that was not evaluated because its batch was already
    /// denied by another transaction (see [`Outcome::skipped`]).
    pub fn skip() -> Self {
        Self {
            skipped: true,
            ..Self::new(false, 0, 0, 0)
        }
    }

    /// The outcome of a tiered decision, and its grant per tier (which goes beside it in its
    /// batch's [`Outcomes`]).
    pub(crate) fn tiered(d: &TierDecision, limit: &TieredLimit) -> (Self, TierGrant) {
        (
            Self::new(d.allowed, d.remaining, d.retry_after_us, d.reset_after_us),
            d.grant(limit),
        )
    }
}

impl From<ConcurrencyOutcome> for Outcome {
    fn from(o: ConcurrencyOutcome) -> Self {
        Self::new(o.allowed, o.remaining, o.retry_after_us, o.reset_after_us)
    }
}

impl From<GcraOutcome> for Outcome {
    fn from(o: GcraOutcome) -> Self {
        Self::new(o.allowed, o.remaining, o.retry_after_us, o.reset_after_us)
    }
}

/// One transaction as a backend sees it: a bucket, the quota that applies to it, what is
/// asked and how it takes part in the batch.
///
/// It is checked once, when it is built ([`BucketTx::new`], [`BucketTx::for_refund`]; the
/// [`Limiter`](crate::Limiter) builds every one it sends): a backend never checks a cost
/// again, it decides.
#[derive(Debug, Clone, Copy)]
pub struct BucketTx<'a> {
    pub(crate) key: &'a BucketKey,
    pub(crate) quota: &'a Quota,
    pub(crate) cost: u64,
    pub(crate) min_cost: u64,
    pub(crate) mode: Mode,
    /// On a concurrency limit: the lease a spend takes or a refund gives back (0: none).
    pub(crate) lease: u64,
    /// A renewal's leases ([`Mode::Renew`]): every lease of the key this instance holds, in
    /// one transaction (empty: `lease` alone).
    pub(crate) leases: &'a [u64],
    /// A limit marked `across_regions` sent to a backend in regional mode
    /// ([`Backend::regional`]): the floor its region holds, and the transaction is decided by
    /// its region's share bucket (`docs/regions.md`). `None` everywhere else.
    pub(crate) floor: Option<crate::config::RegionFloor>,
    /// A refund that gives back a lease: what the request that held it showed (its latency,
    /// whether it failed), for a shape that learns from it (an adaptive concurrency limit);
    /// `None`: nothing known (a release without one, every other transaction).
    pub(crate) completion: Option<&'a crate::completion::Completion>,
    /// A penalty's companion (`docs/penalties.md`): the transaction decides the key's penalty
    /// state under this ladder (kept at [`kit::state_key`]), not its limit's bucket; sent by
    /// the limiter after its limit's transaction, in the same batch. `None` everywhere else.
    pub(crate) penalty: Option<&'a crate::config::PenaltyEntry>,
}

/// Why a transaction cannot be built: what it asks could never be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransactionError {
    /// The cost (for a range: its lower end, the smallest acceptable grant) is above the
    /// burst (for a tiered limit: the sum of the tiers' limits).
    #[error("cost {cost} exceeds the burst of {burst}")]
    CostAboveBurst {
        /// The cost.
        cost: u64,
        /// The burst.
        burst: u64,
    },
    /// A cost range whose lower end is above its upper end.
    #[error("the cost range {min}..={max} is empty")]
    EmptyCostRange {
        /// The lower end.
        min: u64,
        /// The upper end.
        max: u64,
    },
    /// A cost range on a concurrency limit, where a request holds one slot or probes (cost 0).
    #[error("a concurrency limit takes a cost of 0 or 1, not a range")]
    RangeOnConcurrency,
    /// A renewal ([`Mode::Renew`]) on a limit that holds no slots (GCRA, tiers, a calendar
    /// quota).
    #[error("only a concurrency limit's leases can be renewed")]
    RenewWithoutSlots,
}

impl<'a> BucketTx<'a> {
    /// A spend (or, in [`Mode::CheckOnly`], a check) of `costs` units on `key` under `quota`:
    /// one cost (`n..=n`), or a range (`min..=max`: as many units as the limit grants, at
    /// least `min`; `max` may exceed the burst).
    ///
    /// ```
    /// use tower_ratelimits::{BucketKey, BucketTx, Id, Limit, Limits, Mode, Quota, TransactionError};
    /// # let limits = Limits::builder()
    /// #     .limit("Api", Limit::from_micros(5, 5, 1_000_000).unwrap()).build().unwrap();
    /// let key = BucketKey::new(limits.name("Api").unwrap(), Id::from(7u64));
    /// let quota = limits.resolve(&key).unwrap();
    /// assert!(BucketTx::new(&key, quota, 2..=2, Mode::CheckAndSpend).is_ok());
    /// assert_eq!(
    ///     BucketTx::new(&key, quota, 6..=6, Mode::CheckAndSpend).unwrap_err(),
    ///     TransactionError::CostAboveBurst { cost: 6, burst: 5 }
    /// );
    /// ```
    pub fn new(
        key: &'a BucketKey,
        quota: &'a Quota,
        costs: RangeInclusive<u64>,
        mode: Mode,
    ) -> Result<Self, TransactionError> {
        Self::for_refund(key, quota, costs, mode)
    }

    /// A refund of up to `costs`' upper end (a GCRA refund may carry a range; only its upper
    /// end counts).
    pub fn for_refund(
        key: &'a BucketKey,
        quota: &'a Quota,
        costs: RangeInclusive<u64>,
        mode: Mode,
    ) -> Result<Self, TransactionError> {
        let (min_cost, cost) = costs.into_inner();
        if min_cost > cost {
            return Err(TransactionError::EmptyCostRange {
                min: min_cost,
                max: cost,
            });
        }
        if mode == Mode::Renew && !quota.holds_leases() {
            return Err(TransactionError::RenewWithoutSlots);
        }
        // What must fit is the least acceptable part (a single cost is its own least part):
        // a range may ask for more than the burst, and is granted what fits. A charge on a
        // GCRA limit or a calendar quota is taken whatever its size.
        let takes_what_fits = mode == Mode::Charge && quota.charges_any_cost();
        if min_cost > quota.max_cost() && !takes_what_fits {
            return Err(TransactionError::CostAboveBurst {
                cost: min_cost,
                burst: quota.max_cost(),
            });
        }
        if quota.holds_leases() && min_cost < cost {
            return Err(TransactionError::RangeOnConcurrency);
        }
        Ok(Self {
            key,
            quota,
            cost,
            min_cost,
            mode,
            lease: 0,
            leases: &[],
            floor: None,
            completion: None,
            penalty: None,
        })
    }

    /// Decided by its region's share bucket, with this floor (`docs/regions.md`): set by the
    /// limiter on a limit marked `across_regions` when its backend is regional.
    pub(crate) fn across_regions(mut self, floor: Option<crate::config::RegionFloor>) -> Self {
        self.floor = floor;
        self
    }

    /// The companion of this transaction deciding its key's penalty under `penalty` (set by
    /// the limiter, in the same batch).
    pub(crate) fn penalty_of(self, penalty: &'a crate::config::PenaltyEntry) -> Self {
        Self {
            penalty: Some(penalty),
            ..self
        }
    }

    /// The same transaction at `cost` (a penalty's settle: the units its outcome counted).
    pub(crate) fn with_cost(self, cost: u64) -> Self {
        Self {
            cost,
            min_cost: cost,
            ..self
        }
    }

    /// On a concurrency limit, the lease this transaction takes (a spend of cost 1) or gives
    /// back (a refund): an id unique among the leases of its key, not 0 (the
    /// [`Limiter`](crate::Limiter) makes one per spend). A concurrency spend without a lease
    /// id is decided but takes no slot; elsewhere the id is ignored.
    pub fn with_lease(mut self, id: u64) -> Self {
        self.lease = id;
        self
    }

    /// The lease id (0: none); see [`with_lease`](Self::with_lease).
    pub fn lease(&self) -> u64 {
        self.lease
    }

    /// A refund giving back a lease, with what its request showed: a shape that learns from
    /// its requests' outcomes (an adaptive concurrency limit) records it. Any shape may read
    /// it ([`completion`](Self::completion)); the others ignore it.
    pub fn with_completion(mut self, completion: &'a crate::completion::Completion) -> Self {
        self.completion = Some(completion);
        self
    }

    /// What the request giving back its lease showed, if it is known.
    pub fn completion(&self) -> Option<&'a crate::completion::Completion> {
        self.completion
    }

    /// A renewal ([`Mode::Renew`]) of every lease of `ids` on this key, in one transaction:
    /// the kit renews each that still holds its slot, and reports how many in
    /// [`Outcome::granted`].
    pub(crate) fn with_leases(mut self, ids: &'a [u64]) -> Self {
        self.leases = ids;
        self
    }

    /// The leases a renewal renews: those of [`with_leases`](Self::with_leases), else its one
    /// [`lease`](Self::lease).
    pub(crate) fn renewed(&self) -> &[u64] {
        if self.leases.is_empty() {
            std::slice::from_ref(&self.lease)
        } else {
            self.leases
        }
    }

    /// The bucket.
    pub fn key(&self) -> &'a BucketKey {
        self.key
    }

    /// The quota that applies to the bucket.
    pub fn quota(&self) -> &'a Quota {
        self.quota
    }

    /// Its GCRA limit, when it is decided as that limit alone: not a region's share bucket,
    /// whose limit the store finds (`docs/regions.md`).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    #[inline]
    pub(crate) fn plain_gcra(&self) -> Option<&'a crate::algo::gcra::Limit> {
        self.word_limit().filter(|_| self.floor.is_none())
    }

    /// Whether what it spends is undone by putting its value back (a tiered key's, a
    /// penalty's: `Restore`), not by a refund.
    #[cfg(feature = "redis")]
    pub(crate) fn undone_by_value(&self) -> bool {
        self.penalty.is_some() || self.quota.undone_by_value()
    }

    /// Its GCRA limit when its state is that limit's word (not a penalty's companion, which
    /// keeps its key's penalty state): how the memory backend tells its words from its slots.
    #[inline(always)]
    pub(crate) fn word_limit(&self) -> Option<&'a crate::algo::gcra::Limit> {
        self.quota.as_gcra().filter(|_| self.penalty.is_none())
    }

    /// Units to spend or refund; for a range, the most units asked for.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// For a range, the fewest units acceptable (`min_cost..=cost`); else the cost.
    pub fn min_cost(&self) -> u64 {
        self.min_cost
    }

    /// How this transaction takes part in the batch.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

/// Why a backend could not decide.
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The in-memory backend holds `max_keys` live buckets and cannot track a new one.
    #[error("the in-memory backend is full ({max_keys} live keys)")]
    Full {
        /// The configured cap.
        max_keys: usize,
    },
    /// The backend did not answer in time.
    #[error("the backend did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The store could not be reached or failed.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The store is out of memory and refused the write (Redis at `maxmemory` with the
    /// `noeviction` policy): nothing was recorded. The store was reached, so the circuit
    /// breaker does not count it; the failure policy applies.
    #[error("the store is out of memory and refused the write: {0}")]
    OutOfMemory(String),
    /// The store failed repeatedly and the circuit breaker is open: answered at once, without
    /// trying. When the cool-off ends a probe runs in the background; `retry_in` is zero while
    /// it does.
    #[error("backend circuit open after repeated failures (probe in {retry_in:?})")]
    CircuitOpen {
        /// Until the cool-off ends and a probe is let through.
        retry_in: std::time::Duration,
    },
    /// A bucket's stored value is not a valid state. The backends of this crate never return
    /// it (the Redis backend decides such a value as a fresh bucket and replaces it); a custom
    /// backend may.
    #[error("invalid state stored for bucket {key}: {reason}")]
    InvalidState {
        /// The bucket.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The algorithm refused the input.
    #[error(transparent)]
    Gcra(#[from] GcraError),
    /// The tiered algorithm refused the request (a range it cannot grant).
    #[error(transparent)]
    Tiers(#[from] TierRequestError),
    /// The backend is still reading what it must know to decide (a fresh lazy Redis
    /// backend's stored overrides) while its store answers: nothing was spent. The layer and
    /// [`Limiter::spend`](crate::Limiter::spend) wait for
    /// [`Backend::until_ready`](crate::Backend::until_ready) and take the batch again, under the
    /// limits then in force; a caller of the backend itself does the same.
    #[error("the backend is reading what it must know before it decides (the stored overrides)")]
    NotReady,
}

readable_debug!(BackendError { Full { max_keys }, Timeout(after), Unavailable(reason), OutOfMemory(reason), CircuitOpen { retry_in }, InvalidState { key, reason }, Gcra(error), Tiers(error), NotReady });

/// A backend's outcomes for a batch, one per transaction, in order (read them as a slice:
/// `Outcomes` derefs to `[Outcome]`), and the grant per tier of each tiered one
/// ([`tier_grant`](Self::tier_grant)).
///
/// One outcome is on the stack (a request with one rule: the commonest decision allocates
/// nothing; four inline cost a one-rule request 29 instructions and `Backend::spend` 51, for
/// 27 fewer on three rules: callgrind, `benches/instructions.sh`). The tier grants, 80 bytes
/// each, are kept apart so that an outcome is plain data: a batch without a tiered limit
/// carries an empty list, which costs nothing to build or drop.
///
/// ```
/// use tower_ratelimits::{Outcome, Outcomes};
/// let mut outcomes = Outcomes::new();
/// outcomes.push(Outcome::new(true, 4, 0, 200_000));
/// assert_eq!(outcomes.len(), 1);
/// assert!(outcomes[0].allowed && outcomes.tier_grant(0).is_none());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcomes {
    list: smallvec::SmallVec<[Outcome; 1]>,
    /// `(position, grant)` of the tiered outcomes, by position; `None` when there are none
    /// (one word, nothing to free; a tiered batch's grants are few, copied when one is added).
    grants: Option<Box<[(usize, TierGrant)]>>,
}

impl Outcomes {
    /// No outcomes.
    pub fn new() -> Self {
        Self::default()
    }

    /// No outcomes, with room for `n`.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            list: smallvec::SmallVec::with_capacity(n),
            grants: None,
        }
    }

    /// Keeps the first `n` outcomes (those after carry no tier grant: a penalty's companions).
    pub(crate) fn truncate(&mut self, n: usize) {
        self.list.truncate(n);
    }

    /// `n` copies of `outcome`, each to be replaced ([`set`](Self::set)): for a backend that
    /// answers a batch's transactions out of order (one call per node of a cluster).
    pub fn filled(n: usize, outcome: Outcome) -> Self {
        Self {
            list: smallvec::smallvec![outcome; n],
            grants: None,
        }
    }

    /// One outcome (built in place: no copy on the way out).
    #[inline]
    pub(crate) fn one(outcome: Outcome) -> Self {
        Self {
            list: smallvec::SmallVec::from_buf([outcome]),
            grants: None,
        }
    }

    /// Adds the next transaction's outcome.
    #[inline]
    pub fn push(&mut self, outcome: Outcome) {
        self.list.push(outcome);
    }

    /// Adds the next transaction's outcome with its grant per tier (a tiered limit's).
    pub fn push_tiered(&mut self, outcome: Outcome, grant: Option<TierGrant>) {
        if let Some(g) = grant {
            self.put_grant(self.list.len(), g);
        }
        self.list.push(outcome);
    }

    /// Replaces the outcome at `i` (and its grant); nothing when `i` is out of range.
    pub fn set(&mut self, i: usize, outcome: Outcome, grant: Option<TierGrant>) {
        let Some(slot) = self.list.get_mut(i) else {
            return;
        };
        *slot = outcome;
        if let Some(grants) = self.grants.take() {
            let left: Vec<_> = grants.into_iter().filter(|&(at, _)| at != i).collect();
            self.grants = (!left.is_empty()).then(|| left.into_boxed_slice());
        }
        if let Some(g) = grant {
            self.put_grant(i, g);
        }
    }

    /// Records the grant of the outcome at `i` (none recorded there), in order of position.
    pub(crate) fn put_grant(&mut self, i: usize, grant: TierGrant) {
        let mut grants = self.grants.take().map_or_else(Vec::new, Vec::from);
        let at = grants.partition_point(|&(at, _)| at < i);
        grants.insert(at, (i, grant));
        self.grants = Some(grants.into_boxed_slice());
    }

    /// Whether any outcome has a grant per tier.
    #[inline]
    pub fn has_tier_grants(&self) -> bool {
        self.grants.is_some()
    }

    /// The grant per tier of the outcome at `i`, if it is a tiered limit's.
    #[inline]
    pub fn tier_grant(&self, i: usize) -> Option<&TierGrant> {
        let grants = self.grants.as_deref()?;
        grants.iter().find_map(|(at, g)| (*at == i).then_some(g))
    }

    /// Each outcome with its grant per tier, in order, by reference.
    #[inline]
    pub fn iter_tiered(&self) -> impl Iterator<Item = (&Outcome, Option<&TierGrant>)> + Clone {
        let mut grants: &[(usize, TierGrant)] = self.grants.as_deref().map_or(&[], |g| g);
        self.list
            .iter()
            .enumerate()
            .map(move |(i, o)| match grants {
                [(at, g), rest @ ..] if *at == i => {
                    grants = rest;
                    (o, Some(g))
                }
                _ => (o, None),
            })
    }

    /// Each outcome with its grant per tier, in order.
    pub fn into_tiered(self) -> impl Iterator<Item = (Outcome, Option<TierGrant>)> {
        // The grants are in order of position: one cursor, as `iter_tiered` reads them.
        let grants = self.grants.unwrap_or_default();
        let mut next = 0;
        self.list
            .into_iter()
            .enumerate()
            .map(move |(i, o)| match grants.get(next) {
                Some(&(at, g)) if at == i => {
                    next += 1;
                    (o, Some(g))
                }
                _ => (o, None),
            })
    }
}

impl std::ops::Deref for Outcomes {
    type Target = [Outcome];
    #[inline]
    fn deref(&self) -> &[Outcome] {
        &self.list
    }
}

impl std::ops::DerefMut for Outcomes {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Outcome] {
        &mut self.list
    }
}

impl<'a> IntoIterator for &'a Outcomes {
    type Item = &'a Outcome;
    type IntoIter = std::slice::Iter<'a, Outcome>;
    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

impl FromIterator<Outcome> for Outcomes {
    fn from_iter<I: IntoIterator<Item = Outcome>>(iter: I) -> Self {
        Self {
            list: iter.into_iter().collect(),
            grants: None,
        }
    }
}

impl FromIterator<(Outcome, Option<TierGrant>)> for Outcomes {
    fn from_iter<I: IntoIterator<Item = (Outcome, Option<TierGrant>)>>(iter: I) -> Self {
        let mut out = Self::new();
        for (o, g) in iter {
            out.push_tiered(o, g);
        }
        out
    }
}

/// A spend still under way: a future that owns what it needs (it outlives the batch it was
/// asked for), answering the batch's outcomes.
pub type PendingSpend =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Outcomes, BackendError>> + Send>>;

/// A backend's answer to [`Backend::spend`]: decided at once (in memory; a denial the Redis
/// backend's deny cache is sure of), or a future to await (a round trip to a store). A ready
/// answer needs no box and no await: the middleware answers such a request in `call`.
#[must_use = "a pending spend does nothing unless awaited"]
pub enum Spend {
    /// Decided.
    Ready(Result<Outcomes, BackendError>),
    /// Under way.
    Pending(PendingSpend),
}

impl Spend {
    /// The outcomes, awaited if need be.
    pub async fn outcomes(self) -> Result<Outcomes, BackendError> {
        match self {
            Spend::Ready(r) => r,
            Spend::Pending(f) => f.await,
        }
    }
}

impl std::fmt::Debug for Spend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Spend::Ready(r) => f.debug_tuple("Ready").field(r).finish(),
            Spend::Pending(_) => f.write_str("Pending(..)"),
        }
    }
}

/// A page of a limit's penalty states ([`Backend::penalty_page`]): each with its id's text,
/// the store's clock when it was read (microseconds since the Unix epoch), and where the next
/// page starts (`None`: this was the last).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct StatesPage {
    /// The states read, each with its id's text.
    pub states: Vec<(String, crate::algo::penalty::PenaltyState)>,
    /// The store's clock when they were read.
    pub now_us: u64,
    /// Where the next page starts.
    pub next: Option<String>,
}

/// A store of bucket states. Implementations must be atomic per batch: concurrent batches never
/// admit more than `docs/gcra.md` allows, and a denied batch writes nothing.
///
/// It is used as `Arc<dyn Backend>`, hence `async_trait` for `refund` and `reset`: implement it
/// under [`#[tower_ratelimits::async_trait]`](crate::async_trait), re-exported so that a
/// backend outside the crate needs no dependency of its own for it ([`kit`](crate::kit) shows
/// one in full).
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Decides a batch and, if the batch is allowed, spends it (modes as in [`Mode`]): one call
    /// per batch, the only way a batch is spent. A backend that decides without waiting
    /// answers [`Spend::Ready`]; one that must wait answers [`Spend::Pending`] with a future
    /// that owns what it needs (clone the keys and quotas it reads after its await).
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend;

    /// Refunds each transaction's cost, independently, never above a full bucket.
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError>;

    /// Forgets what buckets spent: a GCRA bucket or a tiered key becomes full. A concurrency
    /// key keeps its live leases (they are requests in flight, which end by themselves: their
    /// release, or their deadline); its ended ones may go.
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError>;

    /// Where this backend keeps the overrides set at run time
    /// ([`Limiter::set_override`](crate::Limiter::set_override)): the crate's memory and Redis
    /// backends keep them; `None` (the default) for a backend that keeps none, whose limiters
    /// refuse them ([`OverrideError::NoStore`](crate::OverrideError::NoStore)).
    #[doc(hidden)]
    fn override_store(&self) -> Option<OverrideStoreRef> {
        None
    }

    /// Whether this backend answers a hot key's requests from prefetched tokens
    /// ([`Limit::with_prefetch`](crate::Limit::with_prefetch)): the Redis backend does (unless
    /// turned off); others decide every request in the store, and a limiter over them warns
    /// once, at its start, of each limit that sets `prefetch`.
    #[doc(hidden)]
    fn prefetches(&self) -> bool {
        false
    }

    /// Whether this backend decides penalty ladders (`docs/penalties.md`): a penalty's
    /// companion transactions, after its batch's own, each deciding the key's penalty state at
    /// its own [`kit::state_key`]. A backend that decides with the kit ([`kit::spend`],
    /// [`kit::refund`]) and keeps each state at its `state_key` does: answer `true`. The
    /// memory and Redis backends do; a limiter over a backend that does not (the default)
    /// refuses the requests of a limit with a penalty ([`LimiterError::NoPenalties`]), rather
    /// than decide them without it.
    ///
    /// [`LimiterError::NoPenalties`]: crate::LimiterError::NoPenalties
    fn decides_penalties(&self) -> bool {
        false
    }

    /// One page of the penalty states of limit `limit`, kept under `state` (its name with
    /// `:pen`), for the admin API's ban list ([`Limiter::penalties`](crate::Limiter::penalties)):
    /// about `count` states after `cursor` (`None`: the first page; otherwise a `next` this
    /// backend gave), in the backend's own order. `None`: a cursor this backend never gives.
    /// The default: a backend that keeps none.
    #[doc(hidden)]
    async fn penalty_page(
        &self,
        _limit: LimitName,
        _state: LimitName,
        _cursor: Option<&str>,
        _count: usize,
    ) -> Result<Option<StatesPage>, BackendError> {
        Ok(Some(StatesPage::default()))
    }

    /// Whether this backend decides a limit marked `across_regions` as its region's share of
    /// one limit for every region (`docs/regions.md`): the Redis backend in regional mode
    /// does; every other backend decides it as a limit per region, and a limiter over it warns
    /// once of each marked limit.
    #[doc(hidden)]
    fn regional(&self) -> bool {
        false
    }

    /// This region's share of `key` under `quota` with `floor` (a limit marked
    /// `across_regions`), for an inspection: only a backend in regional mode knows one.
    #[doc(hidden)]
    async fn region_share(
        &self,
        _key: &BucketKey,
        _quota: &Quota,
        _floor: crate::config::RegionFloor,
    ) -> Result<Option<crate::backend::regions::RegionShare>, BackendError> {
        Ok(None)
    }

    /// A regional backend follows the limits in force (the marked limits' keys it rebalances)
    /// while the limiter that holds them lives: the limiter calls this once, at its start.
    #[doc(hidden)]
    fn follow_limits(&self, _limits: FollowedLimits) {}

    /// Whether the backend decides with all it must know. The Redis backend is not ready until
    /// it has read the stored overrides whole once (a fresh instance never decides an
    /// overridden id without its override: until then a spend answers
    /// [`BackendError::NotReady`] while the store answers, and fails while it is unreachable,
    /// so that the layer's failure policy answers); a backend that keeps no overrides elsewhere
    /// is always ready (the default). [`Limiter::is_ready`](crate::Limiter::is_ready) asks it,
    /// for a readiness probe.
    fn ready(&self) -> bool {
        true
    }

    /// Waits until the backend is [ready](Self::ready), within a bound the backend sets (the
    /// Redis backend's [`ready_wait`](crate::RedisBackendBuilder::ready_wait)), and says
    /// whether it is. Asked after a spend answered [`BackendError::NotReady`]. The default
    /// answers [`ready`](Self::ready) at once.
    async fn until_ready(&self) -> bool {
        self.ready()
    }

    /// The clock this backend decides by when it is not the system's (a manual clock, a
    /// caller's time): the layer's in-memory fallback decides by it too, so that what it grants
    /// during an outage is dated as the store dates its decisions. `None` (the default): the
    /// system clock.
    #[doc(hidden)]
    fn clock(&self) -> Option<std::sync::Arc<dyn crate::time::Clock>> {
        None
    }
}

impl BackendError {
    /// A backend that was still not ready once its bound to become ready was over (a lazy
    /// Redis backend that could not read the stored overrides): the failure policy answers.
    pub(crate) fn not_read() -> Self {
        Self::Unavailable(
            "the stored overrides are not read yet: no request is decided without them".into(),
        )
    }

    /// A backend answered `got` outcomes for `sent` transactions (a custom backend's bug).
    pub(crate) fn outcome_count(got: usize, sent: usize) -> Self {
        Self::Unavailable(format!(
            "backend returned {got} outcomes for {sent} transactions"
        ))
    }
}

#[async_trait]
impl<B: Backend + ?Sized> Backend for std::sync::Arc<B> {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        (**self).spend(batch)
    }
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        (**self).refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        (**self).reset(keys).await
    }
    async fn penalty_page(
        &self,
        limit: LimitName,
        state: LimitName,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<Option<StatesPage>, BackendError> {
        (**self).penalty_page(limit, state, cursor, count).await
    }
    fn prefetches(&self) -> bool {
        (**self).prefetches()
    }
    fn regional(&self) -> bool {
        (**self).regional()
    }
    fn decides_penalties(&self) -> bool {
        (**self).decides_penalties()
    }
    fn follow_limits(&self, limits: FollowedLimits) {
        (**self).follow_limits(limits)
    }
    async fn region_share(
        &self,
        key: &BucketKey,
        quota: &Quota,
        floor: crate::config::RegionFloor,
    ) -> Result<Option<crate::backend::regions::RegionShare>, BackendError> {
        (**self).region_share(key, quota, floor).await
    }
    fn ready(&self) -> bool {
        (**self).ready()
    }
    async fn until_ready(&self) -> bool {
        (**self).until_ready().await
    }
    fn override_store(&self) -> Option<OverrideStoreRef> {
        (**self).override_store()
    }
    fn clock(&self) -> Option<std::sync::Arc<dyn crate::time::Clock>> {
        (**self).clock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(tier: u8) -> TierGrant {
        TierGrant {
            tier,
            ..TierGrant::default()
        }
    }

    /// A grant stays with its outcome: pushed, replaced out of order (a cluster's calls),
    /// read by position, by reference and by value.
    #[test]
    fn tier_grants_follow_their_outcomes() {
        let plain = Outcome::new(true, 1, 0, 0);
        let mut o = Outcomes::new();
        o.push(plain);
        o.push_tiered(Outcome::new(true, 2, 0, 0), Some(grant(2)));
        o.push_tiered(plain, None);
        assert!(o.has_tier_grants());
        assert_eq!(o.len(), 3);
        assert_eq!(o.tier_grant(1).map(|g| g.tier), Some(2));
        assert!(
            o.tier_grant(0).is_none() && o.tier_grant(2).is_none() && o.tier_grant(9).is_none()
        );

        let mut filled = Outcomes::filled(3, Outcome::skip());
        filled.set(2, plain, Some(grant(3)));
        filled.set(0, plain, Some(grant(1)));
        filled.set(1, plain, None);
        filled.set(2, plain, Some(grant(4)));
        filled.set(7, plain, Some(grant(5)));
        let tiers = |o: &Outcomes| -> Vec<Option<u8>> {
            o.iter_tiered().map(|(_, g)| g.map(|g| g.tier)).collect()
        };
        assert_eq!(tiers(&filled), [Some(1), None, Some(4)]);
        filled.set(0, plain, None);
        assert_eq!(tiers(&filled), [None, None, Some(4)]);
        let mut emptied = filled.clone();
        emptied.set(2, plain, None);
        assert!(!emptied.has_tier_grants() && filled.has_tier_grants());
        let by_value: Vec<Option<u8>> = filled
            .clone()
            .into_tiered()
            .map(|(_, g)| g.map(|g| g.tier))
            .collect();
        assert_eq!(by_value, tiers(&filled));
        let rebuilt: Outcomes = filled.clone().into_tiered().collect();
        assert_eq!(rebuilt, filled);
        assert!(!Outcomes::one(plain).has_tier_grants());
    }
}
