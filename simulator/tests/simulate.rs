//! The simulator: the spec's worked examples as traces, the trace format, and the command
//! line's behaviour on bad input (message on stderr, exit code 2, nothing partial on stdout).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../src/trace.rs"]
mod simulate;

const DEFAULTS: &str = "\
NewFoosPerIPAddress:
  kind: ip
  burst: 20
  count: 20
  period: 1s
NewOrdersPerAccount:
  kind: account
  burst: 100
  count: 60
  period: 1m
";

async fn run(defaults: &str, overrides: Option<&str>, trace: &str) -> Result<Vec<Value>, String> {
    let limits = Limits::from_yaml_str(defaults, overrides).map_err(|e| e.to_string())?;
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let mut out = Vec::new();
    let result = simulate::run(&limiter, &clock, trace.as_bytes(), &mut out).await;
    let text = String::from_utf8(out).unwrap();
    // Field order is part of the format.
    if let Some(first) = text.lines().find(|l| l.contains(r#""decisions""#)) {
        assert!(first.starts_with(r#"{"line":"#), "{first}");
        let order = [
            "\"at_us\"",
            "\"op\"",
            "\"allowed\"",
            "\"remaining\"",
            "\"retry_after_us\"",
            "\"reset_after_us\"",
            "\"decisions\"",
        ];
        let positions: Vec<usize> = order.iter().map(|k| first.find(k).unwrap()).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{first}");
    }
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    result.map(|()| lines).map_err(|e| e.to_string())
}

#[tokio::test]
async fn reproduces_the_worked_examples() {
    let mut trace = String::from("0ms spend NewFoosPerIPAddress=172.23.45.22\n");
    for i in 1..20 {
        trace.push_str(&format!(
            "{}us spend NewFoosPerIPAddress=172.23.45.22\n",
            i * 100
        ));
    }
    trace.push_str("1.999ms spend NewFoosPerIPAddress=172.23.45.22\n");
    trace.push_str("50ms spend NewFoosPerIPAddress=172.23.45.22\n");
    trace.push_str("3s spend NewFoosPerIPAddress=172.23.45.22\n");
    let out = run(DEFAULTS, None, &trace).await.unwrap();
    assert_eq!(out[0]["remaining"], 19);
    assert_eq!(out[0]["reset_after_us"], 50_000);
    assert!(out[..20].iter().all(|o| o["allowed"] == true));
    // 21st within the same 50ms: denied until TAT - BO = t0 + 50ms.
    assert_eq!(out[20]["allowed"], false);
    assert_eq!(out[20]["retry_after_us"], 50_000 - 1_999);
    assert_eq!(out[21]["allowed"], true, "one request per 50ms");
    assert_eq!(out[22]["remaining"], 19, "idle longer than BO: full again");

    let out = run(
        DEFAULTS,
        None,
        "0s spend NewOrdersPerAccount=7 cost=100\n0s spend NewOrdersPerAccount=7\n0.999999s spend NewOrdersPerAccount=7\n1s spend NewOrdersPerAccount=7\n",
    )
    .await
    .unwrap();
    let allowed: Vec<_> = out.iter().map(|o| o["allowed"].clone()).collect();
    assert_eq!(allowed, [true, false, false, true]);
    assert_eq!(out[1]["retry_after_us"], 1_000_000);
}

#[tokio::test]
async fn output_format_and_trace_syntax() {
    let out = run(
        DEFAULTS,
        Some("- NewFoosPerIPAddress:\n    burst: 2\n    count: 2\n    period: 1s\n    ids: [10.0.0.1]\n"),
        "# a comment\n\n0s spend NewFoosPerIPAddress=10.0.0.1 check-only:NewOrdersPerAccount=5*100   # trailing comment\n\
         250us check NewFoosPerIPAddress=10.0.0.1 cost=2\n\
         1ms spend spend-only:NewFoosPerIPAddress=10.0.0.1 NewOrdersPerAccount=5\n\
         2ms refund NewFoosPerIPAddress=10.0.0.1\n\
         3ms reset NewFoosPerIPAddress=10.0.0.1\n",
    )
    .await
    .unwrap();
    let first = &out[0];
    assert_eq!(first["line"], 3);
    assert_eq!(first["at_us"], 0);
    assert_eq!(first["op"], "spend");
    // The strictest: the check-only account tx at cost 100 leaves 0 remaining.
    assert_eq!(first["remaining"], 0);
    assert_eq!(first["decisions"][0]["limit"], "NewFoosPerIPAddress");
    assert_eq!(first["decisions"][0]["id"], "10.0.0.1");
    assert_eq!(first["decisions"][0]["remaining"], 1, "override: burst 2");
    assert_eq!(first["decisions"][1]["id"], "5");
    assert_eq!(first.as_object().unwrap().len(), 8);
    assert_eq!(out[1]["at_us"], 250);
    assert_eq!(out[1]["allowed"], false, "cost 2 with 1 left");
    assert_eq!(out[2]["decisions"][0]["allowed"], true);
    assert_eq!(
        out[2]["decisions"][1]["remaining"], 99,
        "check-only wrote nothing earlier"
    );
    assert_eq!(out[3]["op"], "refund");
    assert_eq!(out[3]["allowed"], true);
    assert_eq!(
        out[4],
        serde_json::json!({"line": 7, "at_us": 3000, "op": "reset", "keys": ["NewFoosPerIPAddress=10.0.0.1"]})
    );
}

#[tokio::test]
async fn a_hash_inside_an_id_is_part_of_the_id() {
    let out = run(
        "Api: {burst: 1, count: 1, period: 1s}\n",
        None,
        "# comment\n0s spend Api=a#b # trailing comment\n0s spend Api=a\n0s spend Api=a#b\n",
    )
    .await
    .unwrap();
    assert_eq!(out[0]["decisions"][0]["id"], "a#b");
    assert_eq!(out[1]["allowed"], true, "a and a#b are different buckets");
    assert_eq!(out[2]["allowed"], false);
}

#[tokio::test]
async fn bad_lines_name_the_line_and_print_nothing_for_it() {
    let cases = [
        (
            "0s spend NewFoosPerIPAddress=10.0.0.1\nxyz spend NewFoosPerIPAddress=10.0.0.1\n",
            "line 2",
            1,
        ),
        (
            "0s jump NewFoosPerIPAddress=10.0.0.1\n",
            "unknown operation",
            0,
        ),
        ("0s spend\n", "no transaction", 0),
        ("0s spend Typo=10.0.0.1\n", "unknown limit", 0),
        ("0s spend NewFoosPerIPAddress\n", "malformed transaction", 0),
        (
            "0s spend NewFoosPerIPAddress=010.0.0.1\n",
            "not a valid ip id",
            0,
        ),
        ("0s spend NewFoosPerIPAddress=2001:DB8::1\n", "canonical", 0),
        (
            "0s spend NewFoosPerIPAddress=10.0.0.1 cost=x\n",
            "malformed cost",
            0,
        ),
        (
            "0s spend NewFoosPerIPAddress=10.0.0.1 cost=21\n",
            "exceeds the burst",
            0,
        ),
        (
            "0s spend NewFoosPerIPAddress=10.0.0.1*99999999999999999999\n",
            "too large",
            0,
        ),
        (
            "0s spend NewFoosPerIPAddress=10.0.0.1 NewFoosPerIPAddress=10.0.0.1\n",
            "twice",
            0,
        ),
        (
            "2s spend NewFoosPerIPAddress=10.0.0.1\n1s spend NewFoosPerIPAddress=10.0.0.1\n",
            "backwards",
            1,
        ),
        ("1.5 spend NewFoosPerIPAddress=10.0.0.1\n", "unit", 0),
        (
            "0.0000001s spend NewFoosPerIPAddress=10.0.0.1\n",
            "finer",
            0,
        ),
        (
            "-1s spend NewFoosPerIPAddress=10.0.0.1\n",
            "malformed time",
            0,
        ),
    ];
    for (trace, fragment, printed) in cases {
        let limits = Limits::from_yaml_str(DEFAULTS, None).unwrap();
        let clock = ManualClock::new(simulate::EPOCH_US);
        let limiter = Limiter::new(
            limits,
            MemoryBackend::builder().clock(clock.clone()).build(),
        );
        let mut out = Vec::new();
        let err = simulate::run(&limiter, &clock, trace.as_bytes(), &mut out)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(fragment), "{trace:?}: {err}");
        assert!(err.starts_with("line "), "{err}");
        assert_eq!(
            String::from_utf8(out).unwrap().lines().count(),
            printed,
            "{trace:?}"
        );
    }
}

/// A `*` suffix that starts like a cost (a digit, `-` or `.`) but does not parse is an error
/// naming the line (it became part of a text id before); any other `*` stays in the id.
#[tokio::test]
async fn a_malformed_cost_suffix_is_an_error_and_other_stars_stay_in_the_id() {
    let yaml = "Any: {kind: any, burst: 20, count: 20, period: 1s}\n";
    let run = async |trace: &str| {
        let clock = ManualClock::new(simulate::EPOCH_US);
        let limiter = Limiter::new(
            Limits::from_yaml_str(yaml, None).unwrap(),
            MemoryBackend::builder().clock(clock.clone()).build(),
        );
        let mut out = Vec::new();
        simulate::run(&limiter, &clock, trace.as_bytes(), &mut out)
            .await
            .map(|()| String::from_utf8(out).unwrap())
            .map_err(|e| e.to_string())
    };
    for suffix in ["*..5", "*-1..5", "*.5", "*5..", "*1..x", "*3x"] {
        let err = run(&format!("0s spend Any=user{suffix}\n"))
            .await
            .unwrap_err();
        assert!(err.starts_with("line 1"), "{suffix}: {err}");
        assert!(err.contains("malformed cost suffix"), "{suffix}: {err}");
    }
    // A cost, and stars that do not start like one.
    let out = run("0s spend Any=user*5\n0s spend Any=a*b\n0s spend Any=*x*\n")
        .await
        .unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["remaining"], 15, "user spent 5");
    assert_eq!(lines[1]["remaining"], 19, "a*b is an id of its own");
    assert_eq!(lines[2]["remaining"], 19, "*x* too");
}

/// The `tower-ratelimits-simulate` binary, built by `cargo test` for this crate's tests.
/// The repository's root (the traces and configurations live in its `examples/`).
fn repository() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn simulator() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tower-ratelimits-simulate"))
}

