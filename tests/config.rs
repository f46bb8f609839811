//! Configuration loading: good files load, and every bad input is a typed error naming the
//! place (file, line, limit) and the value. None panics.

#[path = "support/cases.rs"]
mod cases;

use std::io::Write;

use tower_ratelimits::ConfigErrorKind;
use tower_ratelimits::{BucketKey, Id, IdKind, Limit, Limits, ShapeError};

const DEFAULTS: &str = "\
NewRegistrationsPerIPAddress:
  kind: ip
  burst: 20
  count: 20
  period: 1s
NewOrdersPerAccount:
  kind: account
  burst: 300
  count: 300
  period: 180m
CertificatesPerDomainPerAccount:
  kind: account_domain
  burst: 50
  count: 50
  period: 1h30m
";

fn limit_of(limits: &Limits, name: &str, id: &str) -> Limit {
    let n = limits.name(name).unwrap();
    let id = limits.id_kind(n).unwrap().parse(id).unwrap();
    *limits
        .resolve(&BucketKey::new(n, id))
        .unwrap()
        .as_gcra()
        .unwrap()
}

#[test]
fn loads_defaults_and_list_overrides() {
    let overrides = "\
- NewRegistrationsPerIPAddress:
    burst: 20
    count: 40
    period: 1s
    ids:
      - 10.0.0.2
      - id: 10.0.0.5
        comment: partner load balancer
- NewOrdersPerAccount:
    burst: 300
    count: 600
    period: 180m
    ids: [12345678, 87654321]
";
    let limits = Limits::from_yaml_str(DEFAULTS, Some(overrides)).unwrap();
    assert_eq!(limits.override_count(), 4);
    assert_eq!(
        limit_of(&limits, "NewRegistrationsPerIPAddress", "10.0.0.5").count(),
        40
    );
    assert_eq!(
        limit_of(&limits, "NewRegistrationsPerIPAddress", "10.0.0.9").count(),
        20
    );
    assert_eq!(
        limit_of(&limits, "NewOrdersPerAccount", "87654321").count(),
        600
    );
    assert_eq!(
        limit_of(&limits, "NewOrdersPerAccount", "1").period_us(),
        10_800_000_000
    );
    assert_eq!(
        limit_of(&limits, "CertificatesPerDomainPerAccount", "1:example.com").period_us(),
        5_400_000_000
    );
    // Names are listed in file order; a bucket is keyed by its limit's name, never a position.
    let names: Vec<_> = limits.names().map(|n| n.as_str()).collect();
    assert_eq!(names[1], "NewOrdersPerAccount");
    let key = BucketKey::new(
        limits.name("NewOrdersPerAccount").unwrap(),
        Id::from(12345678u64),
    );
    assert_eq!(key.to_string(), "NewOrdersPerAccount:12345678");
}

#[test]
fn loads_the_older_name_id_override_format() {
    let overrides = "\
NewRegistrationsPerIPAddress:2001:db8::1:
  burst: 5
  count: 5
  period: 1s
CertificatesPerDomainPerAccount:12345678:example.com:
  burst: 500
  count: 500
  period: 1h
";
    let limits = Limits::from_yaml_str(DEFAULTS, Some(overrides)).unwrap();
    assert_eq!(
        limit_of(&limits, "NewRegistrationsPerIPAddress", "2001:db8::1").burst(),
        5
    );
    assert_eq!(
        limit_of(
            &limits,
            "CertificatesPerDomainPerAccount",
            "12345678:example.com"
        )
        .burst(),
        500
    );
}

#[test]
fn empty_override_collections_mean_none() {
    for o in ["[]", "{}", "# nothing\n[]\n"] {
        let limits = Limits::from_yaml_str(DEFAULTS, Some(o)).unwrap();
        assert_eq!(limits.override_count(), 0);
    }
}

