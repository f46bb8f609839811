//! How a transaction takes part in its batch: the one enum every floor (layer, limiter,
//! backends) names.

/// How a transaction takes part in a batch (`docs/gcra.md`, "Transactions and batches").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Mode {
    /// Counts toward the batch decision and is written when the batch is allowed.
    #[default]
    CheckAndSpend,
    /// Counts toward the batch decision and is never written.
    CheckOnly,
    /// Best effort: does not count toward the batch decision, and is written only when the
    /// batch is allowed and its own decision allows. A shadowed spending rule
    /// ([`Rule::shadow`](crate::Rule::shadow)) runs in this mode.
    SpendOnly,
    /// Decided only: does not count toward the batch decision and is never written. A
    /// shadowed check-only rule runs in this mode.
    Observe,
    /// Units charged after the fact (a [`Settle`](crate::Settle) overrun): does not count
    /// toward the batch decision and is never denied. On a GCRA limit it takes as many of its
    /// units as fit within the limit's [`max_debt`](crate::Limit::max_debt) below empty (the
    /// rest is forgiven; the outcome's `granted` says how many were charged), and the key is
    /// denied until time repays the debt. On a tiered limit it is a spend-only (debt is not
    /// defined for tiers: an overrun that does not fit is forgiven). On a concurrency limit it
    /// records a slot already in use (the lease it names, taken where the store could not see
    /// it: the in-memory fallback during an outage): always taken, even above the limit, so
    /// the key refuses new requests until enough slots end.
    Charge,
    /// A live request's slot kept: on a concurrency limit, moves the deadline of the lease the
    /// transaction names ([`BucketTx::with_lease`](crate::BucketTx::with_lease)) to now plus
    /// the lease time, when that lease still holds its slot; it never takes a slot (spending
    /// the same lease again would count it twice) and does not count toward the batch
    /// decision. The outcome is allowed when the lease was renewed.
    /// [`Limiter::renew`](crate::Limiter::renew) sends it; the layer renews a request's leases
    /// every third of their lease time while the request lives. Refused on other limits.
    Renew,
}

impl Mode {
    /// Whether this transaction's decision counts toward the batch decision.
    pub fn counts(self) -> bool {
        matches!(self, Mode::CheckAndSpend | Mode::CheckOnly)
    }

    /// Whether this transaction spends (is written) when it and its batch are allowed.
    pub fn spends(self) -> bool {
        matches!(self, Mode::CheckAndSpend | Mode::SpendOnly | Mode::Charge)
    }

    /// The mode of this transaction in shadow: decided and, for a spending mode, written
    /// exactly as when enforced, but never counting toward the batch decision.
    pub fn shadowed(self) -> Self {
        match self {
            Mode::CheckAndSpend | Mode::SpendOnly => Mode::SpendOnly,
            Mode::CheckOnly | Mode::Observe => Mode::Observe,
            Mode::Charge => Mode::Charge,
            Mode::Renew => Mode::Renew,
        }
    }
}
