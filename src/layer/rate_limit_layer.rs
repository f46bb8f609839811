//! The layer, its builder and its options: rules resolved once, when the layer is built.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use super::extract::{ClientIp, Exemptions};
use super::failure::{FailurePolicy, Fallback, OnFailure};
use super::observe::{RuleMetrics, WarnGate};
use super::outcome::Shared;
use super::response::{self, Answers, Denial, DenialFn, ErrorBody, FieldStyle};
use super::rule::{ResolvedRule, Rule, Rules};
use super::service::RateLimitService;
use super::settle::{SettleError, Settler};
use super::wait::Waiting;
use crate::config::Limits;
use crate::key::IdKind;
use crate::limiter::Limiter;
use crate::quota::Quota;
use ipnet::IpNet;

/// Why a layer could not be built.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayerError {
    /// A rule names a limit the configuration does not define (with the defined name it most
    /// likely meant: one that differs in case or by a few letters).
    #[error(
        "{}rule for unknown limit {name:?}{}",
        at.as_ref().map_or_else(String::new, |at| format!("{at}: ")),
        did_you_mean.map_or_else(String::new, |n| format!("; did you mean {n:?}?"))
    )]
    UnknownLimit {
        /// The name the rule gives.
        name: String,
        /// The defined name it most likely meant.
        did_you_mean: Option<&'static str>,
        /// Where a rules file defines the rule (`rules.yaml:3`); `None` for a rule built in
        /// code.
        at: Option<String>,
    },
    /// Two rules name the same limit.
    #[error("two rules for limit {0:?}")]
    DuplicateRule(String),
    /// No rules.
    #[error("a rate limit layer needs at least one rule")]
    NoRules,
    /// A rule's [`Settle`](crate::Settle) cannot be used: a bad header name, a unit of 0
    /// bytes, or a rule that spends nothing.
    #[error("rule for limit {limit:?}: settle: {reason}")]
    Settle {
        /// The rule's limit name.
        limit: String,
        /// What is wrong.
        reason: SettleError,
    },
    /// The in-memory fallback cannot be built (a percent outside 1..=100, or a limit that does
    /// not scale).
    #[error("in-memory fallback: {0}")]
    Fallback(String),
    /// The limits a shortcut such as [`RateLimitLayer::per_client_ip`] defines were refused
    /// (the message of the [`ConfigError`](crate::ConfigError)).
    #[error("limits: {0}")]
    Limits(String),
    /// [`RateLimitLayerBuilder::near_limit_percent`] outside `1..=100`.
    #[error("near-limit percent {0} is not in 1..=100")]
    NearLimitPercent(u8),
    /// A per-message rule ([`Rule::per`](crate::Rule::per), feature `stream`) that cannot
    /// count messages: it sets a cost, settles, counts outcomes or waits, it is shadowed (by itself or the
    /// layer) or in a mode other than check and spend, or its limit holds slots.
    #[error("rule for limit {limit:?}: per message: {reason}")]
    PerMessage {
        /// The rule's limit name.
        limit: String,
        /// What is wrong.
        reason: &'static str,
    },
}

readable_debug!(LayerError { UnknownLimit { name, did_you_mean, at }, DuplicateRule(name), NoRules, Settle { limit, reason }, Fallback(reason), Limits(reason), NearLimitPercent(percent), PerMessage { limit, reason } });

/// Builds a [`RateLimitLayer`].
pub struct RateLimitLayerBuilder {
    limiter: Limiter,
    rules: Vec<Rule>,
    timeout: Duration,
    failure: FailurePolicy,
    fields: FieldStyle,
    on_denied: Option<DenialFn>,
    shadow: bool,
    log_ids: bool,
    body: ErrorBody,
    exempt: Option<(ClientIp, Vec<IpNet>)>,
    jitter: Duration,
    near_limit_percent: u8,
    failed_when: super::lease::FailedWhen,
}

