//! One layer for a whole app (rules scoped by method, path and route), stacked layers that
//! never contradict a status, and exemptions: a real axum server over TCP.

#[path = "support/counting.rs"]
mod counting;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::{Router, routing::get};
use counting::Counting;
use http::Method;
use support::http::{HttpClient, Reply, serve};
use tower_ratelimits::{
    ClientIp, Header, Limiter, Limits, ManualClock, MemoryBackend, OnMissingKey, RateLimitLayer,
    Rule,
};

const LIMITS: &str = "\
PerIp: {kind: ip, burst: 10, count: 10, period: 10s}
Reads: {kind: ip, burst: 5, count: 5, period: 10s}
Writes: {kind: ip, burst: 1, count: 1, period: 10s}
UserPage: {kind: ip, burst: 2, count: 2, period: 10s}
PerAccount: {kind: account, burst: 1, count: 1, period: 10s}
";

fn limiter(calls: &Arc<AtomicUsize>, clock: &ManualClock) -> Limiter {
    Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        Counting {
            calls: calls.clone(),
            inner: MemoryBackend::builder().clock(clock.clone()).build(),
        },
    )
}

/// The names in a `RateLimit` field, in order.
fn members(r: &Reply) -> Vec<String> {
    r.header("ratelimit")
        .unwrap_or("")
        .split(", ")
        .filter(|m| !m.is_empty())
        .map(|m| m.split(';').next().unwrap().trim_matches('"').to_owned())
        .collect()
}

fn routes() -> Router {
    Router::new()
        .route(
            "/api/items",
            get(|| async { "list" }).post(|| async { "created" }),
        )
        .route("/users/{id}", get(|| async { "user" }))
        .route("/health", get(|| async { "ok" }))
}

#[tokio::test]
async fn scoped_rules_in_one_layer_are_one_call_per_request_with_their_own_fields() {
    let calls = Arc::new(AtomicUsize::new(0));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let layer = RateLimitLayer::new(
        limiter(&calls, &clock),
        [
            Rule::new("PerIp", ClientIp::new()),
            Rule::new("Reads", ClientIp::new())
                .for_methods([Method::GET])
                .for_path_prefix("/api"),
            Rule::new("Writes", ClientIp::new()).for_methods([Method::POST]),
            Rule::new("UserPage", ClientIp::new()).for_route("/users/{id}"),
        ],
    )
    .unwrap();
    let server = serve(routes().layer(layer)).await;
    let client = HttpClient::new(&server);
    let mut expected_calls = 0;
    let mut call = async |method: Method, path: &str| {
        let r = client.request(method, path, &[]).await;
        expected_calls += 1;
        assert_eq!(
            calls.load(Ordering::SeqCst),
            expected_calls,
            "one call per request"
        );
        r
    };

    let r = call(Method::GET, "/api/items").await;
    assert_eq!(r.status, 200);
    let mut names = members(&r);
    names.sort();
    assert_eq!(names, ["PerIp", "Reads"]);

    let r = call(Method::POST, "/api/items").await;
    assert_eq!(r.status, 200);
    let mut names = members(&r);
    names.sort();
    assert_eq!(names, ["PerIp", "Writes"]);

    let r = call(Method::GET, "/users/7").await;
    let mut names = members(&r);
    names.sort();
    assert_eq!(names, ["PerIp", "UserPage"]);

    let r = call(Method::GET, "/health").await;
    assert_eq!(members(&r), ["PerIp"]);
    // PerIp has spent 4 of 10.
    assert!(
        r.header("ratelimit").unwrap().contains(";r=6;"),
        "{:?}",
        r.header("ratelimit")
    );

    // A second write is denied by Writes alone, and spends nothing anywhere (all or nothing).
    let r = call(Method::POST, "/api/items").await;
    assert_eq!(r.status, 429);
    assert_eq!(members(&r)[0], "Writes");
    let r = call(Method::GET, "/health").await;
    assert!(
        r.header("ratelimit").unwrap().contains(";r=5;"),
        "{:?}",
        r.header("ratelimit")
    );
    // `/api` does not cover `/apix` (no such route: 404, but PerIp still counts it).
    let r = call(Method::GET, "/apix").await;
    assert_eq!(members(&r), ["PerIp"]);
}