#[test]
fn loads_files_and_names_them_in_errors() {
    let dir = std::env::temp_dir().join(format!("trl-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.join("defaults.yaml");
    let o = dir.join("overrides.yaml");
    std::fs::write(&d, DEFAULTS).unwrap();
    std::fs::write(
        &o,
        "- NewOrdersPerAccount:\n    burst: 1\n    count: 1\n    period: 1s\n    ids: [x1]\n",
    )
    .unwrap();
    let err = Limits::from_yaml_files(&d, Some(&o)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("{}:5: limit NewOrdersPerAccount:", o.display())),
        "{text}"
    );
    assert!(matches!(err.kind(), ConfigErrorKind::InvalidId(_)));
    std::fs::write(&o, "[]").unwrap();
    assert!(Limits::from_yaml_files(&d, Some(&o)).is_ok());
    let missing = dir.join("missing.yaml");
    let err = Limits::from_yaml_file(&missing).unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::Io(_)));
    assert!(err.to_string().contains("missing.yaml"));
    // A huge file is refused before parsing.
    let mut f = std::fs::File::create(&o).unwrap();
    let chunk = "# padding padding padding padding padding padding padding padding\n".repeat(1024);
    for _ in 0..260 {
        f.write_all(chunk.as_bytes()).unwrap();
    }
    drop(f);
    let err = Limits::from_yaml_files(&d, Some(&o)).unwrap_err();
    assert!(
        matches!(err.kind(), ConfigErrorKind::TooLarge { .. }),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// (defaults, overrides, expected line, expected limit name, kind check, message fragment)
type Case = (
    &'static str,
    Option<&'static str>,
    Option<u64>,
    Option<&'static str>,
    fn(&ConfigErrorKind) -> bool,
    &'static str,
);

#[test]
fn every_bad_input_is_a_located_typed_error() {
    const OK: &str = "A:\n  burst: 5\n  count: 5\n  period: 1s\n  kind: ip\n";
    let cases: Vec<Case> = vec![
        (
            "A:\n  burst: 0\n  count: 5\n  period: 1s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::BadNumber { field: "burst", .. }),
            "burst",
        ),
        (
            "A:\n  burst: -3\n  count: 5\n  period: 1s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::BadNumber { .. }),
            "-3",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 0s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::Shape(ShapeError::Limit(_))),
            "period",
        ),
        (
            "A:\n  burst: 5\n  count: 99999999999999999999999\n  period: 1s\n",
            None,
            Some(3),
            Some("A"),
            |k| {
                matches!(
                    k,
                    ConfigErrorKind::BadNumber { field: "count", .. } | ConfigErrorKind::Yaml(_)
                )
            },
            "count",
        ),
        (
            "A:\n  burst: 18446744073709551615\n  count: 1\n  period: 1s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::Shape(ShapeError::Limit(_))),
            "100 years",
        ),
        (
            "A:\n  burst: 5\n  count: 5000000\n  period: 1s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::Shape(ShapeError::Limit(_))),
            "1us",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1 second\n",
            None,
            Some(4),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::InvalidPeriod(_)),
            "1 second",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1\n",
            None,
            Some(4),
            Some("A"),
            |k| {
                matches!(
                    k,
                    ConfigErrorKind::BadNumber {
                        field: "period",
                        ..
                    }
                )
            },
            "duration",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\n  brust: 5\n",
            None,
            Some(5),
            Some("A"),
            |k| {
                matches!(
                    k,
                    ConfigErrorKind::UnknownField { field, did_you_mean: Some("burst") } if field == "brust"
                )
            },
            "brust",
        ),
        (
            "A:\n  burst: 5\n  period: 1s\n",
            None,
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::MissingField("count")),
            "count",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\n  kind: ipv4\n",
            None,
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::InvalidId(_)),
            "ipv4",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\n  cost: 6\n",
            None,
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::CostAboveBurst { cost: 6, burst: 5 }),
            "cost 6",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\nA:\n  burst: 5\n  count: 5\n  period: 1s\n",
            None,
            Some(5),
            None,
            |k| {
                matches!(
                    k,
                    ConfigErrorKind::Yaml(_) | ConfigErrorKind::DuplicateName(_)
                )
            },
            "A",
        ),
        (
            "bad name!:\n  burst: 5\n  count: 5\n  period: 1s\n",
            None,
            Some(1),
            Some("bad name!"),
            |k| matches!(k, ConfigErrorKind::InvalidName(_)),
            "bad name!",
        ),
        (
            "bad name!:\n  burst: 5\n  count: 5\n  period: 1s\n  cost: 1\n",
            None,
            Some(1),
            Some("bad name!"),
            |k| matches!(k, ConfigErrorKind::InvalidName(_)),
            "bad name!",
        ),
        (
            "- A\n- B\n",
            None,
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "map",
        ),
        (
            "just a string\n",
            None,
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "map",
        ),
        (
            "A: [1, 2\n",
            None,
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::Yaml(_)),
            "YAML",
        ),
        (
            "",
            None,
            None,
            None,
            |k| matches!(k, ConfigErrorKind::Empty),
            "empty",
        ),
        (
            "# only a comment\n\n",
            None,
            None,
            None,
            |k| matches!(k, ConfigErrorKind::Empty),
            "empty",
        ),
        // Anchors are read (a bounded number): this one is a list where a limit's fields go.
        (
            "a: &x [1]\nb: *x\n",
            None,
            Some(1),
            Some("a"),
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "a list",
        ),
        // Overrides.
        (
            OK,
            Some(""),
            None,
            None,
            |k| matches!(k, ConfigErrorKind::Empty),
            "empty",
        ),
        (
            OK,
            Some("- B:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [10.0.0.1]\n"),
            Some(1),
            Some("B"),
            |k| matches!(k, ConfigErrorKind::UnknownName(n) if n == "B"),
            "unknown limit",
        ),
        (
            OK,
            Some(
                "- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [10.0.0.1, 10.0.0.1]\n",
            ),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::DuplicateId(_)),
            "twice",
        ),
        (
            OK,
            Some(
                "- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids:\n      - 10.0.0.1\n      - 010.0.0.1\n",
            ),
            Some(7),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::InvalidId(_)),
            "010.0.0.1",
        ),
        (
            OK,
            Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [2001:0db8::1]\n"),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::InvalidId(_)),
            "2001:db8::1",
        ),
        (
            OK,
            Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: []\n"),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::NoIds),
            "at least one id",
        ),
        (
            OK,
            Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n"),
            Some(2),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::MissingField("ids")),
            "ids",
        ),
        (
            OK,
            Some(
                "- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [10.0.0.1]\n    why: x\n",
            ),
            Some(6),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::UnknownField { .. }),
            "why",
        ),
        (
            OK,
            Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [{comment: x}]\n"),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::MissingField("id")),
            "id",
        ),
        (
            OK,
            Some("- A:\n    burst: 5\n    count: 5\n    period: 1s\n    ids: [1.5]\n"),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "an id",
        ),
        (
            OK,
            Some("- A: {}\n  B: {}\n"),
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "exactly one",
        ),
        (
            OK,
            Some(
                "A:10.0.0.1:\n  burst: 5\n  count: 5\n  period: 1s\nA:10.0.0.1:\n  burst: 6\n  count: 6\n  period: 1s\n",
            ),
            Some(5),
            None,
            |k| {
                matches!(
                    k,
                    ConfigErrorKind::Yaml(_) | ConfigErrorKind::DuplicateId(_)
                )
            },
            "10.0.0.1",
        ),
        (
            OK,
            Some("A-10.0.0.1:\n  burst: 5\n  count: 5\n  period: 1s\n"),
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "Name:id",
        ),
        (
            OK,
            Some("42\n"),
            Some(1),
            None,
            |k| matches!(k, ConfigErrorKind::WrongShape { .. }),
            "list",
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\n  cost: 2\n",
            Some("- A:\n    burst: 1\n    count: 5\n    period: 1s\n    ids: [x]\n"),
            Some(5),
            Some("A"),
            |k| matches!(k, ConfigErrorKind::CostAboveBurst { cost: 2, burst: 1 }),
            "cost 2",
        ),
    ];
    for (i, (defaults, overrides, line, name, kind_ok, fragment)) in cases.into_iter().enumerate() {
        let err = match Limits::from_yaml_str(defaults, overrides) {
            Ok(_) => panic!("case {i} loaded: {defaults:?} / {overrides:?}"),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(
            kind_ok(err.kind()),
            "case {i}: unexpected kind {:?} ({text})",
            err.kind()
        );
        if let Some(line) = line {
            assert_eq!(err.location().line, Some(line), "case {i}: {text}");
        }
        if let Some(name) = name {
            assert_eq!(err.limit(), Some(name), "case {i}: {text}");
        }
        assert!(
            text.contains(fragment),
            "case {i}: {text:?} lacks {fragment:?}"
        );
        let source = if overrides.is_some() && !text.starts_with("<defaults>") {
            "<overrides>"
        } else {
            "<defaults>"
        };
        assert!(text.starts_with(source), "case {i}: {text}");
    }
}

