//! `tower-ratelimits-simulate plan`: replays access logs through a current and a candidate
//! policy and says what would change (the library's `Replay`; `docs/replay.md`).
//!
//! ```text
//! tower-ratelimits-simulate plan --current A.yaml --candidate B.yaml --rules RULES.yaml
//!     [--candidate-rules RULES2.yaml] --log FILE [--log FILE ...] [--format json|combined]
//!     [--reorder 60s] [--strict] [--json OUT.json] [--html OUT.html] [--max-allow-to-deny N|P%]
//!     [--max-bad-lines N|P%] [--target 1%] [--snapshot FILE] [--max-attempts-per-day N]
//! tower-ratelimits-simulate plan snapshot --redis URL --limits A.yaml --out FILE
//!     [--prefix rl:] [--max-keys N]
//! ```
//!
//! The plan (JSON, `docs/replay.md` "The plan") goes to `--json FILE`, else to standard
//! output; a summary goes to standard error. Exit codes: 0; 1 when `--max-allow-to-deny` is
//! exceeded (the flips are listed on standard error), or when a candidate limit's penalty
//! ladder lets one key through more counted units a day than `--max-attempts-per-day` (the
//! limits are listed); 2 for bad input (an option, a file, a
//! configuration, with `--strict` a bad line, a log of which no line was replayed, or one with
//! more bad lines than `--max-bad-lines` lets through: a gate must not pass on nothing).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tower_ratelimits::{
    Limits, LogFormat, LogReader, Plan, Replay, RuleSet, Snapshot, SnapshotError,
};

pub(crate) const USAGE: &str = "usage: tower-ratelimits-simulate plan --current A.yaml --candidate B.yaml \
--rules RULES.yaml [--candidate-rules RULES2.yaml] --log FILE [--log FILE ...] \
[--format json|combined] [--reorder 60s] [--strict] [--json OUT.json] [--html OUT.html] \
[--max-allow-to-deny N|P%] [--max-bad-lines N|P%] [--target 1%] [--snapshot FILE] \
[--max-attempts-per-day N]\n       \
tower-ratelimits-simulate plan snapshot --redis URL --limits A.yaml --out FILE [--prefix rl:] \
[--max-keys N]";

/// The bad lines a replay lets through by default: 1% of the lines read.
const MAX_BAD_LINES: Bound = Bound::Share(0.01);

/// A bound on flips or bad lines: a count, or a share of the requests or lines.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    Count(u64),
    Share(f64),
}

impl Bound {
    fn limit(self, of: u64) -> u64 {
        match self {
            Bound::Count(n) => n,
            Bound::Share(s) => (s * of as f64).floor() as u64,
        }
    }
}

/// `N` or `P%`, the value of `option`.
fn bound(option: &str, text: &str) -> Result<Bound, String> {
    let bad = || format!("{option} {text:?}: a count (100) or a share (0.1%)");
    match text.strip_suffix('%') {
        Some(p) => percent(p).map(Bound::Share).ok_or_else(bad),
        None => text.parse().map(Bound::Count).map_err(|_| bad()),
    }
}

/// Whether `plan` replayed enough of its logs to stand for them: at least one request, and no
/// more bad lines than `most` of the lines read. A gate over nothing would pass.
fn replayed_enough(plan: &Plan, most: Bound) -> Result<(), String> {
    let lines = plan.requests + plan.bad_lines;
    let first = plan.bad_line_examples.first().map_or(String::new(), |b| {
        format!(
            "; the first: {}:{}: {} (is --format right?)",
            b.file, b.line, b.reason
        )
    });
    if plan.requests == 0 {
        return Err(if lines == 0 {
            "no request was replayed: the logs hold no line".to_owned()
        } else {
            format!("no request was replayed: all {lines} lines were bad{first}")
        });
    }
    let allowed = most.limit(lines);
    if plan.bad_lines > allowed {
        return Err(format!(
            "{} of {lines} lines were bad ({:.2}%), more than the {allowed} --max-bad-lines lets \
             through{first}",
            plan.bad_lines,
            plan.bad_lines as f64 * 100.0 / lines as f64
        ));
    }
    Ok(())
}

/// A percentage (`1`, `0.5`) as a share (0.01, 0.005), 0 to 100.
fn percent(text: &str) -> Option<f64> {
    text.parse::<f64>()
        .ok()
        .filter(|p| p.is_finite() && (0.0..=100.0).contains(p))
        .map(|p| p / 100.0)
}

