//! The Redis backend shared by independent clients and instances: keys name the limit, not
//! its place in a file, and concurrent clients never admit more than the limits.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fred::prelude::KeysInterface;
use support::redis::{TestRedis, unique_prefix};
use tower_ratelimits::{BucketKey, Id, Limiter, Limits, Transaction};

use support::redis_backend::backend;

// ---------------------------------------------------------------------------------------------
// Bucket identity: keys name the limit, not its place in a file.
// ---------------------------------------------------------------------------------------------

async fn identity_across_reordered_files(url: &str) {
    let prefix = unique_prefix("identity");
    let [a, b, c] = support::identity::three_configurations();
    let a = Limiter::new(a, backend(url, &prefix).await);
    let b = Limiter::new(b, backend(url, &prefix).await);
    let c = Limiter::new(c, backend(url, &prefix).await);
    support::identity::instances_share_exactly_the_right_buckets(&a, &b, &c).await;
    // The stored keys are the names' own, as docs/keys-and-http.md documents them.
    let redis = backend(url, &prefix).await;
    for name in ["RequestsPerIPAddress", "RequestsPerIPv6Range", "Unused"] {
        let key = BucketKey::new(a_name(&c, name), Id::new("10.0.0.1").unwrap());
        let stored = redis.redis_key(&key);
        assert_eq!(stored, format!("{prefix}{{{name}:10.0.0.1}}"));
        let exists: i64 = redis
            .client_for_key(&stored)
            .unwrap()
            .exists(&stored)
            .await
            .unwrap();
        assert_eq!(exists, 1, "{stored}");
    }
}

fn a_name(limiter: &Limiter, name: &str) -> tower_ratelimits::LimitName {
    limiter.name(name).unwrap()
}

#[tokio::test]
async fn reordered_and_extended_files_share_exactly_the_right_buckets_on_each_redis() {
    for redis in TestRedis::each() {
        identity_across_reordered_files(&redis.url).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Atomicity across independent clients.
// ---------------------------------------------------------------------------------------------

async fn no_over_admission(url: &str) {
    const BURST: u64 = 100;
    let limits = Limits::from_yaml_str(
        &format!("Hot:\n  burst: {BURST}\n  count: 1\n  period: 1000h\n"),
        None,
    )
    .unwrap();
    let prefix = unique_prefix("atomic");
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _client in 0..2 {
        let limiter = Arc::new(Limiter::new(limits.clone(), backend(url, &prefix).await));
        for _ in 0..64 {
            let limiter = limiter.clone();
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    let key = limiter.parse_key("Hot", "one-key").unwrap();
                    let d = limiter.spend(&[Transaction::new(key)]).await.unwrap();
                    if d.allowed() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(admitted.load(Ordering::Relaxed), BURST);
}

/// `Limiter::spend_or_wait` on the store's arithmetic: two app instances, six callers each,
/// a batch of two limits (two slots on the cluster), one token per 20 ms. Every caller passes
/// within its bound, and no faster than the limits allow (11 waits of 20 ms after the first).
async fn waiting_callers_pass_at_the_limits_rate(url: &str) {
    let limits = Limits::from_yaml_str(
        "Wa: {burst: 1, count: 50, period: 1s}\nWb: {burst: 2, count: 50, period: 1s}\n",
        None,
    )
    .unwrap();
    let prefix = unique_prefix("wait");
    let start = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _instance in 0..2 {
        let limiter = Arc::new(Limiter::new(limits.clone(), backend(url, &prefix).await));
        for _ in 0..6 {
            let limiter = limiter.clone();
            tasks.push(tokio::spawn(async move {
                let batch = [
                    Transaction::new(limiter.parse_key("Wa", "job").unwrap()),
                    Transaction::new(limiter.parse_key("Wb", "other").unwrap()),
                ];
                limiter
                    .spend_or_wait(&batch, Duration::from_secs(30))
                    .await
                    .unwrap()
                    .allowed()
            }));
        }
    }
    for t in tasks {
        assert!(t.await.unwrap(), "a caller gave up within its bound");
    }
    assert!(
        start.elapsed() >= Duration::from_millis(11 * 20),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_callers_pass_at_the_limits_rate_on_each_redis() {
    for redis in TestRedis::each() {
        waiting_callers_pass_at_the_limits_rate(&redis.url).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_128_tasks_admit_exactly_the_burst_on_each_redis() {
    for redis in TestRedis::each() {
        no_over_admission(&redis.url).await;
    }
}
