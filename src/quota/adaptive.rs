//! What an adaptive concurrency limit answers the seam (`docs/adaptive-concurrency.md`): its
//! slots are a concurrency limit's, their number the key's own now.

use std::sync::Arc;

#[cfg(feature = "replay")]
use super::SizedAs;
use super::{Capabilities, Numbers, Quota, Scale, Shape, ShapeError, Shown};
use super::{Form, Settles, StoredFormError, Waits, json_fields, stored_shape};
use crate::algo::adaptive::{Adaptive, AdaptiveConcurrency, Algorithm};
use crate::completion::Measure;
use crate::time::{format_duration_us, us};

#[cfg(any(feature = "yaml", feature = "admin"))]
mod entry;
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(super) use entry::read_entry;

/// Most answers are its slots' (a concurrency limit's): a request holds one, given back when
/// it ends, never waited for, never settled or charged back.
impl Shape for AdaptiveConcurrency {
    /// Its slots' leases, and every request that held one moves the key's number; with a
    /// shared capacity, every key's state is kept with the limit's, and an override keeps the
    /// capacity and headroom (shared by all ids).
    #[inline]
    fn capabilities(&self) -> Capabilities<Self> {
        Capabilities {
            lease_us: Some(self.slots().lease_us()),
            learns: Some(self.measured()),
            state_per_limit: self.shared_capacity().is_some(),
            keeps_on_override: Some(keeps_capacity),
            charge_back: None,
            waits: Waits::Never,
            settles: Settles::Never,
            retry_after_again: None,
            prefetches: false,
            across_regions: Err("an adaptive concurrency limit"),
            undone_by_value: false,
        }
    }

    fn max_cost(&self) -> u64 {
        Shape::max_cost(self.slots())
    }

    fn fixed_policy(&self) -> Option<(u64, u64)> {
        Shape::fixed_policy(self.slots())
    }

    /// The key's slots when it was decided (`q`), and a denial's hint.
    fn shown(&self, n: &Numbers<'_>, _: bool) -> Option<Shown> {
        let q = if n.own.number > 0 {
            u64::from(n.own.number)
        } else {
            self.adaptive().initial()
        };
        Some(Shown {
            q,
            w: 0,
            t_us: n.retry_after_us,
            concurrency: true,
        })
    }

    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, n: &Numbers<'_>) -> u64 {
        if n.own.number > 0 {
            u64::from(n.own.number)
        } else {
            self.adaptive().initial()
        }
    }

    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, super::Described)> {
        use super::Described::{Number, Text};
        let a = self.adaptive();
        vec![
            ("kind", Text("adaptive concurrency".into())),
            ("min", Number(a.min())),
            ("initial", Number(a.initial())),
            ("max", Number(a.max())),
            ("algorithm", Text(a.algorithm().name().into())),
            ("window", Text(format_duration_us(self.window_us()))),
            ("idle_reset", Text(format_duration_us(self.idle_reset_us()))),
            ("lease", Text(format_duration_us(self.slots().lease_us()))),
            ("capacity", Number(self.shared_capacity().unwrap_or(0))),
            ("headroom", Number(self.shared_headroom().unwrap_or(0))),
        ]
    }

    fn unspent(&self, remaining: u64, reset_after_us: u64, _: u64) -> Option<(u64, u64)> {
        Some((
            remaining.saturating_add(1).min(self.adaptive().max()),
            reset_after_us,
        ))
    }

    #[cfg(feature = "admin")]
    fn describe_seen(&self, _: u64, _: u64) -> Vec<(&'static str, super::Described)> {
        Vec::new()
    }

    /// Its least, first and most slots scale; what it learns does not.
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError> {
        let a = self.adaptive();
        let adaptive = Adaptive::new(
            scale.of(a.min(), 1),
            scale.of(a.initial(), 1),
            scale.of(a.max(), 1),
            a.algorithm(),
        )
        .or_else(|_| Adaptive::new(1, 1, scale.of(a.max(), 1), a.algorithm()))
        .map_err(ShapeError::Adaptive)?;
        let mut scaled = AdaptiveConcurrency::new(adaptive)
            .window(us(self.window_us()))
            .and_then(|l| l.window_completions(self.window_completions_count()))
            .and_then(|l| l.idle_reset(us(self.idle_reset_us())))
            .and_then(|l| l.lease(us(self.slots().lease_us())))
            .and_then(|l| l.retry_after(us(self.slots().retry_after_us())))
            .map_err(ShapeError::Adaptive)?;
        scaled = scaled.measure(self.measured());
        if let Some(c) = self.shared() {
            let slots = scale.of(c.slots, 1);
            let headroom = match c.headroom {
                0 => 0,
                h => scale.of(h, 1).min(slots),
            };
            scaled = scaled
                .capacity(slots)
                .and_then(|l| l.headroom(headroom))
                .map_err(ShapeError::Adaptive)?;
        }
        Ok(Quota::Adaptive(Arc::new(scaled)))
    }

    /// `concurrency: {adaptive: {...}}` beside `lease` and `retry_after` in the API (as the
    /// YAML file writes it); stored, every number in microseconds and thousandths.
    fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        let s = Settings::of(self);
        match form {
            Form::Stored => {
                v["concurrency"] = serde_json::json!({ "adaptive": s });
            }
            Form::Api => {
                v["concurrency"] = serde_json::json!({ "adaptive": s.api() });
                v["lease"] = format_duration_us(self.slots().lease_us()).into();
                v["retry_after"] = format_duration_us(self.slots().retry_after_us()).into();
            }
        }
    }

    /// Slots held for a request's duration, at most its `max`.
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_> {
        SizedAs::Slots {
            max: self.adaptive().max(),
            adaptive: true,
        }
    }

    fn shape_name(&self) -> &'static str {
        "an adaptive concurrency limit"
    }
}

