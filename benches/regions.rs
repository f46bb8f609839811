//! One limit across regions on real stores (`BENCHMARKS.md`, "One limit across regions"): a
//! `redis-server` per region and one for the global store, behind a proxy holding every chunk
//! `--delay-ms` (40) each way with up to `--jitter-ms` (10) more, one regional limiter per region
//! (rebalancing every second), and one key of a limit of `--rate` (100) a second, burst the same,
//! marked `across_regions` (floors 10%). The arrivals: 1.5 times the limit, split 95/5 between
//! `--regions` (2, or 3: 90/5/5) for `--seconds` (15), then 5/95 (5/5/90) for as long, the busy
//! region first the first, then the last. Printed: the overshoot (requests
//! over the envelope in the worst window of the union of every region's admitted decisions, a
//! request counting in a window only if it was sent and answered inside it), the utilization
//! from three periods after each shift against one central GCRA on the same arrivals, the
//! convergence after the shift (periods until the busy region's part reaches 90% of the part it
//! ends with), and the commands the global store ran, per region and second.
//!
//! `cargo bench -p tower-ratelimits-benches --bench regions -- [--regions 2] [--seconds 15] [--rate 100] [--delay-ms 40] [--jitter-ms 10]`

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_ratelimits::__private::gcra;
use tower_ratelimits::{Id, Limit, Limiter, Limits, RedisBackend, Transaction};

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use redis_support::RedisServer;

/// One request: its region, when it was sent and answered (µs from the start), admitted.
#[derive(Clone, Copy)]
struct Sample {
    sent: u64,
    answered: u64,
    allowed: bool,
}

/// The most admitted requests over the envelope `burst + rate * (b - a) / 1 s` in any window
/// `[a, b]` (a request counts only if sent and answered inside it).
fn overshoot(admitted: &[Sample], burst: u64, rate: u64) -> f64 {
    let mut by_sent: Vec<Sample> = admitted.to_vec();
    by_sent.sort_by_key(|s| s.sent);
    let mut worst = f64::MIN;
    for (i, first) in by_sent.iter().enumerate() {
        let a = first.sent;
        // Those sent at a or later, by their answer.
        let mut answers: Vec<u64> = by_sent[i..].iter().map(|s| s.answered).collect();
        answers.sort_unstable();
        for (count, &b) in answers.iter().enumerate() {
            let bound = burst as f64 + rate as f64 * (b.saturating_sub(a)) as f64 / 1e6;
            worst = worst.max((count + 1) as f64 - bound);
        }
    }
    worst
}

