//! A rule (a limit name, how to find the id, what a request costs) and what the rules make of
//! one request: a batch of transactions, or an answer right away.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};

use std::time::Duration;

use super::extract::{KeyExtractor, Read, ReadHeader, Readers, Source};
use super::observe::{RuleMetrics, RuleOutcome, Seen};
use super::response::{self, ErrorBody};
use super::settle::{Reservations, Reserved};
use super::wait::{Join, WaitPermit, Waiting};
use crate::config::Limits;
use crate::key::{BucketKey, LimitName};
use crate::limiter::{BatchDecision, PenaltyPart, Transaction};
use crate::mode::Mode;

/// What to do when a rule's extractor finds no id (e.g. no account header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnMissingKey {
    /// Do not apply this rule to the request.
    Skip,
    /// Answer with this status (e.g. 401 or 400) and a JSON body. The default, with 400: a
    /// limit is never skipped unless you say so.
    Reject(StatusCode),
}

impl Default for OnMissingKey {
    fn default() -> Self {
        Self::Reject(StatusCode::BAD_REQUEST)
    }
}

pub(crate) type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;
pub(crate) type Predicate = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// Whether `path` is `prefix` or below it, segment by segment (`/api` covers `/api` and
/// `/api/x`, not `/apix`).
fn under(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || prefix.is_empty())
}

/// One limit applied to requests: a limit name, how to find the id, and what a request costs.
///
/// ```
/// use tower_ratelimits::http::Method;
/// use tower_ratelimits::{Header, OnMissingKey, Rule};
/// let rule = Rule::new("ApiCallsPerAccount", Header::new("X-Account-Id"))
///     .cost_fn(|req| if req.method == Method::POST { 5 } else { 1 })
///     .on_missing_key(OnMissingKey::Skip);
/// ```
#[derive(Clone)]
pub struct Rule {
    pub(crate) name: String,
    pub(crate) extractor: Arc<dyn KeyExtractor>,
    pub(crate) cost: Option<u64>,
    pub(crate) cost_fn: Option<CostFn>,
    pub(crate) mode: Mode,
    pub(crate) shadow: bool,
    pub(crate) on_missing: OnMissingKey,
    /// The rule applies only when every one of these holds.
    pub(crate) scope: Vec<Predicate>,
    /// The rule does not apply when any of these holds.
    pub(crate) exempt: Vec<Predicate>,
    /// Where the true cost is found once the response is known.
    pub(crate) settle: Option<super::settle::Settle>,
    /// How long a request it denies may wait instead.
    pub(crate) wait: Option<super::wait::Wait>,
    /// Where a rules file defines it (`rules.yaml:3`), for the layer's errors about it.
    pub(crate) defined_at: Option<Arc<str>>,
    /// What it counts: requests, or the messages of the streams they open.
    #[cfg(feature = "stream")]
    pub(crate) per: super::stream_keys::Per,
    /// What a stream it counts does at its limit (`None`: the meter's default).
    #[cfg(feature = "stream")]
    pub(crate) at_limit: Option<super::stream_keys::AtLimit>,
    /// The price a rule per unit charges its units at.
    #[cfg(feature = "stream")]
    pub(crate) price: Option<Arc<super::stream_keys::Priced>>,
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("cost", &self.cost)
            .field("mode", &self.mode)
            .field("shadow", &self.shadow)
            .field("on_missing", &self.on_missing)
            .field("scoped", &!self.scope.is_empty())
            .field("exemptions", &self.exempt.len())
            .field("settle", &self.settle)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl Rule {
    /// A rule for the limit `name`, keyed by `extractor`, at the limit's configured cost.
    pub fn new(name: impl Into<String>, extractor: impl KeyExtractor) -> Self {
        Self {
            name: name.into(),
            extractor: Arc::new(extractor),
            cost: None,
            cost_fn: None,
            mode: Mode::CheckAndSpend,
            shadow: false,
            on_missing: OnMissingKey::default(),
            scope: Vec::new(),
            exempt: Vec::new(),
            settle: None,
            wait: None,
            defined_at: None,
            #[cfg(feature = "stream")]
            per: super::stream_keys::Per::Request,
            #[cfg(feature = "stream")]
            at_limit: None,
            #[cfg(feature = "stream")]
            price: None,
        }
    }

    /// A fixed cost per request.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self.cost_fn = None;
        self
    }