/// An unknown field names the known field it most likely meant, a few letters off (a typo,
/// two letters swapped), in the error and its message; a name nothing is near gets no
/// suggestion, and a hostile name of any length is refused as fast.
#[test]
fn an_unknown_field_names_the_field_it_most_likely_meant() {
    let cases = [
        (
            "A:\n  burst: 5\n  count: 5\n  perod: 1s\n",
            "perod",
            Some("period"),
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  priod: 1s\n",
            "priod",
            Some("period"),
        ),
        (
            "A:\n  brust: 5\n  count: 5\n  period: 1s\n",
            "brust",
            Some("burst"),
        ),
        (
            "A:\n  burst: 5\n  count: 5\n  period: 1s\n  colour: red\n",
            "colour",
            None,
        ),
        (
            "A: {kind: account, calendar: {count: 3, period: month, anchorday: 15}}\n",
            "anchorday",
            Some("anchor_day"),
        ),
        (
            "A:\n  tiers:\n    - {limit: 5, widow: 1s}\n",
            "widow",
            Some("window"),
        ),
    ];
    let an_override = [(
        "A:\n  kind: account\n  burst: 5\n  count: 5\n  period: 1s\n",
        Some("- A:\n    burst: 1\n    count: 1\n    period: 1s\n    ids:\n      - {idd: x}\n"),
        "idd",
        Some("id"),
    )];
    let cases = cases
        .into_iter()
        .map(|(yaml, field, suggestion)| (yaml, None, field, suggestion))
        .chain(an_override);
    for (yaml, overrides, field, suggestion) in cases {
        let err = Limits::from_yaml_str(yaml, overrides).unwrap_err();
        match err.kind() {
            ConfigErrorKind::UnknownField {
                field: f,
                did_you_mean,
            } => {
                assert_eq!(f, field, "{yaml}");
                assert_eq!(*did_you_mean, suggestion, "{yaml}");
            }
            other => panic!("{yaml}: {other:?}"),
        }
        let message = err.to_string();
        match suggestion {
            Some(s) => assert!(
                message.contains(&format!("did you mean `{s}`?")),
                "{message}"
            ),
            None => assert!(!message.contains("did you mean"), "{message}"),
        }
    }
    // A hostile name: YAML's plain keys stop at 1,024 characters (a parse error), an explicit
    // key (`? name`) does not; either way the error comes at once, without a suggestion, and
    // quotes no more of the name than an invalid limit name's error does.
    let long = "x".repeat(100_000);
    let yaml = format!("A:\n  burst: 5\n  count: 5\n  period: 1s\n  {long}: 1\n");
    let err = Limits::from_yaml_str(&yaml, None).unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::Yaml(_)), "{err}");
    let long = "perio".repeat(20_000);
    let yaml = format!("A:\n  burst: 5\n  count: 5\n  period: 1s\n  ? {long}\n  : 1\n");
    let err = Limits::from_yaml_str(&yaml, None).unwrap_err();
    match err.kind() {
        ConfigErrorKind::UnknownField {
            field,
            did_you_mean: None,
        } => assert_eq!(*field, long[..80], "the error quotes the name's start"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_yaml_is_bounded_and_never_panics() {
    let deep = format!("A: {}{}\n", "[".repeat(10_000), "]".repeat(10_000));
    assert!(Limits::from_yaml_str(&deep, None).is_err());
    let bomb = "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n";
    assert!(Limits::from_yaml_str(bomb, None).is_err());
    for junk in [
        "\u{0}",
        "\t\t:",
        "{{{{",
        "- - - -",
        "? [a]\n: b\n",
        "A:\n  burst: !!binary aGk=\n",
        "\u{feff}",
    ] {
        let _ = Limits::from_yaml_str(junk, None);
        let _ = Limits::from_yaml_str(DEFAULTS, Some(junk));
    }
}

#[test]
fn builder_reports_the_first_error() {
    let l = Limit::new(5, 5, std::time::Duration::from_secs(1)).unwrap();
    let err = Limits::builder()
        .limit_for("A", IdKind::Account, l)
        .override_for("A", "not-a-number", l)
        .limit("A", l)
        .build()
        .unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::InvalidId(_)));
    assert_eq!(err.limit(), Some("A"));
    let err = Limits::builder()
        .limit("A", l)
        .limit("A", l)
        .build()
        .unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::DuplicateName(_)));
    let err = Limits::builder()
        .override_for("Z", "1", l)
        .build()
        .unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::UnknownName(_)));
}

