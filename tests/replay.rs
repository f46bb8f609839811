//! Replaying logs through a current and a candidate policy (`docs/replay.md`): every request
//! decided by the real layer at its logged time, concurrency slots held for the logged
//! duration, waits decided again when they end, batches all or nothing, and the plan's
//! counts, flips, headroom and suggestions.

use std::time::Duration;

mod support;

use tower_ratelimits::{
    ClientIp, Header, Limits, LogReader, Plan, RateLimitLayer, Replay, ReplayError, Rule, RuleSet,
    Wait,
};

const T0: &str = "2026-11-25T10:00:";

/// A JSON log line at `10:00:<s>` (seconds with a fraction), from `ip`, with `extra` fields.
fn line(s: &str, ip: &str, extra: &str) -> String {
    format!("{{\"time\":\"{T0}{s}Z\",\"ip\":\"{ip}\"{extra}}}\n")
}

fn reader(text: String) -> LogReader {
    LogReader::from_readers(
        vec![("log".into(), Box::new(std::io::Cursor::new(text)))],
        None,
        Duration::ZERO,
    )
}

fn limits(yaml: &str) -> Limits {
    Limits::from_yaml_str(yaml, None).unwrap()
}

fn replay(rules: &str, current: &str, candidate: &str, log: String) -> Plan {
    let rules = RuleSet::from_yaml_str(rules).unwrap();
    Replay::new(move |l| rules.layer(l), limits(current), limits(candidate))
        .run(reader(log))
        .unwrap()
}

const PER_IP: &str = "- {limit: PerIp, key: client_ip}\n";

#[test]
fn each_request_is_decided_at_its_logged_time_by_both_policies() {
    let log = [
        line("00", "192.0.2.1", ""),
        line("00", "192.0.2.1", ""),
        line("00.5", "192.0.2.1", ""),
        line("01", "192.0.2.1", ""),
        line("01", "192.0.2.2", ""),
    ]
    .concat();
    let plan = replay(
        PER_IP,
        "PerIp: {kind: ip, burst: 3, count: 1, period: 1s}\n",
        "PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n",
        log,
    );
    assert_eq!(plan.requests, 5);
    assert_eq!((plan.current.allowed, plan.current.denied), (5, 0));
    // The candidate: 10:00:00 allowed, then denied (no burst), 00.5 denied (half a unit
    // back), 01 allowed (a whole unit back since 00), the other client allowed.
    assert_eq!((plan.candidate.allowed, plan.candidate.denied), (3, 2));
    assert_eq!((plan.allow_to_deny, plan.deny_to_allow), (2, 0));
    let per_ip = &plan.limits["PerIp"];
    assert_eq!((per_ip.current_denied, per_ip.candidate_denied), (0, 2));
    assert_eq!(per_ip.allow_to_deny, 2);
    assert_eq!(plan.top_keys.len(), 1);
    assert_eq!(
        (plan.top_keys[0].id.as_str(), plan.top_keys[0].allow_to_deny),
        ("192.0.2.1", 2)
    );
    assert_eq!(plan.flips.len(), 2);
    assert_eq!(plan.flips[1].time, "2026-11-25T10:00:00.500000Z");
    assert_eq!(plan.flips[1].limits, ["PerIp"]);
    assert_eq!(plan.from.as_deref(), Some("2026-11-25T10:00:00Z"));
    assert_eq!(plan.to.as_deref(), Some("2026-11-25T10:00:01Z"));
}

#[test]
fn a_concurrency_slot_is_held_for_the_logged_duration() {
    // A holds its slot 500 ms; B at 100 ms finds it held; C at 600 ms finds it free again.
    let log = [
        line("00", "192.0.2.1", ",\"duration_ms\":500"),
        line("00.1", "192.0.2.1", ",\"duration_ms\":10"),
        line("00.6", "192.0.2.1", ""),
        line("00.65", "192.0.2.1", ""),
    ]
    .concat();
    let plan = replay(
        PER_IP,
        "PerIp: {kind: ip, concurrency: 2, lease: 1m}\n",
        "PerIp: {kind: ip, concurrency: 1, lease: 1m}\n",
        log,
    );
    assert_eq!(plan.current.allowed, 4);
    assert_eq!((plan.candidate.allowed, plan.candidate.denied), (3, 1));
    assert_eq!(plan.allow_to_deny, 1);
    assert_eq!(plan.flips[0].time, "2026-11-25T10:00:00.100000Z");
}

/// An adaptive candidate learns from the log: two requests answered `503` after 100 ms fill a
/// window (AIMD, 2 completions, back-off to half), so at 300 ms the key's number is 1 and the
/// second of two requests in flight is refused, where the fixed limit of 2 let both through.
#[test]
fn an_adaptive_candidate_learns_from_the_logged_statuses_and_durations() {
    let log = [
        line("00", "192.0.2.1", ",\"duration_ms\":100,\"status\":503"),
        line("00", "192.0.2.1", ",\"duration_ms\":100,\"status\":503"),
        line("00.3", "192.0.2.1", ",\"duration_ms\":500,\"status\":200"),
        line("00.3", "192.0.2.1", ",\"duration_ms\":500,\"status\":200"),
    ]
    .concat();
    let plan = replay(
        PER_IP,
        "PerIp: {kind: ip, concurrency: 2, lease: 1m}\n",
        "PerIp: {kind: ip, concurrency: {adaptive: {min: 1, initial: 2, max: 4, algorithm: aimd, backoff: 50, completions: 2}}, lease: 1m}\n",
        log,
    );
    assert_eq!((plan.current.allowed, plan.current.denied), (4, 0));
    assert_eq!((plan.candidate.allowed, plan.candidate.denied), (3, 1));
    assert_eq!(plan.flips[0].time, "2026-11-25T10:00:00.300000Z");
}

