//! The streaming examples end to end, over real TCP: a real WebSocket client (tokio-tungstenite)
//! against the WebSocket echo, and a plain HTTP/1.1 client reading the SSE answer. Each example's
//! app is served on an ephemeral port on a manual clock: counts, not times.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

#[path = "../axum_websocket.rs"]
#[allow(dead_code)]
mod websocket;

#[path = "../axum_sse_tokens.rs"]
#[allow(dead_code)]
mod sse;

/// `app` of `limits` on a manual clock, served on 127.0.0.1:0.
async fn serve(
    limits: &str,
    app: fn(Limiter) -> axum::Router,
) -> (std::net::SocketAddr, ManualClock) {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(Limits::from_yaml_str(limits, None).unwrap(), backend);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(limiter)).await.unwrap() });
    (addr, clock)
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(addr: std::net::SocketAddr, account: u64, query: &str) -> Socket {
    let mut request = format!("ws://{addr}/echo{query}")
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("x-account", account.to_string().parse().unwrap());
    tokio_tungstenite::connect_async(request).await.unwrap().0
}

/// The next text or close the server sent (pings skipped).
async fn next(socket: &mut Socket) -> Message {
    loop {
        match socket.next().await.unwrap().unwrap() {
            Message::Ping(_) | Message::Pong(_) => continue,
            other => return other,
        }
    }
}

