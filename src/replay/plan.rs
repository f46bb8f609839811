//! What a replay found (`docs/replay.md`, "The plan"): the document and the tallies it is
//! made from, key by key.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::log::{BadLine, LoggedRequest};
use super::suggest::{Arrival, KeyModel, Model, Suggestions};
use super::suggested::{
    Heavy, Suggested, SuggestedBudget, SuggestedCount, SuggestedMax, SuggestedTiers,
};
use crate::key::{Id, LimitName};
use crate::layer::Note;
use crate::layer::RuleOutcome;
use crate::time::instant_text;

/// The version of the plan's JSON document. Fields are added, never changed or removed,
/// within a version.
pub const PLAN_VERSION: u32 = 1;

/// What a replay found: how each policy decided the log's requests, what would change, and
/// how much of each limit its keys used. Its JSON form (`serde`) is a promise: see
/// `docs/replay.md` ("The plan") for every field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_VERSION`].
    pub version: u32,
    /// Lines decided (bad lines are not requests).
    pub requests: u64,
    /// Lines that did not parse.
    pub bad_lines: u64,
    /// The first bad lines, with why.
    pub bad_line_examples: Vec<BadLineExample>,
    /// Lines read more than the reorder window after a later one: decided at the replay's
    /// clock, not their own.
    pub late_lines: u64,
    /// The first request's time (RFC 3339), when there was one.
    pub from: Option<String>,
    /// The last request's time.
    pub to: Option<String>,
    /// How the current policy decided.
    pub current: Counts,
    /// How the candidate decided.
    pub candidate: Counts,
    /// Requests the current policy let through (allowed or exempt) that the candidate denies.
    pub allow_to_deny: u64,
    /// Requests the current policy denies that the candidate lets through.
    pub deny_to_allow: u64,
    /// Per limit (of either policy), by name.
    pub limits: BTreeMap<String, LimitPlan>,
    /// The keys with the most flips, most first.
    pub top_keys: Vec<KeyFlips>,
    /// The first flips of each direction, in order.
    pub flips: Vec<Flip>,
    /// How the replay started from a snapshot ([`Replay::snapshot`](crate::Replay::snapshot));
    /// absent when it started cold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<super::snapshot::Warm>,
    /// Every limit with a penalty ladder in either policy, by name: the most counted units one
    /// key can get through it in a day ("at most 587 failed logins per account per day"),
    /// from the ladder alone. Absent when no limit has one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub penalties: BTreeMap<String, super::penalties::PenaltyPlan>,
    /// The limits a rule of either policy counts per message of a stream (`per: message` or
    /// `per: unit`), by name, with why, when the log has no stream lines: a log of requests
    /// alone holds no messages, so the replay decides none of them, and their entries in
    /// `limits` count nothing. Absent when no rule counts messages or the log has streams.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub not_replayed: BTreeMap<String, String>,
    /// The log's streams (lines with `stream` and `message_of`): each message admitted by the
    /// meter of its stream's per-message keys under each policy (`docs/replay.md`, "Streams").
    /// Absent when the log has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streams: Option<super::streams::StreamsPlan>,
}

/// One bad line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadLineExample {
    /// The file.
    pub file: String,
    /// Its line number.
    pub line: u64,
    /// Why it was refused.
    pub reason: String,
}

/// How one policy decided the requests: `requests` is the sum of the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Requests decided.
    pub requests: u64,
    /// Let through by every rule that applied (or by no rule).
    pub allowed: u64,
    /// Refused by a limit (a 429).
    pub denied: u64,
    /// Refused before a decision (a key the layer cannot read, a cost above a limit) or by a
    /// failure policy.
    pub rejected: u64,
    /// Let through by an exemption.
    pub exempt: u64,
}

