//! Rate limits in front of any [tower](https://docs.rs/tower) service: axum, tonic and hyper
//! apps add a [`RateLimitLayer`] and are protected, in one process (in memory) or across many
//! (Redis and Redis Cluster, feature `redis`), with the same decisions to the microsecond.
//!
//! # Words
//!
//! A [`Limit`] is one GCRA rate: a burst of tokens, refilled at `count` per `period`. A
//! [`Quota`] is any shape a limit can take: a GCRA [`Limit`], burst tiers ([`TieredLimit`]),
//! requests in flight ([`ConcurrencyLimit`]), requests in flight whose number follows each
//! key's latency ([`AdaptiveConcurrency`]), a count per calendar day, week or month
//! ([`CalendarQuota`], renewing exactly at its boundary in a time zone) or one budget shared by
//! weight among the ids active now ([`FairShare`]). [`Limits`] is a whole configuration: named
//! limits, each keyed by one kind of id ([`IdKind`]), with a default and per-id overrides,
//! loaded from YAML or built with [`Limits::builder`]. A [`Limiter`] decides against a
//! snapshot of its [`Limits`] through a [`Backend`] ([`MemoryBackend`], `RedisBackend`): one
//! [`Transaction`] per limit and id, all of a request's in one all-or-nothing batch, answered
//! by a [`BatchDecision`]. A [`Rule`] tells the layer which limit applies to a request and how
//! to key it ([`KeyExtractor`]: [`ClientIp`], [`Header`], [`key_fn`]). The layer hands on the
//! inner service's own response body type ([`ResponseBody`]: axum's, tonic's, or
//! `http_body_util`'s `UnsyncBoxBody` for a hyper service), wrapped only for a request that
//! holds a concurrency slot or settles its cost from the body.
//!
//! # One limit per client IP
//!
//! ```
//! use std::time::Duration;
//! use tower_ratelimits::{Limit, RateLimitLayer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 20 requests at once per client IP, then 10 per second, in memory.
//! let layer = RateLimitLayer::per_client_ip(Limit::new(20, 10, Duration::from_secs(1))?)?;
//! let app: axum::Router = axum::Router::new()
//!     .route("/", axum::routing::get(|| async { "hello" }))
//!     .layer(layer);
//! // Serve with the peer address:
//! // axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
//! # let _ = app; Ok(()) }
//! ```
//!
//! # Named limits, several rules
//!
//! ```
//! use tower_ratelimits::{ClientIp, Header, Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = Limits::from_yaml_str(
//!     "
//! RequestsPerIPAddress: {kind: ip, burst: 20, count: 20, period: 1s}
//! ExportsPerAccount: {kind: account, burst: 5, count: 5, period: 1h}
//! ",
//!     // Overrides for some ids (a second file in production).
//!     Some("ExportsPerAccount:12345678: {burst: 50, count: 50, period: 1h}"),
//! )?;
//! let layer = RateLimitLayer::builder(Limiter::new(limits, MemoryBackend::new()))
//!     .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
//!     // Key by an identity your authentication layer verified, not by what a client says.
//!     .rule(Rule::new("ExportsPerAccount", Header::new("x-account-id")).for_path_prefix("/exports"))
//!     .build()?;
//! # let _ = layer; Ok(()) }
//! ```
//!
//! Every rule that applies to a request is decided in one backend call: allowed, the response
//! carries the IETF `RateLimit` and `RateLimit-Policy` fields; denied, a `429` with
//! `Retry-After` and a JSON body ([`FieldStyle`], [`ErrorBody`]), or `RESOURCE_EXHAUSTED` for
//! gRPC.
//!
//! # Without tower
//!
//! ```
//! use tower_ratelimits::{Id, Limiter, Limits, MemoryBackend, Transaction};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limits = Limits::from_yaml_str("Exports: {kind: account, burst: 2, count: 10, period: 1h}", None)?;
//! let limiter = Limiter::new(limits, MemoryBackend::new());
//! let key = limiter.key("Exports", Id::from(12345678u64))?;
//! let batch = limiter.spend(&[Transaction::new(key)]).await?;
//! assert!(batch.allowed());
//! # Ok(()) }
//! ```
//!
//! # Where to read on
//!
//! | for | see |
//! |---|---|
//! | every feature in code, walked through | [`specs::guide`] |
//! | running it: the limits file, shadow mode, metrics and logs, the admin API, sizing, failure behaviour, security | [`specs::operating`] |
//! | the layer's knobs: scopes, exemptions, failure policy, fields, bodies | [`RateLimitLayerBuilder`], [`Rule`] |
//! | a cost known only after the response (reserve, then settle) | [`Settle`] |
//! | waiting instead of refusing | [`Wait`] |
//! | requests in flight | [`ConcurrencyLimit`], [`specs::concurrency`] |
//! | requests in flight, their number found per key from its latency and failures | [`AdaptiveConcurrency`], [`specs::adaptive_concurrency`] |
//! | one budget shared by weight among the tenants active now | [`FairShare`], [`specs::fair_share`] |
//! | burst tiers | [`TieredLimit`], [`specs::burst_tiers`] |
//! | a count per day, week or month ("100,000 a month, renewing on the 15th") | [`CalendarQuota`], [`specs::calendar`] |
//! | the GCRA rule, partial grants, debt | [`Limit`], [`Transaction::cost_range`], [`specs::gcra`] |
//! | keys, forwarding headers, the response fields | [`ClientIp`], [`specs::keys_and_http`] |
//! | trying a policy on access logs before deploying it | `Replay`, `RuleSet` (features `replay`, `yaml`), [`specs::replay`] |
//! | Redis and Redis Cluster | `RedisBackend` (feature `redis`) |
//! | one limit across regions, each region deciding on its own store | `RedisBackendBuilder::regional` (feature `redis`), [`specs::regions`] |
//! | each message of a gRPC stream, a WebSocket or SSE, each chunk of a body, counted before it passes | `StreamMeter`, `LimitedStream`, `MeteredBody` (feature `stream`), `LimitedSocket` (feature `websocket`), [`specs::streams`] |
//! | reloading limits while running | [`Limiter::reload`], `LimitsWatcher` (feature `reload`) |
//! | overrides changed while running, on every instance; looking at a bucket | [`Limiter::set_override`], [`Limiter::inspect`], `admin_router` (feature `admin`) |
//! | a backend for another store | [`Backend`], [`kit`] |
//!
//! # Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `yaml` | on | [`Limits::from_yaml_str`] and the file loaders |
//! | `axum` | on | the peer address from axum's `ConnectInfo` |
//! | `tonic` | off | the peer address from tonic's `TcpConnectInfo`; gRPC error details |
//! | `redis` | off | `RedisBackend`: Redis and Redis Cluster |
//! | `redis-tls` | off | `rediss://` URLs |
//! | `metrics` | off | counters and histograms through the `metrics` facade |
//! | `reload` | off | `LimitsWatcher`: reload on file changes and SIGHUP |
//! | `admin` | off | `admin_router`: stored overrides and buckets over HTTP (axum) |
//! | `acme` | off | the id kinds `domain`, `fqdn_set`, `account_domain`, `account_fqdn_set` |
//! | `time-zones` | off | IANA time-zone names (`Europe/Berlin`) for calendar quotas; fixed offsets need no feature |
//! | `stream` | off | `StreamMeter`, `LimitedStream`, `MeteredBody`: limits inside streams ([`specs::streams`]) |
//! | `websocket` | off | `LimitedSocket`: an axum WebSocket whose messages pass a meter (axum's `ws`) |
//! | `replay` | off | `Replay`, `LogReader`: access logs replayed through a current and a candidate policy ([`specs::replay`]) |
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The tree, from the inside out (docs/design.md): pure algorithms, quotas and keys,
// configuration, backends, the limiter, the tower layer. Modules are private; what a user
// names is re-exported here, once.
/// `Debug` for a public error: its `Display` sentence (what `fn main() -> Result<(), Box<dyn
/// Error>>` prints for a `?`), the structured form under `{:#?}`. Every variant is listed, so
/// a new one is a compile error here until it is added.
macro_rules! readable_debug {
    ($ty:ident { $($variant:ident $( ( $($t:ident),* ) )? $( { $($f:ident),* } )?),* $(,)? }) => {
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                if !f.alternate() {
                    return std::fmt::Display::fmt(self, f);
                }
                match self {
                    $(
                        #[allow(unreachable_code)]
                        $ty::$variant $( ( $($t),* ) )? $( { $($f),* } )? => {
                            let name = concat!(stringify!($ty), "::", stringify!($variant));
                            $(
                                let mut out = f.debug_tuple(name);
                                $( out.field($t); )*
                                return out.finish();
                            )?
                            $(
                                let mut out = f.debug_struct(name);
                                $( out.field(stringify!($f), $f); )*
                                return out.finish();
                            )?
                            f.write_str(name)
                        }
                    )*
                }
            }
        }
    };
}

