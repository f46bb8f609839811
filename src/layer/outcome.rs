//! What a decision means for a request: call the inner service (with the `RateLimit` fields
//! to add to its response), or answer now (a 429, a 400, or a 503 when the backend failed and
//! the layer fails closed). The policy lives here; the response future only drives states.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};

use http::request::Parts;

use super::charge::{ChargeError, Ledger};
use super::extract::Exemptions;
use super::failure::{FailurePolicy, OnFailure};
use super::lease::{Held, Release};
use super::observe::{RuleOutcome, Seen, count_request};
use super::response::{Answers, Fields, is_grpc};
use super::rule::{Rules, Txs};
use super::settle::Settler;
use super::wait::WaitPermit;
use crate::backend::BackendError;
use crate::limiter::Limiter;
use crate::limiter::LimiterError;
use crate::limiter::{BatchDecision, Pending, Step, Verdict};

/// What a layer holds, as plain pieces each owned by the file that uses it: the limiter, the
/// rules (`rule.rs`), the failure handling (`failure.rs`), how it answers (`response.rs`), the
/// exempt clients (`extract.rs`) and what settling needs (`settle.rs`). Built once by
/// [`RateLimitLayerBuilder::build`](crate::RateLimitLayerBuilder::build).
pub(crate) struct Shared {
    pub(crate) limiter: Limiter,
    pub(crate) rules: Rules,
    pub(crate) failure: OnFailure,
    pub(crate) answers: Answers,
    pub(crate) exempt: Option<Exemptions>,
    pub(crate) settler: Settler,
    /// Which responses failed, for a limit that learns from its requests.
    pub(crate) failed_when: super::lease::FailedWhen,
}

pub(crate) enum Failure {
    Limiter(LimiterError),
    Timeout,
}

impl Failure {
    /// Whether the store failed (timed out, unreachable, open circuit, a bad stored value):
    /// what the in-memory fallback decides instead. A full memory table is not such a failure.
    fn store_failed(&self) -> bool {
        match self {
            Failure::Timeout => true,
            Failure::Limiter(LimiterError::Backend(e)) => !matches!(e, BackendError::Full { .. }),
            Failure::Limiter(_) => false,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Limiter(e) => e.fmt(f),
            Failure::Timeout => f.write_str("the store did not answer in time"),
        }
    }
}

/// A request's decision, with what it was made of.
pub(crate) struct Decided {
    pub(crate) result: Result<BatchDecision, Failure>,
    pub(crate) txs: Txs,
    /// The store failed and the in-memory fallback decided.
    pub(crate) fell_back: bool,
    /// A `HEAD` request: its response has no body, so a rule that settles from the body
    /// keeps its estimate (a `HEAD` of a download is not free).
    pub(crate) head: bool,
}

impl Decided {
    /// Whether the request is allowed: then its answer is the inner service's, and whether it
    /// is a gRPC call does not matter.
    pub(crate) fn allowed(&self) -> bool {
        self.result.as_ref().is_ok_and(BatchDecision::allowed)
    }
}

pub(crate) type Decide = Pin<Box<dyn Future<Output = Decided> + Send>>;

/// Where a request goes once its rules are applied: the one road, taken by `call` and by a
/// request decided again after its wait.
#[expect(
    clippy::large_enum_variant,
    reason = "returned in place and matched at once: boxing `Decided` costs a decided request an allocation"
)]
pub(crate) enum Road {
    /// Answer now (a missing or bad key).
    Answer(Response<Bytes>),
    /// No rule applies: call the inner service as it is.
    Call,
    /// Allowed at once, concluded from the backend's outcomes by reference (no decision
    /// built): call the inner service, its response getting these fields, if any.
    Allowed(Option<Allowed>),
    /// Decided at once (in memory, or a certain denial of the deny cache): no box, no await.
    Decided(Decided),
    /// The store must answer first.
    Deciding(Decide),
}

