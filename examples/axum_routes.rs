//! One layer for a whole app: two routes with different limits, and a route whose cost is
//! only known after the handler ran (reserve, then reconcile), in memory.
//!
//! ```text
//! cargo run --example axum_routes
//! curl -i 'http://127.0.0.1:3000/search?q=rust'
//! curl -i 'http://127.0.0.1:3000/generate?prompt=hello%20world&max_tokens=300'
//! ```
//!
//! - `GET /search`: the limit `SearchesPerIP` (10 a second per client IP).
//! - `GET /generate?prompt=..&max_tokens=N`: the limit `TokensPerIP` (1,000 tokens a minute per
//!   client IP). A request reserves `max_tokens` (default 256) when it is decided; the handler
//!   answers with `x-tokens-used` (here, one token per prompt byte, at most `max_tokens`), and
//!   the unused tokens are refunded before the response leaves: its `RateLimit` field already
//!   shows the settled bucket. `max_tokens` above the burst is a 400.
//!
//! Both rules are in one layer: each request is one all-or-nothing decision, one backend call.
//!
//! Settings (environment), as for `axum_memory`:
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`, `RATELIMITS_OVERRIDES`: YAML files (default
//!   `examples/config/routes.yaml` and `examples/config/routes-overrides.yaml`, which define
//!   `SearchesPerIP` and `TokensPerIP`); watched, reloaded on edit and on SIGHUP
//! - `RATELIMITS_TRUSTED_PROXIES`, `RATELIMITS_SHADOW`, `RATELIMITS_PROBLEM_JSON`,
//!   `RATELIMITS_EXEMPT`, `RUST_LOG`: as in `axum_memory`
//!
//! `GET /metrics` answers the Prometheus text format (not rate limited), with
//! `tower_ratelimits_settlements_total` and `tower_ratelimits_settled_units_total`.

mod common;

use std::process::ExitCode;

use axum::http::{HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::get};
use tower_ratelimits::{Limiter, MemoryBackend, Rule, Settle};

/// What `/generate` reserves when the request does not say.
const DEFAULT_MAX_TOKENS: u64 = 256;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_routes: {e}");
            ExitCode::from(2)
        }
    }
}

/// A query parameter, percent-decoding left out (the demo's values are plain).
fn param<'a>(uri: &'a Uri, name: &str) -> Option<&'a str> {
    uri.query()?
        .split('&')
        .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
}

/// The tokens a request may use: `max_tokens`, or the default when absent or not a number.
fn max_tokens(uri: &Uri) -> u64 {
    param(uri, "max_tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MAX_TOKENS)
}

async fn search(uri: Uri) -> String {
    format!("results for {:?}\n", param(&uri, "q").unwrap_or(""))
}

/// "Generates" one token per prompt byte, at most `max_tokens`, and says how many it used.
async fn generate(uri: Uri) -> Response {
    let prompt = param(&uri, "prompt").unwrap_or("");
    let used = (prompt.len() as u64).min(max_tokens(&uri));
    let mut response = format!("generated {used} tokens\n").into_response();
    response
        .headers_mut()
        .insert("x-tokens-used", HeaderValue::from(used));
    response
}

async fn run() -> Result<(), String> {
    let settings = common::settings_with(
        "examples/config/routes.yaml",
        "examples/config/routes-overrides.yaml",
    )?;
    let limiter = Limiter::new(settings.limits.clone(), MemoryBackend::new());
    let client_ip = settings.client_ip();
    let layer = common::base_builder(limiter.clone(), &settings)
        .rule(settings.rule(
            "SearchesPerIP",
            Rule::new("SearchesPerIP", client_ip.clone()).for_route("/search"),
        ))
        .rule(
            settings.rule(
                "TokensPerIP",
                Rule::new("TokensPerIP", client_ip)
                    .for_route("/generate")
                    .cost_fn(|req| max_tokens(&req.uri))
                    .settle(Settle::header("x-tokens-used")),
            ),
        )
        .build()
        .map_err(|e| e.to_string())?;
    let app = Router::new()
        .route("/search", get(search))
        .route("/generate", get(generate))
        .layer(layer);
    common::serve_app(&settings, limiter, app, "in memory", "/search?q=rust").await
}
