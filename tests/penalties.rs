//! Penalty ladders on a limit (`docs/penalties.md`), decided in the request's one batch: the
//! n-th ban's length, the level's decay, a penalty and another limit all or nothing, a
//! calendar quota's state and its penalty's kept apart, through the layer over TCP, and the
//! configurations and backends that cannot carry one refused with their reasons.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;

use fred::prelude::KeysInterface;
use support::redis::{TestRedis, unique_prefix};
use support::redis_backend::caller_time_backend;
use tower_ratelimits::{
    BatchDecision, BucketKey, ConfigErrorKind, CountWhen, Header, Id, Ladder, Limit, Limiter,
    LimiterError, Limits, ManualClock, MemoryBackend, RateLimitLayer, Rule, Transaction,
};

const S: u64 = 1_000_000;

/// 3 counted units within a minute ban for 10 s, then 20, 40, at most 60; the level falls
/// one step for each 100 s of quiet.
fn ladder() -> Ladder {
    Ladder::new(3, 60 * S, 10 * S, 2, 60 * S)
        .unwrap()
        .forget_after(100 * S)
        .unwrap()
}

fn limits() -> Limits {
    Limits::builder()
        .limit(
            "Login",
            Limit::new(1_000, 1_000, Duration::from_secs(1)).unwrap(),
        )
        .limit("Tight", Limit::new(1, 1, Duration::from_secs(60)).unwrap())
        .penalty("Login", ladder())
        .build()
        .unwrap()
}

/// A limiter on memory over a roomy limit `Login` with [`ladder`], and a tight limit `Tight`
/// of one request a minute (no penalty).
fn limiter(clock: &ManualClock) -> Limiter {
    Limiter::new(
        limits(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    )
}

/// A limiter over [`limits`] on each store, all on `clock` (Redis in caller time); the Redis
/// servers stop when dropped.
async fn stores(clock: &ManualClock) -> Vec<(&'static str, Limiter, Option<TestRedis>)> {
    let mut out = vec![("memory", limiter(clock), None)];
    for (label, redis, cache) in [
        ("a single Redis", TestRedis::single(), false),
        ("the cluster", TestRedis::cluster(), true),
    ] {
        let prefix = unique_prefix("penalties");
        let backend = caller_time_backend(&redis.url, &prefix, clock, cache).await;
        out.push((label, Limiter::new(limits(), backend), Some(redis)));
    }
    out
}

fn key(limiter: &Limiter, name: &str, id: u64) -> BucketKey {
    BucketKey::new(limiter.name(name).unwrap(), Id::from(id))
}

async fn login(limiter: &Limiter, id: u64) -> BatchDecision {
    let key = key(limiter, "Login", id);
    limiter.spend(&[Transaction::new(key)]).await.unwrap()
}

/// Spends until the key is banned; the decision that banned it (still allowed).
async fn until_banned(limiter: &Limiter, id: u64) -> BatchDecision {
    for _ in 0..2 {
        assert!(login(limiter, id).await.allowed());
    }
    let banning = login(limiter, id).await;
    assert!(banning.allowed(), "the event that bans is let through");
    banning
}

#[tokio::test]
async fn the_nth_ban_lasts_base_times_factor_to_the_n_minus_1_up_to_max() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        for ban_s in [10, 20, 40, 60, 60] {
            let banning = until_banned(&limiter, 7).await;
            assert_eq!(banning.decisions()[0].remaining(), 0);
            assert_eq!(
                banning.decisions()[0].reset_after(),
                Duration::from_secs(ban_s)
            );
            let refused = login(&limiter, 7).await;
            assert!(!refused.allowed());
            assert_eq!(
                refused.decisions()[0].retry_after(),
                Duration::from_secs(ban_s)
            );
            clock.advance(Duration::from_secs(ban_s) - Duration::from_micros(1));
            assert!(
                !login(&limiter, 7).await.allowed(),
                "banned to the microsecond"
            );
            clock.advance(Duration::from_micros(1));
        }
        // Another key was never touched.
        assert!(login(&limiter, 8).await.allowed());
    }
}