/// One limit in a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitPlan {
    /// Requests this limit denied under the current policy (a request denied in a batch
    /// counts for every limit whose own decision was a denial).
    pub current_denied: u64,
    /// The same under the candidate.
    pub candidate_denied: u64,
    /// Requests it denies under the candidate that the current policy let through.
    pub allow_to_deny: u64,
    /// Requests it denied under the current policy that the candidate lets through.
    pub deny_to_allow: u64,
    /// How much of the limit its keys used, when any key was decided.
    pub headroom: Option<Headroom>,
    /// The candidate's limit sized to the log, when it is a GCRA limit.
    pub suggested: Option<Suggested>,
    /// The candidate's calendar quota sized to the log: the count per period that no more
    /// than `target` of its keys would exceed. Absent for every other shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_count: Option<SuggestedCount>,
    /// The candidate's concurrency limit (or adaptive limit's `max`) sized to the requests
    /// each key had in flight at once by the log's durations. Absent for every other shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_max: Option<SuggestedMax>,
    /// The candidate's burst tiers sized to the units each key asked in any window of each
    /// tier's length. Absent for every other shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_tiers: Option<SuggestedTiers>,
    /// The candidate's fair share's budget sized to every id's requests together. Absent for
    /// every other shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suggested_budget: Option<SuggestedBudget>,
    /// The keys a suggestion leaves above it (a fair share's: the ids that asked the most),
    /// most first, at most ten: what the limit exists to stop. Absent when none is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub heaviest: Vec<Heavy>,
    /// Marked `across_regions` in either policy (`docs/regions.md`): replayed as one central
    /// limit (every request of the log against one bucket per key), which is the most the
    /// regions together may admit; a regional deployment admits less by what the floors of
    /// idle regions hold back. Absent (false) for every other limit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub across_regions: bool,
    /// Decisions of keys first seen after the replay kept 4,194,304 keys (over every limit,
    /// about 100 bytes each, so at most about 400 MiB whatever the log holds): counted in
    /// the totals and the flips, left out of the headroom, the suggestion and the top keys.
    /// Absent (0) while every key is kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub untallied: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The most keys (a limit's id, counted per limit) whose headroom, flips and suggestion model
/// a replay keeps ([`LimitPlan::untallied`] counts the decisions of the others).
pub(crate) const MAX_TALLIED_KEYS: usize = 4 << 20;

/// The distribution over a limit's keys of the largest share of the limit a key used (in
/// use after a decision over the limit's size, 0 to 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Headroom {
    /// Whose decisions: `current` when the current policy has the limit, else `candidate`.
    pub policy: String,
    /// Keys decided.
    pub keys: u64,
    /// The median key's largest share.
    pub p50: f64,
    /// The 90th percentile's.
    pub p90: f64,
    /// The 99th percentile's.
    pub p99: f64,
    /// The largest.
    pub max: f64,
}

/// A key's flips.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyFlips {
    /// The limit.
    pub limit: String,
    /// The id.
    pub id: String,
    /// Its requests the candidate denies that the current policy let through.
    pub allow_to_deny: u64,
    /// Its requests the current policy denied that the candidate lets through.
    pub deny_to_allow: u64,
}

/// One request whose answer changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flip {
    /// `allow_to_deny` or `deny_to_allow`.
    pub kind: String,
    /// When (RFC 3339).
    pub time: String,
    /// The client.
    pub ip: String,
    /// The method.
    pub method: String,
    /// The path.
    pub path: String,
    /// The limits that denied it (under the policy that denies).
    pub limits: Vec<String>,
}

/// How a policy answered one request of a replay ([`Replay::each`](crate::Replay::each)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answered {
    /// Let through by every rule that applied (or by no rule).
    Allowed,
    /// Refused by a limit.
    Denied,
    /// Refused before a decision (a key the layer cannot read, a cost above a limit) or by a
    /// failure policy.
    Rejected,
    /// Let through by an exemption.
    Exempt,
}

impl Answered {
    fn through(self) -> bool {
        matches!(self, Answered::Allowed | Answered::Exempt)
    }
}

/// One policy's answer to one request: its class and the limits that denied it.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) class: Answered,
    pub(crate) denied_by: Vec<(LimitName, Option<Id>)>,
    /// The buckets it was decided against, kept only for [`Replay::each`](crate::Replay::each).
    pub(crate) buckets: Vec<crate::key::BucketKey>,
}

impl Answer {
    /// The answer that `notes` (the request's, every decision round) and whether the inner
    /// service was called make.
    pub(crate) fn of(served: bool, exempt: bool, notes: &[Note], keep: bool) -> Answer {
        let mut buckets = Vec::new();
        if keep {
            for n in notes {
                if let Some(id) = &n.id {
                    let key = crate::key::BucketKey::new(n.name, id.clone());
                    if !buckets.contains(&key) {
                        buckets.push(key);
                    }
                }
            }
        }
        // A request decided again after a wait may be denied by a limit more than once: the
        // limit denied it, once.
        let denials = || {
            let mut out: Vec<(LimitName, Option<Id>)> = Vec::new();
            for n in notes.iter().filter(|n| n.outcome == RuleOutcome::Denied) {
                if !out.iter().any(|(name, _)| *name == n.name) {
                    out.push((n.name, n.id.clone()));
                }
            }
            out
        };
        match (served, exempt) {
            (true, true) => Answer {
                class: Answered::Exempt,
                denied_by: Vec::new(),
                buckets,
            },
            (true, false) => Answer {
                class: Answered::Allowed,
                denied_by: Vec::new(),
                buckets,
            },
            (false, _) => {
                let denied_by = denials();
                Answer {
                    class: if denied_by.is_empty() {
                        Answered::Rejected
                    } else {
                        Answered::Denied
                    },
                    denied_by,
                    buckets,
                }
            }
        }
    }
}

