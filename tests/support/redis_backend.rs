//! The Redis backends the Redis tests use, and what they read from a server directly.

use std::time::Duration;

use fred::prelude::KeysInterface;
use tower_ratelimits::{Limiter, Limits, ManualClock, RedisBackend};

use super::redis::command;

/// The limits most Redis tests decide under.
pub const KEY_LIMITS: &str = "\
Api:
  burst: 2
  count: 2
  period: 1s
Blip:
  burst: 1
  count: 1
  period: 30ms
PerIp:
  kind: ip
  burst: 10
  count: 10
  period: 1s
PerAccount:
  kind: account
  burst: 10
  count: 10
  period: 1s
Wide:
  burst: 10
  count: 10
  period: 1s
";

pub async fn backend(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

/// A Redis backend under a fresh `prefix` and a limiter over `yaml` storing in it.
pub async fn limiter_on(url: &str, prefix: &str, yaml: &str) -> (RedisBackend, Limiter) {
    let backend = backend(url, prefix).await;
    let limits = Limits::from_yaml_str(yaml, None).unwrap();
    (backend.clone(), Limiter::new(limits, backend))
}

pub async fn caller_time_backend(
    url: &str,
    prefix: &str,
    clock: &ManualClock,
    cache: bool,
) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .caller_time(clock.clone())
        .deny_cache(cache)
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

/// How many times the server ran command `name` (`INFO commandstats`).
pub fn commandstat(port: u16, name: &str) -> u64 {
    let stats = command(port, "INFO commandstats").unwrap();
    stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A key's value, read directly.
pub async fn raw_get(backend: &RedisBackend, key: &str) -> Option<String> {
    backend
        .client_for_key(key)
        .unwrap()
        .get::<Option<String>, _>(key)
        .await
        .unwrap()
}
