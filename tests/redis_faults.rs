//! Redis faults: a flushed script, a dead server, the circuit breaker, a lazy start, a dead
//! cluster node, and batches across cluster slots that stay all or nothing.

mod support;

use std::time::{Duration, Instant};

use fred::prelude::{KeysInterface, Value};
use support::redis::{RedisCluster, RedisServer, TestRedis, command, unique_prefix};
use tower_ratelimits::{
    Backend, BackendError, BucketKey, BucketTx, Id, Limiter, LimiterError, Limits, ManualClock,
    Mode, Transaction, TransactionError,
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
    assert_eq!(d.strictest().unwrap().remaining(), 8);
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

/// A limiter on a Redis backend whose circuit opens after 2 failures for an hour of the
/// caller's (manual) clock, with one transaction to send; no deny cache (every request asks).
struct Breaker {
    clock: ManualClock,
    backend: RedisBackend,
    limiter: Limiter,
    tx: [Transaction; 1],
}

impl Breaker {
    async fn on(url: &str) -> Self {
        let clock = ManualClock::new(simulate::EPOCH_US);
        let backend = RedisBackend::from_url(url)
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
        Self {
            clock,
            backend,
            limiter,
            tx,
        }
    }

    /// Once the store answers, a probe after the cool-off (each failed one opens another, so
    /// the clock moves past it each time) closes the circuit, and requests reach Redis again.
    async fn closes_after_its_cool_off(&self) {
        let d = until_answered(
            &self.limiter,
            &self.tx,
            || self.clock.advance(Duration::from_secs(3601)),
            "the circuit did not close",
        )
        .await;
        assert!(d.allowed());
        assert!(!self.backend.circuit_open());
    }
}

/// While Redis is down, every request used to wait the full command timeout
/// before the failure policy applied. After `failures` consecutive failures the circuit opens:
/// requests get `CircuitOpen` at once, without trying, until the cool-off ends; then one
/// request probes, and its success closes the circuit.
#[tokio::test]
async fn a_dead_redis_opens_the_circuit_and_a_successful_probe_closes_it() {
    let mut server = RedisServer::start();
    let port = server.port;
    let breaker = Breaker::on(&server.url()).await;
    let Breaker {
        backend,
        limiter,
        tx,
        ..
    } = &breaker;
    assert!(limiter.spend(tx).await.unwrap().allowed());
    server.kill();
    for _ in 0..2 {
        let err = limiter.spend(tx).await.unwrap_err();
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
        let err = limiter.spend(tx).await.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::CircuitOpen { retry_in }) if retry_in == Duration::from_secs(3600)),
            "{err:?}"
        );
    }
    assert_eq!(backend.circuit_opened_count(), 1);
    // Redis is back, but nothing tries it before the cool-off ends.
    let _server = RedisServer::start_on(port, &[]);
    assert!(matches!(
        limiter.spend(tx).await.unwrap_err(),
        LimiterError::Backend(BackendError::CircuitOpen { .. })
    ));
    // Redis answers again: after the cool-off a probe closes the circuit.
    breaker.closes_after_its_cool_off().await;
}

/// An operator reading the log of an outage sees one line when a circuit opens, naming the
/// server whose circuit it is (a cluster has one per master: two such lines at once were two
/// masters, and nothing said which). Twenty requests at once against a dead server: one line.
#[test]
fn a_circuit_that_opens_says_so_once_and_names_its_server() {
    let mut server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let breaker = rt.block_on(Breaker::on(&server.url()));
    assert!(
        rt.block_on(breaker.limiter.spend(&breaker.tx))
            .unwrap()
            .allowed()
    );
    server.kill();
    let ((), warned) = support::warnings_during(|| {
        rt.block_on(async {
            let asks = (0..20).map(|_| breaker.limiter.spend(&breaker.tx));
            for answer in futures_util::future::join_all(asks).await {
                assert!(answer.is_err());
            }
        })
    });
    let opened: Vec<&String> = warned
        .iter()
        .filter(|w| w.contains("failed repeatedly"))
        .collect();
    assert_eq!(opened.len(), 1, "{warned:?}");
    assert!(
        opened[0].contains(&format!(
            "Redis at 127.0.0.1:{} failed repeatedly",
            server.port
        )),
        "{opened:?}"
    );
    assert_eq!(breaker.backend.circuit_opened_count(), 1);
}

/// Once the cool-off ends, no request waits the command timeout to learn
/// whether Redis is back. The probe goes in the background; the request that started it, and
/// every request while it runs, is answered at once (`CircuitOpen`; before, that request was
/// the probe and waited the full timeout: `Timeout`). The probe's answer closes the circuit.
#[tokio::test]
async fn the_probe_runs_in_the_background_and_no_request_waits_for_it() {
    let server = RedisServer::start();
    let breaker = Breaker::on(&server.url()).await;
    let Breaker {
        clock,
        backend,
        limiter,
        tx,
        ..
    } = &breaker;
    assert!(limiter.spend(tx).await.unwrap().allowed());
    // Paused: commands wait (long enough for what follows on a busy machine).
    assert!(
        command(server.port, "CLIENT PAUSE 5000 ALL")
            .unwrap()
            .starts_with("+OK")
    );
    for _ in 0..2 {
        let err = limiter.spend(tx).await.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::Timeout(_))),
            "{err:?}"
        );
    }
    assert!(backend.circuit_open());
    clock.advance(Duration::from_secs(3601));
    for n in 0..3 {
        let err = limiter.spend(tx).await.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::CircuitOpen { .. })),
            "request {n} after the cool-off: {err:?}"
        );
    }
    // The pause ends: after the cool-off a probe closes the circuit.
    breaker.closes_after_its_cool_off().await;
}

/// An app could not even start without Redis. A lazy backend connects in
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
    let (backend, limiter) = limiter_on(&redis.url, &unique_prefix("xslot"), KEY_LIMITS).await;
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
    assert_eq!(d.strictest().unwrap().remaining(), 9);
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
