//! Calendar quotas (`docs/calendar.md`) on every store: memory, a single Redis and the
//! cluster, each on a manual clock (Redis in caller time, so the script's clock is the test's):
//! the renewal exact to the microsecond, every calendar edge of the spec, a batch of a throttle
//! and a monthly quota, a plan change that keeps what was used, foreign values, and the
//! configuration's located errors.

mod support;

use std::time::Duration;

use support::redis::{RedisServer, TestRedis, command, unique_prefix};
use support::redis_backend::{caller_time_backend, raw_get};
use tower_ratelimits::{
    BucketKey, ConfigErrorKind, Limiter, Limits, ManualClock, MemoryBackend, Transaction,
};

/// Unix microseconds of a UTC date and time.
fn utc(y: i32, m: u32, d: u32, h: u32, min: u32) -> u64 {
    let days = {
        // Days from 1970-01-01 (proleptic Gregorian), as `docs/calendar.md` counts them.
        let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * m as i32 + 2) / 5 + d as i32 - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        i64::from(era) * 146_097 + i64::from(doe) - 719_468
    };
    ((days * 86_400 + i64::from(h) * 3600 + i64::from(min) * 60) * 1_000_000) as u64
}

/// A limiter over `yaml` on each store, all on `clock`; the Redis servers stop when dropped.
async fn stores(
    yaml: &str,
    name: &str,
    clock: &ManualClock,
) -> Vec<(String, Limiter, Option<TestRedis>)> {
    let limits = || Limits::from_yaml_str(yaml, None).unwrap();
    let memory = Limiter::new(
        limits(),
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let mut out = vec![("memory".to_owned(), memory, None)];
    for (label, redis, cache) in [
        ("a single Redis", TestRedis::single(), false),
        ("the cluster", TestRedis::cluster(), true),
    ] {
        let backend = caller_time_backend(&redis.url, &unique_prefix(name), clock, cache).await;
        out.push((
            label.to_owned(),
            Limiter::new(limits(), backend),
            Some(redis),
        ));
    }
    out
}

async fn spend(limiter: &Limiter, key: &BucketKey) -> tower_ratelimits::BatchDecision {
    limiter
        .spend(&[Transaction::new(key.clone())])
        .await
        .unwrap()
}

/// At `now` a spend of `key` is denied until `renewal` (told so by `retry_after` and
/// `reset_after`), still 1 µs before it, and allowed at it with `left` units left after it.
async fn denied_until_the_renewal(
    limiter: &Limiter,
    key: &BucketKey,
    clock: &ManualClock,
    (now, renewal): (u64, u64),
    left: u64,
    what: &str,
) {
    clock.set(now);
    let denied = spend(limiter, key).await;
    assert!(!denied.allowed(), "{what}");
    let d = denied.strictest().unwrap();
    assert_eq!(
        d.retry_after(),
        Duration::from_micros(renewal - now),
        "{what}"
    );
    assert_eq!(
        d.reset_after(),
        Duration::from_micros(renewal - now),
        "{what}"
    );
    clock.set(renewal - 1);
    assert!(!spend(limiter, key).await.allowed(), "{what}: 1 µs before");
    clock.set(renewal);
    let renewed = spend(limiter, key).await;
    assert!(renewed.allowed(), "{what}: at the renewal");
    assert_eq!(renewed.strictest().unwrap().remaining(), left, "{what}");
}

/// A UTC civil time: year, month, day, hour, minute.
type Civil = (i32, u32, u32, u32, u32);

/// Each case: a quota of 3, a time in its period, and the period's end (the renewal).
const CASES: &[(&str, Civil, Civil)] = &[
    // A month without an anchor is the calendar month: its last day is in it (February of a
    // leap year)...
    (
        "{count: 3, period: month}",
        (2028, 2, 29, 12, 0),
        (2028, 3, 1, 0, 0),
    ),
    // ...and it renews on the 1st (it renewed a day early, on the last day).
    (
        "{count: 3, period: month}",
        (2026, 11, 25, 0, 0),
        (2026, 12, 1, 0, 0),
    ),
    // anchor_day 31 in February: its last day; then March's 31st.
    (
        "{count: 3, period: month, anchor_day: 31}",
        (2027, 2, 1, 0, 0),
        (2027, 2, 28, 0, 0),
    ),
    (
        "{count: 3, period: month, anchor_day: 31}",
        (2027, 3, 1, 0, 0),
        (2027, 3, 31, 0, 0),
    ),
    // A 30-day month and a 31-day month between billing days.
    (
        "{count: 3, period: month, anchor_day: 15}",
        (2026, 11, 20, 0, 0),
        (2026, 12, 15, 0, 0),
    ),
    (
        "{count: 3, period: month, anchor_day: 15}",
        (2026, 12, 20, 0, 0),
        (2027, 1, 15, 0, 0),
    ),
    // A billing time in a fixed zone: 06:30 at +02:00 is 04:30 UTC.
    (
        "{count: 3, period: month, anchor_day: 15, at: \"06:30\", zone: \"+02:00\"}",
        (2026, 11, 24, 0, 0),
        (2026, 12, 15, 4, 30),
    ),
    // A week renewing on Wednesday (2026-11-24 is a Tuesday).
    (
        "{count: 3, period: week, anchor_day: 3}",
        (2026, 11, 24, 12, 0),
        (2026, 11, 25, 0, 0),
    ),
    // Berlin, the night the clocks go back: a day of 25 hours, ending 23:00 UTC.
    (
        "{count: 3, period: day, zone: Europe/Berlin}",
        (2026, 10, 25, 12, 0),
        (2026, 10, 25, 23, 0),
    ),
    // Berlin, the night they go forward: 02:30 does not exist, the day renews at 03:30 CEST.
    (
        "{count: 3, period: day, at: \"02:30\", zone: Europe/Berlin}",
        (2026, 3, 28, 12, 0),
        (2026, 3, 29, 1, 30),
    ),
];

/// Every edge of the spec on every store: the quota's units in the period, a denial told to
/// come back at the renewal, still denied one microsecond before it, allowed at it with the
/// whole count again.
#[tokio::test]
async fn every_calendar_edge_renews_exactly_at_its_boundary_on_every_store() {
    for (i, &(quota, at, renewal)) in CASES.iter().enumerate() {
        let now = utc(at.0, at.1, at.2, at.3, at.4);
        let renewal = utc(renewal.0, renewal.1, renewal.2, renewal.3, renewal.4);
        let clock = ManualClock::new(now);
        let yaml = format!("Plan: {{kind: account, calendar: {quota}}}\n");
        for (store, limiter, _redis) in stores(&yaml, &format!("edge{i}"), &clock).await {
            clock.set(now);
            let what = format!("{store}, case {i}: {quota}");
            let key = limiter.parse_key("Plan", "7").unwrap();
            for left in (0..3).rev() {
                let d = spend(&limiter, &key).await;
                assert!(d.allowed(), "{what}");
                assert_eq!(d.strictest().unwrap().remaining(), left, "{what}");
            }
            denied_until_the_renewal(&limiter, &key, &clock, (now, renewal), 2, &what).await;
        }
    }
}

/// A throttle and a monthly quota in one batch are all or nothing: once the quota is used up,
/// the batch is denied and the throttle keeps its tokens.
#[tokio::test]
async fn a_throttle_and_a_monthly_quota_decide_together_on_every_store() {
    let yaml = "Throttle: {kind: account, burst: 10, count: 1, period: 1h}\n\
                Monthly: {kind: account, calendar: {count: 3, period: month}}\n";
    let clock = ManualClock::new(utc(2026, 11, 24, 12, 0));
    for (store, limiter, _redis) in stores(yaml, "batch", &clock).await {
        let batch = [
            Transaction::new(limiter.parse_key("Throttle", "7").unwrap()),
            Transaction::new(limiter.parse_key("Monthly", "7").unwrap()),
        ];
        for _ in 0..3 {
            assert!(limiter.spend(&batch).await.unwrap().allowed(), "{store}");
        }
        let denied = limiter.spend(&batch).await.unwrap();
        assert!(!denied.allowed(), "{store}");
        assert_eq!(
            denied.strictest().unwrap().key().name().as_str(),
            "Monthly",
            "{store}"
        );
        let throttle = limiter.inspect(&batch[0].key().clone()).await.unwrap();
        assert_eq!(
            throttle.remaining, 7,
            "{store}: the denied batch spent nothing"
        );
    }
}

/// A plan change mid-period keeps what was used (`docs/calendar.md`, "Changing a calendar
/// quota"): 4 of 5 used, raised to 10 leaves 6; lowered to 3 leaves none until the renewal.
#[tokio::test]
async fn a_plan_change_keeps_what_was_used_on_every_store() {
    let plan =
        |count| format!("Plan: {{kind: account, calendar: {{count: {count}, period: month}}}}\n");
    let clock = ManualClock::new(utc(2026, 11, 10, 0, 0));
    for (store, limiter, _redis) in stores(&plan(5), "plan", &clock).await {
        clock.set(utc(2026, 11, 10, 0, 0));
        let key = limiter.parse_key("Plan", "7").unwrap();
        for _ in 0..4 {
            assert!(spend(&limiter, &key).await.allowed(), "{store}");
        }
        limiter
            .reload(Limits::from_yaml_str(&plan(10), None).unwrap())
            .unwrap();
        assert_eq!(
            limiter.inspect(&key).await.unwrap().remaining,
            6,
            "{store}: raised"
        );
        limiter
            .reload(Limits::from_yaml_str(&plan(3), None).unwrap())
            .unwrap();
        assert!(
            !spend(&limiter, &key).await.allowed(),
            "{store}: lowered below what was used"
        );
        clock.set(utc(2026, 12, 1, 0, 0));
        assert!(spend(&limiter, &key).await.allowed(), "{store}: renewed");
    }
}

/// Ranges, refunds and settle charges: a range takes what is left; a refund gives back this
/// period's units; a charge is taken whole and denies the rest of the period.
#[tokio::test]
async fn ranges_refunds_and_charges_on_every_store() {
    let yaml = "Tokens: {kind: account, calendar: {count: 100, period: day}}\n";
    let clock = ManualClock::new(utc(2026, 11, 24, 12, 0));
    for (store, limiter, _redis) in stores(yaml, "units", &clock).await {
        clock.set(utc(2026, 11, 24, 12, 0));
        let key = limiter.parse_key("Tokens", "7").unwrap();
        let d = limiter
            .spend(&[Transaction::new(key.clone()).cost(70)])
            .await
            .unwrap();
        assert!(d.allowed(), "{store}");
        let range = limiter
            .spend(&[Transaction::new(key.clone()).cost_range(10..=50)])
            .await
            .unwrap();
        assert_eq!(
            range.strictest().unwrap().granted(),
            30,
            "{store}: what was left"
        );
        limiter
            .refund(&[Transaction::new(key.clone()).cost(20)])
            .await
            .unwrap();
        assert_eq!(
            limiter.inspect(&key).await.unwrap().remaining,
            20,
            "{store}"
        );
        let charge = Transaction::new(key.clone())
            .cost(50)
            .mode(tower_ratelimits::Mode::Charge);
        assert!(
            limiter.spend(&[charge]).await.unwrap().allowed(),
            "{store}: never denied"
        );
        assert!(!spend(&limiter, &key).await.allowed(), "{store}: overrun");
        clock.set(utc(2026, 11, 25, 0, 0));
        assert_eq!(
            limiter.inspect(&key).await.unwrap().remaining,
            100,
            "{store}: renewed"
        );
    }
}

/// A value this crate could not have written is the period drained (never a fresh count),
/// replaced at once, and gone at the renewal.
#[tokio::test]
async fn a_foreign_value_is_the_period_drained_until_the_renewal() {
    let server = RedisServer::start();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let clock = ManualClock::new(utc(2026, 11, 24, 12, 0));
    let prefix = unique_prefix("foreign");
    let backend = caller_time_backend(&url, &prefix, &clock, false).await;
    let limits = Limits::from_yaml_str(
        "Plan: {kind: account, calendar: {count: 3, period: day}}\n",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(limits, backend.clone());
    let key = limiter.parse_key("Plan", "7").unwrap();
    let redis_key = format!("{prefix}{{Plan:7}}:q");
    command(server.port, &format!("SET {redis_key} not-ours")).unwrap();
    assert!(!spend(&limiter, &key).await.allowed());
    let end = utc(2026, 11, 25, 0, 0);
    assert_eq!(
        raw_get(&backend, &redis_key).await,
        Some(format!("{end} 3"))
    );
    clock.set(end);
    assert!(spend(&limiter, &key).await.allowed());
}

/// Bad calendar values are located errors naming what is wrong.
#[test]
fn bad_calendar_values_are_located_errors() {
    let cases = [
        ("{count: 0, period: day}", "count"),
        (
            "{count: 5, period: year}",
            "period must be day, week or month",
        ),
        ("{count: 5, period: week, anchor_day: 8}", "anchor_day 8"),
        ("{count: 5, period: day, anchor_day: 1}", "anchor_day 1"),
        ("{count: 5, period: day, at: \"24:00\"}", "HH:MM"),
        ("{count: 5, period: day, zone: Mars}", "Mars"),
        ("{count: 5, period: day, zone: \"+25:00\"}", "+25:00"),
        ("{count: 5, period: day, every: 2}", "every"),
        ("{period: day}", "count"),
    ];
    for (calendar, says) in cases {
        let yaml = format!("Plan:\n  kind: account\n  calendar: {calendar}\n");
        let err = Limits::from_yaml_str(&yaml, None).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(says), "{calendar}: {text}");
        assert!(
            text.contains(":3:") && text.contains("Plan"),
            "{calendar}: {text}"
        );
    }
    let both = "Plan: {burst: 5, count: 5, period: 1s, calendar: {count: 5, period: day}}\n";
    let err = Limits::from_yaml_str(both, None).unwrap_err();
    assert!(
        matches!(err.kind(), ConfigErrorKind::ConflictingFields(..)),
        "{err}"
    );
}

/// A calendar quota's answers over TCP, beside a throttle: `RateLimit` with `r` = units left
/// this period and `t` = seconds to the renewal, `RateLimit-Policy` with `q` = the count and
/// `w` = this period's length, a denial's `Retry-After` (and problem+json's `retry_after_ms`)
/// at the renewal; the admin API's bucket (used, remaining, renewal), and a plan changed
/// mid-period through a stored override keeps what was used.
#[tokio::test]
async fn http_answers_and_the_admin_api_speak_the_period() {
    use axum::{Router, routing::get};
    use http::Method;
    use support::http::{HttpClient, serve};
    use tower_ratelimits::{ErrorBody, FieldStyle, Header, RateLimitLayer, Rule, admin_router};

    // 12 hours before the renewal of 2026-12-01 00:00 UTC; the period began 2026-11-01 (30 days).
    let clock = ManualClock::new(utc(2026, 11, 30, 12, 0));
    let limits = Limits::from_yaml_str(
        "Monthly: {kind: any, calendar: {count: 3, period: month}}\n\
         Throttle: {kind: any, burst: 10, count: 10, period: 1s}\n",
        None,
    )
    .unwrap();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Throttle", Header::new("x-client")))
        .rule(Rule::new("Monthly", Header::new("x-client")))
        .fields(FieldStyle::Ietf)
        .error_body(ErrorBody::ProblemJson)
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let admin = serve(admin_router(limiter.clone())).await;
    let (app, admin_client) = (HttpClient::new(&app), HttpClient::new(&admin));
    let a = [("x-client", "a")];

    for left in [2, 1, 0] {
        let r = app.get("/", &a).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let fields = r.header("ratelimit").unwrap();
        assert!(
            fields.contains(&format!("\"Monthly\";r={left};t=43200")),
            "{fields}"
        );
        let policy = r.header("ratelimit-policy").unwrap();
        assert!(policy.contains("\"Monthly\";q=3;w=2592000"), "{policy}");
    }
    let r = app.get("/", &a).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("43200"), "the renewal");
    let problem: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(problem["violated-policies"], serde_json::json!(["Monthly"]));
    assert_eq!(problem["retry_after_ms"], 43_200_000);
    assert!(
        r.header("ratelimit")
            .unwrap()
            .contains("\"Monthly\";r=0;t=43200")
    );

    let get = |path: &'static str| {
        let admin_client = &admin_client;
        async move {
            let r = admin_client.get(path, &[]).await;
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            (r.status, v)
        }
    };
    let put = |path: &'static str, body: &'static str| {
        let admin_client = &admin_client;
        async move {
            let r = admin_client.send(Method::PUT, path, &[], body).await;
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            (r.status, v)
        }
    };
    let (status, bucket) = get("/buckets/Monthly/a").await;
    assert_eq!(status, 200, "{bucket}");
    assert_eq!(bucket["kind"], "calendar");
    assert_eq!(
        (bucket["used"].as_u64(), bucket["remaining"].as_u64()),
        (Some(3), Some(0))
    );
    assert_eq!(bucket["reset_after_ms"], 43_200_000);
    // The renewal by the admin host's clock (the wall clock; the limiter's is a test clock).
    let wall_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let renews =
        tower_ratelimits::__private::parse_instant(bucket["renews_at"].as_str().unwrap()).unwrap();
    let quota = tower_ratelimits::CalendarQuota::new(3, tower_ratelimits::Period::Month).unwrap();
    assert_eq!(renews, quota.period_at(wall_now).1, "{bucket}");

    // A plan of 10 for client a, mid-period: the 3 used stay used.
    let (status, stored) = put(
        "/overrides/Monthly/a",
        r#"{"calendar": {"count": 10, "period": "month"}}"#,
    )
    .await;
    assert_eq!(status, 200, "{stored}");
    assert_eq!(stored["calendar"]["count"], 10);
    assert_eq!(stored["calendar"]["period"], "month");
    let r = app.get("/", &a).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let fields = r.header("ratelimit").unwrap();
    assert!(fields.contains("\"Monthly\";r=6;t=43200"), "{fields}");
    let (_, bucket) = get("/buckets/Monthly/a").await;
    assert_eq!(bucket["source"], "store");
    assert_eq!(
        (bucket["used"].as_u64(), bucket["remaining"].as_u64()),
        (Some(4), Some(6))
    );

    // A plan must fit the limit's shape, and bad fields say which.
    for (path, body, says) in [
        (
            "/overrides/Throttle/a",
            r#"{"calendar": {"count": 10, "period": "month"}}"#,
            "the limit is a GCRA limit, the override a calendar quota",
        ),
        (
            "/overrides/Monthly/b",
            r#"{"burst": 5, "count": 5, "period": "1s"}"#,
            "the limit is a calendar quota, the override a GCRA limit",
        ),
        (
            "/overrides/Monthly/b",
            r#"{"calendar": {"count": 5, "period": "year"}}"#,
            "year",
        ),
        (
            "/overrides/Monthly/b",
            r#"{"calendar": {"count": 5, "period": "week", "anchor_day": 8}}"#,
            "anchor_day",
        ),
        (
            "/overrides/Monthly/b",
            r#"{"calendar": {"count": 5}}"#,
            "period",
        ),
    ] {
        let (status, v) = put(path, body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(says), "{body}: {v}");
    }

    // The renewal: the plan's full count.
    clock.set(utc(2026, 12, 1, 0, 0));
    let r = app.get("/", &a).await;
    let fields = r.header("ratelimit").unwrap();
    assert!(fields.contains("\"Monthly\";r=9;t=2678400"), "{fields}");
}

