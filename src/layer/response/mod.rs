//! What a client sees: `429 Too Many Requests` with `Retry-After`, the IETF `RateLimit` and
//! `RateLimit-Policy` fields and a JSON body; gRPC clients get `RESOURCE_EXHAUSTED`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::quota::{Quota, ceil_secs_us};
use http::{HeaderMap, HeaderName, Response, StatusCode};

use super::observe::Seen;

mod body;
mod denial;
mod fields;

use crate::key::LimitName;
use crate::limiter::{BatchDecision, Strictest};
use body::*;
pub(crate) use body::{error_code, error_response, is_grpc};
pub use denial::Denial;
#[cfg(all(feature = "tonic", feature = "stream"))]
pub(crate) use denial::resource_exhausted;
use denial::*;
use fields::*;
pub(crate) use fields::{Fields, joined_policies, policy_value};

/// `RateLimit-Policy` (IETF httpapi ratelimit-headers, draft 11).
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF httpapi ratelimit-headers, draft 11).
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `grpc-retry-pushback-ms`, on every `RESOURCE_EXHAUSTED` denial (gRPC's client retry design).
static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// Legacy `X-RateLimit-Limit`.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// Legacy `X-RateLimit-Remaining`.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// Legacy `X-RateLimit-Reset` (seconds from now).
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The rate-limit header fields a layer's responses carry
/// ([`RateLimitLayerBuilder::fields`](crate::RateLimitLayerBuilder::fields)). Every denial
/// carries `Retry-After` whatever the style. A new format is one variant here and one writer.
///
/// ```
/// use tower_ratelimits::{FieldStyle, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule, ClientIp};
/// # let limiter = Limiter::new(
/// #     Limits::from_yaml_str("PerIp: {kind: ip, burst: 5, count: 5, period: 1s}\n", None).unwrap(),
/// #     MemoryBackend::new());
/// let layer = RateLimitLayer::builder(limiter)
///     .rule(Rule::new("PerIp", ClientIp::new()))
///     .fields(FieldStyle::IetfAndLegacy)
///     .build()
///     .unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FieldStyle {
    /// The IETF draft-11 `RateLimit` and `RateLimit-Policy` fields, on every response (the
    /// default).
    #[default]
    Ietf,
    /// The draft-11 fields and the legacy `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
    /// `X-RateLimit-Reset` (of the strictest limit), on every response.
    IetfAndLegacy,
    /// The draft-11 fields on denials only: allowed responses carry no rate-limit field.
    IetfOnDenials,
    /// The draft-11 and the legacy fields on denials only.
    IetfAndLegacyOnDenials,
}

impl FieldStyle {
    /// Whether allowed responses carry the fields.
    pub(crate) fn on_allowed(self) -> bool {
        matches!(self, Self::Ietf | Self::IetfAndLegacy)
    }

    /// Writes `fields` into `headers` in this style.
    pub(crate) fn write(self, headers: &mut HeaderMap, fields: Fields) {
        let legacy = matches!(self, Self::IetfAndLegacy | Self::IetfAndLegacyOnDenials);
        fields.write(headers, legacy);
    }
}

/// How the middleware writes the bodies of its own answers: the 429 of a denial, and the
/// 400 and 503 it writes when a key is missing or the store fails
/// ([`RateLimitLayerBuilder::error_body`](crate::RateLimitLayerBuilder::error_body)). gRPC
/// calls get a status whatever the format. A new format is one variant here and one writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ErrorBody {
    /// `{"errors":[{"code":..,"message":..}]}` (the default); a 429's error also has a
    /// `detail` ([`Denial::json_body`]).
    #[default]
    Json,
    /// RFC 9457 `application/problem+json`; a 429's problem has the draft's
    /// `#quota-exceeded` type and `violated-policies` ([`Denial::problem_body`]).
    ProblemJson,
    /// No body and no `Content-Type`: the status, `Retry-After` and the `RateLimit` fields
    /// say it all (the cheapest refusal: a flood is answered without writing a body). The
    /// reason of a 400 or 503 is then in the layer's logs only.
    Empty,
}

impl ErrorBody {
    /// A denial's body and its content type.
    fn denial(self, denial: &Denial<'_>) -> Option<(Bytes, &'static str)> {
        match self {
            Self::Json => Some((denial.json_body(), "application/json")),
            Self::ProblemJson => Some((denial.problem_body(), PROBLEM_JSON)),
            Self::Empty => None,
        }
    }