#[tokio::test]
async fn the_level_falls_a_step_for_each_quiet_forget_after() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        until_banned(&limiter, 7).await; // level 1: 10 s
        clock.advance(Duration::from_secs(10));
        until_banned(&limiter, 7).await; // level 2: 20 s
        // Two steps of quiet after the ban's end: back to level 0, so the next ban is the first's.
        clock.advance(Duration::from_secs(20 + 200));
        let banning = until_banned(&limiter, 7).await;
        assert_eq!(
            banning.decisions()[0].reset_after(),
            Duration::from_secs(10)
        );
        clock.advance(Duration::from_secs(10));
        until_banned(&limiter, 7).await; // level 2: 20 s
        // One step only: level 1 left, so the next ban is the second's again.
        clock.advance(Duration::from_secs(20 + 100));
        let banning = until_banned(&limiter, 7).await;
        assert_eq!(
            banning.decisions()[0].reset_after(),
            Duration::from_secs(20)
        );
    }
}

#[tokio::test]
async fn units_leave_the_window_after_within() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        for _ in 0..2 {
            assert!(login(&limiter, 7).await.allowed());
        }
        assert_eq!(login(&limiter, 8).await.decisions()[0].remaining(), 2);
        clock.advance(Duration::from_secs(60));
        // A check counts only the window's units: the two counted a minute ago left it.
        let check = [Transaction::new(key(&limiter, "Login", 7))];
        let d = limiter.check(&check).await.unwrap();
        assert_eq!(
            d.decisions()[0].remaining(),
            3,
            "a check counts only the window"
        );
        // The two units left the window: two more do not ban.
        for left in [2, 1] {
            let d = login(&limiter, 7).await;
            assert!(d.allowed());
            assert_eq!(d.decisions()[0].remaining(), left);
        }
    }
}

#[tokio::test]
async fn a_penalty_and_another_limit_in_one_batch_are_all_or_nothing() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let batch = [
            Transaction::new(key(&limiter, "Tight", 7)),
            Transaction::new(key(&limiter, "Login", 7)),
        ];
        assert!(limiter.spend(&batch).await.unwrap().allowed());
        // `Tight` refuses the next ones: their penalty counts nothing.
        for _ in 0..5 {
            assert!(!limiter.spend(&batch).await.unwrap().allowed());
        }
        assert_eq!(login(&limiter, 8).await.decisions()[0].remaining(), 2);
        let d = limiter
            .check(&[Transaction::new(key(&limiter, "Login", 7))])
            .await
            .unwrap();
        assert_eq!(d.decisions()[0].remaining(), 2, "one unit counted, not six");
        // A banned key refuses the batch: the other limit spends nothing.
        until_banned(&limiter, 9).await;
        clock.advance(Duration::from_secs(60));
        let banned = [
            Transaction::new(key(&limiter, "Tight", 9)),
            Transaction::new(key(&limiter, "Login", 9)),
        ];
        let d = limiter.spend(&banned).await.unwrap();
        assert!(d.allowed(), "the ban of 10 s is over a minute later");
        until_banned(&limiter, 10).await;
        let refused = [
            Transaction::new(key(&limiter, "Tight", 10)),
            Transaction::new(key(&limiter, "Login", 10)),
        ];
        assert!(!limiter.spend(&refused).await.unwrap().allowed());
        clock.advance(Duration::from_secs(10));
        let d = limiter.spend(&refused).await.unwrap();
        assert!(
            d.allowed(),
            "Tight spent nothing while Login's key was banned"
        );
    }
}

#[tokio::test]
async fn a_check_reads_the_ban_and_counts_nothing() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let check = [Transaction::new(key(&limiter, "Login", 7))];
        for _ in 0..10 {
            assert!(limiter.check(&check).await.unwrap().allowed());
        }
        until_banned(&limiter, 7).await;
        let d = limiter.check(&check).await.unwrap();
        assert!(!d.allowed());
        assert_eq!(d.decisions()[0].retry_after(), Duration::from_secs(10));
    }
}