#[test]
fn a_request_that_outlives_its_lease_keeps_its_slot_until_its_logged_end() {
    // The lease is 1 s; A runs 5 s: its slot is renewed on the logged clock, so B at 3 s is
    // still refused, and C at 5.5 s is let through.
    let log = [
        line("00", "192.0.2.1", ",\"duration_ms\":5000"),
        line("03", "192.0.2.1", ""),
        line("05.5", "192.0.2.1", ""),
    ]
    .concat();
    let plan = replay(
        PER_IP,
        "PerIp: {kind: ip, concurrency: 1, lease: 1s}\n",
        "PerIp: {kind: ip, concurrency: 1, lease: 1s}\n",
        log,
    );
    assert_eq!((plan.current.allowed, plan.current.denied), (2, 1));
    assert_eq!(plan.flips.len(), 0);
}

#[test]
fn a_waiting_request_is_decided_again_when_its_wait_ends() {
    let current = limits("PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n");
    let candidate = current.clone();
    // The current policy refuses at once; the candidate's rule waits up to 2 s.
    let waits = |wait: bool| {
        move |limiter| {
            let rule = Rule::new("PerIp", ClientIp::new());
            let rule = if wait {
                rule.wait(Wait::up_to(Duration::from_secs(2)))
            } else {
                rule
            };
            RateLimitLayer::new(limiter, [rule])
        }
    };
    let log = [
        line("00", "192.0.2.1", ""),
        line("00", "192.0.2.1", ""),
        line("00", "192.0.2.1", ""),
        line("00", "192.0.2.1", ""),
    ]
    .concat();
    let plan = Replay::new(waits(false), current, candidate)
        .candidate_layer(waits(true))
        .run(reader(log))
        .unwrap();
    assert_eq!((plan.current.allowed, plan.current.denied), (1, 3));
    // The second waits 1 s, the third 2 s; the fourth would wait 3 s: refused.
    assert_eq!((plan.candidate.allowed, plan.candidate.denied), (3, 1));
    assert_eq!((plan.allow_to_deny, plan.deny_to_allow), (0, 2));
    assert_eq!(plan.limits["PerIp"].deny_to_allow, 2);
    // The fourth would wait too long: denied at once.
    assert_eq!(plan.limits["PerIp"].candidate_denied, 1);
    assert_eq!(plan.limits["PerIp"].current_denied, 3);
}

#[test]
fn a_batch_is_all_or_nothing_and_a_denial_counts_for_each_limit_that_denied() {
    let rules =
        "- {limit: PerIp, key: client_ip}\n- {limit: PerAccount, key: 'header:x-account'}\n";
    let tight = "PerIp: {kind: ip, burst: 1, count: 1, period: 1h}\n\
                 PerAccount: {kind: account, burst: 1, count: 1, period: 1h}\n";
    let loose = "PerIp: {kind: ip, burst: 9, count: 1, period: 1h}\n\
                 PerAccount: {kind: account, burst: 9, count: 1, period: 1h}\n";
    let account = |a: u32| format!(",\"headers\":{{\"x-account\":\"{a}\"}}");
    let log = [
        line("00", "192.0.2.1", &account(1)),
        // Denied by both limits under the candidate.
        line("01", "192.0.2.1", &account(1)),
        // Denied by PerIp only: the account's unit is not spent (all or nothing), so...
        line("02", "192.0.2.1", &account(2)),
        // ...account 2 is still whole from another address.
        line("03", "192.0.2.2", &account(2)),
    ]
    .concat();
    let plan = replay(rules, loose, tight, log);
    assert_eq!((plan.candidate.allowed, plan.candidate.denied), (2, 2));
    assert_eq!(plan.limits["PerIp"].candidate_denied, 2);
    assert_eq!(plan.limits["PerAccount"].candidate_denied, 1);
    assert_eq!(
        (
            plan.limits["PerIp"].allow_to_deny,
            plan.limits["PerAccount"].allow_to_deny
        ),
        (2, 1)
    );
    assert_eq!(plan.flips[0].limits.len(), 2);
}

