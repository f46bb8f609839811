//! Prefetched tokens: instances of a shared Redis answer a hot key's requests from
//! tokens they took in one call, and all of them together never admit more than the bucket
//! allows. Real Redis servers and a real cluster; time is a manual clock (the script decides
//! at the caller's time), so every count here is exact whatever the machine's speed. The
//! same bounds over TCP, with two `axum_redis` processes, are in `examples.rs`.

mod support;

use std::time::Duration;

use support::redis::{RedisServer, TestRedis, unique_prefix};
use support::redis_backend::{caller_time_backend, commandstat};
use tower_ratelimits::{Limit, Limiter, Limits, ManualClock, Mode, RedisBackend, Transaction};

const EPOCH_US: u64 = 1_700_000_000_000_000;

/// The hot key: burst 500, 300 per second, 50 prefetched for 1 s.
const HOT: &str = "\
Hot:
  burst: 500
  count: 300
  period: 1s
  prefetch: 50
Tight:
  burst: 1
  count: 1
  period: 1h
";

async fn instance(
    url: &str,
    prefix: &str,
    clock: &ManualClock,
    yaml: &str,
) -> (RedisBackend, Limiter) {
    let backend = caller_time_backend(url, prefix, clock, true).await;
    let limits = Limits::from_yaml_str(yaml, None).unwrap();
    (backend.clone(), Limiter::new(limits, backend))
}

fn hot(limiter: &Limiter, id: &str) -> [Transaction; 1] {
    [Transaction::new(limiter.parse_key("Hot", id).unwrap())]
}

/// `n` requests on the key `k`, each allowed.
async fn allowed(limiter: &Limiter, n: usize) {
    for i in 0..n {
        let d = limiter.spend(&hot(limiter, "k")).await.unwrap();
        assert!(d.allowed(), "request {i}");
    }
}

/// Script calls the server ran (`EVALSHA`, and `EVAL` after a lost script).
fn script_calls(port: u16) -> u64 {
    commandstat(port, "evalsha") + commandstat(port, "eval")
}

/// Offers `per_second` requests a second for `seconds`, alternating between `instances`
/// (the clock moves between requests); the requests admitted.
async fn load(instances: &[Limiter], clock: &ManualClock, per_second: u64, seconds: u64) -> u64 {
    let step = Duration::from_micros(1_000_000 / per_second);
    let mut admitted = 0;
    for i in 0..per_second * seconds {
        let limiter = &instances[i as usize % instances.len()];
        if limiter
            .spend(&hot(limiter, "tenant"))
            .await
            .unwrap()
            .allowed()
        {
            admitted += 1;
        }
        clock.advance(step);
    }
    admitted
}

/// The measure, in process: two instances above the limit (2x) and at half of it,
/// over 3 s. Admitted never above burst + rate x elapsed, at least 80% of it above the limit
/// and all of it at half, and at most one script call per 10 admitted requests; on the
/// cluster too (where the bounds are checked; the calls are counted on the single server).
#[tokio::test]
async fn two_instances_admit_at_most_the_bucket_with_a_tenth_of_the_calls() {
    for (per_second, least_share) in [(600, 0.8), (150, 1.0)] {
        let server = RedisServer::start();
        let clock = ManualClock::new(EPOCH_US);
        let prefix = unique_prefix("hot");
        let (_, a) = instance(&server.url(), &prefix, &clock, HOT).await;
        let (_, b) = instance(&server.url(), &prefix, &clock, HOT).await;
        let calls_before = script_calls(server.port);
        let admitted = load(&[a, b], &clock, per_second, 3).await;
        let calls = script_calls(server.port) - calls_before;
        eprintln!("{per_second}/s: admitted {admitted}, {calls} script calls");
        within_bounds(admitted, per_second, least_share);
        assert!(
            calls as f64 <= 0.1 * admitted as f64,
            "{calls} script calls for {admitted} admitted"
        );

        let cluster = TestRedis::cluster();
        let clock = ManualClock::new(EPOCH_US);
        let prefix = unique_prefix("hot-cluster");
        let (_, a) = instance(&cluster.url, &prefix, &clock, HOT).await;
        let (_, b) = instance(&cluster.url, &prefix, &clock, HOT).await;
        within_bounds(
            load(&[a, b], &clock, per_second, 3).await,
            per_second,
            least_share,
        );
    }
}

