//! Loading limits from YAML (feature `yaml`).
//!
//! The text is parsed by `serde-saphyr` under a budget (depth, nodes, aliases, size) into a
//! small tree that keeps each node's line, then checked by hand so every error names the
//! file, the line, the limit and the value. Nothing here panics on any input.

use std::path::Path;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use super::{ConfigError, ConfigErrorKind, Limits, LimitsBuilder, check_name};
use crate::algo::calendar::{CalendarError, CalendarQuota, Period};
use crate::algo::concurrency::{ConcurrencyError, ConcurrencyLimit};
use crate::algo::gcra::{Limit, LimitError};
use crate::algo::tiers::{Tier, TierError, TieredLimit};
use crate::key::IdKind;
use crate::quota::Quota;
use crate::time::parse_duration_us;

/// The largest configuration file accepted: 16 MiB.
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Debug)]
struct Node {
    line: u64,
    /// Where the node's text is in the source (byte offset and length), when known.
    span: Option<(usize, usize)>,
    value: Value,
}

#[derive(Debug)]
enum Value {
    Null,
    Bool(bool),
    Int(i128),
    Float,
    /// A number YAML reads but that is not written in plain decimal (`1_000`, `0x10`, `+5`,
    /// `017`): refused, since what it means depends on the YAML version.
    Unplain(String),
    /// A whole number too large for 64 bits.
    Big(String),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Value {
    fn describe(&self) -> &'static str {
        match self {
            Value::Null => "nothing",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "a number",
            Value::Float => "a decimal number",
            Value::Unplain(_) => "a number not in plain decimal",
            Value::Big(_) => "a number too large",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a map",
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let spanned: Spanned<Value> = Spanned::deserialize(d)?;
        let span = spanned.referenced.span();
        Ok(Node {
            line: spanned.referenced.line(),
            span: span
                .byte_offset()
                .zip(span.byte_len())
                .and_then(|(o, l)| Some((usize::try_from(o).ok()?, usize::try_from(l).ok()?))),
            value: spanned.value,
        })
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a YAML value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Value, E> {
        Ok(Value::Int(i128::try_from(v).unwrap_or(i128::MAX)))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Value, E> {
        Ok(Value::Float)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(n) = seq.next_element::<Node>()? {
            items.push(n);
        }
        Ok(Value::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some((k, v)) = map.next_entry::<Node, Node>()? {
            items.push((k, v));
        }
        Ok(Value::Map(items))
    }
}

fn err_at(kind: ConfigErrorKind, line: u64) -> ConfigError {
    ConfigError::new(kind).at_line(line)
}

/// The most anchors (`&name`) a limits file may define.
pub(crate) const MAX_ANCHORS: usize = 256;
/// The most aliases (`*name`) a limits file may use.
pub(crate) const MAX_ALIASES: usize = 1_024;

fn parse(text: &str) -> Result<Option<Node>, ConfigError> {
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::new(ConfigErrorKind::TooLarge {
            bytes: text.len() as u64,
            max: MAX_FILE_BYTES,
        }));
    }
    let meaningful = text.lines().any(|l| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#') && t != "---" && t != "..."
    });
    if !meaningful {
        return Ok(None);
    }
    let mut options = serde_saphyr::Options::default();
    if let Some(budget) = options.budget.as_mut() {
        budget.max_depth = 16;
        budget.max_nodes = 1_000_000;
        // Anchors and aliases share settings between limits (`B: *a`, `<<: *a`): a bounded
        // number, and what they may copy is bounded too (a "billion laughs" stops here).
        budget.max_aliases = MAX_ALIASES;
        budget.max_anchors = MAX_ANCHORS;
        budget.max_recorded_anchor_events = 100_000;
        budget.max_recorded_anchor_bytes = 1 << 20;
        budget.max_documents = 1;
    }
    options.with_snippet = false;
    // `!tags` the loader does not know are errors, not silently dropped.
    options.reject_unsupported_tags = true;
    match serde_saphyr::from_str_with_options::<Node>(text, options) {
        Ok(mut n) => {
            plain_numbers(&mut n, text);
            Ok(Some(n))
        }
        Err(e) => {
            let line = e.location().map_or(0, |l| l.line());
            let message = e.to_string();
            let mut first = message.lines().next().unwrap_or("").to_owned();
            if first.contains("budget breached") {
                first.push_str(&format!(
                    " (a limits file holds at most {MAX_ANCHORS} anchors, {MAX_ALIASES} aliases, \
                     1,000,000 values and 16 levels)"
                ));
            }
            Err(err_at(ConfigErrorKind::Yaml(first), line))
        }
    }
}

/// Reads numbers from their source text: YAML also reads `1_000`, `0x10`, `0o17`, `+5` (and,
/// in YAML 1.1, `017` as octal) as numbers, and a whole number beyond 64 bits as a decimal
/// one. Only plain decimal digits are numbers here; the others get a precise error.
fn plain_numbers(node: &mut Node, text: &str) {
    match &mut node.value {
        Value::Int(_) | Value::Float => {
            let Some(raw) = node.span.and_then(|(o, l)| text.get(o..o.checked_add(l)?)) else {
                return;
            };
            let raw = raw.trim();
            // A copy an alias made (its span is the alias, `*name`): the anchored original
            // was read from its own text where it stands.
            if raw.starts_with('*') {
                return;
            }
            let digits = raw.strip_prefix('-').unwrap_or(raw);
            let all_digits = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
            let plain = all_digits && (digits == "0" || !digits.starts_with('0'));
            match (&node.value, plain, all_digits) {
                (Value::Float, true, _) => node.value = Value::Big(raw.to_owned()),
                (Value::Int(_), false, _) | (Value::Float, false, true) => {
                    node.value = Value::Unplain(raw.to_owned());
                }
                _ => {}
            }
        }
        Value::Seq(items) => items.iter_mut().for_each(|n| plain_numbers(n, text)),
        Value::Map(items) => items.iter_mut().for_each(|(k, v)| {
            plain_numbers(k, text);
            plain_numbers(v, text);
        }),
        _ => {}
    }
}

fn wrong_shape(expected: &'static str, node: &Node) -> ConfigError {
    err_at(
        ConfigErrorKind::WrongShape {
            expected,
            found: node.value.describe(),
        },
        node.line,
    )
}

fn as_str<'a>(node: &'a Node, expected: &'static str) -> Result<&'a str, ConfigError> {
    match &node.value {
        Value::Str(s) => Ok(s),
        _ => Err(wrong_shape(expected, node)),
    }
}

fn positive(field: &'static str, node: &Node) -> Result<u64, ConfigError> {
    whole(field, node, 1)
}

/// A whole number of at least `least` (0 or 1), in plain decimal digits, that fits 64 bits.
fn whole(field: &'static str, node: &Node, least: i128) -> Result<u64, ConfigError> {
    let bad = |found: String| {
        let kind = if least == 0 {
            ConfigErrorKind::BadCount { field, found }
        } else {
            ConfigErrorKind::BadNumber { field, found }
        };
        err_at(kind, node.line)
    };
    let too_large =
        |v: &dyn std::fmt::Display| bad(format!("{v}, which is larger than {}", u64::MAX));
    match &node.value {
        Value::Int(v) if *v >= least => u64::try_from(*v).map_err(|_| too_large(v)),
        Value::Int(v) => Err(bad(v.to_string())),
        Value::Big(s) => Err(too_large(s)),
        Value::Unplain(s) => Err(bad(format!("{s:?} (write plain decimal digits)"))),
        Value::Str(s) => Err(bad(format!("{s:?}"))),
        other => Err(bad(other.describe().to_owned())),
    }
}

/// The fields of one limit entry (defaults or overrides), each with its line.
#[derive(Default)]
struct Fields<'a> {
    line: u64,
    burst: Option<&'a Node>,
    count: Option<&'a Node>,
    period: Option<&'a Node>,
    max_debt: Option<&'a Node>,
    prefetch: Option<&'a Node>,
    prefetch_ttl: Option<&'a Node>,
    tiers: Option<&'a Node>,
    concurrency: Option<&'a Node>,
    calendar: Option<&'a Node>,
    lease: Option<&'a Node>,
    retry_after: Option<&'a Node>,
    kind: Option<&'a Node>,
    cost: Option<&'a Node>,
    on_store_failure: Option<&'a Node>,
    ids: Option<&'a Node>,
    unlimited: Option<&'a Node>,
    comment: Option<&'a Node>,
}

