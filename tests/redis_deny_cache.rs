//! The Redis backend's local deny cache: a flood on a denied key does not reach Redis, the
//! cache stays bounded, and it never changes a decision.

mod support;

use std::time::Duration;

use support::redis::{RedisServer, TestRedis, unique_prefix};
use tower_ratelimits::{Limiter, Limits, ManualClock, Mode, Transaction};

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../simulator/src/trace.rs"]
mod simulate;
use support::redis_backend::{KEY_LIMITS, caller_time_backend, commandstat};
use tower_ratelimits::RedisBackend;
#[path = "support/conformance.rs"]
#[allow(dead_code)]
mod conformance;
use conformance::{random_trace, same_decisions_but_skipped, simulate_redis};

// ---------------------------------------------------------------------------------------------
// The local deny cache.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_flood_on_a_denied_key_does_not_reach_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(&server.url(), "rl:", &clock, true).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let batch = [
        Transaction::new(limiter.parse_key("Api", "flooder").unwrap()),
        Transaction::new(limiter.parse_key("PerIp", "192.0.2.1").unwrap()),
    ];
    for expected in [true, true, false] {
        assert_eq!(limiter.spend(&batch).await.unwrap().allowed(), expected);
    }
    let before = commandstat(server.port, "evalsha");
    for _ in 0..1000 {
        let d = limiter.spend(&batch).await.unwrap();
        assert!(!d.allowed());
        assert_eq!(
            d.strictest().unwrap().retry_after(),
            Duration::from_millis(500)
        );
    }
    assert_eq!(
        commandstat(server.port, "evalsha"),
        before,
        "no round trip while denied"
    );
    assert_eq!(backend.deny_cache_hits(), 1000);
    // A denial the cache is sure of is decided at once: the spend is ready at its first poll
    // (the middleware answers it in `call`, with no box and no await).
    assert!(!support::ready(limiter.spend(&batch)).unwrap().allowed());

    // When the bucket has room again, the cache lets the request through to Redis.
    clock.advance(Duration::from_millis(500));
    assert!(limiter.spend(&batch).await.unwrap().allowed());
    assert_eq!(commandstat(server.port, "evalsha"), before + 1);
}

/// The deny cache is bounded with O(1) eviction. Before, a full cache scanned
/// every entry (`retain`) for each new denied key, dropping throughput 8-15x under a flood of
/// new keys, and then stopped remembering new keys at all.
#[tokio::test]
async fn a_flood_of_new_denied_keys_keeps_the_deny_cache_bounded_and_answering() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = RedisBackend::from_url(&redis.url)
        .prefix(unique_prefix("bounded"))
        .caller_time(clock.clone())
        .deny_cache_capacity(64)
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(
        Limits::from_yaml_str("One: {burst: 1, count: 1, period: 1h}\n", None).unwrap(),
        backend.clone(),
    );
    let tx = |i: u32| {
        [Transaction::new(
            limiter.parse_key("One", &format!("k{i}")).unwrap(),
        )]
    };
    for i in 0..1_000 {
        assert!(limiter.spend(&tx(i)).await.unwrap().allowed());
        assert!(!limiter.spend(&tx(i)).await.unwrap().allowed());
    }
    let held = backend.deny_cache_len();
    assert!(
        held > 0 && held <= 64,
        "{held} entries for a capacity of 64"
    );
    // The newest denied key is remembered (a full cache still takes new keys) and answered
    // locally.
    let hits = backend.deny_cache_hits();
    assert!(!limiter.spend(&tx(999)).await.unwrap().allowed());
    assert_eq!(backend.deny_cache_hits(), hits + 1);
}

#[tokio::test]
async fn refunds_and_resets_clear_the_deny_cache() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(&redis.url, &unique_prefix("cache"), &clock, true).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let key = limiter.parse_key("Api", "c").unwrap();
    let tx = [Transaction::new(key.clone())];
    for expected in [true, true, false, false] {
        assert_eq!(limiter.spend(&tx).await.unwrap().allowed(), expected);
    }
    assert_eq!(backend.deny_cache_hits(), 1);
    limiter.refund(&tx).await.unwrap();
    assert!(
        limiter.spend(&tx).await.unwrap().allowed(),
        "refunded: Redis allows"
    );
    assert!(!limiter.spend(&tx).await.unwrap().allowed());
    limiter.reset(&[key]).await.unwrap();
    assert!(
        limiter.spend(&tx).await.unwrap().allowed(),
        "reset: Redis allows"
    );
}

