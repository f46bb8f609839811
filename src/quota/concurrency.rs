//! What a concurrency limit answers the seam (`docs/concurrency.md`).

use super::{ChargeBack, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use crate::algo::concurrency::ConcurrencyLimit;

impl Shape for ConcurrencyLimit {
    /// A request holds one slot.
    fn max_cost(&self) -> u64 {
        1
    }

    fn charges_any_cost(&self) -> bool {
        false
    }

    /// A slot in flight is given back when the request ends, never settled.
    fn settle_bound(&self) -> Option<u64> {
        None
    }

    /// A slot frees when a request ends, which no wait can know.
    fn waits(&self) -> bool {
        false
    }

    fn units_return_us(&self, _: u64, _: u64) -> u64 {
        0
    }

    fn holds_leases(&self) -> bool {
        true
    }

    fn prefetches(&self) -> bool {
        false
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        None
    }

    /// The slots, and a denial's hint (else nothing to wait for).
    fn shown(&self, n: &Numbers<'_>, _: bool) -> Option<Shown> {
        Some(Shown {
            q: self.max(),
            w: 0,
            t_us: n.retry_after_us,
            concurrency: true,
        })
    }

    #[cfg(feature = "metrics")]
    fn size(&self, _: &Numbers<'_>) -> u64 {
        self.max()
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        vec![
            ("kind", Text("concurrency".into())),
            ("concurrency", Number(self.max())),
            (
                "lease",
                Text(crate::time::format_duration_us(self.lease_us())),
            ),
        ]
    }

    /// A slot was not taken: it is still free.
    fn unspent(&self, remaining: u64, reset_after_us: u64, _: u64) -> Option<(u64, u64)> {
        Some((remaining.saturating_add(1).min(self.max()), reset_after_us))
    }

    #[cfg(feature = "admin")]
    fn describe_seen(&self, _: u64, _: u64) -> Vec<(&'static str, super::Described)> {
        Vec::new()
    }

    fn retry_after_again(&self, _: u64, _: u64) -> Option<u64> {
        None
    }

    /// A slot the fallback handed out is recorded as a lease of its own (`layer/lease.rs`).
    fn charge_back(&self) -> Option<ChargeBack> {
        None
    }

    /// Its slots scale.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        Ok(Quota::Concurrency(
            ConcurrencyLimit::from_micros(scale.of(self.max(), 1), self.lease_us())?
                .retry_after(crate::time::us(self.retry_after_us()))?,
        ))
    }
}
