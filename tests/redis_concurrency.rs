//! Concurrency limits on Redis: leases in a sorted set per key, shared by every instance.

mod support;

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::KeysInterface;
use support::redis::{TestRedis, unique_prefix};
use tower_ratelimits::{
    BucketKey, Id, Limiter, Limits, ManualClock, MemoryBackend, Mode, Transaction,
};

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../simulator/src/trace.rs"]
mod simulate;
use support::redis_backend::{backend, caller_time_backend};
use tower_ratelimits::RedisBackend;

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
async fn concurrency_is_shared_by_instances_on_each_redis() {
    for redis in TestRedis::each() {
        concurrency_is_shared_by_instances(&redis.url).await;
    }
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
    assert_eq!(after.decisions()[0].remaining(), 1);
    assert_eq!(live_leases(&backend, &set).await, 1);
}

#[tokio::test]
async fn a_killed_instances_leases_expire_on_each_redis() {
    for redis in TestRedis::each() {
        a_killed_instances_leases_expire(&redis.url).await;
    }
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
    let mut next = support::xorshift(0x2545_f491_4f6c_dd1d);
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
                        d.allowed(),
                        d.remaining(),
                        d.retry_after(),
                        d.granted(),
                        d.lease_id().is_some(),
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
async fn concurrency_decides_as_memory_does_on_each_redis() {
    for redis in TestRedis::each() {
        concurrency_conforms(&redis.url).await;
    }
}

/// Leases the crate could not have written (deadlines at 10^18: another program's data) are cut
/// to one lease from now: they hold their slots for one lease time, then end; never for ever
/// (before the foreign rule: centuries) and never nothing (after it, until this change: the key
/// admitted three more at once). The cut is written, so it ends on time.
async fn foreign_leases_are_cut_to_one_lease(url: &str) {
    use fred::interfaces::ClientLike;
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(url, &unique_prefix("foreign-leases"), &clock, false).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    // Brief: 2 slots, a lease of 10 s.
    let key = limiter.parse_key("Brief", "7").unwrap();
    let redis_key = backend.redis_concurrency_key(&key);
    let zadd =
        fred::types::CustomCommand::new_static("ZADD", fred::types::ClusterHash::FirstKey, false);
    let client = backend.client_for_key(&redis_key).unwrap();
    let _: i64 = client
        .custom(
            zadd,
            vec![
                redis_key.clone(),
                "1e18".into(),
                "a".into(),
                "1e18".into(),
                "b".into(),
            ],
        )
        .await
        .unwrap();
    let one = [Transaction::new(key.clone())];
    let spend = || limiter.spend(&one);
    assert!(
        !spend().await.unwrap().allowed(),
        "the two foreign leases hold both slots"
    );
    let zscore =
        fred::types::CustomCommand::new_static("ZSCORE", fred::types::ClusterHash::FirstKey, false);
    let score: String = client
        .custom(zscore, vec![redis_key.clone(), "a".into()])
        .await
        .unwrap();
    assert_eq!(
        score.parse::<u64>().unwrap(),
        simulate::EPOCH_US + 10_000_000,
        "cut to one lease from now, and stored so"
    );
    clock.advance(Duration::from_micros(9_999_999));
    assert!(
        !spend().await.unwrap().allowed(),
        "held until the lease ends"
    );
    clock.advance(Duration::from_micros(1));
    for _ in 0..2 {
        assert!(spend().await.unwrap().allowed(), "ended at one lease time");
    }
    assert!(!spend().await.unwrap().allowed());
    assert_eq!(live_leases(&backend, &redis_key).await, 2, "ours");
}

#[tokio::test]
async fn foreign_leases_are_cut_to_one_lease_on_each_redis() {
    foreign_leases_are_cut_to_one_lease(&TestRedis::single().url).await;
    foreign_leases_are_cut_to_one_lease(&TestRedis::cluster().url).await;
}

/// A renewal on Redis moves a live lease's deadline (the script's renew), never takes a slot
/// back once the lease ended or was released, and decides as memory does.
async fn leases_are_renewed_by_the_script(url: &str) {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let backend = caller_time_backend(url, &unique_prefix("renew"), &clock, false).await;
    let limiter = Limiter::new(
        Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap(),
        backend.clone(),
    );
    let key = limiter.parse_key("Brief", "7").unwrap();
    let tx = || Transaction::new(key.clone());
    let mut leases = Vec::new();
    for _ in 0..2 {
        let batch = limiter.spend(&[tx()]).await.unwrap();
        leases.extend(batch.decisions().iter().filter_map(|d| d.lease()));
    }
    // Brief: 2 slots, a lease of 10 s. Renewed at 9 s, both still hold at 18 s.
    clock.advance(Duration::from_secs(9));
    assert_eq!(limiter.renew(&leases).await.unwrap(), 2);
    clock.advance(Duration::from_secs(9));
    assert!(
        !limiter.check(&[tx()]).await.unwrap().allowed(),
        "both held at 18 s"
    );
    // One released: renewing it takes nothing back; the other one is renewed.
    assert_eq!(limiter.release(&leases[..1]).await.unwrap(), 1);
    assert_eq!(limiter.renew(&leases).await.unwrap(), 1);
    assert_eq!(
        live_leases(&backend, &backend.redis_concurrency_key(&key)).await,
        1
    );
    // Not renewed again: it ends 10 s after its last renewal, and a renewal then is nothing.
    clock.advance(Duration::from_secs(10));
    assert_eq!(limiter.renew(&leases).await.unwrap(), 0);
    assert_eq!(
        live_leases(&backend, &backend.redis_concurrency_key(&key)).await,
        0
    );
}

#[tokio::test]
async fn leases_are_renewed_by_the_script_on_each_redis() {
    leases_are_renewed_by_the_script(&TestRedis::single().url).await;
    leases_are_renewed_by_the_script(&TestRedis::cluster().url).await;
}

/// A reset of a concurrency key (the admin API's `DELETE /buckets/...`) keeps
/// the leases of requests in flight. With 3 slow requests holding a limit of 3, a reset lets no
/// fourth in (before: 3 more, 6 in flight): a reset forgets what a key spent, never requests
/// still running, which end by themselves. Inspection reports the limit's slots (3; before it
/// said `"burst": 1`) and none free; when the requests end, the key admits again.
async fn a_reset_keeps_the_requests_in_flight(backend: impl tower_ratelimits::Backend, what: &str) {
    use axum::{Router, routing::get};
    use support::http::HttpClient;
    use tower_ratelimits::{Header, RateLimitLayer, Rule, admin_router};
    let limiter = Limiter::new(
        Limits::from_yaml_str(CONCURRENCY_LIMITS, None).unwrap(),
        backend,
    );
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Exports", Header::new("x-account")))
        .build()
        .unwrap();
    let gate = support::gate::Gate::new();
    let held = gate.clone();
    let app = support::http::serve(
        Router::new()
            .route(
                "/slow",
                get(move || {
                    let gate = held.clone();
                    async move {
                        gate.pass().await;
                        "done"
                    }
                }),
            )
            .layer(layer),
    )
    .await;
    let admin = support::http::serve(admin_router(limiter.clone())).await;
    let (app, admin_client) = (Arc::new(HttpClient::new(&app)), HttpClient::new(&admin));
    let mut slow = Vec::new();
    for _ in 0..3 {
        let app = app.clone();
        slow.push(tokio::spawn(async move {
            app.get("/slow", &[("x-account", "7")]).await.status
        }));
    }
    gate.entered(3).await;
    let reset = admin_client
        .request(http::Method::DELETE, "/buckets/Exports/7", &[])
        .await;
    assert_eq!(reset.status, 204, "{what}");
    // Three more would make six in flight: each is refused at once (one let in would wait
    // at the gate: the timeout says so).
    for _ in 0..3 {
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            app.get("/slow", &[("x-account", "7")]),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: a reset let a fourth request in (it is running)"));
        assert_eq!(refused.status, 429, "{what}");
    }
    let inspected = admin_client.get("/buckets/Exports/7", &[]).await;
    let v: serde_json::Value = serde_json::from_str(&inspected.body).unwrap();
    assert_eq!(
        (&v["kind"], &v["concurrency"], &v["lease"], &v["remaining"]),
        (
            &serde_json::json!("concurrency"),
            &serde_json::json!(3),
            &serde_json::json!("1h"),
            &serde_json::json!(0)
        ),
        "{what}: {v}"
    );
    assert!(v.get("burst").is_none(), "{what}: {v}");
    gate.open(3);
    for s in slow {
        assert_eq!(s.await.unwrap(), 200, "{what}");
    }
    // Ended: the key admits again (one held at the gate, let through).
    let app2 = app.clone();
    let again = tokio::spawn(async move { app2.get("/slow", &[("x-account", "7")]).await.status });
    gate.entered(4).await;
    gate.open(1);
    assert_eq!(again.await.unwrap(), 200, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_keeps_the_requests_in_flight_on_every_store() {
    a_reset_keeps_the_requests_in_flight(MemoryBackend::new(), "memory").await;
    for (what, redis) in [
        ("a single Redis", TestRedis::single()),
        ("the cluster", TestRedis::cluster()),
    ] {
        let b = backend(&redis.url, &unique_prefix("reset-leases")).await;
        a_reset_keeps_the_requests_in_flight(b, what).await;
    }
}

/// On Redis: slots taken before and after a reload of the count and the
/// lease time are renewed in one call that names the key once, under the newest lease's limit
/// (every deadline moves to now plus the new lease time), within a bound that turns a hang into
/// a failure.
#[tokio::test]
async fn slots_held_across_a_reload_are_renewed_on_each_redis() {
    for redis in TestRedis::each() {
        let prefix = unique_prefix("reload-renew");
        let (backend, limiter) = support::redis_backend::limiter_on(
            &redis.url,
            &prefix,
            "Slots: {kind: account, concurrency: 3, lease: 1h}\n",
        )
        .await;
        let key = limiter.key("Slots", Id::from(7u64)).unwrap();
        let spend = || async {
            let d = limiter
                .spend(&[Transaction::new(key.clone())])
                .await
                .unwrap();
            assert!(d.allowed());
            d.decisions()[0].lease().unwrap()
        };
        let mut leases = Vec::new();
        for _ in 0..3 {
            leases.push(spend().await);
        }
        limiter
            .reload(
                Limits::from_yaml_str("Slots: {kind: account, concurrency: 5, lease: 2h}\n", None)
                    .unwrap(),
            )
            .unwrap();
        for _ in 0..2 {
            leases.push(spend().await);
        }
        let renewed = tokio::time::timeout(Duration::from_secs(30), limiter.renew(&leases))
            .await
            .expect("the renewal hung")
            .unwrap();
        assert_eq!(renewed, 5);
        let set = backend.redis_concurrency_key(&key);
        use fred::interfaces::ClientLike;
        let zrange = fred::types::CustomCommand::new_static(
            "ZRANGE",
            fred::types::ClusterHash::FirstKey,
            false,
        );
        let scores: Vec<String> = backend
            .client_for_key(&set)
            .unwrap()
            .custom(zrange, vec![set.as_str(), "0", "-1", "WITHSCORES"])
            .await
            .unwrap();
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as f64;
        let deadlines: Vec<f64> = scores
            .iter()
            .skip(1)
            .step_by(2)
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(deadlines.len(), 5);
        for d in deadlines {
            assert!(
                d > now_us + 3_600e6,
                "every lease now runs 2 h from its renewal: {d} vs {now_us}"
            );
        }
    }
}
