//! What a client sees: `429 Too Many Requests` with `Retry-After`, the IETF `RateLimit` and
//! `RateLimit-Policy` fields and a JSON body; gRPC clients get `RESOURCE_EXHAUSTED`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::quota::{Quota, ceil_secs_us};
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, HeaderName, Response, StatusCode};

use super::observe::Seen;
use crate::key::LimitName;
use crate::limiter::{BatchDecision, Decision, Strictest};

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
}

impl ErrorBody {
    /// A denial's body and its content type.
    fn denial(self, denial: &Denial<'_>) -> (Bytes, &'static str) {
        match self {
            Self::Json => (denial.json_body(), "application/json"),
            Self::ProblemJson => (denial.problem_body(), PROBLEM_JSON),
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
}

impl Answers {
    /// Puts a denied batch's times back by a random part of the layer's jitter, before it is
    /// waited on or answered (nothing when the layer has none).
    pub(crate) fn jitter(&self, batch: &mut BatchDecision) {
        if !self.jitter.is_zero() {
            batch.delay(random_up_to(self.jitter));
        }
    }

    /// The answer to a denied batch.
    pub(crate) fn denied<'a>(
        &self,
        batch: &'a BatchDecision,
        grpc: bool,
        cached: CachedPolicy<'a>,
    ) -> Response<Bytes> {
        let denial = Denial::new(batch, grpc, self.fields, self.body, cached);
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

/// Whole milliseconds of a duration, rounded up.
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// A wait in whole milliseconds as a person reads it, the same wait every millisecond field
/// gives: `50 ms`, `2.5 s`, `3600 s`.
struct WaitText(u64);

impl std::fmt::Display for WaitText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0;
        if ms < 1000 {
            return write!(f, "{ms} ms");
        }
        let (s, frac) = (ms / 1000, ms % 1000);
        match frac {
            0 => write!(f, "{s} s"),
            _ if frac % 100 == 0 => write!(f, "{s}.{} s", frac / 100),
            _ if frac % 10 == 0 => write!(f, "{s}.{:02} s", frac / 10),
            _ => write!(f, "{s}.{frac:03} s"),
        }
    }
}

fn number(n: u64) -> HeaderValue {
    HeaderValue::from(n)
}

/// Appends the decimal digits of `n` to `buf`.
fn push_u64(buf: &mut Buf, n: u64) {
    buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A header value being built (at its exact size where the layer writes it on every request).
type Buf = Vec<u8>;

/// Appends `"<name>";<a>=<x>;<b>=<y>`, a structured-field list member, to `buf` (`, ` first
/// when the list has members). Names are `[A-Za-z0-9_.-]`, so the value is always valid.
fn push_item(buf: &mut Buf, name: &str, a: u8, x: u64, b: u8, y: u64) {
    if !buf.is_empty() {
        buf.extend_from_slice(b", ");
    }
    buf.push(b'"');
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\";");
    buf.extend_from_slice(&[a, b'=']);
    push_u64(buf, x);
    buf.extend_from_slice(&[b';', b, b'=']);
    push_u64(buf, y);
}

/// Appends `"<name>";q=<max>;qu="concurrent-requests"`, the `RateLimit-Policy` member of a
/// concurrency limit (the draft's quota unit for requests in flight; no window).
fn push_concurrency_policy(buf: &mut Buf, name: &str, max: u64) {
    if !buf.is_empty() {
        buf.extend_from_slice(b", ");
    }
    buf.push(b'"');
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\";q=");
    push_u64(buf, max);
    buf.extend_from_slice(b";qu=\"concurrent-requests\"");
}

/// One structured-field member as a header value.
fn sf_item(name: &str, a: u8, x: u64, b: u8, y: u64) -> HeaderValue {
    let mut buf = Buf::with_capacity(item_len(name, x, y));
    push_item(&mut buf, name, a, x, b, y);
    owned_value(buf)
}

/// The `RateLimit-Policy` value of a limit whose policy does not depend on the decision
/// (`Quota::fixed_policy`), computed once when a layer is built; `None` for another.
pub(crate) fn policy_value(name: &str, quota: &Quota) -> Option<HeaderValue> {
    let (q, w) = quota.fixed_policy()?;
    Some(sf_item(name, b'q', q, b'w', w))
}

