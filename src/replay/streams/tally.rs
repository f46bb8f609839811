//! What a replay's streams came to (`Plan::streams`): each message as each policy answered it,
//! paired as the answers come (a message pushed back is answered when it passes or ends).

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::key::LimitName;

/// How one policy answered one message of a replayed stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::replay) enum Heard {
    /// Passed at its logged time.
    Passed,
    /// Passed after waiting (pushed back, or behind a message that was).
    Held,
    /// Refused: the stream ended at it (by this limit, when one refused it) or before it.
    Refused(Option<LimitName>),
    /// Its stream's request was not let through (refused, or still waiting to be decided
    /// again), so the stream is not open under this policy.
    Unopened,
}

impl Heard {
    fn passed(&self) -> bool {
        matches!(self, Heard::Passed | Heard::Held)
    }
}

/// The streams of a replayed log: what each policy did with their messages
/// ([`Plan::streams`](super::super::Plan::streams)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamsPlan {
    /// Requests that opened a stream (lines with `stream`).
    pub streams: u64,
    /// Of them, streams replayed from their totals (`messages`, `units`: their messages spread
    /// evenly over the stream's duration): an approximation of what their messages did.
    pub approximate: u64,
    /// What the approximation is, when a stream was replayed from its totals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approximation: Option<String>,
    /// Messages replayed (their lines, and those spread from totals).
    pub messages: u64,
    /// How the current policy answered them.
    pub current: MessageCounts,
    /// How the candidate answered them.
    pub candidate: MessageCounts,
    /// Messages the current policy passed (at once or held) that the candidate refuses.
    pub pass_to_refuse: u64,
    /// Messages the current policy refused that the candidate passes.
    pub refuse_to_pass: u64,
    /// Message lines of no stream the replay holds open (an unknown id, a line after its
    /// stream's logged end, or a stream beyond the 131,072 held open at once): not replayed.
    pub outside: u64,
    /// Each limit that ended a stream under either policy, by name: how many streams it ended.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, StreamsEnded>,
}

/// How one policy answered a replay's messages: `passed + held + refused + unopened` is every
/// message replayed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageCounts {
    /// Passed at their logged time.
    pub passed: u64,
    /// Passed after waiting (the rule pushes back: the sender was slowed).
    pub held: u64,
    /// Refused: their stream ended at them or before them.
    pub refused: u64,
    /// Of streams whose request this policy did not let through.
    pub unopened: u64,
}

impl MessageCounts {
    fn count(&mut self, heard: &Heard) {
        match heard {
            Heard::Passed => self.passed += 1,
            Heard::Held => self.held += 1,
            Heard::Refused(_) => self.refused += 1,
            Heard::Unopened => self.unopened += 1,
        }
    }
}

/// How many streams one limit ended under each policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamsEnded {
    /// Under the current policy.
    pub current: u64,
    /// Under the candidate.
    pub candidate: u64,
}

/// What the plan says of streams replayed from totals.
const APPROXIMATION: &str = "streams replayed from their totals (messages, units) had their messages spread evenly over their logged duration, units shared evenly: an approximation, as the real messages came when they came; log a line per message (message_of) for an exact replay";

/// The streams' tally: counts, and messages one policy has answered and the other not yet.
#[derive(Default)]
pub(in crate::replay) struct MessageTally {
    plan: StreamsPlan,
    pending: HashMap<u64, Heard>,
    next: u64,
}

impl MessageTally {
    /// A request opened a stream (from its totals: `approximate`).
    pub(in crate::replay) fn opened(&mut self, approximate: bool) {
        self.plan.streams += 1;
        self.plan.approximate += u64::from(approximate);
    }

    /// A message line of no open stream.
    pub(in crate::replay) fn outside(&mut self) {
        self.plan.outside += 1;
    }

    /// The index of the next message.
    pub(in crate::replay) fn next_index(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Message `index` as policy `side` (0 current, 1 candidate) answered it.
    pub(in crate::replay) fn heard(&mut self, index: u64, side: usize, heard: Heard) {
        let Some(other) = self.pending.remove(&index) else {
            self.pending.insert(index, heard);
            return;
        };
        let [current, candidate] = if side == 0 {
            [heard, other]
        } else {
            [other, heard]
        };
        let plan = &mut self.plan;
        plan.messages += 1;
        plan.current.count(&current);
        plan.candidate.count(&candidate);
        match (current.passed(), candidate.passed()) {
            (true, false) => plan.pass_to_refuse += 1,
            (false, true) => plan.refuse_to_pass += 1,
            _ => {}
        }
        for (side, heard) in [current, candidate].iter().enumerate() {
            if let Heard::Refused(Some(limit)) = heard {
                let ended = plan.limits.entry(limit.to_string()).or_default();
                *[&mut ended.current, &mut ended.candidate][side] += 1;
            }
        }
    }

    /// The streams' plan: absent when the log had no stream line.
    pub(in crate::replay) fn plan(mut self) -> Option<StreamsPlan> {
        if self.plan.streams == 0 && self.plan.outside == 0 {
            return None;
        }
        if self.plan.approximate > 0 {
            self.plan.approximation = Some(APPROXIMATION.to_owned());
        }
        Some(self.plan)
    }
}
