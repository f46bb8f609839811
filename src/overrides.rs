//! Overrides set while the service runs ([`Limiter::set_override`](crate::Limiter::set_override)):
//! what one is, and the one format it is stored in.
//!
//! A stored override is named by its limit's name and its id's canonical text, never by a
//! position; its value is a small JSON object with a version (`"v": 1`), so a store written by
//! one version of the crate stays meaningful to the next. Its expiry is in the value (Unix
//! milliseconds), not a key's TTL: a Redis eviction policy cannot remove it.

use crate::algo::calendar::{CalendarError, CalendarQuota};
use crate::algo::gcra::Limit;

/// What a stored override does to its id's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OverrideKind {
    /// A GCRA limit of its own (burst, count, period) in place of the limit's default.
    Limit(Limit),
    /// A calendar quota of its own (a plan: count, period, ...) in place of the limit's
    /// default, itself a calendar quota. What the id used this period stays used
    /// (`docs/calendar.md`, "Changing a calendar quota").
    Calendar(CalendarQuota),
    /// No limit: every request of the id is allowed without touching the store.
    Unlimited,
    /// Every request of the id is denied until the override ends, with `Retry-After` pointing
    /// at its end (a day when it has none: [`BLOCK_WITHOUT_END`]).
    Block,
}

impl OverrideKind {
    /// The limit an override of its own puts in force (`None`: unlimited or a block).
    #[cfg(feature = "admin")]
    pub(crate) fn quota(&self) -> Option<crate::quota::Quota> {
        match self {
            OverrideKind::Limit(l) => Some((*l).into()),
            OverrideKind::Calendar(q) => Some(q.clone().into()),
            OverrideKind::Unlimited | OverrideKind::Block => None,
        }
    }
}

/// A calendar quota's fields as JSON, as stored and as the admin API shows and takes them:
/// `{"count", "period", "anchor_day", "at", "zone"}` (`anchor_day` only when set).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(any(feature = "redis", feature = "admin")), allow(dead_code))]
pub(crate) struct CalendarFields {
    count: u64,
    period: String,
    anchor_day: Option<u64>,
    at: Option<String>,
    zone: Option<String>,
}

#[cfg_attr(not(any(feature = "redis", feature = "admin")), allow(dead_code))]
impl CalendarFields {
    /// The fields of `q`.
    pub(crate) fn of(q: &CalendarQuota) -> serde_json::Value {
        let mut v = serde_json::json!({
            "count": q.count(),
            "period": q.period().as_str(),
            "at": q.renews_at(),
            "zone": q.zone_name(),
        });
        if let Some(a) = q.anchor() {
            v["anchor_day"] = a.into();
        }
        v
    }

    /// The quota they describe, or why there is none.
    pub(crate) fn quota(&self) -> Result<CalendarQuota, CalendarError> {
        let mut q = CalendarQuota::new(self.count, self.period.parse()?)?;
        if let Some(a) = self.anchor_day {
            q = q.anchor_day(a)?;
        }
        if let Some(at) = &self.at {
            q = q.at(at)?;
        }
        if let Some(zone) = &self.zone {
            q = q.zone(zone)?;
        }
        Ok(q)
    }
}

/// What a block without an expiry answers as `Retry-After`: one day (it has no end to point
/// at; the client is told to stay away long, and is asked again when it comes back).
pub const BLOCK_WITHOUT_END: std::time::Duration = std::time::Duration::from_secs(86_400);

/// An override kept in the store: a limit's name, an id (in its canonical text), what it does,
/// and when it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredOverride {
    pub(crate) limit: String,
    pub(crate) id: String,
    pub(crate) kind: OverrideKind,
    pub(crate) expires_at_ms: Option<u64>,
}

impl StoredOverride {
    /// The limit's name.
    pub fn limit(&self) -> &str {
        &self.limit
    }

    /// The id, in its canonical text (an IPv6 range as `2001:db8::/48`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// What it does.
    pub fn kind(&self) -> &OverrideKind {
        &self.kind
    }

    /// When it ends, in Unix milliseconds (`None`: it stays until removed).
    pub fn expires_at_ms(&self) -> Option<u64> {
        self.expires_at_ms
    }

