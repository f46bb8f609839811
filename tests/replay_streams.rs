//! Streams in a replay (`docs/replay.md`, "Streams"): a log with a line per message replays
//! each message through the meter of its stream's per-message keys under both policies, at
//! its logged time (exact); a log with a stream's totals spreads them (an approximation the
//! plan says it is).

use std::time::Duration;

use tower_ratelimits::{
    Limits, LogReader, MessageCounts, Plan, Replay, RuleSet, StreamsEnded, StreamsPlan,
};

const T0: &str = "2026-11-25T10:00:";

/// A request of account 7 at `10:00:<s>` that opens stream `id`, with `extra` fields.
fn opens(s: &str, id: &str, extra: &str) -> String {
    format!(
        "{{\"time\":\"{T0}{s}Z\",\"ip\":\"192.0.2.1\",\"headers\":{{\"x-account\":\"7\"}},\"stream\":\"{id}\"{extra}}}\n"
    )
}

/// A message of `units` of stream `id` at `10:00:<s>`.
fn message(s: &str, id: &str, units: u64) -> String {
    format!("{{\"time\":\"{T0}{s}Z\",\"message_of\":\"{id}\",\"units\":{units}}}\n")
}

fn replay(rules: &str, current: &str, candidate: &str, log: String) -> Plan {
    let rules = RuleSet::from_yaml_str(rules).unwrap();
    let limits = |yaml: &str| Limits::from_yaml_str(yaml, None).unwrap();
    let reader = LogReader::from_readers(
        vec![("log".into(), Box::new(std::io::Cursor::new(log)))],
        None,
        Duration::ZERO,
    );
    Replay::new(move |l| rules.layer(l), limits(current), limits(candidate))
        .run(reader)
        .unwrap()
}

fn counts(passed: u64, held: u64, refused: u64, unopened: u64) -> MessageCounts {
    MessageCounts {
        passed,
        held,
        refused,
        unopened,
    }
}

const END: &str = "- {limit: Messages, key: 'header:x-account', per: message, at_limit: end}\n";

/// Five messages of one stream under a burst of 4 (current) and of 2 (candidate), ending at
/// the limit: each policy passes its burst and ends the stream at the next message, whose
/// limit the plan names; the messages the candidate refuses and the current passed are its
/// flips; the opening request is the plan's one request.
#[test]
fn each_message_of_a_logged_stream_is_admitted_by_its_meter_under_both_policies() {
    let mut log = opens("00", "s1", "");
    for s in ["01", "02", "03", "04", "05"] {
        log += &message(s, "s1", 1);
    }
    let plan = replay(
        END,
        "Messages: {kind: account, burst: 4, count: 1, period: 1h}\n",
        "Messages: {kind: account, burst: 2, count: 1, period: 1h}\n",
        log,
    );
    assert_eq!(plan.requests, 1);
    assert!(plan.not_replayed.is_empty());
    let streams = plan.streams.unwrap();
    assert_eq!(
        (streams.streams, streams.messages, streams.approximate),
        (1, 5, 0)
    );
    assert_eq!(streams.current, counts(4, 0, 1, 0));
    assert_eq!(streams.candidate, counts(2, 0, 3, 0));
    assert_eq!((streams.pass_to_refuse, streams.refuse_to_pass), (2, 0));
    let ended = StreamsEnded {
        current: 1,
        candidate: 1,
    };
    assert_eq!(streams.limits["Messages"], ended);
    assert!(streams.approximation.is_none());
}

