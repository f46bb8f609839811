//! The Redis backend against a real `redis-server` and a real 3-master Redis Cluster: the same
//! decisions as the in-memory backend, atomicity across clients, key layout and expiry, the
//! deny cache, and faults.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fred::prelude::{ClientLike as _, KeysInterface, Value};
use support::redis::{RedisCluster, RedisServer, TestRedis, command, unique_prefix};
use tower_ratelimits::{
    Backend, BackendError, BucketKey, BucketTx, GcraError, Id, Limiter, LimiterError, Limits,
    ManualClock, MemoryBackend, Mode, Transaction, TransactionError,
};

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../examples/simulate/trace.rs"]
mod simulate;
use tower_ratelimits::{RedisBackend, RedisSetupError};

async fn backend(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

async fn caller_time_backend(
    url: &str,
    prefix: &str,
    clock: &ManualClock,
    cache: bool,
) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .caller_time(clock.clone())
        .deny_cache(cache)
        .command_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

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
    // The stored keys are the names' own, as the README documents them.
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
async fn reordered_and_extended_files_share_exactly_the_right_buckets_on_single_redis() {
    identity_across_reordered_files(&TestRedis::single().url).await;
}

#[tokio::test]
async fn reordered_and_extended_files_share_exactly_the_right_buckets_on_the_cluster() {
    identity_across_reordered_files(&TestRedis::cluster().url).await;
}

// ---------------------------------------------------------------------------------------------
// Conformance: identical traces through memory, single Redis and the cluster.
// ---------------------------------------------------------------------------------------------

const CONFORMANCE_LIMITS: &str = "\
Fast:
  burst: 5
  count: 5
  period: 1s
Slow:
  burst: 3
  count: 1
  period: 2s
Big:
  burst: 100
  count: 60
  period: 1m
TierA:
  tiers:
    - {limit: 3, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 5, window: 2s, active: 1s, cooldown: 2s}
TierB:
  tiers:
    - {limit: 2, window: 500ms, active: 2s, cooldown: 1s}
    - {limit: 2, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 3, window: 3s, active: 2s, cooldown: 1s}
";

/// The limits of the conformance traces: those of the example traces
/// (`examples/traces/gcra-20-per-second.yaml`, `examples/traces/burst-tiers.yaml`) plus
/// `examples/traces/partial-grants.yaml`, `examples/traces/concurrency.yaml` and
/// `CONFORMANCE_LIMITS`.
fn conformance_limits() -> Limits {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let (gcra, tiers) = (read("gcra-20-per-second.yaml"), read("burst-tiers.yaml"));
    let partial = read("partial-grants.yaml");
    let concurrency = read("concurrency.yaml");
    Limits::from_yaml_str(
        &format!("{gcra}\n{tiers}\n{partial}\n{concurrency}\n{CONFORMANCE_LIMITS}"),
        None,
    )
    .unwrap()
}

/// A deterministic pseudo-random trace: batches of 1 to 3 limits (GCRA, tiered and
/// concurrency, mixed), all modes, costs from 0 to the burst and ranges (partial grants, GCRA
/// and tiered), checks, refunds, resets and releases of slots, and time steps from 0 to 700 ms.
fn random_trace(seed: u64, lines: usize) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let limits = [
        ("Fast", 5u64),
        ("TierA", 8),
        ("Slow", 3),
        ("TierB", 7),
        ("Big", 100),
        ("InFlight2", 1),
    ];
    let ids = ["u1", "u2", "a{b}", "x%7By"];
    let mut t_ms = 0u64;
    let mut out = String::new();
    for _ in 0..lines {
        t_ms += [0, 0, 1, 50, 100, 300, 700][next(7) as usize];
        let op = match next(20) {
            0..=12 => "spend",
            13..=15 => "check",
            16..=17 => "refund",
            18 => "release",
            _ => "reset",
        };
        out.push_str(&format!("{t_ms}ms {op}"));
        let first = next(limits.len() as u64) as usize;
        let count = 1 + next(3) as usize;
        for k in 0..count {
            let (name, burst) = limits[(first + k) % limits.len()];
            let id = ids[next(ids.len() as u64) as usize];
            let mode = if op == "spend" {
                ["", "", "", "check-only:", "spend-only:"][next(5) as usize]
            } else {
                ""
            };
            out.push_str(&format!(" {mode}{name}={id}"));
            // A concurrency limit takes a cost of 0 or 1, never a range.
            if name == "InFlight2" && op != "reset" && op != "release" && next(2) == 0 {
                out.push_str(&format!("*{}", next(2)));
            } else if op != "reset" && op != "release" && name != "InFlight2" && next(2) == 0 {
                let cost = match next(4) {
                    0 => 0,
                    1 => burst,
                    _ => 1 + next(burst.min(4)),
                };
                if op != "refund" && next(2) == 0 {
                    let max = cost + next(4);
                    out.push_str(&format!("*{cost}..{max}"));
                } else {
                    out.push_str(&format!("*{cost}"));
                }
            }
        }
        out.push('\n');
    }
    out
}

async fn simulate_with(limiter: &Limiter, clock: &ManualClock, trace: &str) -> String {
    let mut out = Vec::new();
    simulate::run(limiter, clock, trace.as_bytes(), &mut out)
        .await
        .unwrap();
    String::from_utf8(out).unwrap()
}

async fn simulate_memory(trace: &str) -> String {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limits = conformance_limits();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    simulate_with(&limiter, &clock, trace).await
}

async fn simulate_redis(url: &str, trace: &str, cache: bool) -> String {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limits = conformance_limits();
    let backend = caller_time_backend(url, &unique_prefix("conf"), &clock, cache).await;
    let limiter = Limiter::new(limits, backend);
    simulate_with(&limiter, &clock, trace).await
}

fn traces() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces");
    let mut traces: Vec<(String, String)> = [
        "gcra-worked-examples",
        "burst-tiers-v1-v8",
        "partial-grants",
        "concurrency",
    ]
    .iter()
    .map(|name| {
        let text = std::fs::read_to_string(dir.join(format!("{name}.trace"))).unwrap();
        ((*name).to_owned(), text)
    })
    .collect();
    for seed in 0..6 {
        traces.push((format!("random seed {seed}"), random_trace(seed, 250)));
    }
    traces
}

