//! One store matrix: every store decides the conformance traces (the example traces, and
//! pseudo-random ones mixing GCRA, tiered and concurrency limits, every op and mode, costs and
//! ranges) exactly as memory does: a single Redis and a 3-master cluster (with and without the
//! deny cache), and a backend written outside the crate with the public batch kit.

mod support;

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../simulator/src/trace.rs"]
mod simulate;

#[allow(dead_code)]
#[path = "support/conformance.rs"]
mod conformance;

#[path = "support/outside.rs"]
mod outside;

#[cfg(feature = "redis")]
use conformance::conformance_redis;
use conformance::{conformance, conformance_limits, simulate_with};
use tower_ratelimits::{Limiter, ManualClock};

/// A `Mutex<HashMap>` store and the kit, written as a user would (`tests/support/outside.rs`,
/// under 100 lines): no rule of its own, the same decisions.
#[tokio::test]
async fn a_backend_written_outside_the_crate_decides_exactly_like_memory() {
    conformance("outside backend", false, |trace| async move {
        let clock = ManualClock::new(simulate::EPOCH_US);
        let limiter = Limiter::new(conformance_limits(), outside::Outside::new(clock.clone()));
        simulate_with(&limiter, &clock, &trace).await
    })
    .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn single_redis_decides_exactly_like_memory() {
    let redis = support::redis::TestRedis::single();
    conformance_redis(&redis.url).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_cluster_decides_exactly_like_memory_including_cross_slot_batches() {
    let redis = support::redis::TestRedis::cluster();
    conformance_redis(&redis.url).await;
}
