//! The spend step: the one road every batch takes to the backend. A batch is resolved against
//! one snapshot of the limits (each transaction's limit, mode, cost and lease, validated once),
//! sent to the backend once, and its outcomes turned into decisions here, whether the backend
//! answered at once (a [`Verdict`], read by reference) or later (a [`Pending`]). The in-memory
//! fallback takes the same step ([`Limiter::spend_now`]).

use crate::algo::tiers::TierGrant;
use crate::backend::Outcome;
use crate::backend::{BackendError, BucketTx, Outcomes, Spend};
use crate::config::Limits;
use crate::key::BucketKey;
use crate::mode::Mode;
use crate::quota::{Own, Quota};
use crate::time::us;

use super::{
    BatchDecision, Decision, Limiter, LimiterError, Regions, Transaction, first_duplicate,
};

mod penalties;

/// A batch's per-transaction working data: on the stack for up to 8 transactions (a request's
/// rules), so the request path does not allocate for it.
type Batch<T> = smallvec::SmallVec<[T; 8]>;

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
    /// Sent with a penalty's companion after the batch (`penalties.rs`).
    penalty: bool,
}

impl<Q> Resolved<Q> {
    /// Whether it was sent to the backend: its limit applies and no block denied it.
    #[inline]
    fn sent(&self) -> bool {
        self.quota.is_some() && self.block_s == 0
    }
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
    /// A tiered limit's grant per tier.
    pub(crate) tiers: Option<&'v TierGrant>,
    /// The units it asked for.
    cost: u64,
}

impl<'v> Entry<'v> {
    /// Its numbers of its limit's own shape.
    #[inline]
    pub(crate) fn own(&self) -> Own<'v> {
        Own {
            tiers: self.tiers,
            number: self.outcome.shape_number,
        }
    }

    /// Whether it takes part in choosing the batch decision (as [`Decision::counts`]).
    pub(crate) fn counts(&self) -> bool {
        self.mode.counts() && self.quota.is_some() && !self.outcome.skipped
    }

    /// What it reports instead, in a spend the batch rule denied (nothing was spent):
    /// `remaining` and `reset_after` (microseconds) with its units back, as a decision of
    /// the batch would ([`BatchDecision::unspend`]); `None`: what the backend said.
    pub(crate) fn unspent(&self) -> Option<(u64, u64)> {
        let o = self.outcome;
        let granted = granted(self.tiers, o, Op::Spend, self.cost);
        super::decision::unspent(
            self.quota,
            (o.allowed, o.skipped, self.mode, granted),
            o.remaining,
            o.reset_after_us,
        )
    }
}