/// Every answer of a calendar quota is a pure function of the period in
/// force, the same on every store. Over TCP, for a 5-a-month quota renewing on the 15th (a
/// 30-day period) or the 29th (31 days) at 06:00 in Berlin, and for the calendar month: each
/// response's status, `RateLimit`, `RateLimit-Policy` (`w` the period's length), `Retry-After`
/// and problem+json's `retry_after_ms` are the memory backend's, on a Redis and the cluster.
/// Redis answered the neighbouring period's `w` (a cache the script's "next end" overwrote).
#[tokio::test]
async fn every_answer_is_the_same_on_every_store() {
    use axum::{Router, routing::get};
    use support::http::{HttpClient, serve};
    use tower_ratelimits::{ErrorBody, FieldStyle, Header, RateLimitLayer, Rule};
    for (quota, w) in [
        (
            "{count: 5, period: month, anchor_day: 15, at: \"06:00\", zone: Europe/Berlin}",
            2_592_000,
        ),
        (
            "{count: 5, period: month, anchor_day: 29, at: \"06:00\", zone: Europe/Berlin}",
            2_678_400,
        ),
        ("{count: 5, period: month}", 2_592_000),
    ] {
        let yaml = format!("Plan: {{kind: any, calendar: {quota}}}\n");
        let now = utc(2026, 11, 25, 9, 30);
        let clock = ManualClock::new(now);
        let mut answers: Vec<(String, Vec<String>)> = Vec::new();
        for (store, limiter, _redis) in stores(&yaml, "answers", &clock).await {
            clock.set(now);
            let layer = RateLimitLayer::builder(limiter)
                .rule(Rule::new("Plan", Header::new("x-client")))
                .fields(FieldStyle::Ietf)
                .error_body(ErrorBody::ProblemJson)
                .build()
                .unwrap();
            let app = serve(
                Router::new()
                    .route("/", get(|| async { "ok" }))
                    .layer(layer),
            )
            .await;
            let client = HttpClient::new(&app);
            let mut seen = Vec::new();
            for _ in 0..6 {
                let r = client.get("/", &[("x-client", "a")]).await;
                let policy = r.header("ratelimit-policy").unwrap_or_default().to_owned();
                assert!(
                    policy.contains(&format!(";w={w}")),
                    "{store}, {quota}: {policy}"
                );
                let ms = serde_json::from_str::<serde_json::Value>(&r.body)
                    .ok()
                    .map(|v| v["retry_after_ms"].to_string());
                seen.push(format!(
                    "{} | {} | {policy} | {:?} | {ms:?}",
                    r.status,
                    r.header("ratelimit").unwrap_or_default(),
                    r.header("retry-after"),
                ));
            }
            answers.push((store, seen));
        }
        let (first, expected) = &answers[0];
        for (store, seen) in &answers[1..] {
            assert_eq!(seen, expected, "{quota}: {store} against {first}");
        }
    }
}

