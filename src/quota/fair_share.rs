//! What a fair share answers the seam (`docs/fair-share.md`): what a decision shows is its
//! budget's (a GCRA bucket), so most answers are the budget's own; and its fields read from
//! an entry.

use std::sync::Arc;

#[cfg(feature = "replay")]
use super::SizedAs;
#[cfg(any(feature = "yaml", feature = "admin"))]
use super::entry::{
    Entry, FieldError, Node, Problem, Value, at, duration_of, fields_of, positive, shape_at, whole,
    wrong_shape,
};
use super::{Capabilities, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, Settles, StoredFormError, Waits, json_fields, stored_shape};
use crate::algo::fair_share::FairShare;
use crate::time::format_duration_us;

impl Shape for FairShare {
    /// One state per limit, whose budget an override keeps; waited for and settled as its
    /// budget is (a charge is taken whole up to the burst, as a spend); decided in the store
    /// every time (who else is active is the decision), so never prefetched; the fallback
    /// decides each instance's share of the budget alone, so nothing is charged back (who was
    /// active is not known).
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: None,
            learns: None,
            state_per_limit: true,
            keeps_on_override: Some(keeps_budget),
            charge_back: None,
            waits: Waits::Timed(|f, retry_after_us, reset_after_us| {
                super::gcra::units_return_us(f.budget(), retry_after_us, reset_after_us)
            }),
            settles: Settles::UpToMaxCost,
            retry_after_again: Some(|f, reset_after_us, granted| {
                super::gcra::retry_after_again(f.budget(), reset_after_us, granted)
            }),
            prefetches: false,
            across_regions: Err("a fair share (fair_share)"),
            undone_by_value: false,
        }
    }

    fn max_cost(&self) -> u64 {
        self.budget().burst()
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        Shape::fixed_policy(self.budget())
    }

    fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        Shape::shown(self.budget(), n, window)
    }

    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, n: &Numbers<'_>) -> u64 {
        Shape::size(self.budget(), n)
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        let mut d = Shape::describe(self.budget());
        d.push(("kind", Text("fair_share".into())));
        d.push(("weight", Number(self.weight())));
        d.push(("min", Number(self.min())));
        d.push(("refresh", Text(format_duration_us(self.refresh_us()))));
        d.push(("new_ids", Number(self.new_ids())));
        d
    }

    fn unspent(&self, remaining: u64, reset_after_us: u64, granted: u64) -> Option<(u64, u64)> {
        Shape::unspent(self.budget(), remaining, reset_after_us, granted)
    }

    #[cfg(feature = "admin")]
    fn describe_seen(&self, _: u64, _: u64) -> Vec<(&'static str, super::Described)> {
        Vec::new()
    }

    /// The budget scales; weights and minimums (a minimum never above the scaled count) stay.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        let budget = super::gcra::scaled_limit(self.budget(), scale)?;
        let min = self.min().min(budget.count());
        Ok(Quota::FairShare(Arc::new(
            FairShare::new(budget)?
                .with_weight(self.weight())?
                .with_min(min)?
                .with_refresh_us(self.refresh_us())?
                .with_new_ids(self.new_ids())?,
        )))
    }

    /// The budget's fields, and `fair_share: {weight, min, refresh, new_ids}` (`refresh_us`
    /// stored).
    fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        Shape::write_json(self.budget(), form, v);
        v["fair_share"] = match form {
            Form::Stored => serde_json::json!({
                "weight": self.weight(),
                "min": self.min(),
                "refresh_us": self.refresh_us(),
                "new_ids": self.new_ids(),
            }),
            Form::Api => serde_json::json!({
                "weight": self.weight(),
                "min": self.min(),
                "refresh": format_duration_us(self.refresh_us()),
                "new_ids": self.new_ids(),
            }),
        };
    }

    /// One budget every id shares.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Budget(self.budget())
    }

    fn shape_name(&self) -> &'static str {
        "a fair share"
    }
}

/// The budget is the limit's, shared by every id: an id's override changes its weight and
/// minimum only.
fn keeps_budget(f: &FairShare, other: &Quota) -> Result<(), &'static str> {
    match other {
        Quota::FairShare(o) if f.same_budget(o) => Ok(()),
        _ => {
            Err("the fair share's budget, refresh and new_ids (an override changes weight and min)")
        }
    }
}

