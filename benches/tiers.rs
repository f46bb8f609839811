//! Burst tiers: the cost of a tiered decision for the "penalty" pattern (5 per second, burst to
//! 50 per 5 s), in the pure state machine and through the in-memory backend, next to a GCRA
//! decision on the same path; with the `redis` feature, the Redis script's server time per call
//! and `MEMORY USAGE` per key of every named pattern under full load.
//!
//! `cargo bench -p tower-ratelimits-benches --bench tiers` (uses `REDIS_URL` when set, otherwise spawns a
//! `redis-server` on a free loopback port; without the `redis` feature the Redis part is skipped).

use std::hint::black_box;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tower_ratelimits::__private::tiers::{self, Tier, TierState, TieredLimit};
use tower_ratelimits::{Id, Limit, Limiter, Limits, ManualClock, MemoryBackend, Transaction};

fn penalty() -> TieredLimit {
    let s = Duration::from_secs;
    TieredLimit::new([
        Tier::new(5, s(1), s(1), s(0)),
        Tier::new(50, s(5), s(5), s(15)),
    ])
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let limit = penalty();
    let mut group = c.benchmark_group("tiers");

    // Allowed at a steady 4 per second: tier 1 only, a log of 4-5 grants.
    group.bench_function("state_machine_penalty_allowed", |b| {
        let mut state = TierState::new();
        let mut now = 1_700_000_000_000_000u64;
        b.iter(|| {
            now += 250_000;
            black_box(tiers::spend(&limit, &mut state, now, 1, 1).unwrap())
        });
    });
    // Denied with tier 2 full: the exact retry_after walks all 55 grants' expiry events.
    group.bench_function("state_machine_penalty_denied_full", |b| {
        let mut state = TierState::new();
        let t0 = 1_700_000_000_000_000u64;
        for i in 0..55 {
            tiers::spend(&limit, &mut state, t0 + i * 1_000, 1, 1).unwrap();
        }
        b.iter(|| black_box(tiers::spend(&limit, &mut state, t0 + 60_000, 1, 1).unwrap()));
    });

    // Through the limiter and the memory backend (the middleware's synchronous path), 1k keys,
    // next to a GCRA limit on the same path.
    let clock = ManualClock::new(1_700_000_000_000_000);
    let limits = Limits::builder()
        .limit("Penalty", penalty())
        .limit("Gcra", Limit::new(5, 5, Duration::from_secs(1)).unwrap())
        .build()
        .unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    for name in ["Penalty", "Gcra"] {
        let keys: Vec<_> = (0..1000u64)
            .map(|i| limiter.key(name, Id::from(i)).unwrap())
            .collect();
        group.bench_function(format!("memory_backend_{name}_1k_keys"), |b| {
            let mut i = 0usize;
            b.iter(|| {
                i += 1;
                if i.is_multiple_of(1000) {
                    clock.advance(Duration::from_millis(250));
                }
                let tx = [Transaction::new(keys[i % 1000].clone())];
                black_box(ready(limiter.spend(&tx)).unwrap())
            });
        });
    }
    group.finish();

    redis_part::run();
}

#[path = "../tests/support/redis.rs"]
mod redis_support;

mod redis_part {
    use fred::prelude::{ClientLike as _, Value};
    use tower_ratelimits::{Limiter, Limits, RedisBackend, Transaction};

    use super::redis_support;

    const PATTERNS: &str = "\
simple:
  tiers:
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
penalty:
  tiers:
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 50, window: 5s, active: 5s, cooldown: 15s}
punishment:
  tiers:
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 1, window: 15s, active: 15s, cooldown: 0s}
batch:
  tiers:
    - {limit: 50, window: 15s, active: 15s, cooldown: 30s}
gcra:
  burst: 5
  count: 5
  period: 1s
