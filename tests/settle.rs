//! Reserve, then reconcile: a rule charges an estimate and settles the true cost from the
//! response (a header, a function of the head, the bytes of a streamed body, a trailer), on
//! memory and on a real Redis, over real HTTP. Time is a manual clock that never moves unless
//! a test moves it, so every number is exact.

mod support;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::{Router, routing::get};
use bytes::Bytes;
use http_body::Frame;
use support::http::{HttpClient, Reply, serve};
use tokio::sync::{Mutex, mpsc, oneshot};
use tower_ratelimits::__private;
use tower_ratelimits::{
    ClientIp, Id, LayerError, Limiter, Limits, ManualClock, MemoryBackend, Mode, RateLimitLayer,
    Rule, Settle, SettleError, Transaction,
};

/// One unit per second refills each bucket: a frozen clock keeps every number exact.
const LIMITS: &str = "\
Tokens: {kind: ip, burst: 100, count: 100, period: 100s}
Bytes: {kind: ip, burst: 10000, count: 10000, period: 10000s}
Units: {kind: ip, burst: 50, count: 50, period: 50s}
";

use support::store::{EPOCH_US, Fixture, Store};

/// A limiter over `LIMITS` on `store` (on Redis with the deny cache, as the layer's default).
async fn limiter(fixture: &Fixture, store: Store) -> Limiter {
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    fixture.limiter(store, limits, "settle", true).await
}

/// A scenario's parts: a limiter over `LIMITS` on a store, a real server for an app behind
/// one layer with one rule on it, and a client of that server.
struct Served {
    fixture: Fixture,
    limiter: Limiter,
    server: support::http::Server,
    client: HttpClient,
}

/// [`Served`] on `store`, for `app` behind `rule`.
async fn served(store: Store, rule: Rule, app: Router) -> Served {
    let fixture = Fixture::new(store);
    let limiter = limiter(&fixture, store).await;
    let server = serve_rule(&limiter, rule, app).await;
    let client = HttpClient::new(&server);
    Served {
        fixture,
        limiter,
        server,
        client,
    }
}

/// A real server for `app` behind one layer with `rule` on `limiter`.
async fn serve_rule(limiter: &Limiter, rule: Rule, app: Router) -> support::http::Server {
    let layer = RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
    serve(app.layer(layer)).await
}

/// What the bucket of `name` for 127.0.0.1 holds now, asked of the store directly.
async fn remaining(limiter: &Limiter, name: &str) -> u64 {
    let key = limiter
        .key(
            name,
            Id::from("127.0.0.1".parse::<std::net::IpAddr>().unwrap()),
        )
        .unwrap();
    let probe = Transaction::new(key).cost(0);
    limiter.check(&[probe]).await.unwrap().decisions()[0].remaining()
}

/// The `r` of the `RateLimit` member named `name`.
fn r_of(reply: &Reply, name: &str) -> u64 {
    let field = reply.header("ratelimit").expect("a RateLimit field");
    let member = field
        .split(", ")
        .find(|m| m.starts_with(&format!("\"{name}\"")))
        .unwrap_or_else(|| panic!("no {name} in {field}"));
    let r = member
        .split(';')
        .find_map(|p| p.strip_prefix("r="))
        .unwrap_or_else(|| panic!("no r in {member}"));
    r.parse().unwrap()
}

/// `/gen?used=N` answers with `x-tokens-used: N` (none without `used`; one field per `used`);
/// `status=S` sets the status.
async fn generate(uri: http::Uri) -> Response {
    let mut response = Response::new(Body::from("generated"));
    for pair in uri.query().unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("used", used)) => {
                response
                    .headers_mut()
                    .append("x-tokens-used", used.parse().unwrap());
            }
            Some(("status", status)) => {
                *response.status_mut() =
                    http::StatusCode::from_u16(status.parse().unwrap()).unwrap();
            }
            _ => {}
        }
    }
    response
}

