//! What a concurrency limit answers the seam (`docs/concurrency.md`), and its fields read
//! from an entry.

#[cfg(feature = "replay")]
use super::SizedAs;
#[cfg(any(feature = "yaml", feature = "admin"))]
use super::entry::{Entry, FieldError, Node, Problem, at, duration_of, positive, shape_at};
use super::{Capabilities, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, Settles, StoredFormError, Waits, json_fields, names_any, stored_shape};
use crate::algo::concurrency::ConcurrencyLimit;
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::algo::concurrency::{ConcurrencyError, DEFAULT_LEASE_US};
use crate::time::{format_duration_us, us};

impl Shape for ConcurrencyLimit {
    /// Leases, and nothing else: a slot frees when a request ends, which no wait can know,
    /// and is given back then, never settled.
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: Some(self.lease_us()),
            learns: None,
            state_per_limit: false,
            keeps_on_override: None,
            charge_back: None,
            waits: Waits::Never,
            settles: Settles::Never,
            retry_after_again: None,
            prefetches: false,
            across_regions: Err("a concurrency limit"),
            undone_by_value: false,
        }
    }

    /// A request holds one slot.
    fn max_cost(&self) -> u64 {
        1
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

    #[cfg(any(feature = "metrics", feature = "replay"))]
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

    /// Its slots scale.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        Ok(Quota::Concurrency(
            ConcurrencyLimit::from_micros(scale.of(self.max(), 1), self.lease_us())?
                .retry_after(crate::time::us(self.retry_after_us()))?,
        ))
    }

    /// As the YAML file writes it in the API (`concurrency`, `lease`, `retry_after`); stored,
    /// `concurrency: {max, lease_us, retry_after_us}`.
    fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        match form {
            Form::Stored => {
                v["concurrency"] = serde_json::json!({
                    "max": self.max(),
                    "lease_us": self.lease_us(),
                    "retry_after_us": self.retry_after_us(),
                });
            }
            Form::Api => {
                v["concurrency"] = self.max().into();
                v["lease"] = format_duration_us(self.lease_us()).into();
                v["retry_after"] = format_duration_us(self.retry_after_us()).into();
            }
        }
    }

    /// Slots held for a request's duration.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Slots {
            max: self.max(),
            adaptive: false,
        }
    }

    fn shape_name(&self) -> &'static str {
        "a concurrency limit"
    }
}

/// A concurrency limit's fields (`concurrency`, with `lease` and `retry_after` in the API,
/// each with the YAML file's default), if it is there.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Slots {
        max: u64,
        lease_us: u64,
        retry_after_us: u64,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stored {
        concurrency: Slots,
    }
    if !names_any(fields, &["concurrency", "lease", "retry_after"]) {
        return None;
    }
    let slots = json_fields(fields).map(|s: Stored| s.concurrency);
    Some(slots.and_then(|s| {
        ConcurrencyLimit::from_micros(s.max, s.lease_us)
            .and_then(|l| l.retry_after(us(s.retry_after_us)))
            .map(Quota::Concurrency)
            .map_err(stored_shape)
    }))
}

/// `concurrency: N` in an entry, with an optional `lease` (default 60s) and `retry_after`
/// (default 1s) beside it (`max_node`: `concurrency`'s node).
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) fn read_entry(e: &Entry<'_>, max_node: &Node) -> Result<ConcurrencyLimit, FieldError> {
    if let Some((name, n)) = e.rate_field() {
        return Err(at(Problem::ConflictingFields("concurrency", name), n.line));
    }
    let max = positive("concurrency", max_node)?;
    let lease_us = match e.lease {
        Some(n) => duration_of("lease", n)?,
        None => DEFAULT_LEASE_US,
    };
    let mut limit = ConcurrencyLimit::from_micros(max, lease_us).map_err(|x| {
        // A lease error is on the lease's line; `concurrency` above the cap on its own.
        let line = match (&x, e.lease) {
            (ConcurrencyError::TooMany { .. }, _) | (_, None) => max_node.line,
            (_, Some(lease)) => lease.line,
        };
        shape_at(x, line)
    })?;
    if let Some(n) = e.retry_after {
        limit = limit
            .retry_after(us(duration_of("retry_after", n)?))
            .map_err(|x| shape_at(x, n.line))?;
    }
    Ok(limit)
}
