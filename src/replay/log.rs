//! Access logs read as requests (`docs/replay.md`, "Logs"): JSON lines and the combined log
//! format of nginx and Apache, plain or gzip, several files merged by time, lines out of order
//! sorted within a window. Streaming: one line per file and the window's lines in memory.

use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method};

use crate::time::days_from_civil;

mod line_error;
mod stream_line;
pub use line_error::LineError;
pub use stream_line::{MAX_SPREAD_MESSAGES, StreamLine, Totals};

/// The longest line read (64 KiB); a longer one is a bad line, skipped to its end.
pub const MAX_LINE_BYTES: usize = 64 << 10;
/// The most lines the reorder window holds; past it the earliest is decided at once.
const MAX_WINDOW_LINES: usize = 1 << 20;
/// The most headers a JSON line's `headers` may hold.
const MAX_HEADERS: usize = 64;

/// One request as a log recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedRequest {
    /// When it started, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// The client's address (the peer's: forwarding headers in `headers` are read by the
    /// rules' trusted proxies as in production).
    pub ip: IpAddr,
    /// The method.
    pub method: Method,
    /// The path and query.
    pub path: String,
    /// The status the server answered, when logged.
    pub status: Option<u16>,
    /// Request headers the log kept (the combined format keeps `referer` and `user-agent`).
    pub headers: HeaderMap,
    /// How long the server took to answer (a response is held this long in a replay).
    pub duration_us: u64,
    /// Its cost, when logged (see [`LoggedCost`](crate::LoggedCost)).
    pub cost: Option<u64>,
    /// The stream it opens, or the stream it is a message of (then the line is a message, not
    /// a request, and the other fields are not read): JSON lines only.
    pub stream: Option<StreamLine>,
}

impl LoggedRequest {
    /// A `GET /` from `ip` at `time_us`, answered at once.
    pub fn new(time_us: u64, ip: IpAddr) -> Self {
        Self {
            time_us,
            ip,
            method: Method::GET,
            path: "/".to_owned(),
            status: None,
            headers: HeaderMap::new(),
            duration_us: 0,
            cost: None,
            stream: None,
        }
    }
}

/// A log's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object a line: `time` (RFC 3339, to the microsecond; the request's start),
    /// `ip`, `method`, `path`, and optionally `status`, `headers` (an object of strings),
    /// `duration_ms` and `cost`; a request that opens a stream has `stream` (its id, and the
    /// stream's `messages` and `units` when the log has no line per message), and a message of
    /// one is `{time, message_of, units}` ([`StreamLine`]). Other fields are ignored.
    Json,
    /// The combined log format of nginx and Apache (`ip - user [10/Oct/2026:13:55:36 +0000]
    /// "GET /path HTTP/1.1" 200 2326 "referer" "user agent"`), in whole seconds, optionally
    /// followed by the request's duration in seconds (nginx's `$request_time`, bare or as
    /// `rt=0.123` / `request_time=0.123`): the time is then taken as the request's end (what
    /// nginx writes) and its start computed.
    Combined,
}

impl LogFormat {
    /// The format a line looks like: a JSON object, or the combined format.
    pub fn of_line(line: &str) -> LogFormat {
        if line.trim_start().starts_with('{') {
            LogFormat::Json
        } else {
            LogFormat::Combined
        }
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "json" => Ok(LogFormat::Json),
            "combined" => Ok(LogFormat::Combined),
            other => Err(format!("format {other:?}: json or combined")),
        }
    }
}

/// A line that could not be read as a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct BadLine {
    /// The file (or the label it was given).
    pub file: String,
    /// Its 1-based line number.
    pub line: u64,
    /// Why it was refused.
    pub reason: LineError,
}

/// One parsed line, ordered by time and then by the order it was read.
struct Timed {
    time_us: u64,
    seq: u64,
    request: LoggedRequest,
}

