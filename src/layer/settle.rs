//! Reserve, then reconcile: a rule charges an estimate when its request is decided and settles
//! the difference once the response tells the true cost (a response header, a function of the
//! response head, the bytes of the body, or a trailer). The settle rule lives here, once:
//! unused units are refunded, extra units are charged (into debt, up to the limit's
//! `max_debt`; they never turn a response already on its way into a denial), and anything that
//! prevents settling keeps the estimate.

use std::future::Future;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::HeaderName;
use http::response::Parts;

use std::time::Duration;

use super::count_when::{CountWhen, Marks};
use super::observe::WarnGate;
use crate::key::BucketKey;
use crate::limiter::{BatchDecision, Decision, Limiter, PenaltyPart, Transaction};
use crate::mode::Mode;

pub(super) mod error;
pub use error::SettleError;
use error::{MOST_UNITS_REPORTED, header_name};

type HeadFn = Arc<dyn Fn(&Parts) -> Option<u64> + Send + Sync>;

/// Where a rule finds a request's true cost once the response is known ([`Rule::settle`]).
///
/// The rule's cost ([`Rule::cost`](crate::Rule::cost), [`Rule::cost_fn`](crate::Rule::cost_fn)
/// or the limit's) is the estimate, charged when the request is decided like any cost; when
/// the true cost is known the difference is settled on the same bucket:
/// - less than the estimate: the unused units are refunded (never above a full bucket);
/// - more: the extra units are **charged** ([`Mode::Charge`](crate::Mode::Charge)): an
///   already-sent response is never turned into a denial, but on a GCRA limit the bucket may
///   go into **debt**, up to the limit's [`max_debt`](crate::Limit::max_debt) units below
///   empty (by default its burst), and the key is denied until time repays it. Units beyond
///   the debt bound are forgiven (counted as `forgiven`). On a tiered limit, which has no debt,
///   the extra units are taken when the tiers hold them all and forgiven when they do not.
///   Requests admitted in parallel before the first overrun is charged may each overrun; once
///   the debt is recorded the key is denied. Reserve the most a request can cost when an
///   overrun must never be forgiven (an LLM gateway reserves `max_tokens`): settling is then a
///   refund.
///
/// Head sources ([`header`](Self::header), [`response`](Self::response)) settle before the
/// response is handed on, so its `RateLimit` fields already show the settled bucket. Body
/// sources ([`body_bytes`](Self::body_bytes), [`trailer`](Self::trailer)) settle when the body
/// ends, before its end is passed on. What is charged when a request fails or is cancelled
/// first is in `docs/guide.md` ("Cost known only after the response").
///
/// ```
/// use tower_ratelimits::{ClientIp, Rule, Settle};
/// // Charge 100 tokens up front; the handler says how many it used.
/// let tokens = Rule::new("TokensPerIp", ClientIp::new())
///     .cost(100)
///     .settle(Settle::header("x-tokens-used"));
/// // Charge one unit per KiB actually sent.
/// let bytes = Rule::new("KibPerIp", ClientIp::new())
///     .cost(64)
///     .settle(Settle::body_bytes_per(1024));
/// ```
///
/// [`Rule::settle`]: crate::Rule::settle
#[derive(Clone)]
pub struct Settle {
    source: Source,
}

#[derive(Clone)]
enum Source {
    Header(HeaderName),
    Head(HeadFn),
    BodyBytes {
        per_unit: u64,
    },
    Trailer(HeaderName),
    /// The weight of the response's outcome (`Rule::count_when`): from the head, or when a
    /// case reads a gRPC status, when the body ends.
    Outcome(Arc<CountWhen>),
    /// Refused when the layer is built, with this reason.
    Invalid(SettleError),
}

impl std::fmt::Debug for Settle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.source {
            Source::Header(h) => write!(f, "Settle::header({h:?})"),
            Source::Head(_) => f.write_str("Settle::response(..)"),
            Source::BodyBytes { per_unit } => write!(f, "Settle::body_bytes_per({per_unit})"),
            Source::Trailer(h) => write!(f, "Settle::trailer({h:?})"),
            Source::Outcome(cases) => write!(f, "Settle::count_when({cases:?})"),
            Source::Invalid(reason) => write!(f, "Settle(invalid: {reason})"),
        }
    }
}

