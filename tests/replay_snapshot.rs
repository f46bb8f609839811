//! Starting a replay warm (`docs/replay.md`, "Starting warm"): the state of a policy's keys
//! read from a real Redis and a real cluster (read only), saved and read back, and a replay
//! started from it deciding every later request as the store itself goes on to decide it,
//! under the current policy and under a candidate that reads the same state by the change
//! rule.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{Layer, ServiceExt};
use tower_ratelimits::{
    Answered, Limiter, Limits, LogReader, ManualClock, RedisBackend, RedisBackendBuilder, Replay,
    RuleSet, Snapshot, kit,
};

mod support;

use support::redis::{RedisServer, TestRedis, command, unique_prefix};
use support::redis_backend::{caller_time_backend, commandstat};

const RULES: &str = "\
- {limit: PerIp, key: client_ip}
- {limit: Slots, key: client_ip, path_prefix: /slow}
- {limit: Daily, key: client_ip, path_prefix: /quota}
- {limit: Tiered, key: client_ip, path_prefix: /tiered}
";

const CURRENT: &str = "\
PerIp: {kind: ip, burst: 6, count: 1, period: 1s}
Slots: {kind: ip, concurrency: 2, lease: 1m}
Daily: {kind: ip, calendar: {count: 3, period: day}}
Tiered: {kind: ip, tiers: [{limit: 3, window: 10s, active: 10s, cooldown: 0s}]}
";

/// Every limit tighter: each reads the state the current one wrote.
const CANDIDATE: &str = "\
PerIp: {kind: ip, burst: 3, count: 1, period: 1s}
Slots: {kind: ip, concurrency: 1, lease: 1m}
Daily: {kind: ip, calendar: {count: 2, period: day}}
Tiered: {kind: ip, tiers: [{limit: 2, window: 10s, active: 10s, cooldown: 0s}]}
";

/// 2026-11-25T10:00:00Z.
const T0: u64 = 1_764_064_800_000_000;
/// The snapshot's instant: 3 s after the first request.
const T1: u64 = T0 + 3_000_000;

const IPS: [&str; 4] = ["192.0.2.1", "192.0.2.2", "198.51.100.7", "203.0.113.9"];

/// One request of the log: when, from whom, where.
#[derive(Clone, Copy)]
struct Arrival {
    at_us: u64,
    ip: &'static str,
    path: &'static str,
}

/// Each client: a slot taken and held, then calls of every kind, before the snapshot (at
/// T0 + 150 ms steps) and after it (at T1 + 200 ms steps).
fn arrivals() -> (Vec<Arrival>, Vec<Arrival>) {
    let before = [
        "/slow", "/", "/tiered", "/quota", "/", "/tiered", "/quota", "/",
    ];
    let after = [
        "/", "/tiered", "/quota", "/slow", "/", "/slow", "/tiered", "/",
    ];
    let mut early = Vec::new();
    let mut late = Vec::new();
    for (step, path) in before.into_iter().enumerate() {
        for (n, ip) in IPS.into_iter().enumerate() {
            let at_us = T0 + step as u64 * 150_000 + n as u64 * 1_000;
            early.push(Arrival { at_us, ip, path });
        }
    }
    for (step, path) in after.into_iter().enumerate() {
        for (n, ip) in IPS.into_iter().enumerate() {
            let at_us = T1 + 1_000 + step as u64 * 200_000 + n as u64 * 1_000;
            late.push(Arrival { at_us, ip, path });
        }
    }
    (early, late)
}

/// The log line of an arrival: a slot's request is held past the end of the log.
fn line(a: &Arrival) -> String {
    let time = tower_ratelimits::__private::instant_text(a.at_us);
    let held = if a.path == "/slow" {
        ",\"duration_ms\":600000"
    } else {
        ""
    };
    format!(
        "{{\"time\":\"{time}\",\"ip\":\"{}\",\"method\":\"GET\",\"path\":\"{}\"{held}}}\n",
        a.ip, a.path
    )
}

fn limits(yaml: &str) -> Limits {
    Limits::from_yaml_str(yaml, None).unwrap()
}

/// A deployment on the store under `prefix`: the rules' layer on a caller-time Redis
/// backend whose clock the test moves.
struct Deployment {
    limiter: Limiter,
    clock: ManualClock,
    /// Responses kept: a slot's request holds its slot until its response is dropped.
    held: Vec<Box<dyn std::any::Any + Send>>,
}

impl Deployment {
    async fn new(url: &str, prefix: &str) -> Deployment {
        let clock = ManualClock::new(T0);
        let backend = caller_time_backend(url, prefix, &clock, false).await;
        Deployment {
            limiter: Limiter::new(limits(CURRENT), backend),
            clock,
            held: Vec::new(),
        }
    }

