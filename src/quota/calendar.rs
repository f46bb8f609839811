//! What a calendar quota answers the seam (`docs/calendar.md`).

use std::sync::Arc;

use super::{ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use crate::algo::calendar::CalendarQuota;

impl Shape for CalendarQuota {
    /// A period's count.
    fn max_cost(&self) -> u64 {
        self.count()
    }

    /// A charge takes its whole cost (the overrun ends with the period).
    fn charges_any_cost(&self) -> bool {
        true
    }

    fn settle_bound(&self) -> Option<u64> {
        Some(u64::MAX)
    }

    fn waits(&self) -> bool {
        true
    }

    fn units_return_us(&self, _: u64, _: u64) -> u64 {
        0
    }

    fn holds_leases(&self) -> bool {
        false
    }

    fn prefetches(&self) -> bool {
        false
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        None
    }

    /// The period's count and length (of the period decided in, by the store's clock); `r`
    /// holds until the renewal.
    fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        Some(Shown {
            q: self.count(),
            w: if window { u64::from(n.period_s) } else { 0 },
            t_us: n.reset_after_us,
            concurrency: false,
        })
    }

    #[cfg(feature = "metrics")]
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
                Text(crate::algo::calendar::instant_text(
                    self.period_at(now_us).1,
                )),
            ),
        ]
    }

    fn retry_after_again(&self, _: u64, _: u64) -> Option<u64> {
        None
    }

    /// Its units count until their period ends.
    fn charge_back(&self) -> Option<ChargeBack> {
        Some(ChargeBack {
            count: self.count(),
            repaid_every_us: 0,
        })
    }

    /// Its count scales.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        Ok(Quota::Calendar(Arc::new(
            self.scaled(scale.of(self.count(), scale.cost))?,
        )))
    }
}
