//! Overrides set at run time, in memory: the limiter's API (precedence, block, unlimited,
//! expiry, validation, reloads) and the admin router over TCP (its JSON interface).

mod support;

use std::time::Duration;

use serde_json::json;
use support::admin::{FILE_OVERRIDES, LIMITS, every_shape_takes_an_override_of_its_own, instance};
use tower_ratelimits::{
    Limit, LimitSource, Limiter, Limits, ManualClock, MemoryBackend, OverrideError, OverrideKind,
    OverrideRefusal, Transaction,
};

const START_US: u64 = 1_767_225_600_000_000;

fn limiter(clock: &ManualClock) -> Limiter {
    let limits = Limits::from_yaml_str(LIMITS, Some(FILE_OVERRIDES)).unwrap();
    Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    )
}

fn gcra(burst: u64) -> OverrideKind {
    OverrideKind::Quota(
        Limit::new(burst, burst, Duration::from_secs(3600))
            .unwrap()
            .into(),
    )
}

/// A stored override wins over the file's, which wins over the default; removing it gives the
/// file's back; bucket state is kept across each change.
#[tokio::test]
async fn a_stored_override_wins_over_the_file_and_the_default() {
    let clock = ManualClock::new(START_US);
    let limiter = limiter(&clock);
    let filed = limiter.parse_key("PerClient", "filed").unwrap();
    let spend = |key| {
        let limiter = limiter.clone();
        async move {
            limiter
                .spend(&[Transaction::new(key)])
                .await
                .unwrap()
                .allowed()
        }
    };
    assert!(spend(filed.clone()).await);
    let seen = limiter.inspect(&filed).await.unwrap();
    assert_eq!((seen.source, seen.remaining), (LimitSource::Override, 3));

    limiter
        .set_override("PerClient", "filed", gcra(10), None)
        .await
        .unwrap();
    let seen = limiter.inspect(&filed).await.unwrap();
    // The 15 minutes the spend took (one of 4 per hour) stay taken: 7 of 10 per hour.
    assert_eq!(
        (seen.source, seen.remaining),
        (LimitSource::Store, 7),
        "what was spent stays spent"
    );
    assert_eq!(limiter.limits().stored_override_count(), 1);

    assert!(limiter.remove_override("PerClient", "filed").await.unwrap());
    assert!(!limiter.remove_override("PerClient", "filed").await.unwrap());
    let seen = limiter.inspect(&filed).await.unwrap();
    assert_eq!((seen.source, seen.remaining), (LimitSource::Override, 3));
    assert_eq!(limiter.limits().stored_override_count(), 0);
}