// ---------------------------------------------------------------------------------------------
// Burst tiers in YAML.
// ---------------------------------------------------------------------------------------------

/// Configuration edge cases each get a precise, located answer.
#[test]
fn edge_cases_of_the_loader_each_get_a_precise_answer() {
    // A configured cost of 0 counts nothing: refused like any zero (docs/operating.md says so).
    let err = Limits::from_yaml_str(
        "A:\n  burst: 1\n  count: 1\n  period: 1s\n  cost: 0\n",
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err.kind(), ConfigErrorKind::BadNumber { field: "cost", .. }),
        "{err}"
    );
    assert_eq!(err.location().line, Some(5));
    // Units once each, largest first.
    for period in ["1s1s", "30m1h", "1ms1s"] {
        let err = Limits::from_yaml_str(
            &format!("A: {{burst: 1, count: 1, period: {period}}}\n"),
            None,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("each unit at most once"),
            "{period}: {err}"
        );
    }
    assert!(Limits::from_yaml_str("A: {burst: 1, count: 1, period: 1h30m}\n", None).is_ok());
    // A tag the loader does not know is an error, not silently dropped.
    let err =
        Limits::from_yaml_str("A: {burst: !foo 5, count: 1, period: 1s}\n", None).unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::Yaml(_)), "{err}");
}