#[test]
fn command_line_exit_codes() {
    let bin = simulator();
    assert!(
        bin.exists(),
        "cargo test builds the binary: {}",
        bin.display()
    );
    let root = repository();
    let out = Command::new(&bin)
        .args([
            "--defaults",
            "examples/traces/gcra-20-per-second.yaml",
            "examples/traces/gcra-worked-examples.trace",
        ])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let allowed: Vec<bool> = lines
        .iter()
        .map(|l| l["allowed"].as_bool().unwrap())
        .collect();
    assert_eq!(
        allowed,
        [
            true, true, false, true, false, true, true, true, false, false, true
        ]
    );

    // A bad config: exit 2, the file and line on stderr, nothing on stdout.
    let bad = std::env::temp_dir().join(format!("trl-sim-bad-{}.yaml", std::process::id()));
    std::fs::write(&bad, "A:\n  burst: 1\n  count: 1\n  period: 1x\n").unwrap();
    let out = Command::new(&bin)
        .arg("--defaults")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:4: limit A", bad.display())),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    std::fs::remove_file(&bad).unwrap();

    // A bad trace line from stdin: exit 2, earlier lines printed, none for the bad one.
    let mut child = Command::new(&bin)
        .args(["--defaults", "examples/config/defaults.yaml", "-"])
        .current_dir(&root)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(
            b"0s spend RequestsPerIPAddress=10.0.0.1\n1s spend RequestsPerIPAddress=not-an-ip\n",
        )
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));

    // Usage errors.
    let out = Command::new(&bin).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--defaults is required"));
}