/// From a response header: unused units come back, extra units are charged (into debt when
/// the bucket does not hold them: the key then waits until time repays it), a missing or
/// malformed header keeps the estimate; each response already carries the settled bucket, and
/// the next request sees it.
async fn settles_from_a_header(store: Store) {
    let Served {
        fixture,
        limiter,
        server: _server,
        client,
    } = served(
        store,
        Rule::new("Tokens", ClientIp::new())
            .cost(30)
            .settle(Settle::header("x-tokens-used")),
        Router::new().route("/gen", get(generate)),
    )
    .await;

    // (query, status, bucket afterwards): the bucket starts with 100.
    let steps: [(&str, u16, u64); 7] = [
        // 30 reserved, 10 used: 20 back.
        ("used=10", 200, 90),
        // 30 reserved, 50 used: 20 more, which the bucket holds.
        ("used=50", 200, 40),
        // 30 reserved (10 left), 100 used: the extra 70 is charged, 60 of it as debt (it was
        // forgiven before, and the next request passed).
        ("used=100", 200, 0),
        // In debt: refused, nothing spent, nothing settled.
        ("used=0", 429, 0),
        // 120 s repay the 60 of debt and refill 60 units; no header keeps the estimate.
        ("", 200, 30),
        // A malformed header keeps it too.
        ("used=abc", 200, 0),
        ("used=0", 429, 0),
    ];
    for (step, (query, status, after)) in steps.into_iter().enumerate() {
        if step == 4 {
            fixture.clock.advance(Duration::from_secs(120));
        }
        let reply = client.get(&format!("/gen?{query}"), &[]).await;
        assert_eq!(reply.status, status, "{store:?} step {step} ({query})");
        if status == 200 {
            assert_eq!(
                r_of(&reply, "Tokens"),
                after,
                "{store:?} step {step}: the response shows the settled bucket"
            );
        }
        assert_eq!(
            remaining(&limiter, "Tokens").await,
            after,
            "{store:?} step {step} ({query})"
        );
    }
}

on_every_store!(settles_from_a_header => in_memory_a_header_settles_the_true_cost, on_redis_a_header_settles_the_true_cost);

/// An estimate of 0 (an LLM gateway's `max_tokens=0`, read from the request) is charged as 1:
/// it no longer passes an empty bucket, where the true cost could only be forgiven. Twenty such
/// requests that each use 100 tokens get 100 tokens from a bucket of 100 (2,000 before: every
/// request passed, the first one's 100 settled, the others' forgiven).
#[tokio::test]
async fn an_estimate_of_0_is_charged_1_up_front() {
    let Served {
        fixture: _fixture,
        limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new("Tokens", ClientIp::new())
            .cost_fn(|parts| {
                let query = parts.uri.query().unwrap_or("");
                query
                    .split('&')
                    .find_map(|p| p.strip_prefix("max_tokens="))
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(0)
            })
            .settle(Settle::header("x-tokens-used")),
        Router::new().route("/gen", get(generate)),
    )
    .await;
    let mut used = 0;
    for _ in 0..20 {
        let reply = client.get("/gen?max_tokens=0&used=100", &[]).await;
        if reply.status == 200 {
            used += 100;
        } else {
            assert_eq!(reply.status, 429);
        }
    }
    assert_eq!(used, 100, "tokens served against a bucket of 100");
    assert_eq!(remaining(&limiter, "Tokens").await, 0);
}