/// One reported decision's numbers: its `RateLimit-Policy` member (precomputed, or `q` and
/// `w`) and its `RateLimit` member's `r` and `t` (draft-11; see `docs/keys-and-http.md`).
struct Member<'c> {
    name: LimitName,
    concurrency: bool,
    q: u64,
    w: u64,
    r: u64,
    t: u64,
    /// The legacy `X-RateLimit-Reset`: seconds until the bucket is full, rounded up.
    reset_secs: u64,
    cached: Option<&'c HeaderValue>,
}

impl Member<'_> {
    /// The length of its `RateLimit-Policy` member.
    fn policy_len(&self) -> usize {
        match self.cached {
            Some(v) => v.len(),
            None if self.concurrency => self.name.as_str().len() + 30 + decimal_len(self.q),
            None => item_len(self.name.as_str(), self.q, self.w),
        }
    }

    fn push_policy(&self, buf: &mut Buf) {
        let name = self.name.as_str();
        match self.cached {
            Some(v) => {
                if !buf.is_empty() {
                    buf.extend_from_slice(b", ");
                }
                buf.extend_from_slice(v.as_bytes());
            }
            None if self.concurrency => push_concurrency_policy(buf, name, self.q),
            None => push_item(buf, name, b'q', self.q, b'w', self.w),
        }
    }
}

