#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The tree, from the inside out (docs/design.md): pure algorithms, quotas and keys,
// configuration, backends, the limiter, the tower layer. Modules are private; what a user
// names is re-exported here, once.
mod algo;
mod backend;
mod config;
mod key;
mod layer;
mod limiter;
mod mode;
mod quota;
#[cfg(feature = "reload")]
mod reload;
mod telemetry;
mod time;

pub use algo::concurrency::{ConcurrencyError, ConcurrencyLimit};
pub use algo::gcra::{GcraError, Limit, LimitError};
pub use algo::tiers::{
    Tier, TierError, TierGrant, TierLog, TierRequestError, TierState, TieredLimit,
};
/// The batch kit: what a backend decides, written once, for a backend outside the crate.
pub use backend::kit;
pub use backend::{
    Backend, BackendError, BucketTx, MemoryBackend, MemoryBackendBuilder, Mode, Outcome, Outcomes,
    PendingSpend, Spend, TransactionError,
};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use backend::{CoalesceStats, RedisBackend, RedisBackendBuilder, RedisSetupError};
pub use config::{ConfigError, ConfigErrorKind, Limits, LimitsBuilder, LimitsChange, Location};
pub use key::{BucketKey, Id, IdError, IdKind, LimitName};
pub use layer::{
    ClientIp, Denial, ErrorBody, FailurePolicy, FieldStyle, ForwardedHeader, Header, Ipv6Range48,
    KeyError, KeyExtractor, LayerError, OnMissingKey, RateLimitBody, RateLimitLayer,
    RateLimitLayerBuilder, RateLimitService, ResponseFuture, Rule, Settle, Wait, key_fn,
};
pub use limiter::{
    BatchDecision, Decision, Lease, Limiter, LimiterError, ReloadError, Transaction,
};
pub use quota::Quota;
#[cfg(feature = "reload")]
#[cfg_attr(docsrs, doc(cfg(feature = "reload")))]
pub use reload::{LimitsWatcher, ReloadReport, WatchError};
pub use time::{Clock, DurationError, ManualClock, SystemClock};

/// The `http` crate, whose request and response types the layer and its extractors use
/// (`http::request::Parts` in a [`KeyExtractor`] or a cost function), re-exported so a user
/// need not add it.
pub use http;

/// The `ipnet` crate's `IpNet`, in which trusted proxies and exemptions are given
/// ([`ClientIp::trusted_proxies`], [`RateLimitLayerBuilder::exempt_addresses`]), re-exported so a user
/// need not add it.
pub use ipnet::IpNet;

/// Not part of the API: what this repository's own tests, benches and examples reach below
/// the public surface (the pure algorithms, duration parsing, a rule's scope, a settle header's units). Anything here may change
/// in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::algo::{concurrency, gcra, tiers};
    pub use crate::layer::{in_scope, parse_units, units_in};
    pub use crate::time::parse_duration_us;
}
