//! One limit across regions (`docs/regions.md`), as far as it is built: which limits may be
//! marked `across_regions` and with what floor (YAML, the builder, file and stored overrides),
//! each refusal with its line, and the warning of a marked limit on a backend without a
//! regional mode. The protocol's model check is in the library's unit tests
//! (`src/algo/regions/model.rs`).

mod support;

use std::time::Duration;

use tower_ratelimits::{
    ConfigErrorKind, Limit, Limiter, Limits, MemoryBackend, OverrideError, OverrideKind,
    RegionFloor,
};

const MARKED: &str = "\
PerKey:
  burst: 1000
  count: 1000
  period: 1s
  across_regions: true
Narrow:
  burst: 100
  count: 100
  period: 1s
  across_regions: true
  region_floor: 2.5%
Local:
  burst: 10
  count: 10
  period: 1s
";

fn floor(limits: &Limits, name: &str) -> Option<RegionFloor> {
    limits.across_regions(limits.name(name).unwrap())
}

#[test]
fn a_marked_limit_has_a_tenth_as_its_floor_unless_it_says_otherwise() {
    let limits = Limits::from_yaml_str(MARKED, None).unwrap();
    assert_eq!(floor(&limits, "PerKey"), Some(RegionFloor::default()));
    assert_eq!(floor(&limits, "PerKey").unwrap().of(1000), 100);
    assert_eq!(
        floor(&limits, "Narrow"),
        RegionFloor::from_basis_points(250)
    );
    assert_eq!(floor(&limits, "Local"), None);
    let unmarked = MARKED.replace(
        "  across_regions: true\nNarrow",
        "  across_regions: false\nNarrow",
    );
    let limits = Limits::from_yaml_str(&unmarked, None).unwrap();
    assert_eq!(floor(&limits, "PerKey"), None);
}

/// Only a GCRA limit without prefetched tokens can be one limit across regions: every other
/// shape, and prefetch, is refused at the `across_regions` line, naming what it has.
#[test]
fn marking_tiers_a_calendar_a_concurrency_limit_or_prefetch_is_refused_at_its_line() {
    let cases = [
        (
            "tiers:\n    - {limit: 5, window: 1s, active: 1s, cooldown: 0s}\n",
            "burst tiers",
        ),
        (
            "calendar: {count: 100, period: month}\n",
            "a calendar quota",
        ),
        ("concurrency: 5\n", "a concurrency limit"),
        (
            "burst: 10\n  count: 10\n  period: 1s\n  prefetch: 2\n",
            "prefetch",
        ),
    ];
    for (shape, named) in cases {
        let yaml = format!("Api:\n  {shape}  across_regions: true\n");
        let e = Limits::from_yaml_str(&yaml, None).unwrap_err();
        assert!(matches!(e.kind(), ConfigErrorKind::AcrossRegions(_)), "{e}");
        assert!(e.to_string().contains(named), "{e}");
        assert_eq!(e.location().line, Some(yaml.lines().count() as u64), "{e}");
        assert_eq!(e.limit(), Some("Api"));
    }
}

#[test]
fn a_floor_must_be_a_percentage_of_a_marked_limit() {
    for bad in [
        "10", "101%", "abc%", "1.234%", "-5%", "'%'", "5.%", "1e1%", "\"\"",
    ] {
        let yaml = format!(
            "Api:\n  burst: 9\n  count: 9\n  period: 1s\n  across_regions: true\n  region_floor: {bad}\n"
        );
        let e = Limits::from_yaml_str(&yaml, None).unwrap_err();
        assert!(
            matches!(e.kind(), ConfigErrorKind::RegionFloor(_)),
            "{bad}: {e}"
        );
        assert_eq!(e.location().line, Some(6), "{bad}: {e}");
    }
    for good in ["0%", "100%", "12.75%", "7.5%"] {
        let yaml = format!(
            "Api:\n  burst: 9\n  count: 9\n  period: 1s\n  across_regions: true\n  region_floor: {good}\n"
        );
        let limits = Limits::from_yaml_str(&yaml, None).unwrap();
        assert_eq!(floor(&limits, "Api").unwrap().to_string(), good);
    }
    let e = Limits::from_yaml_str(
        "Api:\n  burst: 9\n  count: 9\n  period: 1s\n  region_floor: 5%\n",
        None,
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ConfigErrorKind::RegionFloor(_)), "{e}");
    assert_eq!(e.location().line, Some(5));
    let e = Limits::from_yaml_str(
        "Api:\n  burst: 9\n  count: 9\n  period: 1s\n  across_regions: yes please\n",
        None,
    )
    .unwrap_err();
    assert_eq!(e.location().line, Some(5), "{e}");
}

