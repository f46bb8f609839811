//! Decisions per second of Redis variants, timed in alternating rounds (A, B, B, A, ...), so
//! that a machine busy in one stretch slows both alike; prints each variant's median ops/s and
//! the median of the per-round ratios B/A.
//!
//! `cargo bench -p tower-ratelimits-benches --bench redis_rounds -- --variants ours_1_rule_hot_key,ours_1_rule_hot_key_prefetch --rounds 9 --ops 20000 --concurrency 16`
//!
//! Uses `--url` (or `REDIS_URL`) when given, otherwise spawns a `redis-server` on a free
//! loopback port. Variants as in `common/redis_ops.rs`.
//!
//! Each round also times every decision: the median over the rounds of each round's p50 and
//! p99 latency is printed, and the median of the per-round p99 ratios. `--delay-ms D` puts a
//! proxy in front of Redis that holds every chunk D ms in each direction (a remote Redis):
//!
//! `cargo bench -p tower-ratelimits-benches --bench redis_rounds -- --variants ours_1_rule_uncoalesced,ours_1_rule --rounds 3 --ops 20000 --concurrency 64 --delay-ms 1`

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_ops::RedisOps;
use futures_util::future::join_all;

/// What one round measured.
#[derive(Clone, Copy)]
struct Round {
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

/// `ops` decisions of `variant`, `concurrency` workers: ops/s and latency percentiles.
async fn round(s: &Arc<RedisOps>, variant: &str, ops: u64, concurrency: u64) -> Round {
    let started = Instant::now();
    let workers = (0..concurrency).map(|w| {
        let (s, variant) = (s.clone(), variant.to_owned());
        tokio::spawn(async move {
            let mut took = Vec::with_capacity((ops / concurrency) as usize);
            for i in 0..ops / concurrency {
                let t = Instant::now();
                s.one(&variant, w * 7919 + i).await;
                took.push(t.elapsed().as_secs_f64() * 1e6);
            }
            took
        })
    });
    let mut took: Vec<f64> = Vec::new();
    for r in join_all(workers).await {
        took.extend(r.unwrap());
    }
    let ops_per_s = took.len() as f64 / started.elapsed().as_secs_f64();
    took.sort_by(f64::total_cmp);
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    Round {
        ops_per_s,
        p50_us: at(0.50),
        p99_us: at(0.99),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| common::arg(&args, flag);
    let variants = arg("--variants")
        .unwrap_or_else(|| "ours_1_rule_hot_key,ours_1_rule_hot_key_prefetch".into());
    let variants: Vec<&str> = variants.split(',').collect();
    let rounds: usize = arg("--rounds").map_or(9, |s| s.parse().expect("--rounds N"));
    let ops: u64 = arg("--ops").map_or(20_000, |s| s.parse().expect("--ops N"));
    let concurrency: u64 = arg("--concurrency").map_or(16, |s| s.parse().expect("--concurrency N"));
    let delay_ms: u64 = arg("--delay-ms").map_or(0, |s| s.parse().expect("--delay-ms N"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_server, url) = match arg("--url").or_else(|| std::env::var("REDIS_URL").ok()) {
        Some(url) => (None, url),
        None => {
            let s = redis_support::RedisServer::start();
            let url = s.url();
            (Some(s), url)
        }
    };
    let url = if delay_ms > 0 {
        let upstream = url
            .trim_start_matches("redis://")
            .trim_end_matches('/')
            .to_string();
        let port =
            common::delaying_proxy(upstream, Duration::from_millis(delay_ms), Duration::ZERO);
        format!("redis://127.0.0.1:{port}")
    } else {
        url
    };
    let setup = Arc::new(rt.block_on(RedisOps::connect(&url)));
    // Every other round in the reverse order: the one that runs second in a round is slowed
    // (the first's keys still expiring, its connections' buffers), so each goes first as often.
    let mut per_variant = vec![Vec::new(); variants.len()];
    for r in 0..rounds {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if r % 2 == 1 {
            order.reverse();
        }
        for i in order {
            per_variant[i].push(rt.block_on(round(&setup, variants[i], ops, concurrency)));
        }
    }
    println!(
        "{rounds} alternating rounds of {ops} decisions at concurrency {concurrency}{}:",
        if delay_ms > 0 {
            format!(", through a proxy holding each chunk {delay_ms} ms each way")
        } else {
            String::new()
        }
    );
    let of = |r: &[Round], f: fn(&Round) -> f64| median(r.iter().map(f).collect());
    for (v, r) in variants.iter().zip(&per_variant) {
        println!(
            "  {v:<32} {:>10.0} decisions/s, p50 {:>8.0} us, p99 {:>8.0} us (medians)",
            of(r, |r| r.ops_per_s),
            of(r, |r| r.p50_us),
            of(r, |r| r.p99_us)
        );
    }
    if let Some(stats) = setup.backend.coalesce_stats() {
        println!(
            "  the default backend (the variants without a suffix): {} requests queued, in {} calls; {} direct",
            stats.requests, stats.calls, stats.direct
        );
    }
    for (v, r) in variants.iter().zip(&per_variant).skip(1) {
        let ratio = |f: fn(&Round) -> f64| {
            median(
                r.iter()
                    .zip(&per_variant[0])
                    .map(|(b, a)| f(b) / f(a))
                    .collect(),
            )
        };
        println!(
            "  {v} / {}: {:.2}x the decisions/s, {:.3}x the p99 (medians of the rounds' ratios)",
            variants[0],
            ratio(|r| r.ops_per_s),
            ratio(|r| r.p99_us)
        );
    }
}
