//! An app instance with the admin router: the app (a rule per `x-client` header, a rule per
//! client address) and the admin router on two real TCP ports, the principal taken from an
//! `x-admin-principal` header as the examples do.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use http::Method;
use serde_json::Value;
use tower_ratelimits::{
    AdminPrincipal, Backend, Header, Limiter, Limits, RateLimitLayer, Rule, admin_router,
};

use super::http::{HttpClient, Reply, serve};

pub const LIMITS: &str = "\
PerClient:
  kind: any
  burst: 2
  count: 2
  period: 1h
PerRange:
  kind: ipv6_range
  burst: 2
  count: 2
  period: 1h
Slots: {kind: any, concurrency: 2, lease: 10s}
";

/// A file override the stored ones must win over.
pub const FILE_OVERRIDES: &str = "PerClient:filed: {burst: 4, count: 4, period: 1h}\n";

pub struct Instance {
    pub limiter: Limiter,
    pub app: HttpClient,
    pub admin: HttpClient,
    _servers: [super::http::Server; 2],
}

pub async fn instance(backend: impl Backend) -> Instance {
    let limits = Limits::from_yaml_str(LIMITS, Some(FILE_OVERRIDES)).unwrap();
    let limiter = Limiter::new(limits, backend);
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("PerClient", Header::new("x-client")))
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let admin = serve(
        admin_router(limiter.clone()).layer(axum::middleware::from_fn(
            |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
                if let Some(who) = req
                    .headers()
                    .get("x-admin-principal")
                    .and_then(|v| v.to_str().ok())
                {
                    let who = AdminPrincipal(who.to_owned());
                    req.extensions_mut().insert(who);
                }
                next.run(req).await
            },
        )),
    )
    .await;
    Instance {
        limiter,
        app: HttpClient::new(&app),
        admin: HttpClient::new(&admin),
        _servers: [app, admin],
    }
}

impl Instance {
    /// A request of client `id` through the app.
    pub async fn request(&self, id: &str) -> Reply {
        self.app.get("/", &[("x-client", id)]).await
    }

    pub async fn put(&self, path: &str, body: &str) -> (u16, Value) {
        let r = self
            .admin
            .send(
                Method::PUT,
                path,
                &[("x-admin-principal", "ops@example.com")],
                body,
            )
            .await;
        (r.status, json(&r))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.admin.get(path, &[]).await;
        (r.status, json(&r))
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        let r = self.admin.request(Method::DELETE, path, &[]).await;
        (r.status, json(&r))
    }

    /// The stored overrides' (limit, id) pairs, as `GET /overrides` lists them.
    pub async fn listed(&self) -> Vec<(String, String)> {
        let (status, v) = self.get("/overrides").await;
        assert_eq!(status, 200, "{v}");
        v["overrides"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| {
                (
                    o["limit"].as_str().unwrap().to_owned(),
                    o["id"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }
}

fn json(r: &Reply) -> Value {
    if r.body.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.body))
}

/// Polls `check` until it holds, failing after `deadline` with what it last saw.
pub async fn within<F, Fut, T>(deadline: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if start.elapsed() > deadline => {
                panic!("{what}: not within {deadline:?}; last seen: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}