    /// A cost computed from the request.
    pub fn cost_fn(mut self, f: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.cost_fn = Some(Arc::new(f));
        self.cost = None;
        self
    }

    /// The transaction mode (e.g. [`Mode::CheckOnly`] to enforce without spending).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Shadow (dry-run) mode for this rule: it is decided, and its bucket evolves exactly as
    /// if it were enforced (a request it would deny writes nothing to it), but no request is
    /// ever refused because of it. Each "would deny" is counted
    /// (`tower_ratelimits_decisions_total{outcome="shadow_denied"}`) and logged at `info` on the
    /// target `tower_ratelimits::shadow`, at most once per 10 s per layer (the line's
    /// `held_back` counts those not logged since the last one). Enforced and shadowed rules of
    /// a request are still one backend call.
    /// [`RateLimitLayerBuilder::shadow`](crate::RateLimitLayerBuilder::shadow) shadows every
    /// rule of a layer.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Rule};
    /// let rollout = Rule::new("NewStricterLimit", ClientIp::new()).shadow(true);
    /// ```
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// Applies the rule only to requests for which `f` holds (a scope over the request head).
    /// Several scopes must all hold. An out-of-scope rule is left out of the request's batch:
    /// every rule of a layer that applies is still decided in one all-or-nothing backend call.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Rule};
    /// let uploads = Rule::new("UploadsPerIp", ClientIp::new())
    ///     .when(|req| req.headers.contains_key("content-length"));
    /// ```
    pub fn when(mut self, f: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.scope.push(Arc::new(f));
        self
    }

    /// Applies the rule only to these methods. `GET` covers `HEAD` too, as axum's
    /// `MethodFilter::GET` does (axum answers a `HEAD` with the `GET` handler, so a `GET`
    /// scope that left `HEAD` out would let anyone past it); list `HEAD` alone to limit only
    /// `HEAD`.
    ///
    /// ```
    /// use tower_ratelimits::http::Method;
    /// use tower_ratelimits::{ClientIp, Rule};
    /// let writes = Rule::new("WritesPerIp", ClientIp::new()).for_methods([Method::POST, Method::PUT]);
    /// ```
    pub fn for_methods(self, methods: impl IntoIterator<Item = http::Method>) -> Self {
        let mut methods: Vec<http::Method> = methods.into_iter().collect();
        if methods.contains(&http::Method::GET) && !methods.contains(&http::Method::HEAD) {
            methods.push(http::Method::HEAD);
        }
        self.when(move |req| methods.contains(&req.method))
    }

    /// Applies the rule only to paths at or below `prefix`, segment by segment (`/api` covers
    /// `/api` and `/api/users`, not `/apix`).
    pub fn for_path_prefix(self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.when(move |req| under(req.uri.path(), &prefix))
    }

    /// Applies the rule only to requests axum routed to `route`, as written in the router
    /// (`"/users/{id}"`; axum's `MatchedPath`, present when the layer is added with
    /// `Router::layer`).
    #[cfg(feature = "axum")]
    pub fn for_route(self, route: impl Into<String>) -> Self {
        let route = route.into();
        self.when(move |req| {
            req.extensions
                .get::<axum::extract::MatchedPath>()
                .is_some_and(|m| m.as_str() == route)
        })
    }

    /// Exempts requests for which `f` holds from this rule (an internal health checker, a
    /// partner's header checked by an earlier layer). Several exemptions: any one exempts.
    pub fn exempt_if(mut self, f: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.exempt.push(Arc::new(f));
        self
    }

    /// Reserve, then reconcile: the rule's cost is charged as an estimate when the request is
    /// decided, and the difference with the true cost, found in the response by `settle`, is
    /// settled on the same bucket (unused units refunded, extra units spent spend-only). See
    /// [`Settle`](super::Settle) for the sources and what each outcome charges. The estimate
    /// is at least 1 (a cost of 0 is charged as 1), so a request cannot pass an empty bucket by
    /// estimating nothing. A rule that spends nothing ([`Mode::CheckOnly`]) has nothing to
    /// settle: the layer refuses it.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Rule, Settle};
    /// let rule = Rule::new("TokensPerIp", ClientIp::new())
    ///     .cost(500)
    ///     .settle(Settle::header("x-tokens-used"));
    /// ```
    pub fn settle(mut self, settle: super::settle::Settle) -> Self {
        self.settle = Some(settle);
        self
    }

