//! The tower middleware: [`RateLimitLayer`] and [`RateLimitService`].
//!
//! A layer holds one or more [`Rule`]s; a rule is a limit name, a [`KeyExtractor`] and a
//! cost. For each request every rule's key is extracted and all of them are decided in one
//! batch: one backend call per request. A denied request gets a 429 (or a gRPC
//! `RESOURCE_EXHAUSTED`); an allowed one goes to the inner service, and its response carries
//! the `RateLimit` fields of the strictest rule (configurable).
//!
//! ```no_run
//! use axum::{Router, routing::get};
//! use tower_ratelimits::{Limiter, Limits, MemoryBackend};
//! use tower_ratelimits::{ClientIp, Ipv6Range48, RateLimitLayer, Rule};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = Limits::from_yaml_str(
//!     "RequestsPerIPAddress: {kind: ip, burst: 20, count: 20, period: 1s}\n\
//!      RequestsPerIPv6Range: {kind: ipv6_range, burst: 100, count: 100, period: 1s}\n",
//!     None,
//! )?;
//! let limiter = Limiter::new(limits, MemoryBackend::new());
//! let layer = RateLimitLayer::builder(limiter)
//!     .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
//!     .rule(Rule::new("RequestsPerIPv6Range", Ipv6Range48::new(ClientIp::new())))
//!     .build()?;
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>()).await?;
//! # Ok(()) }
//! ```

mod body;
mod extract;
mod future;
mod response;

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

pub use body::RateLimitBody;
pub use extract::{ClientIp, ForwardedHeader, Header, Ipv6Range48, KeyError, KeyExtractor, key_fn};
pub use future::ResponseFuture;
pub use response::Denial;

use crate::backend::Mode;
use crate::key::{BucketKey, IdKind, LimitName};
use crate::limiter::Limiter;
use crate::limiter::Transaction;

/// What to do when a rule's extractor finds no id (e.g. no account header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// What to do when the backend fails or does not answer within the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Let the request through and log a warning (the default: a rate limiter outage should not
    /// become a service outage).
    #[default]
    FailOpen,
    /// Answer `503 Service Unavailable` with a JSON body.
    FailClosed,
}

type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;
type DenialFn = Arc<dyn Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync>;

/// One limit applied to requests: a limit name, how to find the id, and what a request costs.
///
/// ```
/// use tower_ratelimits::{Header, OnMissingKey, Rule};
/// use tower_ratelimits::Mode;
/// let rule = Rule::new("ApiCallsPerAccount", Header::new("x-account-id"))
///     .cost_fn(|req| if req.method == http::Method::POST { 5 } else { 1 })
///     .on_missing_key(OnMissingKey::Skip);
/// ```
#[derive(Clone)]
pub struct Rule {
    name: String,
    extractor: Arc<dyn KeyExtractor>,
    cost: Option<u64>,
    cost_fn: Option<CostFn>,
    mode: Mode,
    on_missing: OnMissingKey,
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("cost", &self.cost)
            .field("mode", &self.mode)
            .field("on_missing", &self.on_missing)
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
            on_missing: OnMissingKey::default(),
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

    /// What to do when the extractor finds no id.
    pub fn on_missing_key(mut self, policy: OnMissingKey) -> Self {
        self.on_missing = policy;
        self
    }
}

/// Why a layer could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayerError {
    /// A rule names a limit the configuration does not define.
    #[error("rule for unknown limit {0:?}")]
    UnknownLimit(String),
    /// Two rules name the same limit.
    #[error("two rules for limit {0:?}")]
    DuplicateRule(String),
    /// No rules.
    #[error("a rate limit layer needs at least one rule")]
    NoRules,
}

pub(crate) struct ResolvedRule {
    pub(crate) name: LimitName,
    pub(crate) kind: IdKind,
    pub(crate) rule: Rule,
    /// The default limit and its `RateLimit-Policy` value, computed once.
    pub(crate) policy: Option<(crate::algo::gcra::Limit, http::HeaderValue)>,
}

impl Shared {
    /// The precomputed `RateLimit-Policy` of a decision's limit, when it is its default.
    pub(crate) fn cached_policy(&self, d: &crate::limiter::Decision) -> Option<http::HeaderValue> {
        let rule = self.rules.iter().find(|r| r.name == d.key.name())?;
        match (&rule.policy, &d.limit) {
            (Some((l, v)), Some(crate::quota::Quota::Gcra(dl))) if l == dl => Some(v.clone()),
            _ => None,
        }
    }
}

pub(crate) struct Shared {
    pub(crate) limiter: Limiter,
    pub(crate) rules: Vec<ResolvedRule>,
    pub(crate) timeout: Duration,
    pub(crate) failure: FailurePolicy,
    pub(crate) headers_on_allowed: bool,
    pub(crate) legacy_headers: bool,
    pub(crate) on_denied: Option<DenialFn>,
}

