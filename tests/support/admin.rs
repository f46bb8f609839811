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
    AdminPrincipal, Backend, Header, Limiter, Limits, RateLimitLayer, Rule, Transaction,
    admin_router,
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
Tiered:
  kind: any
  tiers:
    - {limit: 2, window: 1h, active: 1h, cooldown: 0s}
Fair: {kind: any, burst: 4, count: 4, period: 1h, fair_share: {}}
Adaptive: {kind: any, concurrency: {adaptive: {min: 1, initial: 2, max: 4, algorithm: aimd}}}
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

/// Every shape takes a stored override of its own shape (tiers, concurrency limits and a fair
/// share's weight too),
/// put through `a`'s admin API and applied on `b` within `deadline` (`a` itself for one
/// instance): shown as put, in force on `b`'s decisions, refused on a limit of another shape.
pub async fn every_shape_takes_an_override_of_its_own(
    a: &Instance,
    b: &Instance,
    deadline: Duration,
) {
    let tiers = serde_json::json!({"tiers": [
        {"limit": 3, "window": "1h", "active": "1h", "cooldown": "0s"},
        {"limit": 2, "window": "10m", "active": "10m", "cooldown": "1h"},
    ]});
    let slots = serde_json::json!({"concurrency": 3, "lease": "10s"});
    for (path, body) in [
        ("/overrides/Tiered/t1", &tiers),
        ("/overrides/Slots/s1", &slots),
    ] {
        let (status, shown) = a.put(path, &body.to_string()).await;
        assert_eq!(status, 200, "{path}: {shown}");
        for (field, value) in body.as_object().unwrap() {
            assert_eq!(&shown[field], value, "{path}: {shown}");
        }
    }
    // What the API shows is what it takes: put back, the same override.
    let (_, listed) = a.get("/overrides").await;
    let shown_slots = listed["overrides"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["limit"] == "Slots")
        .unwrap()
        .clone();
    assert_eq!(shown_slots["retry_after"], "1s", "{listed}");
    let mut again = shown_slots.clone();
    for field in ["limit", "id", "expires_at_ms"] {
        again.as_object_mut().unwrap().remove(field);
    }
    let (status, put_back) = a.put("/overrides/Slots/s1", &again.to_string()).await;
    assert_eq!((status, &put_back), (200, &shown_slots));

    // In force on b: the tiers' 5 units (the default's 2), the 3 slots (the default's 2).
    let t1 = b.limiter.parse_key("Tiered", "t1").unwrap();
    let s1 = b.limiter.parse_key("Slots", "s1").unwrap();
    within(deadline, "the overrides on the other instance", || async {
        let (_, t) = b.get("/buckets/Tiered/t1").await;
        let (_, s) = b.get("/buckets/Slots/s1").await;
        (t["source"] == "store"
            && t["burst"] == 5
            && s["source"] == "store"
            && s["concurrency"] == 3)
            .then_some(())
            .ok_or(format!("{t} {s}"))
    })
    .await;
    let spend = |key, cost| {
        let limiter = b.limiter.clone();
        async move {
            let d = limiter
                .spend(&[Transaction::new(key).cost(cost)])
                .await
                .unwrap();
            d.allowed()
        }
    };
    assert!(spend(t1.clone(), 5).await, "the tiers' 5 units");
    assert!(!spend(t1, 1).await, "none after them");
    let mut held = Vec::new();
    for _ in 0..3 {
        let d = b
            .limiter
            .spend(&[Transaction::new(s1.clone())])
            .await
            .unwrap();
        assert!(d.allowed(), "3 slots");
        held.push(d);
    }
    assert!(!spend(s1, 1).await, "no fourth slot");

    // A fair share's weight: the budget kept, the weight the id's own; the stored form read
    // back on b as the API wrote it.
    let fair = serde_json::json!({"burst": 4, "count": 4, "period": "1h",
        "fair_share": {"weight": 3}});
    let (status, shown) = a.put("/overrides/Fair/f1", &fair.to_string()).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(
        (
            &shown["fair_share"]["weight"],
            &shown["fair_share"]["refresh"]
        ),
        (&serde_json::json!(3), &serde_json::json!("1s")),
        "{shown}"
    );
    within(
        deadline,
        "the fair share's weight on the other instance",
        || async {
            let (_, f) = b.get("/buckets/Fair/f1").await;
            (f["source"] == "store" && f["weight"] == 3 && f["kind"] == "fair_share")
                .then_some(())
                .ok_or(format!("{f}"))
        },
    )
    .await;
    let f1 = b.limiter.parse_key("Fair", "f1").unwrap();
    assert!(spend(f1, 4).await, "alone, the whole budget");

    // Another shape than the limit's is refused, and nothing changes.
    let before = a.listed().await;
    for (path, body, says) in [
        ("/overrides/PerClient/x", tiers.to_string(), "burst tiers"),
        (
            "/overrides/Tiered/x",
            slots.to_string(),
            "a concurrency limit",
        ),
        ("/overrides/Slots/x", r#"{"tiers": []}"#.to_owned(), "tier"),
        (
            "/overrides/Slots/x",
            r#"{"concurrency": 0}"#.to_owned(),
            "concurrency",
        ),
        (
            "/overrides/Slots/x",
            r#"{"concurrency": 3, "lease": "soon"}"#.to_owned(),
            "lease",
        ),
        (
            "/overrides/Fair/x",
            r#"{"burst": 8, "count": 4, "period": "1h", "fair_share": {"weight": 2}}"#.to_owned(),
            "must keep the fair share's budget",
        ),
        (
            "/overrides/Fair/x",
            r#"{"burst": 4, "count": 4, "period": "1h", "fair_share": {"weight": 0}}"#.to_owned(),
            "weight",
        ),
        ("/overrides/PerClient/x", fair.to_string(), "a fair share"),
    ] {
        let (status, reply) = a.put(path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {reply}");
        let error = reply["error"].as_str().unwrap();
        assert!(error.contains(says), "{path} {body}: {error}");
    }
    assert_eq!(a.listed().await, before);
}
