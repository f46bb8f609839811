//! A denied request's answer (`Denial`): its status, `Retry-After`, fields and body, or for
//! gRPC `RESOURCE_EXHAUSTED` with its details.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::*;
use crate::key::Id;
use crate::time::{WaitText, ceil_ms};

/// What refused, as the answers' texts say it.
struct What<'a>(&'a str, bool);

impl std::fmt::Display for What<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            What(name, false) => write!(f, "rate limit {name} exceeded"),
            What(name, true) => write!(f, "rate limit {name}: banned by its penalty"),
        }
    }
}

/// A denied request, as handed to a custom response function
/// ([`RateLimitLayerBuilder::denied_response`](crate::RateLimitLayerBuilder::denied_response)):
/// the limit that denied (the strictest), its id and wait, and every limit that denied. Read
/// from the backend's outcomes by reference: no decision is built to answer a refusal.
pub struct Denial<'a> {
    /// Each transaction of the request as the layer shows it, in order.
    seen: &'a [Seen<'a>],
    /// The one that denied ([`BatchDecision::strictest`]'s rule).
    strictest: Option<usize>,
    grpc: bool,
    fields: FieldStyle,
    body: ErrorBody,
    /// The layer's precomputed `RateLimit-Policy` members (a rule's default limit's).
    cached: CachedPolicy<'a>,
}

/// Finds a limit's precomputed `RateLimit-Policy` member, when its quota is its rule's default.
pub(crate) type CachedPolicy<'a> = &'a dyn Fn(LimitName, &Quota) -> Option<&'a HeaderValue>;

impl std::fmt::Debug for Denial<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Denial")
            .field("limit_name", &self.limit_name())
            .field("retry_after", &self.retry_after())
            .field("grpc", &self.grpc)
            .field("fields", &self.fields)
            .field("body", &self.body)
            .finish_non_exhaustive()
    }
}

impl<'a> Denial<'a> {
    /// The denial of the transactions `seen` (their strictest: `strictest`, as
    /// [`BatchDecision::strictest`] chooses it).
    pub(crate) fn new(
        seen: &'a [Seen<'a>],
        strictest: Option<usize>,
        grpc: bool,
        (fields, body): (FieldStyle, ErrorBody),
        cached: CachedPolicy<'a>,
    ) -> Self {
        Self {
            seen,
            strictest,
            grpc,
            fields,
            body,
            cached,
        }
    }

    /// Whether the request is a gRPC call.
    pub fn is_grpc(&self) -> bool {
        self.grpc
    }

    /// The layer's field style.
    pub fn field_style(&self) -> FieldStyle {
        self.fields
    }

    /// The layer's body format.
    pub fn error_body(&self) -> ErrorBody {
        self.body
    }

    /// The transaction that denied.
    fn first(&self) -> Option<&Seen<'a>> {
        self.seen.get(self.strictest?)
    }

    /// The name of the limit that denied (the strictest denial of the request's rules).
    pub fn limit_name(&self) -> Option<&'a str> {
        self.first().map(|d| d.name.as_str())
    }

    /// The id the limit that denied was keyed by.
    pub fn id(&self) -> Option<&'a Id> {
        self.first().map(|d| d.id)
    }

    /// On a tiered limit, the tier (from 1) that refused.
    pub fn tier(&self) -> Option<u8> {
        self.first().and_then(|d| d.own.tiers).map(|t| t.tier)
    }

    /// Whether the limit that denied refused because the key is banned by its penalty ladder
    /// (`docs/penalties.md`): then [`retry_after`](Self::retry_after) is the ban's end.
    pub fn banned(&self) -> bool {
        self.first().is_some_and(|d| d.banned)
    }

    /// What the answers' texts say: `rate limit <name> exceeded`, or for a ban `<name>: banned
    /// by its penalty`.
    fn what(&self) -> What<'_> {
        What(self.limit_name().unwrap_or(""), self.banned())
    }

    /// The name of every limit that denied the request, the strictest first.
    pub fn denied_limits(&self) -> impl Iterator<Item = &'a str> + '_ {
        let first = self.first();
        first.into_iter().map(|d| d.name.as_str()).chain(
            self.seen
                .iter()
                .enumerate()
                .filter(|&(i, d)| d.counts && !d.allowed && Some(i) != self.strictest)
                .map(|(_, d)| d.name.as_str()),
        )
    }
}

