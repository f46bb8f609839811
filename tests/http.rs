//! The middleware end to end: a real axum server over TCP, a real HTTP client, time driven by
//! a manual clock.

mod support;

use std::time::Duration;

use axum::{Router, routing::get};
use support::http::{HttpClient, serve};
use tower_ratelimits::{ClientIp, Header, Ipv6Range48, OnMissingKey, RateLimitLayer, Rule};
use tower_ratelimits::{Clock, ErrorBody, FieldStyle, Limiter, Limits, ManualClock, MemoryBackend};

const DEFAULTS: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 3
  count: 3
  period: 3s
RequestsPerIPv6Range:
  kind: ipv6_range
  burst: 5
  count: 5
  period: 5s
ApiCallsPerAccount:
  kind: account
  burst: 2
  count: 2
  period: 2s
";

fn limiter(clock: &ManualClock) -> Limiter {
    let limits = Limits::from_yaml_str(DEFAULTS, None).unwrap();
    Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    )
}

fn app(layer: RateLimitLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

fn ip_rules(trusted: &[&str]) -> Vec<Rule> {
    let ip = ClientIp::new().trusted_proxies(trusted.iter().map(|s| s.parse().unwrap()));
    vec![
        Rule::new("RequestsPerIPAddress", ip.clone()),
        Rule::new("RequestsPerIPv6Range", Ipv6Range48::new(ip)),
    ]
}

#[tokio::test]
async fn the_burst_passes_then_429_with_every_header_and_the_exact_body() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let layer = RateLimitLayer::builder(limiter(&clock))
        .rule(ip_rules(&[])[0].clone())
        .fields(FieldStyle::IetfAndLegacy)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    for remaining in [2, 1, 0] {
        let r = client.get("/", &[]).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "hello");
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"RequestsPerIPAddress\";q=3;w=3")
        );
        assert_eq!(
            r.header("ratelimit"),
            // Draft-11: `t` is the effective window, the time until one more unit (1 s here).
            Some(format!("\"RequestsPerIPAddress\";r={remaining};t=1").as_str())
        );
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(remaining.to_string().as_str())
        );
    }
    clock.advance(Duration::from_millis(400));
    let r = client.get("/", &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("retry-after"), Some("1"), "600ms rounded up");
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"RequestsPerIPAddress\";q=3;w=3")
    );
    // Draft-11: `t` is the wait before a cost-1 request passes (600 ms, rounded up), never
    // later than `Retry-After`.
    assert_eq!(
        r.header("ratelimit"),
        Some("\"RequestsPerIPAddress\";r=0;t=1")
    );
    assert_eq!(r.header("x-ratelimit-limit"), Some("3"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(r.header("x-ratelimit-reset"), Some("3"));
    assert_eq!(
        r.body,
        r#"{"errors":[{"code":"TOOMANYREQUESTS","detail":{"entity":"127.0.0.1","limiter":"RequestsPerIPAddress","retry_after_ms":600},"message":"too many requests"}]}"#
    );
    // Time, not sleeping: one emission interval later one request fits.
    clock.advance(Duration::from_millis(600));
    assert_eq!(client.get("/", &[]).await.status, 200);
    assert_eq!(client.get("/", &[]).await.status, 429);
}

#[tokio::test]
async fn trusted_proxies_key_clients_apart_and_untrusted_headers_change_nothing() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    // Loopback is the trusted proxy; the clients are named by X-Forwarded-For.
    let trusted = serve(app(RateLimitLayer::new(
        limiter(&clock),
        ip_rules(&["127.0.0.0/8", "::1/128"]),
    )
    .unwrap()))
    .await;
    let client = HttpClient::new(&trusted);
    for _ in 0..3 {
        assert_eq!(
            client
                .get("/", &[("x-forwarded-for", "203.0.113.7")])
                .await
                .status,
            200
        );
    }
    let r = client.get("/", &[("x-forwarded-for", "203.0.113.7")]).await;
    assert_eq!(r.status, 429);
    assert!(r.body.contains(r#""entity":"203.0.113.7""#), "{}", r.body);
    // Another client behind the same proxy has its own bucket.
    assert_eq!(
        client
            .get("/", &[("x-forwarded-for", "203.0.113.8")])
            .await
            .status,
        200
    );
    // A client that forges an entry is still keyed by the address the proxy appended.
    let r = client
        .get("/", &[("x-forwarded-for", "198.51.100.1, 203.0.113.7")])
        .await;
    assert_eq!(r.status, 429);
    // Two proxies: the walk skips the trusted hop.
    let r = client
        .get("/", &[("x-forwarded-for", "203.0.113.7, 127.0.0.5")])
        .await;
    assert_eq!(r.status, 429);

    // Untrusted peer: no header changes the key.
    let untrusted = serve(app(
        RateLimitLayer::new(limiter(&clock), ip_rules(&[])).unwrap()
    ))
    .await;
    let client = HttpClient::new(&untrusted);
    let spoofs = [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-for", "10.1.1.1, 10.2.2.2"),
        ("forwarded", "for=192.0.2.60"),
        ("x-real-ip", "192.0.2.61"),
        ("x-forwarded-for", "garbage"),
    ];
    for (i, (k, v)) in spoofs.iter().enumerate() {
        let r = client.get("/", &[(k, v)]).await;
        assert_eq!(r.status, if i < 3 { 200 } else { 429 }, "{k}: {v}");
    }
}

#[tokio::test]
async fn an_ipv6_slash_48_neighbour_shares_the_range_bucket() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let server = serve(app(RateLimitLayer::new(
        limiter(&clock),
        ip_rules(&["127.0.0.1/32"]),
    )
    .unwrap()))
    .await;
    let client = HttpClient::new(&server);
    // Five different addresses in 2001:db8:1::/48 drain its range bucket (burst 5) ...
    for i in 1..=5 {
        let xff = format!("2001:db8:1:{i}::1");
        assert_eq!(
            client.get("/", &[("x-forwarded-for", &xff)]).await.status,
            200
        );
    }
    // ... so a sixth neighbour, with a fresh per-address bucket, is refused by the range rule.
    let r = client
        .get("/", &[("x-forwarded-for", "2001:db8:1:ffff::9")])
        .await;
    assert_eq!(r.status, 429);
    assert!(
        r.body.contains(r#""limiter":"RequestsPerIPv6Range""#),
        "{}",
        r.body
    );
    assert!(
        r.body.contains(r#""entity":"2001:db8:1::/48""#),
        "{}",
        r.body
    );
    // Another /48 is not affected.
    assert_eq!(
        client
            .get("/", &[("x-forwarded-for", "2001:db8:2::1")])
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn account_header_missing_skips_or_rejects_and_malformed_is_400() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let skip = RateLimitLayer::builder(limiter(&clock))
        .rule(
            Rule::new("ApiCallsPerAccount", Header::new("x-account-id"))
                .on_missing_key(OnMissingKey::Skip),
        )
        .build()
        .unwrap();
    let server = serve(app(skip)).await;
    let client = HttpClient::new(&server);
    for _ in 0..5 {
        assert_eq!(
            client.get("/", &[]).await.status,
            200,
            "no account: rule skipped"
        );
    }
    assert_eq!(client.get("/", &[("x-account-id", "42")]).await.status, 200);
    assert_eq!(client.get("/", &[("x-account-id", "42")]).await.status, 200);
    let r = client.get("/", &[("x-account-id", "42")]).await;
    assert_eq!(r.status, 429);
    assert!(r.body.contains(r#""entity":"42""#));
    for bad in ["042", "abc", "-1", "18446744073709551616"] {
        let r = client.get("/", &[("x-account-id", bad)]).await;
        assert_eq!(r.status, 400, "{bad}");
        assert!(r.body.contains("BADREQUEST"), "{}", r.body);
    }

    let reject = RateLimitLayer::builder(limiter(&clock))
        .rule(
            Rule::new("ApiCallsPerAccount", Header::new("x-account-id"))
                .on_missing_key(OnMissingKey::Reject(http::StatusCode::UNAUTHORIZED)),
        )
        .build()
        .unwrap();
    let server = serve(app(reject)).await;
    let r = HttpClient::new(&server).get("/", &[]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(
        r.body
            .contains("missing key for rate limit ApiCallsPerAccount"),
        "{}",
        r.body
    );
    assert!(r.body.contains(r#""code":"UNAUTHORIZED""#), "{}", r.body);
}

#[tokio::test]
async fn a_tiered_limit_reports_its_serving_tier_and_the_exact_retry_after() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(
        "\
ApiCallsPerAccount:
  kind: account
  tiers:
    - {limit: 2, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 3, window: 10s, active: 2500ms, cooldown: 15s}
",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("ApiCallsPerAccount", Header::new("x-account")))
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let acct = [("x-account", "42")];
    // Tier 1: 2 per second, policy q=2;w=1.
    for remaining in [1, 0] {
        let r = client.get("/", &acct).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"ApiCallsPerAccount\";q=2;w=1")
        );
        assert_eq!(
            r.header("ratelimit").unwrap(),
            // Fresh again 1 s + 1 us after the last grant (closed window), rounded up.
            format!("\"ApiCallsPerAccount\";r={remaining};t=2")
        );
    }
    // The burst into tier 2: its limit and window are reported.
    for remaining in [2, 1, 0] {
        let r = client.get("/", &acct).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"ApiCallsPerAccount\";q=3;w=10")
        );
        assert!(
            r.header("ratelimit")
                .unwrap()
                .starts_with(&format!("\"ApiCallsPerAccount\";r={remaining};")),
        );
    }
    // Tier 2 is full: 429 until its active period ends at 2.5 s + 1 us (Retry-After rounds
    // up to 3 s), and the body names the tier that refused.
    let r = client.get("/", &acct).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("3"));
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let detail = &body["errors"][0]["detail"];
    assert_eq!(detail["tier"], 2);
    assert_eq!(detail["retry_after_ms"], 2501);
    assert_eq!(detail["limiter"], "ApiCallsPerAccount");
    // After it, tier 1 serves again (tier 2 cools down: no further burst).
    clock.advance(Duration::from_micros(2_500_001));
    for status in [200, 200, 429] {
        assert_eq!(client.get("/", &acct).await.status, status);
    }
}

/// What the authentication layer of `keyed_by_the_identity_an_authentication_layer_verified`
/// verified.
#[derive(Clone)]
struct VerifiedAccount(&'static str);

#[tokio::test]
async fn keyed_by_the_identity_an_authentication_layer_verified() {
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    use axum::response::{IntoResponse, Response};
    use tower_ratelimits::{Id, KeyError, key_fn};

    async fn authenticate(mut req: Request, next: Next) -> Response {
        let account = match req.headers().get("authorization").map(|v| v.as_bytes()) {
            Some(b"Bearer alice-token") => "6f1c2a7e-0b1d-4c1e-9a55-2b8e7f3d9c01",
            Some(b"Bearer bob-token") => "d2a94b3c-5e6f-4a70-8b12-9c3d4e5f6a7b",
            _ => return (http::StatusCode::UNAUTHORIZED, "who are you?").into_response(),
        };
        req.extensions_mut().insert(VerifiedAccount(account));
        next.run(req).await
    }

    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(
        "PerAccount: {kind: any, burst: 2, count: 1, period: 1h}\n",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(limits, MemoryBackend::builder().clock(clock).build());
    let rule = Rule::new(
        "PerAccount",
        key_fn(|req| match req.extensions.get::<VerifiedAccount>() {
            Some(VerifiedAccount(id)) => Ok(Id::new(id).ok()),
            None => Err(KeyError::internal("no verified account")),
        }),
    );
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(limiter, [rule]).unwrap())
        .layer(middleware::from_fn(authenticate));
    let server = serve(app).await;
    let client = HttpClient::new(&server);
    let alice = ("authorization", "Bearer alice-token");
    assert_eq!(client.get("/", &[alice]).await.status, 200);
    // Whatever else Alice writes, she spends her own quota.
    assert_eq!(
        client
            .get("/", &[alice, ("x-account-id", "bob")])
            .await
            .status,
        200
    );
    let r = client.get("/", &[alice]).await;
    assert_eq!(r.status, 429);
    assert!(
        r.body.contains("6f1c2a7e-0b1d-4c1e-9a55-2b8e7f3d9c01"),
        "{}",
        r.body
    );
    // Bob's quota is his own; an unknown client never reaches the limiter.
    let bob = ("authorization", "Bearer bob-token");
    assert_eq!(client.get("/", &[bob]).await.status, 200);
    assert_eq!(client.get("/", &[]).await.status, 401);
}

/// Behind a trusted proxy that appends the address it saw, a client that
/// sends more than 8 KiB, or one byte that is not UTF-8, in its own X-Forwarded-For used to be
/// keyed as the proxy, in the bucket every client behind the proxy shares. It is keyed by its
/// own address, and the proxy's bucket is untouched.
#[tokio::test]
async fn a_hostile_forwarding_header_cannot_escape_into_the_proxys_bucket() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let server = serve(app(RateLimitLayer::new(
        limiter(&clock),
        ip_rules(&["127.0.0.0/8", "::1/128"]),
    )
    .unwrap()))
    .await;
    let client = HttpClient::new(&server);
    let mut long = "1.1.1.1, ".repeat(1_000).into_bytes();
    long.extend_from_slice(b"203.0.113.20");
    let mut not_text = b"\xff\xfe, ".to_vec();
    not_text.extend_from_slice(b"203.0.113.21");
    for (header, entity) in [(long, "203.0.113.20"), (not_text, "203.0.113.21")] {
        // The burst (3) passes, the 4th is refused in the client's own bucket.
        for _ in 0..3 {
            let r = client.get_raw("/", &[("x-forwarded-for", &header)]).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let r = client.get_raw("/", &[("x-forwarded-for", &header)]).await;
        assert_eq!(r.status, 429);
        assert!(
            r.body.contains(&format!(r#""entity":"{entity}""#)),
            "{}",
            r.body
        );
    }
    // The proxy's own bucket (a request from it with no forwarding header) was never spent.
    for _ in 0..3 {
        assert_eq!(client.get("/", &[]).await.status, 200);
    }
    // A proxy that passed on garbage as the client's address: 400, not the proxy's bucket.
    let r = client
        .get("/", &[("x-forwarded-for", "203.0.113.22, junk")])
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("not an address"), "{}", r.body);
}

/// At the key cap, a new client used to be let through unlimited (the
/// default failure policy is fail open) while the table stayed full. It is refused with 503 and
/// `Retry-After: 1` whatever the failure policy; clients already tracked keep their limits.
#[tokio::test]
async fn a_full_memory_table_refuses_new_clients_instead_of_letting_them_through() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(DEFAULTS, None).unwrap();
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .max_keys(2)
        .build();
    let ip = ClientIp::new().trusted_proxies(["127.0.0.0/8".parse().unwrap()]);
    let layer = RateLimitLayer::new(
        Limiter::new(limits, backend.clone()),
        [Rule::new("RequestsPerIPAddress", ip)],
    )
    .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let from = |addr: &'static str| [("x-forwarded-for", addr)];
    assert_eq!(client.get("/", &from("203.0.113.1")).await.status, 200);
    assert_eq!(client.get("/", &from("203.0.113.2")).await.status, 200);
    for _ in 0..3 {
        let r = client.get("/", &from("203.0.113.3")).await;
        assert_eq!(r.status, 503, "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    assert_eq!(backend.full_refusals(), 3);
    // Tracked clients keep their own limits (burst 3).
    assert_eq!(client.get("/", &from("203.0.113.1")).await.status, 200);
    assert_eq!(client.get("/", &from("203.0.113.1")).await.status, 200);
    assert_eq!(client.get("/", &from("203.0.113.1")).await.status, 429);
}

/// `(name, first parameter, second parameter)` of each member of a `RateLimit` or
/// `RateLimit-Policy` field, parsed by an RFC 9651 parser (`sfv`): every member must be an
/// sf-string item with exactly the two integer parameters.
fn sf_members(value: &str, a: &str, b: &str) -> Vec<(String, u64, u64)> {
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .unwrap_or_else(|e| panic!("{value:?} is not a structured-field list: {e}"));
    list.into_iter()
        .map(|entry| {
            let sfv::ListEntry::Item(item) = entry else {
                panic!("{value:?}: an inner list")
            };
            let name = item.bare_item.as_string().expect("an sf-string").as_str();
            assert_eq!(item.params.len(), 2, "{value:?}");
            let param = |key: &str| -> u64 {
                let v = item
                    .params
                    .get(key)
                    .unwrap_or_else(|| panic!("{value:?}: no {key}"));
                let n = i64::from(v.as_integer().expect("an integer"));
                u64::try_from(n).expect("not negative")
            };
            (name.to_owned(), param(a), param(b))
        })
        .collect()
}

/// Draft-11, checked on every response of a script over two GCRA rules (3 per 3 s per IP, 5
/// per 10 s per account): both fields parse as structured-field lists with one member per
/// rule, the strictest first, in the same order; `r` is the units left; `t` is the effective
/// window, checked against the bucket's stored TAT by an independent model (after `t` seconds
/// one more unit is available, one second earlier it is not); on every 429 the first member
/// names the limit that denied and `Retry-After >= t`.
#[tokio::test]
async fn every_ratelimit_field_follows_draft_11() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(
        "\
PerIp: {kind: ip, burst: 3, count: 3, period: 3s}
PerAccount: {kind: account, burst: 5, count: 5, period: 10s}
",
        None,
    )
    .unwrap();
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(limits, backend.clone());
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [
            Rule::new("PerIp", ClientIp::new()),
            Rule::new("PerAccount", Header::new("x-account")),
        ],
    )
    .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let key = |name: &str| {
        let id = if name == "PerIp" { "127.0.0.1" } else { "7" };
        limiter.parse_key(name, id).unwrap()
    };
    let (mut denied, mut allowed) = (0, 0);
    for (step, advance_ms) in [0, 0, 0, 0, 700, 300, 1000, 0, 0, 2500, 0, 0, 0, 6000, 0, 0]
        .into_iter()
        .enumerate()
    {
        clock.advance(Duration::from_millis(advance_ms));
        let r = client.get("/", &[("x-account", "7")]).await;
        let state = sf_members(r.header("ratelimit").unwrap(), "r", "t");
        let policy = sf_members(r.header("ratelimit-policy").unwrap(), "q", "w");
        let names: Vec<&str> = state.iter().map(|m| m.0.as_str()).collect();
        assert_eq!(names.len(), 2, "step {step}: one member per rule");
        assert!(
            policy
                .iter()
                .map(|m| m.0.as_str())
                .eq(names.iter().copied()),
            "step {step}: the same order in both fields"
        );
        let now = clock.now_us();
        for ((name, r_left, t), (_, q, _)) in state.iter().zip(&policy) {
            let quota = limiter.limits().resolve(&key(name)).unwrap().clone();
            let l = quota.as_gcra().unwrap();
            assert_eq!(*q, l.burst(), "step {step} {name}");
            // The model: units available at a time, from the stored TAT.
            let tat = backend.tat(&key(name)).unwrap_or(0);
            let available_at = |at: u64| {
                let ahead = tat.saturating_sub(at);
                (l.burst_offset_us() - ahead.min(l.burst_offset_us())) / l.emission_interval_us()
            };
            assert_eq!(available_at(now), *r_left, "step {step} {name}: r");
            let want = (r_left + 1).min(l.burst());
            assert!(
                available_at(now + t * 1_000_000) >= want,
                "step {step} {name}: one more unit after t={t}"
            );
            if *t > 0 && *r_left < l.burst() {
                assert!(
                    available_at(now + (t - 1) * 1_000_000) <= *r_left,
                    "step {step} {name}: t={t} is not the shortest whole-second window"
                );
            }
        }
        match r.status {
            200 => allowed += 1,
            429 => {
                denied += 1;
                let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
                assert!(retry >= state[0].2, "step {step}: Retry-After {retry} < t");
                let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
                assert_eq!(body["errors"][0]["detail"]["limiter"], state[0].0.as_str());
            }
            other => panic!("step {step}: {other}"),
        }
    }
    assert!(
        allowed >= 5 && denied >= 4,
        "{allowed} allowed, {denied} denied"
    );
}

/// The 429, the 400 (no account header) and the 503 (the memory table full) the middleware
/// writes with `body`, over TCP.
async fn three_answers(body: ErrorBody) -> [support::http::Reply; 3] {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::from_yaml_str(
        "\
PerIp: {kind: ip, burst: 1, count: 1, period: 2s}
PerAccount: {kind: account, burst: 1, count: 1, period: 1s}
",
        None,
    )
    .unwrap();
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .max_keys(3)
        .build();
    let ip = ClientIp::new().trusted_proxies(["127.0.0.0/8".parse().unwrap()]);
    let layer = RateLimitLayer::builder(Limiter::new(limits, backend))
        .rule(Rule::new("PerIp", ip))
        .rule(Rule::new("PerAccount", Header::new("x-account")))
        .error_body(body)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let from = |addr: &'static str| [("x-forwarded-for", addr), ("x-account", "1")];
    assert_eq!(client.get("/", &from("203.0.113.1")).await.status, 200);
    let denied = client.get("/", &from("203.0.113.1")).await;
    let bad = client.get("/", &[("x-forwarded-for", "203.0.113.2")]).await;
    // Two buckets held, room for one more: a new client with a new account needs two.
    let full = client
        .get(
            "/",
            &[("x-forwarded-for", "203.0.113.3"), ("x-account", "2")],
        )
        .await;
    assert_eq!(
        [denied.status, bad.status, full.status],
        [429, 400, 503],
        "{} / {} / {}",
        denied.body,
        bad.body,
        full.body
    );
    [denied, bad, full]
}

/// RFC 9457, opt in: the 429 is `application/problem+json` with the draft's `#quota-exceeded`
/// type and `violated-policies` naming every limit that denied (the strictest first); the 400
/// and the 503 the middleware writes are problems too.
#[tokio::test]
async fn problem_json_bodies_for_429_400_and_503() {
    let [r, bad, full] = three_answers(ErrorBody::ProblemJson).await;
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let p: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        p["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(p["status"], 429);
    assert_eq!(p["title"], "Too Many Requests");
    assert_eq!(
        p["violated-policies"],
        serde_json::json!(["PerIp", "PerAccount"])
    );
    assert_eq!(p["retry_after_ms"], 2000);
    assert_eq!(r.header("retry-after"), Some("2"));

    assert_eq!(bad.header("content-type"), Some("application/problem+json"));
    let p: serde_json::Value = serde_json::from_str(&bad.body).unwrap();
    assert_eq!(p["type"], "about:blank");
    assert_eq!(p["status"], 400);
    assert!(p["detail"].as_str().unwrap().contains("PerAccount"), "{p}");

    assert_eq!(
        full.header("content-type"),
        Some("application/problem+json")
    );
    let p: serde_json::Value = serde_json::from_str(&full.body).unwrap();
    assert_eq!(p["status"], 503);
}

/// No bodies, opt in: the 429, the 400 and the 503 have an empty body and no `Content-Type`;
/// the 429 keeps `Retry-After` and both `RateLimit` fields, the 503 its `Retry-After`.
#[tokio::test]
async fn empty_bodies_for_429_400_and_503() {
    let [denied, bad, full] = three_answers(ErrorBody::Empty).await;
    for r in [&denied, &bad, &full] {
        assert_eq!(r.body, "", "{}", r.status);
        assert_eq!(r.header("content-type"), None, "{}", r.status);
    }
    assert_eq!(denied.header("retry-after"), Some("2"));
    assert!(denied.header("ratelimit").is_some());
    assert!(denied.header("ratelimit-policy").is_some());
    assert_eq!(full.header("retry-after"), Some("1"));
}

/// The 429 bodies are written straight from the denial's numbers, not through a JSON value:
/// an id with quotes, a backslash and non-ASCII text (a header the client writes) still makes
/// valid JSON that reads back as the id, in the default body and in problem+json, both with
/// their keys in the documented order.
#[tokio::test]
async fn a_hostile_id_in_a_429_body_is_escaped() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let id = "a\"b\\c\u{e9}</script>";
    for body in [ErrorBody::Json, ErrorBody::ProblemJson] {
        let limits = Limits::from_yaml_str(
            "Per\"Client: {kind: any, burst: 1, count: 1, period: 1h}\n",
            None,
        );
        // A name cannot hold a quote (names are identifiers): the id is what a client writes.
        assert!(limits.is_err());
        let limits = Limits::from_yaml_str(
            "PerClient: {kind: any, burst: 1, count: 1, period: 1h}\n",
            None,
        )
        .unwrap();
        let limiter = Limiter::new(
            limits,
            MemoryBackend::builder().clock(clock.clone()).build(),
        );
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("PerClient", Header::new("x-client")))
            .error_body(body)
            .build()
            .unwrap();
        let server = serve(app(layer)).await;
        let client = HttpClient::new(&server);
        let raw = [("x-client", id.as_bytes())];
        assert_eq!(client.get_raw("/", &raw).await.status, 200);
        let r = client.get_raw("/", &raw).await;
        assert_eq!(r.status, 429);
        let v: serde_json::Value =
            serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.body));
        match body {
            ErrorBody::Json => {
                assert_eq!(v["errors"][0]["detail"]["entity"], id, "{}", r.body);
                assert_eq!(v["errors"][0]["detail"]["limiter"], "PerClient");
                assert_eq!(v["errors"][0]["detail"]["retry_after_ms"], 3_600_000);
                assert!(
                    r.body
                        .starts_with(r#"{"errors":[{"code":"TOOMANYREQUESTS","detail":{"entity":"#)
                );
            }
            _ => {
                assert_eq!(
                    r.body,
                    "{\"detail\":\"rate limit PerClient exceeded; retry after 3600 s\",\
                     \"retry_after_ms\":3600000,\"status\":429,\"title\":\"Too Many Requests\",\
                     \"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\
                     \"violated-policies\":[\"PerClient\"]}"
                );
            }
        }
    }
}

/// One wait, said the same way everywhere. 49.3 ms to wait: every field in
/// milliseconds (`retry_after_ms` of both bodies) is 50, every field in seconds (`Retry-After`,
/// `RateLimit`'s `t`) is 1, and the text says 50 ms (it said "retry after 1s").
#[tokio::test]
async fn a_wait_is_the_same_in_every_field_and_text() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    for body in [ErrorBody::Json, ErrorBody::ProblemJson] {
        let limits =
            Limits::from_yaml_str("Fast: {kind: any, burst: 1, count: 20, period: 1s}\n", None)
                .unwrap();
        let limiter = Limiter::new(
            limits,
            MemoryBackend::builder().clock(clock.clone()).build(),
        );
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("Fast", Header::new("x-client")))
            .fields(FieldStyle::Ietf)
            .error_body(body)
            .build()
            .unwrap();
        let server = serve(app(layer)).await;
        let client = HttpClient::new(&server);
        let c = [("x-client", "a")];
        assert_eq!(client.get("/", &c).await.status, 200);
        clock.advance(Duration::from_micros(700));
        let r = client.get("/", &c).await;
        assert_eq!(r.status, 429);
        assert_eq!(r.header("retry-after"), Some("1"));
        assert!(
            r.header("ratelimit").unwrap().ends_with(";t=1"),
            "{:?}",
            r.header("ratelimit")
        );
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        match body {
            ErrorBody::Json => assert_eq!(v["errors"][0]["detail"]["retry_after_ms"], 50),
            _ => {
                assert_eq!(v["retry_after_ms"], 50);
                assert_eq!(v["detail"], "rate limit Fast exceeded; retry after 50 ms");
            }
        }
        clock.advance(Duration::from_secs(1));
    }
}

/// Three rules whose policies are precomputed when the layer is built: `RateLimit-Policy`
/// names the strictest first and the others in rule order, whichever is strictest; after a
/// reload changes one limit, that member shows the new quota (nothing precomputed for the old
/// one is served).
#[tokio::test]
async fn the_policy_of_several_rules_follows_the_strictest_and_a_reload() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let yaml = |b: u32| {
        format!(
            "A: {{kind: ip, burst: 9, count: 9, period: 9s}}\n\
             B: {{kind: account, burst: {b}, count: {b}, period: 10s}}\n\
             C: {{kind: domain, burst: 7, count: 7, period: 7s}}\n"
        )
    };
    let limits = Limits::from_yaml_str(&yaml(8), None).unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let layer = RateLimitLayer::new(
        limiter.clone(),
        [
            Rule::new("A", ClientIp::new()),
            Rule::new("B", Header::new("x-account")),
            Rule::new("C", Header::new("x-user")),
        ],
    )
    .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let policy = |r: &support::http::Reply| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("ratelimit-policy").unwrap_or_default().to_string()
    };
    let ids = [("x-account", "1"), ("x-user", "u1.example")];
    // C (7 of 7) has the fewest left: first, then A and B in order.
    let r = client.get("/", &ids).await;
    assert_eq!(policy(&r), "\"C\";q=7;w=7, \"A\";q=9;w=9, \"B\";q=8;w=10");
    // A fresh user: A 7 left, B 6, C 6: B and C tie, the first in rule order wins.
    let r = client
        .get("/", &[("x-account", "1"), ("x-user", "u2.example")])
        .await;
    assert_eq!(policy(&r), "\"B\";q=8;w=10, \"A\";q=9;w=9, \"C\";q=7;w=7");
    // A fresh account and user: A 6 left, B 7, C 6: A first, the others in order.
    let r = client
        .get("/", &[("x-account", "2"), ("x-user", "u3.example")])
        .await;
    assert_eq!(policy(&r), "\"A\";q=9;w=9, \"B\";q=8;w=10, \"C\";q=7;w=7");
    limiter
        .reload(Limits::from_yaml_str(&yaml(5), None).unwrap())
        .unwrap();
    let r = client
        .get("/", &[("x-account", "3"), ("x-user", "u4.example")])
        .await;
    assert_eq!(policy(&r), "\"B\";q=5;w=10, \"A\";q=9;w=9, \"C\";q=7;w=7");
}
