//! The circuit breaker: after repeated failures to reach Redis, requests are answered at once
//! (by the middleware's failure policy) instead of each waiting for the command timeout, for a
//! cool-off; then a probe runs in the background (the request that found the cool-off over
//! starts it and is answered at once), and a success closes the circuit again.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Consecutive failures that open the circuit, by default.
pub(super) const DEFAULT_FAILURES: u32 = 5;
/// How long an open circuit answers at once before it lets one request probe, by default.
pub(super) const DEFAULT_COOL_OFF: Duration = Duration::from_secs(1);

/// When a circuit opens and for how long.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    /// Consecutive failures that open the circuit (0: never opens).
    pub(super) failures: u32,
    pub(super) cool_off: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            failures: DEFAULT_FAILURES,
            cool_off: DEFAULT_COOL_OFF,
        }
    }
}

/// One circuit: per server, so a dead cluster master opens only its own.
pub(super) struct Breaker {
    /// The server, as its log lines name it (`host:port`, never credentials).
    server: String,
    /// Consecutive failures that open the circuit (0: never opens).
    threshold: u32,
    cool_off_us: u64,
    failures: AtomicU32,
    /// While open: the local time (us) until which it answers at once; 0 when closed.
    open_until: AtomicU64,
    /// Whether a probe is under way (one at a time).
    probing: AtomicBool,
    /// How many times the circuit opened.
    pub(super) opened: AtomicU64,
}

/// Whether a call may go to Redis.
pub(super) enum Admission {
    /// Closed: go.
    Go,
    /// Open, cool-off over: this call starts the probe (in the background).
    Probe,
    /// Open: answer now; the cool-off ends in this many microseconds.
    Refuse(u64),
}

impl Breaker {
    pub(super) fn new(settings: Settings, server: String) -> Self {
        Self {
            server,
            threshold: settings.failures,
            cool_off_us: crate::time::duration_us(settings.cool_off),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            opened: AtomicU64::new(0),
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    /// `now` is read only while the circuit is open.
    pub(super) fn admit(&self, now: impl Fn() -> u64) -> Admission {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Admission::Go;
        }
        let now = now();
        if now < until {
            return Admission::Refuse(until - now);
        }
        if self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            Admission::Probe
        } else {
            Admission::Refuse(0)
        }
    }

    /// Records what a call that was let through found.
    /// `now` is read only when the circuit opens.
    pub(super) fn record(&self, reached: bool, probe: bool, now: impl Fn() -> u64) {
        if reached {
            // Read first: a healthy server's answers then write nothing to these shared atomics.
            if self.failures.load(Ordering::Acquire) != 0 {
                self.failures.store(0, Ordering::Release);
            }
            if self.open_until.load(Ordering::Acquire) != 0
                && self.open_until.swap(0, Ordering::AcqRel) != 0
            {
                tracing::info!(target: crate::telemetry::target::BACKEND,
                    server = %self.server,
                    "Redis at {} answers again: the rate limiter's circuit is closed",
                    self.server
                );
            }
            if probe {
                self.probing.store(false, Ordering::Release);
            }
            return;
        }
        if probe {
            self.open(now());
            self.probing.store(false, Ordering::Release);
            return;
        }
        let failures = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        // Only the call that opens a closed circuit says so: two failing at once, one line.
        if self.threshold > 0
            && failures >= self.threshold
            && !self.is_open()
            && self
                .open_until
                .compare_exchange(0, self.until(now()), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.opened();
            tracing::warn!(target: crate::telemetry::target::BACKEND,
                server = %self.server,
                failures,
                cool_off_ms = self.cool_off_us / 1_000,
                "Redis at {} failed repeatedly: the rate limiter answers at once by its failure \
                 policy until a probe succeeds",
                self.server
            );
        }
    }

    fn until(&self, now: u64) -> u64 {
        now.saturating_add(self.cool_off_us).max(1)
    }

    fn open(&self, now: u64) {
        self.open_until.store(self.until(now), Ordering::Release);
        self.opened();
    }

    fn opened(&self) {
        self.opened.fetch_add(1, Ordering::Relaxed);
        crate::telemetry::circuit_opened();
    }
}
