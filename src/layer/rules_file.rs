//! A layer built from a rules file ([`RuleSet`], read in `config/yaml/rules.rs`).

use super::count_when::CountWhen;
use super::extract::{ClientIp, Header, Ipv6Range48};
use super::rate_limit_layer::{LayerError, RateLimitLayer, RateLimitLayerBuilder};
use super::rule::OnMissingKey;
use super::rule::Rule;
#[cfg(feature = "stream")]
use crate::config::{RuleAtLimit, RulePer};
use crate::config::{RuleCost, RuleKey, RuleMissing, RuleOutcome, RuleSet};
use crate::limiter::Limiter;

/// The [`CountWhen`] of a rule's `count_when` cases.
fn count_when_of(cases: &[(RuleOutcome, u64)]) -> CountWhen {
    cases
        .iter()
        .fold(CountWhen::new(), |cw, (outcome, weight)| match outcome {
            RuleOutcome::Status(low, high) => cw.status_range(*low..=*high, *weight),
            RuleOutcome::Header(name, None) => cw.header_named(name.clone(), *weight),
            RuleOutcome::Header(name, Some(value)) => {
                cw.header_value(name.clone(), value.clone(), *weight)
            }
            RuleOutcome::GrpcStatus(code) => cw.grpc_status(*code, *weight),
            RuleOutcome::LatencyAbove(bound) => cw.latency_above(*bound, *weight),
        })
}

/// A rule counting what a rules file's `per` and `at_limit` say (a rule per request, or the
/// messages or units of its streams).
#[cfg(feature = "stream")]
fn per_of(rule: Rule, per: RulePer, at_limit: Option<RuleAtLimit>) -> Rule {
    use super::stream_keys::{AtLimit, Per};
    let rule = rule.per(match per {
        RulePer::Request => Per::Request,
        RulePer::Message => Per::Message,
        RulePer::Unit => Per::Unit,
    });
    match at_limit {
        None => rule,
        Some(RuleAtLimit::End) => rule.at_limit(AtLimit::End),
        Some(RuleAtLimit::PushBack(up_to)) => rule.at_limit(AtLimit::PushBack { up_to }),
    }
}

/// A rule charging what a rules file's `price` says, at the file's `prices`.
#[cfg(feature = "stream")]
fn priced(
    rule: Rule,
    price: &crate::config::RulePrice,
    table: &std::sync::Arc<crate::config::PriceTable>,
) -> Rule {
    use super::stream_keys::ModelFrom;
    use crate::config::{PriceOf, RuleModel, RulePriceOf};
    let of = match price.of {
        RulePriceOf::Input => PriceOf::Input,
        RulePriceOf::CachedInput => PriceOf::CachedInput,
        RulePriceOf::Output => PriceOf::Output,
    };
    let model = match &price.model {
        RuleModel::Header(name) => ModelFrom::Header(name.clone()),
        RuleModel::Body(field) => ModelFrom::BodyField(field.clone()),
    };
    rule.priced(table.clone(), model, of)
}

/// A request's cost as a log recorded it: what a rule with `cost: logged` in a [`RuleSet`]
/// charges (1 when a request has none). The replay (`Replay`, feature `replay`) sets it from
/// each log line's `cost`; a server may set it too (an extension inserted before the layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoggedCost(pub u64);

impl RuleSet {
    /// A layer builder holding these rules, their trusted proxies and their exemptions, on
    /// `limiter`: add settings (fields, failure policy, ...) and build.
    pub fn builder(&self, limiter: Limiter) -> RateLimitLayerBuilder {
        let client = ClientIp::new().trusted_proxies(self.trusted_proxies.iter().copied());
        let mut builder = RateLimitLayer::builder(limiter);
        if !self.exempt.is_empty() {
            builder = builder.exempt_addresses(client.clone(), self.exempt.iter().copied());
        }
        for entry in &self.rules {
            let rule = match &entry.key {
                RuleKey::ClientIp => Rule::new(entry.limit.as_str(), client.clone()),
                RuleKey::Ipv6Range => {
                    Rule::new(entry.limit.as_str(), Ipv6Range48::new(client.clone()))
                }
                RuleKey::Header(name) => {
                    Rule::new(entry.limit.as_str(), Header::named(name.clone()))
                }
            };
            let rule = if entry.methods.is_empty() {
                rule
            } else {
                rule.for_methods(entry.methods.iter().cloned())
            };
            let rule = match &entry.path_prefix {
                Some(prefix) => rule.for_path_prefix(prefix.as_str()),
                None => rule,
            };
            let rule = match entry.cost {
                RuleCost::Default => rule,
                RuleCost::Fixed(cost) => rule.cost(cost),
                RuleCost::Logged => {
                    rule.cost_fn(|parts| parts.extensions.get::<LoggedCost>().map_or(1, |c| c.0))
                }
            };
            let rule = match entry.on_missing_key {
                None => rule,
                Some(RuleMissing::Skip) => rule.on_missing_key(OnMissingKey::Skip),
                Some(RuleMissing::Reject(code)) => rule.on_missing_key(OnMissingKey::Reject(
                    http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::BAD_REQUEST),
                )),
            };
            let rule = if entry.count_when.is_empty() {
                rule
            } else {
                rule.count_when(count_when_of(&entry.count_when))
            };
            #[cfg(feature = "stream")]
            let rule = per_of(rule, entry.per, entry.at_limit);
            #[cfg(feature = "stream")]
            let rule = match (&entry.price, &self.prices) {
                (Some(price), Some(table)) => priced(rule, price, table),
                _ => rule,
            };
            let mut rule = rule;
            rule.defined_at = Some(format!("{}:{}", self.source, entry.line).into());
            builder = builder.rule(rule);
        }
        builder
    }

    /// The layer these rules make on `limiter`, with default settings.
    ///
    /// ```
    /// use tower_ratelimits::{Limiter, Limits, MemoryBackend, RuleSet};
    /// let limits = Limits::from_yaml_str("PerIp: {kind: ip, burst: 5, count: 5, period: 1s}\n", None)?;
    /// let rules = RuleSet::from_yaml_str("- {limit: PerIp, key: client_ip}\n")?;
    /// let layer = rules.layer(Limiter::new(limits, MemoryBackend::new()))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn layer(&self, limiter: Limiter) -> Result<RateLimitLayer, LayerError> {
        self.builder(limiter).build()
    }
}
