//! Each limit shape's fields in a configuration file: burst tiers, a GCRA limit's `max_debt`
//! and `prefetch`, a rate microseconds cannot express, an entry mixing shapes. Every bad value
//! is a typed error naming its line.

use tower_ratelimits::ConfigErrorKind;
use tower_ratelimits::{BucketKey, Id, Limits, ShapeError};

const TIERED: &str = "\
ApiCallsPerAccount:
  kind: account
  tiers:
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 50, window: 5s, active: 5s, cooldown: 15s}
";

#[test]
fn tiers_load_and_overrides_replace_them_for_an_id() {
    let overrides = "\
- ApiCallsPerAccount:
    tiers:
      - {limit: 10, window: 1s, active: 1s, cooldown: 0}
    ids: [42]
- ApiCallsPerAccount:
    burst: 3
    count: 3
    period: 1s
    ids: [43]
";
    let limits = Limits::from_yaml_str(TIERED, Some(overrides)).unwrap();
    let name = limits.name("ApiCallsPerAccount").unwrap();
    let quota = |id: &str| {
        limits
            .resolve(&BucketKey::new(name, Id::new(id).unwrap()))
            .unwrap()
            .clone()
    };
    let default = quota("1");
    let tiers = default.as_tiered().unwrap();
    assert_eq!(tiers.tiers().len(), 2);
    assert_eq!(tiers.tiers()[1].cooldown_us(), 15_000_000);
    assert_eq!(tiers.capacity(), 55);
    assert_eq!(quota("42").as_tiered().unwrap().capacity(), 10);
    assert_eq!(quota("43").as_gcra().unwrap().burst(), 3);
    // Every pattern file of the examples loads.
    for file in ["simple", "penalty", "punishment", "batch"] {
        let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .join(format!("examples/config/tiers-{file}.yaml"));
        Limits::from_yaml_file(&path).unwrap();
    }
}

/// Both formats of the overrides file take every shape, from the one table of limit fields:
/// the list format took neither a concurrency limit nor a calendar quota (`concurrency` was
/// an unknown field there).
#[test]
fn both_override_formats_take_every_shape() {
    let defaults = "\
Slots: {kind: account, concurrency: 2, lease: 10s}
Plan: {kind: account, calendar: {count: 100, period: month}}
";
    let listed = "\
- Slots: {concurrency: 5, lease: 30s, retry_after: 2s, ids: [7]}
- Plan: {calendar: {count: 1000, period: month, anchor_day: 15}, ids: [7]}
";
    let keyed = "\
Slots:7: {concurrency: 5, lease: 30s, retry_after: 2s}
Plan:7: {calendar: {count: 1000, period: month, anchor_day: 15}}
";
    for overrides in [listed, keyed] {
        let limits = Limits::from_yaml_str(defaults, Some(overrides)).unwrap();
        let quota = |name: &str| {
            let name = limits.name(name).unwrap();
            let id = limits.id_kind(name).unwrap().parse("7").unwrap();
            limits.resolve(&BucketKey::new(name, id)).unwrap().clone()
        };
        assert_eq!(quota("Slots").max_cost(), 1, "{overrides}");
        assert_eq!(
            quota("Slots").to_string(),
            "5 in flight (lease 30s, retry after 2s)",
            "{overrides}"
        );
        assert_eq!(quota("Plan").max_cost(), 1000, "{overrides}");
    }
}

/// Each `(defaults, message, line)` is refused, naming limit A, the message and the line.
fn refused_with_their_lines(cases: &[(&str, &str, u64)]) {
    for (text, message, line) in cases {
        let err = Limits::from_yaml_str(text, None).unwrap_err();
        let shown = err.to_string();
        assert!(shown.contains(message), "{text}\n-> {shown}");
        assert!(shown.contains("limit A"), "{shown}");
        assert_eq!(err.location().line, Some(*line), "{text}\n-> {shown}");
    }
}

