//! The slots an allowed request holds on concurrency limits, given back when it ends.
//!
//! A [`Release`] owns the request's leases. The response future holds it until the inner
//! service answers, then the response body holds it until its end; whichever way the request
//! ends (the body's end or error, a client that went away, a handler that panicked, a
//! cancelled future) the guard is dropped and the leases are released. While it lives, the
//! limiter renews them with every other lease it holds, every third of their lease time, in
//! one store call for all keys (`Limiter::hold`), so a request longer than the lease time keeps
//! its slots; the lease time bounds only the slots of an instance that died. A lease that
//! cannot be released (no runtime, the store down) still stops counting at its deadline.
//!
//! Slots the in-memory fallback handed out during an outage are unknown to the store. The
//! task tries, every second (or third of the lease time, if shorter), to record them in the
//! store as leases of its own (`Limiter::adopt`: taken even above the limit, since the work is
//! under way); from then on every instance counts them, they are renewed there too, and they
//! are released there as well when the request ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};
use std::time::Duration;

use smallvec::SmallVec;
use tokio::time::Instant;

use crate::completion::{Completion, Measure};
use crate::limiter::{BatchDecision, Lease, Limiter};

type Leases = SmallVec<[Lease; 1]>;

/// The leases of one request, renewed while it lives and released when dropped.
pub(crate) struct Release {
    limiter: Limiter,
    leases: Leases,
    /// The leases kept renewed by the limiter, while this lives.
    held: Option<crate::limiter::Hold>,
    /// The task adopting and renewing the fallback's leases (none without a runtime).
    renewer: Option<tokio::task::AbortHandle>,
    /// For leases the in-memory fallback took: the store's limiter and the leases recorded
    /// there once it answers again.
    adopted: Option<(Limiter, Arc<Mutex<Vec<Lease>>>)>,
    /// What a limit that learns from its requests is told at the end; `None` when no lease's
    /// limit learns (nothing is noted, not even the time).
    learning: Option<Learning>,
}

/// What a request holding a slot of a limit that learns has shown so far.
struct Learning {
    /// When it took its slots.
    started: Instant,
    /// Its response's head: when it came, and its status (to judge the trailers by).
    head: Option<(Instant, http::StatusCode)>,
    /// It failed: its head or trailers (`failed_when`), its inner service or its body.
    failed: bool,
    /// The judge of its trailers, kept from its head.
    failed_when: Option<FailedWhen>,
}

impl Learning {
    /// For `leases`, when one's limit learns from its requests.
    fn of(leases: &Leases) -> Option<Self> {
        leases
            .iter()
            .any(|l| l.quota().learns().is_some())
            .then(|| Self {
                started: Instant::now(),
                head: None,
                failed: false,
                failed_when: None,
            })
    }

    /// What the request showed, measured as `measure` says, now that it ends: a request that
    /// ends before its head (cancelled, timed out) failed, at the time it ended.
    fn completion(&self, measure: Measure, now: Instant) -> Completion {
        let (end, failed) = match (self.head, measure) {
            (Some((at, _)), Measure::Head) => (at, self.failed),
            (Some(_), Measure::BodyEnd) => (now, self.failed),
            (None, _) => (now, true),
        };
        Completion::new(end.saturating_duration_since(self.started), failed)
    }
}

/// Whether a response failed, as a limit that learns from its requests counts it: by default
/// a 5xx, or a gRPC `UNAVAILABLE` (14), `RESOURCE_EXHAUSTED` (8) or `DEADLINE_EXCEEDED` (4)
/// in the head or the trailers (`RateLimitLayerBuilder::failed_when` replaces it).
pub(crate) type FailedWhen = Arc<dyn Fn(http::StatusCode, &http::HeaderMap) -> bool + Send + Sync>;

/// The default [`FailedWhen`].
pub(crate) fn failed_by_default(status: http::StatusCode, headers: &http::HeaderMap) -> bool {
    status.is_server_error()
        || headers
            .get_all("grpc-status")
            .iter()
            .any(|v| matches!(v.as_bytes(), b"14" | b"8" | b"4"))
}

/// The leases `batch` holds; `None` when it holds none.
fn leases_of(batch: &BatchDecision) -> Option<Leases> {
    // Most requests hold no slot: one pass over the ids, nothing built.
    if batch.decisions().iter().all(|d| d.lease_id.is_none()) {
        return None;
    }
    let leases: Leases = batch.decisions().iter().filter_map(|d| d.lease()).collect();
    (!leases.is_empty()).then_some(leases)
}