    /// Decides `a` as the deployed layer does: whether it was let through.
    async fn send(&mut self, a: &Arrival) -> Answered {
        self.clock.set(a.at_us);
        let rules = RuleSet::from_yaml_str(RULES).unwrap();
        let layer = rules.layer(self.limiter.clone()).unwrap();
        let service = layer.layer(tower::service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
        }));
        let mut request = Request::builder().uri(a.path).body(()).unwrap();
        let ip: IpAddr = a.ip.parse().unwrap();
        request.extensions_mut().insert(SocketAddr::new(ip, 0));
        let response = service.oneshot(request).await.unwrap();
        match response.status() {
            StatusCode::OK => {
                self.held.push(Box::new(response));
                Answered::Allowed
            }
            StatusCode::TOO_MANY_REQUESTS => Answered::Denied,
            other => panic!("unexpected status {other}"),
        }
    }
}

/// A replayed request: its time, client, path, and the current and candidate answers.
type Seen = (u64, IpAddr, String, Answered, Answered);

/// What reads the store under `prefix` for a snapshot, on the deployments' clock.
fn reading(url: &str, prefix: &str, clock: &ManualClock) -> RedisBackendBuilder {
    RedisBackend::from_url(url)
        .prefix(prefix)
        .caller_time(clock.clone())
}

/// The log's requests after the snapshot, replayed from `snapshot` (`None`: cold): each
/// one's answers under the current and the candidate policy, in the log's order.
fn replay(snapshot: Option<Snapshot>, log: String) -> (tower_ratelimits::Plan, Vec<Seen>) {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let into = seen.clone();
    let rules = RuleSet::from_yaml_str(RULES).unwrap();
    let mut replay =
        Replay::new(move |l| rules.layer(l), limits(CURRENT), limits(CANDIDATE)).each(move |r| {
            into.lock().unwrap().push((
                r.request.time_us,
                r.request.ip,
                r.request.path.clone(),
                r.current,
                r.candidate,
            ));
        });
    if let Some(snapshot) = snapshot {
        replay = replay.snapshot(snapshot);
    }
    let reader = LogReader::from_readers(
        vec![("log".into(), Box::new(std::io::Cursor::new(log)))],
        None,
        Duration::ZERO,
    );
    let plan = replay.run(reader).unwrap();
    let mut seen = std::mem::take(&mut *seen.lock().unwrap());
    seen.sort_by_key(|s| s.0);
    (plan, seen)
}

/// What the store wrote, counted: `SET`s, scripts, `DEL`s, sorted-set writes.
fn writes(port: u16) -> u64 {
    [
        "set",
        "evalsha",
        "eval",
        "del",
        "zadd",
        "zremrangebyscore",
        "pexpire",
        "pexpireat",
    ]
    .into_iter()
    .map(|c| commandstat(port, c))
    .sum()
}

