//! `Limiter::inspect` on any store: the same answers as memory, and nothing spent.

use std::time::Duration;

use tower_ratelimits::{
    BucketKey, Id, LimitSource, Limiter, LimiterError, Limits, ManualClock, Transaction,
};

/// Limits for [`inspection_reads_without_spending`]: a GCRA default with an override and an
/// unlimited id, a tiered limit and a concurrency limit.
pub const YAML: &str = "\
Api: {kind: account, burst: 3, count: 3, period: 1h}
Tiered:
  kind: account
  tiers:
    - {limit: 2, window: 1m, active: 1m, cooldown: 0s}
    - {limit: 5, window: 1h, active: 10m, cooldown: 1h}
Exports: {kind: account, concurrency: 2, lease: 10m}
";

/// The overrides beside [`YAML`].
pub const OVERRIDES: &str = "\
Api:42: {burst: 10, count: 10, period: 1h}
Api:43: {unlimited: true}
";

pub fn limits() -> Limits {
    Limits::from_yaml_str(YAML, Some(OVERRIDES)).unwrap()
}

/// Inspection on `limiter` (built over [`limits`], its store driven by `clock`): the limit in
/// force and its source, the bucket's numbers, and that inspecting spends nothing.
pub async fn inspection_reads_without_spending(limiter: &Limiter, clock: &ManualClock) {
    let key = |name: &str, id: u64| limiter.key(name, Id::from(id)).unwrap();
    let api = key("Api", 7);
    let fresh = limiter.inspect(&api).await.unwrap();
    assert_eq!(fresh.source, LimitSource::Default);
    assert_eq!(
        fresh.limit,
        limiter.limits().default_limit(api.name()).cloned()
    );
    assert_eq!((fresh.remaining, fresh.reset_after), (3, Duration::ZERO));
    let spend = |key: BucketKey| async move {
        let decided = limiter.spend(&[Transaction::new(key)]).await.unwrap();
        assert!(decided.allowed());
        decided
    };
    spend(api.clone()).await;
    spend(api.clone()).await;
    clock.advance(Duration::from_secs(5 * 60));
    for _ in 0..3 {
        let seen = limiter.inspect(&api).await.unwrap();
        assert_eq!(seen.remaining, 1, "inspecting spends nothing");
        // Two of 3 spent, one every 20 minutes back, 5 minutes gone: full in 35 minutes.
        assert_eq!(seen.reset_after, Duration::from_secs(35 * 60));
    }
    spend(api.clone()).await;
    let empty = limiter.inspect(&api).await.unwrap();
    assert_eq!(
        (empty.remaining, empty.reset_after),
        (0, Duration::from_secs(55 * 60))
    );

    // A denial (which a Redis deny cache remembers) changes nothing an inspection reads.
    let denied = limiter
        .spend(&[Transaction::new(api.clone())])
        .await
        .unwrap();
    assert!(!denied.allowed());
    assert_eq!(limiter.inspect(&api).await.unwrap(), empty);

    let vip = limiter.inspect(&key("Api", 42)).await.unwrap();
    assert_eq!((vip.source, vip.remaining), (LimitSource::Override, 10));
    let unlimited = limiter.inspect(&key("Api", 43)).await.unwrap();
    assert_eq!(
        (unlimited.source, unlimited.limit.as_ref()),
        (LimitSource::Override, None)
    );
    assert_eq!(
        (unlimited.remaining, unlimited.reset_after),
        (0, Duration::ZERO)
    );

    let tiered = key("Tiered", 7);
    spend(tiered.clone()).await;
    assert_eq!(limiter.inspect(&tiered).await.unwrap().remaining, 1);
    assert_eq!(limiter.inspect(&tiered).await.unwrap().remaining, 1);

    let exports = key("Exports", 7);
    let _held = spend(exports.clone()).await;
    assert_eq!(limiter.inspect(&exports).await.unwrap().remaining, 1);
    assert_eq!(limiter.inspect(&exports).await.unwrap().remaining, 1);

    let other = Limiter::new(
        Limits::from_yaml_str("Else: {burst: 1, count: 1, period: 1s}", None).unwrap(),
        tower_ratelimits::MemoryBackend::new(),
    );
    let unknown = other.key("Else", Id::from(1u64)).unwrap();
    assert!(matches!(
        limiter.inspect(&unknown).await,
        Err(LimiterError::UnknownName(_))
    ));
}
