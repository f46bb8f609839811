//! The Redis backend against a local `redis-server`, side by side with a baseline: `EVALSHA` of
//! a trivial one-key script through the same fred client. All the cost of a decision is the
//! round trip, so the target is ours >= 80% of the baseline's throughput.
//!
//! `cargo bench --bench redis_backend --features redis`
//!
//! Uses `REDIS_URL` when set, otherwise spawns a `redis-server` on a free loopback port. Besides
//! criterion's timings (C concurrent operations per iteration, C = 1, 16, 64) it prints ops/s,
//! p50 and p99 latency per variant and `MEMORY USAGE` of a bucket key.

#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fred::prelude::{ClientLike as _, LuaInterface, Value};
use futures_util::future::join_all;
use tower_ratelimits::{Limiter, Limits, RedisBackend, Transaction};

const LIMITS: &str = "\
A:
  burst: 100000000
  count: 1000000
  period: 1s
B:
  kind: ip
  burst: 100000000
  count: 1000000
  period: 1s
C:
  kind: account
  burst: 100000000
  count: 1000000
  period: 1s
";
const TRIVIAL: &str = "return 1";
const KEYS: u64 = 1000;

struct Setup {
    _server: Option<redis_support::RedisServer>,
    limiter: Arc<Limiter>,
    backend: RedisBackend,
    trivial_sha: String,
}

async fn setup() -> Setup {
    let (server, url) = match std::env::var("REDIS_URL") {
        Ok(url) => (None, url),
        Err(_) => {
            let s = redis_support::RedisServer::start();
            let url = s.url();
            (Some(s), url)
        }
    };
    let backend = RedisBackend::from_url(url.as_str())
        .prefix("rl:bench:")
        .deny_cache(false)
        .connect()
        .await
        .expect("connect to Redis");
    let trivial_sha: String = backend.client().script_load(TRIVIAL).await.unwrap();
    let limiter = Arc::new(Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        backend.clone(),
    ));
    Setup {
        _server: server,
        limiter,
        backend,
        trivial_sha,
    }
}

#[derive(Clone, Copy, Debug)]
enum Variant {
    Baseline,
    Ours1Rule,
    Ours3Rules,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Baseline => "baseline_evalsha",
            Variant::Ours1Rule => "ours_1_rule",
            Variant::Ours3Rules => "ours_3_rules",
        }
    }
}

async fn one(s: &Setup, variant: Variant, i: u64) {
    let id = i % KEYS;
    match variant {
        Variant::Baseline => {
            let key = format!("rl:bench:{{0:{id}}}");
            let _: Value = s
                .backend
                .client()
                .evalsha(s.trivial_sha.as_str(), vec![key], Vec::<Value>::new())
                .await
                .unwrap();
        }
        Variant::Ours1Rule => {
            let key = s.limiter.key("A", tower_ratelimits::Id::from(id)).unwrap();
            let d = s.limiter.spend(&[Transaction::new(key)]).await.unwrap();
            assert!(d.allowed());
        }
        Variant::Ours3Rules => {
            let ip = std::net::IpAddr::from([10, 0, (id >> 8) as u8, id as u8]);
            let batch = [
                Transaction::new(s.limiter.key("A", tower_ratelimits::Id::from(id)).unwrap()),
                Transaction::new(s.limiter.key("B", tower_ratelimits::Id::from(ip)).unwrap()),
                Transaction::new(s.limiter.key("C", tower_ratelimits::Id::from(id)).unwrap()),
            ];
            assert!(s.limiter.spend(&batch).await.unwrap().allowed());
        }
    }
}

/// `concurrency` workers share `total` operations; returns ops/s, p50 and p99.
async fn measure(
    s: &Arc<Setup>,
    variant: Variant,
    concurrency: u64,
    total: u64,
) -> (f64, Duration, Duration) {
    let started = Instant::now();
    let workers = (0..concurrency).map(|w| {
        let s = s.clone();
        tokio::spawn(async move {
            let mut lat = Vec::with_capacity((total / concurrency) as usize);
            for i in 0..total / concurrency {
                let t = Instant::now();
                one(&s, variant, w * 7919 + i).await;
                lat.push(t.elapsed());
            }
            lat
        })
    });
    let mut all: Vec<Duration> = Vec::new();
    for r in join_all(workers).await {
        all.extend(r.unwrap());
    }
    let elapsed = started.elapsed();
    all.sort();
    let p = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)];
    (all.len() as f64 / elapsed.as_secs_f64(), p(0.50), p(0.99))
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let setup = Arc::new(rt.block_on(setup()));
    let variants = [Variant::Baseline, Variant::Ours1Rule, Variant::Ours3Rules];

    let mut group = c.benchmark_group("redis_spend");
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for concurrency in [1u64, 16, 64] {
        group.throughput(Throughput::Elements(concurrency));
        for variant in variants {
            group.bench_with_input(
                BenchmarkId::new(variant.name(), concurrency),
                &concurrency,
                |b, &concurrency| {
                    let mut n = 0u64;
                    b.to_async(&rt).iter(|| {
                        n += concurrency;
                        let s = setup.clone();
                        let base = n;
                        async move {
                            join_all((0..concurrency).map(|k| one(&s, variant, base + k))).await;
                        }
                    });
                },
            );
        }
    }
    group.finish();

    // Throughput and latency side by side, alternating the variants.
    println!("\nvariant             C   ops/s     p50       p99     vs baseline");
    for concurrency in [1u64, 16, 64] {
        let total = if concurrency == 1 { 5_000 } else { 20_000 };
        let mut baseline = 0.0;
        for variant in variants {
            let (ops, p50, p99) = rt.block_on(measure(&setup, variant, concurrency, total));
            if let Variant::Baseline = variant {
                baseline = ops;
            }
            println!(
                "{:<18} {:>3} {:>8.0} {:>9.1?} {:>9.1?}   {:.2}",
                variant.name(),
                concurrency,
                ops,
                p50,
                p99,
                ops / baseline
            );
        }
    }
    let key = setup
        .limiter
        .key("A", tower_ratelimits::Id::from(1u64))
        .unwrap();
    let redis_key = setup.backend.redis_key(&key);
    let bytes: Value = rt
        .block_on(setup.backend.client().custom(
            fred::cmd!("MEMORY"),
            vec!["USAGE".to_owned(), redis_key.clone()],
        ))
        .unwrap();
    println!("MEMORY USAGE {redis_key}: {bytes:?} bytes");
}

criterion_group!(benches, bench);
criterion_main!(benches);