#[test]
fn a_replay_started_from_a_snapshot_decides_as_the_store_goes_on_to_decide() {
    for redis in TestRedis::each() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (early, late) = arrivals();
        let (current, candidate, snapshot, written) = runtime.block_on(async {
            // Two deployments of the current policy fed the same requests; at the snapshot
            // one changes to the candidate.
            let prefixes = [unique_prefix("snap-a"), unique_prefix("snap-b")];
            let mut a = Deployment::new(&redis.url, &prefixes[0]).await;
            let mut b = Deployment::new(&redis.url, &prefixes[1]).await;
            let mut written: BTreeSet<(&str, &str)> = BTreeSet::new();
            for arrival in &early {
                let answer = a.send(arrival).await;
                assert_eq!(b.send(arrival).await, answer);
                if answer == Answered::Allowed {
                    written.insert(("PerIp", arrival.ip));
                    let scoped = match arrival.path {
                        "/slow" => Some("Slots"),
                        "/quota" => Some("Daily"),
                        "/tiered" => Some("Tiered"),
                        _ => None,
                    };
                    if let Some(limit) = scoped {
                        written.insert((limit, arrival.ip));
                    }
                }
            }
            // The snapshot, read only.
            a.clock.set(T1);
            let reader = reading(&redis.url, &prefixes[0], &a.clock);
            let snapshot = Snapshot::from_redis(reader, &limits(CURRENT), 1_000)
                .await
                .unwrap();
            b.limiter.reload(limits(CANDIDATE)).unwrap();
            let mut current = Vec::new();
            let mut candidate = Vec::new();
            for arrival in &late {
                current.push(a.send(arrival).await);
                candidate.push(b.send(arrival).await);
            }
            (current, candidate, snapshot, written)
        });
        drop(runtime);
        // Every key the requests wrote is in the snapshot, on every master, and nothing else.
        assert_eq!(snapshot.instant_us(), T1);
        let found: BTreeSet<(&str, &str)> = snapshot
            .keys()
            .iter()
            .map(|k| (k.limit.as_str(), k.id.as_str()))
            .collect();
        assert_eq!(found, written, "on {}", redis.url);
        assert_eq!(snapshot.keys().len(), written.len());
        assert_eq!(snapshot.foreign(), 0);
        for key in snapshot.keys() {
            let shape = match &key.state {
                kit::Stored::Tat(_) => "PerIp",
                kit::Stored::Leases(_) => "Slots",
                kit::Stored::Calendar(_) => "Daily",
                kit::Stored::Tiers(_) => "Tiered",
                _ => "other",
            };
            assert_eq!(shape, key.limit, "{key:?}");
        }
        // Saved and read back whole.
        let mut file = Vec::new();
        snapshot.write(&mut file).unwrap();
        let read = Snapshot::read(&file[..]).unwrap();
        assert_eq!(read, snapshot);

        let log: String = early.iter().chain(&late).map(line).collect();
        let (plan, seen) = replay(Some(read), log.clone());
        let warm = plan.warm.clone().unwrap();
        assert_eq!(warm.lines_before, early.len() as u64);
        assert_eq!(warm.keys, written.len() as u64);
        assert_eq!(
            (warm.current_seeded, warm.candidate_seeded),
            (warm.keys, warm.keys)
        );
        assert_eq!(plan.requests, late.len() as u64);
        assert_eq!(seen.len(), late.len());
        for (i, (arrival, s)) in late.iter().zip(&seen).enumerate() {
            assert_eq!(s.0, arrival.at_us);
            assert_eq!(
                (s.3, s.4),
                (current[i], candidate[i]),
                "request {i}: {} {} at +{} us",
                arrival.ip,
                arrival.path,
                arrival.at_us - T1
            );
        }
        // The candidate denies some of what the current policy lets through, and the state
        // mattered: the same lines replayed cold decide otherwise.
        assert!(plan.allow_to_deny > 0, "{plan:?}");
        let late_log: String = late.iter().map(line).collect();
        let (_, cold) = replay(None, late_log);
        assert!(
            cold.iter()
                .zip(&seen)
                .any(|(c, w)| (c.3, c.4) != (w.3, w.4)),
            "a cold replay decided the same: the snapshot changed nothing"
        );
    }
}

#[test]
fn a_snapshot_reads_only_and_leaves_out_what_is_not_a_state_of_ours() {
    // A server of its own: its command counts are this test's alone.
    let server = RedisServer::start();
    let port = server.port;
    let url = server.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let prefix = unique_prefix("snap-ro");
    let (snapshot, before, after) = runtime.block_on(async {
        let mut deployment = Deployment::new(&url, &prefix).await;
        let (early, _) = arrivals();
        for arrival in &early {
            deployment.send(arrival).await;
        }
        // Another program's data under the limits' keys: a GCRA key holding text, a tiered
        // key holding a number, a calendar key of another type, a key of ours whose id the
        // limit's kind refuses.
        for cmd in [
            format!("SET {prefix}{{PerIp:192.0.2.200}} hello"),
            format!("SET {prefix}{{Tiered:192.0.2.200}}:t 12"),
            format!("RPUSH {prefix}{{Daily:192.0.2.200}}:q x"),
            format!("SET {prefix}{{Slots:192.0.2.200}}:c x"),
            format!("SET {prefix}{{PerIp:not-an-address}} {}", T0 + 500_000),
            format!("SET {prefix}{{PerIp:192.0.2.201}}:zz {}", T0 + 500_000),
        ] {
            command(port, &cmd).unwrap();
        }
        deployment.clock.set(T1);
        // Counted before the reader connects: connecting writes nothing either.
        let before = writes(port);
        let reader = reading(&url, &prefix, &deployment.clock);
        let snapshot = Snapshot::from_redis(reader, &limits(CURRENT), 1_000)
            .await
            .unwrap();
        (snapshot, before, writes(port))
    });
    drop(runtime);
    assert_eq!(after, before, "the snapshot wrote to the store");
    assert_eq!(snapshot.foreign(), 4);
    assert!(
        snapshot
            .keys()
            .iter()
            .any(|k| k.id == "not-an-address" && k.limit == "PerIp")
    );
    assert!(
        snapshot
            .keys()
            .iter()
            .all(|k| k.id != "192.0.2.200" && k.id != "192.0.2.201")
    );
    // The id no kind reads is in the file but in no policy's buckets.
    let (plan, _) = replay(Some(snapshot.clone()), line(&arrivals().1[0]));
    let warm = plan.warm.unwrap();
    assert_eq!(warm.keys, snapshot.keys().len() as u64);
    assert_eq!(warm.current_seeded, warm.keys - 1);
    assert_eq!(warm.foreign, 4);
    // A bound on keys is an error, not a cut.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let clock = ManualClock::new(T1);
        let err = Snapshot::from_redis(reading(&url, &prefix, &clock), &limits(CURRENT), 3)
            .await
            .unwrap_err();
        assert!(
            matches!(err, tower_ratelimits::SnapshotError::TooManyKeys(3)),
            "{err}"
        );
    });
}

