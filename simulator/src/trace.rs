//! The trace simulator behind `cargo run --example simulate`: runs a trace through a real
//! `Limiter` on a `ManualClock` and writes one JSON object per trace line.
//!
//! # Trace format
//!
//! `<time> <op> <tx> [<tx> ...] [cost=<n>] [@<region>]`, one request per line; blank lines and
//! comments (`#` at the start of a line or after white space) are skipped.
//! - `<time>`: since the trace start, an integer or decimal with unit `us`, `ms` or `s`
//!   (`0ms`, `1.01s`, `250us`), or a date: a UTC instant `YYYY-MM-DDTHH:MM:SS[.ffffff]Z`
//!   (`2028-02-28T23:59:59.999999Z`), for calendar quotas. The trace starts at
//!   [`EPOCH_US`] (2023-11-14T22:13:20Z): a date is that far after it, and one before it is an
//!   error. Times must not go backwards.
//! - `<op>`: `spend`, `check`, `refund`, `charge`, `reset` or `release`. A `spend` on a
//!   concurrency limit (`concurrency: N`) takes a slot when allowed; `release` gives back the
//!   oldest slot each listed key took in the trace and still holds (none held: nothing
//!   happens); on an adaptive concurrency limit (`concurrency: {adaptive: ...}`) the release
//!   is the request's completion, its latency the time since its spend, and `release ...
//!   failed` (the word after the transactions, before a region) makes it a failure, as a 5xx
//!   is to the layer. `charge` charges its cost after the fact, as a settle's overrun is: never
//!   denied, it takes as many units as fit within the limit's `max_debt` below empty (on a
//!   tiered limit: all of them when they fit, else none; on a concurrency limit it takes a
//!   slot even when none is free); its transactions take no mode prefix.
//! - `<tx>`: `[check-only:|spend-only:]<Name>=<id>[*<cost>]`. All transactions of a line are
//!   one batch; `*<cost>` overrides the line's cost for that transaction.
//! - `@<region>`: in a run in regions (`--regions eu:60%,us:40%`), the region whose limiter
//!   decides the line (last on the line, after the cost); a line without it goes to a region
//!   by the percentages (`TraceRegions`). Naming a region not in `--regions`, or any region in
//!   a run without `--regions`, is an error.
//! - Streams: `<time> open <stream> [unit:]<Name>=<id> ... [ahead=<n>]` builds a stream's
//!   meter (each key counted per message, or by the message's units with `unit:`; `ahead=<n>`:
//!   units for n messages taken ahead in grants); `<time> message <stream> [units=<n>]` admits
//!   one message (default 1 unit), all its keys in one batch; `<time> close <stream>` ends it
//!   and gives back what its grants still hold. A trace's clock does not wait: a stream ends at
//!   its first refusal, and every later message of it is refused. At most 10,000 streams open
//!   at once; not in a run in regions.
//! - `cost=<n>`: the line's cost (default: the limit's configured cost, 1 unless set).
//!   `cost=<min>..<max>` (or `*<min>..<max>`) asks for as many units as the limit grants
//!   between `min` and `max` (a partial grant, on GCRA and tiered limits).
//!
//! # Output
//!
//! `{"line":N,"at_us":T,"op":"spend","allowed":bool,"remaining":R,"retry_after_us":X,
//! "reset_after_us":Y,"decisions":[{"limit":"Name","id":"...","allowed":bool,"remaining":R,
//! "retry_after_us":X,"reset_after_us":Y}, ...]}`; the top-level fields are the batch decision
//! (its strictest transaction); in a run in regions, `"region":"eu"` after `"op"` (and after
//! `"released"` on a `reset` or `release` line) names the region that decided it. `at_us` is the line's time in microseconds since the trace's
//! start, [`EPOCH_US`] (2023-11-14T22:13:20Z): `250ms` is 250000, and a dated line's is its
//! instant less the start (`2028-02-01T00:00:00Z` is 132976000000000). The decision of a range (`cost=<min>..<max>`), of a charge and
//! of a tiered limit also has `"granted":G` (units granted or charged); a tiered one also has `"tiers":[units per
//! tier]`, `"burst":bool` (it burst into a higher tier) and `"tier":N` (the tier serving the
//! client, or the one that refused). A transaction the
//! backend did not evaluate, because another one already denied the batch (the Redis deny
//! cache, which the simulator's `--redis` leaves off), has `"skipped":true` and zero numbers;
//! the memory backend never skips. A `reset`
//! line prints `{"line":N,"at_us":T,"op":"reset","keys":["Name=id",...]}`. A decision that
//! took a slot on a concurrency limit has `"lease":true`, and one on an adaptive limit
//! `"slots":N` (the key's number when decided); a `release` line prints
//! `{"line":N,"at_us":T,"op":"release","keys":["Name=id",...],"released":K}` (K: the slots
//! that were still held, not ended at their lease time). A decision denied because its key is
//! banned by its limit's penalty ladder has `"banned":true` (its `retry_after_us`: the ban's
//! end). A stream's lines print `{"line":N,"at_us":T,"op":"open","stream":"s","keys":[..]}`,
//! `{"line":N,"at_us":T,"op":"message","stream":"s","allowed":bool,"units":U,"messages":M,
//! "stream_units":S}` (M and S: what the stream was admitted so far; when refused, also
//! `"retry_after_us"` and `"limit"` when a limit refused it, and `"refused"`: `limited`,
//! `too_large`, `ended` or `failed`) and `{"line":N,"at_us":T,"op":"close","stream":"s",
//! "messages":M,"stream_units":S}`.
//!
//! `tests/simulate.rs` runs it on the worked examples, and `tests/conformance.rs` runs the same
//! traces through memory, a Redis and a cluster. The file is part of the `simulate` example,
//! not of the library: the tests include it by path.

