//! Decisions per second of Redis variants, timed in alternating rounds (A, B, A, B, ...), so
//! that a machine busy in one stretch slows both alike; prints each variant's median ops/s and
//! the median of the per-round ratios B/A.
//!
//! `cargo bench -p tower-ratelimits-benches --bench redis_rounds -- --variants ours_1_rule_hot_key,ours_1_rule_hot_key_prefetch --rounds 9 --ops 20000 --concurrency 16`
//!
//! Uses `--url` (or `REDIS_URL`) when given, otherwise spawns a `redis-server` on a free
//! loopback port. Variants as in `common/redis_ops.rs`.

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::sync::Arc;
use std::time::Instant;

use common::redis_ops::RedisOps;
use futures_util::future::join_all;

/// `ops` decisions of `variant`, `concurrency` workers; ops/s.
async fn round(s: &Arc<RedisOps>, variant: &str, ops: u64, concurrency: u64) -> f64 {
    let started = Instant::now();
    let workers = (0..concurrency).map(|w| {
        let (s, variant) = (s.clone(), variant.to_owned());
        tokio::spawn(async move {
            for i in 0..ops / concurrency {
                s.one(&variant, w * 7919 + i).await;
            }
        })
    });
    for r in join_all(workers).await {
        r.unwrap();
    }
    (ops / concurrency * concurrency) as f64 / started.elapsed().as_secs_f64()
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
    let setup = Arc::new(rt.block_on(RedisOps::connect(&url)));
    let mut per_variant = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (i, v) in variants.iter().enumerate() {
            per_variant[i].push(rt.block_on(round(&setup, v, ops, concurrency)));
        }
    }
    println!("{rounds} alternating rounds of {ops} decisions at concurrency {concurrency}:");
    for (v, r) in variants.iter().zip(&per_variant) {
        println!("  {v:<32} {:>10.0} decisions/s (median)", median(r.clone()));
    }
    for (v, r) in variants.iter().zip(&per_variant).skip(1) {
        let ratios = r.iter().zip(&per_variant[0]).map(|(b, a)| b / a).collect();
        println!(
            "  {v} / {}: {:.2}x (median of the rounds' ratios)",
            variants[0],
            median(ratios)
        );
    }
}
