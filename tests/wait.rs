//! Wait instead of reject ([`Wait`], [`Limiter::spend_or_wait`]), on tokio's paused clock: the
//! memory backend reads the same virtual time the waits sleep on, so every wait is measured
//! exactly, with no real sleep.

#[path = "support/clock.rs"]
mod clock;
#[path = "support/counting.rs"]
mod counting;
#[path = "support/scrape.rs"]
mod scrape;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::{Router, body::Body, routing::any};
use clock::TokioClock;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_ratelimits::{
    ClientIp, Header, Id, Limiter, Limits, MemoryBackend, OnMissingKey, RateLimitLayer, Rule,
    Transaction, Wait,
};

const LIMITS: &str = "\
PerIp: {kind: ip, burst: 1, count: 10, period: 1s}
Slow: {kind: ip, burst: 1, count: 1, period: 1s}
PerAccount: {kind: account, burst: 5, count: 5, period: 1s}
";

fn limiter() -> Limiter {
    let backend = MemoryBackend::builder().clock(TokioClock::now()).build();
    Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend)
}

fn app(rules: Vec<Rule>) -> (Router, Limiter) {
    let limiter = limiter();
    let mut builder = RateLimitLayer::builder(limiter.clone());
    for r in rules {
        builder = builder.rule(r);
    }
    let app = Router::new()
        .route("/", any(|| async { "ok" }))
        .layer(builder.build().unwrap());
    (app, limiter)
}

fn request(peer: &str) -> Request<Body> {
    Request::get("/")
        .extension(peer.parse::<SocketAddr>().unwrap())
        .header("x-account", "7")
        .body(Body::empty())
        .unwrap()
}

/// Sends a request; its status, `RateLimit` field and how long it took (virtual time).
async fn send(app: &Router, peer: &str) -> (StatusCode, String, Duration) {
    let start = tokio::time::Instant::now();
    let r = app.clone().oneshot(request(peer)).await.unwrap();
    let status = r.status();
    let field = r
        .headers()
        .get("ratelimit")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    r.into_body().collect().await.unwrap();
    (status, field, start.elapsed())
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(start_paused = true)]
async fn a_denied_request_waits_exactly_its_retry_after_then_passes() {
    let (app, _) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(ms(250))),
    ]);
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!((status, took), (StatusCode::OK, Duration::ZERO));
    // Burst 1, one token per 100 ms: the next one waits for it, exactly.
    let (status, field, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(took, ms(100));
    assert!(field.contains("r=0"), "{field}");
    // Another client is not slowed.
    let (status, _, took) = send(&app, "10.0.0.2:1").await;
    assert_eq!((status, took), (StatusCode::OK, Duration::ZERO));
}

#[tokio::test(start_paused = true)]
async fn beyond_the_bound_a_request_is_refused_at_once() {
    let (app, _) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(ms(99))),
    ]);
    send(&app, "10.0.0.1:1").await;
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!(
        (status, took),
        (StatusCode::TOO_MANY_REQUESTS, Duration::ZERO)
    );
    // A bound of exactly the wait is enough.
    let (app, _) = app_with_bound(ms(100));
    send(&app, "10.0.0.1:1").await;
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!((status, took), (StatusCode::OK, ms(100)));
}

fn app_with_bound(bound: Duration) -> (Router, Limiter) {
    app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(bound)),
    ])
}

#[tokio::test(start_paused = true)]
async fn a_rule_that_does_not_wait_refuses_even_when_another_would_wait() {
    let (app, _) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(ms(500))),
        Rule::new("Slow", ClientIp::new()),
    ]);
    send(&app, "10.0.0.1:1").await;
    // Both deny; `Slow` does not wait.
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!(
        (status, took),
        (StatusCode::TOO_MANY_REQUESTS, Duration::ZERO)
    );
}

