//! A tonic gRPC server behind the rate limit layer, and a client that runs into it.
//!
//! ```text
//! cargo run -p tonic-example --example tonic_grpc
//! ```
//!
//! The server is the standard gRPC health service (no protobuf compiler needed), limited to 3
//! calls per client IP per 3 seconds.
//!
//! - Without `ADDR`: a self-contained demo. The server listens on a free loopback port and a
//!   client calls it 5 times: the last two get `Code::ResourceExhausted`, with the exact delay
//!   in the standard `RetryInfo` error detail (read through `tonic-types`) and the `retry-after`
//!   metadata.
//! - With `ADDR` (e.g. `ADDR=127.0.0.1:50051`): it serves the rate-limited health service there
//!   until stopped (Ctrl-C or SIGTERM), so any gRPC client can call it
//!   (`grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check`).

use std::net::SocketAddr;

use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tonic_types::StatusExt as _;
use tower_ratelimits::{ClientIp, RateLimitLayer, Rule};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve_only = std::env::var_os("ADDR").is_some();
    let addr: SocketAddr = match std::env::var("ADDR") {
        Ok(addr) => addr.parse().map_err(|e| format!("ADDR {addr:?}: {e}"))?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
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
    let server = Server::builder().layer(layer).add_service(health);
    println!("gRPC health service on {addr}, 3 calls per 3 seconds per IP");
    if serve_only {
        server
            .serve_with_incoming_shutdown(incoming, stopped())
            .await?;
        return Ok(());
    }
    tokio::spawn(server.serve_with_incoming(incoming));

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
                "call {i}: {:?}: {} (RetryInfo: {:?}; retry-after: {:?})",
                status.code(),
                status.message(),
                status
                    .get_error_details()
                    .retry_info()
                    .and_then(|r| r.retry_delay),
                status.metadata().get("retry-after")
            ),
        }
    }
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn stopped() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