/// The cost in the field `name` of `headers`: its one value, as [`parse_units`] reads it. A
/// field sent twice is ambiguous and is no cost (the estimate is kept): taking either value
/// would let whoever adds the second one choose the charge.
pub fn units_in(headers: &http::HeaderMap, name: &HeaderName) -> Option<u64> {
    let mut values = headers.get_all(name).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse_units(value)
}

/// A cost written in a header or trailer: ASCII digits only, at most 20 (`u64`), optional
/// surrounding whitespace. Anything else is no cost (the estimate is kept).
pub fn parse_units(value: &http::HeaderValue) -> Option<u64> {
    let text = value.to_str().ok()?.trim();
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

impl Settle {
    /// The true cost is the integer in this response header (ASCII digits). A missing or
    /// malformed value keeps the estimate, and so does a header sent twice (ambiguous: no
    /// value is chosen). The header is left in the response.
    pub fn header(name: &str) -> Self {
        Self {
            source: header_name(name).map_or_else(Source::Invalid, Source::Header),
        }
    }

    /// The true cost is what `f` finds in the response head (status, headers, extensions);
    /// `None` keeps the estimate.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Rule, Settle};
    /// // A failed request costs nothing.
    /// let rule = Rule::new("CallsPerIp", ClientIp::new())
    ///     .settle(Settle::response(|head| head.status.is_server_error().then_some(0)));
    /// ```
    pub fn response(f: impl Fn(&Parts) -> Option<u64> + Send + Sync + 'static) -> Self {
        Self {
            source: Source::Head(Arc::new(f)),
        }
    }

    /// The settle that counts the weight of the response's outcome
    /// ([`Rule::count_when`](crate::Rule::count_when)), or why its cases cannot be used.
    pub(crate) fn outcome(cases: CountWhen) -> Result<Self, SettleError> {
        cases.check()?;
        Ok(Self {
            source: Source::Outcome(Arc::new(cases)),
        })
    }

    /// The true cost is the number of body bytes sent, one unit per byte.
    pub fn body_bytes() -> Self {
        Self::body_bytes_per(1)
    }

    /// The true cost is one unit per `bytes` body bytes sent, the last one rounded up (so
    /// `body_bytes_per(1024)` counts started KiB). `0` is refused when the layer is built.
    pub fn body_bytes_per(bytes: u64) -> Self {
        Self {
            source: if bytes == 0 {
                Source::Invalid(SettleError::ZeroBytesPerUnit)
            } else {
                Source::BodyBytes { per_unit: bytes }
            },
        }
    }

    /// The true cost is the integer in this trailer of the body (gRPC and HTTP/2 services
    /// report usage this way). A body that ends without it, or with it twice, keeps the
    /// estimate.
    pub fn trailer(name: &str) -> Self {
        Self {
            source: header_name(name).map_or_else(Source::Invalid, Source::Trailer),
        }
    }

    /// A settle refused when the layer is built, with `reason`.
    pub(crate) fn invalid(reason: SettleError) -> Self {
        Self {
            source: Source::Invalid(reason),
        }
    }

    /// Why this settle cannot be used, if it cannot.
    pub(crate) fn check(&self) -> Result<(), SettleError> {
        match &self.source {
            Source::Invalid(reason) => Err(reason.clone()),
            _ => Ok(()),
        }
    }

    /// Where a replayed response carries its logged cost for this settle to read (`None`: a
    /// function of the head, which reads the logged status and the headers given).
    #[cfg(feature = "replay")]
    pub(crate) fn replay_source(&self) -> Option<SettleFrom> {
        match &self.source {
            Source::Header(name) => Some(SettleFrom::Header(name.clone())),
            Source::Trailer(name) => Some(SettleFrom::Trailer(name.clone())),
            Source::BodyBytes { per_unit } => Some(SettleFrom::BodyBytes(*per_unit)),
            Source::Head(_) | Source::Outcome(_) | Source::Invalid(_) => None,
        }
    }

    /// Whether the true cost comes from the body (settled when it ends): its bytes, a
    /// trailer, or an outcome whose gRPC status may be there.
    pub(crate) fn on_body(&self) -> bool {
        match &self.source {
            Source::BodyBytes { .. } | Source::Trailer(_) => true,
            Source::Outcome(cases) => cases.reads_trailers(),
            Source::Header(_) | Source::Head(_) | Source::Invalid(_) => false,
        }
    }

    /// Whether it reads the request's latency (an outcome case of `latency_above`).
    pub(crate) fn times(&self) -> bool {
        matches!(&self.source, Source::Outcome(cases) if cases.times())
    }

    /// The true cost from the response head, which came `latency` after the request was let
    /// through; `None` for body sources.
    fn cost_in_head(&self, head: &Parts, latency: Duration) -> Option<u64> {
        match &self.source {
            Source::Header(name) => units_in(&head.headers, name),
            Source::Head(f) => f(head),
            Source::Outcome(cases) => cases.marks(head, latency).weight(cases),
            _ => None,
        }
    }

    /// The true cost from a body that ended (or stopped) after `bytes` bytes, with its
    /// trailers if it had any, and what its head showed (`marks`, an outcome's); `None` for
    /// head sources.
    fn cost_in_body(
        &self,
        bytes: u64,
        trailers: Option<&http::HeaderMap>,
        marks: Option<Marks>,
    ) -> Option<u64> {
        match &self.source {
            Source::BodyBytes { per_unit } => Some(bytes.div_ceil(*per_unit)),
            Source::Trailer(name) => units_in(trailers?, name),
            Source::Outcome(cases) => cases.weight_at_end(marks?, trailers),
            _ => None,
        }
    }
}

/// Where a settle reads the true cost, as a replayed response gives it (feature `replay`).
#[cfg(feature = "replay")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SettleFrom {
    /// A response header holding the units.
    Header(HeaderName),
    /// A trailer holding the units.
    Trailer(HeaderName),
    /// A body of this many bytes per unit.
    BodyBytes(u64),
}

