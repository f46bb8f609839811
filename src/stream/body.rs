//! A response body metered chunk by chunk (the LLM case): each chunk's units debited before it
//! is forwarded, and what happens at the limit (cut, hold, debt).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::StreamLimited;
use super::meter::{Ask, How, StreamMeter};

/// What a metered body does with the chunk that finds no room ([`MeteredBody`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overrun {
    /// No unit beyond the limit is sent: the body ends at the boundary. A chunk metered in
    /// bytes (the default units) is split: the bytes that fit are sent, then the body ends.
    /// A chunk metered otherwise (tokens) is not sent at all.
    Cut,
    /// The chunk waits for its units, as the meter's push back waits (its bound included:
    /// beyond it, the body is cut at the boundary). The inner body is not polled meanwhile.
    Hold,
    /// The crossing chunk (the one that finds some room, but not all it needs) is sent, its
    /// units beyond the room charged as debt (a GCRA limit's
    /// [`max_debt`](crate::Limit::max_debt) bounds it: set it to at least a chunk's units); a
    /// chunk that finds no room at all (the key empty, or in debt) ends the body at its
    /// boundary. So a key carries at most one chunk's excess at a time, whatever number of
    /// bodies it streams.
    Debt,
}

/// Reads a chunk's units: `None` when they cannot be read.
type UnitsFn = Box<dyn Fn(&Bytes) -> Option<u64> + Send + Sync>;
/// The body's last frame when it is cut ([`MeteredBody::on_end`]).
type EndFn = Box<dyn FnMut(&StreamLimited) -> Option<Frame<Bytes>> + Send + Sync>;

/// Where a metered body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Forwarding: the next chunk is asked for whole.
    Whole,
    /// The chunk found no room whole: as much of it as fits is asked for (under `Cut`, to
    /// send that much; under `Debt`, to know it crosses).
    Splitting,
    /// Under `Debt`, the crossing chunk's units beyond the room are charged.
    Charging(u64),
    /// Ended (cut, or the inner body ended): nothing more.
    Done,
}

pin_project_lite::pin_project! {
    /// A response body whose every chunk its [`StreamMeter`] debits before it is forwarded
    /// (an LLM's answer metered in tokens as it streams, a download in bytes): the meter's
    /// [`per_unit`](super::StreamMeterBuilder::per_unit) keys are charged the chunk's units
    /// (its bytes by default; [`units`](Self::units) reads others, such as the tokens of a
    /// JSON event), its [`per_message`](super::StreamMeterBuilder::per_message) keys one per
    /// chunk. What happens at the limit is the [`Overrun`]. Trailers pass as they are.
    ///
    /// A chunk whose units cannot be read (the closure returns `None`) ends the body before
    /// it: nothing unmetered is sent ([`StreamLimited::Unreadable`]).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::{BodyExt, Full};
    /// use tower_ratelimits::{AtLimit, Id, Limiter, Limits, MemoryBackend, MeteredBody, Overrun, StreamMeter};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str("Bytes: {kind: account, burst: 5, count: 5, period: 1h}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let meter = StreamMeter::builder(&limiter)
    ///     .per_unit(limiter.key("Bytes", Id::from(7u64))?)
    ///     .at_limit(AtLimit::End)
    ///     .build()?;
    /// let body = MeteredBody::new(Full::new(Bytes::from("hello world")), meter, Overrun::Cut);
    /// assert_eq!(body.collect().await?.to_bytes(), "hello"); // cut at the fifth byte
    /// # Ok(()) }
    /// ```
    pub struct MeteredBody<B> {
        #[pin]
        inner: B,
        meter: StreamMeter,
        overrun: Overrun,
        held: Option<(Bytes, u64)>,
        units: UnitsFn,
        // Whether a chunk may be split at a byte (the default units, one per-unit key).
        splits: bool,
        on_end: EndFn,
        phase: Phase,
    }
}

impl<B> MeteredBody<B> {
    /// `inner`'s chunks, each debited by `meter` before it is forwarded, at its length in
    /// bytes, with `overrun` at the limit.
    pub fn new(inner: B, meter: StreamMeter, overrun: Overrun) -> Self {
        let splits = meter.unit_keys() == 1;
        Self {
            inner,
            meter,
            overrun,
            held: None,
            units: Box::new(|chunk| Some(chunk.len() as u64)),
            splits,
            on_end: Box::new(|_| None),
            phase: Phase::Whole,
        }
    }

    /// Reads a chunk's units (tokens of a JSON event, say): `None` when they cannot be read,
    /// which ends the body before the chunk. A chunk metered so is never split.
    pub fn units(mut self, units: impl Fn(&Bytes) -> Option<u64> + Send + Sync + 'static) -> Self {
        self.units = Box::new(units);
        self.splits = false;
        self
    }

