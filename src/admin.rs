//! The admin router (feature `admin`): stored overrides and buckets over HTTP, JSON in and out.
//!
//! It carries no authentication of its own: mount it behind the application's own auth, on an
//! internal port. That auth layer names the caller by inserting an [`AdminPrincipal`] into the
//! request's extensions; every change is logged at `info` (target `tower_ratelimits::admin`)
//! with what changed and that principal.
//!
//! | request | answer |
//! |---|---|
//! | `PUT /overrides/{limit}/{id}` with a limit of the limit's own shape as the YAML file writes it (`{"burst": 3, "count": 3, "period": "1h"}`; `{"tiers": [{"limit": 5, "window": "1s", "active": "1s", "cooldown": "0s"}]}`; `{"concurrency": 10, "lease": "30s"}`; a calendar quota's plan `{"calendar": {"count": 5000000, "period": "month", "anchor_day": 15}}`), `{"unlimited": true}` or `{"block": true}`, each optionally with `"expires_in": "1h"` | 200, the override stored, shown as it was put |
//! | `GET /overrides` | 200, `{"overrides": [...]}` |
//! | `DELETE /overrides/{limit}/{id}` | 204, or 404 without one |
//! | `GET /buckets/{limit}/{id}` | 200, the limit in force, its source (`default`, `file`, `store`), `remaining`, `reset_after_ms`; a calendar quota also `used` (the count less what remains) and `renews_at` (the end of the period in force by this host's clock, `2026-11-30T00:00:00Z`); a key banned by its limit's penalty ladder also `banned: true` and `ban_ends_in_ms` |
//! | `DELETE /buckets/{limit}/{id}` | 204: the bucket is full again, on every instance (a ban lifted, its penalty level forgotten) |
//! | `GET /bans/{limit}?cursor=&count=` | 200, `{"bans": [{"id": "7", "level": 2, "banned": true, "ban_ends_in_ms": 15000}, {"id": "9", "level": 1}], "next": "0.1234"}`: a page of the keys the limit's penalty ladder holds (banned now, or with a level above 0; [`Limiter::penalties`]); `count` (1 to 1,000, 100 unless told) is how many keys the page looks at, `next` the next page's `cursor` (`null`: the last page; a page may hold none while more follow); 400 for a limit without a ladder or a cursor the store never gave |
//!
//! `{id}` is one percent-encoded path segment (`2001:db8::%2F48`); answers carry ids in their
//! canonical text. Errors are `{"error": "..."}`: 400 for an unknown limit, an id of the wrong
//! kind, a zero burst or count, a malformed duration or body; 503 when the store cannot be
//! reached (the overrides last known stay in force).

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use crate::config::{ConfigError, LimitSource};
use crate::key::BucketKey;
use crate::limiter::{Limiter, LimiterError, OverrideError};
use crate::overrides::{OverrideKind, StoredOverride};
use crate::quota::entry::{FieldError, read_api};
use crate::quota::{Described, Form, Quota};
use crate::time::{duration_us, parse_duration_us};

/// Who is making an admin change: set by the application's auth layer as a request extension,
/// logged with every change the [`admin_router`] makes.
///
/// ```
/// use tower_ratelimits::AdminPrincipal;
/// let mut request = axum::http::Request::new(axum::body::Body::empty());
/// request.extensions_mut().insert(AdminPrincipal("ops@example.com".into()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminPrincipal(pub String);

/// The admin router over `limiter` (the module's table: stored overrides and buckets). Serve
/// it apart from the application, behind its own auth:
///
/// ```no_run
/// # use tower_ratelimits::{admin_router, AdminPrincipal, Limiter};
/// # async fn serve(limiter: Limiter) -> std::io::Result<()> {
/// // An internal port; `authenticate` stands for the application's own auth layer, which
/// // inserts an `AdminPrincipal` into the request's extensions.
/// # let authenticate = axum::middleware::from_fn(|mut req: axum::extract::Request, next: axum::middleware::Next| async move {
/// #     req.extensions_mut().insert(AdminPrincipal("ops".into()));
/// #     next.run(req).await
/// # });
/// let admin = admin_router(limiter).layer(authenticate);
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:9091").await?;
/// axum::serve(listener, admin).await
/// # }
/// ```
pub fn admin_router(limiter: Limiter) -> Router {
    Router::new()
        .route("/overrides", get(list_overrides))
        .route(
            "/overrides/{limit}/{id}",
            axum::routing::put(put_override).delete(delete_override),
        )
        .route(
            "/buckets/{limit}/{id}",
            get(get_bucket).delete(reset_bucket),
        )
        .route("/bans/{limit}", get(list_bans))
        .with_state(limiter)
}

