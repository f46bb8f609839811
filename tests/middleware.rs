//! The middleware's own logic, in process: one backend call per request, backend failures
//! both ways (error and timeout), response options, gRPC answers, bad requests. Test backends
//! wrap or replace the real one here; the real backends are proven in their own tests.

#[path = "support/counting.rs"]
mod counting;
#[path = "support/scrape.rs"]
mod scrape;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::{Router, body::Body, routing::any};
use counting::Counting;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimits::async_trait;
use tower_ratelimits::{Backend, BackendError, BucketTx, FieldStyle, Spend};
use tower_ratelimits::{BucketKey, Limiter, Limits, ManualClock, MemoryBackend, Outcomes};
use tower_ratelimits::{
    ClientIp, FailurePolicy, Header, Ipv6Range48, OnMissingKey, RateLimitLayer, Rule, Settle,
};

const DEFAULTS: &str = "\
PerIp: {kind: ip, burst: 2, count: 2, period: 2s}
PerRange: {kind: ipv6_range, burst: 10, count: 10, period: 1s}
PerAccount: {kind: account, burst: 10, count: 10, period: 1s}
";

/// Fails every call, or never answers.
struct Broken {
    hang: bool,
}

#[async_trait]
impl Backend for Broken {
    fn spend(&self, _: &[BucketTx<'_>]) -> Spend {
        let hang = self.hang;
        Spend::Pending(Box::pin(async move {
            if hang {
                std::future::pending::<()>().await;
            }
            Err(BackendError::Unavailable("connection refused".into()))
        }))
    }
    async fn refund(&self, _: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        Err(BackendError::Unavailable("connection refused".into()))
    }
    async fn reset(&self, _: &[&BucketKey]) -> Result<(), BackendError> {
        Err(BackendError::Unavailable("connection refused".into()))
    }
}

/// The field style of the flags: fields on allowed responses, and the legacy ones too.
fn style(on_allowed: bool, legacy: bool) -> FieldStyle {
    match (on_allowed, legacy) {
        (true, false) => FieldStyle::Ietf,
        (true, true) => FieldStyle::IetfAndLegacy,
        (false, false) => FieldStyle::IetfOnDenials,
        (false, true) => FieldStyle::IetfAndLegacyOnDenials,
    }
}

fn limits() -> Limits {
    Limits::from_yaml_str(DEFAULTS, None).unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", any(|| async { "ok" }))
        .layer(layer)
}

fn request(peer: &str) -> http::request::Builder {
    Request::get("/").extension(peer.parse::<SocketAddr>().unwrap())
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let r = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = r.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

fn three_rules() -> Vec<Rule> {
    vec![
        Rule::new("PerIp", ClientIp::new()),
        Rule::new("PerRange", Ipv6Range48::new(ClientIp::new())),
        Rule::new("PerAccount", Header::new("x-account-id")),
    ]
}

#[tokio::test]
async fn a_multi_rule_request_is_one_backend_call() {
    let calls = Arc::new(AtomicUsize::new(0));
    let backend = Counting {
        calls: calls.clone(),
        inner: MemoryBackend::new(),
    };
    let app = app(RateLimitLayer::new(Limiter::new(limits(), backend), three_rules()).unwrap());
    for i in 1..=3 {
        let req = request("[2001:db8::1]:1000")
            .header("x-account-id", "7")
            .body(Body::empty())
            .unwrap();
        let (status, _, _) = send(&app, req).await;
        assert_eq!(
            status,
            if i <= 2 {
                StatusCode::OK
            } else {
                StatusCode::TOO_MANY_REQUESTS
            }
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            i,
            "three rules, one call per request"
        );
    }
}

#[tokio::test]
async fn backend_errors_fail_open_or_closed() {
    let open = app(RateLimitLayer::new(
        Limiter::new(limits(), Broken { hang: false }),
        three_rules()[..1].to_vec(),
    )
    .unwrap());
    let (status, headers, body) =
        send(&open, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "ok");
    assert!(headers.get("ratelimit").is_none());

    let closed = app(
        RateLimitLayer::builder(Limiter::new(limits(), Broken { hang: false }))
            .rule(Rule::new("PerIp", ClientIp::new()))
            .on_backend_failure(FailurePolicy::FailClosed)
            .build()
            .unwrap(),
    );
    let (status, headers, body) =
        send(&closed, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(
        body,
        r#"{"errors":[{"code":"UNAVAILABLE","message":"rate limiter unavailable"}]}"#
    );
}

#[tokio::test(start_paused = true)]
async fn a_hanging_backend_times_out_into_the_policy() {
    for (policy, expected) in [
        (FailurePolicy::FailOpen, StatusCode::OK),
        (FailurePolicy::FailClosed, StatusCode::SERVICE_UNAVAILABLE),
    ] {
        let app = app(
            RateLimitLayer::builder(Limiter::new(limits(), Broken { hang: true }))
                .rule(Rule::new("PerIp", ClientIp::new()))
                .backend_timeout(Duration::from_millis(250))
                .on_backend_failure(policy)
                .build()
                .unwrap(),
        );
        let start = tokio::time::Instant::now();
        let (status, _, _) = send(&app, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
        assert_eq!(status, expected);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(250),
            "answered at the timeout (virtual time)"
        );
    }
}

#[tokio::test]
async fn response_options() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limiter = Limiter::new(
        limits(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let quiet = app(RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("PerIp", ClientIp::new()))
        .fields(FieldStyle::IetfOnDenials)
        .denied_response(|d| {
            let mut r = http::Response::new(bytes::Bytes::from(format!(
                "slow down, {}s",
                d.retry_after_secs()
            )));
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            r
        })
        .build()
        .unwrap());
    for _ in 0..2 {
        let (status, headers, _) =
            send(&quiet, request("10.0.0.2:1").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        assert!(headers.get("ratelimit").is_none() && headers.get("ratelimit-policy").is_none());
    }
    let (status, _, body) = send(&quiet, request("10.0.0.2:1").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(body, "slow down, 1s");

    // A cost function: POST costs 2 (the whole burst).
    let costly = app(RateLimitLayer::builder(limiter)
        .rule(
            Rule::new("PerIp", ClientIp::new())
                .cost_fn(|r| if r.method == http::Method::POST { 2 } else { 1 }),
        )
        .build()
        .unwrap());
    let post = || {
        request("10.0.0.3:1")
            .method("POST")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&costly, post()).await.0, StatusCode::OK);
    assert_eq!(send(&costly, post()).await.0, StatusCode::TOO_MANY_REQUESTS);
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        send(&costly, request("10.0.0.3:1").body(Body::empty()).unwrap())
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn grpc_requests_get_resource_exhausted_trailers_only() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limiter = Limiter::new(limits(), MemoryBackend::builder().clock(clock).build());
    let app = app(RateLimitLayer::new(limiter, vec![Rule::new("PerIp", ClientIp::new())]).unwrap());
    let grpc = || {
        request("10.0.0.4:1")
            .header("content-type", "application/grpc+proto")
            .body(Body::empty())
            .unwrap()
    };
    send(&app, grpc()).await;
    send(&app, grpc()).await;
    let (status, headers, body) = send(&app, grpc()).await;
    assert_eq!(status, StatusCode::OK, "gRPC errors travel in grpc-status");
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(
        headers["grpc-message"],
        "rate limit PerIp exceeded; retry after 1 s"
    );
    assert!(body.is_empty());
}

#[tokio::test]
async fn bad_requests_and_set_up_errors() {
    let limiter = Limiter::new(limits(), MemoryBackend::new());
    // No peer address and no fallback: a 500, never a shared "unknown" key.
    let app1 = app(
        RateLimitLayer::new(limiter.clone(), vec![Rule::new("PerIp", ClientIp::new())]).unwrap(),
    );
    let (status, _, body) = send(&app1, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body.contains("no peer address"), "{body}");
    // With a fallback the request is keyed by it.
    let app2 = app(RateLimitLayer::new(
        limiter.clone(),
        vec![Rule::new(
            "PerIp",
            ClientIp::new().fallback("192.0.2.1".parse().unwrap()),
        )],
    )
    .unwrap());
    let (status, headers, _) = send(&app2, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["ratelimit"], "\"PerIp\";r=1;t=1");
    // A cost above the burst can never pass: 400, not a 429 to retry forever.
    let app3 = app(RateLimitLayer::new(
        limiter.clone(),
        vec![Rule::new("PerIp", ClientIp::new()).cost(3)],
    )
    .unwrap());
    let (status, _, body) = send(&app3, request("10.0.0.5:1").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("exceeds the burst"), "{body}");
    // A header value that is not text, duplicated, or too long.
    let app4 = app(RateLimitLayer::new(
        limiter.clone(),
        vec![
            Rule::new("PerAccount", Header::new("x-account-id")).on_missing_key(OnMissingKey::Skip),
        ],
    )
    .unwrap());
    let raw = Request::get("/")
        .header(
            "x-account-id",
            http::HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app4, raw).await.0, StatusCode::BAD_REQUEST);
    let twice = Request::get("/")
        .header("x-account-id", "1")
        .header("x-account-id", "2")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app4, twice).await.0, StatusCode::BAD_REQUEST);
    let long = Request::get("/")
        .header("x-account-id", "9".repeat(300))
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app4, long).await.0, StatusCode::BAD_REQUEST);
    // Layer set-up errors.
    use tower_ratelimits::LayerError;
    assert_eq!(
        RateLimitLayer::new(limiter.clone(), vec![]).unwrap_err(),
        LayerError::NoRules
    );
    assert_eq!(
        RateLimitLayer::new(limiter.clone(), vec![Rule::new("Nope", ClientIp::new())]).unwrap_err(),
        LayerError::UnknownLimit {
            name: "Nope".into(),
            did_you_mean: None,
            at: None
        }
    );
    // A name that differs in case, or by a letter, says which was meant (before: only
    // `rule for unknown limit "PerIP"`).
    for (given, meant) in [("PerIP", "PerIp"), ("PerIpp", "PerIp")] {
        let e = RateLimitLayer::new(limiter.clone(), vec![Rule::new(given, ClientIp::new())])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("rule for unknown limit {given:?}; did you mean {meant:?}?")
        );
    }
    // A rule from a rules file says where the file defines it (before: no file, no line).
    let rules = tower_ratelimits::RuleSet::from_named_yaml(
        "rules.yaml",
        "rules:\n  - {limit: PerIp, key: client_ip}\n  - {limit: PerIP, key: client_ip}\n",
    )
    .unwrap();
    assert_eq!(
        rules.layer(limiter.clone()).unwrap_err().to_string(),
        "rules.yaml:3: rule for unknown limit \"PerIP\"; did you mean \"PerIp\"?"
    );
    assert_eq!(
        RateLimitLayer::new(
            limiter,
            vec![
                Rule::new("PerIp", ClientIp::new()),
                Rule::new("PerIp", Header::new("x-a"))
            ]
        )
        .unwrap_err(),
        LayerError::DuplicateRule("PerIp".into())
    );
}

