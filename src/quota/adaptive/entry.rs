//! An adaptive concurrency limit's fields read from an entry: `concurrency: {adaptive: {min,
//! initial, max, algorithm, smoothing, tolerance, backoff, increase, window, completions,
//! idle_reset, measure, capacity, headroom}}`, with an optional `lease` and `retry_after`
//! beside it (`docs/adaptive-concurrency.md`); the thousandths of the algorithms are written
//! as whole percentages.

use crate::algo::adaptive::{
    Adaptive, AdaptiveConcurrency, AdaptiveError, Algorithm, DEFAULT_BACKOFF_PM, DEFAULT_INCREASE,
    DEFAULT_SMOOTHING_PM, DEFAULT_TOLERANCE_PM,
};
use crate::completion::Measure;
use crate::quota::entry::{
    Entry, FieldError, Node, Problem, Value, as_str, at, duration_of, fields_of, positive,
    shape_at, whole, wrong_shape,
};
use crate::time::us;

/// `concurrency: {adaptive: {...}}` (`node`: `concurrency`'s node, `entries` its map).
pub(crate) fn read_entry(
    e: &Entry<'_>,
    node: &Node,
    entries: &[(Node, Node)],
) -> Result<AdaptiveConcurrency, FieldError> {
    if let Some((name, n)) = e.rate_field() {
        return Err(at(Problem::ConflictingFields("concurrency", name), n.line));
    }
    let a = AdaptiveNodes::read(node, entries)?;
    let missing = |field| at(Problem::MissingField(field), a.map.line);
    let min = positive("min", a.min.ok_or_else(|| missing("min"))?)?;
    let max = positive("max", a.max.ok_or_else(|| missing("max"))?)?;
    let initial = match a.initial {
        Some(n) => positive("initial", n)?,
        None => min,
    };
    let (algo, algorithm_line) = a.algorithm()?;
    let limit = AdaptiveConcurrency::new(
        Adaptive::new(min, initial, max, algo).map_err(|x| bad(x, algorithm_line))?,
    );
    a.with_options(limit, e)
}

/// An adaptive limit's error on the line of the field that made it.
fn bad(e: AdaptiveError, n: &Node) -> FieldError {
    shape_at(e, n.line)
}

/// The fields of `concurrency: {adaptive: {...}}`, each once.
struct AdaptiveNodes<'a> {
    /// The `{...}` map itself (a missing field's line).
    map: &'a Node,
    min: Option<&'a Node>,
    initial: Option<&'a Node>,
    max: Option<&'a Node>,
    algorithm: Option<&'a Node>,
    smoothing: Option<&'a Node>,
    tolerance: Option<&'a Node>,
    backoff: Option<&'a Node>,
    increase: Option<&'a Node>,
    window: Option<&'a Node>,
    completions: Option<&'a Node>,
    idle_reset: Option<&'a Node>,
    measure: Option<&'a Node>,
    capacity: Option<&'a Node>,
    headroom: Option<&'a Node>,
}

/// The fields an adaptive limit's map may hold.
const ADAPTIVE_FIELDS: [&str; 14] = [
    "min",
    "initial",
    "max",
    "algorithm",
    "smoothing",
    "tolerance",
    "backoff",
    "increase",
    "window",
    "completions",
    "idle_reset",
    "measure",
    "capacity",
    "headroom",
];