/// Admitted over 3 s at `per_second`: at most burst + rate x 3 s, at least `least_share` of
/// what could be.
fn within_bounds(admitted: u64, per_second: u64, least_share: f64) {
    let bound = 500 + 300 * 3;
    let expected = bound.min(per_second * 3);
    assert!(admitted <= bound, "{admitted} admitted, above {bound}");
    assert!(
        admitted as f64 >= least_share * expected as f64,
        "{admitted} admitted, below {least_share} of {expected}"
    );
}

/// Without prefetching, the same key costs one call per request: the baseline the measure
/// above is set against (and proof that the counts above come from prefetching).
#[tokio::test]
async fn without_prefetch_every_request_is_a_call() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let yaml = HOT.replace("  prefetch: 50\n", "");
    let (_, a) = instance(&server.url(), &unique_prefix("cold"), &clock, &yaml).await;
    let before = script_calls(server.port);
    let admitted = load(&[a], &clock, 150, 1).await;
    assert_eq!(admitted, 150);
    assert_eq!(script_calls(server.port) - before, 150);
}

/// A key seen once in a TTL is sent as it is: nothing prefetched, nothing to give back.
#[tokio::test]
async fn a_cold_key_costs_one_call_and_holds_nothing() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let (backend, a) = instance(&server.url(), &unique_prefix("once"), &clock, HOT).await;
    let before = script_calls(server.port);
    for i in 0..20 {
        let d = a.spend(&hot(&a, &format!("client-{i}"))).await.unwrap();
        assert!(d.allowed());
        assert_eq!(
            d.strictest().unwrap().remaining(),
            499,
            "the store's own answer"
        );
    }
    assert_eq!(script_calls(server.port) - before, 20);
    assert_eq!(backend.return_prefetched().await.unwrap(), 0);
}

/// From a full bucket, every instance's prefetched tokens were spent in the store first: the
/// instances together admit the burst at most, however their requests interleave, and what
/// an instance holds when it is killed is lost to the others until the bucket refills (fewer
/// admissions, never more); once it refills, the others get it all.
#[tokio::test]
async fn a_killed_instance_loses_its_tokens_to_everyone_and_never_over_admits() {
    for redis in TestRedis::each() {
        let clock = ManualClock::new(EPOCH_US);
        let prefix = unique_prefix("killed");
        let (_, a) = instance(&redis.url, &prefix, &clock, HOT).await;
        let (_, b) = instance(&redis.url, &prefix, &clock, HOT).await;
        // Both instances warm up on the key, with the clock still: 40 each.
        let mut admitted = 0;
        for _ in 0..40 {
            for limiter in [&a, &b] {
                admitted += u64::from(limiter.spend(&hot(limiter, "k")).await.unwrap().allowed());
            }
        }
        assert_eq!(admitted, 80);
        // `a` is killed: it gives nothing back.
        drop(a);
        let mut by_b = 0;
        for _ in 0..1000 {
            by_b += u64::from(b.spend(&hot(&b, "k")).await.unwrap().allowed());
        }
        assert!(
            80 + by_b <= 500,
            "{} admitted from a bucket of 500",
            80 + by_b
        );
        assert!(
            80 + by_b >= 500 - 2 * 50,
            "{by_b}: at most what `a` held is lost"
        );
        // A second later the bucket has refilled 300 and the lost tokens are gone for good.
        clock.advance(Duration::from_secs(1));
        let mut later = 0;
        for _ in 0..1000 {
            later += u64::from(b.spend(&hot(&b, "k")).await.unwrap().allowed());
        }
        assert!(later <= 300 + 50, "{later} after one second");
        assert!(later >= 300 - 50, "{later} after one second");
    }
}

