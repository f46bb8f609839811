//! The layer, its builder and its options: rules resolved once, when the layer is built.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tower_layer::Layer;

use super::extract::ClientIp;
use super::observe::{RuleMetrics, WarnGate};
use super::response::{self, Denial, ErrorBody, FieldStyle};
use super::rule::{ResolvedRule, Rule};
use super::service::RateLimitService;
use crate::limiter::Limiter;
use ipnet::IpNet;

/// What to do when the backend fails or does not answer within the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Let the request through and log a warning (the default: a rate limiter outage should not
    /// become a service outage).
    #[default]
    FailOpen,
    /// Answer `503 Service Unavailable` with a JSON body.
    FailClosed,
    /// Decide with an in-memory limiter of this instance, at `percent` (1 to 100) of every
    /// limit's rate and burst: an outage neither opens the gates nor closes the shop. With N
    /// instances, `100 / N` keeps the whole fleet near the configured limits. Buckets start
    /// full when the fallback begins, and what it spends is not carried back to the store.
    FallbackToMemory {
        /// The share of each limit every instance grants on its own, from 1 to 100.
        percent: u8,
    },
}

type DenialFn = Arc<dyn Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync>;

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
    /// A rule's [`Settle`](crate::Settle) cannot be used: a bad header name, a unit of 0
    /// bytes, or a rule that spends nothing.
    #[error("rule for limit {limit:?}: settle: {reason}")]
    Settle {
        /// The rule's limit name.
        limit: String,
        /// What is wrong.
        reason: String,
    },
    /// The in-memory fallback cannot be built (a percent outside 1..=100, or a limit that does
    /// not scale).
    #[error("in-memory fallback: {0}")]
    Fallback(String),
}

/// The in-memory limiter of `FailurePolicy::FallbackToMemory`: the main limiter's limits at
/// `percent`, scaled again after each reload.
pub(crate) struct Fallback {
    percent: u8,
    limiter: Limiter,
    /// The main limiter's generation the scaled limits were made from.
    generation: AtomicU64,
}

impl Fallback {
    /// The fallback limiter, following a reload of `main` first if there was one.
    pub(crate) fn limiter(&self, main: &Limiter) -> &Limiter {
        let current = main.generation();
        if self.generation.load(Ordering::Acquire) != current {
            self.generation.store(current, Ordering::Release);
            match main.limits().scaled(self.percent) {
                Ok(scaled) => {
                    if let Err(e) = self.limiter.reload(scaled) {
                        tracing::warn!(error = %e, "in-memory fallback keeps its previous limits");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reloaded limits do not scale; the in-memory fallback keeps its previous limits");
                }
            }
        }
        &self.limiter
    }
}

pub(crate) struct Shared {
    pub(crate) limiter: Limiter,
    pub(crate) fallback: Option<Fallback>,
    pub(crate) rules: Vec<ResolvedRule>,
    pub(crate) log_ids: bool,
    /// Backend failure warnings: one per 10 s at most.
    pub(crate) warn_gate: WarnGate,
    pub(crate) timeout: Duration,
    pub(crate) failure: FailurePolicy,
    pub(crate) fields: FieldStyle,
    pub(crate) body: ErrorBody,
    pub(crate) on_denied: Option<DenialFn>,
    /// Some rule settles its cost from the response ([`Rule::settle`]).
    pub(crate) settles: bool,
    /// Some rule waits instead of rejecting ([`Rule::wait`]).
    pub(crate) waits: bool,
    /// Clients whose address (found by the `ClientIp`) is in one of these bypass every rule.
    pub(crate) exempt: Option<(ClientIp, Vec<IpNet>)>,
}

impl Shared {
    /// Whether the request comes from an exempt address.
    pub(crate) fn exempt(&self, parts: &http::request::Parts) -> bool {
        let Some((client, nets)) = &self.exempt else {
            return false;
        };
        client
            .client_ip(parts)
            .is_ok_and(|ip| nets.iter().any(|n| n.contains(&ip)))
    }
}

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
}

impl RateLimitLayerBuilder {
    /// Exempts clients whose address is in one of `nets` from every rule (internal health
    /// checkers, a partner's egress): their requests go straight to the inner service, with
    /// no `RateLimit` fields, and are counted as `exempt`. The address is the one `client`
    /// finds (so forwarding headers count only from its trusted proxies); a request whose
    /// address cannot be found is not exempt.
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
        self.exempt = Some((client, nets.into_iter().collect()));
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
    /// and its parts stay available to build on.
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
        let limits = self.limiter.limits();
        let mut rules: Vec<ResolvedRule> = Vec::with_capacity(self.rules.len());
        for rule in self.rules {
            let name = limits
                .name(&rule.name)
                .ok_or_else(|| LayerError::UnknownLimit(rule.name.clone()))?;
            if rules.iter().any(|r| r.name == name) {
                return Err(LayerError::DuplicateRule(rule.name));
            }
            if let Some(settle) = &rule.settle {
                let refused = |reason: String| LayerError::Settle {
                    limit: rule.name.clone(),
                    reason,
                };
                settle.check().map_err(refused)?;
                if !rule.mode.spends() {
                    return Err(refused(format!(
                        "a {:?} rule spends nothing to settle",
                        rule.mode
                    )));
                }
            }
            let policy = limits
                .default_limit(name)
                .and_then(|q| q.as_gcra().copied())
                .map(|l| (l, response::policy_value(&rule.name, &l)));
            let shadow = self.shadow || rule.shadow;
            let mode = if shadow {
                rule.mode.shadowed()
            } else {
                rule.mode
            };
            rules.push(ResolvedRule {
                name,
                metrics: RuleMetrics::new(name),
                shadow,
                mode,
                rule,
                policy,
                waiting: Default::default(),
            });
        }
        for r in &rules {
            self.limiter.pin(r.name);
        }
        let fallback = match self.failure {
            FailurePolicy::FallbackToMemory { percent } => {
                if !(1..=100).contains(&percent) {
                    return Err(LayerError::Fallback(format!(
                        "percent {percent} is not between 1 and 100"
                    )));
                }
                let scaled = limits
                    .scaled(percent)
                    .map_err(|e| LayerError::Fallback(e.to_string()))?;
                Some(Fallback {
                    percent,
                    limiter: Limiter::new(scaled, crate::backend::MemoryBackend::new()),
                    generation: AtomicU64::new(self.limiter.generation()),
                })
            }
            _ => None,
        };
        let settles = rules.iter().any(|r| r.rule.settle.is_some());
        let waits = rules.iter().any(|r| r.rule.wait.is_some());
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                settles,
                waits,
                fallback,
                limiter: self.limiter,
                rules,
                log_ids: self.log_ids,
                warn_gate: WarnGate::new(Duration::from_secs(10)),
                timeout: self.timeout,
                failure: self.failure,
                fields: self.fields,
                body: self.body,
                exempt: self.exempt,
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
            fields: FieldStyle::default(),
            on_denied: None,
            shadow: false,
            log_ids: false,
            body: ErrorBody::default(),
            exempt: None,
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
        RateLimitService::new(inner, self.shared.clone())
    }
}