impl PartialEq for Timed {
    fn eq(&self, other: &Self) -> bool {
        (self.time_us, self.seq) == (other.time_us, other.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Timed {
    // Reversed: the heap's top is the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.time_us, other.seq).cmp(&(self.time_us, self.seq))
    }
}

/// One log: its lines, read one at a time.
struct Source {
    name: String,
    reader: Box<dyn BufRead + Send>,
    format: Option<LogFormat>,
    line: u64,
    buf: Vec<u8>,
    /// Its next request, read ahead for the merge.
    head: Option<LoggedRequest>,
    done: bool,
    /// Why the whole file is one bad line (its first bytes are gzip's).
    refused: Option<LineError>,
}

/// The first bytes of a gzip file (RFC 1952).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

enum Next {
    Request(LoggedRequest),
    Bad(BadLine),
    End,
}

impl Source {
    fn read(&mut self) -> Next {
        if let Some(reason) = self.refused.take() {
            self.line = 1;
            self.done = true;
            return Next::Bad(self.bad(reason));
        }
        loop {
            self.buf.clear();
            let long = match read_line(&mut *self.reader, &mut self.buf) {
                Ok(None) => return Next::End,
                Ok(Some(long)) => long,
                Err(e) => {
                    self.line += 1;
                    // A read error ends the file: what follows cannot be found.
                    self.done = true;
                    return Next::Bad(self.bad(LineError::Unreadable(e.to_string())));
                }
            };
            self.line += 1;
            if long {
                return Next::Bad(self.bad(LineError::TooLong));
            }
            let Ok(text) = std::str::from_utf8(&self.buf) else {
                return Next::Bad(self.bad(LineError::NotUtf8));
            };
            let text = text.trim_end_matches(['\n', '\r']);
            if text.trim().is_empty() {
                continue;
            }
            let format = *self.format.get_or_insert_with(|| LogFormat::of_line(text));
            let parsed = match format {
                LogFormat::Json => parse_json(text),
                LogFormat::Combined => parse_combined(text),
            };
            return match parsed {
                Ok(r) => Next::Request(r),
                Err(reason) => Next::Bad(self.bad(reason)),
            };
        }
    }

    fn bad(&self, reason: LineError) -> BadLine {
        BadLine {
            file: self.name.clone(),
            line: self.line,
            reason,
        }
    }
}

/// Reads one line into `buf` (without a cap's worth past [`MAX_LINE_BYTES`]): `None` at the
/// end, `Some(true)` for a line too long (read to its end and dropped).
fn read_line(reader: &mut dyn BufRead, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
    let mut long = false;
    let mut any = false;
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(any.then_some(long));
        }
        any = true;
        let (chunk, used, end) = match memchr(available) {
            Some(i) => (&available[..i], i + 1, true),
            None => (available, available.len(), false),
        };
        if !long && buf.len() + chunk.len() <= MAX_LINE_BYTES {
            buf.extend_from_slice(chunk);
        } else {
            long = true;
            buf.clear();
        }
        reader.consume(used);
        if end {
            return Ok(Some(long));
        }
    }
}

fn memchr(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

/// Requests read from one or more logs, merged by time (see [`LogFormat`] for the formats).
///
/// Each log is read a line at a time, as plain text (see [`LogReader::open_with`] for gzip); the logs'
/// lines are merged by their times, and lines that arrive out of order are sorted within the
/// reorder window (a line more than the window earlier than the latest one read is handed on
/// as it comes: the replay decides it at its own clock, counted late). A line that does not
/// parse is handed on as a [`BadLine`].
///
/// ```
/// use tower_ratelimits::{LogFormat, LogReader};
/// let log = "{\"time\":\"2026-11-25T10:00:00.5Z\",\"ip\":\"192.0.2.1\",\"method\":\"GET\",\"path\":\"/\"}\nnonsense\n";
/// let lines: Vec<_> = LogReader::from_readers(vec![("log".into(), Box::new(log.as_bytes()))], None, std::time::Duration::ZERO).collect();
/// assert_eq!(lines[0].as_ref().unwrap().time_us, 1_795_600_800_500_000);
/// assert_eq!(lines[1].as_ref().unwrap_err().line, 2);
/// ```
pub struct LogReader {
    sources: Vec<Source>,
    window_us: u64,
    held: BinaryHeap<Timed>,
    latest_us: u64,
    seq: u64,
}

impl std::fmt::Debug for LogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogReader")
            .field("sources", &self.sources.len())
            .field("window_us", &self.window_us)
            .finish_non_exhaustive()
    }
}