fn fields<'a>(node: &'a Node, allowed: &[&'static str]) -> Result<Fields<'a>, ConfigError> {
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape("a map of limit fields", node));
    };
    let mut f = Fields {
        line: node.line,
        ..Fields::default()
    };
    for (k, v) in entries {
        let key = as_str(k, "a field name")?;
        if !allowed.contains(&key) {
            return Err(err_at(ConfigErrorKind::unknown_field(key, allowed), k.line));
        }
        let slot = match key {
            "burst" => &mut f.burst,
            "count" => &mut f.count,
            "period" => &mut f.period,
            "max_debt" => &mut f.max_debt,
            "prefetch" => &mut f.prefetch,
            "prefetch_ttl" => &mut f.prefetch_ttl,
            "tiers" => &mut f.tiers,
            "concurrency" => &mut f.concurrency,
            "calendar" => &mut f.calendar,
            "lease" => &mut f.lease,
            "retry_after" => &mut f.retry_after,
            "kind" => &mut f.kind,
            "cost" => &mut f.cost,
            "on_store_failure" => &mut f.on_store_failure,
            "ids" => &mut f.ids,
            "unlimited" => &mut f.unlimited,
            _ => &mut f.comment,
        };
        if slot.replace(v).is_some() {
            return Err(err_at(
                ConfigErrorKind::DuplicateField(key.to_owned()),
                k.line,
            ));
        }
    }
    Ok(f)
}

