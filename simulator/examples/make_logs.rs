//! Makes the access logs shipped in `examples/logs/` (the `plan` command's tests and guide
//! read them): three instances of one service behind a load balancer, ten minutes of traffic
//! from 2026-11-25T10:00:00Z, the same bytes for the same seed.
//!
//! ```text
//! cargo run -p tower-ratelimits-simulator --example make_logs -- examples/logs [SEED]
//! ```
//!
//! What is in them: clients drawn by a skewed (Zipf, s = 1.1) choice from 300 addresses, a
//! quarter of them IPv6; bursts (a client sending 20 to 40 requests within a second, now and
//! then); reads and writes on `/api` with an account header (`x-account`, 50 accounts; 2% of
//! API requests lack it), static files, long exports (`POST /api/export`, 2 to 5 s: longer than
//! the concurrency lease of the shipped limits), a health checker from an exempt network every
//! 5 s; about 0.3% bad lines. Each instance writes a line when its request ends, so lines are
//! out of order by their durations (a `--reorder` of 10 s sorts them). `edge-a.jsonl` and
//! `edge-b.jsonl.gz` are JSON lines (the second gzipped); `edge-c.log` is the combined format
//! with nginx's request time (`rt=`), whole seconds.

use std::io::Write;

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};

const START_S: u64 = 1_795_600_800; // 2026-11-25T10:00:00Z
const SECONDS: u64 = 600;
const CLIENTS: usize = 300;
const ACCOUNTS: u64 = 50;

struct Request {
    start_us: u64,
    duration_us: u64,
    ip: String,
    method: &'static str,
    path: String,
    account: Option<u64>,
    status: u16,
}

fn uniform(rng: &mut Xoshiro256PlusPlus) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn client(i: usize) -> String {
    if i % 4 == 3 {
        format!("2001:db8:{:x}::{:x}", i / 7, i)
    } else {
        format!(
            "{}.{}",
            if i.is_multiple_of(2) {
                "203.0.113"
            } else {
                "198.51.100"
            },
            i % 250 + 1
        )
    }
}

fn requests(rng: &mut Xoshiro256PlusPlus, instance: u64) -> Vec<Request> {
    let weights: Vec<f64> = (1..=CLIENTS).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let pick = |rng: &mut Xoshiro256PlusPlus| {
        let mut x = uniform(rng) * total;
        for (i, w) in weights.iter().enumerate() {
            x -= w;
            if x <= 0.0 {
                return i;
            }
        }
        CLIENTS - 1
    };
    let mut out = Vec::new();
    let mut t_us = START_S * 1_000_000 + instance * 1_000;
    let end_us = (START_S + SECONDS) * 1_000_000;
    while t_us < end_us {
        // About 4 requests a second per instance, exponential gaps.
        t_us += (-(1.0 - uniform(rng)).ln() * 250_000.0) as u64 + 1;
        let c = pick(rng);
        let burst = if uniform(rng) < 0.004 {
            20 + rng.next_u64() % 21
        } else {
            1
        };
        for b in 0..burst {
            let start_us = t_us + b * (rng.next_u64() % 40_000);
            let roll = uniform(rng);
            let (method, path, duration_ms) = if roll < 0.5 {
                (
                    "GET",
                    format!("/api/orders/{}", rng.next_u64() % 1000),
                    20.0 + uniform(rng) * 80.0,
                )
            } else if roll < 0.65 {
                (
                    "POST",
                    "/api/orders".to_owned(),
                    50.0 + uniform(rng) * 150.0,
                )
            } else if roll < 0.67 {
                (
                    "POST",
                    "/api/export".to_owned(),
                    2_000.0 + uniform(rng) * 3_000.0,
                )
            } else {
                (
                    "GET",
                    format!("/static/app.{}.js", rng.next_u64() % 5),
                    1.0 + uniform(rng) * 5.0,
                )
            };
            let account = (path.starts_with("/api") && uniform(rng) >= 0.02)
                .then(|| (c as u64 * 7 + rng.next_u64() % 3) % ACCOUNTS + 1);
            out.push(Request {
                start_us,
                duration_us: (duration_ms * 1000.0) as u64,
                ip: client(c),
                method,
                path,
                account,
                status: 200,
            });
        }
    }
    // The health checker, from the exempt network.
    let mut s = START_S * 1_000_000 + 2_500_000 + instance * 100_000;
    while s < end_us {
        out.push(Request {
            start_us: s,
            duration_us: 1_000,
            ip: format!("10.1.0.{}", instance + 1),
            method: "GET",
            path: "/health".into(),
            account: None,
            status: 200,
        });
        s += 5_000_000;
    }
    // Written when each request ends.
    out.sort_by_key(|r| (r.start_us + r.duration_us, r.start_us));
    out
}