#[test]
fn only_regular_utf8_files_of_at_most_16_mib_are_read() {
    let dir = std::env::temp_dir().join(format!("trl-config-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A directory, and a FIFO (which would block forever on open): not regular files.
    let err = Limits::from_yaml_file(&dir).unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::NotAFile), "{err}");
    let fifo = dir.join("fifo.yaml");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        let err = Limits::from_yaml_file(&fifo).unwrap_err();
        assert!(matches!(err.kind(), ConfigErrorKind::NotAFile), "{err}");
        assert!(
            err.to_string().contains("fifo.yaml: not a regular file"),
            "{err}"
        );
    }
    // Valid UTF-8 over 16 MiB whose cut falls inside a character: "too large", not "not UTF-8".
    let big = dir.join("big.yaml");
    let mut text = String::from("# ");
    while text.len() < 16 * 1024 * 1024 + 8 {
        text.push('\u{e9}');
    }
    std::fs::write(&big, &text).unwrap();
    let err = Limits::from_yaml_file(&big).unwrap_err();
    assert!(
        matches!(err.kind(), ConfigErrorKind::TooLarge { .. }),
        "{err}"
    );
    // Not UTF-8: said so, with where.
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, b"A: {burst: 1, count: 1, period: 1s}\n# \xff\n").unwrap();
    let err = Limits::from_yaml_file(&bad).unwrap_err();
    assert!(
        matches!(err.kind(), ConfigErrorKind::NotUtf8 { offset: 38 }),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// YAML reads `1_000`, `0x10`, `0o17`, `+5` and `017` as numbers (which ones depends on the
/// YAML version), and a whole number beyond 64 bits as a decimal one. Here a number is plain
/// decimal digits; the others are refused, saying what was written.
#[test]
fn numbers_are_plain_decimal_and_too_large_says_so() {
    let burst = |v: &str| {
        Limits::from_yaml_str(
            &format!("A:\n  burst: {v}\n  count: 1\n  period: 1s\n"),
            None,
        )
        .map(|_| ())
        .map_err(|e| (e.location().line, e.to_string()))
    };
    for v in ["1_000", "0x10", "0o17", "+5", "017"] {
        let (line, text) = burst(v).unwrap_err();
        assert_eq!(line, Some(2), "{v}");
        assert!(
            text.contains(&format!("found {v:?} (write plain decimal digits)")),
            "{text}"
        );
    }
    let (_, text) = burst("99999999999999999999").unwrap_err();
    assert!(
        text.contains("found 99999999999999999999, which is larger than 18446744073709551615"),
        "{text}"
    );
    assert!(burst("1000").is_ok());
    assert!(burst("5.0").unwrap_err().1.contains("a decimal number"));
}

// Hostile input, generated: no panic, and every refusal is a located error.

fn yaml_fragment() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let atoms = prop_oneof![
        Just("A:".to_owned()),
        Just("  burst: ".to_owned()),
        Just("  count: ".to_owned()),
        Just("  period: ".to_owned()),
        Just("  tiers:".to_owned()),
        Just("    - {limit: 1, window: 1s, active: 1s, cooldown: 0s}".to_owned()),
        Just("  kind: ".to_owned()),
        Just("  cost: ".to_owned()),
        Just("- A:".to_owned()),
        Just("    ids: [".to_owned()),
        Just("]".to_owned()),
        Just("{".to_owned()),
        Just("&a *a !!str !foo ? : - | >".to_owned()),
        "[0-9xo_+.e-]{0,24}".prop_map(|s| s),
        "[a-z0-9:.,/ ]{0,12}".prop_map(|s| s),
        any::<String>(),
    ];
    proptest::collection::vec(atoms, 0..24).prop_map(|parts| parts.join("\n"))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(cases::cases(512)))]
    /// Any text, as defaults and as overrides: loads or says where it is wrong; never panics.
    #[test]
    fn any_text_loads_or_is_a_located_error(
        defaults in yaml_fragment(),
        overrides in proptest::option::of(yaml_fragment()),
    ) {
        let base = "A: {burst: 5, count: 5, period: 1s, kind: ip}\n";
        for (d, o) in [(defaults.as_str(), overrides.as_deref()), (base, Some(defaults.as_str()))] {
            if let Err(e) = Limits::from_yaml_str(d, o) {
                let text = e.to_string();
                proptest::prop_assert!(!text.is_empty());
                proptest::prop_assert!(e.location().source.is_some(), "{text}");
            }
        }
    }

    /// Any text as an id of any kind: parsed or refused, never a panic; what parses is in
    /// canonical form (it parses again to itself).
    #[test]
    fn any_text_as_an_id_is_parsed_or_refused(text in proptest::prelude::any::<String>()) {
        for (_, kind) in IdKind::ALL {
            if let Ok(id) = kind.parse(&text) {
                let shown = id.to_string();
                if matches!(kind, IdKind::FqdnSet | IdKind::AccountFqdnSet) {
                    continue; // hashed: the canonical form is the digest
                }
                proptest::prop_assert_eq!(kind.parse(&shown).ok(), Some(id), "{} {:?}", kind, text);
            }
        }
        let _ = Id::new(&text);
    }
}

