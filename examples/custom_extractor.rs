//! Keying by who the client *is*: an authentication layer puts the account it verified into
//! the request's extensions, and the rate limit rule reads it from there.
//!
//! ```text
//! cargo run --example custom_extractor
//! # 5 calls per 10 s per account; other accounts and other clients are not affected
//! curl -s -w '%{stderr}%{http_code} ' -H 'authorization: Bearer alice-token' 'http://127.0.0.1:3000/?[1-7]' >/dev/null; echo
//! curl -i -H 'authorization: Bearer bob-token' http://127.0.0.1:3000/
//! curl -i http://127.0.0.1:3000/        # 401 from the authentication layer
//! ```
//!
//! Keying by a header the client writes itself (`x-account-id`) would let any client spend
//! another's quota; an identity the server verified cannot be forged that way. Account ids
//! here are UUIDs, so the limit's kind is `any` (`account` is for numeric ids).
//!
//! Settings: `ADDR` (default `127.0.0.1:3000`).

use std::process::ExitCode;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::get};
use tower_ratelimits::{
    Id, KeyError, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule, key_fn,
};

/// The account the authentication layer verified.
#[derive(Clone)]
struct AccountId(&'static str);

/// A stand-in for real authentication (sessions, JWTs, API keys).
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let account = match token {
        Some("alice-token") => "6f1c2a7e-0b1d-4c1e-9a55-2b8e7f3d9c01",
        Some("bob-token") => "d2a94b3c-5e6f-4a70-8b12-9c3d4e5f6a7b",
        _ => return (StatusCode::UNAUTHORIZED, "who are you?\n").into_response(),
    };
    req.extensions_mut().insert(AccountId(account));
    next.run(req).await
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("custom_extractor: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let limits = Limits::from_yaml_str(
        "ApiCallsPerAccount: {kind: any, burst: 5, count: 5, period: 10s}\n",
        None,
    )?;
    let limiter = Limiter::new(limits, MemoryBackend::new());
    let per_account = Rule::new(
        "ApiCallsPerAccount",
        key_fn(|req| match req.extensions.get::<AccountId>() {
            Some(AccountId(id)) => Ok(Some(
                Id::new(id).map_err(|e| KeyError::internal(e.to_string()))?,
            )),
            // The authentication layer runs first; no account here is a set-up mistake.
            None => Err(KeyError::internal("no verified account in the request")),
        }),
    );
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        // Layers run outside-in from the last added: authenticate, then rate-limit.
        .layer(RateLimitLayer::new(limiter, [per_account])?)
        .layer(middleware::from_fn(authenticate));
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("custom_extractor: listening on http://{addr} (5 calls per 10 s per account)");
    axum::serve(listener, app).await?;
    Ok(())
}
