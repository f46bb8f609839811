//! Streams in a trace (`trace.rs`, "Streams"): `open` builds a stream's meter on the trace's
//! limiter (its keys counted per message, or `unit:` per unit; `ahead=<n>` grants), `message`
//! admits one message of `units=<n>` through it, `close` ends it and gives back its grants.
//! A trace's clock does not wait: a stream ends at its first refusal.

use std::collections::HashMap;

use serde::Serialize;

use tower_ratelimits::{AtLimit, Limiter, StreamLimited, StreamMeter};

use super::{SimulateError, micros, transaction_of};

/// The most streams a trace holds open at once.
const MAX_OPEN: usize = 10_000;

/// Whether `op` is a stream's.
pub(super) fn is_stream_op(op: &str) -> bool {
    matches!(op, "open" | "message" | "close")
}

/// The streams a trace holds open, by name.
#[derive(Default)]
pub(super) struct Streams {
    open: HashMap<String, StreamMeter>,
}

#[derive(Serialize)]
struct OpenOut<'a> {
    line: usize,
    at_us: u64,
    op: &'static str,
    stream: &'a str,
    keys: Vec<&'a str>,
}

#[derive(Serialize)]
struct MessageOut<'a> {
    line: usize,
    at_us: u64,
    op: &'static str,
    stream: &'a str,
    allowed: bool,
    units: u64,
    /// The stream's messages and units admitted so far.
    messages: u64,
    stream_units: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refused: Option<&'static str>,
}

#[derive(Serialize)]
struct CloseOut<'a> {
    line: usize,
    at_us: u64,
    op: &'static str,
    stream: &'a str,
    messages: u64,
    stream_units: u64,
}

/// A stream line's words after its time and op: the stream's name and the rest.
struct Words<'a> {
    stream: &'a str,
    rest: Vec<&'a str>,
}

fn words<'a>(op: &str, mut words: impl Iterator<Item = &'a str>) -> Result<Words<'a>, String> {
    let stream = words
        .next()
        .ok_or_else(|| format!("{op} names no stream: write <time> {op} <stream> ..."))?;
    if stream.contains('=') || stream.starts_with('@') {
        return Err(format!(
            "{stream:?} is not a stream's name: write <time> {op} <stream> ..."
        ));
    }
    Ok(Words {
        stream,
        rest: words.collect(),
    })
}

impl Streams {
    /// Line `line` (at `at_us`, of `op`, its words after them) on `limiter`: its JSON line.
    pub(super) async fn step<'a>(
        &mut self,
        limiter: &Limiter,
        line: usize,
        at_us: u64,
        op: &str,
        text: impl Iterator<Item = &'a str>,
    ) -> Result<String, SimulateError> {
        let bad = |reason: String| SimulateError::Line { line, reason };
        let w = words(op, text).map_err(bad)?;
        let json = match op {
            "open" => {
                let keys = self.open(limiter, &w).map_err(bad)?;
                let stream = w.stream;
                serde_json::to_string(&OpenOut {
                    line,
                    at_us,
                    op: "open",
                    stream,
                    keys,
                })
            }
            "message" => {
                let units = units(&w.rest).map_err(bad)?;
                let meter = self.meter(w.stream).map_err(bad)?;
                let result = meter.admit(units).await;
                serde_json::to_string(&message_out(line, at_us, w.stream, units, meter, result))
            }
            _ => {
                if !w.rest.is_empty() {
                    return Err(bad("close takes only the stream's name".into()));
                }
                let meter = self
                    .open
                    .remove(w.stream)
                    .ok_or_else(|| bad(unknown(w.stream)))?;
                let (messages, stream_units) = (meter.messages(), meter.units());
                meter
                    .close()
                    .await
                    .map_err(|source| SimulateError::Limiter { line, source })?;
                serde_json::to_string(&CloseOut {
                    line,
                    at_us,
                    op: "close",
                    stream: w.stream,
                    messages,
                    stream_units,
                })
            }
        };
        json.map_err(|e| bad(e.to_string()))
    }

    /// `open <stream> [unit:]<Name>=<id> ... [ahead=<n>]`: its meter built; the keys' texts.
    fn open<'a>(&mut self, limiter: &Limiter, w: &Words<'a>) -> Result<Vec<&'a str>, String> {
        if self.open.contains_key(w.stream) {
            return Err(format!("stream {:?} is open already", w.stream));
        }
        if self.open.len() >= MAX_OPEN {
            return Err(format!("more than {MAX_OPEN} streams open at once"));
        }
        let mut builder = StreamMeter::builder(limiter).at_limit(AtLimit::End);
        let mut keys = Vec::new();
        for spec in &w.rest {
            if let Some(n) = spec.strip_prefix("ahead=") {
                let n = n
                    .parse()
                    .map_err(|_| format!("ahead={n}: a whole number"))?;
                builder = builder.ahead(n);
                continue;
            }
            let (unit, key) = match spec.strip_prefix("unit:") {
                Some(key) => (true, key),
                None => (false, *spec),
            };
            if key.contains('*') || key.contains(':') {
                return Err(format!(
                    "{spec:?}: a stream's key is [unit:]<Name>=<id>, its cost the message's"
                ));
            }
            let (text, tx) = transaction_of(limiter, "spend", key, None)?;
            let key = tx.key().clone();
            builder = if unit {
                builder.per_unit(key)
            } else {
                builder.per_message(key)
            };
            keys.push(text);
        }
        let meter = builder.build().map_err(|e| e.to_string())?;
        self.open.insert(w.stream.to_owned(), meter);
        Ok(keys)
    }

    fn meter(&mut self, stream: &str) -> Result<&mut StreamMeter, String> {
        self.open.get_mut(stream).ok_or_else(|| unknown(stream))
    }
}

fn unknown(stream: &str) -> String {
    format!("stream {stream:?} is not open: open it first (<time> open <stream> <Name>=<id> ...)")
}

/// A message line's `units=<n>` (default 1).
fn units(rest: &[&str]) -> Result<u64, String> {
    match rest {
        [] => Ok(1),
        [one] => one
            .strip_prefix("units=")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("{one:?}: write units=<n>")),
        _ => Err("a message takes units=<n> and nothing else".into()),
    }
}

fn message_out<'a>(
    line: usize,
    at_us: u64,
    stream: &'a str,
    units: u64,
    meter: &StreamMeter,
    result: Result<(), StreamLimited>,
) -> MessageOut<'a> {
    let (limit, retry_after_us, refused) = match &result {
        Ok(()) => (None, None, None),
        Err(StreamLimited::Limited {
            limit, retry_after, ..
        }) => (
            Some(limit.to_string()),
            Some(micros(*retry_after)),
            Some("limited"),
        ),
        Err(StreamLimited::TooLarge { limit, .. }) => {
            (Some(limit.to_string()), None, Some("too_large"))
        }
        Err(StreamLimited::Ended) => (None, None, Some("ended")),
        Err(_) => (None, None, Some("failed")),
    };
    MessageOut {
        line,
        at_us,
        op: "message",
        stream,
        allowed: result.is_ok(),
        units,
        messages: meter.messages(),
        stream_units: meter.units(),
        retry_after_us,
        limit,
        refused,
    }
}