/// A settle header sent twice is ambiguous: neither value counts and the estimate stands
/// (before, the first one counted).
#[tokio::test]
async fn a_settle_header_sent_twice_keeps_the_estimate() {
    let Served {
        fixture: _fixture,
        limiter: _limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new("Tokens", ClientIp::new())
            .cost(30)
            .settle(Settle::header("x-tokens-used")),
        Router::new().route("/gen", get(generate)),
    )
    .await;
    let reply = client.get("/gen?used=10&used=50", &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(r_of(&reply, "Tokens"), 70, "the estimate of 30 stands");
    // One field settles as before.
    let reply = client.get("/gen?used=10", &[]).await;
    assert_eq!(r_of(&reply, "Tokens"), 60);
}

/// A `Range` request pays for the bytes it got: a 206 with 2 KiB of a larger file settles to
/// 2 units of 1 KiB, whatever the file's size.
#[tokio::test]
async fn a_range_request_pays_for_the_part_it_got() {
    let part = || async {
        let mut response = Response::new(Body::from(vec![b'x'; 2048]));
        *response.status_mut() = http::StatusCode::PARTIAL_CONTENT;
        response.headers_mut().insert(
            "content-range",
            http::HeaderValue::from_static("bytes 0-2047/1048576"),
        );
        response
    };
    let Served {
        fixture: _fixture,
        limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new("Bytes", ClientIp::new())
            .cost(64)
            .settle(Settle::body_bytes_per(1024)),
        Router::new().route("/file", get(part)),
    )
    .await;
    let reply = client.get("/file", &[("range", "bytes=0-2047")]).await;
    assert_eq!(reply.status, 206);
    assert_eq!(
        remaining(&limiter, "Bytes").await,
        10_000 - 2,
        "64 reserved, 2 kept"
    );
}

/// A bytes limit limits bytes: a client downloading 1 MiB files against 100 KiB per hour
/// (`cost(4)`, one unit per KiB) gets one file, and then waits until the debt is repaid, with
/// an exact `Retry-After`. Before, every overrun the bucket could not hold was forgiven: 100
/// downloads of 1 MiB passed in a row (100 MiB).
async fn a_bytes_limit_limits_bytes(store: Store) {
    let fixture = Fixture::new(store);
    let limits = Limits::from_yaml_str(
        "KibPerHour: {kind: ip, burst: 100, count: 100, period: 1h}\n",
        None,
    )
    .unwrap();
    let limiter = fixture.limiter(store, limits, "bytes", true).await;
    let file = || async { Response::new(Body::from(vec![b'x'; 1024 * 1024])) };
    let server = serve_rule(
        &limiter,
        Rule::new("KibPerHour", ClientIp::new())
            .cost(4)
            .settle(Settle::body_bytes_per(1024)),
        Router::new().route("/file", get(file)),
    )
    .await;
    let client = HttpClient::new(&server);
    let (mut served, mut denied) = (0usize, Vec::new());
    for _ in 0..100 {
        let reply = client.get("/file", &[]).await;
        match reply.status {
            200 => served += reply.body.len(),
            429 => denied.push(reply),
            other => panic!("{store:?}: status {other}"),
        }
    }
    assert_eq!(
        served,
        1024 * 1024,
        "{store:?}: bytes served against 100 KiB"
    );
    assert_eq!(denied.len(), 99, "{store:?}");
    // 4 reserved, 1,024 used: 96 left and 100 of debt charged, 824 forgiven. A request of 4
    // fits once 100 + 4 units (36 s each) are repaid: 3,744 s.
    assert_eq!(denied[0].header("retry-after"), Some("3744"), "{store:?}");
    fixture.clock.advance(Duration::from_secs(3743));
    assert_eq!(client.get("/file", &[]).await.status, 429, "{store:?}");
    fixture.clock.advance(Duration::from_secs(1));
    assert_eq!(client.get("/file", &[]).await.status, 200, "{store:?}");
}

on_every_store!(a_bytes_limit_limits_bytes => in_memory_a_bytes_limit_limits_bytes, on_redis_a_bytes_limit_limits_bytes);

/// A `HEAD` has no body, so a rule that settles from the body keeps its estimate (before, the
/// empty body settled to 0: 300 of 300 `HEAD`s of a download were free); a rule that settles
/// from a header settles from the `HEAD`'s header as from the `GET`'s.
#[tokio::test]
async fn a_head_keeps_the_estimate_of_a_body_settle() {
    let download = || async { Response::new(Body::from(vec![b'x'; 10 * 1024])) };
    let Served {
        fixture: _fixture,
        limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new("Bytes", ClientIp::new())
            .cost(4)
            .settle(Settle::body_bytes_per(1024)),
        Router::new().route("/file", get(download)),
    )
    .await;
    for _ in 0..3 {
        let reply = client.request(http::Method::HEAD, "/file", &[]).await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(
        remaining(&limiter, "Bytes").await,
        10_000 - 3 * 4,
        "three estimates"
    );
    // A GET pays for its 10 KiB.
    client.get("/file", &[]).await;
    assert_eq!(remaining(&limiter, "Bytes").await, 10_000 - 12 - 10);

    let server = serve_rule(
        &limiter,
        Rule::new("Tokens", ClientIp::new())
            .cost(30)
            .settle(Settle::header("x-tokens-used")),
        Router::new().route("/gen", get(generate)),
    )
    .await;
    let client = HttpClient::new(&server);
    let reply = client
        .request(http::Method::HEAD, "/gen?used=10", &[])
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        remaining(&limiter, "Tokens").await,
        90,
        "settled from the header"
    );
}

/// From a function of the response head: a failed request costs nothing.
#[tokio::test]
async fn a_function_of_the_head_refunds_failed_requests() {
    let Served {
        fixture: _fixture,
        limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new("Tokens", ClientIp::new())
            .cost(10)
            .settle(Settle::response(|head| {
                head.status.is_server_error().then_some(0)
            })),
        Router::new().route("/gen", get(generate)),
    )
    .await;
    assert_eq!(client.get("/gen?status=503", &[]).await.status, 503);
    assert_eq!(remaining(&limiter, "Tokens").await, 100, "refunded");
    assert_eq!(client.get("/gen", &[]).await.status, 200);
    assert_eq!(remaining(&limiter, "Tokens").await, 90, "kept");
}

/// A body the test feeds frame by frame; it tells when the server dropped it.
struct Fed {
    frames: mpsc::UnboundedReceiver<Frame<Bytes>>,
    _dropped: oneshot::Sender<()>,
}

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.frames.poll_recv(cx).map(|f| f.map(Ok))
    }
}

