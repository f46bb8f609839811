//! A hand-written GCRA rate limit in front of axum: the floor a layer is measured against. One
//! `Mutex<HashMap<IpAddr, u64>>` of theoretical arrival times keyed by the peer address
//! (`ConnectInfo`), an empty `429` with `Retry-After`, and with `fields` the IETF `RateLimit`
//! and `RateLimit-Policy` fields written by hand on every answer. No configuration, no store,
//! no extractor, no key other than the address. A floor, not a peer: its header names are
//! constants (never parsed per request) and its map hashes with foldhash, the fastest hasher
//! the crate itself uses.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};

/// The fields' names, made once (a `&str` name is parsed on every insert: 724 instructions a
/// request with both fields).
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// The layer: `burst` requests at once, then one every `interval`, per peer address.
#[derive(Clone)]
pub struct Handwritten {
    state: Arc<State>,
}

struct State {
    tats: Mutex<HashMap<IpAddr, u64, foldhash::fast::RandomState>>,
    /// The emission interval, in microseconds.
    interval_us: u64,
    /// `(burst - 1) * interval`: how far ahead of now a TAT may run and still admit.
    tolerance_us: u64,
    fields: bool,
    /// `"default";q=<burst>;w=<window>`, written once.
    policy: HeaderValue,
    start: Instant,
}

/// A decision: allowed or not, what is left, and the seconds until the bucket is full again
/// (allowed) or the request fits (denied).
struct Verdict {
    allowed: bool,
    remaining: u64,
    seconds: u64,
}

impl Handwritten {
    pub fn new(burst: u64, interval: std::time::Duration, fields: bool) -> Self {
        let interval_us = u64::try_from(interval.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let tolerance_us = burst.max(1).saturating_sub(1).saturating_mul(interval_us);
        let window_s = (tolerance_us + interval_us).div_ceil(1_000_000);
        let policy = HeaderValue::from_str(&format!("\"default\";q={burst};w={window_s}"))
            .unwrap_or_else(|_| HeaderValue::from_static("\"default\""));
        Self {
            state: Arc::new(State {
                tats: Mutex::new(HashMap::default()),
                interval_us,
                tolerance_us,
                fields,
                policy,
                start: Instant::now(),
            }),
        }
    }
}

impl State {
    fn decide(&self, ip: IpAddr) -> Verdict {
        let now = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let mut tats = self.tats.lock().unwrap_or_else(PoisonError::into_inner);
        let tat = tats.get(&ip).copied().unwrap_or(0).max(now);
        let allow_at = tat.saturating_sub(self.tolerance_us);
        if now < allow_at {
            return Verdict {
                allowed: false,
                remaining: 0,
                seconds: (allow_at - now).div_ceil(1_000_000),
            };
        }
        let new_tat = tat + self.interval_us;
        tats.insert(ip, new_tat);
        Verdict {
            allowed: true,
            remaining: (now + self.tolerance_us + self.interval_us - new_tat) / self.interval_us,
            seconds: (new_tat - now).div_ceil(1_000_000),
        }
    }

    /// `"default";r=<remaining>;t=<seconds>`, its digits written into a stack buffer.
    fn rate_limit(v: &Verdict) -> HeaderValue {
        const NAME: &[u8] = b"\"default\";r=";
        let mut buf = [0u8; 64];
        buf[..NAME.len()].copy_from_slice(NAME);
        let mut n = NAME.len();
        n += digits(v.remaining, &mut buf[n..]);
        buf[n..n + 3].copy_from_slice(b";t=");
        n += 3;
        n += digits(v.seconds, &mut buf[n..]);
        HeaderValue::from_bytes(&buf[..n])
            .unwrap_or_else(|_| HeaderValue::from_static("\"default\""))
    }
}

/// Writes `v` in decimal at the start of `out`; how many bytes.
fn digits(mut v: u64, out: &mut [u8]) -> usize {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let len = tmp.len() - i;
    out[..len].copy_from_slice(&tmp[i..]);
    len
}

impl<S> tower::Layer<S> for Handwritten {
    type Service = HandwrittenService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HandwrittenService {
            inner,
            state: self.state.clone(),
        }
    }
}

#[derive(Clone)]
pub struct HandwrittenService<S> {
    inner: S,
    state: Arc<State>,
}

impl<S> tower::Service<Request<Body>> for HandwrittenService<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Answer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let Some(ConnectInfo(peer)) = req.extensions().get::<ConnectInfo<SocketAddr>>().copied()
        else {
            return Answer::Allowed {
                inner: self.inner.call(req),
                fields: None,
            };
        };
        let v = self.state.decide(peer.ip());
        let fields = self
            .state
            .fields
            .then(|| [State::rate_limit(&v), self.state.policy.clone()]);
        if v.allowed {
            return Answer::Allowed {
                inner: self.inner.call(req),
                fields,
            };
        }
        let mut response = Response::new(Body::empty());
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let headers = response.headers_mut();
        let mut buf = [0u8; 20];
        let n = digits(v.seconds, &mut buf);
        if let Ok(retry) = HeaderValue::from_bytes(&buf[..n]) {
            headers.insert(http::header::RETRY_AFTER, retry);
        }
        if let Some([limit, policy]) = fields {
            headers.insert(RATELIMIT, limit);
            headers.insert(RATELIMIT_POLICY, policy);
        }
        Answer::Denied(Some(response))
    }
}

/// The inner service's answer with the fields added, or the `429`.
pub enum Answer<F> {
    Denied(Option<Response<Body>>),
    Allowed {
        inner: F,
        fields: Option<[HeaderValue; 2]>,
    },
}

impl<F, E> Future for Answer<F>
where
    F: Future<Output = Result<Response<Body>, E>>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: `inner` is pinned with the answer and never moved out of it; the other
        // fields are never pinned.
        let this = unsafe { self.get_unchecked_mut() };
        match this {
            Answer::Denied(response) => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
            Answer::Allowed { inner, fields } => {
                // SAFETY: see above.
                let inner = unsafe { Pin::new_unchecked(inner) };
                let mut response = match inner.poll(cx) {
                    Poll::Ready(r) => r?,
                    Poll::Pending => return Poll::Pending,
                };
                if let Some([limit, policy]) = fields.take() {
                    let headers = response.headers_mut();
                    headers.insert(RATELIMIT, limit);
                    headers.insert(RATELIMIT_POLICY, policy);
                }
                Poll::Ready(Ok(response))
            }
        }
    }
}
