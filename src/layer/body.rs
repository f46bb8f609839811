//! The response body of a rate-limited service: the inner service's body (counted and settled
//! at its end when a rule settles from the body), or one the middleware wrote (a 429, a 503, a
//! 400).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::lease::Held;
use super::settle::BodySettle;

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Settling {
            #[pin]
            body: B,
            // Boxed: a body that settles nothing stays as small as the inner one.
            settle: Box<BodySettle>,
        },
        Full { data: Option<Bytes> },
    }
}

pin_project! {
    /// Either the inner service's body or a complete body written by the middleware (empty for
    /// gRPC trailers-only responses).
    pub struct RateLimitBody<B> {
        #[pin]
        kind: Kind<B>,
        // The request's slots on concurrency limits: given back at the body's end, or when it
        // is dropped.
        release: Held,
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitBody")
            .field("kind", &self.kind)
            .field("holds_slots", &self.release.is_some())
            .finish()
    }
}

impl<B> RateLimitBody<B> {
    /// A complete body.
    pub fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            release: None,
        }
    }

    /// The inner service's body.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            release: None,
        }
    }

    /// The inner service's body, settling `settle`'s rules when it ends and giving back the
    /// request's slots (`release`) when it ends or is dropped.
    pub(crate) fn settling(body: B, settle: Option<Box<BodySettle>>, release: Held) -> Self {
        let kind = match settle {
            None => Kind::Inner { body },
            Some(settle) => Kind::Settling { body, settle },
        };
        Self { kind, release }
    }
}

impl<B> Body for RateLimitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        let polled = poll_kind(this.kind, cx);
        // The body is over (its end, or an error: the server stops there): the request's
        // slots are free.
        if this.release.is_some() && matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            *this.release = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            // Not over until settled: the server polls once more, and the settle runs.
            Kind::Settling { body, settle } => {
                settle.done && settle.task.is_none() && body.is_end_stream()
            }
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } | Kind::Settling { body, .. } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

/// The next frame of the body itself (settling at its end when it settles).
fn poll_kind<B: Body<Data = Bytes>>(
    kind: Pin<&mut Kind<B>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    match kind.project() {
        KindProj::Inner { body } => body.poll_frame(cx),
        KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        KindProj::Settling { mut body, settle } => loop {
            // The end (or the trailers) is passed on only once the settle is done, so a
            // client that saw the end of the body sees the settled bucket.
            if let Some(t) = &mut settle.task {
                ready!(Pin::new(t).poll(cx));
                settle.task = None;
                settle.done = true;
                return Poll::Ready(settle.held.take().map(Ok));
            }
            if settle.done {
                return body.poll_frame(cx);
            }
            match ready!(body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        settle.sent(data.len());
                    } else if let Some(trailers) = frame.trailers_ref() {
                        settle.task = settle.finish(Some(trailers));
                        if settle.task.is_some() {
                            settle.held = Some(frame);
                            continue;
                        }
                        settle.done = true;
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Err(e)) => {
                    // A failed body settles on what was sent; the error is not held back.
                    drop(settle.finish(None));
                    settle.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    settle.task = settle.finish(None);
                    if settle.task.is_none() {
                        settle.done = true;
                        return Poll::Ready(None);
                    }
                }
            }
        },
    }
}