use std::io::{BufRead, Write};

#[path = "trace/streams.rs"]
mod streams;

use serde::Serialize;

use tower_ratelimits::__private::SimulatedRegions;
use tower_ratelimits::{
    BatchDecision, BucketKey, Completion, Limiter, LimiterError, ManualClock, Mode, Transaction,
};

/// The absolute time (microseconds since the Unix epoch) of trace time zero: 2023-11-14.
pub const EPOCH_US: u64 = 1_700_000_000_000_000;

/// Why a trace could not be run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// A malformed line.
    #[error("line {line}: {reason}")]
    Line {
        /// The 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The limiter refused a line (unknown name, cost above burst, backend failure).
    #[error("line {line}: {source}")]
    Limiter {
        /// The 1-based line number.
        line: usize,
        /// The limiter's error.
        source: LimiterError,
    },
    /// Reading the trace or writing the output failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The longest trace line accepted, in bytes (a longer one is an error, never a growing
/// buffer).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Parses a trace time (`0ms`, `1.01s`, `250us`, or a date `2028-02-29T00:00:00Z`) into
/// microseconds since the trace start (tested in `tests/simulate.rs`).
pub fn parse_time_us(text: &str) -> Result<u64, String> {
    if text.ends_with('Z') && text.contains('T') {
        let at = tower_ratelimits::__private::parse_instant(text).map_err(|e| e.to_string())?;
        return at
            .checked_sub(EPOCH_US)
            .ok_or_else(|| format!("{text:?} is before the trace's start, 2023-11-14T22:13:20Z"));
    }
    let (number, scale, digits) = if let Some(n) = text.strip_suffix("us") {
        (n, 1u64, 0usize)
    } else if let Some(n) = text.strip_suffix("ms") {
        (n, 1_000, 3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1_000_000, 6)
    } else {
        return Err(format!("time {text:?} needs a unit: us, ms or s"));
    };
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !all_digits(whole) || !all_digits(frac) || number.ends_with('.') {
        return Err(format!("malformed time {text:?}"));
    }
    let frac_trimmed = frac.trim_end_matches('0');
    if frac_trimmed.len() > digits {
        return Err(format!("time {text:?} is finer than a microsecond"));
    }
    let too_large = || format!("time {text:?} is too large");
    let whole: u64 = whole.parse().map_err(|_| too_large())?;
    let mut frac_us: u64 = 0;
    if !frac_trimmed.is_empty() {
        let f: u64 = frac_trimmed.parse().map_err(|_| too_large())?;
        frac_us = f
            * 10u64.pow((digits - frac_trimmed.len()) as u32)
            * (scale / 10u64.pow(digits as u32));
    }
    whole
        .checked_mul(scale)
        .and_then(|w| w.checked_add(frac_us))
        .ok_or_else(too_large)
}

#[derive(Serialize)]
struct TxOut<'a> {
    limit: &'a str,
    id: String,
    allowed: bool,
    remaining: u64,
    retry_after_us: u64,
    reset_after_us: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    granted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tiers: Option<&'a [u64]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier: Option<u8>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    skipped: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    lease: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    slots: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    banned: bool,
}

