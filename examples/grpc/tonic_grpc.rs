//! A tonic gRPC server behind the rate limit layer, and a client that runs into it.
//!
//! ```text
//! cargo run -p tonic-example --example tonic_grpc
//! ```
//!
//! The server is the standard gRPC health service (no protobuf compiler needed), limited to 3
//! calls per client IP per 3 seconds. The client calls it 5 times: the last two get
//! `Code::ResourceExhausted` with the retry hint in the `retry-after` metadata.
//!
//! Settings: `ADDR` (default `127.0.0.1:50051`).

use std::net::SocketAddr;

use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tower_ratelimits::{ClientIp, RateLimitLayer, Rule};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:50051".into())
        .parse()?;
    let limits = Limits::from_yaml_str(
        "GrpcCallsPerIPAddress: {kind: ip, burst: 3, count: 3, period: 3s}\n",
        None,
    )?;
    let limiter = Limiter::new(limits, MemoryBackend::new());
    let layer = RateLimitLayer::new(
        limiter,
        [Rule::new("GrpcCallsPerIPAddress", ClientIp::new())],
    )?;

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(incoming),
    );
    println!("gRPC health service on {addr}, 3 calls per 3 seconds per IP");

    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);
    for i in 1..=5 {
        match client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
        {
            Ok(r) => println!("call {i}: {:?}", r.into_inner().status()),
            Err(status) => println!(
                "call {i}: {:?}: {} (retry-after: {:?})",
                status.code(),
                status.message(),
                status.metadata().get("retry-after")
            ),
        }
    }
    Ok(())
}