/// The outcome of a transaction whose limit is disabled for its id.
const DISABLED: Outcome = Outcome {
    allowed: true,
    remaining: u64::MAX,
    retry_after_us: 0,
    reset_after_us: 0,
    granted: None,
    shape_number: 0,
    skipped: false,
    banned: false,
    filled: 0,
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
        let all = &self.outcomes;
        // Most batches have no tiered limit: their grants are never looked for.
        let tiered = all.has_tier_grants();
        let mut outcomes = all.iter();
        let mut at = 0;
        self.batch.iter().zip(&self.resolved).map(move |(tx, r)| {
            let (outcome, tiers) = match r.quota {
                Some(_) => {
                    at += 1;
                    let tiers = if tiered { all.tier_grant(at - 1) } else { None };
                    (outcomes.next().unwrap_or(&DISABLED), tiers)
                }
                None => (&DISABLED, None),
            };
            Entry {
                tx,
                quota: r.quota,
                mode: r.mode,
                outcome,
                tiers,
                cost: r.cost,
            }
        })
    }

    /// Whether the batch is allowed: no counting transaction was denied.
    pub(crate) fn allowed(&self) -> bool {
        self.allowed
    }

    /// The decisions (read in place: a verdict moved into a call is a copy of some 360 bytes,
    /// `ours_limiter` 1,597 -> 1,504 instructions, `benches/instructions.sh`).
    pub(crate) fn decision(&self) -> Result<BatchDecision, LimiterError> {
        finish(
            self.batch,
            &self.resolved,
            &self.outcomes,
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
                    penalty: r.penalty,
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
        if self.counted.penalties {
            penalties::fold(batch, &self.resolved, &mut outcomes)?;
        }
        if self.counted.blocks {
            outcomes = with_blocks(&self.resolved, outcomes)?;
        }
        finish(batch, &self.resolved, &outcomes, self.op, self.counted)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
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
    (o, tiers): (Outcome, Option<&TierGrant>),
    op: Op,
    lease: u64,
) -> Decision {
    // A limit with a penalty holds no slot: its id is its penalty's reservation.
    let lease_id = std::num::NonZeroU64::new(lease).filter(|_| o.allowed && op == Op::Spend);
    let granted = granted(tiers, &o, op, cost);
    Decision {
        allowed: o.allowed,
        granted,
        remaining: o.remaining,
        retry_after: us(o.retry_after_us),
        reset_after: us(o.reset_after_us),
        limit: quota.cloned(),
        tiers: tiers.copied(),
        shape_number: o.shape_number,
        banned: o.banned,
        name: key.name(),
        key,
        mode,
        skipped: o.skipped,
        lease_id,
    }
}

/// The units a transaction of `cost` was granted, by its outcome `o` (and its tiers' grant):
/// what a range or a tiered limit granted, the whole cost when allowed, else none.
#[inline]
fn granted(tiers: Option<&TierGrant>, o: &Outcome, op: Op, cost: u64) -> u64 {
    match (tiers, o.granted, o.allowed, op) {
        (Some(t), _, _, _) => t.granted,
        (None, Some(g), _, Op::Spend | Op::Check) => g,
        (None, None, true, Op::Spend | Op::Check) => cost,
        _ => 0,
    }
}

impl Op {
    /// The mode a transaction of `mode` takes in this op: a check writes nothing, so what
    /// spends only checks and what counts still counts.
    #[inline(always)]
    fn mode_of(self, mode: Mode) -> Mode {
        match (self, mode) {
            (Op::Check, m) if m.counts() => Mode::CheckOnly,
            (Op::Check, _) => Mode::Observe,
            (_, m) => m,
        }
    }

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
    /// Spends `batch` under the limits in force when the backend decides at once (in memory):
    /// the in-memory fallback's road, the same step as every batch. `None`: the backend would
    /// have to be awaited.
    pub(crate) fn spend_now(
        &self,
        batch: &[Transaction],
    ) -> Option<Result<BatchDecision, LimiterError>> {
        let limits = self.load();
        let mut verdict = Verdict::new(batch);
        match self.spend_step(&limits, &mut verdict) {
            Ok(Step::Ready) => Some(verdict.decision()),
            Ok(Step::Pending(_)) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// A stream's message (`stream/`: its batch names no key twice, checked when its meter was
    /// built) spent when the backend decides at once (memory, the deny cache, prefetched
    /// tokens): `Ok(None)` allowed, read in place (no decision built, nothing allocated);
    /// `Ok(Some(decision))` refused. `None`: the backend must be awaited, or is still reading
    /// what it must know (`Limiter::spend` waits for it).
    #[cfg(feature = "stream")]
    pub(crate) fn spend_message_now(
        &self,
        batch: &[Transaction],
    ) -> Option<Result<Option<BatchDecision>, LimiterError>> {
        let limits = self.load();
        let mut verdict = Verdict::new(batch);
        match self.spend_step(&limits, &mut verdict) {
            Ok(Step::Ready) if verdict.allowed() => Some(Ok(None)),
            Ok(Step::Ready) => Some(verdict.decision().map(Some)),
            Ok(Step::Pending(_)) | Err(LimiterError::Backend(BackendError::NotReady)) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Forgets what `keys` spent when the backend does so at once (in memory): the in-memory
    /// fallback's start from the store's last answer. `false`: the backend would have to be
    /// awaited, or failed.
    pub(crate) fn reset_now(&self, keys: &[&BucketKey]) -> bool {
        let mut reset = std::pin::pin!(self.inner.backend.reset(keys));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        matches!(
            std::future::Future::poll(reset.as_mut(), &mut cx),
            std::task::Poll::Ready(Ok(()))
        )
    }

    /// Spends `verdict`'s batch under `limits` (a snapshot the caller holds): resolved and
    /// validated once and sent to the backend once, decided into `verdict` when the backend
    /// answers at once. A layer's batch: its rules each name a limit of their own
    /// (`LayerError::DuplicateRule` when it is built), so no key is named twice and none is
    /// looked for.
    pub(crate) fn spend_step<'a>(
        &self,
        limits: &'a Limits,
        verdict: &mut Verdict<'a>,
    ) -> Result<Step, LimiterError> {
        self.step_apart(limits, verdict, Op::Spend)
    }

    /// A spend or a check of any batch (the `Limiter`'s own): refused when it names a key
    /// twice, else [`step_apart`](Self::step_apart).
    pub(super) fn step<'a>(
        &self,
        limits: &'a Limits,
        verdict: &mut Verdict<'a>,
        op: Op,
    ) -> Result<Step, LimiterError> {
        no_key_twice(verdict.batch)?;
        self.step_apart(limits, verdict, op)
    }

    /// A spend or a check of a batch that names no key twice: the one road every batch takes
    /// to the backend.
    fn step_apart<'a>(
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
                let mut outcomes = outcomes?;
                let sent = txs.len();
                if verdict.counted.penalties {
                    penalties::fold(verdict.batch, &verdict.resolved, &mut outcomes)?;
                } else if outcomes.len() != sent {
                    return Err(BackendError::outcome_count(outcomes.len(), sent).into());
                }
                // The batch rule, once (a disabled limit sent nothing and allows).
                verdict.allowed = crate::backend::kit::batch_allowed(txs.iter().zip(&outcomes));
                verdict.outcomes = outcomes;
                Ok(Step::Ready)
            }
            // The backend's time is measured for a spend it could not decide at once
            // (`backend_duration_seconds` in docs/operating.md), from when its future exists
            // (it works when polled): a decision in memory or from the deny cache reads no
            // clock for it.
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
                    let mut outcomes = outcomes?;
                    if verdict.counted.penalties {
                        penalties::fold(verdict.batch, &verdict.resolved, &mut outcomes)?;
                    } else if outcomes.len() != txs.len() {
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

    pub(super) async fn refund_in(
        &self,
        limits: &Limits,
        batch: &[Transaction],
    ) -> Result<BatchDecision, LimiterError> {
        no_key_twice(batch)?;
        let (mut resolved, mut txs, mut counted) = (Batch::new(), Batch::new(), Counted::default());
        self.resolve(
            limits,
            batch,
            Op::Refund,
            &mut resolved,
            &mut txs,
            &mut counted,
        )?;
        let mut outcomes = if txs.is_empty() {
            Outcomes::new()
        } else {
            #[cfg(feature = "metrics")]
            let started = std::time::Instant::now();
            let outcomes = self.inner.backend.refund(&txs).await;
            #[cfg(feature = "metrics")]
            crate::telemetry::backend_duration(Op::Refund.label(), started.elapsed().as_secs_f64());
            outcomes?
        };
        if counted.penalties {
            penalties::fold(batch, &resolved, &mut outcomes)?;
        }
        if counted.blocks {
            outcomes = with_blocks(&resolved, outcomes)?;
        }
        finish(batch, &resolved, &outcomes, Op::Refund, counted)
    }

    /// Resolves each transaction of a batch (no key named twice: the caller checked,
    /// `no_key_twice`) into `resolved` (its limit, mode and cost, one per transaction), the
    /// transactions to send into `txs` (one per enabled limit, validated by `BucketTx::new`)
    /// and what its decisions are counted by into `counted`:
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
        for tx in batch {
            let name = tx.key().name();
            let Some(entry) = limits.entry(name) else {
                return Err(LimiterError::UnknownName(name.to_string()));
            };
            let mode = op.mode_of(tx.get_mode());
            let resolution = limits.resolve_in(entry, tx.key());
            let quota = resolution.quota;
            let default_cost = entry.cost;
            let cost = tx.cost_or(default_cost);
            let mut lease = 0;
            let (block_s, floor) =
                self.regional(entry.across_regions, quota.is_some(), resolution.block_s);
            if block_s != 0 {
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
                let mut checked = checked
                    .map_err(|e| LimiterError::from_transaction(name, e))?
                    .across_regions(floor);
                // A spend of a slot takes a lease of its own.
                if op == Op::Spend && quota.holds_leases() && cost == 1 && mode.spends() {
                    lease = self.lease_id();
                    checked = checked.with_lease(lease);
                }
                counted.concurrency |= quota.holds_leases();
                txs.push(checked);
                // One state for all the limit's ids (a fair share): one decision per batch.
                if quota.state_per_limit()
                    && crate::backend::kit::earlier(txs, txs.len() - 1).is_some()
                {
                    return Err(LimiterError::LimitTwice(name));
                }
            }
            // A limit with a ladder: its companion follows the batch, decided after the loop
            // (`penalties.rs`, which sets `penalty`; a limit without one pays one test).
            counted.penalties |= entry.penalty.is_some();
            resolved.push(Resolved {
                quota,
                mode,
                cost,
                lease,
                block_s,
                penalty: false,
            });
        }
        if counted.penalties {
            let decides = self.inner.backend.decides_penalties();
            let fresh = || self.lease_id();
            penalties::push_companions(limits, (batch, op), resolved, txs, (decides, &fresh))?;
        }
        Ok(())
    }
}

/// Refuses a batch that names a key twice (a layer's never does: [`Limiter::spend_step`]).
#[inline]
fn no_key_twice(batch: &[Transaction]) -> Result<(), LimiterError> {
    if batch.len() > 1
        && let Some(key) = first_duplicate(batch)
    {
        return Err(LimiterError::DuplicateKey(key.to_string()));
    }
    Ok(())
}

impl Limiter {
    /// A marked limit's transaction as this limiter decides it (`floor`: the limit's region
    /// floor when it is marked): sent with its floor to a backend of share buckets; denied, as
    /// a block of a second is, by the fallback of a regional limiter, which knows no share
    /// (`quota`: whether a limit applies); as any other elsewhere. The block's seconds, and
    /// the floor sent.
    #[inline(always)]
    fn regional(
        &self,
        floor: Option<crate::config::RegionFloor>,
        quota: bool,
        block_s: u32,
    ) -> (u32, Option<crate::config::RegionFloor>) {
        match (floor, self.inner.regions) {
            (None, _) | (_, Regions::PerRegion) => (block_s, None),
            (Some(_), Regions::Shares) => (block_s, floor),
            (Some(_), Regions::Closed) if quota => (block_s.max(1), None),
            (Some(_), Regions::Closed) => (block_s, None),
        }
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
    /// A transaction's limit has a penalty: its companion follows the batch (`penalties.rs`).
    penalties: bool,
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
    let mut sent = sent.into_tiered();
    let mut out = Outcomes::new();
    for r in resolved.iter().filter(|r| r.quota.is_some()) {
        let (o, grant) = if r.block_s != 0 {
            let us = u64::from(r.block_s) * 1_000_000;
            (Outcome::new(false, 0, us, us), None)
        } else {
            sent.next().unwrap_or_default()
        };
        out.push_tiered(o, grant);
    }
    Ok(out)
}

/// Turns the backend's outcomes (one per resolved transaction with a limit) into decisions.
fn finish<Q: std::borrow::Borrow<Quota>>(
    batch: &[Transaction],
    resolved: &[Resolved<Q>],
    outcomes: &Outcomes,
    op: Op,
    counted: Counted,
) -> Result<BatchDecision, LimiterError> {
    let sent = resolved.iter().filter(|r| r.quota.is_some()).count();
    if outcomes.len() != sent {
        return Err(BackendError::outcome_count(outcomes.len(), sent).into());
    }
    let mut answered = outcomes.iter_tiered();
    let mut decisions = Vec::with_capacity(batch.len());
    for (tx, r) in batch.iter().zip(resolved) {
        let quota = r.quota.as_ref().map(std::borrow::Borrow::borrow);
        let (o, grant) = match quota {
            Some(_) => answered
                .next()
                .map_or((Outcome::default(), None), |(o, g)| (*o, g)),
            None => (Outcome::new(true, u64::MAX, 0, 0), None),
        };
        decisions.push(decision(
            tx.key().clone(),
            quota,
            r.mode,
            r.cost,
            (o, grant),
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
        if !d.limit.as_ref().is_some_and(|q| q.holds_leases()) || d.skipped {
            continue;
        }
        let outcome = match d.lease_id() {
            Some(_) => "acquired",
            None if !d.allowed && d.mode.counts() => "denied",
            None => continue,
        };
        crate::telemetry::lease(d.name, outcome);
    }
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

/// The batch decision of `decisions`: a denied spend reports its buckets unspent (nothing of
/// a denied batch was written).
fn concluded(decisions: Vec<Decision>, op: Op) -> BatchDecision {
    let mut batch = BatchDecision::new(decisions);
    if op == Op::Spend && !batch.allowed() {
        batch.unspend();
    }
    batch
}
