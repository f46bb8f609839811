//! What a shape opts into beyond what every shape answers (`Capabilities`, one literal in
//! each shape's file), and the answers a capability carries (`Keeps`, `Waits`, `Settles`).

use super::{ChargeBack, Quota};
use crate::completion::Measure;

/// What a shape opts into beyond what every shape answers (`Shape`): the questions only
/// some shapes answer yes to. Each shape's file states all of them in one struct literal
/// with no `..Default`, so a new capability does not build until every shape says yes or no,
/// and a shape that says no is never asked the question's details (its functions are
/// `None`). [`Quota`]'s methods read them.
pub(crate) struct Capabilities<S> {
    /// Leases: an allowed spend holds a slot in flight until released, which lives this long
    /// (microseconds) unless renewed.
    pub(crate) lease_us: Option<u64>,
    /// Learning at release: it learns from each request that held one of its slots, whose
    /// latency ends where this says.
    pub(crate) learns: Option<Measure>,
    /// State per limit: one state for the whole limit, read by all its ids, at the limit's
    /// key.
    pub(crate) state_per_limit: bool,
    /// What an override must keep of it (`Err` names it); `None`: any limit of its shape may
    /// replace it for an id.
    pub(crate) keeps_on_override: Option<Keeps<S>>,
    /// Charge-back: what the in-memory fallback grants of it weighs once the store answers
    /// again.
    pub(crate) charge_back: Option<ChargeBack>,
    /// Waiting: whether a denial of it may be waited for, and whether it says when.
    pub(crate) waits: Waits<S>,
    /// Settling: whether a spend of it is settled after the response, and up to what.
    pub(crate) settles: Settles,
    /// A settled state's wait: from a bucket's later state (`reset_after_us`) and `granted`
    /// units, the wait before they fit again; `None`: the state's own `retry_after` says it.
    pub(crate) retry_after_again: Option<fn(&S, u64, u64) -> u64>,
    /// Prefetching: a backend that prefetches takes tokens of it ahead for hot keys.
    pub(crate) prefetches: bool,
    /// One limit across regions: `Err` names what in it cannot be.
    pub(crate) across_regions: Result<(), &'static str>,
    /// Undone by its raw value: what a spend of it changed is undone by writing back the
    /// value from before (a cross-slot batch's compensation), not by a refund.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) undone_by_value: bool,
}

/// What an override of a shape must keep ([`Capabilities::keeps_on_override`]): `Err` names
/// it.
pub(crate) type Keeps<S> = fn(&S, &Quota) -> Result<(), &'static str>;

/// Whether a denial of a shape may be waited for ([`Capabilities::waits`]).
pub(crate) enum Waits<S> {
    /// No: a slot frees when a request ends, which no wait can know.
    Never,
    /// Yes, without saying when one request's units come back.
    Untimed,
    /// Yes: from a denial's `retry_after` and `reset_after` (microseconds), how long one
    /// request's units take to come back.
    Timed(fn(&S, u64, u64) -> u64),
}

/// Whether a spend of a shape is settled after the response ([`Capabilities::settles`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settles {
    /// Never: a slot in flight is given back when the request ends.
    Never,
    /// Up to its [`max_cost`](Quota::max_cost).
    UpToMaxCost,
    /// By any charge: a GCRA limit takes what fits within its debt, a calendar quota the
    /// whole cost (the overrun ends with the period).
    AnyCost,
}