/// What settling a reservation does to its bucket: the settle rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Adjust {
    /// The estimate was right.
    Exact,
    /// Give back this many units.
    Refund(u64),
    /// Charge this many more (into debt, as far as the limit allows).
    Charge(u64),
}

impl Adjust {
    fn of(reserved: u64, actual: u64) -> Self {
        match actual.cmp(&reserved) {
            std::cmp::Ordering::Equal => Adjust::Exact,
            std::cmp::Ordering::Less => Adjust::Refund(reserved - actual),
            std::cmp::Ordering::Greater => Adjust::Charge(actual - reserved),
        }
    }
}

/// One bucket a request was charged on, waiting for its true cost.
pub(crate) struct Reserved {
    /// Where its rule finds the true cost.
    settle: Settle,
    key: BucketKey,
    /// Units charged up front.
    reserved: u64,
    /// The most a charge may ask of the bucket (a tiered limit's capacity; unbounded for GCRA,
    /// where a charge takes what fits within the debt bound).
    max_cost: u64,
    /// What the response head showed of an outcome settled when the body ends.
    marks: Option<Marks>,
    /// Its reservation on its limit's penalty, settled with it (`docs/penalties.md`).
    penalty: Option<NonZeroU64>,
}

impl Reserved {
    pub(crate) fn new(settle: Settle, key: BucketKey, reserved: u64, max_cost: u64) -> Self {
        Self {
            settle,
            key,
            reserved,
            max_cost,
            marks: None,
            penalty: None,
        }
    }

    /// With its reservation `id` on its limit's penalty (`None`: the limit has none).
    pub(crate) fn on_penalty(mut self, id: Option<NonZeroU64>) -> Self {
        self.penalty = id;
        self
    }

    /// Notes what the response `head` (come `latency` after the request was let through)
    /// shows of an outcome settled when the body ends.
    pub(crate) fn saw_head(&mut self, head: &Parts, latency: Duration) {
        if let Source::Outcome(cases) = &self.settle.source {
            self.marks = Some(cases.marks(head, latency));
        }
    }
}

pub(crate) type Reservations = smallvec::SmallVec<[Reserved; 1]>;

/// What settling needs of the layer: the limiter, the backend timeout, and the gate that lets
/// one warning through per interval (shared with the failure policy's warnings).
#[derive(Clone)]
pub(crate) struct Settler {
    pub(crate) limiter: Limiter,
    pub(crate) timeout: Duration,
    pub(crate) warn_gate: Arc<WarnGate>,
    /// Settles run in the response's own future, not spawned (a replay: the next request of
    /// the same instant must find the bucket settled, and no request is abandoned).
    #[cfg(feature = "replay")]
    pub(crate) inline: Arc<std::sync::atomic::AtomicBool>,
}

/// A settle under way: done already (a store that answered at once), spawned on the runtime
/// (it completes even if the request goes away), or run in place where there is no runtime.
pub(crate) enum Task {
    Done(Vec<Decision>),
    Spawned(tokio::task::JoinHandle<Vec<Decision>>),
    Inline(Pin<Box<dyn Future<Output = Vec<Decision>> + Send>>),
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Task::Done(_) => "Task::Done",
            Task::Spawned(_) => "Task::Spawned",
            Task::Inline(_) => "Task::Inline",
        })
    }
}