/// Every line of `examples/traces/burst-tiers-v1-v8.trace` ends with the spec's answer
/// (`# G [units per tier]` or `# R`); the simulator's output must give exactly that answer.
#[tokio::test]
async fn the_burst_tier_examples_v1_to_v8() {
    let dir = repository().join("examples/traces");
    let limits = std::fs::read_to_string(dir.join("burst-tiers.yaml")).unwrap();
    let trace = std::fs::read_to_string(dir.join("burst-tiers-v1-v8.trace")).unwrap();
    let out = run(&limits, None, &trace).await.unwrap();
    let mut checked = 0;
    for line in &out {
        let number = line["line"].as_u64().unwrap() as usize;
        let text = trace.lines().nth(number - 1).unwrap();
        let expected = text.split("# ").nth(1).unwrap().trim();
        let d = &line["decisions"][0];
        if expected == "R" {
            assert_eq!(d["allowed"], false, "line {number}: {text}\n{line}");
            assert_eq!(d["granted"], 0, "line {number}");
        } else {
            let units: Vec<u64> =
                serde_json::from_str(expected.strip_prefix("G ").unwrap()).unwrap();
            assert_eq!(d["allowed"], true, "line {number}: {text}\n{line}");
            assert_eq!(
                d["tiers"],
                serde_json::json!(units),
                "line {number}: {text}"
            );
            assert_eq!(d["granted"], units.iter().sum::<u64>(), "line {number}");
        }
        checked += 1;
    }
    assert_eq!(checked, 105);
}

