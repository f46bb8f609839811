//! The simulator's `--regions`: one limit across simulated regions (`docs/regions.md`), each
//! line decided in its region (`@eu`, or split by the percentages), the shares moving to the
//! demand, the union of the regions' admitted requests within the limit itself, the shares
//! drawn, and every bad input an exit code 2 with its reason.
//!
//! These tests run the `tower-ratelimits-simulate` binary, which cargo builds for them.

use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;
use tower_ratelimits::__private::gcra;
use tower_ratelimits::Limit;

/// The example's limits (`examples/traces/regions.yaml`): `Api` one limit across regions,
/// 10 a second, burst 10, floors of 10% (1 a second, 1 at once); `Local` a limit per region.
fn defaults() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/regions.yaml")
}

/// The simulator's exit code, JSON lines and standard error, run on `trace` (standard input)
/// with `args` and the example's limits.
fn simulate(args: &[&str], trace: &str) -> (Option<i32>, Vec<Value>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tower-ratelimits-simulate"))
        .arg("--defaults")
        .arg(defaults())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let text = trace.to_owned();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(text.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let json = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `examples/traces/regions.trace`: eu asks 15 a second and us 1 for 6 s, then the other way
/// round (each line names its region).
fn shift_trace() -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/traces/regions.trace"),
    )
    .unwrap()
}

/// Admitted requests per region and second.
fn admitted(json: &[Value], seconds: usize) -> [Vec<u32>; 2] {
    let mut out = [vec![0; seconds], vec![0; seconds]];
    for line in json {
        if line["allowed"] == true {
            let region = usize::from(line["region"] == "us");
            let second = (line["at_us"].as_u64().unwrap() / 1_000_000) as usize;
            out[region][second] += 1;
        }
    }
    out
}

#[test]
fn the_share_moves_to_the_busy_region_and_the_union_keeps_the_limit() {
    let (code, json, stderr) = simulate(&["--regions", "eu,us"], &shift_trace());
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        json.iter()
            .all(|l| l["region"] == "eu" || l["region"] == "us")
    );
    let [eu, us] = admitted(&json, 12);
    // Three periods after each shift: the busy region admits the limit less the other's
    // floor (9 a second), the other all it asks (1 a second).
    for s in 3..6 {
        assert!(eu[s] >= 8, "eu {eu:?} us {us:?}");
        assert_eq!(us[s], 1, "eu {eu:?} us {us:?}");
    }
    for s in 9..12 {
        assert!(us[s] >= 8, "eu {eu:?} us {us:?}");
        assert_eq!(eu[s], 1, "eu {eu:?} us {us:?}");
    }
    // The union conforms to the limit itself: a GCRA of 10 a second, burst 10, on the trace's
    // clock admits every request either region admitted.
    let whole = Limit::from_micros(10, 10, 1_000_000).unwrap();
    let mut tat = None;
    for line in json.iter().filter(|l| l["allowed"] == true) {
        let at = line["at_us"].as_u64().unwrap() + 1_700_000_000_000_000;
        let check = gcra::check(&whole, tat, at, 1).unwrap();
        assert!(check.allowed, "over the limit at line {}", line["line"]);
        tat = check.new_tat;
    }
    // Limits not marked are per region: each region has a whole one.
    let local: String = (0..20)
        .map(|i| format!("0s spend Local=k @{}\n", ["eu", "us"][i % 2]))
        .collect();
    let (code, json, stderr) = simulate(&["--regions", "eu,us"], &local);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(json.iter().filter(|l| l["allowed"] == true).count(), 20);
}

#[test]
fn lines_naming_no_region_are_split_by_the_percentages() {
    let trace: String = (0..1_000)
        .map(|i| format!("{i}ms spend Local=x{i}\n"))
        .collect();
    let (code, json, stderr) = simulate(&["--regions", "eu:60%,us:30%,ap:10%"], &trace);
    assert_eq!(code, Some(0), "{stderr}");
    // Any 100 lines in a row: each region's percentage, within one line.
    for window in json.windows(100) {
        for (name, percent) in [("eu", 60), ("us", 30), ("ap", 10)] {
            let n = window.iter().filter(|l| l["region"] == name).count() as i64;
            assert!((n - percent).abs() <= 1, "{name}: {n} of 100");
        }
    }
    // No percentages: evenly.
    let (_, json, _) = simulate(&["--regions", "eu,us"], &trace);
    assert_eq!(json.iter().filter(|l| l["region"] == "eu").count(), 500);
    // Without --regions, no region in the output.
    let (_, json, _) = simulate(&[], "0s spend Api=k\n");
    assert!(json[0].get("region").is_none(), "{}", json[0]);
}