/// Units counted to 2^52 or more (one charge of 2^52, two of 2^51, one of
/// u64::MAX) deny the rest of the period and end with it on every store, in caller time; the
/// charge reports its whole cost. Redis read its own sum at 2^52 as a foreign value and
/// denied the next period too.
#[tokio::test]
async fn an_overrun_of_any_size_ends_with_its_period_on_every_store() {
    use tower_ratelimits::Mode;
    let yaml = "Plan: {kind: account, calendar: {count: 5, period: month}}\n";
    let now = utc(2026, 11, 25, 12, 0);
    let renewal = utc(2026, 12, 1, 0, 0);
    let clock = ManualClock::new(now);
    for charges in [vec![1u64 << 52], vec![1 << 51, 1 << 51], vec![u64::MAX, 7]] {
        for (store, limiter, _redis) in stores(yaml, "overrun", &clock).await {
            clock.set(now);
            let what = format!("{store}, charges {charges:?}");
            let key = limiter.parse_key("Plan", "7").unwrap();
            for &cost in &charges {
                let d = limiter
                    .spend(&[Transaction::new(key.clone()).cost(cost).mode(Mode::Charge)])
                    .await
                    .unwrap();
                assert!(d.allowed(), "{what}");
                assert_eq!(d.decisions()[0].granted(), cost, "{what}");
            }
            // The overrun ends with its period.
            denied_until_the_renewal(&limiter, &key, &clock, (now, renewal), 4, &what).await;
        }
    }
}