    /// Count a request only when its response shows one of `outcomes`' cases, by that case's
    /// weight ("10 failed logins an hour per account"). The request reserves the largest
    /// weight it could count when it is decided: a key without room for it is refused before
    /// the service runs, and a thousand attempts in parallel cannot all pass a limit of ten.
    /// Its response head settles what it counts (the rest of the reservation is given back,
    /// before the response is handed on). A request that ends without a response (its client
    /// gone, the service failed, a timeout) keeps the whole reservation: hanging up does not
    /// escape counting. This sets the rule's cost and its [`settle`](Self::settle); a later
    /// `cost`, `cost_fn` or `settle` replaces them. Bad cases (a header name or value that
    /// is not one, a weight above 2^40, nothing that weighs more than 0) are refused when the
    /// layer is built ([`LayerError::Settle`](super::LayerError::Settle)).
    ///
    /// ```
    /// use tower_ratelimits::{CountWhen, Header, Rule};
    /// let failed_logins = Rule::new("FailedLoginsPerAccount", Header::new("x-account"))
    ///     .count_when(CountWhen::new().status(401, 1));
    /// ```
    pub fn count_when(mut self, outcomes: super::count_when::CountWhen) -> Self {
        self.cost = Some(outcomes.most());
        self.cost_fn = None;
        self.settle = Some(
            super::settle::Settle::outcome(outcomes).unwrap_or_else(super::settle::Settle::invalid),
        );
        self
    }

    /// Wait instead of reject: a request this rule would deny, whose `retry_after` is within
    /// the bound, waits that long (holding nothing) and is decided again; beyond the bound, or
    /// when too many already wait, it is refused as before. Every rule that denies a request
    /// must wait for the request to wait. See [`Wait`](super::Wait) for the bound, the cap and
    /// fairness.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimits::{Header, Rule, Wait};
    /// let jobs = Rule::new("JobsPerAccount", Header::new("x-account-id"))
    ///     .wait(Wait::up_to(Duration::from_millis(500)));
    /// ```
    pub fn wait(mut self, wait: super::wait::Wait) -> Self {
        self.wait = Some(wait);
        self
    }

    /// What the rule counts: each request (the default), or each message of the stream a
    /// request opens ([`Per::Message`](crate::Per::Message), or its units:
    /// [`Per::Unit`](crate::Per::Unit)). A per-message rule is not decided by the layer: its
    /// key, found as any rule's (extractor, scopes, missing-key policy: a request without it
    /// is refused before the service runs unless the rule skips), goes to the handler in the
    /// request's [`StreamKeys`](crate::StreamKeys), whose meter counts each message
    /// (`docs/streams.md`). It cannot settle, count outcomes or wait (the meter pushes back
    /// instead: [`Rule::at_limit`]), nor name a limit that holds slots
    /// ([`LayerError::PerMessage`](super::LayerError::PerMessage)).
    ///
    /// ```
    /// use tower_ratelimits::{AtLimit, Header, Per, Rule};
    /// let messages = Rule::new("MessagesPerAccount", Header::new("x-account"))
    ///     .per(Per::Message)
    ///     .at_limit(AtLimit::End);
    /// ```
    #[cfg(feature = "stream")]
    pub fn per(mut self, per: super::stream_keys::Per) -> Self {
        self.per = per;
        self
    }

    /// A rule per unit ([`Per::Unit`](crate::Per::Unit)) charging each message's units at
    /// their price: the model the request names (`model`: a header, or a field of its JSON
    /// body), its price `of` in `table` (money as the limit's units, integer micro-units:
    /// `docs/streams.md`, "Money"). From a header, the layer prices the key: a request
    /// without the header is the rule's missing key ([`Rule::on_missing_key`]); one that sends
    /// it twice, or names a model the table does not price, is refused with a 400. From the
    /// body, the handler prices it ([`StreamKeys::price_from_body`](crate::StreamKeys::price_from_body)).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_ratelimits::{Header, ModelFrom, PriceOf, PriceTable, Rule};
    /// let prices = PriceTable::from_yaml_str("models:\n  small: {input: 150000, output: 600000}\n")?;
    /// let model = ModelFrom::Header(http::HeaderName::from_static("x-model"));
    /// let spend = Rule::new("SpendPerAccount", Header::new("x-account"))
    ///     .priced(Arc::new(prices), model, PriceOf::Output);
    /// # Ok::<(), tower_ratelimits::ConfigError>(())
    /// ```
    #[cfg(feature = "stream")]
    pub fn priced(
        mut self,
        table: Arc<crate::config::PriceTable>,
        model: super::stream_keys::ModelFrom,
        of: crate::config::PriceOf,
    ) -> Self {
        self.per = super::stream_keys::Per::Unit;
        self.price = Some(Arc::new(super::stream_keys::Priced { table, model, of }));
        self
    }

