//! A plan's suggestions (`docs/replay.md`, "Suggestions"): the candidate's limit of each shape
//! sized to the log, and the keys it leaves above it. Part of the plan's JSON document, made
//! by the models of `suggest.rs`.

use serde::{Deserialize, Serialize};

/// The candidate's GCRA limit sized so that the log's requests of no more than `target` of
/// its keys are refused (each key's requests counted at their logged cost, 1 without one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Suggested {
    /// The share of keys that may see a refusal.
    pub target: f64,
    /// Keys the suggestion is taken over.
    pub keys: u64,
    /// The smallest burst at the candidate's count and period.
    pub burst: u64,
    /// The smallest count per the candidate's period at the candidate's burst, from a grid
    /// of counts (a quarter of the candidate's to 64 times it, steps of 19%): `None` when
    /// even 64 times is refused for more keys than the target.
    pub count: Option<u64>,
    /// The candidate's period (`1s`, `1h`).
    pub period: String,
    /// The candidate's burst and count, for comparison.
    pub candidate_burst: u64,
    /// See `candidate_burst`.
    pub candidate_count: u64,
}

/// A calendar quota's count sized to the log: each key's most units asked in one of the
/// candidate's periods, at the share of keys a suggestion may leave refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuggestedCount {
    /// The share of keys that may see a refusal.
    pub target: f64,
    /// Keys the suggestion is taken over.
    pub keys: u64,
    /// The smallest count per period that at most `target` of the keys asked more than.
    pub count: u64,
    /// The candidate's period (`day`, `week`, `month`).
    pub period: String,
    /// The candidate's count, for comparison.
    pub candidate_count: u64,
}

/// A concurrency limit's `max` (an adaptive limit's `adaptive.max`) sized to the log: each
/// key's most requests in flight at once (a request held for its logged duration: the layer
/// renews its lease while it lives), at the share of keys a suggestion may leave refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuggestedMax {
    /// The share of keys that may see a refusal.
    pub target: f64,
    /// Keys the suggestion is taken over.
    pub keys: u64,
    /// The smallest `max` that at most `target` of the keys had more requests in flight than.
    pub max: u64,
    /// True when `max` is the model's bound (65,536 requests of one key in flight): at least.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub at_least: bool,
    /// The candidate's `max`, for comparison.
    pub candidate_max: u64,
    /// An adaptive limit: the suggestion is its `max`, the most it may grow to.
    pub adaptive: bool,
}

/// Burst tiers sized to the log, each tier as if it stood alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuggestedTiers {
    /// The share of keys that may see a refusal.
    pub target: f64,
    /// Keys the suggestion is taken over.
    pub keys: u64,
    /// Per tier, in order.
    pub tiers: Vec<SuggestedTier>,
}

/// One tier of [`SuggestedTiers`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuggestedTier {
    /// The tier's window (`1s`, `1m`).
    pub window: String,
    /// The smallest limit that at most the target share of keys asked more units than in any
    /// window of this length (refused requests included).
    pub limit: u64,
    /// The candidate's limit, for comparison.
    pub candidate_limit: u64,
}

/// A fair share's budget sized to the log: every id's requests as one stream, so that the
/// budget alone refuses no more than `target` of the requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuggestedBudget {
    /// The share of the limit's requests the budget may refuse.
    pub target: f64,
    /// Requests the suggestion is taken over.
    pub requests: u64,
    /// The smallest count per period at the candidate's burst, from the grid of counts
    /// ([`Suggested::count`]'s): `None` when even 64 times refuses more than the target.
    pub count: Option<u64>,
    /// The smallest burst at the candidate's count, from the same grid of bursts.
    pub burst: Option<u64>,
    /// The candidate's period.
    pub period: String,
    /// The candidate's budget, for comparison.
    pub candidate_burst: u64,
    /// See `candidate_burst`.
    pub candidate_count: u64,
}

/// A key named apart by a suggestion ([`LimitPlan::heaviest`](super::LimitPlan::heaviest)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heavy {
    /// The id.
    pub id: String,
    /// What it asked in the suggestion's unit: the burst it needed at the candidate's rate
    /// (GCRA), its most units in one period (calendar), its most requests in flight
    /// (concurrency), its most units in one window of the first tier (tiers), its units over
    /// the log (fair share).
    pub needed: u64,
}
