//! Rules per message (`Rule::per`, `per:` in a rules file): the layer finds a stream's keys as
//! it finds a request's and hands them to the handler (`StreamKeys`), undecided; the handler's
//! meter counts each message. Served over real TCP, read by a real HTTP client.

mod support;

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::{Extension, Router, routing::get};
use futures_util::StreamExt;
use support::http::{HttpClient, serve};
use tower_ratelimits::{
    AtLimit, Header, LayerError, LimitedStream, Limiter, Limits, ManualClock, MemoryBackend, Per,
    Rule, RuleSet, Settle, StreamKeys, Wait,
};

const LIMITS: &str = "\
Requests: {kind: account, burst: 3, count: 1, period: 1h}
Messages: {kind: account, burst: 4, count: 1, period: 1h}
Bytes: {kind: account, burst: 12, count: 1, period: 1h}
Slots: {kind: account, concurrency: 2, lease: 1m}
Spend: {kind: account, burst: 10, count: 1, period: 1h}
";

fn limiter() -> Limiter {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let backend = MemoryBackend::builder().clock(clock).build();
    Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend)
}

/// Streams `n` lines (`m0`, `m1`, ...), each admitted by a meter of the request's keys; a
/// request without keys gets them all, unmetered, after a line `unmetered`.
async fn events(uri: http::Uri, keys: Option<Extension<StreamKeys>>) -> Body {
    let n: u32 = uri
        .query()
        .and_then(|q| q.strip_prefix("n=")?.parse().ok())
        .unwrap_or(0);
    let lines = futures_util::stream::iter(0..n).map(|i| format!("m{i}\n"));
    let Some(Extension(keys)) = keys else {
        let head = futures_util::stream::iter(["unmetered\n".to_owned()]);
        return Body::from_stream(head.chain(lines).map(Ok::<_, Infallible>));
    };
    let ends = match keys.at_limit() {
        Some(AtLimit::End) => "end",
        Some(_) => "push back",
        None => "default",
    };
    let head = futures_util::stream::iter([format!("{} keys, {ends}\n", keys.keys().count())]);
    match keys.meter().build() {
        Ok(meter) => {
            let limited = LimitedStream::new(lines, meter).units(|line: &String| line.len() as u64);
            Body::from_stream(head.chain(limited).map(Ok::<_, Infallible>))
        }
        Err(e) => Body::from(e.to_string()),
    }
}

fn app(layer: tower_ratelimits::RateLimitLayer) -> Router {
    Router::new().route("/events", get(events)).layer(layer)
}

/// A per-message rule decides no request: the account's requests are the request rule's (3,
/// then 429), while each stream is cut at the messages the account has left (4, then 0),
/// and the layer's keys reach the handler whole (two keys, ending at a limit).
#[tokio::test]
async fn a_rule_per_message_counts_a_streams_messages_not_its_requests() {
    let rules = RuleSet::from_yaml_str(
        "- {limit: Requests, key: 'header:x-account'}\n\
         - {limit: Messages, key: 'header:x-account', per: message, at_limit: end}\n\
         - {limit: Bytes, key: 'header:x-account', per: unit, at_limit: {push_back: 2s}}\n",
    )
    .unwrap();
    let server = serve(app(rules.layer(limiter()).unwrap())).await;
    let client = HttpClient::new(&server);
    let first = client.get("/events?n=3", &[("x-account", "7")]).await;
    assert_eq!(
        (first.status, first.body.as_str()),
        (200, "2 keys, end\nm0\nm1\nm2\n")
    );
    // One message left of the burst of 4, and 3 bytes of 12 (a line is 3).
    let second = client.get("/events?n=3", &[("x-account", "7")]).await;
    assert_eq!(second.body, "2 keys, end\nm0\n");
    let third = client.get("/events?n=3", &[("x-account", "7")]).await;
    assert_eq!((third.status, third.body.as_str()), (200, "2 keys, end\n"));
    assert_eq!(
        client
            .get("/events?n=3", &[("x-account", "7")])
            .await
            .status,
        429
    );
    // Another account's messages are its own.
    let other = client.get("/events?n=3", &[("x-account", "8")]).await;
    assert_eq!(other.body, "2 keys, end\nm0\nm1\nm2\n");
}

