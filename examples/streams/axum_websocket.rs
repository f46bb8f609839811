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
//! says); `/echo?push-back` holds a flood at the rate instead of closing it.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::get};
use tower_ratelimits::{AtLimit, Id, LimitedSocket, Limiter, Limits, MemoryBackend, StreamMeter};

/// 5 messages at once per account, then 10 a second; 64 KiB at once, then 62,500 bytes a
/// second.
pub const LIMITS: &str = "\
MessagesPerAccount: {kind: account, burst: 5, count: 10, period: 1s}
BytesPerAccount: {kind: account, burst: 65536, count: 62500, period: 1s}
";

/// The echo service, deciding on `limiter`.
pub fn app(limiter: Limiter) -> Router {
    Router::new().route("/echo", get(echo)).with_state(limiter)
}

async fn echo(
    upgrade: WebSocketUpgrade,
    headers: HeaderMap,
    uri: Uri,
    State(limiter): State<Limiter>,
) -> Response {
    let Some(account) = headers
        .get("x-account")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    else {
        return (StatusCode::UNAUTHORIZED, "x-account").into_response();
    };
    let at_limit = match uri.query() {
        Some("push-back") => AtLimit::PushBack {
            up_to: Duration::from_secs(60),
        },
        _ => AtLimit::End,
    };
    let meter = limiter
        .key("MessagesPerAccount", Id::from(account))
        .and_then(|m| Ok((m, limiter.key("BytesPerAccount", Id::from(account))?)))
        .map_err(|e| e.to_string())
        .and_then(|(messages, bytes)| {
            StreamMeter::builder(&limiter)
                .per_message(messages)
                .per_unit(bytes)
                .at_limit(at_limit)
                .build()
                .map_err(|e| e.to_string())
        });
    match meter {
        Ok(meter) => upgrade.on_upgrade(move |socket| echo_all(socket, meter)),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
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
    axum::serve(listener, app(limiter))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
