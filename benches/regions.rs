//! One limit across regions on real stores (`BENCHMARKS.md`, "One limit across regions"): a
//! `redis-server` per region and one for the global store, behind a proxy holding every chunk
//! `--delay-ms` (40) each way with up to `--jitter-ms` (10) more, one regional limiter per region
//! (rebalancing every second; `--instances` (1) of them per region on its store, the region's
//! arrivals taken by each in turn), and `--keys` (1) keys of a limit of `--rate` (100) a second, burst
//! the same, marked `across_regions` (floors 10%). The arrivals: `--rps` a second in all (1.5
//! times the limit per key by default), spread evenly over the keys, split between `--regions`
//! (2, or 3) by `--scenario`, each phase `--seconds` (15) long:
//!
//! - `shift` (the default): 95/5 (90/5/5), then 5/95 (5/5/90).
//! - `idle`: every arrival in the first region while the others are idle, then half of them in
//!   the last region (it bursts from idle).
//! - `cut`: 95/5 throughout; the global store's proxy cut from the end of the first phase for 30
//!   s (`--cut-s`), then a last phase.
//! - `kill`: 95/5, then the first region's instances are killed (its limiter dropped: no
//!   request, no rebalance) and every arrival goes to the last region (a failover).
//! - `restart`: 95/5 throughout; the global store killed and restarted empty at the end of the
//!   first phase.
//!
//! Printed: the overshoot (the most admitted requests over the envelope in any window, per key,
//! for the union of every region's admitted decisions, a request counting in a window only if
//! it was sent and answered inside it: exact, by a sweep over a segment tree), the utilization
//! of each phase from three periods after its start against one central GCRA per key on the
//! same arrivals, the convergence after the phase change (periods until the last region's part
//! of the first key reaches 90% of the part it ends with), and the commands the global store
//! ran, per region and second.
//!
//! `cargo bench -p tower-ratelimits-benches --bench regions -- [--scenario shift] [--regions 2] [--instances 1] [--seconds 15] [--rate 100] [--keys 1] [--rps 150] [--delay-ms 40] [--jitter-ms 10]`

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_ratelimits::__private::gcra;
use tower_ratelimits::{BucketKey, Id, Limit, Limiter, Limits, RedisBackend, Transaction};

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use redis_support::RedisServer;

/// One request: when it was sent and answered (µs from the start), admitted.
#[derive(Clone, Copy)]
struct Sample {
    sent: u64,
    answered: u64,
    allowed: bool,
}

/// The most admitted requests over the envelope `burst + rate * (b - a) / 1 s` in any window
/// `[a, b]` (a request counts only if sent and answered inside it), exactly: the window starts
/// taken from the latest sent down, each request added to every window end at or after its
/// answer (a range add on a segment tree over the answers), the best end read as a range max.
fn overshoot(admitted: &[Sample], burst: u64, rate: u64) -> f64 {
    if admitted.is_empty() {
        return f64::MIN;
    }
    let mut ends: Vec<u64> = admitted.iter().map(|s| s.answered).collect();
    ends.sort_unstable();
    ends.dedup();
    let n = ends.len();
    let per_us = rate as f64 / 1e6;
    // Leaves: -rate * b for each end b; a request adds 1 to every end at or after its answer.
    let size = n.next_power_of_two();
    let mut max = vec![f64::MIN; 2 * size];
    let mut add = vec![0.0f64; 2 * size];
    for (i, &b) in ends.iter().enumerate() {
        max[size + i] = -per_us * b as f64;
    }
    for i in (1..size).rev() {
        max[i] = max[2 * i].max(max[2 * i + 1]);
    }
    fn update(max: &mut [f64], add: &mut [f64], node: usize, lo: usize, hi: usize, from: usize) {
        if hi <= from {
            return;
        }
        if lo >= from {
            max[node] += 1.0;
            add[node] += 1.0;
            return;
        }
        let mid = (lo + hi) / 2;
        update(max, add, 2 * node, lo, mid, from);
        update(max, add, 2 * node + 1, mid, hi, from);
        max[node] = max[2 * node].max(max[2 * node + 1]) + add[node];
    }
    fn query(max: &[f64], add: &[f64], node: usize, lo: usize, hi: usize, from: usize) -> f64 {
        if hi <= from {
            return f64::MIN;
        }
        if lo >= from {
            return max[node];
        }
        let mid = (lo + hi) / 2;
        query(max, add, 2 * node, lo, mid, from).max(query(max, add, 2 * node + 1, mid, hi, from))
            + add[node]
    }
    let mut by_sent: Vec<Sample> = admitted.to_vec();
    by_sent.sort_by_key(|s| std::cmp::Reverse(s.sent));
    let mut worst = f64::MIN;
    for s in &by_sent {
        let at = ends.partition_point(|&b| b < s.answered);
        update(&mut max, &mut add, 1, 0, size, at);
        let first_end = ends.partition_point(|&b| b < s.sent);
        let best = query(&max, &add, 1, 0, size, first_end);
        worst = worst.max(best + per_us * s.sent as f64 - burst as f64);
    }
    worst
}