#[tokio::test]
async fn readiness_is_forwarded_and_the_ready_service_is_used() {
    use std::task::Poll;
    use tower::Service;
    // An inner service that is ready only after it was polled once.
    #[derive(Clone, Default)]
    struct Warm {
        ready: bool,
    }
    impl Service<Request<Body>> for Warm {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), Self::Error>> {
            if self.ready {
                Poll::Ready(Ok(()))
            } else {
                self.ready = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
        fn call(&mut self, _: Request<Body>) -> Self::Future {
            assert!(self.ready, "called without being ready");
            std::future::ready(Ok(http::Response::new(Body::from("warm"))))
        }
    }
    let layer = RateLimitLayer::new(
        Limiter::new(limits(), MemoryBackend::new()),
        vec![Rule::new("PerIp", ClientIp::new())],
    )
    .unwrap();
    let mut svc = tower::Layer::layer(&layer, Warm::default());
    let r = svc
        .ready()
        .await
        .unwrap()
        .call(request("10.0.0.6:1").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// An allowed request with nothing to settle has its fields taken from the backend's outcomes
/// by reference (the limiter's `Verdict`, no `Decision` built); a layer in which some rule
/// settles takes them from the decisions. Both must answer exactly alike: the same requests,
/// at the same times, through one layer with the rule alone and one with the rule and a
/// second, settling rule that never applies, give the same statuses, `RateLimit` and
/// `RateLimit-Policy` fields, legacy fields and bodies, with headers on and off, costs from a
/// function, an override, and denials.
#[tokio::test]
async fn the_single_rule_path_answers_exactly_as_the_general_path() {
    const WITH_OVERRIDE: &str = "\
PerIp: {kind: ip, burst: 3, count: 3, period: 2s}
Never: {kind: account, burst: 1, count: 1, period: 1s}
";
    const OVERRIDES: &str = "\
- PerIp:
    burst: 5
    count: 5
    period: 1s
    ids: [10.0.0.9]
";
    for (headers, legacy) in [(true, false), (true, true), (false, false)] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let make = |general: bool| {
            let limiter = Limiter::new(
                Limits::from_yaml_str(WITH_OVERRIDE, Some(OVERRIDES)).unwrap(),
                MemoryBackend::builder().clock(clock.clone()).build(),
            );
            let rule = Rule::new("PerIp", ClientIp::new())
                .cost_fn(|r| if r.method == http::Method::POST { 2 } else { 1 });
            let mut builder = RateLimitLayer::builder(limiter)
                .rule(rule)
                .fields(style(headers, legacy));
            if general {
                builder = builder.rule(
                    Rule::new("Never", Header::new("x-never"))
                        .on_missing_key(OnMissingKey::Skip)
                        .settle(Settle::header("x-never-used")),
                );
            }
            app(builder.build().unwrap())
        };
        let (single, general) = (make(false), make(true));
        let steps = [
            ("GET", "10.0.0.1:1", 0),
            ("POST", "10.0.0.1:1", 100),
            ("GET", "10.0.0.1:1", 0),
            ("GET", "10.0.0.1:1", 250),
            ("POST", "10.0.0.1:1", 700),
            ("GET", "10.0.0.9:1", 0),
            ("POST", "10.0.0.9:1", 1),
            ("POST", "10.0.0.9:1", 1),
            ("POST", "10.0.0.9:1", 1),
            ("GET", "[2001:db8::1]:1", 3000),
            ("GET", "10.0.0.1:1", 0),
            ("POST", "10.0.0.1:1", 0),
        ];
        let label = format!("headers {headers}, legacy {legacy}");
        let denied = same_answers(&single, &general, &clock, &steps, headers, &label).await;
        assert!(denied >= 2, "the steps must deny too");
    }
}

/// Several rules: fields taken by reference answer exactly as fields taken from decisions: the
/// same requests, at the same times, through one layer with the rules alone and one with a
/// shadowed, settling rule added that never applies (a layer that settles concludes from
/// decisions), give the same
/// statuses, `RateLimit` and `RateLimit-Policy` fields (the strictest member first), legacy
/// fields and bodies, with headers on and off, a rule out of scope for some requests, costs
/// from a function, an override, and denials by either rule.
#[tokio::test]
async fn the_fast_path_for_several_rules_answers_exactly_as_the_general_path() {
    const LIMITS: &str = "\
PerIp: {kind: ip, burst: 4, count: 4, period: 2s}
PerRange: {kind: ipv6_range, burst: 3, count: 3, period: 1s}
PerAccount: {kind: account, burst: 6, count: 6, period: 3s}
Never: {kind: account, burst: 1, count: 1, period: 1s}
";
    const OVERRIDES: &str = "\
- PerIp:
    burst: 8
    count: 8
    period: 1s
    ids: [10.0.0.9]
";
    for (headers, legacy) in [(true, false), (true, true), (false, false)] {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let make = |general: bool| {
            let limiter = Limiter::new(
                Limits::from_yaml_str(LIMITS, Some(OVERRIDES)).unwrap(),
                MemoryBackend::builder().clock(clock.clone()).build(),
            );
            let mut builder = RateLimitLayer::builder(limiter)
                .rule(
                    Rule::new("PerIp", ClientIp::new())
                        .cost_fn(|r| if r.method == http::Method::POST { 2 } else { 1 }),
                )
                .rule(Rule::new("PerRange", Ipv6Range48::new(ClientIp::new())))
                .rule(
                    Rule::new("PerAccount", Header::new("x-account-id"))
                        .for_methods([http::Method::POST]),
                )
                .fields(style(headers, legacy));
            if general {
                builder = builder.rule(
                    Rule::new("Never", Header::new("x-never"))
                        .on_missing_key(OnMissingKey::Skip)
                        .shadow(true)
                        .settle(Settle::header("x-never-used")),
                );
            }
            app(builder.build().unwrap())
        };
        let (fast, general) = (make(false), make(true));
        let steps = [
            ("GET", "10.0.0.1:1", 0),
            ("POST", "10.0.0.1:1", 100),
            ("GET", "10.0.0.1:1", 0),
            ("GET", "10.0.0.1:1", 250),
            ("POST", "10.0.0.1:1", 700),
            ("GET", "10.0.0.9:1", 0),
            ("POST", "10.0.0.9:1", 1),
            ("POST", "10.0.0.9:1", 1),
            ("GET", "[2001:db8::1]:1", 3000),
            ("GET", "[2001:db8::2]:1", 10),
            ("GET", "[2001:db8::3]:1", 10),
            ("GET", "[2001:db8::4]:1", 10),
            ("POST", "[2001:db8::5]:1", 400),
            ("GET", "10.0.0.1:1", 0),
            ("POST", "10.0.0.1:1", 0),
            ("POST", "10.0.0.1:1", 0),
        ];
        let label = format!("headers {headers}, legacy {legacy}");
        let denied = same_answers(&fast, &general, &clock, &steps, headers, &label).await;
        assert!(denied >= 3, "the steps must deny too ({denied})");
    }
}

/// Sends each step (method, peer, milliseconds to advance `clock` first; with an account
/// header) to `a` and to `b`, asserts they answer the same (status, every header, body) and
/// that allowed answers carry `RateLimit` when `headers`; returns how many were denied.
async fn same_answers(
    a: &Router,
    b: &Router,
    clock: &ManualClock,
    steps: &[(&str, &str, u64)],
    headers: bool,
    label: &str,
) -> usize {
    let mut denied = 0;
    for (n, &(method, peer, ms)) in steps.iter().enumerate() {
        clock.advance(Duration::from_millis(ms));
        let req = || {
            request(peer)
                .method(method)
                .header("x-account-id", "42")
                .body(Body::empty())
                .unwrap()
        };
        let (x, y) = (send(a, req()).await, send(b, req()).await);
        assert_eq!(x, y, "step {n} ({method} {peer}), {label}");
        denied += usize::from(x.0 == StatusCode::TOO_MANY_REQUESTS);
        if headers && x.0 == StatusCode::OK {
            assert!(x.1.contains_key("ratelimit"), "step {n}, {label}");
        }
    }
    denied
}

/// The targets of the events this crate logs, from a global subscriber (installed once; the
/// tests of this binary share it, so the test below only looks for what it caused).
fn logged_targets() -> &'static std::sync::Mutex<Vec<String>> {
    use tracing_subscriber::layer::SubscriberExt as _;
    static TARGETS: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<String>>>> =
        std::sync::OnceLock::new();
    struct Record(Arc<std::sync::Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Record {
        fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if e.metadata().target().starts_with("tower_ratelimits") {
                self.0
                    .lock()
                    .unwrap()
                    .push(e.metadata().target().to_owned());
            }
        }
    }
    TARGETS.get_or_init(|| {
        let targets = Arc::new(std::sync::Mutex::new(Vec::new()));
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(Record(targets.clone())),
        );
        targets
    })
}

