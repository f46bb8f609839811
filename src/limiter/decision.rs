//! What was decided: one [`Decision`] per transaction, and the batch's.

use std::num::NonZeroU64;
use std::time::Duration;

use crate::algo::tiers::TierGrant;
use crate::backend::regions::RegionShare;
use crate::key::{BucketKey, LimitName};
use crate::mode::Mode;
use crate::quota::{Own, Quota};
use crate::time::duration_us;

/// The decision for one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the transaction was allowed (or, for a refund, whether anything was refunded).
    pub(crate) allowed: bool,
    /// Units granted: the cost when allowed, 0 when denied or when another transaction denied
    /// the batch (a GCRA spend); for a range (`min..=max`), how many it granted; for a refund,
    /// 0 (GCRA) or the units taken back (tiers).
    pub(crate) granted: u64,
    /// Tokens left in the bucket (for a tiered limit: in the tier now serving the client). In
    /// a denied batch nothing is spent, and an allowed GCRA transaction reports its bucket as
    /// it is.
    pub(crate) remaining: u64,
    /// How long until an equal request would be allowed (zero when it would be now).
    pub(crate) retry_after: Duration,
    /// How long until the bucket is full again.
    pub(crate) reset_after: Duration,
    /// The limit that decided; `None` when the limit is disabled for this id (no default and no
    /// override), which allows without touching the store.
    pub(crate) limit: Option<Quota>,
    /// For a tiered limit: units per tier, whether the request burst into a higher tier, and
    /// the tier serving the client (on a denial, the tier that refused).
    pub(crate) tiers: Option<TierGrant>,
    /// A number of its limit's own shape ([`Outcome::shape_number`]), read only by the
    /// shape's answers.
    ///
    /// [`Outcome::shape_number`]: crate::backend::Outcome::shape_number
    pub(crate) shape_number: u32,
    /// Denied because its key is banned by its limit's penalty ladder.
    pub(crate) banned: bool,
    /// The limit's name.
    pub(crate) name: LimitName,
    /// The bucket.
    pub(crate) key: BucketKey,
    /// The transaction's mode.
    pub(crate) mode: Mode,
    /// Not evaluated: the batch was already denied by another transaction's remembered
    /// denial (the Redis backend's local deny cache answers a flood without a round trip and
    /// looks no further). A skipped decision is not allowed, grants nothing, its numbers are
    /// zero and it never speaks for the batch; nothing was spent on its bucket.
    pub(crate) skipped: bool,
    /// The id this spend holds when it and its batch were allowed: on a concurrency limit, its
    /// slot's ([`lease`](Self::lease) gives it with its bucket, for
    /// [`Limiter::release`](crate::Limiter::release)); on a limit with a penalty (`reserved`),
    /// the reservation it holds until its outcome settles it (a layer's settling rule:
    /// `docs/penalties.md`). `None` everywhere else. One field for both, told apart by the
    /// limit: a limit with a penalty holds no slot.
    pub(crate) lease_id: Option<NonZeroU64>,
}

/// A bucket seen without spending ([`Limiter::inspect`](crate::Limiter::inspect)): the limit in
/// force for it, where that limit comes from, and what the bucket holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The limit in force; `None`: none applies (the name is disabled for this id, or an
    /// `unlimited` override): every request of this id is allowed.
    pub limit: Option<Quota>,
    /// Where [`limit`](Self::limit) comes from.
    pub source: crate::config::LimitSource,
    /// Whether a stored block denies every request of the id ([`OverrideKind::Block`]): then
    /// `limit` is the name's default, `remaining` 0 and `reset_after` the block's end.
    ///
    /// [`OverrideKind::Block`]: crate::OverrideKind::Block
    pub blocked: bool,
    /// Tokens (a concurrency limit: slots) a request could take now; 0 without a limit.
    pub remaining: u64,
    /// How long until the bucket is full again (zero when it is, or without a limit).
    pub reset_after: Duration,
    /// For a limit marked `across_regions` on a backend in regional mode: this region's share
    /// of it for this key (`docs/regions.md`); `None` everywhere else.
    pub region_share: Option<RegionShare>,
    /// For an adaptive concurrency limit: the key's number of slots now, which it learned
    /// from its latency (`remaining` of them free); `None` for every other limit.
    pub slots: Option<u64>,
    /// When the key is banned by its limit's penalty ladder (`docs/penalties.md`): how long
    /// until the ban ends (`remaining` is then 0); `None` when it is not banned.
    pub banned_for: Option<Duration>,
}