/// [`overshoot`] by trying every window: the check of the sweep, on small sets.
fn overshoot_by_every_window(admitted: &[Sample], burst: u64, rate: u64) -> f64 {
    let mut worst = f64::MIN;
    for a in admitted.iter().map(|s| s.sent) {
        for b in admitted.iter().map(|s| s.answered).filter(|&b| b >= a) {
            let count = admitted
                .iter()
                .filter(|s| s.sent >= a && s.answered <= b)
                .count();
            worst = worst.max(count as f64 - burst as f64 - rate as f64 * (b - a) as f64 / 1e6);
        }
    }
    worst
}

/// The sweep against every window, on random sets (the bench stops if they differ).
fn check_overshoot() {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    for _ in 0..20 {
        let set: Vec<Sample> = (0..120)
            .map(|_| {
                let sent = next(2_000_000);
                Sample {
                    sent,
                    answered: sent + next(50_000),
                    allowed: true,
                }
            })
            .collect();
        let (fast, slow) = (
            overshoot(&set, 5, 20),
            overshoot_by_every_window(&set, 5, 20),
        );
        assert!(
            (fast - slow).abs() < 1e-6,
            "overshoot: sweep {fast}, every window {slow}"
        );
    }
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

/// The scenarios (the module's documentation).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Shift,
    Idle,
    Cut,
    Kill,
    Restart,
}

impl Scenario {
    /// Region `r`'s percent of the arrivals at `now` (µs), of `n` regions, phases of `phase`,
    /// a fault from `phase` to `fault_end`.
    fn percent(self, r: usize, n: usize, now: u64, phase: u64) -> u64 {
        let first = now < phase;
        let busy = 100 - 5 * (n as u64 - 1);
        match self {
            Scenario::Shift => {
                let busy_one = if first { 0 } else { n - 1 };
                if r == busy_one { busy } else { 5 }
            }
            Scenario::Idle => match (first, r) {
                (true, 0) => 100,
                (true, _) => 0,
                (false, 0) => 50,
                (false, r) if r == n - 1 => 50,
                (false, _) => 0,
            },
            Scenario::Cut | Scenario::Restart => {
                if r == 0 {
                    busy
                } else {
                    5
                }
            }
            Scenario::Kill => match (first, r) {
                (true, 0) => busy,
                (true, _) => 5,
                (false, 0) => 0,
                (false, r) if r == n - 1 => 100 - 5 * (n as u64 - 2),
                (false, _) => 5,
            },
        }
    }
}

