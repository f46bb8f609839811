//! One pure GCRA spend decision (no store, no clock).
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tower_ratelimits::__private::gcra;
use tower_ratelimits::Limit;

fn bench(c: &mut Criterion) {
    let limit = Limit::from_micros(20, 20, 1_000_000).unwrap();
    let now = 1_700_000_000_000_000u64;
    c.bench_function("gcra/spend_allowed", |b| {
        b.iter(|| {
            gcra::spend(
                black_box(&limit),
                black_box(Some(now + 500_000)),
                black_box(now),
                1,
            )
        })
    });
    c.bench_function("gcra/spend_denied", |b| {
        b.iter(|| {
            gcra::spend(
                black_box(&limit),
                black_box(Some(now + 1_000_000)),
                black_box(now),
                1,
            )
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