/// Units never count past a renewal of the quota in force. A well-formed
/// value ending a period later than the one in force is cut to it at its first read and
/// written back with a TTL (it was kept, without one, and counted into the next period); one
/// ending more than the longest period ahead is foreign (the period drained, replaced).
#[tokio::test]
async fn a_stored_end_past_the_period_in_force_is_cut_to_it() {
    let server = RedisServer::start();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let now = utc(2026, 11, 24, 12, 0);
    let end = utc(2026, 11, 25, 0, 0);
    let day = 86_400_000_000;
    for (stored, used_now, written) in [
        // A day later: its 2 units count until the renewal in force, then never again.
        (format!("{} 2", end + day), 2, format!("{end} 2")),
        // More than two days ahead: foreign, the day drained.
        (format!("{} 1", now + 3 * day), 3, format!("{end} 3")),
    ] {
        let clock = ManualClock::new(now);
        let prefix = unique_prefix("later");
        let backend = caller_time_backend(&url, &prefix, &clock, false).await;
        let limits = Limits::from_yaml_str(
            "Plan: {kind: account, calendar: {count: 3, period: day}}\n",
            None,
        )
        .unwrap();
        let limiter = Limiter::new(limits, backend.clone());
        let key = limiter.parse_key("Plan", "7").unwrap();
        let redis_key = format!("{prefix}{{Plan:7}}:q");
        command(server.port, &format!("SET {redis_key} \"{stored}\"")).unwrap();
        let seen = limiter.inspect(&key).await.unwrap();
        assert_eq!(seen.remaining, 3 - used_now, "{stored}");
        assert_eq!(
            raw_get(&backend, &redis_key).await,
            Some(written.clone()),
            "{stored}: written back at the first read"
        );
        let ttl: i64 = command(server.port, &format!("PTTL {redis_key}"))
            .unwrap()
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap();
        assert!(ttl > 0, "{stored}: every value written has a TTL ({ttl})");
        clock.set(end);
        let d = spend(&limiter, &key).await;
        assert!(d.allowed(), "{stored}");
        assert_eq!(
            d.strictest().unwrap().remaining(),
            2,
            "{stored}: a fresh count"
        );
    }
}

