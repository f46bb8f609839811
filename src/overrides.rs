//! Overrides set while the service runs ([`Limiter::set_override`](crate::Limiter::set_override)):
//! what one is, and the one format it is stored in.
//!
//! A stored override is named by its limit's name and its id's canonical text, never by a
//! position; its value is a small JSON object with a version (`"v": 1`), so a store written by
//! one version of the crate stays meaningful to the next. Its expiry is in the value (Unix
//! milliseconds), not a key's TTL: a Redis eviction policy cannot remove it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::quota::{Form, Quota};

/// What a stored override does to its id's requests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OverrideKind {
    /// A limit of its own in place of the limit's default, of the default's shape (a GCRA
    /// limit for a GCRA limit, tiers for tiers, a concurrency limit for a concurrency limit, a
    /// calendar quota for a calendar quota; any shape for a limit without a default). What the
    /// id used stays used (a calendar quota: `docs/calendar.md`, "Changing a calendar quota").
    Quota(Quota),
    /// No limit: every request of the id is allowed without touching the store.
    Unlimited,
    /// Every request of the id is denied until the override ends, with `Retry-After` pointing
    /// at its end (a day when it has none: [`BLOCK_WITHOUT_END`]).
    Block,
}

/// What a stored override does, as a store or a snapshot keeps it: a limit shared by every
/// override that gives the same one ([`Interned`]), so a million overrides on a few plans
/// hold a few limits.
#[derive(Debug, Clone)]
pub(crate) enum Shared {
    Quota(Arc<Quota>),
    Unlimited,
    Block,
}

impl Shared {
    /// `kind`, its limit shared through `interned`.
    pub(crate) fn of(kind: &OverrideKind, interned: &Interned) -> Self {
        match kind {
            OverrideKind::Quota(q) => Shared::Quota(interned.get(q)),
            OverrideKind::Unlimited => Shared::Unlimited,
            OverrideKind::Block => Shared::Block,
        }
    }

    /// The kind it keeps.
    pub(crate) fn kind(&self) -> OverrideKind {
        match self {
            Shared::Quota(q) => OverrideKind::Quota((**q).clone()),
            Shared::Unlimited => OverrideKind::Unlimited,
            Shared::Block => OverrideKind::Block,
        }
    }

    /// Whether it keeps `kind`.
    pub(crate) fn is(&self, kind: &OverrideKind) -> bool {
        match (self, kind) {
            (Shared::Quota(a), OverrideKind::Quota(b)) => **a == *b,
            (Shared::Unlimited, OverrideKind::Unlimited) | (Shared::Block, OverrideKind::Block) => {
                true
            }
            _ => false,
        }
    }
}

/// The limits stored overrides give, one allocation each, shared by every override (and every
/// snapshot) that gives the same one.
#[derive(Default)]
pub(crate) struct Interned(Mutex<HashMap<Quota, Weak<Quota>, foldhash::fast::RandomState>>);

impl Interned {
    /// The shared copy of `quota`.
    pub(crate) fn get(&self, quota: &Quota) -> Arc<Quota> {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(q) = map.get(quota).and_then(Weak::upgrade) {
            return q;
        }
        // Drop what no override uses any more before the table grows.
        if map.len() >= 64 && map.len().is_power_of_two() {
            map.retain(|_, q| q.strong_count() > 0);
        }
        let q = Arc::new(quota.clone());
        map.insert(quota.clone(), Arc::downgrade(&q));
        q
    }
}

/// What changed in a store's overrides: those set (new, or replacing the one of their limit
/// and id) and those gone (removed or expired), by limit and id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Delta {
    pub(crate) set: Vec<StoredOverride>,
    pub(crate) gone: Vec<(String, String)>,
}

