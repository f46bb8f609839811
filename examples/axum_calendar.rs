//! A monthly quota per account beside a per-second throttle, in memory: "5 a second, and
//! 1,000 a month, renewing on the 15th" (`docs/calendar.md`).
//!
//! ```text
//! cargo run --example axum_calendar
//! curl -i -H 'x-account: 42' http://127.0.0.1:3000/
//! # RateLimit: "ApiCallsPerSecond";r=4;t=1, "ApiCallsPerMonth";r=999;t=<seconds to the 15th>
//! curl -s -w '%{stderr}%{http_code} ' -H 'x-account: 42' 'http://127.0.0.1:3000/?[1-8]' >/dev/null; echo
//! ```
//!
//! A request the throttle refuses spends nothing of the month (one batch, all or nothing);
//! once the month's count is used, every request is refused with `Retry-After` at the renewal.
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`: the limits, a YAML file defining `ApiCallsPerMonth` and
//!   `ApiCallsPerSecond` (default `examples/config/calendar.yaml`)

use std::process::ExitCode;

use axum::{Router, routing::get};
use tower_ratelimits::{FieldStyle, Header, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_calendar: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("RATELIMITS_DEFAULTS")
        .unwrap_or_else(|_| "examples/config/calendar.yaml".into());
    let text = std::fs::read_to_string(&path).map_err(|e| format!("reading {path}: {e}"))?;
    let limits = Limits::from_yaml_str(&text, None).map_err(|e| format!("{path}: {e}"))?;
    let limiter = Limiter::new(limits, MemoryBackend::new());
    // The throttle first: a request it refuses is answered without looking further.
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("ApiCallsPerSecond", Header::new("x-account")))
        .rule(Rule::new("ApiCallsPerMonth", Header::new("x-account")))
        .fields(FieldStyle::Ietf)
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "listening on http://{} (per account: 5 a second and a monthly quota, {path})",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