/// A block denies every request of its id with the block's end as `retry_after`, spends
/// nothing of the batch's other rules, and ends with its expiry; `unlimited` allows beyond the
/// default.
#[tokio::test]
async fn a_block_denies_until_it_ends_and_spends_nothing_else() {
    let clock = ManualClock::new(START_US);
    let limiter = limiter(&clock);
    limiter
        .set_override(
            "PerClient",
            "bad",
            OverrideKind::Block,
            Some(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let bad = limiter.parse_key("PerClient", "bad").unwrap();
    let slots = limiter.parse_key("Slots", "bad").unwrap();
    clock.advance(Duration::from_secs(600));
    let batch = [
        Transaction::new(bad.clone()),
        Transaction::new(slots.clone()),
    ];
    let denied = limiter.spend(&batch).await.unwrap();
    assert!(!denied.allowed());
    let d = denied.strictest().unwrap();
    assert_eq!(d.key(), &bad);
    assert_eq!(d.retry_after(), Duration::from_secs(3000));
    assert!(
        denied.decisions().iter().all(|d| d.lease().is_none()),
        "no slot was taken"
    );
    let seen = limiter.inspect(&slots).await.unwrap();
    assert_eq!(seen.remaining, 2, "the other rule spent nothing");
    let seen = limiter.inspect(&bad).await.unwrap();
    assert!(seen.blocked);
    assert_eq!((seen.source, seen.remaining), (LimitSource::Store, 0));
    assert_eq!(seen.reset_after, Duration::from_secs(3000));

    clock.advance(Duration::from_secs(3000));
    assert!(
        limiter
            .spend(&[Transaction::new(bad.clone())])
            .await
            .unwrap()
            .allowed(),
        "the block ended"
    );
    assert!(limiter.stored_overrides().await.unwrap().is_empty());

    // Without an expiry, a block says a day.
    limiter
        .set_override("PerClient", "worse", OverrideKind::Block, None)
        .await
        .unwrap();
    let worse = limiter.parse_key("PerClient", "worse").unwrap();
    let denied = limiter.spend(&[Transaction::new(worse)]).await.unwrap();
    assert_eq!(
        denied.strictest().unwrap().retry_after(),
        tower_ratelimits::BLOCK_WITHOUT_END
    );

    limiter
        .set_override("PerClient", "vip", OverrideKind::Unlimited, None)
        .await
        .unwrap();
    let vip = limiter.parse_key("PerClient", "vip").unwrap();
    for _ in 0..10 {
        assert!(
            limiter
                .spend(&[Transaction::new(vip.clone())])
                .await
                .unwrap()
                .allowed()
        );
    }
}

/// Bad input is refused with the reason, and nothing changes.
#[tokio::test]
async fn bad_overrides_are_refused_and_change_nothing() {
    let clock = ManualClock::new(START_US);
    let limiter = limiter(&clock);
    let e = limiter
        .set_override("Nope", "x", OverrideKind::Block, None)
        .await
        .unwrap_err();
    assert!(matches!(e, OverrideError::UnknownName(_)), "{e}");
    let e = limiter
        .set_override("PerRange", "not-an-address", OverrideKind::Block, None)
        .await
        .unwrap_err();
    assert!(matches!(e, OverrideError::InvalidId { .. }), "{e}");
    let e = limiter
        .set_override("Slots", "x", gcra(5), None)
        .await
        .unwrap_err();
    // Why, as a value a caller matches on: a GCRA limit for a concurrency limit's ids.
    assert!(
        matches!(
            &e,
            OverrideError::Refused {
                reason: OverrideRefusal::OtherShape {
                    limit: "a concurrency limit",
                    given: "a GCRA limit"
                },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("only unlimited, block"), "{e}");
    for expiry in [Duration::ZERO, Duration::from_secs(11 * 365 * 86_400)] {
        let e = limiter
            .set_override("PerClient", "x", OverrideKind::Block, Some(expiry))
            .await
            .unwrap_err();
        assert!(matches!(e, OverrideError::Expiry(_)), "{e}");
    }
    assert!(limiter.stored_overrides().await.unwrap().is_empty());
    assert_eq!(limiter.limits().stored_override_count(), 0);
}

/// A reload keeps the stored overrides; one for a limit the new limits lack stays stored and
/// applies again when a reload defines the limit.
#[tokio::test]
async fn stored_overrides_outlive_reloads() {
    let clock = ManualClock::new(START_US);
    let limiter = limiter(&clock);
    limiter
        .set_override("PerClient", "vip", gcra(50), None)
        .await
        .unwrap();
    let vip = limiter.parse_key("PerClient", "vip").unwrap();
    limiter
        .reload(Limits::from_yaml_str(LIMITS, None).unwrap())
        .unwrap();
    assert_eq!(limiter.inspect(&vip).await.unwrap().remaining, 50);
    limiter
        .reload(Limits::from_yaml_str("Other: {burst: 1, count: 1, period: 1s}", None).unwrap())
        .unwrap();
    assert_eq!(limiter.limits().stored_override_count(), 0);
    assert_eq!(limiter.stored_overrides().await.unwrap().len(), 1);
    limiter
        .reload(Limits::from_yaml_str(LIMITS, None).unwrap())
        .unwrap();
    let vip = limiter.parse_key("PerClient", "vip").unwrap();
    assert_eq!(
        limiter.inspect(&vip).await.unwrap().source,
        LimitSource::Store
    );
}

/// The admin router's interface, over TCP, as the issue writes it.
#[tokio::test]
async fn the_admin_router_speaks_the_documented_json() {
    // A manual clock: the bucket's `reset_after_ms` is read some time after the request that
    // spent from it (2 ms on a busy machine, once, in CI); with the clock still, it is exact.
    let clock = ManualClock::new(START_US);
    let node = instance(MemoryBackend::builder().clock(clock).build()).await;
    let (status, body) = node
        .put(
            "/overrides/PerClient/c1",
            r#"{"burst": 3, "count": 3, "period": "1h", "expires_in": "1h"}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let expires = body["expires_at_ms"].as_u64().unwrap();
    assert_eq!(
        body,
        json!({"limit": "PerClient", "id": "c1", "burst": 3, "count": 3, "period": "1h",
               "expires_at_ms": expires})
    );
    // An IPv6 range in one percent-encoded segment, answered in its canonical text.
    let (status, body) = node
        .put(
            "/overrides/PerRange/2001:db8::%2F48",
            r#"{"unlimited": true}"#,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"limit": "PerRange", "id": "2001:db8::/48", "unlimited": true, "expires_at_ms": null})
    );
    let (status, body) = node
        .put("/overrides/PerClient/c2", r#"{"block": true}"#)
        .await;
    assert_eq!((status, &body["block"]), (200, &json!(true)), "{body}");

    let (status, body) = node.get("/overrides").await;
    assert_eq!(status, 200);
    assert_eq!(body["overrides"].as_array().unwrap().len(), 3, "{body}");

    // Buckets: the limit in force, its source, what is left.
    assert_eq!(node.request("c1").await.status, 200);
    let (status, body) = node.get("/buckets/PerClient/c1").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"limit": "PerClient", "id": "c1", "source": "store", "burst": 3, "count": 3,
               "period": "1h", "remaining": 2, "reset_after_ms": 1_200_000})
    );
    let (_, body) = node.get("/buckets/PerClient/filed").await;
    assert_eq!(
        (&body["source"], &body["burst"]),
        (&json!("file"), &json!(4))
    );
    let (_, body) = node.get("/buckets/PerClient/nobody").await;
    assert_eq!(
        (&body["source"], &body["remaining"]),
        (&json!("default"), &json!(2))
    );
    let (_, body) = node.get("/buckets/PerClient/c2").await;
    assert_eq!(
        (&body["source"], &body["block"]),
        (&json!("store"), &json!(true)),
        "{body}"
    );
    let blocked = node.request("c2").await;
    assert_eq!(blocked.status, 429);
    assert_eq!(blocked.header("retry-after"), Some("86400"));

    // A reset fills the bucket.
    assert_eq!(node.delete("/buckets/PerClient/c1").await.0, 204);
    assert_eq!(
        node.get("/buckets/PerClient/c1").await.1["remaining"],
        json!(3)
    );

    // Deleting: 204, then 404.
    assert_eq!(node.delete("/overrides/PerClient/c2").await.0, 204);
    let (status, body) = node.delete("/overrides/PerClient/c2").await;
    assert_eq!(status, 404);
    assert!(body["error"].is_string());
    assert_eq!(node.request("c2").await.status, 200);

    // Bad input: 400 with the reason, and nothing changes.
    let before = node.listed().await;
    for (path, body, says) in [
        ("/overrides/Nope/x", r#"{"block": true}"#, "unknown limit"),
        (
            "/overrides/PerRange/nope",
            r#"{"block": true}"#,
            "invalid id",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"burst": 0, "count": 3, "period": "1h"}"#,
            "burst",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"burst": 3, "count": 0, "period": "1h"}"#,
            "count",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"burst": 3, "count": 3, "period": "soon"}"#,
            "period",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"block": true, "expires_in": "1 h"}"#,
            "expires_in",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"block": true, "expires_in": "0s"}"#,
            "expiry",
        ),
        ("/overrides/PerClient/x", r#"{"block": false}"#, "one of"),
        (
            "/overrides/PerClient/x",
            r#"{"block": true, "unlimited": true}"#,
            "one of",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"block": true, "colour": 1}"#,
            "one of",
        ),
        // A limit's fields are read as the file reads an entry: the file's errors.
        (
            "/overrides/PerClient/x",
            r#"{"colour": 1}"#,
            "unknown field \"colour\"",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"bursts": 3, "count": 3, "period": "1h"}"#,
            "did you mean `burst`",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"burst": 3, "count": 3, "period": "1h", "tiers": []}"#,
            "tiers",
        ),
        // The file's GCRA options a stored override would not keep: refused, not dropped.
        (
            "/overrides/PerClient/x",
            r#"{"burst": 3, "count": 3, "period": "1h", "max_debt": 5}"#,
            "unknown field \"max_debt\"",
        ),
        (
            "/overrides/PerClient/x",
            r#"{"burst": 3, "count": 3, "period": "1h", "prefetch": 2}"#,
            "unknown field \"prefetch\"",
        ),
        ("/overrides/PerClient/x", "{", "malformed"),
        (
            "/overrides/Slots/x",
            r#"{"burst": 3, "count": 3, "period": "1h"}"#,
            "GCRA",
        ),
    ] {
        let (status, reply) = node.put(path, body).await;
        assert_eq!(status, 400, "{path} {body}: {reply}");
        let error = reply["error"].as_str().unwrap();
        assert!(error.contains(says), "{path} {body}: {error}");
    }
    assert_eq!(node.get("/buckets/Nope/x").await.0, 400);
    assert_eq!(node.get("/buckets/PerRange/nope").await.0, 400);
    assert_eq!(node.delete("/overrides/Nope/x").await.0, 400);
    assert_eq!(node.listed().await, before);
}

