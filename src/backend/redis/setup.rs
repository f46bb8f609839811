//! What connecting to a single Redis and to a cluster share: the setup error and the fred
//! builder every client of the backend is made with.

use std::time::Duration;

use fred::prelude::{Builder, Config, ReconnectPolicy};

/// Why a [`RedisBackend`](super::RedisBackend) could not be set up.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum RedisSetupError {
    /// The URL is not a Redis URL fred understands.
    #[error("invalid Redis URL: {0}")]
    InvalidUrl(String),
    /// The key prefix contains `{` or `}` (it would take over the hash tag) or is too long.
    #[error("invalid key prefix {prefix:?}: {reason}")]
    InvalidPrefix {
        /// The prefix.
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The server could not be reached or refused to load the script.
    #[error("cannot connect to Redis at {address}: {reason}{}", lazy_hint(*.single))]
    Connect {
        /// Where: `host:port` (of every seed node for a cluster), never the credentials.
        address: String,
        /// What went wrong.
        reason: String,
        /// A single server (or pool), which a lazy backend can start without.
        single: bool,
    },
    /// Regional mode ([`RedisBackendBuilder::regional`](super::RedisBackendBuilder::regional))
    /// set up wrong: a region name that is not 1 to 32 letters, digits, `-` or `_`, a global
    /// store with the region's own prefix, or a rebalance period or lease margin of zero.
    #[error("invalid regional mode: {0}")]
    InvalidRegional(super::regions::RegionalError),
}

readable_debug!(RedisSetupError { InvalidUrl(url), InvalidPrefix { prefix, reason }, Connect { address, reason, single }, InvalidRegional(what) });

/// What a single server's connect error suggests: a lazy backend.
fn lazy_hint(single: bool) -> &'static str {
    if single {
        "; to start without it (connecting in the background while the failure policy decides), \
         build the backend with `.lazy(true)`"
    } else {
        ""
    }
}

/// The servers of a configuration, `host:port`, without the credentials a URL may hold.
pub(super) fn address(config: &fred::prelude::Config) -> String {
    let hosts: Vec<String> = config
        .server
        .hosts()
        .iter()
        .map(ToString::to_string)
        .collect();
    hosts.join(", ")
}

impl RedisSetupError {
    /// A connect error at `address`.
    pub(super) fn connect(address: &str, reason: impl Into<String>, single: bool) -> Self {
        RedisSetupError::Connect {
            address: address.to_owned(),
            reason: reason.into(),
            single,
        }
    }
}

/// A fred builder with the backend's settings: the command timeout, one attempt per command
/// (a retried spend could be applied twice) and reconnection forever, in the background.
pub(super) fn configured_builder(config: Config, timeout: Duration) -> Builder {
    let mut builder = Builder::from_config(config);
    builder
        .with_performance_config(|p| p.default_command_timeout = timeout)
        .with_connection_config(|c| {
            c.connection_timeout = timeout.max(Duration::from_secs(1));
            c.internal_command_timeout = timeout.max(Duration::from_secs(1));
            c.max_command_attempts = 1;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2));
    builder
}