    /// The body's last frame when the meter ends it (`None`, the default: it just ends): a
    /// final SSE event ([`StreamLimited::json`]), gRPC trailers.
    pub fn on_end(
        mut self,
        on_end: impl FnMut(&StreamLimited) -> Option<Frame<Bytes>> + Send + Sync + 'static,
    ) -> Self {
        self.on_end = Box::new(on_end);
        self
    }

    /// The body's meter: the chunks and units forwarded so far.
    pub fn meter(&self) -> &StreamMeter {
        &self.meter
    }
}

impl<B> Body for MeteredBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            if *this.phase == Phase::Done {
                return Poll::Ready(None);
            }
            let Some((chunk, units)) = this.held.take() else {
                match this.inner.as_mut().poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(chunk) => match (this.units)(&chunk) {
                            Some(units) => *this.held = Some((chunk, units)),
                            None => {
                                let why = StreamLimited::Unreadable;
                                *this.phase = Phase::Done;
                                return Poll::Ready((this.on_end)(&why).map(Ok));
                            }
                        },
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    },
                    Poll::Ready(None) => {
                        *this.phase = Phase::Done;
                        return Poll::Ready(None);
                    }
                    other => return other,
                }
                continue;
            };
            let ask = match *this.phase {
                Phase::Splitting => Ask {
                    units,
                    how: How::UpTo,
                },
                Phase::Charging(excess) => Ask {
                    units: excess,
                    how: How::Charge,
                },
                _ => Ask {
                    units,
                    how: How::Whole {
                        may_wait: *this.overrun == Overrun::Hold,
                    },
                },
            };
            let decided = match this.meter.poll_ask(cx, ask) {
                Poll::Pending => {
                    *this.held = Some((chunk, units));
                    return Poll::Pending;
                }
                Poll::Ready(decided) => decided,
            };
            let next = match decided {
                Ok(passed) => after_passing(*this.overrun, *this.phase, passed, units),
                Err(why) => match next_phase(*this.overrun, *this.phase, &why, *this.splits) {
                    Some(next) => After::Ask(next),
                    None => {
                        *this.phase = Phase::Done;
                        return Poll::Ready((this.on_end)(&why).map(Ok));
                    }
                },
            };
            match next {
                After::Send(phase, len) => {
                    *this.phase = phase;
                    let sent = chunk.slice(..len.min(chunk.len()));
                    return Poll::Ready(Some(Ok(Frame::data(sent))));
                }
                After::Ask(phase) => {
                    *this.phase = phase;
                    *this.held = Some((chunk, units));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.phase == Phase::Done || (self.held.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        // Cut, it may be shorter; never longer.
        let mut hint = SizeHint::new();
        if let Some(upper) = self.inner.size_hint().upper() {
            let held = self.held.as_ref().map_or(0, |(c, _)| c.len() as u64);
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}

/// What a chunk's decision leads to: send so many of its bytes and go on in a phase, or ask
/// for it again in another.
enum After {
    Send(Phase, usize),
    Ask(Phase),
}

/// After `passed` units of a chunk of `units` passed in `phase`: whole, the chunk is sent; a
/// cut chunk's part that fit is sent and the body ends; a crossing chunk under `Debt` has its
/// remaining units charged, then is sent whole.
fn after_passing(overrun: Overrun, phase: Phase, passed: u64, units: u64) -> After {
    let all = usize::MAX;
    match phase {
        Phase::Splitting if overrun == Overrun::Cut => {
            After::Send(Phase::Done, usize::try_from(passed).unwrap_or(all))
        }
        Phase::Splitting if passed < units => After::Ask(Phase::Charging(units - passed)),
        _ => After::Send(Phase::Whole, all),
    }
}

/// After a chunk found no room in `phase`: the phase to ask it again in, or `None` to end the
/// body. A chunk a limit refused whole (or larger than a burst) asks for what fits: under
/// `Cut` when it may be split, under `Debt` always (some room: it crosses; none: the end).
fn next_phase(overrun: Overrun, phase: Phase, why: &StreamLimited, splits: bool) -> Option<Phase> {
    let refused = matches!(
        why,
        StreamLimited::Limited { .. } | StreamLimited::TooLarge { .. }
    );
    match (overrun, phase) {
        (Overrun::Cut, Phase::Whole) if refused && splits => Some(Phase::Splitting),
        (Overrun::Debt, Phase::Whole) if refused => Some(Phase::Splitting),
        _ => None,
    }
}
