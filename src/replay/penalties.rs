//! The attacker's budget of each penalty limit in a plan (`docs/replay.md`, "The plan";
//! `docs/penalties.md`, "The attacker's budget"): the most counted units one key can get
//! through a limit's ladder in a day, under each policy, computed from the ladders alone.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::Limits;

/// A day, in microseconds: the span of the budget.
const DAY_US: u64 = 86_400_000_000;

/// The most counted units (failed logins, ...) one key can get through a ladder in a day.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PerDay {
    /// The units: exactly the most, or a bound above it when `exact` is false.
    pub most: u64,
    /// Whether `most` is exactly the most a key can get (a ladder whose bans are so short that
    /// a day holds thousands gets a bound above it).
    pub exact: bool,
}

/// A limit's penalty ladder in a plan: what one key can get through it per day under each
/// policy (`None`: no ladder there).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PenaltyPlan {
    /// Under the current policy.
    pub current: Option<PerDay>,
    /// Under the candidate.
    pub candidate: Option<PerDay>,
}

/// Every limit with a ladder in either policy, by name.
pub(crate) fn budgets(current: &Limits, candidate: &Limits) -> BTreeMap<String, PenaltyPlan> {
    let mut out: BTreeMap<String, PenaltyPlan> = BTreeMap::new();
    for (side, limits) in [current, candidate].into_iter().enumerate() {
        for name in limits.names() {
            let Some(ladder) = limits.penalty(name) else {
                continue;
            };
            let budget = ladder.budget(DAY_US);
            let per_day = Some(PerDay {
                most: budget.units,
                exact: budget.exact,
            });
            let plan = out.entry(name.as_str().to_owned()).or_default();
            match side {
                0 => plan.current = per_day,
                _ => plan.candidate = per_day,
            }
        }
    }
    out
}
