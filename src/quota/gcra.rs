//! What a GCRA limit answers the seam (`docs/gcra.md`), and its fields read from an entry.

#[cfg(feature = "replay")]
use super::SizedAs;
use super::ceil_secs_us;
#[cfg(any(feature = "yaml", feature = "admin"))]
use super::entry::{Entry, FieldError, Problem, at, duration_of, positive, shape_at, whole};
use super::{
    CHARGED_BACK_FROM_US, Capabilities, ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown,
};
use super::{Form, Settles, StoredFormError, Waits, json_fields, names_any, stored_shape};
use crate::algo::gcra::Limit;
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::algo::gcra::LimitError;
use crate::time::format_duration_us;

impl Shape for Limit {
    /// Waited for, its units' return told; settled by any charge (what fits within its
    /// debt); prefetched when it says so, and one limit across regions unless it is (prefetched
    /// tokens are spent without the store: no region share could count them); of an hour or
    /// longer, its units are repaid one per emission interval after an outage (a throttle of
    /// seconds is repaid before an outage ends).
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: None,
            learns: None,
            state_per_limit: false,
            keeps_on_override: None,
            charge_back: (self.period_us() >= CHARGED_BACK_FROM_US).then(|| ChargeBack {
                count: self.burst(),
                repaid_every_us: self.emission_interval_us(),
            }),
            waits: Waits::Timed(units_return_us),
            settles: Settles::AnyCost,
            retry_after_again: Some(retry_after_again),
            prefetches: self.prefetch() > 0,
            across_regions: if self.prefetch() > 0 {
                Err("prefetched tokens (prefetch)")
            } else {
                Ok(())
            },
            undone_by_value: false,
        }
    }

    fn max_cost(&self) -> u64 {
        self.burst()
    }

    /// The burst and the burst offset rounded up.
    fn fixed_policy(&self) -> Option<(u64, u64)> {
        Some((self.burst(), ceil_secs_us(self.burst_offset_us())))
    }

    /// The burst and the burst offset, and `Limit::window_us`.
    fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        Some(Shown {
            q: self.burst(),
            w: if window {
                ceil_secs_us(self.burst_offset_us())
            } else {
                0
            },
            t_us: self.window_us(n.reset_after_us, n.remaining),
            concurrency: false,
        })
    }

    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, _: &Numbers<'_>) -> u64 {
        self.burst()
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        vec![
            ("burst", Number(self.burst())),
            ("count", Number(self.count())),
            (
                "period",
                Text(crate::time::format_duration_us(self.period_us())),
            ),
        ]
    }

    /// Exact: `remaining` and `reset_after` move by whole emission intervals.
    fn unspent(&self, remaining: u64, reset_after_us: u64, granted: u64) -> Option<(u64, u64)> {
        Some((
            remaining.saturating_add(granted).min(self.burst()),
            reset_after_us.saturating_sub(granted.saturating_mul(self.emission_interval_us())),
        ))
    }

    #[cfg(feature = "admin")]
    fn describe_seen(&self, _: u64, _: u64) -> Vec<(&'static str, super::Described)> {
        Vec::new()
    }

    /// Keeps `count` and stretches the period by `100 / percent` (so the rate scales without a
    /// new rounding of the emission interval), and scales the burst and the debt.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        Ok(Quota::Gcra(scaled_limit(self, scale)?))
    }

    /// `burst`, `count` and the period: `period_us` stored, `period` (`"1h"`) in the API. A
    /// stored one keeps neither the debt nor prefetching (a limit of its own has neither).
    fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        v["burst"] = self.burst().into();
        v["count"] = self.count().into();
        match form {
            Form::Stored => v["period_us"] = self.period_us().into(),
            Form::Api => v["period"] = format_duration_us(self.period_us()).into(),
        }
    }

    /// A rate and a burst.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Rate(self)
    }

    fn shape_name(&self) -> &'static str {
        "a GCRA limit"
    }
}

/// A denial tells the time its units take to come back: `retry_after = ahead + units - burst
/// offset`, and `reset_after = ahead`.
pub(super) fn units_return_us(limit: &Limit, retry_after_us: u64, reset_after_us: u64) -> u64 {
    retry_after_us
        .saturating_add(limit.burst_offset_us())
        .saturating_sub(reset_after_us)
}

/// Exact: a later state's `reset_after` moves by whole emission intervals.
pub(super) fn retry_after_again(limit: &Limit, reset_after_us: u64, granted: u64) -> u64 {
    reset_after_us
        .saturating_add(granted.saturating_mul(limit.emission_interval_us()))
        .saturating_sub(limit.burst_offset_us())
}

/// `limit` at a fallback's share: `count` kept and the period stretched by `100 / percent` (so
/// the rate scales without a new rounding of the emission interval), the burst and the debt
/// scaled (a fair share's budget scales the same way).
pub(super) fn scaled_limit(limit: &Limit, scale: &Scale) -> Result<Limit, ShapeError> {
    Ok(Limit::from_micros(
        scale.of(limit.burst(), scale.cost),
        limit.count(),
        limit.period_us().saturating_mul(100) / scale.percent,
    )?
    .with_max_debt(limit.max_debt().saturating_mul(scale.percent) / 100)?)
}

/// A GCRA limit's fields (`burst`, `count`, and `period_us` or `period`), if any is there.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stored {
        burst: u64,
        count: u64,
        period_us: u64,
    }
    if !names_any(fields, &["burst", "count", "period", "period_us"]) {
        return None;
    }
    let limit = json_fields(fields).and_then(|s: Stored| {
        Limit::from_micros(s.burst, s.count, s.period_us).map_err(stored_shape)
    });
    Some(limit.map(Quota::Gcra))
}

/// A GCRA limit's fields in an entry (`burst`, `count`, `period`, `max_debt`, and
/// `prefetch` with `prefetch_ttl`, default 1s), each error on its field's line (the limit's
/// own on `burst`'s).
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) fn read_entry(e: &Entry<'_>) -> Result<Limit, FieldError> {
    let burst_node = e.need("burst", e.burst)?;
    let burst = positive("burst", burst_node)?;
    let count = positive("count", e.need("count", e.count)?)?;
    let period_us = duration_of("period", e.need("period", e.period)?)?;
    let mut limit =
        Limit::from_micros(burst, count, period_us).map_err(|x| shape_at(x, burst_node.line))?;
    if let Some(debt) = e.max_debt {
        let max_debt = whole("max_debt", debt, 0)?;
        limit = limit
            .with_max_debt(max_debt)
            .map_err(|x| shape_at(x, debt.line))?;
    }
    prefetch_of(e, limit)
}

/// `prefetch: N` and `prefetch_ttl: D` (default 1s) on a GCRA limit.
#[cfg(any(feature = "yaml", feature = "admin"))]
fn prefetch_of(e: &Entry<'_>, limit: Limit) -> Result<Limit, FieldError> {
    let Some(units_node) = e.prefetch else {
        return match e.prefetch_ttl {
            Some(ttl) => Err(at(Problem::MissingField("prefetch"), ttl.line)),
            None => Ok(limit),
        };
    };
    let units = positive("prefetch", units_node)?;
    let ttl_us = match e.prefetch_ttl {
        Some(n) => duration_of("prefetch_ttl", n)?,
        None => limit.prefetch_ttl_us(),
    };
    limit
        .with_prefetch(units, std::time::Duration::from_micros(ttl_us))
        .map_err(|x| {
            let line = match (&x, e.prefetch_ttl) {
                (LimitError::PrefetchTtl { .. }, Some(ttl)) => ttl.line,
                _ => units_node.line,
            };
            shape_at(x, line)
        })
}
