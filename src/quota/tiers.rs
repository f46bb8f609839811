//! What burst tiers answer the seam (`docs/burst-tiers.md`), and their fields read from an
//! entry.

#[cfg(feature = "replay")]
use super::SizedAs;
use super::ceil_secs_us;
#[cfg(any(feature = "yaml", feature = "admin"))]
use super::entry::{FieldError, Node, Problem, Value, at, fields_of, shape_at, wrong_shape};
use super::{Capabilities, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, Settles, StoredFormError, Waits, json_fields, names_any, stored_shape};
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::algo::tiers::TierError;
use crate::algo::tiers::{Tier, TieredLimit};
use crate::time::format_duration_us;
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::time::parse_duration_us;

impl Shape for TieredLimit {
    /// Waited for without knowing when; settled up to its capacity; undone by its value from
    /// before (a refund cannot take back the tiers a spend entered).
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: None,
            learns: None,
            state_per_limit: false,
            keeps_on_override: None,
            charge_back: None,
            waits: Waits::Untimed,
            settles: Settles::UpToMaxCost,
            retry_after_again: None,
            prefetches: false,
            across_regions: Err("burst tiers"),
            undone_by_value: true,
        }
    }

    /// The sum of the tiers' limits.
    fn max_cost(&self) -> u64 {
        self.capacity()
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        None
    }

    /// The serving tier's limit and window, and on a denial the wait before the request
    /// passes, else the time until the serving tier is fresh (a client whose tier is used up
    /// may still burst into the next one, so `r` is not a ceiling). `None` without tiers.
    fn shown(&self, n: &Numbers<'_>, _: bool) -> Option<Shown> {
        let (q, w) = serving_tier(self, n)?;
        Some(Shown {
            q,
            w: ceil_secs_us(w),
            t_us: if n.allowed {
                n.reset_after_us
            } else {
                n.retry_after_us
            },
            concurrency: false,
        })
    }

    /// The serving tier's limit.
    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, n: &Numbers<'_>) -> u64 {
        serving_tier(self, n).map_or(0, |(limit, _)| limit)
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        vec![
            ("kind", Text("tiered".into())),
            ("burst", Number(self.capacity())),
        ]
    }

    /// A tiered state's later state is not known: what the backend said stands.
    fn unspent(&self, _: u64, _: u64, _: u64) -> Option<(u64, u64)> {
        None
    }

    #[cfg(feature = "admin")]
    fn describe_seen(&self, _: u64, _: u64) -> Vec<(&'static str, super::Described)> {
        Vec::new()
    }

    /// Each tier's limit scales (a closed tier stays closed).
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        let tiers = self.tiers().iter().map(|tier| {
            Tier::from_micros(
                if tier.limit() == 0 {
                    0
                } else {
                    scale.of(tier.limit(), 1)
                },
                tier.window_us(),
                tier.active_us(),
                tier.cooldown_us(),
            )
        });
        Ok(Quota::from(TieredLimit::new(tiers)?))
    }

    /// `tiers`: a list of `{limit, window, active, cooldown}` as the YAML file writes it in
    /// the API; stored, the durations in microseconds (`window_us`, `active_us`,
    /// `cooldown_us`).
    fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        let tiers = self.tiers().iter().map(|t| match form {
            Form::Stored => serde_json::json!({
                "limit": t.limit(),
                "window_us": t.window_us(),
                "active_us": t.active_us(),
                "cooldown_us": t.cooldown_us(),
            }),
            Form::Api => serde_json::json!({
                "limit": t.limit(),
                "window": format_duration_us(t.window_us()),
                "active": format_duration_us(t.active_us()),
                "cooldown": format_duration_us(t.cooldown_us()),
            }),
        });
        v["tiers"] = tiers.collect::<Vec<_>>().into();
    }

    /// Its tiers.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Tiers(self)
    }

    fn shape_name(&self) -> &'static str {
        "burst tiers"
    }
}

/// The limit and the window (microseconds) of the tier serving the client (the first when
/// none is named).
fn serving_tier(t: &TieredLimit, n: &Numbers<'_>) -> Option<(u64, u64)> {
    let number = n.own.tiers.map_or(1, |g| usize::from(g.tier));
    let tier = t.tier(number).or(t.tiers().first())?;
    Some((tier.limit(), tier.window_us()))
}

/// Burst tiers' field (`tiers`), if it is there.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stored {
        limit: u64,
        window_us: u64,
        active_us: u64,
        cooldown_us: u64,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Tiers {
        tiers: Vec<Stored>,
    }
    if !names_any(fields, &["tiers"]) {
        return None;
    }
    let tiers = json_fields(fields).map(|t: Tiers| {
        let each = t.tiers.into_iter();
        each.map(|t| Tier::from_micros(t.limit, t.window_us, t.active_us, t.cooldown_us))
            .collect::<Vec<Tier>>()
    });
    Some(tiers.and_then(|t| TieredLimit::new(t).map(Quota::from).map_err(stored_shape)))
}

/// `tiers: [{limit, window, active, cooldown}, ...]` in an entry, a tier's error on its line.
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) fn read_entry(node: &Node) -> Result<TieredLimit, FieldError> {
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
        .collect::<Result<Vec<(u64, Tier)>, FieldError>>()?;
    TieredLimit::new(tiers.iter().map(|&(_, t)| t)).map_err(|e| {
        let line = match &e {
            TierError::Zero { tier, .. } | TierError::TooLarge { tier, .. } => {
                tiers.get(tier - 1).map_or(node.line, |&(l, _)| l)
            }
            _ => node.line,
        };
        shape_at(e, line)
    })
}

/// The fields of a tier, and the `comment` it may have.
#[cfg(any(feature = "yaml", feature = "admin"))]
const TIER_FIELDS: [&str; 5] = ["limit", "window", "active", "cooldown", "comment"];

/// Tier `number` (from 1): `{limit, window, active, cooldown}` (and a `comment`), each error
/// naming the tier and the field.
#[cfg(any(feature = "yaml", feature = "admin"))]
fn tier_of(number: usize, item: &Node) -> Result<Tier, FieldError> {
    let Value::Map(entries) = &item.value else {
        return Err(wrong_shape(
            "a tier: {limit, window, active, cooldown}",
            item,
        ));
    };
    // A `comment` is the reader's, however many.
    let fields = entries
        .iter()
        .filter(|(k, _)| !matches!(&k.value, Value::Str(s) if s == "comment"));
    let slots = fields_of(fields, &TIER_FIELDS, "a tier field")?;
    let bad = |field: &'static str, reason: String, line: u64| {
        at(
            Problem::InvalidTier {
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
#[cfg(any(feature = "yaml", feature = "admin"))]
fn tier_limit(number: usize, node: &Node) -> Result<u64, FieldError> {
    let found = match &node.value {
        Value::Int(v) => match u64::try_from(*v) {
            Ok(limit) => return Ok(limit),
            Err(_) => v.to_string(),
        },
        other => other.describe().to_string(),
    };
    Err(at(
        Problem::InvalidTier {
            tier: number,
            field: "limit",
            reason: format!("must be a whole number of at least 0, found {found}"),
        },
        node.line,
    ))
}