/// An answer: a status and a JSON body (or none).
struct Answer(StatusCode, Option<Value>);

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        match self.1 {
            None => self.0.into_response(),
            Some(body) => (
                self.0,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body.to_string(),
            )
                .into_response(),
        }
    }
}

fn error(status: StatusCode, why: impl std::fmt::Display) -> Answer {
    Answer(status, Some(json!({"error": why.to_string()})))
}

fn override_error(e: OverrideError) -> Answer {
    let status = match &e {
        OverrideError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        OverrideError::NoStore => StatusCode::NOT_IMPLEMENTED,
        // The store cannot take one more: 507, "unable to store the representation".
        OverrideError::TooMany { .. } => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::BAD_REQUEST,
    };
    error(status, e)
}

fn limiter_error(e: LimiterError) -> Answer {
    let status = match &e {
        LimiterError::UnknownName(_)
        | LimiterError::InvalidId { .. }
        | LimiterError::NoPenaltyLadder(_)
        | LimiterError::BadCursor(_) => StatusCode::BAD_REQUEST,
        LimiterError::Backend(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e)
}

fn path(p: Result<Path<(String, String)>, PathRejection>) -> Result<(String, String), Answer> {
    p.map(|Path(p)| p)
        .map_err(|e| error(StatusCode::BAD_REQUEST, e.body_text()))
}

fn principal(p: Option<&AdminPrincipal>) -> &str {
    p.map_or("(none)", |p| p.0.as_str())
}

/// A limit's numbers as JSON fields of `v`.
fn quota_fields(v: &mut Value, q: &Quota) {
    put_described(v, q.describe());
}

/// Described values as JSON fields of `v`.
fn put_described(v: &mut Value, fields: Vec<(&'static str, Described)>) {
    for (field, value) in fields {
        v[field] = match value {
            Described::Number(n) => n.into(),
            Described::Text(t) => t.into(),
        };
    }
}

/// A stored override as the API shows it: a limit of its own as the YAML file writes it
/// (`Form::Api`), so what is shown may be put back.
fn override_json(o: &StoredOverride) -> Value {
    let mut v = json!({"limit": o.limit(), "id": o.id()});
    match o.kind() {
        OverrideKind::Quota(q) => q.write_json(Form::Api, &mut v),
        OverrideKind::Unlimited => v["unlimited"] = true.into(),
        OverrideKind::Block => v["block"] = true.into(),
    }
    v["expires_at_ms"] = o.expires_at_ms().into();
    v
}

/// A `PUT` body.
#[derive(serde::Deserialize)]
struct PutBody {
    unlimited: Option<bool>,
    block: Option<bool>,
    expires_in: Option<String>,
    /// A limit's fields, as the file writes them (each shape's own reader, `read_api`).
    #[serde(flatten)]
    limit: serde_json::Map<String, Value>,
}

fn duration(field: &str, text: &str) -> Result<std::time::Duration, Answer> {
    parse_duration_us(text)
        .map(crate::time::us)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("{field}: {e}")))
}

/// A limit's field error as the API says it: the file's text, and the field a duration's
/// error is about (a body has no line to point at it).
fn api_error(e: FieldError) -> String {
    let field = e.unnamed_field();
    let text = ConfigError::from(e).to_string();
    match field {
        Some(field) => format!("{field}: {text}"),
        None => text,
    }
}

fn parse_put(body: &[u8]) -> Result<(OverrideKind, Option<std::time::Duration>), Answer> {
    let b: PutBody = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("malformed body: {e}")))?;
    let kind = match (b.unlimited, b.block, b.limit.is_empty()) {
        (None, None, false) => read_api(&Value::Object(b.limit))
            .map(OverrideKind::Quota)
            .map_err(|e| error(StatusCode::BAD_REQUEST, api_error(e)))?,
        (Some(true), None, true) => OverrideKind::Unlimited,
        (None, Some(true), true) => OverrideKind::Block,
        _ => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "the body is one of: a limit as the YAML file writes it ({\"burst\", \"count\", \
                 \"period\"}, {\"tiers\": [...]}, {\"concurrency\", \"lease\"}, \
                 {\"calendar\": {...}}), {\"unlimited\": true} or {\"block\": true}, \
                 optionally with \"expires_in\"",
            ));
        }
    };
    let expires_in = b
        .expires_in
        .map(|t| duration("expires_in", &t))
        .transpose()?;
    Ok((kind, expires_in))
}

