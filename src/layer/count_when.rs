//! Outcome rules: a rule that counts a request only when its response says so ("10 failed
//! logins an hour per account"), each counted outcome with a weight. Built on settling: the
//! request reserves the largest weight it could count when it is decided (so a thousand
//! attempts in parallel cannot all pass a limit of ten, and a key at its limit is refused
//! before the service runs), and its response settles what its outcome counts (the rest is
//! given back). A request that ends without a response keeps its reservation: hanging up
//! does not escape counting.
//!
//! Most cases are read in the response head. A gRPC status may come in the trailers instead
//! (a call that answered a message first): a rule with a gRPC case reads the head when it
//! comes ([`Marks`]) and settles when the body ends, from the trailers.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use http::response::Parts;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::response::is_grpc;
use super::settle::error::{MOST_UNITS_REPORTED, SettleError, header_name};

type OutcomeFn = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// Which responses a rule counts, and how much each counts ([`Rule::count_when`]).
///
/// Cases are tried in the order they were added, and the first that matches gives the
/// response's weight; a response no case matches counts nothing. Weights are 0 to 2^40 (a
/// case of weight 0 names an outcome that never counts, ahead of broader cases); a rule has
/// at most 64 cases.
///
/// A rule with a [`grpc_status`](Self::grpc_status) case settles when the response's body
/// ends, where a gRPC call's status is (its trailers; a call refused at once has it in its
/// head). A gRPC response whose status never comes (the client went away, the body broke
/// off) keeps the whole reservation, as a request without a response does.
///
/// ```
/// use tower_ratelimits::{CountWhen, Header, Rule};
/// // Failed logins per account: a wrong password counts 1, a wrong MFA code 3.
/// let rule = Rule::new("FailedLoginsPerAccount", Header::new("x-account"))
///     .count_when(
///         CountWhen::new()
///             .header_equals("x-login-failure", "mfa", 3)
///             .status(401, 1),
///     );
/// ```
///
/// [`Rule::count_when`]: crate::Rule::count_when
#[derive(Clone, Default)]
pub struct CountWhen {
    cases: Vec<(Matcher, u64)>,
    /// The first case refused, with its reason (refused when the layer is built).
    invalid: Option<SettleError>,
}

#[derive(Clone)]
enum Matcher {
    Status(RangeInclusive<u16>),
    Header(HeaderName),
    HeaderEquals(HeaderName, HeaderValue),
    GrpcStatus(u8),
    LatencyAbove(Duration),
    Head(OutcomeFn),
}

/// The most cases a [`CountWhen`] may have.
pub(crate) const MOST_CASES: usize = 64;

/// The highest gRPC status code (`UNAUTHENTICATED`, 16).
const MOST_GRPC_CODE: u32 = 16;

impl std::fmt::Debug for CountWhen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        for (matcher, weight) in &self.cases {
            match matcher {
                Matcher::Status(codes) => list.entry(&format_args!("status {codes:?}: {weight}")),
                Matcher::Header(name) => list.entry(&format_args!("header {name}: {weight}")),
                Matcher::HeaderEquals(name, value) => {
                    list.entry(&format_args!("header {name} = {value:?}: {weight}"))
                }
                Matcher::GrpcStatus(code) => {
                    list.entry(&format_args!("grpc-status {code}: {weight}"))
                }
                Matcher::LatencyAbove(bound) => {
                    list.entry(&format_args!("latency above {bound:?}: {weight}"))
                }
                Matcher::Head(_) => list.entry(&format_args!("response(..): {weight}")),
            };
        }
        list.finish()
    }
}

impl CountWhen {
    /// No case yet: add them with the methods below.
    pub fn new() -> Self {
        Self::default()
    }

    /// Responses with this status code count `weight`.
    pub fn status(self, code: u16, weight: u64) -> Self {
        self.status_range(code..=code, weight)
    }

    /// Responses whose status code is in `codes` (`500..=599`) count `weight`. Codes are 100
    /// to 599 and the start is at most the end ([`SettleError::Status`] otherwise).
    pub fn status_range(self, codes: RangeInclusive<u16>, weight: u64) -> Self {
        let (lo, hi) = (*codes.start(), *codes.end());
        let matcher = if (100..=599).contains(&lo) && (lo..=599).contains(&hi) {
            Ok(Matcher::Status(codes))
        } else {
            Err(SettleError::Status(lo, hi))
        };
        self.case(matcher, weight)
    }

