//! What burst tiers answer the seam (`docs/burst-tiers.md`).

use super::ceil_secs_us;
use super::{ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use crate::algo::tiers::{Tier, TieredLimit};

impl Shape for TieredLimit {
    /// The sum of the tiers' limits.
    fn max_cost(&self) -> u64 {
        self.capacity()
    }

    /// A charge above the capacity is refused.
    fn charges_any_cost(&self) -> bool {
        false
    }

    fn settle_bound(&self) -> Option<u64> {
        Some(self.capacity())
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
    #[cfg(feature = "metrics")]
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

    fn retry_after_again(&self, _: u64, _: u64) -> Option<u64> {
        None
    }

    /// Tiers are not carried back after an outage.
    fn charge_back(&self) -> Option<ChargeBack> {
        None
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
}

/// The limit and the window (microseconds) of the tier serving the client (the first when
/// none is named).
fn serving_tier(t: &TieredLimit, n: &Numbers<'_>) -> Option<(u64, u64)> {
    let number = n.tiers.map_or(1, |g| usize::from(g.tier));
    let tier = t.tier(number).or(t.tiers().first())?;
    Some((tier.limit(), tier.window_us()))
}
