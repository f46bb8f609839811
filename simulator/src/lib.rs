//! The trace simulator of [tower-ratelimits](https://docs.rs/tower-ratelimits): runs a trace
//! of requests through the limiter and prints one JSON decision per line, and draws it as a
//! timeline on request.
//!
//! ```text
//! cargo install tower-ratelimits-simulator        # the `tower-ratelimits-simulate` command
//! tower-ratelimits-simulate --defaults FILE [--overrides FILE] [TRACE]
//! tower-ratelimits-simulate --defaults FILE --html OUT.html [--svg OUT.svg] [TRACE]
//! tower-ratelimits-simulate --defaults FILE --generate "burst 30 at 0s, then 5/s for 20s" \
//!     [--key Name=id ...] --html OUT.html
//! tower-ratelimits-simulate --redis redis://127.0.0.1:6379 --defaults FILE [TRACE]   # feature `redis`
//! tower-ratelimits-simulate --regions eu:60%,us:40% --defaults FILE [--html OUT.html] [TRACE]
//! tower-ratelimits-simulate plan --current A.yaml --candidate B.yaml --rules RULES.yaml --log FILE ...
//! tower-ratelimits-simulate plan snapshot --redis URL --limits A.yaml --out FILE   # feature `redis`
//! ```
//!
//! `plan` replays access logs through a current and a candidate policy and says what would
//! change (`simulator/src/plan.rs`, `docs/replay.md`); a trace file named `plan` is read as
//! `./plan`. `plan snapshot` reads production's state from Redis, read only, for `plan
//! --snapshot FILE` to start from (`simulator/src/snapshot.rs`).
//!
//! In the repository, `cargo run --example simulate -- ARGS` runs the same command (add
//! `--features redis` for `--redis`).
//!
//! With `--redis URL` (feature `redis`) the trace runs through the Redis backend in caller-time
//! mode and prints exactly what the in-memory run prints. Its keys live under a prefix of their
//! own (`rl:sim:<pid>-<time>:`) and expire by themselves on the server (one hour after the
//! trace time they need to refill). A limit's `prefetch` (prefetched tokens, a deployment's
//! optimisation) is ignored there as in memory: a trace decides exactly.
//!
//! With `--regions eu:60%,us:40%` (or `eu,us`: evenly; at most 16 regions) the trace runs in
//! simulated regions of the limits marked `across_regions` (`docs/regions.md`, "Simulated
//! regions"): a limiter per region, each line decided in the region it names (`@eu`) or, naming
//! none, in one chosen by the percentages, and the regions' shares moved between lines as the
//! Redis backend moves them. Limits not marked are per region. Each line's JSON names its
//! `"region"`; a drawing has a lane per region and bucket, a marked limit's with the region's
//! share of the rate. Not with `--redis`.
//!
//! TRACE is a file, or standard input when absent or `-`. The format is documented in
//! `simulator/src/trace.rs`. `--generate PHRASE` makes the trace from a workload phrase
//! instead (grammar: `simulator/src/generate.rs`), each request a batch of the `--key`
//! transactions (trace syntax, repeatable; default: every limit of the defaults file with an id
//! its kind accepts).
//!
//! `--html FILE` and `--svg FILE` also draw the run (`simulator/src/timeline.rs`): one
//! self-contained file, `--width PX` wide (default 1400). `--quiet` leaves out the JSON lines.
//!
//! A malformed trace, phrase or configuration, an unknown option or an output file that cannot
//! be written prints the reason on standard error and exits with code 2, leaving no output file.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use tower_ratelimits::__private::SimulatedRegions;
use tower_ratelimits::{IdKind, Limiter, Limits, ManualClock, MemoryBackend};

mod generate;
mod plan;
mod plan_page;
mod snapshot;
mod timeline;
mod trace;
use trace as simulate;

const USAGE: &str = "usage: tower-ratelimits-simulate [--redis URL | --regions eu:60%,us:40%] \
--defaults FILE [--overrides FILE] [--html FILE] [--svg FILE] [--width PX] [--quiet] \
[--generate PHRASE [--key Name=id ...] | TRACE]";

