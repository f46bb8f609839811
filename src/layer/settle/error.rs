//! What a settle refuses, and the bound on what a response may report: shared by settling
//! (`layer/settle.rs`) and the outcome rules built on it (`layer/count_when.rs`).

use http::HeaderName;

/// The most units one response may report and be counted (2^40, a trillion): a report beyond
/// it is absurd, counted apart (`outcome="absurd"`), so that no counter of units wraps (one
/// such report made the forgiven units read 18446744073709551415).
pub(crate) const MOST_UNITS_REPORTED: u64 = 1 << 40;

/// Why a rule's [`Settle`](crate::Settle) cannot be used ([`LayerError::Settle`], when the layer
/// is built).
///
/// [`LayerError::Settle`]: crate::LayerError::Settle
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SettleError {
    /// [`Settle::header`](crate::Settle::header) or [`Settle::trailer`](crate::Settle::trailer) of a
    /// name that is not a header name.
    #[error("{0:?} is not a header name")]
    NotAHeaderName(String),
    /// [`Settle::body_bytes_per`](crate::Settle::body_bytes_per)`(0)`.
    #[error("body_bytes_per(0): a unit needs at least one byte")]
    ZeroBytesPerUnit,
    /// A settle on a rule whose mode spends nothing (there is nothing to settle).
    #[error("a {0:?} rule spends nothing to settle")]
    SpendsNothing(crate::mode::Mode),
    /// A settle (or [`Rule::count_when`](crate::Rule::count_when)) on a limit of slots in
    /// flight (a concurrency or adaptive limit): its slot is given back when the request
    /// ends, so nothing would ever be settled.
    #[error(
        "a limit of slots in flight is never settled: its slot is given back when the request ends"
    )]
    Leases,
    /// [`CountWhen::header_equals`](crate::CountWhen::header_equals) of a value that is not a
    /// header value.
    #[error("{0:?} is not a header value")]
    NotAHeaderValue(String),
    /// A [`CountWhen`](crate::CountWhen) case weighing more than 2^40.
    #[error("a weight of {0} is above 2^40")]
    Weight(u64),
    /// A [`CountWhen`](crate::CountWhen) whose every case weighs 0, or that has none: it would
    /// count nothing.
    #[error("count_when counts nothing: no case weighs more than 0")]
    NothingCounts,
    /// A [`CountWhen`](crate::CountWhen) status case outside 100 to 599, or a range whose
    /// start is above its end: it would match no response.
    #[error(
        "status {0}..={1} matches no response: codes are 100 to 599, the start at most the end"
    )]
    Status(u16, u16),
    /// A [`CountWhen::grpc_status`](crate::CountWhen::grpc_status) case of a code above 16.
    #[error("gRPC status {0} is no status: codes are 0 to 16")]
    GrpcStatus(u32),
    /// A [`CountWhen::latency_above`](crate::CountWhen::latency_above) case of a zero bound: it
    /// would count every response.
    #[error("latency_above(0) counts every response: give a bound above 0")]
    Latency,
    /// A [`CountWhen`](crate::CountWhen) of more than 64 cases.
    #[error("count_when has more than 64 cases")]
    Cases,
}

pub(crate) fn header_name(name: &str) -> Result<HeaderName, SettleError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| SettleError::NotAHeaderName(name.to_owned()))
}
