//! An LLM-style endpoint whose answer streams as server-sent events, metered in tokens (feature
//! `stream`): the prompt's tokens are counted against the account's input limit before the
//! model starts, and each event of the answer against its output limit before it is sent. An
//! answer that reaches the output limit is cut at the event that would pass it: no token
//! beyond the limit is sent, and a last `rate-limited` event says why and when to come back.
//!
//! ```text
//! cargo run -p streams-example --example axum_sse_tokens
//! curl -N -H 'x-account: 7' -d 'tell me a long story' http://127.0.0.1:3002/v1/complete
//! ```
//!
//! `ADDR` defaults to `127.0.0.1:3002`. The account is the `x-account` header (set it from what
//! your authentication verified). The "model" answers with the prompt's words, over and over,
//! one token an event: `data: {"token":"..","tokens":1}`.
//!
//! Money is a third limit: each model has a price per million input and output tokens
//! (`PRICES`, integer micro-dollars), and the account may spend so much a minute. The prompt's
//! tokens and their price are one batch (both pass or the request is refused), each answer
//! event's tokens and their price another: an answer of the expensive model is cut where its
//! money runs out. The model is the `x-model` header (`small` by default), or the `model` of a
//! JSON body `{"model": "large", "prompt": ".."}`; a model the table does not price is refused
//! with 400.

use std::convert::Infallible;
use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::StreamBody;
use tower_ratelimits::{AtLimit, Id, Limiter, Limits, MemoryBackend, MeteredBody, Overrun};
use tower_ratelimits::{ModelPrice, PriceTable, StreamLimited, StreamMeter, UnitPrice};

/// Per account: 100 prompt tokens a minute, 50 answer tokens a minute, 1,000 micro-dollars a
/// minute (bursts as large).
pub const LIMITS: &str = "\
InputTokensPerAccount: {kind: account, burst: 100, count: 100, period: 1m}
OutputTokensPerAccount: {kind: account, burst: 50, count: 50, period: 1m}
SpendPerAccount: {kind: account, burst: 1000, count: 1000, period: 1m}
";

/// Micro-dollars per million tokens: `small` costs 1 micro-dollar an input token and 2 an
/// output token, `large` 10 and 40.
pub const PRICES: &str = "\
per_tokens: 1000000
models:
  small: {input: 1000000, output: 2000000}
  large: {input: 10000000, output: 40000000}
";

/// How many tokens the "model" answers with.
pub const ANSWER_TOKENS: usize = 80;

/// What the endpoint decides with: the limiter and the price table.
#[derive(Clone)]
pub struct Pricing {
    limiter: Limiter,
    prices: std::sync::Arc<PriceTable>,
}

/// The endpoint, deciding on `limiter`, pricing with `PRICES` (an error if the table does not
/// read: an endpoint without prices would meter money at 0).
pub fn app(limiter: Limiter) -> Result<Router, Box<dyn std::error::Error>> {
    let prices = PriceTable::from_yaml_str(PRICES)?;
    Ok(Router::new()
        .route("/v1/complete", post(complete))
        .with_state(Pricing {
            limiter,
            prices: std::sync::Arc::new(prices),
        }))
}

/// A meter of `limit`'s tokens and their price (at `price`) on the account's spend, for
/// `account`, ending at the first limit without room.
fn meter(
    limiter: &Limiter,
    limit: &str,
    price: UnitPrice,
    account: u64,
) -> Result<StreamMeter, String> {
    let tokens = limiter
        .key(limit, Id::from(account))
        .map_err(|e| e.to_string())?;
    let spend = limiter
        .key("SpendPerAccount", Id::from(account))
        .map_err(|e| e.to_string())?;
    StreamMeter::builder(limiter)
        .per_unit(tokens)
        .per_unit_at(spend, price)
        .at_limit(AtLimit::End)
        .build()
        .map_err(|e| e.to_string())
}

/// The request's model and prompt: a JSON body's `model` and `prompt`, else the `x-model`
/// header (`small` without one) and the body as the prompt.
fn model_and_prompt(headers: &HeaderMap, body: String) -> (String, String) {
    let json = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if json && let Ok(value) = serde_json::from_str::<serde_json::Value>(&body) {
        let field = |name: &str| {
            value
                .get(name)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_owned()
        };
        return (field("model"), field("prompt"));
    }
    let model = headers
        .get("x-model")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("small");
    (model.to_owned(), body)
}

async fn complete(State(pricing): State<Pricing>, headers: HeaderMap, body: String) -> Response {
    let Some(account) = headers
        .get("x-account")
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    else {
        return (StatusCode::UNAUTHORIZED, "x-account").into_response();
    };
    let (model, prompt) = model_and_prompt(&headers, body);
    let Some(price): Option<ModelPrice> = pricing.prices.model(&model) else {
        return (
            StatusCode::BAD_REQUEST,
            format!("no price for model {model:?}"),
        )
            .into_response();
    };
    let limiter = &pricing.limiter;
    let words: Vec<String> = prompt.split_whitespace().map(str::to_owned).collect();
    let (input, output) = match (
        meter(limiter, "InputTokensPerAccount", price.input(), account),
        meter(limiter, "OutputTokensPerAccount", price.output(), account),
    ) {
        (Ok(input), Ok(output)) => (input, output),
        (Err(e), _) | (_, Err(e)) => return (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    };
    // The prompt's tokens and their price, one batch, before the model starts.
    let mut input = input;
    if let Err(why) = input.admit(words.len() as u64).await {
        let mut answer = (StatusCode::TOO_MANY_REQUESTS, why.json()).into_response();
        if let Some(wait) = why.retry_after() {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            answer
                .headers_mut()
                .insert(header::RETRY_AFTER, secs.max(1).into());
        }
        return answer;
    }
    if words.is_empty() {
        return (StatusCode::BAD_REQUEST, "an empty prompt").into_response();
    }
    let events = (0..ANSWER_TOKENS).map(move |i| {
        let event = serde_json::json!({"token": words[i % words.len()], "tokens": 1});
        Ok::<_, Infallible>(Frame::data(Bytes::from(format!("data: {event}\n\n"))))
    });
    let answer = StreamBody::new(futures_util::stream::iter(events));
    let metered = MeteredBody::new(answer, output, Overrun::Cut)
        .units(event_tokens)
        .on_end(|why: &StreamLimited| {
            let event = format!("event: rate-limited\ndata: {}\n\n", why.json());
            Some(Frame::data(Bytes::from(event)))
        });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::new(metered))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// An event's tokens: the `tokens` of its JSON data (`None`, an event it cannot read: the body
/// ends before it, so nothing unmetered is sent).
fn event_tokens(event: &Bytes) -> Option<u64> {
    let text = std::str::from_utf8(event).ok()?;
    let data = text.strip_prefix("data: ")?.trim_end();
    let value: serde_json::Value = serde_json::from_str(data).ok()?;
    value.get("tokens")?.as_u64()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3002".into())
        .parse()?;
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None)?, MemoryBackend::new());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("serving http://{}/v1/complete", listener.local_addr()?);
    axum::serve(listener, app(limiter)?)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
