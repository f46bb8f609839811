//! Outcome rules: a rule that counts a request only when its response says so ("10 failed
//! logins an hour per account"), each counted outcome with a weight. Built on settling: the
//! request reserves the largest weight it could count when it is decided (so a thousand
//! attempts in parallel cannot all pass a limit of ten, and a key at its limit is refused
//! before the service runs), and its response settles what its outcome counts (the rest is
//! given back). A request that ends without a response keeps its reservation: hanging up
//! does not escape counting.

use std::ops::RangeInclusive;
use std::sync::Arc;

use http::response::Parts;
use http::{HeaderName, HeaderValue};

use super::settle::{MOST_UNITS_REPORTED, Settle, SettleError, header_name};

type OutcomeFn = Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// Which responses a rule counts, and how much each counts ([`Rule::count_when`]).
///
/// Cases are tried in the order they were added, and the first that matches gives the
/// response's weight; a response no case matches counts nothing. Weights are 0 to 2^40 (a
/// case of weight 0 names an outcome that never counts, ahead of broader cases).
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
    Head(OutcomeFn),
}

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

    /// Responses whose head `f` accepts count `weight`.
    pub fn response(self, f: impl Fn(&Parts) -> bool + Send + Sync + 'static, weight: u64) -> Self {
        self.case(Ok(Matcher::Head(Arc::new(f))), weight)
    }

    fn case(mut self, matcher: Result<Matcher, SettleError>, weight: u64) -> Self {
        let matcher = match matcher {
            Ok(_) if weight > MOST_UNITS_REPORTED => Err(SettleError::Weight(weight)),
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

    /// What the response `head` counts: the weight of the first case it matches, or 0.
    pub(crate) fn weight_of(&self, head: &Parts) -> u64 {
        self.cases
            .iter()
            .find(|(matcher, _)| matcher.matches(head))
            .map_or(0, |&(_, weight)| weight)
    }

    /// The settle that counts what the response shows, or why these cases cannot be used.
    pub(crate) fn into_settle(self) -> Result<Settle, SettleError> {
        if let Some(reason) = self.invalid {
            return Err(reason);
        }
        if self.most() == 0 {
            return Err(SettleError::NothingCounts);
        }
        Ok(Settle::response(move |head| Some(self.weight_of(head))))
    }
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
        /// A service that answers 200 to everything.
        #[derive(Clone)]
        struct Ok200;
        impl Service<http::Request<String>> for Ok200 {
            type Response = http::Response<axum::body::Body>;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
            fn poll_ready(
                &mut self,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Self::Error>> {
                std::task::Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: http::Request<String>) -> Self::Future {
                std::future::ready(Ok(http::Response::new(axum::body::Body::from("ok"))))
            }
        }
        let mut service = layer.layer(Ok200);
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
        assert_eq!(cw.weight_of(&head(200, &[])), 0);
        assert_eq!(cw.weight_of(&head(401, &[])), 1);
        assert_eq!(cw.weight_of(&head(401, &[("x-login-failure", "mfa")])), 3);
        assert_eq!(cw.weight_of(&head(401, &[("x-login-failure", "MFA")])), 1);
        assert_eq!(cw.weight_of(&head(503, &[])), 0, "a weight of 0 ahead");
        assert_eq!(cw.weight_of(&head(429, &[])), 2);
    }

    #[test]
    fn a_header_sent_twice_matches_no_value_but_is_present() {
        let cw = CountWhen::new()
            .header_equals("x-outcome", "failed", 5)
            .header("x-outcome", 1);
        let twice = head(200, &[("x-outcome", "failed"), ("x-outcome", "failed")]);
        assert_eq!(cw.weight_of(&twice), 1);
        assert_eq!(cw.weight_of(&head(200, &[("x-outcome", "failed")])), 5);
        assert_eq!(cw.weight_of(&head(200, &[])), 0);
    }

    #[test]
    fn bad_cases_are_refused_with_their_reason() {
        let refused = |cw: CountWhen| cw.into_settle().map(|_| ()).unwrap_err();
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
        assert!(
            CountWhen::new()
                .status_range(100..=599, 1)
                .into_settle()
                .is_ok()
        );
        assert_eq!(
            refused(CountWhen::new().status(401, 0)),
            SettleError::NothingCounts
        );
        // A refused case refuses the whole, even beside good ones.
        assert_eq!(
            refused(CountWhen::new().status(401, 1).header("bad name", 1)),
            SettleError::NotAHeaderName("bad name".into())
        );
        assert!(
            CountWhen::new()
                .status(401, MOST_UNITS_REPORTED)
                .into_settle()
                .is_ok()
        );
    }
}