/// Parses `<n>` or `<min>..<max>`.
fn parse_cost(text: &str) -> Result<(Option<u64>, u64), String> {
    let number = |t: &str| {
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("malformed cost {text:?}"));
        }
        t.parse::<u64>()
            .map_err(|_| format!("cost {text:?} is too large"))
    };
    match text.split_once("..") {
        Some((min, max)) => Ok((Some(number(min)?), number(max)?)),
        None => Ok((None, number(text)?)),
    }
}

#[derive(Serialize)]
struct LineOut<'a> {
    line: usize,
    at_us: u64,
    op: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    region: Option<&'a str>,
    allowed: bool,
    remaining: u64,
    retry_after_us: u64,
    reset_after_us: u64,
    decisions: Vec<TxOut<'a>>,
}

#[derive(Serialize)]
struct ResetOut<'a> {
    line: usize,
    at_us: u64,
    op: &'a str,
    keys: Vec<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    region: Option<&'a str>,
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

struct ParsedLine<'a> {
    at_us: u64,
    op: &'a str,
    txs: Vec<(&'a str, Transaction)>,
    /// The region named after the line's tokens (`@eu`), if any.
    region: Option<&'a str>,
    /// A `release ... failed`: the requests it ends failed.
    failed: bool,
}

fn parse_line<'a>(limiter: &Limiter, text: &'a str) -> Result<ParsedLine<'a>, String> {
    let mut words = text.split_whitespace();
    let time = words.next().ok_or("empty line")?;
    let at_us = parse_time_us(time)?;
    let op = words.next().ok_or(
        "missing operation (spend, check, refund, charge, reset, release, open, message, close)",
    )?;
    if !matches!(
        op,
        "spend" | "check" | "refund" | "charge" | "reset" | "release"
    ) {
        return Err(format!(
            "unknown operation {op:?}: use spend, check, refund, charge, reset, release, open, message or close"
        ));
    }
    let mut specs: Vec<&str> = words.collect();
    // `@<region>` after the line's tokens: the region that decides it.
    let mut region = None;
    if let Some(last) = specs.last()
        && let Some(name) = last.strip_prefix('@')
    {
        if name.is_empty() {
            return Err("`@` names no region: write @<region>".into());
        }
        region = Some(name);
        specs.pop();
    }
    // `failed` after a release's transactions: its requests failed.
    let mut failed = false;
    if specs.last() == Some(&"failed") {
        if op != "release" {
            return Err("`failed` marks a release: write <time> release <tx> ... failed".into());
        }
        failed = true;
        specs.pop();
    }
    let mut line_cost: Option<(Option<u64>, u64)> = None;
    if let Some(last) = specs.last()
        && let Some(c) = last.strip_prefix("cost=")
    {
        line_cost = Some(parse_cost(c)?);
        specs.pop();
    }
    if specs.is_empty() {
        return Err("no transaction: write <Name>=<id>".into());
    }
    let txs = specs
        .into_iter()
        .map(|spec| transaction_of(limiter, op, spec, line_cost))
        .collect::<Result<Vec<_>, String>>()?;
    Ok(ParsedLine {
        at_us,
        op,
        txs,
        region,
        failed,
    })
}

/// One transaction of a line of `op`: `[check-only:|spend-only:]<Name>=<id>[*<cost>]`, the
/// line's `cost=` when it gives none; with its text after the mode prefix.
fn transaction_of<'a>(
    limiter: &Limiter,
    op: &str,
    spec: &'a str,
    line_cost: Option<(Option<u64>, u64)>,
) -> Result<(&'a str, Transaction), String> {
    if spec.starts_with('@') {
        return Err(format!(
            "{spec:?}: a region goes last on its line, after the cost (`... cost=2 @eu`)"
        ));
    }
    let (mode, rest) = if let Some(r) = spec.strip_prefix("check-only:") {
        (Mode::CheckOnly, r)
    } else if let Some(r) = spec.strip_prefix("spend-only:") {
        (Mode::SpendOnly, r)
    } else {
        (Mode::CheckAndSpend, spec)
    };
    let mode = match (op, mode) {
        ("charge", Mode::CheckAndSpend) => Mode::Charge,
        ("charge", _) => {
            return Err(format!(
                "{spec:?}: a charge takes no mode prefix (it is never denied)"
            ));
        }
        (_, mode) => mode,
    };
    let (name, id) = rest
        .split_once('=')
        .ok_or_else(|| format!("malformed transaction {spec:?}: write <Name>=<id>"))?;
    let (id, cost) = cost_suffix(id, spec)?;
    let key = limiter.parse_key(name, id).map_err(|e| e.to_string())?;
    let mut tx = Transaction::new(key).mode(mode);
    match cost.or(line_cost) {
        Some((Some(min), max)) => tx = tx.cost_range(min..=max),
        Some((None, c)) => tx = tx.cost(c),
        None => {}
    }
    Ok((rest, tx))
}