impl RateLimitLayerBuilder {
    /// Exempts clients whose address is in one of `nets` from every rule (internal health
    /// checkers, a partner's egress): their requests go straight to the inner service, with
    /// no `RateLimit` fields, and are counted as `exempt`. The address is the one `client`
    /// finds (so forwarding headers count only from its trusted proxies); a request whose
    /// address cannot be found is not exempt. Addresses are compared as IPv4 when they are
    /// IPv4-mapped, so a network written in mapped form (`::ffff:10.0.0.0/104`) is taken as
    /// the IPv4 network it maps (`10.0.0.0/8`).
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};
    /// # let limiter = Limiter::new(
    /// #     Limits::from_yaml_str("PerIp: {kind: ip, burst: 5, count: 5, period: 1s}\n", None).unwrap(),
    /// #     MemoryBackend::new());
    /// let layer = RateLimitLayer::builder(limiter)
    ///     .rule(Rule::new("PerIp", ClientIp::new()))
    ///     .exempt_addresses(ClientIp::new(), ["10.0.0.0/8".parse().unwrap()])
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn exempt_addresses(
        mut self,
        client: ClientIp,
        nets: impl IntoIterator<Item = IpNet>,
    ) -> Self {
        self.exempt = Some((
            client,
            nets.into_iter().map(super::extract::fold_net).collect(),
        ));
        self
    }

    /// How the middleware writes the bodies of its own answers (the 429, and the 400 and 503
    /// it writes): [`ErrorBody::Json`] (the default) or RFC 9457
    /// [`ErrorBody::ProblemJson`].
    pub fn error_body(mut self, body: ErrorBody) -> Self {
        self.body = body;
        self
    }

    /// Shadow (dry-run) mode for every rule of the layer (see [`Rule::shadow`]): requests are
    /// decided and counted, buckets evolve as if enforced, and no request is refused by a
    /// limit. Rejections (a missing or bad key) and failure policies still apply.
    pub fn shadow(mut self, on: bool) -> Self {
        self.shadow = on;
        self
    }

    /// Adds a random delay of up to `max` (uniform, drawn per denied request) to what a denied
    /// request is told and made to wait: `Retry-After`, the `RateLimit` field's `t`, the
    /// bodies' `retry_after_ms`, gRPC's `RetryInfo` and pushback, and a waiting rule's sleep.
    /// Clients refused together then come back spread out instead of all at once (the IETF
    /// draft's advice against synchronised retries). Never earlier than the exact time: a
    /// client that honours the hint is never refused again for coming back too early. Default
    /// 0 (off). A wait's jitter counts toward its rule's [`Wait`](crate::Wait) bound.
    ///
    /// `Retry-After` and the `RateLimit` field's `t` count whole seconds, rounded up, so a
    /// jitter below one second shows there only as one second more for some requests: HTTP
    /// clients that read those spread over whole seconds. The bodies' `retry_after_ms`, gRPC's
    /// `RetryInfo` and pushback (milliseconds) and a waiting rule's sleep carry it exactly. To
    /// spread clients that read `Retry-After`, give a jitter of a second or more.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimits::{Limiter, Limits, MemoryBackend, RateLimitLayer, Rule, ClientIp};
    /// # let limits = Limits::from_yaml_str("PerIp: {kind: ip, burst: 5, count: 5, period: 1s}", None).unwrap();
    /// let layer = RateLimitLayer::builder(Limiter::new(limits, MemoryBackend::new()))
    ///     .rule(Rule::new("PerIp", ClientIp::new()))
    ///     .jitter(Duration::from_secs(2))
    ///     .build();
    /// ```
    pub fn jitter(mut self, max: Duration) -> Self {
        self.jitter = max;
        self
    }

    /// When an allowed decision counts as near its limit, in
    /// `tower_ratelimits_near_limit_total{limit}` (feature `metrics`): when it leaves at most
    /// `100 - percent` % of the limit (the burst, a tier's limit, the slots). Default 80, as
    /// Envoy's rate-limit service; a percent of 0 or above 100 is refused by
    /// [`build`](Self::build).
    pub fn near_limit_percent(mut self, percent: u8) -> Self {
        self.near_limit_percent = percent;
        self
    }

    /// Whether decision events (`tracing`) carry the id (default off: ids can be personal data
    /// such as IP addresses). Metrics never carry ids.
    pub fn log_ids(mut self, on: bool) -> Self {
        self.log_ids = on;
        self
    }

    /// Adds a rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// How long to wait for the backend before applying the failure policy (default 1s). A
    /// backend that decides at once (the in-memory one) never starts the timer.
    pub fn backend_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Which responses count as failures for a limit that learns from its requests (an
    /// adaptive concurrency limit, whose AIMD backs off on them): by default a 5xx, or a gRPC
    /// `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or `DEADLINE_EXCEEDED` in the response's head or
    /// its trailers. The predicate is asked with the head's status and headers, and again with
    /// the head's status and the trailers when a body ends with them (a gRPC status after a
    /// streamed answer); either `true` makes the request a failure. An error of the inner service, a body that ends in an error, and a request that ends before
    /// its response's head (cancelled, timed out) always count as failures.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};
    /// # let limiter = Limiter::new(
    /// #     Limits::from_yaml_str("PerIp: {kind: ip, concurrency: {adaptive: {min: 1, max: 50}}}", None).unwrap(),
    /// #     MemoryBackend::new());
    /// // Only a 503 says the service is overloaded.
    /// let layer = RateLimitLayer::builder(limiter)
    ///     .rule(Rule::new("PerIp", ClientIp::new()))
    ///     .failed_when(|status, _headers| status == http::StatusCode::SERVICE_UNAVAILABLE)
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn failed_when(
        mut self,
        f: impl Fn(http::StatusCode, &http::HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.failed_when = Arc::new(f);
        self
    }

    /// What to do when the backend fails or times out (default [`FailurePolicy::FailOpen`]).
    /// A full in-memory table is not a failure: a request that needs a new bucket then gets
    /// `503` with `Retry-After: 1` under either policy.
    pub fn on_backend_failure(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// The rate-limit header fields responses carry (default [`FieldStyle::Ietf`]: the
    /// draft-11 `RateLimit` and `RateLimit-Policy` on every response).
    pub fn fields(mut self, style: FieldStyle) -> Self {
        self.fields = style;
        self
    }

    /// Replaces the denial response (status, headers and body). [`Denial::default_response`]
    /// and its parts stay available to build on, with what denied: the limit, its id, the
    /// wait.
    ///
    /// ```
    /// use tower_ratelimits::{ClientIp, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};
    /// # let limiter = Limiter::new(
    /// #     Limits::from_yaml_str("PerIp: {kind: ip, burst: 5, count: 5, period: 1s}\n", None).unwrap(),
    /// #     MemoryBackend::new());
    /// let layer = RateLimitLayer::builder(limiter)
    ///     .rule(Rule::new("PerIp", ClientIp::new()))
    ///     .denied_response(|d| {
    ///         let mut r = d.default_response();
    ///         let text = format!(
    ///             "{} refused {}: retry in {} ms",
    ///             d.limit_name().unwrap_or("a limit"),
    ///             d.id().map(ToString::to_string).unwrap_or_default(),
    ///             d.retry_after_ms()
    ///         );
    ///         *r.body_mut() = text.into();
    ///         r
    ///     })
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn denied_response(
        mut self,
        f: impl Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.on_denied = Some(Arc::new(f));
        self
    }

    /// Resolves the rules' limit names and builds the layer. The names are then in use: a
    /// [`Limiter::reload`] that removes one is refused. With the `metrics` feature, the rules'
    /// counters are registered here: install the metrics recorder first.
    pub fn build(self) -> Result<RateLimitLayer, LayerError> {
        if self.rules.is_empty() {
            return Err(LayerError::NoRules);
        }
        if !(1..=100).contains(&self.near_limit_percent) {
            return Err(LayerError::NearLimitPercent(self.near_limit_percent));
        }
        let limits = self.limiter.limits();
        #[cfg(feature = "replay")]
        let journal = std::sync::Arc::new(super::observe::Journal::default());
        let (rules, readers) = resolved_all(
            &self.limiter,
            &limits,
            self.rules,
            self.shadow,
            #[cfg(feature = "replay")]
            &journal,
        )?;
        #[cfg(feature = "stream")]
        let (rules, streams) = per_message(rules, &limits)?;
        let fallback = fallback_of(self.failure, &limits, &self.limiter, self.timeout)?;
        let policies: Vec<_> = rules
            .iter()
            .map(|r| r.policy.as_ref().map(|(_, v)| v))
            .collect();
        let settles = rules.iter().any(|r| r.rule.settle.is_some());
        let times = rules
            .iter()
            .any(|r| r.rule.settle.as_ref().is_some_and(|s| s.times()));
        let waits = rules.iter().any(|r| r.rule.wait.is_some());
        // One gate for the warnings of store failures, on requests and on settles alike.
        let warn_gate = Arc::new(WarnGate::new(Duration::from_secs(10)));
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                settler: Settler {
                    limiter: self.limiter.clone(),
                    timeout: self.timeout,
                    warn_gate: warn_gate.clone(),
                    #[cfg(feature = "replay")]
                    inline: Default::default(),
                },
                limiter: self.limiter,
                rules: Rules {
                    joined_policy: response::joined_policies(&policies),
                    list: rules,
                    #[cfg(feature = "stream")]
                    streams,
                    readers,
                    settles,
                    times,
                    waits,
                    log_ids: self.log_ids,
                    shadow_gate: WarnGate::new(Duration::from_secs(10)),
                    near_limit_percent: self.near_limit_percent,
                    #[cfg(feature = "replay")]
                    journal,
                },
                failure: OnFailure {
                    policy: self.failure,
                    fallback,
                    timeout: self.timeout,
                    warn_gate,
                },
                answers: Answers {
                    fields: self.fields,
                    body: self.body,
                    on_denied: self.on_denied,
                    jitter: self.jitter,
                    #[cfg(feature = "replay")]
                    quiet: Default::default(),
                },
                exempt: self
                    .exempt
                    .map(|(client, nets)| Exemptions { client, nets }),
                failed_when: self.failed_when,
            }),
        })
    }
}

