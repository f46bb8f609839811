//! The service: takes the ready inner service and hands the request to the response future.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::future::ResponseFuture;
use super::outcome::{Decided, Road, Shared, Waited, conclude, road};
use super::response::is_grpc;

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> RateLimitService<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }
}

impl<S: fmt::Debug> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimitService<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for RateLimitService<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    B: Send + 'static,
    ResBody: ResponseBody,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // A request called at once calls the service that is ready; one whose call waits for
        // its decision takes it and leaves a clone for the next call (`Road::Call` and
        // `Road::Allowed` skip the clone: 31 instructions a request behind axum's router).
        let shared = self.shared.clone();
        let (mut parts, body) = req.into_parts();
        let inner = &mut self.inner;
        if shared.exempt.as_ref().is_some_and(|e| e.cover(&parts)) {
            super::observe::count_request("exempt");
            #[cfg(feature = "replay")]
            shared
                .rules
                .journal
                .exempt
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let future = inner.call(Request::from_parts(parts, body));
            return ResponseFuture::calling(shared, future, None);
        }
        match road(&shared, &mut parts) {
            Road::Answer(response) => ResponseFuture::answered(shared, response),
            Road::Call => {
                let future = inner.call(Request::from_parts(parts, body));
                ResponseFuture::calling(shared, future, None)
            }
            Road::Allowed(allowed) => {
                let future = inner.call(Request::from_parts(parts, body));
                ResponseFuture::calling(shared, future, allowed)
            }
            Road::Decided(decided) => {
                // Only an answer of ours depends on it.
                let grpc = !decided.allowed() && is_grpc(&parts.headers);
                concluded(
                    shared,
                    take_ready(inner),
                    Request::from_parts(parts, body),
                    decided,
                    grpc,
                )
            }
            Road::Deciding(decide) => {
                let grpc = is_grpc(&parts.headers);
                ResponseFuture::deciding(
                    shared,
                    decide,
                    take_ready(inner),
                    Request::from_parts(parts, body),
                    grpc,
                )
            }
        }
    }
}

/// The service that is ready, taken for a call made later; a clone left for the next call.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// A request decided at once: calls `inner` with it, answers, or waits, as the decision says.
fn concluded<S, B, ResBody>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<B>,
    decided: Decided,
    grpc: bool,
) -> ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    let conclusion = conclude(&shared, decided, grpc, &mut Waited::default());
    ResponseFuture::concluded(shared, conclusion, inner, req, grpc)
}
