//! Why a log line is not a request: what [`BadLine`](super::BadLine) carries, one variant per
//! cause, each with the text a plan and the simulator print.

use super::MAX_LINE_BYTES;

/// The range of times a replay reads, said to the user.
const TIME_RANGE: &str = "a replay reads times from 1970-01-01T00:00:00Z to 9999-12-31T23:59:59Z";

/// Why a line of a log could not be read as a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LineError {
    /// The file could not be read on (the I/O error's text); the file ends there.
    #[error("cannot read on: {0}")]
    Unreadable(String),
    /// The line is longer than [`MAX_LINE_BYTES`].
    #[error("longer than {MAX_LINE_BYTES} bytes")]
    TooLong,
    /// The line is not UTF-8.
    #[error("not UTF-8")]
    NotUtf8,
    /// The file is gzip: the reader reads plain text.
    #[error(
        "the file is gzip, and this reader reads plain text: decompress it \
         (LogReader::open_with), or replay it with tower-ratelimits-simulate plan, which reads gzip"
    )]
    Gzip,
    /// A JSON line that is not a log line (the parser's text).
    #[error("not a log line: {0}")]
    NotJson(String),
    /// A combined log line missing a part (which one).
    #[error("not a combined log line: {0}")]
    NotCombined(&'static str),
    /// A time that is not RFC 3339 (the text).
    #[error("time {0:?}: write RFC 3339 (2026-11-25T10:00:00.123456Z)")]
    Time(String),
    /// A time outside what a replay reads, 1970 to 9999 in UTC (the text).
    #[error("time {0:?} is out of range: {TIME_RANGE}")]
    TimeOutOfRange(String),
    /// An `ip` that is not an address (the text).
    #[error("ip {0:?} is not an address")]
    Ip(String),
    /// A method that is not a method (the text).
    #[error("method {0:?} is not a method")]
    Method(String),
    /// A path that does not start with `/` or is not a path (the text).
    #[error("path {0:?} is not a path (it starts with /)")]
    Path(String),
    /// A header name that is not one (the text).
    #[error("header {0:?} is not a header name")]
    HeaderName(String),
    /// A header value that is not one (the header's name).
    #[error("header {0}: the value is not a header value")]
    HeaderValue(String),
    /// A `duration_ms` outside 0 to 86,400,000 (as written).
    #[error("duration_ms {0}: 0 to 86400000")]
    Duration(String),
    /// A stream field that does not say a stream (why).
    #[error("{0}")]
    Stream(&'static str),
}