/// Two layers stacked: the inner one's 429 keeps its own fields (the outer layer adds nothing
/// to it), and an allowed response lists both layers' members.
#[tokio::test]
async fn stacked_layers_append_their_fields_and_never_touch_a_429() {
    let calls = Arc::new(AtomicUsize::new(0));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limiter = limiter(&calls, &clock);
    let inner = RateLimitLayer::new(
        limiter.clone(),
        [Rule::new("PerAccount", Header::new("x-account"))],
    )
    .unwrap();
    let outer = RateLimitLayer::new(limiter, [Rule::new("PerIp", ClientIp::new())]).unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(inner)
        .layer(outer);
    let server = serve(app).await;
    let client = HttpClient::new(&server);
    let acct = [("x-account", "3")];

    let r = client.get("/", &acct).await;
    assert_eq!(r.status, 200);
    assert_eq!(members(&r), ["PerAccount", "PerIp"]);
    let policy = r.header("ratelimit-policy").unwrap();
    assert!(
        policy.starts_with("\"PerAccount\";q=1;w=10, \"PerIp\";q=10;"),
        "{policy}"
    );

    let r = client.get("/", &acct).await;
    assert_eq!(r.status, 429);
    assert_eq!(members(&r), ["PerAccount"], "the 429's own fields only");
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"PerAccount\";q=1;w=10")
    );
    let t: u64 = r
        .header("ratelimit")
        .unwrap()
        .rsplit("t=")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(retry >= t);
    assert!(r.body.contains("PerAccount"));
}

#[tokio::test]
async fn exempt_addresses_and_exempt_rules_bypass_limits() {
    let calls = Arc::new(AtomicUsize::new(0));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let ip = ClientIp::new().trusted_proxies(["127.0.0.0/8".parse().unwrap()]);
    let layer = RateLimitLayer::builder(limiter(&calls, &clock))
        .rule(Rule::new("Writes", ip.clone()))
        .rule(
            Rule::new("PerAccount", Header::new("x-account"))
                .on_missing_key(OnMissingKey::Skip)
                .exempt_if(|req| req.headers.get("x-internal").is_some_and(|v| v == "yes")),
        )
        .exempt_addresses(ip, ["10.0.0.0/8".parse().unwrap()])
        .build()
        .unwrap();
    let server = serve(routes().layer(layer)).await;
    let client = HttpClient::new(&server);

    // An exempt address: never limited, no fields, no backend call.
    for _ in 0..5 {
        let r = client
            .get("/health", &[("x-forwarded-for", "10.1.2.3")])
            .await;
        assert_eq!(r.status, 200);
        assert!(r.header("ratelimit").is_none());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // Anyone else: limited (Writes: burst 1).
    let other = [("x-forwarded-for", "192.0.2.1")];
    assert_eq!(client.get("/health", &other).await.status, 200);
    assert_eq!(client.get("/health", &other).await.status, 429);

    // The per-rule exemption: PerAccount (burst 1) does not apply to internal calls.
    let internal = [
        ("x-forwarded-for", "192.0.2.2"),
        ("x-account", "9"),
        ("x-internal", "yes"),
    ];
    let r = client.get("/health", &internal).await;
    assert_eq!(members(&r), ["Writes"]);
    let external = [("x-forwarded-for", "192.0.2.3"), ("x-account", "9")];
    assert_eq!(client.get("/health", &external).await.status, 200);
    let external = [("x-forwarded-for", "192.0.2.4"), ("x-account", "9")];
    let r = client.get("/health", &external).await;
    assert_eq!(r.status, 429, "the account's bucket is spent");
    assert_eq!(members(&r)[0], "PerAccount");
}

/// An id an override makes unlimited is never limited and gets no member in the fields; other
/// ids keep the default.
#[tokio::test]
async fn an_unlimited_override_is_never_limited() {
    let limits = Limits::from_yaml_str(
        "PerAccount: {kind: account, burst: 1, count: 1, period: 10s}\n",
        Some("- PerAccount: {unlimited: true, ids: ['42']}\n"),
    )
    .unwrap();
    let layer = RateLimitLayer::new(
        Limiter::new(limits, MemoryBackend::new()),
        [Rule::new("PerAccount", Header::new("x-account"))],
    )
    .unwrap();
    let server = serve(routes().layer(layer)).await;
    let client = HttpClient::new(&server);
    for _ in 0..5 {
        let r = client.get("/health", &[("x-account", "42")]).await;
        assert_eq!(r.status, 200);
        assert!(r.header("ratelimit").is_none());
    }
    assert_eq!(
        client.get("/health", &[("x-account", "43")]).await.status,
        200
    );
    assert_eq!(
        client.get("/health", &[("x-account", "43")]).await.status,
        429
    );
}

/// axum answers HEAD with the GET handler, so a GET scope covers HEAD: HEAD requests are no way
/// around a rule on a GET route (20 of 20 passed a limit of 2 before).
#[tokio::test]
async fn a_get_scope_covers_head() {
    let calls = Arc::new(AtomicUsize::new(0));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let layer = RateLimitLayer::new(
        limiter(&calls, &clock),
        [Rule::new("UserPage", ClientIp::new()).for_methods([Method::GET])],
    )
    .unwrap();
    let server = serve(routes().layer(layer)).await;
    let client = HttpClient::new(&server);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(client.request(Method::HEAD, "/users/7", &[]).await.status);
    }
    assert_eq!(statuses, [200, 200, 429, 429], "UserPage allows 2");
    // GET and HEAD share the bucket; other methods stay out of the scope.
    assert_eq!(
        client.request(Method::GET, "/users/7", &[]).await.status,
        429
    );
    assert_eq!(
        client.request(Method::POST, "/api/items", &[]).await.status,
        200
    );
}

