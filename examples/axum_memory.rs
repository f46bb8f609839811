//! The quickstart: an axum app limited per client IP and per IPv6 /48 range, in memory.
//!
//! ```text
//! cargo run --example axum_memory
//! curl -s -w '%{stderr}%{http_code} ' 'http://127.0.0.1:3000/?[1-25]' >/dev/null; echo
//! ```
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`, `RATELIMITS_OVERRIDES`: YAML files (default
//!   `examples/config/defaults.yaml` and `examples/config/overrides.yaml`, which define
//!   `RequestsPerIPAddress` and `RequestsPerIPv6Range`)
//! - `RATELIMITS_TRUSTED_PROXIES`: comma-separated CIDRs whose `X-Forwarded-For` is believed
//!   (default none)
//! - `RATELIMITS_SHADOW`: `off` (default), `on` (every rule in shadow mode: decided, counted
//!   and logged, never refusing), or a comma-separated list of limit names to shadow
//! - `RATELIMITS_PROBLEM_JSON`: `off` (default) or `on`: 429, 400 and 503 bodies as RFC 9457
//!   `application/problem+json`
//! - `RATELIMITS_EXEMPT`: comma-separated CIDRs whose clients bypass every rule (default none;
//!   the client address honours `RATELIMITS_TRUSTED_PROXIES`)
//! - `RATELIMITS_ADMIN_ADDR`: where to serve the admin API (overrides set at run time, buckets
//!   looked at and reset: `docs/operating.md`, "Changing limits while the service runs"), e.g.
//!   `127.0.0.1:3001`; not served when unset. For demonstration only: the caller is whatever
//!   an `x-admin-principal` header says
//! - `RUST_LOG`: what is logged to stderr (default `info`; `tower_ratelimits=debug` logs every
//!   decision)
//!
//! `GET /metrics` answers the Prometheus text format (not rate limited). The two YAML files
//! are watched: an edit takes effect within a second or two, logged with what changed, or
//! refused with its location while the previous limits stay in force (also on SIGHUP).

mod common;

use std::process::ExitCode;

use tower_ratelimits::{Limiter, MemoryBackend};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_memory: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let settings = common::settings()?;
    // Idle buckets are swept in the background (every 10 s): nothing to start.
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(settings.limits.clone(), backend);
    let layer = common::layer_builder(limiter.clone(), &settings)
        .build()
        .map_err(|e| e.to_string())?;
    common::serve(&settings, limiter, layer, "in memory").await
}