impl Denial<'_> {
    /// How long until the request would be allowed (at least one second in headers).
    pub fn retry_after(&self) -> Duration {
        self.first()
            .map_or(Duration::ZERO, |d| Duration::from_micros(d.retry_after_us))
    }

    /// `Retry-After` in whole seconds: rounded up, never 0.
    pub fn retry_after_secs(&self) -> u64 {
        ceil_secs(self.retry_after()).max(1)
    }

    /// The wait in whole milliseconds: rounded up, never 0. Every millisecond field says it
    /// (`retry_after_ms`, `grpc-retry-pushback-ms`, gRPC's `RetryInfo`), and so do the texts
    /// (`"retry after 50 ms"`); the second fields (`Retry-After`, `RateLimit`'s `t`) round the
    /// same wait up to the second.
    pub fn retry_after_ms(&self) -> u64 {
        ceil_ms(self.retry_after()).max(1)
    }

    /// The default JSON body:
    /// `{"errors":[{"code":"TOOMANYREQUESTS","detail":{"entity":..,"limiter":..,"retry_after_ms":..},"message":"too many requests"}]}`;
    /// for a tiered limit `detail` also has `"tier"`: the tier (from 1) that refused, and for a
    /// banned key `"banned":true` (the wait is the ban's). Written
    /// straight from the denial's numbers into one buffer (keys in this order, as before).
    pub fn json_body(&self) -> Bytes {
        let mut out = Vec::with_capacity(160);
        out.extend_from_slice(br#"{"errors":[{"code":"TOOMANYREQUESTS","detail":{"entity":"#);
        match self.id() {
            Some(id) => json_id(&mut out, id),
            None => out.extend_from_slice(b"\"\""),
        }
        out.extend_from_slice(br#","limiter":"#);
        json_text(&mut out, self.limit_name().unwrap_or(""));
        out.extend_from_slice(br#","retry_after_ms":"#);
        out.extend_from_slice(itoa::Buffer::new().format(self.retry_after_ms()).as_bytes());
        if self.banned() {
            out.extend_from_slice(br#","banned":true"#);
        }
        if let Some(tier) = self.tier() {
            out.extend_from_slice(br#","tier":"#);
            out.extend_from_slice(itoa::Buffer::new().format(tier).as_bytes());
        }
        out.extend_from_slice(br#"},"message":"too many requests"}]}"#);
        Bytes::from(out)
    }

    /// The RFC 9457 body of a 429: `type` is the draft's `#quota-exceeded` problem type (for a
    /// key banned by a penalty ladder, the URI of `docs/penalties.md` on docs.rs, and `detail`
    /// says so),
    /// `violated-policies` names every limit that denied (strictest first), `retry_after_ms`
    /// is the exact wait:
    /// `{"detail":"..","retry_after_ms":..,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","violated-policies":[".."]}`.
    pub fn problem_body(&self) -> Bytes {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(br#"{"detail":"#);
        json_text(
            &mut out,
            format_args!(
                "{}; retry after {}",
                self.what(),
                WaitText(self.retry_after_ms())
            ),
        );
        out.extend_from_slice(br#","retry_after_ms":"#);
        out.extend_from_slice(itoa::Buffer::new().format(self.retry_after_ms()).as_bytes());
        out.extend_from_slice(br#","status":429,"title":"Too Many Requests","type":"#);
        json_text(
            &mut out,
            if self.banned() {
                BANNED
            } else {
                QUOTA_EXCEEDED
            },
        );
        out.extend_from_slice(br#","violated-policies":["#);
        for (n, name) in self.denied_limits().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            json_text(&mut out, name);
        }
        out.extend_from_slice(b"]}");
        Bytes::from(out)
    }

    /// The default response: a gRPC trailers-only `RESOURCE_EXHAUSTED` (with `retry-after`,
    /// `grpc-retry-pushback-ms` and, with the `tonic` feature, `RetryInfo`), or a 429 with
    /// `Retry-After`, the fields of the layer's [`FieldStyle`] and the body of its
    /// [`ErrorBody`] ([`json_body`](Self::json_body), [`problem_body`](Self::problem_body), or
    /// none).
    pub fn default_response(&self) -> Response<Bytes> {
        let retry = self.retry_after_secs();
        let mut response = if self.grpc {
            let message = format!(
                "{}; retry after {}",
                self.what(),
                WaitText(self.retry_after_ms())
            );
            #[allow(unused_mut)]
            let mut r = grpc_status(8, &message);
            // gRPC's client-retry "pushback": a client whose retry policy lists
            // RESOURCE_EXHAUSTED waits this long before it retries (the wait in whole
            // milliseconds rounded up, at least 1, as `retry-after` is at least a second).
            // By value: `insert` of a `&'static` name has one caller, `put`, where it is inlined
            // (a second caller cost every request 68 instructions).
            r.headers_mut().insert(
                GRPC_RETRY_PUSHBACK_MS.clone(),
                number(self.retry_after_ms()),
            );
            #[cfg(feature = "tonic")]
            self.add_grpc_details(r.headers_mut(), &message);
            r
        } else {
            let (body, content_type) = match self.body.denial(self) {
                Some((body, content_type)) => (body, Some(content_type)),
                None => (Bytes::new(), None),
            };
            let mut r = Response::new(body);
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            if let Some(content_type) = content_type {
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
            }
            r
        };
        let headers = response.headers_mut();
        headers.insert(RETRY_AFTER, number(retry));
        let reported = self.seen.iter().map(|d| {
            let policy = d.quota.and_then(|q| (self.cached)(d.name, q));
            (*d, policy)
        });
        if let Some(fields) = Fields::from_reported(reported, &[]) {
            self.fields.write(headers, fields);
        }
        response
    }
}

#[cfg(feature = "tonic")]
impl Denial<'_> {
    /// `grpc-status-details-bin`: a `google.rpc.Status` with `RetryInfo` (the exact wait
    /// before this request passes) and a `QuotaFailure` violation per limit that denied
    /// (subject: the limit's name), encoded by `tonic-types`, so standard clients read the
    /// delay without parsing text.
    fn add_grpc_details(&self, headers: &mut HeaderMap, message: &str) {
        let denied = self.seen.iter().filter(|d| d.counts && !d.allowed);
        // The wait every millisecond field gives.
        let status = resource_exhausted(
            message,
            Some(self.retry_after_ms()),
            denied.map(|d| (d.name, Duration::from_micros(d.retry_after_us))),
        );
        // Only the details: `grpc-status` and `grpc-message` are ours already.
        let mut encoded = HeaderMap::new();
        match status.add_header(&mut encoded) {
            Ok(()) => {
                if let Some(v) = encoded.remove("grpc-status-details-bin") {
                    headers.insert("grpc-status-details-bin", v);
                }
            }
            Err(e) => {
                tracing::debug!(target: crate::telemetry::target::LAYER, error = %e, "gRPC error details not added")
            }
        }
    }
}

/// A gRPC `RESOURCE_EXHAUSTED` with its details: `RetryInfo` (`retry_ms`, the wait in whole
/// milliseconds; none when waiting would not help) and a `QuotaFailure` violation per limit
/// that denied (subject: the limit's name; its own wait in the description), encoded by
/// `tonic-types`. A denied request's trailers-only answer and an ended stream's trailers
/// (`stream/`) say it alike.
#[cfg(feature = "tonic")]
pub(crate) fn resource_exhausted(
    message: &str,
    retry_ms: Option<u64>,
    denied: impl Iterator<Item = (LimitName, Duration)>,
) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut details = match retry_ms {
        Some(ms) => ErrorDetails::with_retry_info(Some(Duration::from_millis(ms))),
        None => ErrorDetails::new(),
    };
    for (name, wait) in denied {
        let wait = WaitText(ceil_ms(wait).max(1));
        details.add_quota_failure_violation(
            name.as_str(),
            format!("rate limit {name} exceeded; retry after {wait}"),
        );
    }
    tonic::Status::with_error_details(tonic::Code::ResourceExhausted, message, details)
}
