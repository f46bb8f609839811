//! Outcome rules (`Rule::count_when`): a request counts only when its response says so, by
//! the weight of the case it matches, over real HTTP on memory and on a real Redis. Time is a
//! manual clock that never moves, so every number is exact.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use support::http::{HttpClient, serve};
use support::store::{Fixture, Store};
use tower_ratelimits::{
    CountWhen, Header, Id, LayerError, Limiter, Limits, RateLimitLayer, Rule, SettleError,
    Transaction,
};

/// Three counted units an hour per account, and the same for a rule whose cases weigh up to 3.
const LIMITS: &str = "\
FailedLogins: {burst: 3, count: 3, period: 1h}
FailedSecondFactors: {burst: 6, count: 6, period: 1h}
InFlight: {concurrency: 2}
";

/// A login: `x-password: right` is 200, `mfa` a 401 naming the second factor, anything else
/// a plain 401. Counts the requests that reached it.
fn login(reached: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/login",
        get(move |headers: HeaderMap| {
            let reached = reached.clone();
            async move {
                reached.fetch_add(1, Ordering::SeqCst);
                match headers.get("x-password").map(|v| v.as_bytes()) {
                    Some(b"right") => (StatusCode::OK, [("x-login-failure", "")]),
                    Some(b"mfa") => (StatusCode::UNAUTHORIZED, [("x-login-failure", "mfa")]),
                    _ => (StatusCode::UNAUTHORIZED, [("x-login-failure", "password")]),
                }
            }
        }),
    )
}

fn failed_logins() -> Rule {
    Rule::new("FailedLogins", Header::new("x-account")).count_when(CountWhen::new().status(401, 1))
}

async fn limiter(fixture: &Fixture, store: Store) -> Limiter {
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    fixture.limiter(store, limits, "outcomes", false).await
}

/// The login app served behind one layer with `rule`, over `LIMITS` on a store.
struct Login {
    _fixture: Fixture,
    limiter: Limiter,
    _server: support::http::Server,
    client: HttpClient,
    /// The requests that reached the service.
    reached: Arc<AtomicUsize>,
}

impl Login {
    async fn serve(store: Store, rule: Rule) -> Self {
        let fixture = Fixture::new(store);
        let limiter = limiter(&fixture, store).await;
        let reached = Arc::new(AtomicUsize::new(0));
        let layer = RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
        let server = serve(login(reached.clone()).layer(layer)).await;
        let client = HttpClient::new(&server);
        Login {
            _fixture: fixture,
            limiter,
            _server: server,
            client,
            reached,
        }
    }
}

/// What the bucket of `name` for `account` holds now, asked of the store directly.
async fn remaining(limiter: &Limiter, name: &str, account: &str) -> u64 {
    let key = limiter.key(name, Id::new(account).unwrap()).unwrap();
    let probe = Transaction::new(key).cost(0);
    limiter.check(&[probe]).await.unwrap().decisions()[0].remaining()
}

/// Successful logins count nothing; failed ones count one each, and the request after the
/// third is refused before it reaches the service, whatever its password (the key has no
/// room for another failure); another account is untouched.
async fn only_the_outcomes_named_count(store: Store) {
    let login = Login::serve(store, failed_logins()).await;
    let (limiter, client, reached) = (&login.limiter, &login.client, &login.reached);
    let attempt = |password: &'static str| async move {
        client
            .get("/login", &[("x-account", "ada"), ("x-password", password)])
            .await
            .status
    };
    for _ in 0..10 {
        assert_eq!(attempt("right").await, 200);
    }
    assert_eq!(remaining(limiter, "FailedLogins", "ada").await, 3);
    for left in [2, 1, 0] {
        assert_eq!(attempt("wrong").await, 401);
        assert_eq!(
            remaining(limiter, "FailedLogins", "ada").await,
            left,
            "{store:?}"
        );
    }
    let before = reached.load(Ordering::SeqCst);
    assert_eq!(attempt("wrong").await, 429);
    assert_eq!(attempt("right").await, 429);
    assert_eq!(
        reached.load(Ordering::SeqCst),
        before,
        "refused before the service"
    );
    let other = client
        .get("/login", &[("x-account", "bob"), ("x-password", "right")])
        .await;
    assert_eq!(other.status, 200);
}

on_every_store!(only_the_outcomes_named_count => in_memory_only_the_outcomes_named_count, on_redis_only_the_outcomes_named_count);

/// A hundred failed logins of one account at once: each reserves its weight when it is
/// decided, so exactly three reach the service and the 97 others are refused (charged after
/// their responses, all hundred would have passed).
async fn parallel_attempts_cannot_all_pass(store: Store) {
    let login = Login::serve(store, failed_logins()).await;
    let (limiter, client, reached) = (&login.limiter, &login.client, &login.reached);
    let statuses = futures_util::future::join_all(
        (0..100).map(|_| client.get("/login", &[("x-account", "eve"), ("x-password", "guess")])),
    )
    .await;
    let count = |s: u16| statuses.iter().filter(|r| r.status == s).count();
    assert_eq!((count(401), count(429)), (3, 97), "{store:?}");
    assert_eq!(reached.load(Ordering::SeqCst), 3);
    assert_eq!(remaining(limiter, "FailedLogins", "eve").await, 0);
}

on_every_store!(parallel_attempts_cannot_all_pass => in_memory_parallel_attempts_cannot_all_pass, on_redis_parallel_attempts_cannot_all_pass);

