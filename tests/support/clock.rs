//! A clock for the limiter that follows tokio's (virtual when the test's time is paused), so a
//! sleep of the layer or a stream's meter and the store's decisions see the same time.

use tower_ratelimits::Clock;

/// Microseconds since the epoch on tokio's clock, from 2023-11-14 at its creation.
#[derive(Clone)]
pub struct TokioClock(pub tokio::time::Instant);

impl TokioClock {
    /// Starts now, on tokio's clock.
    pub fn now() -> Self {
        Self(tokio::time::Instant::now())
    }
}

impl Clock for TokioClock {
    fn now_us(&self) -> u64 {
        1_700_000_000_000_000 + self.0.elapsed().as_micros() as u64
    }
}
