//! One limit entry read as its shape: a GCRA limit, burst tiers, a concurrency limit, a
//! calendar quota or a fair share, an override's limit, and their fields (durations, rates, prefetch).

use super::node::{Fields, Node, Value, as_str, err_at, need, positive, whole, wrong_shape};
use crate::algo::adaptive::{
    Adaptive, AdaptiveConcurrency, AdaptiveError, Algorithm, DEFAULT_BACKOFF_PM, DEFAULT_INCREASE,
    DEFAULT_SMOOTHING_PM, DEFAULT_TOLERANCE_PM,
};
use crate::algo::calendar::{CalendarError, CalendarQuota, Period};
use crate::algo::concurrency::{ConcurrencyError, ConcurrencyLimit, DEFAULT_LEASE_US};
use crate::algo::fair_share::{FairShare, FairShareError};
use crate::algo::gcra::{Limit, LimitError};
use crate::algo::tiers::{Tier, TierError, TieredLimit};
use crate::completion::Measure;
use crate::config::{ConfigError, ConfigErrorKind};
use crate::quota::Quota;
use crate::time::parse_duration_us;

/// What an override entry gives its ids: a limit, or `unlimited: true` (no limit at all).
pub(super) fn override_of(f: &Fields<'_>) -> Result<Option<Quota>, ConfigError> {
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
        ("fair_share", f.fair_share),
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
pub(super) fn quota_of(f: &Fields<'_>) -> Result<Quota, ConfigError> {
    shapes_apart(f)?;
    if let Some(max) = f.concurrency {
        if let Value::Map(entries) = &max.value {
            return adaptive_of(f, max, entries).map(Quota::from);
        }
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
        if let Some(fair) = f.fair_share {
            return Err(err_at(
                ConfigErrorKind::ConflictingFields("fair_share", "calendar"),
                fair.line,
            ));
        }
        return calendar_of(f, calendar).map(Quota::from);
    }
    if let Some(fair) = f.fair_share {
        if let Some(tiers) = f.tiers {
            return Err(err_at(
                ConfigErrorKind::ConflictingFields("fair_share", "tiers"),
                tiers.line,
            ));
        }
        return fair_share_of(f, fair).map(Quota::from);
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

/// Fields of two shapes in one entry, refused on the later one's line: a GCRA limit's options
/// (debt and prefetched tokens: tiers forgive overruns and keep a state no instance can split,
/// and slots have no units) beside another shape, a calendar quota or a fair share beside a
/// concurrency limit.
fn shapes_apart(f: &Fields<'_>) -> Result<(), ConfigError> {
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
            ("fair_share", f.fair_share),
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
    if let (Some(_), Some(fair)) = (f.concurrency, f.fair_share) {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("fair_share", "concurrency"),
            fair.line,
        ));
    }
    Ok(())
}

/// `tiers: [{limit, window, active, cooldown}, ...]`.
pub(super) fn tiers_of(node: &Node) -> Result<TieredLimit, ConfigError> {
    let Value::Seq(items) = &node.value else {
        return Err(wrong_shape(
            "a list of tiers ({limit, window, active, cooldown})",
            node,
        ));
    };
    let tiers = items
        .iter()
        .enumerate()
        .map(|(i, item)| Ok((item.line, tier_of(i + 1, item)?)))
        .collect::<Result<Vec<(u64, Tier)>, ConfigError>>()?;
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

/// The fields of a tier.
const TIER_FIELDS: [&str; 4] = ["limit", "window", "active", "cooldown"];

/// Tier `number` (from 1): `{limit, window, active, cooldown}` (and a `comment`), each error
/// naming the tier and the field.
fn tier_of(number: usize, item: &Node) -> Result<Tier, ConfigError> {
    let Value::Map(entries) = &item.value else {
        return Err(wrong_shape(
            "a tier: {limit, window, active, cooldown}",
            item,
        ));
    };
    let mut slots: [Option<&Node>; 4] = [None; 4];
    for (k, v) in entries {
        let key = as_str(k, "a tier field")?;
        if key == "comment" {
            continue;
        }
        let Some(at) = TIER_FIELDS.iter().position(|f| *f == key) else {
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
        |at: usize| slots[at].ok_or_else(|| bad(TIER_FIELDS[at], "is missing".into(), item.line));
    let limit = tier_limit(number, get(0)?)?;
    let mut durations = [0u64; 3];
    for (j, slot) in durations.iter_mut().enumerate() {
        let field = TIER_FIELDS[j + 1];
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
    Ok(Tier::from_micros(
        limit,
        durations[0],
        durations[1],
        durations[2],
    ))
}

/// Tier `number`'s `limit`: a whole number of at least 0.
fn tier_limit(number: usize, node: &Node) -> Result<u64, ConfigError> {
    let found = match &node.value {
        Value::Int(v) => match u64::try_from(*v) {
            Ok(limit) => return Ok(limit),
            Err(_) => v.to_string(),
        },
        other => other.describe().to_string(),
    };
    Err(err_at(
        ConfigErrorKind::InvalidTier {
            tier: number,
            field: "limit",
            reason: format!("must be a whole number of at least 0, found {found}"),
        },
        node.line,
    ))
}

/// The first field of a rate limit (GCRA or tiers) an entry gives, if any.
pub(super) fn rate_field<'a>(f: &Fields<'a>) -> Option<(&'static str, &'a Node)> {
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
pub(super) fn duration_of(field: &'static str, node: &Node) -> Result<u64, ConfigError> {
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
pub(super) fn concurrency_of(
    f: &Fields<'_>,
    max_node: &Node,
) -> Result<ConcurrencyLimit, ConfigError> {
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
pub(super) fn calendar_of(f: &Fields<'_>, node: &Node) -> Result<CalendarQuota, ConfigError> {
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

/// A GCRA budget (`burst`, `count`, `period`) shared fairly: `fair_share: {weight, min,
/// refresh, new_ids}`, each optional (`fair_share: {}` for the defaults), `docs/fair-share.md`.
pub(super) fn fair_share_of(f: &Fields<'_>, node: &Node) -> Result<FairShare, ConfigError> {
    let entries: &[(Node, Node)] = match &node.value {
        Value::Map(entries) => entries,
        _ => {
            return Err(wrong_shape(
                "a map: {weight, min, refresh, new_ids} (each optional)",
                node,
            ));
        }
    };
    let [mut weight, mut min, mut refresh, mut new_ids] = [None::<&Node>; 4];
    for (k, v) in entries {
        let key = as_str(k, "a field name")?;
        let slot = match key {
            "weight" => &mut weight,
            "min" => &mut min,
            "refresh" => &mut refresh,
            "new_ids" => &mut new_ids,
            _ => {
                const KNOWN: [&str; 4] = ["weight", "min", "refresh", "new_ids"];
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
    if let Some(p) = f.prefetch {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("prefetch", "fair_share"),
            p.line,
        ));
    }
    let budget = limit_of(f)?;
    let at = |e: FairShareError, n: &Node| err_at(e.into(), n.line);
    let mut share = FairShare::new(budget).map_err(|e| at(e, node))?;
    if let Some(n) = weight {
        share = share
            .with_weight(positive("weight", n)?)
            .map_err(|e| at(e, n))?;
    }
    if let Some(n) = min {
        share = share.with_min(whole("min", n, 0)?).map_err(|e| at(e, n))?;
    }
    if let Some(n) = refresh {
        share = share
            .with_refresh_us(duration_of("refresh", n)?)
            .map_err(|e| at(e, n))?;
    }
    if let Some(n) = new_ids {
        share = share
            .with_new_ids(whole("new_ids", n, 0)?)
            .map_err(|e| at(e, n))?;
    }
    Ok(share)
}

pub(super) fn limit_of(f: &Fields<'_>) -> Result<Limit, ConfigError> {
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
pub(super) fn prefetch_of(f: &Fields<'_>, limit: Limit) -> Result<Limit, ConfigError> {
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

/// `concurrency: {adaptive: {min, initial, max, algorithm, smoothing, tolerance, backoff,
/// increase, window, completions, idle_reset, measure, capacity}}` with an optional `lease` and
/// `retry_after` beside it (`docs/adaptive-concurrency.md`); the thousandths of the algorithms
/// are written as whole percentages.
fn adaptive_of(
    f: &Fields<'_>,
    node: &Node,
    entries: &[(Node, Node)],
) -> Result<AdaptiveConcurrency, ConfigError> {
    if let Some((name, n)) = rate_field(f) {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("concurrency", name),
            n.line,
        ));
    }
    let a = AdaptiveNodes::read(node, entries)?;
    let missing = |field| err_at(ConfigErrorKind::MissingField(field), a.map.line);
    let min = positive("min", a.min.ok_or_else(|| missing("min"))?)?;
    let max = positive("max", a.max.ok_or_else(|| missing("max"))?)?;
    let initial = match a.initial {
        Some(n) => positive("initial", n)?,
        None => min,
    };
    let (algo, algorithm_line) = a.algorithm()?;
    let limit = AdaptiveConcurrency::new(
        Adaptive::new(min, initial, max, algo).map_err(|e| adaptive_error(e, algorithm_line))?,
    );
    a.with_options(limit, f)
}

/// An adaptive limit's error on the line of the field that made it.
fn adaptive_error(e: AdaptiveError, n: &Node) -> ConfigError {
    err_at(e.into(), n.line)
}

/// The fields of `concurrency: {adaptive: {...}}`, each once.
struct AdaptiveNodes<'a> {
    /// The `{...}` map itself (a missing field's line).
    map: &'a Node,
    min: Option<&'a Node>,
    initial: Option<&'a Node>,
    max: Option<&'a Node>,
    algorithm: Option<&'a Node>,
    smoothing: Option<&'a Node>,
    tolerance: Option<&'a Node>,
    backoff: Option<&'a Node>,
    increase: Option<&'a Node>,
    window: Option<&'a Node>,
    completions: Option<&'a Node>,
    idle_reset: Option<&'a Node>,
    measure: Option<&'a Node>,
    capacity: Option<&'a Node>,
    headroom: Option<&'a Node>,
}

/// The fields an adaptive limit's map may hold.
const ADAPTIVE_FIELDS: [&str; 14] = [
    "min",
    "initial",
    "max",
    "algorithm",
    "smoothing",
    "tolerance",
    "backoff",
    "increase",
    "window",
    "completions",
    "idle_reset",
    "measure",
    "capacity",
    "headroom",
];

impl<'a> AdaptiveNodes<'a> {
    /// `{adaptive: {...}}` (`entries`, the map of `concurrency`, `node`) read field by field:
    /// an unknown field or one given twice refused on its line.
    fn read(node: &'a Node, entries: &'a [(Node, Node)]) -> Result<Self, ConfigError> {
        let map = match entries {
            [(k, v)] if matches!(&k.value, Value::Str(s) if s == "adaptive") => v,
            _ => {
                return Err(wrong_shape(
                    "a number of slots, or {adaptive: {min, initial, max, ...}}",
                    node,
                ));
            }
        };
        let Value::Map(fields) = &map.value else {
            return Err(wrong_shape("a map: {min, initial, max, ...}", map));
        };
        let mut found: [Option<&Node>; 14] = [None; 14];
        for (k, v) in fields {
            let key = as_str(k, "a field name")?;
            let Some(i) = ADAPTIVE_FIELDS.iter().position(|&n| n == key) else {
                return Err(err_at(
                    ConfigErrorKind::unknown_field(key, &ADAPTIVE_FIELDS),
                    k.line,
                ));
            };
            if found[i].replace(v).is_some() {
                return Err(err_at(
                    ConfigErrorKind::DuplicateField(key.to_owned()),
                    k.line,
                ));
            }
        }
        let [
            min,
            initial,
            max,
            algorithm,
            smoothing,
            tolerance,
            backoff,
            increase,
            window,
            completions,
            idle_reset,
            measure,
            capacity,
            headroom,
        ] = found;
        Ok(Self {
            map,
            min,
            initial,
            max,
            algorithm,
            smoothing,
            tolerance,
            backoff,
            increase,
            window,
            completions,
            idle_reset,
            measure,
            capacity,
            headroom,
        })
    }

    /// The algorithm (`gradient` unless told) with its parameters or their defaults, and the
    /// line its errors are on; a parameter of the other algorithm refused.
    fn algorithm(&self) -> Result<(Algorithm, &'a Node), ConfigError> {
        let percent = |field, n: Option<&Node>, default: u64| -> Result<u64, ConfigError> {
            n.map_or(Ok(default), |n| {
                whole(field, n, 0).map(|p| p.saturating_mul(10))
            })
        };
        let name = match self.algorithm {
            Some(n) => as_str(n, "gradient or aimd")?,
            None => "gradient",
        };
        let line = self.algorithm.unwrap_or(self.map);
        let (algo, others) = match name {
            "gradient" => (
                Algorithm::Gradient {
                    smoothing_pm: percent("smoothing", self.smoothing, DEFAULT_SMOOTHING_PM)?,
                    tolerance_pm: percent("tolerance", self.tolerance, DEFAULT_TOLERANCE_PM)?,
                },
                [("backoff", self.backoff), ("increase", self.increase)],
            ),
            "aimd" => (
                Algorithm::Aimd {
                    backoff_pm: percent("backoff", self.backoff, DEFAULT_BACKOFF_PM)?,
                    increase: self
                        .increase
                        .map_or(Ok(DEFAULT_INCREASE), |n| positive("increase", n))?,
                },
                [("smoothing", self.smoothing), ("tolerance", self.tolerance)],
            ),
            _ => return Err(wrong_shape("gradient or aimd", line)),
        };
        for (field, n) in others {
            if let Some(n) = n {
                let kind = ConfigErrorKind::OtherAlgorithm {
                    field,
                    algorithm: algo.name(),
                };
                return Err(err_at(kind, n.line));
            }
        }
        Ok((algo, line))
    }

    /// `limit` with the options given: the window, the completions, the idle time, where a
    /// latency ends, the capacity and its headroom, and the slots' `lease` and `retry_after`
    /// (the entry's, `f`), each error on its field's line.
    fn with_options(
        &self,
        mut limit: AdaptiveConcurrency,
        f: &Fields<'_>,
    ) -> Result<AdaptiveConcurrency, ConfigError> {
        let bad = adaptive_error;
        if let Some(n) = self.window {
            limit = limit
                .window(crate::time::us(duration_of("window", n)?))
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = self.completions {
            limit = limit
                .window_completions(whole("completions", n, 0)?)
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = self.idle_reset {
            limit = limit
                .idle_reset(crate::time::us(duration_of("idle_reset", n)?))
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = self.measure {
            limit = limit.measure(match as_str(n, "head or body_end")? {
                "head" => Measure::Head,
                "body_end" => Measure::BodyEnd,
                _ => return Err(wrong_shape("head or body_end", n)),
            });
        }
        if let Some(n) = self.capacity {
            limit = limit
                .capacity(positive("capacity", n)?)
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = self.headroom {
            limit = limit
                .headroom(whole("headroom", n, 0)?)
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = f.lease {
            limit = limit
                .lease(crate::time::us(duration_of("lease", n)?))
                .map_err(|e| bad(e, n))?;
        }
        if let Some(n) = f.retry_after {
            limit = limit
                .retry_after(crate::time::us(duration_of("retry_after", n)?))
                .map_err(|e| bad(e, n))?;
        }
        Ok(limit)
    }
}
