//! What a calendar quota answers the seam (`docs/calendar.md`), and its fields read from an
//! entry.

use std::sync::Arc;

#[cfg(feature = "replay")]
use super::SizedAs;
#[cfg(any(feature = "yaml", feature = "admin"))]
use super::entry::{
    Entry, FieldError, Node, Problem, Value, as_str, at, fields_of, positive, shape_at, wrong_shape,
};
use super::{Capabilities, ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, Settles, StoredFormError, Waits, json_fields, names_any, stored_shape};
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::algo::calendar::Period;
use crate::algo::calendar::{CalendarError, CalendarQuota};

impl Shape for CalendarQuota {
    /// Waited for without knowing when (the period's end); settled by any charge (the overrun
    /// ends with the period); charged back after an outage, its units repaid only when the
    /// period ends.
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: None,
            learns: None,
            state_per_limit: false,
            keeps_on_override: None,
            charge_back: Some(ChargeBack {
                count: self.count(),
                repaid_every_us: 0,
            }),
            waits: Waits::Untimed,
            settles: Settles::AnyCost,
            retry_after_again: None,
            prefetches: false,
            across_regions: Err("a calendar quota"),
            undone_by_value: false,
        }
    }

    /// A period's count.
    fn max_cost(&self) -> u64 {
        self.count()
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        None
    }

    /// The period's count and length (of the period decided in, by the store's clock); `r`
    /// holds until the renewal.
    fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        Some(Shown {
            q: self.count(),
            w: if window { u64::from(n.own.number) } else { 0 },
            t_us: n.reset_after_us,
            concurrency: false,
        })
    }

    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, _: &Numbers<'_>) -> u64 {
        self.count()
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        let mut v = vec![
            ("kind", Text("calendar".into())),
            ("count", Number(self.count())),
            ("period", Text(self.period().as_str().into())),
            ("at", Text(self.renews_at())),
            ("zone", Text(self.zone_name())),
        ];
        if let Some(a) = self.anchor() {
            v.push(("anchor_day", Number(a)));
        }
        v
    }

    /// What the period had left, the units back (the renewal does not move).
    fn unspent(&self, remaining: u64, reset_after_us: u64, granted: u64) -> Option<(u64, u64)> {
        Some((
            remaining.saturating_add(granted).min(self.count()),
            reset_after_us,
        ))
    }

    /// `used` (the count less what remains: an overrun shows as the whole count) and
    /// `renews_at` (the end of the period in force, a UTC instant).
    #[cfg(feature = "admin")]
    fn describe_seen(&self, remaining: u64, now_us: u64) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        vec![
            ("used", Number(self.count().saturating_sub(remaining))),
            (
                "renews_at",
                Text(crate::time::instant_text(self.period_at(now_us).1)),
            ),
        ]
    }

    /// Its count scales.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        Ok(Quota::Calendar(Arc::new(
            self.scaled(scale.of(self.count(), scale.cost))?,
        )))
    }

    /// `calendar: {count, period, anchor_day, at, zone}` (`anchor_day` only when set), the
    /// same in the store and in the API.
    fn write_json(&self, _: Form, v: &mut serde_json::Value) {
        let mut c = serde_json::json!({
            "count": self.count(),
            "period": self.period().as_str(),
            "at": self.renews_at(),
            "zone": self.zone_name(),
        });
        if let Some(a) = self.anchor() {
            c["anchor_day"] = a.into();
        }
        v["calendar"] = c;
    }

    /// A count per period.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Period(self)
    }

    fn shape_name(&self) -> &'static str {
        "a calendar quota"
    }
}

/// A calendar quota's field (`calendar`), if it is there. A quota this build cannot make (an
/// IANA zone without the feature `time-zones`) is refused with the reason.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Plan {
        count: u64,
        period: String,
        anchor_day: Option<u64>,
        at: Option<String>,
        zone: Option<String>,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Calendar {
        calendar: Plan,
    }
    fn quota(p: Plan) -> Result<CalendarQuota, CalendarError> {
        let mut q = CalendarQuota::new(p.count, p.period.parse()?)?;
        if let Some(a) = p.anchor_day {
            q = q.anchor_day(a)?;
        }
        if let Some(at) = &p.at {
            q = q.at(at)?;
        }
        if let Some(zone) = &p.zone {
            q = q.zone(zone)?;
        }
        Ok(q)
    }
    if !names_any(fields, &["calendar"]) {
        return None;
    }
    Some(
        json_fields(fields)
            .and_then(|c: Calendar| quota(c.calendar).map(Quota::from).map_err(stored_shape)),
    )
}

/// The fields of `calendar: {...}`.
#[cfg(any(feature = "yaml", feature = "admin"))]
const CALENDAR_FIELDS: [&str; 5] = ["count", "period", "anchor_day", "at", "zone"];

/// `calendar: {count, period, anchor_day, at, zone}` in an entry (`node`: its map), each
/// error on its field's line.
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) fn read_entry(e: &Entry<'_>, node: &Node) -> Result<CalendarQuota, FieldError> {
    if let Some((name, _)) = e.rate_field() {
        return Err(at(Problem::ConflictingFields("calendar", name), node.line));
    }
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape(
            "a map: {count, period, anchor_day, at, zone}",
            node,
        ));
    };
    let [count, period, anchor, at_node, zone] =
        fields_of(entries, &CALENDAR_FIELDS, "a field name")?;
    let missing = |field| at(Problem::MissingField(field), node.line);
    let count_node = count.ok_or_else(|| missing("count"))?;
    let period_node = period.ok_or_else(|| missing("period"))?;
    let period: Period = as_str(period_node, "day, week or month")?
        .parse()
        .map_err(|x: CalendarError| shape_at(x, period_node.line))?;
    let mut q = CalendarQuota::new(positive("count", count_node)?, period)
        .map_err(|x| shape_at(x, count_node.line))?;
    if let Some(n) = anchor {
        q = q
            .anchor_day(positive("anchor_day", n)?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    if let Some(n) = at_node {
        q = q
            .at(as_str(n, "a time of day, \"HH:MM\"")?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    if let Some(n) = zone {
        q = q
            .zone(as_str(n, "a zone, \"+02:00\" or \"Europe/Berlin\"")?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    Ok(q)
}