/// Every rule resolved ([`resolved`]) and its limit's name pinned on `limiter` (a reload may
/// not remove it), with the client address readers they share.
fn resolved_all(
    limiter: &Limiter,
    limits: &Limits,
    list: Vec<Rule>,
    shadow_all: bool,
    #[cfg(feature = "replay")] journal: &std::sync::Arc<super::observe::Journal>,
) -> Result<(Vec<ResolvedRule>, super::extract::Readers), LayerError> {
    let mut rules: Vec<ResolvedRule> = Vec::with_capacity(list.len());
    for rule in list {
        let resolved = resolved(
            limits,
            rule,
            &rules,
            shadow_all,
            #[cfg(feature = "replay")]
            journal,
        )?;
        rules.push(resolved);
    }
    let readers = super::extract::Readers::shared(rules.iter().map(|r| &*r.rule.extractor));
    for r in &mut rules {
        r.source = readers.source(&*r.rule.extractor);
        #[cfg(feature = "stream")]
        let units = r.rule.per != super::stream_keys::Per::Request;
        #[cfg(not(feature = "stream"))]
        let units = false;
        limiter.pin(r.name, units);
    }
    Ok((rules, readers))
}

/// A rule with its limit's name resolved under `limits` and checked (a known limit, no rule
/// for it in `before`, a settle it can do), its policy precomputed, shadowed when the layer
/// or the rule is.
fn resolved(
    limits: &Limits,
    rule: Rule,
    before: &[ResolvedRule],
    shadow_all: bool,
    #[cfg(feature = "replay")] journal: &Arc<super::observe::Journal>,
) -> Result<ResolvedRule, LayerError> {
    let name = limits
        .name(&rule.name)
        .ok_or_else(|| LayerError::UnknownLimit {
            name: rule.name.clone(),
            did_you_mean: limits.nearest_name(&rule.name),
            at: rule.defined_at.as_deref().map(str::to_owned),
        })?;
    if before.iter().any(|r| r.name == name) {
        return Err(LayerError::DuplicateRule(rule.name));
    }
    if let Some(settle) = &rule.settle {
        let refused = |reason: SettleError| LayerError::Settle {
            limit: rule.name.clone(),
            reason,
        };
        settle.check().map_err(refused)?;
        if !rule.mode.spends() {
            return Err(refused(SettleError::SpendsNothing(rule.mode)));
        }
        if limits
            .default_limit(name)
            .is_some_and(|q| q.settle_bound().is_none())
        {
            return Err(refused(SettleError::Leases));
        }
    }
    let policy = limits.default_limit(name).and_then(|q| {
        let value = response::policy_value(&rule.name, q)?;
        Some((q.clone(), value))
    });
    let shadow = shadow_all || rule.shadow;
    let mode = if shadow {
        rule.mode.shadowed()
    } else {
        rule.mode
    };
    Ok(ResolvedRule {
        source: super::extract::Source::Own,
        name,
        metrics: RuleMetrics::new(
            name,
            #[cfg(feature = "replay")]
            journal,
        ),
        shadow,
        mode,
        rule,
        policy,
        waiting: Waiting::new(name),
    })
}

