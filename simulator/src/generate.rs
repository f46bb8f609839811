//! `simulate --generate PHRASE`: a workload described in a phrase, turned into the request
//! times of a trace, so a policy can be tried without writing a trace by hand.
//!
//! # Grammar
//!
//! ```text
//! workload := phase { ("," | ";") ["then"] phase }
//! phase    := "burst" COUNT [options]                      COUNT requests at one instant
//!           | RATE "for" DURATION [options]                evenly spaced: the first one
//!                                                          interval after the phase start
//!           | "poisson" "rate=" RATE "for" DURATION [options]
//!                                                          random arrivals at that mean rate
//!           | ("idle" | "wait") DURATION                   nothing for a while
//! options  := { "at" TIME | "cost=" COUNT | "seed=" COUNT }
//! RATE     := NUMBER "/" UNIT        5/s, 0.5/s, 300/m, 2/ms, 1/250ms
//! UNIT     := "us" | "ms" | "s" | "m" | "h" | DURATION
//! TIME, DURATION := NUMBER ("us" | "ms" | "s" | "m" | "h")      0s, 1.5s, 250ms, 2m
//! ```
//!
//! A phase starts where the previous one ended (the first at `0s`; a burst ends where it
//! starts, an `idle` or a rate phase `DURATION` later), or at `at TIME` (trace time). Phases
//! may overlap; the requests are sorted by time. `cost=N` gives each request of the phase that
//! cost (otherwise the limit's configured cost). `poisson` draws exponential gaps from a
//! generator seeded with `seed=` (default 1), so a phrase always gives the same trace.
//!
//! Examples: `burst 30 at 0s, then 5/s for 20s`; `poisson rate=50/s for 10s`;
//! `10/s for 5s, idle 30s, burst 100 cost=2`.
//!
//! A generated trace holds at most [`MAX_REQUESTS`] requests; anything the grammar does not
//! accept is an error that names the column of the word at fault.

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};

use crate::trace::parse_time_us;

/// The most requests a generated trace may hold.
pub const MAX_REQUESTS: usize = 1_000_000;
/// The latest trace time a generated request may have (about 31 years).
const MAX_TIME_US: u64 = 1_000_000_000_000_000;

/// A phrase the generator does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at column {column} ({word:?}): {message}")]
pub struct GenerateError {
    /// The 1-based column (in characters) of the word at fault.
    pub column: usize,
    /// The word at fault (empty at the end of the phrase).
    pub word: String,
    /// What is wrong.
    pub message: String,
}

/// One generated request: trace time and cost (`None`: the limit's configured cost).
pub type Request = (u64, Option<u64>);

/// A word of the phrase and its 1-based column.
#[derive(Debug, Clone, Copy)]
struct Word<'a> {
    text: &'a str,
    column: usize,
}

impl Word<'_> {
    fn error(&self, message: impl Into<String>) -> GenerateError {
        GenerateError {
            column: self.column,
            word: self.text.to_owned(),
            message: message.into(),
        }
    }
}

/// Splits the phrase into phases of words, with their columns.
fn phases(phrase: &str) -> Vec<(usize, Vec<Word<'_>>)> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    let mut phase_column = 1;
    let mut word_start: Option<(usize, usize)> = None;
    for (column, (i, c)) in phrase.char_indices().enumerate() {
        let column = column + 1;
        let separator = c == ',' || c == ';';
        if separator || c.is_whitespace() {
            if let Some((s, col)) = word_start.take() {
                current.push(Word {
                    text: &phrase[s..i],
                    column: col,
                });
            }
            if separator {
                out.push((phase_column, std::mem::take(&mut current)));
                phase_column = column + 1;
            }
        } else if word_start.is_none() {
            word_start = Some((i, column));
        }
    }
    if let Some((s, col)) = word_start {
        current.push(Word {
            text: &phrase[s..],
            column: col,
        });
    }
    out.push((phase_column, current));
    out
}

/// The words of a phase still to read.
struct Words<'p, 'w> {
    rest: &'w [Word<'p>],
    /// Where the phase starts, for "the phase ends where ... was expected".
    column: usize,
}

