//! One store fixture for the tests that run a body on memory and on Redis: a manual clock
//! both share, and a limiter on the store asked for (on Redis: a server of its own, a fresh
//! key prefix, the caller's clock).

use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

/// The time the fixtures start at.
pub const EPOCH_US: u64 = 1_700_000_000_000_000;

/// One test per store for a scenario (an `async fn(Store)`): `in_memory_<name>` and, with
/// the feature `redis`, `on_redis_<name>`.
#[macro_export]
macro_rules! on_every_store {
    ($scenario:ident => $memory:ident, $redis:ident) => {
        #[tokio::test]
        async fn $memory() {
            $scenario(Store::Memory).await;
        }

        #[cfg(feature = "redis")]
        #[tokio::test]
        async fn $redis() {
            $scenario(Store::Redis).await;
        }
    };
}

/// Which store a test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Store {
    Memory,
    #[cfg(feature = "redis")]
    Redis,
}

pub struct Fixture {
    pub clock: ManualClock,
    #[cfg(feature = "redis")]
    redis: Option<super::redis::TestRedis>,
}

impl Fixture {
    pub fn new(store: Store) -> Self {
        let clock = ManualClock::new(EPOCH_US);
        match store {
            Store::Memory => Self {
                clock,
                #[cfg(feature = "redis")]
                redis: None,
            },
            #[cfg(feature = "redis")]
            Store::Redis => Self {
                clock,
                redis: Some(super::redis::TestRedis::single()),
            },
        }
    }

    /// A limiter over `limits` on `store`. On Redis: keys under a fresh prefix named after
    /// `test`, and the deny cache as `deny_cache` says (off: every request is one round trip).
    pub async fn limiter(
        &self,
        store: Store,
        limits: Limits,
        test: &str,
        deny_cache: bool,
    ) -> Limiter {
        match store {
            Store::Memory => {
                let _ = (test, deny_cache);
                Limiter::new(
                    limits,
                    MemoryBackend::builder().clock(self.clock.clone()).build(),
                )
            }
            #[cfg(feature = "redis")]
            Store::Redis => {
                let url = &self.redis.as_ref().expect("a Redis fixture").url;
                let backend = tower_ratelimits::RedisBackend::from_url(url)
                    .prefix(super::redis::unique_prefix(test))
                    .caller_time(self.clock.clone())
                    .deny_cache(deny_cache)
                    .connect()
                    .await
                    .unwrap();
                Limiter::new(limits, backend)
            }
        }
    }
}