#[tokio::test]
async fn a_calendar_quota_and_its_penalty_keep_their_own_states() {
    let clock = ManualClock::new(1_000 * S);
    let limits = Limits::builder()
        .limit(
            "Monthly",
            tower_ratelimits::CalendarQuota::new(100, tower_ratelimits::Period::Month).unwrap(),
        )
        .penalty("Monthly", ladder())
        .build()
        .unwrap();
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(limits, backend.clone());
    let k = key(&limiter, "Monthly", 7);
    for left in [99, 98] {
        let d = limiter.spend(&[Transaction::new(k.clone())]).await.unwrap();
        assert!(d.allowed());
        // What the quota has left, not the penalty's 2 or 1.
        assert_eq!(backend.calendar_state(&k).unwrap().used, 100 - left);
    }
    let d = limiter.spend(&[Transaction::new(k.clone())]).await.unwrap();
    assert!(d.allowed());
    assert_eq!(backend.calendar_state(&k).unwrap().used, 3);
    assert!(
        !limiter
            .spend(&[Transaction::new(k.clone())])
            .await
            .unwrap()
            .allowed()
    );
    assert_eq!(
        backend.calendar_state(&k).unwrap().used,
        3,
        "a banned request spends nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_requests_at_once_ban_at_after_and_admit_no_more() {
    let clock = ManualClock::new(1_000 * S);
    let limiter = limiter(&clock);
    let tasks = (0..1_000).map(|_| {
        let limiter = limiter.clone();
        tokio::spawn(async move { login(&limiter, 7).await.allowed() })
    });
    let all = futures_util::future::join_all(tasks).await;
    let admitted = all.into_iter().filter(|d| *d.as_ref().unwrap()).count();
    assert_eq!(admitted, 3, "the third bans; none after it is let through");
}

/// A login over TCP: `x-password: right` is 200, anything else 401, counting the requests
/// that reached it; behind a layer whose rule keys on `x-account` and counts the 401s (weight
/// 1) on `Login`, whose penalty is [`ladder`].
struct LoginApp {
    _server: support::http::Server,
    client: support::http::HttpClient,
    reached: Arc<AtomicUsize>,
}

impl LoginApp {
    async fn serve(limiter: Limiter) -> Self {
        let reached = Arc::new(AtomicUsize::new(0));
        let seen = reached.clone();
        let app = Router::new().route(
            "/login",
            get(move |headers: HeaderMap| {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, Ordering::SeqCst);
                    match headers.get("x-password").map(|v| v.as_bytes()) {
                        Some(b"right") => StatusCode::OK,
                        _ => StatusCode::UNAUTHORIZED,
                    }
                }
            }),
        );
        let rule = Rule::new("Login", Header::new("x-account"))
            .count_when(CountWhen::new().status(401, 1));
        let layer = RateLimitLayer::new(limiter, [rule]).unwrap();
        let server = support::http::serve(app.layer(layer)).await;
        let client = support::http::HttpClient::new(&server);
        LoginApp {
            _server: server,
            client,
            reached,
        }
    }

    async fn login(&self, account: &str, password: &str) -> support::http::Reply {
        let headers = [("x-account", account), ("x-password", password)];
        self.client.get("/login", &headers).await
    }
}

#[tokio::test]
async fn failed_logins_ban_the_account_and_successes_count_nothing() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let app = LoginApp::serve(limiter).await;
        for _ in 0..10 {
            let ok = app.login("ann", "right").await;
            assert_eq!(ok.status, 200, "a success counts nothing");
            // Settled before the answer: three failures left before a ban.
            let fields = ok.header("ratelimit").unwrap();
            assert!(fields.contains(";r=3;"), "{fields}");
        }
        let failed = app.login("ann", "wrong").await;
        assert!(failed.header("ratelimit").unwrap().contains(";r=2;"));
        app.login("ann", "right").await;
        for _ in 0..2 {
            assert_eq!(app.login("ann", "wrong").await.status, 401);
        }
        // The third failure banned the account for 10 s: even the right password is refused there.
        let reached = app.reached.load(Ordering::SeqCst);
        let banned = app.login("ann", "right").await;
        assert_eq!(banned.status, 429);
        assert_eq!(banned.header("retry-after"), Some("10"));
        assert_eq!(
            app.reached.load(Ordering::SeqCst),
            reached,
            "the service never saw it"
        );
        // Another account is free.
        assert_eq!(app.login("bob", "right").await.status, 200);
        clock.advance(Duration::from_secs(10));
        assert_eq!(app.login("ann", "right").await.status, 200);
        // The second ban is twice as long.
        for _ in 0..3 {
            assert_eq!(app.login("ann", "wrong").await.status, 401);
        }
        assert_eq!(
            app.login("ann", "right").await.header("retry-after"),
            Some("20")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_failed_logins_at_once_reach_the_service_at_most_after_times() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let app = Arc::new(LoginApp::serve(limiter).await);
        let tasks = (0..100).map(|_| {
            let app = app.clone();
            tokio::spawn(async move { app.login("ann", "wrong").await.status })
        });
        let statuses: Vec<u16> = futures_util::future::join_all(tasks)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        // Each attempt in flight reserves: 3 reach the service, the rest are refused, and the
        // third failure bans.
        assert_eq!(statuses.iter().filter(|s| **s == 401).count(), 3);
        assert_eq!(app.reached.load(Ordering::SeqCst), 3);
        assert_eq!(app.login("ann", "right").await.status, 429);
    }
}