/// The largest trace drawn (a drawing reads the whole trace before running it).
const MAX_DRAWN_TRACE_BYTES: u64 = 256 << 20;

struct Args {
    redis: Option<String>,
    /// `--regions`: each region's name and the percentage of the lines naming none it takes.
    regions: Vec<(String, u64)>,
    defaults: PathBuf,
    overrides: Option<PathBuf>,
    trace: Option<PathBuf>,
    html: Option<PathBuf>,
    svg: Option<PathBuf>,
    generate: Option<String>,
    keys: Vec<String>,
    width: u32,
    quiet: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut defaults = None;
    let mut overrides = None;
    let mut trace = None;
    let mut redis = None;
    let mut regions = Vec::new();
    let mut html = None;
    let mut svg = None;
    let mut generate = None;
    let mut keys = Vec::new();
    let mut width = timeline::DEFAULT_WIDTH;
    let mut quiet = false;
    let mut args = std::env::args_os().skip(1);
    let text = option_text;
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--defaults") => defaults = Some(args.next().ok_or("--defaults needs a file")?),
            Some("--overrides") => overrides = Some(args.next().ok_or("--overrides needs a file")?),
            Some("--html") => html = Some(PathBuf::from(args.next().ok_or("--html needs a file")?)),
            Some("--svg") => svg = Some(PathBuf::from(args.next().ok_or("--svg needs a file")?)),
            Some("--redis") => redis = Some(text("--redis", args.next())?),
            Some("--regions") => regions = parse_regions(&text("--regions", args.next())?)?,
            Some("--generate") => generate = Some(text("--generate", args.next())?),
            Some("--key") => keys.push(text("--key", args.next())?),
            Some("--width") => {
                let w = text("--width", args.next())?;
                width = w
                    .parse()
                    .ok()
                    .filter(|w| timeline::WIDTH_RANGE.contains(w))
                    .ok_or_else(|| {
                        format!(
                            "--width {w:?}: a number of pixels from {} to {}",
                            timeline::WIDTH_RANGE.start(),
                            timeline::WIDTH_RANGE.end()
                        )
                    })?;
            }
            Some("--quiet" | "-q") => quiet = true,
            Some("-h" | "--help") => return Err(String::new()),
            Some(s) if s.starts_with("--") => return Err(format!("unknown option {s}")),
            _ if trace.is_none() => trace = Some(arg),
            _ => return Err("more than one trace given".into()),
        }
    }
    if generate.is_some() && trace.is_some() {
        return Err("give a TRACE or --generate, not both".into());
    }
    if !keys.is_empty() && generate.is_none() {
        return Err("--key only goes with --generate (a trace names its own keys)".into());
    }
    if redis.is_some() && !regions.is_empty() {
        return Err(
            "--regions simulates its regions and their global store in memory: drop --redis".into(),
        );
    }
    if redis.is_some() && (html.is_some() || svg.is_some()) {
        return Err(
            "--html and --svg draw from the in-memory backend's state: drop --redis (both \
             backends decide the same)"
                .into(),
        );
    }
    Ok(Args {
        redis,
        regions,
        defaults: defaults.ok_or("--defaults is required")?.into(),
        overrides: overrides.map(PathBuf::from),
        trace: trace.map(PathBuf::from).filter(|p| p.as_os_str() != "-"),
        html,
        svg,
        generate,
        keys,
        width,
        quiet,
    })
}

/// The most regions `--regions` names.
const MAX_REGIONS: usize = 16;

