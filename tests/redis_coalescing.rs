//! Coalescing (`RedisBackendBuilder::coalesce`): coalesced requests decide as if sent one by
//! one, what cannot be coalesced is called directly, timeouts and cancellation.

mod support;

use std::time::{Duration, Instant};

use support::redis::{RedisServer, TestRedis, command, unique_prefix};
use tower_ratelimits::{
    BackendError, BatchDecision, Id, Limiter, LimiterError, Limits, Mode, Transaction,
};

use tower_ratelimits::RedisBackend;

// ---------------------------------------------------------------------------------------------
// Coalescing (`RedisBackendBuilder::coalesce`).

/// A GCRA limit (its spends coalesce as `M` calls) and a calendar quota (`K` calls).
const SLOW_LIMITS: &str =
    "Slow: {burst: 10, count: 1, period: 1h}\nMonth: {calendar: {count: 10, period: month}}\n";

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

async fn spend_all(
    limiter: &Limiter,
    batches: &[[Transaction; 1]],
) -> Vec<Result<BatchDecision, LimiterError>> {
    futures_util::future::join_all(batches.iter().map(|b| limiter.spend(b))).await
}

/// What the allowed answers left, sorted.
fn left(answers: Vec<Result<BatchDecision, LimiterError>>) -> Vec<u64> {
    let mut left: Vec<u64> = answers
        .into_iter()
        .map(Result::unwrap)
        .filter(|d| d.allowed())
        .map(|d| d.decisions()[0].remaining())
        .collect();
    left.sort_unstable();
    left
}

