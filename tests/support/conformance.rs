//! The conformance traces (the example traces and pseudo-random ones mixing every shape, op and
//! mode) and how a store's output is held to memory's. Included by the tests that run them
//! (`#[path]`), next to `mod simulate` (the simulator's trace runner).

use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

use crate::simulate;
#[cfg(feature = "redis")]
use crate::support::redis::unique_prefix;
#[cfg(feature = "redis")]
use crate::support::redis_backend::caller_time_backend;

pub const CONFORMANCE_LIMITS: &str = "\
Fast:
  burst: 5
  count: 5
  period: 1s
Slow:
  burst: 3
  count: 1
  period: 2s
Big:
  burst: 100
  count: 60
  period: 1m
TierA:
  tiers:
    - {limit: 3, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 5, window: 2s, active: 1s, cooldown: 2s}
# A calendar quota renewing 40 s after the traces' start (22:13:20 UTC), mid-trace.
Quota6:
  calendar: {count: 6, period: day, at: '22:14'}
TierB:
  tiers:
    - {limit: 2, window: 500ms, active: 2s, cooldown: 1s}
    - {limit: 2, window: 1s, active: 1s, cooldown: 0s}
    - {limit: 3, window: 3s, active: 2s, cooldown: 1s}
";

/// The limits of the conformance traces: those of the example traces
/// (`examples/traces/gcra-20-per-second.yaml`, `examples/traces/burst-tiers.yaml`) plus
/// `examples/traces/partial-grants.yaml`, `examples/traces/concurrency.yaml`,
/// `examples/traces/debt.yaml`, `examples/traces/calendar.yaml`, `examples/traces/fair-share.yaml` (with its overrides),
/// `examples/traces/adaptive.yaml`, `examples/traces/penalty.yaml`,
/// `examples/traces/streams.yaml` and `CONFORMANCE_LIMITS`.
pub fn conformance_limits() -> Limits {
    let dir =
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("examples/traces");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
    let (gcra, tiers) = (read("gcra-20-per-second.yaml"), read("burst-tiers.yaml"));
    let partial = read("partial-grants.yaml");
    let concurrency = read("concurrency.yaml");
    let debt = read("debt.yaml");
    let calendar = read("calendar.yaml");
    let fair = read("fair-share.yaml");
    let adaptive = read("adaptive.yaml");
    let penalty = read("penalty.yaml");
    let streams = read("streams.yaml");
    Limits::from_yaml_str(
        &format!(
            "{gcra}\n{tiers}\n{partial}\n{concurrency}\n{debt}\n{calendar}\n{fair}\n{adaptive}\n{penalty}\n{streams}\n{CONFORMANCE_LIMITS}"
        ),
        Some(&read("fair-share-overrides.yaml")),
    )
    .unwrap()
}

/// A deterministic pseudo-random trace: batches of 1 to 3 limits (GCRA, tiered, concurrency
/// and a calendar quota renewing mid-trace, mixed), all modes, costs from 0 to the burst and ranges (partial grants, GCRA
/// and tiered), checks, refunds, charges (up to three bursts: into debt and beyond it), resets
/// and releases of slots, and time steps from 0 to 700 ms.
pub fn random_trace(seed: u64, lines: usize) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let limits = [
        ("Fast", 5u64),
        ("TierA", 8),
        ("Slow", 3),
        ("TierB", 7),
        ("Big", 100),
        ("InFlight2", 1),
        ("Quota6", 6),
        ("Shared", 4),
    ];
    let ids = ["u1", "u2", "a{b}", "x%7By", "gold"];
    let mut t_ms = 0u64;
    let mut out = String::new();
    for _ in 0..lines {
        t_ms += [0, 0, 1, 50, 100, 300, 700][next(7) as usize];
        let op = match next(22) {
            0..=12 => "spend",
            13..=15 => "check",
            16..=17 => "refund",
            18 => "release",
            19..=20 => "charge",
            _ => "reset",
        };
        out.push_str(&format!("{t_ms}ms {op}"));
        let first = next(limits.len() as u64) as usize;
        let mut count = 1 + next(3) as usize;
        if op == "charge" {
            // One key: a slot charged on a concurrency limit, units elsewhere.
            count = 1;
        }
        for k in 0..count {
            let (name, burst) = limits[(first + k) % limits.len()];
            let id = ids[next(ids.len() as u64) as usize];
            let mode = if op == "spend" {
                ["", "", "", "check-only:", "spend-only:"][next(5) as usize]
            } else {
                ""
            };
            out.push_str(&format!(" {mode}{name}={id}"));
            // A concurrency limit takes a cost of 0 or 1, never a range.
            if name == "InFlight2" && op != "reset" && op != "release" && next(2) == 0 {
                out.push_str(&format!("*{}", next(2)));
            } else if op == "charge" && name == "InFlight2" {
                // A slot (or a probe), taken even when none is free.
                out.push_str(&format!("*{}", next(2)));
            } else if op == "charge" {
                // Tiers and a fair share take a charge up to their capacity (the burst), and
                // refuse one above it.
                let most = if name.starts_with("Tier") || name == "Shared" {
                    burst
                } else {
                    3 * burst
                };
                out.push_str(&format!("*{}", next(most + 1)));
            } else if op != "reset" && op != "release" && name != "InFlight2" && next(2) == 0 {
                let cost = match next(4) {
                    0 => 0,
                    1 => burst,
                    _ => 1 + next(burst.min(4)),
                };
                if op != "refund" && next(2) == 0 {
                    let max = cost + next(4);
                    out.push_str(&format!("*{cost}..{max}"));
                } else {
                    out.push_str(&format!("*{cost}"));
                }
            }
        }
        out.push('\n');
    }
    out
}