/// A per-message rule finds its key as any rule does: a request without it is refused (400 by
/// default) before the handler runs, unless the rule skips (then no keys reach the handler);
/// out of the rule's scope, none either.
#[tokio::test]
async fn a_per_message_rules_key_is_found_as_any_rules() {
    let refusing = Rule::new("Messages", Header::new("x-account")).per(Per::Message);
    let layer = tower_ratelimits::RateLimitLayer::builder(limiter())
        .rule(refusing)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let client = HttpClient::new(&server);
    let reply = client.get("/events?n=1", &[]).await;
    assert_eq!(reply.status, 400);
    assert!(
        reply.body.contains("missing key for rate limit Messages"),
        "{}",
        reply.body
    );

    let rules = RuleSet::from_yaml_str(
        "- {limit: Messages, key: 'header:x-account', per: message, on_missing_key: skip}\n\
         - {limit: Bytes, key: 'header:x-account', per: unit, path_prefix: /elsewhere}\n",
    )
    .unwrap();
    let server = serve(app(rules.layer(limiter()).unwrap())).await;
    let client = HttpClient::new(&server);
    let skipped = client.get("/events?n=1", &[]).await;
    assert_eq!(
        (skipped.status, skipped.body.as_str()),
        (200, "unmetered\nm0\n")
    );
    let scoped = client.get("/events?n=1", &[("x-account", "7")]).await;
    assert_eq!(scoped.body, "1 keys, default\nm0\n");
}

/// What a per-message rule cannot do is refused when the layer is built, naming the rule: a
/// cost of its own, settling, waiting, shadow (its own or the layer's), a limit of slots.
#[test]
fn a_rule_per_message_that_cannot_count_messages_is_refused() {
    let refused = |rule: Rule, shadow_all: bool| {
        let built = tower_ratelimits::RateLimitLayer::builder(limiter())
            .rule(rule)
            .shadow(shadow_all)
            .build();
        match built {
            Err(LayerError::PerMessage { limit, reason }) => format!("{limit}: {reason}"),
            other => panic!("{other:?}"),
        }
    };
    let rule = |name: &str| Rule::new(name, Header::new("x-account")).per(Per::Message);
    assert!(refused(rule("Messages").cost(2), false).starts_with("Messages: a message costs"));
    assert!(refused(rule("Messages").settle(Settle::header("x-used")), false).contains("settle"));
    let wait = Wait::up_to(Duration::from_secs(1));
    assert!(refused(rule("Messages").wait(wait), false).contains("pushing back"));
    assert!(refused(rule("Messages").shadow(true), false).contains("no shadow"));
    assert!(refused(rule("Messages"), true).contains("no shadow"));
    assert!(refused(rule("Slots"), false).contains("holds slots"));
}

/// A rules file's `per` and `at_limit`, and what it refuses, by line.
#[test]
fn a_rules_file_says_per_and_at_limit() {
    let error = |text: &str| RuleSet::from_yaml_str(text).unwrap_err().to_string();
    assert!(
        error("- {limit: M, key: client_ip, at_limit: end}\n")
            .contains("at_limit is for a rule with `per: message`")
    );
    assert!(
        error("- {limit: M, key: client_ip, per: frame}\n")
            .contains("use request, message or unit")
    );
    assert!(
        error("- {limit: M, key: client_ip, per: message, cost: 2}\n").contains("leave `cost`")
    );
    assert!(
        error("- {limit: M, key: client_ip, per: unit, count_when: [{status: 401}]}\n")
            .contains("leave `cost` and `count_when` out")
    );
    assert!(
        error("- {limit: M, key: client_ip, per: message, at_limit: {push_back: soon}}\n")
            .contains("push_back")
    );
    assert!(
        error("- {limit: M, key: client_ip, per: message, at_limit: stop}\n")
            .contains("at_limit: end, push_back")
    );
    // `per: request` is the default, spelled out.
    let set = RuleSet::from_yaml_str(
        "- {limit: Requests, key: client_ip, per: request}\n\
         - {limit: Messages, key: client_ip, per: message, at_limit: push_back}\n",
    )
    .unwrap();
    assert_eq!(set.limit_names().count(), 2);
}

/// A limit a rule per message counts cannot be reloaded into one that holds slots (its
/// streams' meters could not be built): the reload is refused and the old limits stay; any
/// other change of it is taken.
#[test]
fn a_reload_may_not_make_a_per_message_limit_hold_slots() {
    let limiter = limiter();
    let _layer = tower_ratelimits::RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Messages", Header::new("x-account")).per(Per::Message))
        .rule(Rule::new("Slots", Header::new("x-account")))
        .build()
        .unwrap();
    let with = |messages: &str| {
        let yaml = LIMITS.replace(
            "Messages: {kind: account, burst: 4, count: 1, period: 1h}",
            messages,
        );
        Limits::from_yaml_str(&yaml, None).unwrap()
    };
    match limiter.reload(with("Messages: {kind: account, concurrency: 3, lease: 1m}")) {
        Err(tower_ratelimits::ReloadError::HoldsSlots(name)) => assert_eq!(name, "Messages"),
        other => panic!("{other:?}"),
    }
    let key = limiter
        .key("Messages", tower_ratelimits::Id::from(7u64))
        .unwrap();
    // The old limits stay: a stream's meter of the limit is still built.
    assert!(
        tower_ratelimits::StreamMeter::builder(&limiter)
            .per_message(key)
            .build()
            .is_ok()
    );
    limiter
        .reload(with(
            "Messages: {kind: account, burst: 9, count: 9, period: 1h}",
        ))
        .unwrap();
}

