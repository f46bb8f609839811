//! One budget for the whole API, shared fairly among the tenants active now, in memory: "20 a
//! second in all, split by weight, `acme` weighing 3, each tenant guaranteed 2 a second"
//! (`docs/fair-share.md`).
//!
//! ```text
//! cargo run --example axum_fair_share
//! # a tenant alone takes the whole budget:
//! curl -s -w '%{stderr}%{http_code} ' -H 'x-tenant: globex' 'http://127.0.0.1:3000/?[1-25]' >/dev/null; echo
//! # two tenants flooding at once: acme gets about three times what globex gets
//! for t in acme globex; do (for i in $(seq 200); do curl -s -o /dev/null -w "%{http_code}\n" -H "x-tenant: $t" http://127.0.0.1:3000/; done | sort | uniq -c | sed "s/^/$t /") & done; wait
//! ```
//!
//! A tenant under its share spends from the budget; one over its share spends only beyond
//! what refused tenants under their share are waiting for. Refused: `429`, with `Retry-After`
//! and the budget's `RateLimit` fields.
//!
//! Settings (environment):
//! - `ADDR`: listen address (default `127.0.0.1:3000`)
//! - `RATELIMITS_DEFAULTS`: the limits, a YAML file defining `ApiPerTenant` as a fair share
//!   (default `examples/config/fair-share.yaml`)
//! - `RATELIMITS_OVERRIDES`: the tenants' weights (default
//!   `examples/config/fair-share-overrides.yaml`)

use std::process::ExitCode;

use axum::{Router, routing::get};
use tower_ratelimits::{FieldStyle, Header, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("axum_fair_share: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let read = |var: &str, default: &str| {
        let path = std::env::var(var).unwrap_or_else(|_| default.into());
        std::fs::read_to_string(&path)
            .map(|text| (path.clone(), text))
            .map_err(|e| format!("reading {path}: {e}"))
    };
    let (path, defaults) = read("RATELIMITS_DEFAULTS", "examples/config/fair-share.yaml")?;
    let (opath, overrides) = read(
        "RATELIMITS_OVERRIDES",
        "examples/config/fair-share-overrides.yaml",
    )?;
    let limits = Limits::from_yaml_str(&defaults, Some(&overrides))
        .map_err(|e| format!("{path} / {opath}: {e}"))?;
    let limiter = Limiter::new(limits, MemoryBackend::new());
    let layer = RateLimitLayer::builder(limiter)
        .rule(Rule::new("ApiPerTenant", Header::new("x-tenant")))
        .fields(FieldStyle::Ietf)
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "listening on http://{} (one budget shared by tenant, x-tenant, {path})",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}