/// A slot held on a concurrency limit ([`ConcurrencyLimit`](crate::ConcurrencyLimit)): a bucket and a lease id unique
/// among its leases. Give it back with [`Limiter::release`](crate::Limiter::release); one never
/// given back stops counting at its deadline (the limit's lease time after it was taken).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub(crate) key: BucketKey,
    pub(crate) quota: Quota,
    pub(crate) id: u64,
}

impl Lease {
    /// The bucket the slot is held on.
    pub fn key(&self) -> &BucketKey {
        &self.key
    }

    /// The lease id (never 0).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The limit the slot was taken under (a [`ConcurrencyLimit`]).
    ///
    /// [`ConcurrencyLimit`]: crate::ConcurrencyLimit
    pub fn quota(&self) -> &Quota {
        &self.quota
    }
}

impl Decision {
    /// Whether the transaction was allowed (or, for a refund, whether anything was refunded).
    #[inline]
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// Units granted: the cost when allowed, 0 when denied or when another transaction denied
    /// the batch (a GCRA spend); for a range (`min..=max`), how many it granted; for a refund,
    /// 0 (GCRA) or the units taken back (tiers).
    #[inline]
    pub fn granted(&self) -> u64 {
        self.granted
    }

    /// Tokens left in the bucket (for a tiered limit: in the tier now serving the client). In
    /// a denied batch nothing is spent, and an allowed GCRA transaction reports its bucket as
    /// it is.
    #[inline]
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// On an adaptive concurrency limit, the key's number of slots when it was decided
    /// (`docs/adaptive-concurrency.md`); `None` for every other limit.
    #[inline]
    pub fn slots(&self) -> Option<u64> {
        self.limit.as_ref()?.slots_learned(self.shape_number)
    }

    /// Its numbers of its limit's own shape, as the shape's answers read them.
    #[inline]
    pub(crate) fn own(&self) -> Own<'_> {
        Own {
            tiers: self.tiers.as_ref(),
            number: self.shape_number,
        }
    }

    /// How long until an equal request would be allowed (zero when it would be now).
    #[inline]
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How long until the bucket is full again.
    #[inline]
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// The limit that decided; `None` when the limit is disabled for this id (no default and no
    /// override), which allows without touching the store.
    #[inline]
    pub fn limit(&self) -> Option<&Quota> {
        self.limit.as_ref()
    }

    /// For a tiered limit: units per tier, whether the request burst into a higher tier, and
    /// the tier serving the client (on a denial, the tier that refused).
    #[inline]
    pub fn tiers(&self) -> Option<&TierGrant> {
        self.tiers.as_ref()
    }

    /// The limit's name.
    #[inline]
    pub fn name(&self) -> LimitName {
        self.name
    }

    /// The bucket.
    #[inline]
    pub fn key(&self) -> &BucketKey {
        &self.key
    }

    /// The transaction's mode.
    #[inline]
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Not evaluated: the batch was already denied by another transaction's remembered
    /// denial (the Redis backend's local deny cache answers a flood without a round trip and
    /// looks no further). A skipped decision is not allowed, grants nothing, its numbers are
    /// zero and it never speaks for the batch; nothing was spent on its bucket.
    #[inline]
    pub fn skipped(&self) -> bool {
        self.skipped
    }

    /// Denied because its key is banned by its limit's penalty ladder (`docs/penalties.md`):
    /// [`retry_after`](Self::retry_after) is when the ban ends.
    #[inline]
    pub fn banned(&self) -> bool {
        self.banned
    }

    /// On a concurrency limit, the id of the slot this spend holds when it and its batch were
    /// allowed ([`lease`](Self::lease) gives it with its bucket). `None` everywhere else.
    #[inline]
    pub fn lease_id(&self) -> Option<NonZeroU64> {
        self.lease_id.filter(|_| self.holds_slot())
    }

    /// On a limit with a penalty, the id of the reservation this spend holds until its
    /// outcome settles it (`docs/penalties.md`); `None` elsewhere.
    #[inline]
    pub(crate) fn reservation(&self) -> Option<NonZeroU64> {
        self.lease_id.filter(|_| !self.holds_slot())
    }

    /// Whether its limit holds slots (its id, if any, is a slot's, not a reservation's).
    #[inline]
    fn holds_slot(&self) -> bool {
        self.limit.as_ref().is_some_and(Quota::holds_leases)
    }

    /// The slot this spend holds on a concurrency limit, to give back with
    /// [`Limiter::release`](crate::Limiter::release) when the work ends (it also ends by itself
    /// after the limit's lease time); `None` when it holds none.
    pub fn lease(&self) -> Option<Lease> {
        Some(Lease {
            id: self.lease_id()?.get(),
            key: self.key.clone(),
            quota: self.limit.clone()?,
        })
    }

    /// Whether this decision takes part in choosing the batch decision: its mode counts, its
    /// limit is enabled and it was evaluated.
    pub fn counts(&self) -> bool {
        self.mode.counts() && self.limit.is_some() && !self.skipped
    }
}