/// Applies the rules to a request and asks the limiter once, under one snapshot of the limits
/// (a reload never mixes two within a request).
pub(crate) fn road(shared: &Arc<Shared>, parts: &mut Parts) -> Road {
    let limits = shared.limiter.load();
    let mut txs = Txs::new();
    if let Some(response) = shared
        .rules
        .prepare(&limits, parts, shared.answers.body, &mut txs)
    {
        return Road::Answer(response);
    }
    #[cfg(feature = "stream")]
    if !shared.rules.streams.is_empty()
        && let Some(response) = with_stream_keys(shared, &limits, parts)
    {
        return Road::Answer(response);
    }
    let parts = &*parts;
    if txs.is_empty() {
        return Road::Call;
    }
    let head = parts.method == http::Method::HEAD;
    // What the in-memory fallback granted a key during an outage reaches the store first.
    if let Some(ledger) = shared.failure.ledger()
        && ledger.owes(&txs)
    {
        return Road::Deciding(charged_first(shared, ledger.clone(), txs, head));
    }
    // What the step leads to, taken out of it (the verdict borrows `txs`) before `txs` moves on.
    let result = {
        let mut verdict = Verdict::new(&txs);
        match shared.limiter.spend_step(&limits, &mut verdict) {
            // (A layer with a fallback has its ledger learn from every answer: `decided`.)
            Ok(Step::Ready)
                if verdict.plain()
                    && !shared.rules.settles
                    && verdict.allowed()
                    && shared.failure.fallback.is_none() =>
            {
                return Road::Allowed(allowed_now(shared, &verdict));
            }
            // A refusal likewise, when no rule waits (a wait needs the decisions).
            Ok(Step::Ready)
                if verdict.plain()
                    && !verdict.allowed()
                    && !shared.rules.waits
                    && shared.failure.fallback.is_none() =>
            {
                return Road::Answer(refused_now(shared, &verdict, parts));
            }
            Ok(Step::Ready) => Ok(verdict.decision()),
            Ok(Step::Pending(pending)) => Err(pending),
            Err(e) => Ok(Err(e)),
        }
    };
    match result {
        Ok(Err(LimiterError::Backend(BackendError::NotReady))) => {
            Road::Deciding(ready_first(shared, txs, head))
        }
        Ok(result) => Road::Decided(decided(shared, result.map_err(Failure::Limiter), txs, head)),
        Err(pending) => Road::Deciding(decide(shared, pending, txs, head)),
    }
}

/// Puts the keys of the layer's per-message rules that apply to a request in its extensions
/// (`StreamKeys`, for its handler's meter); `Some`: the request is answered now (a missing or
/// bad key). Out of line: a layer without such rules pays one test on the road.
#[cfg(feature = "stream")]
#[cold]
#[inline(never)]
fn with_stream_keys(
    shared: &Shared,
    limits: &crate::config::Limits,
    parts: &mut Parts,
) -> Option<Response<Bytes>> {
    let body = shared.answers.body;
    match shared
        .rules
        .stream_keys(&shared.limiter, limits, parts, body)
    {
        Ok(Some(keys)) => {
            parts.extensions.insert(keys);
            None
        }
        Ok(None) => None,
        Err(response) => Some(*response),
    }
}

/// The road of a request that reached a backend still reading what it must know (a fresh
/// lazy Redis backend's stored overrides, while its store answers): it waits for the read,
/// bounded by the backend (`RedisBackendBuilder::ready_wait`; the layer's timeout bounds the
/// store's answers, and this is no answer), then takes the road again under the limits then
/// in force, so an id blocked in the store is decided with its block. A backend still not
/// ready then (its store unreachable, or the wait over): the failure policy.
#[cold]
#[inline(never)]
fn ready_first(shared: &Arc<Shared>, txs: Txs, head: bool) -> Decide {
    let shared = shared.clone();
    Box::pin(async move {
        if !shared.limiter.until_ready().await {
            let e = BackendError::not_read().into();
            return decided(&shared, Err(Failure::Limiter(e)), txs, head);
        }
        step_again(&shared, txs, head).await
    })
}