impl Delta {
    pub(crate) fn is_empty(&self) -> bool {
        self.set.is_empty() && self.gone.is_empty()
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
    pub(crate) fn encode(&self) -> String {
        let mut v = serde_json::json!({"v": 1, "limit": self.limit, "id": self.id});
        match &self.kind {
            OverrideKind::Quota(q) => q.write_json(Form::Stored, &mut v),
            OverrideKind::Unlimited => v["unlimited"] = true.into(),
            OverrideKind::Block => v["block"] = true.into(),
        }
        if let Some(at) = self.expires_at_ms {
            v["expires_at_ms"] = at.into();
        }
        v.to_string()
    }

    /// What the store keeps of it: what every instance applies (a GCRA limit of its own keeps
    /// neither a debt nor prefetching).
    pub(crate) fn into_stored(self) -> Self {
        Self::decode(&self.encode()).unwrap_or(self)
    }

    /// A stored value read back; `None` for one this crate could not have written (foreign
    /// data, a later version, a limit that does not validate), which is skipped, not applied.
    pub(crate) fn decode(text: &str) -> Option<Self> {
        #[derive(serde::Deserialize)]
        struct Stored {
            v: u32,
            limit: String,
            id: String,
            #[serde(default)]
            unlimited: bool,
            #[serde(default)]
            block: bool,
            expires_at_ms: Option<u64>,
            /// The limit's fields, each shape's own ([`Quota::read_json`]).
            #[serde(flatten)]
            limit_fields: serde_json::Map<String, serde_json::Value>,
        }
        let s: Stored = serde_json::from_str(text).ok()?;
        if s.v != 1 {
            return None;
        }
        let kind = match (s.unlimited, s.block, s.limit_fields.is_empty()) {
            (true, false, true) => OverrideKind::Unlimited,
            (false, true, true) => OverrideKind::Block,
            // A limit this build cannot make (an IANA zone without the feature) is skipped.
            (false, false, false) => OverrideKind::Quota(
                Quota::read_json(&serde_json::Value::Object(s.limit_fields)).ok()?,
            ),
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
    use crate::algo::calendar::CalendarQuota;
    use crate::algo::concurrency::ConcurrencyLimit;
    use crate::algo::gcra::Limit;
    use crate::algo::tiers::{Tier, TieredLimit};

    fn plan() -> CalendarQuota {
        CalendarQuota::new(1_000_000, crate::algo::calendar::Period::Month)
            .and_then(|q| q.anchor_day(15))
            .and_then(|q| q.at("06:30"))
            .and_then(|q| q.zone("+02:00"))
            .unwrap()
    }

    fn every_shape() -> Vec<OverrideKind> {
        let s = std::time::Duration::from_secs;
        vec![
            OverrideKind::Quota(Limit::from_micros(3, 3, 3_600_000_000).unwrap().into()),
            OverrideKind::Quota(plan().into()),
            OverrideKind::Quota(
                CalendarQuota::new(5, crate::algo::calendar::Period::Day)
                    .unwrap()
                    .into(),
            ),
            OverrideKind::Quota(
                TieredLimit::new([
                    Tier::new(5, s(1), s(1), s(0)),
                    Tier::new(50, s(5), s(5), s(15)),
                ])
                .unwrap()
                .into(),
            ),
            OverrideKind::Quota(
                ConcurrencyLimit::new(10, s(30))
                    .and_then(|c| c.retry_after(std::time::Duration::from_millis(250)))
                    .unwrap()
                    .into(),
            ),
            OverrideKind::Unlimited,
            OverrideKind::Block,
        ]
    }

    #[test]
    fn stored_values_of_every_shape_read_back() {
        for kind in every_shape() {
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
    }

    /// The format is a promise across versions: what the crate wrote before stored overrides
    /// had one shape enum (values taken from that build's `encode`) reads back as the same
    /// override, and is written back byte for byte, so an older instance reads what a newer one
    /// writes during a rolling deploy.
    #[test]
    fn values_an_older_instance_wrote_read_back_and_are_written_byte_for_byte() {
        let limit = Limit::from_micros(3, 3, 3_600_000_000).unwrap();
        let written = [
            (
                r#"{"burst":3,"count":3,"id":"7","limit":"Api","period_us":3600000000,"v":1}"#,
                OverrideKind::Quota(limit.into()),
            ),
            (
                r#"{"burst":3,"count":3,"expires_at_ms":1767225600000,"id":"7","limit":"Api","period_us":3600000000,"v":1}"#,
                OverrideKind::Quota(limit.into()),
            ),
            (
                r#"{"calendar":{"anchor_day":15,"at":"06:30","count":1000000,"period":"month","zone":"+02:00"},"id":"7","limit":"Api","v":1}"#,
                OverrideKind::Quota(plan().into()),
            ),
            (
                r#"{"calendar":{"at":"00:00","count":5,"period":"day","zone":"UTC"},"id":"7","limit":"Api","v":1}"#,
                OverrideKind::Quota(
                    CalendarQuota::new(5, crate::algo::calendar::Period::Day)
                        .unwrap()
                        .into(),
                ),
            ),
            (
                r#"{"id":"7","limit":"Api","unlimited":true,"v":1}"#,
                OverrideKind::Unlimited,
            ),
            (
                r#"{"block":true,"expires_at_ms":1767225600000,"id":"7","limit":"Api","v":1}"#,
                OverrideKind::Block,
            ),
        ];
        for (text, kind) in written {
            let o = StoredOverride::decode(text).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(o.kind, kind, "{text}");
            assert_eq!(o.encode(), text);
        }
        // Keys in another order (another writer) read the same.
        assert_eq!(
            StoredOverride::decode(
                r#"{"v":1,"limit":"Api","id":"7","burst":3,"count":3,"period_us":3600000000}"#
            )
            .map(|o| o.kind),
            Some(OverrideKind::Quota(limit.into()))
        );
    }

    #[test]
    fn foreign_values_are_refused() {
        for foreign in [
            "",
            "not json",
            "[1]",
            r#"{"v":2,"limit":"Api","id":"7","block":true}"#,
            r#"{"v":1,"limit":"Api","id":"7"}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":false}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":true,"unlimited":true}"#,
            r#"{"v":1,"limit":"Api","id":"7","burst":0,"count":3,"period_us":1000000}"#,
            r#"{"v":1,"limit":"Api","id":"7","burst":3,"count":3}"#,
            r#"{"v":1,"limit":"Api","id":"7","burst":3,"count":3,"period":"1h"}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":true,"extra":1}"#,
            r#"{"v":1,"limit":"Api","id":"7","block":true,"burst":3,"count":3,"period_us":1}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":0,"period":"month"}}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"year"}}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"day"},"burst":3}"#,
            r#"{"v":1,"limit":"Api","id":"7","calendar":{"count":3,"period":"day","x":1}}"#,
            r#"{"v":1,"limit":"Api","id":"7","tiers":[]}"#,
            r#"{"v":1,"limit":"Api","id":"7","tiers":[{"limit":5,"window":"1s","active":"1s","cooldown":"0s"}]}"#,
            r#"{"v":1,"limit":"Api","id":"7","concurrency":{"max":0,"lease_us":1,"retry_after_us":1}}"#,
            r#"{"v":1,"limit":"Api","id":"7","concurrency":10}"#,
        ] {
            assert_eq!(StoredOverride::decode(foreign), None, "{foreign}");
        }
    }
}