pub async fn simulate_with(limiter: &Limiter, clock: &ManualClock, trace: &str) -> String {
    let mut out = Vec::new();
    simulate::run(limiter, clock, trace.as_bytes(), &mut out)
        .await
        .unwrap();
    String::from_utf8(out).unwrap()
}

pub async fn simulate_memory(trace: &str) -> String {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limits = conformance_limits();
    let limiter = Limiter::new(
        limits,
        MemoryBackend::builder().clock(clock.clone()).build(),
    );
    simulate_with(&limiter, &clock, trace).await
}

#[cfg(feature = "redis")]
pub async fn simulate_redis(url: &str, trace: &str, cache: bool) -> String {
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limits = conformance_limits();
    let backend = caller_time_backend(url, &unique_prefix("conf"), &clock, cache).await;
    let limiter = Limiter::new(limits, backend);
    simulate_with(&limiter, &clock, trace).await
}

pub fn traces() -> Vec<(String, String)> {
    let dir =
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("examples/traces");
    let mut traces: Vec<(String, String)> = [
        "gcra-worked-examples",
        "burst-tiers-v1-v8",
        "partial-grants",
        "concurrency",
        "debt",
        "calendar",
        "fair-share",
        "adaptive",
        "penalty",
        "streams",
    ]
    .iter()
    .map(|name| {
        let text = std::fs::read_to_string(dir.join(format!("{name}.trace"))).unwrap();
        ((*name).to_owned(), text)
    })
    .collect();
    for seed in 0..6 {
        traces.push((format!("random seed {seed}"), random_trace(seed, 250)));
    }
    traces
}

/// Every trace through memory and through `store` (`cached`: the store answers some denials
/// from a local deny cache, which may skip what a denied batch never needed), output for
/// output.
pub async fn conformance<F, Fut>(label: &str, cached: bool, store: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = String>,
{
    for (name, trace) in traces() {
        let memory = simulate_memory(&trace).await;
        assert!(
            memory.contains(r#""allowed":false"#),
            "{name}: the trace never denies"
        );
        let other = store(trace.clone()).await;
        if cached {
            same_decisions_but_skipped(&name, &trace, &memory, &other);
            continue;
        }
        if other != memory {
            let (line, (m, o)) = memory
                .lines()
                .zip(other.lines())
                .enumerate()
                .find(|(_, (m, o))| m != o)
                .unwrap();
            panic!(
                "{name} ({label}): line {} differs\n trace: {}\nmemory: {m}\n {label}: {o}",
                line + 1,
                trace.lines().nth(line).unwrap_or("")
            );
        }
    }
}

/// Every trace through a Redis backend at `url`, with the deny cache (the same decisions, but
/// for what a denied batch skipped) and without it (identical output).
#[cfg(feature = "redis")]
pub async fn conformance_redis(url: &str) {
    for cache in [false, true] {
        let label = if cache { "redis, deny cache" } else { "redis" };
        conformance(label, cache, |trace| async move {
            simulate_redis(url, &trace, cache).await
        })
        .await;
    }
}

/// `with_cache` (simulator output through the deny cache) against `exact` (memory, or Redis
/// without the cache), line by line: the same batch verdict on every line; every evaluated
/// decision identical; a decision is skipped only on a denied line, with zero numbers; and a
/// line with skipped decisions never reports a longer `retry_after` than the exact one (the
/// remembered denial is one of the exact line's denials, and the exact line reports the
/// longest). Lines without skips are byte-identical.
pub fn same_decisions_but_skipped(name: &str, trace: &str, exact: &str, with_cache: &str) {
    assert_eq!(exact.lines().count(), with_cache.lines().count(), "{name}");
    for (n, (e, c)) in exact.lines().zip(with_cache.lines()).enumerate() {
        let context = || {
            format!(
                "{name}, line {}: {}\nexact: {e}\ncache: {c}",
                n + 1,
                trace.lines().nth(n).unwrap_or("")
            )
        };
        if !c.contains(r#""skipped":true"#) {
            assert_eq!(e, c, "{}", context());
            continue;
        }
        let e: serde_json::Value = serde_json::from_str(e).unwrap();
        let c: serde_json::Value = serde_json::from_str(c).unwrap();
        assert_eq!(c["allowed"], false, "{}", context());
        assert_eq!(e["allowed"], false, "{}", context());
        assert!(
            c["retry_after_us"].as_u64().unwrap() <= e["retry_after_us"].as_u64().unwrap(),
            "{}",
            context()
        );
        let (ed, cd) = (
            e["decisions"].as_array().unwrap(),
            c["decisions"].as_array().unwrap(),
        );
        assert_eq!(ed.len(), cd.len(), "{}", context());
        for (ed, cd) in ed.iter().zip(cd) {
            if cd["skipped"] == true {
                assert_eq!(cd["allowed"], false, "{}", context());
                assert_eq!(cd["remaining"], 0, "{}", context());
                assert_eq!(cd["retry_after_us"], 0, "{}", context());
            } else {
                assert_eq!(ed, cd, "{}", context());
            }
        }
    }
}
