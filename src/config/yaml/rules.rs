//! The rules file (`docs/replay.md`, "The rules file"): which limit applies to which requests,
//! keyed by what, read as data. The layer builds its rules from it (`layer/rules_file.rs`).

use std::path::Path;

use ipnet::IpNet;

use super::node::{Node, Value, as_str, duplicate, err_at, invalid, parse, positive, wrong_shape};
use super::outcomes::{RuleOutcome, count_when_of};
use super::read;
use super::rule_price::{RulePrice, price_of};
use crate::config::{ConfigError, ConfigErrorKind, check_name};

/// What a rule of a [`RuleSet`] is keyed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RuleKey {
    /// `client_ip`: the client's address.
    ClientIp,
    /// `ipv6_range`: the client's address, an IPv6 one as its /48.
    Ipv6Range,
    /// `header:<Name>`: one request header's value.
    Header(http::HeaderName),
}

/// What a rule of a [`RuleSet`] costs a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuleCost {
    /// The limit's default cost.
    Default,
    /// A fixed cost.
    Fixed(u64),
    /// `logged`: the request's [`LoggedCost`](crate::LoggedCost), 1 without one.
    Logged,
}

/// What a rule of a [`RuleSet`] does with a request whose key is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuleMissing {
    /// `skip`: the rule does not apply to it.
    Skip,
    /// `reject` (400) or a status from 400 to 599: the request is answered with it.
    Reject(u16),
}

/// What a rule of a [`RuleSet`] counts (`per:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum RulePer {
    /// `request` (the default).
    #[default]
    Request,
    /// `message`: each message of the stream a request opens.
    Message,
    /// `unit`: each message's units (bytes, tokens).
    Unit,
}

/// What a stream counted by a rule of a [`RuleSet`] does at its limit (`at_limit:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuleAtLimit {
    /// `end`.
    End,
    /// `push_back` (10 s) or `{push_back: 5s}`: the longest a message waits.
    PushBack(std::time::Duration),
}

/// One rule of a [`RuleSet`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RuleEntry {
    pub(crate) limit: String,
    pub(crate) key: RuleKey,
    pub(crate) methods: Vec<http::Method>,
    pub(crate) path_prefix: Option<String>,
    pub(crate) cost: RuleCost,
    /// `None`: the layer's default (reject with 400).
    pub(crate) on_missing_key: Option<RuleMissing>,
    /// `count_when`: the outcome cases that count a request, in order, with their weights
    /// (empty: every request counts its cost).
    pub(crate) count_when: Vec<(RuleOutcome, u64)>,
    /// `per`: requests (the default), or a stream's messages or units.
    pub(crate) per: RulePer,
    /// `at_limit`: what a stream does at the rule's limit (`None`: the meter's default).
    pub(crate) at_limit: Option<RuleAtLimit>,
    /// `price`: a rule per unit charges its units' price, the model's from the file's `prices`.
    pub(crate) price: Option<RulePrice>,
    /// Its line in the file, for a layer's errors about it.
    pub(crate) line: u64,
}