fn need<'a>(
    f: &Fields<'a>,
    field: &'static str,
    n: Option<&'a Node>,
) -> Result<&'a Node, ConfigError> {
    n.ok_or_else(|| err_at(ConfigErrorKind::MissingField(field), f.line))
}

/// What an override entry gives its ids: a limit, or `unlimited: true` (no limit at all).
fn override_of(f: &Fields<'_>) -> Result<Option<Quota>, ConfigError> {
    let Some(node) = f.unlimited else {
        return quota_of(f).map(Some);
    };
    match node.value {
        Value::Bool(true) => {}
        Value::Bool(false) => {
            return Err(err_at(
                ConfigErrorKind::WrongShape {
                    expected: "true (to give the limit, write it instead)",
                    found: "false",
                },
                node.line,
            ));
        }
        _ => return Err(wrong_shape("true", node)),
    }
    let others = [
        ("burst", f.burst),
        ("count", f.count),
        ("period", f.period),
        ("max_debt", f.max_debt),
        ("prefetch", f.prefetch),
        ("prefetch_ttl", f.prefetch_ttl),
        ("tiers", f.tiers),
        ("concurrency", f.concurrency),
        ("calendar", f.calendar),
    ];
    for (name, other) in others {
        if let Some(n) = other {
            return Err(err_at(
                ConfigErrorKind::ConflictingFields("unlimited", name),
                n.line,
            ));
        }
    }
    Ok(None)
}

