//! A change of limit never hands back what was spent (`docs/gcra.md` "Changing a
//! limit"): a stored override set then removed, a reload that lowers a limit then restores it,
//! a raise that ends (removed, or expired); in memory, on a single Redis and on the cluster.
//! Each bucket keeps its TAT, and with it the bound of the limit that wrote it, so a bucket
//! drained under a larger limit is drained under a smaller one (never fresh) and found as it
//! was when the larger limit returns.

mod support;

use std::time::Duration;

use support::redis::{TestRedis, unique_prefix};
use support::redis_backend::limiter_on;
use tower_ratelimits::{
    Limit, LimitSource, Limiter, Limits, ManualClock, MemoryBackend, OverrideKind, Transaction,
};

/// 40 an hour in a burst of 40, per account.
const LIMITS: &str = "Api: {kind: account, burst: 40, count: 1, period: 1h}\n";
/// The same name cut to a burst of 2.
const LOWERED: &str = "Api: {kind: account, burst: 2, count: 1, period: 1h}\n";

const HOUR: Duration = Duration::from_secs(3600);

/// A limiter over `yaml` on each store: memory (on a manual clock), then a single Redis and the
/// cluster on the server's clock (where a bucket keeps its writer's bound: the key's expiry),
/// each with the servers it needs (stopped when dropped).
async fn stores(yaml: &str, name: &str) -> Vec<(String, Limiter, Option<TestRedis>)> {
    let clock = ManualClock::new(1_767_225_600_000_000);
    let memory = Limiter::new(
        Limits::from_yaml_str(yaml, None).unwrap(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let mut out = vec![("memory".to_owned(), memory, None)];
    for (label, redis) in [
        ("a single Redis", TestRedis::single()),
        ("the cluster", TestRedis::cluster()),
    ] {
        let (_, limiter) = limiter_on(&redis.url, &unique_prefix(name), yaml).await;
        out.push((label.to_owned(), limiter, Some(redis)));
    }
    out
}

/// How many of `n` spends of one unit on `key` are allowed.
async fn admitted(limiter: &Limiter, key: &tower_ratelimits::BucketKey, n: usize) -> usize {
    let one = [Transaction::new(key.clone())];
    let mut allowed = 0;
    for _ in 0..n {
        if limiter.spend(&one).await.unwrap().allowed() {
            allowed += 1;
        }
    }
    allowed
}

fn limit(burst: u64) -> OverrideKind {
    OverrideKind::Quota(Limit::new(burst, 1, HOUR).unwrap().into())
}

/// The first failure: 30 of 40 spent (10 left), a stored override of burst 2 set then
/// removed. Under the override the bucket is drained (its TAT, 30 hours ahead, lies beyond
/// what the smaller limit writes, but within what the larger one did): denied until the
/// spent time is repaid, not refilled. After the removal the limit of 40 finds the 10 that
/// were left. Before, the override read the TAT as a fresh bucket: 2 more at once, and 38
/// after the removal (40 in all against 10).
#[tokio::test]
async fn a_penalty_override_set_then_removed_hands_back_nothing() {
    for (store, limiter, _) in stores(LIMITS, "penalty").await {
        let key = limiter.parse_key("Api", "7").unwrap();
        assert_eq!(admitted(&limiter, &key, 30).await, 30, "{store}");
        limiter
            .set_override("Api", "7", limit(2), None)
            .await
            .unwrap();
        let denied = limiter
            .spend(&[Transaction::new(key.clone())])
            .await
            .unwrap();
        assert!(!denied.allowed(), "{store}: drained, not fresh");
        // 30 hours ahead, a burst offset of 2 hours: the next unit in 29 hours.
        let wait = denied.strictest().unwrap().retry_after();
        assert!(
            wait > 29 * HOUR - Duration::from_secs(60) && wait <= 29 * HOUR,
            "{store}: {wait:?}"
        );
        let seen = limiter.inspect(&key).await.unwrap();
        assert_eq!(
            (seen.source, seen.remaining),
            (LimitSource::Store, 0),
            "{store}"
        );
        assert!(limiter.remove_override("Api", "7").await.unwrap());
        assert_eq!(
            admitted(&limiter, &key, 50).await,
            10,
            "{store}: the 10 left"
        );
    }
}

/// The second failure: a reload that cuts the burst to 2 and one that restores it (a
/// bad deploy rolled back) hand back nothing: 10 left before, 0 in between, 10 after. Before,
/// the lowered limit read every drained bucket as fresh: 2 in between and 38 after.
#[tokio::test]
async fn a_reload_that_lowers_then_restores_a_limit_hands_back_nothing() {
    for (store, limiter, _) in stores(LIMITS, "rollback").await {
        let key = limiter.parse_key("Api", "7").unwrap();
        assert_eq!(admitted(&limiter, &key, 30).await, 30, "{store}");
        limiter
            .reload(Limits::from_yaml_str(LOWERED, None).unwrap())
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 5).await, 0, "{store}: lowered");
        assert_eq!(limiter.inspect(&key).await.unwrap().remaining, 0, "{store}");
        limiter
            .reload(Limits::from_yaml_str(LIMITS, None).unwrap())
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 50).await, 10, "{store}: restored");
    }
}