/// The timing bound, measured: tokens taken before a window and used in it. Two instances
/// hold what they prefetched; a third client (no prefetching) then takes everything the store
/// has. In the next millisecond the bucket alone allows nothing more, and the two instances
/// admit what they hold: more than the bucket alone, never more than instances x N.
#[tokio::test]
async fn in_a_short_window_instances_admit_at_most_what_they_hold() {
    for redis in TestRedis::each() {
        let clock = ManualClock::new(EPOCH_US);
        let prefix = unique_prefix("window");
        let (_, a) = instance(&redis.url, &prefix, &clock, HOT).await;
        let (_, b) = instance(&redis.url, &prefix, &clock, HOT).await;
        let plain = HOT.replace("  prefetch: 50\n", "");
        let (_, store) = instance(&redis.url, &prefix, &clock, &plain).await;
        for _ in 0..40 {
            for limiter in [&a, &b] {
                assert!(limiter.spend(&hot(limiter, "k")).await.unwrap().allowed());
            }
        }
        // The store's bucket, drained by a client that holds nothing.
        while store.spend(&hot(&store, "k")).await.unwrap().allowed() {}
        let mut in_window = 0;
        for _ in 0..200 {
            for limiter in [&a, &b] {
                in_window += u64::from(limiter.spend(&hot(limiter, "k")).await.unwrap().allowed());
            }
        }
        clock.advance(Duration::from_micros(999));
        assert!(
            !store.spend(&hot(&store, "k")).await.unwrap().allowed(),
            "the bucket alone: none"
        );
        eprintln!("{in_window} admitted in a window where the bucket alone allows none");
        assert!(in_window > 0, "the instances used what they held");
        assert!(in_window <= 2 * 50, "{in_window}: more than instances x N");
    }
}

/// A batch is all or nothing: when another rule denies it, the token a request took from
/// the pool goes back, and the instance's view of the bucket is what it was. On the cluster
/// the two keys live in different slots (the denied slot's batch is undone there).
#[tokio::test]
async fn a_batch_another_rule_denies_gives_its_token_back_to_the_pool() {
    for redis in TestRedis::each() {
        let clock = ManualClock::new(EPOCH_US);
        let (_, a) = instance(&redis.url, &unique_prefix("batch"), &clock, HOT).await;
        let remaining = |d: tower_ratelimits::BatchDecision| d.decisions()[0].remaining();
        allowed(&a, 5).await;
        let view = remaining(a.spend(&hot(&a, "k")).await.unwrap());
        let batch = [
            Transaction::new(a.parse_key("Hot", "k").unwrap()),
            Transaction::new(a.parse_key("Tight", "k").unwrap()),
        ];
        assert!(
            a.spend(&batch).await.unwrap().allowed(),
            "Tight's one token"
        );
        let after_first = remaining(a.spend(&hot(&a, "k")).await.unwrap());
        assert_eq!(after_first, view - 2);
        for _ in 0..3 {
            let d = a.spend(&batch).await.unwrap();
            assert!(!d.allowed(), "Tight is empty");
        }
        let now = remaining(a.spend(&hot(&a, "k")).await.unwrap());
        assert_eq!(now, after_first - 1, "the denied batches took nothing");
    }
}

/// Many requests on one key at once on one instance share one refill: they wait for the
/// refill under way rather than each calling the store.
#[tokio::test]
async fn concurrent_requests_on_an_empty_pool_share_one_refill() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let (_, a) = instance(&server.url(), &unique_prefix("herd"), &clock, HOT).await;
    // Demand seen: the next refill takes 50.
    allowed(&a, 60).await;
    clock.advance(Duration::from_millis(1));
    let before = script_calls(server.port);
    let spends = (0..40).map(|_| {
        let a = a.clone();
        tokio::spawn(async move { a.spend(&hot(&a, "k")).await.unwrap().allowed() })
    });
    let allowed = futures_util::future::join_all(spends).await;
    assert!(allowed.iter().all(|r| *r.as_ref().unwrap()));
    let calls = script_calls(server.port) - before;
    assert!(calls <= 2, "{calls} calls for 40 concurrent requests");
}