#[tokio::test(start_paused = true)]
async fn the_cap_on_waiting_requests_holds_and_waiters_that_lose_wait_again() {
    let (app, _) = app(vec![
        Rule::new("Slow", ClientIp::new())
            .wait(Wait::up_to(Duration::from_secs(10)).max_waiting(2)),
    ]);
    send(&app, "10.0.0.1:1").await;
    // Five at once: two wait, three are refused at once.
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, "10.0.0.1:1").await })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        let (status, _, took) = t.await.unwrap();
        results.push((status, took.as_millis()));
    }
    results.sort();
    // One token per second: the two waiters wake together at 1 s; one passes, the other
    // lost the race and waits again, passing at 2 s.
    assert_eq!(
        results,
        [
            (StatusCode::OK, 1000),
            (StatusCode::OK, 2000),
            (StatusCode::TOO_MANY_REQUESTS, 0),
            (StatusCode::TOO_MANY_REQUESTS, 0),
            (StatusCode::TOO_MANY_REQUESTS, 0),
        ]
    );
    // Every place was given back: two more may wait.
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!((status, took.as_millis()), (StatusCode::OK, 1000));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiting_request_spends_nothing_and_gives_its_place_back() {
    let (app, _) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(ms(500)).max_waiting(1)),
    ]);
    send(&app, "10.0.0.1:1").await;
    // The client goes away after 50 ms of its 100 ms wait.
    let gone = tokio::time::timeout(ms(50), send(&app, "10.0.0.1:1")).await;
    assert!(gone.is_err());
    // Its place is free (cap 1), and it spent nothing: the next one waits only the 50 ms
    // left until the token it would have taken.
    let (status, _, took) = send(&app, "10.0.0.1:1").await;
    assert_eq!((status, took), (StatusCode::OK, ms(50)));
}

#[tokio::test(start_paused = true)]
async fn a_waiting_request_is_decided_again_with_every_rule() {
    // The account rule allows 5 per second; the IP rule waits. Waiting and passing spends
    // the account once per request, never for a round that was denied.
    let (app, limiter) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(Duration::from_secs(1))),
        Rule::new("PerAccount", Header::new("x-account")).on_missing_key(OnMissingKey::Skip),
    ]);
    for i in 0..3u64 {
        let (status, _, took) = send(&app, "10.0.0.1:1").await;
        assert_eq!(
            (status, took),
            (StatusCode::OK, ms(if i == 0 { 0 } else { 100 }))
        );
    }
    let account = limiter.key("PerAccount", Id::from(7u64)).unwrap();
    let d = limiter
        .check(&[Transaction::new(account).cost(0)])
        .await
        .unwrap();
    // 3 spent in 200 ms (one token back): 5 - 3 + 1.
    assert_eq!(d.decisions()[0].remaining(), 3);
}