/// The rules split into those per request and those per message (`Rule::per`), each of the
/// latter checked: it neither settles (nor counts outcomes) nor waits, and its limit counts
/// units, not slots.
#[cfg(feature = "stream")]
fn per_message(
    rules: Vec<ResolvedRule>,
    limits: &Limits,
) -> Result<(Vec<ResolvedRule>, Vec<ResolvedRule>), LayerError> {
    let (streams, rules): (Vec<_>, Vec<_>) = rules
        .into_iter()
        .partition(|r| r.rule.per != super::stream_keys::Per::Request);
    for r in &streams {
        let refused = |reason| LayerError::PerMessage {
            limit: r.rule.name.clone(),
            reason,
        };
        if r.rule.settle.is_some() {
            return Err(refused(
                "a message's cost is known when it passes: nothing to settle or count after it",
            ));
        }
        if r.rule.wait.is_some() {
            return Err(refused("a stream waits by pushing back (`at_limit`)"));
        }
        if r.rule.cost.is_some() || r.rule.cost_fn.is_some() {
            return Err(refused(
                "a message costs one unit (`Per::Message`) or its units (`Per::Unit`), not a cost of the rule's",
            ));
        }
        if r.mode != crate::mode::Mode::CheckAndSpend {
            return Err(refused(
                "a stream's meter checks and spends: no other mode, no shadow (of the rule or the layer)",
            ));
        }
        if limits
            .default_limit(r.name)
            .is_some_and(|q| q.holds_leases())
        {
            return Err(refused(
                "its limit holds slots: a stream holds one through a rule per request",
            ));
        }
    }
    Ok((rules, streams))
}