/// One request of a replay as both policies answered it ([`Replay::each`](crate::Replay::each)).
#[derive(Debug)]
#[non_exhaustive]
pub struct Replayed<'a> {
    /// The request.
    pub request: &'a LoggedRequest,
    /// The current policy's answer.
    pub current: Answered,
    /// The candidate's answer.
    pub candidate: Answered,
    /// The buckets (limit and id) the current policy decided it against.
    pub current_buckets: &'a [crate::key::BucketKey],
    /// The buckets the candidate decided it against.
    pub candidate_buckets: &'a [crate::key::BucketKey],
}

/// What a flip shows of its request.
pub(crate) struct Seen<'a> {
    pub(crate) time_us: u64,
    pub(crate) ip: std::net::IpAddr,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
}

/// A key's tallies: the largest share it used under each policy, its flips, and its state in
/// the suggestion model.
#[derive(Default)]
struct KeyTally {
    share: [f32; 2],
    flips: [u32; 2],
    model: Option<Box<KeyModel>>,
}

#[derive(Default)]
struct LimitTally {
    denied: [u64; 2],
    flips: [u64; 2],
    keys: HashMap<Id, KeyTally>,
    /// The suggestion's model of the candidate's limit.
    model: Option<Model>,
    /// Marked `across_regions` in either policy.
    across_regions: bool,
    /// Notes of keys past the bound, not kept.
    untallied: u64,
}

/// The tallies a plan is made from.
pub(crate) struct Tally {
    pub(crate) base_us: u64,
    pub(crate) requests: u64,
    pub(crate) bad_lines: u64,
    bad_examples: Vec<BadLineExample>,
    pub(crate) late_lines: u64,
    first_us: Option<u64>,
    last_us: u64,
    counts: [Counts; 2],
    flips: [u64; 2],
    limits: HashMap<LimitName, LimitTally>,
    /// Keys kept over every limit, and the most kept ([`MAX_TALLIED_KEYS`]).
    tallied: usize,
    max_tallied: usize,
    flip_examples: Vec<Flip>,
    flip_kinds: [usize; 2],
    target: f64,
    top: usize,
    bad_examples_max: usize,
    flip_examples_max: usize,
}

const A2D: usize = 0;
const D2A: usize = 1;

impl Tally {
    pub(crate) fn new(
        base_us: u64,
        target: f64,
        top: usize,
        bad_examples: usize,
        flip_examples: usize,
    ) -> Tally {
        Tally {
            base_us,
            requests: 0,
            bad_lines: 0,
            bad_examples: Vec::new(),
            late_lines: 0,
            first_us: None,
            last_us: 0,
            counts: [Counts::default(); 2],
            flips: [0; 2],
            limits: HashMap::new(),
            tallied: 0,
            max_tallied: MAX_TALLIED_KEYS,
            flip_examples: Vec::new(),
            flip_kinds: [0; 2],
            target,
            top,
            bad_examples_max: bad_examples,
            flip_examples_max: flip_examples,
        }
    }

    /// Marks `name` as one limit across regions, replayed as one central limit.
    pub(crate) fn across_regions(&mut self, name: LimitName) {
        self.limits.entry(name).or_default().across_regions = true;
    }

    /// Sizes the suggestion of `name` for the candidate's default `quota`.
    pub(crate) fn size(&mut self, name: LimitName, quota: &crate::quota::Quota) {
        self.limits.entry(name).or_default().model = Some(Model::of(quota));
    }

    pub(crate) fn bad_line(&mut self, bad: &BadLine) {
        self.bad_lines += 1;
        if self.bad_examples.len() < self.bad_examples_max {
            self.bad_examples.push(BadLineExample {
                file: bad.file.clone(),
                line: bad.line,
                reason: bad.reason.to_string(),
            });
        }
    }