/// Tiers and concurrency limits take stored overrides of their own shape, as GCRA limits and
/// calendar quotas do (they were refused with 400 before `OverrideKind::Quota`).
#[tokio::test]
async fn every_shape_takes_a_stored_override_of_its_own_shape() {
    let node = instance(MemoryBackend::new()).await;
    every_shape_takes_an_override_of_its_own(&node, &node, Duration::ZERO).await;
}

/// The in-memory store's cap: a new override past `max_overrides` is refused (nothing
/// changes), one replacing a stored one is taken.
#[tokio::test]
async fn the_memory_store_refuses_a_new_override_past_its_cap() {
    let clock = ManualClock::new(START_US);
    let limits = Limits::from_yaml_str(LIMITS, Some(FILE_OVERRIDES)).unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder()
            .clock(clock.clone())
            .max_overrides(1)
            .build(),
    );
    limiter
        .set_override("PerClient", "a", gcra(5), None)
        .await
        .unwrap();
    let err = limiter
        .set_override("PerClient", "b", gcra(5), None)
        .await
        .unwrap_err();
    assert!(matches!(err, OverrideError::TooMany { max: 1 }), "{err:?}");
    limiter
        .set_override("PerClient", "a", OverrideKind::Unlimited, None)
        .await
        .unwrap();
    assert_eq!(limiter.limits().stored_override_count(), 1);
}