#[test]
fn tier_errors_name_the_tier_the_field_and_the_line() {
    let cases: &[(&str, &str, u64)] = &[
        (
            "A:\n  tiers:\n    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}\n    - {limit: 5, active: 1s, cooldown: 0s}\n",
            "tier 2: window is missing",
            4,
        ),
        (
            "A:\n  tiers:\n    - {limit: 5, window: 1s, active: 0s, cooldown: 0s}\n",
            "tier 1: active must be greater than zero",
            3,
        ),
        (
            "A:\n  tiers:\n    - {limit: -1, window: 1s, active: 1s, cooldown: 0s}\n",
            "tier 1: limit must be a whole number of at least 0, found -1",
            3,
        ),
        (
            "A:\n  tiers:\n    - {limit: 1, window: 1x, active: 1s, cooldown: 0s}\n",
            "tier 1: window is not a duration",
            3,
        ),
        (
            "A:\n  tiers:\n    - {limit: 1, window: 1s, active: 1s, cooldown: 0s, burst: 3}\n",
            "unknown field \"burst\"",
            3,
        ),
        (
            "A:\n  burst: 1\n  tiers:\n    - {limit: 1, window: 1s, active: 1s, cooldown: 0s}\n",
            "tiers and burst cannot be given together",
            2,
        ),
        ("A:\n  tiers: []\n", "at least one tier", 2),
        (
            "A:\n  tiers:\n    - {limit: 0, window: 1s, active: 1s, cooldown: 0s}\n",
            "every tier has limit 0",
            3,
        ),
        (
            "A:\n  cost: 6\n  tiers:\n    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}\n",
            "cost 6 exceeds the burst of 5",
            2,
        ),
        (
            "A:\n  tiers:\n    - {limit: 1, window: 1s, active: 1s, cooldown: 200y}\n",
            "tier 1: cooldown",
            3,
        ),
    ];
    refused_with_their_lines(cases);
}