async fn put_override(
    State(limiter): State<Limiter>,
    p: Result<Path<(String, String)>, PathRejection>,
    who: Option<axum::Extension<AdminPrincipal>>,
    body: Bytes,
) -> Answer {
    let (limit, id) = match path(p) {
        Ok(p) => p,
        Err(a) => return a,
    };
    let (kind, expires_in) = match parse_put(&body) {
        Ok(k) => k,
        Err(a) => return a,
    };
    match limiter.set_override(&limit, &id, kind, expires_in).await {
        Ok(o) => {
            let shown = override_json(&o);
            tracing::info!(
                target: "tower_ratelimits::admin",
                principal = principal(who.as_deref()),
                limit = %o.limit(),
                id = %o.id(),
                stored = %shown,
                "override set"
            );
            Answer(StatusCode::OK, Some(shown))
        }
        Err(e) => override_error(e),
    }
}

async fn list_overrides(State(limiter): State<Limiter>) -> Answer {
    match limiter.stored_overrides().await {
        Ok(list) => Answer(
            StatusCode::OK,
            Some(json!({"overrides": list.iter().map(override_json).collect::<Vec<_>>()})),
        ),
        Err(e) => override_error(e),
    }
}

async fn delete_override(
    State(limiter): State<Limiter>,
    p: Result<Path<(String, String)>, PathRejection>,
    who: Option<axum::Extension<AdminPrincipal>>,
) -> Answer {
    let (limit, id) = match path(p) {
        Ok(p) => p,
        Err(a) => return a,
    };
    match limiter.remove_override(&limit, &id).await {
        Ok(true) => {
            tracing::info!(
                target: "tower_ratelimits::admin",
                principal = principal(who.as_deref()),
                limit = %limit,
                id = %id,
                "override removed"
            );
            Answer(StatusCode::NO_CONTENT, None)
        }
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            format!("no stored override for {limit:?} and {id:?}"),
        ),
        Err(e) => override_error(e),
    }
}

/// The bucket a `/buckets/{limit}/{id}` path names.
fn bucket(
    limiter: &Limiter,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, BucketKey), Answer> {
    let (limit, id) = path(p)?;
    let key = limiter.parse_key(&limit, &id).map_err(limiter_error)?;
    Ok((limit, key))
}

async fn get_bucket(
    State(limiter): State<Limiter>,
    p: Result<Path<(String, String)>, PathRejection>,
) -> Answer {
    let (limit, key) = match bucket(&limiter, p) {
        Ok(b) => b,
        Err(a) => return a,
    };
    let seen = match limiter.inspect(&key).await {
        Ok(s) => s,
        Err(e) => return limiter_error(e),
    };
    let source = match seen.source {
        LimitSource::Default => "default",
        LimitSource::Override => "file",
        LimitSource::Store => "store",
    };
    let mut v = json!({"limit": limit, "id": key.id().to_string(), "source": source});
    match (&seen.limit, seen.blocked) {
        (_, true) => v["block"] = true.into(),
        (None, false) => v["unlimited"] = true.into(),
        (Some(q), false) => quota_fields(&mut v, q),
    }
    v["remaining"] = seen.remaining.into();
    v["reset_after_ms"] = (duration_us(seen.reset_after).div_ceil(1_000)).into();
    // An adaptive key: its number of slots now, and how many of them requests hold.
    if let Some(slots) = seen.slots {
        v["slots"] = slots.into();
        v["in_use"] = slots.saturating_sub(seen.remaining).into();
    }
    // A key banned by its limit's penalty ladder: until when (a reset lifts it).
    if let Some(wait) = seen.banned_for {
        v["banned"] = true.into();
        v["ban_ends_in_ms"] = duration_us(wait).div_ceil(1_000).into();
    }
    // A limit across regions on a backend in regional mode: this region's share of the key.
    if let Some(share) = &seen.region_share {
        v["region"] = json!({
            "name": share.region,
            "confirmed": share.confirmed,
            "floor": {"rate": share.floor.0, "burst": share.floor.1},
            "part": {"rate": share.part.0, "burst": share.part.1},
            "lease_left_ms": duration_us(share.lease_left).div_ceil(1_000),
        });
    }
    // What the key's state adds (a calendar quota: used, and its renewal by this host's clock).
    if let (Some(q), false) = (&seen.limit, seen.blocked) {
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, duration_us);
        put_described(&mut v, q.describe_seen(seen.remaining, now_us));
    }
    Answer(StatusCode::OK, Some(v))
}