/// Runs `examples/traces/<name>.trace` on `<name>.yaml` and holds every output line to the
/// fields its trace line ends with (`# {...}`): those of its first decision, or of the line
/// itself for a `release`. Returns each output line with its trace text.
async fn documented_values(name: &str) -> Vec<(Value, String)> {
    let dir = repository().join("examples/traces");
    let limits = std::fs::read_to_string(dir.join(format!("{name}.yaml"))).unwrap();
    let trace = std::fs::read_to_string(dir.join(format!("{name}.trace"))).unwrap();
    // Its overrides, where it has some (`<name>-overrides.yaml`).
    let overrides = std::fs::read_to_string(dir.join(format!("{name}-overrides.yaml"))).ok();
    let out = run(&limits, overrides.as_deref(), &trace).await.unwrap();
    out.into_iter()
        .map(|line| {
            let number = line["line"].as_u64().unwrap() as usize;
            let text = trace.lines().nth(number - 1).unwrap().to_owned();
            let expected: Value = serde_json::from_str(text.split("# ").nth(1).unwrap()).unwrap();
            let op = line["op"].as_str().unwrap_or("");
            let whole_line = ["release", "reset", "open", "message", "close"].contains(&op);
            let d = if whole_line {
                &line
            } else {
                &line["decisions"][0]
            };
            for (field, want) in expected.as_object().unwrap() {
                assert_eq!(&d[field], want, "line {number} {field}: {text}\n{line}");
            }
            (line, text)
        })
        .collect()
}

/// Every line of `examples/traces/calendar.trace` (dated lines: a month renewing on its last
/// day in a leap year, a billing day of 31 in February, a day at 06:00 in +02:00, a week, a
/// batch with a throttle, a charge's overrun, a reset) ends with the fields its decision must
/// have: the renewal exact to the microsecond.
#[tokio::test]
async fn calendar_quotas_renew_exactly_at_their_dated_boundaries() {
    let out = documented_values("calendar").await;
    assert_eq!(out.len(), 24);
    // The renewal: denied one microsecond before it, told to retry in 1 us.
    let before: Vec<_> = out
        .iter()
        .filter(|(l, _)| l["retry_after_us"] == 1)
        .collect();
    assert_eq!(before.len(), 3);
}