/// The first case that matches gives the weight: a failed second factor counts 3, a failed
/// password 1, a success nothing. A request reserves the largest weight (3), so a key needs
/// room for 3 to be let in: after one failed factor and two failed passwords (5 of 6), the
/// next request is refused though it might have counted 1.
async fn weights_count_by_the_first_case_that_matches(store: Store) {
    let rule = Rule::new("FailedSecondFactors", Header::new("x-account")).count_when(
        CountWhen::new()
            .header_equals("x-login-failure", "mfa", 3)
            .status(401, 1),
    );
    let login = Login::serve(store, rule).await;
    let (limiter, client) = (&login.limiter, &login.client);
    for (password, status, left) in [
        ("right", 200, 6),
        ("mfa", 401, 3),
        ("wrong", 401, 2),
        ("right", 429, 2),
    ] {
        let reply = client
            .get("/login", &[("x-account", "kim"), ("x-password", password)])
            .await;
        assert_eq!(reply.status, status, "{store:?} {password}");
        assert_eq!(
            remaining(limiter, "FailedSecondFactors", "kim").await,
            left,
            "{store:?} {password}"
        );
    }
}

on_every_store!(weights_count_by_the_first_case_that_matches => in_memory_weights_count_by_the_first_case_that_matches, on_redis_weights_count_by_the_first_case_that_matches);

/// A client that hangs up before its response does not escape counting: the request's
/// reservation stands once the service's future is dropped.
#[tokio::test]
async fn a_client_that_hangs_up_is_counted() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = limiter(&fixture, Store::Memory).await;
    let (reached_tx, mut reached_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (dropped_tx, dropped_rx) = tokio::sync::oneshot::channel::<()>();
    let dropped_tx = Arc::new(std::sync::Mutex::new(Some(dropped_tx)));
    /// Tells when the handler's future is dropped.
    struct OnDrop(Arc<std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            if let Some(tx) = self.0.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
    }
    let app = Router::new().route(
        "/login",
        get(move || {
            let guard = OnDrop(dropped_tx.clone());
            let reached = reached_tx.clone();
            async move {
                let _guard = guard;
                let _ = reached.send(());
                std::future::pending::<StatusCode>().await
            }
        }),
    );
    let layer = RateLimitLayer::new(limiter.clone(), [failed_logins()]).unwrap();
    let server = serve(app.layer(layer)).await;
    let client = HttpClient::new(&server);
    let request = client.get("/login", &[("x-account", "mal")]);
    tokio::select! {
        _ = request => panic!("the handler never answers"),
        _ = reached_rx.recv() => {}
    }
    // The request future is gone: its connection closes, and the server drops the handler
    // (within a minute of the test's clock, or the server kept a request nobody waits for).
    tokio::time::timeout(std::time::Duration::from_secs(60), dropped_rx)
        .await
        .expect("the server never dropped the handler of a request whose client hung up")
        .unwrap();
    assert_eq!(remaining(&limiter, "FailedLogins", "mal").await, 2);
}

/// A limit of slots in flight gives its slot back when the request ends: an outcome rule (or
/// any settle) on it would never count, so the layer refuses it.
#[tokio::test]
async fn an_outcome_rule_on_slots_in_flight_refuses_the_layer() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = limiter(&fixture, Store::Memory).await;
    let rules = [
        Rule::new("InFlight", Header::new("x-account")).count_when(CountWhen::new().status(401, 1)),
        Rule::new("InFlight", Header::new("x-account"))
            .settle(tower_ratelimits::Settle::header("x-used")),
    ];
    for rule in rules {
        match RateLimitLayer::new(limiter.clone(), [rule]) {
            Err(LayerError::Settle { limit, reason }) => {
                assert_eq!((limit.as_str(), reason), ("InFlight", SettleError::Leases));
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Cases that cannot be used are refused when the layer is built, naming the rule.
#[tokio::test]
async fn bad_cases_refuse_the_layer() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = limiter(&fixture, Store::Memory).await;
    for (cases, reason) in [
        (CountWhen::new(), SettleError::NothingCounts),
        (CountWhen::new().status(401, 0), SettleError::NothingCounts),
        (
            CountWhen::new().status(401, (1 << 40) + 1),
            SettleError::Weight((1 << 40) + 1),
        ),
        (
            CountWhen::new().header("no spaces", 1),
            SettleError::NotAHeaderName("no spaces".into()),
        ),
    ] {
        let rule = Rule::new("FailedLogins", Header::new("x-account")).count_when(cases);
        match RateLimitLayer::new(limiter.clone(), [rule]) {
            Err(LayerError::Settle { limit, reason: got }) => {
                assert_eq!((limit.as_str(), got), ("FailedLogins", reason));
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A rules file's `count_when` builds the same rule as `Rule::count_when`: a wrong second
/// factor counts 3, a wrong password 1, a success nothing.
#[tokio::test]
async fn a_rules_file_counts_outcomes_as_the_builder_does() {
    let fixture = Fixture::new(Store::Memory);
    let limiter = limiter(&fixture, Store::Memory).await;
    let rules = tower_ratelimits::RuleSet::from_yaml_str(
        "- limit: FailedSecondFactors\n  key: header:x-account\n  count_when:\n    \
         - {header: x-login-failure, equals: mfa, weight: 3}\n    - {status: 401}\n",
    )
    .unwrap();
    let server = serve(login(Arc::default()).layer(rules.layer(limiter.clone()).unwrap())).await;
    let client = HttpClient::new(&server);
    for (password, status, left) in [("right", 200, 6), ("mfa", 401, 3), ("wrong", 401, 2)] {
        let reply = client
            .get("/login", &[("x-account", "kim"), ("x-password", password)])
            .await;
        assert_eq!(reply.status, status, "{password}");
        assert_eq!(
            remaining(&limiter, "FailedSecondFactors", "kim").await,
            left,
            "{password}"
        );
    }
}
