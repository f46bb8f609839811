//! The response future of [`RateLimitService`](super::RateLimitService): a state machine that
//! waits for the decision (when the backend did not answer at once), then for the inner
//! service, or hands out the answer `call` already made. What a decision means is decided in
//! `outcome.rs`, never here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RateLimitBody;
use super::outcome::{AllowedHeaders, Conclusion, Decide, conclude};
use super::rate_limit_layer::Shared;
use super::response::{error_response, insert_ratelimit_headers};

pin_project! {
    #[project = StateProj]
    enum State<S, B, F> {
        Deciding {
            decide: Decide,
            pending: Option<(S, Request<B>)>,
            grpc: bool,
        },
        Calling {
            #[pin]
            future: F,
            headers: Option<AllowedHeaders>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
    }
}

pin_project! {
    /// The future of a rate-limited call: decide, then call the inner service or answer.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<B>>,
    {
        #[pin]
        state: State<S, B, S::Future>,
        shared: Arc<Shared>,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    /// Waits for `decide`, then calls `inner` with `req` or answers.
    pub(crate) fn deciding(
        shared: Arc<Shared>,
        decide: Decide,
        inner: S,
        req: Request<B>,
        grpc: bool,
    ) -> Self {
        Self {
            state: State::Deciding {
                decide,
                pending: Some((inner, req)),
                grpc,
            },
            shared,
        }
    }

    /// Waits for the inner service's response, adding `headers` to it.
    pub(crate) fn calling(
        shared: Arc<Shared>,
        future: S::Future,
        headers: Option<AllowedHeaders>,
    ) -> Self {
        Self {
            state: State::Calling { future, headers },
            shared,
        }
    }

    /// Answers `response` without calling the inner service.
    pub(crate) fn answered(shared: Arc<Shared>, response: Response<Bytes>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
            shared,
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    type Output = Result<Response<RateLimitBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding {
                    decide,
                    pending,
                    grpc,
                } => {
                    let result = ready!(decide.as_mut().poll(cx));
                    let headers = match conclude(this.shared, result, *grpc) {
                        Conclusion::Call(headers) => headers,
                        Conclusion::Answer(response) => {
                            this.state.set(State::Answered {
                                response: Some(response),
                            });
                            continue;
                        }
                    };
                    let Some((mut inner, req)) = pending.take() else {
                        // Only reachable if polled again after completion.
                        let r = error_response(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "INTERNAL",
                            "polled after completion",
                            *grpc,
                            false,
                        );
                        return Poll::Ready(Ok(r.map(RateLimitBody::full)));
                    };
                    let future = inner.call(req);
                    this.state.set(State::Calling { future, headers });
                }
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    // A 429 from an inner layer keeps its own fields: adding ours would make
                    // them contradict the status.
                    if let Some(h) = headers.take()
                        && response.status() != StatusCode::TOO_MANY_REQUESTS
                    {
                        let shared = &**this.shared;
                        insert_ratelimit_headers(
                            response.headers_mut(),
                            &h.batch,
                            |d| shared.cached_policy(d),
                            h.legacy,
                        );
                    }
                    return Poll::Ready(Ok(response.map(RateLimitBody::inner)));
                }
                StateProj::Answered { response } => {
                    let response = response.take().unwrap_or_else(|| {
                        error_response(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "INTERNAL",
                            "polled after completion",
                            false,
                            false,
                        )
                    });
                    return Poll::Ready(Ok(response.map(RateLimitBody::full)));
                }
            }
        }
    }
}