impl LogReader {
    /// Opens `paths`, each in `format` or, when `None`, the format its first line looks like;
    /// lines out of order are sorted within `reorder`. The files are read as plain text: a
    /// gzip file is one bad line saying so (decompress it through [`LogReader::open_with`];
    /// `tower-ratelimits-simulate plan` reads gzip).
    pub fn open<P: AsRef<Path>>(
        paths: &[P],
        format: Option<LogFormat>,
        reorder: Duration,
    ) -> Result<LogReader, std::io::Error> {
        Self::open_with(paths, format, reorder, |file| Box::new(file))
    }

    /// [`LogReader::open`], each file read through `decode`: a decompressor, such as one that
    /// reads gzip by its first bytes with `flate2`'s `MultiGzDecoder` (this crate has no
    /// decompressor of its own, so that an app that never replays a log builds none).
    ///
    /// ```
    /// use std::io::Read;
    /// use tower_ratelimits::LogReader;
    /// let path = std::env::temp_dir().join("open_with.log");
    /// std::fs::write(&path, "{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"192.0.2.1\"}\n")?;
    /// let as_is = |file: std::fs::File| -> Box<dyn Read + Send> { Box::new(file) };
    /// let reader = LogReader::open_with(&[&path], None, std::time::Duration::ZERO, as_is)?;
    /// assert_eq!(reader.filter(Result::is_ok).count(), 1);
    /// # Ok::<(), std::io::Error>(())
    /// ```
    pub fn open_with<P, D>(
        paths: &[P],
        format: Option<LogFormat>,
        reorder: Duration,
        mut decode: D,
    ) -> Result<LogReader, std::io::Error>
    where
        P: AsRef<Path>,
        D: FnMut(File) -> Box<dyn Read + Send>,
    {
        let mut readers: Vec<(String, Box<dyn Read + Send>)> = Vec::with_capacity(paths.len());
        for path in paths {
            let path = path.as_ref();
            let file = File::open(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            if !file.metadata()?.is_file() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{}: not a regular file", path.display()),
                ));
            }
            readers.push((path.display().to_string(), decode(file)));
        }
        Ok(Self::from_readers(readers, format, reorder))
    }

    /// Reads from `readers` (each named, for its bad lines), as [`LogReader::open`] does.
    pub fn from_readers(
        readers: Vec<(String, Box<dyn Read + Send>)>,
        format: Option<LogFormat>,
        reorder: Duration,
    ) -> LogReader {
        let sources = readers
            .into_iter()
            .map(|(name, reader)| {
                let mut reader = BufReader::with_capacity(64 << 10, reader);
                let gzip = reader.fill_buf().is_ok_and(|b| b.starts_with(&GZIP_MAGIC));
                Source {
                    name,
                    reader: Box::new(reader),
                    format,
                    line: 0,
                    buf: Vec::new(),
                    head: None,
                    done: false,
                    refused: gzip.then_some(LineError::Gzip),
                }
            })
            .collect();
        LogReader {
            sources,
            window_us: crate::time::duration_us(reorder),
            held: BinaryHeap::new(),
            latest_us: 0,
            seq: 0,
        }
    }

    /// Fills each source's head; a bad line found on the way is handed on first.
    fn fill(&mut self) -> Option<BadLine> {
        for source in &mut self.sources {
            while source.head.is_none() && !source.done {
                match source.read() {
                    Next::Request(r) => source.head = Some(r),
                    Next::Bad(bad) => return Some(bad),
                    Next::End => source.done = true,
                }
            }
        }
        None
    }
}

