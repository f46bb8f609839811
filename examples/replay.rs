//! Trying a tighter policy on recorded traffic before deploying it, from code: the layer is
//! built by the same function a server would use, and the replay says which requests and
//! keys the candidate would refuse (`docs/replay.md`).
//!
//! ```text
//! cargo run --example replay --features replay -- [LOG ...]
//! ```
//!
//! With no LOG it replays the plain logs of `examples/logs/` when run from the repository (a
//! gzip one would need a decompressor: `LogReader::open_with`), else a
//! minute of traffic it writes itself. Prints the counts, the flips, the keys with most flips
//! and each limit's suggestion.

use std::time::Duration;

use tower_ratelimits::{
    ClientIp, Header, LayerError, Limiter, Limits, LogReader, OnMissingKey, RateLimitLayer, Replay,
    Rule,
};

/// The layer a server deploys (its rules and settings): the replay builds it as the server
/// does, on each policy's limits.
fn layer(limiter: Limiter) -> Result<RateLimitLayer, LayerError> {
    RateLimitLayer::builder(limiter)
        .rule(Rule::new("PerIp", ClientIp::new()))
        .rule(
            Rule::new("PerAccount", Header::new("x-account"))
                .for_path_prefix("/api")
                .on_missing_key(OnMissingKey::Skip),
        )
        .build()
}

const CURRENT: &str = "\
PerIp: {kind: ip, burst: 40, count: 20, period: 1s}
PerAccount: {kind: account, burst: 60, count: 30, period: 1s}
";
const CANDIDATE: &str = "\
PerIp: {kind: ip, burst: 20, count: 10, period: 1s}
PerAccount: {kind: account, burst: 30, count: 30, period: 1s}
";

/// A minute of traffic: forty clients, client `c` sending `c` requests a second, evenly.
fn a_minute() -> String {
    let mut lines: Vec<(u64, String)> = Vec::new();
    for c in 1..=40u64 {
        for k in 0..60 * c {
            let us = k * 1_000_000 / c + c;
            lines.push((
                us,
                format!(
                    "{{\"time\":\"2026-11-25T10:00:{:02}.{:06}Z\",\"ip\":\"192.0.2.{c}\",\"path\":\"/api/items\",\"headers\":{{\"x-account\":\"{}\"}}}}\n",
                    us / 1_000_000,
                    us % 1_000_000,
                    c % 7 + 1
                ),
            ));
        }
    }
    lines.sort();
    lines.into_iter().map(|(_, line)| line).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut logs: Vec<String> = std::env::args().skip(1).collect();
    if logs.is_empty() {
        let shipped = ["examples/logs/edge-a.jsonl", "examples/logs/edge-c.log"];
        if shipped.iter().all(|p| std::path::Path::new(p).exists()) {
            logs = shipped.iter().map(|p| p.to_string()).collect();
        }
    }
    let reader = if logs.is_empty() {
        println!("replaying a minute of traffic of forty clients (give LOG files to replay yours)");
        LogReader::from_readers(
            vec![(
                "generated".into(),
                Box::new(std::io::Cursor::new(a_minute())),
            )],
            None,
            Duration::ZERO,
        )
    } else {
        println!("replaying {}", logs.join(", "));
        LogReader::open(&logs, None, Duration::from_secs(10))?
    };
    let plan = Replay::new(
        layer,
        Limits::from_yaml_str(CURRENT, None)?,
        Limits::from_yaml_str(CANDIDATE, None)?,
    )
    .run(reader)?;
    println!(
        "{} requests ({} bad lines): today {} allowed, {} denied; the candidate {} allowed, {} denied",
        plan.requests,
        plan.bad_lines,
        plan.current.allowed,
        plan.current.denied,
        plan.candidate.allowed,
        plan.candidate.denied
    );
    println!(
        "allowed today, denied by the candidate: {}; denied today, allowed: {}",
        plan.allow_to_deny, plan.deny_to_allow
    );
    for key in plan.top_keys.iter().take(5) {
        println!(
            "  {}={}: {} would be refused, {} let through",
            key.limit, key.id, key.allow_to_deny, key.deny_to_allow
        );
    }
    for (name, limit) in &plan.limits {
        if let Some(s) = &limit.suggested {
            println!(
                "{name}: for {:.0}% of keys or fewer to see a refusal, a burst of {} at {} per {}, or {} per {} at a burst of {}",
                s.target * 100.0,
                s.burst,
                s.candidate_count,
                s.period,
                s.count
                    .map_or("more than 64 times".to_owned(), |c| c.to_string()),
                s.period,
                s.candidate_burst
            );
        }
    }
    Ok(())
}