    /// Responses that carry the header `name` count `weight`.
    pub fn header(self, name: &str, weight: u64) -> Self {
        let matcher = header_name(name).map(Matcher::Header);
        self.case(matcher, weight)
    }

    /// Responses whose header `name` has exactly the value `value`, sent once, count
    /// `weight`. A header sent twice is ambiguous and matches no value.
    pub fn header_equals(self, name: &str, value: &str, weight: u64) -> Self {
        let matcher = header_name(name).and_then(|name| {
            HeaderValue::from_str(value)
                .map(|value| Matcher::HeaderEquals(name, value))
                .map_err(|_| SettleError::NotAHeaderValue(value.to_owned()))
        });
        self.case(matcher, weight)
    }

    /// [`header`](Self::header) of a name already checked (a rules file's).
    #[cfg(feature = "yaml")]
    pub(crate) fn header_named(self, name: HeaderName, weight: u64) -> Self {
        self.case(Ok(Matcher::Header(name)), weight)
    }

    /// [`header_equals`](Self::header_equals) of a name and a value already checked (a rules
    /// file's).
    #[cfg(feature = "yaml")]
    pub(crate) fn header_value(self, name: HeaderName, value: HeaderValue, weight: u64) -> Self {
        self.case(Ok(Matcher::HeaderEquals(name, value)), weight)
    }

    /// gRPC calls that end with the status `code` (0 to 16: 16 is `UNAUTHENTICATED`, 7
    /// `PERMISSION_DENIED`) count `weight`, read where the call puts it: its trailers, or its
    /// head for a call refused at once. A response that is not gRPC (its `content-type` not
    /// `application/grpc`) never matches, and a status sent twice is ambiguous and matches no
    /// code. The rule then settles when the body ends ([`CountWhen`]).
    pub fn grpc_status(self, code: u32, weight: u64) -> Self {
        let matcher = match u8::try_from(code) {
            Ok(c) if code <= MOST_GRPC_CODE => Ok(Matcher::GrpcStatus(c)),
            _ => Err(SettleError::GrpcStatus(code)),
        };
        self.case(matcher, weight)
    }

    /// Responses whose head comes more than `bound` after the request was let through count
    /// `weight` (a slow, expensive query). The time runs on tokio's clock (a test's paused
    /// time moves it). A bound of zero is refused ([`SettleError::Latency`]): it would count
    /// every response.
    pub fn latency_above(self, bound: Duration, weight: u64) -> Self {
        let matcher = match bound.is_zero() {
            true => Err(SettleError::Latency),
            false => Ok(Matcher::LatencyAbove(bound)),
        };
        self.case(matcher, weight)
    }

    /// Responses whose head `f` accepts count `weight`.
    pub fn response(self, f: impl Fn(&Parts) -> bool + Send + Sync + 'static, weight: u64) -> Self {
        self.case(Ok(Matcher::Head(Arc::new(f))), weight)
    }

    fn case(mut self, matcher: Result<Matcher, SettleError>, weight: u64) -> Self {
        let matcher = match matcher {
            Ok(_) if weight > MOST_UNITS_REPORTED => Err(SettleError::Weight(weight)),
            Ok(_) if self.cases.len() >= MOST_CASES => Err(SettleError::Cases),
            other => other,
        };
        match matcher {
            Ok(matcher) => self.cases.push((matcher, weight)),
            Err(reason) => {
                self.invalid.get_or_insert(reason);
            }
        }
        self
    }

    /// The largest weight a response could count: what a request reserves.
    pub(crate) fn most(&self) -> u64 {
        self.cases.iter().map(|&(_, w)| w).max().unwrap_or(0)
    }

    /// Whether a case reads the trailers (a gRPC status): the rule settles when the body ends.
    pub(crate) fn reads_trailers(&self) -> bool {
        self.cases
            .iter()
            .any(|(m, _)| matches!(m, Matcher::GrpcStatus(_)))
    }

