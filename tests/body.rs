//! The response body the layer hands on: the inner service's own, untouched, unless the request
//! holds a slot of a concurrency limit or settles from the body (then wrapped, through
//! `ResponseBody::hooked`); the layer's own answers through `ResponseBody::from_bytes`. Chosen
//! per request from the limits in force, so a reload that turns a GCRA limit into a concurrency
//! limit under load wraps the bodies of the requests decided after it, and no slot is leaked.
//!
//! The inner service is a tower service in process whose body type records which road each
//! response took (a real axum server cannot show the type of a body it sent); the backend is
//! the real memory backend. `tests/concurrency.rs` holds the same limits over TCP.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use tokio::sync::{Semaphore, mpsc};
use tower::{Layer, ServiceExt};
use tower_ratelimits::{
    Header, Id, Limiter, Limits, MemoryBackend, RateLimitBody, RateLimitLayer, ResponseBody, Rule,
};

/// A body that says which road it took.
enum Probe {
    /// The inner service's body, handed on as it was.
    Plain(Full<Bytes>),
    /// An answer of the layer's own.
    Answer(Full<Bytes>),
    /// The inner service's body wrapped by the layer.
    Hooked(UnsyncBoxBody<Bytes, Infallible>),
}

impl Probe {
    fn road(&self) -> &'static str {
        match self {
            Probe::Plain(_) => "plain",
            Probe::Answer(_) => "answer",
            Probe::Hooked(_) => "hooked",
        }
    }
}

impl Body for Probe {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Probe::Plain(b) | Probe::Answer(b) => Pin::new(b).poll_frame(cx),
            Probe::Hooked(b) => Pin::new(b).poll_frame(cx),
        }
    }
}

impl ResponseBody for Probe {
    fn from_bytes(data: Bytes) -> Self {
        Probe::Answer(Full::new(data))
    }

    fn hooked(body: RateLimitBody<Self>) -> Self {
        Probe::Hooked(body.boxed_unsync())
    }
}

const GCRA: &str = "L: {kind: account, burst: 1000, count: 1000, period: 1s}\n";
const SLOTS: &str = "L: {kind: account, concurrency: 2, lease: 1h}\n";

struct App {
    limiter: Limiter,
    backend: MemoryBackend,
    /// Held by every request in the inner service until the test adds permits.
    gate: Arc<Semaphore>,
    /// One message each time a request reaches the inner service.
    entered: mpsc::UnboundedReceiver<()>,
    service: tower_ratelimits::RateLimitService<
        tower::util::BoxCloneSyncService<Request<()>, Response<Probe>, Infallible>,
    >,
}

fn app(limits: &str) -> App {
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(limits, None).unwrap(),
        backend.clone(),
    );
    let gate = Arc::new(Semaphore::new(0));
    let (tx, entered) = mpsc::unbounded_channel();
    let held = gate.clone();
    let inner = tower::service_fn(move |_req: Request<()>| {
        let (gate, tx) = (held.clone(), tx.clone());
        async move {
            let _ = tx.send(());
            gate.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(Probe::Plain(Full::new(Bytes::from_static(
                b"ok",
            )))))
        }
    });
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("L", Header::new("x-account-id")))
        .build()
        .unwrap();
    App {
        limiter,
        backend,
        gate,
        entered,
        service: layer.layer(tower::util::BoxCloneSyncService::new(inner)),
    }
}

fn request() -> Request<()> {
    Request::builder()
        .uri("/")
        .header("x-account-id", "7")
        .body(())
        .unwrap()
}

/// Sends a request in a task of its own: its response, when it comes.
fn send(app: &App) -> tokio::task::JoinHandle<Response<Probe>> {
    let service = app.service.clone();
    tokio::spawn(async move { service.oneshot(request()).await.unwrap() })
}

#[tokio::test]
async fn a_gcra_limit_hands_on_the_inner_body_and_answers_with_the_layers_own() {
    let mut app = app("L: {kind: account, burst: 1, count: 1, period: 1h}\n");
    app.gate.add_permits(10);
    let allowed = app.service.clone().oneshot(request()).await.unwrap();
    assert_eq!(allowed.status(), StatusCode::OK);
    assert_eq!(
        allowed.body().road(),
        "plain",
        "nothing held, nothing settled: no wrapper"
    );
    let denied = app.service.clone().oneshot(request()).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(denied.body().road(), "answer");
    let body = denied.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(br#"{"errors":"#), "{body:?}");
    assert!(app.entered.try_recv().is_ok());
}

#[tokio::test]
async fn a_concurrency_limit_wraps_the_body_and_its_end_gives_the_slot_back() {
    let mut app = app(SLOTS);
    let key = app.limiter.key("L", Id::from(7u64)).unwrap();
    app.gate.add_permits(10);
    let first = app.service.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.body().road(), "hooked");
    assert_eq!(app.backend.leases(&key), 1, "held until the body ends");
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, Bytes::from_static(b"ok"));
    assert_eq!(app.backend.leases(&key), 0, "the body's end gave it back");
    let _ = app.entered.recv().await;
}

/// Requests in flight across a reload from a GCRA limit to a concurrency limit of 2: those
/// decided before it hold nothing and get their body as it was; of those decided after it, two
/// hold slots (their bodies wrapped) and the rest are refused; once every body is gone, no slot
/// is held.
#[tokio::test]
async fn a_reload_into_a_concurrency_limit_under_load_wraps_new_requests_and_leaks_no_slot() {
    let mut app = app(GCRA);
    let key = app.limiter.key("L", Id::from(7u64)).unwrap();
    let before: Vec<_> = (0..4).map(|_| send(&app)).collect();
    for _ in 0..4 {
        app.entered.recv().await.unwrap();
    }
    app.limiter
        .reload(Limits::from_yaml_str(SLOTS, None).unwrap())
        .unwrap();
    let after: Vec<_> = (0..4).map(|_| send(&app)).collect();
    // Two of the four reach the inner service; the other two are refused at once.
    for _ in 0..2 {
        app.entered.recv().await.unwrap();
    }
    assert_eq!(app.backend.leases(&key), 2);
    app.gate.add_permits(8);
    let mut roads = Vec::new();
    for task in before {
        let response = task.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        roads.push(response.body().road());
    }
    assert_eq!(roads, ["plain"; 4], "decided under the GCRA limit");
    let mut bodies = Vec::new();
    let mut refused = 0;
    for task in after {
        let response = task.await.unwrap();
        match response.status() {
            StatusCode::OK => {
                assert_eq!(response.body().road(), "hooked");
                bodies.push(response.into_body());
            }
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(response.body().road(), "answer");
                refused += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((bodies.len(), refused), (2, 2));
    assert_eq!(app.backend.leases(&key), 2, "held while their bodies live");
    drop(bodies);
    assert_eq!(app.backend.leases(&key), 0, "no slot leaked");
    // And the limit is whole again: a new request takes a slot.
    app.gate.add_permits(1);
    let again = app.service.clone().oneshot(request()).await.unwrap();
    assert_eq!(again.body().road(), "hooked");
}