#[test]
fn a_penalty_where_none_can_be_is_refused_with_its_reason() {
    let limit = || Limit::new(10, 10, Duration::from_secs(1)).unwrap();
    let marked = Limits::builder()
        .limit("A", limit())
        .across_regions("A", tower_ratelimits::RegionFloor::default())
        .penalty("A", ladder())
        .build()
        .unwrap_err();
    assert!(
        matches!(marked.kind(), ConfigErrorKind::Penalty(_)),
        "{marked}"
    );
    assert_eq!(marked.limit(), Some("A"));
    let slots = Limits::builder()
        .limit(
            "A",
            tower_ratelimits::ConcurrencyLimit::new(5, Duration::from_secs(30)).unwrap(),
        )
        .penalty("A", ladder())
        .build()
        .unwrap_err();
    assert!(
        matches!(slots.kind(), ConfigErrorKind::Penalty(_)),
        "{slots}"
    );
    let unknown = Limits::builder()
        .limit("A", limit())
        .penalty("B", ladder())
        .build();
    assert!(matches!(
        unknown.unwrap_err().kind(),
        ConfigErrorKind::UnknownName(_)
    ));
}

/// A backend of the crate's memory store that does not say it decides penalties (as a
/// backend written before them): every call passed through.
struct Unaware(MemoryBackend);

