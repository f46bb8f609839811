//! The tower middleware: [`RateLimitLayer`] and [`RateLimitService`].
//!
//! A layer holds one or more [`Rule`]s; a rule is a limit name, a [`KeyExtractor`] and a
//! cost. For each request every rule's key is extracted and all of them are decided in one
//! batch: one backend call per request. A denied request gets a 429 (or a gRPC
//! `RESOURCE_EXHAUSTED`); an allowed one goes to the inner service, and its response carries
//! the `RateLimit` fields of the strictest rule (configurable).
//!
//! ```no_run
//! use axum::{Router, routing::get};
//! use tower_ratelimits::{Limiter, Limits, MemoryBackend};
//! use tower_ratelimits::{ClientIp, Ipv6Range48, RateLimitLayer, Rule};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = Limits::from_yaml_str(
//!     "RequestsPerIPAddress: {kind: ip, burst: 20, count: 20, period: 1s}\n\
//!      RequestsPerIPv6Range: {kind: ipv6_range, burst: 100, count: 100, period: 1s}\n",
//!     None,
//! )?;
//! let limiter = Limiter::new(limits, MemoryBackend::new());
//! let layer = RateLimitLayer::builder(limiter)
//!     .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
//!     .rule(Rule::new("RequestsPerIPv6Range", Ipv6Range48::new(ClientIp::new())))
//!     .build()?;
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>()).await?;
//! # Ok(()) }
//! ```

mod body;
mod charge;
mod count_when;
mod extract;
mod failure;
mod future;
mod lease;
mod observe;
mod outcome;
mod rate_limit_layer;
mod response;
mod rule;
#[cfg(feature = "yaml")]
mod rules_file;
mod service;
mod settle;
#[cfg(feature = "stream")]
mod stream_keys;
mod wait;

pub use body::{RateLimitBody, ResponseBody};
pub use count_when::CountWhen;
pub use extract::{ClientIp, ForwardedHeader, Header, Ipv6Range48, KeyError, KeyExtractor, key_fn};
pub use failure::FailurePolicy;
pub use future::ResponseFuture;
pub use rate_limit_layer::{LayerError, RateLimitLayer, RateLimitLayerBuilder};
#[cfg(all(feature = "tonic", feature = "stream"))]
pub(crate) use response::resource_exhausted;
pub use response::{Denial, ErrorBody, FieldStyle};
pub use rule::{OnMissingKey, Rule};
#[cfg(feature = "yaml")]
pub use rules_file::LoggedCost;
pub use service::RateLimitService;
pub use settle::{Settle, SettleError};
#[cfg(feature = "stream")]
pub(crate) use stream_keys::KeyPrice;
#[cfg(feature = "stream")]
pub use stream_keys::{AtLimit, ModelFrom, Per, StreamKeys};
pub use wait::Wait;

#[cfg(feature = "replay")]
pub(crate) use extract::parse_forwarded_ip;
#[cfg(feature = "replay")]
pub(crate) use observe::{Note, RuleOutcome};
#[cfg(feature = "replay")]
pub(crate) use settle::SettleFrom;

// For `crate::__private` only (this repository's property tests); not re-exported otherwise.
pub use rule::in_scope;
pub use settle::{parse_units, units_in};
