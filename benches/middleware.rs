//! Requests through an axum Router in process (tower `oneshot`, no sockets): bare, with our
//! layer (in-memory backend, 1 rule and 3 rules), and with tower_governor's layer (per IP, an
//! equivalent quota). Every request is allowed, so each one takes the full decision path.
//!
//! `cargo bench --bench middleware`
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::{Router, body::Body, routing::get};
use criterion::{Criterion, criterion_group, criterion_main};
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_ratelimits::layer::{ClientIp, Header, Ipv6Range48, OnMissingKey, RateLimitLayer, Rule};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

const LIMITS: &str = "\
PerIp: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerRange: {kind: ipv6_range, burst: 1000000, count: 1000000, period: 1s}
PerAccount: {kind: account, burst: 1000000, count: 1000000, period: 1s}
";

fn base() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

fn ours(rules: usize) -> Router {
    ours_with(rules, true)
}

fn ours_with(rules: usize, headers: bool) -> Router {
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        MemoryBackend::new(),
    );
    let all = [
        Rule::new("PerIp", ClientIp::new()),
        Rule::new("PerRange", Ipv6Range48::new(ClientIp::new())),
        Rule::new("PerAccount", Header::new("x-account-id")).on_missing_key(OnMissingKey::Skip),
    ];
    let layer = all
        .into_iter()
        .take(rules)
        .fold(RateLimitLayer::builder(limiter), |b, r| b.rule(r))
        .ratelimit_headers_on_allowed(headers)
        .build()
        .unwrap();
    base().layer(layer)
}

fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1_000)
        .burst_size(1_000_000)
        .finish()
        .unwrap();
    base().layer(GovernorLayer::new(config))
}

fn request(i: u32) -> http::Request<Body> {
    let peer = SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 4000));
    http::Request::get("/")
        .header("x-account-id", (i % 1000).to_string())
        .extension(ConnectInfo(peer))
        .body(Body::empty())
        .unwrap()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("middleware");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    let apps = [
        ("bare", base()),
        ("ours_1_rule", ours(1)),
        ("ours_1_rule_no_headers", ours_with(1, false)),
        ("ours_3_rules", ours(3)),
        ("tower_governor", governor()),
    ];
    for (name, app) in apps {
        let mut i = 0u32;
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                i = (i + 1) % 1000;
                let app = app.clone();
                let req = request(i);
                async move {
                    let r = app.oneshot(req).await.unwrap();
                    assert!(r.status().is_success());
                    r
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
