//! `tower-ratelimits-simulate plan snapshot`: reads the state of a policy's keys from Redis,
//! read only, into a file a plan starts warm from (`--snapshot FILE`; `docs/replay.md`,
//! "Starting warm").
//!
//! ```text
//! tower-ratelimits-simulate plan snapshot --redis URL --limits A.yaml --out FILE
//!     [--prefix rl:] [--max-keys N]
//! ```
//!
//! Exit codes: 0; 2 for bad input (an option, a file, the limits) or a store that cannot be
//! read.

use std::path::PathBuf;
use std::process::ExitCode;

pub(crate) const USAGE: &str = "usage: tower-ratelimits-simulate plan snapshot --redis URL \
--limits A.yaml --out FILE [--prefix rl:] [--max-keys N]";

struct Args {
    redis: String,
    limits: PathBuf,
    out: PathBuf,
    prefix: String,
    max_keys: usize,
}

fn parse_args(mut args: impl Iterator<Item = std::ffi::OsString>) -> Result<Args, String> {
    let (mut redis, mut limits, mut out) = (None, None, None);
    let (mut prefix, mut max_keys) = (String::from("rl:"), tower_ratelimits::DEFAULT_SNAPSHOT_KEYS);
    let text = crate::option_text;
    while let Some(arg) = args.next() {
        let Some(option) = arg.to_str() else {
            return Err(format!("unexpected argument {arg:?}"));
        };
        match option {
            "--redis" => redis = Some(text(option, args.next())?),
            "--limits" => limits = Some(PathBuf::from(text(option, args.next())?)),
            "--out" => out = Some(PathBuf::from(text(option, args.next())?)),
            "--prefix" => prefix = text(option, args.next())?,
            "--max-keys" => {
                let t = text(option, args.next())?;
                max_keys = t
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("--max-keys {t:?}: a count of keys (1 or more)"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(Args {
        redis: redis.ok_or("--redis is required")?,
        limits: limits.ok_or("--limits is required")?,
        out: out.ok_or("--out is required")?,
        prefix,
        max_keys,
    })
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    crate::bad_input("simulate plan snapshot", message)
}

/// Runs `plan snapshot` with the arguments after the word `snapshot`.
pub(crate) fn cli(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(format!("{e}\n{USAGE}")),
    };
    let limits = match tower_ratelimits::Limits::from_yaml_file(&args.limits) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    // The file is made first: an unwritable path fails before the store is read.
    let out = match crate::Output::create("--out", &args.out) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    let snapshot = match read(&args, &limits) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let mut text = Vec::new();
    if let Err(e) = snapshot.write(&mut text) {
        return fail(e);
    }
    if let Err(e) = out.write(&String::from_utf8_lossy(&text)) {
        return fail(e);
    }
    eprintln!(
        "{} keys at {} ({} values not ours left out) -> {}",
        snapshot.keys().len(),
        tower_ratelimits::__private::instant_text(snapshot.instant_us()),
        snapshot.foreign(),
        args.out.display()
    );
    if snapshot.keys().is_empty() {
        // An empty store is a fresh one; a store written under another prefix looks the same.
        eprintln!(
            "simulate plan snapshot: nothing matched the prefix {:?}: if the app writes its keys \
             under another (RedisBackend::prefix), give it with --prefix",
            args.prefix
        );
    }
    ExitCode::SUCCESS
}

#[cfg(feature = "redis")]
fn read(
    args: &Args,
    limits: &tower_ratelimits::Limits,
) -> Result<tower_ratelimits::Snapshot, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting a runtime: {e}"))?;
    let backend = tower_ratelimits::RedisBackend::from_url(&args.redis).prefix(args.prefix.clone());
    runtime
        .block_on(tower_ratelimits::Snapshot::from_redis(
            backend,
            limits,
            args.max_keys,
        ))
        .map_err(|e| match e {
            // The library's advice (`.lazy(true)`) is for a program; here the store must answer.
            tower_ratelimits::SnapshotError::Connect(
                tower_ratelimits::RedisSetupError::Connect {
                    address, reason, ..
                },
            ) => format!(
                "--redis {}: cannot connect to {address}: {reason} (is the store up, and the URL \
                 right?)",
                args.redis
            ),
            e => format!("--redis {}: {e}", args.redis),
        })
}

#[cfg(not(feature = "redis"))]
fn read(args: &Args, _: &tower_ratelimits::Limits) -> Result<tower_ratelimits::Snapshot, String> {
    let _ = (&args.prefix, args.max_keys);
    Err(format!("--redis {}: ", args.redis)
        + "plan snapshot reads Redis: build the simulator with `--features redis`")
}