/// Every line of `examples/traces/partial-grants.trace` (redis_rate's `AllowAtMost` and
/// Envoy's partial consumption, published values) ends with the fields its decision must have.
#[tokio::test]
async fn partial_grants_on_gcra_give_the_published_values() {
    let out = documented_values("partial-grants").await;
    for (line, text) in &out {
        // A range says what it granted; a single cost does not.
        assert_eq!(
            line["decisions"][0].get("granted").is_some(),
            text.contains(".."),
            "{text}"
        );
    }
    assert_eq!(out.len(), 12);
}

/// Every line of `examples/traces/debt.trace` (charges into debt, the debt bound, exact
/// waits, `max_debt: 0`, the default, tiers without debt) ends with the fields its decision
/// must have; a charge always says what it charged.
#[tokio::test]
async fn charges_go_into_debt_up_to_the_bound_and_the_key_waits_exactly() {
    let out = documented_values("debt").await;
    for (line, text) in &out {
        if line["op"] == "charge" {
            assert!(line["decisions"][0].get("granted").is_some(), "{text}");
            assert_eq!(line["allowed"], true, "a charge is never denied: {text}");
        }
    }
    assert_eq!(out.len(), 17);
}

/// Every line of `examples/traces/streams.trace` (messages counted per message and per unit
/// in one batch, a stream ended at its first refusal, two streams sharing a key, a message
/// above the burst, grants taken ahead and given back at close) ends with the fields its
/// answer must have.
#[tokio::test]
async fn a_stream_s_messages_are_admitted_one_batch_each_and_its_grants_come_back() {
    let out = documented_values("streams").await;
    assert_eq!(out.len(), 25);
    let refused = out.iter().filter(|(l, _)| l["allowed"] == false).count();
    assert_eq!(refused, 4);
}

/// A stream line that does not say a stream is an error with its line: a message or close of
/// a stream not open, a stream opened twice, a key with a cost or a mode, units that are not
/// a number, and a run in regions.
#[tokio::test]
async fn stream_lines_that_say_no_stream_are_errors() {
    let limits = "M: {kind: account, burst: 3, count: 1, period: 1s}\n";
    let cases = [
        ("0s message s\n", "is not open"),
        ("0s close s\n", "is not open"),
        ("0s open s M=1\n0s open s M=1\n", "open already"),
        ("0s open s M=1*2\n", "its cost the message's"),
        ("0s open s check-only:M=1\n", "its cost the message's"),
        ("0s open s M=1\n0s message s units=x\n", "units=<n>"),
        ("0s open s M=1\n0s message s units=1 more\n", "nothing else"),
        ("0s open\n", "names no stream"),
        ("0s open s\n", "at least one key"),
        ("0s open s M=1 ahead=x\n", "ahead=x"),
        ("1s open s M=1\n0s message s\n", "backwards"),
    ];
    for (trace, fragment) in cases {
        let err = run(limits, None, trace).await.unwrap_err();
        assert!(err.contains(fragment), "{trace:?}: {err}");
    }
}

/// A charge line takes no mode prefix (an error, not a decision); on a concurrency limit a
/// charge records a slot already in use, even when none is free.
#[tokio::test]
async fn a_charge_takes_no_mode_and_takes_a_slot_even_when_none_is_free() {
    let limits = "Debt5:\n  burst: 10\n  count: 10\n  period: 1s\nSlots:\n  concurrency: 2\n";
    let err = run(limits, None, "0s charge spend-only:Debt5=a*3\n")
        .await
        .unwrap_err();
    assert!(
        err.contains("line 1") && err.contains("no mode prefix"),
        "{err}"
    );
    let out = run(
        limits,
        None,
        "0s spend Slots=a\n0s spend Slots=a\n0s charge Slots=a\n0s spend Slots=a\n",
    )
    .await
    .unwrap();
    let allowed: Vec<_> = out
        .iter()
        .map(|l| l["allowed"].as_bool().unwrap())
        .collect();
    assert_eq!(allowed, [true, true, true, false]);
    assert_eq!(
        out[2]["decisions"][0]["lease"], true,
        "the charge took a slot"
    );
}