    /// One policy's notes of one request (`side` 0: current, 1: candidate), as they come: the
    /// shares its keys used and, for the candidate's first decision of a request (`arrival`:
    /// the request's cost), the suggestion model's arrivals.
    pub(crate) fn noted(
        &mut self,
        side: usize,
        notes: &[Note],
        now_us: u64,
        arrival: Option<Arrival>,
    ) {
        for note in notes {
            let Some(id) = &note.id else { continue };
            let limit = self.limits.entry(note.name).or_default();
            let key = match limit.keys.get_mut(id) {
                Some(k) => k,
                None if self.tallied >= self.max_tallied => {
                    limit.untallied += 1;
                    continue;
                }
                None => {
                    self.tallied += 1;
                    limit.keys.entry(id.clone()).or_default()
                }
            };
            if note.size > 0 {
                let share = (note.used as f64 / note.size as f64).min(1.0) as f32;
                key.share[side] = key.share[side].max(share);
            }
            if side == 1
                && let (Some(model), Some(arrival)) = (&mut limit.model, arrival)
            {
                model.arrive(&mut key.model, now_us, self.base_us, arrival);
            }
        }
    }

    /// Both policies' answers to one request.
    pub(crate) fn decided(&mut self, request: &Seen<'_>, answers: [&Answer; 2]) {
        self.requests += 1;
        self.first_us.get_or_insert(request.time_us);
        self.last_us = self.last_us.max(request.time_us);
        for (side, answer) in answers.iter().enumerate() {
            let c = &mut self.counts[side];
            c.requests += 1;
            match answer.class {
                Answered::Allowed => c.allowed += 1,
                Answered::Denied => c.denied += 1,
                Answered::Rejected => c.rejected += 1,
                Answered::Exempt => c.exempt += 1,
            }
            if answer.class == Answered::Denied {
                for (name, _) in &answer.denied_by {
                    self.limits.entry(*name).or_default().denied[side] += 1;
                }
            }
        }
        let [current, candidate] = answers;
        let (kind, denier) = if current.class.through() && candidate.class == Answered::Denied {
            (A2D, candidate)
        } else if current.class == Answered::Denied && candidate.class.through() {
            (D2A, current)
        } else {
            return;
        };
        self.flips[kind] += 1;
        for (name, id) in &denier.denied_by {
            let limit = self.limits.entry(*name).or_default();
            limit.flips[kind] += 1;
            if let Some(id) = id
                && let Some(key) = limit.keys.get_mut(id)
            {
                key.flips[kind] += 1;
            }
        }
        if self.flip_kinds[kind] < self.flip_examples_max {
            self.flip_kinds[kind] += 1;
            self.flip_examples.push(Flip {
                kind: if kind == A2D {
                    "allow_to_deny"
                } else {
                    "deny_to_allow"
                }
                .into(),
                time: instant_text(request.time_us),
                ip: request.ip.to_string(),
                method: request.method.to_owned(),
                path: request.path.to_owned(),
                limits: denier
                    .denied_by
                    .iter()
                    .map(|(n, _)| n.as_str().to_owned())
                    .collect(),
            });
        }
    }

    /// Drops what the suggestion models of keys no longer need at `now_us`: memory follows
    /// live keys.
    pub(crate) fn sweep(&mut self, now_us: u64) {
        for limit in self.limits.values_mut() {
            let Some(model) = &limit.model else { continue };
            for key in limit.keys.values_mut() {
                if let Some(k) = key.model.as_mut() {
                    model.sweep(k, now_us, self.base_us);
                }
            }
        }
    }