/// A GCRA limit (`burst`, `count`, `period`), burst tiers (`tiers`) or a concurrency limit
/// (`concurrency`, with `lease` and `retry_after`).
fn quota_of(f: &Fields<'_>) -> Result<Quota, ConfigError> {
    // Debt and prefetched tokens are a GCRA limit's: tiers forgive overruns and keep a
    // state no instance can split, and slots have no units.
    let gcra_only = [
        ("max_debt", f.max_debt),
        ("prefetch", f.prefetch),
        ("prefetch_ttl", f.prefetch_ttl),
    ];
    for (field, given) in gcra_only {
        let Some(given) = given else { continue };
        for (name, node) in [
            ("tiers", f.tiers),
            ("concurrency", f.concurrency),
            ("calendar", f.calendar),
        ] {
            if node.is_some() {
                return Err(err_at(
                    ConfigErrorKind::ConflictingFields(field, name),
                    given.line,
                ));
            }
        }
    }
    if let (Some(_), Some(calendar)) = (f.concurrency, f.calendar) {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("calendar", "concurrency"),
            calendar.line,
        ));
    }
    if let Some(max) = f.concurrency {
        return concurrency_of(f, max).map(Quota::from);
    }
    // `lease` and `retry_after` belong to a concurrency limit.
    for (name, node) in [("lease", f.lease), ("retry_after", f.retry_after)] {
        if let Some(n) = node {
            return Err(err_at(
                match rate_field(f) {
                    Some((other, _)) => ConfigErrorKind::ConflictingFields(name, other),
                    None => ConfigErrorKind::MissingField("concurrency"),
                },
                n.line,
            ));
        }
    }
    if let Some(calendar) = f.calendar {
        return calendar_of(f, calendar).map(Quota::from);
    }
    let Some(tiers) = f.tiers else {
        return limit_of(f).map(Quota::from);
    };
    for (name, node) in [("burst", f.burst), ("count", f.count), ("period", f.period)] {
        if let Some(n) = node {
            return Err(err_at(
                ConfigErrorKind::ConflictingFields("tiers", name),
                n.line,
            ));
        }
    }
    tiers_of(tiers).map(Quota::from)
}

/// `tiers: [{limit, window, active, cooldown}, ...]`.
fn tiers_of(node: &Node) -> Result<TieredLimit, ConfigError> {
    let Value::Seq(items) = &node.value else {
        return Err(wrong_shape(
            "a list of tiers ({limit, window, active, cooldown})",
            node,
        ));
    };
    let mut tiers = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let number = i + 1;
        let Value::Map(entries) = &item.value else {
            return Err(wrong_shape(
                "a tier: {limit, window, active, cooldown}",
                item,
            ));
        };
        let mut slots: [Option<&Node>; 4] = [None; 4];
        const FIELDS: [&str; 4] = ["limit", "window", "active", "cooldown"];
        for (k, v) in entries {
            let key = as_str(k, "a tier field")?;
            if key == "comment" {
                continue;
            }
            let Some(at) = FIELDS.iter().position(|f| *f == key) else {
                const KNOWN: [&str; 5] = ["limit", "window", "active", "cooldown", "comment"];
                return Err(err_at(ConfigErrorKind::unknown_field(key, &KNOWN), k.line));
            };
            if slots[at].replace(v).is_some() {
                return Err(err_at(
                    ConfigErrorKind::DuplicateField(key.to_owned()),
                    k.line,
                ));
            }
        }
        let bad = |field: &'static str, reason: String, line: u64| {
            err_at(
                ConfigErrorKind::InvalidTier {
                    tier: number,
                    field,
                    reason,
                },
                line,
            )
        };
        let get =
            |at: usize| slots[at].ok_or_else(|| bad(FIELDS[at], "is missing".into(), item.line));
        let limit_node = get(0)?;
        let limit = match &limit_node.value {
            Value::Int(v) => u64::try_from(*v).map_err(|_| {
                bad(
                    "limit",
                    format!("must be a whole number of at least 0, found {v}"),
                    limit_node.line,
                )
            })?,
            other => {
                return Err(bad(
                    "limit",
                    format!(
                        "must be a whole number of at least 0, found {}",
                        other.describe()
                    ),
                    limit_node.line,
                ));
            }
        };
        let mut durations = [0u64; 3];
        for (j, slot) in durations.iter_mut().enumerate() {
            let field = FIELDS[j + 1];
            let n = get(j + 1)?;
            *slot = match &n.value {
                Value::Int(0) => 0,
                Value::Str(text) => parse_duration_us(text)
                    .map_err(|e| bad(field, format!("is not a duration: {e}"), n.line))?,
                other => {
                    return Err(bad(
                        field,
                        format!(
                            "must be a duration such as 1s or 15m, found {}",
                            other.describe()
                        ),
                        n.line,
                    ));
                }
            };
        }
        tiers.push((
            item.line,
            Tier::from_micros(limit, durations[0], durations[1], durations[2]),
        ));
    }
    TieredLimit::new(tiers.iter().map(|&(_, t)| t)).map_err(|e| {
        let line = match &e {
            TierError::Zero { tier, .. } | TierError::TooLarge { tier, .. } => {
                tiers.get(tier - 1).map_or(node.line, |&(l, _)| l)
            }
            _ => node.line,
        };
        err_at(e.into(), line)
    })
}

