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

use super::body::{RateLimitBody, ResponseBody};
use super::lease::Held;
use super::outcome::{
    AfterSettle, Allowed, Conclusion, Decide, Road, Shared, Waited, conclude, road,
};
use super::response::{ErrorBody, Fields, error_response};
use super::settle::{self, BodySettle, Task};
use crate::limiter::BatchDecision;

pin_project! {
    #[project = StateProj]
    enum State<S, B, F, R> {
        Deciding {
            decide: Decide,
            pending: Option<(S, Request<B>)>,
            grpc: bool,
        },
        Calling {
            #[pin]
            future: F,
        },
        // Settling the rules that settle from the response head, before handing it on (boxed:
        // the future of a request that settles nothing stays small).
        Settling {
            task: Task,
            held: Option<Box<(R, BatchDecision, AfterSettle)>>,
        },
        Answered {
            response: Option<Response<Bytes>>,
        },
        // Denied, waiting to be decided again ([`Rule::wait`](crate::Rule::wait)): nothing
        // held but the request and its place among the rule's waiting requests. The timer is
        // boxed (112 bytes): it made this the largest state, moved with every request's future.
        Waiting {
            sleep: Pin<Box<tokio::time::Sleep>>,
            pending: Option<(S, Request<B>)>,
            grpc: bool,
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
        state: State<S, B, S::Future, S::Response>,
        shared: Arc<Shared>,
        waited: Waited,
        // The slots the request holds on concurrency limits: moved into the response body,
        // given back if the future is dropped first (cancelled, or the handler panicked).
        release: Held,
        // What an allowed response gets (its fields, or the decisions to settle), beside the
        // state rather than in it: the call's state is then built in place (a 424-byte copy
        // fewer per request, 76 instructions).
        allowed: Option<Allowed>,
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
            waited: Waited::default(),
            release: None,
            allowed: None,
        }
    }

    /// Waits for the inner service's response, adding what `allowed` asks to it.
    pub(crate) fn calling(
        shared: Arc<Shared>,
        future: S::Future,
        allowed: Option<Allowed>,
    ) -> Self {
        Self {
            state: State::Calling { future },
            shared,
            waited: Waited::default(),
            release: None,
            allowed,
        }
    }

    /// Answers `response` without calling the inner service.
    pub(crate) fn answered(shared: Arc<Shared>, response: Response<Bytes>) -> Self {
        Self {
            state: State::Answered {
                response: Some(response),
            },
            shared,
            waited: Waited::default(),
            release: None,
            allowed: None,
        }
    }

    /// Goes where a request's first conclusion says: calls `inner` with `req`, answers, or
    /// waits to decide it again.
    pub(crate) fn concluded(
        shared: Arc<Shared>,
        conclusion: Conclusion,
        inner: S,
        req: Request<B>,
        grpc: bool,
    ) -> Self {
        let mut waited = Waited::default();
        let mut release = None;
        let mut allowed = None;
        let state = next(
            conclusion,
            inner,
            req,
            grpc,
            &mut waited,
            &mut release,
            &mut allowed,
        );
        Self {
            state,
            shared,
            waited,
            release,
            allowed,
        }
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    ResBody: ResponseBody,
{
    type Output = Result<Response<ResBody>, S::Error>;

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
                    let grpc = *grpc;
                    let Some((inner, req)) = pending.take() else {
                        return Poll::Ready(Ok(polled_after_completion(grpc)));
                    };
                    let conclusion = conclude(this.shared, result, grpc, this.waited);
                    let state = next(
                        conclusion,
                        inner,
                        req,
                        grpc,
                        this.waited,
                        this.release,
                        this.allowed,
                    );
                    this.state.set(state);
                }
                StateProj::Waiting {
                    sleep,
                    pending,
                    grpc,
                } => {
                    ready!(sleep.as_mut().poll(cx));
                    if this.waited.sleeps_on(sleep.as_mut()) {
                        continue;
                    }
                    let grpc = *grpc;
                    let Some((inner, req)) = pending.take() else {
                        return Poll::Ready(Ok(polled_after_completion(grpc)));
                    };
                    let state = again(
                        this.shared,
                        inner,
                        req,
                        grpc,
                        this.waited,
                        this.release,
                        this.allowed,
                    );
                    this.state.set(state);
                }
                StateProj::Calling { future } => {
                    // An error of the inner service: the request failed.
                    let response = ready!(future.poll(cx))
                        .inspect_err(|_| this.release.as_mut().map_or((), |r| r.failed()))?;
                    match answered(this.shared, response, this.release, this.allowed) {
                        Ok(response) => return Poll::Ready(Ok(response)),
                        Err((task, held)) => this.state.set(State::Settling {
                            task,
                            held: Some(held),
                        }),
                    }
                }
                StateProj::Settling { task, held } => {
                    let states = ready!(Pin::new(task).poll(cx));
                    let Some((response, mut batch, after)) = held.take().map(|held| *held) else {
                        return Poll::Ready(Ok(polled_after_completion(false)));
                    };
                    settle::merge(&mut batch, states);
                    let release = this.release.take();
                    return Poll::Ready(Ok(settled(this.shared, response, batch, after, release)));
                }
                StateProj::Answered { response } => {
                    let response = response.take().map(|r| r.map(ResBody::from_bytes));
                    return Poll::Ready(Ok(
                        response.unwrap_or_else(|| polled_after_completion(false))
                    ));
                }
            }
        }
    }
}

