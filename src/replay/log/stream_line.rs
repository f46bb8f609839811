//! The stream fields of a JSON log line (`docs/replay.md`, "Streams"): a request that opens a
//! stream, with the stream's totals when the log has no line per message, or a line that is
//! one message of an open stream.

use std::sync::Arc;

use super::LineError;

/// The most messages a stream's totals spread (a larger count is a bad line: a replay decides
/// each one).
pub const MAX_SPREAD_MESSAGES: u64 = 1_000_000;
/// The longest stream id read (bytes).
const MAX_ID_BYTES: usize = 256;

/// What a log line says of a stream ([`LoggedRequest::stream`](super::LoggedRequest::stream)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamLine {
    /// The request opens stream `id` (`"stream": id`), open until its logged end (`duration_ms`;
    /// none: until the log ends). `totals` when the line carries the stream's `messages` (and
    /// `units`) instead of a line per message: the replay spreads them evenly over the stream's
    /// duration, an approximation the plan says it is.
    Opens {
        /// The stream's id, as the log's message lines name it.
        id: Arc<str>,
        /// The stream's messages and units from a per-request total, when logged.
        totals: Option<Totals>,
    },
    /// One message of stream `id` (`"message_of": id`), of `units` units (`"units"`, 1 when
    /// absent): not a request. Its line's other fields are not read.
    Message {
        /// The stream it belongs to.
        id: Arc<str>,
        /// Its units (bytes, tokens: what a rule `per: unit` counts).
        units: u64,
    },
}

/// A stream's totals from a per-request line: `messages` messages (1 to
/// [`MAX_SPREAD_MESSAGES`]) carrying `units` units together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// How many messages the stream carried.
    pub messages: u64,
    /// Their units together (`messages` when not logged: a unit a message).
    pub units: u64,
}

/// The stream a JSON line's `stream`, `message_of`, `messages` and `units` say, if any.
pub(super) fn stream_line(
    stream: Option<&str>,
    message_of: Option<&str>,
    messages: Option<u64>,
    units: Option<u64>,
) -> Result<Option<StreamLine>, LineError> {
    let id = |text: &str| {
        if text.is_empty() || text.len() > MAX_ID_BYTES {
            return Err(LineError::Stream("a stream id is 1 to 256 bytes"));
        }
        Ok(Arc::<str>::from(text))
    };
    match (stream, message_of) {
        (Some(_), Some(_)) => Err(LineError::Stream(
            "a line opens a stream (stream) or is a message of one (message_of), not both",
        )),
        (None, Some(_)) if messages.is_some() => {
            Err(LineError::Stream("a message line has units, not messages"))
        }
        (None, Some(of)) => Ok(Some(StreamLine::Message {
            id: id(of)?,
            units: units.unwrap_or(1),
        })),
        (Some(opens), None) => {
            let totals = match (messages, units) {
                (None, None) => None,
                (Some(0), _) => {
                    return Err(LineError::Stream("messages: 1 or more"));
                }
                (Some(m), _) if m > MAX_SPREAD_MESSAGES => {
                    return Err(LineError::Stream("messages: at most 1000000"));
                }
                (m, u) => {
                    let messages = m.unwrap_or(1);
                    Some(Totals {
                        messages,
                        units: u.unwrap_or(messages),
                    })
                }
            };
            Ok(Some(StreamLine::Opens {
                id: id(opens)?,
                totals,
            }))
        }
        (None, None) if messages.is_some() || units.is_some() => Err(LineError::Stream(
            "messages and units are a stream's: the line opens none (stream)",
        )),
        (None, None) => Ok(None),
    }
}
