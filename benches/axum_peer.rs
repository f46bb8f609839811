//! The quickstart's hello-world app with a peer's rate limiter instead of ours, or ours cut to
//! the peer's shape, for side-by-side load tests (`benches/load.sh`): the same router, the same
//! handler, the same listener set-up as `axum_memory`.
//!
//! ```text
//! PEER=tower_governor PER_SECOND=1000000 BURST=1000000 cargo run --release -p tower-ratelimits-benches --example axum_peer
//! ```
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `PEER`: `tower_governor` (default: per peer IP, its default key), `ours_1_rule` (ours
//!   like for like: one rule per peer IP, in memory, no `RateLimit` fields on allowed
//!   responses, as tower_governor sends none), `ours_1_rule_no_body` (the same with
//!   `ErrorBody::Empty`: a 429 without a body), `handwritten` (a hand-written
//!   `Mutex<HashMap>` GCRA layer per peer IP, an empty 429: the floor), `handwritten_fields`
//!   (the same writing `RateLimit` and `RateLimit-Policy` on every answer) or `none` (no limit)
//! - `PER_SECOND`, `BURST`: the quota (default 20 and 20, as the quickstart's
//!   `RequestsPerIPAddress`)

#[path = "common/handwritten.rs"]
mod handwritten;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::{Router, routing::get};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_ratelimits::{
    ClientIp, ErrorBody, FieldStyle, IdKind, Limit, Limiter, Limits, MemoryBackend, RateLimitLayer,
    Rule,
};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_peer: {e}");
            ExitCode::from(2)
        }
    }
}

fn number(var: &str, default: u64) -> Result<u64, String> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(s) => match s.parse::<u64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{var}: {s:?} is not a positive integer")),
        },
    }
}

async fn run() -> Result<(), String> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("ADDR: {e}"))?;
    let app = Router::new().route("/", get(|| async { "hello\n" }));
    let peer = std::env::var("PEER").unwrap_or_else(|_| "tower_governor".into());
    let per_second = number("PER_SECOND", 20)?;
    let burst = number("BURST", 20)?;
    let app = match peer.as_str() {
        "tower_governor" => {
            let burst = u32::try_from(burst).map_err(|_| "BURST: too large".to_string())?;
            let config = GovernorConfigBuilder::default()
                .period(Duration::from_nanos((1_000_000_000 / per_second).max(1)))
                .burst_size(burst)
                .finish()
                .ok_or("tower_governor refused the quota")?;
            app.layer(GovernorLayer::new(config))
        }
        "ours_1_rule" | "ours_1_rule_no_body" => {
            let limit =
                Limit::new(burst, per_second, Duration::from_secs(1)).map_err(|e| e.to_string())?;
            let limits = Limits::builder()
                .limit_for("RequestsPerIPAddress", IdKind::Ip, limit)
                .build()
                .map_err(|e| e.to_string())?;
            let layer = RateLimitLayer::builder(Limiter::new(limits, MemoryBackend::new()))
                .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
                .fields(FieldStyle::IetfOnDenials)
                .error_body(if peer == "ours_1_rule_no_body" {
                    ErrorBody::Empty
                } else {
                    ErrorBody::Json
                })
                .build()
                .map_err(|e| e.to_string())?;
            app.layer(layer)
        }
        "handwritten" | "handwritten_fields" => {
            let every = Duration::from_nanos((1_000_000_000 / per_second).max(1));
            let fields = peer == "handwritten_fields";
            app.layer(handwritten::Handwritten::new(burst, every, fields))
        }
        "none" => app,
        other => {
            return Err(format!(
                "PEER: {other:?} is not `tower_governor`, `ours_1_rule`, `ours_1_rule_no_body`, \
                 `handwritten`, `handwritten_fields` or `none`"
            ));
        }
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    println!("listening on http://{addr} ({peer})");
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .map_err(|e| e.to_string())
}