/// A plan change that moves the renewal earlier (anchor_day 15 -> 1) on
/// every store. With a request before the 1st, the units counted under the old plan end at
/// the new renewal. Read first after the 1st, they may have been counted before the change or
/// after it (a stored `<end> <used>` does not say when): they count in the new plan's first
/// period, never handing back what was spent (docs/calendar.md, "Changing a calendar quota").
#[tokio::test]
async fn a_renewal_moved_earlier_ends_the_old_units_on_every_store() {
    let plan = |anchor: &str| {
        format!("Plan: {{kind: account, calendar: {{count: 5, period: month{anchor}}}}}\n")
    };
    let start = utc(2026, 11, 20, 0, 0);
    for request_before_the_1st in [true, false] {
        let clock = ManualClock::new(start);
        for (store, limiter, _redis) in stores(&plan(", anchor_day: 15"), "moved", &clock).await {
            clock.set(start);
            let what = format!("{store}, a request before the 1st: {request_before_the_1st}");
            let key = limiter.parse_key("Plan", "7").unwrap();
            let three = Transaction::new(key.clone()).cost(3);
            assert!(limiter.spend(&[three]).await.unwrap().allowed(), "{what}");
            limiter
                .reload(Limits::from_yaml_str(&plan(""), None).unwrap())
                .unwrap();
            if request_before_the_1st {
                clock.set(utc(2026, 11, 25, 0, 0));
                let d = spend(&limiter, &key).await;
                assert_eq!(d.strictest().unwrap().remaining(), 1, "{what}");
                clock.set(utc(2026, 12, 1, 0, 0));
                let d = spend(&limiter, &key).await;
                assert_eq!(
                    d.strictest().unwrap().remaining(),
                    4,
                    "{what}: renewed on the 1st"
                );
            } else {
                // Read first on the 2nd: the 3 count in the new plan's first period.
                clock.set(utc(2026, 12, 2, 0, 0));
                let d = spend(&limiter, &key).await;
                assert_eq!(d.strictest().unwrap().remaining(), 1, "{what}");
                clock.set(utc(2027, 1, 1, 0, 0));
                let d = spend(&limiter, &key).await;
                assert_eq!(d.strictest().unwrap().remaining(), 4, "{what}: renewed");
            }
        }
    }
}

