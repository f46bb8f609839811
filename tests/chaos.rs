//! Chaos against a real `redis-server`: what the limiter does when the store is paused,
//! flushed, loses its script, runs out of memory, dies or holds foreign data. Each test states
//! the outcome it holds; none of them over-admits, and every one recovers without a restart.
//! (A killed cluster master, and a dead server with the circuit breaker, are in `redis.rs`:
//! `a_dead_cluster_node_fails_only_its_own_slots`,
//! `a_dead_redis_opens_the_circuit_and_a_successful_probe_closes_it`; foreign data:
//! `foreign_data_at_a_key_is_a_drained_bucket_replaced_at_once`.)

mod support;

use std::time::{Duration, Instant};

use support::redis::{RedisServer, command};
use tower_ratelimits::{
    BackendError, Limiter, LimiterError, Limits, ManualClock, RedisBackend, Transaction,
};

const LIMITS: &str = "Api: {burst: 5, count: 5, period: 1h}\n";

async fn limiter(server: &RedisServer, clock: &ManualClock) -> (Limiter, RedisBackend) {
    let backend = RedisBackend::from_url(server.url())
        .caller_time(clock.clone())
        .command_timeout(Duration::from_millis(300))
        .deny_cache(false)
        .connect()
        .await
        .unwrap();
    (
        Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            backend.clone(),
        ),
        backend,
    )
}

fn tx(l: &Limiter, id: &str) -> [Transaction; 1] {
    [Transaction::new(l.parse_key("Api", id).unwrap())]
}

/// Spends until denied; returns how many were allowed.
async fn drain(l: &Limiter, id: &str) -> u32 {
    let mut allowed = 0;
    while l.spend(&tx(l, id)).await.unwrap().allowed() {
        allowed += 1;
        assert!(allowed <= 5, "over-admission");
    }
    allowed
}

/// Retries `spend` until it answers (the client reconnects in the background).
async fn until_answered(l: &Limiter, id: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match l.spend(&tx(l, id)).await {
            Ok(d) => return d.allowed(),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no recovery: {e}"),
        }
    }
}

/// `CLIENT PAUSE`: commands wait; each request fails within the command timeout (the
/// failure policy applies), and the limiter answers again when the pause ends. A request that
/// timed out was still sent: Redis may apply it when it resumes, spending tokens for a request
/// the failure policy already answered. That can only under-admit, never over-admit.
#[tokio::test]
async fn a_paused_server_fails_within_the_timeout_and_keeps_its_state() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (l, _) = limiter(&server, &clock).await;
    for _ in 0..3 {
        assert!(l.spend(&tx(&l, "p")).await.unwrap().allowed());
    }
    assert!(
        command(server.port, "CLIENT PAUSE 1500 ALL")
            .unwrap()
            .starts_with("+OK")
    );
    let err = l.spend(&tx(&l, "p")).await.unwrap_err();
    assert!(
        matches!(err, LimiterError::Backend(BackendError::Timeout(_))),
        "{err:?}"
    );
    // After the pause: what the timed-out requests spent is gone, and never more than the 5.
    let mut allowed = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match l.spend(&tx(&l, "p")).await {
            Ok(d) if d.allowed() => allowed += 1,
            Ok(_) => break,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no recovery: {e}"),
        }
    }
    assert!(
        3 + allowed <= 5,
        "{allowed} allowed after the pause: over-admission"
    );
    assert!(!l.spend(&tx(&l, "p")).await.unwrap().allowed());
}

/// `FLUSHALL` (or losing the data another way) forgets every bucket: each client gets one fresh
/// burst, exactly, and is limited again from there. The script, flushed too, is sent again.
#[tokio::test]
async fn a_flushed_server_gives_each_client_one_fresh_burst_and_no_more() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (l, _) = limiter(&server, &clock).await;
    assert_eq!(drain(&l, "f").await, 5);
    assert!(command(server.port, "FLUSHALL").unwrap().starts_with("+OK"));
    assert!(
        command(server.port, "SCRIPT FLUSH")
            .unwrap()
            .starts_with("+OK")
    );
    assert_eq!(drain(&l, "f").await, 5);
    assert!(!l.spend(&tx(&l, "f")).await.unwrap().allowed());
}

/// `maxmemory` reached with `noeviction`: Redis refuses the script's writes. The request fails
/// (the failure policy applies), nothing is admitted that is not recorded, each refusal is
/// counted in `tower_ratelimits_redis_out_of_memory_total` (scraped from a real Prometheus
/// recorder and parsed), and once memory is available again the limiter works with the state
/// it had.
#[tokio::test]
async fn a_full_server_refuses_writes_and_nothing_is_admitted_unrecorded() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (l, _) = limiter(&server, &clock).await;
    for _ in 0..2 {
        assert!(l.spend(&tx(&l, "m")).await.unwrap().allowed());
    }
    assert!(
        command(server.port, "CONFIG SET maxmemory-policy noeviction")
            .unwrap()
            .starts_with("+OK")
    );
    assert!(
        command(server.port, "CONFIG SET maxmemory 1")
            .unwrap()
            .starts_with("+OK")
    );
    for id in ["m", "new-client"] {
        let err = l.spend(&tx(&l, id)).await.unwrap_err();
        assert!(
            matches!(err, LimiterError::Backend(BackendError::OutOfMemory(ref m)) if m.contains("OOM")),
            "{err:?}"
        );
    }
    let m = support::scrape::samples(&handle.render());
    assert_eq!(m["tower_ratelimits_redis_out_of_memory_total{}"], 2.0);
    assert!(
        command(server.port, "CONFIG SET maxmemory 0")
            .unwrap()
            .starts_with("+OK")
    );
    // The refused spends wrote nothing: 3 of the 5 tokens are left.
    assert!(until_answered(&l, "m").await);
    assert_eq!(drain(&l, "m").await, 2);
}

/// A server killed and started again empty (no persistence): like a flush, each client gets
/// one fresh burst, and the backend reconnects by itself.
#[tokio::test]
async fn a_restarted_empty_server_is_used_again_with_one_fresh_burst() {
    let mut server = RedisServer::start();
    let port = server.port;
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (l, _) = limiter(&server, &clock).await;
    assert_eq!(drain(&l, "r").await, 5);
    server.kill();
    assert!(l.spend(&tx(&l, "r")).await.is_err());
    let _server = RedisServer::start_on(port, &[]);
    assert!(until_answered(&l, "r").await);
    assert_eq!(drain(&l, "r").await, 4);
}