#[test]
fn exempt_rejected_and_scoped_requests_are_told_apart() {
    let rules = "trusted_proxies: [10.0.0.0/8]\nexempt: [198.51.100.0/24]\nrules:\n  \
                 - {limit: PerAccount, key: 'header:x-account', methods: [POST], path_prefix: /api}\n";
    let l = "PerAccount: {kind: account, burst: 1, count: 1, period: 1h}\n";
    let log = [
        // Exempt: its address is in the exempt network (through a trusted proxy).
        line("00", "10.0.0.1", ",\"method\":\"POST\",\"path\":\"/api/x\",\"headers\":{\"x-forwarded-for\":\"198.51.100.7\"}"),
        // Rejected: no account header on a rule's request.
        line("01", "192.0.2.1", ",\"method\":\"POST\",\"path\":\"/api/x\""),
        // Out of the rule's scope: a GET, and a path beside /api.
        line("02", "192.0.2.1", ",\"path\":\"/api/x\""),
        line("03", "192.0.2.1", ",\"method\":\"POST\",\"path\":\"/apix\""),
    ]
    .concat();
    let plan = replay(rules, l, l, log);
    assert_eq!(plan.current.exempt, 1);
    assert_eq!(plan.current.rejected, 1);
    assert_eq!(plan.current.allowed, 2);
    assert_eq!(plan.current.requests, 4);
    assert_eq!(plan.candidate, plan.current);
}

#[test]
fn headroom_and_suggestions_are_sized_from_the_log() {
    // Ten clients: client i sends i + 1 requests at once, every minute for five minutes.
    let mut log = String::new();
    for minute in 0..5 {
        for i in 0..10u32 {
            for _ in 0..=i {
                log.push_str(&format!(
                    "{{\"time\":\"2026-11-25T10:{minute:02}:00Z\",\"ip\":\"192.0.2.{i}\"}}\n"
                ));
            }
        }
    }
    let rules = RuleSet::from_yaml_str(PER_IP).unwrap();
    let plan = Replay::new(
        move |l| rules.layer(l),
        limits("PerIp: {kind: ip, burst: 20, count: 20, period: 1m}\n"),
        limits("PerIp: {kind: ip, burst: 4, count: 20, period: 1m}\n"),
    )
    .target(0.1)
    .run(reader(log))
    .unwrap();
    let per_ip = &plan.limits["PerIp"];
    let headroom = per_ip.headroom.as_ref().unwrap();
    assert_eq!((headroom.policy.as_str(), headroom.keys), ("current", 10));
    // Client i uses i + 1 units of 20, refilled (a unit every 3 s) before its next burst.
    assert_eq!((headroom.p50, headroom.max), (0.25, 0.5));
    let suggested = per_ip.suggested.as_ref().unwrap();
    // A burst of 9 refuses only the largest client (1 of 10 keys: the 10% target).
    assert_eq!(
        (suggested.burst, suggested.keys, suggested.period.as_str()),
        (9, 10, "1m")
    );
    // At a burst of 4, six clients send more than 4 at once: no count lets them through.
    assert_eq!(suggested.count, None);
    assert_eq!(plan.candidate.denied, 5 * (1 + 2 + 3 + 4 + 5 + 6));

    // One client, a request a second for a minute, against 20 a minute with a burst of 4:
    // at 20 a minute it needs a burst of 41 (the last request finds 121 s of debt: 40.3
    // units); at a burst of 4 the grid's 57 a minute (20 x 2^1.5) is the least that never
    // refuses it (48 refuses the 17th request).
    let log: String = (0..60)
        .map(|s| format!("{{\"time\":\"2026-11-25T10:00:{s:02}Z\",\"ip\":\"192.0.2.1\"}}\n"))
        .collect();
    let rules = RuleSet::from_yaml_str(PER_IP).unwrap();
    let l = "PerIp: {kind: ip, burst: 4, count: 20, period: 1m}\n";
    let plan = Replay::new(move |l| rules.layer(l), limits(l), limits(l))
        .target(0.0)
        .run(reader(log))
        .unwrap();
    let suggested = plan.limits["PerIp"].suggested.as_ref().unwrap();
    assert_eq!((suggested.burst, suggested.count), (41, Some(57)));
}

#[test]
fn bad_lines_are_counted_and_a_strict_replay_stops_at_the_first() {
    let log = [
        line("00", "192.0.2.1", ""),
        "not json\n".to_owned(),
        line("01", "nobody", ""),
        line("02", "192.0.2.1", ""),
        // Earlier than the line before it, with no window: decided at the replay's clock.
        line("01.5", "192.0.2.1", ""),
    ]
    .concat();
    let l = "PerIp: {kind: ip, burst: 5, count: 1, period: 1s}\n";
    let plan = replay(PER_IP, l, l, log.clone());
    assert_eq!((plan.requests, plan.bad_lines, plan.late_lines), (3, 2, 1));
    assert_eq!(plan.bad_line_examples[0].line, 2);
    assert_eq!(plan.bad_line_examples[1].line, 3);
    assert!(plan.bad_line_examples[1].reason.contains("not an address"));
    let rules = RuleSet::from_yaml_str(PER_IP).unwrap();
    let e = Replay::new(move |l| rules.layer(l), limits(l), limits(l))
        .strict(true)
        .run(reader(log))
        .unwrap_err();
    assert!(
        matches!(e, ReplayError::BadLine(ref b) if b.line == 2),
        "{e}"
    );
}

