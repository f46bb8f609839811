//! The axum apps the middleware benches compare: bare, ours (1 or 3 rules) and
//! tower_governor, all with a hello-world handler and an equivalent quota (every request of
//! the benches is allowed, so each takes the full decision path).
#![allow(dead_code)]

use std::net::SocketAddr;

use axum::extract::ConnectInfo;
use axum::{Router, body::Body, routing::get};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_ratelimits::{
    ClientIp, CountWhen, ErrorBody, FieldStyle, Header, Ipv6Range48, OnMissingKey, RateLimitLayer,
    Rule,
};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

const LIMITS: &str = "\
PerIp: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerRange: {kind: ipv6_range, burst: 1000000, count: 1000000, period: 1s}
PerAccount: {kind: account, burst: 1000000, count: 1000000, period: 1s}
PerAccountDay: {kind: account, burst: 1000000, count: 1000000, period: 1d}
PerIp4: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerIp5: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerIp6: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerIp7: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
PerIp8: {kind: ip, burst: 1000000, count: 1000000, period: 1s}
Tight: {kind: ip, burst: 1, count: 1, period: 1h}
";

/// The in-memory backend of the apps, with no background sweep: a sweep that fell inside a
/// counted run (a busy machine makes the run longer than its 10 s) took the shards' locks
/// under the measured requests and moved a count by 0.4%.
fn memory() -> MemoryBackend {
    MemoryBackend::builder().no_background_sweep().build()
}

/// The hello-world router, before any layer.
fn hello() -> Router {
    Router::new().route("/", get(|| async { "hello" }))
}

/// `app` as `axum::serve` runs it: `into_make_service` turns every handler into a route once
/// (`Router::with_state`). Called as built, axum would make the route, and apply every layer
/// to it, on each request (about 1,000 instructions a request for a layered app at b64ca46,
/// which no served app pays).
fn served(app: Router) -> Router {
    app.with_state(())
}

/// The app with no rate limit.
pub fn bare() -> Router {
    served(hello())
}

/// Ours with the first `rules` of: per IP, per /48, per account header, then per IP under
/// other names (`PerIp4` to `PerIp8`; 1 to 8 rules), in memory.
pub fn ours(rules: usize, headers_on_allowed: bool) -> Router {
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), memory());
    let all = [
        Rule::new("PerIp", ClientIp::new()),
        Rule::new("PerRange", Ipv6Range48::new(ClientIp::new())),
        Rule::new("PerAccount", Header::new("x-account-id")).on_missing_key(OnMissingKey::Skip),
    ]
    .into_iter()
    .chain((4..=8).map(|n| Rule::new(format!("PerIp{n}"), ClientIp::new())));
    let layer = all
        .into_iter()
        .take(rules)
        .fold(RateLimitLayer::builder(limiter), |b, r| b.rule(r))
        .fields(if headers_on_allowed {
            FieldStyle::Ietf
        } else {
            FieldStyle::IetfOnDenials
        })
        .build()
        .unwrap();
    served(hello().layer(layer))
}

/// Ours with one rule per IP that counts only failed logins (`count_when` a 401, weight 1),
/// fields on allowed responses: every response is a success, so each request reserves a unit
/// and gives it back when its head is seen (a refund, the store's second call). With
/// `penalty`, the limit has a ladder no run reaches: the unit is reserved and settled on it
/// too.
pub fn ours_count_when(penalty: bool) -> Router {
    let mut limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    if penalty {
        let ladder =
            tower_ratelimits::Ladder::new(1_000, 1_000_000, 1_000_000, 2, 3_600_000_000).unwrap();
        limits = Limits::builder()
            .limit_for(
                "PerIp",
                tower_ratelimits::IdKind::Ip,
                tower_ratelimits::Limit::new(
                    1_000_000,
                    1_000_000,
                    std::time::Duration::from_secs(1),
                )
                .unwrap(),
            )
            .penalty("PerIp", ladder)
            .build()
            .unwrap();
    }
    let limiter = Limiter::new(limits, memory());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("PerIp", ClientIp::new()).count_when(CountWhen::new().status(401, 1)))
        .fields(FieldStyle::Ietf)
        .build()
        .unwrap();
    served(hello().layer(layer))
}

/// Ours with two rules keyed by the same header (per account per second and per day, the
/// header read once), fields on allowed responses.
pub fn ours_same_header() -> Router {
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), memory());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("PerAccount", Header::new("x-account-id")))
        .rule(Rule::new("PerAccountDay", Header::new("x-account-id")))
        .fields(FieldStyle::Ietf)
        .build()
        .unwrap();
    served(hello().layer(layer))
}

/// Ours with one rule per IP of 1 an hour, burst 1, fields on denials (the default), the
/// 429's body as `body` says: after one request per client, every request is refused (the
/// `_refused` variants; `_refused_no_body` with `ErrorBody::Empty`).
pub fn ours_refusing(body: ErrorBody) -> Router {
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), memory());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("Tight", ClientIp::new()))
        .error_body(body)
        .build()
        .unwrap();
    served(hello().layer(layer))
}

/// tower_governor per peer IP, one request an hour, burst 1: after one request per client,
/// every request is refused.
pub fn governor_refusing() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_second(3600)
        .burst_size(1)
        .finish()
        .unwrap();
    served(hello().layer(GovernorLayer::new(config)))
}

/// tower_governor per peer IP (its default key), 1,000,000 per second, burst 1,000,000.
pub fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1_000)
        .burst_size(1_000_000)
        .finish()
        .unwrap();
    served(hello().layer(GovernorLayer::new(config)))
}

/// The hand-written GCRA layer (`handwritten.rs`) with the quota of `governor()`: an empty 429,
/// and the two IETF fields on every answer with `fields`.
pub fn handwritten(fields: bool) -> Router {
    let every = std::time::Duration::from_micros(1);
    served(hello().layer(super::handwritten::Handwritten::new(
        1_000_000, every, fields,
    )))
}

/// The hand-written layer at one request an hour, burst 1: after one request per client,
/// every request is refused.
pub fn handwritten_refusing() -> Router {
    let every = std::time::Duration::from_secs(3600);
    served(hello().layer(super::handwritten::Handwritten::new(1, every, false)))
}

/// Request `i` of a run: client `10.0.x.y` (1,000 distinct), account `i % 1000`.
pub fn request(i: u32) -> http::Request<Body> {
    let peer = SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 4000));
    http::Request::get("/")
        .header("x-account-id", (i % 1000).to_string())
        .extension(ConnectInfo(peer))
        .body(Body::empty())
        .unwrap()
}