    /// Whether a case reads the request's latency: the layer then notes when it let the
    /// request through.
    pub(crate) fn times(&self) -> bool {
        self.cases
            .iter()
            .any(|(m, _)| matches!(m, Matcher::LatencyAbove(_)))
    }

    /// What the response head shows of its cases, its head coming `latency` after the
    /// request was let through: the first case it matches, and the cases before it that wait
    /// for the trailers (a gRPC case of a gRPC response whose head has no status). The cases
    /// after the first match are not looked at (their functions are not called).
    pub(crate) fn marks(&self, head: &Parts, latency: Duration) -> Marks {
        // Whether the response is gRPC, and its status in the head: read at the first gRPC
        // case, once (a rule without one reads neither).
        let mut grpc: Option<(bool, Option<Option<u8>>)> = None;
        let mut marks = Marks::default();
        for (i, (matcher, _)) in self.cases.iter().enumerate() {
            let bit = 1u64 << i;
            let matched = match matcher {
                Matcher::GrpcStatus(code) => {
                    let (is, status) = *grpc.get_or_insert_with(|| {
                        let is = is_grpc(&head.headers);
                        (is, is.then(|| grpc_status_in(&head.headers)).flatten())
                    });
                    if is && status.is_none() {
                        marks.open |= bit;
                        continue;
                    }
                    status == Some(Some(*code))
                }
                Matcher::LatencyAbove(bound) => latency > *bound,
                other => other.matches(head),
            };
            if matched {
                marks.matched |= bit;
                break;
            }
        }
        marks
    }

    /// What a response counts from its head's `marks` and, for the cases that wait for them,
    /// the trailers the body ended with (`None`: it ended without any, or broke off): the
    /// weight of the first case that matches, 0 when none does, and `None` when a case that
    /// waits comes first and the status never came (the reservation stands).
    pub(crate) fn weight_at_end(&self, marks: Marks, trailers: Option<&HeaderMap>) -> Option<u64> {
        let status = trailers.and_then(grpc_status_in);
        for (i, (matcher, weight)) in self.cases.iter().enumerate() {
            let bit = 1u64 << i;
            if marks.matched & bit != 0 {
                return Some(*weight);
            }
            if marks.open & bit != 0 {
                let Matcher::GrpcStatus(code) = matcher else {
                    continue;
                };
                match status? {
                    Some(found) if found == *code => return Some(*weight),
                    _ => {}
                }
            }
        }
        Some(0)
    }

    /// Why these cases cannot be used, if they cannot: the first case refused, or nothing
    /// that counts.
    pub(crate) fn check(&self) -> Result<(), SettleError> {
        if let Some(reason) = &self.invalid {
            return Err(reason.clone());
        }
        if self.most() == 0 {
            return Err(SettleError::NothingCounts);
        }
        Ok(())
    }
}

/// What a response head showed of a [`CountWhen`]'s cases, one bit per case in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Marks {
    /// The cases the head matches.
    matched: u64,
    /// The cases that wait for the trailers (a gRPC status not in the head).
    open: u64,
}

impl Marks {
    /// What the head alone counts: the weight of its first matching case when no case before
    /// it waits for the trailers (`None` when one does).
    pub(crate) fn weight(self, cases: &CountWhen) -> Option<u64> {
        cases.weight_at_end(self, None)
    }
}

/// The gRPC status in `headers`: `None` when there is none, `Some(None)` when it is not one
/// code (sent twice, or not a number from 0 to 16: it matches no case).
fn grpc_status_in(headers: &HeaderMap) -> Option<Option<u8>> {
    let mut values = headers.get_all("grpc-status").iter();
    let first = values.next()?;
    if values.next().is_some() {
        return Some(None);
    }
    let code = std::str::from_utf8(first.as_bytes())
        .ok()
        .and_then(|t| t.parse::<u8>().ok())
        .filter(|&c| u32::from(c) <= MOST_GRPC_CODE);
    Some(code)
}