    /// Whether it has ended at `now_ms` (Unix milliseconds).
    pub(crate) fn expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| at <= now_ms)
    }

    /// The store's name for it: unique per limit and id.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn field(limit: &str, id: &str) -> String {
        let mut f = String::with_capacity(limit.len() + 1 + id.len());
        f.push_str(limit);
        f.push(':');
        f.push_str(id);
        f
    }

    /// Its stored value (version 1).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn encode(&self) -> String {
        let mut v = serde_json::json!({"v": 1, "limit": self.limit, "id": self.id});
        match &self.kind {
            OverrideKind::Limit(l) => {
                v["burst"] = l.burst().into();
                v["count"] = l.count().into();
                v["period_us"] = l.period_us().into();
            }
            OverrideKind::Calendar(q) => v["calendar"] = CalendarFields::of(q),
            OverrideKind::Unlimited => v["unlimited"] = true.into(),
            OverrideKind::Block => v["block"] = true.into(),
        }
        if let Some(at) = self.expires_at_ms {
            v["expires_at_ms"] = at.into();
        }
        v.to_string()
    }

    /// A stored value read back; `None` for one this crate could not have written (foreign
    /// data, a later version, a limit that does not validate), which is skipped, not applied.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn decode(text: &str) -> Option<Self> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Stored {
            v: u32,
            limit: String,
            id: String,
            burst: Option<u64>,
            count: Option<u64>,
            period_us: Option<u64>,
            calendar: Option<CalendarFields>,
            #[serde(default)]
            unlimited: bool,
            #[serde(default)]
            block: bool,
            expires_at_ms: Option<u64>,
        }
        let s: Stored = serde_json::from_str(text).ok()?;
        if s.v != 1 {
            return None;
        }
        let numbers = (s.burst, s.count, s.period_us);
        let kind = match (numbers, s.calendar, s.unlimited, s.block) {
            ((Some(b), Some(c), Some(p)), None, false, false) => {
                OverrideKind::Limit(Limit::from_micros(b, c, p).ok()?)
            }
            // A quota this build cannot make (an IANA zone without the feature) is skipped.
            ((None, None, None), Some(c), false, false) => OverrideKind::Calendar(c.quota().ok()?),
            ((None, None, None), None, true, false) => OverrideKind::Unlimited,
            ((None, None, None), None, false, true) => OverrideKind::Block,
            _ => return None,
        };
        Some(Self {
            limit: s.limit,
            id: s.id,
            kind,
            expires_at_ms: s.expires_at_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_values_read_back_and_foreign_ones_are_refused() {
        let limit = Limit::from_micros(3, 3, 3_600_000_000).unwrap();
        let plan = CalendarQuota::new(1_000_000, crate::Period::Month)
            .and_then(|q| q.anchor_day(15))
            .and_then(|q| q.at("06:30"))
            .and_then(|q| q.zone("+02:00"))
            .unwrap();
        for kind in [
            OverrideKind::Limit(limit),
            OverrideKind::Calendar(plan.clone()),
            OverrideKind::Calendar(CalendarQuota::new(5, crate::Period::Day).unwrap()),
            OverrideKind::Unlimited,
            OverrideKind::Block,
        ] {
            for expires_at_ms in [None, Some(1_767_225_600_000)] {
                let o = StoredOverride {
                    limit: "Api".into(),
                    id: "2001:db8::/48".into(),
                    kind: kind.clone(),
                    expires_at_ms,
                };
                assert_eq!(StoredOverride::decode(&o.encode()), Some(o));
            }
        }
        // The format is a promise: this exact text stays readable.
        assert_eq!(
            StoredOverride::decode(
                r#"{"v":1,"limit":"Api","id":"7","burst":3,"count":3,"period_us":3600000000}"#
            )
            .map(|o| o.kind),
            Some(OverrideKind::Limit(limit))
        );
        assert_eq!(
            StoredOverride::decode(
                r#"{"v":1,"limit":"Plan","id":"7","calendar":{"count":1000000,"period":"month","anchor_day":15,"at":"06:30","zone":"+02:00"}}"#
            )
            .map(|o| o.kind),
            Some(OverrideKind::Calendar(plan))
        );
        for foreign in [
            "",
            "not json",
            r#"{"v":2,"limit":"Api","id":"7","block":true}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":true,"unlimited":true}"#,
            r#"{"v":1,"limit":"Api","id":"7","burst":0,"count":3,"period_us":1000000}"#,
            r#"{"v":1,"limit":"Api","id":"7","burst":3,"count":3}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":true,"extra":1}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":0,"period":"month"}}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"year"}}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"day"},"burst":3}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"day","x":1}}"#,
        ] {
            assert_eq!(StoredOverride::decode(foreign), None, "{foreign}");
        }
    }
}