/// Exemption and proxy networks written in IPv4-mapped form match the IPv4 addresses they map
/// (addresses are folded to IPv4 before they are compared, so `::ffff:10.0.0.0/104` never
/// matched before).
#[tokio::test]
async fn ipv4_mapped_networks_match_the_addresses_they_map() {
    let calls = Arc::new(AtomicUsize::new(0));
    let clock = ManualClock::new(1_700_000_000_000_000);
    let ip = ClientIp::new().trusted_proxies(["::ffff:127.0.0.0/104".parse().unwrap()]);
    let layer = RateLimitLayer::builder(limiter(&calls, &clock))
        .rule(Rule::new("Writes", ip.clone()))
        .exempt_addresses(ip, ["::ffff:10.0.0.0/104".parse().unwrap()])
        .build()
        .unwrap();
    let server = serve(routes().layer(layer)).await;
    let client = HttpClient::new(&server);
    for _ in 0..3 {
        let r = client
            .get("/health", &[("x-forwarded-for", "10.1.2.3")])
            .await;
        assert_eq!(r.status, 200, "exempt through the mapped network");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // The proxy network in mapped form is trusted: the forwarded client is keyed, not the proxy.
    let other = [("x-forwarded-for", "192.0.2.1")];
    assert_eq!(client.get("/health", &other).await.status, 200);
    assert_eq!(client.get("/health", &other).await.status, 429);
    let third = [("x-forwarded-for", "192.0.2.2")];
    assert_eq!(
        client.get("/health", &third).await.status,
        200,
        "its own bucket"
    );
}

/// Scopes by path prefix and method, for any path and method a client can send.
mod scope_properties {
    use proptest::prelude::*;
    use tower_ratelimits::{__private, ClientIp, Rule};

    /// Whether `rule`'s scopes hold for a request of `method` to `path`.
    fn in_scope(rule: &Rule, method: &http::Method, path: &str) -> bool {
        let (parts, ()) = http::Request::builder()
            .method(method.clone())
            .uri(path)
            .body(())
            .unwrap()
            .into_parts();
        __private::in_scope(rule, &parts)
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            Just("api".to_owned()),
            Just("apix".to_owned()),
            Just("API".to_owned()),
            Just("%61pi".to_owned()),
            Just("..".to_owned()),
            "[a-z]{1,3}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A path prefix covers a path exactly when the prefix's segments (a trailing `/`
        /// ignored) begin the path's segments: never `/apix` for `/api`, never another case or
        /// encoding of a segment, never a path that only shares its characters.
        #[test]
        fn a_path_prefix_matches_whole_segments(
            prefix in proptest::collection::vec(segment(), 0..3),
            trailing in any::<bool>(),
            path in proptest::collection::vec(segment(), 0..5),
        ) {
            let prefix_text = format!("/{}{}", prefix.join("/"), if trailing { "/" } else { "" });
            let path_text = format!("/{}", path.join("/"));
            let model = {
                let trimmed = prefix_text.trim_end_matches('/');
                trimmed.is_empty() || {
                    let want: Vec<&str> = trimmed.split('/').collect();
                    let have: Vec<&str> = path_text.split('/').collect();
                    have.starts_with(&want)
                }
            };
            let rule = Rule::new("R", ClientIp::new()).for_path_prefix(prefix_text.clone());
            prop_assert_eq!(in_scope(&rule, &http::Method::GET, &path_text), model, "{} under {}", path_text, prefix_text);
        }

        /// A method scope holds for exactly its methods, and a `GET` scope for `HEAD` too; a
        /// method spelled otherwise (`get`, `GETX`, an extension method) is not `GET`.
        #[test]
        fn a_method_scope_holds_for_its_methods_and_get_for_head(
            method in prop_oneof![
                Just("GET".to_owned()), Just("HEAD".to_owned()), Just("POST".to_owned()),
                Just("get".to_owned()), Just("GETX".to_owned()), "[A-Za-z]{1,8}",
            ],
            scope in proptest::sample::subsequence(vec!["GET", "HEAD", "POST", "PUT"], 1..=4),
        ) {
            let method = http::Method::from_bytes(method.as_bytes()).unwrap();
            let methods: Vec<http::Method> =
                scope.iter().map(|m| http::Method::from_bytes(m.as_bytes()).unwrap()).collect();
            let expected = methods.contains(&method)
                || (method == http::Method::HEAD && methods.contains(&http::Method::GET));
            let rule = Rule::new("R", ClientIp::new()).for_methods(methods);
            prop_assert_eq!(in_scope(&rule, &method, "/"), expected);
        }
    }
}