/// The default lease time of a concurrency limit: a request holding its slot longer than this
/// (or whose instance died) stops counting.
const DEFAULT_LEASE_US: u64 = 60_000_000;

/// The first field of a rate limit (GCRA or tiers) an entry gives, if any.
fn rate_field<'a>(f: &Fields<'a>) -> Option<(&'static str, &'a Node)> {
    [
        ("burst", f.burst),
        ("count", f.count),
        ("period", f.period),
        ("tiers", f.tiers),
    ]
    .into_iter()
    .find_map(|(name, node)| Some((name, node?)))
}

/// A duration field (`period`, `lease`, `retry_after`), in microseconds.
fn duration_of(field: &'static str, node: &Node) -> Result<u64, ConfigError> {
    let Value::Str(text) = &node.value else {
        return Err(err_at(
            ConfigErrorKind::BadNumber {
                field,
                found: format!(
                    "{} (write a duration such as 1s or 180m)",
                    node.value.describe()
                ),
            },
            node.line,
        ));
    };
    parse_duration_us(text).map_err(|e| err_at(e.into(), node.line))
}

/// `concurrency: N` with an optional `lease` (default 60s) and `retry_after` (default 1s).
fn concurrency_of(f: &Fields<'_>, max_node: &Node) -> Result<ConcurrencyLimit, ConfigError> {
    if let Some((name, n)) = rate_field(f) {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("concurrency", name),
            n.line,
        ));
    }
    let max = positive("concurrency", max_node)?;
    let lease_us = match f.lease {
        Some(n) => duration_of("lease", n)?,
        None => DEFAULT_LEASE_US,
    };
    let mut limit = ConcurrencyLimit::from_micros(max, lease_us).map_err(|e| {
        // A lease error is on the lease's line; `concurrency` above the cap on its own.
        let line = match (&e, f.lease) {
            (ConcurrencyError::TooMany { .. }, _) | (_, None) => max_node.line,
            (_, Some(lease)) => lease.line,
        };
        err_at(e.into(), line)
    })?;
    if let Some(n) = f.retry_after {
        limit = limit
            .retry_after(crate::time::us(duration_of("retry_after", n)?))
            .map_err(|e| err_at(e.into(), n.line))?;
    }
    Ok(limit)
}

/// `calendar: {count, period, anchor_day, at, zone}` (`docs/calendar.md`).
fn calendar_of(f: &Fields<'_>, node: &Node) -> Result<CalendarQuota, ConfigError> {
    if let Some((name, _)) = rate_field(f) {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("calendar", name),
            node.line,
        ));
    }
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape(
            "a map: {count, period, anchor_day, at, zone}",
            node,
        ));
    };
    let [mut count, mut period, mut anchor, mut at, mut zone] = [None::<&Node>; 5];
    for (k, v) in entries {
        let key = as_str(k, "a field name")?;
        let slot = match key {
            "count" => &mut count,
            "period" => &mut period,
            "anchor_day" => &mut anchor,
            "at" => &mut at,
            "zone" => &mut zone,
            _ => {
                const KNOWN: [&str; 5] = ["count", "period", "anchor_day", "at", "zone"];
                return Err(err_at(ConfigErrorKind::unknown_field(key, &KNOWN), k.line));
            }
        };
        if slot.replace(v).is_some() {
            return Err(err_at(
                ConfigErrorKind::DuplicateField(key.to_owned()),
                k.line,
            ));
        }
    }
    let missing = |field| err_at(ConfigErrorKind::MissingField(field), node.line);
    let count_node = count.ok_or_else(|| missing("count"))?;
    let period_node = period.ok_or_else(|| missing("period"))?;
    let period: Period = as_str(period_node, "day, week or month")?
        .parse()
        .map_err(|e: CalendarError| err_at(e.into(), period_node.line))?;
    let at_line = |e: CalendarError, n: &Node| err_at(e.into(), n.line);
    let mut q = CalendarQuota::new(positive("count", count_node)?, period)
        .map_err(|e| at_line(e, count_node))?;
    if let Some(n) = anchor {
        q = q
            .anchor_day(positive("anchor_day", n)?)
            .map_err(|e| at_line(e, n))?;
    }
    if let Some(n) = at {
        q = q
            .at(as_str(n, "a time of day, \"HH:MM\"")?)
            .map_err(|e| at_line(e, n))?;
    }
    if let Some(n) = zone {
        q = q
            .zone(as_str(n, "a zone, \"+02:00\" or \"Europe/Berlin\"")?)
            .map_err(|e| at_line(e, n))?;
    }
    Ok(q)
}

