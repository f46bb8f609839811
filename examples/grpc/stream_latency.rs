//! What a flood pushed back costs a quiet stream beside it: the round trips of a quiet account's
//! bidirectional stream (one message every 2 ms, echoed) alone, then beside another account
//! flooding its own stream as fast as HTTP/2 lets it (held to its rate by push back), in
//! alternating rounds on one server. Prints each round's p50 and p99 and the ratio of the
//! p99s (BENCHMARKS.md, "Limits inside streams"; the goal: within 1.2x).
//!
//! ```text
//! cargo run --release -p tonic-example --example stream_latency [ROUNDS]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint, Server};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

#[path = "tonic_streams.rs"]
#[allow(dead_code)]
mod example;
use example::{Raw, Streams, StreamsServer};

/// Per account: 1,000 messages a second, 100 at once; one stream at once.
const LIMITS: &str = "\
MessagesPerAccount: {kind: account, burst: 100, count: 1000, period: 1s}
StreamsPerAccount: {kind: account, concurrency: 1, lease: 1m}
";

const QUIET_MESSAGES: usize = 500;

fn request<S>(account: u64, messages: S) -> tonic::Request<S> {
    let mut request = tonic::Request::new(messages);
    let meta = request.metadata_mut();
    meta.insert("x-account", account.to_string().parse().expect("a number"));
    meta.insert("x-at-limit", "push-back".parse().expect("ascii"));
    request
}

fn path() -> http::uri::PathAndQuery {
    http::uri::PathAndQuery::from_static("/test.Streams/Echo")
}

/// The quiet account's round trips: a message every 2 ms, each timed until its echo.
async fn quiet_round(channel: Channel, account: u64) -> Vec<Duration> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let outbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut replies = grpc
        .streaming(request(account, outbound), path(), Raw)
        .await
        .expect("a stream")
        .into_inner();
    let mut times = Vec::with_capacity(QUIET_MESSAGES);
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    for _ in 0..QUIET_MESSAGES {
        tick.tick().await;
        let sent = Instant::now();
        tx.send(Bytes::from_static(b"ping")).await.expect("open");
        replies.next().await.expect("an echo").expect("no error");
        times.push(sent.elapsed());
    }
    times
}

/// A flood as fast as the transport lets it, until aborted; counts its echoes in `echoed`.
async fn flood(channel: Channel, account: u64, echoed: Arc<std::sync::atomic::AtomicU64>) {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let endless = tokio_stream::iter(0u64..).map(|i| Bytes::from(i.to_string()));
    let mut replies = grpc
        .streaming(request(account, endless), path(), Raw)
        .await
        .expect("a stream")
        .into_inner();
    while let Some(Ok(_)) = replies.next().await {
        echoed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn percentile(times: &mut [Duration], p: f64) -> Duration {
    times.sort();
    times[((times.len() as f64 * p).ceil() as usize).clamp(1, times.len()) - 1]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args().nth(1).map_or(Ok(3), |s| s.parse())?;
    let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None)?, MemoryBackend::new());
    let service = StreamsServer(Streams {
        limiter: limiter.clone(),
        taken: Arc::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .layer(example::layer(&limiter))
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))?;
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    let mut account = 10;
    for round in 0..rounds {
        account += 2;
        // Alternate which goes first, so that neither gains from the machine warming up.
        let mut a = Vec::new();
        if round % 2 == 0 {
            a = quiet_round(endpoint.connect().await?, account).await;
        }
        let echoed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let flooding = tokio::spawn(flood(
            endpoint.connect().await?,
            account + 1,
            echoed.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(200)).await; // the flood at its rate
        let start = echoed.load(std::sync::atomic::Ordering::Relaxed);
        let began = Instant::now();
        let mut b = quiet_round(endpoint.connect().await?, account + 100).await;
        let flood_rate = (echoed.load(std::sync::atomic::Ordering::Relaxed) - start) as f64
            / began.elapsed().as_secs_f64();
        flooding.abort();
        if round % 2 == 1 {
            a = quiet_round(endpoint.connect().await?, account).await;
        }
        println!(
            "round {round}: alone p50 {:?} p99 {:?}; beside a flood (echoed {flood_rate:.0}/s) p50 {:?} p99 {:?}",
            percentile(&mut a, 0.5),
            percentile(&mut a, 0.99),
            percentile(&mut b, 0.5),
            percentile(&mut b, 0.99)
        );
        alone.extend(a);
        beside.extend(b);
    }
    let (pa, pb) = (percentile(&mut alone, 0.99), percentile(&mut beside, 0.99));
    println!(
        "all rounds: p99 alone {pa:?}, beside a flood {pb:?}: {:.2}x",
        pb.as_secs_f64() / pa.as_secs_f64()
    );
    Ok(())
}