/// The road of a request one of whose keys the in-memory fallback granted units the store has
/// not been charged (`charge.rs`): the charge first (after any under way), then the request's
/// own spend, under a snapshot taken then. A charge that fails is the store's failure: the
/// fallback decides the request, and what is owed stays owed.
#[cold]
#[inline(never)]
fn charged_first(shared: &Arc<Shared>, ledger: Arc<Ledger>, txs: Txs, head: bool) -> Decide {
    let shared = shared.clone();
    Box::pin(async move {
        if let Err(e) = ledger.charge(&shared.limiter, &txs).await {
            let failure = match e {
                ChargeError::Limiter(e) => Failure::Limiter(e),
                ChargeError::Timeout => Failure::Timeout,
            };
            return decided(&shared, Err(failure), txs, head);
        }
        step_again(&shared, txs, head).await
    })
}

/// The request's spend after something it waited for (a charge, a first read), under a
/// snapshot of the limits taken now, within the layer's timeout.
async fn step_again(shared: &Arc<Shared>, txs: Txs, head: bool) -> Decided {
    let step = {
        let limits = shared.limiter.load();
        let mut verdict = Verdict::new(&txs);
        match shared.limiter.spend_step(&limits, &mut verdict) {
            Ok(Step::Ready) => Ok(verdict.decision()),
            Ok(Step::Pending(pending)) => Err(pending),
            Err(e) => Ok(Err(e)),
        }
    };
    match step {
        Ok(result) => decided(shared, result.map_err(Failure::Limiter), txs, head),
        Err(pending) => decide(shared, pending, txs, head).await,
    }
}

/// An allowed request concluded from its verdict by reference, as `conclude` concludes its
/// decisions: counted and traced, and its fields' numbers taken. Only for a verdict that holds
/// no slot, no cost range and nothing to settle (`Verdict::plain`), whose decisions would
/// carry nothing more.
#[inline]
fn allowed_now(shared: &Shared, verdict: &Verdict<'_>) -> Option<Allowed> {
    count("allowed");
    let seen = verdict.entries().map(Seen::from);
    if !shared.answers.fields.on_allowed() {
        // Nothing is built when nothing observes.
        shared.rules.observe(seen, true);
        return None;
    }
    // One pass: each transaction counted and traced as the fields take its numbers.
    let observed = shared.rules.observed();
    let reported = seen.map(|s| shared.rules.observe_reported(s, observed));
    Fields::from_reported(reported, &shared.rules.joined_policy).map(Allowed::Fields)
}

/// Waits for a spend under way (`pending`, the limiter's step for `txs`), within the layer's
/// timeout.
pub(crate) fn decide(shared: &Arc<Shared>, pending: Pending, txs: Txs, head: bool) -> Decide {
    let shared = shared.clone();
    Box::pin(async move {
        let timeout = shared.failure.timeout;
        let result = match tokio::time::timeout(timeout, pending.decided(&txs)).await {
            Ok(r) => r.map_err(Failure::Limiter),
            Err(_) => Err(Failure::Timeout),
        };
        decided(&shared, result, txs, head)
    })
}

/// A request's decision: when the store failed (not a full memory table, which is refused
/// whatever the policy), this instance's in-memory fallback decides `txs` instead, if the
/// layer has one; what the store answered and what the fallback granted go to its ledger.
fn decided(
    shared: &Shared,
    result: Result<BatchDecision, Failure>,
    txs: Txs,
    head: bool,
) -> Decided {
    match (result, &shared.failure.fallback) {
        (Ok(batch), Some(fallback)) => {
            fallback.ledger.know(&batch, fallback.ledger.now());
            Decided {
                result: Ok(batch),
                txs,
                fell_back: false,
                head,
            }
        }
        // A limit that fails closed is never decided by the fallback.
        (Err(failure), Some(fallback)) if failure.store_failed() && !fails_closed(shared, &txs) => {
            let local = fallback.limiter(&shared.limiter);
            tracing::debug!(target: crate::telemetry::target::BACKEND, reason = %failure, "rate limit store failed; deciding in memory");
            let now = fallback.ledger.now();
            fallback.ledger.seed(local, &txs, now);
            // In memory it always answers at once; if it did not, the failure stands.
            match local.spend_now(&txs) {
                Some(result) => {
                    if let Ok(batch) = &result
                        && batch.allowed()
                    {
                        fallback
                            .ledger
                            .record(&shared.limiter.load(), batch, now, &shared.limiter);
                    }
                    Decided {
                        result: result.map_err(Failure::Limiter),
                        txs,
                        fell_back: true,
                        head,
                    }
                }
                None => Decided {
                    result: Err(failure),
                    txs,
                    fell_back: false,
                    head,
                },
            }
        }
        (result, _) => Decided {
            result,
            txs,
            fell_back: false,
            head,
        },
    }
}

