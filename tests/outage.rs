//! An outage cannot hand out a fresh quota: what the in-memory fallback grants a calendar
//! quota or a GCRA limit of an hour or longer is charged to the store once it answers again,
//! and the fallback starts from the policy's share of what the store last said was left
//! (`docs/operating.md`, "When the store fails"). Redis is killed and restarted with its data
//! (an append-only file written before every answer), over TCP through a real axum server.

mod support;

use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use support::http::{HttpClient, Reply, serve};
use support::redis::{RedisServer, unique_prefix};
use tower_ratelimits::{
    ClientIp, FailurePolicy, Id, Limiter, Limits, ManualClock, RateLimitLayer, RedisBackend, Rule,
};

const TIMEOUT: Duration = Duration::from_secs(2);
const HALF: FailurePolicy = FailurePolicy::FallbackToMemory { percent: 50 };

/// A Redis backend of `server` under `prefix`, on `clock` when given (the caller's time).
async fn backend(server: &RedisServer, prefix: &str, clock: Option<&ManualClock>) -> RedisBackend {
    let mut builder = RedisBackend::from_url(server.url())
        .prefix(prefix)
        .command_timeout(TIMEOUT);
    if let Some(clock) = clock {
        builder = builder.caller_time(clock.clone());
    }
    builder.connect().await.unwrap()
}

/// An app whose one rule is limit `name` of `yaml` per client IP, on `backend`, falling back
/// to memory at 50% while the store fails.
fn app(yaml: &str, name: &str, backend: RedisBackend) -> Router {
    let limiter = Limiter::new(Limits::from_yaml_str(yaml, None).unwrap(), backend);
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new(name, ClientIp::new()))
        .on_backend_failure(HALF)
        .backend_timeout(TIMEOUT)
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// Counts the requests an app allowed, checking each answer's policy (`q`: the store's limit,
/// or the fallback's half of it).
struct Tally {
    client: HttpClient,
    allowed: usize,
}

impl Tally {
    fn new(server: &support::http::Server) -> Self {
        Tally {
            client: HttpClient::new(server),
            allowed: 0,
        }
    }

    /// One request: whether it was allowed, and the policy's `q` it was answered under.
    async fn get(&mut self) -> (bool, u64) {
        let r = self.client.get("/", &[]).await;
        assert!(
            r.status == 200 || r.status == 429,
            "{} {}",
            r.status,
            r.body
        );
        if r.status == 200 {
            self.allowed += 1;
        }
        (r.status == 200, q(&r))
    }

    /// Requests until the store answers one with a refusal (its policy's `q` is `store_q`),
    /// each answer of the fallback meanwhile a refusal too.
    async fn until_the_store_refuses(&mut self, store_q: u64) {
        self.until_the_store_refuses_on(store_q, None).await;
    }

