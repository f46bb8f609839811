//! Runs a trace of requests through the limiter and prints one JSON decision per line.
//!
//! ```text
//! cargo run --example simulate -- --defaults FILE [--overrides FILE] [TRACE]
//! ```
//!
//! TRACE is a file, or standard input when absent or `-`. The format is documented in
//! `tower_ratelimits::simulate`. A malformed trace or configuration prints the line and the
//! reason on standard error and exits with code 2.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use tower_ratelimits::{Limiter, Limits, ManualClock, MemoryBackend, simulate};

const USAGE: &str = "usage: simulate --defaults FILE [--overrides FILE] [TRACE]";

struct Args {
    defaults: PathBuf,
    overrides: Option<PathBuf>,
    trace: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut defaults = None;
    let mut overrides = None;
    let mut trace = None;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--defaults") => defaults = Some(args.next().ok_or("--defaults needs a file")?),
            Some("--overrides") => overrides = Some(args.next().ok_or("--overrides needs a file")?),
            Some("-h" | "--help") => return Err(String::new()),
            Some(s) if s.starts_with("--") => return Err(format!("unknown option {s}")),
            _ if trace.is_none() => trace = Some(arg),
            _ => return Err("more than one trace given".into()),
        }
    }
    Ok(Args {
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
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(limits, backend);
    let stdout = std::io::stdout().lock();
    match simulate::run(&limiter, &clock, input, stdout).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}