/// An id and its cost suffix, `*<n>` or `*<min>..<max>`. A suffix that starts like a cost (a
/// digit, `-` or `.`) but is not one is an error; anything else after a `*` is part of the id.
#[allow(clippy::type_complexity)]
fn cost_suffix<'a>(
    id: &'a str,
    spec: &str,
) -> Result<(&'a str, Option<(Option<u64>, u64)>), String> {
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let is_cost = |c: &str| match c.split_once("..") {
        Some((min, max)) => digits(min) && digits(max),
        None => digits(c),
    };
    let like_cost = |c: &str| matches!(c.bytes().next(), Some(b'0'..=b'9' | b'-' | b'.'));
    match id.rsplit_once('*') {
        Some((id, c)) if is_cost(c) => Ok((id, Some(parse_cost(c)?))),
        Some((_, c)) if like_cost(c) => Err(format!(
            "malformed cost suffix *{c} in {spec:?}: write *<n> or *<min>..<max>"
        )),
        _ => Ok((id, None)),
    }
}

/// The time and keys of a trace line, or `None` for a blank, comment or malformed line (the
/// run reports those). For a pass over a trace before running it (the timeline's axis).
pub fn peek(limiter: &Limiter, line: &str) -> Option<(u64, Vec<BucketKey>)> {
    let text = strip_comment(line).trim();
    if text.is_empty() {
        return None;
    }
    let parsed = parse_line(limiter, text).ok()?;
    Some((
        parsed.at_us,
        parsed.txs.iter().map(|(_, t)| t.key().clone()).collect(),
    ))
}

/// Whether a trace line parses: its time, operation, limit names and ids.
pub fn check_line(limiter: &Limiter, line: &str) -> Result<(), String> {
    parse_line(limiter, strip_comment(line).trim()).map(|_| ())
}

fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let cut = (0..bytes.len())
        .find(|&i| bytes[i] == b'#' && (i == 0 || bytes[i - 1].is_ascii_whitespace()));
    cut.map_or(line, |i| &line[..i])
}

/// What watches a run besides its JSON output (the timeline drawing, `timeline.rs`): told
/// before the clock moves to a line's time, and what each line decided or changed.
pub trait Observer {
    /// The clock is about to move from the previous line's time to `at_us` (trace time).
    fn advance(&mut self, _at_us: u64) {}
    /// A `spend`, `check` or `refund` line was decided: its transactions and their decisions.
    fn decided(
        &mut self,
        _line: usize,
        _at_us: u64,
        _op: &str,
        _txs: &[Transaction],
        _batch: &BatchDecision,
    ) {
    }
    /// A `reset` or `release` line was applied to these keys.
    fn changed(&mut self, _line: usize, _at_us: u64, _op: &str, _keys: &[BucketKey]) {}
    /// The next line is decided in region `region` (its position in `--regions`), told
    /// before [`decided`](Self::decided) or [`changed`](Self::changed) of every line of a run
    /// in regions.
    fn in_region(&mut self, _region: usize) {}
}

/// Nothing watches.
impl Observer for () {}

/// Runs a trace, writing one JSON line per request. Stops at the first bad line.
pub async fn run(
    limiter: &Limiter,
    clock: &ManualClock,
    input: impl BufRead,
    output: impl Write,
) -> Result<(), SimulateError> {
    run_observed(limiter, clock, input, output, &mut ()).await
}

/// [`run`], telling `observer` what happens.
pub async fn run_observed(
    limiter: &Limiter,
    clock: &ManualClock,
    input: impl BufRead,
    output: impl Write,
    observer: &mut impl Observer,
) -> Result<(), SimulateError> {
    run_on(Deciders::One(limiter), clock, input, output, observer).await
}

