//! What the quickstart examples share: settings from the environment, the rules, serving.
//!
//! Built from the published package, the examples have the crate's default features only:
//! the file watcher (feature `reload`), the admin API (`admin`) and the layer's counters on
//! `/metrics` (`metrics`) are then left out, and the example says which feature brings each
//! (`cargo run --example axum_memory --features reload,admin,metrics`). In the repository the
//! dev-dependencies turn them on.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::{Router, routing::get};
use ipnet::IpNet;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tower_ratelimits::{ClientIp, Ipv6Range48, RateLimitLayerBuilder, Rule};
use tower_ratelimits::{ErrorBody, Limiter, Limits, RateLimitLayer};

/// `ADDR`, the YAML files, the trusted proxies, shadow mode, and the metrics exporter.
pub struct Settings {
    pub addr: SocketAddr,
    pub defaults: PathBuf,
    pub overrides: PathBuf,
    pub limits: Limits,
    pub trusted: Vec<IpNet>,
    pub shadow: Shadow,
    pub problem_json: bool,
    pub exempt: Vec<IpNet>,
    pub metrics: PrometheusHandle,
    /// `RATELIMITS_ADMIN_ADDR`: where the admin router listens (nowhere when unset).
    pub admin_addr: Option<SocketAddr>,
}

/// `RATELIMITS_SHADOW`: `off` (default), `on` (every rule), or a comma-separated list of limit
/// names to shadow.
pub enum Shadow {
    Off,
    All,
    Names(Vec<String>),
}

impl Shadow {
    fn from_env(limits: &Limits) -> Result<Self, String> {
        let text = match std::env::var("RATELIMITS_SHADOW") {
            Err(std::env::VarError::NotPresent) => return Ok(Shadow::Off),
            Err(_) => return Err("RATELIMITS_SHADOW: not UTF-8".into()),
            Ok(text) => text,
        };
        match text.trim() {
            "" | "off" => Ok(Shadow::Off),
            "on" => Ok(Shadow::All),
            list => {
                let names: Vec<String> = list
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(str::to_owned)
                    .collect();
                if let Some(unknown) = names.iter().find(|n| limits.name(n).is_none()) {
                    return Err(format!(
                        "RATELIMITS_SHADOW: {unknown:?} is not a configured limit (use `off`, `on` or limit names)"
                    ));
                }
                Ok(Shadow::Names(names))
            }
        }
    }

    pub fn covers(&self, name: &str) -> bool {
        match self {
            Shadow::Off => false,
            Shadow::All => true,
            Shadow::Names(names) => names.iter().any(|n| n == name),
        }
    }
}