impl Matcher {
    fn matches(&self, head: &Parts) -> bool {
        match self {
            Matcher::Status(codes) => codes.contains(&head.status.as_u16()),
            Matcher::Header(name) => head.headers.contains_key(name),
            Matcher::HeaderEquals(name, value) => {
                let mut values = head.headers.get_all(name).iter();
                values.next() == Some(value) && values.next().is_none()
            }
            Matcher::Head(f) => f(head),
            // Read by `CountWhen::marks`, which knows the latency and the gRPC status.
            Matcher::GrpcStatus(_) | Matcher::LatencyAbove(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16, headers: &[(&str, &str)]) -> Parts {
        let mut response = http::Response::builder().status(status);
        for (name, value) in headers {
            response = response.header(*name, *value);
        }
        response.body(()).unwrap().into_parts().0
    }

    /// What the head alone counts, its latency 0.
    fn weight(cw: &CountWhen, head: &Parts) -> u64 {
        cw.marks(head, Duration::ZERO).weight(cw).unwrap()
    }

    /// Polls `f` to its end with no runtime around it (a layer driven by another executor).
    fn no_runtime<F: std::future::Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for _ in 0..1_000 {
            if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
                return out;
            }
        }
        panic!("a memory store's request never ended");
    }

    /// An uncounted outcome gives its unit back with no tokio runtime (the settle's timeout
    /// needed one: the response panicked).
    #[test]
    #[cfg(feature = "axum")]
    fn an_outcome_settles_outside_a_tokio_runtime() {
        use tower_layer::Layer;
        use tower_service::Service;
        let limits = crate::Limits::from_yaml_str("Logins: {burst: 3, count: 3, period: 1h}", None);
        let limiter = crate::Limiter::new(limits.unwrap(), crate::MemoryBackend::new());
        let rule = crate::Rule::new("Logins", crate::Header::new("x-account"))
            .count_when(CountWhen::new().status(401, 1));
        let layer = crate::RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
        // Answers at once: no timer, no runtime needed.
        let mut service = layer.layer(Slow(Duration::ZERO));
        for _ in 0..10 {
            let request = http::Request::builder()
                .header("x-account", "a")
                .body(String::new())
                .unwrap();
            let response = no_runtime(service.call(request)).unwrap();
            assert_eq!(response.status(), 200);
        }
        let key = limiter.key("Logins", crate::Id::new("a").unwrap()).unwrap();
        let probe = crate::Transaction::new(key).cost(0);
        let remaining = no_runtime(limiter.check(&[probe])).unwrap().decisions()[0].remaining();
        assert_eq!(remaining, 3, "ten successes count nothing");
    }

    #[test]
    fn the_first_case_that_matches_gives_the_weight() {
        let cw = CountWhen::new()
            .header_equals("x-login-failure", "mfa", 3)
            .status(401, 1)
            .status_range(500..=599, 0)
            .status_range(400..=599, 2);
        assert_eq!(cw.most(), 3);
        assert_eq!(weight(&cw, &head(200, &[])), 0);
        assert_eq!(weight(&cw, &head(401, &[])), 1);
        assert_eq!(weight(&cw, &head(401, &[("x-login-failure", "mfa")])), 3);
        assert_eq!(weight(&cw, &head(401, &[("x-login-failure", "MFA")])), 1);
        assert_eq!(weight(&cw, &head(503, &[])), 0, "a weight of 0 ahead");
        assert_eq!(weight(&cw, &head(429, &[])), 2);
    }

    /// A gRPC response's head: `content-type: application/grpc`, and these headers.
    fn grpc_head(headers: &[(&str, &str)]) -> Parts {
        let mut all = vec![("content-type", "application/grpc")];
        all.extend_from_slice(headers);
        head(200, &all)
    }

    fn trailers(status: &[&str]) -> http::HeaderMap {
        let mut t = http::HeaderMap::new();
        for s in status {
            t.append("grpc-status", HeaderValue::from_str(s).unwrap());
        }
        t
    }