    /// What a stream a per-message rule counts does at the rule's limit (push back or end;
    /// [`StreamKeys::at_limit`](crate::StreamKeys::at_limit) joins several rules'). A rule per
    /// request ignores it.
    #[cfg(feature = "stream")]
    pub fn at_limit(mut self, at_limit: super::stream_keys::AtLimit) -> Self {
        self.at_limit = Some(at_limit);
        self
    }

    /// What to do when the extractor finds no id.
    pub fn on_missing_key(mut self, policy: OnMissingKey) -> Self {
        self.on_missing = policy;
        self
    }
}

pub(crate) struct ResolvedRule {
    pub(crate) name: LimitName,
    pub(crate) rule: Rule,
    pub(crate) metrics: RuleMetrics,
    /// Shadowed, by the rule or by the layer.
    pub(crate) shadow: bool,
    /// The mode its transactions are sent in (shadowed when `shadow`).
    pub(crate) mode: Mode,
    /// The default limit and its `RateLimit-Policy` value, computed once.
    pub(crate) policy: Option<(crate::quota::Quota, http::HeaderValue)>,
    /// Requests of this rule waiting now ([`Rule::wait`]).
    pub(crate) waiting: Arc<Waiting>,
    /// Where its id comes from: its extractor, or an address the request's rules read once.
    pub(crate) source: Source,
}

impl ResolvedRule {
    /// Whether the rule applies to a request (in its scope, not exempted by it).
    fn applies(&self, parts: &Parts) -> bool {
        in_scope(&self.rule, parts) && !self.rule.exempt.iter().any(|f| f(parts))
    }

    /// The cost the rule sets for a request (its function's, else its fixed cost); `None`:
    /// the limit's default cost. A rule that settles charges at least 1 up front: an estimate
    /// of 0 (a client's `max_tokens=0`) would pass an empty bucket, and the true cost found
    /// later could only be forgiven there.
    fn cost(&self, parts: &Parts) -> Option<u64> {
        let cost = match &self.rule.cost_fn {
            Some(f) => Some(f(parts)),
            None => self.rule.cost,
        };
        match cost {
            Some(0) if self.rule.settle.is_some() => Some(1),
            cost => cost,
        }
    }
}

impl ResolvedRule {
    /// Whether `limit` is the rule's default limit, whose `RateLimit-Policy` member was
    /// computed when the layer was built.
    #[inline(always)]
    fn is_default(&self, limit: &crate::quota::Quota) -> bool {
        self.policy
            .as_ref()
            .is_some_and(|(default, _)| default == limit)
    }

    /// The precomputed `RateLimit-Policy` of `limit`, when it is the rule's default.
    #[inline]
    fn cached_policy(&self, limit: &crate::quota::Quota) -> Option<&http::HeaderValue> {
        self.is_default(limit)
            .then(|| self.policy.as_ref().map(|(_, v)| v))
            .flatten()
    }

    /// Counts and traces one of its decided transactions, of a batch allowed or not.
    #[inline]
    fn observe(&self, d: &Seen<'_>, batch_allowed: bool, rules: &Rules) {
        let outcome = RuleOutcome::of(d, self.shadow, batch_allowed);
        self.metrics.count_seen(d, outcome);
        self.metrics
            .count_near_limit(d, outcome, rules.near_limit_percent);
        super::observe::trace_decision(d, outcome, rules.log_ids, &rules.shadow_gate);
    }
}

/// A request's transactions, one per rule that applies: on the stack for up to four rules (the
/// limiter's batches hold four too; at two, three rules spilled to the heap: +254 instructions).
pub(crate) type Txs = smallvec::SmallVec<[Transaction; 4]>;

