//! What the quickstart examples share: settings from the environment, the rules, serving.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::{Router, routing::get};
use ipnet::IpNet;
use tower_ratelimits::{ClientIp, Ipv6Range48, RateLimitLayerBuilder, Rule};
use tower_ratelimits::{Limiter, Limits, RateLimitLayer};

/// `ADDR`, the YAML files and the trusted proxies.
pub struct Settings {
    pub addr: SocketAddr,
    pub defaults: PathBuf,
    pub limits: Limits,
    pub trusted: Vec<IpNet>,
}

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

/// Reads `ADDR`, `RATELIMITS_DEFAULTS`, `RATELIMITS_OVERRIDES` and
/// `RATELIMITS_TRUSTED_PROXIES`.
pub fn settings() -> Result<Settings, String> {
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("ADDR: {e}"))?;
    let defaults = config_path("RATELIMITS_DEFAULTS", "examples/config/defaults.yaml");
    let overrides = config_path("RATELIMITS_OVERRIDES", "examples/config/overrides.yaml");
    let limits = Limits::from_yaml_files(&defaults, Some(&overrides)).map_err(|e| e.to_string())?;
    Ok(Settings {
        addr,
        defaults,
        limits,
        trusted: trusted_proxies()?,
    })
}

/// The layer builder with the two quickstart rules: per client IP and per IPv6 /48.
pub fn layer_builder(limiter: Limiter, trusted: &[IpNet]) -> RateLimitLayerBuilder {
    let client_ip = ClientIp::new().trusted_proxies(trusted.to_vec());
    RateLimitLayer::builder(limiter)
        .rule(Rule::new("RequestsPerIPAddress", client_ip.clone()))
        .rule(Rule::new(
            "RequestsPerIPv6Range",
            Ipv6Range48::new(client_ip),
        ))
}

/// Serves a hello-world app behind `layer` until Ctrl-C.
pub async fn serve(
    settings: &Settings,
    layer: RateLimitLayer,
    backend: &str,
) -> Result<(), String> {
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind(settings.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.addr))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "listening on http://{addr} (limits from {}, {backend})",
        settings.defaults.display()
    );
    if !settings.trusted.is_empty() {
        println!("trusting X-Forwarded-For from {:?}", settings.trusted);
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
