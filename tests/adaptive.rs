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
    MemoryBackend, RateLimitLayer, Rule, Transaction,
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
";

struct Store {
    clock: ManualClock,
    backend: MemoryBackend,
    limiter: Limiter,
}

fn store() -> Store {
    let clock = ManualClock::new(1_800_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    );
    Store {
        clock,
        backend,
        limiter,
    }
}

impl Store {
    fn key(&self, limit: &str) -> BucketKey {
        self.limiter.key(limit, Id::from(7u64)).unwrap()
    }

    /// Takes slots until one is refused: the leases taken.
    async fn fill(&self, limit: &str) -> Vec<Lease> {
        let mut leases = Vec::new();
        for _ in 0..100 {
            let d = self
                .limiter
                .spend(&[Transaction::new(self.key(limit))])
                .await
                .unwrap();
            if !d.allowed() {
                return leases;
            }
            leases.extend(d.decisions().iter().filter_map(|d| d.lease()));
        }
        panic!("never refused");
    }

    fn state(&self, limit: &str) -> AdaptiveState {
        self.backend.adaptive_state(&self.key(limit)).unwrap()
    }

    fn slots(&self, limit: &str) -> u64 {
        self.state(limit).controller.limit_milli / 1000
    }

    async fn complete(&self, leases: &[Lease], latency_ms: u64, failed: bool) {
        let c = Completion::new(Duration::from_millis(latency_ms), failed);
        assert_eq!(
            self.limiter.complete(leases, c).await.unwrap(),
            leases.len()
        );
    }
}

/// AIMD: a window (5 completions) with a failure keeps 90% of the slots; a full window without
/// one adds a slot. What the key admits follows at once.
#[tokio::test]
async fn failures_back_a_key_off_and_a_full_window_grows_it() {
    let s = store();
    let mut held = s.fill("Aimd").await;
    assert_eq!(held.len(), 10, "initial");
    let done: Vec<Lease> = held.drain(..5).collect();
    for l in &done[..4] {
        s.complete(std::slice::from_ref(l), 5, false).await;
    }
    s.complete(&done[4..], 5, true).await;
    assert_eq!(s.slots("Aimd"), 9, "10 x 0.9");
    // 5 in flight, 9 slots: 4 more.
    held.extend(s.fill("Aimd").await);
    assert_eq!(held.len(), 9);
    // A full window without a failure: one slot more.
    let done: Vec<Lease> = held.drain(..5).collect();
    s.complete(&done, 5, false).await;
    assert_eq!(s.slots("Aimd"), 10);
    assert_eq!(s.fill("Aimd").await.len(), 6, "4 in flight of 10");
}

