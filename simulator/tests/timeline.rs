//! The simulator's timeline (`--svg`, `--html`) and workload generator (`--generate`): the
//! numbers drawn are the numbers decided (the SVG read back as XML against the JSON of the
//! same run), large traces stay bounded, the generator follows its grammar, bad input exits 2
//! with a located message and leaves no file, and the page opens in a real headless Chromium
//! without console errors or network requests, with a screenshot that is not blank.
//!
//! These tests run the `tower-ratelimits-simulate` binary, which cargo builds for them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

#[path = "support/browser.rs"]
mod browser;

/// The `tower-ratelimits-simulate` binary, built by `cargo test` for this crate's tests.
fn simulator() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tower-ratelimits-simulate"))
}

/// A scratch directory, removed at the end of the test.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "trl-timeline-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Run {
    code: Option<i32>,
    json: Vec<Value>,
    stderr: String,
}

fn simulate(args: &[&str]) -> Run {
    let out = Command::new(simulator()).args(args).output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    Run {
        code: out.status.code(),
        json: stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

/// Runs a trace with `--svg`, returning the JSON lines and the SVG.
fn draw(defaults: &str, trace_args: &[&str], extra: &[&str]) -> (Vec<Value>, String) {
    let scratch = Scratch::new("draw");
    let svg = scratch.path("out.svg");
    let mut args = vec!["--defaults", defaults, "--svg", svg.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.extend_from_slice(trace_args);
    let run = simulate(&args);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    (run.json, std::fs::read_to_string(&svg).unwrap())
}

/// The drawing's time axis, as the file states it: `start:end:x` pieces and microseconds per
/// pixel.
struct Axis {
    pieces: Vec<(u64, u64, f64)>,
    us_per_px: f64,
}

impl Axis {
    fn read(svg: roxmltree::Node<'_, '_>) -> Axis {
        let pieces = svg
            .attribute("data-axis")
            .unwrap()
            .split(';')
            .map(|p| {
                let f: Vec<&str> = p.split(':').collect();
                (
                    f[0].parse().unwrap(),
                    f[1].parse().unwrap(),
                    f[2].parse().unwrap(),
                )
            })
            .collect();
        Axis {
            pieces,
            us_per_px: svg.attribute("data-us-per-px").unwrap().parse().unwrap(),
        }
    }

    /// The pixel of `t`, which must lie inside a drawn piece.
    fn x(&self, t: u64) -> f64 {
        let &(start, _, x) = self
            .pieces
            .iter()
            .find(|&&(s, e, _)| s <= t && t <= e)
            .unwrap_or_else(|| panic!("{t} is not drawn"));
        x + (t - start) as f64 / self.us_per_px
    }

    fn drawn(&self, t: u64) -> bool {
        self.pieces.iter().any(|&(s, e, _)| s <= t && t <= e)
    }
}

fn attr<'a>(n: roxmltree::Node<'a, '_>, name: &str) -> &'a str {
    n.attribute(name)
        .unwrap_or_else(|| panic!("no {name} on {n:?}"))
}

fn num(n: roxmltree::Node<'_, '_>, name: &str) -> f64 {
    attr(n, name).parse().unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 0.02
}

/// What [`check_drawing`] saw.
#[derive(Debug, Default)]
struct Seen {
    marks: usize,
    aggregated: usize,
    quota_points: usize,
    retry_pointers: usize,
    blocked: usize,
}

/// Every decision of the JSON is in the drawing: as its own mark, with the same numbers, at its
/// time, with the quota just after it drawn where its value says; or counted in an aggregate
/// mark covering its line.
fn check_drawing(json: &[Value], svg: &str) -> Seen {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
    let root = doc.root_element();
    let axis = Axis::read(root);
    let lanes: HashMap<&str, roxmltree::Node<'_, '_>> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("lane"))
        .map(|n| (attr(n, "data-key"), n))
        .collect();
    let mut seen = Seen::default();
    // Per aggregate mark (by node id): decisions counted, denied, refused by the batch.
    let mut aggregates: HashMap<roxmltree::NodeId, (u64, u64, u64)> = HashMap::new();
    // Resets and releases counted in aggregate marks (not decisions).
    let mut changes_aggregated = 0;
    for line in json {
        let number = line["line"].as_u64().unwrap();
        let Some(decisions) = line["decisions"].as_array() else {
            // A reset or release: its own mark on each key's lane, or counted in an aggregate.
            for key in line["keys"].as_array().into_iter().flatten() {
                let lane = lanes[key.as_str().unwrap()];
                if mark_of(lane, number).is_none() {
                    let agg = aggregate_of(lane, number, key.as_str().unwrap());
                    aggregates.entry(agg.id()).or_default().0 += 1;
                    changes_aggregated += 1;
                }
            }
            continue;
        };
        let at = line["at_us"].as_u64().unwrap();
        let op = line["op"].as_str().unwrap();
        for d in decisions {
            let key = format!(
                "{}={}",
                d["limit"].as_str().unwrap(),
                d["id"].as_str().unwrap()
            );
            let lane = lanes
                .get(key.as_str())
                .unwrap_or_else(|| panic!("no lane for {key}"));
            let Some(mark) = mark_of(*lane, number) else {
                let agg = aggregate_of(*lane, number, &key);
                let e = aggregates.entry(agg.id()).or_default();
                e.0 += 1;
                e.1 += u64::from(d["allowed"] == json!(false));
                e.2 += u64::from(d["allowed"] == json!(true) && line["allowed"] == json!(false));
                continue;
            };
            seen.marks += 1;
            let ctx = format!("line {number} {key}");
            assert_eq!(attr(mark, "data-op"), op, "{ctx}");
            assert_eq!(num(mark, "data-at-us") as u64, at, "{ctx}");
            assert_eq!(
                attr(mark, "data-allowed"),
                d["allowed"].to_string(),
                "{ctx}"
            );
            assert_eq!(
                attr(mark, "data-batch-allowed"),
                line["allowed"].to_string(),
                "{ctx}"
            );
            for (field, data) in [
                ("remaining", "data-remaining"),
                ("retry_after_us", "data-retry-after-us"),
                ("reset_after_us", "data-reset-after-us"),
            ] {
                assert_eq!(attr(mark, data), d[field].to_string(), "{ctx} {field}");
            }
            if let Some(g) = d.get("granted") {
                assert_eq!(attr(mark, "data-granted"), g.to_string(), "{ctx}");
            }
            if let Some(t) = d["tiers"].as_array() {
                let units: Vec<String> = t.iter().map(Value::to_string).collect();
                assert_eq!(attr(mark, "data-tiers"), units.join(","), "{ctx}");
                assert_eq!(attr(mark, "data-tier"), d["tier"].to_string(), "{ctx}");
                assert_eq!(attr(mark, "data-burst"), d["burst"].to_string(), "{ctx}");
            }
            assert_eq!(
                mark.attribute("data-lease").is_some(),
                d.get("lease").is_some(),
                "{ctx}"
            );
            let class = attr(mark, "data-class");
            let expected = if op == "refund" {
                "other"
            } else if d["allowed"] == json!(false) {
                "deny"
            } else if line["allowed"] == json!(false) {
                "blocked"
            } else if class == "part" {
                // A range granted below its maximum: the JSON says how much was granted.
                assert!(d.get("granted").is_some(), "{ctx}");
                "part"
            } else {
                "ok"
            };
            assert_eq!(class, expected, "{ctx}");
            if class == "blocked" {
                seen.blocked += 1;
                assert_eq!(
                    attr(mark, "data-refused-by"),
                    line_refuser(line).as_str(),
                    "{ctx}"
                );
            }
            // The mark sits at its time.
            let x = axis.x(at);
            let shape = mark
                .children()
                .find(|n| n.has_tag_name("circle") || n.has_tag_name("rect"));
            if let Some(s) = shape {
                let cx = if s.has_tag_name("circle") {
                    num(s, "cx")
                } else {
                    num(s, "x") + num(s, "width") / 2.0
                };
                assert!(close(cx, x), "{ctx}: drawn at {cx}, time at {x}");
            }
            // A denial points at its retry_after.
            let retry = d["retry_after_us"].as_u64().unwrap();
            if class == "deny" && retry > 0 {
                let pointer = mark
                    .children()
                    .find(|n| n.attribute("class") == Some("retry"))
                    .unwrap_or_else(|| panic!("{ctx}: no retry pointer"));
                assert_eq!(num(pointer, "data-at-us") as u64, at + retry, "{ctx}");
                assert!(close(num(pointer, "x1"), x), "{ctx}");
                if axis.drawn(at + retry) {
                    assert!(close(num(pointer, "x2"), axis.x(at + retry)), "{ctx}");
                }
                seen.retry_pointers += 1;
            }
            // The quota just after the request, where its value says.
            let points: Vec<_> = lane
                .descendants()
                .filter(|n| {
                    n.attribute("class") == Some("qp")
                        && n.attribute("data-line") == Some(&number.to_string())
                })
                .collect();
            let kind = attr(*lane, "data-kind");
            let series: Vec<_> = lane
                .descendants()
                .filter(|n| n.attribute("class") == Some("series"))
                .collect();
            assert_eq!(points.len(), series.len(), "{ctx}: one point per quantity");
            for p in &points {
                let s = series
                    .iter()
                    .find(|s| attr(**s, "data-series") == attr(*p, "data-series"))
                    .unwrap();
                let value = num(*p, "data-value");
                let y = num(*s, "data-y0") - value * num(*s, "data-px-per-unit");
                assert!(close(num(*p, "cy"), y), "{ctx}: point drawn off its value");
                assert!(close(num(*p, "cx"), x), "{ctx}: point drawn off its time");
                assert!(value <= num(*s, "data-max"), "{ctx}");
                seen.quota_points += 1;
            }
            // What the state shows after a spend is what the decision reported.
            if op == "spend" {
                let remaining = d["remaining"].as_f64().unwrap();
                let ladder = lane.attribute("data-penalty").is_some();
                match kind {
                    // A ladder's lane: the decision reports the fewer of the tokens and the
                    // units left before a ban.
                    "gcra" if ladder => assert!(num(points[0], "data-value") >= remaining),
                    "gcra" => assert_eq!(num(points[0], "data-value"), remaining, "{ctx}"),
                    "concurrency" => {
                        let max = num(series[0], "data-max");
                        assert_eq!(num(points[0], "data-value"), max - remaining, "{ctx}")
                    }
                    // The key's number, and under it the slots in use once one is taken
                    // (a refusal or a probe may find more in use: slots outlive a drop).
                    "adaptive" => {
                        let slots = d["slots"].as_f64().unwrap();
                        assert_eq!(num(points[1], "data-value"), slots, "{ctx}");
                        if d["lease"] == json!(true) {
                            assert_eq!(num(points[0], "data-value"), slots - remaining, "{ctx}");
                        }
                    }
                    "tiered" => {
                        let tier = d["tier"].as_u64().unwrap() as usize - 1;
                        let max = num(series[tier], "data-max");
                        assert_eq!(
                            num(points[tier], "data-value"),
                            max - remaining,
                            "{ctx}: tier {}",
                            tier + 1
                        );
                    }
                    other => panic!("{other}"),
                }
            }
        }
    }
    for (id, (count, denied, blocked)) in aggregates {
        let agg = doc.get_node(id).unwrap();
        assert_eq!(num(agg, "data-count") as u64, count, "{agg:?}");
        assert_eq!(num(agg, "data-denied") as u64, denied, "{agg:?}");
        assert_eq!(num(agg, "data-blocked") as u64, blocked, "{agg:?}");
        seen.aggregated += count as usize;
    }
    seen.aggregated -= changes_aggregated;
    // Nothing drawn that was not decided.
    let drawn: usize = doc
        .descendants()
        .filter(|n| n.attribute("data-op").is_some() && n.attribute("data-allowed").is_some())
        .count();
    assert_eq!(drawn, seen.marks);
    seen
}

/// The mark of line `number` on `lane`, when it is drawn as its own.
fn mark_of<'a, 'i>(lane: roxmltree::Node<'a, 'i>, number: u64) -> Option<roxmltree::Node<'a, 'i>> {
    lane.descendants().find(|n| {
        n.attribute("data-line") == Some(&number.to_string()) && n.attribute("data-op").is_some()
    })
}

/// The aggregate mark on `lane` (of `key`) that counts line `number`.
fn aggregate_of<'a, 'i>(
    lane: roxmltree::Node<'a, 'i>,
    number: u64,
    key: &str,
) -> roxmltree::Node<'a, 'i> {
    lane.descendants()
        .find(|n| {
            n.attribute("class") == Some("agg")
                && num(*n, "data-first-line") as u64 <= number
                && number <= num(*n, "data-last-line") as u64
        })
        .unwrap_or_else(|| panic!("line {number} ({key}) is not drawn"))
}

/// The limit that refused a denied line: the strictest denying decision (the top-level
/// numbers are its numbers).
fn line_refuser(line: &Value) -> String {
    line["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| {
            d["allowed"] == json!(false)
                && d["retry_after_us"] == line["retry_after_us"]
                && d["remaining"] == line["remaining"]
        })
        .map(|d| d["limit"].as_str().unwrap().to_owned())
        .unwrap()
}

#[test]
fn the_numbers_drawn_are_the_numbers_decided() {
    let cases = [
        (
            "examples/traces/burst-tiers.yaml",
            "examples/traces/burst-tiers-v1-v8.trace",
        ),
        (
            "examples/traces/gcra-20-per-second.yaml",
            "examples/traces/gcra-worked-examples.trace",
        ),
        (
            "examples/traces/partial-grants.yaml",
            "examples/traces/partial-grants.trace",
        ),
        (
            "examples/traces/concurrency.yaml",
            "examples/traces/concurrency.trace",
        ),
        (
            "examples/traces/adaptive.yaml",
            "examples/traces/adaptive.trace",
        ),
    ];
    for (defaults, trace) in cases {
        // Wide, where most requests are marks of their own (requests at one instant or a few
        // milliseconds apart still share a mark), then the default width.
        let (json, svg) = draw(&repo(defaults), &[&repo(trace)], &["--width", "100000"]);
        let seen = check_drawing(&json, &svg);
        let decisions: usize = json
            .iter()
            .filter_map(|l| l["decisions"].as_array())
            .map(Vec::len)
            .sum();
        assert_eq!(seen.marks + seen.aggregated, decisions, "{trace}: {seen:?}");
        assert!(seen.marks * 2 >= decisions, "{trace}: {seen:?}");
        assert!(seen.quota_points >= seen.marks, "{trace}: {seen:?}");
        let (json, svg) = draw(&repo(defaults), &[&repo(trace)], &[]);
        let seen = check_drawing(&json, &svg);
        assert_eq!(seen.marks + seen.aggregated, decisions, "{trace}: {seen:?}");
        assert!(seen.marks > 0, "{trace}: {seen:?}");
        if trace.contains("v1-v8") {
            // 8 examples over 800 s in 1,400 px: the aggregate marks are checked too.
            assert!(seen.aggregated > 0, "{trace}: {seen:?}");
        }
    }
    // Denials point at their retry_after; the burst tiers draw their activations.
    let (json, svg) = draw(
        &repo("examples/traces/burst-tiers.yaml"),
        &[&repo("examples/traces/burst-tiers-v1-v8.trace")],
        &["--width", "100000"],
    );
    let seen = check_drawing(&json, &svg);
    assert!(seen.retry_pointers >= 10, "{seen:?}");
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let v2 = doc
        .descendants()
        .find(|n| n.attribute("data-key") == Some("V2Penalty=v2"))
        .unwrap();
    // V2: tier 2 entered at 100.5 s (active 5 s, then cooling 15 s), and again at 120.51 s.
    let entries: Vec<(String, String)> = v2
        .descendants()
        .filter(|n| n.attribute("data-entry-us").is_some())
        .map(|n| (attr(n, "data-tier").into(), attr(n, "data-entry-us").into()))
        .collect();
    for expected in [("2", "100500000"), ("2", "120510000")] {
        assert!(
            entries.contains(&(expected.0.into(), expected.1.into())),
            "{entries:?}"
        );
    }
    let cooling = v2
        .descendants()
        .filter(|n| n.attribute("class") == Some("cooldown"))
        .count();
    assert!(cooling >= 2, "tier 2 cooled down twice");
}

#[test]
fn a_batch_refused_by_one_limit_shows_which() {
    let scratch = Scratch::new("batch");
    let defaults = scratch.path("limits.yaml");
    std::fs::write(
        &defaults,
        "Wide:\n  burst: 10\n  count: 10\n  period: 1s\nNarrow:\n  burst: 2\n  count: 1\n  period: 1s\n",
    )
    .unwrap();
    let trace = scratch.path("t.trace");
    std::fs::write(
        &trace,
        "0s spend Wide=a Narrow=a\n0.1s spend Wide=a Narrow=a\n0.2s spend Wide=a Narrow=a\n\
         0.3s spend Wide=a Narrow=a\n1.5s spend Wide=a Narrow=a\n",
    )
    .unwrap();
    let (json, svg) = draw(
        defaults.to_str().unwrap(),
        &[trace.to_str().unwrap()],
        &["--width", "20000"],
    );
    let seen = check_drawing(&json, &svg);
    assert_eq!(seen.blocked, 2, "{seen:?}");
    assert!(svg.contains(r#"data-refused-by="Narrow""#));
}

#[test]
fn a_hundred_thousand_requests_draw_into_a_bounded_file() {
    let scratch = Scratch::new("large");
    let html = scratch.path("large.html");
    let run = simulate(&[
        "--defaults",
        &repo("examples/traces/gcra-20-per-second.yaml"),
        "--generate",
        "poisson rate=10000/s for 10s",
        "--key",
        "NewFoosPerIPAddress=192.0.2.1",
        "--html",
        html.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(run.json.is_empty(), "--quiet prints no JSON");
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.len() < 3 << 20, "{} bytes", page.len());
    let svg = &page[page.find("<svg").unwrap()..page.find("</svg>").unwrap() + 6];
    let doc = roxmltree::Document::parse(svg).unwrap();
    let counted: f64 = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("agg"))
        .map(|n| num(n, "data-count"))
        .sum();
    let single = doc
        .descendants()
        .filter(|n| n.attribute("data-op").is_some())
        .count();
    let requests = counted as usize + single;
    // Poisson arrivals at a mean of 100,000 in 10 s.
    assert!((99_000..=101_000).contains(&requests), "{requests}");
    // 20 per second are allowed, and the aggregates say so.
    let allowed: f64 = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("agg"))
        .map(|n| num(n, "data-allowed"))
        .sum();
    assert!((200.0..=222.0).contains(&allowed), "{allowed}");
}

#[test]
fn many_buckets_draw_the_first_hundred_and_count_the_rest() {
    let scratch = Scratch::new("lanes");
    let trace = scratch.path("ids.trace");
    let lines: String = (0..150)
        .map(|i| {
            format!(
                "{i}ms spend NewFoosPerIPAddress=10.0.{}.{}\n",
                i / 100,
                i % 100
            )
        })
        .collect();
    std::fs::write(&trace, lines).unwrap();
    let (json, svg) = draw(
        &repo("examples/traces/gcra-20-per-second.yaml"),
        &[trace.to_str().unwrap()],
        &[],
    );
    assert_eq!(json.len(), 150, "every line is still decided and printed");
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let lanes = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("lane"))
        .count();
    assert_eq!(lanes, 100);
    assert!(
        svg.contains("and 50 decisions on buckets past the first 100, not drawn"),
        "the drawing says what it left out"
    );
}

fn at_us(run: &Run) -> Vec<u64> {
    run.json
        .iter()
        .map(|l| l["at_us"].as_u64().unwrap())
        .collect()
}

#[test]
fn generated_workloads_follow_the_grammar() {
    let gcra = repo("examples/traces/gcra-20-per-second.yaml");
    let run = simulate(&[
        "--defaults",
        &gcra,
        "--generate",
        "burst 3 at 1s, then 2/s for 2s; idle 1s, then burst 1 cost=2",
        "--key",
        "NewFoosPerIPAddress=192.0.2.1",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(
        at_us(&run),
        [
            1_000_000, 1_000_000, 1_000_000, 1_500_000, 2_000_000, 2_500_000, 3_000_000, 4_000_000
        ]
    );
    // The last request costs 2: the bucket (20 per second, full again) is left with 18.
    assert_eq!(run.json[7]["remaining"], 18);
    assert_eq!(run.json[6]["remaining"], 19);

    // Poisson arrivals: reproducible, about the rate asked for, different under another seed.
    let poisson = |phrase: &str| {
        simulate(&[
            "--defaults",
            &gcra,
            "--generate",
            phrase,
            "--key",
            "NewFoosPerIPAddress=192.0.2.1",
        ])
    };
    let a = at_us(&poisson("poisson rate=50/s for 10s"));
    let b = at_us(&poisson("poisson rate=50/s for 10s"));
    let c = at_us(&poisson("poisson rate=50/s for 10s seed=7"));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!((400..=600).contains(&a.len()), "{}", a.len());
    assert!(a.windows(2).all(|w| w[0] <= w[1]));
    assert!(a.iter().all(|&t| t <= 10_000_000));
    // Rates in other units and `at` for an absolute start.
    assert_eq!(
        at_us(&poisson("120/m for 1s at 10s, 1/250ms for 1s")),
        [
            10_500_000, 11_000_000, 11_250_000, 11_500_000, 11_750_000, 12_000_000
        ]
    );

    // Without --key: every limit of the defaults file, in one batch, with ids of its kind.
    let run = simulate(&["--defaults", &gcra, "--generate", "burst 1"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let names: Vec<&str> = run.json[0]["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["limit"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["NewFoosPerIPAddress", "NewOrdersPerAccount"]);
}

#[test]
fn bad_input_exits_2_with_a_located_message_and_leaves_no_file() {
    let scratch = Scratch::new("bad");
    let gcra = repo("examples/traces/gcra-20-per-second.yaml");
    let html = scratch.path("out.html");
    let html = html.to_str().unwrap();
    let bad_trace = scratch.path("bad.trace");
    std::fs::write(
        &bad_trace,
        "0s spend NewFoosPerIPAddress=192.0.2.1\n1s sprint X=1\n",
    )
    .unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--generate", "sometimes maybe"],
            r#"at column 1 ("sometimes"): unknown phase"#,
        ),
        (
            vec!["--generate", "poisson rate=-5/s for 10s"],
            r#"at column 9 ("rate=-5/s"): a rate must be positive"#,
        ),
        (
            vec!["--generate", "burst 30 at 0s, then -5/s for 20s"],
            r#"at column 22 ("-5/s"): a rate must be positive"#,
        ),
        (
            vec!["--generate", "burst 30 at 0s, then 5/s"],
            "the phase ends where `for <duration>` was expected",
        ),
        (
            vec!["--generate", "5/s for 0s"],
            r#"at column 9 ("0s"): the duration must be longer than 0"#,
        ),
        (
            vec!["--generate", "5/s for 10 s"],
            r#"at column 9 ("10"): time "10" needs a unit"#,
        ),
        (
            vec!["--generate", "burst 2000000"],
            "a generated trace holds at most 1000000",
        ),
        (
            vec!["--generate", "burst 1,"],
            "at column 9 (\"\"): an empty phase",
        ),
        (
            vec!["--generate", "burst 1 sometimes"],
            r#"at column 9 ("sometimes"): unexpected word"#,
        ),
        (
            vec!["--generate", "burst 1", "--key", "Nope=1"],
            r#"--key "Nope=1""#,
        ),
        (
            vec!["--key", "NewFoosPerIPAddress=1"],
            "--key only goes with --generate",
        ),
        (vec!["--width", "10"], "--width \"10\": a number of pixels"),
        (
            vec!["--redis", "redis://127.0.0.1:1", "--svg", "x.svg"],
            "draw from the in-memory backend",
        ),
        (
            vec!["--generate", "burst 1", "--svg", "/nonexistent-dir/out.svg"],
            "--svg /nonexistent-dir/out.svg: No such file or directory",
        ),
        (
            vec![bad_trace.to_str().unwrap()],
            "line 2: unknown operation",
        ),
    ];
    for (extra, message) in cases {
        let mut args = vec!["--defaults", gcra.as_str(), "--html", html];
        args.extend(extra.iter().copied());
        let run = simulate(&args);
        assert_eq!(run.code, Some(2), "{extra:?}: {}", run.stderr);
        assert!(
            run.stderr.starts_with("simulate: ") && run.stderr.contains(message),
            "{extra:?}: {}",
            run.stderr
        );
        assert!(!Path::new(html).exists(), "{extra:?} left {html}");
    }
}

// Ignored by default, so a run without a browser says so in its output ("ignored, needs
// Chromium..."); `bash scripts/test --with-browser` (what `.ci/run` runs) installs Chromium and
// runs it, and then a missing browser fails it rather than skipping it.
#[test]
#[ignore = "needs a headless Chromium: bash scripts/test --with-browser installs one and runs it"]
fn the_page_opens_in_a_real_browser_without_errors_or_network_requests() {
    let Some(binary) = browser::find() else {
        panic!(
            "no Chromium on this machine: apt-get install -y chromium (or bash scripts/test \
             --with-browser as root on Debian), or set TRL_CHROMIUM to a browser binary"
        );
    };
    let scratch = Scratch::new("browser");
    let html = scratch.path("page.html");
    let run = simulate(&[
        "--defaults",
        &repo("examples/traces/burst-tiers.yaml"),
        "--generate",
        "burst 30 at 0s, then 5/s for 20s",
        "--key",
        "V2Penalty=client",
        "--html",
        html.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let page = std::fs::read_to_string(&html).unwrap();
    // Self-contained: nothing to fetch.
    for reference in ["src=", "href=", "@import", "url(", "http://", "https://"] {
        let allowed = r#"xmlns="http://www.w3.org/2000/svg""#;
        assert!(
            !page.replace(allowed, "").contains(reference),
            "the page refers to something outside it: {reference}"
        );
    }

    let profile = scratch.path("profile");
    std::fs::create_dir_all(&profile).unwrap();
    let mut b = browser::Browser::start(&binary, &profile);
    let url = format!("file://{}", html.display());
    b.open(&url);
    let marks = b.eval("document.querySelectorAll('g[data-line]').length");
    assert!(marks.as_u64().unwrap() > 50, "{marks}");

    // Hovering a mark shows its numbers.
    let target = b.eval(
        "(() => { const c = document.querySelector('g[data-class=\"deny\"] path') \
         || document.querySelector('g[data-line] circle'); \
         c.scrollIntoView({block: 'center', inline: 'center'}); \
         const r = c.getBoundingClientRect(); \
         return {x: r.x + r.width / 2, y: r.y + r.height / 2, \
                 line: c.closest('g[data-line]').dataset.line}; })()",
    );
    b.call(
        "Input.dispatchMouseEvent",
        json!({"type": "mouseMoved", "x": target["x"], "y": target["y"]}),
    );
    let tip = b.eval(
        "(() => { const t = document.getElementById('tip'); return t.hidden ? '' : t.textContent; })()",
    );
    let line = target["line"].as_str().unwrap();
    let tip = tip.as_str().unwrap();
    assert!(tip.starts_with(&format!("line {line} at ")), "{tip:?}");
    assert!(tip.contains("retry_after"), "{tip:?}");

    let png = b.screenshot();
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut pixels).unwrap();
    let bytes = &pixels[..frame.buffer_size()];
    let channels = frame.color_type.samples();
    let mut colors = std::collections::HashSet::new();
    let mut inked = 0usize;
    for px in bytes.chunks(channels) {
        colors.insert(px[..3.min(channels)].to_vec());
        if px[..3.min(channels)].iter().any(|&v| v < 200) {
            inked += 1;
        }
    }
    let total = bytes.len() / channels;
    assert!(frame.width >= 1000 && frame.height >= 300, "{frame:?}");
    assert!(
        colors.len() > 20,
        "a blank screenshot: {} colors",
        colors.len()
    );
    assert!(inked * 100 > total, "{inked} of {total} pixels drawn");

    let errors = b.errors();
    assert!(errors.is_empty(), "{errors:#?}");
    let outside = b.outside_requests();
    assert!(outside.is_empty(), "network requests: {outside:?}");
    // The navigation itself is the one request seen: the Network domain does watch.
    assert!(b.requests().iter().any(|u| u == &url), "{:?}", b.requests());
}

/// A calendar quota is drawn as the units used against its count, with its
/// renewals marked, on an axis labelled in UTC dates from the first line (its lanes were "a
/// limit of another shape", dots on an axis of seconds since the trace's epoch).
#[test]
fn a_calendar_quota_is_drawn_as_units_used_with_its_renewals_on_a_dated_axis() {
    let (json, svg) = draw(
        &repo("examples/traces/calendar.yaml"),
        &[&repo("examples/traces/calendar.trace")],
        &[],
    );
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let lane = doc
        .descendants()
        .find(|n| {
            n.attribute("class") == Some("lane") && n.attribute("data-key") == Some("Monthly=a")
        })
        .expect("a lane for Monthly=a");
    assert_eq!(lane.attribute("data-kind"), Some("calendar"));
    let texts: Vec<&str> = lane.descendants().filter_map(|n| n.text()).collect();
    assert!(texts.contains(&"used (0..5)"), "{texts:?}");
    assert!(
        texts.contains(&"calendar: 5 per month, at 00:00 UTC"),
        "{texts:?}"
    );
    // The renewal of 2028-02-01, in trace time (microseconds since the trace's start).
    let renewal = tower_ratelimits::__private::parse_instant("2028-02-01T00:00:00Z").unwrap()
        - 1_700_000_000_000_000;
    let renewals: Vec<u64> = lane
        .descendants()
        .filter(|n| n.attribute("class") == Some("renewal"))
        .map(|n| attr(n, "data-renewal-us").parse().unwrap())
        .collect();
    assert!(renewals.contains(&renewal), "{renewals:?}");
    // The units used after the third request (3, then a range taking the 2 left, of 5): 5.
    let third = json[2]["line"].to_string();
    let used: Vec<f64> = lane
        .descendants()
        .filter(|n| {
            n.attribute("class") == Some("qp") && n.attribute("data-line") == Some(third.as_str())
        })
        .map(|n| num(n, "data-value"))
        .collect();
    assert_eq!(used, [5.0]);
    // Dated: the first tick is the first line's day, every label a date.
    let ticks: Vec<&str> = doc
        .descendants()
        .filter(|n| n.attribute("data-tick-us").is_some())
        .filter_map(|n| n.text())
        .collect();
    assert_eq!(ticks.first(), Some(&"2028-01-31"), "{ticks:?}");
    assert!(ticks.iter().all(|t| t.starts_with("2028-")), "{ticks:?}");
    // `at_us` of a dated line is its instant less the trace's start (2023-11-14T22:13:20Z).
    assert_eq!(json[0]["at_us"], renewal - 12 * 3_600_000_000);
}

/// A limit with a penalty ladder draws the key's level under its tokens and each ban behind
/// it, from the request that started it to its end, at its level; every decision is still in
/// the drawing with its numbers.
#[test]
fn a_penalty_ladder_is_drawn_as_the_key_s_level_with_its_bans() {
    let (json, svg) = draw(
        &repo("examples/traces/penalty.yaml"),
        &[&repo("examples/traces/penalty.trace")],
        &[],
    );
    check_drawing(&json, &svg);
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let lane = doc
        .descendants()
        .find(|n| {
            n.attribute("class") == Some("lane") && n.attribute("data-key") == Some("Login=7")
        })
        .expect("a lane for Login=7");
    let texts: Vec<&str> = lane.descendants().filter_map(|n| n.text()).collect();
    assert!(texts.contains(&"tokens (0..100)"), "{texts:?}");
    assert!(texts.contains(&"ban level (0..3)"), "{texts:?}");
    assert!(
        texts.contains(
            &"GCRA: burst 100, 100 per 1s · penalty: 3 within 60s, bans of 10s x2 up to 30s"
        ),
        "{texts:?}"
    );
    let bans: Vec<(u64, u64, u32)> = lane
        .descendants()
        .filter(|n| n.attribute("class") == Some("ban"))
        .map(|n| {
            (
                attr(n, "data-ban-start-us").parse().unwrap(),
                attr(n, "data-ban-end-us").parse().unwrap(),
                attr(n, "data-level").parse().unwrap(),
            )
        })
        .collect();
    let s = 1_000_000;
    assert_eq!(
        bans,
        [
            (s, 11 * s, 1),
            (11 * s, 31 * s, 2),
            (45 * s, 75 * s, 3),
            (155 * s, 185 * s, 3),
            (365 * s, 375 * s, 1)
        ]
    );
    // The level just after the third ban's request: 3.
    let third_ban = json.iter().find(|l| l["at_us"] == 45 * s).unwrap()["line"].to_string();
    let level: Vec<f64> = lane
        .descendants()
        .filter(|n| {
            n.attribute("class") == Some("qp")
                && n.attribute("data-line") == Some(third_ban.as_str())
                && n.attribute("data-series") == Some("1")
        })
        .map(|n| num(n, "data-value"))
        .collect();
    assert_eq!(level, [3.0]);
}
