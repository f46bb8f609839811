//! Adaptive concurrency per key (`concurrency: {adaptive: ...}`, `docs/adaptive-concurrency.md`)
//! on the memory backend, on a manual clock: through the `Limiter` (its slots move with the
//! key's failures and latency, merged from every instance in the store; a drop below the slots
//! in use keeps their leases; an idle key starts again), through the layer on a real axum
//! server over TCP (a failing response backs the key off; `RateLimit-Policy` shows its number
//! now), and its configuration (YAML errors with lines, the JSON forms).

mod support;

use std::time::Duration;

use axum::{Router, routing::get};
use support::admin;
use support::http::{HttpClient, serve};
use tower_ratelimits::kit::AdaptiveState;
use tower_ratelimits::{
    BucketKey, Completion, ConfigErrorKind, Header, Id, Lease, Limiter, Limits, ManualClock,
    MemoryBackend, RateLimitLayer, Rule, ShapeError, Transaction,
};

const LIMITS: &str = "\
Aimd:
  kind: account
  concurrency: {adaptive: {min: 2, initial: 10, max: 20, algorithm: aimd, completions: 5, idle_reset: 1m}}
  lease: 10m
Steep:
  kind: account
  concurrency: {adaptive: {min: 1, initial: 10, max: 20, algorithm: aimd, backoff: 50, completions: 2}}
  lease: 10m
Gradient:
  kind: account
  concurrency: {adaptive: {min: 2, initial: 10, max: 40, completions: 10, smoothing: 50}}
  lease: 10m
Probing:
  kind: account
  concurrency: {adaptive: {min: 2, initial: 10, max: 40, smoothing: 50}}
  lease: 10m
";

struct Store {
    label: String,
    clock: ManualClock,
    /// The memory backend, when the store is it (its state can be read whole).
    memory: Option<MemoryBackend>,
    limiter: Limiter,
    #[cfg(feature = "redis")]
    _redis: Option<(support::redis::TestRedis, String)>,
}