impl Release {
    /// The leases `batch` (allowed, decided by `limiter`) holds; `None` when it holds none.
    pub(crate) fn of(limiter: &Limiter, batch: &BatchDecision) -> Option<Box<Self>> {
        let leases = leases_of(batch)?;
        let learning = Learning::of(&leases);
        Some(Box::new(Self {
            limiter: limiter.clone(),
            held: Some(limiter.hold(&leases)),
            leases,
            renewer: None,
            adopted: None,
            learning,
        }))
    }

    /// The leases `batch` (allowed, decided by the in-memory `fallback` because the store of
    /// `main` failed) holds, to be recorded in that store once it answers again.
    pub(crate) fn of_fallback(
        fallback: &Limiter,
        main: &Limiter,
        batch: &BatchDecision,
    ) -> Option<Box<Self>> {
        let leases = leases_of(batch)?;
        let learning = Learning::of(&leases);
        let adopted = Arc::new(Mutex::new(Vec::new()));
        let renewer = spawn(adopt(
            fallback.clone(),
            main.clone(),
            leases.clone(),
            adopted.clone(),
            Instant::now(),
        ));
        Some(Box::new(Self {
            limiter: fallback.clone(),
            leases,
            held: None,
            renewer,
            adopted: Some((main.clone(), adopted)),
            learning,
        }))
    }

    /// The response's head came: when, and whether it failed (`failed_when`).
    pub(crate) fn head(
        &mut self,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        failed_when: &FailedWhen,
    ) {
        if let Some(learning) = &mut self.learning
            && learning.head.is_none()
        {
            learning.head = Some((Instant::now(), status));
            learning.failed |= failed_when(status, headers);
            learning.failed_when = Some(failed_when.clone());
        }
    }

    /// The response's body ended with `trailers`: judged by `failed_when` with the head's
    /// status (a gRPC status sent after a streamed answer).
    pub(crate) fn trailers(&mut self, trailers: &http::HeaderMap) {
        if let Some(learning) = &mut self.learning
            && let (Some((_, status)), Some(failed_when)) = (learning.head, &learning.failed_when)
        {
            learning.failed |= failed_when(status, trailers);
        }
    }

    /// The inner service or the response's body failed.
    pub(crate) fn failed(&mut self) {
        if let Some(learning) = &mut self.learning {
            learning.failed = true;
        }
    }
}

/// `task` on the runtime, if there is one.
fn spawn(task: impl Future<Output = ()> + Send + 'static) -> Option<tokio::task::AbortHandle> {
    tokio::runtime::Handle::try_current()
        .ok()
        .map(|runtime| runtime.spawn(task).abort_handle())
}