/// What an allowed request's response needs from its decision.
pub(crate) enum Allowed {
    /// The `RateLimit` fields to add (nothing settles), taken from the decisions when they
    /// were made: the decisions are not kept.
    Fields(Fields),
    /// The decisions of rules that settle from the response
    /// ([`Rule::settle`](crate::Rule::settle)), and what the response gets once they are
    /// settled.
    Settle {
        batch: BatchDecision,
        after: AfterSettle,
    },
}

/// What the response of a request whose rules settle gets once they are settled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AfterSettle {
    /// The `RateLimit` fields of the settled decisions.
    pub(crate) fields: bool,
    /// A body that settles the rules that settle from the body: not for a `HEAD` (no body),
    /// whose estimate stands.
    pub(crate) body: bool,
    /// When the request was let through, where an outcome reads its latency.
    pub(crate) since: Option<tokio::time::Instant>,
    /// How long after that the response's head came, once it has
    /// ([`head_came`](Self::head_came)).
    pub(crate) latency: Duration,
}

impl AfterSettle {
    /// Notes that the response's head came now: its latency, read by every outcome of the
    /// request (those settled from the head, and those settled when the body ends).
    pub(crate) fn head_came(&mut self) {
        if let Some(since) = self.since.take() {
            self.latency = since.elapsed();
        }
    }
}

pub(crate) enum Conclusion {
    /// Call the inner service; its response gets what `Allowed` asks, and the request holds
    /// its slots on concurrency limits until it ends.
    Call(Option<Allowed>, Held),
    /// Answer with this response.
    Answer(Response<Bytes>),
    /// Denied, but every rule that denied waits ([`Rule::wait`](crate::Rule::wait)): sleep
    /// this long, holding the place, then decide the request again.
    Wait(Duration, WaitPermit),
}

/// Where a request stands with waiting: since when it has been waiting (its first denial that
/// waited), and its place among its rule's waiting requests.
#[derive(Default)]
pub(crate) struct Waited {
    pub(crate) since: Option<tokio::time::Instant>,
    pub(crate) permit: Option<WaitPermit>,
}

impl Waited {
    /// Whether the line knows the key's next unit is not free yet (another waiter of this
    /// instance went to the store for it): then `sleep` is reset to sleep on, without a call.
    pub(crate) fn sleeps_on(&self, sleep: std::pin::Pin<&mut tokio::time::Sleep>) -> bool {
        let Some(more) = self.permit.as_ref().and_then(|p| p.turn()) else {
            return false;
        };
        sleep.reset(tokio::time::Instant::now() + more);
        true
    }
}

