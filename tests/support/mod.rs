//! Test support: real servers and clients.
#![allow(dead_code)]

pub mod admin;
pub mod clock;
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

/// What `f` logged at warning level on this crate's targets, as `target: message`, through a
/// subscriber of this thread only (so `f` must not hand its work to another thread).
pub fn warnings_during<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt as _;
    #[derive(Clone, Default)]
    struct Warnings(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
        fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(&mut self, field: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    if field.name() == "message" {
                        self.0 = format!("{v:?}");
                    }
                }
            }
            let target = e.metadata().target();
            if *e.metadata().level() == tracing::Level::WARN
                && target.starts_with("tower_ratelimits")
            {
                let mut message = Message(String::new());
                e.record(&mut message);
                self.0
                    .lock()
                    .unwrap()
                    .push(format!("{target}: {}", message.0));
            }
        }
    }
    let warnings = Warnings::default();
    let out = tracing::subscriber::with_default(
        tracing_subscriber::registry().with(warnings.clone()),
        || {
            // A callsite another test's thread registered while this subscriber was being
            // installed may keep the interest it had without it (tracing caches it per
            // callsite): asked again now, with this subscriber in place.
            tracing::callsite::rebuild_interest_cache();
            f()
        },
    );
    let logged = warnings.0.lock().unwrap().clone();
    (out, logged)
}
