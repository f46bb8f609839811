//! Per-key concurrency limits (`concurrency: N` in YAML) on the memory backend: through the
//! `Limiter`, and through the layer on a real axum server over TCP with slow handlers held at
//! a gate (no sleeps: a handler waits for the test to open the gate). The Redis and cluster
//! versions, with two app instances, are in `tests/redis_concurrency.rs`.

#[path = "support/clock.rs"]
mod clock;
#[path = "support/counting.rs"]
mod counting;
#[path = "support/gate.rs"]
mod gate;
#[path = "support/http.rs"]
mod http_support;
#[path = "support/scrape.rs"]
mod scrape;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::{Router, body::Body, routing::get};
use bytes::Bytes;
use gate::Gate;
use http_body_util::BodyExt;
use http_support::{HttpClient, serve};
use tokio::sync::mpsc;
use tower_ratelimits::{
    ConfigErrorKind, Header, Id, Limiter, LimiterError, Limits, ManualClock, MemoryBackend, Mode,
    RateLimitLayer, Rule, ShapeError, Transaction,
};

const LIMITS: &str = "\
Exports: {kind: account, concurrency: 3, lease: 60s, retry_after: 2s}
One: {kind: account, concurrency: 1, lease: 1h}
Expiring: {kind: account, concurrency: 1, lease: 10s}
PerAccount: {kind: account, burst: 2, count: 2, period: 1s}
";

/// Waits (bounded) until `done` holds: a slot is given back when the server drops the body,
/// which may come just after the client saw its end.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

/// The senders feeding the bodies of `/stream` responses.
type Feeds = Arc<std::sync::Mutex<Vec<mpsc::Sender<Result<Bytes, Infallible>>>>>;

struct App {
    router: Router,
    limiter: Limiter,
    backend: MemoryBackend,
    gate: Gate,
    /// The bodies of `/stream` requests, fed by the test.
    streams: Feeds,
}

fn app(limit: &str) -> App {
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    );
    let gate = Gate::new();
    let streams: Feeds = Arc::default();
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new(limit, Header::new("x-account")))
        .build()
        .unwrap();
    let slow = gate.clone();
    let feeds = streams.clone();
    let router = Router::new()
        .route(
            "/slow",
            get(move || {
                let gate = slow.clone();
                async move {
                    gate.pass().await;
                    "done"
                }
            }),
        )
        .route("/quick", get(|| async { "quick" }))
        .route(
            "/stream",
            get(move || {
                let feeds = feeds.clone();
                async move {
                    let (tx, rx) = mpsc::channel(4);
                    feeds.lock().unwrap().push(tx);
                    Body::new(ChannelBody(rx))
                }
            }),
        )
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("a handler that panics");
                }
                "never"
            }),
        )
        .layer(layer);
    App {
        router,
        limiter,
        backend,
        gate,
        streams,
    }
}

/// An app behind `layer`: `/stream` answers a body fed by the test through the returned
/// senders (its slot held until the body ends), `/quick` answers at once.
fn streaming_app(layer: RateLimitLayer) -> (Router, Feeds) {
    let feeds: Feeds = Arc::default();
    let streams = feeds.clone();
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let feeds = streams.clone();
                async move {
                    let (tx, rx) = mpsc::channel(4);
                    feeds.lock().unwrap().push(tx);
                    Body::new(ChannelBody(rx))
                }
            }),
        )
        .route("/quick", get(|| async { "quick" }))
        .layer(layer);
    (app, feeds)
}

/// `GET path` for `account`, through `app` in process (its body still to be read).
async fn get_as(app: &Router, path: &str, account: u64) -> http::Response<Body> {
    use tower::ServiceExt;
    app.clone()
        .oneshot(
            http::Request::get(path)
                .header("x-account", account.to_string())
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap()
}

/// A response body made of the chunks sent on its channel, ending when every sender is gone.
struct ChannelBody(mpsc::Receiver<Result<Bytes, Infallible>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| c.map(http_body::Frame::data)))
    }
}

/// A client that keeps no idle connection, and its GET of `path` for account 7 as a response
/// whose body is still to be read (or the error of a connection that died).
async fn raw_get(
    server: &http_support::Server,
    path: &str,
) -> (
    RawClient,
    Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>,
) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<http_body_util::Full<Bytes>>();
    let request = http::Request::get(format!("http://{}{path}", server.addr))
        .header("x-account", "7")
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let response = client.request(request).await;
    (client, response)
}

type RawClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<Bytes>,
>;

fn key(limiter: &Limiter, name: &str, account: u64) -> tower_ratelimits::BucketKey {
    limiter.key(name, Id::from(account)).unwrap()
}

/// N + 1 slow requests of one key over TCP: exactly N reach the handler, the last is refused
/// with 429, `Retry-After` from the limit's hint and the `concurrent-requests` policy; another
/// key is not affected; once the N end, their slots are free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_plus_one_slow_requests_admit_exactly_n() {
    let app = app("Exports");
    let server = serve(app.router.clone()).await;
    let client = Arc::new(HttpClient::new(&server));
    let exports = key(&app.limiter, "Exports", 7);
    let mut slow = Vec::new();
    for _ in 0..3 {
        let client = client.clone();
        slow.push(tokio::spawn(async move {
            client.get("/slow", &[("x-account", "7")]).await
        }));
    }
    app.gate.entered(3).await;
    assert_eq!(app.backend.leases(&exports), 3);

    let refused = client.get("/quick", &[("x-account", "7")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("2"));
    assert_eq!(
        refused.header("ratelimit-policy"),
        Some("\"Exports\";q=3;qu=\"concurrent-requests\"")
    );
    assert_eq!(refused.header("ratelimit"), Some("\"Exports\";r=0;t=2"));

    // Another key has its own slots.
    let other = client.get("/quick", &[("x-account", "8")]).await;
    assert_eq!(other.status, 200);
    assert_eq!(other.header("ratelimit"), Some("\"Exports\";r=2;t=0"));

    app.gate.open(3);
    for s in slow {
        assert_eq!(s.await.unwrap().status, 200);
    }
    eventually("the slots are given back", || {
        app.backend.leases(&exports) == 0
    })
    .await;
    let again = client.get("/quick", &[("x-account", "7")]).await;
    assert_eq!(again.status, 200);
}

/// The slot is held until the response body ends, not only until its head: a streaming
/// response keeps its key at its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_is_held_until_the_body_ends() {
    let app = app("One");
    let server = serve(app.router.clone()).await;
    let client = HttpClient::new(&server);
    let one = key(&app.limiter, "One", 7);
    let (_client, response) = raw_get(&server, "/stream").await;
    let response = response.unwrap();
    assert_eq!(response.status(), 200);
    let feed = app.streams.lock().unwrap().pop().unwrap();
    feed.send(Ok(Bytes::from_static(b"part 1"))).await.unwrap();

    assert_eq!(app.backend.leases(&one), 1);
    assert_eq!(
        client.get("/quick", &[("x-account", "7")]).await.status,
        429
    );

    drop(feed);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"part 1");
    eventually("the slot is given back at the body's end", || {
        app.backend.leases(&one) == 0
    })
    .await;
    assert_eq!(
        client.get("/quick", &[("x-account", "7")]).await.status,
        200
    );
}

/// A client that goes away in the middle of the body gives its slot back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_gives_its_slot_back() {
    let app = app("One");
    let server = serve(app.router.clone()).await;
    let one = key(&app.limiter, "One", 7);
    let (raw, response) = raw_get(&server, "/stream").await;
    let response = response.unwrap();
    let feed = app.streams.lock().unwrap().pop().unwrap();
    feed.send(Ok(Bytes::from_static(b"part 1"))).await.unwrap();
    assert_eq!(app.backend.leases(&one), 1);
    drop(response);
    drop(raw);
    // The server notices when it next writes: the stream keeps going until then.
    let feeding = tokio::spawn(async move {
        while feed.send(Ok(Bytes::from_static(b"more"))).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    eventually("the slot of a client that went away is given back", || {
        app.backend.leases(&one) == 0
    })
    .await;
    feeding.abort();
}

/// A handler that panics gives its slot back (its connection dies, and the response future
/// with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_gives_its_slot_back() {
    let app = app("One");
    let server = serve(app.router.clone()).await;
    let one = key(&app.limiter, "One", 7);
    let (_client, response) = raw_get(&server, "/panic").await;
    assert!(response.is_err(), "the connection dies");
    eventually("the slot of a panicking handler is given back", || {
        app.backend.leases(&one) == 0
    })
    .await;
    let client = HttpClient::new(&server);
    assert_eq!(
        client.get("/quick", &[("x-account", "7")]).await.status,
        200
    );
}