/// `unlimited: true` in an override entry (both formats) makes a limit unlimited for its ids;
/// anything else in that field, or a limit beside it, is a located error.
#[test]
fn an_override_can_make_a_limit_unlimited_for_listed_ids() {
    let limits = Limits::from_yaml_str(
        DEFAULTS,
        Some(
            "\
- NewOrdersPerAccount:
    unlimited: true
    ids: [7, 8]
    comment: the partner's accounts
- NewOrdersPerAccount:
    burst: 600
    count: 600
    period: 180m
    ids: [9]
",
        ),
    )
    .unwrap();
    let key = |id: &str| {
        let n = limits.name("NewOrdersPerAccount").unwrap();
        BucketKey::new(n, IdKind::Account.parse(id).unwrap())
    };
    assert!(limits.resolve(&key("7")).is_none(), "unlimited");
    assert!(limits.resolve(&key("8")).is_none(), "unlimited");
    assert_eq!(limit_of(&limits, "NewOrdersPerAccount", "9").burst(), 600);
    assert_eq!(limit_of(&limits, "NewOrdersPerAccount", "10").burst(), 300);
    assert_eq!(limits.override_count(), 3);

    let old_format =
        Limits::from_yaml_str(DEFAULTS, Some("NewOrdersPerAccount:7: {unlimited: true}\n"))
            .unwrap();
    let n = old_format.name("NewOrdersPerAccount").unwrap();
    assert!(
        old_format
            .resolve(&BucketKey::new(n, Id::from(7u64)))
            .is_none()
    );

    for (overrides, line, what) in [
        (
            "- NewOrdersPerAccount: {unlimited: false, ids: [7]}\n",
            1,
            "false",
        ),
        (
            "- NewOrdersPerAccount: {unlimited: 1, ids: [7]}\n",
            1,
            "a number",
        ),
        (
            "- NewOrdersPerAccount:\n    unlimited: true\n    burst: 5\n    ids: [7]\n",
            3,
            "burst",
        ),
        // A concurrency limit's `lease` and `retry_after` are limit fields too (they were
        // read past, and the override made its ids unlimited without a word).
        (
            "- NewOrdersPerAccount:\n    unlimited: true\n    ids: [7]\n    lease: 5s\n",
            4,
            "lease",
        ),
        (
            "- NewOrdersPerAccount: {unlimited: true, retry_after: 1s, ids: [7]}\n",
            1,
            "retry_after",
        ),
        (
            "- NewOrdersPerAccount: {unlimited: true, ids: [7]}\n- NewOrdersPerAccount: {unlimited: true, ids: [7]}\n",
            2,
            "7",
        ),
    ] {
        let e = Limits::from_yaml_str(DEFAULTS, Some(overrides)).unwrap_err();
        assert_eq!(e.location().line, Some(line), "{overrides}: {e}");
        assert_eq!(e.limit(), Some("NewOrdersPerAccount"), "{overrides}: {e}");
        assert!(e.to_string().contains(what), "{overrides}: {e}");
    }

    // In code too.
    let built = Limits::builder()
        .limit(
            "Api",
            Limit::new(1, 1, std::time::Duration::from_secs(1)).unwrap(),
        )
        .unlimited_for("Api", "vip")
        .build()
        .unwrap();
    let n = built.name("Api").unwrap();
    assert!(
        built
            .resolve(&BucketKey::new(n, Id::new("vip").unwrap()))
            .is_none()
    );
}