fn limit_of(f: &Fields<'_>) -> Result<Limit, ConfigError> {
    let need = |field, n| need(f, field, n);
    let burst_node = need("burst", f.burst)?;
    let burst = positive("burst", burst_node)?;
    let count = positive("count", need("count", f.count)?)?;
    let period_us = duration_of("period", need("period", f.period)?)?;
    let mut limit = Limit::from_micros(burst, count, period_us)
        .map_err(|e| err_at(e.into(), burst_node.line))?;
    if let Some(debt) = f.max_debt {
        let max_debt = whole("max_debt", debt, 0)?;
        limit = limit
            .with_max_debt(max_debt)
            .map_err(|e| err_at(e.into(), debt.line))?;
    }
    prefetch_of(f, limit)
}

/// `prefetch: N` and `prefetch_ttl: D` (default 1s) on a GCRA limit.
fn prefetch_of(f: &Fields<'_>, limit: Limit) -> Result<Limit, ConfigError> {
    let Some(units_node) = f.prefetch else {
        return match f.prefetch_ttl {
            Some(ttl) => Err(err_at(ConfigErrorKind::MissingField("prefetch"), ttl.line)),
            None => Ok(limit),
        };
    };
    let units = positive("prefetch", units_node)?;
    let ttl_us = match f.prefetch_ttl {
        Some(n) => duration_of("prefetch_ttl", n)?,
        None => limit.prefetch_ttl_us(),
    };
    limit
        .with_prefetch(units, std::time::Duration::from_micros(ttl_us))
        .map_err(|e| {
            let line = match (&e, f.prefetch_ttl) {
                (LimitError::PrefetchTtl { .. }, Some(ttl)) => ttl.line,
                _ => units_node.line,
            };
            err_at(e.into(), line)
        })
}

fn id_text(node: &Node) -> Result<(String, u64), ConfigError> {
    match &node.value {
        Value::Str(s) => Ok((s.clone(), node.line)),
        Value::Int(i) => Ok((i.to_string(), node.line)),
        Value::Map(entries) => {
            let mut id = None;
            for (k, v) in entries {
                match as_str(k, "a field name")? {
                    "id" => {
                        if id.is_some() {
                            return Err(err_at(
                                ConfigErrorKind::DuplicateField("id".into()),
                                k.line,
                            ));
                        }
                        id = Some(id_text(v)?.0);
                    }
                    "comment" => {}
                    other => {
                        return Err(err_at(
                            ConfigErrorKind::unknown_field(other, &["id", "comment"]),
                            k.line,
                        ));
                    }
                }
            }
            id.map(|id| (id, node.line))
                .ok_or_else(|| err_at(ConfigErrorKind::MissingField("id"), node.line))
        }
        _ => Err(wrong_shape(
            "an id (a string, or {id: ..., comment: ...})",
            node,
        )),
    }
}

