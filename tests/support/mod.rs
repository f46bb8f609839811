//! Test support: real servers and clients.
#![allow(dead_code)]

pub mod admin;
pub mod examples;
pub mod gate;
pub mod http;
pub mod identity;
pub mod inspect;
pub mod redis;
#[cfg(feature = "redis")]
pub mod redis_backend;
pub mod scrape;
pub mod store;

/// A seeded xorshift: `next(n)` is a pseudo-random number below `n`, the same sequence on
/// every run (the random traces the conformance tests replay).
pub fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

/// The output of a future that is ready at its first poll (a spend the in-memory backend, or
/// the Redis deny cache, decides at once); panics if it would wait.
pub fn ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(out) => out,
        std::task::Poll::Pending => panic!("the future was not ready at its first poll"),
    }
}