    /// The body of an error the middleware writes (not a rate limit), as a response, written
    /// into one buffer as the 429's are: `{"errors":[{"code":..,"message":..}]}`, or the
    /// problem `{"detail":..,"status":..,"title":..,"type":"about:blank"}`.
    fn error(self, status: StatusCode, code: &str, message: &str) -> Response<Bytes> {
        let mut out = Vec::with_capacity(96 + message.len());
        let content_type = match self {
            Self::Json => {
                out.extend_from_slice(br#"{"errors":[{"code":"#);
                json_text(&mut out, code);
                out.extend_from_slice(br#","message":"#);
                json_text(&mut out, message);
                out.extend_from_slice(b"}]}");
                "application/json"
            }
            Self::ProblemJson => {
                out.extend_from_slice(br#"{"detail":"#);
                json_text(&mut out, message);
                out.extend_from_slice(br#","status":"#);
                out.extend_from_slice(itoa::Buffer::new().format(status.as_u16()).as_bytes());
                out.extend_from_slice(br#","title":"#);
                json_text(&mut out, status.canonical_reason().unwrap_or("Error"));
                out.extend_from_slice(br#","type":"about:blank"}"#);
                PROBLEM_JSON
            }
            Self::Empty => {
                let mut r = Response::new(Bytes::new());
                *r.status_mut() = status;
                return r;
            }
        };
        json_response(status, Bytes::from(out), content_type)
    }
}

/// A user's own denial response ([`RateLimitLayerBuilder::denied_response`](crate::RateLimitLayerBuilder::denied_response)).
pub(crate) type DenialFn = Arc<dyn Fn(&Denial<'_>) -> Response<Bytes> + Send + Sync>;

/// How a layer answers: the fields it writes, the bodies of its own answers, and a user's own
/// denial response, if any.
pub(crate) struct Answers {
    pub(crate) fields: FieldStyle,
    pub(crate) body: ErrorBody,
    pub(crate) on_denied: Option<DenialFn>,
    /// The most a denial's times are put back by ([`RateLimitLayerBuilder::jitter`]).
    ///
    /// [`RateLimitLayerBuilder::jitter`]: crate::RateLimitLayerBuilder::jitter
    pub(crate) jitter: Duration,
    /// A denial is answered with its status alone: a replay reads the layer's notes, never
    /// the response, so no body or field is written for it.
    #[cfg(feature = "replay")]
    pub(crate) quiet: std::sync::atomic::AtomicBool,
}

impl Answers {
    /// Puts a denied batch's times back by a random part of the layer's jitter, before it is
    /// waited on or answered (nothing when the layer has none).
    pub(crate) fn jitter(&self, batch: &mut BatchDecision) {
        if !self.jitter.is_zero() {
            batch.delay(random_up_to(self.jitter));
        }
    }

    /// [`jitter`](Self::jitter) for a denial read by reference (`seen`, its transactions), as
    /// [`BatchDecision::delay`] puts a batch's times back.
    pub(crate) fn jitter_seen(&self, seen: &mut [Seen<'_>]) {
        if self.jitter.is_zero() {
            return;
        }
        let extra = crate::time::duration_us(random_up_to(self.jitter));
        for d in seen.iter_mut().filter(|d| !d.allowed && d.counts) {
            d.retry_after_us = d.retry_after_us.saturating_add(extra);
            d.reset_after_us = d.reset_after_us.saturating_add(extra);
        }
    }

    /// The answer to a denied request whose transactions are `seen` (`strictest`: the one that
    /// denied), by the layer's own response or the user's: one road for both.
    pub(crate) fn denied<'a>(
        &self,
        seen: &'a [Seen<'a>],
        strictest: Option<usize>,
        grpc: bool,
        cached: CachedPolicy<'a>,
    ) -> Response<Bytes> {
        #[cfg(feature = "replay")]
        if self.quiet.load(std::sync::atomic::Ordering::Relaxed) {
            let mut r = Response::new(Bytes::new());
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            return r;
        }
        let denial = Denial::new(seen, strictest, grpc, (self.fields, self.body), cached);
        match &self.on_denied {
            Some(f) => f(&denial),
            None => denial.default_response(),
        }
    }

    /// An error the middleware writes (not a rate limit).
    pub(crate) fn error(
        &self,
        status: StatusCode,
        code: &str,
        message: &str,
        grpc: bool,
    ) -> Response<Bytes> {
        error_response(status, code, message, grpc, self.body)
    }
}

/// A duration in `[0, max]`, uniform to the microsecond: std's per-process random hash keys
/// over a counter (jitter needs spread, not secrecy; no generator crate needed).
fn random_up_to(max: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static KEYS: OnceLock<std::hash::RandomState> = OnceLock::new();
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = KEYS.get_or_init(std::hash::RandomState::new).build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, Ordering::Relaxed));
    let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(match max_us.checked_add(1) {
        Some(span) => hasher.finish() % span,
        None => hasher.finish(),
    })
}

/// Whole seconds, rounded up.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::decimal_len;

    /// An id in a 429 body reads as its `Display` text, whatever its kind.
    #[test]
    fn an_id_is_written_as_its_text() {
        use crate::key::Id;
        let ids = [
            Id::from(std::net::IpAddr::from([0, 10, 255, 1])),
            Id::from(std::net::IpAddr::from([255, 255, 255, 255])),
            Id::from("2001:db8::1".parse::<std::net::IpAddr>().unwrap()),
            Id::from(0u64),
            Id::from(u64::MAX),
            Id::new("a\"b\\c\u{e9}").unwrap(),
        ];
        for id in ids {
            let mut out = Vec::new();
            super::json_id(&mut out, &id);
            let read: String = serde_json::from_slice(&out).unwrap();
            assert_eq!(read, id.to_string());
        }
    }

    /// The middleware's own error bodies read back as written, a message with quotes
    /// escaped, keys in the documented order.
    #[test]
    fn error_bodies_are_escaped_json() {
        use super::ErrorBody;
        use http::StatusCode;
        let message = "the header \"x-account\" is not a number: \"12\\3\"";
        let r = ErrorBody::Json.error(StatusCode::BAD_REQUEST, "BADKEY", message);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["errors"][0]["code"], "BADKEY");
        assert_eq!(v["errors"][0]["message"], message);
        let r =
            ErrorBody::ProblemJson.error(StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE", "down");
        assert_eq!(
            std::str::from_utf8(r.body()).unwrap(),
            r#"{"detail":"down","status":503,"title":"Service Unavailable","type":"about:blank"}"#
        );
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn decimal_len_counts_the_digits_itoa_writes() {
        let mut cases = vec![0, 1, 2, u64::MAX / 10, u64::MAX - 1, u64::MAX];
        let mut p = 1u64;
        while let Some(next) = p.checked_mul(10) {
            cases.extend([p - 1, p, p + 1, next / 2]);
            p = next;
        }
        cases.extend([p - 1, p, p + 1]);
        for n in cases {
            assert_eq!(decimal_len(n), itoa::Buffer::new().format(n).len(), "{n}");
        }
    }
}