/// A layer's rules read from a YAML file: each rule names a limit, the key it is keyed by, its
/// scope and its cost; beside them the proxies whose forwarding headers are believed and the
/// networks exempt from every rule. [`RuleSet::layer`] builds the layer, so the limits a
/// deployment runs and the ones a replay tries (`Replay`, feature `replay`) read the same file.
///
/// ```yaml
/// trusted_proxies: [10.0.0.0/8]
/// exempt: [192.0.2.0/24]
/// rules:
///   - limit: PerIp
///     key: client_ip
///   - limit: ApiWrites
///     key: client_ip
///     methods: [POST]
///     path_prefix: /api
///   - limit: PerAccount
///     key: header:x-account
///     cost: logged
/// ```
///
/// A plain list of rules is a file with no proxies and no exemptions. `key` is `client_ip`,
/// `ipv6_range` (an IPv6 client by its /48) or `header:<Name>`; `methods` (a rule for `GET`
/// covers `HEAD` too) and `path_prefix` (segment by segment: `/api` covers `/api/users`, not
/// `/apix`) narrow the requests a rule applies to; `cost` is a whole number, or `logged` (the
/// request's [`LoggedCost`](crate::LoggedCost): a replayed log line's `cost`, 1 when it has
/// none); without it, the limit's default cost. `on_missing_key` is `skip` (the rule does not
/// apply to a request without its key), `reject` (the default: a 400) or a status from 400 to
/// 599. `count_when` counts a request only when its response matches one of its cases
/// ([`Rule::count_when`](crate::Rule::count_when)): `{status: 401}`, `{status: 500-599,
/// weight: 0}`, `{header: x-login-failure, equals: mfa, weight: 3}` (weight 1 by default).
/// `per` is `request` (the default), `message` or `unit` (feature `stream`: the rule counts a
/// stream's messages or their units, its key handed to the handler: `StreamKeys`), with
/// `at_limit` (`end`, `push_back`, `{push_back: 5s}`) for a rule per message, and `price`
/// (`{model: 'header:<Name>', of: input | cached_input | output}`) for a rule per unit that
/// charges its units' price from the file's `prices` (a price table:
/// `PriceTable`, feature `stream`).
///
/// ```
/// use tower_ratelimits::RuleSet;
/// let rules = RuleSet::from_yaml_str("- {limit: PerIp, key: client_ip}\n")?;
/// assert_eq!(rules.limit_names().collect::<Vec<_>>(), ["PerIp"]);
/// # Ok::<(), tower_ratelimits::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RuleSet {
    /// The file's name (or `<rules>`), for a layer's errors about a rule.
    pub(crate) source: std::sync::Arc<str>,
    pub(crate) rules: Vec<RuleEntry>,
    pub(crate) trusted_proxies: Vec<IpNet>,
    pub(crate) exempt: Vec<IpNet>,
    /// `prices`: the price table the rules with a `price` charge at.
    #[cfg(feature = "stream")]
    pub(crate) prices: Option<std::sync::Arc<crate::config::PriceTable>>,
}

const FILE_FIELDS: &[&str] = &["rules", "trusted_proxies", "exempt", "prices"];
const RULE_FIELDS: &[&str] = &[
    "limit",
    "key",
    "methods",
    "path_prefix",
    "cost",
    "on_missing_key",
    "count_when",
    "per",
    "price",
    "at_limit",
];

impl RuleSet {
    /// Reads a rules file's text. Errors name the line.
    pub fn from_yaml_str(text: &str) -> Result<RuleSet, ConfigError> {
        Self::from_named_yaml("<rules>", text)
    }

    /// [`RuleSet::from_yaml_str`] with the text's name, which its errors, and a layer's errors
    /// about a rule, give as a file's.
    pub fn from_named_yaml(name: &str, text: &str) -> Result<RuleSet, ConfigError> {
        let rules = load(text).map_err(|e| e.in_source(name))?;
        Ok(RuleSet {
            source: name.into(),
            ..rules
        })
    }

    /// Reads a rules file. Errors name the file and the line.
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<RuleSet, ConfigError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = read(path).map_err(|e| e.in_source(&name))?;
        Self::from_named_yaml(&name, &text)
    }

    /// The limits its rules name, in the file's order.
    pub fn limit_names(&self) -> impl Iterator<Item = &str> {
        self.rules.iter().map(|r| r.limit.as_str())
    }
}