impl<'p> Words<'p, '_> {
    fn next(&mut self, what: &str) -> Result<Word<'p>, GenerateError> {
        let (w, r) = self.rest.split_first().ok_or_else(|| GenerateError {
            column: self.column,
            word: String::new(),
            message: format!("the phase ends where {what} was expected"),
        })?;
        self.rest = r;
        Ok(*w)
    }

    /// `for <duration>`, longer than 0.
    fn for_duration(&mut self) -> Result<u64, GenerateError> {
        let w = self.next("`for <duration>`")?;
        if w.text != "for" {
            return Err(w.error("expected `for <duration>`"));
        }
        let d = self.next("a duration")?;
        let us = duration(&d)?;
        if us == 0 {
            return Err(d.error("the duration must be longer than 0"));
        }
        Ok(us)
    }
}

/// A trace time or duration: the trace's units (`us`, `ms`, `s`) plus `m` and `h`.
fn duration(word: &Word<'_>) -> Result<u64, GenerateError> {
    let text = word.text;
    if text.starts_with('-') {
        return Err(word.error("a time cannot be negative"));
    }
    let scaled = |number: &str, factor: u64| {
        parse_time_us(&format!("{number}s"))
            .map_err(|e| word.error(e))?
            .checked_mul(factor)
            .ok_or_else(|| word.error("too large"))
    };
    let us = if let Some(n) = text.strip_suffix('h') {
        scaled(n, 3600)?
    } else if let Some(n) = text.strip_suffix('m') {
        scaled(n, 60)?
    } else {
        parse_time_us(text).map_err(|e| word.error(e))?
    };
    if us > MAX_TIME_US {
        return Err(word.error("too large (at most about 31 years)"));
    }
    Ok(us)
}

/// A rate as requests per microsecond.
fn rate(word: &Word<'_>, text: &str) -> Result<f64, GenerateError> {
    let usage = "write a rate as <number>/<unit>, like 50/s, 0.5/s or 300/m";
    let (number, unit) = text.split_once('/').ok_or_else(|| word.error(usage))?;
    if number.starts_with('-') {
        return Err(word.error("a rate must be positive"));
    }
    let valid = !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && number.bytes().filter(|&b| b == b'.').count() <= 1
        && !number.starts_with('.')
        && !number.ends_with('.');
    if !valid {
        return Err(word.error(usage));
    }
    let count: f64 = number.parse().map_err(|_| word.error(usage))?;
    let per_us = match unit {
        "us" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" | "min" => 60_000_000,
        "h" => 3_600_000_000,
        other => duration(&Word {
            text: other,
            column: word.column,
        })
        .map_err(|_| word.error(usage))?,
    };
    if count <= 0.0 || per_us == 0 {
        return Err(word.error("a rate must be positive"));
    }
    let r = count / per_us as f64;
    if !r.is_finite() || r > 1.0 {
        return Err(word.error("faster than one request per microsecond"));
    }
    Ok(r)
}

fn count(word: &Word<'_>, text: &str, what: &str) -> Result<u64, GenerateError> {
    if text.starts_with('-') {
        return Err(word.error(format!("{what} cannot be negative")));
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(word.error(format!("{what} must be a whole number")));
    }
    text.parse()
        .map_err(|_| word.error(format!("{what} is too large")))
}

/// What a phase asks for, before it is placed in time.
enum Shape {
    Burst(u64),
    Steady { rate: f64, for_us: u64 },
    Poisson { rate: f64, for_us: u64 },
    Idle(u64),
}

const PHASES: &str = "a phase is `burst N`, `<rate> for <duration>`, `poisson rate=<rate> for <duration>` or `idle <duration>`";

