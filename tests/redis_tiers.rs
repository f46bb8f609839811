//! Burst tiers on Redis: one value per key, expiry, no over-grant across clients, foreign data.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fred::prelude::{ClientLike as _, KeysInterface};
use support::redis::{TestRedis, unique_prefix};
use tower_ratelimits::{Limiter, Limits, Transaction};

use support::redis_backend::{KEY_LIMITS, backend, limiter_on};
use tower_ratelimits::RedisBackend;

// ---------------------------------------------------------------------------------------------
// Burst tiers on Redis.
// ---------------------------------------------------------------------------------------------

const TIER_LIMITS: &str = "\
Penalty:
  tiers:
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 50, window: 5s, active: 5s, cooldown: 15s}
Short:
  tiers:
    - {limit: 1, window: 30ms, active: 30ms, cooldown: 0s}
Hot:
  tiers:
    - {limit: 60, window: 1000h, active: 1000h, cooldown: 0s}
    - {limit: 40, window: 1000h, active: 1000h, cooldown: 1000h}
";

async fn raw_bytes(backend: &RedisBackend, key: &str) -> Option<Vec<u8>> {
    backend
        .client_for_key(key)
        .unwrap()
        .get::<Option<Vec<u8>>, _>(key)
        .await
        .unwrap()
}

async fn server_time_us(backend: &RedisBackend, key: &str) -> u64 {
    let t: Vec<String> = backend
        .client_for_key(key)
        .unwrap()
        .custom(fred::cmd!("TIME"), Vec::<String>::new())
        .await
        .unwrap();
    t[0].parse::<u64>().unwrap() * 1_000_000 + t[1].parse::<u64>().unwrap()
}

