//! What a decision means for a request: call the inner service (with the `RateLimit` fields
//! to add to its response), or answer now (a 429, a 400, or a 503 when the backend failed and
//! the layer fails closed). The policy lives here; the response future only drives states.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::rate_limit_layer::{FailurePolicy, Shared};
use super::response::{Denial, error_response};
use crate::backend::BackendError;
use crate::limiter::LimiterError;
use crate::limiter::{BatchDecision, Decision, Transaction};

pub(crate) enum Failure {
    Limiter(LimiterError),
    Timeout,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Limiter(e) => e.fmt(f),
            Failure::Timeout => f.write_str("the store did not answer in time"),
        }
    }
}

pub(crate) type Decide = Pin<Box<dyn Future<Output = Result<BatchDecision, Failure>> + Send>>;

pub(crate) fn decide(shared: &Arc<Shared>, txs: Vec<Transaction>) -> Decide {
    let limiter = shared.limiter.clone();
    let fallback = shared.fallback.clone();
    let timeout = shared.timeout;
    Box::pin(async move {
        let result = {
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
        };
        match (result, fallback) {
            // The store failed: this instance's in-memory limiter decides instead.
            (
                Err(failure @ (Failure::Timeout | Failure::Limiter(LimiterError::Backend(_)))),
                Some(local),
            ) => {
                count("fallback");
                tracing::debug!(reason = %failure, "rate limit store failed; deciding in memory");
                // In memory it always answers at once; if it did not, the failure stands.
                match local.try_spend_now(&txs) {
                    Some(result) => result.map_err(Failure::Limiter),
                    None => Err(failure),
                }
            }
            (result, _) => result,
        }
    })
}

/// The headers an allowed response gets: the strictest decision, and its cached policy value.
pub(crate) struct AllowedHeaders {
    pub(crate) decision: Decision,
    pub(crate) policy: Option<http::HeaderValue>,
    pub(crate) legacy: bool,
}

pub(crate) enum Conclusion {
    /// Call the inner service, adding these headers to its response.
    Call(Option<AllowedHeaders>),
    /// Answer with this response.
    Answer(Response<Bytes>),
}

/// What a decision (or a failure to decide) means for the request.
pub(crate) fn conclude(
    shared: &Shared,
    result: Result<BatchDecision, Failure>,
    grpc: bool,
) -> Conclusion {
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
        Err(Failure::Limiter(LimiterError::Backend(BackendError::Full { .. }))) => {
            // The memory backend protects its memory: a new key cannot be tracked now. Letting
            // it through unlimited (fail open) is what a flood of new keys aims for, so this is
            // refused whatever the failure policy, with a hint to come back.
            count("full");
            let mut response = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "UNAVAILABLE",
                "the rate limiter is at capacity; try again shortly",
                grpc,
            );
            if !grpc {
                response.headers_mut().insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from_static("1"),
                );
            }
            Conclusion::Answer(response)
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