impl Iterator for LogReader {
    type Item = Result<LoggedRequest, BadLine>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(bad) = self.fill() {
                return Some(Err(bad));
            }
            // The earliest head of all logs moves into the window.
            let earliest = self
                .sources
                .iter_mut()
                .filter(|s| s.head.is_some())
                .min_by_key(|s| s.head.as_ref().map_or(u64::MAX, |r| r.time_us));
            let Some(source) = earliest else {
                // Every log read: the window empties in order.
                return self.held.pop().map(|t| Ok(t.request));
            };
            let Some(request) = source.head.take() else {
                continue;
            };
            self.latest_us = self.latest_us.max(request.time_us);
            self.seq += 1;
            self.held.push(Timed {
                time_us: request.time_us,
                seq: self.seq,
                request,
            });
            let ready = self.held.peek().is_some_and(|t| {
                t.time_us.saturating_add(self.window_us) <= self.latest_us
                    || self.held.len() > MAX_WINDOW_LINES
            });
            if ready {
                return self.held.pop().map(|t| Ok(t.request));
            }
        }
    }
}

/// Reads an RFC 3339 instant (`2026-11-25T10:00:00.123456Z`, `...+02:00`; a space or `t`
/// for the `T`; up to 9 digits of fraction, cut to microseconds) as Unix microseconds.
pub(crate) fn parse_rfc3339(text: &str) -> Result<u64, LineError> {
    let bad = || LineError::Time(text.to_owned());
    let b = text.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return Err(bad());
    }
    let num = |from: usize, to: usize| -> Result<i64, LineError> {
        let t = text.get(from..to).ok_or_else(bad)?;
        if !t.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    };
    let (y, mo, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (h, mi, s) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    let mut rest = &text[19..];
    let mut frac_us = 0;
    if let Some(f) = rest.strip_prefix('.') {
        let digits = f.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 9 {
            return Err(bad());
        }
        let kept = &f[..digits.min(6)];
        frac_us = kept.parse::<u64>().map_err(|_| bad())? * 10u64.pow(6 - kept.len() as u32);
        rest = &f[digits..];
    }
    let offset_s = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 && matches!(&o[..1], "+" | "-") && &o[3..4] == ":" => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let hours: i64 = o[1..3].parse().map_err(|_| bad())?;
            let minutes: i64 = o[4..6].parse().map_err(|_| bad())?;
            if hours > 23 || minutes > 59 {
                return Err(bad());
            }
            sign * (hours * 3600 + minutes * 60)
        }
        _ => return Err(bad()),
    };
    match civil_us(y, mo, d, h, mi, s, offset_s) {
        Ok(us) => Ok(us + frac_us),
        Err(Civil::NoSuchTime) => Err(bad()),
        Err(Civil::OutOfRange) => Err(LineError::TimeOutOfRange(text.to_owned())),
    }
}

/// The last second a replay reads, 9999-12-31T23:59:59Z, in Unix seconds.
const LAST_SECOND: i64 = 253_402_300_799;

/// Why a civil time is not an instant a replay reads.
#[derive(Debug, PartialEq)]
enum Civil {
    /// No such date or time (a 30th of February, an hour 24).
    NoSuchTime,
    /// A real instant, in UTC before 1970 or after 9999 (a time of 9999's last hour at a
    /// negative offset, written `10000-01-01` in a plan before).
    OutOfRange,
}

/// Unix microseconds of a civil time at an offset from UTC.
fn civil_us(y: i64, mo: i64, d: i64, h: i64, mi: i64, s: i64, offset_s: i64) -> Result<u64, Civil> {
    let month_days = match mo {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        1..=12 => 31,
        _ => return Err(Civil::NoSuchTime),
    };
    if !(0..=9999).contains(&y) || d < 1 || d > month_days || h > 23 || mi > 59 || s > 60 {
        return Err(Civil::NoSuchTime);
    }
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + s.min(59) - offset_s;
    if !(0..=LAST_SECOND).contains(&secs) {
        return Err(Civil::OutOfRange);
    }
    u64::try_from(secs)
        .map(|s| s * 1_000_000)
        .map_err(|_| Civil::OutOfRange)
}

/// A duration in seconds written as a decimal (`0.123`), in microseconds.
fn seconds_us(text: &str) -> Option<u64> {
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    let digits = |t: &str| t.bytes().all(|c| c.is_ascii_digit());
    if whole.is_empty() || whole.len() > 9 || !digits(whole) || !digits(frac) {
        return None;
    }
    let kept = &frac[..frac.len().min(6)];
    let frac_us = if kept.is_empty() {
        0
    } else {
        kept.parse::<u64>().ok()? * 10u64.pow(6 - kept.len() as u32)
    };
    Some(whole.parse::<u64>().ok()? * 1_000_000 + frac_us)
}