/// What an adaptive limit's override keeps: the capacity and headroom its ids share.
fn keeps_capacity(a: &AdaptiveConcurrency, other: &Quota) -> Result<(), &'static str> {
    match other {
        Quota::Adaptive(o) if o.shared() == a.shared() => Ok(()),
        _ => Err("the adaptive limit's capacity and headroom, shared by all ids"),
    }
}

/// An adaptive limit's numbers as stored (microseconds, thousandths).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    min: u64,
    initial: u64,
    max: u64,
    algorithm: String,
    #[serde(default)]
    smoothing_pm: u64,
    #[serde(default)]
    tolerance_pm: u64,
    #[serde(default)]
    backoff_pm: u64,
    #[serde(default)]
    increase: u64,
    window_us: u64,
    completions: u64,
    idle_reset_us: u64,
    measure: String,
    lease_us: u64,
    retry_after_us: u64,
    /// The capacity the keys share (0: none; absent in what earlier versions stored).
    #[serde(default, skip_serializing_if = "is_zero")]
    capacity: u64,
    /// The capacity's headroom (absent in what earlier versions stored: the default then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    headroom: Option<u64>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Settings {
    fn of(l: &AdaptiveConcurrency) -> Self {
        let a = l.adaptive();
        let (mut smoothing_pm, mut tolerance_pm, mut backoff_pm, mut increase) = (0, 0, 0, 0);
        match a.algorithm() {
            Algorithm::Gradient {
                smoothing_pm: s,
                tolerance_pm: t,
            } => (smoothing_pm, tolerance_pm) = (s, t),
            Algorithm::Aimd {
                backoff_pm: b,
                increase: i,
            } => (backoff_pm, increase) = (b, i),
        }
        Settings {
            min: a.min(),
            initial: a.initial(),
            max: a.max(),
            algorithm: a.algorithm().name().into(),
            smoothing_pm,
            tolerance_pm,
            backoff_pm,
            increase,
            window_us: l.window_us(),
            completions: l.window_completions_count(),
            idle_reset_us: l.idle_reset_us(),
            measure: measure_name(l.measured()).into(),
            lease_us: l.slots().lease_us(),
            retry_after_us: l.slots().retry_after_us(),
            capacity: l.shared_capacity().unwrap_or(0),
            headroom: l.shared_headroom(),
        }
    }

    /// As the YAML file writes it (percentages, durations as text).
    fn api(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "min": self.min,
            "initial": self.initial,
            "max": self.max,
            "algorithm": self.algorithm,
            "window": format_duration_us(self.window_us),
            "completions": self.completions,
            "idle_reset": format_duration_us(self.idle_reset_us),
            "measure": self.measure,
        });
        if self.algorithm == "gradient" {
            v["smoothing"] = (self.smoothing_pm / 10).into();
            v["tolerance"] = (self.tolerance_pm / 10).into();
        } else {
            v["backoff"] = (self.backoff_pm / 10).into();
            v["increase"] = self.increase.into();
        }
        if self.capacity > 0 {
            v["capacity"] = self.capacity.into();
        }
        if let Some(h) = self.headroom {
            v["headroom"] = h.into();
        }
        v
    }

    fn limit(&self) -> Result<AdaptiveConcurrency, StoredFormError> {
        let algorithm = match self.algorithm.as_str() {
            "gradient" => Algorithm::Gradient {
                smoothing_pm: self.smoothing_pm,
                tolerance_pm: self.tolerance_pm,
            },
            "aimd" => Algorithm::Aimd {
                backoff_pm: self.backoff_pm,
                increase: self.increase,
            },
            other => {
                return Err(StoredFormError::Unknown {
                    field: "algorithm",
                    found: other.to_owned(),
                    known: "gradient or aimd",
                });
            }
        };
        let measure = match self.measure.as_str() {
            "head" => Measure::Head,
            "body_end" => Measure::BodyEnd,
            other => {
                return Err(StoredFormError::Unknown {
                    field: "measure",
                    found: other.to_owned(),
                    known: "head or body_end",
                });
            }
        };
        let adaptive =
            Adaptive::new(self.min, self.initial, self.max, algorithm).map_err(stored_shape)?;
        AdaptiveConcurrency::new(adaptive)
            .window(us(self.window_us))
            .and_then(|l| l.window_completions(self.completions))
            .and_then(|l| l.idle_reset(us(self.idle_reset_us)))
            .and_then(|l| l.lease(us(self.lease_us)))
            .and_then(|l| l.retry_after(us(self.retry_after_us)))
            .map(|l| l.measure(measure))
            .and_then(|l| match self.capacity {
                0 => Ok(l),
                c => l.capacity(c),
            })
            .and_then(|l| match self.headroom {
                Some(h) => l.headroom(h),
                None => Ok(l),
            })
            .map_err(stored_shape)
    }
}