/// What `fn main() -> Result<(), Box<dyn Error>>` prints for `?` is the
/// error's `Debug`: the `Display` sentence, with the structured form under `{:#?}` (it printed
/// `ConfigError { location: Location { .. }, kind: InvalidCalendar(Zone("Mars/Olympus")) }`; the kind is
/// `Shape(Calendar(..))` since one kind holds every shape's error).
#[test]
fn a_config_error_reads_as_its_sentence_where_main_prints_it() {
    let yaml = "Plan:\n  calendar: {count: 5, period: month, zone: Mars/Olympus}\n";
    let err = Limits::from_yaml_str(yaml, None).unwrap_err();
    let printed = format!("{err:?}");
    assert_eq!(printed, err.to_string());
    assert!(printed.contains("Mars/Olympus"), "{printed}");
    assert!(!printed.contains("ConfigError {"), "{printed}");
    let structured = format!("{err:#?}");
    assert!(structured.starts_with("ConfigError {"), "{structured}");
    assert!(
        structured.contains("Shape(\n") && structured.contains("Calendar("),
        "{structured}"
    );
    // Through a boxed error, as `main` holds it.
    let boxed: Box<dyn std::error::Error> = Box::new(err);
    assert_eq!(format!("{boxed:?}"), printed);
    // The limiter's and the layer's errors read the same way.
    let limits = Limits::from_yaml_str("A: {burst: 1, count: 1, period: 1s}\n", None).unwrap();
    let limiter = tower_ratelimits::Limiter::new(limits, tower_ratelimits::MemoryBackend::new());
    let err = limiter
        .key("ApiCallsPerMonth", tower_ratelimits::Id::from(1u64))
        .unwrap_err();
    assert_eq!(format!("{err:?}"), err.to_string());
    assert!(format!("{err:#?}").starts_with("LimiterError::UnknownName("));
}

/// An invalid limit name in the error's location is escaped and cut to 80
/// characters like its quoted part (a 100,000-character name made a 100,180-byte line, and NUL
/// and ESC reached the terminal).
#[test]
fn a_hostile_limit_name_is_escaped_and_cut_in_the_location() {
    // In YAML (an explicit key, with YAML's escapes: ESC and NUL, then 100,000 characters) and
    // in code.
    let yaml = format!(
        "? \"\\e[31m\\0{}\"\n: {{burst: 1, count: 1, period: 1s}}\n",
        "x".repeat(100_000)
    );
    let name = format!("\u{1b}[31m\u{0}{}", "x".repeat(100_000));
    let limit = Limit::new(1, 1, std::time::Duration::from_secs(1)).unwrap();
    for err in [
        Limits::from_yaml_str(&yaml, None).unwrap_err(),
        Limits::builder().limit(&name, limit).build().unwrap_err(),
    ] {
        let message = err.to_string();
        assert!(
            matches!(err.kind(), ConfigErrorKind::InvalidName(_)),
            "{message}"
        );
        assert!(message.len() < 400, "{} bytes: {message}", message.len());
        assert!(
            !message.contains('\u{1b}') && !message.contains('\u{0}'),
            "{message:?}"
        );
    }
}