fn load(text: &str) -> Result<RuleSet, ConfigError> {
    let root = parse(text)?.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty))?;
    let mut set = RuleSet::default();
    let list = match &root.value {
        Value::Seq(_) => &root,
        Value::Map(entries) => {
            let mut rules = None;
            for (k, v) in entries {
                let field = as_str(k, "a field name")?;
                let slot = match field {
                    "rules" => &mut rules,
                    "trusted_proxies" | "exempt" => {
                        let nets = networks(v)?;
                        let into = if field == "exempt" {
                            &mut set.exempt
                        } else {
                            &mut set.trusted_proxies
                        };
                        if !into.is_empty() {
                            return Err(duplicate(field, k));
                        }
                        *into = nets;
                        continue;
                    }
                    "prices" => {
                        prices_of(&mut set, v)?;
                        continue;
                    }
                    other => {
                        return Err(err_at(
                            ConfigErrorKind::unknown_field(other, FILE_FIELDS),
                            k.line,
                        ));
                    }
                };
                if slot.replace(v).is_some() {
                    return Err(duplicate(field, k));
                }
            }
            rules.ok_or_else(|| err_at(ConfigErrorKind::MissingField("rules"), root.line))?
        }
        _ => {
            return Err(wrong_shape(
                "a list of rules, or a map with `rules:`",
                &root,
            ));
        }
    };
    let Value::Seq(items) = &list.value else {
        return Err(wrong_shape("a list of rules", list));
    };
    for item in items {
        let rule = entry(item)?;
        if rule.price.is_some() && !set.has_prices() {
            return Err(invalid(
                "a rule with a price needs the file's `prices` (a price table)".into(),
                item,
            ));
        }
        if set.rules.iter().any(|r| r.limit == rule.limit) {
            return Err(err_at(
                ConfigErrorKind::InvalidRule(format!(
                    "limit {:?} has a rule already (one rule per limit)",
                    rule.limit
                )),
                item.line,
            ));
        }
        set.rules.push(rule);
    }
    Ok(set)
}

/// The file's `prices`: a price table (feature `stream`).
fn prices_of(set: &mut RuleSet, node: &Node) -> Result<(), ConfigError> {
    #[cfg(feature = "stream")]
    {
        set.prices = Some(std::sync::Arc::new(super::prices::table_of(node)?));
        Ok(())
    }
    #[cfg(not(feature = "stream"))]
    {
        let _ = set;
        Err(invalid(
            "prices are charged by rules per unit: the crate's feature `stream`".into(),
            node,
        ))
    }
}

impl RuleSet {
    fn has_prices(&self) -> bool {
        #[cfg(feature = "stream")]
        return self.prices.is_some();
        #[cfg(not(feature = "stream"))]
        false
    }
}

fn networks(node: &Node) -> Result<Vec<IpNet>, ConfigError> {
    let Value::Seq(items) = &node.value else {
        return Err(wrong_shape(
            "a list of networks (10.0.0.0/8, 2001:db8::/32)",
            node,
        ));
    };
    items
        .iter()
        .map(|n| {
            let text = as_str(n, "a network (10.0.0.0/8, 2001:db8::/32)")?;
            // A lone address is its own network.
            text.parse::<IpNet>()
                .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
                .map_err(|_| invalid(format!("{text:?} is not a network or an address"), n))
        })
        .collect()
}

fn entry(node: &Node) -> Result<RuleEntry, ConfigError> {
    let Value::Map(fields) = &node.value else {
        return Err(wrong_shape("a rule (a map with `limit` and `key`)", node));
    };
    let (mut limit, mut key, mut methods, mut prefix, mut cost) = (None, None, None, None, None);
    let (mut on_missing, mut count_when, mut per, mut at_limit) = (None, None, None, None);
    let mut price = None;
    for (k, v) in fields {
        let field = as_str(k, "a field name")?;
        let slot = match field {
            "limit" => &mut limit,
            "key" => &mut key,
            "methods" => &mut methods,
            "path_prefix" => &mut prefix,
            "cost" => &mut cost,
            "on_missing_key" => &mut on_missing,
            "count_when" => &mut count_when,
            "per" => &mut per,
            "at_limit" => &mut at_limit,
            "price" => &mut price,
            other => {
                return Err(err_at(
                    ConfigErrorKind::unknown_field(other, RULE_FIELDS),
                    k.line,
                ));
            }
        };
        if slot.replace(v).is_some() {
            return Err(duplicate(field, k));
        }
    }
    let missing = |field| err_at(ConfigErrorKind::MissingField(field), node.line);
    let limit_node = limit.ok_or_else(|| missing("limit"))?;
    let limit = as_str(limit_node, "a limit name")?;
    check_name(limit).map_err(|kind| err_at(kind, limit_node.line))?;
    let key = key_of(key.ok_or_else(|| missing("key"))?)?;
    let methods = methods.map_or(Ok(Vec::new()), methods_of)?;
    let path_prefix = prefix.map(path_prefix_of).transpose()?;
    let cost = match cost {
        None => RuleCost::Default,
        Some(n) => match &n.value {
            Value::Str(s) if s == "logged" => RuleCost::Logged,
            _ => RuleCost::Fixed(positive("cost", n)?),
        },
    };
    let on_missing_key = on_missing.map(on_missing_of).transpose()?;
    if let (Some(count_when), RuleCost::Fixed(_) | RuleCost::Logged) = (count_when, cost) {
        return Err(invalid(
            "count_when sets the rule's cost (its largest weight): leave `cost` out".into(),
            count_when,
        ));
    }
    let count_when = count_when.map_or(Ok(Vec::new()), count_when_of)?;
    let (per, at_limit) = per_of(per, at_limit, cost, !count_when.is_empty())?;
    let price = match price {
        Some(node) if per != RulePer::Unit => {
            return Err(invalid(
                "a price is charged per unit: write `per: unit`".into(),
                node,
            ));
        }
        price => price.map(price_of).transpose()?,
    };
    Ok(RuleEntry {
        limit: limit.to_owned(),
        key,
        methods,
        path_prefix,
        cost,
        on_missing_key,
        count_when,
        per,
        at_limit,
        price,
        line: node.line,
    })
}

