#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod backend;
pub mod config;
pub mod decision;
pub mod gcra;
pub mod key;
pub mod limit;
pub mod tiers;
pub mod time;

#[cfg(feature = "redis")]
pub use backend::RedisBackend;
pub use backend::{Backend, BackendError, MemoryBackend};
pub use config::{ConfigError, Limits};
pub use decision::{BatchDecision, Decision, Mode, Outcome, Transaction};
pub use key::{BucketKey, Id, IdKind, LimitName};
pub use limit::{Limit, Quota};
pub use time::{Clock, ManualClock, SystemClock};
pub mod limiter;
pub use limiter::{Limiter, LimiterError};
pub mod layer;
pub mod simulate;
pub use layer::{RateLimitLayer, Rule};