/// Ticks every `every`, the first one `every` after `start` (when the leases were taken, not
/// when the task first runs).
fn ticks(start: Instant, every: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval_at(start + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// Warns once about a store that cannot renew, until a renewal succeeds again.
#[derive(Default)]
struct RenewWarning(bool);

impl RenewWarning {
    fn after(&mut self, result: Result<usize, crate::limiter::LimiterError>) {
        match result {
            Ok(_) => self.0 = false,
            Err(e) if !self.0 => {
                self.0 = true;
                tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e, "could not renew concurrency slots; they end at their lease time unless a later renewal succeeds");
            }
            Err(_) => {}
        }
    }
}

/// Renews the fallback's `leases` in memory and records them in `main`'s store as soon as it
/// answers (tried every second, or every third of the lease time if shorter), then renews
/// them there too, until aborted.
async fn adopt(
    fallback: Limiter,
    main: Limiter,
    leases: Leases,
    adopted: Arc<Mutex<Vec<Lease>>>,
    start: Instant,
) {
    let every = crate::limiter::third_of_lease(&leases).min(Duration::from_secs(1));
    let mut ticks = ticks(start, every);
    let mut warning = RenewWarning::default();
    let mut held: Vec<Lease> = Vec::new();
    loop {
        ticks.tick().await;
        // In memory: answered at once.
        let _ = fallback.renew(&leases).await;
        if held.is_empty() {
            if let Ok(mine) = main.adopt(&leases).await {
                held.clone_from(&mine);
                *adopted.lock().unwrap_or_else(PoisonError::into_inner) = mine;
            }
        } else {
            warning.after(main.renew(&held).await);
        }
    }
}

impl Drop for Release {
    /// Releases the leases: at once when the backend answers at once (in memory), else on the
    /// tokio runtime. Without a runtime they stop counting at their deadlines. Leases the
    /// fallback took and the store adopted are released in both.
    fn drop(&mut self) {
        self.held = None;
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
        // The end of a request whose limit learns (no clock read otherwise).
        let now = self.learning.as_ref().map(|_| Instant::now());
        let leases = std::mem::take(&mut self.leases).into_vec();
        let adopted = self.adopted.take().map(|(main, adopted)| {
            let adopted =
                std::mem::take(&mut *adopted.lock().unwrap_or_else(PoisonError::into_inner));
            (main, adopted)
        });
        for (limiter, leases) in std::iter::once((self.limiter.clone(), leases)).chain(adopted) {
            if leases.is_empty() {
                continue;
            }
            // Most requests hold leases of limits that do not learn: released as they are.
            let (Some(learning), Some(now)) = (&self.learning, now) else {
                release(limiter, leases, None);
                continue;
            };
            let (head, rest): (Vec<_>, Vec<_>) = leases
                .into_iter()
                .partition(|l| l.quota().learns() == Some(Measure::Head));
            let (body_end, plain): (Vec<_>, Vec<_>) = rest
                .into_iter()
                .partition(|l| l.quota().learns() == Some(Measure::BodyEnd));
            for (leases, completion) in [
                (head, Some(learning.completion(Measure::Head, now))),
                (body_end, Some(learning.completion(Measure::BodyEnd, now))),
                (plain, None),
            ] {
                if !leases.is_empty() {
                    release(limiter.clone(), leases, completion);
                }
            }
        }
    }
}

/// Releases `leases` on `limiter` (with what their request showed, when a limit learns from
/// it): at once when it answers at once, else on the runtime.
fn release(limiter: Limiter, leases: Vec<Lease>, completion: Option<Completion>) {
    let mut release: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
        let released = match completion {
            Some(c) => limiter.complete(&leases, c).await,
            None => limiter.release(&leases).await,
        };
        if let Err(e) = released {
            tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e, "could not release concurrency slots; they end at their lease time");
        }
    });
    if release
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_ready()
    {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(release);
        }
        Err(_) => tracing::warn!(target: crate::telemetry::target::BACKEND,
            "concurrency slots released with no runtime to release them on; they end at their lease time"
        ),
    }
}