async fn reset_bucket(
    State(limiter): State<Limiter>,
    p: Result<Path<(String, String)>, PathRejection>,
    who: Option<axum::Extension<AdminPrincipal>>,
) -> Answer {
    let (limit, key) = match bucket(&limiter, p) {
        Ok(b) => b,
        Err(a) => return a,
    };
    match limiter.reset(std::slice::from_ref(&key)).await {
        Ok(()) => {
            tracing::info!(
                target: "tower_ratelimits::admin",
                principal = principal(who.as_deref()),
                limit = %limit,
                id = %key.id(),
                "bucket reset"
            );
            Answer(StatusCode::NO_CONTENT, None)
        }
        Err(e) => limiter_error(e),
    }
}

/// A ban list's query: `cursor` (a page's `next`, percent-encoded) and `count` (keys a page
/// looks at). Read here rather than by a query extractor: the quickstart, which builds the
/// admin router, keeps its crate count.
#[derive(Default)]
struct BansQuery {
    cursor: Option<String>,
    count: Option<usize>,
}

impl BansQuery {
    /// The query `raw` (`None`: no query), each field at most once; anything else refused.
    fn read(raw: Option<&str>) -> Result<Self, String> {
        let mut q = BansQuery::default();
        for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value =
                percent_decoded(value).ok_or("a query value that is not percent-encoded UTF-8")?;
            match name {
                "cursor" if q.cursor.is_none() => q.cursor = Some(value),
                "count" if q.count.is_none() => {
                    let n = value
                        .parse()
                        .map_err(|_| format!("count {value:?} is not a number"))?;
                    q.count = Some(n);
                }
                "cursor" | "count" => return Err(format!("{name} is given twice")),
                other => {
                    return Err(format!(
                        "unknown query field {:?}",
                        other.chars().take(40).collect::<String>()
                    ));
                }
            }
        }
        Ok(q)
    }
}

/// A query value decoded as a form encodes it: `+` a space, each `%XX` its byte (`None`: not
/// UTF-8 once decoded).
fn percent_decoded(text: &str) -> Option<String> {
    let spaced = text.replace('+', " ");
    let decoded = percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .ok()?;
    Some(decoded.into_owned())
}

/// The keys a limit's penalty ladder holds, a page at a time ([`Limiter::penalties`]).
async fn list_bans(
    State(limiter): State<Limiter>,
    limit: Result<Path<String>, PathRejection>,
    RawQuery(raw): RawQuery,
) -> Answer {
    let limit = match limit {
        Ok(Path(limit)) => limit,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let query = match BansQuery::read(raw.as_deref()) {
        Ok(q) => q,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let count = query.count.unwrap_or(100);
    let page = match limiter
        .penalties(&limit, query.cursor.as_deref(), count)
        .await
    {
        Ok(page) => page,
        Err(e) => return limiter_error(e),
    };
    let bans: Vec<Value> = page
        .keys
        .iter()
        .map(|k| {
            let mut v = json!({"id": k.id, "level": k.level});
            if let Some(wait) = k.banned_for {
                v["banned"] = true.into();
                v["ban_ends_in_ms"] = duration_us(wait).div_ceil(1_000).into();
            }
            v
        })
        .collect();
    Answer(
        StatusCode::OK,
        Some(json!({"bans": bans, "next": page.next})),
    )
}

#[cfg(test)]
mod tests {
    use super::BansQuery;

    /// A cursor as a form encodes it: `+` is a space, `%2B` a plus (before, a `+` stayed a
    /// plus, and a cursor of an id with a space named another place).
    #[test]
    fn a_query_is_read_as_a_form_encodes_it() {
        let q = BansQuery::read(Some("cursor=m%3Aa+b%2Bc&count=2")).unwrap();
        assert_eq!((q.cursor.as_deref(), q.count), (Some("m:a b+c"), Some(2)));
        assert!(BansQuery::read(Some("cursor=%FF")).is_err(), "not UTF-8");
        assert!(BansQuery::read(Some("count=1&count=2")).is_err(), "twice");
        assert!(BansQuery::read(Some("limit=1")).is_err(), "unknown");
        assert_eq!(BansQuery::read(None).unwrap().cursor, None);
    }
}
