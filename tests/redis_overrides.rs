//! Overrides set at run time, on a real Redis and a real cluster: two app instances, each with
//! its own connections and its admin router on real TCP ports. A change made through one
//! applies on the other within two seconds (polled with a deadline), blocks and expiries hold
//! on both, a reset reaches the other's deny cache, bad input changes nothing, and with Redis
//! down the last overrides stay in force while the admin API answers 503.

mod support;

use std::time::Duration;

use fred::prelude::LuaInterface;
use serde_json::json;
use support::admin::{Instance, every_shape_takes_an_override_of_its_own, instance, within};
use support::redis::{RedisServer, TestRedis, unique_prefix};
use support::redis_backend::backend;
use tower_ratelimits::RedisBackend;

/// The issue's promise: every instance applies a change within two seconds.
const TWO_SECONDS: Duration = Duration::from_secs(2);

async fn source_on(node: &Instance, id: &str) -> Result<serde_json::Value, String> {
    let (status, body) = node.get(&format!("/buckets/PerClient/{id}")).await;
    if status == 200 {
        Ok(body)
    } else {
        Err(format!("{status} {body}"))
    }
}

async fn blocked_on(node: &Instance, id: &str) -> Result<(), String> {
    let v = source_on(node, id).await?;
    (v["block"] == json!(true))
        .then_some(())
        .ok_or(v.to_string())
}