/// While the store's last word leaves no room for the least refill, the key's requests are
/// denied without a call; the wait they are told is never earlier than the store's own for
/// the request, and they pass again when the refill fits.
#[tokio::test]
async fn at_saturation_requests_are_denied_locally_with_a_wait_no_earlier_than_the_store() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let prefix = unique_prefix("saturated");
    let (_, a) = instance(&server.url(), &prefix, &clock, HOT).await;
    // A second client of the store, without prefetching, to read what the store says.
    let plain = HOT.replace("  prefetch: 50\n", "");
    let (_, store) = instance(&server.url(), &prefix, &clock, &plain).await;
    let mut admitted = 0;
    while a.spend(&hot(&a, "k")).await.unwrap().allowed() {
        admitted += 1;
        assert!(admitted <= 500);
    }
    let before = script_calls(server.port);
    let denied = a.spend(&hot(&a, "k")).await.unwrap();
    assert!(!denied.allowed());
    assert_eq!(script_calls(server.port), before, "denied without a call");
    let probe = [Transaction::new(store.parse_key("Hot", "k").unwrap()).mode(Mode::CheckOnly)];
    let store_says = store.check(&probe).await.unwrap();
    let told = denied.strictest().unwrap().retry_after();
    assert!(
        told >= store_says.strictest().unwrap().retry_after(),
        "told {told:?}, the store says {:?}",
        store_says.strictest().unwrap().retry_after()
    );
    clock.advance(told);
    assert!(a.spend(&hot(&a, "k")).await.unwrap().allowed());
}

/// Expired tokens go back to the store by themselves; `return_prefetched` gives back the
/// rest (at shutdown), and the store's bucket then holds them again. (A limit that refills
/// one token in 7.2 s, so that what the store holds moves only by what is spent and given
/// back.)
#[tokio::test]
async fn unused_tokens_go_back_when_they_expire_and_at_shutdown() {
    const SLOW: &str =
        "Hot:\n  burst: 500\n  count: 500\n  period: 1h\n  prefetch: 50\n  prefetch_ttl: 10ms\n";
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let prefix = unique_prefix("back");
    let (backend, a) = instance(&server.url(), &prefix, &clock, SLOW).await;
    let plain = SLOW.replace("  prefetch: 50\n  prefetch_ttl: 10ms\n", "");
    let (_, store) = instance(&server.url(), &prefix, &clock, &plain).await;
    // What the store's bucket holds (a check of cost 0).
    let probe = [Transaction::new(store.parse_key("Hot", "k").unwrap())
        .cost(0)
        .mode(Mode::CheckOnly)];
    let in_store = || async {
        store
            .check(&probe)
            .await
            .unwrap()
            .strictest()
            .unwrap()
            .remaining()
    };
    allowed(&a, 10).await;
    let held = 500 - 10 - in_store().await;
    assert!(held > 0, "refills took more than was used");
    assert_eq!(backend.return_prefetched().await.unwrap(), held);
    assert_eq!(in_store().await, 490);

    // Again, and this time let the tokens expire: the backend gives them back by itself.
    allowed(&a, 10).await;
    assert!(in_store().await < 480, "a refill took tokens");
    clock.advance(Duration::from_millis(11));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while in_store().await != 480 {
        assert!(
            std::time::Instant::now() < deadline,
            "expired tokens never came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        backend.return_prefetched().await.unwrap(),
        0,
        "nothing left"
    );
}

/// A reset drops the instance's tokens (the bucket is full again); a charge (a settle's
/// overrun) drops them back to the store, and the debt it records denies the key here too.
#[tokio::test]
async fn a_reset_or_a_charge_drops_the_local_tokens() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let (_, a) = instance(&server.url(), &unique_prefix("drop"), &clock, HOT).await;
    allowed(&a, 5).await;
    let key = a.parse_key("Hot", "k").unwrap();
    a.reset(std::slice::from_ref(&key)).await.unwrap();
    let d = a.spend(&hot(&a, "k")).await.unwrap();
    assert_eq!(
        d.strictest().unwrap().remaining(),
        499,
        "the store's fresh bucket"
    );

    allowed(&a, 5).await;
    // A charge of 1,000 units: 500 of the burst and 500 of debt.
    let charge = [Transaction::new(key.clone()).cost(1000).mode(Mode::Charge)];
    a.spend(&charge).await.unwrap();
    let d = a.spend(&hot(&a, "k")).await.unwrap();
    assert!(!d.allowed(), "in debt: the pool no longer answers");
}

/// A reset through another instance reaches this one's prefetched tokens (told on the store's
/// channel): once the news is in, the key's next request here is decided by the store's fresh
/// bucket, not from tokens taken before the reset. The news is seen on a second key of the same
/// reset that this instance's deny cache held (polled until it is let through: those requests
/// touch nothing), within the two seconds the issue allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_through_another_instance_drops_this_ones_tokens() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let prefix = unique_prefix("drop-elsewhere");
    let (_, a) = instance(&server.url(), &prefix, &clock, HOT).await;
    let (_, b) = instance(&server.url(), &prefix, &clock, HOT).await;
    a_reset_through_a_reaches_b(&a, &b, Duration::from_secs(2)).await;
}

