//! What a request that held a slot showed when it ended ([`Completion`]), and where its
//! latency ends ([`Measure`]): what the layer notes of a request and a learning shape
//! (`docs/adaptive-concurrency.md`) learns from, on the stack's lowest floor so the layer
//! names it without naming the algorithm.

use std::time::Duration;

use crate::time::duration_us;

/// Where a request's latency ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Measure {
    /// At the response's head (the default).
    #[default]
    Head,
    /// At the end of the response's body (streaming responses).
    BodyEnd,
}

/// What a request that held a slot showed when it ended: its latency (to the response's head,
/// or to its body's end: [`Measure`]) and whether it failed (by default a 5xx, a gRPC
/// `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or `DEADLINE_EXCEEDED`, an error or a timeout). Given
/// back with its leases ([`Limiter::complete`](crate::Limiter::complete)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Completion {
    /// Its latency, in microseconds.
    pub latency_us: u64,
    /// Whether it failed.
    pub failed: bool,
}

impl Completion {
    /// A request that took `latency` and `failed` or not.
    pub fn new(latency: Duration, failed: bool) -> Self {
        Self {
            latency_us: duration_us(latency),
            failed,
        }
    }
}