fn rfc3339(us: u64) -> String {
    let s = us / 1_000_000;
    let (day, secs) = (s / 86_400, s % 86_400);
    assert_eq!(day, START_S / 86_400, "the logs stay within their day");
    format!(
        "2026-11-25T{:02}:{:02}:{:02}.{:06}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        us % 1_000_000
    )
}

fn bad_line(rng: &mut Xoshiro256PlusPlus) -> String {
    match rng.next_u64() % 3 {
        0 => "{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"not-an-address\"}".to_owned(),
        1 => "GET /truncated HTTP/1.1\" 200".to_owned(),
        _ => "{\"time\":\"yesterday\",\"ip\":\"192.0.2.1\"}".to_owned(),
    }
}

fn json_log(rng: &mut Xoshiro256PlusPlus, requests: &[Request]) -> String {
    let mut text = String::new();
    for r in requests {
        if uniform(rng) < 0.003 {
            text.push_str(&bad_line(rng));
            text.push('\n');
        }
        let headers = match r.account {
            Some(a) => format!(",\"headers\":{{\"x-account\":\"{a}\"}}"),
            None => String::new(),
        };
        text.push_str(&format!(
            "{{\"time\":\"{}\",\"ip\":\"{}\",\"method\":\"{}\",\"path\":\"{}\",\"status\":{}{headers},\"duration_ms\":{:.3}}}\n",
            rfc3339(r.start_us),
            r.ip,
            r.method,
            r.path,
            r.status,
            r.duration_us as f64 / 1000.0
        ));
    }
    text
}

fn combined_log(rng: &mut Xoshiro256PlusPlus, requests: &[Request]) -> String {
    let mut text = String::new();
    for r in requests {
        if uniform(rng) < 0.003 {
            text.push_str(&bad_line(rng));
            text.push('\n');
        }
        // nginx writes the second the request ended in, truncated.
        let end_s = (r.start_us + r.duration_us) / 1_000_000;
        let secs = end_s % 86_400;
        // The combined format has no account: these requests are keyed by address only.
        text.push_str(&format!(
            "{} - - [25/Nov/2026:{:02}:{:02}:{:02} +0000] \"{} {} HTTP/1.1\" {} 512 \"-\" \"loadgen/1.0\" rt={:.3}\n",
            r.ip,
            secs / 3600,
            secs / 60 % 60,
            secs % 60,
            r.method,
            r.path,
            r.status,
            r.duration_us as f64 / 1e6
        ));
    }
    text
}

/// Writes the three logs into `dir` (made if missing), from `seed`.
pub fn write_logs(dir: &std::path::Path, seed: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let a = requests(&mut rng, 0);
    let b = requests(&mut rng, 1);
    let c = requests(&mut rng, 2);
    std::fs::write(dir.join("edge-a.jsonl"), json_log(&mut rng, &a))?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(json_log(&mut rng, &b).as_bytes())?;
    std::fs::write(dir.join("edge-b.jsonl.gz"), gz.finish()?)?;
    std::fs::write(dir.join("edge-c.log"), combined_log(&mut rng, &c))?;
    Ok(())
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().ok_or("usage: make_logs DIR [SEED]")?);
    let seed: u64 = args.next().map_or(Ok(7), |s| s.parse())?;
    write_logs(&dir, seed)?;
    Ok(())
}
