//! The quickstart: an axum app limited per client IP and per IPv6 /48 range, in memory.
//!
//! ```text
//! cargo run --example axum_memory
//! for i in $(seq 1 25); do curl -s -o /dev/null -w "%{http_code} " http://127.0.0.1:3000/; done
//! ```
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`, `RATELIMITS_OVERRIDES`: YAML files (default
//!   `examples/config/defaults.yaml` and `examples/config/overrides.yaml`, which define
//!   `RequestsPerIPAddress` and `RequestsPerIPv6Range`)
//! - `RATELIMITS_TRUSTED_PROXIES`: comma-separated CIDRs whose `X-Forwarded-For` is believed
//!   (default none)

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use axum::{Router, routing::get};
use ipnet::IpNet;
use tower_ratelimits::layer::{ClientIp, Ipv6Range48, RateLimitLayer, Rule};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

fn config_path(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(default))
}

fn trusted_proxies() -> Result<Vec<IpNet>, String> {
    let Ok(text) = std::env::var("RATELIMITS_TRUSTED_PROXIES") else {
        return Ok(Vec::new());
    };
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
                .map_err(|_| format!("RATELIMITS_TRUSTED_PROXIES: {s:?} is not a CIDR"))
        })
        .collect()
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_memory: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), String> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("ADDR: {e}"))?;
    let defaults = config_path("RATELIMITS_DEFAULTS", "examples/config/defaults.yaml");
    let overrides = config_path("RATELIMITS_OVERRIDES", "examples/config/overrides.yaml");
    let limits = Limits::from_yaml_files(&defaults, Some(&overrides)).map_err(|e| e.to_string())?;
    let trusted = trusted_proxies()?;

    let backend = MemoryBackend::new();
    let _sweeper = backend.start_sweeper(Duration::from_secs(10));
    let limiter = Limiter::new(limits, backend);
    let client_ip = ClientIp::new().trusted_proxies(trusted.clone());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("RequestsPerIPAddress", client_ip.clone()))
        .rule(Rule::new(
            "RequestsPerIPv6Range",
            Ipv6Range48::new(client_ip),
        ))
        .build()
        .map_err(|e| e.to_string())?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "listening on http://{addr} (limits from {})",
        defaults.display()
    );
    if !trusted.is_empty() {
        println!("trusting X-Forwarded-For from {trusted:?}");
    }
    println!(
        "try: for i in $(seq 1 25); do curl -s -o /dev/null -w '%{{http_code}} ' http://{addr}/; done; echo"
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .map_err(|e| e.to_string())
}