/// The in-memory fallback a failure policy asks for (its limits scaled to `percent`), if any.
fn fallback_of(
    failure: FailurePolicy,
    limits: &Limits,
    limiter: &Limiter,
    timeout: Duration,
) -> Result<Option<Fallback>, LayerError> {
    let FailurePolicy::FallbackToMemory { percent } = failure else {
        return Ok(None);
    };
    if !(1..=100).contains(&percent) {
        return Err(LayerError::Fallback(format!(
            "percent {percent} is not between 1 and 100"
        )));
    }
    let scaled = limits
        .scaled(percent)
        .map_err(|e| LayerError::Fallback(e.to_string()))?;
    Ok(Some(Fallback::new(percent, scaled, limiter, timeout)))
}

/// A tower layer that rate-limits requests. Cheap to clone.
#[derive(Clone)]
pub struct RateLimitLayer {
    pub(super) shared: Arc<Shared>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rules", &self.shared.rules.list.len())
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// What a replay reads of each decision.
    #[cfg(feature = "replay")]
    pub(crate) fn journal(&self) -> &super::observe::Journal {
        &self.shared.rules.journal
    }

    /// Answers a denial with its status alone from now on (a replay, which reads the layer's
    /// notes and discards every response).
    #[cfg(feature = "replay")]
    pub(crate) fn answer_quietly(&self) {
        self.shared
            .answers
            .quiet
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Settles in each response's own future from now on (a replay).
    #[cfg(feature = "replay")]
    pub(crate) fn settle_inline(&self) {
        self.shared
            .settler
            .inline
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Where the layer's settling rules read a response's true cost.
    #[cfg(feature = "replay")]
    pub(crate) fn settle_sources(&self) -> Vec<super::settle::SettleFrom> {
        let mut out = Vec::new();
        for r in &self.shared.rules.list {
            if let Some(from) = r.rule.settle.as_ref().and_then(|s| s.replay_source())
                && !out.contains(&from)
            {
                out.push(from);
            }
        }
        out
    }

    /// The limits the layer's rules count per message (`Rule::per`): a replay of request logs
    /// does not decide them, and its plan says so.
    #[cfg(feature = "replay")]
    pub(crate) fn per_message_limits(&self) -> Vec<crate::key::LimitName> {
        #[cfg(feature = "stream")]
        return self.shared.rules.streams.iter().map(|r| r.name).collect();
        #[cfg(not(feature = "stream"))]
        Vec::new()
    }

    /// A builder.
    pub fn builder(limiter: Limiter) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            limiter,
            rules: Vec::new(),
            timeout: Duration::from_secs(1),
            failure: FailurePolicy::default(),
            fields: FieldStyle::default(),
            on_denied: None,
            shadow: false,
            log_ids: false,
            jitter: Duration::ZERO,
            near_limit_percent: 80,
            body: ErrorBody::default(),
            exempt: None,
            failed_when: Arc::new(super::lease::failed_by_default),
        }
    }