/// A replay of request logs decides the rules per request and says which limits it left out:
/// a rule per message in its plan's `not_replayed`, with why; the requests are the request
/// rule's alone (3 of 4 allowed, the 4th denied by `Requests`).
#[test]
fn a_plan_says_which_limits_counted_per_message_it_did_not_replay() {
    use tower_ratelimits::{LogReader, Replay};
    let rules = RuleSet::from_yaml_str(
        "- {limit: Requests, key: 'header:x-account'}\n\
         - {limit: Messages, key: 'header:x-account', per: message}\n",
    )
    .unwrap();
    let limits = Limits::from_yaml_str(LIMITS, None).unwrap();
    let line = r#"{"time":"2026-11-25T10:00:00Z","ip":"192.0.2.1","headers":{"x-account":"7"}}"#;
    let log = format!("{line}\n").repeat(4);
    let lines = LogReader::from_readers(
        vec![("log".into(), Box::new(std::io::Cursor::new(log)))],
        None,
        Default::default(),
    );
    let plan = Replay::new(move |l| rules.layer(l), limits.clone(), limits)
        .run(lines)
        .unwrap();
    assert_eq!((plan.current.allowed, plan.current.denied), (3, 1));
    let reasons: Vec<_> = plan.not_replayed.iter().collect();
    assert_eq!(reasons.len(), 1);
    assert_eq!(reasons[0].0, "Messages");
    assert!(reasons[0].1.contains("holds no messages"));
    let json = serde_json::to_value(&plan).unwrap();
    assert!(json["not_replayed"]["Messages"].is_string());
}

/// A rules file's rule may charge a stream's units at their price (`price: {model, of}` from
/// the file's `prices`): the model the request's header names, priced in micro-units against
/// the account's spend. A line is 3 tokens: the small model's output costs 2 a line (5 lines
/// of 10), the large one's 9 (1 line). A model the table does not price, the header sent
/// twice, or none at all: refused with a 400 before the handler runs, saying why.
#[tokio::test]
async fn a_priced_rule_charges_a_streams_units_at_the_named_models_price() {
    let rules = RuleSet::from_yaml_str(
        "prices:\n  per_tokens: 3\n  models:\n    small: {input: 1, output: 2}\n    large: {input: 1, output: 9}\n\
         rules:\n  - {limit: Spend, key: 'header:x-account', per: unit, at_limit: end, price: {model: 'header:x-model', of: output}}\n",
    )
    .unwrap();
    let server = serve(app(rules.layer(limiter()).unwrap())).await;
    let client = HttpClient::new(&server);
    let small = client
        .get("/events?n=7", &[("x-account", "7"), ("x-model", "small")])
        .await;
    assert_eq!(small.body, "1 keys, end\nm0\nm1\nm2\nm3\nm4\n");
    let large = client
        .get("/events?n=7", &[("x-account", "8"), ("x-model", "large")])
        .await;
    assert_eq!(large.body, "1 keys, end\nm0\n");
    let refused = [
        (vec![("x-model", "huge")], "model \\\"huge\\\" has no price"),
        (
            vec![("x-model", "small"), ("x-model", "large")],
            "sent twice",
        ),
        (vec![], "missing model"),
    ];
    for (model, why) in refused {
        let mut headers = vec![("x-account", "9")];
        headers.extend(model);
        let reply = client.get("/events?n=1", &headers).await;
        assert_eq!(reply.status, 400, "{headers:?}");
        assert!(reply.body.contains(why), "{headers:?}: {}", reply.body);
    }
}