/// The regions a trace runs in (`--regions eu:60%,us:40%`): simulated regions of one limit
/// across regions (`SimulatedRegions`, moving shares on the trace's clock), a limiter per
/// region over its backend, and how the lines that name no region (`@eu`) are split: by a
/// smooth weighted round robin of the percentages, so any 100 lines in a row hold each
/// region's percentage to within one line.
pub struct TraceRegions<'a> {
    names: Vec<String>,
    percents: Vec<u64>,
    limiters: &'a [Limiter],
    regions: &'a mut SimulatedRegions,
    /// The round robin's credit per region.
    credit: Vec<i64>,
}

impl<'a> TraceRegions<'a> {
    /// Regions `names` (each with a limiter over its backend in `regions`, in its order)
    /// taking `percents` of the lines that name none.
    pub fn new(
        names: Vec<String>,
        percents: Vec<u64>,
        limiters: &'a [Limiter],
        regions: &'a mut SimulatedRegions,
    ) -> Self {
        Self {
            credit: vec![0; names.len()],
            names,
            percents,
            limiters,
            regions,
        }
    }

    /// The region of the next line that names none.
    fn split(&mut self) -> usize {
        let total: i64 = self.percents.iter().map(|&p| p as i64).sum();
        for (c, &p) in self.credit.iter_mut().zip(&self.percents) {
            *c += p as i64;
        }
        let pick = (0..self.credit.len())
            .max_by_key(|&i| (self.credit[i], std::cmp::Reverse(i)))
            .unwrap_or(0);
        self.credit[pick] -= total;
        pick
    }
}

/// Where a run's lines are decided.
enum Deciders<'r, 'a> {
    One(&'a Limiter),
    Regions(&'r mut TraceRegions<'a>),
}

/// [`run_observed`] in regions: each line decided by its region's limiter (`"region"` in its
/// JSON), the shares moved between lines at the instants they are due.
pub async fn run_in_regions(
    regions: &mut TraceRegions<'_>,
    clock: &ManualClock,
    input: impl BufRead,
    output: impl Write,
    observer: &mut impl Observer,
) -> Result<(), SimulateError> {
    run_on(Deciders::Regions(regions), clock, input, output, observer).await
}

async fn run_on(
    mut deciders: Deciders<'_, '_>,
    clock: &ManualClock,
    mut input: impl BufRead,
    mut output: impl Write,
    observer: &mut impl Observer,
) -> Result<(), SimulateError> {
    let first = match &deciders {
        Deciders::One(limiter) => *limiter,
        Deciders::Regions(r) => match r.limiters.first() {
            Some(limiter) => limiter,
            None => return Ok(()),
        },
    };
    let mut last_us = 0u64;
    let mut buf = Vec::new();
    let mut held = Held::new();
    let mut streams = streams::Streams::default();
    for number in 1.. {
        let Some(line) = next_line(&mut input, &mut buf, number)? else {
            break;
        };
        // A comment starts with '#' at the beginning of a line or after white space, so an
        // id may contain '#'.
        let text = strip_comment(line).trim();
        if text.is_empty() {
            continue;
        }
        let bad = |reason: String| SimulateError::Line {
            line: number,
            reason,
        };
        if let Some(json) =
            stream_line(&mut streams, &deciders, clock, number, text, &mut last_us).await?
        {
            writeln!(output, "{json}")?;
            continue;
        }
        let parsed = parse_line(first, text).map_err(bad)?;
        if parsed.at_us < last_us {
            return Err(bad(format!(
                "time goes backwards ({}us after {}us)",
                parsed.at_us, last_us
            )));
        }
        last_us = parsed.at_us;
        let at = EPOCH_US.saturating_add(parsed.at_us);
        let (region, limiter) = deciders.pick(parsed.region, at, observer).map_err(bad)?;
        observer.advance(parsed.at_us);
        clock.set(at);
        let step = Step {
            number,
            parsed: &parsed,
            region,
            limiter,
        };
        let json = if matches!(parsed.op, "reset" | "release") {
            step.change(&mut held, observer).await?
        } else {
            step.decide(&mut held, observer).await?
        };
        writeln!(output, "{json}")?;
    }
    output.flush()?;
    Ok(())
}

/// Line `number` when it is a stream's (`open`, `message`, `close`): its JSON line, decided
/// on the trace's one limiter at its time (the clock set, `last_us` moved); `None` for any
/// other line.
async fn stream_line(
    streams: &mut streams::Streams,
    deciders: &Deciders<'_, '_>,
    clock: &ManualClock,
    number: usize,
    text: &str,
    last_us: &mut u64,
) -> Result<Option<String>, SimulateError> {
    let mut words = text.split_whitespace();
    let (Some(time), Some(op)) = (words.next(), words.next()) else {
        return Ok(None);
    };
    if !streams::is_stream_op(op) {
        return Ok(None);
    }
    let bad = |reason: String| SimulateError::Line {
        line: number,
        reason,
    };
    let Deciders::One(limiter) = deciders else {
        return Err(bad(
            "streams are simulated in a run without --regions".into()
        ));
    };
    let at_us = parse_time_us(time).map_err(bad)?;
    if at_us < *last_us {
        return Err(bad(format!(
            "time goes backwards ({at_us}us after {last_us}us)"
        )));
    }
    *last_us = at_us;
    clock.set(EPOCH_US.saturating_add(at_us));
    streams
        .step(limiter, number, at_us, op, words)
        .await
        .map(Some)
}

/// The slots the trace's spends hold, oldest first per region and key, each with its spend's
/// time (for `release`: an adaptive limit learns the request's latency).
type Held = std::collections::HashMap<
    (usize, BucketKey),
    std::collections::VecDeque<(tower_ratelimits::Lease, u64)>,
>;

/// Line `number` of `input` into `buf`, without its line ending; `None` at the end. Bounded: a
/// line that never ends costs at most `MAX_LINE_BYTES` of memory.
fn next_line<'b>(
    input: &mut impl BufRead,
    buf: &'b mut Vec<u8>,
    number: usize,
) -> Result<Option<&'b str>, SimulateError> {
    buf.clear();
    let read =
        std::io::Read::take(&mut *input, MAX_LINE_BYTES as u64 + 1).read_until(b'\n', buf)?;
    if read == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_LINE_BYTES {
        return Err(SimulateError::Line {
            line: number,
            reason: format!("too long (more than {MAX_LINE_BYTES} bytes)"),
        });
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    match std::str::from_utf8(buf) {
        Ok(line) => Ok(Some(line)),
        Err(_) => Err(SimulateError::Line {
            line: number,
            reason: "not UTF-8".into(),
        }),
    }
}