/// A route whose response body is fed by the test: each request takes the next feed.
type Feeds = Arc<Mutex<mpsc::UnboundedReceiver<Fed>>>;

fn fed_route(feeds: Feeds) -> Router {
    Router::new().route(
        "/download",
        get(move || {
            let feeds = feeds.clone();
            async move {
                let fed = feeds.lock().await.recv().await.expect("a feed per request");
                Response::new(Body::new(fed))
            }
        }),
    )
}

struct Feeder {
    feeds: mpsc::UnboundedSender<Fed>,
}

impl Feeder {
    fn new() -> (Self, Feeds) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { feeds: tx }, Arc::new(Mutex::new(rx)))
    }

    /// The next response's body: send frames on the first, learn of its drop on the second.
    fn next(&self) -> (mpsc::UnboundedSender<Frame<Bytes>>, oneshot::Receiver<()>) {
        let (frames, rx) = mpsc::unbounded_channel();
        let (dropped, gone) = oneshot::channel();
        self.feeds
            .send(Fed {
                frames: rx,
                _dropped: dropped,
            })
            .unwrap();
        (frames, gone)
    }
}

fn chunk(n: usize) -> Frame<Bytes> {
    Frame::data(Bytes::from(vec![b'x'; n]))
}

/// Waits (bounded) until the bucket holds `want`: a settle spawned when a body was dropped
/// completes on its own time. This waits for an effect; it asserts no duration.
async fn until_remaining(limiter: &Limiter, name: &str, want: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = remaining(limiter, name).await;
        if got == want || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A streamed body settles on its bytes when it ends, before its end reaches the client (so
/// the next request sees it); a body the client abandons settles on the bytes sent so far.
async fn settles_a_streamed_body(store: Store) {
    let (feeder, feeds) = Feeder::new();
    let Served {
        fixture: _fixture,
        limiter,
        server,
        client: _client,
    } = served(
        store,
        Rule::new("Bytes", ClientIp::new())
            .cost(1000)
            .settle(Settle::body_bytes()),
        fed_route(feeds),
    )
    .await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let uri: http::Uri = format!("http://{}/download", server.addr).parse().unwrap();

    // 1. Three chunks of 100 bytes: 1,000 reserved, 300 used.
    let (frames, _gone) = feeder.next();
    let response = client.get(uri.clone()).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        r_of_head(response.headers(), "Bytes"),
        9000,
        "{store:?}: the estimate"
    );
    let mut body = response.into_body();
    for _ in 0..3 {
        frames.send(chunk(100)).unwrap();
        let f = http_body_util::BodyExt::frame(&mut body)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(f.into_data().unwrap().len(), 100);
    }
    assert_eq!(
        remaining(&limiter, "Bytes").await,
        9000,
        "{store:?}: not settled before the end"
    );
    drop(frames);
    assert!(http_body_util::BodyExt::frame(&mut body).await.is_none());
    assert_eq!(
        remaining(&limiter, "Bytes").await,
        9700,
        "{store:?}: settled on 300 bytes by the time the client saw the end"
    );

    // 2. The next request shows it: 9,700 - 1,000 reserved.
    let (frames, gone) = feeder.next();
    let response = client.get(uri.clone()).await.unwrap();
    assert_eq!(r_of_head(response.headers(), "Bytes"), 8700, "{store:?}");
    // 3. The client reads 250 bytes and goes away.
    let mut body = response.into_body();
    frames.send(chunk(250)).unwrap();
    let f = http_body_util::BodyExt::frame(&mut body)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(f.into_data().unwrap().len(), 250);
    drop(body);
    gone.await.unwrap_err(); // the server dropped the body
    assert_eq!(
        until_remaining(&limiter, "Bytes", 9450).await,
        9450,
        "{store:?}: an abandoned body is charged the 250 bytes it sent"
    );
    drop(frames);
}

fn r_of_head(headers: &http::HeaderMap, name: &str) -> u64 {
    r_of(
        &Reply {
            status: 200,
            headers: headers.clone(),
            body: String::new(),
        },
        name,
    )
}

on_every_store!(settles_a_streamed_body => in_memory_a_streamed_body_settles_its_bytes, on_redis_a_streamed_body_settles_its_bytes);

/// A trailer settles when it arrives; a body that ends without it keeps the estimate.
async fn settles_from_a_trailer(store: Store) {
    let (feeder, feeds) = Feeder::new();
    let Served {
        fixture: _fixture,
        limiter,
        server: _server,
        client,
    } = served(
        store,
        Rule::new("Units", ClientIp::new())
            .cost(10)
            .settle(Settle::trailer("x-units")),
        fed_route(feeds),
    )
    .await;

    let (frames, _gone) = feeder.next();
    frames.send(chunk(5)).unwrap();
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-units", "3".parse().unwrap());
    frames.send(Frame::trailers(trailers)).unwrap();
    drop(frames);
    let reply = client.get("/download", &[]).await;
    assert_eq!((reply.status, reply.body.len()), (200, 5));
    assert_eq!(
        remaining(&limiter, "Units").await,
        47,
        "{store:?}: 3 units used"
    );

    let (frames, _gone) = feeder.next();
    frames.send(chunk(5)).unwrap();
    drop(frames);
    let reply = client.get("/download", &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        remaining(&limiter, "Units").await,
        37,
        "{store:?}: no trailer, the 10 reserved stand"
    );
}

on_every_store!(settles_from_a_trailer => in_memory_a_trailer_settles_the_true_cost, on_redis_a_trailer_settles_the_true_cost);

/// Settling is refused where it cannot work, when the layer is built.
#[test]
fn a_settle_that_cannot_work_is_refused_when_the_layer_is_built() {
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        MemoryBackend::new(),
    );
    let build = |rule: Rule| RateLimitLayer::new(limiter.clone(), [rule]).map(|_| ());
    let rule = || Rule::new("Tokens", ClientIp::new());
    for (settle_rule, reason, text) in [
        (
            rule().settle(Settle::header("not a header")),
            SettleError::NotAHeaderName("not a header".into()),
            "\"not a header\" is not a header name",
        ),
        (
            rule().settle(Settle::trailer("")),
            SettleError::NotAHeaderName(String::new()),
            "\"\" is not a header name",
        ),
        (
            rule().settle(Settle::body_bytes_per(0)),
            SettleError::ZeroBytesPerUnit,
            "body_bytes_per(0): a unit needs at least one byte",
        ),
        (
            rule().mode(Mode::CheckOnly).settle(Settle::body_bytes()),
            SettleError::SpendsNothing(Mode::CheckOnly),
            "a CheckOnly rule spends nothing to settle",
        ),
    ] {
        assert_eq!(reason.to_string(), text);
        assert_eq!(
            build(settle_rule),
            Err(LayerError::Settle {
                limit: "Tokens".into(),
                reason
            })
        );
    }
    assert!(build(rule().settle(Settle::header("x-tokens-used"))).is_ok());
}