#[test]
fn a_snapshot_file_that_is_not_one_is_refused_with_its_line() {
    let cases: [(&str, &str); 9] = [
        ("", "line 1"),
        // A key twice: which state a replay started from was the file's order.
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":2}\n{\"limit\":\"A\",\"id\":\"x\",\"calendar\":{\"end_us\":5,\"used\":1}}\n{\"limit\":\"A\",\"id\":\"x\",\"calendar\":{\"end_us\":5,\"used\":3}}\n",
            "line 3: limit \"A\" id \"x\" is on line 2 too",
        ),
        (
            "{\"snapshot\":2,\"instant_us\":1,\"keys\":0}\n",
            "snapshot format 2",
        ),
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":1}\n{\"limit\":\"A\",\"id\":\"x\"}\n",
            "line 2: a key holds exactly one",
        ),
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":2}\n{\"limit\":\"A\",\"id\":\"x\",\"calendar\":{\"end_us\":5,\"used\":1}}\n",
            "promises 2 keys",
        ),
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":1}\n{\"limit\":\"A\",\"id\":\"x\",\"gcra\":{\"tat_us\":5,\"bound_bits\":60}}\n",
            "line 2: bound_bits 60",
        ),
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":0}\nnot json\n",
            "line 2",
        ),
        // Two states for one key, and a state of no shape: each shape reads its own field.
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":1}\n{\"limit\":\"A\",\"id\":\"x\",\"leases\":[],\"calendar\":{\"end_us\":5,\"used\":1}}\n",
            "line 2: a key holds exactly one state beside its limit and id, found 2",
        ),
        (
            "{\"snapshot\":1,\"instant_us\":1,\"keys\":1}\n{\"limit\":\"A\",\"id\":\"x\",\"bucket\":1}\n",
            "line 2: unknown variant `bucket`, expected one of `gcra`, `tiers`, `leases`",
        ),
    ];
    for (text, expected) in cases {
        let err = Snapshot::read(text.as_bytes()).unwrap_err().to_string();
        assert!(err.contains(expected), "{text:?}: {err}");
    }
    // A line that never ends is cut at its bound, not read whole.
    let mut long = b"{\"snapshot\":1,\"instant_us\":1,\"keys\":1}\n".to_vec();
    long.extend(std::iter::repeat_n(b'x', 5 << 20));
    let err = Snapshot::read(&long[..]).unwrap_err().to_string();
    assert!(err.contains("line 2: longer than"), "{err}");
}

/// On the store's own clock a GCRA key records its writer's bound in when it expires: the
/// snapshot reads it back (the candidate reads a TAT up to that bound ahead as its own).
#[test]
fn a_snapshot_reads_the_bound_a_gcra_key_was_written_under() {
    let redis = TestRedis::single();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let prefix = unique_prefix("snap-k");
    let snapshot = runtime.block_on(async {
        let (_backend, limiter) =
            support::redis_backend::limiter_on(&redis.url, &prefix, CURRENT).await;
        let name = limiter.limits().name("PerIp").unwrap();
        let key =
            tower_ratelimits::BucketKey::new(name, "192.0.2.1".parse::<IpAddr>().unwrap().into());
        let spent = limiter
            .spend(&[tower_ratelimits::Transaction::new(key)])
            .await;
        assert!(spent.unwrap().allowed());
        let reader = RedisBackend::from_url(&redis.url).prefix(&prefix);
        Snapshot::from_redis(reader, &limits(CURRENT), 10)
            .await
            .unwrap()
    });
    let mut file = Vec::new();
    snapshot.write(&mut file).unwrap();
    let text = String::from_utf8(file).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
    // The limit's bound (its burst offset and its debt's), as a bit length.
    let per_ip = limits(CURRENT);
    let limit = per_ip
        .default_limit(per_ip.name("PerIp").unwrap())
        .and_then(|q| q.as_gcra())
        .unwrap();
    let bound = limit.burst_offset_us() + limit.debt_offset_us();
    assert_eq!(
        line["gcra"]["bound_bits"],
        u64::from(u64::BITS - bound.leading_zeros()),
        "{text}"
    );
    assert_eq!(line["id"], "192.0.2.1");
    let header: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    let tat = line["gcra"]["tat_us"].as_u64().unwrap();
    let instant = header["instant_us"].as_u64().unwrap();
    // The store's clock: the TAT is one emission interval after the spend, within a minute.
    assert!(
        tat > instant && tat - instant <= 1_000_000 + 60_000_000,
        "{text}"
    );
}