struct Args {
    current: PathBuf,
    candidate: PathBuf,
    rules: PathBuf,
    candidate_rules: Option<PathBuf>,
    logs: Vec<PathBuf>,
    format: Option<LogFormat>,
    reorder: Duration,
    strict: bool,
    json: Option<PathBuf>,
    html: Option<PathBuf>,
    max_allow_to_deny: Option<Bound>,
    max_bad_lines: Bound,
    target: f64,
    snapshot: Option<PathBuf>,
    max_attempts_per_day: Option<u64>,
}

fn parse_args(args: impl Iterator<Item = std::ffi::OsString>) -> Result<Args, String> {
    let mut args = args;
    let (mut current, mut candidate, mut rules, mut candidate_rules) = (None, None, None, None);
    let (mut logs, mut format, mut reorder, mut strict) = (Vec::new(), None, Duration::ZERO, false);
    let (mut json, mut html, mut max, mut target) = (None, None, None, 0.01);
    let (mut snapshot, mut max_bad_lines, mut attempts) = (None, MAX_BAD_LINES, None);
    let text = crate::option_text;
    while let Some(arg) = args.next() {
        let Some(option) = arg.to_str() else {
            return Err(format!("unexpected argument {arg:?}"));
        };
        let path = |v: Option<std::ffi::OsString>| {
            v.map(PathBuf::from)
                .ok_or_else(|| format!("{option} needs a file"))
        };
        match option {
            "--current" => current = Some(path(args.next())?),
            "--candidate" => candidate = Some(path(args.next())?),
            "--rules" => rules = Some(path(args.next())?),
            "--candidate-rules" => candidate_rules = Some(path(args.next())?),
            "--log" => logs.push(path(args.next())?),
            "--json" => json = Some(path(args.next())?),
            "--html" => html = Some(path(args.next())?),
            "--format" => format = Some(text(option, args.next())?.parse::<LogFormat>()?),
            "--reorder" => {
                let t = text(option, args.next())?;
                let us = tower_ratelimits::__private::parse_duration_us(&t)
                    .map_err(|e| format!("--reorder {t:?}: {e}"))?;
                reorder = Duration::from_micros(us);
            }
            "--strict" => strict = true,
            "--max-allow-to-deny" => max = Some(bound(option, &text(option, args.next())?)?),
            "--max-bad-lines" => max_bad_lines = bound(option, &text(option, args.next())?)?,
            "--max-attempts-per-day" => {
                let t = text(option, args.next())?;
                let n = t
                    .parse()
                    .map_err(|_| format!("{option} {t:?}: a count (100)"))?;
                attempts = Some(n);
            }
            "--target" => {
                let t = text(option, args.next())?;
                target = t
                    .strip_suffix('%')
                    .and_then(percent)
                    .ok_or_else(|| format!("--target {t:?}: a share of keys (1%)"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            "--snapshot" => snapshot = Some(path(args.next())?),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if logs.is_empty() {
        return Err("--log is required (once per file)".into());
    }
    Ok(Args {
        current: current.ok_or("--current is required")?,
        candidate: candidate.ok_or("--candidate is required")?,
        rules: rules.ok_or("--rules is required")?,
        candidate_rules,
        logs,
        format,
        reorder,
        strict,
        json,
        html,
        max_allow_to_deny: max,
        max_bad_lines,
        target,
        snapshot,
        max_attempts_per_day: attempts,
    })
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    crate::bad_input("simulate plan", message)
}

/// Runs `plan` with the arguments after the word `plan`: read the arguments and make the
/// output files, replay, check that enough was replayed, write, gate.
pub(crate) fn cli(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    let mut args = args.peekable();
    if args.next_if(|w| w == "snapshot").is_some() {
        return crate::snapshot::cli(args);
    }
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(format!("{e}\n{USAGE}")),
    };
    let run = || -> Result<Plan, String> {
        // Output files are made first: an unwritable path fails before the replay.
        let create = |flag, path: &Option<PathBuf>| {
            path.as_deref()
                .map(|p| crate::Output::create(flag, p))
                .transpose()
        };
        let (json, html) = (create("--json", &args.json)?, create("--html", &args.html)?);
        let loaded = Loaded::read(&args)?;
        let plan = loaded.replay(&args)?;
        if let Err(e) = replayed_enough(&plan, args.max_bad_lines) {
            eprintln!("{}", summary(&plan));
            return Err(e);
        }
        if let Some(out) = html {
            out.write(&loaded.page(&plan, &args)?)?;
        }
        let text =
            serde_json::to_string_pretty(&plan).map_err(|e| format!("writing the plan: {e}"))?;
        match json {
            Some(out) => out.write(&text)?,
            None => println!("{text}"),
        }
        eprintln!("{}", summary(&plan));
        Ok(plan)
    };
    match run() {
        Ok(plan) => {
            let flips = gate(&plan, args.max_allow_to_deny);
            let attempts = gate_attempts(&plan, args.max_attempts_per_day);
            if flips == ExitCode::SUCCESS {
                attempts
            } else {
                flips
            }
        }
        Err(e) => fail(e),
    }
}

/// Exit 1 when a candidate limit's penalty ladder lets one key through more counted units a
/// day than `--max-attempts-per-day`, naming each such limit.
fn gate_attempts(plan: &Plan, most: Option<u64>) -> ExitCode {
    let Some(most) = most else {
        return ExitCode::SUCCESS;
    };
    let over: Vec<_> = plan
        .penalties
        .iter()
        .filter_map(|(name, p)| Some((name, p.candidate?)))
        .filter(|(_, day)| day.most > most)
        .collect();
    if over.is_empty() {
        return ExitCode::SUCCESS;
    }
    for (name, day) in over {
        eprintln!(
            "simulate plan: {name} lets one key through {}{} counted a day, more than the {most} allowed (--max-attempts-per-day)",
            if day.exact { "" } else { "at most " },
            day.most
        );
    }
    ExitCode::from(1)
}

/// Exit 1 when more requests let through today would be denied than `--max-allow-to-deny`
/// lets through, naming them.
fn gate(plan: &Plan, max_allow_to_deny: Option<Bound>) -> ExitCode {
    let Some(bound) = max_allow_to_deny else {
        return ExitCode::SUCCESS;
    };
    let most = bound.limit(plan.requests);
    if plan.allow_to_deny <= most {
        return ExitCode::SUCCESS;
    }
    eprintln!(
        "simulate plan: {} requests let through today would be denied, more than the {most} allowed (--max-allow-to-deny):",
        plan.allow_to_deny
    );
    for flip in plan.flips.iter().filter(|f| f.kind == "allow_to_deny") {
        eprintln!(
            "  {} {} {} {} denied by {}",
            flip.time,
            flip.ip,
            flip.method,
            flip.path,
            flip.limits.join(", ")
        );
    }
    ExitCode::from(1)
}

/// The policies and rules, read once.
struct Loaded {
    current: Limits,
    candidate: Limits,
    rules: RuleSet,
    candidate_rules: RuleSet,
    snapshot: Option<Snapshot>,
}

impl Loaded {
    /// The HTML page of `plan`: the logs read again, the most-flipped keys drawn.
    fn page(&self, plan: &Plan, args: &Args) -> Result<String, String> {
        crate::plan_page::page(
            plan,
            crate::plan_page::Inputs {
                current: &self.current,
                candidate: &self.candidate,
                rules: &self.rules,
                candidate_rules: &self.candidate_rules,
                reader: open_logs(args)?,
                title: format!("{} -> {}", args.current.display(), args.candidate.display()),
            },
        )
    }

    fn read(args: &Args) -> Result<Loaded, String> {
        let rules = RuleSet::from_yaml_file(&args.rules).map_err(|e| e.to_string())?;
        Ok(Loaded {
            current: Limits::from_yaml_file(&args.current).map_err(|e| e.to_string())?,
            candidate: Limits::from_yaml_file(&args.candidate).map_err(|e| e.to_string())?,
            candidate_rules: match &args.candidate_rules {
                Some(p) => RuleSet::from_yaml_file(p).map_err(|e| e.to_string())?,
                None => rules.clone(),
            },
            rules,
            snapshot: match &args.snapshot {
                Some(p) => Some(
                    std::fs::File::open(p)
                        .map_err(SnapshotError::from)
                        .and_then(|f| Snapshot::read(std::io::BufReader::new(f)))
                        .map_err(|e| format!("--snapshot {}: {e}", p.display()))?,
                ),
                None => None,
            },
        })
    }

    fn replay(&self, args: &Args) -> Result<Plan, String> {
        let reader = open_logs(args)?;
        let (rules, candidate_rules) = (self.rules.clone(), self.candidate_rules.clone());
        let mut replay = Replay::new(
            move |l| rules.layer(l),
            self.current.clone(),
            self.candidate.clone(),
        )
        .candidate_layer(move |l| candidate_rules.layer(l))
        .strict(args.strict)
        .target(args.target);
        if let Some(snapshot) = &self.snapshot {
            replay = replay.snapshot(snapshot.clone());
        }
        replay.run(reader).map_err(|e| e.to_string())
    }
}

fn summary(plan: &Plan) -> String {
    let side = |c: &tower_ratelimits::Counts| {
        format!(
            "{} allowed, {} denied, {} rejected, {} exempt",
            c.allowed, c.denied, c.rejected, c.exempt
        )
    };
    let warm = plan.warm.as_ref().map_or(String::new(), |w| {
        format!(
            "\n  warm from {}: {} keys (current {} seeded, candidate {}), {} lines before it",
            w.instant, w.keys, w.current_seeded, w.candidate_seeded, w.lines_before
        )
    });
    let per_day = |day: Option<tower_ratelimits::PerDay>| {
        day.map_or("no ladder".to_owned(), |d| {
            format!("at most {} a key a day", d.most)
        })
    };
    let penalties: String = plan
        .penalties
        .iter()
        .map(|(name, p)| {
            format!(
                "\n  {name}: candidate {}, current {}",
                per_day(p.candidate),
                per_day(p.current)
            )
        })
        .collect();
    let streams = plan.streams.as_ref().map_or(String::new(), streams_summary);
    let not_replayed: String = plan
        .not_replayed
        .keys()
        .map(|name| {
            format!("\n  {name}: not replayed (counted per message; the log has no stream lines)")
        })
        .collect();
    format!(
        "{} requests ({} bad lines, {} late)\n  current:   {}\n  candidate: {}\n  allow -> deny: {}, deny -> allow: {}{streams}{not_replayed}{warm}{penalties}",
        plan.requests,
        plan.bad_lines,
        plan.late_lines,
        side(&plan.current),
        side(&plan.candidate),
        plan.allow_to_deny,
        plan.deny_to_allow
    )
}

/// The streams' lines of the summary: their messages under each policy, their flips, and the
/// approximation when a stream was replayed from its totals.
fn streams_summary(s: &tower_ratelimits::StreamsPlan) -> String {
    let side = |c: &tower_ratelimits::MessageCounts| {
        format!(
            "{} passed, {} held, {} refused, {} unopened",
            c.passed, c.held, c.refused, c.unopened
        )
    };
    let approximate = match s.approximate {
        0 => String::new(),
        n => format!(" ({n} from their totals: approximate)"),
    };
    format!(
        "\n{} streams{approximate}, {} messages ({} outside an open stream)\n  current:   {}\n  candidate: {}\n  pass -> refuse: {}, refuse -> pass: {}",
        s.streams,
        s.messages,
        s.outside,
        side(&s.current),
        side(&s.candidate),
        s.pass_to_refuse,
        s.refuse_to_pass
    )
}

/// The logs of `--log`, each plain or gzip by its first bytes (RFC 1952's `1f 8b`).
fn open_logs(args: &Args) -> Result<LogReader, String> {
    fn plain_or_gzip(file: std::fs::File) -> Box<dyn std::io::Read + Send> {
        use std::io::BufRead as _;
        let mut buffered = std::io::BufReader::with_capacity(64 << 10, file);
        if buffered
            .fill_buf()
            .is_ok_and(|b| b.starts_with(&[0x1f, 0x8b]))
        {
            Box::new(flate2::bufread::MultiGzDecoder::new(buffered))
        } else {
            Box::new(buffered)
        }
    }
    LogReader::open_with(&args.logs, args.format, args.reorder, plain_or_gzip)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_targets_read_counts_and_shares() {
        assert_eq!(bound("--max-bad-lines", "100"), Ok(Bound::Count(100)));
        assert_eq!(bound("--max-bad-lines", "0.1%"), Ok(Bound::Share(0.001)));
        assert_eq!(Bound::Share(0.001).limit(12_345), 12);
        for bad in ["-1", "x", "101%", "NaN%", ""] {
            let e = bound("--max-bad-lines", bad).unwrap_err();
            assert!(e.starts_with("--max-bad-lines"), "{bad}: {e}");
        }
        assert_eq!(percent("1"), Some(0.01));
    }
}