fn load_defaults(builder: &mut LimitsBuilder, root: &Node) -> Result<(), ConfigError> {
    let Value::Map(entries) = &root.value else {
        return Err(wrong_shape("a map of limit names to limits", root));
    };
    for (k, v) in entries {
        let name = as_str(k, "a limit name")?;
        let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
        let f = fields(
            v,
            &[
                "burst",
                "count",
                "period",
                "max_debt",
                "prefetch",
                "prefetch_ttl",
                "tiers",
                "concurrency",
                "calendar",
                "lease",
                "retry_after",
                "kind",
                "cost",
                "on_store_failure",
                "comment",
            ],
        )
        .map_err(located)?;
        let limit = quota_of(&f).map_err(located)?;
        let kind = match f.kind {
            None => IdKind::Any,
            Some(n) => as_str(n, "an id kind")?
                .parse::<IdKind>()
                .map_err(|e| located(err_at(e.into(), n.line)))?,
        };
        // A configured cost of 0 would make the limit count nothing: refused like any zero.
        // (A request can still probe with cost 0: `Rule::cost(0)`, `Transaction::cost(0)`.)
        let cost = match f.cost {
            None => 1,
            Some(n) => positive("cost", n).map_err(located)?,
        };
        builder
            .try_define(name, kind, cost, Some(limit))
            .map_err(|e| {
                let line = match (e.kind(), f.cost) {
                    (ConfigErrorKind::CostAboveBurst { .. }, Some(c)) => c.line,
                    _ => k.line,
                };
                located(e.at_line(line))
            })?;
        // What a store failure does to this limit's requests: the layer's policy (`layer`, the
        // default) or a refusal whatever that policy is (`fail_closed`).
        if let Some(n) = f.on_store_failure {
            match as_str(n, "fail_closed or layer")? {
                "layer" => {}
                "fail_closed" => *builder = std::mem::take(builder).fail_closed(name),
                other => {
                    return Err(located(err_at(
                        ConfigErrorKind::OnStoreFailure(other.chars().take(80).collect()),
                        n.line,
                    )));
                }
            }
        }
    }
    Ok(())
}

fn load_overrides(builder: &mut LimitsBuilder, root: &Node) -> Result<(), ConfigError> {
    match &root.value {
        // The list format: `- Name: {burst, count, period, ids: [...]}`.
        Value::Seq(items) => {
            for item in items {
                let Value::Map(entries) = &item.value else {
                    return Err(wrong_shape("a map with one limit name", item));
                };
                let [(k, v)] = entries.as_slice() else {
                    return Err(wrong_shape("a map with exactly one limit name", item));
                };
                let name = as_str(k, "a limit name")?;
                let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
                let f = fields(
                    v,
                    &[
                        "burst",
                        "count",
                        "period",
                        "max_debt",
                        "prefetch",
                        "prefetch_ttl",
                        "tiers",
                        "ids",
                        "unlimited",
                        "comment",
                    ],
                )
                .map_err(located)?;
                let limit = override_of(&f).map_err(located)?;
                let ids_node = f
                    .ids
                    .ok_or_else(|| located(err_at(ConfigErrorKind::MissingField("ids"), f.line)))?;
                let Value::Seq(ids) = &ids_node.value else {
                    return Err(located(wrong_shape("a list of ids", ids_node)));
                };
                if ids.is_empty() {
                    return Err(located(err_at(ConfigErrorKind::NoIds, ids_node.line)));
                }
                check_name(name).map_err(|e| located(ConfigError::new(e)))?;
                if builder.limits.name(name).is_none() {
                    return Err(located(ConfigError::new(ConfigErrorKind::UnknownName(
                        name.to_owned(),
                    ))));
                }
                for id in ids {
                    let (text, line) = id_text(id).map_err(located)?;
                    builder
                        .try_override(name, &text, limit.clone())
                        .map_err(|e| e.for_limit(name).at_line(line))?;
                }
            }
            Ok(())
        }
        // The older format: `Name:id: {burst, count, period}`.
        Value::Map(entries) => {
            for (k, v) in entries {
                let key = as_str(k, "a Name:id key")?;
                let Some((name, id)) = key.split_once(':') else {
                    return Err(err_at(
                        ConfigErrorKind::WrongShape {
                            expected: "a key of the form Name:id",
                            found: "a key without ':'",
                        },
                        k.line,
                    ));
                };
                let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
                let f = fields(
                    v,
                    &[
                        "burst",
                        "count",
                        "period",
                        "max_debt",
                        "prefetch",
                        "prefetch_ttl",
                        "tiers",
                        "concurrency",
                        "calendar",
                        "lease",
                        "retry_after",
                        "unlimited",
                        "comment",
                    ],
                )
                .map_err(located)?;
                let limit = override_of(&f).map_err(located)?;
                builder.try_override(name, id, limit).map_err(located)?;
            }
            Ok(())
        }
        _ => Err(wrong_shape(
            "a list of overrides (or a map of Name:id keys)",
            root,
        )),
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "yaml")))]
impl Limits {
    /// Loads defaults, and optionally overrides, from YAML text.
    ///
    /// ```
    /// use tower_ratelimits::Limits;
    /// let limits = Limits::from_yaml_str(
    ///     "NewOrdersPerAccount:\n  burst: 300\n  count: 300\n  period: 180m\n  kind: account\n",
    ///     Some("- NewOrdersPerAccount:\n    burst: 300\n    count: 600\n    period: 180m\n    ids: [12345678]\n"),
    /// ).unwrap();
    /// assert_eq!(limits.override_count(), 1);
    /// ```
    pub fn from_yaml_str(defaults: &str, overrides: Option<&str>) -> Result<Limits, ConfigError> {
        load(
            (defaults, "<defaults>"),
            overrides.map(|o| (o, "<overrides>")),
        )
    }

