//! The smallest tonic app behind the layer, as the README shows it: one limit per client IP.
//!
//! ```text
//! cargo run -p tonic-example --example tonic_smallest
//! ```

use std::time::Duration;
use tonic::transport::Server;
use tower_ratelimits::{Limit, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 20 calls at once per client IP, then 10 per second (the feature `tonic` reads the peer).
    let layer = RateLimitLayer::per_client_ip(Limit::new(20, 10, Duration::from_secs(1))?)?;
    let (_reporter, health) = tonic_health::server::health_reporter(); // your service here
    Server::builder()
        .layer(layer)
        .add_service(health)
        .serve("127.0.0.1:50051".parse()?)
        .await?;
    Ok(())
}
