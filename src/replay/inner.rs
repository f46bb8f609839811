//! The inner service of a replayed layer (`replay/mod.rs`): what the app behind the layer
//! answered, as the log recorded it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use tower_service::Service;

use crate::layer::{SettleFrom, StreamKeys};

/// The inner service of a replayed layer: counts its calls (the request was let through)
/// and answers when the request's logged duration has passed, with its logged status and its
/// logged cost where the layer's settling rules read a true cost (a header, a trailer, a body
/// of so many bytes per unit). A request that opens a stream leaves, in `opened`, the stream's
/// id and the keys the layer's per-message rules found for it (`replay/streams.rs` meters the
/// stream's messages with them).
#[derive(Clone)]
pub(super) struct Inner {
    pub(super) served: Arc<AtomicU64>,
    pub(super) settles: Arc<[SettleFrom]>,
    pub(super) opened: Arc<std::sync::Mutex<Vec<Opened>>>,
}

/// A stream whose request the layer let through: its id and its per-message keys (none: no
/// per-message rule applied).
pub(super) type Opened = (Arc<str>, Option<StreamKeys>);

/// What a request's answer carries: its logged end on tokio's clock, status and cost, and the
/// stream it opens.
#[derive(Clone)]
pub(super) struct Logged {
    pub(super) until: Option<tokio::time::Instant>,
    pub(super) status: Option<u16>,
    pub(super) cost: Option<u64>,
    pub(super) stream: Option<Arc<str>>,
}

pub(super) type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The most body bytes a replayed response carries for a body-length settle (1 GiB).
const MAX_BODY_BYTES: u64 = 1 << 30;

impl Service<Request<()>> for Inner {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Held;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<()>) -> Held {
        self.served.fetch_add(1, Ordering::Relaxed);
        let logged = request.extensions().get::<Logged>();
        if let Some(id) = logged.and_then(|l| l.stream.clone())
            && let Ok(mut opened) = self.opened.lock()
        {
            opened.push((id, request.extensions().get::<StreamKeys>().cloned()));
        }
        Held {
            sleep: logged
                .and_then(|l| l.until)
                .map(|until| Box::pin(tokio::time::sleep_until(until))),
            response: Some(self.answer(logged)),
        }
    }
}

impl Inner {
    /// The response: the logged status (a logged 429 was production's limiter: the app's own
    /// answer is taken as 200) and, for each place a settling rule reads, the logged cost.
    fn answer(&self, logged: Option<&Logged>) -> Response<Body> {
        use http_body_util::BodyExt;
        let status = logged
            .and_then(|l| l.status)
            .filter(|&s| s != 429)
            .and_then(|s| http::StatusCode::from_u16(s).ok())
            .unwrap_or(http::StatusCode::OK);
        let cost = logged.and_then(|l| l.cost);
        let mut body = ReplayBody {
            left: 0,
            trailers: None,
        };
        let mut response = Response::new(());
        *response.status_mut() = status;
        if let Some(cost) = cost {
            let value = http::HeaderValue::from(cost);
            for from in self.settles.iter() {
                match from {
                    SettleFrom::Header(name) => {
                        response.headers_mut().insert(name.clone(), value.clone());
                    }
                    SettleFrom::Trailer(name) => {
                        body.trailers
                            .get_or_insert_with(http::HeaderMap::new)
                            .insert(name.clone(), value.clone());
                    }
                    SettleFrom::BodyBytes(per_unit) => {
                        body.left = body
                            .left
                            .max(cost.saturating_mul(*per_unit).min(MAX_BODY_BYTES));
                    }
                }
            }
        }
        response.map(|()| body.boxed_unsync())
    }
}

/// A replayed response's body: `left` bytes of zeros, then the trailers.
struct ReplayBody {
    left: u64,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for ReplayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        if self.left > 0 {
            let n = self.left.min(ZEROS.len() as u64);
            self.left -= n;
            return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                &ZEROS[..n as usize],
            )))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0 && self.trailers.is_none()
    }
}

/// The inner service's answer, after its hold.
pub(super) struct Held {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    response: Option<Response<Body>>,
}

impl Future for Held {
    type Output = Result<Response<Body>, Infallible>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(sleep) = self.sleep.as_mut() {
            std::task::ready!(sleep.as_mut().poll(cx));
        }
        Poll::Ready(Ok(self.response.take().unwrap_or_default()))
    }
}

/// Reads a response's body to its end, as a client would: a settle from the body settles
/// there, and the request's slots are given back.
pub(super) async fn drain(response: Response<Body>) {
    use http_body_util::BodyExt;
    let mut body = response.into_body();
    while let Some(Ok(_)) = body.frame().await {}
}
