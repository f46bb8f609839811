//! Transactions (what to ask) and decisions (what was decided).

use std::time::Duration;

use crate::key::{BucketKey, LimitName};
use crate::limit::Quota;
use crate::tiers::{TierDecision, TierGrant, TieredLimit};

/// How a transaction takes part in a batch (`spec/gcra.md`, "Transactions and batches").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Counts toward the batch decision and is written when the batch is allowed.
    #[default]
    CheckAndSpend,
    /// Counts toward the batch decision and is never written.
    CheckOnly,
    /// Best effort: does not count toward the batch decision, and is written only when the
    /// batch is allowed and its own decision allows.
    SpendOnly,
}

impl Mode {
    /// Whether this transaction's decision counts toward the batch decision.
    pub fn counts(self) -> bool {
        !matches!(self, Mode::SpendOnly)
    }
}

/// One request against one bucket: a key, a cost and a mode.
///
/// ```
/// use tower_ratelimits::{BucketKey, Id, Mode, Transaction};
/// # let name = tower_ratelimits::Limits::builder()
/// #     .limit("ApiPerIp", tower_ratelimits::Limit::new(5, 5, std::time::Duration::from_secs(1)).unwrap())
/// #     .build().unwrap().name("ApiPerIp").unwrap();
/// let tx = Transaction::new(BucketKey::new(name, Id::from(7u64))).cost(2).mode(Mode::CheckOnly);
/// assert_eq!(tx.cost_or(1), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transaction {
    key: BucketKey,
    cost: Option<u64>,
    min_cost: Option<u64>,
    mode: Mode,
}

impl Transaction {
    /// A check-and-spend transaction at the limit's configured cost (1 unless configured).
    pub fn new(key: BucketKey) -> Self {
        Self {
            key,
            cost: None,
            min_cost: None,
            mode: Mode::CheckAndSpend,
        }
    }

    /// Sets the cost (0 is a probe that consumes nothing).
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self.min_cost = None;
        self
    }

    /// Asks a tiered limit for as many units as it grants between `min` and `max` (a group
    /// request); the decision's `granted` says how many. GCRA limits refuse a range whose ends
    /// differ ([`LimiterError::CostRangeOnGcra`](crate::LimiterError::CostRangeOnGcra)).
    ///
    /// ```
    /// # use tower_ratelimits::{BucketKey, Id, Transaction};
    /// # let name = tower_ratelimits::Limits::builder()
    /// #     .limit("A", tower_ratelimits::Limit::new(5, 5, std::time::Duration::from_secs(1)).unwrap())
    /// #     .build().unwrap().name("A").unwrap();
    /// let tx = Transaction::new(BucketKey::new(name, Id::from(7u64))).cost_range(1..=10);
    /// assert_eq!((tx.min_cost_or(0), tx.cost_or(0)), (1, 10));
    /// ```
    pub fn cost_range(mut self, range: std::ops::RangeInclusive<u64>) -> Self {
        let (min, max) = range.into_inner();
        self.cost = Some(max);
        self.min_cost = Some(min);
        self
    }

    /// Sets the mode.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The bucket key.
    pub fn key(&self) -> &BucketKey {
        &self.key
    }

    /// The cost set on this transaction, or `default` (for a range: its upper end).
    pub fn cost_or(&self, default: u64) -> u64 {
        self.cost.unwrap_or(default)
    }

    /// The smallest acceptable grant: the lower end of a [`cost_range`](Self::cost_range), else
    /// the cost (set, or `default`).
    pub fn min_cost_or(&self, default: u64) -> u64 {
        self.min_cost.unwrap_or_else(|| self.cost_or(default))
    }

    /// The mode.
    pub fn get_mode(&self) -> Mode {
        self.mode
    }
}

/// What a backend decided for one transaction of a batch.
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
    /// For a tiered limit: the units granted per tier and the tier serving the client.
    pub tiers: Option<TierGrant>,
}