fn parse_ip(text: &str) -> Result<IpAddr, LineError> {
    crate::layer::parse_forwarded_ip(text).ok_or_else(|| LineError::Ip(text.to_owned()))
}

fn parse_method(text: &str) -> Result<Method, LineError> {
    Method::from_bytes(text.as_bytes()).map_err(|_| LineError::Method(text.to_owned()))
}

fn check_path(path: &str) -> Result<(), LineError> {
    if path.starts_with('/') && http::uri::PathAndQuery::try_from(path).is_ok() {
        Ok(())
    } else {
        Err(LineError::Path(path.to_owned()))
    }
}

#[derive(serde::Deserialize)]
struct JsonLine<'a> {
    #[serde(borrow)]
    time: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    ip: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    method: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    path: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    status: Option<u16>,
    #[serde(borrow, default, deserialize_with = "header_pairs::optional")]
    headers: Option<header_pairs::Pairs<'a>>,
    #[serde(default)]
    duration_ms: Option<f64>,
    #[serde(default)]
    cost: Option<u64>,
    #[serde(borrow, default)]
    stream: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    message_of: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    messages: Option<u64>,
    #[serde(default)]
    units: Option<u64>,
}

/// `headers` as an object read into pairs, in order.
mod header_pairs {
    use std::borrow::Cow;

    use serde::de::{Deserializer, MapAccess, Visitor};

    pub(super) type Pairs<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

    pub(super) struct PairsVisitor;

    impl<'de> Visitor<'de> for PairsVisitor {
        type Value = Pairs<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of header names and string values")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some((k, v)) = map.next_entry::<Cow<'de, str>, Cow<'de, str>>()? {
                if out.len() == super::MAX_HEADERS {
                    return Err(serde::de::Error::custom(format!(
                        "more than {} headers",
                        super::MAX_HEADERS
                    )));
                }
                out.push((k, v));
            }
            Ok(out)
        }
    }

    pub(super) fn optional<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Pairs<'de>>, D::Error> {
        d.deserialize_map(PairsVisitor).map(Some)
    }
}

fn parse_json(text: &str) -> Result<LoggedRequest, LineError> {
    let raw: JsonLine<'_> =
        serde_json::from_str(text).map_err(|e| LineError::NotJson(e.to_string()))?;
    let time_us = parse_rfc3339(&raw.time)?;
    let stream = stream_line::stream_line(
        raw.stream.as_deref(),
        raw.message_of.as_deref(),
        raw.messages,
        raw.units,
    )?;
    if let Some(StreamLine::Message { .. }) = stream {
        return Ok(LoggedRequest {
            stream,
            ..LoggedRequest::new(time_us, IpAddr::from([0, 0, 0, 0]))
        });
    }
    let ip = raw
        .ip
        .ok_or_else(|| LineError::NotJson("missing field `ip`".into()))?;
    let ip = parse_ip(&ip)?;
    let method = raw
        .method
        .as_deref()
        .map_or(Ok(Method::GET), parse_method)?;
    let path = raw.path.map_or_else(|| "/".to_owned(), |p| p.into_owned());
    check_path(&path)?;
    let mut headers = HeaderMap::new();
    for (name, value) in raw.headers.unwrap_or_default() {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| LineError::HeaderName(name.into_owned()))?;
        let value =
            HeaderValue::from_str(&value).map_err(|_| LineError::HeaderValue(name.to_string()))?;
        headers.append(name, value);
    }
    let duration_us = match raw.duration_ms {
        None => 0,
        Some(ms) if ms.is_finite() && (0.0..=86_400_000.0).contains(&ms) => (ms * 1000.0) as u64,
        Some(ms) => return Err(LineError::Duration(ms.to_string())),
    };
    Ok(LoggedRequest {
        time_us,
        ip,
        method,
        path,
        status: raw.status,
        headers,
        duration_us,
        cost: raw.cost,
        stream,
    })
}

