//! How fast a plan replays a log, and in how much memory (`docs/replay.md`; BENCHMARKS.md,
//! "Replaying logs"; in the simulator's crate, since the benches' crate builds the library
//! without the feature `replay`, as a server does): a JSON-lines log of `--lines` requests from `--keys` clients (a skewed
//! choice: a tenth of the clients send half the requests), about 5,000 requests a second, three
//! rules (per address, per account, writes per address), through both policies, on one core.
//!
//! ```text
//! cargo bench -p tower-ratelimits-simulator --bench replay -- --lines 2000000 --keys 10000
//! ```
//!
//! It writes the log to a temporary file first (not timed), then times `LogReader` +
//! `Replay::run` (parsing, both layers, the plan) and prints lines a minute and the peak
//! resident memory (`VmHWM`) before and after.

use std::io::Write;
use std::time::{Duration, Instant};

use tower_ratelimits::{Limits, LogReader, Replay, RuleSet};

const RULES: &str = "\
rules:
  - {limit: PerIp, key: client_ip}
  - {limit: PerAccount, key: 'header:x-account'}
  - {limit: ApiWrites, key: client_ip, methods: [POST], path_prefix: /api}
";
const CURRENT: &str = "\
PerIp: {kind: ip, burst: 40, count: 20, period: 1s}
PerAccount: {kind: account, burst: 60, count: 30, period: 1s}
ApiWrites: {kind: ip, burst: 10, count: 1, period: 1s}
";
const CANDIDATE: &str = "\
PerIp: {kind: ip, burst: 20, count: 10, period: 1s}
PerAccount: {kind: account, burst: 30, count: 30, period: 1s}
ApiWrites: {kind: ip, burst: 5, count: 1, period: 1s}
";

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn write_log(path: &std::path::Path, lines: u64, keys: u64) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut t_us: u64 = 1_795_600_800_000_000;
    let hot = (keys / 10).max(1);
    for _ in 0..lines {
        t_us += rng.next() % 400;
        let r = rng.next();
        let key = if r.is_multiple_of(2) {
            r / 2 % hot
        } else {
            r / 2 % keys
        };
        let (s, us) = (t_us / 1_000_000 % 86_400, t_us % 1_000_000);
        let method = if rng.next().is_multiple_of(5) {
            "POST"
        } else {
            "GET"
        };
        writeln!(
            out,
            "{{\"time\":\"2026-11-25T{:02}:{:02}:{:02}.{us:06}Z\",\"ip\":\"10.{}.{}.{}\",\"method\":\"{method}\",\"path\":\"/api/orders\",\"headers\":{{\"x-account\":\"{}\"}},\"duration_ms\":12.5}}",
            s / 3600,
            s / 60 % 60,
            s % 60,
            key >> 16,
            key >> 8 & 255,
            key & 255,
            key % 3_000 + 1,
        )?;
    }
    out.flush()
}

fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut lines, mut keys) = (2_000_000u64, 10_000u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--lines" => lines = args.next().ok_or("--lines N")?.parse()?,
            "--keys" => keys = args.next().ok_or("--keys N")?.parse()?,
            // cargo bench passes --bench.
            _ => {}
        }
    }
    let path = std::env::temp_dir().join(format!("trl-replay-bench-{}.jsonl", std::process::id()));
    write_log(&path, lines, keys)?;
    let before = peak_kib();
    let rules = RuleSet::from_yaml_str(RULES)?;
    let reader = LogReader::open(&[&path], None, Duration::ZERO)?;
    let started = Instant::now();
    let plan = Replay::new(
        move |l| rules.layer(l),
        Limits::from_yaml_str(CURRENT, None)?,
        Limits::from_yaml_str(CANDIDATE, None)?,
    )
    .run(reader)?;
    let elapsed = started.elapsed();
    let _ = std::fs::remove_file(&path);
    println!(
        "replay: {} lines, {keys} keys: {:.2} s, {:.0} lines a minute; peak memory {} MiB before the replay, {} MiB after; allow->deny {}, deny->allow {}",
        plan.requests,
        elapsed.as_secs_f64(),
        plan.requests as f64 / elapsed.as_secs_f64() * 60.0,
        before / 1024,
        peak_kib() / 1024,
        plan.allow_to_deny,
        plan.deny_to_allow,
    );
    Ok(())
}
