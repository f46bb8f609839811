//! An axum WebSocket echo with limits inside the socket (feature `websocket`): every message a
//! client sends is counted against its account's limits (messages and bytes) before the
//! handler sees it; a flood is closed with 1013 (try again later) and the exact wait in the
//! close reason.
//!
//! ```text
//! cargo run -p streams-example --example axum_websocket
//! ```
//!
//! It serves `ws://ADDR/echo` (`ADDR` defaults to `127.0.0.1:3001`). The account is the
//! `x-account` header (set it from what your authentication verified, never from what a client
//! says); `/echo?push-back` holds a flood at the rate instead of closing it. The limits are
//! rules of the layer, `per: message` and `per: unit`: the layer finds the account's keys
//! before the upgrade and hands them to the handler (`StreamKeys`).

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router, routing::get};
use tower_ratelimits::{
    AtLimit, LimitedSocket, Limiter, Limits, MemoryBackend, RuleSet, StreamKeys, StreamMeter,
};

/// 5 messages at once per account, then 10 a second; 64 KiB at once, then 62,500 bytes a
/// second.
pub const LIMITS: &str = "\
MessagesPerAccount: {kind: account, burst: 5, count: 10, period: 1s}
BytesPerAccount: {kind: account, burst: 65536, count: 62500, period: 1s}
";

/// The rules: both limits count the messages inside a socket (`per: message`, `per: unit`:
/// its bytes), keyed by the account; a socket ends at a limit; an upgrade without an account
/// is refused with 401 before the handler runs.
pub const RULES: &str = "\
- {limit: MessagesPerAccount, key: 'header:x-account', per: message, at_limit: end, on_missing_key: 401}
- {limit: BytesPerAccount, key: 'header:x-account', per: unit, at_limit: end, on_missing_key: 401}
";

/// The echo service, deciding on `limiter`: the layer finds each upgrade's keys (`RULES`),
/// the handler meters the socket with them.
pub fn app(limiter: Limiter) -> Result<Router, Box<dyn std::error::Error>> {
    let layer = RuleSet::from_yaml_str(RULES)?.layer(limiter)?;
    Ok(Router::new().route("/echo", get(echo)).layer(layer))
}

async fn echo(
    upgrade: WebSocketUpgrade,
    uri: Uri,
    keys: Option<Extension<StreamKeys>>,
) -> Response {
    // The rules refuse a request without the account header: every upgrade here has keys.
    let Some(Extension(keys)) = keys else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "no stream keys").into_response();
    };
    let meter = match uri.query() {
        Some("push-back") => keys.meter().at_limit(AtLimit::PushBack {
            up_to: Duration::from_secs(60),
        }),
        _ => keys.meter(),
    };
    match meter.build() {
        Ok(meter) => upgrade.on_upgrade(move |socket| echo_all(socket, meter)),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Echoes every message the meter admits, until the client or a limit closes the socket.
async fn echo_all(socket: WebSocket, meter: StreamMeter) {
    let mut socket = LimitedSocket::new(socket, meter);
    while let Some(Ok(message)) = socket.recv().await {
        if socket.send(message).await.is_err() {
            break;
        }
    }
    if let Some(why) = socket.ended() {
        println!("closed a socket: {why}");
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3001".into())
        .parse()?;
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None)?, MemoryBackend::new());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("serving ws://{}/echo", listener.local_addr()?);
    axum::serve(listener, app(limiter)?)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