/// A flood of 20 messages on a stopped clock: 5 echoes (the burst), then a close frame with
/// 1013 and the exact wait in its reason.
#[tokio::test]
async fn a_websocket_flood_is_echoed_to_the_burst_then_closed_with_1013() {
    let (addr, _clock) = serve(websocket::LIMITS, |l| websocket::app(l).unwrap()).await;
    let mut socket = connect(addr, 1, "").await;
    for i in 0..20 {
        let _ = socket.send(Message::text(format!("m{i}"))).await;
    }
    for i in 0..5 {
        assert_eq!(next(&mut socket).await, Message::text(format!("m{i}")));
    }
    match next(&mut socket).await {
        Message::Close(Some(frame)) => {
            assert_eq!(frame.code, CloseCode::from(1013));
            assert_eq!(
                frame.reason.as_str(),
                "rate limit MessagesPerAccount exceeded; retry after 100 ms"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// Push back: on a stopped clock the echo stops at the burst without a close; each token the
/// clock brings lets one more through, and the socket stays open.
#[tokio::test]
async fn a_websocket_pushed_back_stalls_without_a_close() {
    let (addr, clock) = serve(websocket::LIMITS, |l| websocket::app(l).unwrap()).await;
    let mut socket = connect(addr, 2, "?push-back").await;
    for i in 0..8 {
        socket.send(Message::text(format!("m{i}"))).await.unwrap();
    }
    for i in 0..5 {
        assert_eq!(next(&mut socket).await, Message::text(format!("m{i}")));
    }
    for i in 5..8 {
        clock.advance(Duration::from_millis(100));
        assert_eq!(next(&mut socket).await, Message::text(format!("m{i}")));
    }
    socket.close(None).await.unwrap();
}

/// A quiet client of another account gets every message echoed while a flood is held back
/// beside it on the same server.
#[tokio::test]
async fn a_quiet_websocket_beside_a_flood_gets_every_message() {
    let (addr, _clock) = serve(websocket::LIMITS, |l| websocket::app(l).unwrap()).await;
    let mut flood = connect(addr, 3, "?push-back").await;
    for i in 0..200 {
        flood.send(Message::text(format!("f{i}"))).await.unwrap();
    }
    let mut quiet = connect(addr, 4, "").await;
    for i in 0..5 {
        quiet.send(Message::text(format!("q{i}"))).await.unwrap();
        assert_eq!(next(&mut quiet).await, Message::text(format!("q{i}")));
    }
}

/// A message larger than the byte limit's burst (100 KB against 64 KiB) can never pass: the
/// socket is closed with 1009 (message too big) at once, even when it pushes back.
#[tokio::test]
async fn an_oversized_websocket_message_is_closed_with_1009() {
    let (addr, _clock) = serve(websocket::LIMITS, |l| websocket::app(l).unwrap()).await;
    let mut socket = connect(addr, 5, "?push-back").await;
    socket
        .send(Message::binary(vec![0u8; 100_000]))
        .await
        .unwrap();
    match next(&mut socket).await {
        Message::Close(Some(frame)) => assert_eq!(frame.code, CloseCode::from(1009)),
        other => panic!("{other:?}"),
    }
}

/// The account's limit is the rules' (`per: message`), shared by every socket of the account:
/// a second socket of it, opened after the first spent the burst, is closed at its first
/// message; and an upgrade without the account header is refused by the layer with 401
/// before any socket opens.
#[tokio::test]
async fn the_rules_limit_per_message_is_the_accounts_across_its_sockets() {
    let (addr, _clock) = serve(websocket::LIMITS, |l| websocket::app(l).unwrap()).await;
    let mut first = connect(addr, 6, "").await;
    for i in 0..5 {
        first.send(Message::text(format!("a{i}"))).await.unwrap();
        assert_eq!(next(&mut first).await, Message::text(format!("a{i}")));
    }
    let mut second = connect(addr, 6, "").await;
    second.send(Message::text("b0")).await.unwrap();
    match next(&mut second).await {
        Message::Close(Some(frame)) => assert_eq!(frame.code, CloseCode::from(1013)),
        other => panic!("{other:?}"),
    }
    let request = format!("ws://{addr}/echo").into_client_request().unwrap();
    match tokio_tungstenite::connect_async(request).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 401);
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// A POST of `prompt` as `account`, read to its end over a plain HTTP/1.1 connection.
async fn complete(addr: std::net::SocketAddr, account: u64, prompt: &str) -> String {
    complete_with(addr, account, "", prompt).await
}

/// [`complete`] with more header lines (`extra`, each ending in `\r\n`).
async fn complete_with(
    addr: std::net::SocketAddr,
    account: u64,
    extra: &str,
    body: &str,
) -> String {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/complete HTTP/1.1\r\nhost: x\r\nx-account: {account}\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tcp.read_to_end(&mut response).await.unwrap();
    String::from_utf8(response).unwrap()
}

/// The answer of 80 tokens against an output limit of 50: exactly 50 token events are sent,
/// then one `rate-limited` event naming the limit and the wait, and nothing after it.
#[tokio::test]
async fn an_sse_answer_is_cut_at_the_output_limit_with_a_last_event() {
    let (addr, _clock) = serve(sse::LIMITS, |l| sse::app(l).unwrap()).await;
    let response = complete(addr, 1, "tell me a story").await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("content-type: text/event-stream"));
    assert_eq!(
        response.matches("data: {\"token\"").count(),
        50,
        "{response}"
    );
    let last = response
        .split("event: rate-limited\ndata: ")
        .nth(1)
        .unwrap();
    let data: serde_json::Value = serde_json::from_str(last.lines().next().unwrap()).unwrap();
    assert_eq!(data["limiter"], "OutputTokensPerAccount");
    // 50 tokens a minute: the next one in 1.2 s.
    assert_eq!(data["retry_after_ms"], 1200);
    assert!(
        !last.contains("data: {\"token\""),
        "no token after the last event"
    );
}

/// The prompt's tokens count against the input limit before the model starts: 60 words pass,
/// 60 more are refused with 429, `Retry-After` and the reason as JSON.
#[tokio::test]
async fn a_prompt_beyond_the_input_limit_is_refused_before_the_model_starts() {
    let (addr, _clock) = serve(sse::LIMITS, |l| sse::app(l).unwrap()).await;
    let prompt = vec!["word"; 60].join(" ");
    assert!(complete(addr, 2, &prompt).await.starts_with("HTTP/1.1 200"));
    let refused = complete(addr, 2, &prompt).await;
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    assert!(refused.contains("retry-after: 12"), "{refused}");
    assert!(refused.contains("\"limiter\":\"InputTokensPerAccount\""));
}

/// Money is a limit of the same batch: the large model's prompt (5 tokens at 10 micro-dollars)
/// and each answer token (at 40) are charged on the account's 1,000 micro-dollars a minute
/// beside its tokens, so the answer is cut by the spend after 23 tokens (50 + 23 x 40 = 970),
/// long before the output limit of 50; the next prompt (50 more) is refused with 429 naming
/// the spend. The model comes from a JSON body; one the table does not price is refused with
/// 400 before anything is charged.
#[tokio::test]
async fn an_answer_of_the_expensive_model_is_cut_where_its_money_runs_out() {
    let (addr, _clock) = serve(sse::LIMITS, |l| sse::app(l).unwrap()).await;
    let json = "content-type: application/json\r\n";
    let body = r#"{"model": "large", "prompt": "one two three four five"}"#;
    let response = complete_with(addr, 3, json, body).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert_eq!(
        response.matches("data: {\"token\"").count(),
        23,
        "{response}"
    );
    let last = response
        .split("event: rate-limited\ndata: ")
        .nth(1)
        .unwrap();
    let data: serde_json::Value = serde_json::from_str(last.lines().next().unwrap()).unwrap();
    assert_eq!(data["limiter"], "SpendPerAccount");
    let refused = complete_with(addr, 3, json, body).await;
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    assert!(
        refused.contains("\"limiter\":\"SpendPerAccount\""),
        "{refused}"
    );
    let unpriced = complete_with(addr, 4, "x-model: huge\r\n", "hello").await;
    assert!(unpriced.starts_with("HTTP/1.1 400"), "{unpriced}");
    assert!(
        unpriced.contains("no price for model \"huge\""),
        "{unpriced}"
    );
    // The header names the model too: the small one's answer is cut by its output limit.
    let small = complete_with(addr, 4, "x-model: small\r\n", "hello").await;
    assert_eq!(small.matches("data: {\"token\"").count(), 50, "{small}");
}