/// A key banned by its limit's penalty ladder in production starts the replay banned: the
/// snapshot carries the ladder's state beside the key's bucket (a line of its own, read
/// back whole), and the replay started from it refuses the key's requests until the ban
/// ends, as the store does; a cold replay lets them through.
#[test]
fn a_snapshot_carries_a_ban_into_the_replay() {
    const LADDER: &str = "Login: {kind: ip, burst: 100, count: 100, period: 1s, penalty: {after: 2, within: 1m, base: 1m, factor: 2, max: 1h}}\n";
    const RULE: &str = "- {limit: Login, key: client_ip}\n";
    for redis in TestRedis::each() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let at = |ms: u64, ip: &'static str| Arrival {
            at_us: T0 + ms * 1_000,
            ip,
            path: "/login",
        };
        // Two requests of 192.0.2.1 ban it for a minute; 192.0.2.2 counts one.
        let early = [at(0, IPS[0]), at(100, IPS[0]), at(200, IPS[1])];
        let late = [at(3_500, IPS[0]), at(3_600, IPS[1]), at(61_000, IPS[0])];
        let (answers, snapshot) = runtime.block_on(async {
            let prefix = unique_prefix("snap-ban");
            let clock = ManualClock::new(T0);
            let backend = caller_time_backend(&redis.url, &prefix, &clock, false).await;
            let limiter = Limiter::new(limits(LADDER), backend);
            let rules = RuleSet::from_yaml_str(RULE).unwrap();
            let layer = rules.layer(limiter.clone()).unwrap();
            let send = |a: &Arrival| {
                clock.set(a.at_us);
                let service = layer.layer(tower::service_fn(|_: Request<()>| async {
                    Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
                }));
                let mut request = Request::builder().uri(a.path).body(()).unwrap();
                let ip: IpAddr = a.ip.parse().unwrap();
                request.extensions_mut().insert(SocketAddr::new(ip, 0));
                async move { service.oneshot(request).await.unwrap().status() }
            };
            for a in &early {
                assert_eq!(send(a).await, StatusCode::OK);
            }
            clock.set(T1);
            let reader = reading(&redis.url, &prefix, &clock);
            let snapshot = Snapshot::from_redis(reader, &limits(LADDER), 1_000)
                .await
                .unwrap();
            let mut answers = Vec::new();
            for a in &late {
                answers.push(send(a).await == StatusCode::OK);
            }
            (answers, snapshot)
        });
        drop(runtime);
        assert_eq!(
            answers,
            [false, true, true],
            "the store: banned for a minute"
        );
        let penalties = snapshot
            .keys()
            .iter()
            .filter(|k| matches!(k.state, kit::Stored::Penalty(_)))
            .count();
        assert_eq!(
            (snapshot.keys().len(), penalties),
            (4, 2),
            "{:?}",
            snapshot.keys()
        );
        let mut file = Vec::new();
        snapshot.write(&mut file).unwrap();
        let read = Snapshot::read(&file[..]).unwrap();
        assert_eq!(read, snapshot);
        let log: String = early.iter().chain(&late).map(line).collect();
        let seen: Arc<Mutex<Vec<bool>>> = Arc::default();
        let into = seen.clone();
        let rules = RuleSet::from_yaml_str(RULE).unwrap();
        let replay = Replay::new(move |l| rules.layer(l), limits(LADDER), limits(LADDER))
            .each(move |r| into.lock().unwrap().push(r.current == Answered::Allowed));
        let reader = LogReader::from_readers(
            vec![("log".into(), Box::new(std::io::Cursor::new(log)))],
            None,
            Duration::ZERO,
        );
        let plan = replay.snapshot(read).run(reader).unwrap();
        let warm = plan.warm.unwrap();
        assert_eq!((warm.current_seeded, warm.candidate_seeded), (4, 4));
        assert_eq!(
            *seen.lock().unwrap(),
            answers,
            "the replay decides as the store"
        );
    }
}
