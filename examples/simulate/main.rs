//! Runs a trace of requests through the limiter and prints one JSON decision per line.
//!
//! ```text
//! cargo run --example simulate -- --defaults FILE [--overrides FILE] [TRACE]
//! cargo run --example simulate --features redis -- --redis redis://127.0.0.1:6379 --defaults FILE [TRACE]
//! ```
//!
//! With `--redis URL` (feature `redis`) the trace runs through the Redis backend in caller-time
//! mode and prints exactly what the in-memory run prints. Its keys live under a prefix of their
//! own (`rl:sim:<pid>-<time>:`) and expire by themselves on the server (one hour after the
//! trace time they need to refill).
//!
//! TRACE is a file, or standard input when absent or `-`. The format is documented in
//! `examples/simulate/trace.rs`. A malformed trace or configuration prints the line and the
//! reason on standard error and exits with code 2.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend};

mod trace;
use trace as simulate;

const USAGE: &str = "usage: simulate [--redis URL] --defaults FILE [--overrides FILE] [TRACE]";

struct Args {
    redis: Option<String>,
    defaults: PathBuf,
    overrides: Option<PathBuf>,
    trace: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut defaults = None;
    let mut overrides = None;
    let mut trace = None;
    let mut redis = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--defaults") => defaults = Some(args.next().ok_or("--defaults needs a file")?),
            Some("--overrides") => overrides = Some(args.next().ok_or("--overrides needs a file")?),
            Some("--redis") => {
                let url = args.next().ok_or("--redis needs a URL")?;
                redis = Some(
                    url.into_string()
                        .map_err(|_| "--redis: the URL is not UTF-8")?,
                );
            }
            Some("-h" | "--help") => return Err(String::new()),
            Some(s) if s.starts_with("--") => return Err(format!("unknown option {s}")),
            _ if trace.is_none() => trace = Some(arg),
            _ => return Err("more than one trace given".into()),
        }
    }
    Ok(Args {
        redis,
        defaults: defaults.ok_or("--defaults is required")?.into(),
        overrides: overrides.map(PathBuf::from),
        trace: trace.map(PathBuf::from).filter(|p| p.as_os_str() != "-"),
    })
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("simulate: {message}");
    ExitCode::from(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(format!("{e}\n{USAGE}")),
    };
    let limits = match Limits::from_yaml_files(&args.defaults, args.overrides.as_deref()) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let input: Box<dyn BufRead> = match &args.trace {
        None => Box::new(BufReader::new(std::io::stdin())),
        Some(p) => match std::fs::File::open(p) {
            Ok(f) => Box::new(BufReader::new(f)),
            Err(e) => return fail(format!("{}: {e}", p.display())),
        },
    };
    let clock = ManualClock::new(simulate::EPOCH_US);
    let limiter = match &args.redis {
        None => Limiter::new(
            limits,
            MemoryBackend::builder().clock(clock.clone()).build(),
        ),
        Some(url) => match redis_backend(url, &clock).await {
            Ok(backend) => Limiter::with_shared_backend(limits, backend),
            Err(e) => return fail(e),
        },
    };
    let stdout = std::io::stdout().lock();
    match simulate::run(&limiter, &clock, input, stdout).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

#[cfg(feature = "redis")]
async fn redis_backend(
    url: &str,
    clock: &ManualClock,
) -> Result<std::sync::Arc<dyn tower_ratelimits::Backend>, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let backend = tower_ratelimits::RedisBackend::from_url(url)
        .prefix(format!("rl:sim:{}-{nanos}:", std::process::id()))
        .caller_time(clock.clone())
        .connect()
        .await
        .map_err(|e| format!("--redis {url}: {e}"))?;
    Ok(std::sync::Arc::new(backend))
}

#[cfg(not(feature = "redis"))]
async fn redis_backend(
    _url: &str,
    _clock: &ManualClock,
) -> Result<std::sync::Arc<dyn tower_ratelimits::Backend>, String> {
    Err("--redis needs the `redis` feature: cargo run --example simulate --features redis".into())
}
