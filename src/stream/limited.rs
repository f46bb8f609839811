//! A stream whose every message passes its [`StreamMeter`] before it is yielded.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;

use super::{StreamLimited, StreamMeter};

/// Reads a message's units ([`LimitedStream::units`]).
type UnitsFn<T> = Box<dyn Fn(&T) -> u64 + Send + Sync>;
/// Makes the stream's last item from why it ended ([`LimitedStream::on_end`]).
type EndFn<T> = Box<dyn FnMut(StreamLimited) -> Option<T> + Send + Sync>;

pin_project_lite::pin_project! {
    /// A stream whose every message passes its [`StreamMeter`] before it is yielded: tonic's
    /// `Streaming<T>` (a client's messages to the handler), the stream a handler answers with
    /// (its messages to the client), an SSE stream of events, any [`Stream`].
    ///
    /// The stream takes the next message from the inner stream, then holds it until the
    /// meter admits it: while the meter pushes back, the inner stream is not polled again (an
    /// inbound gRPC stream's sender stalls on HTTP/2 flow control; an outbound message waits
    /// before it is sent). When the meter ends the stream, the held message is dropped, the
    /// stream yields what [`on_end`](Self::on_end) makes of the reason (by default nothing),
    /// and then ends.
    ///
    /// ```
    /// use tower_ratelimits::{AtLimit, Id, LimitedStream, Limiter, Limits, MemoryBackend, StreamMeter};
    /// # use futures_util::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str("Events: {kind: account, burst: 2, count: 1, period: 1s}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let meter = StreamMeter::builder(&limiter)
    ///     .per_message(limiter.key("Events", Id::from(7u64))?)
    ///     .at_limit(AtLimit::End)
    ///     .build()?;
    /// let events = futures_util::stream::iter(["a", "b", "c", "d"]);
    /// let limited = LimitedStream::new(events, meter).on_end(|_| Some("rate-limited"));
    /// let seen: Vec<_> = limited.collect().await;
    /// assert_eq!(seen, ["a", "b", "rate-limited"]);
    /// # Ok(()) }
    /// ```
    #[must_use = "streams do nothing unless polled"]
    pub struct LimitedStream<S: Stream> {
        #[pin]
        inner: S,
        meter: StreamMeter,
        // The message taken from the inner stream and its units, until the meter admits it.
        held: Option<(S::Item, u64)>,
        units: UnitsFn<S::Item>,
        on_end: EndFn<S::Item>,
        ended: bool,
    }
}

impl<S: Stream> LimitedStream<S> {
    /// `inner`'s messages, each admitted by `meter` at one unit (a message's units:
    /// [`units`](Self::units)).
    pub fn new(inner: S, meter: StreamMeter) -> Self {
        Self {
            inner,
            meter,
            held: None,
            units: Box::new(|_| 1),
            on_end: Box::new(|_| None),
            ended: false,
        }
    }

    /// Reads a message's units for the meter's [`per_unit`] keys (its bytes, its tokens).
    /// Every item is a message: an error item of a stream of results counts too (it is
    /// usually the stream's last).
    ///
    /// [`per_unit`]: super::StreamMeterBuilder::per_unit
    pub fn units(mut self, units: impl Fn(&S::Item) -> u64 + Send + Sync + 'static) -> Self {
        self.units = Box::new(units);
        self
    }

    /// The stream's last item when the meter ends it (`None`: it just ends): a gRPC status
    /// ([`StreamLimited::to_status`], the trailers a client reads), an SSE event
    /// ([`StreamLimited::json`]).
    pub fn on_end(
        mut self,
        on_end: impl FnMut(StreamLimited) -> Option<S::Item> + Send + Sync + 'static,
    ) -> Self {
        self.on_end = Box::new(on_end);
        self
    }

    /// The stream's meter: the messages and units admitted so far.
    pub fn meter(&self) -> &StreamMeter {
        &self.meter
    }
}

#[cfg(feature = "tonic")]
impl<S, T> LimitedStream<S>
where
    S: Stream<Item = Result<T, tonic::Status>>,
{
    /// Ends with the gRPC status the meter's reason says ([`StreamLimited::to_status`]):
    /// a handler that returns it, or answers with this stream, sends it in the trailers.
    pub fn grpc(self) -> Self {
        self.on_end(|e| Some(Err(e.to_status())))
    }
}

impl<S: Stream> Stream for LimitedStream<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let units = match this.held {
            Some((_, units)) => *units,
            None => match this.inner.poll_next(cx) {
                Poll::Ready(Some(item)) => {
                    let units = (this.units)(&item);
                    *this.held = Some((item, units));
                    units
                }
                Poll::Ready(None) => {
                    *this.ended = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            },
        };
        match this.meter.poll_admit(cx, units) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) => Poll::Ready(this.held.take().map(|(item, _)| item)),
            Poll::Ready(Err(why)) => {
                *this.ended = true;
                *this.held = None;
                Poll::Ready((this.on_end)(why))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.ended {
            return (0, Some(0));
        }
        let held = usize::from(self.held.is_some());
        // Ended early it yields fewer, and its last item may be one the inner never had.
        let high = self.inner.size_hint().1;
        (0, high.and_then(|h| h.checked_add(held + 1)))
    }
}