/// A rule that pushes back holds a message until its units come, and the stream's next
/// message waits behind it (a stalled sender): counted as held, not refused, and not a flip.
#[test]
fn a_message_pushed_back_is_held_and_the_next_waits_behind_it() {
    let rules =
        "- {limit: Messages, key: 'header:x-account', per: message, at_limit: {push_back: 5s}}\n";
    let log = opens("00", "s1", "")
        + &message("00", "s1", 1)
        + &message("00.1", "s1", 1)
        + &message("00.2", "s1", 1)
        + &message("09", "s1", 1);
    let plan = replay(
        rules,
        "Messages: {kind: account, burst: 1, count: 1, period: 1s}\n",
        "Messages: {kind: account, burst: 3, count: 1, period: 1s}\n",
        log,
    );
    let streams = plan.streams.unwrap();
    // Current: the 2nd waits to 1s, the 3rd behind it to 2s; the 4th finds room at 9s.
    assert_eq!(streams.current, counts(2, 2, 0, 0));
    assert_eq!(streams.candidate, counts(4, 0, 0, 0));
    assert_eq!((streams.pass_to_refuse, streams.refuse_to_pass), (0, 0));
    assert!(streams.limits.is_empty());
}

/// One limit across an account's streams: two streams of account 7 share its 3 messages
/// (current); under a candidate whose request limit refuses the second stream's request, that
/// stream is not open and its messages are `unopened` (refused, as flips count them).
#[test]
fn streams_of_one_key_share_its_limit_and_a_refused_request_opens_none() {
    let rules = format!("- {{limit: Requests, key: 'header:x-account'}}\n{END}");
    let log = opens("00", "a", "")
        + &opens("00.5", "b", "")
        + &message("01", "a", 1)
        + &message("02", "b", 1)
        + &message("03", "a", 1)
        + &message("04", "b", 1);
    let messages = "Messages: {kind: account, burst: 3, count: 1, period: 1h}\n";
    let plan = replay(
        &rules,
        &format!("Requests: {{kind: account, burst: 2, count: 1, period: 1h}}\n{messages}"),
        &format!("Requests: {{kind: account, burst: 1, count: 1, period: 1h}}\n{messages}"),
        log,
    );
    assert_eq!((plan.current.allowed, plan.candidate.allowed), (2, 1));
    let streams = plan.streams.unwrap();
    assert_eq!(streams.streams, 2);
    assert_eq!(streams.current, counts(3, 0, 1, 0));
    assert_eq!(streams.candidate, counts(2, 0, 0, 2));
    // b's first message flips (passed, then unopened); b's second was refused by both.
    assert_eq!((streams.pass_to_refuse, streams.refuse_to_pass), (1, 0));
}

/// A rule `per: unit` charges a message's units: 5 + 5 pass a burst of 12, the third 5 ends
/// the stream (limit named).
#[test]
fn a_rule_per_unit_charges_each_message_its_logged_units() {
    let rules = "- {limit: Bytes, key: 'header:x-account', per: unit, at_limit: end}\n";
    let log = opens("00", "s", "") + &message("01", "s", 5).repeat(3);
    let bytes = "Bytes: {kind: account, burst: 12, count: 1, period: 1h}\n";
    let plan = replay(rules, bytes, bytes, log);
    let streams = plan.streams.unwrap();
    assert_eq!(streams.current, counts(2, 0, 1, 0));
    assert_eq!(streams.limits["Bytes"].current, 1);
}

/// A stream logged by its totals (`messages`, `units` on its request) is replayed with its
/// messages spread evenly over its duration: the same answers as the log with those messages
/// written out, and the plan says it is an approximation.
#[test]
fn a_stream_logged_by_its_totals_is_an_approximation_the_plan_names() {
    let limits = "Messages: {kind: account, burst: 4, count: 1, period: 1h}\n";
    let totals = replay(
        END,
        limits,
        limits,
        opens("00", "s", ",\"duration_ms\":4000,\"messages\":5"),
    );
    let mut log = opens("00", "s", ",\"duration_ms\":4000");
    for s in ["00", "00.8", "01.6", "02.4", "03.2"] {
        log += &message(s, "s", 1);
    }
    let exact = replay(END, limits, limits, log);
    let (totals, exact) = (totals.streams.unwrap(), exact.streams.unwrap());
    assert_eq!(totals.approximate, 1);
    assert!(totals.approximation.unwrap().contains("approximation"));
    assert_eq!(
        StreamsPlan {
            approximate: 0,
            approximation: None,
            ..totals
        },
        exact
    );
    assert_eq!(exact.current, counts(4, 0, 1, 0));
}