/// The inner service's response, noted by the request's slots: handed on with what the
/// allowed request gets (its fields, its body settling), or, for rules that settle from the
/// head, the settle's task and what waits for it.
#[inline]
#[allow(clippy::type_complexity)]
fn answered<R: ResponseBody>(
    shared: &Arc<Shared>,
    response: Response<R>,
    release: &mut Held,
    allowed: &mut Option<Allowed>,
) -> Result<Response<R>, (Task, Box<(Response<R>, BatchDecision, AfterSettle)>)> {
    if let Some(release) = release.as_mut() {
        release.head(response.status(), response.headers(), &shared.failed_when);
    }
    let (mut batch, mut after) = match allowed.take() {
        Some(Allowed::Settle { batch, after }) => (batch, after),
        fields => {
            let mut response = response;
            if let Some(Allowed::Fields(fields)) = fields {
                with_fields(shared, &mut response, fields);
            }
            let release = release.take();
            return Ok(response.map(|b| RateLimitBody::settling(b, None, release)));
        }
    };
    let (head, body) = response.into_parts();
    let reserved = shared.rules.reservations(&batch, false);
    after.head_came();
    let task = settle::settle_head(&shared.settler, reserved, &head, after.latency);
    let response = Response::from_parts(head, body);
    match task {
        None => Ok(settled(shared, response, batch, after, release.take())),
        // Settled at once (a store in memory): no state to wait in.
        Some(Task::Done(states)) => {
            settle::merge(&mut batch, states);
            Ok(settled(shared, response, batch, after, release.take()))
        }
        Some(task) => Err((task, Box::new((response, batch, after)))),
    }
}

/// The state a conclusion leads to: calling `inner` with `req` (the slots it holds kept in
/// `release`, what its response gets in `gets`), answering, or waiting (the place kept in
/// `waited`, and the time of the first wait).
fn next<S, B>(
    conclusion: Conclusion,
    mut inner: S,
    req: Request<B>,
    grpc: bool,
    waited: &mut Waited,
    release: &mut Held,
    gets: &mut Option<Allowed>,
) -> State<S, B, S::Future, S::Response>
where
    S: Service<Request<B>>,
{
    match conclusion {
        Conclusion::Call(allowed, held) => {
            // Held before the call: a handler that panics in `call` still gives them back.
            *release = held;
            *gets = allowed;
            State::Calling {
                future: inner.call(req),
            }
        }
        Conclusion::Answer(response) => State::Answered {
            response: Some(response),
        },
        Conclusion::Wait(delay, permit) => {
            waited.since.get_or_insert_with(tokio::time::Instant::now);
            waited.permit = Some(permit);
            State::Waiting {
                sleep: Box::pin(tokio::time::sleep(delay)),
                pending: Some((inner, req)),
                grpc,
            }
        }
    }
}

/// Decides a request again after its wait, under the limits of now, as the service does.
fn again<S, B>(
    shared: &Arc<Shared>,
    inner: S,
    req: Request<B>,
    grpc: bool,
    waited: &mut Waited,
    release: &mut Held,
    gets: &mut Option<Allowed>,
) -> State<S, B, S::Future, S::Response>
where
    S: Service<Request<B>>,
{
    let (mut parts, body) = req.into_parts();
    let decided = road(shared, &mut parts);
    let req = Request::from_parts(parts, body);
    match decided {
        Road::Answer(response) => {
            waited.permit = None;
            State::Answered {
                response: Some(response),
            }
        }
        // A reload disabled every rule that applied.
        Road::Call => {
            waited.permit = None;
            next(
                Conclusion::Call(None, None),
                inner,
                req,
                grpc,
                waited,
                release,
                gets,
            )
        }
        Road::Allowed(allowed) => {
            waited.permit = None;
            next(
                Conclusion::Call(allowed, None),
                inner,
                req,
                grpc,
                waited,
                release,
                gets,
            )
        }
        Road::Decided(decided) => {
            let conclusion = conclude(shared, decided, grpc, waited);
            next(conclusion, inner, req, grpc, waited, release, gets)
        }
        Road::Deciding(decide) => State::Deciding {
            decide,
            pending: Some((inner, req)),
            grpc,
        },
    }
}

/// The answer of a future polled again after it completed (a caller's bug; never a panic).
fn polled_after_completion<B: ResponseBody>(grpc: bool) -> Response<B> {
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "INTERNAL",
        "polled after completion",
        grpc,
        ErrorBody::Json,
    )
    .map(B::from_bytes)
}

/// An allowed request's response with its `RateLimit` fields added (unless an inner layer
/// answered 429: ours would contradict the status).
fn with_fields<B>(shared: &Shared, response: &mut Response<B>, fields: Fields) {
    if response.status() != StatusCode::TOO_MANY_REQUESTS {
        shared.answers.fields.write(response.headers_mut(), fields);
    }
}

/// The response of an allowed request whose rules settle, as `after` says: the fields of its
/// settled decisions, and its body settling the rules that settle from the body.
fn settled<B: ResponseBody>(
    shared: &Arc<Shared>,
    mut response: Response<B>,
    batch: BatchDecision,
    after: AfterSettle,
    release: Held,
) -> Response<B> {
    if after.fields
        && let Some(fields) = Fields::of(
            &batch,
            |name, quota| shared.rules.cached_policy(name, quota),
            &shared.rules.joined_policy,
        )
    {
        with_fields(shared, &mut response, fields);
    }
    // A HEAD's response has no body: its rules that settle from the body keep the estimate.
    let (head, body) = response.into_parts();
    let settle = after
        .body
        .then(|| {
            let mut pending = shared.rules.reservations(&batch, true);
            pending
                .iter_mut()
                .for_each(|r| r.saw_head(&head, after.latency));
            BodySettle::of(&shared.settler, pending)
        })
        .flatten();
    Response::from_parts(head, RateLimitBody::settling(body, settle, release))
}
