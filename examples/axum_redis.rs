//! The quickstart on Redis: the same app as `axum_memory`, with its limits kept in Redis (or a
//! Redis Cluster), so that every instance of the app shares them.
//!
//! ```text
//! cargo run --example axum_redis --features redis
//! ADDR=127.0.0.1:3001 cargo run --example axum_redis --features redis   # a second instance
//! curl -s -w '%{stderr}%{http_code} ' 'http://127.0.0.1:3000/?[1-25]' >/dev/null; echo
//! curl -s -w '%{stderr}%{http_code} ' 'http://127.0.0.1:3001/?[1-25]' >/dev/null; echo
//! ```
//!
//! Settings (environment): those of `axum_memory` (`ADDR`, `RATELIMITS_DEFAULTS`,
//! `RATELIMITS_OVERRIDES`, `RATELIMITS_TRUSTED_PROXIES`, `RATELIMITS_SHADOW`, `RATELIMITS_PROBLEM_JSON`, `RATELIMITS_EXEMPT`, `RATELIMITS_ADMIN_ADDR`, `RUST_LOG`;
//! `GET /metrics`; the YAML files are watched and reloaded; the admin API's overrides are kept
//! in Redis, so a change through one instance's admin API applies on all), plus
//! - `REDIS_URL`: `redis://`, `rediss://` or `redis-cluster://` URL (default
//!   `redis://127.0.0.1:6379`)
//! - `RATELIMITS_ON_BACKEND_ERROR`: `open` (default: let requests through when Redis cannot
//!   answer), `closed` (answer 503) or `memory:<percent>` (decide in this instance's memory at
//!   that share of every limit, e.g. `memory:50` for two instances)
//! - `RATELIMITS_DENY_CACHE`: `on` (default: a key denied until a known instant is answered
//!   locally until then, without asking Redis) or `off`
//! - `RATELIMITS_REGION` and `RATELIMITS_GLOBAL_REDIS_URL` (both, or neither): regional mode
//!   (`docs/regions.md`). `REDIS_URL` stays the store that decides, this region's own; the
//!   limits marked `across_regions: true` are one limit for every region, their shares moving
//!   through the global store (keys under the prefix `rlg:` there). A region is named by 1 to
//!   32 letters, digits, `-` or `_`

mod common;

use std::process::ExitCode;

use tower_ratelimits::FailurePolicy;
use tower_ratelimits::{Limiter, RedisBackend};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_redis: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let settings = common::settings()?;
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let policy = match std::env::var("RATELIMITS_ON_BACKEND_ERROR").as_deref() {
        Err(_) | Ok("open") => FailurePolicy::FailOpen,
        Ok("closed") => FailurePolicy::FailClosed,
        Ok(other) => match other.strip_prefix("memory:").map(str::parse::<u8>) {
            Some(Ok(percent)) if (1..=100).contains(&percent) => {
                FailurePolicy::FallbackToMemory { percent }
            }
            _ => {
                return Err(format!(
                    "RATELIMITS_ON_BACKEND_ERROR: {other:?} is not `open`, `closed` or `memory:<1-100>`"
                ));
            }
        },
    };
    let deny_cache = match std::env::var("RATELIMITS_DENY_CACHE").as_deref() {
        Err(_) | Ok("on") => true,
        Ok("off") => false,
        Ok(other) => {
            return Err(format!(
                "RATELIMITS_DENY_CACHE: {other:?} is neither `on` nor `off`"
            ));
        }
    };
    // A single server is connected in the background: the app starts while Redis is still
    // coming up (failing open or closed, as configured, while it is unreachable); a request
    // that arrives while Redis answers but the stored overrides are not read yet waits for
    // that read (`ready_wait`). A cluster's topology is read now.
    let lazy = |url: &str| !url.contains("-cluster://");
    let mut builder = RedisBackend::from_url(url.as_str())
        .deny_cache(deny_cache)
        .lazy(lazy(&url));
    let region = std::env::var("RATELIMITS_REGION").ok();
    let global_url = std::env::var("RATELIMITS_GLOBAL_REDIS_URL").ok();
    let regional = match (region, global_url) {
        (Some(region), Some(global_url)) => {
            let global = RedisBackend::from_url(global_url.as_str())
                .prefix("rlg:")
                .lazy(lazy(&global_url))
                .connect()
                .await
                .map_err(|e| format!("RATELIMITS_GLOBAL_REDIS_URL: {global_url}: {e}"))?;
            builder = builder.regional(region.as_str(), global);
            format!(", region {region} (global store {global_url})")
        }
        (None, None) => String::new(),
        _ => {
            return Err(
                "RATELIMITS_REGION and RATELIMITS_GLOBAL_REDIS_URL: set both (regional mode) or neither"
                    .into(),
            );
        }
    };
    let backend = builder.connect().await.map_err(|e| format!("{url}: {e}"))?;
    let limiter = Limiter::new(settings.limits.clone(), backend.clone());
    let layer = common::layer_builder(limiter.clone(), &settings)
        .on_backend_failure(policy)
        .build()
        .map_err(|e| e.to_string())?;
    common::serve(
        &settings,
        limiter,
        layer,
        &format!(
            "on {url}{regional}, failing {policy:?}, deny cache {}",
            if deny_cache { "on" } else { "off" }
        ),
    )
    .await?;
    // Stopped taking requests: the tokens of limits with `prefetch` this instance did not use
    // go back to Redis for the other instances.
    if let Err(e) = backend.return_prefetched().await {
        eprintln!("axum_redis: prefetched tokens not given back: {e}");
    }
    Ok(())
}