/// Every line of `examples/traces/fair-share.trace` (an id alone taking the whole budget, a
/// weighted id refused below its share and its units held, an id over its share refused while
/// a unit is left, a new id below its share, what is held after they go quiet, a probe, a
/// refund) ends with the fields its decision must have.
#[tokio::test]
async fn fair_shares_give_the_documented_values() {
    let out = documented_values("fair-share").await;
    assert_eq!(out.len(), 26);
    assert!(out.iter().any(|(l, _)| l["allowed"] == false));
}

/// Every line of `examples/traces/concurrency.trace` (slots taken, refused, probed, released,
/// held back by a batch's rate limit, ended at their lease time) ends with the fields its first
/// decision (a `release` line: the line itself) must have.
#[tokio::test]
async fn concurrency_limits_give_the_documented_values() {
    let out = documented_values("concurrency").await;
    for (line, text) in &out {
        // Only a slot taken says so.
        if line["op"] != "release" {
            assert_eq!(
                line["decisions"][0].get("lease").is_some(),
                text.contains("\"lease\":true"),
                "{text}"
            );
        }
    }
    assert_eq!(out.len(), 15);
}

/// Every line of `examples/traces/penalty.trace` (a ladder's bans of 10, 20 and at most 30 s,
/// each to the microsecond, refused with `"banned":true`, a unit leaving the window after a
/// minute, the level falling a step each quiet minute) ends with the fields its decision must
/// have.
#[tokio::test]
async fn penalty_ladders_ban_for_the_documented_lengths() {
    let out = documented_values("penalty").await;
    assert_eq!(out.len(), 24);
    let banned = out
        .iter()
        .filter(|(l, _)| l["decisions"][0]["banned"] == true)
        .count();
    assert_eq!(banned, 7, "every refusal is a ban's");
}

/// Every line of `examples/traces/adaptive.trace` (slots taken under the key's number, a
/// window of completions growing it, a failure halving it below the slots in use, held slots
/// kept, a probe, the idle reset to `initial`) ends with the fields its first decision (a
/// `release` line: the line itself) must have; the number moved as the trace says.
#[tokio::test]
async fn adaptive_limits_give_the_documented_values() {
    let out = documented_values("adaptive").await;
    assert_eq!(out.len(), 33);
    let numbers: Vec<u64> = out
        .iter()
        .filter_map(|(l, _)| l["decisions"][0]["slots"].as_u64())
        .collect();
    let mut moves = numbers.clone();
    moves.dedup();
    assert_eq!(moves, [4, 5, 2, 3, 4]);
}

/// `failed` ends a release's transactions; on any other line it is an error naming the line.
#[tokio::test]
async fn failed_marks_only_a_release() {
    let limits = "Slots:\n  concurrency: {adaptive: {min: 1, initial: 2, max: 4, algorithm: aimd, completions: 1}}\n";
    let out = run(
        limits,
        None,
        "0s spend Slots=a\n0s release Slots=a failed\n0s check Slots=a\n",
    )
    .await
    .unwrap();
    assert_eq!(out[1]["released"], 1);
    assert_eq!(
        out[2]["decisions"][0]["slots"], 1,
        "a window of one failure: 2 -> 1"
    );
    let err = run(limits, None, "0s spend Slots=a failed\n")
        .await
        .unwrap_err();
    assert!(
        err.contains("line 1") && err.contains("`failed` marks a release"),
        "{err}"
    );
}