#[tokio::test]
async fn a_tiered_key_is_one_value_unchanged_by_rejections_and_expires_when_fresh() {
    let redis = TestRedis::single();
    let (backend, limiter) = limiter_on(&redis.url, &unique_prefix("tiers"), TIER_LIMITS).await;
    let key = limiter.parse_key("Penalty", "acct").unwrap();
    let redis_key = backend.redis_tier_key(&key);
    let before_us = server_time_us(&backend, &redis_key).await;
    let d = limiter
        .spend(&[Transaction::new(key.clone()).cost(6)])
        .await
        .unwrap();
    let after_us = server_time_us(&backend, &redis_key).await;
    let d = &d.decisions()[0];
    assert!(d.allowed() && d.tiers().unwrap().burst);
    let raw = raw_bytes(&backend, &redis_key).await.unwrap();
    // Expiry: the moment the state equals a fresh one (tier 2's cooldown end), on the server.
    let reset_us = d.reset_after().as_micros() as u64;
    let expire_ms: i64 = backend
        .client()
        .custom(fred::cmd!("PEXPIRETIME"), vec![redis_key.clone()])
        .await
        .unwrap();
    let expire_ms = expire_ms as u64;
    assert!(
        ((before_us + reset_us) / 1000..=(after_us + reset_us).div_ceil(1000)).contains(&expire_ms),
        "PEXPIRETIME {expire_ms} vs reset {reset_us}us"
    );
    // A rejected request writes nothing.
    let denied = limiter
        .spend(&[Transaction::new(key.clone()).cost(50)])
        .await
        .unwrap();
    assert!(!denied.allowed());
    assert_eq!(raw_bytes(&backend, &redis_key).await.unwrap(), raw);
    // The state is compact: one MessagePack array.
    assert!(raw.len() < 40, "{} bytes", raw.len());
    // Reset deletes it.
    limiter.reset(std::slice::from_ref(&key)).await.unwrap();
    assert_eq!(raw_bytes(&backend, &redis_key).await, None);
    // A short-lived state goes away by itself.
    let short = limiter.parse_key("Short", "acct").unwrap();
    limiter
        .spend(&[Transaction::new(short.clone())])
        .await
        .unwrap();
    let short_key = backend.redis_tier_key(&short);
    let deadline = Instant::now() + Duration::from_secs(10);
    while raw_bytes(&backend, &short_key).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "the fresh state was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn no_over_grant_of_tiers(url: &str) {
    let limits = Limits::from_yaml_str(TIER_LIMITS, None).unwrap();
    let prefix = unique_prefix("tier-atomic");
    let granted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _client in 0..2 {
        let limiter = Arc::new(Limiter::new(limits.clone(), backend(url, &prefix).await));
        for _ in 0..64 {
            let (limiter, granted) = (limiter.clone(), granted.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    let key = limiter.parse_key("Hot", "one-key").unwrap();
                    let tx = Transaction::new(key).cost_range(1..=2);
                    let d = limiter.spend(&[tx]).await.unwrap();
                    granted.fetch_add(d.decisions()[0].granted(), Ordering::Relaxed);
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(granted.load(Ordering::Relaxed), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_128_tasks_grant_exactly_the_tiers_capacity_on_each_redis() {
    for redis in TestRedis::each() {
        no_over_grant_of_tiers(&redis.url).await;
    }
}

/// The same for a tiered key: not MessagePack, MessagePack of the wrong shape, a negative
/// time, a grant of 1,000 units 30 years ahead (it counted in every window before: the key was
/// blocked for 30 years), a hash: the state drained under the limit (what a fresh key holds
/// once its whole capacity was granted: Penalty's tier 2 entered and used up, 5 s active),
/// replaced by it at once; never a fresh state (a full burst to whoever wrote it).
#[tokio::test]
async fn foreign_data_at_a_tiered_key_is_a_drained_state_replaced_at_once() {
    let redis = TestRedis::single();
    let (backend, limiter) =
        limiter_on(&redis.url, &unique_prefix("tier-foreign"), TIER_LIMITS).await;
    // {1, base, 1 tier, no entry, 1 grant: (base + 0, 1000 units)}, base 30 years from now
    // on the server's clock (this machine's).
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let mut ahead = vec![0x97, 0x01, 0xcf];
    ahead.extend((now_us + 30 * 365 * 86_400_000_000).to_be_bytes());
    ahead.extend([0x01, 0xff, 0x01, 0x00, 0xcd, 0x03, 0xe8]);
    let values: [&[u8]; 4] = [
        b"hello",
        &[0x93, 0x02, 0x00, 0x00],
        &[0x95, 0x01, 0xff, 0x01, 0x00, 0x00],
        &ahead,
    ];
    for (i, value) in values.into_iter().enumerate() {
        let key = limiter.parse_key("Penalty", &format!("x{i}")).unwrap();
        let redis_key = backend.redis_tier_key(&key);
        let client = backend.client_for_key(&redis_key).unwrap();
        let _: () = client
            .set(&redis_key, value.to_vec(), None, None, false)
            .await
            .unwrap();
        let d = limiter
            .check(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        assert!(!d.allowed(), "{value:?}");
        let replaced = raw_bytes(&backend, &redis_key).await.unwrap();
        assert_ne!(replaced, value);
        let d = limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        assert!(!d.allowed(), "{value:?}");
        // Tier 2 is active for 5 s from the replacement: the wait says so.
        let wait = d.strictest().unwrap().retry_after();
        assert!(
            wait > Duration::from_secs(4) && wait <= Duration::from_secs(5),
            "{wait:?}"
        );
        assert_eq!(raw_bytes(&backend, &redis_key).await.unwrap(), replaced);
    }
    let key = limiter.parse_key("Penalty", "hash").unwrap();
    let redis_key = backend.redis_tier_key(&key);
    let client = backend.client_for_key(&redis_key).unwrap();
    let _: i64 = client
        .custom(
            fred::cmd!("HSET"),
            vec![redis_key.clone(), "f".into(), "v".into()],
        )
        .await
        .unwrap();
    assert!(
        !limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap()
            .allowed()
    );
    let kind: String = client
        .custom(fred::cmd!("TYPE"), vec![redis_key.clone()])
        .await
        .unwrap();
    assert_eq!(kind, "string", "the hash was replaced by our state");
}

/// The Redis metrics, recorded by a real Prometheus recorder (this thread's) and parsed: a
/// cross-slot batch denied in one slot is one compensation, three scripts (one per slot, one
/// refund); the latency histogram counts each spend.
#[tokio::test]
async fn round_trips_compensations_and_latency_are_counted_on_the_cluster() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let redis = TestRedis::cluster();
    let backend = RedisBackend::from_url(&redis.url)
        .prefix(unique_prefix("metrics"))
        .deny_cache(false)
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(Limits::from_yaml_str(KEY_LIMITS, None).unwrap(), backend);
    let api = limiter.parse_key("Api", "42").unwrap();
    let acct = limiter.parse_key("PerAccount", "42").unwrap();
    for _ in 0..2 {
        assert!(
            limiter
                .spend(&[Transaction::new(api.clone())])
                .await
                .unwrap()
                .allowed()
        );
    }
    for _ in 0..3 {
        let batch = [
            Transaction::new(acct.clone()),
            Transaction::new(api.clone()),
        ];
        assert!(!limiter.spend(&batch).await.unwrap().allowed());
    }
    let m = support::scrape::samples(&handle.render());
    assert_eq!(m["tower_ratelimits_redis_compensations_total{}"], 3.0);
    assert_eq!(
        m["tower_ratelimits_redis_round_trips_total{}"],
        2.0 + 3.0 * 3.0
    );
    assert_eq!(
        m["tower_ratelimits_backend_duration_seconds{op=spend}"],
        5.0
    );
    assert!(!m.contains_key("tower_ratelimits_redis_deny_cache_hits_total{}"));
}

/// On a cluster a batch's keys go out in one call per slot and their outcomes come back out of
/// order: each tier grant stays with its own transaction, on a spend and on a refund.
#[tokio::test]
async fn tier_grants_stay_with_their_transactions_across_a_clusters_slots() {
    let redis = TestRedis::cluster();
    let yaml = format!("{TIER_LIMITS}Plain:\n  burst: 100\n  count: 100\n  period: 1s\n");
    let (_backend, limiter) = limiter_on(&redis.url, &unique_prefix("grants"), &yaml).await;
    let plain = |id: &str| limiter.parse_key("Plain", id).unwrap();
    let hot = limiter.parse_key("Hot", "acct").unwrap();
    let penalty = limiter.parse_key("Penalty", "other").unwrap();
    // Two tiered keys between plain ones, on more slots than one.
    let batch = [
        Transaction::new(plain("a")),
        Transaction::new(hot.clone()).cost(70),
        Transaction::new(plain("b")),
        Transaction::new(penalty.clone()).cost(3),
        Transaction::new(plain("c")),
    ];
    let d = limiter.spend(&batch).await.unwrap();
    assert!(d.allowed(), "{d:?}");
    let tiers: Vec<_> = d
        .decisions()
        .iter()
        .map(|d| d.tiers().map(|t| t.units().to_vec()))
        .collect();
    assert_eq!(
        tiers,
        [None, Some(vec![60, 10]), None, Some(vec![3, 0]), None],
        "{d:?}"
    );
    let refund = [
        Transaction::new(plain("a")),
        Transaction::new(penalty.clone()).cost(2),
        Transaction::new(hot.clone()).cost(5),
    ];
    let r = limiter.refund(&refund).await.unwrap();
    let taken: Vec<_> = r
        .decisions()
        .iter()
        .map(|d| (d.granted(), d.tiers().map(|t| t.granted)))
        .collect();
    assert_eq!(taken, [(0, None), (2, Some(2)), (5, Some(5))], "{r:?}");
}