#[test]
fn a_candidate_with_its_own_rules_adds_a_limit() {
    let current_rules = RuleSet::from_yaml_str(PER_IP).unwrap();
    let candidate_rules = RuleSet::from_yaml_str(
        "- {limit: PerIp, key: client_ip}\n- {limit: Writes, key: client_ip, methods: [POST]}\n",
    )
    .unwrap();
    let both = "PerIp: {kind: ip, burst: 9, count: 1, period: 1h}\n\
                Writes: {kind: ip, burst: 1, count: 1, period: 1h}\n";
    let log = [
        line("00", "192.0.2.1", ",\"method\":\"POST\""),
        line("01", "192.0.2.1", ",\"method\":\"POST\""),
        line("02", "192.0.2.1", ""),
    ]
    .concat();
    let plan = Replay::new(move |l| current_rules.layer(l), limits(both), limits(both))
        .candidate_layer(move |l| candidate_rules.layer(l))
        .run(reader(log))
        .unwrap();
    assert_eq!(plan.allow_to_deny, 1);
    assert_eq!(plan.limits["Writes"].candidate_denied, 1);
    assert_eq!(
        plan.limits["Writes"].headroom.as_ref().unwrap().policy,
        "candidate"
    );
}

#[test]
fn a_layer_that_cannot_be_built_names_its_policy() {
    let l = "PerIp: {kind: ip, burst: 5, count: 1, period: 1s}\n";
    let e = Replay::new(
        |limiter| RateLimitLayer::new(limiter, [Rule::new("Nope", Header::new("x-a"))]),
        limits(l),
        limits(l),
    )
    .run(reader(line("00", "192.0.2.1", "")))
    .unwrap_err();
    assert!(
        matches!(
            e,
            ReplayError::Layer {
                policy: "current",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn the_plan_reads_back_from_its_json() {
    let l = "PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n";
    let plan = replay(
        PER_IP,
        l,
        l,
        [line("00", "192.0.2.1", ""), line("00", "192.0.2.1", "")].concat(),
    );
    let json = serde_json::to_value(&plan).unwrap();
    assert_eq!(json["version"], 1);
    assert_eq!(json["current"]["denied"], 1);
    assert_eq!(json["limits"]["PerIp"]["current_denied"], 1);
    let back: Plan = serde_json::from_value(json).unwrap();
    assert_eq!(back, plan);
}

mod tcp {
    //! A real server over TCP records what it decided; the replay of its log decides the same.

    use std::collections::HashMap;
    use std::net::{IpAddr, SocketAddr};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use axum::extract::{ConnectInfo, Request, State};
    use axum::middleware::Next;
    use axum::response::Response;
    use axum::routing::{get, post};
    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use tower_ratelimits::{Answered, Limiter, MemoryBackend, Replay, RuleSet};

    use super::{limits, reader};

    const RULES: &str = "\
- {limit: PerIp, key: client_ip}
- {limit: Exports, key: 'header:x-account', methods: [POST], path_prefix: /export}
";
    /// A unit a second with a burst of 3; one export in flight per account, on a lease of
    /// 300 ms that the exports (held 1.2 s) outlive.
    const LIMITS: &str = "\
PerIp: {kind: ip, burst: 3, count: 1, period: 1s}
Exports: {kind: account, concurrency: 1, lease: 300ms}
";

    type Log = Arc<Mutex<Vec<(String, u16)>>>;

    fn now_us() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    }

    /// Writes a JSON log line per request: its start, peer, method, path, account, how long
    /// it took, and the status the server answered.
    async fn record(
        State(log): State<Log>,
        ConnectInfo(peer): ConnectInfo<SocketAddr>,
        request: Request,
        next: Next,
    ) -> Response {
        let start = now_us();
        let (method, path) = (
            request.method().to_string(),
            request.uri().path().to_owned(),
        );
        let account = request
            .headers()
            .get("x-account")
            .map(|v| format!(",\"headers\":{{\"x-account\":\"{}\"}}", v.to_str().unwrap()))
            .unwrap_or_default();
        let response = next.run(request).await;
        let took = now_us() - start;
        let time = tower_ratelimits::__private::instant_text(start);
        let status = response.status().as_u16();
        let line = format!(
            "{{\"time\":\"{time}\",\"ip\":\"{}\",\"method\":\"{method}\",\"path\":\"{path}\"{account},\"status\":{status},\"duration_ms\":{}}}\n",
            peer.ip(),
            took as f64 / 1000.0
        );
        log.lock().unwrap().push((line, status));
        response
    }

    async fn hold(request: Request) -> &'static str {
        let ms = request
            .headers()
            .get("x-hold-ms")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        "ok"
    }

    fn client(from: IpAddr) -> Client<HttpConnector, Full<Bytes>> {
        let mut connector = HttpConnector::new();
        connector.set_local_address(Some(from));
        Client::builder(TokioExecutor::new()).build(connector)
    }

    #[test]
    fn a_replay_of_a_real_servers_log_decides_every_request_as_the_server_did() {
        let rules = RuleSet::from_yaml_str(RULES).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let recorded = runtime.block_on(serve_and_record(&rules));
        drop(runtime);
        let statuses: Vec<u16> = recorded.iter().map(|(_, s)| *s).collect();
        for expected in [200, 429, 400] {
            assert!(statuses.contains(&expected), "{statuses:?}");
        }
        assert_eq!(recorded.len(), PLAN.len());
        // The log in the order requests started (a line is written when a request ends).
        let mut lines: Vec<(String, u16)> = recorded;
        lines.sort_by(|x, y| x.0.cmp(&y.0));
        let by_time: HashMap<String, u16> = lines
            .iter()
            .map(|(l, s)| {
                let line: serde_json::Value = serde_json::from_str(l).unwrap();
                (line["time"].as_str().unwrap().to_owned(), *s)
            })
            .collect();
        let text: String = lines.iter().map(|(l, _)| l.as_str()).collect();
        let seen: Arc<Mutex<Vec<(String, u16, Answered)>>> = Arc::default();
        let into = seen.clone();
        let replayed = Replay::new(move |l| rules.layer(l), limits(LIMITS), limits(LIMITS))
            .each(move |replayed| {
                let (request, current) = (replayed.request, replayed.current);
                let time = tower_ratelimits::__private::instant_text(request.time_us);
                let server = by_time[&time];
                into.lock().unwrap().push((
                    format!("{time} {} {}", request.method, request.path),
                    server,
                    current,
                ));
            })
            .run(reader(text))
            .unwrap();
        assert_eq!(replayed.requests, PLAN.len() as u64);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), PLAN.len());
        for (what, server, replay) in seen.iter() {
            let expected = match server {
                200 => Answered::Allowed,
                429 => Answered::Denied,
                _ => Answered::Rejected,
            };
            assert_eq!(*replay, expected, "{what}: the server answered {server}");
        }
    }

    #[test]
    fn a_replay_inside_a_runtime_is_refused_with_a_reason() {
        let l = "PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n";
        let e = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(async {
                let rules = RuleSet::from_yaml_str(super::PER_IP).unwrap();
                Replay::new(move |x| rules.layer(x), limits(l), limits(l))
                    .run(reader(String::new()))
                    .unwrap_err()
            });
        assert!(
            matches!(e, tower_ratelimits::ReplayError::InsideRuntime),
            "{e}"
        );
    }

    /// (ms from the start, client, method, path, account, hold ms): client A spends its
    /// burst and is refused, then is let through again; client B's first export holds the
    /// account's slot 1.2 s, four leases long, so its second export is refused; the third
    /// comes after it ended; an export without an account is rejected.
    type Sent = (
        u64,
        &'static str,
        &'static str,
        &'static str,
        Option<&'static str>,
        u64,
    );
    const PLAN: &[Sent] = &[
        (0, "127.0.0.1", "GET", "/items", None, 0),
        (20, "127.0.0.1", "GET", "/items", None, 0),
        (40, "127.0.0.1", "GET", "/items", None, 0),
        (60, "127.0.0.1", "GET", "/items", None, 0),
        (100, "127.0.0.2", "POST", "/export", Some("7"), 1200),
        (700, "127.0.0.2", "POST", "/export", Some("7"), 0),
        (900, "127.0.0.1", "POST", "/export", None, 0),
        (1900, "127.0.0.2", "POST", "/export", Some("7"), 100),
        (2300, "127.0.0.1", "GET", "/items", None, 0),
    ];

    /// Serves the rules on a real socket, sends [`PLAN`] from two loopback addresses, and
    /// gives the server's log.
    async fn serve_and_record(rules: &RuleSet) -> Vec<(String, u16)> {
        let layer = rules
            .layer(Limiter::new(limits(LIMITS), MemoryBackend::new()))
            .unwrap();
        let log: Log = Arc::default();
        let app = axum::Router::new()
            .route("/items", get(hold))
            .route("/export", post(hold))
            .layer(layer)
            .layer(axum::middleware::from_fn_with_state(log.clone(), record));
        let server = crate::support::http::serve(app).await;
        let addr = server.addr;
        let start = tokio::time::Instant::now();
        let mut sent = Vec::new();
        for &(at, from, method, path, account, hold_ms) in PLAN {
            let from: IpAddr = from.parse().unwrap();
            tokio::time::sleep_until(start + Duration::from_millis(at)).await;
            let mut request = http::Request::builder()
                .method(method)
                .uri(format!("http://{addr}{path}"))
                .header("x-hold-ms", hold_ms.to_string());
            if let Some(account) = account {
                request = request.header("x-account", account);
            }
            let request = request.body(Full::new(Bytes::new())).unwrap();
            let client = client(from);
            sent.push(tokio::spawn(async move {
                client.request(request).await.unwrap().status().as_u16()
            }));
        }
        for s in sent {
            s.await.unwrap();
        }
        drop(server);
        std::mem::take(&mut *log.lock().unwrap())
    }
}

