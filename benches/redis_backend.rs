//! The Redis backend against a local `redis-server`, side by side with a baseline: `EVALSHA` of
//! a trivial one-key script through the same fred client. All the cost of a decision is the
//! round trip, so the target is ours >= 80% of the baseline's throughput.
//!
//! `cargo bench -p tower-ratelimits-benches --bench redis_backend`
//!
//! Uses `REDIS_URL` when set, otherwise spawns a `redis-server` on a free loopback port. Besides
//! criterion's timings (C concurrent operations per iteration, C = 1, 16, 64) it prints ops/s,
//! p50 and p99 latency per variant, `MEMORY USAGE` of a bucket key, Redis's own time per script
//! call, and Redis memory with 1M live buckets and after they expire (about a minute; skip it
//! with `TRL_BENCH_SKIP_IDLE=1`). The peer is tower-rate-limit-fred, GCRA over the same fred.

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_ops::{RedisOps, VARIANTS};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fred::prelude::{ClientLike as _, Value};
use futures_util::future::join_all;
use tower_ratelimits::Transaction;

struct Setup {
    _server: Option<redis_support::RedisServer>,
    ops: RedisOps,
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
    Setup {
        _server: server,
        ops: RedisOps::connect(&url).await,
    }
}

#[derive(Clone, Copy, Debug)]
enum Variant {
    Baseline,
    Ours1Rule,
    Ours3Rules,
    /// tower-rate-limit-fred's `rate_limit`: GCRA in one Lua script over fred, as ours.
    PeerTowerRateLimitFred,
    /// Ours, 1 rule, with `coalesce(64)`.
    Ours1RuleCoalesced,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Baseline => VARIANTS[0],
            Variant::Ours1Rule => VARIANTS[1],
            Variant::Ours3Rules => VARIANTS[2],
            Variant::PeerTowerRateLimitFred => VARIANTS[3],
            Variant::Ours1RuleCoalesced => VARIANTS[4],
        }
    }
}

async fn one(s: &Setup, variant: Variant, i: u64) {
    s.ops.one(variant.name(), i).await;
}

async fn command(s: &Setup, cmd: &'static str, args: &[&str]) -> Value {
    s.ops
        .backend
        .client()
        .custom(
            fred::cmd!(cmd),
            args.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        )
        .await
        .unwrap()
}

/// Redis's own time per decision (`INFO commandstats`: EVALSHA's usec over the decisions;
/// one call per decision except when coalescing) while `variant` runs 10,000 operations at
/// `concurrency`; and the decisions per call.
async fn server_usec_per_decision(
    s: &Arc<Setup>,
    variant: Variant,
    concurrency: u64,
) -> (f64, f64) {
    const OPS: u64 = 10_000;
    command(s, "CONFIG", &["RESETSTAT"]).await;
    measure(s, variant, concurrency, OPS).await;
    let info = command(s, "INFO", &["commandstats"]).await;
    let info = info.as_str().map(|c| c.to_string()).unwrap_or_default();
    let field = |name: &str| -> f64 {
        info.lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split([':', ',']).find_map(|f| f.strip_prefix(name)))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN)
    };
    let (usec, calls) = (field("usec="), field("calls="));
    (usec / OPS as f64, OPS as f64 / calls)
}

fn used_memory(info: &Value) -> u64 {
    let text = info.as_str().map(|c| c.to_string()).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Redis memory per live bucket (1M keys that live 30 s) and once they have all expired.
async fn idle_memory(s: &Arc<Setup>) {
    const N: u64 = 1_000_000;
    let before = used_memory(&command(s, "INFO", &["memory"]).await);
    let workers = (0..64u64).map(|w| {
        let s = s.clone();
        tokio::spawn(async move {
            for i in (w..N).step_by(64) {
                let key = s
                    .ops
                    .limiter
                    .key("Live", tower_ratelimits::Id::from(i))
                    .unwrap();
                assert!(
                    s.ops
                        .limiter
                        .spend(&[Transaction::new(key)])
                        .await
                        .unwrap()
                        .allowed()
                );
            }
        })
    });
    let started = Instant::now();
    join_all(workers).await;
    let written_in = started.elapsed();
    let live = used_memory(&command(s, "INFO", &["memory"]).await);
    let keys = command(s, "DBSIZE", &[]).await;
    println!(
        "Redis used_memory: {:.1} MiB before, {:.1} MiB with {N} live buckets ({keys:?} keys, \
         written in {written_in:.1?}): {} bytes per live bucket",
        before as f64 / 1_048_576.0,
        live as f64 / 1_048_576.0,
        live.saturating_sub(before) / N
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let keys = command(s, "DBSIZE", &[]).await.as_u64().unwrap_or(u64::MAX);
        if keys == 0 || Instant::now() > deadline {
            let after = used_memory(&command(s, "INFO", &["memory"]).await);
            println!(
                "Redis used_memory after the buckets went idle: {:.1} MiB ({keys} keys left, \
                 {:.0?} after the last write)",
                after as f64 / 1_048_576.0,
                started.elapsed() - written_in
            );
            return;
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
    let variants = [
        Variant::Baseline,
        Variant::Ours1Rule,
        Variant::Ours3Rules,
        Variant::PeerTowerRateLimitFred,
        Variant::Ours1RuleCoalesced,
    ];

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
    // A bucket that lives 30 s (the bench's own keys expire within a millisecond).
    let key = setup
        .ops
        .limiter
        .key("Live", tower_ratelimits::Id::from(u64::MAX))
        .unwrap();
    rt.block_on(setup.ops.limiter.spend(&[Transaction::new(key.clone())]))
        .unwrap();
    let redis_key = setup.ops.backend.redis_key(&key);
    let bytes: Value = rt
        .block_on(setup.ops.backend.client().custom(
            fred::cmd!("MEMORY"),
            vec!["USAGE".to_owned(), redis_key.clone()],
        ))
        .unwrap();
    println!("MEMORY USAGE {redis_key}: {bytes:?} bytes");

    for concurrency in [16, 64] {
        println!(
            "\nRedis time per decision (INFO commandstats, C={concurrency}, 10,000 decisions)"
        );
        let (baseline, _) = rt.block_on(server_usec_per_decision(
            &setup,
            Variant::Baseline,
            concurrency,
        ));
        for variant in variants {
            let (usec, per_call) =
                rt.block_on(server_usec_per_decision(&setup, variant, concurrency));
            println!(
                "{:<24} {usec:>6.2} usec per decision   {:.2}x the baseline   {per_call:.1} decisions per call",
                variant.name(),
                usec / baseline
            );
        }
    }
    if std::env::var_os("TRL_BENCH_SKIP_IDLE").is_none() {
        rt.block_on(idle_memory(&setup));
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