#[cfg(feature = "admin")]
mod admin;
mod algo;
mod backend;
mod completion;
mod config;
mod key;
mod layer;
mod limiter;
mod mode;
mod overrides;
mod quota;
#[cfg(feature = "reload")]
mod reload;
#[cfg(feature = "replay")]
mod replay;
#[cfg(feature = "stream")]
mod stream;
mod telemetry;
mod time;

#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub use admin::{AdminPrincipal, admin_router};
pub use algo::adaptive::{
    Adaptive, AdaptiveConcurrency, AdaptiveError, Algorithm, MAX_ADAPTIVE_SLOTS,
};
pub use algo::calendar::{CalendarError, CalendarQuota, CalendarState, Period};
pub use algo::concurrency::{ConcurrencyError, ConcurrencyLimit};
pub use algo::fair_share::{FairShare, FairShareError};
pub use algo::gcra::{GcraError, Limit, LimitError};
pub use algo::penalty::{Ladder, PenaltyError, PenaltyStanding};
pub use algo::tiers::{
    Tier, TierError, TierGrant, TierLog, TierRequestError, TierState, TieredLimit,
};
/// The batch kit: what a backend decides, written once, for a backend outside the crate.
pub use backend::kit;
pub use backend::regions::RegionShare;
pub use backend::{
    Backend, BackendError, BucketTx, DEFAULT_MAX_OVERRIDES, MemoryBackend, MemoryBackendBuilder,
    Mode, Outcome, Outcomes, PendingSpend, Spend, TransactionError,
};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use backend::{
    CoalesceStats, RedisBackend, RedisBackendBuilder, RedisSetupError, RegionalError,
};
pub use completion::{Completion, Measure};
#[cfg(feature = "yaml")]
#[cfg_attr(docsrs, doc(cfg(feature = "yaml")))]
pub use config::RuleSet;
pub use config::{
    ConfigError, ConfigErrorKind, LimitSource, Limits, LimitsBuilder, LimitsChange, Location,
    OverrideRefusal, RegionFloor,
};
#[cfg(feature = "stream")]
#[cfg_attr(docsrs, doc(cfg(feature = "stream")))]
pub use config::{ModelPrice, PriceOf, PriceTable, UnitPrice};
pub use key::{BucketKey, Id, IdError, IdKind, LimitName};
#[cfg(feature = "yaml")]
#[cfg_attr(docsrs, doc(cfg(feature = "yaml")))]
pub use layer::LoggedCost;
#[cfg(feature = "stream")]
#[cfg_attr(docsrs, doc(cfg(feature = "stream")))]
pub use layer::{AtLimit, ModelFrom, Per, StreamKeys};
pub use layer::{
    ClientIp, CountWhen, Denial, ErrorBody, FailurePolicy, FieldStyle, ForwardedHeader, Header,
    Ipv6Range48, KeyError, KeyExtractor, LayerError, OnMissingKey, RateLimitBody, RateLimitLayer,
    RateLimitLayerBuilder, RateLimitService, ResponseBody, ResponseFuture, Rule, Settle,
    SettleError, Wait, key_fn,
};
pub use limiter::{
    BatchDecision, Decision, Inspection, Lease, Limiter, LimiterError, OverrideError, PenaltyPage,
    ReloadError, Transaction,
};
pub use overrides::{BLOCK_WITHOUT_END, OverrideKind, StoredOverride};
pub use quota::{Quota, ShapeError};
#[cfg(feature = "reload")]
#[cfg_attr(docsrs, doc(cfg(feature = "reload")))]
pub use reload::{LimitsWatcher, ReloadReport, WatchError};
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub use replay::{
    Answered, BadLine, BadLineExample, Counts, Flip, Headroom, Heavy, KeyFlips, LimitPlan,
    LineError, LogFormat, LogReader, LoggedRequest, MAX_LINE_BYTES, PLAN_VERSION, PenaltyPlan,
    PerDay, Plan, Replay, ReplayError, Replayed, Suggested, SuggestedBudget, SuggestedCount,
    SuggestedMax, SuggestedTier, SuggestedTiers,
};
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub use replay::{
    DEFAULT_SNAPSHOT_KEYS, RefusedId, SNAPSHOT_VERSION, Snapshot, SnapshotError, SnapshotKey, Warm,
};
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub use replay::{
    MAX_SPREAD_MESSAGES, MessageCounts, StreamLine, StreamsEnded, StreamsPlan, Totals,
};
#[cfg(feature = "websocket")]
#[cfg_attr(docsrs, doc(cfg(feature = "websocket")))]
pub use stream::LimitedSocket;
#[cfg(feature = "stream")]
#[cfg_attr(docsrs, doc(cfg(feature = "stream")))]
pub use stream::{
    LimitedStream, MeteredBody, Overrun, StreamError, StreamLimited, StreamMeter,
    StreamMeterBuilder,
};
pub use time::{Clock, DurationError, ManualClock, SystemClock};