#[test]
fn times_far_apart_and_hostile_values_are_decided_without_a_panic() {
    let l = "PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n";
    let rules = "- {limit: PerIp, key: client_ip, cost: logged}\n";
    let log = [
        line("00", "192.0.2.1", ",\"cost\":0"),
        // Eight thousand years later, then back: decided at the replay's clock, late.
        "{\"time\":\"9999-12-31T23:59:59.999999Z\",\"ip\":\"192.0.2.1\",\"duration_ms\":86400000}\n".to_owned(),
        line("01", "192.0.2.1", &format!(",\"cost\":{}", u64::MAX)),
        line("02", "192.0.2.2", ",\"duration_ms\":86400000"),
    ]
    .concat();
    let plan = replay(rules, l, l, log);
    assert_eq!((plan.requests, plan.late_lines), (4, 2));
    // A cost above the burst is rejected before a decision.
    assert_eq!(plan.current.rejected, 1);
    assert_eq!(plan.to.as_deref(), Some("9999-12-31T23:59:59.999999Z"));
}

#[test]
fn a_long_gap_after_held_slots_ends_at_once() {
    // Slots renewed every third of a second while held; then a line a thousand years on.
    let l = "PerIp: {kind: ip, concurrency: 2, lease: 1s}\n";
    let log = [
        line("00", "192.0.2.1", ",\"duration_ms\":5000"),
        line("01", "192.0.2.1", ""),
        "{\"time\":\"3026-01-01T00:00:00Z\",\"ip\":\"192.0.2.1\"}\n".to_owned(),
    ]
    .concat();
    let plan = replay(PER_IP, l, l, log);
    assert_eq!((plan.requests, plan.current.allowed), (3, 3));
}