/// What a transaction of a denied spend reports instead of what the backend said, when it was
/// allowed, evaluated, spending and granted units (`(allowed, skipped, mode, granted)`):
/// `remaining` and `reset_after` (microseconds) with the units back, as its shape says
/// ([`Quota::unspent`]); `None`: keep what the backend said. The one home of the rule, for a
/// batch's decisions ([`BatchDecision::unspend`]) and a refusal answered from the backend's
/// outcomes by reference.
#[inline]
pub(crate) fn unspent(
    quota: Option<&Quota>,
    (allowed, skipped, mode, granted): (bool, bool, Mode, u64),
    remaining: u64,
    reset_after_us: u64,
) -> Option<(u64, u64)> {
    if !allowed || skipped || !mode.spends() || granted == 0 {
        return None;
    }
    quota?.unspent(remaining, reset_after_us, granted)
}

/// The decisions of one batch, and which of them is the strictest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchDecision {
    decisions: Vec<Decision>,
    strictest: Option<usize>,
}

/// The strictest of decisions given as `(allowed, retry_after, remaining)` (`None`: one that
/// does not count): a denial beats an allowance; among equals the longer `retry_after` (a
/// `Duration`, or the same wait in microseconds), then the fewer `remaining`, then the first.
pub(crate) fn strictest<T: Ord>(
    decisions: impl IntoIterator<Item = Option<(bool, T, u64)>>,
) -> Option<usize> {
    let mut best = Strictest::default();
    for (i, d) in decisions.into_iter().enumerate() {
        if let Some((allowed, retry_after, remaining)) = d {
            best.offer(i, allowed, retry_after, remaining);
        }
    }
    best.index()
}

/// The strictest decision seen so far, offered one at a time (for a pass that does more than
/// choose it). The one home of "which decision speaks for the batch".
pub(crate) struct Strictest<T> {
    best: Option<(usize, Strictness<T>)>,
}

/// How strict a decision is, compared as a tuple: denied, then `retry_after`, then fewer
/// `remaining`.
type Strictness<T> = (bool, T, std::cmp::Reverse<u64>);

impl<T> Default for Strictest<T> {
    fn default() -> Self {
        Self { best: None }
    }
}

