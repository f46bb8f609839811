//! Operating the limiter: shadow (dry-run) rules and layers, and hot reload of the limits
//! (state kept, no mixed batch, refused files), on memory and on a real Redis, over real HTTP.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::{Router, routing::get};
use support::http::{HttpClient, serve};
use tower_ratelimits::{
    Header, Id, Limiter, Limits, LimitsChange, LimitsWatcher, MemoryBackend, RateLimitLayer,
    ReloadError, ReloadReport, Rule, Transaction,
};
use tracing_subscriber::layer::SubscriberExt as _;

const LIMITS: &str = "\
PerAccount:
  kind: account
  burst: 3
  count: 3
  period: 1s
Strict:
  kind: account
  burst: 1
  count: 1
  period: 1s
";

use support::store::{Fixture, Store};

fn limits(yaml: &str) -> Limits {
    Limits::from_yaml_str(yaml, None).unwrap()
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

/// Every `tower_ratelimits::shadow` event of this test binary, as (limit, id), from a global
/// subscriber (a thread-scoped one misses events when tests race to register the callsite);
/// each test takes the events of its own ids.
#[derive(Clone, Default)]
struct ShadowEvents(Arc<Mutex<Vec<(String, String)>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ShadowEvents {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "tower_ratelimits::shadow" {
            return;
        }
        #[derive(Default)]
        struct Fields(String, String);
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "limit" {
                    self.0 = value.to_owned();
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "id" {
                    self.1 = format!("{value:?}");
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        self.0.lock().unwrap().push((fields.0, fields.1));
    }
}

impl ShadowEvents {
    fn global() -> &'static ShadowEvents {
        static EVENTS: std::sync::OnceLock<ShadowEvents> = std::sync::OnceLock::new();
        EVENTS.get_or_init(|| {
            let events = ShadowEvents::default();
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(events.clone()),
            )
            .unwrap();
            events
        })
    }

    /// The limit names of the events about `ids`, taken out.
    fn take(&self, ids: &[&str]) -> Vec<String> {
        let mut all = self.0.lock().unwrap();
        let (mine, others): (Vec<_>, Vec<_>) = all
            .drain(..)
            .partition(|(_, id)| ids.contains(&id.as_str()));
        *all = others;
        mine.into_iter().map(|(limit, _)| limit).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Shadow mode.
// ---------------------------------------------------------------------------------------------

/// The same script of requests through an enforced rule and through the same rule in shadow:
/// the shadowed app answers every request, its "would deny" events fall only where the
/// enforced app answered 429 (the first one logged, the rest of the 10 s held back), and after
/// every request both buckets hold the same state.
async fn shadow_decides_like_enforced(store: Store) {
    let events = ShadowEvents::global();
    // Ids of this store's run only (the two runs share the event log).
    let ids: [&str; 2] = match store {
        Store::Memory => ["1001", "1002"],
        #[cfg(feature = "redis")]
        Store::Redis => ["2001", "2002"],
    };
    let fixture = Fixture::new(store);
    let enforced = fixture
        .limiter(store, limits(LIMITS), "operate", false)
        .await;
    let shadowed = fixture
        .limiter(store, limits(LIMITS), "operate", false)
        .await;
    let rule = || Rule::new("PerAccount", Header::new("x-account"));
    let enforced_server =
        serve(app(RateLimitLayer::new(enforced.clone(), [rule()]).unwrap())).await;
    let shadow_layer = RateLimitLayer::builder(shadowed.clone())
        .rule(rule().shadow(true))
        .log_ids(true)
        .build()
        .unwrap();
    let shadow_server = serve(app(shadow_layer)).await;
    let (e_client, s_client) = (
        HttpClient::new(&enforced_server),
        HttpClient::new(&shadow_server),
    );

    // (milliseconds to advance first, which of the two accounts)
    let script: &[(u64, usize)] = &[
        (0, 0),
        (0, 0),
        (0, 0),
        (0, 0),
        (0, 1),
        (100, 0),
        (250, 0),
        (0, 0),
        (0, 1),
        (0, 1),
        (0, 1),
        (1000, 0),
        (0, 1),
        (10, 1),
        (400, 1),
    ];
    let mut enforced_denials = 0;
    let mut logged = 0;
    for (step, &(advance, account)) in script.iter().enumerate() {
        fixture.clock.advance(Duration::from_millis(advance));
        let headers = [("x-account", ids[account])];
        let e = e_client.get("/", &headers).await;
        let s = s_client.get("/", &headers).await;
        assert_eq!(
            s.status, 200,
            "{store:?} step {step}: the shadow never refuses"
        );
        let would_deny = events.take(&ids);
        logged += would_deny.len();
        match e.status {
            200 => assert!(
                would_deny.is_empty(),
                "{store:?} step {step}: {would_deny:?}"
            ),
            429 => {
                enforced_denials += 1;
                // One "would deny" line per 10 s (the metrics count each): the first is
                // logged; those after it, within the interval, are held back.
                if enforced_denials == 1 {
                    assert_eq!(would_deny, ["PerAccount"], "{store:?} step {step}");
                } else {
                    assert!(
                        would_deny.len() <= 1,
                        "{store:?} step {step}: {would_deny:?}"
                    );
                }
            }
            other => panic!("{store:?} step {step}: status {other}"),
        }
        for id in ids {
            let check = |l: &Limiter| {
                let tx = [Transaction::new(l.parse_key("PerAccount", id).unwrap())];
                let l = l.clone();
                async move {
                    let d = l.check(&tx).await.unwrap();
                    let d = d.strictest().unwrap().clone();
                    (d.allowed(), d.remaining(), d.retry_after(), d.reset_after())
                }
            };
            assert_eq!(
                check(&enforced).await,
                check(&shadowed).await,
                "{store:?} step {step}: bucket {id}"
            );
        }
    }
    assert!(
        enforced_denials >= 3,
        "the script denies ({enforced_denials})"
    );
    // The run takes far less than the gate's 10 s: one line for all its would-denies (one
    // per request before).
    assert_eq!(logged, 1, "{store:?}: {enforced_denials} would-denies");
}

on_every_store!(shadow_decides_like_enforced => in_memory_a_shadowed_rule_decides_like_the_enforced_one_while_every_request_passes, on_redis_a_shadowed_rule_decides_like_the_enforced_one_while_every_request_passes);

/// An enforced and a shadowed rule in one request: one backend call per request, the shadow's
/// denial never refuses, and a request both deny is refused by the enforced one only (its name
/// in the 429).
async fn enforced_and_shadowed_together(store: Store) {
    let fixture = Fixture::new(store);
    let limiter = fixture
        .limiter(store, limits(LIMITS), "operate", false)
        .await;
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [
            Rule::new("PerAccount", Header::new("x-account")),
            Rule::new("Strict", Header::new("x-account")).shadow(true),
        ],
    )
    .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    for step in 0..5 {
        let r = client.get("/", &[("x-account", "7")]).await;
        if step < 3 {
            assert_eq!(r.status, 200, "{store:?} step {step}: Strict only shadows");
        } else {
            assert_eq!(r.status, 429, "{store:?} step {step}");
            let policy = r.header("ratelimit-policy").unwrap();
            assert!(policy.starts_with("\"PerAccount\""), "{policy}");
            assert!(r.body.contains("PerAccount"), "{}", r.body);
            assert!(!r.body.contains("Strict"), "{}", r.body);
        }
    }
}

#[cfg(feature = "redis")]
fn evalsha_calls(port: u16) -> u64 {
    let stats = support::redis::command(port, "INFO commandstats").unwrap();
    stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

on_every_store!(enforced_and_shadowed_together => in_memory_an_enforced_rule_refuses_what_a_shadowed_one_would_too, on_redis_an_enforced_rule_refuses_what_a_shadowed_one_would_too);

/// On a private server: a request with an enforced and a shadowed rule is exactly one script.
#[cfg(feature = "redis")]
#[tokio::test]
async fn enforced_and_shadowed_rules_of_a_request_are_one_round_trip() {
    let server = support::redis::RedisServer::start();
    let backend = tower_ratelimits::RedisBackend::from_url(server.url())
        .deny_cache(false)
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(limits(LIMITS), backend);
    let layer = RateLimitLayer::new(
        limiter,
        [
            Rule::new("PerAccount", Header::new("x-account")),
            Rule::new("Strict", Header::new("x-account")).shadow(true),
        ],
    )
    .unwrap();
    let http = serve(app(layer)).await;
    let client = HttpClient::new(&http);
    for step in 0..5u64 {
        let before = evalsha_calls(server.port);
        client.get("/", &[("x-account", "8")]).await;
        assert_eq!(evalsha_calls(server.port), before + 1, "step {step}");
    }
}

#[tokio::test]
async fn a_shadowed_layer_never_refuses_and_still_rejects_a_missing_key() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = fixture
        .limiter(Store::Memory, limits(LIMITS), "operate", false)
        .await;
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("PerAccount", Header::new("x-account")))
        .rule(Rule::new("Strict", Header::new("x-account")))
        .shadow(true)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    for _ in 0..10 {
        assert_eq!(client.get("/", &[("x-account", "9")]).await.status, 200);
    }
    // The buckets evolved as if enforced: PerAccount spent its burst of 3, Strict its 1.
    let tx = [Transaction::new(
        limiter.parse_key("PerAccount", "9").unwrap(),
    )];
    assert!(!limiter.check(&tx).await.unwrap().allowed());
    assert_eq!(client.get("/", &[]).await.status, 400, "a missing key");
}

// ---------------------------------------------------------------------------------------------
// Hot reload.
// ---------------------------------------------------------------------------------------------

const EXTENDED: &str = "\
Unrelated:
  burst: 50
  count: 50
  period: 1s
PerAccount:
  kind: account
  burst: 3
  count: 3
  period: 1s
Strict:
  kind: account
  burst: 1
  count: 1
  period: 1s
";

const WIDER: &str = "\
PerAccount:
  kind: account
  burst: 6
  count: 6
  period: 2s
Strict:
  kind: account
  burst: 1
  count: 1
  period: 1s
";

/// A drained bucket stays drained across an unrelated edit; a changed limit applies to the
/// existing bucket from the next request (its stored TAT read under the new limit:
/// `docs/gcra.md`).
async fn reload_keeps_state(store: Store) {
    let fixture = Fixture::new(store);
    let limiter = fixture
        .limiter(store, limits(LIMITS), "operate", false)
        .await;
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("PerAccount", Header::new("x-account"))],
    )
    .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let get = || client.get("/", &[("x-account", "10")]);
    for _ in 0..3 {
        assert_eq!(get().await.status, 200);
    }
    assert_eq!(get().await.status, 429);

    let change = limiter.reload(limits(EXTENDED)).unwrap();
    assert_eq!(change.added, ["Unrelated"]);
    assert!(change.changed.is_empty() && change.removed.is_empty());
    assert_eq!(
        get().await.status,
        429,
        "still drained after an unrelated edit"
    );

    let change = limiter.reload(limits(WIDER)).unwrap();
    assert_eq!(
        change.to_string(),
        "removed: Unrelated; changed: PerAccount"
    );
    // Three spends at 333,334 us each left a TAT 1,000,002 us ahead; under 6 per 2 s (same
    // emission interval, burst offset 2,000,004 us) three more fit.
    for n in 0..3 {
        let r = get().await;
        assert_eq!(r.status, 200, "{store:?} request {n} under the wider limit");
        let policy = r.header("ratelimit-policy").unwrap();
        assert!(
            policy.starts_with("\"PerAccount\";q=6;"),
            "{store:?}: {policy}"
        );
    }
    assert_eq!(get().await.status, 429);
}

