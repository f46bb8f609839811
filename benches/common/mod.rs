//! Helpers shared by the benches.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

/// Polls a future that completes without waiting (the in-memory backend's futures do) without
/// the cost of a runtime. Panics if it would wait: a bench set-up error, not a request path.
pub fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the benchmarked future waited"),
    }
}

/// One transaction spent on a backend that answers at once (the in-memory one): its one
/// `spend`, with a batch of one. Panics if it would wait (a bench set-up error).
pub fn spend_one(
    backend: &impl tower_ratelimits::Backend,
    tx: &tower_ratelimits::BucketTx<'_>,
) -> Result<tower_ratelimits::Outcomes, tower_ratelimits::BackendError> {
    match backend.spend(std::slice::from_ref(tx)) {
        tower_ratelimits::Spend::Ready(r) => r,
        tower_ratelimits::Spend::Pending(_) => panic!("the benchmarked spend waited"),
    }
}

pub mod apps;
pub mod handwritten;
pub mod redis_ops;

/// The value after `flag` on the command line.
pub fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|p| args.get(p + 1))
        .cloned()
}