/// `RATELIMITS_PROBLEM_JSON`: `off` (default) or `on`.
fn problem_json() -> Result<bool, String> {
    match std::env::var("RATELIMITS_PROBLEM_JSON").as_deref() {
        Err(_) | Ok("off") => Ok(false),
        Ok("on") => Ok(true),
        Ok(other) => Err(format!(
            "RATELIMITS_PROBLEM_JSON: {other:?} is neither `on` nor `off`"
        )),
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`): a level, `target=level` pairs, or
/// both, comma-separated (`info,tower_ratelimits=debug`).
fn init_logging() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt as _;
    let default = || Targets::new().with_default(LevelFilter::INFO);
    let filter = match std::env::var("RUST_LOG") {
        Err(_) => default(),
        Ok(text) => text.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("RUST_LOG={text:?}: {e}; logging at info");
            default()
        }),
    };
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .finish()
        .with(filter);
    let _ = tracing::subscriber::set_global_default(logs);
}

/// Installs the Prometheus recorder (before any layer is built: rules register their
/// counters when built).
fn install_metrics() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0,
            ],
        )
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| format!("metrics: {e}"))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

fn config_path(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(default))
}

fn trusted_proxies() -> Result<Vec<IpNet>, String> {
    cidrs("RATELIMITS_TRUSTED_PROXIES")
}

/// A comma-separated list of CIDRs (or addresses) from `var`; none when unset.
fn cidrs(var: &str) -> Result<Vec<IpNet>, String> {
    let Ok(text) = std::env::var(var) else {
        return Ok(Vec::new());
    };
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
                .map_err(|_| format!("{var}: {s:?} is not a CIDR"))
        })
        .collect()
}

/// Starts logging and metrics, and reads `ADDR`, `RATELIMITS_DEFAULTS`,
/// `RATELIMITS_OVERRIDES`, `RATELIMITS_TRUSTED_PROXIES`, `RATELIMITS_SHADOW`,
/// `RATELIMITS_PROBLEM_JSON` and `RATELIMITS_EXEMPT`.
pub fn settings() -> Result<Settings, String> {
    settings_with(
        "examples/config/defaults.yaml",
        "examples/config/overrides.yaml",
    )
}

/// [`settings`] with other default YAML files (relative to the crate).
pub fn settings_with(defaults: &str, overrides: &str) -> Result<Settings, String> {
    init_logging();
    let metrics = install_metrics()?;
    let addr: SocketAddr = std::env::var("ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| format!("ADDR: {e}"))?;
    let defaults = config_path("RATELIMITS_DEFAULTS", defaults);
    let overrides = config_path("RATELIMITS_OVERRIDES", overrides);
    let limits = Limits::from_yaml_files(&defaults, Some(&overrides)).map_err(|e| e.to_string())?;
    let admin_addr = match std::env::var("RATELIMITS_ADMIN_ADDR") {
        Ok(text) => Some(
            text.parse()
                .map_err(|e| format!("RATELIMITS_ADMIN_ADDR: {e}"))?,
        ),
        Err(std::env::VarError::NotPresent) => None,
        Err(_) => return Err("RATELIMITS_ADMIN_ADDR: not UTF-8".into()),
    };
    Ok(Settings {
        admin_addr,
        addr,
        shadow: Shadow::from_env(&limits)?,
        problem_json: problem_json()?,
        exempt: cidrs("RATELIMITS_EXEMPT")?,
        defaults,
        overrides,
        limits,
        trusted: trusted_proxies()?,
        metrics,
    })
}

/// The layer builder with the two quickstart rules: per client IP and per IPv6 /48, each
/// shadowed when `RATELIMITS_SHADOW` says so.
pub fn layer_builder(limiter: Limiter, settings: &Settings) -> RateLimitLayerBuilder {
    let client_ip = settings.client_ip();
    let rule = |name: &str, rule: Rule| settings.rule(name, rule);
    base_builder(limiter, settings)
        .rule(rule(
            "RequestsPerIPAddress",
            Rule::new("RequestsPerIPAddress", client_ip.clone()),
        ))
        .rule(rule(
            "RequestsPerIPv6Range",
            Rule::new("RequestsPerIPv6Range", Ipv6Range48::new(client_ip)),
        ))
}

impl Settings {
    /// The client address: the peer, or what `RATELIMITS_TRUSTED_PROXIES` forward.
    pub fn client_ip(&self) -> ClientIp {
        ClientIp::new().trusted_proxies(self.trusted.clone())
    }

    /// `rule`, shadowed when `RATELIMITS_SHADOW` names `name` (or is `on`).
    pub fn rule(&self, name: &str, rule: Rule) -> Rule {
        rule.shadow(self.shadow.covers(name))
    }
}

/// A layer builder with the settings' problem+json and exempt addresses, and no rules yet.
pub fn base_builder(limiter: Limiter, settings: &Settings) -> RateLimitLayerBuilder {
    let body = if settings.problem_json {
        ErrorBody::ProblemJson
    } else {
        ErrorBody::Json
    };
    let builder = RateLimitLayer::builder(limiter).error_body(body);
    if settings.exempt.is_empty() {
        return builder;
    }
    builder.exempt_addresses(settings.client_ip(), settings.exempt.clone())
}

/// Serves a hello-world app behind `layer` (and `GET /metrics`, not rate limited) until
/// Ctrl-C, reloading `limiter`'s limits when the YAML files change.
pub async fn serve(
    settings: &Settings,
    limiter: Limiter,
    layer: RateLimitLayer,
    backend: &str,
) -> Result<(), String> {
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    serve_app(settings, limiter, app, backend, "/").await
}

/// Without the feature `admin`: says how to get the admin API.
#[cfg(not(feature = "admin"))]
async fn serve_admin(addr: SocketAddr, _limiter: Limiter) -> Result<(), String> {
    Err(format!(
        "RATELIMITS_ADMIN_ADDR={addr}: the admin API needs the feature `admin` \
         (cargo run --example ... --features admin)"
    ))
}

/// Serves the admin router on `addr` in the background. For demonstration only: the principal
/// is whatever the `x-admin-principal` header says, and nothing checks it; a real application
/// mounts the router behind its own auth, which sets the `AdminPrincipal`.
#[cfg(feature = "admin")]
async fn serve_admin(addr: SocketAddr, limiter: Limiter) -> Result<(), String> {
    let admin = tower_ratelimits::admin_router(limiter).layer(axum::middleware::from_fn(
        |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            let who = req
                .headers()
                .get("x-admin-principal")
                .and_then(|v| v.to_str().ok())
                .map(|v| tower_ratelimits::AdminPrincipal(v.to_owned()));
            if let Some(who) = who {
                req.extensions_mut().insert(who);
            }
            next.run(req).await
        },
    ));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("RATELIMITS_ADMIN_ADDR: cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    println!("admin API on http://{bound} (demonstration: x-admin-principal names the caller)");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, admin).await {
            eprintln!("admin API stopped: {e}");
        }
    });
    Ok(())
}

/// Serves `app` (already rate limited), `GET /metrics` and `GET /ready` (not rate limited) until
/// Ctrl-C,
/// reloading `limiter`'s limits when the YAML files change; `path` is the one the printed
/// `curl` loop asks.
pub async fn serve_app(
    settings: &Settings,
    limiter: Limiter,
    app: Router,
    backend: &str,
    path: &str,
) -> Result<(), String> {
    if let Some(addr) = settings.admin_addr {
        serve_admin(addr, limiter.clone()).await?;
    }
    // Readiness for a load balancer (not rate limited): 503 until the limiter decides with all
    // it must know (on Redis, once the stored overrides were read whole).
    let ready = limiter.clone();
    let app = app.route(
        "/ready",
        get(move || {
            let ready = ready.is_ready();
            async move {
                if ready {
                    (axum::http::StatusCode::OK, "ready\n")
                } else {
                    (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: reading the stored overrides\n",
                    )
                }
            }
        }),
    );
    #[cfg(feature = "reload")]
    let _watcher = tower_ratelimits::LimitsWatcher::spawn(
        limiter,
        &settings.defaults,
        Some(&settings.overrides),
    )
    .map_err(|e| e.to_string())?;
    #[cfg(not(feature = "reload"))]
    {
        drop(limiter);
        println!("the YAML files are read once: watching them needs the feature `reload`");
    }
    #[cfg(not(feature = "metrics"))]
    println!("/metrics shows no rate-limit counters: they need the feature `metrics`");
    let metrics = settings.metrics.clone();
    let app = app.route(
        "/metrics",
        get(move || std::future::ready(metrics.render())),
    );
    let listener = tokio::net::TcpListener::bind(settings.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.addr))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "listening on http://{addr} (limits from {}, {backend}; metrics on /metrics)",
        settings.defaults.display()
    );
    match &settings.shadow {
        Shadow::Off => {}
        Shadow::All => println!("shadow mode: no rule refuses a request"),
        Shadow::Names(names) => println!("shadow mode for {}", names.join(", ")),
    }
    if !settings.trusted.is_empty() {
        println!("trusting X-Forwarded-For from {:?}", settings.trusted);
    }
    // One curl process (one connection): the 25 requests arrive within a few milliseconds, so
    // the 429s show before tokens refill.
    println!(
        "try: curl -s -w '%{{stderr}}%{{http_code}} ' 'http://{addr}{path}?[1-25]' >/dev/null; echo"
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