/// `b` holds a hot key's tokens and remembers a denial of `Tight`; a reset of both through
/// `a` reaches `b` within `deadline`: polled on the denied key (those requests touch nothing
/// before `b` knows), then the hot key is decided by the fresh bucket, not by `b`'s tokens.
async fn a_reset_through_a_reaches_b(a: &Limiter, b: &Limiter, deadline: Duration) {
    allowed(b, 100).await;
    let tight = [Transaction::new(b.parse_key("Tight", "x").unwrap())];
    assert!(b.spend(&tight).await.unwrap().allowed());
    assert!(!b.spend(&tight).await.unwrap().allowed());
    let keys = [
        a.parse_key("Hot", "k").unwrap(),
        a.parse_key("Tight", "x").unwrap(),
    ];
    a.reset(&keys).await.unwrap();
    let start = std::time::Instant::now();
    while !b.spend(&tight).await.unwrap().allowed() {
        assert!(start.elapsed() < deadline, "b never heard of the reset");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let d = b.spend(&hot(b, "k")).await.unwrap();
    assert_eq!(
        d.strictest().unwrap().remaining(),
        499,
        "decided by the fresh bucket, not by tokens taken before the reset"
    );
}

/// A reload that changes a key's limit (here: `prefetch` off) applies at once: the tokens held
/// under the old limit are dropped, and every request is then a call.
#[tokio::test]
async fn a_reload_applies_from_the_next_refill() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let prefix = unique_prefix("reload");
    let (_, a) = instance(&server.url(), &prefix, &clock, HOT).await;
    allowed(&a, 60).await;
    let off = HOT.replace("  prefetch: 50\n", "");
    a.reload(Limits::from_yaml_str(&off, None).unwrap())
        .unwrap();
    let before = script_calls(server.port);
    allowed(&a, 200).await;
    assert_eq!(script_calls(server.port) - before, 200);
}

/// Prefetching is a deployment optimisation of a shared store: in memory (and so in the
/// simulator) a limit decides exactly as without it.
#[tokio::test]
async fn in_memory_prefetch_changes_nothing() {
    let clock = ManualClock::new(EPOCH_US);
    let with = Limits::from_yaml_str(HOT, None).unwrap();
    let without = Limits::from_yaml_str(&HOT.replace("  prefetch: 50\n", ""), None).unwrap();
    let a = Limiter::new(
        with,
        tower_ratelimits::MemoryBackend::builder()
            .clock(clock.clone())
            .build(),
    );
    let b = Limiter::new(
        without,
        tower_ratelimits::MemoryBackend::builder()
            .clock(clock.clone())
            .build(),
    );
    for i in 0..1500u64 {
        let (x, y) = (
            a.spend(&hot(&a, "k")).await.unwrap(),
            b.spend(&hot(&b, "k")).await.unwrap(),
        );
        let numbers = |d: &tower_ratelimits::BatchDecision| {
            let d = d.strictest().unwrap();
            (d.allowed(), d.remaining(), d.retry_after(), d.reset_after())
        };
        assert_eq!(numbers(&x), numbers(&y), "request {i}");
        clock.advance(Duration::from_micros(1_000 + i % 7));
    }
}

/// The builder API carries the same settings as YAML.
#[test]
fn the_builder_api_sets_prefetch() {
    let limit = Limit::new(500, 300, Duration::from_secs(1))
        .unwrap()
        .with_prefetch(50, Duration::from_millis(500))
        .unwrap();
    let limits = Limits::builder().limit("Hot", limit).build().unwrap();
    let quota = limits.default_limit(limits.name("Hot").unwrap()).unwrap();
    let gcra = quota.as_gcra().unwrap();
    assert_eq!(
        (gcra.prefetch(), gcra.prefetch_ttl()),
        (50, Duration::from_millis(500))
    );
}

