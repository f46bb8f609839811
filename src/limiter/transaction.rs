//! A transaction: one request against one bucket, with its cost and mode. Built by the
//! caller; checked once, when the limiter resolves it.

use crate::key::BucketKey;
use crate::mode::Mode;

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
    penalty: PenaltyPart,
}

/// What a transaction asks of its limit's penalty ladder, if the limit has one
/// (`docs/penalties.md`): its cost counted at admission (every transaction but a settling
/// rule's), reserved until its outcome settles it (the admission of a layer's rule that
/// settles after the response), or that settle (a refund's: the reservation's id and the
/// units its outcome counts), or nothing (`Skip`: the in-memory fallback's charge-back of a
/// quota's units its ladder never counted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum PenaltyPart {
    #[default]
    Count,
    Reserve,
    Skip,
    Settle {
        id: std::num::NonZeroU64,
        counted: u64,
    },
}

impl Transaction {
    /// A check-and-spend transaction at the limit's configured cost (1 unless configured).
    pub fn new(key: BucketKey) -> Self {
        Self {
            key,
            cost: None,
            min_cost: None,
            mode: Mode::CheckAndSpend,
            penalty: PenaltyPart::Count,
        }
    }

    /// A transaction in `mode` at `cost` (`None`: the limit's), built in one go where it is
    /// stored (the layer's request path).
    pub(crate) fn of(key: BucketKey, mode: Mode, cost: Option<u64>) -> Self {
        Self {
            key,
            cost,
            min_cost: None,
            mode,
            penalty: PenaltyPart::Count,
        }
    }

    /// What it asks of its limit's penalty (the layer's settling rules: [`PenaltyPart`]).
    pub(crate) fn with_penalty(mut self, part: PenaltyPart) -> Self {
        self.penalty = part;
        self
    }

    /// What it asks of its limit's penalty.
    #[inline]
    pub(crate) fn penalty(&self) -> PenaltyPart {
        self.penalty
    }

    /// Sets the cost (0 is a probe that consumes nothing).
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self.min_cost = None;
        self
    }

    /// Asks for as many units as the limit grants between `min` and `max` (a partial grant:
    /// "give me what you have"); the decision's `granted` says how many. A GCRA limit grants
    /// the most units that fit at that instant, all or nothing at `min`; a tiered limit plans
    /// them across its tiers. `max` may exceed the burst, `min` may not. In a batch, the
    /// transaction takes part in all-or-nothing at `min`.
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

    /// Sets the cost (`min..=max`: a partial grant when they differ) and the mode in place (a
    /// stream's batch, reused message after message).
    #[cfg(feature = "stream")]
    pub(crate) fn set(&mut self, min: u64, max: u64, mode: Mode) {
        self.cost = Some(max);
        self.min_cost = (min != max).then_some(min);
        self.mode = mode;
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