impl<'a> Deciders<'_, 'a> {
    /// The region a line at `at` is decided in (the one it names, else the round robin's) and
    /// its limiter; the regions' shares moved first at the instants they were due, drawn as
    /// they do.
    fn pick(
        &mut self,
        named: Option<&str>,
        at: u64,
        observer: &mut impl Observer,
    ) -> Result<(Option<Region<'_>>, &'a Limiter), String> {
        let r = match (self, named) {
            (Deciders::One(limiter), None) => return Ok((None, *limiter)),
            (Deciders::One(_), Some(name)) => {
                return Err(format!(
                    "the line names region {name:?}, but the trace runs in none: give --regions"
                ));
            }
            (Deciders::Regions(r), _) => r,
        };
        let i = match named {
            None => r.split(),
            Some(name) => r.names.iter().position(|n| n == name).ok_or_else(|| {
                format!(
                    "unknown region {name:?}: --regions names {}",
                    r.names.join(", ")
                )
            })?,
        };
        while r.regions.next_at() <= at {
            let step = r.regions.next_at();
            observer.advance(step - EPOCH_US);
            r.regions
                .advance(step)
                .map_err(|e| format!("moving the regions' shares: {e}"))?;
        }
        observer.in_region(i);
        let limiters = r.limiters;
        Ok((Some((i, r.names[i].as_str())), &limiters[i]))
    }
}

/// A region a line is decided in: its position and its name.
type Region<'n> = (usize, &'n str);

/// One line of a trace, decided by `limiter` (in `region`, with its number).
struct Step<'s> {
    number: usize,
    parsed: &'s ParsedLine<'s>,
    region: Option<Region<'s>>,
    limiter: &'s Limiter,
}

