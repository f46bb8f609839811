//! The response future of [`RateLimitService`](super::RateLimitService).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RateLimitBody;
use super::rate_limit_layer::{FailurePolicy, Shared};
use super::response::{Denial, error_response, insert_ratelimit_headers, is_grpc};
use super::rule::Prepared;
use crate::limiter::LimiterError;
use crate::limiter::{BatchDecision, Transaction};

enum Failure {
    Limiter(LimiterError),
    Timeout,
}

type Decide = Pin<Box<dyn Future<Output = Result<BatchDecision, Failure>> + Send>>;

fn decide(shared: &Arc<Shared>, txs: Vec<Transaction>) -> Decide {
    let limiter = shared.limiter.clone();
    let timeout = shared.timeout;
    Box::pin(async move {
        let mut spend = std::pin::pin!(limiter.spend(&txs));
        // A backend that answers at once (in memory) needs no timer.
        let first = std::future::poll_fn(|cx| match spend.as_mut().poll(cx) {
            Poll::Ready(r) => Poll::Ready(Some(r)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        match first {
            Some(r) => r.map_err(Failure::Limiter),
            None => match tokio::time::timeout(timeout, spend).await {
                Ok(r) => r.map_err(Failure::Limiter),
                Err(_) => Err(Failure::Timeout),
            },
        }
    })
}

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
    pub(crate) fn new(shared: Arc<Shared>, mut inner: S, req: Request<B>) -> Self {
        let (parts, body) = req.into_parts();
        let grpc = is_grpc(&parts.headers);
        let state = match shared.prepare(&parts, grpc) {
            Prepared::Reject(response) => State::Answered {
                response: Some(response),
            },
            Prepared::Batch(txs) if txs.is_empty() => State::Calling {
                future: inner.call(Request::from_parts(parts, body)),
                headers: None,
            },
            Prepared::Batch(txs) => match shared.limiter.try_spend_now(&txs) {
                // The backend decided at once (in memory): no box, nothing stored.
                Some(result) => match conclude(&shared, result.map_err(Failure::Limiter), grpc) {
                    Conclusion::Call(headers) => State::Calling {
                        future: inner.call(Request::from_parts(parts, body)),
                        headers,
                    },
                    Conclusion::Answer(response) => State::Answered {
                        response: Some(response),
                    },
                },
                None => State::Deciding {
                    decide: decide(&shared, txs),
                    pending: Some((inner, Request::from_parts(parts, body))),
                    grpc,
                },
            },
        };
        Self { state, shared }
    }
}

/// The headers an allowed response gets: the strictest decision, and its cached policy value.
struct AllowedHeaders {
    decision: crate::limiter::Decision,
    policy: Option<http::HeaderValue>,
    legacy: bool,
}

enum Conclusion {
    /// Call the inner service, adding these headers to its response.
    Call(Option<AllowedHeaders>),
    /// Answer with this response.
    Answer(Response<Bytes>),
}

/// What a decision (or a failure to decide) means for the request.
fn conclude(shared: &Shared, result: Result<BatchDecision, Failure>, grpc: bool) -> Conclusion {
    match result {
        Ok(batch) if batch.allowed() => {
            count("allowed");
            if !shared.headers_on_allowed {
                return Conclusion::Call(None);
            }
            let policy = batch.strictest().and_then(|d| shared.cached_policy(d));
            Conclusion::Call(batch.into_strictest().map(|decision| AllowedHeaders {
                decision,
                policy,
                legacy: shared.legacy_headers,
            }))
        }
        Ok(batch) => {
            count("denied");
            let denial = Denial {
                batch: &batch,
                grpc,
                legacy_headers: shared.legacy_headers,
            };
            Conclusion::Answer(match &shared.on_denied {
                Some(f) => f(&denial),
                None => denial.default_response(),
            })
        }
        Err(Failure::Limiter(LimiterError::CostAboveBurst { name, cost, burst })) => {
            count("rejected");
            let message =
                format!("request cost {cost} exceeds the burst of {burst} of rate limit {name}");
            Conclusion::Answer(error_response(
                StatusCode::BAD_REQUEST,
                "BADREQUEST",
                &message,
                grpc,
            ))
        }
        Err(failure) => {
            count("backend_failure");
            let reason = match &failure {
                Failure::Timeout => format!(
                    "rate limit backend did not answer within {:?}",
                    shared.timeout
                ),
                Failure::Limiter(e) => e.to_string(),
            };
            if shared.failure == FailurePolicy::FailClosed {
                tracing::warn!(%reason, "rate limiter failed; failing closed");
                return Conclusion::Answer(error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "UNAVAILABLE",
                    "rate limiter unavailable",
                    grpc,
                ));
            }
            tracing::warn!(%reason, "rate limiter failed; failing open");
            Conclusion::Call(None)
        }
    }
}

#[cfg(feature = "metrics")]
fn count(outcome: &'static str) {
    metrics::counter!("tower_ratelimits_requests_total", "outcome" => outcome).increment(1);
}

#[cfg(not(feature = "metrics"))]
fn count(_: &'static str) {}

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
                        );
                        return Poll::Ready(Ok(r.map(RateLimitBody::full)));
                    };
                    let future = inner.call(req);
                    this.state.set(State::Calling { future, headers });
                }
                StateProj::Calling { future, headers } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(h) = headers.take() {
                        insert_ratelimit_headers(
                            response.headers_mut(),
                            &h.decision,
                            h.policy,
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
                        )
                    });
                    return Poll::Ready(Ok(response.map(RateLimitBody::full)));
                }
            }
        }
    }
}
