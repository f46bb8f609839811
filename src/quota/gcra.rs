//! What a GCRA limit answers the seam (`docs/gcra.md`).

use super::ceil_secs_us;
use super::{CHARGED_BACK_FROM_US, ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, json_duration, json_fields, names_any};
use crate::algo::gcra::Limit;
use crate::time::format_duration_us;

impl Shape for Limit {
    fn max_cost(&self) -> u64 {
        self.burst()
    }

    /// A charge takes what fits within the limit's debt.
    fn charges_any_cost(&self) -> bool {
        true
    }

    fn settle_bound(&self) -> Option<u64> {
        Some(u64::MAX)
    }

    fn waits(&self) -> bool {
        true
    }

    /// A denial tells the time its units take to come back: `retry_after = ahead + units -
    /// burst offset`, and `reset_after = ahead`.
    fn units_return_us(&self, retry_after_us: u64, reset_after_us: u64) -> u64 {
        retry_after_us
            .saturating_add(self.burst_offset_us())
            .saturating_sub(reset_after_us)
    }

    fn lease_us(&self) -> Option<u64> {
        None
    }

    fn learns(&self) -> Option<crate::algo::adaptive::Measure> {
        None
    }

    fn prefetches(&self) -> bool {
        self.prefetch() > 0
    }

    /// One state per id.
    fn state_per_limit(&self) -> bool {
        false
    }

    /// Any limit of its shape may replace it for an id.
    fn keeps_on_override(&self, _: &Quota) -> Result<(), &'static str> {
        Ok(())
    }

    fn across_regions(&self) -> Result<(), &'static str> {
        // Prefetched tokens are spent without the store: no region share could count them.
        if self.prefetch() > 0 {
            Err("prefetched tokens (prefetch)")
        } else {
            Ok(())
        }
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

    fn retry_after_again(&self, reset_after_us: u64, granted: u64) -> Option<u64> {
        Some(
            reset_after_us
                .saturating_add(granted.saturating_mul(self.emission_interval_us()))
                .saturating_sub(self.burst_offset_us()),
        )
    }

    /// Of an hour or longer, its units are repaid one per emission interval; a throttle of
    /// seconds is repaid before an outage ends.
    fn charge_back(&self) -> Option<ChargeBack> {
        (self.period_us() >= CHARGED_BACK_FROM_US).then(|| ChargeBack {
            count: self.burst(),
            repaid_every_us: self.emission_interval_us(),
        })
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

    fn shape_name(&self) -> &'static str {
        "a GCRA limit"
    }
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
pub(super) fn read_json(form: Form, fields: &serde_json::Value) -> Option<Result<Quota, String>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stored {
        burst: u64,
        count: u64,
        period_us: u64,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Api {
        burst: u64,
        count: u64,
        period: String,
    }
    if !names_any(fields, &["burst", "count", "period", "period_us"]) {
        return None;
    }
    let limit = match form {
        Form::Stored => json_fields(fields).and_then(|s: Stored| {
            Limit::from_micros(s.burst, s.count, s.period_us).map_err(|e| e.to_string())
        }),
        Form::Api => json_fields(fields).and_then(|a: Api| {
            let period_us = json_duration("period", &a.period)?;
            Limit::from_micros(a.burst, a.count, period_us).map_err(|e| e.to_string())
        }),
    };
    Some(limit.map(Quota::Gcra))
}