fn main() {
    check_overshoot();
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str, default: u64| {
        common::arg(&args, flag).map_or(default, |s| s.parse().expect("a number"))
    };
    let scenario = match common::arg(&args, "--scenario").as_deref() {
        None | Some("shift") => Scenario::Shift,
        Some("idle") => Scenario::Idle,
        Some("cut") => Scenario::Cut,
        Some("kill") => Scenario::Kill,
        Some("restart") => Scenario::Restart,
        Some(other) => panic!("--scenario {other}: shift, idle, cut, kill or restart"),
    };
    let seconds = arg("--seconds", 15);
    let rate = arg("--rate", 100);
    let keys = arg("--keys", 1).max(1) as usize;
    let rps = arg("--rps", rate * 3 / 2 * keys as u64);
    let cut_s = arg("--cut-s", 30);
    let delay = Duration::from_millis(arg("--delay-ms", 40));
    let jitter = Duration::from_millis(arg("--jitter-ms", 10));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let n = arg("--regions", 2).clamp(2, 3) as usize;
    let regions = &["eu", "us", "ap"][..n];
    let instances = arg("--instances", 1).clamp(1, 8) as usize;
    let servers: Vec<RedisServer> = regions.iter().map(|_| RedisServer::start()).collect();
    let mut global = RedisServer::start();
    let cut = Arc::new(AtomicBool::new(false));
    let proxy = common::delaying_proxy_with_cut(
        format!("127.0.0.1:{}", global.port),
        delay,
        jitter,
        cut.clone(),
    );
    let yaml = format!(
        "Api: {{kind: any, burst: {rate}, count: {rate}, period: 1s, across_regions: true}}\n"
    );
    let limits = Limits::from_yaml_str(&yaml, None).unwrap();
    let limit = Limit::from_micros(rate, rate, 1_000_000).unwrap();
    let phase = seconds * 1_000_000;
    // The phases: two, or (a cut) before, during and after it.
    let (fault_at, fault_end, end) = match scenario {
        Scenario::Cut => (
            phase,
            phase + cut_s * 1_000_000,
            2 * phase + cut_s * 1_000_000,
        ),
        _ => (phase, phase, 2 * phase),
    };
    runtime.block_on(async {
        // Each region's instances: a limiter each, on the region's store.
        let mut limiters: Vec<Vec<Limiter>> = Vec::new();
        for (region, server) in regions.iter().zip(&servers) {
            let mut here = Vec::new();
            for _ in 0..instances {
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
                here.push(Limiter::new(limits.clone(), backend));
            }
            limiters.push(here);
        }
        let keyset: Vec<BucketKey> = (0..keys)
            .map(|k| limiters[0][0].key("Api", Id::from(k as u64)).unwrap())
            .collect();
        // Until every instance's registration is confirmed.
        let waited = Instant::now();
        loop {
            let mut all = true;
            for l in limiters.iter().flatten() {
                let seen = l.inspect(&keyset[0]).await.unwrap();
                all &= seen.region_share.is_some_and(|s| s.confirmed);
            }
            if all {
                break;
            }
            assert!(waited.elapsed() < Duration::from_secs(60), "never confirmed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("confirmed after {:.1} s", waited.elapsed().as_secs_f64());
        // Each region's limiter while its instances live (`kill` drops the first).
        let alive: Arc<Mutex<Vec<Option<Vec<Limiter>>>>> =
            Arc::new(Mutex::new(limiters.into_iter().map(Some).collect()));
        let start = Instant::now();
        // The global store's calls at the start of each steady window (3 s into the first
        // phase, 3 s into the last): the steady state's commands.
        let steady_calls: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
        {
            let (steady_calls, port) = (steady_calls.clone(), global.port);
            let marks = [3_000_000, fault_at, fault_end + 3_000_000];
            tokio::spawn(async move {
                for mark in marks {
                    tokio::time::sleep(Duration::from_micros(mark).saturating_sub(start.elapsed())).await;
                    let at = start.elapsed().as_micros() as u64;
                    let calls = global_calls(port).await;
                    steady_calls.lock().unwrap().push((at, calls));
                }
            });
        }
        let us = move || start.elapsed().as_micros() as u64;
        let samples: Arc<Mutex<Vec<(usize, Sample)>>> = Arc::default();
        let parts: Arc<Mutex<Vec<(u64, usize, u64)>>> = Arc::default();
        let mut tasks = Vec::new();
        // Arrivals: every millisecond, each region sends what its share of `rps` is due, the
        // keys in turn.
        for r in 0..n {
            let (alive, keyset, samples) = (alive.clone(), keyset.clone(), samples.clone());
            tasks.push(tokio::spawn(async move {
                let (mut owed, mut last, mut next_key, mut turn) = (0.0f64, 0u64, r, 0usize);
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                loop {
                    tick.tick().await;
                    let now = us();
                    if now >= end {
                        return;
                    }
                    let percent = scenario.percent(r, n, now, fault_at);
                    owed += (now - last) as f64 * rps as f64 * percent as f64 / 100.0 / 1e6;
                    last = now;
                    let Some(here) = alive.lock().unwrap()[r].clone() else {
                        owed = 0.0;
                        continue;
                    };
                    while owed >= 1.0 {
                        owed -= 1.0;
                        let k = next_key % keyset.len();
                        next_key += 1;
                        turn += 1;
                        let (limiter, key, samples) = (
                            here[turn % here.len()].clone(),
                            keyset[k].clone(),
                            samples.clone(),
                        );
                        tokio::spawn(async move {
                            let sent = us();
                            let Ok(d) = limiter.spend(&[Transaction::new(key)]).await else {
                                return;
                            };
                            let answered = us();
                            samples.lock().unwrap().push((
                                k,
                                Sample {
                                    sent,
                                    answered,
                                    allowed: d.allowed(),
                                },
                            ));
                        });
                    }
                }
            }));
        }
        // The parts of the first key, every 100 ms.
        {
            let (alive, key, parts) = (alive.clone(), keyset[0].clone(), parts.clone());
            tasks.push(tokio::spawn(async move {
                while us() < end {
                    for r in 0..n {
                        let Some(l) = alive.lock().unwrap()[r].as_ref().map(|h| h[0].clone()) else {
                            continue;
                        };
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
        // The fault.
        let at = Duration::from_micros(fault_at);
        tokio::time::sleep(at.saturating_sub(start.elapsed())).await;
        match scenario {
            Scenario::Cut => {
                cut.store(true, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_micros(fault_end - fault_at)).await;
                cut.store(false, Ordering::Relaxed);
            }
            Scenario::Kill => {
                alive.lock().unwrap()[0] = None;
            }
            Scenario::Restart => {
                global.kill();
                global.restart();
            }
            Scenario::Shift | Scenario::Idle => {}
        }
        for t in tasks {
            t.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let samples = samples.lock().unwrap().clone();
        let mut by_key: HashMap<usize, Vec<Sample>> = HashMap::new();
        for (k, s) in &samples {
            by_key.entry(*k).or_default().push(*s);
        }
        let admitted = samples.iter().filter(|(_, s)| s.allowed).count();
        let over = by_key
            .values()
            .map(|ss| {
                let ok: Vec<Sample> = ss.iter().filter(|s| s.allowed).copied().collect();
                overshoot(&ok, rate, rate)
            })
            .fold(f64::MIN, f64::max);
        let name = match scenario {
            Scenario::Shift => "shift",
            Scenario::Idle => "idle",
            Scenario::Cut => "cut",
            Scenario::Kill => "kill",
            Scenario::Restart => "restart",
        };
        println!("One limit across regions, scenario {name}: {rate}/s, burst {rate}, floors 10%, {n} regions of {instances} instances, global store behind {delay:?} + up to {jitter:?} each way, {keys} keys, {rps} requests/s in all");
        println!();
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| requests sent / admitted | {} / {admitted} |", samples.len());
        println!("| overshoot: most admitted over the envelope in any window, worst key | {:.2} |", over.max(0.0));
        let mut windows = vec![("first phase", 3_000_000, fault_at)];
        if fault_end > fault_at {
            windows.push(("during the cut", fault_at, fault_end));
        }
        windows.push(("last phase", fault_end, fault_end + 3_000_000));
        windows.push(("last phase, from 3 periods after its start", fault_end + 3_000_000, end));
        if scenario != Scenario::Shift && scenario != Scenario::Idle {
            // A lease and the margin (what a fault waits out), then 3 periods.
            windows.push(("last phase, from 7 s after its start", fault_end + 7_000_000, end));
        }
        for (what, from, to) in windows {
            let (mut ours, mut one) = (0u64, 0u64);
            for ss in by_key.values() {
                ours += ss.iter().filter(|s| s.allowed && (from..to).contains(&s.sent)).count() as u64;
                let mut arrivals: Vec<u64> = ss.iter().map(|s| s.sent).collect();
                arrivals.sort_unstable();
                one += central(&limit, &arrivals, from, to);
            }
            println!(
                "| utilization, {what} ({:.0} to {:.0} s): ours / one central GCRA | {ours} / {one} = {:.1}% |",
                from as f64 / 1e6,
                to as f64 / 1e6,
                100.0 * ours as f64 / one.max(1) as f64
            );
        }
        // Convergence: after the fault (the shift), the first sample where the last region's
        // part reaches 90% of its last.
        let parts = parts.lock().unwrap().clone();
        if args.iter().any(|a| a == "--parts") {
            // Each change of a region's part of the first key, from a second before the
            // phase change.
            let mut last = vec![u64::MAX; n];
            for &(at, r, part) in parts.iter().filter(|p| p.0 + 1_000_000 >= fault_end) {
                if last[r] != part {
                    eprintln!("{:>7.2} s  {}  part {part}", at as f64 / 1e6, regions[r]);
                    last[r] = part;
                }
            }
        }
        let last_us = parts.iter().rev().find(|p| p.1 == n - 1).map_or(0, |p| p.2);
        let reached = parts
            .iter()
            .find(|p| p.0 >= fault_end && p.1 == n - 1 && p.2 * 10 >= last_us * 9)
            .map(|p| (p.0 - fault_end) as f64 / 1e6);
        match reached {
            Some(s) => println!("| convergence after the phase change: the last region's part at 90% of its last ({last_us}) | {s:.1} periods |"),
            None => println!("| convergence after the phase change | not reached (last part {last_us}) |"),
        }
        let calls = global_calls(global.port).await;
        let note = if scenario == Scenario::Restart { " (since the restart)" } else { "" };
        println!(
            "| commands the global store ran, per region per second{note} | {:.2} |",
            calls as f64 / n as f64 / ((end - if scenario == Scenario::Restart { fault_at } else { 0 }) as f64 / 1e6)
        );
        // Steady: from 3 s into the first phase to its end, and from 3 s into the last to the
        // run's end (the restart's store counts from 0 again: its last window only).
        let marks = steady_calls.lock().unwrap().clone();
        if marks.len() == 3 && scenario != Scenario::Restart {
            let per_s = |(a, ca): (u64, u64), (b, cb): (u64, u64)| {
                cb.saturating_sub(ca) as f64 / n as f64 / ((b - a).max(1) as f64 / 1e6)
            };
            let now = start.elapsed().as_micros() as u64;
            println!(
                "| commands per region per second at steady state: first phase from 3 s, last phase from 3 s | {:.2}, {:.2} |",
                per_s(marks[0], marks[1]),
                per_s(marks[2], (now, calls))
            );
        }
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