#[test]
fn a_settling_rule_settles_to_the_logged_cost() {
    // Each request reserves 500 of a bucket of 1,000; the response reports its true cost,
    // the logged one. Costs of 1 leave room for every request; costs of 500 refuse the third.
    let l = "Tokens: {kind: ip, burst: 1000, count: 1000, period: 1h}\n";
    type MakeSettle = fn() -> tower_ratelimits::Settle;
    let layers: [(&str, MakeSettle); 4] = [
        ("header", || {
            tower_ratelimits::Settle::header("x-tokens-used")
        }),
        ("trailer", || {
            tower_ratelimits::Settle::trailer("x-tokens-used")
        }),
        ("body bytes", || {
            tower_ratelimits::Settle::body_bytes_per(16)
        }),
        ("status", || {
            tower_ratelimits::Settle::response(|head| head.status.is_server_error().then_some(1))
        }),
    ];
    for (name, settle) in layers {
        let build = move |limiter| {
            RateLimitLayer::new(
                limiter,
                [Rule::new("Tokens", ClientIp::new())
                    .cost(500)
                    .settle(settle())],
            )
        };
        let costs = |cost: u64, status: u16| {
            (0..3)
                .map(|_| {
                    line(
                        "00",
                        "192.0.2.1",
                        &format!(",\"cost\":{cost},\"status\":{status}"),
                    )
                })
                .collect::<String>()
        };
        // The status settle reads a failure as costing 1: the logged status makes it so.
        let status = if name == "status" { 503 } else { 200 };
        let cheap = Replay::new(build, limits(l), limits(l))
            .run(reader(costs(1, status)))
            .unwrap();
        assert_eq!(cheap.current.allowed, 3, "{name}");
        let dear = Replay::new(build, limits(l), limits(l))
            .run(reader(costs(500, 200)))
            .unwrap();
        assert_eq!(
            (dear.current.allowed, dear.current.denied),
            (2, 1),
            "{name}"
        );
    }
}

#[test]
fn an_outcome_rule_counts_the_logged_failures_only() {
    // Three failed logins an hour per address: the successes in between count nothing, the
    // fourth failure's line is refused (it reserves its weight before its logged outcome), and
    // so is every later line of that address, success or not, while another address passes.
    let rules = "- limit: FailedLogins\n  key: client_ip\n  count_when: [{status: 401}]\n";
    let l = "FailedLogins: {kind: ip, burst: 3, count: 3, period: 1h}\n";
    let status = |s: &str, ip: &str, code: u16| line(s, ip, &format!(",\"status\":{code}"));
    let log = [
        status("00", "192.0.2.1", 200),
        status("01", "192.0.2.1", 401),
        status("02", "192.0.2.1", 200),
        status("03", "192.0.2.1", 401),
        status("04", "192.0.2.1", 401),
        status("05", "192.0.2.1", 200),
        status("06", "192.0.2.1", 401),
        status("07", "192.0.2.2", 401),
    ]
    .concat();
    let plan = replay(rules, l, l, log);
    assert_eq!(
        (plan.requests, plan.current.allowed, plan.current.denied),
        (8, 6, 2)
    );
}

#[test]
fn an_outcome_rule_counts_the_logged_slow_answers_only() {
    // Two slow answers an hour per address: a response's latency is its logged duration, on
    // the replay's clock (up to 1 ms long: tokio's resolution, `docs/replay.md`). Fast lines
    // count nothing; the third slow line is refused (it reserves its weight before its
    // duration is known), and so is every later line.
    let rules = "- limit: Slow\n  key: client_ip\n  count_when: [{latency_above: 2s}]\n";
    let l = "Slow: {kind: ip, burst: 2, count: 2, period: 1h}\n";
    let took = |s: &str, ms: u32| line(s, "192.0.2.1", &format!(",\"duration_ms\":{ms}"));
    let log = [
        took("00", 100),
        took("03", 2_500),
        took("06", 1_998),
        took("09", 1_900),
        took("12", 3_000),
        took("16", 5),
        took("17", 9_000),
    ]
    .concat();
    let plan = replay(rules, l, l, log);
    assert_eq!(
        (plan.requests, plan.current.allowed, plan.current.denied),
        (7, 5, 2),
        "1,998 ms is not above 2 s; the 2.5 s and 3 s answers fill the limit"
    );
}

