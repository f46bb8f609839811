//! A stream's totals as messages (`docs/replay.md`, "Streams"): `messages` spread evenly over
//! the stream's logged duration, `units` shared evenly, made one at a time in time order
//! beside the log's own lines (one entry per stream whose messages are still to come).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use crate::replay::log::{LoggedRequest, StreamLine, Totals};

/// A stream's next spread message.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Next {
    time_us: u64,
    seq: u64,
    /// Messages made so far.
    made: u64,
    start_us: u64,
    duration_us: u64,
    totals: (u64, u64),
    id: Arc<str>,
}

impl Next {
    /// Message `made`'s time: the `made`-th of `messages` equal steps of the duration.
    fn time_of(&self) -> u64 {
        let step = u128::from(self.duration_us) * u128::from(self.made) / u128::from(self.totals.0);
        self.start_us
            .saturating_add(u64::try_from(step).unwrap_or(u64::MAX))
    }
}

/// The messages still to come of every stream replayed from its totals, earliest first.
#[derive(Default)]
pub(in crate::replay) struct Spread {
    heap: BinaryHeap<Reverse<Next>>,
    seq: u64,
}

impl Spread {
    /// Stream `id`, opened at `start_us` for `duration_us`, carried `totals`.
    pub(in crate::replay) fn add(
        &mut self,
        id: Arc<str>,
        start_us: u64,
        duration_us: u64,
        totals: Totals,
    ) {
        self.seq += 1;
        let next = Next {
            time_us: start_us,
            seq: self.seq,
            made: 0,
            start_us,
            duration_us,
            totals: (totals.messages.max(1), totals.units),
            id,
        };
        self.heap.push(Reverse(next));
    }

    /// When the next spread message is.
    pub(in crate::replay) fn next_us(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse(n)| n.time_us)
    }

    /// The next spread message, as a message line.
    pub(in crate::replay) fn pop(&mut self) -> Option<LoggedRequest> {
        let Reverse(mut next) = self.heap.pop()?;
        let (messages, units) = next.totals;
        let extra = u64::from(next.made < units % messages);
        let line = LoggedRequest {
            stream: Some(StreamLine::Message {
                id: next.id.clone(),
                units: units / messages + extra,
            }),
            ..LoggedRequest::new(next.time_us, [0, 0, 0, 0].into())
        };
        next.made += 1;
        if next.made < messages {
            next.time_us = next.time_of();
            self.heap.push(Reverse(next));
        }
        Some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_become_evenly_spaced_messages_that_carry_every_unit() {
        let mut spread = Spread::default();
        spread.add(
            "a".into(),
            1_000,
            900,
            Totals {
                messages: 3,
                units: 10,
            },
        );
        spread.add(
            "b".into(),
            1_100,
            0,
            Totals {
                messages: 2,
                units: 2,
            },
        );
        let mut made = Vec::new();
        while let Some(line) = spread.pop() {
            let Some(StreamLine::Message { id, units }) = line.stream else {
                panic!("a message line");
            };
            made.push((line.time_us, id.to_string(), units));
        }
        let expected = [
            (1_000, "a", 4),
            (1_100, "b", 1),
            (1_100, "b", 1),
            (1_300, "a", 3),
            (1_600, "a", 3),
        ];
        let expected: Vec<_> = expected
            .iter()
            .map(|(t, i, u)| (*t, i.to_string(), *u))
            .collect();
        assert_eq!(made, expected);
    }
}