impl Future for Task {
    type Output = Vec<Decision>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Vec<Decision>> {
        match self.get_mut() {
            Task::Done(states) => Poll::Ready(std::mem::take(states)),
            // A settle that panicked or was cancelled with the runtime changed nothing we
            // can report: the response keeps the fields it had.
            Task::Spawned(handle) => Pin::new(handle).poll(cx).map(Result::unwrap_or_default),
            Task::Inline(future) => future.as_mut().poll(cx),
        }
    }
}

/// A settle's refunds or charges: one rule's, most often, held without a heap allocation.
type Txs = smallvec::SmallVec<[Transaction; 1]>;

/// Starts settling `work` (reservations with their true costs); `None` when nothing needs the
/// store (every estimate exact or kept).
fn start(settler: &Settler, work: impl Iterator<Item = (Reserved, Option<u64>)>) -> Option<Task> {
    let mut refunds = Txs::new();
    let mut charges = Txs::new();
    for (r, actual) in work {
        let (refund, charge) = adjust(settler, &r, actual);
        // What the outcome counts on the penalty: at most what was reserved, all of it when
        // the outcome never came (a body cut before its trailers). Settled with the refund,
        // or alone (a refund of 0) when nothing is refunded.
        let penalty = r.penalty.map(|id| PenaltyPart::Settle {
            id,
            counted: actual.unwrap_or(r.reserved).min(r.reserved),
        });
        let refund = match (refund, penalty) {
            (None, None) => None,
            (n, p) => Some((n.unwrap_or(0), p.unwrap_or_default())),
        };
        // The key moves into the last transaction that names it.
        match (refund, charge) {
            (Some((n, p)), Some(c)) => {
                charges.push(charging(r.key.clone(), c));
                refunds.push(settling(r.key, n, p));
            }
            (Some((n, p)), None) => refunds.push(settling(r.key, n, p)),
            (None, Some(c)) => charges.push(charging(r.key, c)),
            (None, None) => {}
        }
    }
    if refunds.is_empty() && charges.is_empty() {
        return None;
    }
    let mut future = Box::pin(run(settler.clone(), refunds, charges));
    // A store that answers at once (memory) settles here: no task to spawn, no second poll.
    // A later poll with the real waker replaces this one's.
    let mut now = Context::from_waker(std::task::Waker::noop());
    if let Poll::Ready(states) = future.as_mut().poll(&mut now) {
        return Some(Task::Done(states));
    }
    #[cfg(feature = "replay")]
    if settler.inline.load(std::sync::atomic::Ordering::Relaxed) {
        return Some(Task::Inline(future));
    }
    Some(match tokio::runtime::Handle::try_current() {
        Ok(runtime) => Task::Spawned(runtime.spawn(future)),
        Err(_) => Task::Inline(future),
    })
}

/// What settling `r` at its true cost `actual` (`None`: never known, the estimate kept) gives
/// back and charges of its bucket, each counted (`None`: nothing).
fn adjust(settler: &Settler, r: &Reserved, actual: Option<u64>) -> (Option<u64>, Option<u64>) {
    let name = r.key.name();
    let Some(actual) = actual else {
        crate::telemetry::settled(name, "kept", 0);
        return (None, None);
    };
    match Adjust::of(r.reserved, actual) {
        Adjust::Exact => {
            crate::telemetry::settled(name, "exact", 0);
            (None, None)
        }
        Adjust::Refund(n) => (Some(n), None),
        // A report no response could be worth: counted apart (`absurd`), its units in no
        // counter (they would wrap it). What the bucket can take of it is still charged.
        Adjust::Charge(n) if n > MOST_UNITS_REPORTED => {
            crate::telemetry::settled(name, "absurd", 0);
            if settler.warn_gate.admit().is_some() {
                tracing::warn!(target: crate::telemetry::target::LAYER, limit = %name, units = n, "a response reported an absurd cost: counted apart, charged what the bucket takes");
            }
            (None, (n <= r.max_cost).then_some(n))
        }
        // More than tiers hold can never be taken: forgiven without asking.
        Adjust::Charge(n) if n > r.max_cost => {
            crate::telemetry::settled(name, "forgiven", n);
            (None, None)
        }
        Adjust::Charge(n) => (None, Some(n)),
    }
}