/// A quoted field of the combined format (`"..."`, `\"` and `\\` escaped), and what follows.
fn quoted(text: &str) -> Option<(String, &str)> {
    let rest = text.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = rest.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                if let Some((_, e)) = chars.next() {
                    out.push(e);
                }
            }
            '"' => return Some((out, &rest[i + 1..])),
            c => out.push(c),
        }
    }
    None
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// `10/Oct/2026:13:55:36 -0700` as Unix microseconds.
fn parse_clf_time(text: &str) -> Result<u64, LineError> {
    match clf_civil(text) {
        Some(Ok(us)) => Ok(us),
        Some(Err(Civil::OutOfRange)) => Err(LineError::TimeOutOfRange(text.to_owned())),
        None | Some(Err(Civil::NoSuchTime)) => Err(LineError::NotCombined(
            "the time is not dd/Mon/yyyy:HH:MM:SS +hhmm",
        )),
    }
}

/// The civil time of a combined log line's `[time]` (`None`: not that form).
fn clf_civil(text: &str) -> Option<Result<u64, Civil>> {
    let b = text.as_bytes();
    if b.len() != 26 || b[2] != b'/' || b[6] != b'/' || b[11] != b':' || b[20] != b' ' {
        return None;
    }
    let num = |t: &str| -> Option<i64> {
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let d = num(&text[0..2])?;
    let mo = MONTHS.iter().position(|m| *m == &text[3..6])? as i64 + 1;
    let y = num(&text[7..11])?;
    let (h, mi, s) = (
        num(&text[12..14])?,
        num(&text[15..17])?,
        num(&text[18..20])?,
    );
    let sign = match &text[21..22] {
        "+" => 1,
        "-" => -1,
        _ => return None,
    };
    let (oh, om) = (num(&text[22..24])?, num(&text[24..26])?);
    Some(civil_us(y, mo, d, h, mi, s, sign * (oh * 3600 + om * 60)))
}

fn parse_combined(text: &str) -> Result<LoggedRequest, LineError> {
    let bad = LineError::NotCombined;
    let (ip, rest) = text.split_once(' ').ok_or_else(|| bad("no fields"))?;
    let ip = parse_ip(ip)?;
    let open = rest.find('[').ok_or_else(|| bad("no [time]"))?;
    let close = rest[open..].find(']').ok_or_else(|| bad("no [time]"))? + open;
    let logged_us = parse_clf_time(&rest[open + 1..close])?;
    let (request, rest) =
        quoted(rest[close + 1..].trim_start()).ok_or_else(|| bad("no \"request line\""))?;
    let mut parts = request.split(' ');
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        return Err(bad("the request line is not METHOD PATH PROTOCOL"));
    };
    let method = parse_method(method)?;
    check_path(path)?;
    let path = path.to_owned();
    let mut rest = rest.trim_start();
    let (status, after) = rest.split_once(' ').unwrap_or((rest, ""));
    let status = status
        .parse::<u16>()
        .ok()
        .filter(|s| (100..=999).contains(s))
        .ok_or_else(|| bad("no status"))?;
    rest = after.trim_start();
    // The bytes sent.
    rest = rest.split_once(' ').map_or("", |(_, r)| r).trim_start();
    let mut headers = HeaderMap::new();
    for name in ["referer", "user-agent"] {
        let Some((value, after)) = quoted(rest) else {
            break;
        };
        if value != "-"
            && let Ok(v) = HeaderValue::from_str(&value)
        {
            headers.insert(HeaderName::from_static(name), v);
        }
        rest = after.trim_start();
    }
    let duration_us = rest
        .split_whitespace()
        .find_map(|field| {
            let value = field
                .strip_prefix("rt=")
                .or_else(|| field.strip_prefix("request_time="))
                .unwrap_or(field);
            seconds_us(value.trim_matches('"'))
        })
        .unwrap_or(0);
    Ok(LoggedRequest {
        // nginx writes the time a request ended: with its duration, the start is computed.
        time_us: logged_us.saturating_sub(duration_us),
        ip,
        method,
        path,
        status: Some(status),
        headers,
        duration_us,
        cost: None,
        stream: None,
    })
}

#[cfg(test)]
mod tests;