/// The stores under test, each on its own manual clock (Redis in caller time): memory, and
/// with the `redis` feature a single Redis and the cluster.
async fn stores() -> Vec<Store> {
    let limits = || Limits::from_yaml_str(LIMITS, None).unwrap();
    let clock = ManualClock::new(1_800_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    #[allow(unused_mut)]
    let mut out = vec![Store {
        label: "memory".into(),
        clock,
        memory: Some(backend.clone()),
        limiter: Limiter::new(limits(), backend),
        #[cfg(feature = "redis")]
        _redis: None,
    }];
    #[cfg(feature = "redis")]
    for (label, redis) in [
        ("a single Redis", support::redis::TestRedis::single()),
        ("the cluster", support::redis::TestRedis::cluster()),
    ] {
        let clock = ManualClock::new(1_800_000_000_000_000);
        let prefix = support::redis::unique_prefix("adaptive");
        let backend =
            support::redis_backend::caller_time_backend(&redis.url, &prefix, &clock, true).await;
        out.push(Store {
            label: label.into(),
            clock,
            memory: None,
            limiter: Limiter::new(limits(), backend),
            _redis: Some((redis, prefix)),
        });
    }
    out
}

impl Store {
    fn key(&self, limit: &str) -> BucketKey {
        self.limiter.key(limit, Id::from(7u64)).unwrap()
    }

    /// Takes slots until one is refused: the leases taken.
    async fn fill(&self, limit: &str) -> Vec<Lease> {
        let mut leases = Vec::new();
        for _ in 0..100 {
            let (allowed, taken) = spend_one(self, limit).await;
            if !allowed {
                return leases;
            }
            leases.extend(taken);
        }
        panic!("{}: never refused", self.label);
    }

    /// The key's number now, as a probe (cost 0: takes nothing) is told.
    async fn slots(&self, limit: &str) -> u64 {
        let probe = Transaction::new(self.key(limit)).cost(0);
        let d = self.limiter.check(&[probe]).await.unwrap();
        d.decisions()[0].slots().unwrap()
    }

    /// Ends the first `n` requests `held` (their leases given back, each taking `latency_ms`
    /// and `failed` or not).
    async fn end_first(&self, held: &mut Vec<Lease>, n: usize, latency_ms: u64, failed: bool) {
        let done: Vec<Lease> = held.drain(..n).collect();
        self.complete(&done, latency_ms, failed).await;
    }

    async fn complete(&self, leases: &[Lease], latency_ms: u64, failed: bool) {
        let c = Completion::new(Duration::from_millis(latency_ms), failed);
        assert_eq!(
            self.limiter.complete(leases, c).await.unwrap(),
            leases.len(),
            "{}",
            self.label
        );
    }
}

async fn spend_one(s: &Store, limit: &str) -> (bool, Vec<Lease>) {
    let d = s
        .limiter
        .spend(&[Transaction::new(s.key(limit))])
        .await
        .unwrap();
    (
        d.allowed(),
        d.decisions().iter().filter_map(|d| d.lease()).collect(),
    )
}

/// AIMD: a window (5 completions) with a failure keeps 90% of the slots; a full window without
/// one adds a slot. What the key admits follows at once.
#[tokio::test]
async fn failures_back_a_key_off_and_a_full_window_grows_it() {
    for s in stores().await {
        let l = &s.label;
        let mut held = s.fill("Aimd").await;
        assert_eq!(held.len(), 10, "{l}: initial");
        let done: Vec<Lease> = held.drain(..5).collect();
        for lease in &done[..4] {
            s.complete(std::slice::from_ref(lease), 5, false).await;
        }
        assert_eq!(s.slots("Aimd").await, 10, "{l}: a window of 4");
        s.complete(&done[4..], 5, true).await;
        assert_eq!(s.slots("Aimd").await, 9, "{l}: 10 x 0.9");
        // 5 in flight, 9 slots: 4 more.
        held.extend(s.fill("Aimd").await);
        assert_eq!(held.len(), 9, "{l}");
        // A full window without a failure: one slot more.
        s.end_first(&mut held, 5, 5, false).await;
        assert_eq!(s.slots("Aimd").await, 10, "{l}");
        assert_eq!(s.fill("Aimd").await.len(), 6, "{l}: 4 in flight of 10");
    }
}

/// A number that drops below the slots in use takes no lease away: the requests in flight
/// keep their slots, and new ones are refused until in-flight falls under the number.
#[tokio::test]
async fn a_drop_below_the_slots_in_use_keeps_their_leases() {
    for s in stores().await {
        let l = &s.label;
        let mut held = s.fill("Steep").await;
        assert_eq!(held.len(), 10, "{l}");
        // A window of two failures halves the number under eight requests still in flight.
        s.end_first(&mut held, 2, 5, true).await;
        assert_eq!(s.slots("Steep").await, 5, "{l}");
        if let Some(memory) = &s.memory {
            assert_eq!(memory.leases(&s.key("Steep")), 8, "every lease kept");
        }
        assert!(!spend_one(&s, "Steep").await.0, "{l}");
        // Given back without a completion (the number stays 5): refused until under it.
        let back: Vec<Lease> = held.drain(..3).collect();
        assert_eq!(
            s.limiter.release(&back).await.unwrap(),
            3,
            "{l}: every lease was kept"
        );
        assert!(!spend_one(&s, "Steep").await.0, "{l}: 5 in flight of 5");
        let back: Vec<Lease> = held.drain(..1).collect();
        s.limiter.release(&back).await.unwrap();
        assert!(spend_one(&s, "Steep").await.0, "{l}: 4 in flight of 5");
    }
}

/// A key idle for `idle_reset` starts again at `initial`, whatever it learned.
#[tokio::test]
async fn an_idle_key_starts_again_at_initial() {
    for s in stores().await {
        let l = &s.label;
        let held = s.fill("Aimd").await;
        s.complete(&held[..5], 5, true).await;
        s.limiter.release(&held[5..]).await.unwrap();
        assert_eq!(s.slots("Aimd").await, 9, "{l}");
        s.clock.advance(Duration::from_secs(59));
        let again = s.fill("Aimd").await;
        assert_eq!(again.len(), 9, "{l}: not idle long enough");
        s.complete(&again, 5, true).await;
        assert_eq!(s.slots("Aimd").await, 8, "{l}");
        s.clock.advance(Duration::from_secs(60));
        assert_eq!(s.fill("Aimd").await.len(), 10, "{l}: back at initial");
    }
}

/// Gradient: at full load, a latency as good as the best recent one lets the number grow by
/// its queue (sqrt of the number); a latency four times worse takes it down. Every store moves
/// it to the same numbers.
#[tokio::test]
async fn the_gradient_follows_the_latency_at_full_load() {
    let mut seen: Vec<Vec<u64>> = Vec::new();
    for s in stores().await {
        let mut numbers = Vec::new();
        for latency in [10, 10, 10, 10, 10, 40, 40, 40, 40, 40] {
            let held = s.fill("Gradient").await;
            s.complete(&held, latency, false).await;
            numbers.push(s.slots("Gradient").await);
        }
        assert!(numbers[4] > 10, "{}: {numbers:?}", s.label);
        assert!(numbers[9] < numbers[4], "{}: {numbers:?}", s.label);
        seen.push(numbers);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}

/// The gradient's probe: every tenth window (by its start, a second each here) the key runs
/// at half its number, and that window's latency becomes the unloaded one. A service that got
/// slower (10 ms, then 30 ms at any load) first takes the number down, and after the next
/// probe it reads 30 ms as the unloaded latency and grows again. Every store halves and moves
/// the number alike.
#[tokio::test]
async fn the_gradient_probes_at_half_its_number_on_every_store() {
    let mut seen: Vec<Vec<u64>> = Vec::new();
    for s in stores().await {
        let mut numbers = Vec::new();
        for window in 0..30 {
            // The key takes all it may; all but one of its requests end (the first starts the
            // window), and a second later the last one ends it, alone in flight.
            let latency = if window < 12 { 10 } else { 30 };
            let held = s.fill("Probing").await;
            numbers.push(held.len() as u64);
            let (first, last) = held.split_at(held.len() - 1);
            s.complete(first, latency, false).await;
            s.clock.advance(Duration::from_secs(1));
            s.complete(last, latency, false).await;
        }
        // A probe: half the number of the windows beside it.
        let halved = numbers
            .windows(3)
            .filter(|w| w[1] < w[0] && w[1] < w[2] && w[1] * 2 <= w[0].max(w[2]) + 1)
            .count();
        assert!(halved >= 2, "{}: no probe in {numbers:?}", s.label);
        // Once a probe has read 30 ms as the unloaded latency, the number grows again
        // beyond where the slowdown took it (it fell without end before the probes).
        let fell = *numbers[12..20].iter().min().unwrap();
        let after = *numbers[20..].iter().max().unwrap();
        assert!(after > 2 * fell, "{}: {numbers:?}", s.label);
        seen.push(numbers);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}

/// Latencies beyond what a store keeps exactly (a window summing more than 2^52 microseconds)
/// are capped there, the same on every store: the window still reads as far worse than the
/// key's best, and every store takes the number down alike.
#[tokio::test]
async fn a_window_of_huge_latencies_moves_every_store_alike() {
    let huge_ms = (1u64 << 51) / 1000;
    let mut seen: Vec<Vec<u64>> = Vec::new();
    for s in stores().await {
        let held = s.fill("Gradient").await;
        s.complete(&held, 1, false).await;
        let grown = s.slots("Gradient").await;
        let held = s.fill("Gradient").await;
        s.complete(&held[..3], huge_ms, false).await;
        s.complete(&held[3..], 1, false).await;
        let after = s.slots("Gradient").await;
        assert!(after < grown, "{}: {grown} then {after}", s.label);
        seen.push(vec![grown, after]);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}

/// Two instances giving back leases of one key merge their completions in the store: the
/// window (5 completions) fills from both, and moves the number once, not twice.
#[tokio::test]
async fn instances_merge_their_completions_in_the_store() {
    for s in stores().await {
        let l = &s.label;
        let held = s.fill("Aimd").await;
        s.complete(&held[..3], 5, true).await;
        assert_eq!(s.slots("Aimd").await, 10, "{l}: a window of 3");
        // Another instance: another limiter (its own lease ids) on the same store.
        let other = other_instance(&s).await;
        let c = Completion::new(Duration::from_millis(5), false);
        assert_eq!(other.complete(&held[3..5], c).await.unwrap(), 2, "{l}");
        assert_eq!(
            s.slots("Aimd").await,
            9,
            "{l}: one window of 5, with a failure"
        );
        if let Some(memory) = &s.memory {
            let st: AdaptiveState = memory.adaptive_state(&s.key("Aimd")).unwrap();
            assert_eq!(st.window.completions, 0);
        }
    }
}

/// A limiter of another instance on `s`'s store.
async fn other_instance(s: &Store) -> Limiter {
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    match &s.memory {
        Some(memory) => Limiter::new(limits, memory.clone()),
        #[cfg(feature = "redis")]
        None => {
            let (redis, prefix) = s._redis.as_ref().unwrap();
            let backend =
                support::redis_backend::caller_time_backend(&redis.url, prefix, &s.clock, true)
                    .await;
            Limiter::new(limits, backend)
        }
        #[cfg(not(feature = "redis"))]
        None => unreachable!(),
    }
}

/// A lease given back without a completion (`release`) moves nothing.
#[tokio::test]
async fn a_plain_release_teaches_nothing() {
    for s in stores().await {
        let held = s.fill("Aimd").await;
        assert_eq!(s.limiter.release(&held).await.unwrap(), 10, "{}", s.label);
        assert_eq!(
            s.limiter.release(&held).await.unwrap(),
            0,
            "{}: once",
            s.label
        );
        assert_eq!(s.slots("Aimd").await, 10, "{}", s.label);
    }
}

/// Through the layer on a real server: a 503 is a failure (a window of 5 backs the key off
/// to 9), a 200 is not, and `RateLimit-Policy` shows the key's number now.
#[tokio::test]
async fn a_failing_service_backs_its_key_off_through_the_layer() {
    let routes = Router::new().route("/ok", get(|| async { "ok" })).route(
        "/fail",
        get(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "busy") }),
    );
    let AimdServer {
        _server,
        client,
        backend,
        key,
    } = AimdServer::serve(routes).await;
    let learned = |b: &MemoryBackend| b.adaptive_state(&key).unwrap().controller.limit_milli;
    let completions = |b: &MemoryBackend| b.adaptive_state(&key).unwrap().window.completions;
    for n in 1..=5 {
        let r = client.get("/ok", &[("x-account", "7")]).await;
        assert_eq!(r.status, 200);
        // Given back when the server drops the body, just after the client read its end.
        eventually(|| completions(&backend) == n % 5).await;
    }
    // One request in flight at a time: the key was not held back by its number, which stays.
    assert_eq!(learned(&backend), 10_000);
    for n in 1..=5 {
        let r = client.get("/fail", &[("x-account", "7")]).await;
        assert_eq!(r.status, 503);
        eventually(|| completions(&backend) == n % 5).await;
    }
    assert_eq!(learned(&backend), 9_000);
    let r = client.get("/ok", &[("x-account", "7")]).await;
    let policy = r.header("ratelimit-policy").unwrap().to_owned();
    assert!(
        policy.contains(&format!("q={}", learned(&backend) / 1000)),
        "{policy}"
    );
}

/// A gRPC status sent in the trailers after a streamed answer (`200`, then `grpc-status: 14`)
/// is a failure as it would be in the head; `grpc-status: 0` there is not.
#[tokio::test]
async fn a_grpc_failure_in_the_trailers_backs_its_key_off() {
    fn streamed(grpc_status: &'static str) -> axum::body::Body {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static(grpc_status));
        let frames = [
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(bytes::Bytes::from_static(
                b"part",
            ))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        axum::body::Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
    }
    let routes = Router::new()
        .route("/ok", get(|| async { streamed("0") }))
        .route("/unavailable", get(|| async { streamed("14") }));
    let AimdServer {
        _server,
        client,
        backend,
        key,
    } = AimdServer::serve(routes).await;
    let learned = |b: &MemoryBackend| b.adaptive_state(&key).unwrap().controller.limit_milli;
    let completions = |b: &MemoryBackend| b.adaptive_state(&key).unwrap().window.completions;
    for (path, after) in [("/ok", 10_000), ("/unavailable", 9_000)] {
        for n in 1..=5 {
            let r = client.get(path, &[("x-account", "7")]).await;
            assert_eq!((r.status, r.body.as_str()), (200, "part"));
            eventually(|| completions(&backend) == n % 5).await;
        }
        assert_eq!(learned(&backend), after, "after five {path}");
    }
}

/// The numbers completions leave their keys at are a histogram per limit, read by a real
/// Prometheus recorder, parsed: five completions of a window that backs the key off (10, 10,
/// 10, 10, then 9); a plain release records nothing.
#[tokio::test]
async fn the_numbers_after_completions_are_a_histogram_per_limit() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let s = stores().await.swap_remove(0);
    let mut held = s.fill("Aimd").await;
    for _ in 0..4 {
        s.end_first(&mut held, 1, 5, false).await;
    }
    s.end_first(&mut held, 1, 5, true).await;
    s.limiter.release(&held[..1]).await.unwrap();
    let m = support::scrape::samples(&handle.render());
    assert_eq!(
        m.get("tower_ratelimits_adaptive_slots_count{limit=Aimd}"),
        Some(&5.0),
        "{m:?}"
    );
    assert_eq!(
        m.get("tower_ratelimits_adaptive_slots_sum{limit=Aimd}"),
        Some(&49.0),
        "{m:?}"
    );
}

/// `routes` behind a layer of the `Aimd` limit keyed by `x-account`, on a real server over
/// TCP, with the memory backend holding key 7's state.
struct AimdServer {
    _server: support::http::Server,
    client: HttpClient,
    backend: MemoryBackend,
    key: BucketKey,
}

impl AimdServer {
    async fn serve(routes: Router) -> Self {
        let backend = MemoryBackend::new();
        let limiter = Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            backend.clone(),
        );
        let layer = RateLimitLayer::builder(limiter.clone())
            .rule(Rule::new("Aimd", Header::new("x-account")))
            .build()
            .unwrap();
        let server = serve(routes.layer(layer)).await;
        Self {
            client: HttpClient::new(&server),
            _server: server,
            backend,
            key: limiter.key("Aimd", Id::from(7u64)).unwrap(),
        }
    }
}

/// Waits (bounded) until `done` holds.
async fn eventually(done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never");
}

/// The configuration: what is wrong is named with its line.
#[test]
fn a_bad_adaptive_limit_is_refused_with_its_line() {
    let err = |yaml: &str| Limits::from_yaml_str(yaml, None).unwrap_err();
    let e = err("A:\n  concurrency: {adaptive: {min: 5, initial: 2, max: 9}}\n");
    assert!(
        matches!(e.kind(), ConfigErrorKind::Shape(ShapeError::Adaptive(_))),
        "{e}"
    );
    assert_eq!(e.location().line, Some(2));
    // Each message names the field that is wrong and what it takes (before: `min (20) <=
    // initial (20) <= max (10) <= 65535, min at least 1`, `capacity is out of range`, and a
    // list of shapes for a field of the other algorithm).
    let says = [
        (
            "{min: 20, initial: 20, max: 10}",
            "min (20) is above max (10) (1 <= min <= initial <= max <= 65535)",
        ),
        (
            "{min: 5, initial: 2, max: 9}",
            "initial (2) is below min (5)",
        ),
        (
            "{min: 0, max: 9}",
            "min must be a whole number greater than zero, found 0",
        ),
        (
            "{min: 2, max: 20, capacity: 5000}",
            "capacity is out of range: it must be 1 to 4096",
        ),
        (
            "{min: 2, max: 20, algorithm: aimd, increase: 30}",
            "increase is out of range: it must be 1 to max (20)",
        ),
        (
            "{min: 1, max: 9, algorithm: aimd, smoothing: 30}",
            "smoothing is a field of algorithm: gradient; algorithm: aimd takes backoff and increase",
        ),
    ];
    for (adaptive, message) in says {
        let e = err(&format!("A:\n  concurrency:\n    adaptive: {adaptive}\n"));
        assert!(e.to_string().contains(message), "{adaptive}: {e}");
    }
    let e =
        err("A:\n  concurrency:\n    adaptive: {min: 1, max: 9, algorithm: aimd, smoothing: 30}\n");
    assert!(
        matches!(
            e.kind(),
            ConfigErrorKind::OtherAlgorithm {
                field: "smoothing",
                ..
            }
        ),
        "{e}"
    );
    let e = err("A:\n  concurrency:\n    adaptive:\n      min: 1\n      max: 9\n      windw: 1s\n");
    assert!(e.to_string().contains("window"), "{e}");
    assert_eq!(e.location().line, Some(6));
    let e = err("A: {concurrency: {adaptive: {min: 1, max: 9, window: 0s}}}\n");
    assert!(
        matches!(e.kind(), ConfigErrorKind::Shape(ShapeError::Adaptive(_))),
        "{e}"
    );
    let e = err("A: {burst: 1, count: 1, period: 1s, concurrency: {adaptive: {min: 1, max: 9}}}\n");
    assert!(
        matches!(e.kind(), ConfigErrorKind::ConflictingFields(..)),
        "{e}"
    );
    let e = err("A: {concurrency: {adaptive: {min: 1, max: 9}}, across_regions: true}\n");
    assert!(e.to_string().contains("adaptive"), "{e}");
}

/// The admin API takes an adaptive limit as an override, shows it as the file writes it, and
/// the override is in force: the key starts at its `initial`.
#[tokio::test]
async fn an_override_sets_an_ids_adaptive_limit_through_the_admin_api() {
    // On a manual clock: on the system's, one window in ten is a probe at half the slots.
    let clock = ManualClock::new(1_800_000_000_000_000);
    let instance = admin::instance(MemoryBackend::builder().clock(clock).build()).await;
    let body = serde_json::json!({"concurrency": {"adaptive": {
        "min": 1, "initial": 3, "max": 6, "algorithm": "gradient", "window": "250ms"}}});
    let (status, shown) = instance
        .put("/overrides/Adaptive/a1", &body.to_string())
        .await;
    assert_eq!(status, 200, "{shown}");
    let adaptive = &shown["concurrency"]["adaptive"];
    assert_eq!(
        (adaptive["initial"].as_u64(), adaptive["window"].as_str()),
        (Some(3), Some("250ms")),
        "{shown}"
    );
    assert_eq!(
        adaptive["smoothing"], 20,
        "the default, in percent: {shown}"
    );
    // Put back as shown: the same override.
    let mut again = shown.clone();
    for field in ["limit", "id", "expires_at_ms"] {
        again.as_object_mut().unwrap().remove(field);
    }
    let (status, put_back) = instance
        .put("/overrides/Adaptive/a1", &again.to_string())
        .await;
    assert_eq!((status, &put_back), (200, &shown));
    let (_, bucket) = instance.get("/buckets/Adaptive/a1").await;
    assert_eq!(
        (bucket["source"].as_str(), bucket["kind"].as_str()),
        (Some("store"), Some("adaptive concurrency")),
        "{bucket}"
    );
    let key = instance.limiter.parse_key("Adaptive", "a1").unwrap();
    let mut held = 0;
    while instance
        .limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap()
        .allowed()
    {
        held += 1;
    }
    assert_eq!(held, 3);
    // The key's number now and the slots its requests hold (before: neither was shown).
    let (_, bucket) = instance.get("/buckets/Adaptive/a1").await;
    assert_eq!(
        (
            bucket["slots"].as_u64(),
            bucket["in_use"].as_u64(),
            bucket["remaining"].as_u64()
        ),
        (Some(3), Some(3), Some(0)),
        "{bucket}"
    );
}

/// A snapshot read from Redis (a replay's warm start) holds an adaptive key's state as memory
/// holds it after the same requests: its leases, its number, its window.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_snapshot_of_redis_holds_the_adaptive_state_memory_holds() {
    let all = stores().await;
    let (memory, redis) = (&all[0], &all[1]);
    let mut held = Vec::new();
    for s in [memory, redis] {
        let mut leases = s.fill("Aimd").await;
        s.complete(&leases[..5], 7, true).await;
        s.complete(&leases[5..7], 9, false).await;
        leases.drain(..7);
        held.push(leases);
    }
    let (server, prefix) = redis._redis.as_ref().unwrap();
    let reader = tower_ratelimits::RedisBackend::from_url(&server.url)
        .prefix(prefix)
        .caller_time(redis.clock.clone());
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    let snapshot = tower_ratelimits::Snapshot::from_redis(reader, &limits, 100)
        .await
        .unwrap();
    let found: Vec<_> = snapshot
        .keys()
        .iter()
        .filter(|k| k.limit == "Aimd")
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    let tower_ratelimits::kit::Stored::Adaptive(read) = &found[0].state else {
        panic!("{:?}", found[0].state);
    };
    let kept = memory
        .memory
        .as_ref()
        .unwrap()
        .adaptive_state(&memory.key("Aimd"))
        .unwrap();
    assert_eq!(
        (read.controller, read.window),
        (kept.controller, kept.window)
    );
    assert_eq!(
        (read.window_start_us, read.last_us),
        (kept.window_start_us, kept.last_us)
    );
    let ids = |st: &AdaptiveState| {
        let mut d: Vec<u64> = st.leases.iter().map(|&(_, d)| d).collect();
        d.sort();
        d
    };
    assert_eq!(ids(read), ids(&kept));
    assert_eq!(read.leases.len(), 3);
    assert_eq!(snapshot.foreign(), 0);
}