/// `--regions eu:60%,us:40%`: each region's name and the percentage of the trace's lines that
/// name no region (`@eu`) it takes; without percentages (`eu,us`) they are split evenly.
/// Either every region has a percentage and they sum to 100%, or none has.
fn parse_regions(spec: &str) -> Result<Vec<(String, u64)>, String> {
    let bad = |why: String| format!("--regions {spec:?}: {why}");
    let items: Vec<&str> = spec.split(',').map(str::trim).collect();
    if items.len() > MAX_REGIONS {
        return Err(bad(format!("at most {MAX_REGIONS} regions")));
    }
    let mut out: Vec<(String, Option<u64>)> = Vec::with_capacity(items.len());
    for item in items {
        let (name, percent) = match item.split_once(':') {
            Some((name, p)) => {
                let digits = p
                    .strip_suffix('%')
                    .filter(|d| {
                        !d.is_empty() && d.len() <= 3 && d.bytes().all(|b| b.is_ascii_digit())
                    })
                    .ok_or_else(|| bad(format!("{p:?} is not a percentage (write 60%)")))?;
                (
                    name,
                    Some(digits.parse::<u64>().map_err(|e| bad(e.to_string()))?),
                )
            }
            None => (item, None),
        };
        if name.is_empty() {
            return Err(bad("a region without a name".into()));
        }
        out.push((name.to_owned(), percent));
    }
    let given = out.iter().filter(|(_, p)| p.is_some()).count();
    if given == 0 {
        let n = out.len() as u64;
        // Even parts; the first regions take what does not divide.
        return Ok(out
            .into_iter()
            .enumerate()
            .map(|(i, (name, _))| (name, 100 / n + u64::from((i as u64) < 100 % n)))
            .collect());
    }
    if given != out.len() {
        return Err(bad("give every region a percentage, or none".into()));
    }
    let total: u64 = out.iter().filter_map(|(_, p)| *p).sum();
    if total != 100 {
        return Err(bad(format!("the percentages sum to {total}%, not 100%")));
    }
    Ok(out.into_iter().map(|(n, p)| (n, p.unwrap_or(0))).collect())
}

/// An option's value as text: present, and UTF-8.
pub(crate) fn option_text(
    option: &str,
    value: Option<std::ffi::OsString>,
) -> Result<String, String> {
    value
        .ok_or_else(|| format!("{option} needs a value"))?
        .into_string()
        .map_err(|_| format!("{option}: the value is not UTF-8"))
}

/// Bad input to `command`: the reason on standard error after its name, exit code 2.
pub(crate) fn bad_input(command: &str, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("{command}: {message}");
    ExitCode::from(2)
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    bad_input("simulate", message)
}

/// An output file, created before the run so an unwritable path fails first, and removed
/// again unless the run completes.
pub(crate) struct Output {
    path: PathBuf,
    file: Option<std::fs::File>,
}

impl Output {
    pub(crate) fn create(option: &str, path: &Path) -> Result<Output, String> {
        let file =
            std::fs::File::create(path).map_err(|e| format!("{option} {}: {e}", path.display()))?;
        Ok(Output {
            path: path.to_owned(),
            file: Some(file),
        })
    }