/// `per: request | message | unit` and `at_limit: end | push_back | {push_back: 5s}`: a rule
/// per message or unit (feature `stream`) has no `cost` and no `count_when`; `at_limit` is
/// for it only.
fn per_of(
    per: Option<&Node>,
    at_limit: Option<&Node>,
    cost: RuleCost,
    counts_outcomes: bool,
) -> Result<(RulePer, Option<RuleAtLimit>), ConfigError> {
    let Some(node) = per else {
        return match at_limit {
            Some(n) => Err(invalid(
                "at_limit is for a rule with `per: message` or `per: unit`".into(),
                n,
            )),
            None => Ok((RulePer::Request, None)),
        };
    };
    let per = match as_str(node, "request, message or unit")? {
        "request" => RulePer::Request,
        "message" => RulePer::Message,
        "unit" => RulePer::Unit,
        other => {
            return Err(invalid(
                format!("per {other:?}: use request, message or unit"),
                node,
            ));
        }
    };
    if per == RulePer::Request {
        return per_of(None, at_limit, cost, counts_outcomes);
    }
    if cfg!(not(feature = "stream")) {
        return Err(invalid(
            "a rule per message or unit needs the crate's feature `stream`".into(),
            node,
        ));
    }
    if cost != RuleCost::Default || counts_outcomes {
        return Err(invalid(
            "a rule per message or unit costs one unit a message, or its units: leave `cost` and `count_when` out".into(),
            node,
        ));
    }
    Ok((per, at_limit.map(at_limit_of).transpose()?))
}

/// `at_limit: end | push_back | {push_back: 5s}`.
fn at_limit_of(node: &Node) -> Result<RuleAtLimit, ConfigError> {
    const WHAT: &str = "at_limit: end, push_back, or {push_back: <duration>}";
    match &node.value {
        Value::Str(s) if s == "end" => Ok(RuleAtLimit::End),
        Value::Str(s) if s == "push_back" => {
            Ok(RuleAtLimit::PushBack(std::time::Duration::from_secs(10)))
        }
        Value::Map(fields) => match fields.as_slice() {
            [(k, v)] if as_str(k, "push_back")? == "push_back" => {
                let text = as_str(v, "a duration (5s, 500ms)")?;
                crate::time::parse_duration_us(text)
                    .map(|us| RuleAtLimit::PushBack(std::time::Duration::from_micros(us)))
                    .map_err(|e| invalid(format!("push_back: {e}"), v))
            }
            _ => Err(invalid(WHAT.into(), node)),
        },
        _ => Err(invalid(WHAT.into(), node)),
    }
}

/// `key: client_ip | ipv6_range | header:<Name>`.
fn key_of(node: &Node) -> Result<RuleKey, ConfigError> {
    Ok(
        match as_str(node, "a key (client_ip, ipv6_range, header:<Name>)")? {
            "client_ip" => RuleKey::ClientIp,
            "ipv6_range" => RuleKey::Ipv6Range,
            text => match text.strip_prefix("header:").map(str::trim) {
                Some(name) => match http::HeaderName::from_bytes(name.as_bytes()) {
                    Ok(header) => RuleKey::Header(header),
                    Err(_) => {
                        return Err(invalid(format!("{name:?} is not a header name"), node));
                    }
                },
                None => {
                    return Err(invalid(
                        format!("key {text:?}: use client_ip, ipv6_range or header:<Name>"),
                        node,
                    ));
                }
            },
        },
    )
}