/// What a decision (or a failure to decide) means for the request: counted, traced, and
/// turned into a call or an answer.
pub(crate) fn conclude(
    shared: &Arc<Shared>,
    decided: Decided,
    grpc: bool,
    waited: &mut Waited,
) -> Conclusion {
    let Decided {
        result,
        txs,
        fell_back,
        head,
    } = decided;
    // Decided: a place among waiting requests is given back, unless the request waits again.
    let held = waited.permit.take();
    // A waiter allowed: its line learns when the key's next unit is free (the store's word).
    if let (Some(permit), Ok(batch)) = (&held, &result)
        && batch.allowed()
        && let Some(d) = batch.decisions().iter().find(|d| d.key() == permit.key())
    {
        permit.admitted(d.retry_after());
    }
    match &result {
        Ok(_) if fell_back => {
            count("fallback");
            shared.rules.count(&txs, RuleOutcome::Fallback);
        }
        Ok(batch) => shared
            .rules
            .observe(batch.decisions().iter().map(Seen::from), batch.allowed()),
        Err(_) => {}
    }
    match result {
        Ok(batch) if batch.allowed() => allowed(shared, batch, fell_back, head),
        Ok(batch) => denied(shared, batch, grpc, waited, held),
        Err(Failure::Limiter(LimiterError::Backend(BackendError::Full { .. }))) => {
            full(shared, &txs, grpc)
        }
        Err(Failure::Limiter(LimiterError::CostAboveBurst { name, cost, burst })) => {
            count("rejected");
            shared.rules.count_one(name, RuleOutcome::Rejected);
            let message =
                format!("request cost {cost} exceeds the burst of {burst} of rate limit {name}");
            Conclusion::Answer(shared.answers.error(
                StatusCode::BAD_REQUEST,
                "BADREQUEST",
                &message,
                grpc,
            ))
        }
        Err(failure) => failed(shared, &failure, &txs, grpc),
    }
}

/// An allowed batch: the inner service called, with the fields or the settle it asks for, and
/// its slots held until the request ends (those of the in-memory fallback given back to it).
#[inline]
fn allowed(shared: &Arc<Shared>, batch: BatchDecision, fell_back: bool, head: bool) -> Conclusion {
    count("allowed");
    let release = match (&shared.failure.fallback, fell_back) {
        (Some(fallback), true) => {
            Release::of_fallback(fallback.limiter(&shared.limiter), &shared.limiter, &batch)
        }
        _ => Release::of(&shared.limiter, &batch),
    };
    // What the in-memory fallback spent is settled nowhere: its estimates stand.
    let settle = shared.rules.settles && !fell_back;
    let headers = shared.answers.fields.on_allowed();
    let allowed = if settle {
        Some(Allowed::Settle {
            batch,
            after: AfterSettle {
                fields: headers,
                body: !head,
                since: shared.rules.times.then(tokio::time::Instant::now),
                latency: Duration::ZERO,
            },
        })
    } else if headers {
        let cached = |name, quota: &_| shared.rules.cached_policy(name, quota);
        Fields::of(&batch, cached, &shared.rules.joined_policy).map(Allowed::Fields)
    } else {
        None
    };
    Conclusion::Call(allowed, release)
}

/// A denied batch: waited for when every rule that denied waits (the place held), else the
/// denial's answer.
#[inline]
fn denied(
    shared: &Arc<Shared>,
    mut batch: BatchDecision,
    grpc: bool,
    waited: &Waited,
    held: Option<WaitPermit>,
) -> Conclusion {
    shared.answers.jitter(&mut batch);
    if shared.rules.waits
        && let Some((delay, permit)) = shared.rules.wait_for(&batch, waited.since, held)
    {
        return Conclusion::Wait(delay, permit);
    }
    count("denied");
    let seen: Seen4<'_> = batch.decisions().iter().map(Seen::from).collect();
    Conclusion::Answer(answer_denied(shared, &seen, batch.strictest_at(), grpc))
}

/// A request's transactions as the layer shows them: on the stack for up to four rules.
type Seen4<'a> = smallvec::SmallVec<[Seen<'a>; 4]>;