/// A layer's rules, resolved when it was built, with what the rest of the layer asks of them.
pub(crate) struct Rules {
    pub(crate) list: Vec<ResolvedRule>,
    /// The per-message rules (`Rule::per`): their keys go to the handler, undecided.
    #[cfg(feature = "stream")]
    pub(crate) streams: Vec<ResolvedRule>,
    /// The client address readers the rules share.
    pub(crate) readers: Readers,
    /// Some rule settles its cost from the response ([`Rule::settle`]).
    pub(crate) settles: bool,
    /// Some rule's outcome reads the request's latency (`CountWhen::latency_above`): an
    /// allowed request notes when it was let through.
    pub(crate) times: bool,
    /// Some rule waits instead of rejecting ([`Rule::wait`]).
    pub(crate) waits: bool,
    /// The `RateLimit-Policy` values when every rule reports its precomputed member, one per
    /// rule reported strictest ([`joined_policies`](super::response::joined_policies)).
    pub(crate) joined_policy: Box<[http::HeaderValue]>,
    /// Decision events carry the id.
    pub(crate) log_ids: bool,
    /// Lets one shadow "would deny" line through per interval.
    pub(crate) shadow_gate: super::observe::WarnGate,
    /// An allowed decision leaving at most `100 - this` % of its limit is near it.
    pub(crate) near_limit_percent: u8,
    /// What a replay reads of each decision.
    #[cfg(feature = "replay")]
    pub(crate) journal: std::sync::Arc<super::observe::Journal>,
}

impl Rules {
    /// The rule of a limit.
    fn of(&self, name: LimitName) -> Option<&ResolvedRule> {
        self.list.iter().find(|r| r.name == name)
    }

    /// The precomputed `RateLimit-Policy` of a limit's quota, when it is its default.
    pub(crate) fn cached_policy(
        &self,
        name: LimitName,
        limit: &crate::quota::Quota,
    ) -> Option<&http::HeaderValue> {
        self.of(name)?.cached_policy(limit)
    }

    /// Whether anything reads what a decision was: the metrics (feature `metrics`), a replay's
    /// journal, or a `tracing` subscriber at `info` or finer (a shadowed rule's "would deny"
    /// line is at `info`). When nothing does, a request's decisions are not looked at again.
    #[inline(always)]
    pub(crate) fn observed(&self) -> bool {
        #[cfg(feature = "replay")]
        if self.journal.on() {
            return true;
        }
        cfg!(feature = "metrics") || tracing::level_enabled!(tracing::Level::INFO)
    }