fn monthly(limiter: &Limiter, id: &str) -> Transaction {
    Transaction::new(limiter.key("Month", Id::new(id).unwrap()).unwrap())
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
        .map(|d| d.decisions()[0].remaining())
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    for d in same
        .iter()
        .map(|d| d.as_ref().unwrap())
        .filter(|d| !d.allowed())
    {
        assert!(
            d.strictest().unwrap().retry_after() > Duration::from_secs(3500),
            "{d:?}"
        );
    }
    for d in apart {
        let d = d.unwrap();
        assert!(d.allowed());
        assert_eq!(d.decisions()[0].remaining(), 9);
    }
    for d in blocked {
        assert!(!d.unwrap().allowed());
    }
    // What was allowed was written; the denied requests spent nothing on their first bucket.
    for i in 0..30 {
        let d = l.check(&[slow(&l, &format!("k{i}"))]).await.unwrap();
        assert_eq!(
            d.decisions()[0].remaining(),
            8,
            "k{i}: spent once, and one more fits"
        );
    }
    let d = l.check(&[slow(&l, "same")]).await.unwrap();
    assert!(!d.allowed());
    for i in 0..10 {
        let d = l.check(&[slow(&l, &format!("b{i}"))]).await.unwrap();
        assert_eq!(d.decisions()[0].remaining(), 9, "b{i}");
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
    assert_eq!(one_by_one(&redis.url, slow, 30).await, remaining);
}

/// `n` spends of one fresh key of `tx`'s limit without coalescing, one after the other: what
/// the allowed ones left, sorted.
async fn one_by_one(url: &str, tx: fn(&Limiter, &str) -> Transaction, n: usize) -> Vec<u64> {
    let plain = Limiter::new(
        Limits::from_yaml_str(SLOW_LIMITS, None).unwrap(),
        backend_without_cache(url, &unique_prefix("coalesce-off")).await,
    );
    let mut left = Vec::new();
    for _ in 0..n {
        let d = plain.spend(&[tx(&plain, "same")]).await.unwrap();
        if d.allowed() {
            left.push(d.decisions()[0].remaining());
        }
    }
    left.sort_unstable();
    left
}

async fn backend_without_cache(url: &str, prefix: &str) -> RedisBackend {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .deny_cache(false)
        .connect()
        .await
        .unwrap()
}

/// A calendar quota's spends (one key alone in each batch) share calls too, in a queue of
/// their own beside the GCRA spends, and decide as if sent one by one: 30 requests for one
/// key of 10 a month admit exactly 10 (remaining 9 down to 0 once each), requests of cost 3 on
/// a fresh key admit 3 (7, 4, 1 left) and deny the rest whole, 20 requests for 20 keys all
/// leave 9, while 20 GCRA spends in the same moment decide as usual. The same requests
/// without coalescing decide the same.
#[tokio::test]
async fn coalesced_calendar_spends_decide_as_if_sent_one_by_one() {
    let redis = TestRedis::single();
    let (l, backend) = coalescing_limiter(
        &redis.url,
        &unique_prefix("coalesce-calendar"),
        Duration::from_secs(5),
    )
    .await;
    let before = backend.coalesce_stats().unwrap();
    let same: Vec<[Transaction; 1]> = (0..30).map(|_| [monthly(&l, "same")]).collect();
    let threes: Vec<[Transaction; 1]> = (0..5).map(|_| [monthly(&l, "three").cost(3)]).collect();
    let apart: Vec<[Transaction; 1]> = (0..20).map(|i| [monthly(&l, &format!("m{i}"))]).collect();
    let gcra: Vec<[Transaction; 1]> = (0..20).map(|i| [slow(&l, &format!("g{i}"))]).collect();
    let (same, threes, apart, gcra) = tokio::join!(
        spend_all(&l, &same),
        spend_all(&l, &threes),
        spend_all(&l, &apart),
        spend_all(&l, &gcra)
    );
    let after = backend.coalesce_stats().unwrap();
    assert_eq!(left(same), (0..10).collect::<Vec<u64>>());
    assert_eq!(left(threes), [1, 4, 7]);
    assert_eq!(left(apart), [9; 20]);
    assert_eq!(left(gcra), [9; 20]);
    // What was allowed was written: a check of one more unit leaves what is left less one.
    for (id, left, allowed) in [("same", 0, false), ("three", 0, true), ("m0", 8, true)] {
        let d = l.check(&[monthly(&l, id)]).await.unwrap();
        assert_eq!(
            (d.decisions()[0].remaining(), d.allowed()),
            (left, allowed),
            "{id}"
        );
    }
    let (requests, direct) = (
        after.requests - before.requests,
        after.direct - before.direct,
    );
    assert_eq!(requests + direct, 75, "{before:?} -> {after:?}");
    assert!(
        requests >= 70,
        "the requests shared calls: {before:?} -> {after:?}"
    );

    // The same requests without coalescing decide the same (fresh keys).
    assert_eq!(
        one_by_one(&redis.url, monthly, 30).await,
        (0..10).collect::<Vec<u64>>()
    );
}

/// The cluster's hash slot of a limit's key for `id`.
fn hash_slot(backend: &RedisBackend, limiter: &Limiter, name: &str, id: &str) -> u16 {
    let key = limiter.key(name, Id::new(id).unwrap()).unwrap();
    fred::util::redis_keyslot(backend.redis_key(&key).as_bytes())
}

/// On a cluster a call carries one hash slot's keys. Hot keys on each of the three masters
/// (20 GCRA spends and 20 calendar spends each, all at once): each key's requests share calls
/// sent to its own master, and decide as if sent one by one (10 admitted of each, remaining 9
/// down to 0). Requests for 30 keys of 30 slots at once never queue behind each other: each
/// makes its own call, as without coalescing.
#[tokio::test]
async fn on_a_cluster_requests_share_calls_per_hash_slot() {
    let redis = TestRedis::cluster();
    let (l, backend) = coalescing_limiter(
        &redis.url,
        &unique_prefix("coalesce-cluster"),
        Duration::from_secs(5),
    )
    .await;
    // One hot id per master (`redis-cli --cluster create` gives each a third of the slots).
    let hot: Vec<String> = [0..5461, 5461..10923, 10923..16384]
        .into_iter()
        .map(|slots| {
            (0..)
                .map(|i| format!("hot{i}"))
                .find(|id| {
                    slots.contains(&hash_slot(&backend, &l, "Slow", id))
                        && slots.contains(&hash_slot(&backend, &l, "Month", id))
                })
                .unwrap()
        })
        .collect();
    let before = backend.coalesce_stats().unwrap();
    let batches: Vec<Vec<[Transaction; 1]>> = hot
        .iter()
        .flat_map(|id| {
            [
                (0..20).map(|_| [slow(&l, id)]).collect(),
                (0..20).map(|_| [monthly(&l, id)]).collect(),
            ]
        })
        .collect();
    let answers = futures_util::future::join_all(batches.iter().map(|b| spend_all(&l, b))).await;
    let after = backend.coalesce_stats().unwrap();
    for (i, answers) in answers.into_iter().enumerate() {
        assert_eq!(
            left(answers),
            (0..10).collect::<Vec<u64>>(),
            "hot key {}",
            i / 2
        );
    }
    let (calls, requests, direct) = (
        after.calls - before.calls,
        after.requests - before.requests,
        after.direct - before.direct,
    );
    assert_eq!((direct, requests), (6, 114), "{before:?} -> {after:?}");
    assert!(calls <= 12, "{calls} calls for {requests} requests");

    // Keys of 30 slots: 30 calls of their own, none queued.
    let mut slots = std::collections::HashSet::new();
    let apart: Vec<[Transaction; 1]> = (0..)
        .map(|i| format!("apart{i}"))
        .filter(|id| slots.insert(hash_slot(&backend, &l, "Slow", id)))
        .take(30)
        .map(|id| [slow(&l, &id)])
        .collect();
    let before = backend.coalesce_stats().unwrap();
    for d in spend_all(&l, &apart).await {
        assert_eq!(d.unwrap().decisions()[0].remaining(), 9);
    }
    let after = backend.coalesce_stats().unwrap();
    assert_eq!(
        (
            after.direct - before.direct,
            after.requests - before.requests
        ),
        (30, 0)
    );
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
    assert_eq!(d.decisions()[0].remaining(), 9);
    let d = l
        .spend(&[slow(&l, "c").mode(Mode::SpendOnly)])
        .await
        .unwrap();
    assert_eq!(d.decisions()[0].remaining(), 9);
    // A calendar spend of a range (its least units below its cost) takes the general path.
    let d = l
        .spend(&[monthly(&l, "c").cost_range(1..=4)])
        .await
        .unwrap();
    assert_eq!(d.decisions()[0].remaining(), 6);
    assert_eq!(backend.coalesce_stats().unwrap(), before);
    // A plain spend with no call in flight makes its own, as without coalescing.
    let d = l.spend(&[slow(&l, "c")]).await.unwrap();
    assert_eq!(d.decisions()[0].remaining(), 8);
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

/// One request's failure in a coalesced call is its own: a user whose ACL lets it write only
/// the keys of ids starting with `good` (and read the rest) sends 40 requests at once, every
/// fourth for a `bad` id; the server refuses any call naming a `bad` key (`NOPERM`, before
/// the script runs), so a call carrying both kinds is sent again a request a call: every
/// `good` request is allowed and spent once, every `bad` one fails with the server's refusal.
/// The same for GCRA spends (`M` calls) and calendar spends (`K` calls).
#[tokio::test]
async fn a_request_the_server_refuses_fails_alone_in_a_coalesced_call() {
    let server = RedisServer::start();
    let prefix = "acl:";
    // Read every key of the prefix; write the stored overrides (`{overrides}...`)
    // and the good ids' buckets.
    let acl = format!(
        "ACL SETUSER lim on >pw %R~{prefix}* ~{prefix}{{overrides}}* ~{prefix}{{Slow:good* ~{prefix}{{Month:good* allchannels +@all"
    );
    assert!(command(server.port, &acl).unwrap().starts_with("+OK"));
    let url = format!("redis://lim:pw@127.0.0.1:{}", server.port);
    let (l, backend) = coalescing_limiter(&url, prefix, Duration::from_secs(5)).await;
    let id = |i: usize| format!("{}{i}", if i.is_multiple_of(4) { "bad" } else { "good" });
    let shapes: [fn(&Limiter, &str) -> Transaction; 2] = [slow, monthly];
    for tx in shapes {
        let before = backend.coalesce_stats().unwrap();
        let batches: Vec<[Transaction; 1]> = (0..40).map(|i| [tx(&l, &id(i))]).collect();
        let answers = futures_util::future::join_all(batches.iter().map(|b| l.spend(b))).await;
        for (i, answer) in answers.iter().enumerate() {
            if i.is_multiple_of(4) {
                assert!(
                    matches!(answer, Err(LimiterError::Backend(BackendError::Unavailable(t))) if t.contains("NOPERM")),
                    "{}: {answer:?}",
                    id(i)
                );
            } else {
                let d = answer.as_ref().unwrap();
                assert!(d.allowed(), "{}", id(i));
                assert_eq!(d.decisions()[0].remaining(), 9, "{}: spent once", id(i));
            }
        }
        let after = backend.coalesce_stats().unwrap();
        assert!(
            after.requests - before.requests >= 30,
            "the requests shared calls: {before:?} -> {after:?}"
        );
    }
}

/// One request's refused write in a coalesced call fails that request alone: at `maxmemory`
/// under `noeviction` Redis refuses the script's writes (the first write of a script without
/// flags is checked), so the requests that would write fail with `OutOfMemory`, while those
/// beside them in the same call that write nothing (a bucket already empty: denied) are
/// decided as usual. The same for GCRA spends and calendar spends.
#[tokio::test]
async fn a_refused_write_fails_only_its_request_in_a_coalesced_call() {
    let server = RedisServer::start();
    let (l, backend) = coalescing_limiter(
        &server.url(),
        &unique_prefix("coalesce-oom"),
        Duration::from_secs(5),
    )
    .await;
    let shapes: [fn(&Limiter, &str) -> Transaction; 2] = [slow, monthly];
    for tx in shapes {
        for _ in 0..10 {
            assert!(l.spend(&[tx(&l, "full")]).await.unwrap().allowed());
        }
    }
    for cmd in [
        "CONFIG SET maxmemory-policy noeviction",
        "CONFIG SET maxmemory 1",
    ] {
        assert!(
            command(server.port, cmd).unwrap().starts_with("+OK"),
            "{cmd}"
        );
    }
    let id = |i: usize| {
        if i.is_multiple_of(2) {
            "full".to_string()
        } else {
            format!("fresh{i}")
        }
    };
    for tx in shapes {
        let before = backend.coalesce_stats().unwrap();
        let batches: Vec<[Transaction; 1]> = (0..20).map(|i| [tx(&l, &id(i))]).collect();
        let answers = futures_util::future::join_all(batches.iter().map(|b| l.spend(b))).await;
        let after = backend.coalesce_stats().unwrap();
        for (i, answer) in answers.iter().enumerate() {
            if i.is_multiple_of(2) {
                assert!(!answer.as_ref().unwrap().allowed(), "{}: {answer:?}", id(i));
            } else {
                assert!(
                    matches!(
                        answer,
                        Err(LimiterError::Backend(BackendError::OutOfMemory(_)))
                    ),
                    "{}: {answer:?}",
                    id(i)
                );
            }
        }
        assert!(
            after.requests - before.requests >= 10,
            "the requests shared calls: {before:?} -> {after:?}"
        );
    }
    command(server.port, "CONFIG SET maxmemory 0").unwrap();
}