#[tokio::test]
async fn tiered_decisions_carry_granted_tiers_burst_and_tier() {
    let limits = "\
P:
  tiers:
    - {limit: 2, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 3, window: 1s, active: 1s, cooldown: 5s}
";
    let out = run(
        limits,
        None,
        "0s spend P=a cost=1..4\n0s spend P=a*2\n0s spend P=a\n",
    )
    .await
    .unwrap();
    let d = &out[0]["decisions"][0];
    assert_eq!(d["granted"], 4);
    assert_eq!(d["tiers"], serde_json::json!([2, 2]));
    assert_eq!(d["burst"], true);
    assert_eq!(d["tier"], 2);
    assert_eq!(d["remaining"], 1);
    let denied = &out[1]["decisions"][0];
    assert_eq!(
        (denied["allowed"].clone(), denied["tier"].clone()),
        (false.into(), 2.into())
    );
    // Tier 2's active period ends at 1s + 1us; then tier 1 is full (until 1s + 1us too).
    assert_eq!(denied["retry_after_us"], 1_000_001);
    assert_eq!(out[2]["decisions"][0]["granted"], 1);
    // GCRA decisions keep their fields (no tier fields).
    let gcra = run(DEFAULTS, None, "0s spend NewFoosPerIPAddress=1.2.3.4\n")
        .await
        .unwrap();
    assert!(gcra[0]["decisions"][0].get("granted").is_none());
    // A range whose lower end exceeds the burst, an empty range and a malformed one are errors
    // naming the line.
    let e = run(
        DEFAULTS,
        None,
        "0s spend NewFoosPerIPAddress=1.2.3.4 cost=21..22\n",
    )
    .await;
    assert!(e.unwrap_err().contains("cost 21 exceeds the burst of 20"));
    let e = run(limits, None, "0s spend P=a cost=3..2\n").await;
    assert!(e.unwrap_err().contains("empty"));
    let e = run(limits, None, "0s spend P=a cost=1..x\n").await;
    assert!(e.unwrap_err().contains("malformed cost"));
    // After a `*`, `<n>` or `<min>..<max>` is a cost; a suffix that starts like one (a digit,
    // `-` or `.`) but is not one is an error (`a*1.2` was the id "a*1.2");
    // anything else is part of the id.
    let e = run(limits, None, "0s spend P=a*1.2\n").await;
    assert!(e.unwrap_err().contains("malformed cost suffix *1.2"));
    let ids = run(limits, None, "0s spend P=a*b\n0s spend P=a*1..2\n")
        .await
        .unwrap();
    assert_eq!(ids[0]["decisions"][0]["id"], "a*b");
    assert_eq!(ids[1]["decisions"][0]["id"], "a");
    assert_eq!(ids[1]["decisions"][0]["granted"], 2);
    let e = run(limits, None, "0s spend P=a cost=6..9\n").await;
    assert!(e.unwrap_err().contains("exceeds"), "too large a minimum");
}

#[test]
fn trace_times_are_exact_microseconds() {
    assert_eq!(simulate::parse_time_us("1.01s"), Ok(1_010_000));
    assert_eq!(simulate::parse_time_us("250us"), Ok(250));
    assert_eq!(simulate::parse_time_us("0ms"), Ok(0));
    assert!(simulate::parse_time_us("1.0000001s").is_err());
    assert!(simulate::parse_time_us("5").is_err());
    // A date: that far after the trace's start, to the microsecond.
    assert_eq!(simulate::parse_time_us("2023-11-14T22:13:20Z"), Ok(0));
    assert_eq!(
        simulate::parse_time_us("2023-11-14T22:13:21.000001Z"),
        Ok(1_000_001)
    );
    let before = simulate::parse_time_us("2023-11-14T22:13:19Z").unwrap_err();
    assert!(before.contains("before the trace's start"), "{before}");
    let bad = simulate::parse_time_us("2023-02-30T00:00:00Z").unwrap_err();
    assert!(bad.contains("no such date"), "{bad}");
}