    #[test]
    fn a_grpc_status_is_read_in_the_head_or_the_trailers() {
        let cw = CountWhen::new()
            .grpc_status(16, 3)
            .grpc_status(7, 1)
            .status_range(500..=599, 5);
        assert!(cw.reads_trailers());
        // A call refused at once: its status in its head decides there.
        let refused = cw.marks(&grpc_head(&[("grpc-status", "16")]), Duration::ZERO);
        assert_eq!(refused.weight(&cw), Some(3));
        assert_eq!(cw.weight_at_end(refused, None), Some(3));
        // A call that answered: its head waits for the trailers.
        let answered = cw.marks(&grpc_head(&[]), Duration::ZERO);
        assert_eq!(answered.weight(&cw), None);
        for (status, counted) in [
            (&["7"][..], Some(1)),
            (&["16"], Some(3)),
            (&["0"], Some(0)),
            (&["16", "16"], Some(0)),
            (&["x"], Some(0)),
            (&["17"], Some(0)),
            (&[], None),
        ] {
            let t = trailers(status);
            assert_eq!(
                cw.weight_at_end(answered, Some(&t)),
                counted,
                "trailers {status:?}"
            );
        }
        // A body that broke off before its trailers: the reservation stands.
        assert_eq!(cw.weight_at_end(answered, None), None);
        // Not a gRPC response: the gRPC cases match nothing, the rest are read in the head.
        let http = cw.marks(&head(503, &[("grpc-status", "16")]), Duration::ZERO);
        assert_eq!(http.weight(&cw), Some(5));
        assert_eq!(cw.weight_at_end(http, Some(&trailers(&["16"]))), Some(5));
    }

    #[test]
    fn a_case_before_an_open_grpc_case_decides_in_the_head() {
        let cw = CountWhen::new().header("x-failed", 2).grpc_status(16, 3);
        let failed = cw.marks(&grpc_head(&[("x-failed", "1")]), Duration::ZERO);
        assert_eq!(failed.weight(&cw), Some(2));
        assert_eq!(
            cw.weight_at_end(failed, None),
            Some(2),
            "no trailers needed"
        );
        let open = cw.marks(&grpc_head(&[]), Duration::ZERO);
        assert_eq!(cw.weight_at_end(open, Some(&trailers(&["16"]))), Some(3));
    }

    #[test]
    fn the_cases_after_the_first_match_are_not_looked_at() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = calls.clone();
        let cw = CountWhen::new().status(401, 1).response(
            move |_| {
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            },
            2,
        );
        assert_eq!(weight(&cw, &head(401, &[])), 1);
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(weight(&cw, &head(200, &[])), 2);
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn latency_counts_above_its_bound_only() {
        let cw = CountWhen::new().latency_above(Duration::from_secs(2), 4);
        assert!(cw.times() && !cw.reads_trailers());
        let at = |ms| {
            cw.marks(&head(200, &[]), Duration::from_millis(ms))
                .weight(&cw)
        };
        assert_eq!(at(1_999), Some(0));
        assert_eq!(at(2_000), Some(0), "at the bound: not above it");
        assert_eq!(at(2_001), Some(4));
    }

    /// A service that answers 200, after this delay on tokio's clock to a request with an
    /// `x-slow` header (0: at once, with no timer).
    #[cfg(feature = "axum")]
    #[derive(Clone)]
    struct Slow(Duration);

