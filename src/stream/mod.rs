//! Limits inside a stream (`docs/streams.md`): each message of a gRPC stream, a WebSocket or
//! server-sent events counted against the stream's keys before it passes. A tower layer sees
//! a request and its response's body, not the messages inside them once a stream is open (a
//! WebSocket's frames after the upgrade, a gRPC stream's messages inside its body), so the
//! handler meters them: [`StreamMeter`] decides one message (one batch on the limiter's road,
//! as a request is), [`LimitedStream`] wraps any stream of messages with it (tonic's
//! `Streaming<T>` and a response stream, an SSE stream), [`MeteredBody`] debits each chunk of
//! a response body (bytes, tokens) before it is forwarded, and a WebSocket handler calls
//! [`StreamMeter::admit`] per frame.

mod body;
mod grants;
mod keys;
mod limited;
mod meter;
#[cfg(feature = "websocket")]
mod socket;

use std::time::Duration;

use crate::key::LimitName;
use crate::limiter::{BatchDecision, LimiterError};
use crate::time::{WaitText, ceil_ms};

pub use body::{MeteredBody, Overrun};
pub use limited::LimitedStream;
pub use meter::{StreamMeter, StreamMeterBuilder};
#[cfg(feature = "websocket")]
pub use socket::LimitedSocket;

/// Why a [`StreamMeter`] cannot be built.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A meter with no key counts nothing.
    #[error("a stream meter needs at least one key")]
    NoKeys,
    /// A limit that holds slots (a concurrency or an adaptive limit) cannot count messages:
    /// a stream holds its slot for its whole life through the layer's rule instead.
    #[error("limit {0} holds slots: a stream holds one through the layer's rule, not per message")]
    HoldsSlots(LimitName),
    /// A key the limiter refuses (the same key twice).
    #[error(transparent)]
    Limiter(LimiterError),
    /// A key of limit `.0` charges the price of a model the request's body names, and the
    /// body did not price it (why: `.1`), or was not read
    /// ([`StreamKeys::price_from_body`](crate::StreamKeys::price_from_body)).
    #[error("limit {0}: {1}")]
    Unpriced(LimitName, String),
}

readable_debug!(StreamError { NoKeys, HoldsSlots(name), Limiter(e), Unpriced(name, why) });

/// Why a stream ends at a message ([`StreamMeter::admit`]).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StreamLimited {
    /// A limit had no room for the message (and pushing back would wait longer than allowed,
    /// or the meter ends at a limit).
    #[error("rate limit {limit} exceeded; retry after {}", WaitText(ceil_ms(*retry_after).max(1)))]
    Limited {
        /// The limit that refused (the strictest, when several did).
        limit: LimitName,
        /// How long until a message as large would pass.
        retry_after: Duration,
        /// The key is banned by its limit's penalty ladder (the wait is the ban's).
        banned: bool,
    },
    /// The message is larger than a limit's burst: it could never pass.
    #[error("a message of {units} units exceeds limit {limit}'s burst of {max}")]
    TooLarge {
        /// The limit.
        limit: LimitName,
        /// The message's units.
        units: u64,
        /// The most one message may cost.
        max: u64,
    },
    /// The limits could not be decided (the store failed) and the meter does not fail open.
    #[error("the stream's limits could not be decided: {0}")]
    Failed(#[source] LimiterError),
    /// A metered body's chunk whose units could not be read ([`MeteredBody::units`]): the
    /// body ends before it, so that nothing unmetered is sent.
    #[error("a chunk's units could not be read")]
    Unreadable,
    /// The stream ended already, at an earlier message.
    #[error("the stream ended at an earlier message")]
    Ended,
}

readable_debug!(StreamLimited { Limited { limit, retry_after, banned }, TooLarge { limit, units, max }, Failed(e), Unreadable, Ended });

impl StreamLimited {
    /// The refusal a denied batch says: its strictest limit's.
    fn of(decision: &BatchDecision) -> Self {
        match decision.strictest() {
            Some(d) => StreamLimited::Limited {
                limit: d.name(),
                retry_after: d.retry_after(),
                banned: d.banned(),
            },
            // A denied batch has a strictest decision; no answer is an ended stream.
            None => StreamLimited::Ended,
        }
    }

    /// How long until a message as large would pass: `None` when waiting would not help
    /// (too large, a failure, ended).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            StreamLimited::Limited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The WebSocket close code that ends the socket: 1013 (try again later) at a limit,
    /// 1008 (policy violation) for a banned key, 1009 (message too big) for a message larger
    /// than a limit's burst, 1011 (internal error) when the limits could not be decided, a
    /// message's units could not be read, or the stream had ended.
    pub fn close_code(&self) -> u16 {
        match self {
            StreamLimited::Limited { banned: false, .. } => 1013,
            StreamLimited::Limited { banned: true, .. } => 1008,
            StreamLimited::TooLarge { .. } => 1009,
            StreamLimited::Failed(_) | StreamLimited::Unreadable | StreamLimited::Ended => 1011,
        }
    }

    /// The WebSocket close reason: the error's sentence, cut at a character boundary to the
    /// 123 bytes a close frame holds.
    pub fn close_reason(&self) -> String {
        let mut text = self.to_string();
        if text.len() > 123 {
            let mut end = 123;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        text
    }

    /// The JSON an SSE stream's last event carries (`event: rate-limited`, `docs/streams.md`):
    /// `{"limiter":"..","retry_after_ms":..,"message":".."}`, `retry_after_ms` only when
    /// waiting would help, `limiter` only when a limit refused.
    pub fn json(&self) -> String {
        let mut v = serde_json::Map::new();
        match self {
            StreamLimited::Limited { limit, .. } | StreamLimited::TooLarge { limit, .. } => {
                v.insert("limiter".into(), limit.as_str().into());
            }
            StreamLimited::Failed(_) | StreamLimited::Unreadable | StreamLimited::Ended => {}
        }
        if let Some(wait) = self.retry_after() {
            v.insert("retry_after_ms".into(), ceil_ms(wait).max(1).into());
        }
        v.insert("message".into(), self.to_string().into());
        serde_json::Value::Object(v).to_string()
    }

    /// The gRPC status that ends the stream (its trailers): `RESOURCE_EXHAUSTED` with
    /// `RetryInfo` (the exact wait, in whole milliseconds) and a `QuotaFailure` naming the
    /// limit at a limit; without `RetryInfo` for a message too large; `UNAVAILABLE` when the
    /// limits could not be decided; `INTERNAL` for units that could not be read; `CANCELLED`
    /// for a stream that had ended.
    #[cfg(feature = "tonic")]
    pub fn to_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            StreamLimited::Limited {
                limit, retry_after, ..
            } => crate::layer::resource_exhausted(
                &message,
                Some(ceil_ms(*retry_after).max(1)),
                std::iter::once((*limit, *retry_after)),
            ),
            StreamLimited::TooLarge { .. } => {
                crate::layer::resource_exhausted(&message, None, std::iter::empty())
            }
            StreamLimited::Failed(_) => tonic::Status::unavailable(message),
            StreamLimited::Unreadable => tonic::Status::internal(message),
            StreamLimited::Ended => tonic::Status::cancelled(message),
        }
    }
}