/// The requests `phrase` describes, in time order.
pub fn generate(phrase: &str) -> Result<Vec<Request>, GenerateError> {
    let mut out: Vec<Request> = Vec::new();
    let mut cursor = 0u64;
    for (phase_column, words) in phases(phrase) {
        let mut words: &[Word<'_>] = &words;
        if words.first().is_some_and(|w| w.text == "then") {
            words = &words[1..];
        }
        let Some(first) = words.first() else {
            return Err(GenerateError {
                column: phase_column,
                word: String::new(),
                message: format!("an empty phase: {PHASES}"),
            });
        };
        let mut words = Words {
            rest: &words[1..],
            column: phase_column,
        };
        let shape = shape_of(first, &mut words)?;
        let options = words.options(cursor)?;
        let end = place(shape, &options, first, &mut out)?;
        if end > MAX_TIME_US {
            return Err(first.error("the workload runs too long (at most about 31 years)"));
        }
        cursor = end;
    }
    out.sort_by_key(|r| r.0);
    Ok(out)
}

/// What a phase starting with `first` asks for, its words read from `words`.
fn shape_of(first: &Word<'_>, words: &mut Words<'_, '_>) -> Result<Shape, GenerateError> {
    Ok(match first.text {
        "burst" => {
            let n = words.next("the number of requests")?;
            let c = count(&n, n.text, "the number of requests")?;
            if c == 0 {
                return Err(n.error("a burst needs at least one request"));
            }
            Shape::Burst(c)
        }
        "idle" | "wait" => Shape::Idle(duration(&words.next("a duration")?)?),
        "poisson" => {
            let w = words.next("`rate=<rate>`")?;
            let text = w
                .text
                .strip_prefix("rate=")
                .ok_or_else(|| w.error("expected `rate=<rate>`, like rate=50/s"))?;
            let rate = rate(&w, text)?;
            Shape::Poisson {
                rate,
                for_us: words.for_duration()?,
            }
        }
        text if text.contains('/') || text.starts_with("rate=") => {
            let rate = rate(first, text.strip_prefix("rate=").unwrap_or(text))?;
            Shape::Steady {
                rate,
                for_us: words.for_duration()?,
            }
        }
        _ => return Err(first.error(format!("unknown phase: {PHASES}"))),
    })
}

/// A phase's options: where it starts (`at <time>`, else where the last one ended), its
/// requests' cost and its random seed.
struct Options {
    start: u64,
    cost: Option<u64>,
    seed: u64,
}

impl Words<'_, '_> {
    /// The options after a phase's shape (`cursor`: where the last phase ended).
    fn options(&mut self, cursor: u64) -> Result<Options, GenerateError> {
        let mut o = Options {
            start: cursor,
            cost: None,
            seed: 1,
        };
        while let Some((w, r)) = self.rest.split_first() {
            self.rest = r;
            if w.text == "at" {
                let (t, r) = self
                    .rest
                    .split_first()
                    .ok_or_else(|| w.error("`at` needs a time"))?;
                self.rest = r;
                o.start = duration(t)?;
            } else if let Some(c) = w.text.strip_prefix("cost=") {
                o.cost = Some(count(w, c, "a cost")?);
            } else if let Some(s) = w.text.strip_prefix("seed=") {
                o.seed = count(w, s, "a seed")?;
            } else {
                return Err(
                    w.error("unexpected word: options are `at <time>`, `cost=<n>`, `seed=<n>`")
                );
            }
        }
        Ok(o)
    }
}

/// A phase's requests placed in time into `out` (at most `MAX_REQUESTS` in all, an error on
/// the phase's `first` word past it); where the phase ends.
fn place(
    shape: Shape,
    o: &Options,
    first: &Word<'_>,
    out: &mut Vec<Request>,
) -> Result<u64, GenerateError> {
    let too_many = |w: &Word<'_>, n: f64| {
        w.error(format!(
            "this would make {n:.0} requests; a generated trace holds at most {MAX_REQUESTS}"
        ))
    };
    let room = (MAX_REQUESTS - out.len()) as f64;
    let (start, cost) = (o.start, o.cost);
    Ok(match shape {
        Shape::Burst(n) => {
            if n as f64 > room {
                return Err(too_many(first, n as f64));
            }
            out.extend((0..n).map(|_| (start, cost)));
            start
        }
        Shape::Idle(d) => start.saturating_add(d),
        Shape::Steady { rate, for_us } => {
            let n = (for_us as f64 * rate + 1e-9).floor();
            if n > room {
                return Err(too_many(first, n));
            }
            out.extend((1..=n as u64).map(|k| (start + (k as f64 / rate).round() as u64, cost)));
            start.saturating_add(for_us)
        }
        Shape::Poisson { rate, for_us } => {
            if for_us as f64 * rate > room {
                return Err(too_many(first, for_us as f64 * rate));
            }
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(o.seed);
            let mut t = 0.0f64;
            loop {
                // Uniform in (0, 1]: 53 random bits.
                let u = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
                t += -u.ln() / rate;
                if t > for_us as f64 {
                    break;
                }
                if out.len() >= MAX_REQUESTS {
                    return Err(too_many(first, for_us as f64 * rate));
                }
                out.push((start + t.round() as u64, cost));
            }
            start.saturating_add(for_us)
        }
    })
}