    /// A layer with `rules` and default settings.
    pub fn new(
        limiter: Limiter,
        rules: impl IntoIterator<Item = Rule>,
    ) -> Result<Self, LayerError> {
        rules
            .into_iter()
            .fold(Self::builder(limiter), RateLimitLayerBuilder::rule)
            .build()
    }

    /// One limit per client IP address, in memory, in one expression: the set-up for a single
    /// process that needs no configuration file. The limit is named
    /// [`PER_CLIENT_IP`](Self::PER_CLIENT_IP) (in the `RateLimit` fields, the metrics and the
    /// logs); the address is the peer's ([`ClientIp::new`]: forwarding headers are not
    /// believed), so serve with the peer address (axum:
    /// `into_make_service_with_connect_info::<SocketAddr>()`). For more rules, overrides,
    /// Redis or trusted proxies, use [`RateLimitLayer::builder`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{Router, body::Body, routing::get};
    /// use tower_ratelimits::{Limit, RateLimitLayer};
    /// use tower_service::Service;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// // Two requests at once per client, then one per second.
    /// let layer = RateLimitLayer::per_client_ip(Limit::new(2, 1, Duration::from_secs(1))?)?;
    /// let mut app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
    /// for expected in [200, 200, 429] {
    ///     let mut request = http::Request::new(Body::empty());
    ///     // What axum's connect info provides when serving; set here by hand.
    ///     request.extensions_mut().insert(std::net::SocketAddr::from(([192, 0, 2, 7], 50_000)));
    ///     assert_eq!(app.call(request).await?.status(), expected);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn per_client_ip(limit: impl Into<Quota>) -> Result<Self, LayerError> {
        let limits = Limits::builder()
            .limit_for(Self::PER_CLIENT_IP, IdKind::Ip, limit)
            .build()
            .map_err(|e| LayerError::Limits(e.to_string()))?;
        Self::new(
            Limiter::in_memory(limits),
            [Rule::new(Self::PER_CLIENT_IP, ClientIp::new())],
        )
    }

    /// The name of [`per_client_ip`](Self::per_client_ip)'s limit.
    pub const PER_CLIENT_IP: &'static str = "RequestsPerClientIP";
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService::new(inner, self.shared.clone())
    }
}