/// A refund of `n` units of `key`'s bucket, with what it settles of its limit's penalty
/// (`PenaltyPart::Count`: nothing; a refund of 0 that settles only the penalty).
fn settling(key: BucketKey, n: u64, penalty: PenaltyPart) -> Transaction {
    Transaction::new(key).cost(n).with_penalty(penalty)
}

/// A charge of `n` more units of `key`'s bucket (into debt, as far as its limit allows).
fn charging(key: BucketKey, n: u64) -> Transaction {
    Transaction::new(key).cost(n).mode(Mode::Charge)
}

/// Refunds and charges (one backend call each, when there are any), counted; returns the
/// buckets' new states.
async fn run(settler: Settler, refunds: Txs, charges: Txs) -> Vec<Decision> {
    let mut states = Vec::new();
    if !refunds.is_empty() {
        match within(settler.timeout, settler.limiter.refund(&refunds)).await {
            Ok(batch) => {
                // The refunds' decisions are the states, as they come (most settles are
                // refunds alone).
                states = batch.into_decisions();
                // A refund of 0 settles only a penalty: no units came back.
                for (d, t) in states
                    .iter()
                    .zip(&refunds)
                    .filter(|(_, t)| t.cost_or(0) > 0)
                {
                    crate::telemetry::settled(d.name, "refunded", t.cost_or(0));
                }
            }
            Err(reason) => failed(&settler.warn_gate, &refunds, &reason),
        }
    }
    if !charges.is_empty() {
        match within(settler.timeout, settler.limiter.spend(&charges)).await {
            Ok(batch) => {
                // Decisions come in the order of the transactions.
                for (d, t) in batch.into_decisions().into_iter().zip(&charges) {
                    // A GCRA charge takes what fits within the debt bound (`granted`); a tiered
                    // one all or nothing.
                    let charged = if d.allowed { d.granted } else { 0 };
                    let asked = t.cost_or(0);
                    let forgiven = asked.saturating_sub(charged);
                    if asked > MOST_UNITS_REPORTED {
                        // Counted as absurd already: only the units really taken count.
                        crate::telemetry::settled_units(d.name, "charged", charged);
                    } else if charged > 0 {
                        crate::telemetry::settled(d.name, "charged", charged);
                        crate::telemetry::settled_units(d.name, "forgiven", forgiven);
                    } else {
                        crate::telemetry::settled(d.name, "forgiven", forgiven);
                    }
                    states.push(d);
                }
            }
            Err(reason) => failed(&settler.warn_gate, &charges, &reason),
        }
    }
    states
}