/// A fair share's fields: a GCRA budget's, and `fair_share` (each of its fields optional, with
/// the YAML file's defaults), if `fair_share` is there.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    #[derive(serde::Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct Fair {
        weight: Option<u64>,
        min: Option<u64>,
        refresh_us: Option<u64>,
        new_ids: Option<u64>,
    }
    let fair = fields.get("fair_share")?;
    let mut rest = fields.clone();
    if let Some(o) = rest.as_object_mut() {
        o.remove("fair_share");
    }
    let read = || -> Result<Quota, StoredFormError> {
        let f: Fair = if fair.is_null() {
            Fair::default()
        } else {
            json_fields(fair)?
        };
        let budget = match super::gcra::read_json(&rest) {
            Some(Ok(Quota::Gcra(l))) => l,
            Some(Err(e)) => return Err(e),
            _ => return Err(StoredFormError::NoBudget),
        };
        let mut share = FairShare::new(budget).map_err(stored_shape)?;
        share = share
            .with_weight(f.weight.unwrap_or(1))
            .and_then(|s| s.with_min(f.min.unwrap_or(0)))
            .map_err(stored_shape)?;
        if let Some(us) = f.refresh_us {
            share = share.with_refresh_us(us).map_err(stored_shape)?;
        }
        if let Some(p) = f.new_ids {
            share = share.with_new_ids(p).map_err(stored_shape)?;
        }
        Ok(Quota::FairShare(Arc::new(share)))
    };
    Some(read())
}

impl From<FairShare> for Quota {
    fn from(s: FairShare) -> Self {
        Quota::FairShare(Arc::new(s))
    }
}

/// The fields of `fair_share: {...}`, each optional.
#[cfg(any(feature = "yaml", feature = "admin"))]
const FAIR_SHARE_FIELDS: [&str; 4] = ["weight", "min", "refresh", "new_ids"];

/// A GCRA budget (`burst`, `count`, `period`) shared fairly, in an entry: `fair_share:
/// {weight, min, refresh, new_ids}` (`node`: its map), each optional (`fair_share: {}` for the
/// defaults), `docs/fair-share.md`.
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) fn read_entry(e: &Entry<'_>, node: &Node) -> Result<FairShare, FieldError> {
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape(
            "a map: {weight, min, refresh, new_ids} (each optional)",
            node,
        ));
    };
    let [weight, min, refresh, new_ids] = fields_of(entries, &FAIR_SHARE_FIELDS, "a field name")?;
    if let Some(p) = e.prefetch {
        return Err(at(
            Problem::ConflictingFields("prefetch", "fair_share"),
            p.line,
        ));
    }
    let budget = super::gcra::read_entry(e)?;
    let mut share = FairShare::new(budget).map_err(|x| shape_at(x, node.line))?;
    if let Some(n) = weight {
        share = share
            .with_weight(positive("weight", n)?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    if let Some(n) = min {
        share = share
            .with_min(whole("min", n, 0)?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    if let Some(n) = refresh {
        share = share
            .with_refresh_us(duration_of("refresh", n)?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    if let Some(n) = new_ids {
        share = share
            .with_new_ids(whole("new_ids", n, 0)?)
            .map_err(|x| shape_at(x, n.line))?;
    }
    Ok(share)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::gcra::Limit;

    /// The fallback's share of a fair share: the budget scaled as a GCRA limit is, the weight
    /// kept, a minimum never above the scaled count.
    #[test]
    fn a_fallback_scales_the_budget_and_keeps_the_weight() {
        let budget = Limit::from_micros(100, 100, 1_000_000).unwrap();
        let share = FairShare::new(budget)
            .unwrap()
            .with_weight(3)
            .unwrap()
            .with_min(100)
            .unwrap();
        let quota = Quota::from(share);
        let Quota::FairShare(half) = quota.scaled(50, 1).unwrap() else {
            panic!("a fair share scales to a fair share");
        };
        assert_eq!(half.budget().burst(), 50);
        assert_eq!(half.budget().period_us(), 2_000_000);
        assert_eq!((half.weight(), half.min()), (3, 100));
        assert_eq!(
            Quota::from(budget).scaled(50, 1).unwrap(),
            Quota::Gcra(*half.budget())
        );
    }

    /// Its fields as JSON read back as written, in both forms; a budget is required.
    #[test]
    fn its_json_reads_back_in_both_forms() {
        let share = FairShare::new(Limit::from_micros(10, 20, 1_000_000).unwrap())
            .unwrap()
            .with_weight(2)
            .unwrap();
        let quota = Quota::from(share);
        for form in [Form::Stored, Form::Api] {
            let mut v = serde_json::json!({});
            quota.write_json(form, &mut v);
            assert_eq!(super::super::read_in(form, &v).unwrap(), quota, "{v}");
        }
        assert!(super::super::read_in(Form::Api, &serde_json::json!({"fair_share": {}})).is_err());
    }
}