#[test]
fn the_drawing_shows_each_regions_share_of_the_rate() {
    let dir = std::env::temp_dir().join(format!("trl-regions-svg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg_path = dir.join("out.svg");
    let (code, json, stderr) = simulate(
        &["--regions", "eu,us", "--svg", svg_path.to_str().unwrap()],
        &shift_trace(),
    );
    assert_eq!(code, Some(0), "{stderr}");
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let at_of = |line: &str| -> u64 {
        let n: u64 = line.parse().unwrap();
        json.iter().find(|l| l["line"] == n).unwrap()["at_us"]
            .as_u64()
            .unwrap()
    };
    for (region, busy_from, busy_to) in
        [("eu", 3_000_000, 6_000_000), ("us", 9_000_000, 12_000_000)]
    {
        let lane = doc
            .descendants()
            .find(|n| n.attribute("data-key") == Some(&*format!("{region} · Api=k")))
            .unwrap_or_else(|| panic!("no lane of {region}"));
        let share = lane
            .descendants()
            .find(|n| {
                n.attribute("class") == Some("series") && n.attribute("data-series") == Some("1")
            })
            .expect("a share series");
        assert!(svg.contains("share of rate"));
        // The share drawn after each of the region's requests: its floor (1) before any
        // grant, the limit less the other's floor (9) while it is busy.
        let points: Vec<(u64, u64)> = lane
            .descendants()
            .filter(|n| {
                n.attribute("class") == Some("qp") && n.attribute("data-series") == Some("1")
            })
            .map(|n| {
                (
                    at_of(n.attribute("data-line").unwrap()),
                    n.attribute("data-value").unwrap().parse().unwrap(),
                )
            })
            .collect();
        assert!(share.attribute("data-max") == Some("10"));
        assert!(
            points.iter().any(|&(at, v)| at < 1_000_000 && v == 1),
            "{region}: {points:?}"
        );
        let busy: Vec<u64> = points
            .iter()
            .filter(|(at, _)| (busy_from..busy_to).contains(at))
            .map(|&(_, v)| v)
            .collect();
        assert!(
            !busy.is_empty() && busy.iter().all(|&v| v == 9),
            "{region}: {busy:?}"
        );
    }
}

#[test]
fn bad_regions_exit_2_with_the_reason() {
    for (args, trace, reason) in [
        (
            &["--regions", "eu:60%,us:30%"][..],
            "0s spend Api=k\n",
            "sum to 90%",
        ),
        (
            &["--regions", "eu:60%,us"][..],
            "0s spend Api=k\n",
            "every region a percentage",
        ),
        (
            &["--regions", "eu,eu"][..],
            "0s spend Api=k\n",
            "named twice",
        ),
        (
            &["--regions", "e u"][..],
            "0s spend Api=k\n",
            "a region is named by",
        ),
        (
            &["--regions", "eu:6o%"][..],
            "0s spend Api=k\n",
            "not a percentage",
        ),
        (
            &["--regions", "eu,us"][..],
            "0s spend Api=k @mars\n",
            "unknown region \"mars\"",
        ),
        (
            &["--regions", "eu,us"][..],
            "0s spend Api=k @eu cost=1\n",
            "a region goes last",
        ),
        (
            &["--regions", "eu,us"][..],
            "0s spend Api=k @\n",
            "names no region",
        ),
        (&[][..], "0s spend Api=k @eu\n", "give --regions"),
        (
            &["--regions", "eu", "--redis", "redis://127.0.0.1:1"][..],
            "",
            "drop --redis",
        ),
    ] {
        let (code, _, stderr) = simulate(args, trace);
        assert_eq!(code, Some(2), "{args:?} {trace:?}: {stderr}");
        assert!(stderr.contains(reason), "{args:?} {trace:?}: {stderr}");
    }
}