    #[cfg(feature = "axum")]
    impl tower_service::Service<http::Request<String>> for Slow {
        type Response = http::Response<axum::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, request: http::Request<String>) -> Self::Future {
            let delay = match request.headers().contains_key("x-slow") {
                true => self.0,
                false => Duration::ZERO,
            };
            Box::pin(async move {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Ok(http::Response::new(axum::body::Body::from("ok")))
            })
        }
    }

    /// Slow answers count through the layer, on tokio's paused clock: two slow requests use a
    /// limit of 2, fast ones use none of it.
    #[tokio::test(start_paused = true)]
    #[cfg(feature = "axum")]
    async fn slow_responses_count_through_the_layer() {
        use tower_service::Service;
        let limits = crate::Limits::from_yaml_str("Slow: {burst: 2, count: 2, period: 1h}", None);
        let limiter = crate::Limiter::new(limits.unwrap(), crate::MemoryBackend::new());
        let rule = crate::Rule::new("Slow", crate::Header::new("x-account"))
            .count_when(CountWhen::new().latency_above(Duration::from_secs(1), 1));
        let layer = crate::RateLimitLayer::new(limiter.clone(), [rule]).unwrap();
        let service = tower_layer::Layer::layer(&layer, Slow(Duration::from_millis(1_001)));
        let call = |slow: bool| {
            let mut request = http::Request::builder().header("x-account", "a");
            if slow {
                request = request.header("x-slow", "1");
            }
            // `Slow` is always ready: no `poll_ready` needed.
            service.clone().call(request.body(String::new()).unwrap())
        };
        let key = limiter.key("Slow", crate::Id::new("a").unwrap()).unwrap();
        let remaining = || async {
            let probe = crate::Transaction::new(key.clone()).cost(0);
            limiter.check(&[probe]).await.unwrap().decisions()[0].remaining()
        };
        for _ in 0..5 {
            assert_eq!(call(false).await.unwrap().status(), 200);
        }
        assert_eq!(remaining().await, 2, "fast answers count nothing");
        for _ in 0..2 {
            assert_eq!(call(true).await.unwrap().status(), 200);
        }
        assert_eq!(remaining().await, 0, "each slow answer counts 1");
        assert_eq!(
            call(false).await.unwrap().status(),
            429,
            "the key is refused"
        );
    }

    #[test]
    fn a_header_sent_twice_matches_no_value_but_is_present() {
        let cw = CountWhen::new()
            .header_equals("x-outcome", "failed", 5)
            .header("x-outcome", 1);
        let twice = head(200, &[("x-outcome", "failed"), ("x-outcome", "failed")]);
        assert_eq!(weight(&cw, &twice), 1);
        assert_eq!(weight(&cw, &head(200, &[("x-outcome", "failed")])), 5);
        assert_eq!(weight(&cw, &head(200, &[])), 0);
    }

    #[test]
    fn bad_cases_are_refused_with_their_reason() {
        let refused = |cw: CountWhen| cw.check().unwrap_err();
        assert_eq!(
            refused(CountWhen::new().header("bad name", 1)),
            SettleError::NotAHeaderName("bad name".into())
        );
        assert_eq!(
            refused(CountWhen::new().header_equals("x-a", "bad\nvalue", 1)),
            SettleError::NotAHeaderValue("bad\nvalue".into())
        );
        assert_eq!(
            refused(CountWhen::new().status(401, MOST_UNITS_REPORTED + 1)),
            SettleError::Weight(MOST_UNITS_REPORTED + 1)
        );
        assert_eq!(refused(CountWhen::new()), SettleError::NothingCounts);
        for (lo, hi) in [(99, 99), (600, 600), (0, 700), (500, 400), (400, 600)] {
            assert_eq!(
                refused(CountWhen::new().status_range(lo..=hi, 1)),
                SettleError::Status(lo, hi)
            );
        }
        assert!(CountWhen::new().status_range(100..=599, 1).check().is_ok());
        assert_eq!(
            refused(CountWhen::new().status(401, 0)),
            SettleError::NothingCounts
        );
        assert_eq!(
            refused(CountWhen::new().grpc_status(17, 1)),
            SettleError::GrpcStatus(17)
        );
        assert_eq!(
            refused(CountWhen::new().grpc_status(u32::MAX, 1)),
            SettleError::GrpcStatus(u32::MAX)
        );
        assert_eq!(
            refused(CountWhen::new().latency_above(Duration::ZERO, 1)),
            SettleError::Latency
        );
        let many = (0..MOST_CASES).fold(CountWhen::new(), |cw, _| cw.status(401, 1));
        assert!(many.clone().check().is_ok());
        let too_many = refused(many.status(402, 1));
        assert_eq!(too_many, SettleError::Cases);
        assert!(
            too_many
                .to_string()
                .contains(&format!("more than {MOST_CASES}"))
        );
        // A refused case refuses the whole, even beside good ones.
        assert_eq!(
            refused(CountWhen::new().status(401, 1).header("bad name", 1)),
            SettleError::NotAHeaderName("bad name".into())
        );
        assert!(
            CountWhen::new()
                .status(401, MOST_UNITS_REPORTED)
                .check()
                .is_ok()
        );
    }
}