/// A raise that ends keeps what was spent under it: 90 of a stored 100 per hour spent, then
/// the override removed. Under the default of 40 the bucket is 90 hours ahead: drained until
/// time brings it within 40 hours (50 hours), not a fresh burst of 40 (before: 40 at once).
#[tokio::test]
async fn a_raise_removed_keeps_what_was_spent_under_it() {
    for (store, limiter, _) in stores(LIMITS, "raise").await {
        let key = limiter.parse_key("Api", "7").unwrap();
        limiter
            .set_override("Api", "7", limit(100), None)
            .await
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 90).await, 90, "{store}");
        assert!(limiter.remove_override("Api", "7").await.unwrap());
        assert_eq!(admitted(&limiter, &key, 5).await, 0, "{store}");
        let seen = limiter.inspect(&key).await.unwrap();
        assert_eq!(
            (seen.source, seen.remaining),
            (LimitSource::Default, 0),
            "{store}"
        );
        assert!(
            seen.reset_after > 89 * HOUR && seen.reset_after <= 90 * HOUR,
            "{store}: {:?}",
            seen.reset_after
        );
    }
}

/// The same when the raise expires instead (memory, on a manual clock: the expiry is read on
/// the limiter's clock): an hour after 90 of 100 were spent, the default of 40 finds the bucket
/// 89 hours ahead and waits 49 more hours for the next unit.
#[tokio::test]
async fn a_raise_that_expires_keeps_what_was_spent_under_it() {
    let clock = ManualClock::new(1_767_225_600_000_000);
    let limiter = Limiter::new(
        Limits::from_yaml_str(LIMITS, None).unwrap(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let key = limiter.parse_key("Api", "7").unwrap();
    limiter
        .set_override("Api", "7", limit(100), Some(HOUR))
        .await
        .unwrap();
    assert_eq!(admitted(&limiter, &key, 90).await, 90);
    clock.advance(HOUR);
    let denied = limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap();
    assert!(!denied.allowed());
    let d = denied.strictest().unwrap();
    assert_eq!(d.retry_after(), 50 * HOUR);
    assert_eq!(
        limiter.inspect(&key).await.unwrap().source,
        LimitSource::Default
    );
    clock.advance(50 * HOUR);
    assert_eq!(admitted(&limiter, &key, 5).await, 1);
}

/// On Redis the expiry of a raise is read on the system clock: an override of 100 ending in a
/// second, 90 spent under it; once it has ended (polled by inspection, which spends nothing),
/// the default of 40 finds the bucket drained.
#[tokio::test]
async fn a_raise_that_expires_keeps_what_was_spent_under_it_on_redis() {
    for redis in TestRedis::each() {
        let (_, limiter) = limiter_on(&redis.url, &unique_prefix("expires"), LIMITS).await;
        let key = limiter.parse_key("Api", "7").unwrap();
        limiter
            .set_override("Api", "7", limit(100), Some(Duration::from_secs(1)))
            .await
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 90).await, 90);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while limiter.inspect(&key).await.unwrap().source != LimitSource::Default {
            assert!(
                std::time::Instant::now() < deadline,
                "the override never ended"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(admitted(&limiter, &key, 5).await, 0);
    }
}

/// Raising a limit refills nothing beyond what time did: 30 of 40 spent, the burst raised to
/// 100 (burst offset 100 hours): the 30 hours spent stay spent, 70 left; lowered back, 10.
#[tokio::test]
async fn a_raise_by_reload_adds_the_difference_and_takes_it_back() {
    for (store, limiter, _) in stores(LIMITS, "grow").await {
        let key = limiter.parse_key("Api", "7").unwrap();
        assert_eq!(admitted(&limiter, &key, 30).await, 30, "{store}");
        limiter
            .reload(
                Limits::from_yaml_str(
                    "Api: {kind: account, burst: 100, count: 1, period: 1h}\n",
                    None,
                )
                .unwrap(),
            )
            .unwrap();
        assert_eq!(
            limiter.inspect(&key).await.unwrap().remaining,
            70,
            "{store}"
        );
        assert_eq!(admitted(&limiter, &key, 5).await, 5, "{store}");
        limiter
            .reload(Limits::from_yaml_str(LIMITS, None).unwrap())
            .unwrap();
        assert_eq!(admitted(&limiter, &key, 50).await, 5, "{store}");
    }
}

/// A clock stepped back (a day) leaves every bucket further ahead than the crate writes:
/// foreign. Each is read as drained under its limit (nothing left, the next unit one emission
/// interval away) and stored so, never blocked for the day the clock lost, and never fresh.
#[tokio::test]
async fn a_clock_stepped_back_drains_buckets_for_one_interval_not_for_the_step() {
    let start = 1_767_225_600_000_000;
    let clock = ManualClock::new(start);
    let limiter = Limiter::new(
        Limits::from_yaml_str(
            "Fast: {kind: account, burst: 10, count: 10, period: 1s}\n",
            None,
        )
        .unwrap(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let key = limiter.parse_key("Fast", "7").unwrap();
    assert_eq!(admitted(&limiter, &key, 3).await, 3);
    clock.set(start - 86_400_000_000);
    let denied = limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap();
    assert!(!denied.allowed(), "drained, not fresh");
    assert_eq!(
        denied.strictest().unwrap().retry_after(),
        Duration::from_millis(100)
    );
    clock.advance(Duration::from_millis(100));
    assert_eq!(admitted(&limiter, &key, 5).await, 1);
}