    /// Counts and traces every decided transaction of a request whose batch was allowed or
    /// not (`batch_allowed`), when anything reads them ([`Rules::observed`]).
    #[inline]
    pub(crate) fn observe<'a>(
        &self,
        decided: impl IntoIterator<Item = Seen<'a>>,
        batch_allowed: bool,
    ) {
        if !self.observed() {
            return;
        }
        for d in decided {
            if let Some(rule) = self.of(d.name) {
                rule.observe(&d, batch_allowed, self);
            }
        }
    }

    /// Counts and traces one decided transaction of an allowed batch (when `observed`: see
    /// [`Rules::observed`]) and gives it with its precomputed `RateLimit-Policy` member (as
    /// [`Rules::cached_policy`]): the rule found once for both.
    #[inline]
    pub(crate) fn observe_reported<'a>(
        &self,
        d: Seen<'a>,
        observed: bool,
    ) -> (Seen<'a>, Option<&http::HeaderValue>) {
        let Some(rule) = self.of(d.name) else {
            return (d, None);
        };
        if observed {
            rule.observe(&d, true, self);
        }
        let cached = d.quota.and_then(|q| rule.cached_policy(q));
        (d, cached)
    }

    /// Counts every rule of a request that did not get a decision of its own.
    pub(crate) fn count(&self, txs: &[Transaction], outcome: RuleOutcome) {
        for tx in txs {
            if let Some(rule) = self.of(tx.key().name()) {
                rule.metrics.count(outcome);
            }
        }
    }

    /// Counts a rule's outcome.
    pub(crate) fn count_one(&self, name: LimitName, outcome: RuleOutcome) {
        if let Some(rule) = self.of(name) {
            rule.metrics.count(outcome);
        }
    }

    /// The buckets of an allowed batch whose rules settle from the head (`on_body == false`)
    /// or from the body: allowed, evaluated, spending, enabled decisions only (a shadowed rule
    /// that would deny spent nothing and settles nothing).
    pub(crate) fn reservations(&self, batch: &BatchDecision, on_body: bool) -> Reservations {
        let mut out = Reservations::new();
        for d in batch.decisions() {
            // A slot in flight is given back when the request ends, never settled.
            let Some(most) = d.limit.as_ref().and_then(|q| q.settle_bound()) else {
                continue;
            };
            if !d.allowed || d.skipped || !d.mode.spends() {
                continue;
            }
            let Some(settle) = self.of(d.name).and_then(|r| r.rule.settle.as_ref()) else {
                continue;
            };
            if settle.on_body() == on_body {
                let reserved = Reserved::new(settle.clone(), d.key.clone(), d.granted, most);
                out.push(reserved.on_penalty(d.reservation()));
            }
        }
        out
    }

    /// Whether a denied `batch` waits, and how long: every counting rule that denied has a
    /// [`Wait`](super::Wait), the batch's `retry_after` (its strictest denial's, the longest)
    /// is above zero and within what is left of each such rule's bound (`since`: the request's
    /// first denial), and the strictest rule has room for one more waiting request. The place
    /// is taken (or kept: `held`, from an earlier wait of the same request) and returned with
    /// the wait. The one home of the waiting rule in the layer.
    pub(crate) fn wait_for(
        &self,
        batch: &BatchDecision,
        since: Option<tokio::time::Instant>,
        held: Option<WaitPermit>,
    ) -> Option<(Duration, WaitPermit)> {
        let strictest = batch.strictest()?;
        let delay = strictest.retry_after;
        // Sleeping needs tokio's timer; with no runtime the request is refused as before.
        if strictest.allowed || delay.is_zero() || tokio::runtime::Handle::try_current().is_err() {
            return None;
        }
        let waited = since.map_or(Duration::ZERO, |s| s.elapsed());
        let mut rule_of_strictest = None;
        // What is left of the tightest bound among the denying rules.
        let mut room = Duration::MAX;
        for d in batch.decisions() {
            if d.allowed || !d.counts() {
                continue;
            }
            // A slot frees when a request ends, which no wait can know: never waited for.
            if d.limit.as_ref().is_some_and(|l| !l.waits()) {
                return None;
            }
            let rule = self.of(d.name)?;
            let wait = rule.rule.wait?;
            if !crate::limiter::may_wait(waited, delay, wait.up_to) {
                crate::telemetry::wait_refused(d.name, "too_long");
                return None;
            }
            room = room.min(wait.up_to.saturating_sub(waited));
            if std::ptr::eq(d, strictest) {
                rule_of_strictest = Some((rule, wait));
            }
        }
        let (rule, wait) = rule_of_strictest?;
        // How long the strictest denial's units take to come back (a GCRA limit says).
        let interval = strictest.limit.as_ref().map_or(Duration::ZERO, |l| {
            Duration::from_micros(l.units_return_us(
                crate::time::duration_us(strictest.retry_after),
                crate::time::duration_us(strictest.reset_after),
            ))
        });
        let join = Join {
            delay,
            interval,
            room,
        };
        match rule.waiting.join(&wait, &strictest.key, join, held) {
            Ok((sleep, permit)) => {
                crate::telemetry::waited(strictest.name);
                Some((sleep, permit))
            }
            Err(refused) => {
                crate::telemetry::wait_refused(strictest.name, refused.outcome());
                None
            }
        }
    }
}

impl Rules {
    /// The rules' transactions for a request, under `limits` (the snapshot the request is
    /// decided under: a rule's id kind comes from it), pushed into `txs` (the caller's, so
    /// nothing is moved). `Some`: the request is answered now with this response, written as
    /// `body` says.
    #[inline]
    pub(crate) fn prepare(
        &self,
        limits: &Limits,
        parts: &Parts,
        body: ErrorBody,
        txs: &mut Txs,
    ) -> Option<Response<Bytes>> {
        self.keys_of(&self.list, limits, parts, body, |r, key| {
            let tx = Transaction::of(key, r.mode, r.cost(parts));
            // A rule that settles after the response reserves on its limit's penalty, if any.
            txs.push(match r.rule.settle {
                Some(_) => tx.with_penalty(PenaltyPart::Reserve),
                None => tx,
            });
        })
    }