/// `methods: [GET, POST]`: at least one.
fn methods_of(node: &Node) -> Result<Vec<http::Method>, ConfigError> {
    let Value::Seq(items) = &node.value else {
        return Err(wrong_shape("a list of methods ([GET, POST])", node));
    };
    let mut out = Vec::with_capacity(items.len());
    for m in items {
        let text = as_str(m, "a method (GET, POST, ...)")?;
        let method = http::Method::from_bytes(text.to_ascii_uppercase().as_bytes())
            .map_err(|_| invalid(format!("{text:?} is not a method"), m))?;
        out.push(method);
    }
    if out.is_empty() {
        return Err(invalid(
            "methods: an empty list matches no request".into(),
            node,
        ));
    }
    Ok(out)
}

/// `path_prefix: /api`.
fn path_prefix_of(node: &Node) -> Result<String, ConfigError> {
    let text = as_str(node, "a path prefix (/api)")?;
    if !text.starts_with('/') {
        return Err(invalid(
            format!("path_prefix {text:?} must start with /"),
            node,
        ));
    }
    Ok(text.to_owned())
}

/// `on_missing_key: skip | reject | <status from 400 to 599>`.
fn on_missing_of(node: &Node) -> Result<RuleMissing, ConfigError> {
    Ok(match &node.value {
        Value::Str(s) if s == "skip" => RuleMissing::Skip,
        Value::Str(s) if s == "reject" => RuleMissing::Reject(400),
        Value::Int(code) if (400..=599).contains(code) => RuleMissing::Reject(*code as u16),
        _ => {
            return Err(invalid(
                "on_missing_key: skip, reject, or a status from 400 to 599".into(),
                node,
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_reads_its_rules_scopes_costs_proxies_and_exemptions() {
        let set = RuleSet::from_yaml_str(
            "trusted_proxies: [10.0.0.0/8, ::1]\nexempt: [192.0.2.0/24]\nrules:\n  \
             - {limit: PerIp, key: client_ip}\n  \
             - {limit: Writes, key: ipv6_range, methods: [post, PUT], path_prefix: /api, cost: 3}\n  \
             - {limit: PerAccount, key: 'header:X-Account', cost: logged, on_missing_key: 401}\n",
        )
        .unwrap();
        assert_eq!(set.trusted_proxies.len(), 2);
        assert_eq!(set.exempt, ["192.0.2.0/24".parse::<IpNet>().unwrap()]);
        assert_eq!(set.rules[0].key, RuleKey::ClientIp);
        assert_eq!(set.rules[0].cost, RuleCost::Default);
        assert_eq!(
            set.rules[1].methods,
            [http::Method::POST, http::Method::PUT]
        );
        assert_eq!(set.rules[1].path_prefix.as_deref(), Some("/api"));
        assert_eq!(set.rules[1].cost, RuleCost::Fixed(3));
        assert_eq!(
            set.rules[2].key,
            RuleKey::Header(http::HeaderName::from_static("x-account"))
        );
        assert_eq!(set.rules[2].cost, RuleCost::Logged);
        assert_eq!(set.rules[2].on_missing_key, Some(RuleMissing::Reject(401)));
        assert_eq!(set.rules[0].on_missing_key, None);
        let plain = RuleSet::from_yaml_str("- {limit: PerIp, key: client_ip}\n").unwrap();
        assert!(plain.trusted_proxies.is_empty() && plain.rules.len() == 1);
    }

    #[test]
    fn count_when_lists_at_most_64_cases() {
        let rules = |n: usize| {
            let cases = vec!["{status: 401}"; n].join(", ");
            RuleSet::from_yaml_str(&format!(
                "- {{limit: A, key: client_ip, count_when: [{cases}]}}\n"
            ))
        };
        assert_eq!(rules(64).unwrap().rules[0].count_when.len(), 64);
        let refused = rules(65).unwrap_err().to_string();
        assert!(refused.contains("65 cases: at most 64"), "{refused}");
    }

    #[test]
    fn count_when_reads_its_cases_in_order_with_their_weights() {
        let set = RuleSet::from_yaml_str(
            "- limit: FailedLogins\n  key: header:x-account\n  count_when:\n    \
             - {header: x-login-failure, equals: mfa, weight: 3}\n    \
             - {status: 401}\n    - {status: 500-599, weight: 0}\n    - {header: x-failed}\n    \
             - {grpc_status: 16, weight: 2}\n    - {latency_above: 1500ms}\n",
        )
        .unwrap();
        let header = |name: &str| http::HeaderName::from_bytes(name.as_bytes()).unwrap();
        assert_eq!(
            set.rules[0].count_when,
            [
                (
                    RuleOutcome::Header(
                        header("x-login-failure"),
                        Some(http::HeaderValue::from_static("mfa"))
                    ),
                    3
                ),
                (RuleOutcome::Status(401, 401), 1),
                (RuleOutcome::Status(500, 599), 0),
                (RuleOutcome::Header(header("x-failed"), None), 1),
                (RuleOutcome::GrpcStatus(16), 2),
                (
                    RuleOutcome::LatencyAbove(std::time::Duration::from_millis(1500)),
                    1
                ),
            ]
        );
        let plain = RuleSet::from_yaml_str("- {limit: A, key: client_ip}\n").unwrap();
        assert!(plain.rules[0].count_when.is_empty());
    }

    #[test]
    fn a_bad_rules_file_is_refused_with_its_line() {
        for (text, says, line) in [
            ("- {limit: A, key: cookie}\n", "use client_ip", 1),
            (
                "- {limit: A, key: client_ip}\n- {limit: B, key: 'header:bad name'}\n",
                "not a header name",
                2,
            ),
            (
                "- {limit: A, key: client_ip, cost: 0}\n",
                "greater than zero",
                1,
            ),
            (
                "- {limit: A, key: client_ip, methods: []}\n",
                "matches no request",
                1,
            ),
            (
                "- {limit: A, key: client_ip, path_prefix: api}\n",
                "must start with /",
                1,
            ),
            (
                "- {limit: A, key: client_ip, scope: x}\n",
                "unknown field",
                1,
            ),
            (
                "- {limit: A, key: client_ip}\n- {limit: A, key: client_ip}\n",
                "one rule per limit",
                2,
            ),
            (
                "- limit: A\n  key: client_ip\n  count_when:\n    - {status: 401}\n    - {status: 600}\n",
                "a code from 100 to 599",
                5,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{status: 599-500}]}\n",
                "a range of them",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{status: 401, weight: 0}]}\n",
                "counts nothing",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{status: 401, weight: 1099511627777}]}\n",
                "from 0 to 2^40",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{status: 401, header: x-a}]}\n",
                "a case is one of `status`",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{grpc_status: 17}]}\n",
                "a gRPC status code from 0 to 16",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{grpc_status: 2, status: 500}]}\n",
                "a case is one of `status`",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{latency_above: 0s}]}\n",
                "counts every response",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{latency_above: soon}]}\n",
                "latency_above: ",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{header: x-a, equals: \"a\\nb\"}]}\n",
                "not a header value",
                1,
            ),
            (
                "- {limit: A, key: client_ip, count_when: [{latency: 1s}]}\n",
                "unknown field",
                1,
            ),
            (
                "- {limit: A, key: client_ip, cost: 2, count_when: [{status: 401}]}\n",
                "leave `cost` out",
                1,
            ),
            ("- {key: client_ip}\n", "missing field \"limit\"", 1),
            ("rules: []\nexempt: [nope]\n", "not a network", 2),
            ("trusted_proxies: []\n", "missing field \"rules\"", 1),
            ("'just text'\n", "a list of rules", 1),
        ] {
            let e = RuleSet::from_yaml_str(text).unwrap_err();
            assert!(e.to_string().contains(says), "{text:?}: {e}");
            assert_eq!(e.location().line, Some(line), "{text:?}: {e}");
        }
    }
}