pub(crate) fn measure_name(m: Measure) -> &'static str {
    match m {
        Measure::Head => "head",
        Measure::BodyEnd => "body_end",
    }
}

/// An adaptive limit's fields (`concurrency: {adaptive: ...}`), if they are there.
pub(super) fn read_json(fields: &serde_json::Value) -> Option<Result<Quota, StoredFormError>> {
    fields.get("concurrency")?.get("adaptive")?;
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Stored {
        concurrency: Wrapped,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wrapped {
        adaptive: Settings,
    }
    Some(
        json_fields(fields)
            .and_then(|s: Stored| s.concurrency.adaptive.limit())
            .map(|l| Quota::Adaptive(Arc::new(l))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit() -> AdaptiveConcurrency {
        AdaptiveConcurrency::new(Adaptive::aimd(2, 10, 40).unwrap())
            .window_completions(20)
            .unwrap()
            .idle_reset(std::time::Duration::from_secs(90))
            .unwrap()
            .measure(Measure::BodyEnd)
            .capacity(60)
            .unwrap()
    }

    /// Its fields as JSON read back as written, in both forms, for both algorithms.
    #[test]
    fn its_json_reads_back_in_both_forms() {
        let gradient = AdaptiveConcurrency::new(
            Adaptive::new(
                1,
                5,
                9,
                Algorithm::Gradient {
                    smoothing_pm: 300,
                    tolerance_pm: 2000,
                },
            )
            .unwrap(),
        );
        for quota in [Quota::from(limit()), Quota::from(gradient)] {
            for form in [Form::Stored, Form::Api] {
                let mut v = serde_json::json!({});
                quota.write_json(form, &mut v);
                assert_eq!(super::super::read_in(form, &v).unwrap(), quota, "{v}");
            }
        }
        // A headroom set reads back; none, as earlier versions stored it, is the default.
        let kept = Quota::from(limit().headroom(7).unwrap());
        for form in [Form::Stored, Form::Api] {
            let mut v = serde_json::json!({});
            kept.write_json(form, &mut v);
            assert_eq!(super::super::read_in(form, &v).unwrap(), kept, "{v}");
            v["concurrency"]["adaptive"]
                .as_object_mut()
                .unwrap()
                .remove("headroom");
            let Ok(Quota::Adaptive(old)) = super::super::read_in(form, &v) else {
                panic!("{v}");
            };
            assert_eq!(old.shared_headroom(), Some(12), "{v}");
        }
        // A headroom without a capacity is refused, as in the file.
        let alone =
            serde_json::json!({"concurrency": {"adaptive": {"min": 1, "max": 2, "headroom": 1}}});
        assert!(super::super::read_in(Form::Api, &alone).is_err());
        let bad = serde_json::json!({"concurrency": {"adaptive": {"min": 3, "max": 2}}});
        assert!(super::super::read_in(Form::Api, &bad).is_err());
        let unknown =
            serde_json::json!({"concurrency": {"adaptive": {"min": 1, "max": 2, "x": 1}}});
        assert!(super::super::read_in(Form::Api, &unknown).is_err());
    }

    /// An omitted field takes the default the file gives it: `initial` the `min` (before, the
    /// API answered `missing field initial` to a body the file takes).
    #[test]
    fn the_api_takes_what_the_file_takes() {
        let body =
            serde_json::json!({"concurrency": {"adaptive": {"min": 2, "max": 20, "capacity": 40}}});
        let from_api = super::super::read_in(Form::Api, &body).unwrap();
        let limits = crate::config::Limits::from_yaml_str(
            "S:\n  kind: any\n  concurrency:\n    adaptive: {min: 2, max: 20, capacity: 40}\n",
            None,
        )
        .unwrap();
        let name = limits.name("S").unwrap();
        assert_eq!(limits.default_limit(name), Some(&from_api));
        let Quota::Adaptive(a) = from_api else {
            panic!("an adaptive limit");
        };
        assert_eq!(a.adaptive().initial(), 2);
    }

    /// A fallback's share scales its least, first and most slots, never below 1, and keeps
    /// the rest.
    #[test]
    fn a_fallback_scales_its_slots() {
        let Quota::Adaptive(half) = Quota::from(limit()).scaled(50, 1).unwrap() else {
            panic!("an adaptive limit scales to one");
        };
        let a = half.adaptive();
        assert_eq!((a.min(), a.initial(), a.max()), (1, 5, 20));
        assert_eq!(half.window_completions_count(), 20);
        assert_eq!(half.measured(), Measure::BodyEnd);
        let Quota::Adaptive(tiny) = Quota::from(limit()).scaled(1, 1).unwrap() else {
            panic!("an adaptive limit scales to one");
        };
        assert_eq!((tiny.adaptive().min(), tiny.adaptive().max()), (1, 1));
    }
}