    /// [`until_the_store_refuses`](Self::until_the_store_refuses) where the instance decides
    /// by `clock` (the caller's time): moved a second between tries, since the circuit
    /// breaker's cool-off runs on it too.
    async fn until_the_store_refuses_on(&mut self, store_q: u64, clock: Option<&ManualClock>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (allowed, q) = self.get().await;
            if q == store_q && !allowed {
                return;
            }
            assert!(
                q == store_q || !allowed,
                "the fallback granted more than its share"
            );
            assert!(Instant::now() < deadline, "the store did not answer again");
            if q != store_q {
                if let Some(clock) = clock {
                    clock.advance(Duration::from_secs(1));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// `allowed` requests in all, or one fewer: a charge whose answer came after the timeout
    /// may reach the store and be sent again (a unit lost, never one granted twice).
    fn allowed(&self, count: usize, why: &str) {
        assert!(
            self.allowed == count || self.allowed + 1 == count,
            "{} allowed: {why}",
            self.allowed
        );
    }
}

fn q(r: &Reply) -> u64 {
    let policy = r.header("ratelimit-policy").unwrap_or_default();
    policy
        .split(';')
        .find_map(|p| p.strip_prefix("q="))
        .and_then(|q| q.parse().ok())
        .unwrap_or_else(|| panic!("no q in {policy:?}"))
}

const MONTHLY: &str = "Monthly: {kind: ip, calendar: {count: 5, period: month}}\n";

/// 5 a month, 3 spent before Redis dies. The fallback starts from half of
/// the 2 left (1), and once Redis is back that 1 is charged before Redis decides the next
/// request: 5 in all. Before, the fallback granted a fresh half (2) and Redis another 2: 7.
#[tokio::test]
async fn an_outage_does_not_hand_out_a_fresh_monthly_quota() {
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-month");
    let served = serve(app(
        MONTHLY,
        "Monthly",
        backend(&server, &prefix, None).await,
    ))
    .await;
    let mut tally = Tally::new(&served);
    for _ in 0..3 {
        assert_eq!(tally.get().await, (true, 5));
    }
    server.kill();
    assert_eq!(tally.get().await, (true, 2), "half of the 2 left");
    assert_eq!(tally.get().await, (false, 2));
    server.restart();
    tally.until_the_store_refuses(5).await;
    tally.allowed(5, "5 a month, outage or not");
}

/// The same for a GCRA limit of an hour or longer: 4 at once, 1 more an hour. 2 spent, the
/// fallback grants half of the 2 left, charged back less what time repaid (nothing, in
/// seconds): 4 in all, where 6 were granted before.
#[tokio::test]
async fn an_outage_does_not_refill_a_limit_of_one_an_hour() {
    let yaml = "Hourly: {kind: ip, burst: 4, count: 1, period: 1h}\n";
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-hour");
    let served = serve(app(yaml, "Hourly", backend(&server, &prefix, None).await)).await;
    let mut tally = Tally::new(&served);
    for _ in 0..2 {
        assert_eq!(tally.get().await, (true, 4));
    }
    server.kill();
    assert_eq!(tally.get().await, (true, 2));
    assert_eq!(tally.get().await, (false, 2));
    server.restart();
    tally.until_the_store_refuses(4).await;
    tally.allowed(4, "4 at once, outage or not");
}

/// A renewal during the outage: what the fallback granted in November is dropped with
/// November; what it granted in December is charged to December. (The instance's clock is
/// the caller's time, moved by the test; Redis decides by it.)
#[tokio::test]
async fn what_the_fallback_granted_is_charged_to_its_own_period() {
    // 2026-11-30T12:00:00Z.
    let clock = ManualClock::new(1_796_040_000_000_000);
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-renewal");
    let store = backend(&server, &prefix, Some(&clock)).await;
    let served = serve(app(MONTHLY, "Monthly", store)).await;
    let mut tally = Tally::new(&served);
    for _ in 0..3 {
        assert_eq!(tally.get().await, (true, 5));
    }
    server.kill();
    assert_eq!(tally.get().await, (true, 2), "November: half of the 2 left");
    assert_eq!(tally.get().await, (false, 2));
    // 2026-12-01T00:00:01Z: the fallback's December starts from its half of a fresh count.
    clock.set(1_796_083_201_000_000);
    assert_eq!(tally.get().await, (true, 2));
    assert_eq!(tally.get().await, (true, 2));
    assert_eq!(tally.get().await, (false, 2));
    assert_eq!(tally.allowed, 6);
    server.restart();
    // December's 2 are charged, November's 1 is not: 3 more in December.
    tally.until_the_store_refuses_on(5, Some(&clock)).await;
    tally.allowed(9, "November 3 + 1, December 2 + 3");
}

/// What an instance's fallback granted reaches the store within a second of its return, with
/// no request of that key on that instance: another instance decides with it.
#[tokio::test]
async fn another_instance_sees_the_charge_once_the_store_is_back() {
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-fleet");
    let a = serve(app(
        MONTHLY,
        "Monthly",
        backend(&server, &prefix, None).await,
    ))
    .await;
    let b = serve(app(
        MONTHLY,
        "Monthly",
        backend(&server, &prefix, None).await,
    ))
    .await;
    let mut on_a = Tally::new(&a);
    let mut on_b = Tally::new(&b);
    for _ in 0..3 {
        assert_eq!(on_a.get().await, (true, 5));
    }
    server.kill();
    assert_eq!(on_a.get().await, (true, 2));
    server.restart();
    // The store's count, as a third party reads it, until it holds instance A's charge.
    let reader = Limiter::new(
        Limits::from_yaml_str(MONTHLY, None).unwrap(),
        backend(&server, &prefix, None).await,
    );
    let key = reader
        .key("Monthly", Id::new("127.0.0.1").unwrap())
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while reader
        .inspect(&key)
        .await
        .ok()
        .is_none_or(|i| i.remaining > 1)
    {
        assert!(
            Instant::now() < deadline,
            "instance A never charged the store"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    on_b.until_the_store_refuses(5).await;
    on_b.allowed += on_a.allowed;
    on_b.allowed(5, "5 a month on the two instances");
}

/// Per client IP: 100 a minute, and a ban after 3 requests within 10 minutes, an hour long
/// the first time.
const LOGIN: &str = "Login: {kind: ip, burst: 100, count: 100, period: 1m, penalty: {after: 3, within: 10m, base: 1h, factor: 2, max: 1d}}\n";

/// The seconds a refusal tells its client to wait, and the policy's `q` it was answered under
/// (100: the store's; 50: the fallback's half).
fn refused(r: &Reply) -> (u64, u64) {
    assert_eq!(r.status, 429, "{}", r.body);
    let retry = r.header("retry-after").and_then(|s| s.parse().ok());
    (
        retry.unwrap_or_else(|| panic!("no Retry-After: {}", r.body)),
        q(r),
    )
}

/// A ban the store answered is not forgotten when it fails: the fallback starts the key banned
/// until the same end (before, it started the key fresh and let it through).
#[tokio::test]
async fn a_ban_the_store_answered_holds_in_the_fallback() {
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-ban");
    let served = serve(app(LOGIN, "Login", backend(&server, &prefix, None).await)).await;
    let client = HttpClient::new(&served);
    for _ in 0..3 {
        assert_eq!(client.get("/", &[]).await.status, 200);
    }
    let (retry, q_store) = refused(&client.get("/", &[]).await);
    assert!(
        retry > 3_500 && q_store == 100,
        "banned for the hour by the store"
    );
    server.kill();
    let (retry, q_fallback) = refused(&client.get("/", &[]).await);
    assert_eq!(q_fallback, 50, "the fallback answered");
    assert!(retry > 3_500, "still banned to the ban's end: {retry} s");
    server.restart();
}

/// A ban the fallback decided reaches the store: what it counted is charged once the store is
/// back, and the store bans the key for every instance (before, the store had counted 1 and
/// let the key through).
#[tokio::test]
async fn a_ban_the_fallback_decided_reaches_the_store() {
    let mut server = RedisServer::start_durable();
    let prefix = unique_prefix("outage-fallback-ban");
    let served = serve(app(LOGIN, "Login", backend(&server, &prefix, None).await)).await;
    let client = HttpClient::new(&served);
    assert_eq!(client.get("/", &[]).await.status, 200);
    server.kill();
    for _ in 0..3 {
        assert_eq!(
            client.get("/", &[]).await.status,
            200,
            "the fallback counts"
        );
    }
    let (retry, q_fallback) = refused(&client.get("/", &[]).await);
    assert!(retry > 3_500 && q_fallback == 50, "banned by the fallback");
    server.restart();
    // Another instance's view of the store, until it holds the ban.
    let reader = Limiter::new(
        Limits::from_yaml_str(LOGIN, None).unwrap(),
        backend(&server, &prefix, None).await,
    );
    let key = reader.key("Login", Id::new("127.0.0.1").unwrap()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while reader
        .inspect(&key)
        .await
        .ok()
        .is_none_or(|i| i.banned_for.is_none())
    {
        assert!(
            Instant::now() < deadline,
            "the store never learned of the ban"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (retry, q_store) = refused(&client.get("/", &[]).await);
    assert!(retry > 3_500 && q_store == 100, "banned by the store");
}