/// A request cancelled while its handler runs (its future dropped) gives its slot back at once.
#[tokio::test]
async fn a_cancelled_request_gives_its_slot_back_at_once() {
    use tower::ServiceExt;
    let app = app("One");
    let one = key(&app.limiter, "One", 7);
    let router = app.router.clone();
    let request = http::Request::get("/slow")
        .header("x-account", "7")
        .body(Body::empty())
        .unwrap();
    let running = tokio::spawn(router.oneshot(request));
    app.gate.entered(1).await;
    assert_eq!(app.backend.leases(&one), 1);
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    assert_eq!(app.backend.leases(&one), 0);
}

/// Through the `Limiter`: a slot per spend, given back by `release` (once: a second release
/// finds nothing); a lease never given back stops counting at its deadline, on the backend's
/// clock.
#[tokio::test]
async fn leases_are_released_once_and_expire_at_their_deadline() {
    let clock = ManualClock::new(1_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    );
    let tx = Transaction::new(key(&limiter, "Expiring", 7));
    let first = limiter.spend(std::slice::from_ref(&tx)).await.unwrap();
    assert!(first.allowed());
    let lease = first.decisions()[0].lease().unwrap();
    assert_eq!(lease.quota().max_cost(), 1);
    let denied = limiter.spend(std::slice::from_ref(&tx)).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.decisions()[0].retry_after(), Duration::from_secs(1));
    assert_eq!(denied.decisions()[0].lease_id(), None);

    assert_eq!(
        limiter.release(std::slice::from_ref(&lease)).await.unwrap(),
        1
    );
    assert_eq!(
        limiter.release(std::slice::from_ref(&lease)).await.unwrap(),
        0
    );

    // Taken and never given back (its instance died): it counts for 10 s, then no longer.
    assert!(
        limiter
            .spend(std::slice::from_ref(&tx))
            .await
            .unwrap()
            .allowed()
    );
    clock.advance(Duration::from_secs(10) - Duration::from_micros(1));
    assert!(
        !limiter
            .spend(std::slice::from_ref(&tx))
            .await
            .unwrap()
            .allowed()
    );
    clock.advance(Duration::from_micros(1));
    assert!(
        limiter
            .spend(std::slice::from_ref(&tx))
            .await
            .unwrap()
            .allowed()
    );
    // Every lease has ended: the sweep drops the key.
    clock.advance(Duration::from_secs(10));
    assert_eq!(backend.leases(tx.key()), 0);
    assert_eq!(backend.sweep(), 1);
}

/// In a batch, a concurrency limit is all or nothing with the others: a batch another limit
/// denies takes no slot. A probe (cost 0) and a check take none either; a range is refused.
#[tokio::test]
async fn batches_probes_and_checks_take_no_slot_unless_allowed() {
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    );
    let one = key(&limiter, "One", 7);
    let rate = key(&limiter, "PerAccount", 7);
    let batch = [
        Transaction::new(one.clone()),
        Transaction::new(rate.clone()).cost(2),
    ];
    let allowed = limiter.spend(&batch).await.unwrap();
    assert!(allowed.allowed());
    let held = allowed.decisions()[0].lease().unwrap();
    assert_eq!(limiter.release(&[held]).await.unwrap(), 1);

    // The rate limit is spent: the batch is denied, and the free slot stays free.
    let denied = limiter.spend(&batch).await.unwrap();
    assert!(!denied.allowed());
    assert!(denied.decisions()[0].allowed());
    assert_eq!(denied.decisions()[0].remaining(), 1);
    assert_eq!(denied.decisions()[0].lease_id(), None);
    assert_eq!(backend.leases(&one), 0);

    let probe = limiter
        .spend(&[Transaction::new(one.clone()).cost(0)])
        .await
        .unwrap();
    assert!(probe.allowed());
    assert_eq!(
        (
            probe.decisions()[0].remaining(),
            probe.decisions()[0].granted()
        ),
        (1, 0)
    );
    let check = limiter
        .spend(&[Transaction::new(one.clone()).mode(Mode::CheckOnly)])
        .await
        .unwrap();
    assert!(check.allowed());
    assert_eq!(check.decisions()[0].lease_id(), None);
    assert_eq!(backend.leases(&one), 0);

    assert!(matches!(
        limiter
            .spend(&[Transaction::new(one.clone()).cost_range(0..=1)])
            .await,
        Err(LimiterError::RangeOnConcurrency { .. })
    ));
    assert!(matches!(
        limiter.spend(&[Transaction::new(one).cost(2)]).await,
        Err(LimiterError::CostAboveBurst {
            cost: 2,
            burst: 1,
            ..
        })
    ));
}