/// A limiter in memory with a monthly quota of `count`, and one key of it.
fn monthly_in_memory(count: u64) -> (Limiter, BucketKey) {
    let yaml = format!("Monthly: {{kind: account, calendar: {{count: {count}, period: month}}}}\n");
    let limiter = Limiter::new(
        Limits::from_yaml_str(&yaml, None).unwrap(),
        MemoryBackend::new(),
    );
    let key = limiter
        .key("Monthly", tower_ratelimits::Id::from(1u64))
        .unwrap();
    (limiter, key)
}

/// Many threads spending one calendar key in memory at once: exactly the month's count is
/// granted (its road locks the key's slot; no update is lost and none is counted twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_spends_of_one_key_in_memory_grant_exactly_the_count() {
    let (limiter, key) = monthly_in_memory(500);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(async move {
                let mut granted = 0u64;
                for _ in 0..200 {
                    let tx = [Transaction::new(key.clone())];
                    granted += u64::from(limiter.spend(&tx).await.unwrap().allowed());
                }
                granted
            })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += task.await.unwrap();
    }
    assert_eq!(granted, 500);
}

/// Spends of one calendar key racing its resets (a reset takes the key's shard, then its slot;
/// a spend takes the same two in the same order): every task ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_spends_and_resets_of_one_key_in_memory_all_end() {
    let (limiter, key) = monthly_in_memory(50);
    let tasks: Vec<_> = (0..6)
        .map(|n| {
            let (limiter, key) = (limiter.clone(), key.clone());
            tokio::spawn(async move {
                for _ in 0..300 {
                    if n % 3 == 0 {
                        limiter.reset(std::slice::from_ref(&key)).await.unwrap();
                    } else {
                        limiter
                            .spend(&[Transaction::new(key.clone())])
                            .await
                            .unwrap();
                    }
                }
            })
        })
        .collect();
    let all = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("a spend and a reset waited for each other");
}