/// An instance whose notifications are down (here: a Redis user that may not
/// subscribe) still drops its prefetched tokens and its remembered denials after a reset made
/// elsewhere, within two seconds: the store counts resets, and a count this instance was not
/// told of drops every key's local state. Before, it kept its tokens through the reset (4
/// over the bucket in the trial) and its deny cache denied for the rest of the hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_an_instance_whose_notifications_are_down() {
    let server = RedisServer::start();
    support::redis::command(
        server.port,
        "ACL SETUSER deaf on >deaf-pw ~* allchannels +@all -subscribe -psubscribe -ssubscribe",
    )
    .unwrap();
    let clock = ManualClock::new(EPOCH_US);
    let prefix = unique_prefix("deaf");
    let (_, a) = instance(&server.url(), &prefix, &clock, HOT).await;
    let deaf_url = format!("redis://deaf:deaf-pw@127.0.0.1:{}", server.port);
    let (_, b) = instance(&deaf_url, &prefix, &clock, HOT).await;
    a_reset_through_a_reaches_b(&a, &b, Duration::from_secs(3)).await;
}

/// A reload that lowers a limit drops the tokens an instance took under the
/// old one. 60 requests spent at once under a burst of 500 (a pool of tokens held), the burst
/// cut to 2: the bucket is drained under the new limit (what was spent stays spent) and no
/// token of the pool is used (before: the pool's tokens kept being admitted).
#[tokio::test]
async fn a_lowered_limit_drops_the_tokens_taken_under_the_old_one() {
    let server = RedisServer::start();
    let clock = ManualClock::new(EPOCH_US);
    let (_, a) = instance(&server.url(), &unique_prefix("lowered"), &clock, HOT).await;
    allowed(&a, 60).await;
    let lowered = HOT
        .replace("burst: 500", "burst: 2")
        .replace("prefetch: 50", "prefetch: 2");
    a.reload(Limits::from_yaml_str(&lowered, None).unwrap())
        .unwrap();
    let mut admitted = 0;
    for _ in 0..20 {
        if a.spend(&hot(&a, "k")).await.unwrap().allowed() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 0, "a burst of 2 under 60 spent: nothing left");
}

/// Many instances on one hot key (requests alternating between them, the clock moving between
/// requests), over 10 s: above the limit (2x) never more than the bucket, at least 90% of it,
/// with at most one script call per 10 admitted requests up to 8 instances; at half the limit
/// every request admitted. Each instance waits for its least refill expecting the others to
/// take their recent part of what the bucket refills meanwhile; before, an instance called when
/// the store's last word alone said it fit, and most of those calls were denied (8 instances:
/// 0.166 calls per admitted, 414 of 571 calls denied).
#[tokio::test]
async fn many_instances_share_a_hot_key_with_few_calls() {
    let server = RedisServer::start();
    for n in [2usize, 4, 8, 16] {
        for per_second in [600, 300, 150] {
            let clock = ManualClock::new(EPOCH_US);
            let prefix = unique_prefix("many");
            let mut instances = Vec::new();
            for _ in 0..n {
                instances.push(instance(&server.url(), &prefix, &clock, HOT).await.1);
            }
            let before = script_calls(server.port);
            let admitted = load(&instances, &clock, per_second, 10).await;
            let calls = script_calls(server.port) - before;
            let per_admitted = calls as f64 / admitted as f64;
            eprintln!(
                "{n} instances, {per_second}/s: admitted {admitted}, {calls} script calls, \
                 {per_admitted:.3} per admitted"
            );
            let bound = 500 + 300 * 10;
            let offered = per_second * 10;
            assert!(admitted <= bound, "{admitted} above the bound {bound}");
            if offered <= bound / 2 {
                assert_eq!(admitted, offered, "below the limit, every request");
            } else if offered > bound {
                assert!(
                    admitted * 10 >= bound * 9,
                    "{admitted}: below 90% of {bound}"
                );
            }
            if n <= 8 {
                assert!(per_admitted <= 0.1, "{n} instances: {per_admitted:.3}");
            }
        }
    }
}