#[tower_ratelimits::async_trait]
impl tower_ratelimits::Backend for Unaware {
    fn spend(&self, batch: &[tower_ratelimits::BucketTx<'_>]) -> tower_ratelimits::Spend {
        self.0.spend(batch)
    }
    async fn refund(
        &self,
        batch: &[tower_ratelimits::BucketTx<'_>],
    ) -> Result<tower_ratelimits::Outcomes, tower_ratelimits::BackendError> {
        self.0.refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), tower_ratelimits::BackendError> {
        self.0.reset(keys).await
    }
}

#[tokio::test]
async fn a_backend_that_decides_no_penalty_refuses_the_limit_rather_than_forget_it() {
    let limiter = Limiter::new(limits(), Unaware(MemoryBackend::new()));
    let err = limiter
        .spend(&[Transaction::new(key(&limiter, "Login", 7))])
        .await
        .unwrap_err();
    assert!(matches!(err, LimiterError::NoPenalties(name) if name.as_str() == "Login"));
    // A limit without one is decided as ever.
    let other = [Transaction::new(key(&limiter, "Tight", 7))];
    assert!(limiter.spend(&other).await.unwrap().allowed());
}

#[tokio::test]
async fn redis_keeps_a_penalty_beside_its_bucket_until_it_is_fresh_and_replaces_foreign_data() {
    let clock = ManualClock::new(1_000 * S);
    let redis = TestRedis::single();
    let prefix = unique_prefix("penalty-key");
    let backend = caller_time_backend(&redis.url, &prefix, &clock, false).await;
    let limiter = Limiter::new(limits(), backend.clone());
    let pen = format!("{}:pen", backend.redis_key(&key(&limiter, "Login", 7)));
    assert!(pen.ends_with("{Login:7}:pen"), "{pen}");
    // Foreign data where the state goes: read as none, replaced by the first write.
    let client = backend.client_for_key(&pen).unwrap();
    let _: () = client
        .set(&pen, "not-a-state", None, None, false)
        .await
        .unwrap();
    assert_eq!(login(&limiter, 7).await.decisions()[0].remaining(), 2);
    let raw: Vec<u8> = client.get(&pen).await.unwrap();
    assert_ne!(raw, b"not-a-state", "replaced by a penalty state");
    let ttl: i64 = client.pttl(&pen).await.unwrap();
    // Its window (a minute), and the margin of a store on caller time (an hour).
    assert!(
        ttl > 0 && ttl <= 60_000 + 3_600_000,
        "kept for its window: {ttl}"
    );
    until_banned(&limiter, 8).await;
    // A reset lifts the ban and forgets the level.
    limiter.reset(&[key(&limiter, "Login", 8)]).await.unwrap();
    assert!(login(&limiter, 8).await.allowed());
}

#[tokio::test]
async fn every_store_gives_a_key_the_same_jittered_ban() {
    let jittery = || {
        Limits::builder()
            .limit(
                "Login",
                Limit::new(1_000, 1_000, Duration::from_secs(1)).unwrap(),
            )
            .penalty("Login", ladder().jitter(1_000).unwrap())
            .build()
            .unwrap()
    };
    let mut ends = Vec::new();
    let clock = ManualClock::new(1_000 * S);
    let memory = Limiter::new(
        jittery(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let redis = TestRedis::single();
    let backend = caller_time_backend(&redis.url, &unique_prefix("jitter"), &clock, false).await;
    let on_redis = Limiter::new(jittery(), backend);
    for limiter in [&memory, &on_redis] {
        let mut of_store = Vec::new();
        for id in 0..20 {
            of_store.push(until_banned(limiter, id).await.decisions()[0].reset_after());
        }
        ends.push(of_store);
    }
    assert_eq!(
        ends[0], ends[1],
        "memory and Redis agree to the microsecond"
    );
    assert!(
        ends[0]
            .iter()
            .all(|d| *d >= Duration::from_secs(10) && *d <= Duration::from_secs(20))
    );
    let distinct: std::collections::HashSet<_> = ends[0].iter().collect();
    assert!(
        distinct.len() > 10,
        "the jitter spreads the keys' ends: {distinct:?}"
    );
}

#[test]
fn a_penalty_in_yaml_is_the_builder_s_ladder_and_its_mistakes_are_located() {
    let yaml = "\
Login:
  burst: 1000
  count: 1000
  period: 1s
  penalty: {after: 3, within: 1m, base: 10s, factor: 2, max: 1m, forget_after: 100s}
";
    let limits = Limits::from_yaml_str(yaml, None).unwrap();
    assert_eq!(
        limits.penalty(limits.name("Login").unwrap()),
        Some(&ladder())
    );
    let jitter = "A: {burst: 1, count: 1, period: 1s, penalty: {after: 1, within: 1s, base: 1s, factor: 1, max: 1s, jitter: 2.5%}}";
    let limits = Limits::from_yaml_str(jitter, None).unwrap();
    let with = Ladder::new(1, S, S, 1, S).unwrap().jitter(25).unwrap();
    assert_eq!(limits.penalty(limits.name("A").unwrap()), Some(&with));

    let err = |text: &str| Limits::from_yaml_str(text, None).unwrap_err();
    let base = "A:\n  burst: 1\n  count: 1\n  period: 1s\n  penalty:";
    let missing = err(&format!(
        "{base} {{after: 1, within: 1s, base: 1s, factor: 2}}\n"
    ));
    assert!(
        matches!(missing.kind(), ConfigErrorKind::MissingField("max")),
        "{missing}"
    );
    assert_eq!(
        (missing.location().line, missing.limit()),
        (Some(5), Some("A"))
    );
    let below = err(&format!(
        "{base} {{after: 1, within: 1s, base: 1m, factor: 2, max: 1s}}\n"
    ));
    assert!(
        matches!(below.kind(), ConfigErrorKind::Ladder(_)),
        "{below}"
    );
    assert_eq!(below.location().line, Some(5));
    let factor = err(&format!(
        "{base}\n    after: 1\n    within: 1s\n    base: 1s\n    factor: 1001\n    max: 1m\n"
    ));
    assert!(
        matches!(factor.kind(), ConfigErrorKind::Ladder(_)),
        "{factor}"
    );
    for bad in ["150%", "abc", "2.55%", "-1%"] {
        let e = err(&format!(
            "{base} {{after: 1, within: 1s, base: 1s, factor: 2, max: 1s, jitter: \"{bad}\"}}\n"
        ));
        assert!(
            matches!(
                e.kind(),
                ConfigErrorKind::Jitter(_) | ConfigErrorKind::Ladder(_)
            ),
            "{bad}: {e}"
        );
    }
    let unknown = err(&format!(
        "{base} {{after: 1, within: 1s, base: 1s, factor: 2, max: 1s, ban: 1s}}\n"
    ));
    assert!(
        matches!(unknown.kind(), ConfigErrorKind::UnknownField { .. }),
        "{unknown}"
    );
    let zero = err(&format!(
        "{base} {{after: 0, within: 1s, base: 1s, factor: 2, max: 1s}}\n"
    ));
    assert!(
        matches!(
            zero.kind(),
            ConfigErrorKind::BadNumber { field: "after", .. }
        ),
        "{zero}"
    );
    let marked = err(
        "A:\n  burst: 1\n  count: 1\n  period: 1s\n  across_regions: true\n  penalty: {after: 1, within: 1s, base: 1s, factor: 2, max: 1s}\n",
    );
    assert!(
        matches!(marked.kind(), ConfigErrorKind::Penalty(_)),
        "{marked}"
    );
    assert_eq!(marked.location().line, Some(6));
    let slots = err(
        "A:\n  concurrency: 3\n  penalty: {after: 1, within: 1s, base: 1s, factor: 2, max: 1s}\n",
    );
    assert!(
        matches!(slots.kind(), ConfigErrorKind::Penalty(_)),
        "{slots}"
    );
    let not_a_map = err(&format!("{base} 5\n"));
    assert!(
        matches!(not_a_map.kind(), ConfigErrorKind::WrongShape { .. }),
        "{not_a_map}"
    );
}

#[tokio::test]
async fn a_banned_account_is_told_so_and_when_the_ban_ends_in_every_answer() {
    let clock = ManualClock::new(1_000 * S);
    for body in [
        tower_ratelimits::ErrorBody::Json,
        tower_ratelimits::ErrorBody::ProblemJson,
    ] {
        let app = Router::new().route("/login", get(|| async { StatusCode::UNAUTHORIZED }));
        let rule = Rule::new("Login", Header::new("x-account"))
            .count_when(CountWhen::new().status(401, 1));
        let layer = RateLimitLayer::builder(limiter(&clock))
            .rule(rule)
            .error_body(body)
            .build()
            .unwrap();
        let server = support::http::serve(app.layer(layer)).await;
        let client = support::http::HttpClient::new(&server);
        for _ in 0..3 {
            let r = client.get("/login", &[("x-account", "ann")]).await;
            assert_eq!(r.status, 401);
        }
        let banned = client.get("/login", &[("x-account", "ann")]).await;
        assert_eq!(banned.status, 429);
        assert_eq!(banned.header("retry-after"), Some("10"));
        let fields = banned.header("ratelimit").unwrap();
        assert!(
            fields.contains("r=0") && fields.contains("t=10"),
            "{fields}"
        );
        let json: serde_json::Value = serde_json::from_str(&banned.body).unwrap();
        match body {
            tower_ratelimits::ErrorBody::Json => {
                let detail = &json["errors"][0]["detail"];
                assert_eq!(detail["banned"], true, "{json}");
                assert_eq!(detail["retry_after_ms"], 10_000);
            }
            _ => {
                let kind = json["type"].as_str().unwrap();
                assert!(kind.ends_with("/specs/penalties/"), "{json}");
                let detail = json["detail"].as_str().unwrap();
                assert!(detail.contains("banned by its penalty"), "{detail}");
            }
        }
        clock.advance(Duration::from_secs(10));
    }
}

#[tokio::test]
async fn two_instances_on_one_store_share_a_key_s_ladder() {
    let clock = ManualClock::new(1_000 * S);
    for redis in TestRedis::each() {
        let prefix = unique_prefix("penalty-instances");
        let one = Limiter::new(
            limits(),
            caller_time_backend(&redis.url, &prefix, &clock, false).await,
        );
        let two = Limiter::new(
            limits(),
            caller_time_backend(&redis.url, &prefix, &clock, true).await,
        );
        // Failures by turns on the two instances: the third, wherever it lands, bans.
        assert!(login(&one, 7).await.allowed());
        assert!(login(&two, 7).await.allowed());
        let banning = login(&one, 7).await;
        assert_eq!(
            banning.decisions()[0].reset_after(),
            Duration::from_secs(10)
        );
        for instance in [&one, &two] {
            let refused = login(instance, 7).await;
            assert!(!refused.allowed());
            assert_eq!(
                refused.decisions()[0].retry_after(),
                Duration::from_secs(10)
            );
        }
        // The second ban, made on the other instance, is the second rung for both.
        clock.advance(Duration::from_secs(10));
        for instance in [&two, &one, &two] {
            assert!(login(instance, 7).await.allowed());
        }
        let refused = login(&one, 7).await;
        assert_eq!(
            refused.decisions()[0].retry_after(),
            Duration::from_secs(20)
        );
        clock.advance(Duration::from_secs(20));
    }
}

#[tokio::test]
async fn the_admin_api_shows_a_ban_and_a_reset_lifts_it_and_forgets_the_level() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let admin = support::http::serve(tower_ratelimits::admin_router(limiter.clone())).await;
        let admin = support::http::HttpClient::new(&admin);
        until_banned(&limiter, 7).await;
        clock.advance(Duration::from_secs(10));
        until_banned(&limiter, 7).await; // the second ban: 20 s
        clock.advance(Duration::from_secs(5));
        let shown = admin.get("/buckets/Login/7", &[]).await;
        let v: serde_json::Value = serde_json::from_str(&shown.body).unwrap();
        assert_eq!(
            (v["banned"].clone(), v["ban_ends_in_ms"].clone()),
            (true.into(), 15_000.into()),
            "{v}"
        );
        assert_eq!(v["remaining"], 0);
        let lifted = admin
            .request(http::Method::DELETE, "/buckets/Login/7", &[])
            .await;
        assert_eq!(lifted.status, 204);
        assert!(login(&limiter, 7).await.allowed(), "the ban is lifted");
        let v: serde_json::Value =
            serde_json::from_str(&admin.get("/buckets/Login/7", &[]).await.body).unwrap();
        assert_eq!(v["banned"], serde_json::Value::Null, "{v}");
        // The level is forgotten: the next ban is the first's length again.
        assert!(login(&limiter, 7).await.allowed());
        let banning = login(&limiter, 7).await;
        assert_eq!(
            banning.decisions()[0].reset_after(),
            Duration::from_secs(10)
        );
    }
}

/// Hostile weights: a failure that weighs 2^40 counts as `after` (the ladder's most), so one
/// such failure bans at once on every store; a weight of 0 counts nothing however often.
#[tokio::test]
async fn a_huge_weight_counts_as_after_and_a_zero_weight_as_nothing() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let key = key(&limiter, "Login", 7);
        for _ in 0..50 {
            let d = limiter
                .spend(&[Transaction::new(key.clone()).cost(0)])
                .await
                .unwrap();
            assert!(d.allowed(), "a weight of 0 counts nothing");
        }
        let huge = limiter
            .spend(&[Transaction::new(key.clone())
                .cost(1 << 40)
                .mode(tower_ratelimits::Mode::Charge)])
            .await
            .unwrap();
        assert!(huge.allowed(), "the event that bans is let through");
        assert_eq!(huge.decisions()[0].reset_after(), Duration::from_secs(10));
        let refused = login(&limiter, 7).await;
        assert!(!refused.allowed());
        assert_eq!(
            refused.decisions()[0].retry_after(),
            Duration::from_secs(10)
        );
        clock.advance(Duration::from_secs(10));
    }
}