/// A reset forgets what a key learned and keeps its requests in flight, on every store.
#[tokio::test]
async fn a_reset_keeps_the_slots_in_use_and_forgets_the_number() {
    for s in stores().await {
        let l = &s.label;
        let mut held = s.fill("Steep").await;
        s.end_first(&mut held, 2, 5, true).await;
        assert_eq!(s.slots("Steep").await, 5, "{l}");
        s.limiter.reset(&[s.key("Steep")]).await.unwrap();
        assert_eq!(s.slots("Steep").await, 10, "{l}: back at initial");
        // 8 still in flight: 2 more.
        assert_eq!(s.fill("Steep").await.len(), 2, "{l}");
    }
}

/// Foreign data at an adaptive key on Redis (another type, members that are not ours) is read
/// as a fresh key and replaced; state values out of range are ignored.
#[cfg(feature = "redis")]
#[tokio::test]
async fn foreign_data_at_an_adaptive_key_is_read_as_fresh() {
    let all = stores().await;
    let s = &all[1];
    let (server, prefix) = s._redis.as_ref().unwrap();
    let port: u16 = server.url.rsplit(':').next().unwrap().parse().unwrap();
    let key = format!("{prefix}{{Aimd:7}}:a");
    let cmd = |c: String| support::redis::command(port, &c).unwrap();
    for foreign in [
        format!("SET {key} hello"),
        format!("ZADD {key} -1e300 ~c -0.5 ~g -3 ~zz"),
    ] {
        cmd(format!("DEL {key}"));
        cmd(foreign.clone());
        let held = s.fill("Aimd").await;
        assert_eq!(held.len(), 10, "{foreign}");
        s.limiter.release(&held).await.unwrap();
        assert!(cmd(format!("TYPE {key}")).contains("zset"), "{foreign}");
    }
}

/// A request longer than its lease keeps its slot by renewals (as the layer renews it), on
/// every store; a renewal takes no slot and moves nothing.
#[tokio::test]
async fn a_renewed_slot_outlives_its_lease_time() {
    for s in stores().await {
        let l = &s.label;
        let mut held = s.fill("Aimd").await;
        assert_eq!(held.len(), 10, "{l}");
        s.end_first(&mut held, 5, 5, true).await;
        assert_eq!(s.slots("Aimd").await, 9, "{l}");
        for _ in 0..3 {
            s.clock.advance(Duration::from_secs(400));
            assert_eq!(s.limiter.renew(&held).await.unwrap(), 5, "{l}");
        }
        // 20 minutes in, past the 10-minute lease: every slot still held, and a key with
        // requests in flight is not idle (its number stays).
        assert_eq!(s.slots("Aimd").await, 9, "{l}");
        assert_eq!(s.fill("Aimd").await.len(), 4, "{l}");
        assert_eq!(s.limiter.release(&held).await.unwrap(), 5, "{l}");
        assert_eq!(s.limiter.renew(&held).await.unwrap(), 0, "{l}: released");
    }
}