/// Random operations through a backend with the cache and one without (same server, other
/// prefix, one writer each): every batch verdict and every evaluated decision is identical, so
/// the cache never denied what Redis would have allowed; it only skips the rest of a batch it
/// knows is denied. The traces do skip (a cache answering only whole batches would pass the
/// comparison but not this).
#[tokio::test]
async fn the_deny_cache_never_changes_a_decision() {
    let redis = TestRedis::single();
    let mut skipped = 0;
    for seed in 10..14 {
        let trace = random_trace(seed, 400);
        let with = simulate_redis(&redis.url, &trace, true).await;
        let without = simulate_redis(&redis.url, &trace, false).await;
        same_decisions_but_skipped(&format!("seed {seed}"), &trace, &without, &with);
        skipped += with.matches(r#""skipped":true"#).count();
    }
    assert!(skipped > 0, "no trace exercised a partial answer");
}

/// One remembered denial of a counting transaction denies the batch. Before,
/// the cache answered only when every bucket of the request was remembered, so a client rotating
/// addresses inside an exhausted /48 cost one Redis call per request.
#[tokio::test]
async fn rotating_addresses_inside_an_exhausted_48_never_reach_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(&server.url(), "rl:", &clock, true).await;
    let limits = Limits::from_yaml_str(
        "\
PerIp: {kind: ip, burst: 5, count: 5, period: 1s}
Per48: {kind: ipv6_range, burst: 3, count: 3, period: 1s}
",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(limits, backend.clone());
    let request = |i: u32| {
        let ip = std::net::Ipv6Addr::new(0x2001, 0xdb8, 1, 7, 0, 0, (i >> 16) as u16, i as u16);
        let ip = ip.to_string();
        [
            Transaction::new(limiter.parse_key("PerIp", &ip).unwrap()),
            Transaction::new(limiter.parse_key("Per48", "2001:db8:1::/48").unwrap()),
        ]
    };
    for i in 0..3 {
        assert!(limiter.spend(&request(i)).await.unwrap().allowed());
    }
    let d = limiter.spend(&request(3)).await.unwrap();
    assert!(!d.allowed(), "the /48 is exhausted");
    let before = commandstat(server.port, "evalsha");
    for i in 4..1004 {
        let d = limiter.spend(&request(i)).await.unwrap();
        assert!(!d.allowed());
        let [ip, range] = d.decisions() else {
            panic!("two decisions")
        };
        assert!(ip.skipped() && !ip.allowed() && ip.granted() == 0, "{ip:?}");
        assert!(!range.skipped() && !range.allowed());
        assert_eq!(d.strictest().unwrap().name(), range.name());
        assert_eq!(
            d.strictest().unwrap().retry_after(),
            Duration::from_micros(333_334)
        );
    }
    assert_eq!(
        commandstat(server.port, "evalsha"),
        before,
        "a new address inside the denied /48 costs no round trip"
    );
    assert_eq!(backend.deny_cache_hits(), 1000);
    // A spend-only transaction's remembered denial does not count: that batch goes to Redis.
    let shadow = [
        Transaction::new(limiter.parse_key("PerIp", "192.0.2.9").unwrap()),
        Transaction::new(limiter.parse_key("Per48", "2001:db8:1::/48").unwrap())
            .mode(Mode::SpendOnly),
    ];
    assert!(limiter.spend(&shadow).await.unwrap().allowed());
    assert_eq!(commandstat(server.port, "evalsha"), before + 1);
    // When the /48 has room again, Redis decides.
    clock.advance(Duration::from_millis(334));
    assert!(limiter.spend(&request(5000)).await.unwrap().allowed());
    assert_eq!(commandstat(server.port, "evalsha"), before + 2);
}