/// The YAML form: `concurrency` with its `lease` (default 60 s) and `retry_after` (default
/// 1 s), in defaults and overrides; mixing it with a rate limit's fields is an error naming
/// both, and `lease` without `concurrency` names what is missing.
#[test]
fn the_yaml_form_and_its_errors() {
    let limits = Limits::from_yaml_str("Jobs: {concurrency: 4}", None).unwrap();
    let name = limits.name("Jobs").unwrap();
    let quota = limits.default_limit(name).unwrap();
    let c = quota.as_concurrency().unwrap();
    assert_eq!(
        (c.max(), c.lease_us(), c.retry_after_us()),
        (4, 60_000_000, 1_000_000)
    );
    assert_eq!(quota.max_cost(), 1);

    let with_override = Limits::from_yaml_str(
        "Jobs: {kind: account, concurrency: 4}\n",
        Some("Jobs:42: {concurrency: 40, lease: 5m}\n"),
    )
    .unwrap();
    let vip =
        tower_ratelimits::BucketKey::new(with_override.name("Jobs").unwrap(), Id::from(42u64));
    assert_eq!(
        with_override
            .resolve(&vip)
            .unwrap()
            .as_concurrency()
            .unwrap()
            .max(),
        40
    );

    let err = |yaml: &str| Limits::from_yaml_str(yaml, None).unwrap_err();
    assert!(matches!(
        err("Jobs: {concurrency: 4, burst: 5}").kind(),
        ConfigErrorKind::ConflictingFields("concurrency", "burst")
    ));
    assert!(matches!(
        err("Jobs: {burst: 5, count: 5, period: 1s, lease: 5s}").kind(),
        ConfigErrorKind::ConflictingFields("lease", "burst")
    ));
    assert!(matches!(
        err("Jobs: {lease: 5s}").kind(),
        ConfigErrorKind::MissingField("concurrency")
    ));
    assert!(matches!(
        err("Jobs: {concurrency: 0}").kind(),
        ConfigErrorKind::BadNumber {
            field: "concurrency",
            ..
        }
    ));
    assert!(matches!(
        err("Jobs: {concurrency: 4, lease: 0s}").kind(),
        ConfigErrorKind::Shape(ShapeError::Concurrency(_))
    ));
    // A lease error is on the lease's line, a concurrency above the cap on its own line; a
    // duration written as a number says what to write.
    let lease = err("Jobs:\n  concurrency: 4\n  lease: 0s\n");
    assert!(matches!(
        lease.kind(),
        ConfigErrorKind::Shape(ShapeError::Concurrency(_))
    ));
    assert_eq!(lease.location().line, Some(3));
    let many = err("Jobs:\n  lease: 5s\n  concurrency: 100001\n");
    assert!(matches!(
        many.kind(),
        ConfigErrorKind::Shape(ShapeError::Concurrency(
            tower_ratelimits::ConcurrencyError::TooMany { max: 100_001 }
        ))
    ));
    assert_eq!(many.location().line, Some(3));
    assert!(matches!(
        err("Jobs: {concurrency: 4, retry_after: 1}").kind(),
        ConfigErrorKind::BadNumber {
            field: "retry_after",
            ..
        }
    ));
    assert!(matches!(
        err("Jobs: {concurrency: 4, cost: 2}").kind(),
        ConfigErrorKind::CostAboveBurst { cost: 2, burst: 1 }
    ));
}

/// Slots are counted, by a real Prometheus recorder, parsed: acquired, denied, released.
#[tokio::test]
async fn slots_are_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        MemoryBackend::new(),
    );
    let tx = [Transaction::new(key(&limiter, "One", 7))];
    let first = limiter.spend(&tx).await.unwrap();
    assert!(!limiter.spend(&tx).await.unwrap().allowed());
    let leases: Vec<_> = first.decisions().iter().filter_map(|d| d.lease()).collect();
    limiter.release(&leases).await.unwrap();
    // Given back twice: the second finds nothing held and is not counted.
    assert_eq!(limiter.release(&leases).await.unwrap(), 0);
    let m = scrape::samples(&handle.render());
    let count = |outcome: &str| {
        m.get(&format!(
            "tower_ratelimits_leases_total{{limit=One,outcome={outcome}}}"
        ))
        .copied()
        .unwrap_or(0.0)
    };
    assert_eq!(
        (count("acquired"), count("denied"), count("released")),
        (1.0, 1.0, 1.0)
    );
}