async fn status_on(node: &Instance, id: &str, want: u16) -> Result<support::http::Reply, String> {
    let r = node.request(id).await;
    if r.status == want {
        Ok(r)
    } else {
        Err(format!("{} {}", r.status, r.body))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_through_one_instance_applies_on_the_other() {
    for redis in TestRedis::each() {
        let prefix = unique_prefix("overrides");
        let a = instance(backend(&redis.url, &prefix).await).await;
        let b = instance(backend(&redis.url, &prefix).await).await;

        // c1 is denied on b: b's deny cache remembers it.
        for _ in 0..2 {
            assert_eq!(b.request("c1").await.status, 200);
        }
        assert_eq!(b.request("c1").await.status, 429);

        // Raised through a (a larger burst at the same rate: the hour c1 spent stays spent):
        // b applies it (inspection says so) and lets c1 through.
        let (status, body) = a
            .put(
                "/overrides/PerClient/c1",
                r#"{"burst": 10, "count": 2, "period": "1h"}"#,
            )
            .await;
        assert_eq!(status, 200, "{body}");
        within(TWO_SECONDS, "b applies the raised limit", || async {
            let v = source_on(&b, "c1").await?;
            (v["source"] == json!("store") && v["burst"] == json!(10))
                .then_some(())
                .ok_or(v.to_string())
        })
        .await;
        assert_eq!(
            b.request("c1").await.status,
            200,
            "the deny cache forgot c1"
        );

        // A block through a: b denies with the block's Retry-After.
        let (status, body) = a
            .put(
                "/overrides/PerClient/c2",
                r#"{"block": true, "expires_in": "1h"}"#,
            )
            .await;
        assert_eq!(status, 200, "{body}");
        // Polled by inspection (a request before the block arrived would spend c2's tokens).
        within(TWO_SECONDS, "b applies the block", || blocked_on(&b, "c2")).await;
        let denied = b.request("c2").await;
        assert_eq!(denied.status, 429);
        let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
        assert!((3595..=3600).contains(&retry), "Retry-After {retry}");
        let (_, v) = b.get("/buckets/PerClient/c2").await;
        assert_eq!((&v["source"], &v["block"]), (&json!("store"), &json!(true)));

        // A short block ends on both, and leaves the store.
        let (status, _) = a
            .put(
                "/overrides/PerClient/c3",
                r#"{"block": true, "expires_in": "1s"}"#,
            )
            .await;
        assert_eq!(status, 200);
        within(TWO_SECONDS, "b applies the short block", || {
            blocked_on(&b, "c3")
        })
        .await;
        within(Duration::from_secs(5), "the short block ends on b", || {
            status_on(&b, "c3", 200)
        })
        .await;
        within(
            Duration::from_secs(5),
            "the ended block leaves the store",
            || async {
                let listed = a.listed().await;
                (!listed.iter().any(|(_, id)| id == "c3"))
                    .then_some(())
                    .ok_or(format!("{listed:?}"))
            },
        )
        .await;

        // Deleted through b: a goes back to the default.
        assert_eq!(
            a.get("/buckets/PerClient/c1").await.1["source"],
            json!("store")
        );
        assert_eq!(b.delete("/overrides/PerClient/c1").await.0, 204);
        assert_eq!(b.delete("/overrides/PerClient/c1").await.0, 404);
        within(TWO_SECONDS, "a drops the deleted override", || async {
            let v = source_on(&a, "c1").await?;
            (v["source"] == json!("default"))
                .then_some(())
                .ok_or(v.to_string())
        })
        .await;

        // A reset through a reaches b's deny cache.
        for _ in 0..2 {
            assert_eq!(b.request("c4").await.status, 200);
        }
        assert_eq!(b.request("c4").await.status, 429);
        assert_eq!(b.request("c4").await.status, 429, "denied from b's cache");
        assert_eq!(a.delete("/buckets/PerClient/c4").await.0, 204);
        within(TWO_SECONDS, "b forgets c4's denial", || {
            status_on(&b, "c4", 200)
        })
        .await;

        // Bad input: 400, and nothing changes anywhere.
        let before = a.listed().await;
        for (path, body) in [
            ("/overrides/Nope/x", r#"{"block": true}"#),
            (
                "/overrides/PerClient/x",
                r#"{"burst": 0, "count": 1, "period": "1h"}"#,
            ),
            (
                "/overrides/PerClient/x",
                r#"{"block": true, "expires_in": "later"}"#,
            ),
            ("/overrides/PerRange/nope", r#"{"block": true}"#),
            ("/overrides/PerClient/x", "not json"),
        ] {
            assert_eq!(a.put(path, body).await.0, 400, "{path} {body}");
        }
        assert_eq!(a.listed().await, before);
        assert_eq!(b.listed().await, before);
        assert_eq!(b.request("x").await.status, 200);
    }
}

/// Tiers and concurrency limits take stored overrides of their own shape: put through one
/// instance, in force on the other, on a real Redis and a real cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_takes_a_stored_override_applied_on_every_instance() {
    for redis in TestRedis::each() {
        let prefix = unique_prefix("overrides-shapes");
        let a = instance(backend(&redis.url, &prefix).await).await;
        let b = instance(backend(&redis.url, &prefix).await).await;
        every_shape_takes_an_override_of_its_own(&a, &b, TWO_SECONDS).await;
    }
}

/// With Redis down, the overrides last read stay in force (a block still denies, an unlimited
/// id is still let through by the override, not by the failure policy) and the admin API
/// answers 503 for what needs the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_the_last_overrides_stay_in_force() {
    let mut server = RedisServer::start();
    let prefix = unique_prefix("overrides-down");
    let a = instance(backend(&server.url(), &prefix).await).await;
    let b = instance(backend(&server.url(), &prefix).await).await;
    assert_eq!(
        a.put("/overrides/PerClient/bad", r#"{"block": true}"#)
            .await
            .0,
        200
    );
    assert_eq!(
        a.put("/overrides/PerClient/vip", r#"{"unlimited": true}"#)
            .await
            .0,
        200
    );
    within(TWO_SECONDS, "b applies both", || async {
        let listed = b.limiter.limits().stored_override_count();
        (listed == 2).then_some(()).ok_or(listed.to_string())
    })
    .await;
    server.kill();
    for node in [&a, &b] {
        assert_eq!(node.request("bad").await.status, 429);
        for _ in 0..5 {
            assert_eq!(node.request("vip").await.status, 200);
        }
        let (status, body) = node
            .put("/overrides/PerClient/new", r#"{"block": true}"#)
            .await;
        assert_eq!(status, 503, "{body}");
        assert!(body["error"].as_str().unwrap().contains("store"), "{body}");
        assert_eq!(node.get("/overrides").await.0, 503);
        assert_eq!(node.delete("/overrides/PerClient/bad").await.0, 503);
        assert_eq!(node.delete("/buckets/PerClient/bad").await.0, 503);
        assert_eq!(node.limiter.limits().stored_override_count(), 2);
    }
}

/// A block among a request's rules on Redis: the other rules are only checked (nothing spent,
/// no slot taken) while the store answers for them, and the block's denial joins their
/// outcomes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_beside_other_rules_spends_nothing_on_redis() {
    use tower_ratelimits::{OverrideKind, Transaction};
    for redis in TestRedis::each() {
        let prefix = unique_prefix("overrides-batch");
        let node = instance(backend(&redis.url, &prefix).await).await;
        let limiter = &node.limiter;
        limiter
            .set_override(
                "PerClient",
                "bad",
                OverrideKind::Block,
                Some(Duration::from_secs(600)),
            )
            .await
            .unwrap();
        let bad = limiter.parse_key("PerClient", "bad").unwrap();
        let slots = limiter.parse_key("Slots", "bad").unwrap();
        let range = limiter.parse_key("PerRange", "2001:db8::/48").unwrap();
        let batch = [
            Transaction::new(range.clone()),
            Transaction::new(bad.clone()),
            Transaction::new(slots.clone()),
        ];
        let denied = limiter.spend(&batch).await.unwrap();
        assert!(!denied.allowed());
        let strictest = denied.strictest().unwrap();
        assert_eq!(strictest.key(), &bad);
        assert!((595..=600).contains(&strictest.retry_after().as_secs()));
        assert!(denied.decisions().iter().all(|d| d.lease().is_none()));
        assert_eq!(limiter.inspect(&slots).await.unwrap().remaining, 2);
        assert_eq!(limiter.inspect(&range).await.unwrap().remaining, 2);
    }
}

/// Runs `script` on the node of `key` (what another program could write there).
async fn raw(backend: &RedisBackend, key: &str, script: &str, args: Vec<String>) {
    backend
        .client_for_key(key)
        .unwrap()
        .eval::<fred::prelude::Value, _, _, _>(script, vec![key.to_owned()], args)
        .await
        .unwrap();
}

/// Foreign data in the override hash is skipped (with the valid entries beside it applied),
/// and a foreign type at its key makes the admin API answer 503 while requests go on under
/// the overrides last known.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_data_in_the_store_is_skipped_or_refused_never_applied() {
    for redis in TestRedis::each() {
        let prefix = unique_prefix("overrides-foreign");
        let hash = format!("{prefix}{{overrides}}");
        let seed = backend(&redis.url, &prefix).await;
        let hset = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])";
        for (field, value) in [
            ("garbage", "not json"),
            // Valid, but filed under another bucket's name.
            (
                "PerClient:other",
                r#"{"v":1,"limit":"PerClient","id":"moved","block":true}"#,
            ),
            // A later version this crate does not know.
            (
                "PerClient:future",
                r#"{"v":2,"limit":"PerClient","id":"future","block":true}"#,
            ),
            // What this crate writes: applied.
            (
                "PerClient:bad",
                r#"{"v":1,"limit":"PerClient","id":"bad","block":true}"#,
            ),
        ] {
            raw(&seed, &hash, hset, vec![field.into(), value.into()]).await;
        }
        let node = instance(backend(&redis.url, &prefix).await).await;
        assert_eq!(
            node.listed().await,
            [("PerClient".to_owned(), "bad".to_owned())]
        );
        assert_eq!(node.request("bad").await.status, 429);
        for id in ["moved", "future", "other"] {
            assert_eq!(node.request(id).await.status, 200, "{id}");
        }

        raw(
            &seed,
            &hash,
            "redis.call('DEL', KEYS[1]) redis.call('SET', KEYS[1], 'x')",
            vec![],
        )
        .await;
        let (status, body) = node.get("/overrides").await;
        assert_eq!(status, 503, "{body}");
        let (status, body) = node
            .put("/overrides/PerClient/new", r#"{"block": true}"#)
            .await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(node.request("bad").await.status, 429, "the last known stay");
        assert_eq!(node.request("new").await.status, 200);
    }
}

/// After the store lost its data (`FLUSHALL`, a restart without
/// persistence), every instance follows the store, not the list it held. Before, an instance
/// applied only a read whose version was at least the highest it had seen, and the store's
/// counter started again at 0: a block set before the loss could not be lifted (`DELETE` 404,
/// `PUT {"unlimited": true}` through one instance applied on that one only, the other still
/// answered 429 forty seconds later). Now the store's epoch changes with its life: each
/// instance reads it again, drops what it no longer holds (with a warning), and applies what
/// is set after.
async fn a_store_that_lost_its_data_is_followed(url: &str, flush: &dyn Fn(), what: &str) {
    let prefix = unique_prefix("overrides-lost");
    let a = instance(backend(url, &prefix).await).await;
    let b = instance(backend(url, &prefix).await).await;
    assert_eq!(
        a.put(
            "/overrides/PerClient/c1",
            r#"{"block": true, "expires_in": "1h"}"#
        )
        .await
        .0,
        200
    );
    within(TWO_SECONDS, "b applies the block", || blocked_on(&b, "c1")).await;
    assert_eq!(b.request("c1").await.status, 429);
    for _ in 0..3 {
        assert!(
            a.put("/overrides/PerClient/other", r#"{"unlimited": true}"#)
                .await
                .0
                == 200
        );
    }

    flush();
    // Within a reconcile or two (and a reconnect), both follow the empty store: c1 passes.
    for node in [&a, &b] {
        within(
            Duration::from_secs(10),
            &format!("{what}: the block goes"),
            || async {
                let v = source_on(node, "c1").await?;
                (v["source"] != json!("store"))
                    .then_some(())
                    .ok_or(v.to_string())
            },
        )
        .await;
        assert_eq!(node.limiter.limits().stored_override_count(), 0, "{what}");
    }
    assert_eq!(b.request("c1").await.status, 200, "{what}");
    // Changes after the loss reach every instance (the version starts again, under a new
    // epoch).
    let (status, body) = a.put("/overrides/PerClient/c1", r#"{"block": true}"#).await;
    assert_eq!(status, 200, "{what}: {body}");
    within(
        TWO_SECONDS,
        &format!("{what}: b applies the new block"),
        || blocked_on(&b, "c1"),
    )
    .await;
    let (status, body) = b.delete("/overrides/PerClient/c1").await;
    assert_eq!(status, 204, "{what}: {body}");
    within(TWO_SECONDS, &format!("{what}: a lifts it"), || async {
        let v = source_on(&a, "c1").await?;
        (v["source"] != json!("store"))
            .then_some(())
            .ok_or(v.to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_its_data_is_followed_by_every_instance() {
    // A single server flushed, then one restarted on its port without persistence.
    let server = std::sync::Mutex::new(RedisServer::start());
    let port = server.lock().unwrap().port;
    let url = server.lock().unwrap().url();
    let flushall = || {
        support::redis::command(port, "FLUSHALL").unwrap();
    };
    a_store_that_lost_its_data_is_followed(&url, &flushall, "FLUSHALL").await;
    let restart = || {
        let mut s = server.lock().unwrap();
        s.kill();
        *s = RedisServer::start_on(port, &[]);
    };
    a_store_that_lost_its_data_is_followed(&url, &restart, "a restart").await;
    // A cluster flushed on every master.
    let cluster = support::redis::RedisCluster::start();
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let flush_all = || {
        for p in &ports {
            support::redis::command(*p, "FLUSHALL").unwrap();
        }
    };
    a_store_that_lost_its_data_is_followed(&cluster.url(), &flush_all, "the cluster").await;
}

/// A change costs the store what it changes, not what it holds. With 5,000
/// overrides stored and three instances (two apps and the backend that filled the store), one
/// change is one script call, read back by each of the other two instances with one `HMGET`
/// of the one field it names (the one that made it has it): no command reads the whole hash
/// (before, every instance ran `HGETALL` on every change: 145 ms of Redis each at 200,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_costs_the_store_what_it_changes() {
    let server = RedisServer::start();
    let prefix = unique_prefix("overrides-cost");
    let seed = backend(&server.url(), &prefix).await;
    let hash = format!("{prefix}{{overrides}}");
    // 5,000 blocks, written straight into the hash (as a store of that size holds them).
    let fill = "for i = 1, 5000 do redis.call('HSET', KEYS[1], 'PerClient:f' .. i, \
        '{\"v\":1,\"limit\":\"PerClient\",\"id\":\"f' .. i .. '\",\"block\":true}') end";
    raw(&seed, &hash, fill, vec![]).await;
    let a = instance(backend(&server.url(), &prefix).await).await;
    let b = instance(backend(&server.url(), &prefix).await).await;
    for node in [&a, &b] {
        assert_eq!(node.limiter.limits().stored_override_count(), 5_000);
        assert_eq!(node.request("f17").await.status, 429);
    }
    let stat = |name| support::redis_backend::commandstat(server.port, name);
    let whole = || stat("hgetall") + stat("hscan") + stat("hkeys") + stat("hvals");
    let (whole_before, hmget_before) = (whole(), stat("hmget"));
    let (status, body) = a.put("/overrides/PerClient/c9", r#"{"block": true}"#).await;
    assert_eq!(status, 200, "{body}");
    within(TWO_SECONDS, "b applies the change", || blocked_on(&b, "c9")).await;
    // Let a few reconciles pass: they read the version, never the hash.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(whole() - whole_before, 0, "no read of the whole hash");
    let hmgets = stat("hmget") - hmget_before;
    // One per instance told; on a busy machine an instance's reconcile may find the new
    // version before its notification arrives and read the field once more (never the hash).
    assert!(
        (1..=4).contains(&hmgets),
        "{hmgets} HMGETs: one per instance told, at most twice"
    );
    assert_eq!(b.limiter.limits().stored_override_count(), 5_001);
}

/// The cap: a store holds at most `max_overrides`; a new one past it is refused with 507 and
/// a clear error on every instance (the change itself checks the store's size), while one
/// replacing an override already stored is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_refuses_a_new_override_with_507() {
    for redis in TestRedis::each() {
        let prefix = unique_prefix("overrides-cap");
        let capped = || async {
            tower_ratelimits::RedisBackend::from_url(&redis.url)
                .prefix(&prefix)
                .max_overrides(2)
                .command_timeout(Duration::from_secs(2))
                .connect()
                .await
                .unwrap()
        };
        let a = instance(capped().await).await;
        let b = instance(capped().await).await;
        for id in ["one", "two"] {
            let (status, body) = a
                .put(&format!("/overrides/PerClient/{id}"), r#"{"block": true}"#)
                .await;
            assert_eq!(status, 200, "{body}");
        }
        let (status, body) = b
            .put("/overrides/PerClient/three", r#"{"block": true}"#)
            .await;
        assert_eq!(status, 507, "{body}");
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("most overrides (2)"),
            "{body}"
        );
        let (status, body) = b
            .put("/overrides/PerClient/two", r#"{"unlimited": true}"#)
            .await;
        assert_eq!(status, 200, "replacing one is taken: {body}");
        assert!(!a.listed().await.iter().any(|(_, id)| id == "three"));
    }
}

/// A fresh instance never decides an overridden id without its override.
/// 200,000 stored blocks: `connect` returns once they are read whole (it returned after 2 s,
/// and an instance serving while it read admitted blocked ids), so the last one written is
/// refused on the first request and the instance says it is ready. A lazy backend whose store
/// is down at start is not ready, and its spends fail (the layer's failure policy answers
/// them) until its first read, in the background, once the store is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_instance_decides_no_request_before_it_read_every_override() {
    let server = RedisServer::start();
    let prefix = unique_prefix("overrides-fresh");
    let seed = backend(&server.url(), &prefix).await;
    let hash = format!("{prefix}{{overrides}}");
    // In calls of 10,000 fields: one call of 200,000 outlasts the command timeout on a busy
    // machine.
    let fill = "local from = tonumber(ARGV[1]) for i = from, from + 9999 do \
        redis.call('HSET', KEYS[1], 'PerClient:f' .. i, \
        '{\"v\":1,\"limit\":\"PerClient\",\"id\":\"f' .. i .. '\",\"block\":true}') end";
    for from in (1..=200_000).step_by(10_000) {
        raw(&seed, &hash, fill, vec![from.to_string()]).await;
    }
    let fresh = instance(backend(&server.url(), &prefix).await).await;
    assert!(fresh.limiter.is_ready());
    assert_eq!(fresh.limiter.limits().stored_override_count(), 200_000);
    for id in ["f1", "f100000", "f200000"] {
        assert_eq!(fresh.request(id).await.status, 429, "{id}");
    }

    // Lazy, with the store up: `connect` returns at once, and a spend made before the read is
    // done waits for it and is decided with the blocks (it failed before, and the layer's
    // failure policy answered it).
    let lazy = RedisBackend::from_url(server.url())
        .prefix(&prefix)
        .lazy(true)
        .connect()
        .await
        .unwrap();
    let limits = tower_ratelimits::Limits::from_yaml_str(support::admin::LIMITS, None).unwrap();
    let limiter = tower_ratelimits::Limiter::new(limits, lazy);
    assert!(!limiter.is_ready(), "200,000 blocks are not read at once");
    let blocked = limiter.parse_key("PerClient", "f200000").unwrap();
    let decision = limiter
        .spend(&[tower_ratelimits::Transaction::new(blocked)])
        .await
        .expect("decided once the overrides are read");
    assert!(!decision.allowed(), "the block is applied");
    assert!(limiter.is_ready());

    // Lazy, with the store down at start: not ready, and a spend fails, until it is up and read.
    let port = support::redis::free_port();
    let lazy = RedisBackend::from_url(format!("redis://127.0.0.1:{port}"))
        .prefix(&prefix)
        .lazy(true)
        .command_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let limits = tower_ratelimits::Limits::from_yaml_str(support::admin::LIMITS, None).unwrap();
    let limiter = tower_ratelimits::Limiter::new(limits, lazy);
    assert!(!limiter.is_ready());
    let key = limiter.parse_key("PerClient", "f7").unwrap();
    let tx = || [tower_ratelimits::Transaction::new(key.clone())];
    assert!(matches!(
        limiter.spend(&tx()).await,
        Err(tower_ratelimits::LimiterError::Backend(
            tower_ratelimits::BackendError::Unavailable(_)
        ))
    ));
    let _late = RedisServer::start_on(port, &[]);
    // Another store (empty) on the same address: read whole once it answers.
    within(
        Duration::from_secs(10),
        "the lazy backend is ready",
        || async { limiter.is_ready().then_some(()).ok_or("not yet".to_owned()) },
    )
    .await;
    assert!(limiter.spend(&tx()).await.unwrap().allowed());
}