#[tokio::test]
async fn a_line_that_never_ends_is_an_error_in_bounded_memory() {
    let limits = Limits::from_yaml_str(DEFAULTS, None).unwrap();
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    // A first good line, then bytes that never end: the reader gives up after the cap.
    let input = std::io::BufReader::new(std::io::Read::chain(
        "0s spend NewFoosPerIPAddress=10.0.0.1\n".as_bytes(),
        std::io::repeat(b'a'),
    ));
    let mut out = Vec::new();
    let err = simulate::run(&limiter, &clock, input, &mut out)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "line 2: too long (more than {} bytes)",
            simulate::MAX_LINE_BYTES
        )
    );
    assert_eq!(String::from_utf8(out).unwrap().lines().count(), 1);
    // A line at the cap is read; one byte more is refused.
    let at_cap = format!(
        "0s spend NewFoosPerIPAddress=10.0.0.1{}\n",
        " ".repeat(simulate::MAX_LINE_BYTES - "0s spend NewFoosPerIPAddress=10.0.0.1".len(),)
    );
    assert!(run(DEFAULTS, None, &at_cap).await.is_ok());
    let over = format!("{} \n", &at_cap[..at_cap.len() - 1]);
    assert!(
        run(DEFAULTS, None, &over)
            .await
            .unwrap_err()
            .contains("too long")
    );
    // Bytes that are not UTF-8 are a line error, not an i/o failure.
    let mut out = Vec::new();
    let err = simulate::run(&limiter, &clock, &b"0s spend \xff\n"[..], &mut out)
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "line 1: not UTF-8");
}

#[tokio::test]
async fn a_line_with_many_transactions_finds_its_duplicate() {
    // 20,000 distinct ids and one repeated at the end: the duplicate is found (by a hash set
    // beyond 16 transactions) and named.
    let mut line = String::from("0s check");
    for i in 0..20_000u32 {
        line.push_str(&format!(
            " NewFoosPerIPAddress=10.{}.{}.{}",
            i >> 16,
            (i >> 8) & 255,
            i & 255
        ));
    }
    let unique = run(DEFAULTS, None, &format!("{line}\n")).await.unwrap();
    assert_eq!(unique[0]["decisions"].as_array().unwrap().len(), 20_000);
    let err = run(
        DEFAULTS,
        None,
        &format!("{line} NewFoosPerIPAddress=10.0.78.31\n"),
    )
    .await
    .unwrap_err();
    assert!(
        err.contains("NewFoosPerIPAddress:10.0.78.31 appears twice"),
        "{err}"
    );
}

/// `--redis` prints exactly what the in-memory run prints, also where the
/// Redis backend's deny cache would answer (a batch denied by its throttle, then the same batch
/// again: the cache knew the denial and left the quota unevaluated, `"skipped":true`, where
/// memory evaluates it). The simulator runs Redis without the deny cache and without
/// prefetching: deployments' optimisations, which a trace leaves out. Every conformance trace
/// is run both ways too.
#[cfg(feature = "redis")]
#[path = "support/redis.rs"]
mod redis_support;

#[cfg(feature = "redis")]
#[test]
fn redis_prints_what_memory_prints() {
    let server = redis_support::Server::shared_or_own();
    let dir = std::env::temp_dir().join(format!("sim-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let defaults = dir.join("limits.yaml");
    std::fs::write(
        &defaults,
        "Throttle: {kind: account, burst: 1, count: 1, period: 1h}\n\
         Monthly: {kind: account, calendar: {count: 5, period: month}}\n",
    )
    .unwrap();
    let trace = dir.join("deny.trace");
    std::fs::write(
        &trace,
        "0ms spend Throttle=7 Monthly=7\n1ms spend Throttle=7 Monthly=7\n2ms spend Throttle=7 Monthly=7\n",
    )
    .unwrap();
    let root = repository();
    let mut runs: Vec<(String, String)> =
        vec![(defaults.display().to_string(), trace.display().to_string())];
    for (yaml, t) in [
        ("gcra-20-per-second.yaml", "gcra-worked-examples.trace"),
        ("calendar.yaml", "calendar.trace"),
        ("concurrency.yaml", "concurrency.trace"),
        ("adaptive.yaml", "adaptive.trace"),
        ("streams.yaml", "streams.trace"),
    ] {
        let at = |f: &str| root.join("examples/traces").join(f).display().to_string();
        runs.push((at(yaml), at(t)));
    }
    for (yaml, t) in runs {
        let run = |redis: bool| {
            let mut cmd = Command::new(simulator());
            if redis {
                cmd.args(["--redis", &server.1]);
            }
            let out = cmd.args(["--defaults", &yaml, &t]).output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let memory = run(false);
        assert!(!memory.is_empty());
        assert_eq!(run(true), memory, "{t}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