/// A response's rate-limit fields, written when its decisions are made (the decisions
/// themselves need not be kept): the `RateLimit-Policy` and `RateLimit` values, one member per
/// reported decision, the strictest first, and the legacy fields' numbers (of the strictest).
/// Two values whatever the number of rules, each written once at its exact size.
pub(crate) struct Fields {
    policy: HeaderValue,
    state: HeaderValue,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`.
    legacy: [u64; 3],
}

impl Fields {
    /// The fields of `batch`; `cached` gives a limit's precomputed `RateLimit-Policy` member,
    /// if any. `None` when no decision is reported.
    pub(crate) fn of<'c>(
        batch: &BatchDecision,
        cached: impl Fn(LimitName, &Quota) -> Option<&'c HeaderValue>,
    ) -> Option<Self> {
        Self::from_reported(batch.decisions().iter().map(|d| {
            let seen = Seen::from(d);
            let policy = seen.quota.and_then(|q| cached(seen.name, q));
            (seen, policy)
        }))
    }

    /// The fields of the transactions `items`, each with its precomputed `RateLimit-Policy`
    /// member if any, reporting the strictest first (as [`BatchDecision::strictest`] chooses
    /// it), then every other one that counts, in order. Every item is taken (a caller may count
    /// and trace them on the way). The one home of the fields' numbers.
    pub(crate) fn from_reported<'a, 'c>(
        items: impl Iterator<Item = (Seen<'a>, Option<&'c HeaderValue>)>,
    ) -> Option<Self> {
        // One pass: each member as it comes (on the stack for a request's few rules), the
        // strictest chosen on the way and moved to the front at the end.
        let mut members: SmallVec<[Member<'c>; 8]> = SmallVec::new();
        let mut strictest = Strictest::default();
        let mut first = None;
        for (i, (r, cached)) in items.enumerate() {
            let Some(quota) = r.quota.filter(|_| r.counts) else {
                continue;
            };
            strictest.offer(i, r.allowed, r.retry_after_us, r.remaining);
            // A cached member needs no window.
            let shown = quota.shown(&r.numbers(), cached.is_none());
            if strictest.index() == Some(i) {
                first = shown.map(|_| members.len());
            }
            let Some(shown) = shown else { continue };
            members.push(Member {
                name: r.name,
                concurrency: shown.concurrency,
                q: shown.q,
                w: shown.w,
                r: r.remaining,
                t: ceil_secs_us(shown.t_us),
                reset_secs: ceil_secs_us(r.reset_after_us),
                cached,
            });
        }
        if let Some(at @ 1..) = first {
            members[..=at].rotate_right(1);
        }
        let members: &[Member<'c>] = &members;
        let first = members.first()?;
        let separators = 2 * (members.len() - 1);
        let policy = match (members, first.cached) {
            ([_], Some(v)) => v.clone(),
            _ => {
                let len = members.iter().map(Member::policy_len).sum::<usize>() + separators;
                let mut policy = Buf::with_capacity(len);
                for m in members {
                    m.push_policy(&mut policy);
                }
                debug_assert_eq!(
                    policy.len(),
                    len,
                    "the policy field's length was computed wrong"
                );
                owned_value(policy)
            }
        };
        let len = members
            .iter()
            .map(|m| item_len(m.name.as_str(), m.r, m.t))
            .sum::<usize>()
            + separators;
        let mut state = Buf::with_capacity(len);
        for m in members {
            push_item(&mut state, m.name.as_str(), b'r', m.r, b't', m.t);
        }
        debug_assert_eq!(
            state.len(),
            len,
            "the state field's length was computed wrong"
        );
        Some(Self {
            policy,
            state: owned_value(state),
            legacy: [first.q, first.r, first.reset_secs],
        })
    }

    /// Adds `RateLimit-Policy` and `RateLimit`, appended to members another layer already
    /// wrote, and the legacy `X-RateLimit-*` fields of the strictest when asked (unless
    /// another layer wrote them). A lone member's precomputed policy is shared, not copied.
    fn write(self, headers: &mut HeaderMap, legacy: bool) {
        put(headers, &RATELIMIT_POLICY, self.policy);
        put(headers, &RATELIMIT, self.state);
        if legacy && !headers.contains_key(&X_RATELIMIT_LIMIT) {
            let [limit, remaining, reset] = self.legacy;
            headers.insert(X_RATELIMIT_LIMIT.clone(), number(limit));
            headers.insert(X_RATELIMIT_REMAINING.clone(), number(remaining));
            headers.insert(X_RATELIMIT_RESET.clone(), number(reset));
        }
    }
}

/// The length of the member [`push_item`] writes.
fn item_len(name: &str, x: u64, y: u64) -> usize {
    name.len() + 8 + decimal_len(x) + decimal_len(y)
}

/// The number of decimal digits of `n`, in a few instructions whatever `n` (`ilog10` costs
/// 26): the bit length gives the digits within one, a power of ten settles it.
fn decimal_len(n: u64) -> usize {
    const POW10: [u64; 20] = {
        let mut p = [1u64; 20];
        let mut i = 1;
        while i < 20 {
            p[i] = p[i - 1] * 10;
            i += 1;
        }
        p
    };
    let bits = 64 - (n | 1).leading_zeros() as usize;
    // bits * log10(2), rounded down: floor(log10(n)) or one more (at most 19).
    let guess = (bits * 1233) >> 12;
    let at_least = POW10.get(guess).is_some_and(|&p| n >= p);
    (guess + usize::from(at_least)).max(1)
}

/// A header value that owns `buf`, written at its exact size (so nothing is copied).
fn owned_value(buf: Buf) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::from(buf))
        .unwrap_or_else(|_| HeaderValue::from_static("\"invalid\""))
}

/// Adds `ours` to the field `name`: appended to the members another layer already wrote
/// (stacked layers), else as the field.
fn put(headers: &mut HeaderMap, name: &'static HeaderName, ours: HeaderValue) {
    // One lookup when the field is new (the common case); a field another layer wrote is
    // read back and joined.
    let Some(theirs) = headers.insert(name, ours) else {
        return;
    };
    if let Some(slot) = headers.get_mut(name) {
        let mut both = Buf::with_capacity(theirs.len() + 2 + slot.len());
        both.extend_from_slice(theirs.as_bytes());
        both.extend_from_slice(b", ");
        both.extend_from_slice(slot.as_bytes());
        if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(both)) {
            *slot = v;
        }
    }
}

/// A denied request, as handed to a custom response function
/// ([`RateLimitLayerBuilder::denied_response`](crate::RateLimitLayerBuilder::denied_response)).
pub struct Denial<'a> {
    batch: &'a BatchDecision,
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
            .field("batch", &self.batch)
            .field("grpc", &self.grpc)
            .field("fields", &self.fields)
            .field("body", &self.body)
            .finish_non_exhaustive()
    }
}

impl<'a> Denial<'a> {
    pub(crate) fn new(
        batch: &'a BatchDecision,
        grpc: bool,
        fields: FieldStyle,
        body: ErrorBody,
        cached: CachedPolicy<'a>,
    ) -> Self {
        Self {
            batch,
            grpc,
            fields,
            body,
            cached,
        }
    }

    /// The batch decision; its strictest decision is the one that denied.
    pub fn batch(&self) -> &'a BatchDecision {
        self.batch
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
}

impl Denial<'_> {
    /// The decision that denied.
    pub fn decision(&self) -> Option<&Decision> {
        self.batch.strictest()
    }

    /// How long until the request would be allowed (at least one second in headers).
    pub fn retry_after(&self) -> Duration {
        self.decision().map_or(Duration::ZERO, |d| d.retry_after)
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
    /// for a tiered limit `detail` also has `"tier"`: the tier (from 1) that refused. Written
    /// straight from the denial's numbers into one buffer (keys in this order, as before).
    pub fn json_body(&self) -> Bytes {
        let d = self.decision();
        let mut out = Vec::with_capacity(160);
        out.extend_from_slice(br#"{"errors":[{"code":"TOOMANYREQUESTS","detail":{"entity":"#);
        match d {
            Some(d) => json_id(&mut out, d.key.id()),
            None => out.extend_from_slice(b"\"\""),
        }
        out.extend_from_slice(br#","limiter":"#);
        json_text(&mut out, d.map_or("", |d| d.name.as_str()));
        out.extend_from_slice(br#","retry_after_ms":"#);
        out.extend_from_slice(itoa::Buffer::new().format(self.retry_after_ms()).as_bytes());
        if let Some(t) = d.and_then(|d| d.tiers) {
            out.extend_from_slice(br#","tier":"#);
            out.extend_from_slice(itoa::Buffer::new().format(t.tier).as_bytes());
        }
        out.extend_from_slice(br#"},"message":"too many requests"}]}"#);
        Bytes::from(out)
    }

    /// The RFC 9457 body of a 429: `type` is the draft's `#quota-exceeded` problem type,
    /// `violated-policies` names every limit that denied (strictest first), `retry_after_ms`
    /// is the exact wait:
    /// `{"detail":"..","retry_after_ms":..,"status":429,"title":"Too Many Requests","type":"https://iana.org/assignments/http-problem-types#quota-exceeded","violated-policies":[".."]}`.
    pub fn problem_body(&self) -> Bytes {
        let first = self.decision();
        let violated =
            first
                .into_iter()
                .chain(self.batch.decisions().iter().filter(|d| {
                    d.counts() && !d.allowed && !first.is_some_and(|f| std::ptr::eq(f, *d))
                }));
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(br#"{"detail":"#);
        json_text(
            &mut out,
            format_args!(
                "rate limit {} exceeded; retry after {}",
                first.map_or("", |d| d.name.as_str()),
                WaitText(self.retry_after_ms())
            ),
        );
        out.extend_from_slice(br#","retry_after_ms":"#);
        out.extend_from_slice(itoa::Buffer::new().format(self.retry_after_ms()).as_bytes());
        out.extend_from_slice(br#","status":429,"title":"Too Many Requests","type":"#);
        json_text(&mut out, QUOTA_EXCEEDED);
        out.extend_from_slice(br#","violated-policies":["#);
        for (n, d) in violated.enumerate() {
            if n > 0 {
                out.push(b',');
            }
            json_text(&mut out, d.name.as_str());
        }
        out.extend_from_slice(b"]}");
        Bytes::from(out)
    }

    /// The default response: a gRPC trailers-only `RESOURCE_EXHAUSTED` (with `retry-after`,
    /// `grpc-retry-pushback-ms` and, with the `tonic` feature, `RetryInfo`), or a 429 with
    /// `Retry-After`, the fields of the layer's [`FieldStyle`] and the body of its
    /// [`ErrorBody`] ([`json_body`](Self::json_body) or [`problem_body`](Self::problem_body)).
    pub fn default_response(&self) -> Response<Bytes> {
        let retry = self.retry_after_secs();
        let mut response = if self.grpc {
            let name = self
                .decision()
                .map(|d| d.name.to_string())
                .unwrap_or_default();
            let message = format!(
                "rate limit {name} exceeded; retry after {}",
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
            let (body, content_type) = self.body.denial(self);
            let mut r = Response::new(body);
            *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
            r
        };
        let headers = response.headers_mut();
        headers.insert(RETRY_AFTER, number(retry));
        if let Some(fields) = Fields::of(self.batch, self.cached) {
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
        use tonic_types::{ErrorDetails, StatusExt};
        // The wait every millisecond field gives.
        let mut details =
            ErrorDetails::with_retry_info(Some(Duration::from_millis(self.retry_after_ms())));
        for d in self
            .batch
            .decisions()
            .iter()
            .filter(|d| d.counts() && !d.allowed)
        {
            let wait = WaitText(ceil_ms(d.retry_after).max(1));
            details.add_quota_failure_violation(
                d.name.as_str(),
                format!("rate limit {} exceeded; retry after {wait}", d.name),
            );
        }
        let status =
            tonic::Status::with_error_details(tonic::Code::ResourceExhausted, message, details);
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

/// A gRPC trailers-only response: HTTP 200 with `grpc-status` and `grpc-message` in the
/// headers and an empty body.
pub fn grpc_status(code: u8, message: &str) -> Response<Bytes> {
    let mut r = Response::new(Bytes::new());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    h.insert("grpc-status", number(u64::from(code)));
    // grpc-message is percent-encoded (gRPC over HTTP/2 spec).
    let mut encoded = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(v) = HeaderValue::try_from(encoded) {
        h.insert("grpc-message", v);
    }
    r
}

/// The JSON `code` of an error status: its reason phrase, upper case, without spaces
/// (`400` -> `BADREQUEST`, `401` -> `UNAUTHORIZED`, `500` -> `INTERNALSERVERERROR`).
pub(crate) fn error_code(status: StatusCode) -> String {
    status
        .canonical_reason()
        .unwrap_or("ERROR")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

/// An error answer written by the middleware (not a rate limit): a JSON body with `code`
/// and `message`, or for gRPC a trailers-only status (`code` maps to a gRPC code).
pub(crate) fn error_response(
    status: StatusCode,
    code: &str,
    message: &str,
    grpc: bool,
    body: ErrorBody,
) -> Response<Bytes> {
    if grpc {
        let grpc_code = match status {
            StatusCode::BAD_REQUEST => 3,          // INVALID_ARGUMENT
            StatusCode::UNAUTHORIZED => 16,        // UNAUTHENTICATED
            StatusCode::SERVICE_UNAVAILABLE => 14, // UNAVAILABLE
            _ => 13,                               // INTERNAL
        };
        return grpc_status(grpc_code, message);
    }
    body.error(status, code, message)
}

/// `application/problem+json` (RFC 9457).
const PROBLEM_JSON: &str = "application/problem+json";

/// The problem type of a rate-limited request (draft-ietf-httpapi-ratelimit-headers-11).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Writes `value`'s text as a JSON string (quoted and escaped), with no string in between.
fn json_text(out: &mut Vec<u8>, value: impl std::fmt::Display) {
    use serde::Serializer;
    // Writing to a Vec cannot fail, nor can the Display of a name, an id or a number.
    let _ = serde_json::Serializer::new(out).collect_str(&value);
}

/// Writes an id as a JSON string, as its `Display` text: an IPv4 address or a number with
/// integer digits ([`Id::digits`](crate::key::Id::digits)), the rest escaped.
fn json_id(out: &mut Vec<u8>, id: &crate::key::Id) {
    match id.digits() {
        Some(digits) => {
            out.push(b'"');
            out.extend_from_slice(digits.as_bytes());
            out.push(b'"');
        }
        None => json_text(out, id),
    }
}

fn json_response(status: StatusCode, body: Bytes, content_type: &'static str) -> Response<Bytes> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Whether a request is a gRPC call (`content-type: application/grpc...`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::decimal_len;

    /// A wait reads as the milliseconds every field gives, in the unit a person reads.
    #[test]
    fn a_wait_reads_as_its_milliseconds() {
        use super::WaitText;
        for (ms, text) in [
            (1, "1 ms"),
            (50, "50 ms"),
            (999, "999 ms"),
            (1000, "1 s"),
            (1001, "1.001 s"),
            (2500, "2.5 s"),
            (2550, "2.55 s"),
            (3_600_000, "3600 s"),
        ] {
            assert_eq!(WaitText(ms).to_string(), text);
        }
    }

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