/// A snapshot holding what no deployment wrote (times far ahead of its instant, more leases
/// than the limit, an instant before or after every line) starts a replay that decides every
/// line as a store would read such values: foreign ones as the script reads them, never a
/// panic; and a snapshot of a key whose state is another shape than the policy's limit is not
/// put in its buckets.
#[test]
fn a_snapshot_of_hostile_states_is_read_as_a_store_reads_them() {
    use tower_ratelimits::__private::tiers::{TierLog, TierState};
    use tower_ratelimits::{CalendarState, Snapshot, kit};
    let l = "\
PerIp: {kind: ip, burst: 2, count: 1, period: 1s}
Slots: {kind: ip, concurrency: 1, lease: 1s}
Daily: {kind: ip, calendar: {count: 2, period: day}}
Tiered: {kind: ip, tiers: [{limit: 2, window: 10s, active: 10s, cooldown: 0s}]}
";
    let rules = "\
- {limit: PerIp, key: client_ip}
- {limit: Slots, key: client_ip, path_prefix: /slow}
- {limit: Daily, key: client_ip, path_prefix: /quota}
- {limit: Tiered, key: client_ip, path_prefix: /tiered}
";
    // 10:00:00 on the log's day.
    let t0 = 1_764_064_800_000_000u64;
    let far = t0 + 1_000 * 365 * 86_400_000_000;
    let mut snapshot = Snapshot::new(t0);
    snapshot.push("PerIp", "192.0.2.1", kit::Stored::Tat(far));
    snapshot.push(
        "Slots",
        "192.0.2.1",
        kit::Stored::Leases((0..50).map(|i| (i, far)).collect()),
    );
    snapshot.push(
        "Daily",
        "192.0.2.1",
        kit::Stored::Calendar(CalendarState {
            end_us: far,
            used: u64::MAX,
        }),
    );
    snapshot.push(
        "Tiered",
        "192.0.2.1",
        kit::Stored::Tiers(TierState::from_tiers(vec![
            TierLog::new(
                Some(far),
                vec![(far, 9)]
            );
            70
        ])),
    );
    // Another shape than the limit's, an id the kind refuses, a limit no policy has.
    snapshot.push(
        "PerIp",
        "192.0.2.2",
        kit::Stored::Calendar(CalendarState {
            end_us: far,
            used: 1,
        }),
    );
    snapshot.push("PerIp", "not-an-ip", kit::Stored::Tat(t0 + 1_000_000));
    snapshot.push("Nobody", "192.0.2.3", kit::Stored::Tat(t0 + 1_000_000));
    let log = ["/", "/slow", "/quota", "/tiered", "/", "/"]
        .iter()
        .enumerate()
        .map(|(i, path)| {
            line(
                &format!("0{i}"),
                "192.0.2.1",
                &format!(",\"path\":\"{path}\""),
            )
        })
        .collect::<String>()
        + &line("00", "192.0.2.2", "");
    let answers: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let run = |snapshot: Snapshot| {
        let rules = RuleSet::from_yaml_str(rules).unwrap();
        let into = answers.clone();
        into.lock().unwrap().clear();
        Replay::new(move |b| rules.layer(b), limits(l), limits(l))
            .snapshot(snapshot)
            .each(move |r| {
                into.lock().unwrap().push(format!(
                    "{} {} {:?}",
                    r.request.ip, r.request.path, r.current
                ))
            })
            .run(reader(log.clone()))
            .unwrap()
    };
    // Read back from its file, each key knows its line (the header is line 1).
    let mut file = Vec::new();
    snapshot.write(&mut file).unwrap();
    let snapshot = Snapshot::read(&file[..]).unwrap();
    let plan = run(snapshot);
    // Every foreign value reads as the store's script reads it: the TAT far ahead as the
    // bucket drained (refused at 00, refilled by 04), the leases far ahead cut to one lease
    // from the decision (held at 01), the calendar's end past its horizon and the tiers' far
    // times as drained; 192.0.2.2's calendar state is not a GCRA bucket's: not put.
    assert_eq!(
        *answers.lock().unwrap(),
        [
            "192.0.2.1 / Denied",
            "192.0.2.1 /slow Denied",
            "192.0.2.1 /quota Denied",
            "192.0.2.1 /tiered Denied",
            "192.0.2.1 / Allowed",
            "192.0.2.1 / Allowed",
            "192.0.2.2 / Allowed",
        ]
    );
    let warm = plan.warm.clone().unwrap();
    assert_eq!(
        (warm.keys, warm.current_seeded, warm.lines_before),
        (7, 4, 0)
    );
    // The id the kind refuses is counted under each policy and named with its line (before:
    // only missing from current_seeded).
    assert_eq!(warm.refused_ids, [1, 1]);
    let refused = &warm.refused_id_examples[0];
    assert_eq!(
        (refused.limit.as_str(), refused.id.as_str(), refused.line),
        ("PerIp", "not-an-ip", 7),
        "{refused:?}"
    );
    assert!(refused.reason.contains("not-an-ip"), "{refused:?}");
    assert_eq!(plan.requests, 7);
    assert_eq!((plan.current.denied, plan.current.rejected), (4, 0));
    // An instant after every line: nothing replayed, nothing panics.
    let late = Snapshot::new(u64::MAX / 2);
    let plan = run(late);
    assert_eq!((plan.requests, plan.warm.unwrap().lines_before), (0, 7));
    // An instant long before the first line: the clock runs from it to the log.
    let plan = run(Snapshot::new(0));
    assert_eq!(plan.requests, 7);
}