impl<'a> AdaptiveNodes<'a> {
    /// `{adaptive: {...}}` (`entries`, the map of `concurrency`, `node`) read field by field:
    /// an unknown field or one given twice refused on its line.
    fn read(node: &'a Node, entries: &'a [(Node, Node)]) -> Result<Self, FieldError> {
        let map = match entries {
            [(k, v)] if matches!(&k.value, Value::Str(s) if s == "adaptive") => v,
            _ => {
                return Err(wrong_shape(
                    "a number of slots, or {adaptive: {min, initial, max, ...}}",
                    node,
                ));
            }
        };
        let Value::Map(fields) = &map.value else {
            return Err(wrong_shape("a map: {min, initial, max, ...}", map));
        };
        let [
            min,
            initial,
            max,
            algorithm,
            smoothing,
            tolerance,
            backoff,
            increase,
            window,
            completions,
            idle_reset,
            measure,
            capacity,
            headroom,
        ] = fields_of(fields, &ADAPTIVE_FIELDS, "a field name")?;
        Ok(Self {
            map,
            min,
            initial,
            max,
            algorithm,
            smoothing,
            tolerance,
            backoff,
            increase,
            window,
            completions,
            idle_reset,
            measure,
            capacity,
            headroom,
        })
    }

    /// The algorithm (`gradient` unless told) with its parameters or their defaults, and the
    /// line its errors are on; a parameter of the other algorithm refused.
    fn algorithm(&self) -> Result<(Algorithm, &'a Node), FieldError> {
        let percent = |field, n: Option<&Node>, default: u64| -> Result<u64, FieldError> {
            n.map_or(Ok(default), |n| {
                whole(field, n, 0).map(|p| p.saturating_mul(10))
            })
        };
        let name = match self.algorithm {
            Some(n) => as_str(n, "gradient or aimd")?,
            None => "gradient",
        };
        let line = self.algorithm.unwrap_or(self.map);
        let (algo, others) = match name {
            "gradient" => (
                Algorithm::Gradient {
                    smoothing_pm: percent("smoothing", self.smoothing, DEFAULT_SMOOTHING_PM)?,
                    tolerance_pm: percent("tolerance", self.tolerance, DEFAULT_TOLERANCE_PM)?,
                },
                [("backoff", self.backoff), ("increase", self.increase)],
            ),
            "aimd" => (
                Algorithm::Aimd {
                    backoff_pm: percent("backoff", self.backoff, DEFAULT_BACKOFF_PM)?,
                    increase: self
                        .increase
                        .map_or(Ok(DEFAULT_INCREASE), |n| positive("increase", n))?,
                },
                [("smoothing", self.smoothing), ("tolerance", self.tolerance)],
            ),
            _ => return Err(wrong_shape("gradient or aimd", line)),
        };
        for (field, n) in others {
            if let Some(n) = n {
                let problem = Problem::OtherAlgorithm {
                    field,
                    algorithm: algo.name(),
                };
                return Err(at(problem, n.line));
            }
        }
        Ok((algo, line))
    }

    /// `limit` with the options given: the window, the completions, the idle time, where a
    /// latency ends, the capacity and its headroom, and the slots' `lease` and `retry_after`
    /// (the entry's, `e`), each error on its field's line.
    fn with_options(
        &self,
        mut limit: AdaptiveConcurrency,
        e: &Entry<'_>,
    ) -> Result<AdaptiveConcurrency, FieldError> {
        if let Some(n) = self.window {
            limit = limit
                .window(us(duration_of("window", n)?))
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = self.completions {
            limit = limit
                .window_completions(whole("completions", n, 0)?)
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = self.idle_reset {
            limit = limit
                .idle_reset(us(duration_of("idle_reset", n)?))
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = self.measure {
            limit = limit.measure(match as_str(n, "head or body_end")? {
                "head" => Measure::Head,
                "body_end" => Measure::BodyEnd,
                _ => return Err(wrong_shape("head or body_end", n)),
            });
        }
        if let Some(n) = self.capacity {
            limit = limit
                .capacity(positive("capacity", n)?)
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = self.headroom {
            limit = limit
                .headroom(whole("headroom", n, 0)?)
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = e.lease {
            limit = limit
                .lease(us(duration_of("lease", n)?))
                .map_err(|x| bad(x, n))?;
        }
        if let Some(n) = e.retry_after {
            limit = limit
                .retry_after(us(duration_of("retry_after", n)?))
                .map_err(|x| bad(x, n))?;
        }
        Ok(limit)
    }
}
