//! Requests in flight per tenant, their number found from the tenant's own latency, in memory
//! (`docs/adaptive-concurrency.md`): a search whose latency grows with the requests in flight
//! (10 ms, plus 5 ms for each other request running), `/busy` answering `503` (a failure).
//! All tenants together hold at most 60 slots (`capacity: 60`), shared equally among the
//! tenants active now: one tenant flooding the search cannot take the others' share.
//!
//! ```text
//! cargo run --example axum_adaptive
//! # 40 at once, five times: the tenant's number (q in RateLimit-Policy) falls as its latency
//! # rises; the requests over it are refused (429)
//! for round in 1 2 3 4 5; do for i in $(seq 40); do curl -s -o /dev/null -w '%{http_code}\n' -H 'x-tenant: acme' http://127.0.0.1:3000/search & done | sort | uniq -c; wait; done
//! curl -si -H 'x-tenant: acme' http://127.0.0.1:3000/search | grep -i ratelimit-policy
//! ```
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`: the limits, a YAML file defining `SearchPerTenant` as an adaptive
//!   concurrency limit (default `examples/config/adaptive.yaml`)

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::{Router, http::StatusCode, routing::get};
use tower_ratelimits::{FieldStyle, Header, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_adaptive: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("RATELIMITS_DEFAULTS")
        .unwrap_or_else(|_| "examples/config/adaptive.yaml".into());
    let defaults = std::fs::read_to_string(&path).map_err(|e| format!("reading {path}: {e}"))?;
    let limits = Limits::from_yaml_str(&defaults, None).map_err(|e| format!("{path}: {e}"))?;
    let limiter = Limiter::new(limits, MemoryBackend::new());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("SearchPerTenant", Header::new("x-tenant")))
        .fields(FieldStyle::Ietf)
        .build()?;
    let running = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route(
            "/search",
            get(move || {
                let running = running.clone();
                async move {
                    let others = running.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(10 + 5 * others)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    "found\n"
                }
            }),
        )
        .route(
            "/busy",
            get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "busy\n") }),
        )
        .layer(layer);
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "listening on http://{} (adaptive concurrency per tenant, x-tenant, {path})",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