/// A store that can be taken down and brought back: the memory backend behind a switch (a
/// fake for the middleware's own logic; the store's part, a charge of a slot, is in the
/// conformance traces on Redis and the cluster).
#[derive(Clone)]
struct Switch {
    down: Arc<std::sync::atomic::AtomicBool>,
    inner: MemoryBackend,
}

#[tower_ratelimits::async_trait]
impl tower_ratelimits::Backend for Switch {
    fn spend(&self, batch: &[tower_ratelimits::BucketTx<'_>]) -> tower_ratelimits::Spend {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return tower_ratelimits::Spend::Ready(Err(
                tower_ratelimits::BackendError::Unavailable("down".into()),
            ));
        }
        self.inner.spend(batch)
    }
    async fn refund(
        &self,
        batch: &[tower_ratelimits::BucketTx<'_>],
    ) -> Result<tower_ratelimits::Outcomes, tower_ratelimits::BackendError> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tower_ratelimits::BackendError::Unavailable("down".into()));
        }
        self.inner.refund(batch).await
    }
    async fn reset(
        &self,
        keys: &[&tower_ratelimits::BucketKey],
    ) -> Result<(), tower_ratelimits::BackendError> {
        self.inner.reset(keys).await
    }
}

/// Slots the in-memory fallback handed out during an outage are recorded in the store within
/// a second of its return, so they keep counting there: limit 3, three streams admitted by the
/// fallback, the store back, then a fourth request is refused (before, the store knew none of
/// them and admitted three more: six in flight). When the streams end their slots are given
/// back in both.
#[tokio::test(start_paused = true)]
async fn slots_the_fallback_handed_out_count_in_the_store_once_it_returns() {
    let switch = Switch {
        down: Arc::default(),
        inner: MemoryBackend::new(),
    };
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), switch.clone());
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Exports", Header::new("x-account")))
        .on_backend_failure(tower_ratelimits::FailurePolicy::FallbackToMemory { percent: 100 })
        .build()
        .unwrap();
    let (app, feeds) = streaming_app(layer);
    let get_ = |path: &'static str| get_as(&app, path, 7);
    let exports = key(&limiter, "Exports", 7);
    switch.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut held = Vec::new();
    for _ in 0..3 {
        let response = get_("/stream").await;
        assert_eq!(response.status(), 200, "the fallback admits");
        held.push(response);
    }
    assert_eq!(get_("/quick").await.status(), 429, "the fallback holds 3");
    switch
        .down
        .store(false, std::sync::atomic::Ordering::SeqCst);
    tokio::time::advance(Duration::from_secs(1)).await;
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(switch.inner.leases(&exports), 3, "recorded in the store");
    assert_eq!(
        get_("/quick").await.status(),
        429,
        "a fourth is refused by the store"
    );
    drop(held);
    drop(feeds);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(switch.inner.leases(&exports), 0, "given back in the store");
    assert_eq!(get_("/quick").await.status(), 200);
}

/// The slots of requests in flight are renewed together. 300 long requests
/// over 3 keys (a lease of 3 s: renewed every second) cost one backend call per renewal, for
/// all of them: 4 calls over 4 seconds, where each request renewed its own before (1,200). Every
/// slot stays held past its lease time: the 101st request of a key is refused.
#[tokio::test(start_paused = true)]
async fn the_slots_of_requests_in_flight_are_renewed_in_one_call_per_tick() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = Arc::new(AtomicUsize::new(0));
    let backend = counting::Counting {
        calls: calls.clone(),
        inner: MemoryBackend::new(),
    };
    let limits = "Streams: {kind: account, concurrency: 100, lease: 3s}\n";
    let limiter = Limiter::new(Limits::from_yaml_str(limits, None).unwrap(), backend);
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Streams", Header::new("x-account")))
        .build()
        .unwrap();
    let (app, feeds) = streaming_app(layer);
    let get_ = |account: u64| get_as(&app, "/stream", account);
    let mut held = Vec::new();
    for i in 0..300u64 {
        let response = get_(i % 3).await;
        assert_eq!(response.status(), 200);
        held.push(response);
    }
    let admitted = calls.load(Ordering::SeqCst);
    assert_eq!(admitted, 300, "one call per request");
    for second in 1..=4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            calls.load(Ordering::SeqCst) - admitted,
            second,
            "one renewal call per tick, for 300 requests"
        );
    }
    // 4 s past a 3 s lease: every slot is still held.
    for account in 0..3 {
        assert_eq!(get_(account).await.status(), 429, "account {account}");
    }
    drop(held);
    drop(feeds);
}