    pub(crate) fn write(mut self, text: &str) -> Result<(), String> {
        let result = self.file.take().map_or(Ok(()), |mut f| {
            f.write_all(text.as_bytes()).and_then(|()| f.flush())
        });
        result.map_err(|e| format!("{}: {e}", self.path.display()))?;
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            drop(self.file.take());
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// An id that a limit of this kind accepts, for the default `--generate` keys.
fn sample_id(kind: IdKind) -> &'static str {
    match kind {
        IdKind::Ip => "192.0.2.1",
        IdKind::Ipv6Range => "2001:db8::/48",
        IdKind::Account => "1",
        #[cfg(feature = "acme")]
        IdKind::Domain | IdKind::FqdnSet => "example.com",
        #[cfg(feature = "acme")]
        IdKind::AccountDomain | IdKind::AccountFqdnSet => "1:example.com",
        _ => "client",
    }
}

/// The trace text a `--generate` phrase makes, each request a batch of `keys`.
fn generated_trace(limiter: &Limiter, phrase: &str, keys: &[String]) -> Result<String, String> {
    let requests = generate::generate(phrase).map_err(|e| format!("--generate {phrase:?}: {e}"))?;
    let limits = limiter.limits();
    let batch = if keys.is_empty() {
        let mut names: Vec<_> = limits.names().collect();
        names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        let all: Vec<String> = names
            .iter()
            .map(|&n| {
                let id = sample_id(limits.id_kind(n).unwrap_or_default());
                format!("{}={id}", n.as_str())
            })
            .collect();
        if all.is_empty() {
            return Err("--generate: the defaults file has no limit to spend on".into());
        }
        all.join(" ")
    } else {
        for key in keys {
            // The first line the phrase makes shows any mistake in a key at once.
            let line = format!("0s spend {key}");
            simulate::check_line(limiter, &line).map_err(|e| format!("--key {key:?}: {e}"))?;
        }
        keys.join(" ")
    };
    let mut text = String::with_capacity(requests.len() * (batch.len() + 24));
    for (at, cost) in requests {
        use std::fmt::Write as _;
        let _ = match cost {
            Some(c) => writeln!(text, "{at}us spend {batch} cost={c}"),
            None => writeln!(text, "{at}us spend {batch}"),
        };
    }
    Ok(text)
}

/// Runs the command line (`std::env::args`) to its end: the JSON lines on standard output, a
/// reason on standard error and exit code 2 on bad input.
pub fn cli() -> ExitCode {
    // `plan` is a subcommand; a trace file named `plan` is read as `./plan`.
    let mut words = std::env::args_os().skip(1);
    if words.next().is_some_and(|w| w == "plan") {
        return plan::cli(words);
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => return fail(format!("{e}\n{USAGE}")),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return fail(format!("starting the runtime: {e}")),
    };
    match runtime.block_on(simulate_main(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

async fn simulate_main(args: Args) -> Result<(), String> {
    let limits = Limits::from_yaml_files(&args.defaults, args.overrides.as_deref())
        .map_err(|e| e.to_string())?;
    let html = args
        .html
        .as_deref()
        .map(|p| Output::create("--html", p))
        .transpose()?;
    let svg = args
        .svg
        .as_deref()
        .map(|p| Output::create("--svg", p))
        .transpose()?;
    let clock = ManualClock::new(simulate::EPOCH_US);
    let memory = MemoryBackend::builder().clock(clock.clone()).build();
    // `--regions`: a limiter per region over simulated regions, registered (and confirmed)
    // before the trace starts.
    let names: Vec<&str> = args.regions.iter().map(|(n, _)| n.as_str()).collect();
    let mut regions = match names.is_empty() {
        true => None,
        false => {
            Some(SimulatedRegions::new(&clock, &names).map_err(|e| format!("--regions: {e}"))?)
        }
    };
    let limiters = limiters_for(&args, limits, regions.as_ref(), &memory, &clock).await?;
    if let Some(r) = &mut regions {
        r.start()
            .map_err(|e| format!("--regions: registering the regions: {e}"))?;
    }
    let limiter = &limiters[0];
    let generated = (args.generate.as_ref())
        .map(|phrase| generated_trace(limiter, phrase, &args.keys))
        .transpose()?;
    let input = input_of(generated.as_deref(), args.trace.as_deref())?;
    let stdout: Box<dyn Write> = if args.quiet {
        Box::new(std::io::sink())
    } else {
        Box::new(std::io::stdout().lock())
    };
    let backends: Vec<(String, MemoryBackend)> = regions
        .as_ref()
        .map_or(Vec::new(), |r| r.regions().to_vec());
    let percents: Vec<u64> = args.regions.iter().map(|(_, p)| *p).collect();
    let mut in_regions = regions.as_mut().map(|r| {
        simulate::TraceRegions::new(
            names.iter().map(|n| (*n).to_owned()).collect(),
            percents,
            &limiters,
            r,
        )
    });
    if html.is_none() && svg.is_none() {
        let run = match &mut in_regions {
            Some(r) => simulate::run_in_regions(r, &clock, input, stdout, &mut ()).await,
            None => simulate::run(limiter, &clock, input, stdout).await,
        };
        return run.map_err(|e| e.to_string());
    }
    // A drawing reads the trace first: its axis needs every time.
    let text = read_drawn(input)?;
    let events = timeline::events(limiter, &String::from_utf8_lossy(&text));
    let title = title_of(&args);
    let axis = timeline::Axis::new(&events, args.width);
    let dated = is_dated(&String::from_utf8_lossy(&text));
    let mut drawing = timeline::Timeline::new(axis, limiter, memory, clock.clone(), title)
        .dated(dated)
        .regions(backends);
    match &mut in_regions {
        Some(r) => simulate::run_in_regions(r, &clock, &text[..], stdout, &mut drawing).await,
        None => simulate::run_observed(limiter, &clock, &text[..], stdout, &mut drawing).await,
    }
    .map_err(|e| e.to_string())?;
    if let Some(out) = svg {
        out.write(&drawing.svg())?;
    }
    if let Some(out) = html {
        out.write(&drawing.html())?;
    }
    Ok(())
}

/// The limiters a run decides with: one per simulated region, or one over memory or over
/// the Redis at `--redis`.
async fn limiters_for(
    args: &Args,
    limits: Limits,
    regions: Option<&SimulatedRegions>,
    memory: &MemoryBackend,
    clock: &ManualClock,
) -> Result<Vec<Limiter>, String> {
    Ok(match (regions, &args.redis) {
        (Some(r), _) => (r.regions().iter())
            .map(|(_, backend)| Limiter::new(limits.clone(), backend.clone()))
            .collect(),
        (None, None) => vec![Limiter::new(limits, memory.clone())],
        (None, Some(url)) => vec![Limiter::with_shared_backend(
            limits,
            redis_backend(url, clock).await?,
        )],
    })
}

/// Where the trace is read from: the generated one, the file, or standard input.
fn input_of<'a>(
    generated: Option<&'a str>,
    trace: Option<&std::path::Path>,
) -> Result<Box<dyn BufRead + 'a>, String> {
    Ok(match (generated, trace) {
        (Some(text), _) => Box::new(text.as_bytes()),
        (None, None) => Box::new(BufReader::new(std::io::stdin())),
        (None, Some(p)) => match std::fs::File::open(p) {
            Ok(f) => Box::new(BufReader::new(f)),
            Err(e) => return Err(format!("{}: {e}", p.display())),
        },
    })
}

/// The whole trace, for a drawing (its axis needs every time): at most
/// `MAX_DRAWN_TRACE_BYTES`.
fn read_drawn(input: impl Read) -> Result<Vec<u8>, String> {
    let mut text = Vec::new();
    input
        .take(MAX_DRAWN_TRACE_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| format!("reading the trace: {e}"))?;
    if text.len() as u64 > MAX_DRAWN_TRACE_BYTES {
        return Err(format!(
            "the trace is larger than {} MiB, the most a drawing reads",
            MAX_DRAWN_TRACE_BYTES >> 20
        ));
    }
    Ok(text)
}

/// A drawing's title: the limits file and where the trace came from.
fn title_of(args: &Args) -> String {
    format!(
        "{} · {}",
        args.defaults.display(),
        match (&args.generate, &args.trace) {
            (Some(phrase), _) => format!("--generate \"{phrase}\""),
            (None, Some(p)) => p.display().to_string(),
            (None, None) => "standard input".into(),
        }
    )
}

/// Whether a trace's first line is dated: then it is drawn on an axis of UTC dates.
fn is_dated(text: &str) -> bool {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| !l.is_empty())
        .and_then(|l| l.split_whitespace().next())
        .is_some_and(|time| time.ends_with('Z') && time.contains('T'))
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
        // Prefetched tokens and the deny cache are a deployment's optimisations: a trace
        // decides as if no limit had `prefetch`, and evaluates every transaction of a denied
        // batch (the deny cache leaves them unevaluated), exactly as in memory.
        .prefetch(false)
        .deny_cache(false)
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
    Err("--redis needs the `redis` feature: build the simulator with `--features redis`".into())
}