/// A message of no open stream (an unknown id, or after its stream's logged end) is not
/// replayed: counted as `outside`. A stream no per-message rule applies to passes every
/// message.
#[test]
fn messages_outside_an_open_stream_are_counted_and_unmetered_streams_pass() {
    let log = opens("00", "s", ",\"duration_ms\":1000")
        + &message("00.5", "s", 1)
        + &message("00.6", "nobody", 1)
        + &message("02", "s", 1);
    let rules = "- {limit: Messages, key: 'header:x-other', per: message, on_missing_key: skip}\n";
    let limits = "Messages: {kind: account, burst: 1, count: 1, period: 1h}\n";
    let plan = replay(rules, limits, limits, log);
    let streams = plan.streams.unwrap();
    assert_eq!((streams.messages, streams.outside), (1, 2));
    assert_eq!(streams.current, counts(1, 0, 0, 0));
}

/// Stream fields that say no stream are bad lines, each with its reason; a message line needs
/// no address.
#[test]
fn stream_fields_that_say_no_stream_are_bad_lines() {
    let bad = [
        r#"{"time":"2026-11-25T10:00:01Z","ip":"192.0.2.1","stream":"a","message_of":"a"}"#,
        r#"{"time":"2026-11-25T10:00:01Z","ip":"192.0.2.1","stream":"a","messages":0}"#,
        r#"{"time":"2026-11-25T10:00:01Z","ip":"192.0.2.1","stream":"a","messages":1000001}"#,
        r#"{"time":"2026-11-25T10:00:01Z","message_of":"a","messages":2}"#,
        r#"{"time":"2026-11-25T10:00:01Z","ip":"192.0.2.1","units":2}"#,
        r#"{"time":"2026-11-25T10:00:01Z","ip":"192.0.2.1","stream":""}"#,
        r#"{"time":"2026-11-25T10:00:01Z"}"#,
    ];
    let log = opens("00", "s", "") + &bad.join("\n") + "\n" + &message("02", "s", 1);
    let limits = "Messages: {kind: account, burst: 1, count: 1, period: 1h}\n";
    let plan = replay(END, limits, limits, log);
    assert_eq!(plan.bad_lines, 7);
    let reasons: Vec<_> = plan
        .bad_line_examples
        .iter()
        .map(|b| b.reason.as_str())
        .collect();
    assert!(reasons[0].contains("not both"), "{reasons:?}");
    assert!(reasons[1].contains("1 or more"), "{reasons:?}");
    assert!(reasons[2].contains("at most 1000000"), "{reasons:?}");
    assert!(reasons[3].contains("units, not messages"), "{reasons:?}");
    assert!(reasons[4].contains("opens none"), "{reasons:?}");
    assert_eq!(plan.streams.unwrap().messages, 1);
}

/// A log holds no bodies: a rule priced from the request's body cannot be priced in a replay,
/// and its streams' messages are refused there (as a handler that cannot price them refuses
/// them), as `docs/replay.md` says.
#[test]
fn a_rule_priced_from_the_body_refuses_its_messages_in_a_replay() {
    let rules = "prices: {models: {small: {input: 1, output: 1}}}\n\
                 rules:\n  - {limit: Spend, key: 'header:x-account', per: unit, price: {model: 'body:model', of: output}}\n";
    let spend = "Spend: {kind: account, burst: 100, count: 1, period: 1h}\n";
    let log = opens("00", "s", "") + &message("01", "s", 1).repeat(2);
    let streams = replay(rules, spend, spend, log).streams.unwrap();
    assert_eq!(streams.current, counts(0, 0, 2, 0));
}
