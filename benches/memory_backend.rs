//! Spend on the in-memory backend, side by side with governor's keyed limiter, at 1k and 1M
//! distinct keys, on 1 and 2 threads. Both use their default clocks and an equivalent quota
//! (1,000,000 per second, burst 1,000,000: every call is allowed and writes).
//!
//! `cargo bench -p tower-ratelimits-benches --bench memory_backend` (bytes per key:
//! `bash benches/memory.sh`)
mod common;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use tower_ratelimits::{Backend, BucketTx};
use tower_ratelimits::{BucketKey, Id, Limit, Limiter, Limits, MemoryBackend, Mode, Transaction};

const RATE: u32 = 1_000_000;

fn limits() -> Limits {
    Limits::builder()
        .limit(
            "Bench",
            Limit::new(RATE.into(), RATE.into(), Duration::from_secs(1)).unwrap(),
        )
        .build()
        .unwrap()
}

/// Runs `op(i)` for `iters` iterations split over `threads` threads; returns the wall time.
fn run_threads<F: Fn(u64) + Sync>(threads: u64, iters: u64, op: F) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let op = &op;
            s.spawn(move || {
                let per = iters / threads;
                let offset = t * 7_919;
                for i in 0..per {
                    op(i + offset);
                }
            });
        }
    });
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_spend");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    group.sample_size(20);
    for &keys in &[1_000u64, 1_000_000] {
        let limits = limits();
        let name = limits.name("Bench").unwrap();
        let bucket_keys: Vec<BucketKey> = (0..keys)
            .map(|k| BucketKey::new(name, Id::from(k)))
            .collect();
        let txs: Vec<Transaction> = bucket_keys
            .iter()
            .map(|k| Transaction::new(k.clone()))
            .collect();
        let backend = MemoryBackend::new();
        let limiter = Limiter::new(limits.clone(), backend.clone());
        let limit = limits.default_limit(name).unwrap();
        // Built (and checked) once, outside the measured loops.
        let bucket_txs: Vec<BucketTx<'_>> = bucket_keys
            .iter()
            .map(|k| BucketTx::new(k, limit, 1..=1, Mode::CheckAndSpend).unwrap())
            .collect();
        let quota = Quota::per_second(NonZeroU32::new(RATE).unwrap())
            .allow_burst(NonZeroU32::new(RATE).unwrap());
        let governor = Arc::new(RateLimiter::keyed(quota));
        // Fill both stores first so the 1M-key runs measure lookups of live keys.
        for k in 0..keys {
            common::ready(limiter.spend(std::slice::from_ref(&txs[k as usize]))).unwrap();
            let _ = governor.check_key(&k);
        }
        for &threads in &[1u64, 2] {
            let id = format!("{keys}keys/{threads}t");
            group.bench_function(BenchmarkId::new("ours_limiter", &id), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters, |i| {
                        let tx = &txs[(i % keys) as usize];
                        let _ = common::ready(limiter.spend(std::slice::from_ref(tx)));
                    })
                })
            });
            group.bench_function(BenchmarkId::new("ours_backend", &id), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters, |i| {
                        let tx = &bucket_txs[(i % keys) as usize];
                        let _ = common::ready(backend.spend(std::slice::from_ref(tx)).outcomes());
                    })
                })
            });
            group.bench_function(BenchmarkId::new("ours_spend_one", &id), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters, |i| {
                        let _ = common::spend_one(&backend, &bucket_txs[(i % keys) as usize]);
                    })
                })
            });
            group.bench_function(BenchmarkId::new("governor", &id), |b| {
                b.iter_custom(|iters| {
                    run_threads(threads, iters, |i| {
                        let _ = governor.check_key(&(i % keys));
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