impl<T: Ord> Strictest<T> {
    /// Offers the counting decision at `index`.
    pub(crate) fn offer(&mut self, index: usize, allowed: bool, retry_after: T, remaining: u64) {
        let key = (!allowed, retry_after, std::cmp::Reverse(remaining));
        if self.best.as_ref().is_none_or(|(_, b)| key > *b) {
            self.best = Some((index, key));
        }
    }

    /// The index of the strictest decision offered, if any.
    pub(crate) fn index(&self) -> Option<usize> {
        self.best.as_ref().map(|(i, _)| *i)
    }
}

impl BatchDecision {
    /// Builds a batch decision, choosing the strictest counting decision: a denial beats an
    /// allowance; among equals the longer `retry_after`, then the fewer `remaining`, then the
    /// first.
    pub fn new(decisions: Vec<Decision>) -> Self {
        let strictest = strictest(decisions.iter().map(|d| {
            d.counts()
                .then_some((d.allowed, d.retry_after, d.remaining))
        }));
        Self {
            decisions,
            strictest,
        }
    }

    /// A denied spend writes nothing, but a backend reports each allowed GCRA transaction as
    /// if it had spent: report the bucket as it is instead (the cost back in `remaining`, one
    /// emission interval per unit off `reset_after`, nothing granted). Exact for GCRA, where
    /// `remaining` and `reset_after` move by whole emission intervals; a tiered decision keeps
    /// what the backend said.
    pub(crate) fn unspend(&mut self) {
        for d in &mut self.decisions {
            let Some((remaining, reset_after_us)) = unspent(
                d.limit.as_ref(),
                (d.allowed, d.skipped, d.mode, d.granted),
                d.remaining,
                duration_us(d.reset_after),
            ) else {
                continue;
            };
            d.remaining = remaining;
            d.reset_after = Duration::from_micros(reset_after_us);
            d.lease_id = None;
            d.granted = 0;
        }
    }

    /// Puts every counting denial's times back by `extra` (a layer's jitter): `retry_after`,
    /// and `reset_after` with it, so that each time told to the client moves alike and none
    /// moves earlier.
    pub(crate) fn delay(&mut self, extra: Duration) {
        for d in &mut self.decisions {
            if !d.allowed && d.counts() {
                d.retry_after = d.retry_after.saturating_add(extra);
                d.reset_after = d.reset_after.saturating_add(extra);
            }
        }
    }

    /// Brings buckets' later states (a settle's refund or charge decisions, by key) into an
    /// allowed batch's decisions: `remaining` and `reset_after` become the bucket's, and a
    /// GCRA `retry_after` the wait before an equal request (its granted cost) fits again. The
    /// strictest decision is chosen again.
    pub(crate) fn update(&mut self, states: impl IntoIterator<Item = Decision>) {
        let mut changed = false;
        for s in states {
            let Some(d) = self.decisions.iter_mut().find(|d| d.key == s.key) else {
                continue;
            };
            d.remaining = s.remaining;
            d.reset_after = s.reset_after;
            d.retry_after = d
                .limit
                .as_ref()
                .and_then(|q| q.retry_after_again(duration_us(s.reset_after), d.granted))
                .map_or(s.retry_after, Duration::from_micros);
            changed = true;
        }
        if changed {
            *self = Self::new(std::mem::take(&mut self.decisions));
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

    /// The position of the strictest decision among [`decisions`](Self::decisions).
    pub(crate) fn strictest_at(&self) -> Option<usize> {
        self.strictest
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

#[cfg(test)]
mod tests {
    /// Every request's road copies its decisions (one per transaction) and the bucket
    /// transactions it sends: what a limit with a capability (a penalty's reservation) carries
    /// must not grow them for the limits without it (`BENCHMARKS.md`: a decision of 264 bytes
    /// cost each `finish` 22 instructions more than one of 256).
    #[test]
    fn the_road_s_values_keep_their_sizes() {
        use std::mem::size_of;
        assert!(size_of::<super::Decision>() <= 256);
        assert!(size_of::<crate::backend::BucketTx<'static>>() <= 80);
        assert!(size_of::<crate::limiter::Transaction>() <= 96);
    }
}