/// A stream open for a day holds its slot the whole day: the layer renews its lease (10
/// minutes, renewed every third of it) 432 times and never loses it, so the account's second
/// stream is refused at every hour; the stream's messages keep flowing; when it ends, the slot
/// comes back at once.
#[tokio::test(start_paused = true)]
async fn a_stream_open_for_a_day_keeps_its_slot_renewed_and_gives_it_back() {
    let limits = "Streams: {kind: account, concurrency: 1, lease: 10m}\n";
    // The store reads tokio's (paused) clock: a lease not renewed would end within the day.
    let backend = MemoryBackend::builder()
        .clock(clock::TokioClock::now())
        .build();
    let limiter = Limiter::new(Limits::from_yaml_str(limits, None).unwrap(), backend);
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("Streams", Header::new("x-account")))
        .build()
        .unwrap();
    let (app, feeds) = streaming_app(layer);
    let mut stream = get_as(&app, "/stream", 7).await.into_body();
    let feed = feeds.lock().unwrap()[0].clone();
    for hour in 0..24 {
        for _ in 0..18 {
            // 200 s: one renewal tick.
            tokio::time::advance(Duration::from_secs(200)).await;
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
        }
        feed.send(Ok(Bytes::from(format!("hour {hour}"))))
            .await
            .unwrap();
        let chunk = stream.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(chunk, format!("hour {hour}"));
        assert_eq!(get_as(&app, "/quick", 7).await.status(), 429, "hour {hour}");
    }
    // The stream ends: every sender of its channel gone (the app keeps the list of them).
    drop(feed);
    feeds.lock().unwrap().clear();
    assert!(stream.frame().await.is_none(), "the stream ended");
    drop(stream);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(get_as(&app, "/quick", 7).await.status(), 200);
}

/// Day-long streams cannot corner a capacity shared by an adaptive limit's keys: one account
/// opens streams until it is refused (it holds all but the headroom: 16 of 20), they stay open
/// a whole day (the layer renews their leases on tokio's paused clock, which the store reads),
/// and a quiet account is served at every hour while the flooding one stays refused.
#[tokio::test(start_paused = true)]
async fn day_long_streams_of_one_key_leave_a_quiet_key_a_slot_of_a_shared_capacity() {
    let limits = "\
Shared:
  kind: account
  concurrency: {adaptive: {min: 1, initial: 30, max: 100, algorithm: aimd, capacity: 20}}
  lease: 10m
";
    let backend = MemoryBackend::builder()
        .clock(clock::TokioClock::now())
        .build();
    let limiter = Limiter::new(Limits::from_yaml_str(limits, None).unwrap(), backend);
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("Shared", Header::new("x-account")))
        .build()
        .unwrap();
    let (app, feeds) = streaming_app(layer);
    let mut streams = Vec::new();
    for _ in 0..100 {
        let response = get_as(&app, "/stream", 7).await;
        if response.status() != 200 {
            break;
        }
        streams.push(response);
    }
    assert_eq!(streams.len(), 16, "all but the headroom");
    for hour in 0..24 {
        for _ in 0..18 {
            tokio::time::advance(Duration::from_secs(200)).await;
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(get_as(&app, "/quick", 7).await.status(), 429, "hour {hour}");
        let quiet = get_as(&app, "/quick", 8).await;
        assert_eq!(quiet.status(), 200, "hour {hour}");
        drop(quiet);
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
    }
    feeds.lock().unwrap().clear();
    drop(streams);
}

/// Runs `test` on a runtime of its own (time paused) in a thread of its own, and fails if it
/// has not finished within a minute: a deadlock parks the runtime's only thread, so only a
/// watcher outside it can turn the hang into a failure.
fn within_a_minute(
    test: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> + Send + 'static,
) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(test());
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {}
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the test failed (above)"),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("hung: no answer within a minute")
        }
    }
}