on_every_store!(reload_keeps_state => in_memory_a_reload_keeps_state_and_applies_a_changed_limit_from_the_next_request, on_redis_a_reload_keeps_state_and_applies_a_changed_limit_from_the_next_request);

#[tokio::test]
async fn a_reload_that_removes_a_rules_limit_is_refused_and_the_old_limits_stay() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = fixture
        .limiter(Store::Memory, limits(LIMITS), "operate", false)
        .await;
    let _layer = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("Strict", Header::new("x-account"))],
    )
    .unwrap();
    let without_strict = limits("PerAccount: {kind: account, burst: 3, count: 3, period: 1s}\n");
    match limiter.reload(without_strict) {
        Err(ReloadError::LimitInUse(name)) => assert_eq!(name, "Strict"),
        other => panic!("{other:?}"),
    }
    assert_eq!(limiter.generation(), 0);
    assert!(limiter.limits().name("Strict").is_some());
    // A limit no rule uses may go.
    let without_per_account = limits("Strict: {kind: account, burst: 1, count: 1, period: 1s}\n");
    assert_eq!(
        limiter.reload(without_per_account).unwrap().removed,
        ["PerAccount"]
    );
}

/// Two configurations that differ in both limits of a batch, swapped back and forth while
/// tasks spend: every batch is decided entirely under one of them, and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_decided_under_one_configuration_while_reloads_race_it() {
    let a =
        "First: {burst: 10, count: 10, period: 1s}\nSecond: {burst: 20, count: 20, period: 1s}\n";
    let b =
        "First: {burst: 11, count: 11, period: 1s}\nSecond: {burst: 21, count: 21, period: 1s}\n";
    let limiter = Limiter::new(limits(a), MemoryBackend::new());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // On a thread of its own, so that it truly races the spending tasks.
    let reloader = {
        let (limiter, stop) = (limiter.clone(), stop.clone());
        let (a, b) = (limits(a), limits(b));
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                limiter
                    .reload(if n.is_multiple_of(2) {
                        b.clone()
                    } else {
                        a.clone()
                    })
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    let mut tasks = Vec::new();
    for t in 0..4 {
        let limiter = limiter.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..2_000u64 {
                let id = format!("{t}-{i}");
                let batch = [
                    Transaction::new(limiter.key("First", Id::new(id.as_str()).unwrap()).unwrap()),
                    Transaction::new(
                        limiter
                            .key("Second", Id::new(id.as_str()).unwrap())
                            .unwrap(),
                    ),
                ];
                let d = limiter.spend(&batch).await.unwrap();
                let bursts: Vec<u64> = d
                    .decisions()
                    .iter()
                    .map(|d| d.limit().as_ref().unwrap().as_gcra().unwrap().burst())
                    .collect();
                assert!(
                    bursts == [10, 20] || bursts == [11, 21],
                    "a mixed batch: {bursts:?}"
                );
                assert!(d.allowed());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reloads = reloader.join().unwrap();
    assert!(reloads > 10, "only {reloads} reloads raced the spends");
}

/// Concurrent HTTP requests while the limits are reloaded: every request gets a rate limit
/// answer (200 or 429), none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_during_reloads_never_fail() {
    let limiter = Limiter::new(limits(LIMITS), MemoryBackend::new());
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("PerAccount", Header::new("x-account"))],
    )
    .unwrap();
    let server = Arc::new(serve(app(layer)).await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reloader = {
        let (limiter, stop) = (limiter.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                limiter
                    .reload(limits(if n.is_multiple_of(2) { WIDER } else { LIMITS }))
                    .unwrap();
                n += 1;
                tokio::task::yield_now().await;
            }
            n
        })
    };
    let mut tasks = Vec::new();
    for t in 0..4 {
        let server = server.clone();
        tasks.push(tokio::spawn(async move {
            let client = HttpClient::new(&server);
            for i in 0..150 {
                let id = format!("{}", t * 10 + i % 5);
                let r = client.get("/", &[("x-account", id.as_str())]).await;
                assert!(r.status == 200 || r.status == 429, "status {}", r.status);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reloader.await.unwrap() > 0);
}

/// The file watcher: an edit is applied and reported with what changed; a broken file is
/// refused with its location and the previous limits keep deciding; fixing it applies it.
#[tokio::test]
async fn the_watcher_applies_edits_and_refuses_a_broken_file_with_its_location() {
    let dir = std::env::temp_dir().join(format!("trl-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let defaults = dir.join("defaults.yaml");
    let overrides = dir.join("overrides.yaml");
    std::fs::write(&defaults, LIMITS).unwrap();
    std::fs::write(&overrides, "[]\n").unwrap();
    let limiter = Limiter::new(
        Limits::from_yaml_files(&defaults, Some(&overrides)).unwrap(),
        MemoryBackend::new(),
    );
    let (tx, mut reports) = tokio::sync::mpsc::unbounded_channel::<Result<LimitsChange, String>>();
    let _watcher = LimitsWatcher::spawn_with(
        limiter.clone(),
        &defaults,
        Some(&overrides),
        move |report: &ReloadReport| {
            let _ = tx.send(match report {
                Ok(change) => Ok(change.clone()),
                Err(e) => Err(e.to_string()),
            });
        },
    )
    .unwrap();
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(20), reports.recv())
            .await
            .expect("a reload report")
            .unwrap()
    };
    let vip = || limiter.parse_key("PerAccount", "42").unwrap();
    let burst_of_vip = || {
        limiter
            .limits()
            .resolve(&vip())
            .unwrap()
            .as_gcra()
            .unwrap()
            .burst()
    };
    assert_eq!(burst_of_vip(), 3);

    std::fs::write(
        &overrides,
        "- PerAccount: {burst: 9, count: 9, period: 1s, ids: ['42']}\n",
    )
    .unwrap();
    let change = next().await.unwrap();
    assert_eq!(change.changed, ["PerAccount"]);
    assert_eq!(burst_of_vip(), 9);

    std::fs::write(
        &overrides,
        "- PerAccount: {burst: 5, count: 5, period: 1s, ids: ['42']}\n- PerAccount: {burst: 0}\n",
    )
    .unwrap();
    let refused = next().await.unwrap_err();
    assert!(
        refused.contains(&format!("{}:2", overrides.display())),
        "located: {refused}"
    );
    assert_eq!(burst_of_vip(), 9, "the previous limits stay in force");
    let d = limiter
        .spend(&[Transaction::new(vip()).cost(9)])
        .await
        .unwrap();
    assert!(d.allowed());

    // Replaced by rename, as editors do.
    let tmp = dir.join("overrides.yaml.tmp");
    std::fs::write(&tmp, "[]\n").unwrap();
    std::fs::rename(&tmp, &overrides).unwrap();
    let change = next().await.unwrap();
    assert_eq!(change.changed, ["PerAccount"]);
    assert_eq!(burst_of_vip(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiered limit reloaded with fewer and then more tiers: the recorded grants are read tier by
/// tier (tiers the new limit lacks are dropped, new ones start empty), on memory and Redis;
/// nothing panics and no request fails.
async fn tiers_across_reloads(store: Store) {
    let three = "\
Tiered:
  kind: account
  tiers:
    - {limit: 2, window: 1h, active: 1h, cooldown: 0s}
    - {limit: 3, window: 1h, active: 1h, cooldown: 1h}
    - {limit: 4, window: 1h, active: 1h, cooldown: 1h}
";
    let one = "\
Tiered:
  kind: account
  tiers:
    - {limit: 2, window: 1h, active: 1h, cooldown: 0s}
";
    let fixture = Fixture::new(store);
    let limiter = fixture
        .limiter(store, limits(three), "operate", false)
        .await;
    let tx = [Transaction::new(limiter.parse_key("Tiered", "5").unwrap())];
    let mut granted = 0;
    for _ in 0..4 {
        granted += limiter
            .spend(&tx)
            .await
            .unwrap()
            .strictest()
            .unwrap()
            .granted();
    }
    assert_eq!(granted, 4, "{store:?}: tier 1 (2) and two of tier 2");
    limiter.reload(limits(one)).unwrap();
    // Under one tier, tier 1's two grants fill it.
    assert!(!limiter.spend(&tx).await.unwrap().allowed(), "{store:?}");
    limiter.reload(limits(three)).unwrap();
    // Back to three tiers: what the one-tier spends wrote is read again tier by tier; the
    // bucket still holds tier 1's grants, so the next grant comes from a higher tier.
    let d = limiter.spend(&tx).await.unwrap();
    let d = d.strictest().unwrap();
    assert!(d.allowed(), "{store:?}: {d:?}");
    assert!(d.tiers().unwrap().tier >= 1, "{store:?}: {d:?}");
}

on_every_store!(tiers_across_reloads => in_memory_a_tiered_bucket_survives_reloads_that_change_its_tier_count, on_redis_a_tiered_bucket_survives_reloads_that_change_its_tier_count);