/// Every event is on one of the targets `docs/operating.md` lists, never on a module path that
/// moves with the code: a decision on `tower_ratelimits::decision`, a store failure on
/// `tower_ratelimits::backend` (it was `tower_ratelimits::layer::outcome`).
#[tokio::test]
async fn logs_use_the_documented_targets() {
    const DOCUMENTED: [&str; 5] = [
        "tower_ratelimits::decision",
        "tower_ratelimits::shadow",
        "tower_ratelimits::reload",
        "tower_ratelimits::backend",
        "tower_ratelimits::layer",
    ];
    let targets = logged_targets();
    let fine = app(RateLimitLayer::new(
        Limiter::new(limits(), MemoryBackend::new()),
        three_rules()[..1].to_vec(),
    )
    .unwrap());
    let broken = app(RateLimitLayer::new(
        Limiter::new(limits(), Broken { hang: false }),
        three_rules()[..1].to_vec(),
    )
    .unwrap());
    send(&fine, request("10.9.9.9:1").body(Body::empty()).unwrap()).await;
    send(&broken, request("10.9.9.9:1").body(Body::empty()).unwrap()).await;
    let seen = targets.lock().unwrap().clone();
    for target in &seen {
        assert!(
            DOCUMENTED.contains(&target.as_str()),
            "undocumented log target {target}"
        );
    }
    for expected in ["tower_ratelimits::decision", "tower_ratelimits::backend"] {
        assert!(
            seen.iter().any(|t| t == expected),
            "nothing on {expected}: {seen:?}"
        );
    }
}

