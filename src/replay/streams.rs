//! Streams in a replay (`docs/replay.md`, "Streams"): a request that opens a stream, let
//! through by a policy's layer, leaves the keys its per-message rules found (`inner.rs`); each
//! message line of the stream is then admitted by a meter of those keys, built as a handler
//! builds it ([`StreamKeys::meter`](crate::StreamKeys::meter)), at the message's logged time,
//! on the log's clock. A message the meter pushes back waits, and the stream's next messages
//! wait behind it, as a sender stalled by flow control does.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

use crate::stream::{StreamLimited, StreamMeter};
use crate::time::Clock;

use super::inner::Opened;
use super::{LogClock, State};

mod spread;
mod tally;

pub(super) use spread::Spread;
pub(super) use tally::{Heard, MessageTally};
pub use tally::{MessageCounts, StreamsEnded, StreamsPlan};

/// The most streams held open at once; a stream opened past it is not replayed (its messages
/// count as `outside`).
const MAX_OPEN_STREAMS: usize = 1 << 17;

/// One message of a stream, to be admitted.
struct Message {
    index: u64,
    units: u64,
    time_us: u64,
}

/// A stream under one policy.
enum Metering {
    /// No per-message rule applied to its request: its messages pass.
    Unmetered,
    /// Its meter could not be built (a handler's `build()?` fails the stream): its messages
    /// are refused.
    Broken,
    /// Its meter, and the messages waiting behind one that was pushed back.
    Metered(Rc<RefCell<Metered>>),
}

/// A metered stream: its meter (absent while a task drives it through a wait) and the
/// messages that came meanwhile, in order.
struct Metered {
    meter: Option<StreamMeter>,
    queue: VecDeque<Message>,
}

/// A stream a request opened: until when (its logged end), and under each policy.
struct Stream {
    end_us: u64,
    sides: [Option<Metering>; 2],
}

/// The streams open in a replay.
#[derive(Default)]
pub(super) struct Streams {
    open: HashMap<Arc<str>, Stream>,
}

impl Streams {
    /// A request opens stream `id` until `end_us` (a second opening of an open id starts it
    /// again): false when too many are open.
    pub(super) fn opens(&mut self, id: Arc<str>, end_us: u64) -> bool {
        if self.open.len() >= MAX_OPEN_STREAMS && !self.open.contains_key(&id) {
            return false;
        }
        let sides = [None, None];
        self.open.insert(id, Stream { end_us, sides });
        true
    }

    /// The streams policy `side`'s layer let through since the last call, with their keys.
    pub(super) fn let_through(&mut self, side: usize, opened: Vec<Opened>) {
        for (id, keys) in opened {
            let Some(stream) = self.open.get_mut(&id) else {
                continue;
            };
            let metering = match keys.map(|k| k.meter().build()) {
                None => Metering::Unmetered,
                Some(Err(_)) => Metering::Broken,
                Some(Ok(meter)) => Metering::Metered(Rc::new(RefCell::new(Metered {
                    meter: Some(meter),
                    queue: VecDeque::new(),
                }))),
            };
            stream.sides[side] = Some(metering);
        }
    }

    /// Drops the streams whose logged end is before `now_us` (their meters give back what
    /// they hold).
    pub(super) fn sweep(&mut self, now_us: u64) {
        self.open.retain(|_, s| s.end_us >= now_us);
    }

    /// A message of `units` of stream `id` at `time_us`, admitted under each policy: answered
    /// now, or by a task when the message waits. False: no such stream is open.
    pub(super) async fn message(
        &mut self,
        id: &str,
        units: u64,
        time_us: u64,
        state: &Rc<RefCell<State>>,
        clock: &LogClock,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> bool {
        let Some(stream) = self.open.get(id).filter(|s| s.end_us >= time_us) else {
            self.open.remove(id);
            state.borrow_mut().messages.outside();
            return false;
        };
        let index = state.borrow_mut().messages.next_index();
        for (side, metering) in stream.sides.iter().enumerate() {
            let message = Message {
                index,
                units,
                time_us,
            };
            let heard = match metering {
                None => Some(Heard::Unopened),
                Some(Metering::Unmetered) => Some(Heard::Passed),
                Some(Metering::Broken) => Some(Heard::Refused(None)),
                Some(Metering::Metered(metered)) => {
                    admit(metered, message, side, state, clock, tasks).await
                }
            };
            if let Some(heard) = heard {
                state.borrow_mut().messages.heard(index, side, heard);
            }
        }
        true
    }
}

/// Admits `message` on a metered stream: its answer when the meter decides it at once, else
/// (it waits, or a message before it does) a task answers it when it is decided.
async fn admit(
    metered: &Rc<RefCell<Metered>>,
    message: Message,
    side: usize,
    state: &Rc<RefCell<State>>,
    clock: &LogClock,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Option<Heard> {
    let taken = metered.borrow_mut().meter.take();
    let Some(mut meter) = taken else {
        // A task drives the stream: the message waits behind the one it holds.
        metered.borrow_mut().queue.push_back(message);
        return None;
    };
    let units = message.units;
    let polled = std::future::poll_fn(|cx| Poll::Ready(meter.poll_admit(cx, units))).await;
    if let Poll::Ready(result) = polled {
        metered.borrow_mut().meter = Some(meter);
        return Some(heard(result, false));
    }
    let (metered, state, clock) = (metered.clone(), state.clone(), clock.clone());
    tasks.spawn_local(drive(metered, meter, message, side, state, clock));
    None
}

/// Drives a stream's meter through `message` (under way) and every message queued behind
/// it, answering each; gives the meter back to the stream when none is left.
async fn drive(
    metered: Rc<RefCell<Metered>>,
    mut meter: StreamMeter,
    mut message: Message,
    side: usize,
    state: Rc<RefCell<State>>,
    clock: LogClock,
) {
    loop {
        let result = meter.admit(message.units).await;
        let waited = clock.now_us() > message.time_us;
        state
            .borrow_mut()
            .messages
            .heard(message.index, side, heard(result, waited));
        let next = metered.borrow_mut().queue.pop_front();
        match next {
            Some(m) => message = m,
            None => {
                metered.borrow_mut().meter = Some(meter);
                return;
            }
        }
    }
}

/// A meter's answer as the plan counts it.
fn heard(result: Result<(), StreamLimited>, waited: bool) -> Heard {
    match result {
        Ok(()) if waited => Heard::Held,
        Ok(()) => Heard::Passed,
        Err(StreamLimited::Limited { limit, .. } | StreamLimited::TooLarge { limit, .. }) => {
            Heard::Refused(Some(limit))
        }
        Err(_) => Heard::Refused(None),
    }
}