    pub(crate) fn plan(self) -> Plan {
        let mut limits = BTreeMap::new();
        let mut top: Vec<KeyFlips> = Vec::new();
        for (name, limit) in &self.limits {
            for (id, key) in &limit.keys {
                if key.flips != [0, 0] {
                    top.push(KeyFlips {
                        limit: name.as_str().to_owned(),
                        id: id.to_string(),
                        allow_to_deny: u64::from(key.flips[A2D]),
                        deny_to_allow: u64::from(key.flips[D2A]),
                    });
                }
            }
            let s = limit.model.as_ref().map_or_else(Suggestions::default, |m| {
                let keys = limit.keys.iter().map(|(id, k)| (id, k.model.as_deref()));
                m.suggest(keys, self.target)
            });
            limits.insert(
                name.as_str().to_owned(),
                LimitPlan {
                    current_denied: limit.denied[0],
                    candidate_denied: limit.denied[1],
                    allow_to_deny: limit.flips[A2D],
                    deny_to_allow: limit.flips[D2A],
                    headroom: headroom(limit),
                    suggested: s.suggested,
                    suggested_count: s.suggested_count,
                    suggested_max: s.suggested_max,
                    suggested_tiers: s.suggested_tiers,
                    suggested_budget: s.suggested_budget,
                    heaviest: s.heaviest,
                    across_regions: limit.across_regions,
                    untallied: limit.untallied,
                },
            );
        }
        top.sort_by(|a, b| {
            (b.allow_to_deny + b.deny_to_allow)
                .cmp(&(a.allow_to_deny + a.deny_to_allow))
                .then_with(|| (&a.limit, &a.id).cmp(&(&b.limit, &b.id)))
        });
        top.truncate(self.top);
        Plan {
            version: PLAN_VERSION,
            requests: self.requests,
            bad_lines: self.bad_lines,
            bad_line_examples: self.bad_examples,
            late_lines: self.late_lines,
            from: self.first_us.map(instant_text),
            to: self.first_us.map(|_| instant_text(self.last_us)),
            current: self.counts[0],
            candidate: self.counts[1],
            allow_to_deny: self.flips[A2D],
            deny_to_allow: self.flips[D2A],
            limits,
            top_keys: top,
            flips: self.flip_examples,
            warm: None,
            penalties: BTreeMap::new(),
            not_replayed: BTreeMap::new(),
            streams: None,
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn headroom(limit: &LimitTally) -> Option<Headroom> {
    let side = if limit.keys.values().any(|k| k.share[0] > 0.0) {
        0
    } else {
        1
    };
    let mut shares: Vec<f64> = limit
        .keys
        .values()
        .map(|k| f64::from(k.share[side]))
        .collect();
    if shares.is_empty() {
        return None;
    }
    shares.sort_by(f64::total_cmp);
    let round = |x: f64| (x * 10_000.0).round() / 10_000.0;
    Some(Headroom {
        policy: if side == 0 { "current" } else { "candidate" }.into(),
        keys: shares.len() as u64,
        p50: round(quantile(&shares, 0.5)),
        p90: round(quantile(&shares, 0.9)),
        p99: round(quantile(&shares, 0.99)),
        max: round(shares[shares.len() - 1]),
    })
}

/// For tests: an allowed note of `name` for the client `192.0.2.<client>`, one used of `size`.
#[cfg(test)]
pub(crate) fn note_of(name: LimitName, client: u8, size: u64) -> Note {
    Note {
        name,
        outcome: RuleOutcome::Allowed,
        id: Some(Id::from(std::net::IpAddr::from([192, 0, 2, client]))),
        used: 1,
        size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_that_denied_a_request_twice_denied_it_once() {
        let limits = crate::config::Limits::from_yaml_str(
            "ReplayOnce: {kind: ip, burst: 1, count: 1, period: 1s}\n",
            None,
        )
        .unwrap();
        let name = limits.name("ReplayOnce").unwrap();
        let id = crate::key::Id::from(std::net::IpAddr::from([192, 0, 2, 1]));
        let denied = Note {
            name,
            outcome: RuleOutcome::Denied,
            id: Some(id),
            used: 1,
            size: 1,
        };
        // Denied, woken after its wait, denied again: one denial of the limit.
        let answer = Answer::of(false, false, &[denied.clone(), denied], false);
        assert_eq!(answer.class, Answered::Denied);
        assert_eq!(answer.denied_by.len(), 1);
    }

    #[test]
    fn a_replay_keeps_at_most_its_bound_of_keys_and_counts_the_rest() {
        let limits = crate::config::Limits::from_yaml_str(
            "ReplayBound: {kind: ip, burst: 2, count: 2, period: 1s}\n",
            None,
        )
        .unwrap();
        let name = limits.name("ReplayBound").unwrap();
        let mut tally = Tally::new(0, 0.01, 10, 10, 10);
        tally.max_tallied = 2;
        for client in 1..=5u8 {
            let note = note_of(name, client, 2);
            // Each client asks twice: the first two are kept, the others' four notes counted.
            tally.noted(0, std::slice::from_ref(&note), 0, None);
            tally.noted(0, &[note], 0, None);
        }
        let limit = &tally.limits[&name];
        assert_eq!(
            (limit.keys.len(), tally.tallied, limit.untallied),
            (2, 2, 6)
        );
    }
}
