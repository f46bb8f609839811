//! The response body of a rate-limited service: the inner service's own, untouched, unless the
//! request holds slots or settles from the body; then it is wrapped in [`RateLimitBody`] (its
//! end counted and settled, its slots given back) and handed on as the inner body's type
//! ([`ResponseBody`]). The middleware's own answers are [`ResponseBody::from_bytes`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::lease::Held;
use super::settle::BodySettle;

/// A response body type the layer hands on as it is, answers with, and wraps only when a
/// rule needs the body's end.
///
/// An allowed request's response keeps the inner service's body untouched unless the request
/// holds a slot of a concurrency limit (given back at the body's end) or a rule settles its
/// cost from the body ([`Settle`](crate::Settle)): then the body is wrapped in a
/// [`RateLimitBody`] and turned back into this type by [`hooked`](Self::hooked) (a box, for
/// the types below). The layer's own answers (a 429, a 503, a 400) are
/// [`from_bytes`](Self::from_bytes).
///
/// Implemented for axum's body (feature `axum`), tonic's (feature `tonic`) and
/// `http-body-util`'s `UnsyncBoxBody`. For another body type, implement it, or map the inner
/// service's responses into one of these first (`tower::ServiceExt::map_response`).
///
/// ```
/// use bytes::Bytes;
/// use http_body::Body as _;
/// use http_body_util::combinators::UnsyncBoxBody;
/// use tower_ratelimits::ResponseBody;
///
/// let answer = UnsyncBoxBody::<Bytes, std::io::Error>::from_bytes(Bytes::from_static(b"no"));
/// assert_eq!(answer.size_hint().exact(), Some(2));
/// ```
pub trait ResponseBody: Body<Data = Bytes> + Sized + Send + 'static {
    /// A complete body holding `data` (empty for a gRPC trailers-only answer).
    fn from_bytes(data: Bytes) -> Self;

    /// `body`, which gives back the request's slots and settles its costs at its end, as this
    /// type.
    fn hooked(body: RateLimitBody<Self>) -> Self;
}

#[cfg(feature = "axum")]
impl ResponseBody for axum::body::Body {
    fn from_bytes(data: Bytes) -> Self {
        Self::from(data)
    }

    fn hooked(body: RateLimitBody<Self>) -> Self {
        Self::new(body)
    }
}

#[cfg(feature = "tonic")]
impl ResponseBody for tonic::body::Body {
    fn from_bytes(data: Bytes) -> Self {
        if data.is_empty() {
            Self::empty()
        } else {
            Self::new(http_body_util::Full::new(data))
        }
    }

    fn hooked(body: RateLimitBody<Self>) -> Self {
        Self::new(body)
    }
}

impl<E: 'static> ResponseBody for http_body_util::combinators::UnsyncBoxBody<Bytes, E> {
    fn from_bytes(data: Bytes) -> Self {
        use http_body_util::BodyExt;
        http_body_util::Full::new(data)
            .map_err(|never| match never {})
            .boxed_unsync()
    }

    fn hooked(body: RateLimitBody<Self>) -> Self {
        Self::new(body)
    }
}

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
    }
}

pin_project! {
    /// The inner service's body, with what the request holds until its end: its slots on
    /// concurrency limits (given back when it ends or is dropped) and the rules it settles
    /// from the bytes sent ([`Settle`](crate::Settle)). Made by the layer only for a response
    /// that needs it, and handed on as the inner service's body type
    /// ([`ResponseBody::hooked`]).
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

impl<B: ResponseBody> RateLimitBody<B> {
    /// The inner service's body, settling `settle`'s rules when it ends and giving back the
    /// request's slots (`release`) when it ends or is dropped: the body as it is when there is
    /// neither.
    pub(crate) fn settling(body: B, settle: Option<Box<BodySettle>>, release: Held) -> B {
        let kind = match (settle, &release) {
            (None, None) => return body,
            (None, Some(_)) => Kind::Inner { body },
            (Some(settle), _) => Kind::Settling { body, settle },
        };
        B::hooked(Self { kind, release })
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
        if let Some(release) = this.release.as_mut() {
            match &polled {
                // A gRPC status after a streamed answer: judged as the head was.
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(trailers) = frame.trailers_ref() {
                        release.trailers(trailers);
                    }
                }
                Poll::Ready(Some(Err(_))) => {
                    release.failed();
                    *this.release = None;
                }
                Poll::Ready(None) => *this.release = None,
                Poll::Pending => {}
            }
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
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } | Kind::Settling { body, .. } => body.size_hint(),
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