    /// The keys of the per-message rules that apply to a request (`Rule::per`), found as a
    /// request's are, for its handler's stream meter: `Ok(None)` when none applies, `Err`
    /// when the request is answered now (a missing or bad key).
    #[cfg(feature = "stream")]
    #[cold]
    pub(crate) fn stream_keys(
        &self,
        limiter: &crate::limiter::Limiter,
        limits: &Limits,
        parts: &Parts,
        body: ErrorBody,
    ) -> Result<Option<super::stream_keys::StreamKeys>, Box<Response<Bytes>>> {
        let mut keys = super::stream_keys::StreamKeys::new(limiter);
        let mut unpriced = None;
        let found = |r: &ResolvedRule, key| {
            let price = match r.rule.price.as_ref().map(|p| p.price(parts)) {
                None => super::stream_keys::KeyPrice::Unpriced,
                Some(Ok(Some(price))) => price,
                Some(Ok(None)) => match r.rule.on_missing {
                    OnMissingKey::Skip => return,
                    OnMissingKey::Reject(status) => {
                        let why = format!("missing model for rate limit {}", r.rule.name);
                        unpriced.get_or_insert((status, why));
                        return;
                    }
                },
                Some(Err(why)) => {
                    unpriced.get_or_insert((StatusCode::BAD_REQUEST, why));
                    return;
                }
            };
            keys.push(key, r.rule.per, price, r.rule.at_limit);
        };
        if let Some(response) = self.keys_of(&self.streams, limits, parts, body, found) {
            return Err(Box::new(response));
        }
        if let Some((status, why)) = unpriced {
            super::observe::count_request("rejected");
            let grpc = response::is_grpc(&parts.headers);
            let code = response::error_code(status);
            return Err(Box::new(response::error_response(
                status, &code, &why, grpc, body,
            )));
        }
        Ok((!keys.is_empty()).then_some(keys))
    }

    /// Finds the key of each rule of `list` that applies to a request (in its scope, not
    /// exempted, its id found, or missing and the rule refusing), handed to `found` with its
    /// rule. `Some`: the request is answered now (a missing id the rule refuses, an id its
    /// kind refuses). The client addresses and header the rules read are read once.
    #[inline(always)]
    fn keys_of(
        &self,
        list: &[ResolvedRule],
        limits: &Limits,
        parts: &Parts,
        body: ErrorBody,
        mut found: impl FnMut(&ResolvedRule, BucketKey),
    ) -> Option<Response<Bytes>> {
        let (mut read, mut read_header): (Read, ReadHeader<'_>) = Default::default();
        for r in list {
            if !r.applies(parts) {
                continue;
            }
            let reject = |status: StatusCode, message: &str| {
                r.metrics.count(RuleOutcome::Rejected);
                super::observe::count_request("rejected");
                tracing::debug!(target: crate::telemetry::target::DECISION, limit = r.name.as_str(), outcome = "rejected", status = status.as_u16(), reason = message, "rate limit rejected the request");
                Some(response::error_response(
                    status,
                    &response::error_code(status),
                    message,
                    response::is_grpc(&parts.headers),
                    body,
                ))
            };
            let extracted = match r.source {
                Source::Header => self.readers.header(parts, &mut read_header),
                _ => self
                    .readers
                    .extract(r.source, &*r.rule.extractor, parts, &mut read),
            };
            let id = match extracted {
                Ok(Some(id)) => id,
                Ok(None) => match r.rule.on_missing {
                    OnMissingKey::Skip => continue,
                    OnMissingKey::Reject(status) => {
                        return reject(
                            status,
                            &format!("missing key for rate limit {}", r.rule.name),
                        );
                    }
                },
                Err(e) => {
                    if e.status.is_server_error() {
                        tracing::error!(target: crate::telemetry::target::LAYER, limit = %r.rule.name, error = %e, "rate limit key extraction failed");
                    }
                    return reject(e.status, &e.message);
                }
            };
            let kind = limits.id_kind(r.name).unwrap_or_default();
            let id = match kind.conform(id) {
                Ok(id) => id,
                Err(e) => {
                    return reject(
                        StatusCode::BAD_REQUEST,
                        &format!("rate limit {}: {e}", r.rule.name),
                    );
                }
            };
            found(r, BucketKey::new(r.name, id));
        }
        None
    }
}

/// Whether `rule`'s scopes all hold for a request head (exemptions aside). Reached by the
/// tests through `crate::__private`.
pub fn in_scope(rule: &Rule, parts: &http::request::Parts) -> bool {
    rule.scope.iter().all(|f| f(parts))
}