/// A number that drops below the slots in use takes no lease away: the requests in flight
/// keep their slots, and new ones are refused until in-flight falls under the number.
#[tokio::test]
async fn a_drop_below_the_slots_in_use_keeps_their_leases() {
    let s = store();
    let mut held = s.fill("Steep").await;
    assert_eq!(held.len(), 10);
    // A window of two failures halves the number under eight requests still in flight.
    let done: Vec<Lease> = held.drain(..2).collect();
    s.complete(&done, 5, true).await;
    assert_eq!(s.slots("Steep"), 5);
    assert_eq!(s.backend.leases(&s.key("Steep")), 8, "every lease kept");
    assert!(!spend_one(&s, "Steep").await.0);
    // Given back without a completion (the number stays 5): refused until under it.
    s.limiter
        .release(&held.drain(..3).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(held.len(), 5);
    assert!(!spend_one(&s, "Steep").await.0, "5 in flight of 5");
    s.limiter
        .release(&held.drain(..1).collect::<Vec<_>>())
        .await
        .unwrap();
    assert!(spend_one(&s, "Steep").await.0, "4 in flight of 5");
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

/// A key idle for `idle_reset` starts again at `initial`, whatever it learned.
#[tokio::test]
async fn an_idle_key_starts_again_at_initial() {
    let s = store();
    let held = s.fill("Aimd").await;
    s.complete(&held[..5], 5, true).await;
    s.limiter.release(&held[5..]).await.unwrap();
    assert_eq!(s.slots("Aimd"), 9);
    s.clock.advance(Duration::from_secs(59));
    let again = s.fill("Aimd").await;
    assert_eq!(again.len(), 9, "not idle long enough");
    s.complete(&again, 5, true).await;
    assert_eq!(s.slots("Aimd"), 8);
    s.clock.advance(Duration::from_secs(60));
    assert_eq!(s.fill("Aimd").await.len(), 10, "back at initial");
}

/// Gradient: at full load, a latency as good as the best recent one lets the number grow by
/// its queue (sqrt of the number); a latency four times worse takes it down.
#[tokio::test]
async fn the_gradient_follows_the_latency_at_full_load() {
    let s = store();
    for _ in 0..5 {
        let held = s.fill("Gradient").await;
        s.complete(&held, 10, false).await;
    }
    let grown = s.slots("Gradient");
    assert!(grown > 10, "{grown}");
    for _ in 0..5 {
        let held = s.fill("Gradient").await;
        s.complete(&held, 40, false).await;
    }
    let fallen = s.slots("Gradient");
    assert!(fallen < grown, "{fallen} after {grown}");
}

/// Two instances giving back leases of one key merge their completions in the store: the
/// window (5 completions) fills from both, and moves the number once, not twice.
#[tokio::test]
async fn instances_merge_their_completions_in_the_store() {
    let s = store();
    let other = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        s.backend.clone(),
    );
    let held = s.fill("Aimd").await;
    s.complete(&held[..3], 5, true).await;
    assert_eq!(s.state("Aimd").window.completions, 3);
    let c = Completion::new(Duration::from_millis(5), false);
    assert_eq!(other.complete(&held[3..5], c).await.unwrap(), 2);
    let st = s.state("Aimd");
    assert_eq!((st.window.completions, s.slots("Aimd")), (0, 9));
}

/// A lease given back without a completion (`release`) moves nothing.
#[tokio::test]
async fn a_plain_release_teaches_nothing() {
    let s = store();
    let held = s.fill("Aimd").await;
    assert_eq!(s.limiter.release(&held).await.unwrap(), 10);
    let st = s.state("Aimd");
    assert_eq!((st.window.completions, s.slots("Aimd")), (0, 10));
}

/// Through the layer on a real server: a 503 is a failure (a window of 5 backs the key off
/// to 9), a 200 is not, and `RateLimit-Policy` shows the key's number now.
#[tokio::test]
async fn a_failing_service_backs_its_key_off_through_the_layer() {
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    );
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Aimd", Header::new("x-account")))
        .build()
        .unwrap();
    let router = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route(
            "/fail",
            get(|| async { (http::StatusCode::SERVICE_UNAVAILABLE, "busy") }),
        )
        .layer(layer);
    let server = serve(router).await;
    let client = HttpClient::new(&server);
    let key = limiter.key("Aimd", Id::from(7u64)).unwrap();
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
        matches!(e.kind(), ConfigErrorKind::InvalidAdaptive(_)),
        "{e}"
    );
    assert_eq!(e.location().line, Some(2));
    let e =
        err("A:\n  concurrency:\n    adaptive: {min: 1, max: 9, algorithm: aimd, smoothing: 30}\n");
    assert!(
        matches!(e.kind(), ConfigErrorKind::ConflictingFields("smoothing", _)),
        "{e}"
    );
    let e = err("A:\n  concurrency:\n    adaptive:\n      min: 1\n      max: 9\n      windw: 1s\n");
    assert!(e.to_string().contains("window"), "{e}");
    assert_eq!(e.location().line, Some(6));
    let e = err("A: {concurrency: {adaptive: {min: 1, max: 9, window: 0s}}}\n");
    assert!(
        matches!(e.kind(), ConfigErrorKind::InvalidAdaptive(_)),
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
    let instance = admin::instance(MemoryBackend::new()).await;
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
}