impl Step<'_> {
    fn failed(&self, source: LimiterError) -> SimulateError {
        SimulateError::Limiter {
            line: self.number,
            source,
        }
    }

    fn txs(&self) -> Vec<Transaction> {
        self.parsed.txs.iter().map(|(_, t)| t.clone()).collect()
    }

    /// A `reset`, or a `release` of the oldest slot each key holds with its request's
    /// completion (a limit that does not learn ignores it): its JSON line.
    async fn change(
        &self,
        held: &mut Held,
        observer: &mut impl Observer,
    ) -> Result<String, SimulateError> {
        let parsed = self.parsed;
        let keys: Vec<_> = self.txs().iter().map(|t| t.key().clone()).collect();
        let slot = self.region.map_or(0, |r| r.0);
        let released = if parsed.op == "reset" {
            self.limiter
                .reset(&keys)
                .await
                .map_err(|e| self.failed(e))?;
            None
        } else {
            let mut released = 0;
            for key in &keys {
                if let Some((lease, taken_us)) = held
                    .get_mut(&(slot, key.clone()))
                    .and_then(|q| q.pop_front())
                {
                    let latency = parsed.at_us.saturating_sub(taken_us);
                    let done =
                        Completion::new(std::time::Duration::from_micros(latency), parsed.failed);
                    released += self
                        .limiter
                        .complete(&[lease], done)
                        .await
                        .map_err(|e| self.failed(e))?;
                }
            }
            Some(released)
        };
        observer.changed(self.number, parsed.at_us, parsed.op, &keys);
        self.json(&ResetOut {
            line: self.number,
            at_us: parsed.at_us,
            op: parsed.op,
            keys: parsed.txs.iter().map(|(s, _)| *s).collect(),
            released,
            region: self.region.map(|r| r.1),
        })
    }

    /// A spend, check, charge or refund: its decisions, the slots its spends hold, and its
    /// JSON line.
    async fn decide(
        &self,
        held: &mut Held,
        observer: &mut impl Observer,
    ) -> Result<String, SimulateError> {
        let parsed = self.parsed;
        let txs = self.txs();
        let batch = match parsed.op {
            "spend" | "charge" => self.limiter.spend(&txs).await,
            "check" => self.limiter.check(&txs).await,
            _ => self.limiter.refund(&txs).await,
        }
        .map_err(|e| self.failed(e))?;
        observer.decided(self.number, parsed.at_us, parsed.op, &txs, &batch);
        for d in batch.decisions() {
            if let Some(lease) = d.lease() {
                let slot = self.region.map_or(0, |r| r.0);
                held.entry((slot, d.key().clone()))
                    .or_default()
                    .push_back((lease, parsed.at_us));
            }
        }
        let top = batch.strictest().or(batch.decisions().first());
        self.json(&LineOut {
            line: self.number,
            at_us: parsed.at_us,
            op: parsed.op,
            region: self.region.map(|r| r.1),
            allowed: batch.allowed(),
            remaining: top.map_or(0, |d| d.remaining()),
            retry_after_us: top.map_or(0, |d| micros(d.retry_after())),
            reset_after_us: top.map_or(0, |d| micros(d.reset_after())),
            decisions: batch
                .decisions()
                .iter()
                .zip(&txs)
                .map(|(d, tx)| tx_out(d, tx, parsed.op))
                .collect(),
        })
    }

    fn json(&self, out: &impl Serialize) -> Result<String, SimulateError> {
        serde_json::to_string(out).map_err(|e| SimulateError::Line {
            line: self.number,
            reason: e.to_string(),
        })
    }
}

/// One transaction's decision as its line shows it.
fn tx_out<'d>(d: &'d tower_ratelimits::Decision, tx: &Transaction, op: &str) -> TxOut<'d> {
    TxOut {
        limit: d.name().as_str(),
        id: d.key().id().to_string(),
        allowed: d.allowed(),
        remaining: d.remaining(),
        retry_after_us: micros(d.retry_after()),
        reset_after_us: micros(d.reset_after()),
        // A tiered limit, a range (a partial grant) or a charge says how much.
        granted: (d.tiers().is_some() || tx.min_cost_or(0) != tx.cost_or(0) || op == "charge")
            .then_some(d.granted()),
        tiers: d.tiers().map(|t| t.units()),
        burst: d.tiers().map(|t| t.burst),
        tier: d.tiers().map(|t| t.tier),
        skipped: d.skipped(),
        lease: d.lease_id().is_some(),
        slots: d.slots(),
        banned: d.banned(),
    }
}