/// A rules file's `price` is refused with its line where it cannot charge: without the file's
/// `prices`, on a rule that does not count units, with a model not read from a header, or
/// charging a price the table does not have.
#[test]
fn a_price_that_cannot_charge_is_refused_with_its_line() {
    let prices = "prices:\n  models:\n    small: {input: 1, output: 2}\n";
    let rule = |fields: &str| {
        format!("{prices}rules:\n  - {{limit: Spend, key: 'header:x-account', {fields}}}\n")
    };
    let cases = [
        (
            "rules:\n  - {limit: Spend, key: 'header:x-account', per: unit, price: {model: 'header:x-model', of: output}}\n".to_owned(),
            "needs the file's `prices`",
        ),
        (rule("per: message, price: {model: 'header:x-model', of: output}"), "write `per: unit`"),
        (rule("price: {model: 'header:x-model', of: output}"), "write `per: unit`"),
        (rule("per: unit, price: {model: 'query:model', of: output}"), "names the model"),
        (rule("per: unit, price: {model: 'header:x-model', of: total}"), "use input, cached_input or output"),
        (rule("per: unit, price: {model: 'header:x-model'}"), "price: {model"),
        ("prices: {models: {a: {input: 1}}}\nrules: []\n".to_owned(), "needs its `input` and `output`"),
    ];
    for (text, why) in cases {
        let error = RuleSet::from_yaml_str(&text).unwrap_err().to_string();
        // `<rules>:<line>: ...`
        let line = error
            .strip_prefix("<rules>:")
            .and_then(|r| r.split(':').next());
        assert!(line.is_some_and(|l| l.parse::<u64>().is_ok()), "{error}");
        assert!(error.contains(why), "{text}: {error}");
    }
}

/// Lines `m0` to `m6`, each 3 units, metered by the request's keys once the handler priced
/// them from the request's JSON body (`x-unpriced`: it does not, and the meter refuses to
/// build); a body that does not price them is answered with a 400 saying why.
async fn priced_by_body(
    keys: Option<Extension<StreamKeys>>,
    headers: http::HeaderMap,
    body: axum::body::Bytes,
) -> (http::StatusCode, Body) {
    let Some(Extension(mut keys)) = keys else {
        return (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            Body::from("no keys"),
        );
    };
    if !headers.contains_key("x-unpriced")
        && let Err(e) = keys.price_from_body(&body)
    {
        return (http::StatusCode::BAD_REQUEST, Body::from(e.to_string()));
    }
    match keys.meter().build() {
        Ok(meter) => {
            let lines = futures_util::stream::iter(0..7).map(|i| format!("m{i}\n"));
            let limited = LimitedStream::new(lines, meter).units(|line: &String| line.len() as u64);
            (
                http::StatusCode::OK,
                Body::from_stream(limited.map(Ok::<_, Infallible>)),
            )
        }
        Err(e) => (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            Body::from(e.to_string()),
        ),
    }
}

/// A rule whose model is a field of the request's JSON body (`model: 'body:model'`): the layer
/// hands the key unpriced, the handler prices it from the body it read, and the stream is
/// charged at that model's price (small: 5 lines of 7 within 10 micro-units). A model the
/// table does not price, a body that is not JSON or whose field is not a string: the handler's
/// 400 with why; a meter built before pricing is refused (its units would count as money).
#[tokio::test]
async fn a_rule_priced_from_the_body_is_priced_by_the_handler_from_the_body_it_read() {
    let rules = RuleSet::from_yaml_str(
        "prices:\n  per_tokens: 3\n  models:\n    small: {input: 1, output: 2}\n\
         rules:\n  - {limit: Spend, key: 'header:x-account', per: unit, at_limit: end, price: {model: 'body:model', of: output}}\n",
    )
    .unwrap();
    let app = Router::new()
        .route("/priced", axum::routing::post(priced_by_body))
        .layer(rules.layer(limiter()).unwrap());
    let server = serve(app).await;
    let client = HttpClient::new(&server);
    let post = async |account: &str, extra: Option<(&str, &str)>, body: &str| {
        let mut headers = vec![("x-account", account)];
        headers.extend(extra);
        client
            .send(http::Method::POST, "/priced", &headers, body)
            .await
    };
    let small = post("7", None, r#"{"model": "small", "prompt": "hi"}"#).await;
    assert_eq!(
        (small.status, small.body.as_str()),
        (200, "m0\nm1\nm2\nm3\nm4\n")
    );
    let refused = [
        (r#"{"model": "huge"}"#, "model \"huge\" has no price"),
        ("not json", "not a JSON object"),
        (r#"{"model": 3}"#, "no string field \"model\""),
    ];
    for (body, why) in refused {
        let reply = post("8", None, body).await;
        assert_eq!(reply.status, 400, "{body}");
        assert!(reply.body.contains(why), "{body}: {}", reply.body);
    }
    let unpriced = post("8", Some(("x-unpriced", "1")), "{}").await;
    assert_eq!(unpriced.status, 500);
    assert!(
        unpriced.body.contains("price_from_body"),
        "{}",
        unpriced.body
    );
}