#[test]
fn a_rate_microseconds_cannot_express_is_refused_with_its_location() {
    let err = Limits::from_yaml_str(
        "Ok: {burst: 1, count: 20, period: 1s}\nFast:\n  burst: 10\n  count: 600000\n  period: 1s\n",
        None,
    )
    .unwrap_err();
    assert_eq!(err.limit(), Some("Fast"));
    assert!(err.location().line.is_some(), "{err}");
    assert!(
        matches!(
            err.kind(),
            ConfigErrorKind::Shape(ShapeError::Limit(tower_ratelimits::LimitError::Inexact {
                emission_interval_us: 2,
                ..
            }))
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.starts_with("<defaults>:"), "{text}");
    assert!(text.contains("limit Fast"), "{text}");
    assert!(text.contains("166\u{2030} fewer than 600000"), "{text}");
    // 500,000 per second is 2us each, exactly: accepted.
    assert!(Limits::from_yaml_str("Fast: {burst: 10, count: 500000, period: 1s}\n", None).is_ok());
}

/// `max_debt` on a GCRA limit, in defaults and overrides (default: the burst; 0 allowed); on
/// tiers or a concurrency limit, negative, or so large that a bucket in full debt would run
/// more than 100 years ahead, it is refused with its line.
#[test]
fn max_debt_is_a_gcra_field_checked_with_its_line() {
    let limits = Limits::from_yaml_str(
        "A: {burst: 10, count: 10, period: 1s, max_debt: 4}\nB: {burst: 10, count: 10, period: 1s}\nC: {burst: 10, count: 10, period: 1s, max_debt: 0}\n",
        Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n    max_debt: 50\n    ids: [x]\n"),
    )
    .unwrap();
    let debt = |name: &str, id: &str| {
        let key =
            tower_ratelimits::BucketKey::new(limits.name(name).unwrap(), Id::new(id).unwrap());
        limits.resolve(&key).unwrap().as_gcra().unwrap().max_debt()
    };
    assert_eq!((debt("A", "y"), debt("A", "x")), (4, 50));
    assert_eq!((debt("B", "y"), debt("C", "y")), (10, 0));
    let cases: &[(&str, &str, u64)] = &[
        (
            "A:\n  max_debt: 3\n  tiers:\n    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}\n",
            "max_debt and tiers cannot be given together",
            2,
        ),
        (
            "A:\n  concurrency: 3\n  max_debt: 3\n",
            "max_debt and concurrency cannot be given together",
            3,
        ),
        (
            "A:\n  burst: 1\n  count: 1\n  period: 1s\n  max_debt: -1\n",
            "max_debt must be a whole number, 0 or more, found -1",
            5,
        ),
        (
            "A:\n  burst: 1\n  count: 1\n  period: 1s\n  max_debt: 1_000\n",
            "max_debt must be a whole number, 0 or more, found \"1_000\" (write plain decimal digits)",
            5,
        ),
        (
            "A:\n  burst: 1\n  count: 1\n  period: 1d\n  max_debt: 40000\n",
            "larger than 100 years",
            5,
        ),
    ];
    refused_with_their_lines(cases);
}

/// `prefetch` and `prefetch_ttl` (default 1s) on a GCRA limit, in defaults and in both
/// override formats; on tiers, a concurrency limit or `unlimited`, 0, above the burst, a TTL
/// without `prefetch`, or a TTL outside 1ms..=1h, they are refused with their line.
#[test]
fn prefetch_is_a_gcra_field_checked_with_its_line() {
    let limits = Limits::from_yaml_str(
        "A: {burst: 500, count: 300, period: 1s, prefetch: 50}\nB: {burst: 10, count: 10, period: 1s, prefetch: 10, prefetch_ttl: 250ms}\nC: {burst: 10, count: 10, period: 1s}\n",
        Some("- A:\n    burst: 50\n    count: 50\n    period: 1s\n    prefetch: 5\n    prefetch_ttl: 2s\n    ids: [x]\n"),
    )
    .unwrap();
    let prefetch = |name: &str, id: &str| {
        let key =
            tower_ratelimits::BucketKey::new(limits.name(name).unwrap(), Id::new(id).unwrap());
        let limit = *limits.resolve(&key).unwrap().as_gcra().unwrap();
        (limit.prefetch(), limit.prefetch_ttl().as_millis())
    };
    assert_eq!(prefetch("A", "y"), (50, 1000));
    assert_eq!(prefetch("A", "x"), (5, 2000), "the override's own");
    assert_eq!(prefetch("B", "y"), (10, 250));
    assert_eq!(prefetch("C", "y").0, 0, "off unless given");
    let map_format = Limits::from_yaml_str(
        "A: {burst: 500, count: 300, period: 1s}\n",
        Some("A:x: {burst: 50, count: 50, period: 1s, prefetch: 7}\n"),
    )
    .unwrap();
    let key =
        tower_ratelimits::BucketKey::new(map_format.name("A").unwrap(), Id::new("x").unwrap());
    assert_eq!(
        map_format
            .resolve(&key)
            .unwrap()
            .as_gcra()
            .unwrap()
            .prefetch(),
        7
    );
    let cases: &[(&str, &str, u64)] = &[
        (
            "A:\n  prefetch: 3\n  tiers:\n    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}\n",
            "prefetch and tiers cannot be given together",
            2,
        ),
        (
            "A:\n  concurrency: 3\n  prefetch_ttl: 1s\n",
            "prefetch_ttl and concurrency cannot be given together",
            3,
        ),
        (
            "A:\n  burst: 10\n  count: 10\n  period: 1s\n  prefetch: 0\n",
            "prefetch must be",
            5,
        ),
        (
            "A:\n  burst: 10\n  count: 10\n  period: 1s\n  prefetch: 11\n",
            "prefetch 11 is above the burst of 10",
            5,
        ),
        (
            "A:\n  burst: 10\n  count: 10\n  period: 1s\n  prefetch_ttl: 1s\n",
            "prefetch",
            5,
        ),
        (
            "A:\n  burst: 10\n  count: 10\n  period: 1s\n  prefetch: 5\n  prefetch_ttl: 2h\n",
            "prefetch_ttl 7200000000us is outside 1ms..=1h",
            6,
        ),
        (
            "A:\n  burst: 10\n  count: 10\n  period: 1s\n  prefetch: 5\n  prefetch_ttl: 500us\n",
            "outside 1ms..=1h",
            6,
        ),
    ];
    refused_with_their_lines(cases);
    let unlimited = Limits::from_yaml_str(
        "A: {burst: 10, count: 10, period: 1s}\n",
        Some("- A:\n    unlimited: true\n    prefetch: 5\n    ids: [x]\n"),
    )
    .unwrap_err();
    assert!(
        unlimited
            .to_string()
            .contains("unlimited and prefetch cannot be given together"),
        "{unlimited}"
    );
}

/// A limit that mixes two shapes is refused with a message naming every shape and its fields
/// (it named three, without calendar quotas; then four, without fair shares and adaptive
/// limits).
#[test]
fn a_mixed_shape_error_names_every_shape() {
    let yaml = "A: {burst: 1, count: 1, period: 1s, concurrency: 2}\n";
    let message = Limits::from_yaml_str(yaml, None).unwrap_err().to_string();
    for shape in [
        "GCRA (burst, count, period)",
        "tiered (tiers)",
        "concurrency limit (concurrency, lease, retry_after; concurrency: {adaptive: ...}",
        "calendar quota (calendar)",
        "fair share (a GCRA budget with fair_share)",
    ] {
        assert!(message.contains(shape), "{shape}: {message}");
    }
}