/// A request's leases, if it holds any.
pub(crate) type Held = Option<Box<Release>>;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Release;
    use crate::{BucketKey, Id, Limiter, Limits, ManualClock, MemoryBackend, Transaction};

    /// A limiter on a manual clock with `Streams`: `max` slots of a 3 s lease; the key of
    /// client 7.
    fn streams(max: u64) -> (ManualClock, MemoryBackend, Limiter, BucketKey) {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend = MemoryBackend::builder().clock(clock.clone()).build();
        let yaml = format!("Streams: {{concurrency: {max}, lease: 3s}}");
        let limiter = Limiter::new(Limits::from_yaml_str(&yaml, None).unwrap(), backend.clone());
        let key = limiter.key("Streams", Id::from(7u64)).unwrap();
        (clock, backend, limiter, key)
    }

    /// Three streams of 8 s on a limit of 3 with a lease of 3 s keep their three slots the whole
    /// time: at 3.7 s (and at every 100 ms step) a fourth request is denied. Before, the slots
    /// ended at 3 s under live streams and three more requests were admitted (six in flight).
    /// Once the streams end their slots are free at once.
    #[tokio::test(start_paused = true)]
    async fn a_live_request_keeps_its_slots_past_the_lease_time() {
        let (clock, backend, limiter, key) = streams(3);
        let tx = || Transaction::new(key.clone());
        let mut streams = Vec::new();
        for _ in 0..3 {
            let batch = limiter.spend(&[tx()]).await.unwrap();
            assert!(batch.allowed());
            streams.push(Release::of(&limiter, &batch).unwrap());
        }
        let step = Duration::from_millis(100);
        for n in 1..=80 {
            clock.advance(step);
            tokio::time::advance(step).await;
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            assert_eq!(backend.leases(&key), 3, "at {} ms", n * 100);
            let fourth = limiter.check(&[tx()]).await.unwrap();
            assert!(
                !fourth.allowed(),
                "at {} ms a fourth request passed",
                n * 100
            );
        }
        drop(streams);
        assert_eq!(backend.leases(&key), 0);
        assert!(limiter.check(&[tx()]).await.unwrap().allowed());
    }

    /// The default failure: a 5xx, or a gRPC `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or
    /// `DEADLINE_EXCEEDED` in the head (another status, or another gRPC code, is not).
    #[test]
    fn a_failure_is_a_5xx_or_an_overload_grpc_status() {
        use http::{HeaderMap, HeaderValue, StatusCode};
        let grpc = |code: &'static str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-status", HeaderValue::from_static(code));
            h
        };
        let none = HeaderMap::new();
        assert!(super::failed_by_default(StatusCode::BAD_GATEWAY, &none));
        assert!(!super::failed_by_default(
            StatusCode::TOO_MANY_REQUESTS,
            &none
        ));
        assert!(!super::failed_by_default(StatusCode::OK, &none));
        for (code, failed) in [
            ("14", true),
            ("8", true),
            ("4", true),
            ("0", false),
            ("5", false),
        ] {
            assert_eq!(
                super::failed_by_default(StatusCode::OK, &grpc(code)),
                failed,
                "{code}"
            );
        }
    }

    /// What a request showed: its head's time and verdict (head), the time it ended (body
    /// end), a failure of the body; one that ends before its head failed.
    #[tokio::test(start_paused = true)]
    async fn a_completion_is_measured_where_the_limit_says() {
        use crate::Measure;
        let yaml = "Adaptive: {concurrency: {adaptive: {min: 1, max: 9}}}";
        let limiter = Limiter::new(
            Limits::from_yaml_str(yaml, None).unwrap(),
            MemoryBackend::new(),
        );
        let key = limiter.key("Adaptive", Id::from(7u64)).unwrap();
        let batch = limiter.spend(&[Transaction::new(key)]).await.unwrap();
        let mut r = Release::of(&limiter, &batch).unwrap();
        tokio::time::advance(Duration::from_millis(30)).await;
        let end = tokio::time::Instant::now() + Duration::from_millis(70);
        let completion = |r: &Release, m| r.learning.as_ref().unwrap().completion(m, end);
        let c = completion(&r, Measure::Head);
        assert_eq!((c.latency_us, c.failed), (100_000, true), "no head: failed");
        let failed_when: super::FailedWhen =
            std::sync::Arc::new(|status, headers: &http::HeaderMap| {
                super::failed_by_default(status, headers) || headers.contains_key("x-bad")
            });
        r.head(http::StatusCode::OK, &http::HeaderMap::new(), &failed_when);
        let c = completion(&r, Measure::Head);
        assert_eq!((c.latency_us, c.failed), (30_000, false));
        let c = completion(&r, Measure::BodyEnd);
        assert_eq!((c.latency_us, c.failed), (100_000, false));
        // Trailers are judged with the head's status: these are fine, then these are not.
        r.trailers(&http::HeaderMap::new());
        assert!(!completion(&r, Measure::Head).failed);
        let mut bad = http::HeaderMap::new();
        bad.insert("x-bad", http::HeaderValue::from_static("1"));
        r.trailers(&bad);
        assert!(completion(&r, Measure::Head).failed);
        let mut r = Release::of(&limiter, &batch).unwrap();
        r.head(http::StatusCode::OK, &http::HeaderMap::new(), &failed_when);
        r.failed();
        assert!(completion(&r, Measure::Head).failed);
    }

    /// A request whose limits do not learn notes nothing (no clock read at its end).
    #[tokio::test]
    async fn a_limit_that_does_not_learn_notes_nothing() {
        let (_, _, limiter, key) = streams(3);
        let batch = limiter.spend(&[Transaction::new(key)]).await.unwrap();
        let r = Release::of(&limiter, &batch).unwrap();
        assert!(r.learning.is_none());
    }

    /// A renewal never takes a slot: a lease that ended (or was released) stays ended.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_never_brings_back_an_ended_lease() {
        let (clock, backend, limiter, key) = streams(1);
        let batch = limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        let leases: Vec<_> = batch.decisions().iter().filter_map(|d| d.lease()).collect();
        clock.advance(Duration::from_secs(3));
        assert_eq!(limiter.renew(&leases).await.unwrap(), 0);
        assert_eq!(backend.leases(&key), 0);
    }
}
