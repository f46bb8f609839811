//! The Redis backend's unit tests that need its private parts: the circuit breaker's probe, and
//! a clock skew between an instance and the store (against a real `redis-server`).

use super::*;
use crate::time::{ManualClock, SystemClock};

/// A Redis to run against: the one `.ci/run` started (`TRL_TEST_REDIS_URL`), or a new
/// `redis-server` on a free port, stopped when dropped.
struct Server {
    url: String,
    child: Option<std::process::Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn redis() -> Server {
    if let Ok(url) = std::env::var("TRL_TEST_REDIS_URL") {
        return Server { url, child: None };
    }
    own_redis(free_port())
}

/// A loopback port free now (for a server the test starts, stops and starts again on it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A new `redis-server` on `port`, without persistence (started again on the same port, it is
/// empty), stopped when dropped.
fn own_redis(port: u16) -> Server {
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server (bash scripts/test installs it)");
    let server = Server {
        url: format!("redis://127.0.0.1:{port}"),
        child: Some(child),
    };
    // Until it listens (bounded).
    for _ in 0..500 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return server;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("redis-server did not start on port {port}");
}

/// The store's clock decides the calendar period. A daily quota renews
/// at `renewal`, less than 70 s from the store's now. An instance whose clock runs ahead,
/// past the renewal, spends the day's 5 units: they are counted in the store's period
/// (its denial says retry at the store's renewal, not in a day), and an instance whose
/// clock is right sees the whole count again at the renewal. An instance whose clock runs
/// behind the renewal the store has passed spends in the store's new period.
#[tokio::test]
async fn the_stores_clock_decides_the_calendar_period() {
    use crate::{CalendarQuota, Id, Limiter, Limits, Period, Transaction};
    let server = redis();
    let minute = 60_000_000;
    let real = SystemClock.now_us();
    for ahead in [true, false] {
        // The next minute at least 5 s away, or the last one at least 5 s ago.
        let renewal = if ahead {
            (real + 5_000_000).div_ceil(minute) * minute
        } else {
            (real - 5_000_000) / minute * minute
        };
        let at = format!(
            "{:02}:{:02}",
            renewal / 3_600_000_000 % 24,
            renewal / minute % 60
        );
        let quota = CalendarQuota::new(5, Period::Day).unwrap().at(&at).unwrap();
        let limits = || {
            Limits::builder()
                .limit("Daily", quota.clone())
                .build()
                .unwrap()
        };
        let prefix = format!("t:skew:{}:{ahead}:{real}:", std::process::id());
        // Its clock 10 s past the renewal (ahead of the store), or 10 s before it (behind).
        let skewed = if ahead {
            renewal + 10_000_000
        } else {
            renewal - 10_000_000
        };
        let instance = RedisBackend::from_url(&server.url)
            .prefix(&prefix)
            .deny_cache(false)
            .skewed_clock(ManualClock::new(skewed))
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::new(limits(), instance);
        let key = limiter.key("Daily", Id::from(7u64)).unwrap();
        let tx = Transaction::new(key.clone());
        assert!(
            limiter
                .spend(&[tx.clone().cost(5)])
                .await
                .unwrap()
                .allowed()
        );
        let denied = limiter.spend(std::slice::from_ref(&tx)).await.unwrap();
        assert!(!denied.allowed(), "ahead: {ahead}");
        let decided = &denied.decisions()[0];
        // The store's renewal: the one ahead of its now, or a day after the one it passed.
        let store_end = if ahead {
            renewal
        } else {
            renewal + 86_400_000_000
        };
        let wait = decided.retry_after().as_micros() as u64;
        let expected = store_end - SystemClock.now_us();
        assert!(
            wait.abs_diff(expected) < 5_000_000,
            "ahead: {ahead}: told to wait {wait} us, the store's renewal is {expected} us away"
        );
        assert_eq!(decided.shape_number, 86_400);
        // A right clock at the store's renewal (caller time): a fresh count.
        let right = RedisBackend::from_url(&server.url)
            .prefix(&prefix)
            .deny_cache(false)
            .caller_time(ManualClock::new(store_end + 1_000_000))
            .connect()
            .await
            .unwrap();
        let right = Limiter::new(limits(), right);
        let fresh = right.spend(std::slice::from_ref(&tx)).await.unwrap();
        assert!(fresh.allowed(), "ahead: {ahead}");
        assert_eq!(fresh.decisions()[0].remaining(), 4, "ahead: {ahead}");
    }
}

/// A probe dropped before it answers (its runtime shut down, its task aborted) must not
/// leave the circuit waiting for it: it counts as a failed probe, so after another
/// cool-off the next request starts a new one. Before, `probing` stayed set and every
/// request was refused for good.
#[tokio::test]
async fn a_probe_dropped_before_it_answers_lets_the_next_cool_off_probe_again() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    // Nothing listens: a lazy backend is built anyway, and its commands wait to connect.
    let backend = RedisBackend::from_url("redis://127.0.0.1:9")
        .lazy(true)
        .caller_time(clock.clone())
        .command_timeout(Duration::from_secs(60))
        .circuit_breaker(1, Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let breaker = backend.breaker(0);
    breaker.record(false, false, || clock.now_us());
    assert!(breaker.is_open());
    clock.advance(Duration::from_secs(2));
    assert!(matches!(
        breaker.admit(|| clock.now_us()),
        breaker::Admission::Probe
    ));
    // The probe starts, cannot answer yet, and is dropped.
    {
        let probe = std::pin::pin!(backend.probe(0));
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(probe.poll(&mut cx).is_pending());
    }
    assert!(
        breaker.is_open(),
        "a dropped probe does not close the circuit"
    );
    assert!(matches!(
        breaker.admit(|| clock.now_us()),
        breaker::Admission::Refuse(_)
    ));
    clock.advance(Duration::from_secs(2));
    assert!(
        matches!(breaker.admit(|| clock.now_us()), breaker::Admission::Probe),
        "the next cool-off probes again"
    );
}

mod instances;
mod penalty;
mod shares;