#[tokio::test(start_paused = true)]
async fn the_limiter_waits_exactly_and_gives_up_beyond_the_bound() {
    let limiter = Arc::new(limiter());
    let key = limiter.parse_key("Slow", "10.0.0.9").unwrap();
    let tx = [Transaction::new(key)];
    let start = tokio::time::Instant::now();
    assert!(limiter.spend_or_wait(&tx, ms(10)).await.unwrap().allowed());
    // One per second: a bound of 999 ms is too short; the denial comes back at once.
    let d = limiter.spend_or_wait(&tx, ms(999)).await.unwrap();
    assert!(!d.allowed());
    assert_eq!(d.strictest().unwrap().retry_after(), Duration::from_secs(1));
    assert_eq!(start.elapsed(), Duration::ZERO);
    // A bound of a second is enough: it waits exactly that.
    assert!(
        limiter
            .spend_or_wait(&tx, Duration::from_secs(1))
            .await
            .unwrap()
            .allowed()
    );
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    // Cancelled while waiting: nothing spent, the next waits the same second.
    let l = limiter.clone();
    let tx2 = tx.clone();
    let waiting = tokio::spawn(async move { l.spend_or_wait(&tx2, Duration::from_secs(5)).await });
    tokio::time::sleep(ms(500)).await;
    waiting.abort();
    assert!(
        limiter
            .spend_or_wait(&tx, Duration::from_secs(5))
            .await
            .unwrap()
            .allowed()
    );
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

/// Waits are counted, recorded by a real Prometheus recorder (this thread's: the runtime is
/// current-thread) and parsed: a wait that began, one refused because the rule's waiting
/// requests were at their cap, one refused because it was too long; the gauge of waiting
/// requests is back at 0.
#[tokio::test(start_paused = true)]
async fn waits_are_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (app, _) = app(vec![
        Rule::new("Slow", ClientIp::new()).wait(Wait::up_to(Duration::from_secs(5)).max_waiting(1)),
    ]);
    send(&app, "10.0.0.1:1").await;
    let (a, b) = tokio::join!(send(&app, "10.0.0.1:1"), send(&app, "10.0.0.1:1"));
    let mut statuses = [a.0, b.0];
    statuses.sort();
    assert_eq!(statuses, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    let m = scrape::samples(&handle.render());
    let waits = |limit: &str, outcome: &str| {
        m.get(&format!(
            "tower_ratelimits_waits_total{{limit={limit},outcome={outcome}}}"
        ))
        .copied()
        .unwrap_or(0.0)
    };
    assert_eq!(waits("Slow", "waited"), 1.0);
    assert_eq!(waits("Slow", "full"), 1.0);
    assert_eq!(m["tower_ratelimits_waiting{limit=Slow}"], 0.0);
    assert_eq!(m["tower_ratelimits_requests_total{outcome=allowed}"], 2.0);
    assert_eq!(m["tower_ratelimits_requests_total{outcome=denied}"], 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_wait_beyond_the_bound_is_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (app, _) = app_with_bound(ms(50));
    send(&app, "10.0.0.1:1").await;
    let (status, _, _) = send(&app, "10.0.0.1:1").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let m = scrape::samples(&handle.render());
    assert_eq!(
        m["tower_ratelimits_waits_total{limit=PerIp,outcome=too_long}"],
        1.0
    );
}

/// Fifty requests of one client wait for a limit of 10 per second (burst 1): they wake one per
/// token, in the order they arrived, and each goes to the store twice in all (its denial, then
/// its turn). Before, every waiter was told the same wait, all woke together and all but one
/// went back to the store: 50 waiters cost 26.5 calls per admitted request in memory (32.5 on
/// Redis, the figure).
#[tokio::test(start_paused = true)]
async fn waiters_of_one_key_wake_one_per_token_in_arrival_order() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let calls = Arc::new(AtomicUsize::new(0));
    let backend = counting::Counting {
        calls: calls.clone(),
        inner: MemoryBackend::builder().clock(TokioClock::now()).build(),
    };
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
    let layer = RateLimitLayer::builder(limiter)
        .rule(
            Rule::new("PerIp", ClientIp::new())
                .wait(Wait::up_to(Duration::from_secs(10)).max_waiting_per_key(64)),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", any(|| async { "ok" }))
        .layer(layer);
    send(&app, "10.0.0.1:1").await;
    let before = calls.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..50u64 {
        let app = app.clone();
        tasks.push(tokio::spawn(
            async move { (i, send(&app, "10.0.0.1:1").await) },
        ));
        // Each is denied and joins the line before the next arrives.
        tokio::task::yield_now().await;
    }
    for t in tasks {
        let (i, (status, _, took)) = t.await.unwrap();
        assert_eq!(status, StatusCode::OK, "waiter {i}");
        assert_eq!(took, ms(100 * (i + 1)), "waiter {i} wakes at its token");
    }
    let per_waiter = (calls.load(Ordering::SeqCst) - before) as f64 / 50.0;
    assert_eq!(per_waiter, 2.0, "store calls per admitted waiter");
}

/// One client cannot take every waiting place of a rule: at most `max_waiting_per_key` of one
/// key wait (32 by default); another client still waits.
#[tokio::test(start_paused = true)]
async fn one_key_takes_at_most_its_share_of_the_waiting_places() {
    let (app, _) = app(vec![
        Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(Duration::from_secs(60))),
    ]);
    send(&app, "10.0.0.1:1").await;
    send(&app, "10.0.0.2:1").await;
    let mut tasks = Vec::new();
    for _ in 0..33 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move { send(&app, "10.0.0.1:1").await }));
        tokio::task::yield_now().await;
    }
    let other = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, "10.0.0.2:1").await })
    };
    let mut refused = 0;
    for t in tasks {
        let (status, _, took) = t.await.unwrap();
        if status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(took, Duration::ZERO);
            refused += 1;
        }
    }
    assert_eq!(refused, 1, "the 33rd waiter of one key is refused");
    let (status, _, took) = other.await.unwrap();
    assert_eq!((status, took), (StatusCode::OK, ms(100)));
}

/// With the layer's jitter, a waiting request sleeps its exact wait plus a random part of the
/// jitter: never less than exact, at most exact + jitter, and not the same for every request.
#[tokio::test(start_paused = true)]
async fn jitter_lengthens_waits_within_its_bound() {
    let limiter = limiter();
    let app = Router::new().route("/", any(|| async { "ok" })).layer(
        RateLimitLayer::builder(limiter)
            .rule(Rule::new("PerIp", ClientIp::new()).wait(Wait::up_to(ms(1_000))))
            .jitter(ms(50))
            .build()
            .unwrap(),
    );
    let mut waits = std::collections::BTreeSet::new();
    for client in 1..=20 {
        let peer = format!("10.0.1.{client}:1");
        send(&app, &peer).await;
        // Burst 1, one token per 100 ms: the exact wait is 100 ms.
        let (status, _, took) = send(&app, &peer).await;
        assert_eq!(status, StatusCode::OK);
        assert!(took >= ms(100) && took <= ms(150), "{took:?}");
        waits.insert(took);
    }
    assert!(waits.len() > 1, "{waits:?}");
}