/// The answer to a denied request (the layer's or the user's): the one road of every denial,
/// read by reference from its transactions `seen` (`strictest`: the one that denied).
fn answer_denied(
    shared: &Shared,
    seen: &[Seen<'_>],
    strictest: Option<usize>,
    grpc: bool,
) -> Response<Bytes> {
    let cached = |name, quota: &_| shared.rules.cached_policy(name, quota);
    shared.answers.denied(seen, strictest, grpc, &cached)
}

/// A request refused at once, answered from its verdict by reference as an allowed one is
/// (`allowed_now`): no decision built. Only for a verdict that holds no slot and no cost range
/// (`Verdict::plain`) of a layer where no rule waits and no fallback learns from answers, as
/// `conclude` would answer it: counted and traced with the batch's numbers (each allowed
/// transaction's units back: nothing was spent), its times put back by the jitter, answered.
#[inline(never)]
fn refused_now(shared: &Shared, verdict: &Verdict<'_>, parts: &Parts) -> Response<Bytes> {
    let mut seen: Seen4<'_> = verdict
        .entries()
        .map(|e| {
            let unspent = e.unspent();
            let mut seen = Seen::from(e);
            if let Some((remaining, reset_after_us)) = unspent {
                (seen.remaining, seen.reset_after_us) = (remaining, reset_after_us);
            }
            seen
        })
        .collect();
    shared.rules.observe(seen.iter().copied(), false);
    shared.answers.jitter_seen(&mut seen);
    count("denied");
    let strictest = crate::limiter::strictest(seen.iter().map(|d| {
        d.counts
            .then_some((d.allowed, d.retry_after_us, d.remaining))
    }));
    answer_denied(shared, &seen, strictest, is_grpc(&parts.headers))
}

/// The memory backend protects its memory: a new key cannot be tracked now. Letting it through
/// unlimited (fail open) is what a flood of new keys aims for, so this is refused whatever the
/// failure policy, with a hint to come back.
#[cold]
fn full(shared: &Arc<Shared>, txs: &Txs, grpc: bool) -> Conclusion {
    count("full");
    shared.rules.count(txs, RuleOutcome::FailedClosed);
    let mut response = shared.answers.error(
        StatusCode::SERVICE_UNAVAILABLE,
        "UNAVAILABLE",
        "the rate limiter is at capacity; try again shortly",
        grpc,
    );
    if !grpc {
        response.headers_mut().insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
    }
    Conclusion::Answer(response)
}

/// A store that failed (or did not answer in time): the failure policy (the layer's, or a
/// limit's `fail_closed`), counted and warned of through the warning gate.
#[cold]
fn failed(shared: &Arc<Shared>, failure: &Failure, txs: &Txs, grpc: bool) -> Conclusion {
    count("backend_failure");
    let reason = match failure {
        Failure::Timeout => format!(
            "rate limit backend did not answer within {:?}",
            shared.failure.timeout
        ),
        Failure::Limiter(e) => e.to_string(),
    };
    let closed = shared.failure.policy == FailurePolicy::FailClosed || fails_closed(shared, txs);
    shared.rules.count(
        txs,
        if closed {
            RuleOutcome::FailedClosed
        } else {
            RuleOutcome::FailedOpen
        },
    );
    let policy = if closed {
        "failing closed"
    } else {
        "failing open"
    };
    match shared.failure.warn_gate.admit() {
        Some(0) => {
            tracing::warn!(target: crate::telemetry::target::BACKEND, %reason, "rate limiter failed; {policy}")
        }
        Some(held) => tracing::warn!(target: crate::telemetry::target::BACKEND,
            %reason,
            "rate limiter failed; {policy} ({held} more failures since the last warning)"
        ),
        None => {
            tracing::debug!(target: crate::telemetry::target::BACKEND, %reason, "rate limiter failed; {policy}")
        }
    }
    if closed {
        return Conclusion::Answer(shared.answers.error(
            StatusCode::SERVICE_UNAVAILABLE,
            "UNAVAILABLE",
            "rate limiter unavailable",
            grpc,
        ));
    }
    Conclusion::Call(None, None)
}

fn count(outcome: &'static str) {
    count_request(outcome);
}

/// Whether a store failure refuses `txs` whatever the layer's policy: one of their limits asks
/// for it (`on_store_failure: fail_closed`). Asked only when the store failed.
#[cold]
fn fails_closed(shared: &Shared, txs: &Txs) -> bool {
    let limits = shared.limiter.limits();
    txs.iter().any(|tx| limits.fails_closed(tx.key().name()))
}