impl Outcome {
    /// An outcome from its fields.
    pub fn new(allowed: bool, remaining: u64, retry_after_us: u64, reset_after_us: u64) -> Self {
        Self {
            allowed,
            remaining,
            retry_after_us,
            reset_after_us,
            tiers: None,
        }
    }

    /// The outcome of a tiered decision.
    pub fn tiered(d: &TierDecision, limit: &TieredLimit) -> Self {
        Self {
            tiers: Some(d.grant(limit)),
            ..Self::new(d.allowed, d.remaining, d.retry_after_us, d.reset_after_us)
        }
    }
}

impl From<crate::gcra::GcraOutcome> for Outcome {
    fn from(o: crate::gcra::GcraOutcome) -> Self {
        Self::new(o.allowed, o.remaining, o.retry_after_us, o.reset_after_us)
    }
}

/// The decision for one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the transaction was allowed (or, for a refund, whether anything was refunded).
    pub allowed: bool,
    /// Units granted: the cost when allowed, 0 when denied; for a tiered limit asked for a
    /// range, how many it granted; for a refund, 0 (GCRA) or the units taken back (tiers).
    pub granted: u64,
    /// Tokens left in the bucket (for a tiered limit: in the tier now serving the client).
    pub remaining: u64,
    /// How long until an equal request would be allowed (zero when it would be now).
    pub retry_after: Duration,
    /// How long until the bucket is full again.
    pub reset_after: Duration,
    /// The limit that decided; `None` when the limit is disabled for this id (no default and no
    /// override), which allows without touching the store.
    pub limit: Option<Quota>,
    /// For a tiered limit: units per tier, whether the request burst into a higher tier, and
    /// the tier serving the client (on a denial, the tier that refused).
    pub tiers: Option<TierGrant>,
    /// The limit's name.
    pub name: LimitName,
    /// The bucket.
    pub key: BucketKey,
    /// The transaction's mode.
    pub mode: Mode,
}

impl Decision {
    /// Whether this decision takes part in choosing the batch decision.
    pub fn counts(&self) -> bool {
        self.mode.counts() && self.limit.is_some()
    }
}

/// The decisions of one batch, and which of them is the strictest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchDecision {
    decisions: Vec<Decision>,
    strictest: Option<usize>,
}

impl BatchDecision {
    /// Builds a batch decision, choosing the strictest counting decision: a denial beats an
    /// allowance; among equals the longer `retry_after`, then the fewer `remaining`, then the
    /// first.
    pub fn new(decisions: Vec<Decision>) -> Self {
        let mut strictest: Option<usize> = None;
        for (i, d) in decisions.iter().enumerate() {
            if !d.counts() {
                continue;
            }
            let stricter = match strictest {
                None => true,
                Some(s) => {
                    let s = &decisions[s];
                    (!d.allowed, d.retry_after, std::cmp::Reverse(d.remaining))
                        > (!s.allowed, s.retry_after, std::cmp::Reverse(s.remaining))
                }
            };
            if stricter {
                strictest = Some(i);
            }
        }
        Self {
            decisions,
            strictest,
        }
    }

    /// Whether the batch was allowed: no counting transaction was denied.
    pub fn allowed(&self) -> bool {
        self.strictest().is_none_or(|d| d.allowed)
    }

    /// The strictest counting decision, which speaks for the batch; `None` when no transaction
    /// counts (all disabled or spend-only).
    pub fn strictest(&self) -> Option<&Decision> {
        self.strictest.map(|i| &self.decisions[i])
    }

    /// Every decision, in the order of the transactions.
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    /// Consumes the batch decision, returning the strictest decision.
    pub fn into_strictest(mut self) -> Option<Decision> {
        self.strictest.map(|i| self.decisions.swap_remove(i))
    }

    /// Consumes the batch decision, returning every decision.
    pub fn into_decisions(self) -> Vec<Decision> {
        self.decisions
    }
}