/// The in-memory backend whose refunds wait until the client saw the end of the body (or a
/// second passed): the order of the two events shows whether the middleware held the end back
/// until the settle was done.
struct HoldsRefunds {
    inner: MemoryBackend,
    end_seen: Arc<tokio::sync::Notify>,
    log: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

#[tower_ratelimits::async_trait]
impl tower_ratelimits::Backend for HoldsRefunds {
    fn spend(&self, batch: &[tower_ratelimits::BucketTx<'_>]) -> tower_ratelimits::Spend {
        self.inner.spend(batch)
    }
    async fn refund(
        &self,
        batch: &[tower_ratelimits::BucketTx<'_>],
    ) -> Result<tower_ratelimits::Outcomes, tower_ratelimits::BackendError> {
        // Not a timing assertion: the wait only breaks the deadlock of a correct middleware.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.end_seen.notified()).await;
        let out = self.inner.refund(batch).await;
        self.log.lock().unwrap().push("settled");
        out
    }
    async fn reset(
        &self,
        keys: &[&tower_ratelimits::BucketKey],
    ) -> Result<(), tower_ratelimits::BackendError> {
        self.inner.reset(keys).await
    }
}

#[tokio::test]
async fn the_end_of_a_body_reaches_the_client_only_once_it_is_settled() {
    let end_seen = Arc::new(tokio::sync::Notify::new());
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        HoldsRefunds {
            inner: MemoryBackend::builder()
                .clock(ManualClock::new(EPOCH_US))
                .build(),
            end_seen: end_seen.clone(),
            log: log.clone(),
        },
    );
    let (feeder, feeds) = Feeder::new();
    // The layer waits for the settle far longer than the backend holds it back: with equal
    // times, a busy machine could let the layer's timeout end the settle first.
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(
            Rule::new("Bytes", ClientIp::new())
                .cost(1000)
                .settle(Settle::body_bytes()),
        )
        .backend_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let server = serve(fed_route(feeds).layer(layer)).await;
    let client = HttpClient::new(&server);
    let (frames, _gone) = feeder.next();
    frames.send(chunk(10)).unwrap();
    drop(frames);
    let reply = client.get("/download", &[]).await;
    log.lock().unwrap().push("end seen");
    end_seen.notify_one();
    assert_eq!(reply.body.len(), 10);
    assert_eq!(*log.lock().unwrap(), ["settled", "end seen"]);
    assert_eq!(remaining(&limiter, "Bytes").await, 9990);
}

// The units a settle header reports, for any value a server may send.
proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any `u64`, in plain digits with optional spaces or tabs around it (leading zeros
    /// too), is that cost; the same value sent twice in a field is no cost (ambiguous).
    #[test]
    fn a_cost_is_its_digits_and_a_field_sent_twice_is_none(
        n in proptest::prelude::any::<u64>(),
        zeros in 0usize..3,
        before in "[ \t]{0,2}",
        after in "[ \t]{0,2}",
    ) {
        let digits = format!("{}{n}", "0".repeat(zeros));
        let text = format!("{before}{digits}{after}");
        let value = http::HeaderValue::from_str(&text).unwrap();
        let expected = (digits.len() <= 20).then_some(n);
        proptest::prop_assert_eq!(__private::parse_units(&value), expected);
        let name = http::HeaderName::from_static("x-tokens-used");
        let mut headers = http::HeaderMap::new();
        headers.append(&name, value.clone());
        proptest::prop_assert_eq!(__private::units_in(&headers, &name), expected);
        headers.append(&name, value);
        proptest::prop_assert_eq!(__private::units_in(&headers, &name), None);
    }

    /// Anything that is not plain digits (a sign, a decimal point, an exponent, letters, an
    /// empty value, digits split by a space) is no cost: the estimate is kept.
    #[test]
    fn anything_but_digits_is_no_cost(text in "[0-9+\\-.eE xX_a-z]{0,24}") {
        let trimmed = text.trim_matches([' ', '\t']);
        let digits = !trimmed.is_empty()
            && trimmed.len() <= 20
            && trimmed.bytes().all(|b| b.is_ascii_digit());
        let value = http::HeaderValue::from_str(&text).unwrap();
        let parsed = __private::parse_units(&value);
        if digits {
            proptest::prop_assert_eq!(parsed, trimmed.parse::<u64>().ok());
        } else {
            proptest::prop_assert_eq!(parsed, None);
        }
    }
}

/// A response that reports an absurd cost (here `u64::MAX` units) is
/// counted apart (`outcome="absurd"`) and its units in no counter: the forgiven units stay what
/// the sane reports forgave (before, one such report wrapped the counter to
/// 18446744073709551415). The bucket is still charged what it takes (its debt). Scraped from
/// a real Prometheus recorder (this thread's: the runtime runs on it) and parsed.
#[tokio::test]
async fn an_absurd_reported_cost_is_counted_apart_and_wraps_no_counter() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let Served {
        fixture: _fixture,
        limiter: _limiter,
        server: _server,
        client,
    } = served(
        Store::Memory,
        Rule::new(
            "Tokens",
            ClientIp::new().trusted_proxies(["127.0.0.1/32".parse().unwrap()]),
        )
        .cost(10)
        .settle(Settle::header("x-tokens-used")),
        Router::new().route("/gen", get(generate)),
    )
    .await;
    // 10 reserved, 300 used: 90 of the bucket and 100 of debt charged, 100 forgiven.
    assert_eq!(client.get("/gen?used=300", &[]).await.status, 200);
    let forgiven = "tower_ratelimits_settled_units_total{limit=Tokens,outcome=forgiven}";
    let absurd = "tower_ratelimits_settlements_total{limit=Tokens,outcome=absurd}";
    let m = support::scrape::samples(&handle.render());
    assert_eq!(m[forgiven], 100.0);
    // A second client (its own bucket) reports every unit there is.
    let reply = client
        .get(
            "/gen?used=18446744073709551615",
            &[("x-forwarded-for", "203.0.113.9")],
        )
        .await;
    assert_eq!(reply.status, 200);
    let m = support::scrape::samples(&handle.render());
    assert_eq!(m[forgiven], 100.0, "no units of the absurd report");
    assert_eq!(m[absurd], 1.0);
}