/// Why a settle's call to the store did not apply (its warning says it).
#[derive(Debug, thiserror::Error)]
enum Unsettled {
    #[error(transparent)]
    Limiter(#[from] crate::limiter::LimiterError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// `f` within the layer's backend timeout. A store that answers at once (memory) sets no
/// timer; without a tokio runtime (no timer to set: a layer polled by another executor), `f`
/// is awaited as it is.
async fn within<T>(
    timeout: Duration,
    f: impl Future<Output = Result<T, crate::limiter::LimiterError>>,
) -> Result<T, Unsettled> {
    let mut f = std::pin::pin!(f);
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await;
    if let std::task::Poll::Ready(r) = first {
        return Ok(r?);
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return Ok(f.await?);
    }
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(Unsettled::Timeout(timeout)),
    }
}

/// A settle the store could not apply: the estimates stand.
fn failed(warn_gate: &WarnGate, txs: &[Transaction], reason: &Unsettled) {
    for t in txs {
        crate::telemetry::settled(t.key().name(), "failed", 0);
    }
    // The failure policy does not apply: the response is already out.
    match warn_gate.admit() {
        Some(_) => {
            tracing::warn!(target: crate::telemetry::target::BACKEND, %reason, "rate limit settle failed; the estimated costs stand")
        }
        None => {
            tracing::debug!(target: crate::telemetry::target::BACKEND, %reason, "rate limit settle failed; the estimated costs stand")
        }
    }
}

/// Starts settling the head-settled rules of an allowed batch from the response head; `None`
/// when there is nothing to send to the store.
pub(crate) fn settle_head(
    settler: &Settler,
    reserved: Reservations,
    head: &Parts,
    latency: Duration,
) -> Option<Task> {
    if reserved.is_empty() {
        return None;
    }
    let work = reserved.into_iter().map(|r| {
        let actual = r.settle.cost_in_head(head, latency);
        (r, actual)
    });
    start(settler, work)
}

/// Brings the settled buckets' states into the batch whose `RateLimit` fields the response is
/// about to carry.
pub(crate) fn merge(batch: &mut BatchDecision, settled: Vec<Decision>) {
    batch.update(settled);
}

/// The body-settled rules of a request: counts the body's bytes and settles when it ends.
pub(crate) struct BodySettle {
    settler: Settler,
    pending: Reservations,
    bytes: u64,
    /// The settle under way, and the frame held back until it is done (the trailers, or `None`
    /// for the end of the body).
    pub(crate) task: Option<Task>,
    pub(crate) held: Option<http_body::Frame<bytes::Bytes>>,
    /// Settled: the rest of the body passes through.
    pub(crate) done: bool,
}

impl std::fmt::Debug for BodySettle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodySettle")
            .field("pending", &self.pending.len())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl BodySettle {
    /// The body-settled reservations of a request (`pending`); `None` when it has none.
    pub(crate) fn of(settler: &Settler, pending: Reservations) -> Option<Box<Self>> {
        (!pending.is_empty()).then(|| {
            Box::new(Self {
                settler: settler.clone(),
                pending,
                bytes: 0,
                task: None,
                held: None,
                done: false,
            })
        })
    }

    /// Counts `n` more body bytes sent.
    pub(crate) fn sent(&mut self, n: usize) {
        self.bytes = self.bytes.saturating_add(n as u64);
    }

    /// Settles now, with the bytes so far and `trailers` when the body ended with them. Once:
    /// later calls (and the drop) find nothing pending.
    pub(crate) fn finish(&mut self, trailers: Option<&http::HeaderMap>) -> Option<Task> {
        let bytes = self.bytes;
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            return None;
        }
        let work = pending.into_iter().map(|r| {
            let actual = r.settle.cost_in_body(bytes, trailers, r.marks);
            (r, actual)
        });
        start(&self.settler, work)
    }
}

impl Drop for BodySettle {
    /// A body dropped before its end (the client went away) settles on the bytes sent so far;
    /// a trailer never came, so those rules keep their estimates. The settle runs on the
    /// runtime; without one it cannot run and the estimates stand.
    fn drop(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if let Some(Task::Inline(_)) = self.finish(None) {
            tracing::debug!(target: crate::telemetry::target::BACKEND, "rate limit settle dropped: no runtime; the estimated costs stand");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // tests/settle.rs holds the parsing rules for any value (property tests).

    #[test]
    fn the_settle_rule_refunds_the_unused_and_charges_the_extra() {
        assert_eq!(Adjust::of(10, 10), Adjust::Exact);
        assert_eq!(Adjust::of(10, 3), Adjust::Refund(7));
        assert_eq!(Adjust::of(10, 0), Adjust::Refund(10));
        assert_eq!(Adjust::of(0, 4), Adjust::Charge(4));
        assert_eq!(Adjust::of(2, u64::MAX), Adjust::Charge(u64::MAX - 2));
    }

    #[test]
    fn units_are_plain_decimal_integers() {
        let v = |s: &'static str| http::HeaderValue::from_static(s);
        assert_eq!(parse_units(&v("42")), Some(42));
        assert_eq!(parse_units(&v(" 7 ")), Some(7));
        assert_eq!(parse_units(&v("0")), Some(0));
        assert_eq!(parse_units(&v("18446744073709551615")), Some(u64::MAX));
        for bad in [
            "",
            "-1",
            "+1",
            "1.5",
            "1e3",
            "18446744073709551616",
            "12 3",
            "0x10",
        ] {
            assert_eq!(parse_units(&v(bad)), None, "{bad:?}");
        }
    }

    #[test]
    fn body_bytes_round_the_last_unit_up() {
        let kib = Settle::body_bytes_per(1024);
        assert_eq!(kib.cost_in_body(0, None, None), Some(0));
        assert_eq!(kib.cost_in_body(1, None, None), Some(1));
        assert_eq!(kib.cost_in_body(1024, None, None), Some(1));
        assert_eq!(kib.cost_in_body(1025, None, None), Some(2));
        assert_eq!(Settle::body_bytes().cost_in_body(77, None, None), Some(77));
        assert!(Settle::body_bytes_per(0).check().is_err());
        assert!(Settle::header("bad header").check().is_err());
        assert!(Settle::trailer("x-used").check().is_ok());
    }
}
