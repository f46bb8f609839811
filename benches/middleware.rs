//! Requests through an axum Router in process (tower `oneshot`, no sockets): bare, with our
//! layer (in-memory backend, 1 rule and 3 rules), and with tower_governor's layer (per IP, an
//! equivalent quota). Every request is allowed, so each one takes the full decision path.
//!
//! `cargo bench -p tower-ratelimits-benches --bench middleware`
mod common;

use std::time::Duration;

use common::apps::{bare, governor, ours, request};
use criterion::{Criterion, criterion_group, criterion_main};
use tower::ServiceExt;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("middleware");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    let apps = [
        ("bare", bare()),
        ("ours_1_rule", ours(1, true)),
        ("ours_1_rule_no_headers", ours(1, false)),
        ("ours_3_rules", ours(3, true)),
        ("tower_governor", governor()),
    ];
    for (name, app) in apps {
        let mut i = 0u32;
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| {
                i = (i + 1) % 1000;
                let app = app.clone();
                let req = request(i);
                async move {
                    let r = app.oneshot(req).await.unwrap();
                    assert!(r.status().is_success());
                    r
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