";

    async fn evalsha_stats(backend: &RedisBackend) -> (u64, u64) {
        let info: String = backend
            .client()
            .custom(fred::cmd!("INFO"), vec!["commandstats"])
            .await
            .unwrap();
        let line = info
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .unwrap_or("");
        let field = |name: &str| {
            line.split([':', ','])
                .find_map(|kv| kv.strip_prefix(name))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        (field("calls="), field("usec="))
    }

    /// Server microseconds per script call over `n` single-unit requests on `keys` keys.
    async fn usec_per_call(
        limiter: &Limiter,
        backend: &RedisBackend,
        name: &str,
        keys: u64,
        n: u64,
    ) -> f64 {
        let (c0, u0) = evalsha_stats(backend).await;
        for i in 0..n {
            let key = limiter
                .key(name, tower_ratelimits::Id::from(i % keys))
                .unwrap();
            let _ = limiter.spend(&[Transaction::new(key)]).await.unwrap();
        }
        let (c1, u1) = evalsha_stats(backend).await;
        (u1 - u0) as f64 / (c1 - c0).max(1) as f64
    }

    pub fn run() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (_server, url) = match std::env::var("REDIS_URL") {
                Ok(url) => (None, url),
                Err(_) => {
                    let s = redis_support::RedisServer::start();
                    let url = s.url();
                    (Some(s), url)
                }
            };
            let prefix = format!("rl:bench-tiers:{}:", std::process::id());
            let backend = RedisBackend::from_url(url.as_str())
                .prefix(prefix)
                .deny_cache(false)
                .connect()
                .await
                .expect("connect to Redis");
            let limiter = Limiter::new(
                Limits::from_yaml_str(PATTERNS, None).unwrap(),
                backend.clone(),
            );
            println!("\nRedis script time per call (server side, INFO commandstats):");
            // 1000 keys, 20 requests each: tier 1 fills, then tier 2 (allowed throughout).
            let gcra = usec_per_call(&limiter, &backend, "gcra", 100_000, 20_000).await;
            let tiered = usec_per_call(&limiter, &backend, "penalty", 1_000, 20_000).await;
            println!("  gcra, allowed                        {gcra:>6.2} us");
            println!("  penalty, allowed (tier 1 then 2)     {tiered:>6.2} us");
            // One key with both tiers full: every request is denied after an exact retry_after
            // over the 55 recorded grants.
            let denied = usec_per_call(&limiter, &backend, "penalty", 1, 5_000).await;
            println!("  penalty, denied with tier 2 full     {denied:>6.2} us");

            println!("\nMEMORY USAGE per key under full load (one grant per request):");
            for (name, capacity) in [
                ("simple", 5),
                ("penalty", 55),
                ("punishment", 6),
                ("batch", 50),
                ("gcra", 5),
            ] {
                let key = limiter
                    .key(name, tower_ratelimits::Id::new("full").unwrap())
                    .unwrap();
                let mut granted = 0;
                for _ in 0..capacity * 2 {
                    let d = limiter
                        .spend(&[Transaction::new(key.clone())])
                        .await
                        .unwrap();
                    granted += d.decisions()[0].granted().min(1);
                }
                let redis_key = if name == "gcra" {
                    backend.redis_key(&key)
                } else {
                    backend.redis_tier_key(&key)
                };
                let bytes: Value = backend
                    .client()
                    .custom(
                        fred::cmd!("MEMORY"),
                        vec!["USAGE".to_owned(), redis_key.clone()],
                    )
                    .await
                    .unwrap();
                let len: Value = backend
                    .client()
                    .custom(fred::cmd!("STRLEN"), vec![redis_key])
                    .await
                    .unwrap();
                println!(
                    "  {name:<11} granted {granted:>3}: MEMORY USAGE {:?} bytes, value {:?} bytes",
                    bytes.as_i64().unwrap_or(-1),
                    len.as_i64().unwrap_or(-1)
                );
            }
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

/// Polls a future the in-memory backend completes at once.
fn ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the benchmarked future waited"),
    }
}