/// With `jitter(2 s)`, clients refused together are told to come back spread over the next
/// two seconds, never earlier than the exact time: `Retry-After` from 3600 (the exact wait,
/// rounded up) to 3602, the `RateLimit` field's `t` and the body's `retry_after_ms` moved
/// alike. Without jitter every one of them is told the same.
#[tokio::test]
async fn jitter_spreads_retries_and_never_shortens_them() {
    let hourly = || {
        Limits::from_yaml_str("PerIp: {kind: ip, burst: 1, count: 1, period: 1h}", None).unwrap()
    };
    let layer = |jitter| {
        // Time stands still: without jitter, every denial's numbers are the same.
        let frozen = MemoryBackend::builder()
            .clock(ManualClock::new(1_000_000_000_000))
            .build();
        RateLimitLayer::builder(Limiter::new(hourly(), frozen))
            .rule(Rule::new("PerIp", ClientIp::new()))
            .jitter(jitter)
            .build()
            .unwrap()
    };
    for (jitter, spread) in [(Duration::ZERO, false), (Duration::from_secs(2), true)] {
        let app = app(layer(jitter));
        send(&app, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
        let mut retries = std::collections::BTreeSet::new();
        for _ in 0..50 {
            let (status, headers, body) =
                send(&app, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
            let field = headers["ratelimit"].to_str().unwrap();
            let t: u64 = field.rsplit("t=").next().unwrap().parse().unwrap();
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            let ms = body["errors"][0]["detail"]["retry_after_ms"]
                .as_u64()
                .unwrap();
            assert!((3600..=3602).contains(&retry), "Retry-After {retry}");
            assert!(t <= retry && t >= 3600, "t={t}, Retry-After {retry}");
            assert!(
                ms > 3_599_000 && ms <= 3_602_000 && ms.div_ceil(1000) == retry,
                "{ms} ms"
            );
            retries.insert(ms);
        }
        assert_eq!(retries.len() > 1, spread, "{jitter:?}: {retries:?}");
    }
}

/// `tower_ratelimits_near_limit_total{limit}`, scraped from a real Prometheus recorder,
/// counts the allowed requests that leave at most a fifth of the burst (80%, by default) or
/// half of it (50%): a burst of 10 leaves 9, 8, ... 0, then refuses. A percent outside 1..=100
/// is refused when the layer is built.
#[tokio::test]
async fn near_limit_counts_the_allowed_requests_close_to_the_limit() {
    for (percent, near) in [(None, 3.0), (Some(50), 6.0)] {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let _guard = metrics::set_default_local_recorder(&recorder);
        let limits =
            Limits::from_yaml_str("PerIp: {kind: ip, burst: 10, count: 10, period: 1h}", None)
                .unwrap();
        let builder = RateLimitLayer::builder(Limiter::new(limits, MemoryBackend::new()))
            .rule(Rule::new("PerIp", ClientIp::new()));
        let builder = match percent {
            Some(p) => builder.near_limit_percent(p),
            None => builder,
        };
        let app = app(builder.build().unwrap());
        for _ in 0..11 {
            send(&app, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
        }
        let m = scrape::samples(&handle.render());
        assert_eq!(
            m["tower_ratelimits_near_limit_total{limit=PerIp}"], near,
            "{percent:?}"
        );
        assert_eq!(
            m["tower_ratelimits_decisions_total{limit=PerIp,outcome=allowed}"],
            10.0
        );
    }
    for bad in [0, 101] {
        let limits =
            Limits::from_yaml_str("PerIp: {kind: ip, burst: 10, count: 10, period: 1h}", None)
                .unwrap();
        let built = RateLimitLayer::builder(Limiter::new(limits, MemoryBackend::new()))
            .rule(Rule::new("PerIp", ClientIp::new()))
            .near_limit_percent(bad)
            .build();
        assert_eq!(
            built.err(),
            Some(tower_ratelimits::LayerError::NearLimitPercent(bad))
        );
    }
}

/// A limit that asks for fail-closed (`on_store_failure:
/// fail_closed`) refuses its requests while the store fails, whatever the layer's policy: a
/// monthly quota neither opens (`FailOpen`, which made it unlimited) nor falls back to a fresh
/// count in memory. A request with only other limits follows the layer's policy.
#[tokio::test]
async fn a_limit_that_fails_closed_wins_over_the_layers_policy() {
    let yaml = "\
PerIp: {kind: ip, burst: 5, count: 5, period: 1s}
Monthly: {kind: ip, calendar: {count: 100, period: month}, on_store_failure: fail_closed}
";
    for policy in [
        FailurePolicy::FailOpen,
        FailurePolicy::FallbackToMemory { percent: 50 },
    ] {
        let limits = Limits::from_yaml_str(yaml, None).unwrap();
        assert!(limits.fails_closed(limits.name("Monthly").unwrap()));
        assert!(!limits.fails_closed(limits.name("PerIp").unwrap()));
        let layer = |rules: Vec<Rule>| {
            let mut b = RateLimitLayer::builder(Limiter::new(
                Limits::from_yaml_str(yaml, None).unwrap(),
                Broken { hang: false },
            ))
            .on_backend_failure(policy);
            for r in rules {
                b = b.rule(r);
            }
            app(b.build().unwrap())
        };
        let both = layer(vec![
            Rule::new("PerIp", ClientIp::new()),
            Rule::new("Monthly", ClientIp::new()),
        ]);
        let (status, _, body) =
            send(&both, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{policy:?}: {body}"
        );
        let open = layer(vec![Rule::new("PerIp", ClientIp::new())]);
        let (status, _, body) =
            send(&open, request("10.0.0.1:1").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK, "{policy:?}: {body}");
    }
    // Anything else than `fail_closed` or `layer` is a located error naming the field.
    let err = Limits::from_yaml_str(
        "A: {burst: 1, count: 1, period: 1s, on_store_failure: closed}\n",
        None,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("on_store_failure must be `fail_closed` or `layer`"),
        "{err}"
    );
    assert_eq!(err.location().line, Some(1));
}

/// The in-memory backend answering through a future, as a store does: its batches take the
/// road of a spend under way, whose decisions are built before a refusal is answered.
struct Deferred(MemoryBackend);

#[async_trait]
impl Backend for Deferred {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        match self.0.spend(batch) {
            Spend::Ready(decided) => Spend::Pending(Box::pin(async move { decided })),
            pending => pending,
        }
    }
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        self.0.refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        self.0.reset(keys).await
    }
}

/// A refusal decided at once is answered from the backend's outcomes by reference, without the
/// decisions a spend under way builds: every answer (status, every header, body) is the same,
/// byte for byte, for HTTP and gRPC, each field style and body, a custom response, a rule that
/// allowed beside the one that denied (its units back in its fields: nothing was spent) and a
/// shadowed rule that would deny.
#[tokio::test]
async fn a_refusal_read_by_reference_answers_as_the_decisions_do() {
    const LIMITS: &str = "\
PerIp: {kind: ip, burst: 2, count: 2, period: 2s}
PerAccount: {kind: account, burst: 5, count: 5, period: 1s}
PerRange: {kind: ipv6_range, burst: 1, count: 1, period: 1s}
";
    let custom = |d: &tower_ratelimits::Denial<'_>| {
        let text = format!(
            "{:?} {:?} {:?} {:?} {}",
            d.limit_name(),
            d.id().map(ToString::to_string),
            d.tier(),
            d.denied_limits().collect::<Vec<_>>(),
            d.retry_after_ms()
        );
        let mut r = d.default_response();
        *r.body_mut() = bytes::Bytes::from(text);
        r
    };
    let bodies = [
        tower_ratelimits::ErrorBody::Json,
        tower_ratelimits::ErrorBody::ProblemJson,
        tower_ratelimits::ErrorBody::Empty,
    ];
    for (n, body) in bodies.into_iter().enumerate() {
        for own in [false, true] {
            let clock = ManualClock::new(1_700_000_000_000_000);
            let layer = |backend: Box<dyn Fn() -> Limiter>| {
                let mut b = RateLimitLayer::builder(backend())
                    .rule(Rule::new("PerIp", ClientIp::new()))
                    .rule(Rule::new("PerAccount", Header::new("x-account-id")))
                    .rule(Rule::new("PerRange", Ipv6Range48::new(ClientIp::new())).shadow(true))
                    .fields(style(n != 1, n == 1))
                    .error_body(body);
                if own {
                    b = b.denied_response(custom);
                }
                app(b.build().unwrap())
            };
            let memory = || MemoryBackend::builder().clock(clock.clone()).build();
            let limits = || Limits::from_yaml_str(LIMITS, None).unwrap();
            let at_once = layer(Box::new(|| Limiter::new(limits(), memory())));
            let later = layer(Box::new(|| Limiter::new(limits(), Deferred(memory()))));
            let (mut refused, mut grpc_refused) = (0, 0);
            for step in 0..12 {
                let grpc = step % 3 == 2;
                let req = || {
                    let mut r = request("[2001:db8::1]:1000").header("x-account-id", "7");
                    if grpc {
                        r = r.header("content-type", "application/grpc");
                    }
                    r.body(Body::empty()).unwrap()
                };
                let (a, b) = (send(&at_once, req()).await, send(&later, req()).await);
                assert_eq!(a, b, "body {n}, own response {own}, step {step}");
                let denied = a.0 == StatusCode::TOO_MANY_REQUESTS
                    || a.1.get("grpc-status").is_some_and(|s| s == "8");
                refused += usize::from(denied);
                grpc_refused += usize::from(denied && grpc);
                clock.advance(Duration::from_millis(150));
            }
            assert!(
                refused >= 4 && grpc_refused >= 1,
                "body {n}: {refused} refusals, {grpc_refused} gRPC"
            );
        }
    }
}