/// The `http` crate, whose request and response types the layer and its extractors use
/// (`http::request::Parts` in a [`KeyExtractor`] or a cost function), re-exported so a user
/// need not add it.
pub use http;

/// The `async-trait` crate's attribute, with which [`Backend`] is written, re-exported so that
/// a backend outside the crate implements it as `#[tower_ratelimits::async_trait]` without
/// adding the crate (the kit's example, [`kit`], does).
pub use async_trait::async_trait;

/// The `ipnet` crate's `IpNet`, in which trusted proxies and exemptions are given
/// ([`ClientIp::trusted_proxies`], [`RateLimitLayerBuilder::exempt_addresses`]), re-exported
/// so a user need not add it.
pub use ipnet::IpNet;

/// The guides and the specifications the crate is held to, as kept in the repository's
/// `docs/`.
// Prose in Markdown: brackets there are data (`[5,1,1,0]`), not links to items.
#[allow(rustdoc::broken_intra_doc_links, clippy::doc_lazy_continuation)]
pub mod specs {
    // The guides' Rust code is compiled and run as doc tests where the features it uses are
    // on (the test command turns every feature on); other builds render the pages alone.
    #[cfg_attr(
        any(not(doctest), all(feature = "redis", feature = "yaml", feature = "axum")),
        doc = include_str!("../docs/guide.md")
    )]
    #[cfg_attr(
        all(
            doctest,
            not(all(feature = "redis", feature = "yaml", feature = "axum"))
        ),
        doc = "Using tower-ratelimits (its code needs the features `redis`, `yaml`, `axum`)."
    )]
    pub mod guide {}
    #[cfg_attr(
        any(not(doctest), all(feature = "admin", feature = "yaml", feature = "axum")),
        doc = include_str!("../docs/operating.md")
    )]
    #[cfg_attr(
        all(
            doctest,
            not(all(feature = "admin", feature = "yaml", feature = "axum"))
        ),
        doc = "Operating tower-ratelimits (its code needs the features `admin`, `yaml`, `axum`)."
    )]
    pub mod operating {}
    #[doc = include_str!("../docs/gcra.md")]
    pub mod gcra {}
    #[doc = include_str!("../docs/burst-tiers.md")]
    pub mod burst_tiers {}
    #[doc = include_str!("../docs/calendar.md")]
    pub mod calendar {}
    #[doc = include_str!("../docs/concurrency.md")]
    pub mod concurrency {}
    #[doc = include_str!("../docs/fair-share.md")]
    pub mod fair_share {}
    #[doc = include_str!("../docs/adaptive-concurrency.md")]
    pub mod adaptive_concurrency {}
    #[doc = include_str!("../docs/keys-and-http.md")]
    pub mod keys_and_http {}
    #[doc = include_str!("../docs/penalties.md")]
    pub mod penalties {}
    #[cfg_attr(
        any(not(doctest), feature = "redis"),
        doc = include_str!("../docs/regions.md")
    )]
    #[cfg_attr(
        all(doctest, not(feature = "redis")),
        doc = "One limit across regions (its code needs the feature `redis`)."
    )]
    pub mod regions {}
    #[cfg_attr(
        any(not(doctest), feature = "replay"),
        doc = include_str!("../docs/replay.md")
    )]
    #[cfg_attr(
        all(doctest, not(feature = "replay")),
        doc = "Replaying access logs (its code needs the feature `replay`)."
    )]
    pub mod replay {}
    #[cfg_attr(
        any(
            not(doctest),
            all(feature = "websocket", feature = "tonic", feature = "yaml")
        ),
        doc = include_str!("../docs/streams.md")
    )]
    #[cfg_attr(
        all(
            doctest,
            not(all(feature = "websocket", feature = "tonic", feature = "yaml"))
        ),
        doc = "Limits inside a stream (its code needs the features `websocket`, `tonic`, `yaml`)."
    )]
    pub mod streams {}
}

/// The README's code, compiled and run as doc tests (its examples use axum and a YAML file).
#[cfg(all(doctest, feature = "yaml", feature = "axum"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Not part of the API: what this repository's own tests, benches and examples reach below
/// the public surface (the pure algorithms, duration parsing, a rule's scope, a settle
/// header's units). Anything here may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::algo::{adaptive, calendar, concurrency, fair_share, gcra, tiers};
    pub use crate::backend::regions::{Moved, ShareNow, SimulatedRegions};
    pub use crate::layer::{in_scope, parse_units, units_in};
    pub use crate::quota::ShapeRef;
    pub use crate::time::{instant_text, parse_duration_us, parse_instant};
}
