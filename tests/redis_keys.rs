//! What the Redis backend stores: the key layout and its expiry, one round trip per request,
//! hostile ids, foreign data at a key, and the script's two paths deciding and storing alike.

mod support;

use std::time::{Duration, Instant};

use fred::prelude::{ClientLike as _, KeysInterface};
use support::redis::{RedisServer, TestRedis, unique_prefix};
use tower_ratelimits::{
    BackendError, Clock, GcraError, Id, Limiter, LimiterError, Limits, ManualClock, Mode,
    Transaction,
};

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../simulator/src/trace.rs"]
mod simulate;
use support::redis_backend::{
    KEY_LIMITS, backend, caller_time_backend, commandstat, limiter_on, raw_get,
};
use tower_ratelimits::{RedisBackend, RedisSetupError};

// ---------------------------------------------------------------------------------------------
// Keys, expiry, round trips.
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_key_expires_exactly_when_its_bucket_is_full_again() {
    let redis = TestRedis::single();
    let (backend, limiter) = limiter_on(&redis.url, &unique_prefix("expiry"), KEY_LIMITS).await;
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
    // Api: burst 2 per second, as much debt: a bound of 2 s, whose bit length (21) the key
    // keeps as the milliseconds it lives past its TAT (`docs/gcra.md`, "Changing a limit").
    assert_eq!(
        expire_ms as u64,
        tat.div_ceil(1000) + 21,
        "PXAT is the TAT, rounded up to a ms, and the writer's bound"
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

/// Another program's data at a bucket key (another type, text, a
/// negative or fractional number, a TAT out of range) used to be an error on every request:
/// the id was unlimited forever under fail open, blocked forever under fail closed. Then it was
/// a fresh bucket, a full burst to whoever wrote it. It is now the bucket drained
/// under the limit in force: a check sees it so and replaces the value with that drained TAT,
/// and the id refills from there like any other.
#[tokio::test]
async fn foreign_data_at_a_key_is_a_drained_bucket_replaced_at_once() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(&redis.url, &unique_prefix("foreign"), &clock, false).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(KEY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let cases: [(&str, Option<&str>); 6] = [
        ("list", None),
        ("text", Some("not a number")),
        ("negative", Some("-5")),
        ("fraction", Some("1.5")),
        ("huge", Some("99999999999999999999")),
        ("out-of-range", Some("9000000000000000")),
    ];
    for (id, value) in cases {
        let now = clock.now_us();
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
        // A check sees the bucket drained under Api (burst 2 per second): nothing left, the
        // next unit in 500 ms; the value is replaced by that drained TAT.
        let d = limiter
            .check(&[Transaction::new(bad.clone())])
            .await
            .unwrap();
        assert!(!d.allowed(), "{id}");
        assert_eq!(d.decisions()[0].remaining(), 0, "{id}");
        assert_eq!(
            d.decisions()[0].retry_after(),
            Duration::from_millis(500),
            "{id}"
        );
        assert_eq!(
            raw_get(&backend, &bad_key).await,
            Some((now + 1_000_000).to_string()),
            "{id}"
        );
        // From then on the id is limited as any other: one unit every 500 ms.
        let one = [Transaction::new(bad.clone())];
        let spend = || limiter.spend(&one);
        assert!(!spend().await.unwrap().allowed(), "{id}");
        clock.advance(Duration::from_millis(500));
        assert!(spend().await.unwrap().allowed(), "{id}");
        assert!(!spend().await.unwrap().allowed(), "{id}");
        clock.advance(Duration::from_secs(10));
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
    // Nothing listens on a port that was just free. What `main` prints for `?` (the error's
    // `Debug`) is the sentence, naming the address (never the URL's password) and the way to
    // start without the server (it printed `Connect("IO Error: ..")`).
    let port = support::redis::free_port();
    let err = RedisBackend::from_url(format!("redis://user:s3cret@127.0.0.1:{port}"))
        .command_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RedisSetupError::Connect { address, single: true, .. } if *address == format!("127.0.0.1:{port}")),
        "{err:#?}"
    );
    let printed = format!("{err:?}");
    assert!(
        printed.starts_with(&format!("cannot connect to Redis at 127.0.0.1:{port}: ")),
        "{printed}"
    );
    assert!(printed.contains("`.lazy(true)`"), "{printed}");
    assert!(!printed.contains("s3cret"), "{printed}");
    assert_eq!(printed, err.to_string());
    let structured = format!("{err:#?}");
    assert!(
        structured.starts_with("RedisSetupError::Connect {"),
        "{structured}"
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
    let mut next = support::xorshift(0x2545_f491_4f6c_dd1d);
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
                (
                    df.allowed(),
                    df.remaining(),
                    df.retry_after(),
                    df.reset_after()
                ),
                (
                    dg.allowed(),
                    dg.remaining(),
                    dg.retry_after(),
                    dg.reset_after()
                ),
                "step {step}: {}",
                df.key()
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

/// A daily and a monthly quota of 6 (their own path when alone: `C`, or `c` on the server's
/// clock) and a GCRA limit the general path's batches carry spend-only (so the calendar key
/// decides those batches alone).
const CALENDAR_PATH_LIMITS: &str = "\
Q: {calendar: {count: 6, period: day}}
M: {calendar: {count: 6, period: month}}
S: {burst: 1000, count: 1000, period: 1s}
";

#[tokio::test]
async fn the_scripts_calendar_path_decides_exactly_as_its_general_path() {
    let redis = TestRedis::single();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let own = caller_time_backend(&redis.url, &unique_prefix("calendar_own"), &clock, false).await;
    let general = caller_time_backend(
        &redis.url,
        &unique_prefix("calendar_general"),
        &clock,
        false,
    )
    .await;
    // Days end every few steps.
    calendar_paths_agree(own, general, "Q", 24 * HOUR_US, Some(&clock)).await;
}

#[tokio::test]
async fn the_scripts_calendar_path_on_the_servers_clock_decides_as_its_general_path() {
    let redis = TestRedis::single();
    let own = backend(&redis.url, &unique_prefix("calendar_own_server")).await;
    let general = backend(&redis.url, &unique_prefix("calendar_general_server")).await;
    // The server's clock: a month, which no run of this test sees end (but at a month's end).
    calendar_paths_agree(own, general, "M", 30 * 24 * HOUR_US, None).await;
}

const HOUR_US: u64 = 3_600_000_000;

/// Random spends of limit `name` (period about `period_us` long) on `own` (one calendar key
/// alone: the script's calendar path) and on `general` (with a spend-only key beside it: the
/// general path), with the same values written under both keys now and then (the crate's,
/// ending this period, a later one within the horizon, one past it, one already ended, units
/// past 2^52, foreign data): the same decisions and the same stored values. On `clock` (caller
/// time, advanced up to a fifth of a period a step), or on the server's clock when `None`
/// (then the two decisions are made a moment apart: their times to the renewal are compared to
/// the second).
async fn calendar_paths_agree(
    own: RedisBackend,
    general: RedisBackend,
    name: &str,
    period_us: u64,
    clock: Option<&ManualClock>,
) {
    let limits = || Limits::from_yaml_str(CALENDAR_PATH_LIMITS, None).unwrap();
    let (own_limiter, general_limiter) = (
        Limiter::new(limits(), own.clone()),
        Limiter::new(limits(), general.clone()),
    );
    let mut next = support::xorshift(0x9e37_79b9_7f4a_7c15);
    let steps = if clock.is_some() { 600 } else { 200 };
    for step in 0..steps {
        let t = match clock {
            Some(clock) => {
                clock.advance(Duration::from_micros(next(period_us / 5)));
                clock.now_us()
            }
            None => tower_ratelimits::SystemClock.now_us(),
        };
        let id = ["a", "b"][next(2) as usize];
        // A calendar key's state is under the bucket's key and `:q`.
        let key = |l: &Limiter, b: &RedisBackend| {
            format!(
                "{}:q",
                b.redis_key(&l.key(name, Id::new(id).unwrap()).unwrap())
            )
        };
        let (own_key, general_key) = (key(&own_limiter, &own), key(&general_limiter, &general));
        if next(2) == 0 {
            let p = period_us;
            let value = match next(7) {
                0 => format!("{} {}", t + next(p * 4 / 5), next(8)),
                1 => format!("{} {}", t + p * 5 / 4 + next(p / 3), next(8)),
                2 => format!("{} {}", t + p * 21 / 10, next(8)),
                3 => format!("{} {}", t.saturating_sub(next(HOUR_US)), next(8)),
                4 => format!(
                    "{} {}",
                    t + [HOUR_US, p * 5 / 4][next(2) as usize],
                    u64::MAX
                ),
                5 => "not ours".to_string(),
                _ => format!("{}", t + HOUR_US),
            };
            for (b, k) in [(&own, &own_key), (&general, &general_key)] {
                let _: () = b
                    .client_for_key(k)
                    .unwrap()
                    .set(k, value.as_str(), None, None, false)
                    .await
                    .unwrap();
            }
        }
        let (min, max) = (next(3), 1 + next(3));
        let q = |l: &Limiter| {
            Transaction::new(l.key(name, Id::new(id).unwrap()).unwrap())
                .cost_range(min.min(max)..=max)
        };
        let o = own_limiter.spend(&[q(&own_limiter)]).await.unwrap();
        let g = general_limiter
            .spend(&[
                q(&general_limiter),
                Transaction::new(general_limiter.key("S", Id::new("s").unwrap()).unwrap())
                    .mode(Mode::SpendOnly),
            ])
            .await
            .unwrap();
        let (od, gd) = (&o.decisions()[0], &g.decisions()[0]);
        assert_eq!(
            (od.allowed(), od.granted(), od.remaining()),
            (gd.allowed(), gd.granted(), gd.remaining()),
            "step {step}"
        );
        for (a, b) in [
            (od.retry_after(), gd.retry_after()),
            (od.reset_after(), gd.reset_after()),
        ] {
            match clock {
                Some(_) => assert_eq!(a, b, "step {step}"),
                None => assert!(a.abs_diff(b) < Duration::from_secs(1), "step {step}"),
            }
        }
        assert_eq!(o.allowed(), g.allowed(), "step {step}");
        assert_eq!(
            raw_get(&own, &own_key).await,
            raw_get(&general, &general_key).await,
            "step {step}: the stored value"
        );
        // Written with the same expiry (the period's end, plus the caller-time margin):
        // read a moment apart.
        let pttl = |b: &RedisBackend, k: &str| {
            let (b, k) = (b.clone(), k.to_string());
            async move {
                b.client_for_key(&k)
                    .unwrap()
                    .pttl::<i64, _>(&k)
                    .await
                    .unwrap()
            }
        };
        let (a, b) = (
            pttl(&own, &own_key).await,
            pttl(&general, &general_key).await,
        );
        assert!(
            (a - b).abs() < 1_000,
            "step {step}: expiries {a} ms and {b} ms"
        );
    }
}

#[tokio::test]
async fn both_paths_decide_a_tat_beyond_what_the_crate_writes_as_a_drained_bucket() {
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
    // G: burst 3 per second (burst offset 1,000,002 us) and 3 units of debt (as much again):
    // the crate writes a TAT at most 2,000,004 us ahead; a minute more is allowed for clocks.
    let furthest = 2_000_004 + tower_ratelimits::__private::gcra::FOREIGN_SLACK_US;
    let bo = 1_000_002;
    for (path, batch) in [("lean", fast()), ("general", general())] {
        // As far as the crate may write: a bucket in debt, denied until it is repaid.
        let now = clock.now_us();
        set(now + furthest).await;
        let d = limiter.spend(&batch).await.unwrap();
        assert!(!d.decisions()[0].allowed(), "{path}");
        assert_eq!(
            d.decisions()[0].reset_after(),
            Duration::from_micros(furthest),
            "{path}"
        );
        // One microsecond further, decades ahead (a key blocked for decades before: a
        // denial writes nothing), 2^52 - 1 and 2^52: not a TAT of ours. The bucket drained
        // under G (not a fresh one, which handed a full burst to whoever wrote it), replaced
        // by its drained TAT though the spend is denied; one emission interval later a unit
        // fits.
        for foreign in [
            now + furthest + 1,
            now + 30 * 365 * 86_400_000_000,
            (1 << 52) - 1,
            1 << 52,
        ] {
            let now = clock.now_us();
            set(foreign).await;
            let d = limiter.spend(&batch).await.unwrap();
            assert!(!d.decisions()[0].allowed(), "{path} {foreign}");
            assert_eq!(d.decisions()[0].remaining(), 0, "{path} {foreign}");
            assert_eq!(
                d.decisions()[0].retry_after(),
                Duration::from_micros(333_334),
                "{path} {foreign}"
            );
            let stored: u64 = raw_get(&backend, &key).await.unwrap().parse().unwrap();
            assert_eq!(stored, now + bo, "{path} {foreign}");
            clock.advance(Duration::from_micros(333_334));
            assert!(
                limiter.spend(&batch).await.unwrap().allowed(),
                "{path} {foreign}"
            );
            clock.advance(Duration::from_secs(5));
        }
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

/// `Limiter::inspect` answers on a single Redis and the cluster as in memory: the limit in
/// force and its source, the bucket's numbers, and nothing spent.
#[tokio::test]
async fn inspection_reads_a_bucket_without_spending_on_redis() {
    for redis in TestRedis::each() {
        let clock = ManualClock::new(1_700_000_000_000_000);
        let backend =
            caller_time_backend(&redis.url, &unique_prefix("inspect"), &clock, true).await;
        let limiter = Limiter::new(support::inspect::limits(), backend);
        support::inspect::inspection_reads_without_spending(&limiter, &clock).await;
    }
}