/// The admin API's ban list, a page at a time over TCP, on every store: 25 banned accounts
/// (one banned twice) are each listed once with their levels and bans, an account with
/// counted failures but no ban is not, a ban that ended leaves its level listed until the
/// level decays, and a limit without a ladder, a cursor the store never gave and a count
/// that is not a number are refused.
#[tokio::test]
async fn the_admin_api_lists_the_banned_keys_a_page_at_a_time() {
    let clock = ManualClock::new(1_000 * S);
    for (store, limiter, _redis) in stores(&clock).await {
        eprintln!("on {store}");
        let admin = support::http::serve(tower_ratelimits::admin_router(limiter.clone())).await;
        let admin = support::http::HttpClient::new(&admin);
        for id in 1..=25 {
            until_banned(&limiter, id).await;
        }
        clock.advance(Duration::from_secs(10));
        until_banned(&limiter, 1).await; // its second ban: 20 s
        assert!(login(&limiter, 100).await.allowed(), "one failure: no ban");
        clock.advance(Duration::from_secs(5));
        let list = |cursor: Option<String>| {
            let admin = &admin;
            async move {
                let path = match cursor {
                    Some(c) => format!("/bans/Login?count=10&cursor={c}"),
                    None => "/bans/Login?count=10".to_owned(),
                };
                let reply = admin.get(&path, &[]).await;
                assert_eq!(reply.status, 200, "{}", reply.body);
                serde_json::from_str::<serde_json::Value>(&reply.body).unwrap()
            }
        };
        let walk = || async {
            let (mut seen, mut cursor, mut pages) = (Vec::new(), None, 0);
            loop {
                let page = list(cursor).await;
                pages += 1;
                assert!(pages < 1_000, "the walk ends");
                seen.extend(page["bans"].as_array().unwrap().iter().cloned());
                match page["next"].as_str() {
                    Some(next) => cursor = Some(next.to_owned()),
                    None => break,
                }
            }
            seen.sort_by_key(|b| b["id"].as_str().unwrap().parse::<u64>().unwrap());
            seen
        };
        let seen = walk().await;
        let ids: Vec<u64> = seen
            .iter()
            .map(|b| b["id"].as_str().unwrap().parse().unwrap())
            .collect();
        assert_eq!(ids, (1..=25).collect::<Vec<_>>(), "each banned key once");
        assert_eq!(
            seen[0],
            serde_json::json!({"id": "1", "level": 2, "banned": true, "ban_ends_in_ms": 15_000})
        );
        // The first bans (10 s) ended 5 s ago: their levels stay until they decay.
        assert_eq!(seen[1], serde_json::json!({"id": "2", "level": 1}));
        // 105 s after the first bans ended their keys are fresh; key 1's second ended 85 s ago.
        clock.advance(Duration::from_secs(100));
        let seen = walk().await;
        assert_eq!(seen, vec![serde_json::json!({"id": "1", "level": 2})]);
        clock.advance(Duration::from_secs(15));
        let seen = walk().await;
        assert_eq!(
            seen,
            vec![serde_json::json!({"id": "1", "level": 1})],
            "a level falls a step each quiet forget_after (100 s)"
        );
        // An empty cursor is the first page's; a count of 0 looks at one key.
        for path in ["/bans/Login?cursor=", "/bans/Login?count=0"] {
            let reply = admin.get(path, &[]).await;
            assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        }
        for (path, why) in [
            ("/bans/Tight", "has no penalty ladder"),
            ("/bans/Nope", "unknown limit"),
            ("/bans/Login?cursor=x.y", "not a cursor"),
            ("/bans/Login?count=ten", "count"),
            ("/bans/Login?count=1&count=2", "twice"),
            // A bad escape stays as it is, as a form decodes it; bytes not UTF-8 are refused.
            ("/bans/Login?cursor=%ZZ", "not a cursor"),
            ("/bans/Login?cursor=%FF", "percent-encoded"),
            ("/bans/Login?limit=3", "unknown query field"),
        ] {
            let reply = admin.get(path, &[]).await;
            assert_eq!(reply.status, 400, "{path}: {}", reply.body);
            assert!(reply.body.contains(why), "{path}: {}", reply.body);
        }
    }
}
