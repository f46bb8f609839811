//! A login limited by its failures, per account and per address, with bans that grow: five
//! failed logins within ten minutes ban the account for a minute, the next time for five, then
//! 25, up to a day (`docs/penalties.md`). Successes count nothing; a banned account is refused
//! before the login runs, even with the right password, and told when the ban ends.
//!
//! ```text
//! cargo run --example axum_login
//! curl -s -w '%{stderr}%{http_code} ' -X POST -H 'x-account: ann' -H 'x-password: guess' \
//!   'http://127.0.0.1:3000/login?[1-7]' >/dev/null; echo
//! # 401 401 401 401 401 429 429
//! curl -i -X POST -H 'x-account: ann' -H 'x-password: hunter2' http://127.0.0.1:3000/login
//! # 429, Retry-After: 60, {"errors":[{"code":"TOOMANYREQUESTS","detail":{..,"banned":true}}]}
//! ```
//!
//! The login is a stand-in: `x-account` names the account, `x-password: hunter2` is right,
//! anything else is a 401.
//!
//! Settings (environment), as `axum_memory`'s:
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`, `RATELIMITS_OVERRIDES`: YAML files (default
//!   `examples/config/login.yaml` and `examples/config/login-overrides.yaml`, which define
//!   `FailedLoginsPerAccount` and `FailedLoginsPerAddress`)
//! - `RATELIMITS_TRUSTED_PROXIES`, `RATELIMITS_SHADOW`, `RATELIMITS_PROBLEM_JSON`,
//!   `RATELIMITS_EXEMPT`, `RATELIMITS_ADMIN_ADDR`, `RUST_LOG`: as in `axum_memory`
//!
//! `GET /metrics` counts the bans by level (`tower_ratelimits_bans_total`).

mod common;

use std::process::ExitCode;

use axum::http::{HeaderMap, StatusCode};
use axum::{Router, routing::post};
use tower_ratelimits::{CountWhen, Header, Limiter, MemoryBackend, Rule};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_login: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let settings = common::settings_with(
        "examples/config/login.yaml",
        "examples/config/login-overrides.yaml",
    )?;
    let limiter = Limiter::new(settings.limits.clone(), MemoryBackend::new());
    // A failed login is a 401; nothing else counts.
    let failed = || CountWhen::new().status(401, 1);
    let rule = |name: &str, rule: Rule| settings.rule(name, rule.count_when(failed()));
    let layer = common::base_builder(limiter.clone(), &settings)
        .rule(rule(
            "FailedLoginsPerAccount",
            Rule::new("FailedLoginsPerAccount", Header::new("x-account")),
        ))
        .rule(rule(
            "FailedLoginsPerAddress",
            Rule::new("FailedLoginsPerAddress", settings.client_ip()),
        ))
        .build()
        .map_err(|e| e.to_string())?;
    let app = Router::new().route("/login", post(login)).layer(layer);
    common::serve_app(&settings, limiter, app, "in memory", "/login").await
}

/// The stand-in login: `x-password: hunter2` is right.
async fn login(headers: HeaderMap) -> (StatusCode, &'static str) {
    match headers.get("x-password").map(|v| v.as_bytes()) {
        Some(b"hunter2") => (StatusCode::OK, "welcome\n"),
        _ => (StatusCode::UNAUTHORIZED, "wrong account or password\n"),
    }
}