/// An override of a marked limit must be one that can cross regions too: in the overrides
/// file (at its line), in code, and stored at run time.
#[tokio::test]
async fn an_override_of_a_marked_limit_that_prefetches_is_refused_everywhere() {
    let overrides =
        "- PerKey:\n    burst: 50\n    count: 50\n    period: 1s\n    prefetch: 5\n    ids: [k]\n";
    let e = Limits::from_yaml_str(MARKED, Some(overrides)).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ConfigErrorKind::AcrossRegions("prefetched tokens (prefetch)")
        ),
        "{e}"
    );
    assert_eq!(e.location().line, Some(6), "the id it refuses: {e}");
    let fine = overrides.replace("    prefetch: 5\n", "");
    assert!(Limits::from_yaml_str(MARKED, Some(&fine)).is_ok());

    let prefetching = Limit::new(50, 50, Duration::from_secs(1))
        .unwrap()
        .with_prefetch(5, Duration::from_secs(1))
        .unwrap();
    let plain = Limit::new(50, 50, Duration::from_secs(1)).unwrap();
    // Marked after the override, or before it: refused either way.
    let e = Limits::builder()
        .limit("PerKey", plain)
        .override_for("PerKey", "k", prefetching)
        .across_regions("PerKey", RegionFloor::default())
        .build()
        .unwrap_err();
    assert!(matches!(e.kind(), ConfigErrorKind::AcrossRegions(_)), "{e}");
    let e = Limits::builder()
        .limit("PerKey", plain)
        .across_regions("PerKey", RegionFloor::default())
        .override_for("PerKey", "k", prefetching)
        .build()
        .unwrap_err();
    assert!(matches!(e.kind(), ConfigErrorKind::AcrossRegions(_)), "{e}");
    let e = Limits::builder()
        .across_regions("Nope", RegionFloor::default())
        .build()
        .unwrap_err();
    assert!(matches!(e.kind(), ConfigErrorKind::UnknownName(_)), "{e}");

    let limiter = Limiter::new(
        Limits::from_yaml_str(MARKED, None).unwrap(),
        MemoryBackend::new(),
    );
    let e = limiter
        .set_override("PerKey", "k", OverrideKind::Quota(prefetching.into()), None)
        .await
        .unwrap_err();
    assert!(matches!(e, OverrideError::Refused { .. }), "{e}");
    assert!(e.to_string().contains("across_regions"), "{e}");
    limiter
        .set_override("PerKey", "k", OverrideKind::Quota(plain.into()), None)
        .await
        .unwrap();
    // An unmarked limit takes the prefetching override as before.
    limiter
        .set_override("Local", "k", OverrideKind::Quota(prefetching.into()), None)
        .await
        .unwrap();
}

/// A backend without regional mode (memory here; Redis without `regional`): a marked limit
/// decides as a limit per region, and the limiter says so once per limit, at its start or at
/// the reload that marks it.
#[test]
fn a_marked_limit_without_a_regional_mode_is_warned_of_once() {
    let (limiter, warned) = support::warnings_during(|| {
        Limiter::new(
            Limits::from_yaml_str(MARKED, None).unwrap(),
            MemoryBackend::new(),
        )
    });
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(
        warned[0].starts_with("tower_ratelimits::backend: limit PerKey is marked across_regions"),
        "{warned:?}"
    );
    assert!(
        warned[1].contains("limit Narrow is marked across_regions"),
        "{warned:?}"
    );
    let (_, warned) = support::warnings_during(|| {
        limiter
            .reload(Limits::from_yaml_str(MARKED, None).unwrap())
            .unwrap()
    });
    assert!(warned.is_empty(), "{warned:?}");
    let local_marked = format!("{MARKED}  across_regions: true\n");
    let (_, warned) = support::warnings_during(|| {
        limiter
            .reload(Limits::from_yaml_str(&local_marked, None).unwrap())
            .unwrap()
    });
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("limit Local is marked"), "{warned:?}");
}

/// The example of `docs/regions.md` loads as it says.
#[test]
fn the_documented_example_loads() {
    let doc = include_str!("../docs/regions.md");
    let yaml = doc
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap();
    let limits = Limits::from_yaml_str(yaml, None).unwrap();
    assert_eq!(floor(&limits, "ApiPerKey"), Some(RegionFloor::default()));
}