/// A limit marked `across_regions` is replayed as the one central limit it stands for (one
/// bucket per key for the whole log), decides exactly as the same limit unmarked, and the plan
/// says so for that limit only (the field is absent from the JSON of every other).
#[test]
fn a_limit_across_regions_is_replayed_as_one_central_limit_and_the_plan_says_so() {
    let log = [
        line("00", "192.0.2.1", ""),
        line("00", "192.0.2.1", ""),
        line("00.5", "192.0.2.1", ""),
        line("01", "192.0.2.1", ""),
    ]
    .concat();
    let plain = "PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n";
    let marked = "PerIp: {kind: ip, burst: 1, count: 1, period: 1s, across_regions: true}\n";
    let central = replay(PER_IP, plain, marked, log.clone());
    let unmarked = replay(PER_IP, plain, plain, log);
    assert_eq!(central.candidate, unmarked.candidate);
    assert_eq!(
        (central.candidate.allowed, central.candidate.denied),
        (2, 2)
    );
    assert!(central.limits["PerIp"].across_regions);
    assert!(!unmarked.limits["PerIp"].across_regions);
    let json = serde_json::to_value(&central).unwrap();
    assert_eq!(json["limits"]["PerIp"]["across_regions"], true);
    let json = serde_json::to_value(&unmarked).unwrap();
    assert!(
        json["limits"]["PerIp"].get("across_regions").is_none(),
        "{json}"
    );
    let back: Plan = serde_json::from_value(json).unwrap();
    assert!(!back.limits["PerIp"].across_regions);
}

#[test]
fn each_shape_s_suggestion_taken_refuses_no_key() {
    // Three clients: 192.0.2.1 sends 4 at once each held 3 s, then 6 within a second;
    // 192.0.2.2 sends one a second for 10 s, each held 1.5 s; 192.0.2.3 sends one.
    let mut log = String::new();
    for s in [
        "00", "00", "00", "00", "05", "05.1", "05.2", "05.3", "05.4", "05.9",
    ] {
        log.push_str(&line(s, "192.0.2.1", ",\"duration_ms\":3000"));
    }
    for s in 0..10 {
        log.push_str(&line(
            &format!("{s:02}.5"),
            "192.0.2.2",
            ",\"duration_ms\":1500",
        ));
    }
    log.push_str(&line("07", "192.0.2.3", ""));
    let sorted = |log: &str| {
        let mut lines: Vec<&str> = log.lines().collect();
        lines.sort();
        lines.join("\n") + "\n"
    };
    let log = sorted(&log);
    let plan_of = |yaml: &str| {
        let rules = RuleSet::from_yaml_str(PER_IP).unwrap();
        Replay::new(move |l| rules.layer(l), limits(yaml), limits(yaml))
            .target(0.0)
            .run(reader(log.clone()))
            .unwrap()
    };
    let tiers = |a: u64, b: u64| {
        format!(
            "PerIp:\n  kind: ip\n  tiers:\n    - {{limit: {a}, window: 1s, active: 10s, cooldown: 0s}}\n    - {{limit: {b}, window: 10s, active: 10s, cooldown: 0s}}\n"
        )
    };
    // Each shape, too tight: it refuses; its suggestion, taken: it refuses nothing.
    let plan = plan_of("PerIp: {kind: ip, concurrency: 1}\n");
    assert!(plan.candidate.denied > 0);
    let max = plan.limits["PerIp"].suggested_max.as_ref().unwrap().max;
    // The first client's six within 0.9 s, each held 3 s.
    assert_eq!(max, 6);
    let taken = plan_of(&format!("PerIp: {{kind: ip, concurrency: {max}}}\n"));
    assert_eq!(taken.candidate.denied, 0);
    // At a target of 0 no key is left above the suggestion: none is named.
    assert!(plan.limits["PerIp"].heaviest.is_empty());

    let plan = plan_of(&tiers(1, 2));
    assert!(plan.candidate.denied > 0);
    let s = plan.limits["PerIp"].suggested_tiers.clone().unwrap();
    let limits: Vec<u64> = s.tiers.iter().map(|t| t.limit).collect();
    assert_eq!(limits, [6, 10]);
    let taken = plan_of(&tiers(limits[0], limits[1]));
    assert_eq!(taken.candidate.denied, 0);

    let plan = plan_of("PerIp: {kind: ip, calendar: {count: 2, period: day}}\n");
    assert!(plan.candidate.denied > 0);
    let count = plan.limits["PerIp"].suggested_count.as_ref().unwrap().count;
    assert_eq!(count, 10);
    let taken = plan_of(&format!(
        "PerIp: {{kind: ip, calendar: {{count: {count}, period: day}}}}\n"
    ));
    assert_eq!(taken.candidate.denied, 0);

    let plan = plan_of("PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n");
    assert!(plan.candidate.denied > 0);
    let burst = plan.limits["PerIp"].suggested.as_ref().unwrap().burst;
    let taken = plan_of(&format!(
        "PerIp: {{kind: ip, burst: {burst}, count: 1, period: 1s}}\n"
    ));
    assert_eq!(taken.candidate.denied, 0);
}