    /// Loads defaults from a YAML file (no overrides). Errors name the file.
    pub fn from_yaml_file(defaults: impl AsRef<Path>) -> Result<Limits, ConfigError> {
        Self::from_yaml_files(defaults, None::<&Path>)
    }

    /// Loads defaults, and optionally overrides, from YAML files. Errors name the file. Paths
    /// are anything path-like: `&str`, `String`, `&Path`, `PathBuf`.
    ///
    /// ```no_run
    /// # use tower_ratelimits::Limits;
    /// let limits = Limits::from_yaml_files("ratelimits.yaml", Some("overrides.yaml"))?;
    /// let from_env = Limits::from_yaml_files("ratelimits.yaml", std::env::var("OVERRIDES").ok())?;
    /// let defaults_only = Limits::from_yaml_file("ratelimits.yaml")?;
    /// # Ok::<(), tower_ratelimits::ConfigError>(())
    /// ```
    pub fn from_yaml_files(
        defaults: impl AsRef<Path>,
        overrides: Option<impl AsRef<Path>>,
    ) -> Result<Limits, ConfigError> {
        let defaults = defaults.as_ref();
        let d_name = defaults.display().to_string();
        let d_text = read(defaults).map_err(|e| e.in_source(&d_name))?;
        match overrides.as_ref().map(AsRef::as_ref) {
            None => load((&d_text, &d_name), None),
            Some(o) => {
                let o_name = o.display().to_string();
                let o_text = read(o).map_err(|e| e.in_source(&o_name))?;
                load((&d_text, &d_name), Some((&o_text, &o_name)))
            }
        }
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    // Only a regular file: opening a FIFO (or reading a device) could block forever.
    let metadata = std::fs::metadata(path).map_err(ConfigError::new)?;
    if !metadata.is_file() {
        return Err(ConfigError::new(ConfigErrorKind::NotAFile));
    }
    let file = std::fs::File::open(path).map_err(ConfigError::new)?;
    let mut bytes = Vec::new();
    let read = file
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(ConfigError::new)?;
    // The size first: a cut through a multi-byte character is not the file's fault.
    if read as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::new(ConfigErrorKind::TooLarge {
            bytes: metadata.len().max(read as u64),
            max: MAX_FILE_BYTES,
        }));
    }
    String::from_utf8(bytes).map_err(|e| {
        ConfigError::new(ConfigErrorKind::NotUtf8 {
            offset: e.utf8_error().valid_up_to(),
        })
    })
}

fn load(defaults: (&str, &str), overrides: Option<(&str, &str)>) -> Result<Limits, ConfigError> {
    let mut builder = Limits::builder();
    let (text, source) = defaults;
    let root = parse(text)
        .and_then(|r| r.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty)))
        .map_err(|e| e.in_source(source))?;
    load_defaults(&mut builder, &root).map_err(|e| e.in_source(source))?;
    if let Some((text, source)) = overrides {
        let root = parse(text)
            .and_then(|r| r.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty)))
            .map_err(|e| e.in_source(source))?;
        load_overrides(&mut builder, &root).map_err(|e| e.in_source(source))?;
    }
    builder.build()
}