/// Slots held across a reload of the limit's count or of its lease time.
/// The renewal named the key once per limit its leases were taken under, and the memory
/// backend locked the key's slot once per transaction: the second lock, on the same thread,
/// never returned, and the server answered nothing from the first renewal tick on. Now the
/// server keeps answering, and every slot stays held past its lease time (renewed under the
/// limit in force).
#[test]
fn a_reload_with_slots_held_keeps_the_server_answering_and_the_slots_renewed() {
    for (after, held_after) in [
        ("Streams: {kind: account, concurrency: 5, lease: 3s}\n", 5),
        ("Streams: {kind: account, concurrency: 3, lease: 4s}\n", 3),
    ] {
        within_a_minute(move || {
            Box::pin(async move {
                let before = "Streams: {kind: account, concurrency: 3, lease: 3s}\n";
                let limiter = Limiter::new(
                    Limits::from_yaml_str(before, None).unwrap(),
                    MemoryBackend::new(),
                );
                let layer = RateLimitLayer::builder(limiter.clone())
                    .rule(Rule::new("Streams", Header::new("x-account")).for_path_prefix("/stream"))
                    .build()
                    .unwrap();
                let (app, feeds) = streaming_app(layer);
                let get_ = |path: &'static str| get_as(&app, path, 7);
                let mut held = Vec::new();
                for _ in 0..3 {
                    let response = get_("/stream").await;
                    assert_eq!(response.status(), 200);
                    held.push(response);
                }
                limiter
                    .reload(Limits::from_yaml_str(after, None).unwrap())
                    .unwrap();
                for _ in 3..held_after {
                    let response = get_("/stream").await;
                    assert_eq!(response.status(), 200, "after the reload to {after}");
                    held.push(response);
                }
                // Past two renewal ticks and the first lease time: the server still answers,
                // and every slot is still held.
                for _ in 0..5 {
                    tokio::time::advance(Duration::from_secs(1)).await;
                    for _ in 0..8 {
                        tokio::task::yield_now().await;
                    }
                    assert_eq!(get_("/quick").await.status(), 200, "after {after}");
                }
                assert_eq!(get_("/stream").await.status(), 429, "after {after}");
                drop(held);
                drop(feeds);
            })
        });
    }
}

/// A batch that names one key twice, sent to the memory backend as the lease calls may send
/// it: decided in order (the second spend reads what the first leaves), one lock per key, on
/// every shape (GCRA keyed by a number, one word, and by text), and the key written once.
#[test]
fn a_batch_naming_one_key_twice_is_decided_in_order() {
    within_a_minute(|| {
        Box::pin(async {
            use tower_ratelimits::{Backend, BucketTx};
            let yaml = "\
Slots: {kind: account, concurrency: 1, lease: 1h}
Tiered: {kind: account, tiers: [{limit: 1, window: 1m, active: 1m, cooldown: 0s}]}
Rate: {kind: account, burst: 1, count: 1, period: 1h}
RateText: {kind: domain, burst: 1, count: 1, period: 1h}
Monthly: {kind: account, calendar: {count: 1, period: month}}
";
            let backend = MemoryBackend::new();
            let limiter = Limiter::new(Limits::from_yaml_str(yaml, None).unwrap(), backend.clone());
            for name in ["Slots", "Tiered", "Rate", "RateText", "Monthly"] {
                let key = match name {
                    "RateText" => limiter.parse_key(name, "a.example").unwrap(),
                    _ => key(&limiter, name, 7),
                };
                let limits = limiter.limits();
                let quota = limits.resolve(&key).unwrap();
                let tx = |lease| {
                    BucketTx::new(&key, quota, 1..=1, Mode::CheckAndSpend)
                        .unwrap()
                        .with_lease(lease)
                };
                let both = [tx(1), tx(2)];
                let outcomes = backend.spend(&both).outcomes().await.unwrap();
                assert!(outcomes[0].allowed, "{name}: the first spend fits");
                assert!(
                    !outcomes[1].allowed,
                    "{name}: the second reads the first's spend"
                );
                // The batch was denied: nothing was spent, one spend still fits.
                let outcomes = backend.spend(&both[..1]).outcomes().await.unwrap();
                assert!(outcomes[0].allowed, "{name}: a denied batch spends nothing");
                let outcomes = backend.spend(&both[1..]).outcomes().await.unwrap();
                assert!(!outcomes[0].allowed, "{name}: one spend was written");
            }
        })
    });
}
