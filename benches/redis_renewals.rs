//! Lease renewals on Redis: the store calls a second that requests in
//! flight cost while they hold concurrency slots.
//!
//! `cargo bench -p tower-ratelimits-benches --bench redis_renewals -- --requests 2000 --keys 4`
//!
//! `--requests` requests (spread over `--keys` accounts, a limit of as many slots each, a lease
//! of 3 s: renewed every second) are admitted through the layer and held (their bodies never
//! end); then the store's calls (`INFO commandstats`, after `CONFIG RESETSTAT`) are counted
//! over 10 seconds. Before, each request renewed its own lease: one script call per
//! request a second.
//!
//! Uses `--url` (or `REDIS_URL`) when given, otherwise spawns a `redis-server` on a free
//! loopback port.

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::convert::Infallible;
use std::time::Duration;

use axum::{Router, body::Body, routing::get};
use fred::prelude::ClientLike;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_ratelimits::{Header, Limiter, Limits, RateLimitLayer, RedisBackend, Rule};

/// A body that ends when its sender is dropped.
struct Held(mpsc::Receiver<Result<bytes::Bytes, Infallible>>);

impl http_body::Body for Held {
    type Data = bytes::Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|f| f.map(|r| r.map(http_body::Frame::data)))
    }
}

async fn script_calls(client: &fred::clients::Client) -> (u64, u64) {
    let info: String = client
        .custom(fred::cmd!("INFO"), vec!["commandstats"])
        .await
        .unwrap();
    let mut calls = (0, 0);
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let n: u64 = fields
            .split(',')
            .find_map(|f| f.strip_prefix("calls="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if name == "evalsha" || name == "eval" {
            calls.0 += n;
        }
        if name != "info" && name != "config|resetstat" {
            calls.1 += n;
        }
    }
    calls
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| common::arg(&args, flag);
    let requests: u64 = arg("--requests").map_or(2_000, |s| s.parse().expect("--requests N"));
    let keys: u64 = arg("--keys").map_or(4, |s| s.parse().expect("--keys N"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_server, url) = match arg("--url").or_else(|| std::env::var("REDIS_URL").ok()) {
        Some(url) => (None, url),
        None => {
            let s = redis_support::RedisServer::start();
            let url = s.url();
            (Some(s), url)
        }
    };
    rt.block_on(async move {
        let client = fred::prelude::Builder::from_config(
            fred::prelude::Config::from_url(&url).expect("a Redis URL"),
        )
        .build()
        .unwrap();
        client.init().await.unwrap();
        let backend = RedisBackend::from_url(&url)
            .prefix(format!("renewals{}:", std::process::id()))
            .connect()
            .await
            .unwrap();
        let per_key = requests.div_ceil(keys);
        let yaml = format!("Streams: {{kind: account, concurrency: {per_key}, lease: 3s}}\n");
        let limiter = Limiter::new(Limits::from_yaml_str(&yaml, None).unwrap(), backend);
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("Streams", Header::new("x-account")))
            .build()
            .unwrap();
        let (feed, _) = tokio::sync::broadcast::channel::<()>(1);
        let senders = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = senders.clone();
        let app = Router::new()
            .route(
                "/stream",
                get(move || {
                    let kept = kept.clone();
                    async move {
                        let (tx, rx) = mpsc::channel(1);
                        kept.lock().unwrap().push(tx);
                        Body::new(Held(rx))
                    }
                }),
            )
            .layer(layer);
        let mut held = Vec::with_capacity(requests as usize);
        for i in 0..requests {
            let response = app
                .clone()
                .oneshot(
                    http::Request::get("/stream")
                        .header("x-account", (i % keys).to_string())
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "request {i}");
            held.push(response);
        }
        let _: String = client
            .custom(fred::cmd!("CONFIG"), vec!["RESETSTAT"])
            .await
            .unwrap();
        let window = Duration::from_secs(10);
        tokio::time::sleep(window).await;
        let (scripts, all) = script_calls(&client).await;
        println!(
            "{requests} requests in flight over {keys} keys (lease 3 s): {:.1} script calls a second, {:.1} commands a second (the store's own count over {} s)",
            scripts as f64 / window.as_secs_f64(),
            all as f64 / window.as_secs_f64(),
            window.as_secs()
        );
        drop(held);
        drop(senders);
        drop(feed);
        let _ = client.quit().await;
    });
}