/// What one central GCRA of `limit` admits of `arrivals` (µs, sorted) within `[from, to)`.
fn central(limit: &Limit, arrivals: &[u64], from: u64, to: u64) -> u64 {
    let base = 1_700_000_000_000_000;
    let mut tat = None;
    let mut admitted = 0;
    for &t in arrivals {
        let out = gcra::check(limit, tat, base + t, 1).unwrap();
        if out.allowed {
            tat = out.new_tat.or(tat);
            if (from..to).contains(&t) {
                admitted += 1;
            }
        }
    }
    admitted
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str, default: u64| {
        common::arg(&args, flag).map_or(default, |s| s.parse().expect("a number"))
    };
    let seconds = arg("--seconds", 15);
    let rate = arg("--rate", 100);
    let delay = Duration::from_millis(arg("--delay-ms", 40));
    let jitter = Duration::from_millis(arg("--jitter-ms", 10));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let n = arg("--regions", 2).clamp(2, 3) as usize;
    let regions = &["eu", "us", "ap"][..n];
    let servers: Vec<RedisServer> = regions.iter().map(|_| RedisServer::start()).collect();
    let global = RedisServer::start();
    let proxy = common::delaying_proxy(format!("127.0.0.1:{}", global.port), delay, jitter);
    let yaml = format!(
        "Api: {{kind: any, burst: {rate}, count: {rate}, period: 1s, across_regions: true}}\n"
    );
    let limits = Limits::from_yaml_str(&yaml, None).unwrap();
    let limit = Limit::from_micros(rate, rate, 1_000_000).unwrap();
    runtime.block_on(async {
        let mut limiters = Vec::new();
        for (region, server) in regions.iter().zip(&servers) {
            let global = RedisBackend::from_url(format!("redis://127.0.0.1:{proxy}"))
                .prefix("g:")
                .connect()
                .await
                .unwrap();
            let backend = RedisBackend::from_url(server.url())
                .deny_cache(false)
                .regional(*region, global)
                .connect()
                .await
                .unwrap();
            limiters.push(Limiter::new(limits.clone(), backend));
        }
        let key = limiters[0].key("Api", Id::new("k").unwrap()).unwrap();
        // Until every region's registration is confirmed.
        let waited = Instant::now();
        loop {
            let mut all = true;
            for l in &limiters {
                let seen = l.inspect(&key).await.unwrap();
                all &= seen.region_share.is_some_and(|s| s.confirmed);
            }
            if all {
                break;
            }
            assert!(waited.elapsed() < Duration::from_secs(60), "never confirmed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("confirmed after {:.1} s", waited.elapsed().as_secs_f64());
        let start = Instant::now();
        let us = move || start.elapsed().as_micros() as u64;
        let phase = seconds * 1_000_000;
        let samples: Arc<Mutex<Vec<(usize, Sample)>>> = Arc::default();
        let parts: Arc<Mutex<Vec<(u64, usize, u64)>>> = Arc::default();
        // Arrivals: 1.5 x the limit, 95/5 then 5/95.
        let mut tasks = Vec::new();
        for (r, limiter) in limiters.iter().enumerate() {
            let (limiter, key, samples) = (limiter.clone(), key.clone(), samples.clone());
            tasks.push(tokio::spawn(async move {
                let mut next = 0u64;
                loop {
                    let now = us();
                    if now >= 2 * phase {
                        return;
                    }
                    let busy = if now < phase { 0 } else { n - 1 };
                    let share = if r == busy { 100 - 5 * (n as u64 - 1) } else { 5 };
                    let gap = 100 * 1_000_000 / (rate * 3 / 2 * share);
                    next = next.max(now) + gap;
                    let limiter = limiter.clone();
                    let key = key.clone();
                    let samples = samples.clone();
                    tokio::spawn(async move {
                        let sent = us();
                        let d = limiter.spend(&[Transaction::new(key)]).await.unwrap();
                        let answered = us();
                        samples.lock().unwrap().push((
                            r,
                            Sample {
                                sent,
                                answered,
                                allowed: d.allowed(),
                            },
                        ));
                    });
                    tokio::time::sleep(Duration::from_micros(next.saturating_sub(us()))).await;
                }
            }));
        }
        // The parts, every 100 ms.
        {
            let (limiters, key, parts) = (limiters.clone(), key.clone(), parts.clone());
            tasks.push(tokio::spawn(async move {
                while us() < 2 * phase {
                    for (r, l) in limiters.iter().enumerate() {
                        if let Ok(seen) = l.inspect(&key).await
                            && let Some(s) = seen.region_share
                        {
                            parts.lock().unwrap().push((us(), r, s.part.0));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let samples = samples.lock().unwrap().clone();
        let admitted: Vec<Sample> = samples.iter().filter(|(_, s)| s.allowed).map(|(_, s)| *s).collect();
        let over = overshoot(&admitted, rate, rate);
        let mut arrivals: Vec<u64> = samples.iter().map(|(_, s)| s.sent).collect();
        arrivals.sort_unstable();
        println!("One limit across regions: {rate}/s, burst {rate}, floors 10%, {n} regions, global store behind {delay:?} + up to {jitter:?} each way, 1 key");
        println!();
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| requests sent / admitted | {} / {} |", samples.len(), admitted.len());
        println!("| overshoot: most admitted over the envelope in any window | {:.2} |", over.max(0.0));
        for (name, from, to) in [("first", 3_000_000, phase), ("second", phase + 3_000_000, 2 * phase)] {
            let ours = admitted.iter().filter(|s| (from..to).contains(&s.sent)).count();
            let one = central(&limit, &arrivals, from, to);
            println!(
                "| utilization, {name} phase, from 3 periods after its start: ours / one central GCRA | {ours} / {one} = {:.1}% |",
                100.0 * ours as f64 / one as f64
            );
        }
        // Convergence: after the shift, the first sample where the newly busy region's part
        // reaches 90% of its last.
        let parts = parts.lock().unwrap().clone();
        let last_us = parts.iter().rev().find(|p| p.1 == n - 1).map_or(0, |p| p.2);
        let reached = parts
            .iter()
            .find(|p| p.0 >= phase && p.1 == n - 1 && p.2 * 10 >= last_us * 9)
            .map(|p| (p.0 - phase) as f64 / 1e6);
        match reached {
            Some(s) => println!("| convergence after the shift: the busy region's part at 90% of its last ({last_us}) | {s:.1} periods |"),
            None => println!("| convergence after the shift | not reached (last part {last_us}) |"),
        }
        let calls = global_calls(global.port).await;
        println!(
            "| commands the global store ran, per region per second | {:.2} |",
            calls as f64 / n as f64 / (2 * seconds) as f64
        );
    });
    drop(servers);
}

/// Script calls the global store ran (`INFO commandstats`: `evalsha` and `eval`).
async fn global_calls(port: u16) -> u64 {
    let backend = RedisBackend::from_url(format!("redis://127.0.0.1:{port}"))
        .connect()
        .await
        .unwrap();
    use fred::prelude::ClientLike;
    let info: String = backend
        .client()
        .custom(fred::cmd!("INFO"), vec!["commandstats"])
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}