/// Builds a [`RateLimitLayer`].
pub struct RateLimitLayerBuilder {
    limiter: Limiter,
    rules: Vec<Rule>,
    timeout: Duration,
    failure: FailurePolicy,
    headers_on_allowed: bool,
    legacy_headers: bool,
    on_denied: Option<DenialFn>,
}

impl RateLimitLayerBuilder {
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

    /// What to do when the backend fails or times out (default [`FailurePolicy::FailOpen`]).
    pub fn on_backend_failure(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// Whether allowed responses carry `RateLimit` and `RateLimit-Policy` (default on).
    pub fn ratelimit_headers_on_allowed(mut self, on: bool) -> Self {
        self.headers_on_allowed = on;
        self
    }

    /// Whether responses also carry the legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining`
    /// and `X-RateLimit-Reset` (default off).
    pub fn legacy_headers(mut self, on: bool) -> Self {
        self.legacy_headers = on;
        self
    }

    /// Replaces the denial response (status, headers and body). [`Denial::default_response`]
    /// and its parts stay available to build on.
    pub fn denied_response(
        mut self,
        f: impl Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.on_denied = Some(Arc::new(f));
        self
    }

    /// Resolves the rules' limit names and builds the layer.
    pub fn build(self) -> Result<RateLimitLayer, LayerError> {
        if self.rules.is_empty() {
            return Err(LayerError::NoRules);
        }
        let limits = self.limiter.limits();
        let mut rules: Vec<ResolvedRule> = Vec::with_capacity(self.rules.len());
        for rule in self.rules {
            let name = limits
                .name(&rule.name)
                .ok_or_else(|| LayerError::UnknownLimit(rule.name.clone()))?;
            if rules.iter().any(|r| r.name == name) {
                return Err(LayerError::DuplicateRule(rule.name));
            }
            let kind = limits.id_kind(name).unwrap_or_default();
            let policy = limits
                .default_limit(name)
                .and_then(|q| q.as_gcra().copied())
                .map(|l| (l, response::policy_value(&rule.name, &l)));
            rules.push(ResolvedRule {
                name,
                kind,
                rule,
                policy,
            });
        }
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                limiter: self.limiter,
                rules,
                timeout: self.timeout,
                failure: self.failure,
                headers_on_allowed: self.headers_on_allowed,
                legacy_headers: self.legacy_headers,
                on_denied: self.on_denied,
            }),
        })
    }
}

/// A tower layer that rate-limits requests. Cheap to clone.
#[derive(Clone)]
pub struct RateLimitLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rules", &self.shared.rules.len())
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A builder.
    pub fn builder(limiter: Limiter) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            limiter,
            rules: Vec::new(),
            timeout: Duration::from_secs(1),
            failure: FailurePolicy::default(),
            headers_on_allowed: true,
            legacy_headers: false,
            on_denied: None,
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
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The rate-limiting service made by [`RateLimitLayer`].
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S: fmt::Debug> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// What the rules made of a request: a batch to decide, or an answer right away.
pub(crate) enum Prepared {
    Batch(Vec<Transaction>),
    Reject(Response<Bytes>),
}

impl Shared {
    pub(crate) fn prepare(&self, parts: &Parts, grpc: bool) -> Prepared {
        let mut txs = Vec::with_capacity(self.rules.len());
        for r in &self.rules {
            let reject = |status: StatusCode, message: &str| {
                Prepared::Reject(response::error_response(
                    status,
                    &response::error_code(status),
                    message,
                    grpc,
                ))
            };
            let id = match r.rule.extractor.extract(parts) {
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
                        tracing::error!(limit = %r.rule.name, error = %e, "rate limit key extraction failed");
                    }
                    return reject(e.status, &e.message);
                }
            };
            let id = match r.kind.conform(id) {
                Ok(id) => id,
                Err(e) => {
                    return reject(
                        StatusCode::BAD_REQUEST,
                        &format!("rate limit {}: {e}", r.rule.name),
                    );
                }
            };
            let mut tx = Transaction::new(BucketKey::new(r.name, id)).mode(r.rule.mode);
            if let Some(f) = &r.rule.cost_fn {
                tx = tx.cost(f(parts));
            } else if let Some(c) = r.rule.cost {
                tx = tx.cost(c);
            }
            txs.push(tx);
        }
        Prepared::Batch(txs)
    }
}

impl<S, B, ResBody> Service<Request<B>> for RateLimitService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    B: Send + 'static,
{
    type Response = Response<RateLimitBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Take the service that is ready; leave a clone for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(self.shared.clone(), inner, req)
    }
}