async fn conformance(url: &str) {
    for (name, trace) in traces() {
        let memory = simulate_memory(&trace).await;
        assert!(
            memory.contains(r#""allowed":false"#),
            "{name}: the trace never denies"
        );
        for cache in [true, false] {
            let redis = simulate_redis(url, &trace, cache).await;
            if cache {
                same_decisions_but_skipped(&name, &trace, &memory, &redis);
                continue;
            }
            if redis != memory {
                let (line, (m, r)) = memory
                    .lines()
                    .zip(redis.lines())
                    .enumerate()
                    .find(|(_, (m, r))| m != r)
                    .unwrap();
                panic!(
                    "{name} (deny cache {cache}): line {} differs\n trace: {}\nmemory: {m}\n redis: {r}",
                    line + 1,
                    trace.lines().nth(line).unwrap_or("")
                );
            }
        }
    }
}

/// `with_cache` (simulator output through the deny cache) against `exact` (memory, or Redis
/// without the cache), line by line: the same batch verdict on every line; every evaluated
/// decision identical; a decision is skipped only on a denied line, with zero numbers; and a
/// line with skipped decisions never reports a longer `retry_after` than the exact one (the
/// remembered denial is one of the exact line's denials, and the exact line reports the
/// longest). Lines without skips are byte-identical.
fn same_decisions_but_skipped(name: &str, trace: &str, exact: &str, with_cache: &str) {
    assert_eq!(exact.lines().count(), with_cache.lines().count(), "{name}");
    for (n, (e, c)) in exact.lines().zip(with_cache.lines()).enumerate() {
        let context = || {
            format!(
                "{name}, line {}: {}\nexact: {e}\ncache: {c}",
                n + 1,
                trace.lines().nth(n).unwrap_or("")
            )
        };
        if !c.contains(r#""skipped":true"#) {
            assert_eq!(e, c, "{}", context());
            continue;
        }
        let e: serde_json::Value = serde_json::from_str(e).unwrap();
        let c: serde_json::Value = serde_json::from_str(c).unwrap();
        assert_eq!(c["allowed"], false, "{}", context());
        assert_eq!(e["allowed"], false, "{}", context());
        assert!(
            c["retry_after_us"].as_u64().unwrap() <= e["retry_after_us"].as_u64().unwrap(),
            "{}",
            context()
        );
        let (ed, cd) = (
            e["decisions"].as_array().unwrap(),
            c["decisions"].as_array().unwrap(),
        );
        assert_eq!(ed.len(), cd.len(), "{}", context());
        for (ed, cd) in ed.iter().zip(cd) {
            if cd["skipped"] == true {
                assert_eq!(cd["allowed"], false, "{}", context());
                assert_eq!(cd["remaining"], 0, "{}", context());
                assert_eq!(cd["retry_after_us"], 0, "{}", context());
            } else {
                assert_eq!(ed, cd, "{}", context());
            }
        }
    }
}

#[tokio::test]
async fn single_redis_decides_exactly_like_memory() {
    let redis = TestRedis::single();
    conformance(&redis.url).await;
}

#[tokio::test]
async fn redis_cluster_decides_exactly_like_memory_including_cross_slot_batches() {
    let redis = TestRedis::cluster();
    conformance(&redis.url).await;
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
async fn waiting_callers_pass_at_the_limits_rate_on_single_redis() {
    let redis = TestRedis::single();
    waiting_callers_pass_at_the_limits_rate(&redis.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_callers_pass_at_the_limits_rate_on_the_cluster() {
    let redis = TestRedis::cluster();
    waiting_callers_pass_at_the_limits_rate(&redis.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_128_tasks_admit_exactly_the_burst_on_single_redis() {
    let redis = TestRedis::single();
    no_over_admission(&redis.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_128_tasks_admit_exactly_the_burst_on_the_cluster() {
    let redis = TestRedis::cluster();
    no_over_admission(&redis.url).await;
}

// ---------------------------------------------------------------------------------------------
// Keys, expiry, round trips.
// ---------------------------------------------------------------------------------------------

const KEY_LIMITS: &str = "\
Api:
  burst: 2
  count: 2
  period: 1s
Blip:
  burst: 1
  count: 1
  period: 30ms
PerIp:
  kind: ip
  burst: 10
  count: 10
  period: 1s
PerAccount:
  kind: account
  burst: 10
  count: 10
  period: 1s
Wide:
  burst: 10
  count: 10
  period: 1s
";

async fn raw_get(backend: &RedisBackend, key: &str) -> Option<String> {
    backend
        .client_for_key(key)
        .unwrap()
        .get::<Option<String>, _>(key)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_key_expires_exactly_when_its_bucket_is_full_again() {
    let redis = TestRedis::single();
    let backend = backend(&redis.url, &unique_prefix("expiry")).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let key = limiter.parse_key("Api", "client-1").unwrap();
    let d = limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap();
    assert!(d.allowed());
    let redis_key = backend.redis_key(&key);
    let tat: u64 = raw_get(&backend, &redis_key)
        .await
        .unwrap()
        .parse()
        .unwrap();
    let expire_ms: i64 = backend
        .client()
        .custom(fred::cmd!("PEXPIRETIME"), vec![redis_key.clone()])
        .await
        .unwrap();
    assert_eq!(
        expire_ms as u64,
        tat.div_ceil(1000),
        "PXAT is the TAT, rounded up to a ms"
    );

    // A refund back to full deletes the key at once.
    limiter
        .refund(&[Transaction::new(key.clone())])
        .await
        .unwrap();
    assert_eq!(raw_get(&backend, &redis_key).await, None);

    // And an idle key goes away by itself (30 ms bucket): wait for Redis to drop it.
    let blip = limiter.parse_key("Blip", "client-1").unwrap();
    limiter
        .spend(&[Transaction::new(blip.clone())])
        .await
        .unwrap();
    let blip_key = backend.redis_key(&blip);
    assert!(raw_get(&backend, &blip_key).await.is_some());
    let deadline = Instant::now() + Duration::from_secs(10);
    while raw_get(&backend, &blip_key).await.is_some() {
        assert!(Instant::now() < deadline, "the idle key was never dropped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_three_rule_request_is_one_round_trip_on_a_single_node() {
    let mut server = RedisServer::start();
    let backend = backend(&server.url(), "rl:").await;
    let limiter = Limiter::new(Limits::from_yaml_str(KEY_LIMITS, None).unwrap(), backend);
    let batch = [
        Transaction::new(limiter.parse_key("Wide", "acct-9").unwrap()),
        Transaction::new(limiter.parse_key("PerIp", "10.0.0.1").unwrap()),
        Transaction::new(limiter.parse_key("PerAccount", "9").unwrap()),
    ];
    let calls = |port| commandstat(port, "evalsha") + commandstat(port, "eval");
    // The first call may meet NOSCRIPT only if the script was flushed; it was just loaded.
    let before = calls(server.port);
    for _ in 0..5 {
        assert!(limiter.spend(&batch).await.unwrap().allowed());
    }
    assert_eq!(
        calls(server.port) - before,
        5,
        "one script call per 3-rule request"
    );
    server.kill();
}

#[tokio::test]
async fn hostile_ids_keep_their_slot_and_never_collide() {
    let redis = TestRedis::cluster();
    let prefix = unique_prefix("hostile");
    let backend = backend(&redis.url, &prefix).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let long = "é".repeat(128);
    let hostile = [
        "a}b",
        "a%7Db",
        "{x}",
        "%7Bx%7D",
        "}{",
        "a b",
        "a%20b",
        "ümlaut",
        "%C3%BCmlaut",
        "x}:1",
        "a\u{a0}b",
        long.as_str(),
    ];
    let mut keys = std::collections::HashSet::new();
    for id in hostile {
        let key = limiter.parse_key("Api", id).unwrap();
        let redis_key = backend.redis_key(&key);
        assert!(redis_key.is_ascii(), "{redis_key}");
        assert!(
            keys.insert(redis_key.clone()),
            "{id:?} collides: {redis_key}"
        );
        // The hash tag is exactly `{<name>:<escaped id>}`: one `{`, one `}`, at the end.
        let tag = &redis_key[prefix.len()..];
        assert!(tag.starts_with('{') && tag.ends_with('}'), "{redis_key}");
        assert_eq!(tag.matches('{').count(), 1, "{redis_key}");
        assert_eq!(tag.matches('}').count(), 1, "{redis_key}");
        // Each id has its own bucket: 2 allowed, the third denied, on the cluster.
        for expected in [true, true, false] {
            let d = limiter
                .spend(&[Transaction::new(key.clone())])
                .await
                .unwrap();
            assert_eq!(d.allowed(), expected, "{id:?}");
        }
        assert!(raw_get(&backend, &redis_key).await.is_some());
    }
}

// ---------------------------------------------------------------------------------------------
// Bad state at a key.
// ---------------------------------------------------------------------------------------------

/// Issue 13, "must define": another program's data at a bucket key (another type, text, a
/// negative or fractional number, a TAT out of range) used to be an error on every request:
/// the id was unlimited forever under fail open, blocked forever under fail closed. It is now a
/// fresh bucket: decided as one, and replaced by the first spend that writes; a check writes
/// nothing and leaves it.
#[tokio::test]
async fn foreign_data_at_a_key_is_a_fresh_bucket_replaced_by_the_first_write() {
    let redis = TestRedis::single();
    let backend = backend(&redis.url, &unique_prefix("foreign")).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let cases: [(&str, Option<&str>); 6] = [
        ("list", None),
        ("text", Some("not a number")),
        ("negative", Some("-5")),
        ("float", Some("1.5e3")),
        ("huge", Some("99999999999999999999")),
        ("out-of-range", Some("9000000000000000")),
    ];
    for (id, value) in cases {
        let bad = limiter.parse_key("Api", id).unwrap();
        let bad_key = backend.redis_key(&bad);
        match value {
            None => {
                let _: i64 = backend
                    .client()
                    .custom(
                        fred::cmd!("LPUSH"),
                        vec![bad_key.clone(), "someone else's".into()],
                    )
                    .await
                    .unwrap();
            }
            Some(v) => {
                let _: () = backend
                    .client()
                    .set(&bad_key, v, None, None, false)
                    .await
                    .unwrap();
            }
        }
        // A check sees a fresh bucket (Api: burst 2) and writes nothing.
        let d = limiter
            .check(&[Transaction::new(bad.clone())])
            .await
            .unwrap();
        assert!(d.allowed(), "{id}");
        assert_eq!(d.decisions()[0].remaining, 1, "{id}");
        if let Some(v) = value {
            assert_eq!(
                raw_get(&backend, &bad_key).await.as_deref(),
                Some(v),
                "{id}"
            );
        }
        // A spend decides as on a fresh bucket and replaces the value with its TAT; from then
        // on the id is limited as any other.
        assert!(
            limiter
                .spend(&[Transaction::new(bad.clone())])
                .await
                .unwrap()
                .allowed()
        );
        let stored = raw_get(&backend, &bad_key).await.unwrap();
        assert!(stored.parse::<u64>().is_ok(), "{id}: {stored}");
        assert!(
            limiter
                .spend(&[Transaction::new(bad.clone())])
                .await
                .unwrap()
                .allowed()
        );
        assert!(
            !limiter
                .spend(&[Transaction::new(bad.clone())])
                .await
                .unwrap()
                .allowed(),
            "{id}"
        );
    }
}

#[tokio::test]
async fn setup_errors_are_typed() {
    let err = RedisBackend::from_url("http://127.0.0.1:1")
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisSetupError::InvalidUrl(_)), "{err:?}");
    let err = RedisBackend::from_url("redis://127.0.0.1:6379")
        .prefix("a{b")
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(err, RedisSetupError::InvalidPrefix { .. }),
        "{err:?}"
    );
    // Nothing listens on a port that was just free.
    let port = support::redis::free_port();
    let err = RedisBackend::from_url(format!("redis://127.0.0.1:{port}"))
        .command_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisSetupError::Connect(_)), "{err:?}");
}

// ---------------------------------------------------------------------------------------------
// The local deny cache.
// ---------------------------------------------------------------------------------------------

fn commandstat(port: u16, name: &str) -> u64 {
    let stats = command(port, "INFO commandstats").unwrap();
    stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
        .and_then(|l| l.split("calls=").nth(1))
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

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
            d.strictest().unwrap().retry_after,
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

/// Issue 13, item 4: the deny cache is bounded with O(1) eviction. Before, a full cache scanned
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

/// Issue 13, item 4: one remembered denial of a counting transaction denies the batch. Before,
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
        assert!(ip.skipped && !ip.allowed && ip.granted == 0, "{ip:?}");
        assert!(!range.skipped && !range.allowed);
        assert_eq!(d.strictest().unwrap().name, range.name);
        assert_eq!(
            d.strictest().unwrap().retry_after,
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

// ---------------------------------------------------------------------------------------------
// Faults.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn script_flush_is_survived() {
    let server = RedisServer::start();
    let backend = backend(&server.url(), "rl:").await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let tx = [Transaction::new(
        limiter.parse_key("PerAccount", "5").unwrap(),
    )];
    assert!(limiter.spend(&tx).await.unwrap().allowed());
    assert!(
        command(server.port, "SCRIPT FLUSH")
            .unwrap()
            .starts_with("+OK")
    );
    let d = limiter.spend(&tx).await.unwrap();
    assert!(d.allowed());
    assert_eq!(d.strictest().unwrap().remaining, 8);
    // The script is cached again: the next call is a plain EVALSHA.
    let evals = commandstat(server.port, "eval");
    assert!(limiter.spend(&tx).await.unwrap().allowed());
    assert_eq!(commandstat(server.port, "eval"), evals);
}

/// Spends `tx` until the backend answers (it reconnects in the background), calling `before`
/// ahead of each try; panics with `what` after 30 s.
async fn until_answered(
    limiter: &Limiter,
    tx: &[Transaction],
    before: impl Fn(),
    what: &str,
) -> tower_ratelimits::BatchDecision {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        before();
        match limiter.spend(tx).await {
            Ok(d) => return d,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[tokio::test]
async fn a_dead_redis_gives_errors_within_the_timeout_and_a_restarted_one_is_used_again() {
    let mut server = RedisServer::start();
    let port = server.port;
    let timeout = Duration::from_millis(300);
    let backend = RedisBackend::from_url(server.url())
        .command_timeout(timeout)
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(Limits::from_yaml_str(KEY_LIMITS, None).unwrap(), backend);
    let tx = [Transaction::new(
        limiter.parse_key("PerAccount", "7").unwrap(),
    )];
    assert!(limiter.spend(&tx).await.unwrap().allowed());

    server.kill();
    for _ in 0..5 {
        let started = Instant::now();
        let err = limiter.spend(&tx).await.unwrap_err();
        let elapsed = started.elapsed();
        assert!(
            matches!(
                err,
                LimiterError::Backend(BackendError::Timeout(_) | BackendError::Unavailable(_))
            ),
            "{err:?}"
        );
        assert!(
            elapsed < timeout + Duration::from_secs(1),
            "took {elapsed:?}"
        );
    }

    let _server = RedisServer::start_on(port, &[]);
    let d = until_answered(&limiter, &tx, || {}, "the backend did not recover").await;
    assert!(d.allowed());
}

/// Issue 13, item 6: while Redis is down, every request used to wait the full command timeout
/// before the failure policy applied. After `failures` consecutive failures the circuit opens:
/// requests get `CircuitOpen` at once, without trying, until the cool-off ends; then one
/// request probes, and its success closes the circuit.
#[tokio::test]
async fn a_dead_redis_opens_the_circuit_and_a_successful_probe_closes_it() {
    let mut server = RedisServer::start();
    let port = server.port;
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = RedisBackend::from_url(server.url())
        .caller_time(clock.clone())
        .command_timeout(Duration::from_millis(300))
        .circuit_breaker(2, Duration::from_secs(3600))
        .deny_cache(false)
        .connect()
        .await
        .unwrap();
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let tx = [Transaction::new(
        limiter.parse_key("PerAccount", "7").unwrap(),
    )];
    assert!(limiter.spend(&tx).await.unwrap().allowed());
    server.kill();
    for _ in 0..2 {
        let err = limiter.spend(&tx).await.unwrap_err();
        assert!(
            matches!(
                err,
                LimiterError::Backend(BackendError::Timeout(_) | BackendError::Unavailable(_))
            ),
            "{err:?}"
        );
    }
    assert!(backend.circuit_open());
    // Open: answered at once, without trying (the cool-off is on the manual clock).
    for _ in 0..100 {
        let err = limiter.spend(&tx).await.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::CircuitOpen { retry_in }) if retry_in == Duration::from_secs(3600)),
            "{err:?}"
        );
    }
    assert_eq!(backend.circuit_opened_count(), 1);
    // Redis is back, but nothing tries it before the cool-off ends.
    let _server = RedisServer::start_on(port, &[]);
    assert!(matches!(
        limiter.spend(&tx).await.unwrap_err(),
        LimiterError::Backend(BackendError::CircuitOpen { .. })
    ));
    // After the cool-off, a probe (the client reconnects in the background; a failed probe
    // opens the circuit for another cool-off, so the clock moves past it each time).
    let d = until_answered(
        &limiter,
        &tx,
        || clock.advance(Duration::from_secs(3601)),
        "the circuit did not close",
    )
    .await;
    assert!(d.allowed());
    assert!(!backend.circuit_open());
}

/// Issue 13, item 6: an app could not even start without Redis. A lazy backend connects in
/// the background: built while nothing listens, it fails requests (fast once the circuit
/// opens) and uses Redis as soon as it is up, loading the script on first use.
#[tokio::test]
async fn a_lazy_backend_starts_without_redis_and_uses_it_once_it_is_up() {
    let port = support::redis::free_port();
    let backend = RedisBackend::from_url(format!("redis://127.0.0.1:{port}"))
        .command_timeout(Duration::from_millis(200))
        .lazy(true)
        .connect()
        .await
        .expect("a lazy backend is built without a server");
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let tx = [Transaction::new(
        limiter.parse_key("PerAccount", "7").unwrap(),
    )];
    assert!(limiter.spend(&tx).await.is_err());
    let _server = RedisServer::start_on(port, &[]);
    let d = until_answered(&limiter, &tx, || {}, "the lazy backend never connected").await;
    assert!(d.allowed());
    // A cluster's topology is read when connecting: lazy is refused for it, clearly.
    let err = RedisBackend::from_url(format!("redis-cluster://127.0.0.1:{port}"))
        .lazy(true)
        .connect()
        .await
        .unwrap_err();
    assert!(matches!(err, RedisSetupError::InvalidUrl(_)), "{err}");
}

#[tokio::test]
async fn a_dead_cluster_node_fails_only_its_own_slots() {
    let mut cluster = RedisCluster::start();
    let timeout = Duration::from_millis(300);
    let backend = RedisBackend::from_url(cluster.url())
        .command_timeout(timeout)
        .connect()
        .await
        .unwrap();
    assert!(backend.is_clustered());
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    // One key on node 0, one elsewhere.
    let mut on_node = [None, None];
    for i in 0..1000 {
        let key = limiter.parse_key("PerAccount", &i.to_string()).unwrap();
        let slot = fred::util::redis_keyslot(backend.redis_key(&key).as_bytes());
        let which = usize::from(cluster.node_of_slot(slot) != 0);
        on_node[which].get_or_insert(key);
        if on_node.iter().all(Option::is_some) {
            break;
        }
    }
    let [Some(dead_key), Some(live_key)] = on_node else {
        panic!("no keys found on both sides")
    };
    for key in [&dead_key, &live_key] {
        assert!(
            limiter
                .spend(&[Transaction::new(key.clone())])
                .await
                .unwrap()
                .allowed()
        );
    }
    cluster.nodes[0].kill();
    for _ in 0..5 {
        let started = Instant::now();
        let err = limiter
            .spend(&[Transaction::new(dead_key.clone())])
            .await
            .unwrap_err();
        assert!(matches!(err, LimiterError::Backend(_)), "{err:?}");
        assert!(
            started.elapsed() < timeout + Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
    // Five failures in a row opened the dead master's circuit (and only its own: one breaker
    // per master).
    let err = limiter
        .spend(&[Transaction::new(dead_key.clone())])
        .await
        .unwrap_err();
    assert!(
        matches!(err, LimiterError::Backend(BackendError::CircuitOpen { .. })),
        "{err:?}"
    );
    // The other nodes keep deciding (allow some time for the client to settle its view), and
    // never answer from the dead master's circuit.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut successes = 0;
    while successes < 5 {
        match limiter.spend(&[Transaction::new(live_key.clone())]).await {
            Ok(d) => {
                assert!(d.allowed());
                successes += 1;
            }
            Err(e) => {
                assert!(
                    !matches!(e, LimiterError::Backend(BackendError::CircuitOpen { .. })),
                    "a live master answered from a circuit: {e}"
                );
                assert!(
                    Instant::now() < deadline,
                    "the live node stopped answering: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Batches across slots on the cluster.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_cross_slot_batch_denied_in_one_slot_spends_nothing_in_the_others() {
    let redis = TestRedis::cluster();
    let backend = backend(&redis.url, &unique_prefix("xslot")).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let api = limiter.parse_key("Api", "42").unwrap();
    let acct = limiter.parse_key("PerAccount", "42").unwrap();
    let slot = |k| fred::util::redis_keyslot(backend.redis_key(k).as_bytes());
    assert_ne!(slot(&api), slot(&acct));
    // Exhaust Api (burst 2) alone.
    for _ in 0..2 {
        assert!(
            limiter
                .spend(&[Transaction::new(api.clone())])
                .await
                .unwrap()
                .allowed()
        );
    }
    let acct_key = backend.redis_key(&acct);
    for _ in 0..5 {
        let d = limiter
            .spend(&[
                Transaction::new(acct.clone()),
                Transaction::new(api.clone()),
            ])
            .await
            .unwrap();
        assert!(!d.allowed());
        // PerAccount was spent by its own slot's script and refunded: nothing remains.
        assert_eq!(raw_get(&backend, &acct_key).await, None);
    }
    let d = limiter
        .spend(&[Transaction::new(acct.clone()).mode(Mode::CheckOnly)])
        .await
        .unwrap();
    assert_eq!(d.strictest().unwrap().remaining, 9);
    // Resets go to every slot.
    limiter.reset(&[api.clone(), acct.clone()]).await.unwrap();
    assert!(
        limiter
            .spend(&[Transaction::new(api), Transaction::new(acct)])
            .await
            .unwrap()
            .allowed()
    );
}

#[tokio::test]
async fn spend_and_refund_through_the_backend_trait() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(&redis.url, &unique_prefix("trait"), &clock, false).await;
    let limits = Limits::from_yaml_str(KEY_LIMITS, None).unwrap();
    let key = BucketKey::new(limits.name("Api").unwrap(), Id::new("t").unwrap());
    let limit = limits.default_limit(key.name()).unwrap();
    let tx = |cost| BucketTx::new(&key, limit, cost..=cost, Mode::CheckAndSpend);
    // A cost above the burst never reaches a backend: the transaction cannot be built.
    assert_eq!(
        tx(3).unwrap_err(),
        TransactionError::CostAboveBurst { cost: 3, burst: 2 }
    );
    let ok = backend.spend(&[tx(2).unwrap()]).outcomes().await.unwrap();
    assert!(ok[0].allowed);
    assert_eq!(ok[0].remaining, 0);
    let refund = BucketTx::for_refund(&key, limit, 1..=1, Mode::CheckAndSpend).unwrap();
    let r = backend.refund(&[refund]).await.unwrap();
    assert!(r[0].allowed);
    assert_eq!(r[0].remaining, 1);
    let v: Value = backend.client().get(backend.redis_key(&key)).await.unwrap();
    assert_eq!(
        v.as_string().unwrap().parse::<u64>().unwrap(),
        simulate::EPOCH_US + 500_000
    );
}

// ---------------------------------------------------------------------------------------------
// The script's two paths: an all-GCRA spend takes a fast path; a batch with a tiered key the
// general one. Both call the script's one `gcra` function; these tests hold them together.
// ---------------------------------------------------------------------------------------------

const PATH_LIMITS: &str = "\
G: {burst: 3, count: 3, period: 1s}
H: {burst: 5, count: 2, period: 1s}
T:
  tiers:
    - {limit: 2, window: 1s, active: 1s, cooldown: 0s}
";

/// A limiter over its own prefix, on `clock`, with the deny cache off (every batch runs the
/// script).
async fn path_limiter(url: &str, name: &str, clock: &ManualClock) -> (Limiter, RedisBackend) {
    let backend = caller_time_backend(url, &unique_prefix(name), clock, false).await;
    let limits = Limits::from_yaml_str(PATH_LIMITS, None).unwrap();
    (Limiter::new(limits, backend.clone()), backend)
}

#[tokio::test]
async fn the_scripts_fast_path_decides_gcra_exactly_as_its_general_path() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let (fast, fast_backend) = path_limiter(&redis.url, "fast", &clock).await;
    let (general, general_backend) = path_limiter(&redis.url, "general", &clock).await;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for step in 0..400 {
        clock.advance(Duration::from_micros(next(400_000)));
        let modes = [Mode::CheckAndSpend, Mode::CheckOnly, Mode::SpendOnly];
        let gcra = |l: &Limiter, name: &str, id: &str, cost: u64, mode: Mode| {
            Transaction::new(l.key(name, Id::new(id).unwrap()).unwrap())
                .cost(cost)
                .mode(mode)
        };
        let (g_cost, h_cost) = (next(4), next(6));
        let (g_mode, h_mode) = (modes[next(3) as usize], modes[next(3) as usize]);
        let id = ["a", "b"][next(2) as usize];
        let refund = next(5) == 0;
        let batch = |l: &Limiter| {
            vec![
                gcra(l, "G", id, g_cost, g_mode),
                gcra(l, "H", "h", h_cost, h_mode),
            ]
        };
        let (f, g) = if refund {
            (
                fast.refund(&batch(&fast)).await,
                general
                    .refund(&{
                        let mut b = batch(&general);
                        b.push(gcra(&general, "T", "t", 1, Mode::CheckAndSpend));
                        b
                    })
                    .await,
            )
        } else {
            // A spend-only tiered key never changes the batch decision: the GCRA keys decide.
            let mut b = batch(&general);
            b.push(gcra(&general, "T", "t", 1, Mode::SpendOnly));
            (fast.spend(&batch(&fast)).await, general.spend(&b).await)
        };
        let (f, g) = (f.unwrap(), g.unwrap());
        for (df, dg) in f.decisions().iter().zip(g.decisions()) {
            assert_eq!(
                (df.allowed, df.remaining, df.retry_after, df.reset_after),
                (dg.allowed, dg.remaining, dg.retry_after, dg.reset_after),
                "step {step}: {}",
                df.key
            );
        }
        if !refund {
            assert_eq!(f.allowed(), g.allowed(), "step {step}");
        }
        for (name, id) in [("G", id), ("H", "h")] {
            let stored = |l: &Limiter, b: &RedisBackend| {
                b.redis_key(&l.key(name, Id::new(id).unwrap()).unwrap())
            };
            assert_eq!(
                raw_get(&fast_backend, &stored(&fast, &fast_backend)).await,
                raw_get(&general_backend, &stored(&general, &general_backend)).await,
                "step {step}: stored TAT of {name}={id}"
            );
        }
    }
}

#[tokio::test]
async fn both_paths_take_a_stored_tat_below_2_pow_52_and_replace_one_at_it() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let (limiter, backend) = path_limiter(&redis.url, "edges", &clock).await;
    let g = limiter.key("G", Id::new("edge").unwrap()).unwrap();
    let t = limiter.key("T", Id::new("edge").unwrap()).unwrap();
    let key = backend.redis_key(&g);
    let set = |v: u64| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            let _: () = backend
                .client_for_key(&key)
                .unwrap()
                .set(&key, v.to_string(), None, None, false)
                .await
                .unwrap();
        }
    };
    let fast = || vec![Transaction::new(g.clone())];
    let general = || {
        vec![
            Transaction::new(g.clone()),
            Transaction::new(t.clone()).mode(Mode::SpendOnly),
        ]
    };
    for batch in [fast(), general()] {
        // 2^52 - 1: a TAT far ahead, still exact in a double: a plain denial.
        set((1 << 52) - 1).await;
        let d = limiter.spend(&batch).await.unwrap();
        assert!(!d.decisions()[0].allowed);
        assert_eq!(
            d.decisions()[0].reset_after,
            Duration::from_micros((1 << 52) - 1 - simulate::EPOCH_US)
        );
        // 2^52: not a TAT of ours: a fresh bucket (G: burst 3), replaced by the spend.
        set(1 << 52).await;
        let d = limiter.spend(&batch).await.unwrap();
        assert!(d.decisions()[0].allowed);
        assert_eq!(d.decisions()[0].remaining, 2);
        let stored: u64 = raw_get(&backend, &key).await.unwrap().parse().unwrap();
        assert!(stored < 1 << 52);
    }
    // A caller clock at 2^52 is refused before anything is sent.
    let late = ManualClock::new(1 << 52);
    let late_backend = caller_time_backend(&redis.url, &unique_prefix("late"), &late, false).await;
    let late_limiter = Limiter::new(
        Limits::from_yaml_str(PATH_LIMITS, None).unwrap(),
        late_backend,
    );
    let err = late_limiter
        .spend(&[Transaction::new(
            late_limiter.key("G", Id::new("x").unwrap()).unwrap(),
        )])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LimiterError::Backend(BackendError::Gcra(GcraError::TimeOverflow))
        ),
        "{err:?}"
    );
}

/// The script passes numbers to `SET` as they are (no `string.format`): a TAT just below 2^52
/// with every digit significant is stored exactly, on the lean path and the general one.
#[tokio::test]
async fn a_tat_near_2_pow_52_is_stored_to_the_microsecond_on_both_paths() {
    let redis = TestRedis::single();
    let start = (1u64 << 52) - 2_000_001;
    let clock = ManualClock::new(start);
    let (limiter, backend) = path_limiter(&redis.url, "exact", &clock).await;
    let t = limiter.key("T", Id::new("x").unwrap()).unwrap();
    for (n, id) in ["lean", "general"].into_iter().enumerate() {
        let g = limiter.key("G", Id::new(id).unwrap()).unwrap();
        let mut batch = vec![Transaction::new(g.clone())];
        if n == 1 {
            batch.push(Transaction::new(t.clone()).mode(Mode::SpendOnly));
        }
        assert!(limiter.spend(&batch).await.unwrap().allowed());
        // G: 3 per second, an emission interval of 333,334 us.
        assert_eq!(
            raw_get(&backend, &backend.redis_key(&g)).await,
            Some((start + 333_334).to_string()),
            "{id}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Through the middleware and the tools.
// ---------------------------------------------------------------------------------------------

mod through_http {
    use super::*;
    use axum::{Router, routing::get};
    use support::http::{HttpClient, serve};
    use tower_ratelimits::{ClientIp, FailurePolicy, LayerError, RateLimitLayer, Rule};

    const LIMITS: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 7
  count: 7
  period: 1h
";

    async fn app(url: &str, prefix: &str, policy: FailurePolicy, timeout: Duration) -> Router {
        let backend = RedisBackend::from_url(url)
            .prefix(prefix)
            .command_timeout(timeout)
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
            .on_backend_failure(policy)
            .build()
            .unwrap();
        Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer)
    }

    #[tokio::test]
    async fn two_app_instances_on_one_redis_share_one_limit() {
        let redis = TestRedis::single();
        let prefix = unique_prefix("shared");
        let timeout = Duration::from_secs(2);
        let a = serve(app(&redis.url, &prefix, FailurePolicy::FailOpen, timeout).await).await;
        let b = serve(app(&redis.url, &prefix, FailurePolicy::FailOpen, timeout).await).await;
        let (ca, cb) = (HttpClient::new(&a), HttpClient::new(&b));
        let mut ok = 0;
        let mut limited = 0;
        for i in 0..20 {
            let reply = if i % 2 == 0 {
                ca.get("/", &[]).await
            } else {
                cb.get("/", &[]).await
            };
            match reply.status {
                200 => ok += 1,
                429 => {
                    limited += 1;
                    assert!(reply.header("retry-after").is_some());
                }
                s => panic!("unexpected status {s}"),
            }
        }
        assert_eq!(
            (ok, limited),
            (7, 13),
            "7 requests in all, whichever instance serves them"
        );
    }

    #[tokio::test]
    async fn a_dead_redis_follows_the_failure_policy_within_the_timeout() {
        let mut server = RedisServer::start();
        let timeout = Duration::from_millis(300);
        let closed =
            serve(app(&server.url(), "rl:", FailurePolicy::FailClosed, timeout).await).await;
        let open = serve(app(&server.url(), "rl:", FailurePolicy::FailOpen, timeout).await).await;
        let (cc, co) = (HttpClient::new(&closed), HttpClient::new(&open));
        assert_eq!(cc.get("/", &[]).await.status, 200);
        assert_eq!(co.get("/", &[]).await.status, 200);
        server.kill();
        for _ in 0..3 {
            let started = Instant::now();
            assert_eq!(cc.get("/", &[]).await.status, 503);
            assert_eq!(co.get("/", &[]).await.status, 200);
            let elapsed = started.elapsed();
            assert!(
                elapsed < 2 * timeout + Duration::from_secs(1),
                "took {elapsed:?}"
            );
        }
    }

    /// Issue 13, item 6: the third failure policy. While Redis is down, each instance decides
    /// in memory at a share of every limit (burst 7 at 43% is 3): neither unlimited (fail
    /// open) nor refused (fail closed).
    #[tokio::test]
    async fn a_dead_redis_falls_back_to_memory_at_a_share_of_each_limit() {
        let mut server = RedisServer::start();
        let timeout = Duration::from_millis(300);
        let fallback = FailurePolicy::FallbackToMemory { percent: 43 };
        let server_app = serve(app(&server.url(), "rl:", fallback, timeout).await).await;
        let client = HttpClient::new(&server_app);
        assert_eq!(client.get("/", &[]).await.status, 200);
        server.kill();
        for _ in 0..3 {
            let r = client.get("/", &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
            // The fallback's own limit: burst 3, refilled over 3,589 s (7 per 8,372 s, 43% of
            // 7 per hour).
            assert_eq!(
                r.header("ratelimit-policy"),
                Some("\"RequestsPerIPAddress\";q=3;w=3589")
            );
        }
        let r = client.get("/", &[]).await;
        assert_eq!(r.status, 429, "{}", r.body);
        // An invalid share is refused when the layer is built.
        let limiter = Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            MemoryBackend::new(),
        );
        let err = RateLimitLayer::builder(limiter)
            .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
            .on_backend_failure(FailurePolicy::FallbackToMemory { percent: 0 })
            .build()
            .unwrap_err();
        assert!(matches!(err, LayerError::Fallback(_)), "{err}");
    }
}

mod simulator {
    use super::*;
    use std::process::Command;

    fn simulator() -> std::path::PathBuf {
        super::support::examples::example_binary("simulate")
    }

    fn run(extra: &[&str]) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(simulator())
            .args(extra)
            .arg("--defaults")
            .arg(root.join("examples/traces/gcra-20-per-second.yaml"))
            .arg(root.join("examples/traces/gcra-worked-examples.trace"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn the_command_line_prints_the_same_decisions_with_redis() {
        let memory = run(&[]);
        assert!(memory.lines().count() > 5);
        let single = TestRedis::single();
        assert_eq!(run(&["--redis", &single.url]), memory);
        let cluster = TestRedis::cluster();
        assert_eq!(run(&["--redis", &cluster.url]), memory);
    }

    #[test]
    fn an_unreachable_redis_is_exit_code_2() {
        let port = support::redis::free_port();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(simulator())
            .args(["--redis", &format!("redis://127.0.0.1:{port}")])
            .arg("--defaults")
            .arg(root.join("examples/traces/gcra-20-per-second.yaml"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--redis"));
        assert!(out.stdout.is_empty());
    }
}

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
    let backend = backend(&redis.url, &unique_prefix("tiers")).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(TIER_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let key = limiter.parse_key("Penalty", "acct").unwrap();
    let redis_key = backend.redis_tier_key(&key);
    let before_us = server_time_us(&backend, &redis_key).await;
    let d = limiter
        .spend(&[Transaction::new(key.clone()).cost(6)])
        .await
        .unwrap();
    let after_us = server_time_us(&backend, &redis_key).await;
    let d = &d.decisions()[0];
    assert!(d.allowed && d.tiers.unwrap().burst);
    let raw = raw_bytes(&backend, &redis_key).await.unwrap();
    // Expiry: the moment the state equals a fresh one (tier 2's cooldown end), on the server.
    let reset_us = d.reset_after.as_micros() as u64;
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
                    granted.fetch_add(d.decisions()[0].granted, Ordering::Relaxed);
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
async fn two_clients_and_128_tasks_grant_exactly_the_tiers_capacity_on_single_redis() {
    let redis = TestRedis::single();
    no_over_grant_of_tiers(&redis.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_and_128_tasks_grant_exactly_the_tiers_capacity_on_the_cluster() {
    let redis = TestRedis::cluster();
    no_over_grant_of_tiers(&redis.url).await;
}

/// The same for a tiered key: not MessagePack, MessagePack of the wrong shape, a negative
/// time, a hash: a fresh state, replaced by the first spend.
#[tokio::test]
async fn foreign_data_at_a_tiered_key_is_a_fresh_state_replaced_by_the_first_write() {
    let redis = TestRedis::single();
    let backend = backend(&redis.url, &unique_prefix("tier-foreign")).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(TIER_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let values: [&[u8]; 3] = [
        b"hello",
        &[0x93, 0x02, 0x00, 0x00],
        &[0x95, 0x01, 0xff, 0x01, 0x00, 0x00],
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
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        assert!(d.allowed(), "{value:?}");
        assert_ne!(raw_bytes(&backend, &redis_key).await.unwrap(), value);
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
        limiter
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

// ---------------------------------------------------------------------------------------------
// Coalescing (`RedisBackendBuilder::coalesce`, issue 16).

const SLOW_LIMITS: &str = "Slow: {burst: 10, count: 1, period: 1h}\n";

async fn coalescing_limiter(url: &str, prefix: &str, timeout: Duration) -> (Limiter, RedisBackend) {
    let backend = RedisBackend::from_url(url)
        .prefix(prefix)
        .command_timeout(timeout)
        .deny_cache(false)
        .coalesce(64)
        .coalesce_in_flight(1)
        .connect()
        .await
        .unwrap();
    let limits = Limits::from_yaml_str(SLOW_LIMITS, None).unwrap();
    (Limiter::new(limits, backend.clone()), backend)
}

fn slow(limiter: &Limiter, id: &str) -> Transaction {
    Transaction::new(limiter.key("Slow", Id::new(id).unwrap()).unwrap())
}

/// Many requests in flight at once share script calls, and each is decided as if it had been
/// sent alone, in order: 30 requests for one bucket of 10 admit exactly 10, with the remaining
/// counts 9 down to 0 once each (a later request in a call reads what an earlier one wrote);
/// 30 requests for 30 buckets are all allowed with 9 left; a two-key request whose second
/// bucket is empty is denied whole and spends nothing, while the requests beside it in the
/// same call are allowed. Without coalescing the same requests decide the same.
#[tokio::test]
async fn coalesced_requests_decide_as_if_sent_one_by_one() {
    let redis = TestRedis::single();
    let (l, backend) = coalescing_limiter(
        &redis.url,
        &unique_prefix("coalesce"),
        Duration::from_secs(5),
    )
    .await;
    for _ in 0..10 {
        assert!(l.spend(&[slow(&l, "full")]).await.unwrap().allowed());
    }
    let before = backend.coalesce_stats().unwrap();

    let same: Vec<[Transaction; 1]> = (0..30).map(|_| [slow(&l, "same")]).collect();
    let apart: Vec<[Transaction; 1]> = (0..30).map(|i| [slow(&l, &format!("k{i}"))]).collect();
    let blocked: Vec<[Transaction; 2]> = (0..10)
        .map(|i| [slow(&l, &format!("b{i}")), slow(&l, "full")])
        .collect();
    let (same, apart, blocked) = tokio::join!(
        futures_util::future::join_all(same.iter().map(|b| l.spend(b))),
        futures_util::future::join_all(apart.iter().map(|b| l.spend(b))),
        futures_util::future::join_all(blocked.iter().map(|b| l.spend(b))),
    );

    let mut remaining: Vec<u64> = same
        .iter()
        .map(|d| d.as_ref().unwrap())
        .filter(|d| d.allowed())
        .map(|d| d.decisions()[0].remaining)
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    for d in same
        .iter()
        .map(|d| d.as_ref().unwrap())
        .filter(|d| !d.allowed())
    {
        assert!(
            d.strictest().unwrap().retry_after > Duration::from_secs(3500),
            "{d:?}"
        );
    }
    for d in apart {
        let d = d.unwrap();
        assert!(d.allowed());
        assert_eq!(d.decisions()[0].remaining, 9);
    }
    for d in blocked {
        assert!(!d.unwrap().allowed());
    }
    // What was allowed was written; the denied requests spent nothing on their first bucket.
    for i in 0..30 {
        let d = l.check(&[slow(&l, &format!("k{i}"))]).await.unwrap();
        assert_eq!(
            d.decisions()[0].remaining,
            8,
            "k{i}: spent once, and one more fits"
        );
    }
    let d = l.check(&[slow(&l, "same")]).await.unwrap();
    assert!(!d.allowed());
    for i in 0..10 {
        let d = l.check(&[slow(&l, &format!("b{i}"))]).await.unwrap();
        assert_eq!(d.decisions()[0].remaining, 9, "b{i}");
    }

    // They did share calls: one found the call slot free, the 69 others queued behind it and
    // shared fewer calls.
    let after = backend.coalesce_stats().unwrap();
    let (calls, requests, direct) = (
        after.calls - before.calls,
        after.requests - before.requests,
        after.direct - before.direct,
    );
    assert_eq!((direct, requests), (1, 69));
    assert!(
        calls < requests / 2,
        "{calls} calls for {requests} requests"
    );

    // The same requests without coalescing decide the same (fresh buckets).
    let plain = Limiter::new(
        Limits::from_yaml_str(SLOW_LIMITS, None).unwrap(),
        backend_without_cache(&redis.url, &unique_prefix("coalesce-off")).await,
    );
    let mut plain_remaining = Vec::new();
    for _ in 0..30 {
        let d = plain.spend(&[slow(&plain, "same")]).await.unwrap();
        if d.allowed() {
            plain_remaining.push(d.decisions()[0].remaining);
        }
    }
    plain_remaining.sort_unstable();
    assert_eq!(plain_remaining, remaining);
}

async fn backend_without_cache(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .deny_cache(false)
        .connect()
        .await
        .unwrap()
}

/// Calls that coalescing cannot carry are made as without it: a check (not a spend) and a
/// spend-only transaction decide exactly, and coalescing counts none of them; a spend that
/// finds no call in flight makes its own.
#[tokio::test]
async fn what_coalescing_cannot_carry_is_called_directly() {
    let redis = TestRedis::single();
    let (l, backend) = coalescing_limiter(
        &redis.url,
        &unique_prefix("coalesce-direct"),
        Duration::from_secs(5),
    )
    .await;
    let before = backend.coalesce_stats().unwrap();
    let d = l.check(&[slow(&l, "c")]).await.unwrap();
    assert_eq!(d.decisions()[0].remaining, 9);
    let d = l
        .spend(&[slow(&l, "c").mode(Mode::SpendOnly)])
        .await
        .unwrap();
    assert_eq!(d.decisions()[0].remaining, 9);
    assert_eq!(backend.coalesce_stats().unwrap(), before);
    // A plain spend with no call in flight makes its own, as without coalescing.
    let d = l.spend(&[slow(&l, "c")]).await.unwrap();
    assert_eq!(d.decisions()[0].remaining, 8);
    let after = backend.coalesce_stats().unwrap();
    assert_eq!(
        (after.calls, after.requests, after.direct),
        (before.calls, before.requests, before.direct + 1)
    );
}

/// A paused server: every queued request fails with a timeout (the middleware's failure policy
/// applies), none waits forever behind the stuck call, and the limiter answers again after.
#[tokio::test]
async fn coalesced_requests_time_out_when_the_server_stops_answering() {
    let server = RedisServer::start();
    let (l, _) = coalescing_limiter(
        &server.url(),
        &unique_prefix("coalesce-pause"),
        Duration::from_millis(300),
    )
    .await;
    assert!(l.spend(&[slow(&l, "p")]).await.unwrap().allowed());
    assert!(
        command(server.port, "CLIENT PAUSE 2000 ALL")
            .unwrap()
            .starts_with("+OK")
    );
    let batches: Vec<[Transaction; 1]> = (0..20).map(|i| [slow(&l, &format!("p{i}"))]).collect();
    for r in futures_util::future::join_all(batches.iter().map(|b| l.spend(b))).await {
        let err = r.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::Timeout(_))),
            "{err:?}"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match l.spend(&[slow(&l, "after")]).await {
            Ok(d) => {
                assert!(d.allowed());
                break;
            }
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no recovery: {e}"),
        }
    }
}

/// A request cancelled while its call is in flight (a client that went away) gives the call
/// slot back: the next request still makes its own call instead of queueing behind a slot
/// nobody holds (it would time out).
#[tokio::test]
async fn a_cancelled_request_gives_its_call_slot_back() {
    use futures_util::FutureExt as _;
    let redis = TestRedis::single();
    let (l, backend) = coalescing_limiter(
        &redis.url,
        &unique_prefix("coalesce-cancel"),
        Duration::from_secs(2),
    )
    .await;
    for i in 0..3 {
        let batch = [slow(&l, &format!("gone{i}"))];
        assert!(l.spend(&batch).now_or_never().is_none(), "answered at once");
    }
    let before = backend.coalesce_stats().unwrap();
    let d = l.spend(&[slow(&l, "next")]).await.unwrap();
    assert!(d.allowed());
    let after = backend.coalesce_stats().unwrap();
    assert_eq!(after.direct, before.direct + 1);
}

// ---------------------------------------------------------------------------------------------
// Concurrency limits: leases in a sorted set per key, shared by every instance.
// ---------------------------------------------------------------------------------------------

const CONCURRENCY_LIMITS: &str = "\
Exports: {kind: account, concurrency: 3, lease: 1h, retry_after: 2s}
Brief: {kind: account, concurrency: 2, lease: 10s}
Rate: {kind: account, burst: 1, count: 1, period: 1h}
";

/// One app instance: its own limiter and connection to the store, a layer with `rules`, a
/// slow route held at `gate` and a quick one, served over TCP.
async fn concurrency_instance(
    url: &str,
    prefix: &str,
    rules: &[&str],
    gate: &support::gate::Gate,
) -> (support::http::Server, RedisBackend) {
    use axum::{Router, routing::get};
    use tower_ratelimits::{Header, RateLimitLayer, Rule};
    let backend = backend(url, prefix).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let mut layer = RateLimitLayer::builder(limiter);
    for name in rules {
        layer = layer.rule(Rule::new(*name, Header::new("x-account")));
    }
    let gate = gate.clone();
    let router = Router::new()
        .route(
            "/slow",
            get(move || {
                let gate = gate.clone();
                async move {
                    gate.pass().await;
                    "done"
                }
            }),
        )
        .route("/quick", get(|| async { "quick" }))
        .layer(layer.build().unwrap());
    (support::http::serve(router).await, backend)
}

async fn live_leases(backend: &RedisBackend, key: &str) -> i64 {
    use fred::interfaces::ClientLike;
    let zcard =
        fred::types::CustomCommand::new_static("ZCARD", fred::types::ClusterHash::FirstKey, false);
    backend
        .client_for_key(key)
        .unwrap()
        .custom::<i64, _>(zcard, vec![key])
        .await
        .unwrap()
}

/// Two app instances share one store: N + 1 slow requests of one key, spread over both,
/// admit exactly N; when they end the sorted set is empty and the key passes again. A batch
/// with a rate limit that denies takes no slot (on the cluster the two limits live in two
/// slots, and the slot taken is released by the compensation).
async fn concurrency_is_shared_by_instances(url: &str) {
    use support::http::HttpClient;
    let prefix = unique_prefix("conc");
    let gate = support::gate::Gate::new();
    let (a, backend) = concurrency_instance(url, &prefix, &["Exports"], &gate).await;
    let (b, _) = concurrency_instance(url, &prefix, &["Exports"], &gate).await;
    let clients = [Arc::new(HttpClient::new(&a)), Arc::new(HttpClient::new(&b))];
    let mut slow = Vec::new();
    for i in 0..3 {
        let client = clients[i % 2].clone();
        slow.push(tokio::spawn(async move {
            client.get("/slow", &[("x-account", "7")]).await.status
        }));
    }
    gate.entered(3).await;
    let name = Limits::from_yaml_str(CONCURRENCY_LIMITS, None)
        .unwrap()
        .name("Exports")
        .unwrap();
    let set_of = |id: u64| backend.redis_concurrency_key(&BucketKey::new(name, Id::from(id)));
    let set = set_of(7);
    assert_eq!(live_leases(&backend, &set).await, 3);
    for client in &clients {
        let refused = client.get("/quick", &[("x-account", "7")]).await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("retry-after"), Some("2"));
    }
    gate.open(3);
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
    until_no_leases(&backend, &set).await;
    assert_eq!(
        clients[1].get("/quick", &[("x-account", "7")]).await.status,
        200
    );

    // With a rate limit in the batch: the second request is denied by it, and holds no slot.
    let (c, _) = concurrency_instance(url, &prefix, &["Exports", "Rate"], &gate).await;
    let client = HttpClient::new(&c);
    assert_eq!(
        client.get("/quick", &[("x-account", "9")]).await.status,
        200
    );
    assert_eq!(
        client.get("/quick", &[("x-account", "9")]).await.status,
        429
    );
    until_no_leases(&backend, &set_of(9)).await;
}

/// Waits (bounded) until the sorted set `key` holds no lease: a slot is given back when the
/// server drops the response body, which may come just after the client saw its end.
async fn until_no_leases(backend: &RedisBackend, key: &str) {
    for _ in 0..1000 {
        if live_leases(backend, key).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(live_leases(backend, key).await, 0, "{key}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_shared_by_instances_on_single_redis() {
    let redis = TestRedis::single();
    concurrency_is_shared_by_instances(&redis.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_shared_by_instances_on_the_cluster() {
    let redis = TestRedis::cluster();
    concurrency_is_shared_by_instances(&redis.url).await;
}

/// An instance that dies holding slots (its leases never given back) blocks the key only
/// until the leases' deadlines, on the caller's clock; the key itself expires in the store.
async fn a_killed_instances_leases_expire(url: &str) {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let prefix = unique_prefix("killed");
    let limits = Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap();
    let doomed = Limiter::new(
        limits.clone(),
        caller_time_backend(url, &prefix, &clock, false).await,
    );
    let tx = [Transaction::new(doomed.parse_key("Brief", "7").unwrap())];
    for _ in 0..2 {
        assert!(doomed.spend(&tx).await.unwrap().allowed());
    }
    drop(doomed); // killed: nothing is given back
    let backend = caller_time_backend(url, &prefix, &clock, false).await;
    let survivor = Limiter::new(limits, backend.clone());
    assert!(!survivor.spend(&tx).await.unwrap().allowed());
    let set = backend.redis_concurrency_key(tx[0].key());
    let ttl: i64 = backend
        .client_for_key(&set)
        .unwrap()
        .pttl(&set)
        .await
        .unwrap();
    assert!(ttl > 0, "the set expires in the store ({ttl})");
    clock.advance(Duration::from_secs(10) - Duration::from_micros(1));
    assert!(!survivor.spend(&tx).await.unwrap().allowed());
    clock.advance(Duration::from_micros(1));
    let after = survivor.spend(&tx).await.unwrap();
    assert!(after.allowed());
    assert_eq!(after.decisions()[0].remaining, 1);
    assert_eq!(live_leases(&backend, &set).await, 1);
}

#[tokio::test]
async fn a_killed_instances_leases_expire_on_single_redis() {
    let redis = TestRedis::single();
    a_killed_instances_leases_expire(&redis.url).await;
}

#[tokio::test]
async fn a_killed_instances_leases_expire_on_the_cluster() {
    let redis = TestRedis::cluster();
    a_killed_instances_leases_expire(&redis.url).await;
}

/// Memory and Redis decide concurrency exactly alike: a pseudo-random sequence of spends
/// (alone, with a rate limit, probes, checks), releases of held leases and clock steps across
/// the lease time, on the same manual clock; every decision's numbers are compared.
async fn concurrency_conforms(url: &str) {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limits = Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap();
    let memory = Limiter::new(
        limits.clone(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let redis = Limiter::new(
        limits,
        caller_time_backend(url, &unique_prefix("conc-conf"), &clock, false).await,
    );
    let mut held: [Vec<tower_ratelimits::Lease>; 2] = [Vec::new(), Vec::new()];
    let (mut denied, mut released_held, mut expired) = (0, 0, 0);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for step in 0..300 {
        let account = next(2).to_string();
        let brief = Transaction::new(memory.parse_key("Brief", &account).unwrap());
        let rate = Transaction::new(memory.parse_key("Rate", &account).unwrap());
        let choice = next(10);
        if choice == 0 {
            clock.advance(Duration::from_millis(next(6000)));
            continue;
        }
        if choice <= 2 {
            if held[0].is_empty() {
                continue;
            }
            let i = next(held[0].len() as u64) as usize;
            let (m, r) = (held[0].remove(i), held[1].remove(i));
            let released = [
                memory.release(&[m]).await.unwrap(),
                redis.release(&[r]).await.unwrap(),
            ];
            assert_eq!(released[0], released[1], "step {step}: release");
            if released[0] == 1 {
                released_held += 1;
            } else {
                expired += 1;
            }
            continue;
        }
        let batch = match choice {
            3 => vec![brief.cost(0)],
            4 => vec![brief.mode(Mode::CheckOnly)],
            5 => vec![brief, rate],
            _ => vec![brief],
        };
        let decided = [
            memory.spend(&batch).await.unwrap(),
            redis.spend(&batch).await.unwrap(),
        ];
        let numbers = |d: &tower_ratelimits::BatchDecision| {
            d.decisions()
                .iter()
                .map(|d| {
                    (
                        d.allowed,
                        d.remaining,
                        d.retry_after,
                        d.granted,
                        d.lease_id.is_some(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            numbers(&decided[0]),
            numbers(&decided[1]),
            "step {step}: {batch:?}"
        );
        for (l, d) in decided.iter().enumerate() {
            held[l].extend(d.decisions().iter().filter_map(|d| d.lease()));
        }
        denied += usize::from(!decided[0].allowed());
    }
    // The sequence went through every case: denials, releases of live and of ended leases.
    assert!(
        denied > 10 && released_held > 10 && expired > 0,
        "{denied} {released_held} {expired}"
    );
}

#[tokio::test]
async fn concurrency_decides_as_memory_does_on_single_redis() {
    let redis = TestRedis::single();
    concurrency_conforms(&redis.url).await;
}

#[tokio::test]
async fn concurrency_decides_as_memory_does_on_the_cluster() {
    let redis = TestRedis::cluster();
    concurrency_conforms(&redis.url).await;
}