/// A limit that sets `prefetch` on a backend that does not prefetch is decided as without it,
/// and the limiter says so once, at its start, naming the limit: on memory, and on Redis with
/// prefetching turned off; on Redis with it on (the default), nothing is said.
#[tokio::test]
async fn prefetch_where_nothing_prefetches_is_warned_once_at_start() {
    let limits = || Limits::from_yaml_str(HOT, None).unwrap();
    let (memory, warned) =
        support::warnings_during(|| Limiter::new(limits(), tower_ratelimits::MemoryBackend::new()));
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].starts_with("tower_ratelimits::backend: limit Hot sets prefetch"),
        "{warned:?}"
    );
    assert!(memory.spend(&hot(&memory, "k")).await.unwrap().allowed());
    // A file override that sets it, on a limit whose default does not: warned the same way.
    let plain = HOT.replace("  prefetch: 50\n", "");
    let by_override =
        "- Hot:\n    burst: 500\n    count: 300\n    period: 1s\n    prefetch: 50\n    ids: [k]\n";
    let (_, warned) = support::warnings_during(|| {
        let limits = Limits::from_yaml_str(&plain, Some(by_override)).unwrap();
        Limiter::new(limits, tower_ratelimits::MemoryBackend::new())
    });
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("limit Hot sets prefetch"), "{warned:?}");

    let server = RedisServer::start();
    let prefix = unique_prefix("warned");
    let on = RedisBackend::from_url(server.url())
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let (_, warned) = support::warnings_during(|| Limiter::new(limits(), on));
    assert!(warned.is_empty(), "{warned:?}");
    let off = RedisBackend::from_url(server.url())
        .prefix(&prefix)
        .prefetch(false)
        .connect()
        .await
        .unwrap();
    let (_, warned) = support::warnings_during(|| Limiter::new(limits(), off));
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("limit Hot sets prefetch"), "{warned:?}");
}

/// A reload that brings `prefetch` to a limiter whose backend ignores it warns once of each
/// limit it brings it to; a reload that keeps it, or drops it, says nothing, and one that
/// brings it back warns again. On Redis, which prefetches, a reload that brings it says
/// nothing, and neither does the layer's in-memory fallback when it follows the reload (its
/// limits are the main limiter's, scaled without prefetch): here Redis is down, so the fallback
/// decides the request after the reload, at half of the reloaded burst (400).
#[test]
fn a_reload_that_brings_prefetch_where_nothing_prefetches_is_warned_once() {
    use axum::{Router, body::Body, routing::get};
    use tower::ServiceExt as _;
    use tower_ratelimits::{ClientIp, FailurePolicy, RateLimitLayer, Rule};

    let plain = HOT.replace("  prefetch: 50\n", "");
    let yaml = |text: &str| Limits::from_yaml_str(text, None).unwrap();
    let memory = Limiter::new(yaml(&plain), tower_ratelimits::MemoryBackend::new());
    let reload = |text: &str| support::warnings_during(|| memory.reload(yaml(text)).unwrap()).1;
    let warned = reload(HOT);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].starts_with("tower_ratelimits::backend: limit Hot sets prefetch"),
        "{warned:?}"
    );
    assert_eq!(reload(HOT), Vec::<String>::new());
    assert_eq!(reload(&plain), Vec::<String>::new());
    assert_eq!(reload(HOT).len(), 1);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let reloaded = HOT.replace("burst: 500", "burst: 400");
    let (policy, warned) = support::warnings_during(|| {
        runtime.block_on(async {
            // A port nothing listens on: every call fails, and the fallback decides.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let down = RedisBackend::from_url(format!("redis://127.0.0.1:{port}"))
                .lazy(true)
                .command_timeout(Duration::from_millis(50))
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::new(yaml(&plain), down);
            let layer = RateLimitLayer::builder(limiter.clone())
                .rule(Rule::new("Hot", ClientIp::new()))
                .on_backend_failure(FailurePolicy::FallbackToMemory { percent: 50 })
                .build()
                .unwrap();
            limiter.reload(yaml(&reloaded)).unwrap();
            let app = Router::new()
                .route("/", get(|| async { "ok" }))
                .layer(layer);
            let request = http::Request::get("/")
                .extension("10.0.0.1:1".parse::<std::net::SocketAddr>().unwrap())
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            assert_eq!(response.status(), http::StatusCode::OK);
            response.headers()["ratelimit-policy"].clone()
        })
    });
    assert_eq!(
        policy, "\"Hot\";q=200;w=2",
        "not the fallback's reloaded limit"
    );
    assert!(
        !warned.iter().any(|w| w.contains("sets prefetch")),
        "{warned:?}"
    );
}