/// YAML anchors and aliases share settings between limits (every anchor was
/// refused with "budget breached: Anchors"): a whole value (`B: *rate`), a list of tiers, and a
/// merge key (`<<: *rate`) with a field of its own; a bounded number of them, and an alias
/// bomb is still refused at once.
#[test]
fn anchors_and_aliases_share_settings_between_limits() {
    let yaml = "\
A: &rate {kind: account, burst: 5, count: 5, period: 1s}
B: *rate
C:
  <<: *rate
  burst: 10
T1:
  tiers: &tiers
    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}
T2:
  tiers: *tiers
";
    let limits = Limits::from_yaml_str(yaml, None).unwrap_or_else(|e| panic!("{e}"));
    let gcra = |name: &str| {
        let key = BucketKey::new(limits.name(name).unwrap(), Id::from(7u64));
        *limits.resolve(&key).unwrap().as_gcra().unwrap()
    };
    assert_eq!((gcra("B").burst(), gcra("B").count()), (5, 5));
    assert_eq!((gcra("C").burst(), gcra("C").count()), (10, 5));
    // A thousand laughs and more: refused, quickly, with what was breached.
    let mut bomb = String::from("a: &a [x,x,x,x,x,x,x,x,x,x]\n");
    for (i, name) in ["b", "c", "d", "e", "f", "g", "h"].iter().enumerate() {
        let prev = ["a", "b", "c", "d", "e", "f", "g"][i];
        let list = vec![format!("*{prev}"); 10].join(",");
        bomb.push_str(&format!("{name}: &{name} [{list}]\n"));
    }
    let err = Limits::from_yaml_str(&bomb, None).unwrap_err();
    assert!(matches!(err.kind(), ConfigErrorKind::Yaml(_)), "{err}");
    // More anchors than a limits file needs: refused, saying so.
    let many: String = (0..300)
        .map(|i| format!("L{i}: &a{i} {{burst: 1, count: 1, period: 1s}}\n"))
        .collect();
    let err = Limits::from_yaml_str(&many, None).unwrap_err();
    assert!(err.to_string().contains("anchors"), "{err}");
}

/// A configuration finds its names by their process number while few names exist, and by a
/// hash of the name from the 16,384th name interned in the process on (in its own test
/// binary's process: at least the last 64 names here are past that line). Every name is found
/// with its own settings, and a name the configuration lacks is found by neither road.
#[test]
fn names_past_the_dense_table_are_found_by_hash() {
    let limit = Limit::new(10, 10, std::time::Duration::from_secs(1)).unwrap();
    let count = (1 << 14) + 64;
    let mut b = Limits::builder();
    for i in 0..count {
        let kind = if i % 2 == 0 {
            IdKind::Ip
        } else {
            IdKind::Account
        };
        b = b.limit_for(&format!("many-{i}"), kind, limit);
    }
    let limits = b.build().unwrap();
    for i in 0..count {
        let name = limits.name(&format!("many-{i}")).unwrap();
        let kind = if i % 2 == 0 {
            IdKind::Ip
        } else {
            IdKind::Account
        };
        assert_eq!(limits.id_kind(name), Some(kind), "many-{i}");
    }
    let other = Limits::builder()
        .limit("many-absent", limit)
        .limit("many-0", limit)
        .build()
        .unwrap();
    let late = other.name("many-absent").unwrap();
    assert_eq!(limits.id_kind(late), None, "a late name it lacks");
    assert_eq!(
        other.id_kind(limits.name("many-1").unwrap()),
        None,
        "an early name it lacks"
    );
    assert_eq!(
        other.id_kind(limits.name(&format!("many-{}", count - 1)).unwrap()),
        None,
        "a late name it lacks"
    );
    assert!(other.id_kind(limits.name("many-0").unwrap()).is_some());
}
