//! The Redis / Redis Cluster backend (feature `redis`), over [fred].
//!
//! # How a request is decided
//!
//! Every transaction of a batch whose keys share a slot is decided **and** written by one Lua
//! script, run with `EVALSHA` (and `EVAL` once, when the server answers `NOSCRIPT`, e.g. after
//! `SCRIPT FLUSH` or a failover). The script mirrors [`gcra`](crate::algo::gcra) in integer microseconds, so
//! Redis decides exactly as the in-memory backend does. On a single Redis server the whole batch
//! is one script, one round trip.
//!
//! By default the script reads the server's clock (`TIME`), so app instances whose clocks
//! disagree still agree on every decision. [`RedisBackendBuilder::caller_time`] makes the
//! caller's [`Clock`] the time source instead (tests, the simulator).
//!
//! # Keys
//!
//! A bucket lives at `<prefix>{<limit name>:<id>}` (prefix `rl:` by default): the braces are a
//! Redis Cluster hash tag. In a text id, every byte outside printable ASCII and every `{`, `}`
//! and `%` is written as `%XX`, so no client-chosen id can move a key to another slot, collide
//! with another id, or break the format. A key expires (`PXAT`) at the moment its bucket equals
//! a fresh one, so an idle client costs nothing.
//!
//! # Redis Cluster
//!
//! The keys of one request usually live in different slots. The batch is split by slot and the
//! scripts run concurrently, one per slot. If a group is denied while another group was allowed
//! (and spent), what the allowed groups spent is refunded at once, so the batch is all or nothing
//! as seen by the client. **The remaining race:** between the spend and its refund (one round
//! trip), other requests on those keys see the spend and may be denied; they are never
//! over-admitted. If the refund itself fails (the node went away), the spend stays until it
//! drains at the limit's rate; the failure is logged.
//!
//! # Local deny cache
//!
//! On by default. When Redis denies a batch, the backend remembers each of its buckets' TAT
//! (translated to the local clock, rounded toward "earlier"). A later batch whose buckets are all
//! remembered and that the remembered TATs already deny is denied locally, with no round trip:
//! a client flooding a denied key costs Redis nothing. Remembered TATs are lower bounds of the
//! real ones (spends only move a TAT forward), so the cache never denies what Redis would allow,
//! with one exception it cannot see: a refund or reset made **by another app instance**. Refunds
//! and resets made through this backend update the cache. Turn it off with
//! [`RedisBackendBuilder::deny_cache`] if other instances refund or reset and a wrong denial of
//! up to `retry_after` is not acceptable.
//!
//! # Failures
//!
//! Every command has a timeout ([`RedisBackendBuilder::command_timeout`], 500 ms by default;
//! fred's own default is none). An unreachable server gives [`BackendError::Unavailable`] or
//! [`BackendError::Timeout`], and the middleware applies its failure policy; the client
//! reconnects by itself, so the backend recovers without restarting the app. Another program's
//! data at a bucket's key (a wrong type, a value that is not a TAT) gives
//! [`BackendError::InvalidState`] and nothing is written.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dashmap::DashMap;
use fred::prelude::{
    Builder, Client, ClientLike, Config, Error as FredError, ErrorKind, Key, KeysInterface,
    LuaInterface, Pool, ReconnectPolicy, ServerConfig, Value,
};

mod cluster;

use cluster::ClusterRouter;

use super::{Backend, BackendError, BucketTx, batch_allowed};
use crate::algo::gcra::{self, GcraError};
use crate::algo::tiers::{MAX_TIERS, TierGrant, TierRequestError};
use crate::backend::{Mode, Outcome};
use crate::key::BucketKey;
use crate::quota::Quota;
use crate::time::{Clock, SystemClock};

/// The script (GCRA and burst tiers), as run by `EVALSHA`.
pub const SCRIPT: &str = include_str!("ratelimit.lua");

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "rl:";

/// The default timeout of every Redis command.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

/// The default number of buckets the local deny cache remembers.
pub const DEFAULT_DENY_CACHE_CAPACITY: usize = 100_000;

/// TATs and times sent to or read from Redis stay below 2^52 µs (year 2112), so that the
/// script's doubles are exact.
const MAX_TIME_US: u64 = 1 << 52;

/// In caller-time mode a key expires this long after the moment its bucket is full again,
/// counted on the server's clock from the write: the server cannot follow the caller's clock,
/// and a run slower than its own time must not lose state.
const CALLER_TIME_EXPIRY_MARGIN_MS: i64 = 3_600_000;

/// Why a [`RedisBackend`] could not be set up.
#[derive(Debug, thiserror::Error)]
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
    #[error("cannot connect to Redis: {0}")]
    Connect(String),
}

enum Connection {
    Client(Client),
    Pool(Pool),
    Cluster(ClusterRouter),
}

impl Connection {
    /// The client for `slot` (any client when not clustered).
    fn client(&self, slot: u16) -> Result<Client, BackendError> {
        match self {
            Connection::Client(c) => Ok(c.clone()),
            Connection::Pool(p) => Ok(p.next().clone()),
            Connection::Cluster(r) => r.client_for_slot(slot),
        }
    }
}

/// A fred builder with the backend's settings: the command timeout, one attempt per command
/// (a retried spend could be applied twice) and reconnection forever, in the background.
pub(crate) fn configured_builder(config: Config, timeout: Duration) -> Builder {
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

enum Source {
    Url(String),
    Client(Client),
    Pool(Pool),
}

/// Builds a [`RedisBackend`]: see [`RedisBackend::from_url`], [`RedisBackend::from_client`] and
/// [`RedisBackend::from_pool`].
pub struct RedisBackendBuilder {
    source: Source,
    prefix: String,
    command_timeout: Duration,
    pool_size: usize,
    clock: Option<Arc<dyn Clock>>,
    deny_cache: bool,
    deny_cache_capacity: usize,
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackendBuilder")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.command_timeout)
            .field("pool_size", &self.pool_size)
            .field("caller_time", &self.clock.is_some())
            .field("deny_cache", &self.deny_cache)
            .finish()
    }
}

impl RedisBackendBuilder {
    fn new(source: Source) -> Self {
        Self {
            source,
            prefix: DEFAULT_PREFIX.to_owned(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            pool_size: 1,
            clock: None,
            deny_cache: true,
            deny_cache_capacity: DEFAULT_DENY_CACHE_CAPACITY,
        }
    }

    /// The prefix of every key (default `rl:`). It must not contain `{` or `}` and is at most
    /// 128 bytes.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The timeout of every command (default 500 ms). A zero duration is raised to 1 ms: there
    /// is always a timeout.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Connections to open when built from a URL (default 1; fred pipelines commands on one
    /// connection, more help only under heavy concurrency).
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Uses `clock` instead of the server's clock as the time of every decision. For tests and
    /// the simulator: app instances whose clocks disagree would disagree on decisions. Keys then
    /// expire one hour (on the server's clock) after the time their bucket needs to refill
    /// (the server cannot follow a manual clock).
    pub fn caller_time(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Turns the local deny cache on or off (default on).
    pub fn deny_cache(mut self, enabled: bool) -> Self {
        self.deny_cache = enabled;
        self
    }

    /// How many buckets the deny cache remembers at most (default
    /// 100,000).
    pub fn deny_cache_capacity(mut self, capacity: usize) -> Self {
        self.deny_cache_capacity = capacity;
        self
    }

    /// Connects (when built from a URL) and loads the script.
    pub async fn connect(self) -> Result<RedisBackend, RedisSetupError> {
        if self.prefix.contains(['{', '}']) {
            return Err(RedisSetupError::InvalidPrefix {
                prefix: self.prefix,
                reason: "it must not contain '{' or '}'",
            });
        }
        if self.prefix.len() > 128 {
            return Err(RedisSetupError::InvalidPrefix {
                prefix: self.prefix,
                reason: "it is longer than 128 bytes",
            });
        }
        let timeout = self.command_timeout;
        let connect_timeout = timeout.max(Duration::from_secs(2));
        // Connections the backend opened itself are closed when it is dropped.
        let owned = matches!(self.source, Source::Url(_));
        let conn = match self.source {
            Source::Client(c) if c.is_clustered() => {
                // The backend opens one connection per master from the client's configuration.
                Connection::Cluster(ClusterRouter::connect(c.client_config(), timeout).await?)
            }
            Source::Pool(p) if p.next().is_clustered() => Connection::Cluster(
                ClusterRouter::connect(p.next().client_config(), timeout).await?,
            ),
            Source::Client(c) => Connection::Client(c),
            Source::Pool(p) => Connection::Pool(p),
            Source::Url(url) => {
                check_scheme(&url)?;
                let config = Config::from_url(&url)
                    .map_err(|e| RedisSetupError::InvalidUrl(e.to_string()))?;
                if matches!(config.server, ServerConfig::Clustered { .. }) {
                    Connection::Cluster(ClusterRouter::connect(config, timeout).await?)
                } else {
                    let builder = configured_builder(config, timeout);
                    let conn = if self.pool_size > 1 {
                        let pool = builder
                            .build_pool(self.pool_size)
                            .map_err(|e| RedisSetupError::InvalidUrl(e.to_string()))?;
                        Connection::Pool(pool)
                    } else {
                        let client = builder
                            .build()
                            .map_err(|e| RedisSetupError::InvalidUrl(e.to_string()))?;
                        Connection::Client(client)
                    };
                    let init = async {
                        match &conn {
                            Connection::Client(c) => c.init().await.map(drop),
                            Connection::Pool(p) => p.init().await.map(drop),
                            Connection::Cluster(_) => Ok(()),
                        }
                    };
                    match tokio::time::timeout(connect_timeout, init).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(RedisSetupError::Connect(e.to_string())),
                        Err(_) => {
                            return Err(RedisSetupError::Connect(format!(
                                "no connection within {connect_timeout:?}"
                            )));
                        }
                    }
                    conn
                }
            }
        };
        let clustered = matches!(conn, Connection::Cluster(_));
        if let Connection::Cluster(router) = &conn {
            router.load_script(connect_timeout).await?;
        } else {
            let client = conn
                .client(0)
                .map_err(|e| RedisSetupError::Connect(e.to_string()))?;
            match tokio::time::timeout(connect_timeout, client.script_load::<String, _>(SCRIPT))
                .await
            {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(RedisSetupError::Connect(e.to_string())),
                Err(_) => return Err(RedisSetupError::Connect("SCRIPT LOAD timed out".into())),
            }
        }
        let local: Arc<dyn Clock> = match &self.clock {
            Some(c) => c.clone(),
            None => Arc::new(SystemClock),
        };
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                conn,
                owned: owned || clustered,
                prefix: self.prefix,
                caller_time: self.clock.is_some(),
                local,
                clustered,
                timeout,
                sha: fred::util::sha1_hash(SCRIPT),
                cache: self
                    .deny_cache
                    .then(|| DenyCache::new(self.deny_cache_capacity)),
            }),
        })
    }
}

/// Accepts the schemes the backend supports, with a clear error for the others.
fn check_scheme(url: &str) -> Result<(), RedisSetupError> {
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    match scheme {
        "redis" | "redis-cluster" => Ok(()),
        "rediss" | "rediss-cluster" if cfg!(feature = "redis-tls") => Ok(()),
        "rediss" | "rediss-cluster" => Err(RedisSetupError::InvalidUrl(format!(
            "{scheme}:// needs the `redis-tls` feature of tower-ratelimits"
        ))),
        _ => Err(RedisSetupError::InvalidUrl(format!(
            "unsupported scheme {scheme:?}: use redis://, rediss:// or redis-cluster://"
        ))),
    }
}

struct Inner {
    conn: Connection,
    owned: bool,
    prefix: String,
    caller_time: bool,
    local: Arc<dyn Clock>,
    clustered: bool,
    timeout: Duration,
    sha: String,
    cache: Option<DenyCache>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        match &self.conn {
            Connection::Client(c) => {
                let c = c.clone();
                runtime.spawn(async move { c.quit().await });
            }
            Connection::Pool(p) => {
                let p = p.clone();
                runtime.spawn(async move { p.quit().await });
            }
            Connection::Cluster(r) => r.close(),
        }
    }
}

/// The Redis / Redis Cluster backend. Cheap to clone (an `Arc`).
///
/// ```no_run
/// use std::time::Duration;
/// use tower_ratelimits::{Limiter, Limits, RedisBackend};
///
/// async fn limiter(limits: Limits) -> Result<Limiter, Box<dyn std::error::Error>> {
///     let backend = RedisBackend::from_url("redis://127.0.0.1:6379")
///         .prefix("myapp:rl:")
///         .command_timeout(Duration::from_millis(200))
///         .connect()
///         .await?;
///     Ok(Limiter::new(limits, backend))
/// }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.inner.prefix)
            .field("clustered", &self.inner.clustered)
            .field("caller_time", &self.inner.caller_time)
            .field("deny_cache", &self.inner.cache.is_some())
            .finish()
    }
}

/// What one script run answered.
struct ScriptReply {
    outcomes: Vec<Outcome>,
    /// TAT stored after the script, per key (0: none).
    tats: Vec<u64>,
    /// Per tiered key, when asked for: its value before and after, and the milliseconds the
    /// value before had to live.
    raws: Vec<Option<RawChange>>,
    /// The script's now.
    now: u64,
}

/// A tiered key's value before and after a spend, to undo it.
#[derive(Clone)]
struct RawChange {
    before: Value,
    after: Value,
    ttl_ms: i64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Spend,
    Refund,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Spend => "spend",
            Op::Refund => "refund",
        }
    }
}

/// The suffix of a tiered key's Redis key (after the hash tag, so it stays in the same slot):
/// a name switched between GCRA and tiers never reads the other algorithm's state.
const TIERS_SUFFIX: &str = ":t";

fn mode_code(mode: Mode) -> i64 {
    match mode {
        Mode::CheckAndSpend => 0,
        Mode::CheckOnly => 1,
        Mode::SpendOnly => 2,
    }
}

fn int(v: u64) -> Value {
    // Every value sent is below 2^53 (see `MAX_BURST_OFFSET_US` and `MAX_TIME_US`).
    Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

fn unavailable(e: FredError) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

/// Writes `id` into `out`, escaping what could break the key format (see the module docs).
fn push_escaped(out: &mut String, id: &str) {
    for b in id.bytes() {
        if (0x21..=0x7e).contains(&b) && !matches!(b, b'{' | b'}' | b'%') {
            out.push(b as char);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
    }
}

impl RedisBackend {
    /// A builder connecting to `url`: `redis://[user:pass@]host:port[/db]`, `rediss://` (TLS,
    /// needs the `redis-tls` feature) or `redis-cluster://host:port[?node=host:port…]`.
    pub fn from_url(url: impl Into<String>) -> RedisBackendBuilder {
        RedisBackendBuilder::new(Source::Url(url.into()))
    }

    /// A builder over a fred client you configured and initialized. Set its command timeout
    /// yourself if you like; the backend also bounds each command by
    /// [`command_timeout`](RedisBackendBuilder::command_timeout).
    pub fn from_client(client: Client) -> RedisBackendBuilder {
        RedisBackendBuilder::new(Source::Client(client))
    }

    /// A builder over a fred pool you configured and initialized.
    pub fn from_pool(pool: Pool) -> RedisBackendBuilder {
        RedisBackendBuilder::new(Source::Pool(pool))
    }

    /// A fred client of this backend (the next one of the pool; on a cluster, the client of
    /// the node serving slot 0), for your own commands.
    pub fn client(&self) -> Client {
        match &self.inner.conn {
            Connection::Client(c) => c.clone(),
            Connection::Pool(p) => p.next().clone(),
            Connection::Cluster(r) => r.any_client(),
        }
    }

    /// The fred client of the node that holds `key` (see [`redis_key`](Self::redis_key)).
    pub fn client_for_key(&self, key: &str) -> Result<Client, BackendError> {
        self.inner
            .conn
            .client(fred::util::redis_keyslot(key.as_bytes()))
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Whether the server is a Redis Cluster.
    pub fn is_clustered(&self) -> bool {
        self.inner.clustered
    }

    /// The SHA-1 of the script, as used by `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        &self.inner.sha
    }

    /// Batches the local deny cache answered without a round trip, since the backend was built.
    pub fn deny_cache_hits(&self) -> u64 {
        self.inner
            .cache
            .as_ref()
            .map_or(0, |c| c.hits.load(Ordering::Relaxed))
    }

    /// The Redis key of a bucket: `<prefix>{<limit name>:<escaped id>}`. The limit's name,
    /// not its place in a file, so the key keeps its meaning when the configuration is
    /// reordered, extended or reloaded. In the id, `{`, `}`, `%`, spaces and bytes outside
    /// printable ASCII are percent-escaped: the bucket of limit `Api` for the id `a{b}%c é`
    /// is `rl:{Api:a%7Bb%7D%25c%20%C3%A9}`.
    pub fn redis_key(&self, key: &BucketKey) -> String {
        redis_key(&self.inner.prefix, key)
    }

    /// The Redis key of a tiered key's state: [`redis_key`](Self::redis_key) followed by `:t`
    /// (same slot; a name switched between GCRA and tiers never reads the other's state).
    pub fn redis_tier_key(&self, key: &BucketKey) -> String {
        let mut k = redis_key(&self.inner.prefix, key);
        k.push_str(TIERS_SUFFIX);
        k
    }

    fn now_arg(&self) -> Result<(i64, u64), BackendError> {
        let local = self.inner.local.now_us();
        if !self.inner.caller_time {
            return Ok((-1, local));
        }
        if local >= MAX_TIME_US {
            return Err(GcraError::TimeOverflow.into());
        }
        Ok((i64::try_from(local).unwrap_or(i64::MAX), local))
    }

    /// Splits a batch into groups of one slot (one group, "slot" 0, when not clustered).
    fn groups(&self, keys: &[Key]) -> Vec<(u16, Vec<usize>)> {
        if !self.inner.clustered {
            return vec![(0, (0..keys.len()).collect())];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = fred::util::redis_keyslot(key.as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups
    }

    /// Runs `f` on the client of `slot`; on a cluster, a `MOVED`/`ASK` answer refreshes the
    /// slot map and retries once (the command did not run), and a failure to reach the node
    /// schedules a refresh (a failover may have moved the slot).
    async fn with_client<T, F, Fut>(&self, slot: u16, f: F) -> Result<T, BackendError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, FredError>>,
    {
        let timeout = self.inner.timeout;
        let attempt = |client: Client| async {
            match tokio::time::timeout(timeout, f(client)).await {
                Ok(r) => r.map_err(Some),
                Err(_) => Err(None),
            }
        };
        let client = self.inner.conn.client(slot)?;
        let result = attempt(client).await;
        let Connection::Cluster(router) = &self.inner.conn else {
            return result.map_err(|e| self.error(e));
        };
        match result {
            Ok(v) => Ok(v),
            Err(Some(e)) if cluster::is_redirect(&e) => {
                router.refresh_now().await;
                let client = self.inner.conn.client(slot)?;
                attempt(client).await.map_err(|e| self.error(e))
            }
            Err(e) => {
                router.refresh_soon();
                Err(self.error(e))
            }
        }
    }

    fn error(&self, e: Option<FredError>) -> BackendError {
        match e {
            None => BackendError::Timeout(self.inner.timeout),
            Some(e) if *e.kind() == ErrorKind::Timeout => BackendError::Timeout(self.inner.timeout),
            Some(e) => unavailable(e),
        }
    }

    async fn run_script(
        &self,
        op: Op,
        now: i64,
        batch: &[BucketTx<'_>],
        keys: &[Key],
        (slot, group): &(u16, Vec<usize>),
        want_raw: bool,
    ) -> Result<ScriptReply, BackendError> {
        let slot = *slot;
        let mut args = Vec::with_capacity(4 + group.len() * 6);
        args.push(Value::from(op.name()));
        args.push(Value::Integer(now));
        args.push(Value::Integer(if self.inner.caller_time {
            CALLER_TIME_EXPIRY_MARGIN_MS
        } else {
            -1
        }));
        args.push(Value::Integer(i64::from(want_raw)));
        let mut script_keys = Vec::with_capacity(group.len());
        for &i in group {
            let tx = &batch[i];
            match tx.quota {
                Quota::Gcra(limit) => {
                    args.push(Value::Integer(0));
                    args.push(int(limit.emission_interval_us()));
                    args.push(int(limit.burst_offset_us()));
                    args.push(int(limit.burst()));
                    args.push(int(tx.cost));
                    args.push(Value::Integer(mode_code(tx.mode)));
                }
                Quota::Tiered(limit) => {
                    args.push(Value::Integer(1));
                    args.push(Value::Integer(mode_code(tx.mode)));
                    args.push(int(tx.min_cost));
                    args.push(int(tx.cost));
                    args.push(int(limit.tiers().len() as u64));
                    for t in limit.tiers() {
                        args.push(int(t.limit()));
                        args.push(int(t.window_us()));
                        args.push(int(t.active_us()));
                        args.push(int(t.cooldown_us()));
                    }
                }
            }
            script_keys.push(keys[i].clone());
        }
        let sha = self.inner.sha.as_str();
        let value = self
            .with_client(slot, |client| {
                let (script_keys, args) = (&script_keys, &args);
                async move {
                    match client
                        .evalsha::<Value, _, _, _>(sha, script_keys.clone(), args.clone())
                        .await
                    {
                        Err(e) if e.details().contains("NOSCRIPT") => {
                            tracing::debug!("Redis lost the rate-limit script; sending it again");
                            client
                                .eval::<Value, _, _, _>(SCRIPT, script_keys.clone(), args.clone())
                                .await
                        }
                        other => other,
                    }
                }
            })
            .await?;
        decode(value, batch, group, keys, want_raw)
    }

    /// Runs `op` on every group (concurrently), returning replies in batch order.
    async fn run_groups(
        &self,
        op: Op,
        now: i64,
        batch: &[BucketTx<'_>],
        keys: &[Key],
        groups: &[(u16, Vec<usize>)],
    ) -> Vec<Result<ScriptReply, BackendError>> {
        if let [group] = groups {
            return vec![self.run_script(op, now, batch, keys, group, false).await];
        }
        // Several slots: a spend may have to be undone, so tiered keys report their values.
        let want_raw = op == Op::Spend && batch.iter().any(|tx| tx.quota.as_tiered().is_some());
        futures_util::future::join_all(
            groups
                .iter()
                .map(|g| self.run_script(op, now, batch, keys, g, want_raw)),
        )
        .await
    }

    fn keys(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Key>, BackendError> {
        batch
            .iter()
            .map(|tx| match tx.quota {
                Quota::Gcra(limit) => {
                    if tx.cost > limit.burst() {
                        return Err(GcraError::CostAboveBurst {
                            cost: tx.cost,
                            burst: limit.burst(),
                        }
                        .into());
                    }
                    Ok(Key::from(self.redis_key(tx.key)))
                }
                Quota::Tiered(limit) => {
                    if tx.min_cost > tx.cost {
                        return Err(TierRequestError::MinAboveMax {
                            min: tx.min_cost,
                            max: tx.cost,
                        }
                        .into());
                    }
                    if tx.min_cost > limit.capacity() {
                        return Err(TierRequestError::MinAboveCapacity {
                            min: tx.min_cost,
                            capacity: limit.capacity(),
                        }
                        .into());
                    }
                    Ok(Key::from(self.redis_tier_key(tx.key)))
                }
            })
            .collect()
    }

    /// Gives back what allowed groups of a denied cluster batch spent: GCRA buckets by a
    /// refund, tiered keys by putting back their value from before (when nobody wrote them
    /// since), which also undoes the tiers the spend entered.
    async fn compensate(
        &self,
        batch: &[BucketTx<'_>],
        keys: &[Key],
        spent: &[usize],
        raws: &[Option<RawChange>],
    ) {
        let txs: Vec<BucketTx<'_>> = spent
            .iter()
            .filter(|&&i| batch[i].quota.as_gcra().is_some())
            .map(|&i| batch[i])
            .collect();
        if let Err(e) = self.refund_batch(&txs).await {
            tracing::error!(
                error = %e,
                "could not refund the allowed part of a denied cross-slot batch; \
                 it drains at the limits' rate"
            );
        }
        for &i in spent {
            let Some(raw) = &raws[i] else { continue };
            if raw.before == raw.after {
                continue;
            }
            let slot = fred::util::redis_keyslot(keys[i].as_bytes());
            let args: Vec<Value> = vec![
                Value::from("restore"),
                Value::Integer(-1),
                Value::Integer(-1),
                Value::Integer(0),
                raw.after.clone(),
                raw.before.clone(),
                Value::Integer(raw.ttl_ms),
            ];
            let key = keys[i].clone();
            let sha = self.inner.sha.as_str();
            let result = self
                .with_client(slot, |client| {
                    let (key, args) = (key.clone(), args.clone());
                    async move {
                        match client
                            .evalsha::<Value, _, _, _>(sha, key.clone(), args.clone())
                            .await
                        {
                            Err(e) if e.details().contains("NOSCRIPT") => {
                                client.eval::<Value, _, _, _>(SCRIPT, key, args).await
                            }
                            other => other,
                        }
                    }
                })
                .await;
            if let Err(e) = result {
                tracing::error!(
                    error = %e,
                    "could not undo the tiered part of a denied cross-slot batch"
                );
            }
        }
    }

    async fn refund_batch(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let keys = self.keys(batch)?;
        let (now, _) = self.now_arg()?;
        if let Some(cache) = &self.inner.cache {
            for tx in batch {
                cache.forget(tx.key);
            }
        }
        let groups = self.groups(&keys);
        let replies = self
            .run_groups(Op::Refund, now, batch, &keys, &groups)
            .await;
        let mut outcomes = vec![Outcome::new(false, 0, 0, 0); batch.len()];
        for ((_, group), reply) in groups.iter().zip(replies) {
            let reply = reply?;
            for (&i, o) in group.iter().zip(reply.outcomes) {
                outcomes[i] = o;
            }
        }
        Ok(outcomes)
    }
}

/// The Redis key of `key` under `prefix` (see [`RedisBackend::redis_key`]).
pub(crate) fn redis_key(prefix: &str, key: &BucketKey) -> String {
    use std::fmt::Write as _;
    /// Escapes what the id's `Display` writes, straight into the key.
    struct Escaping<'a>(&'a mut String);
    impl fmt::Write for Escaping<'_> {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            push_escaped(self.0, s);
            Ok(())
        }
    }
    let mut out = String::with_capacity(prefix.len() + 64);
    out.push_str(prefix);
    out.push('{');
    push_escaped(&mut out, key.name().as_str());
    out.push(':');
    let _ = write!(Escaping(&mut out), "{}", key.id());
    out.push('}');
    out
}

fn decode(
    value: Value,
    batch: &[BucketTx<'_>],
    group: &[usize],
    keys: &[Key],
    want_raw: bool,
) -> Result<ScriptReply, BackendError> {
    let bad =
        |reason: String| BackendError::Unavailable(format!("unexpected script reply: {reason}"));
    let Value::Array(mut items) = value else {
        return Err(bad(format!("{:?}", value.kind())));
    };
    if items.first().and_then(Value::as_i64) == Some(-1) {
        let index = items
            .get(1)
            .and_then(Value::as_i64)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| group.get(i))
            .copied();
        let reason = items
            .get(2)
            .and_then(|v| v.as_string())
            .unwrap_or_else(|| "invalid state".into());
        let key = index.map_or_else(
            || "?".into(),
            |i| {
                keys.get(i)
                    .and_then(|k| k.as_str().map(str::to_owned))
                    .unwrap_or_else(|| batch[i].key.to_string())
            },
        );
        return Err(BackendError::InvalidState { key, reason });
    }
    if items.len() != group.len() + 1 {
        return Err(bad(format!(
            "{} values for {} keys",
            items.len(),
            group.len()
        )));
    }
    let num = |v: &Value| -> Result<u64, BackendError> {
        v.as_i64()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(format!("{v:?} is not a non-negative integer")))
    };
    let now = num(&items[group.len()])?;
    let mut outcomes = Vec::with_capacity(group.len());
    let mut tats = Vec::with_capacity(group.len());
    let mut raws = Vec::new();
    for (&i, item) in group.iter().zip(items.iter_mut()) {
        let Value::Array(fields) = item else {
            return Err(bad(format!("{:?} for one key", item.kind())));
        };
        let tiers = batch[i].quota.as_tiered().map(|t| t.tiers().len());
        let expected = match tiers {
            None => 5,
            Some(n) => 8 + n + if want_raw { 3 } else { 0 },
        };
        if fields.len() != expected {
            return Err(bad(format!("{} values for one key", fields.len())));
        }
        let mut outcome = Outcome::new(
            num(&fields[0])? == 1,
            num(&fields[1])?,
            num(&fields[2])?,
            num(&fields[3])?,
        );
        tats.push(num(&fields[4])?);
        if let Some(n) = tiers {
            let mut grant = TierGrant {
                granted: num(&fields[5])?,
                tier_count: n as u8,
                tier: u8::try_from(num(&fields[6])?).map_err(|_| bad("tier".into()))?,
                burst: num(&fields[7])? == 1,
                ..TierGrant::default()
            };
            for (j, u) in fields[8..8 + n.min(MAX_TIERS)].iter().enumerate() {
                grant.units[j] = num(u)?;
            }
            outcome.tiers = Some(grant);
            if want_raw {
                let ttl_ms = fields[8 + n + 2].as_i64().unwrap_or(-1);
                let after = std::mem::replace(&mut fields[8 + n + 1], Value::Null);
                let before = std::mem::replace(&mut fields[8 + n], Value::Null);
                raws.resize(outcomes.len(), None);
                raws.push(Some(RawChange {
                    before,
                    after,
                    ttl_ms,
                }));
            }
        }
        outcomes.push(outcome);
    }
    raws.resize(outcomes.len(), None);
    Ok(ScriptReply {
        outcomes,
        tats,
        raws,
        now,
    })
}

#[async_trait]
impl Backend for RedisBackend {
    async fn spend(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let (now, local_now) = self.now_arg()?;
        if let Some(cache) = &self.inner.cache
            && let Some(answer) = cache.answer(batch, local_now)
        {
            return answer;
        }
        let keys = self.keys(batch)?;
        let groups = self.groups(&keys);
        let replies = self.run_groups(Op::Spend, now, batch, &keys, &groups).await;

        let mut outcomes = vec![Outcome::new(false, 0, 0, 0); batch.len()];
        let mut local_tats = vec![0u64; batch.len()];
        let mut group_allowed = Vec::with_capacity(groups.len());
        let mut first_error = None;
        let mut raws: Vec<Option<RawChange>> = vec![None; batch.len()];
        for ((_, group), reply) in groups.iter().zip(replies) {
            match reply {
                Ok(reply) => {
                    for (&i, raw) in group.iter().zip(&reply.raws) {
                        raws[i] = raw.clone();
                    }
                    let allowed = group
                        .iter()
                        .zip(&reply.outcomes)
                        .all(|(&i, o)| !batch[i].mode.counts() || o.allowed);
                    group_allowed.push(Some(allowed));
                    for ((&i, o), tat) in group.iter().zip(reply.outcomes).zip(reply.tats) {
                        outcomes[i] = o;
                        local_tats[i] = if tat > reply.now {
                            local_now.saturating_add(tat - reply.now)
                        } else {
                            0
                        };
                    }
                }
                Err(e) => {
                    group_allowed.push(None);
                    first_error.get_or_insert(e);
                }
            }
        }
        let all_allowed = group_allowed.iter().all(|a| *a == Some(true));
        let mut spent = Vec::new();
        if !all_allowed && groups.len() > 1 {
            // Another group was denied or failed: take back what the allowed groups spent.
            spent = groups
                .iter()
                .zip(&group_allowed)
                .filter(|(_, a)| **a == Some(true))
                .flat_map(|((_, g), _)| g.iter().copied())
                .filter(|&i| batch[i].mode != Mode::CheckOnly && outcomes[i].allowed)
                .collect();
            if !spent.is_empty() {
                self.compensate(batch, &keys, &spent, &raws).await;
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if let Some(cache) = &self.inner.cache {
            for (i, tx) in batch.iter().enumerate() {
                if tx.quota.as_tiered().is_some() {
                    continue;
                }
                if all_allowed {
                    cache.refresh(tx.key, local_tats[i]);
                } else if spent.contains(&i) {
                    // Refunded: its TAT is no longer the one the script returned.
                    cache.forget(tx.key);
                } else {
                    cache.remember(tx.key, local_tats[i], local_now);
                }
            }
        }
        Ok(outcomes)
    }

    fn spend_now(&self, batch: &[BucketTx<'_>]) -> Option<Result<Vec<Outcome>, BackendError>> {
        let cache = self.inner.cache.as_ref()?;
        let now = self.inner.local.now_us();
        cache.answer(batch, now)
    }

    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        self.refund_batch(batch).await
    }

    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        if keys.is_empty() {
            return Ok(());
        }
        if let Some(cache) = &self.inner.cache {
            for key in keys {
                cache.forget(key);
            }
        }
        let redis_keys: Vec<Key> = keys
            .iter()
            .flat_map(|k| {
                [
                    Key::from(self.redis_key(k)),
                    Key::from(self.redis_tier_key(k)),
                ]
            })
            .collect();
        let groups = self.groups(&redis_keys);
        let dels = groups.iter().map(|(slot, g)| {
            let ks: Vec<Key> = g.iter().map(|&i| redis_keys[i].clone()).collect();
            self.with_client(*slot, move |client| {
                let ks = ks.clone();
                async move { client.del::<i64, _>(ks).await }
            })
        });
        for r in futures_util::future::join_all(dels).await {
            r?;
        }
        Ok(())
    }
}

/// Remembers the TATs of recently denied buckets, on the local clock.
struct DenyCache {
    /// Bucket -> TAT lower bound in local microseconds (0: the bucket was fresh).
    map: DashMap<BucketKey, u64, foldhash::fast::RandomState>,
    capacity: usize,
    hits: AtomicU64,
}

impl DenyCache {
    fn new(capacity: usize) -> Self {
        Self {
            map: DashMap::with_hasher(foldhash::fast::RandomState::default()),
            capacity,
            hits: AtomicU64::new(0),
        }
    }

    /// Answers a batch locally when every bucket is remembered and the remembered TATs deny
    /// it. Never answers "allowed".
    fn answer(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Option<Result<Vec<Outcome>, BackendError>> {
        if self.map.is_empty() {
            return None;
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for tx in batch {
            // Only GCRA buckets are remembered: a batch with a tiered key goes to Redis.
            let limit = tx.quota.as_gcra()?;
            let tat = *self.map.get(tx.key)?;
            match gcra::check(limit, (tat != 0).then_some(tat), now, tx.cost) {
                Ok(o) => outcomes.push(Outcome::from(o)),
                Err(_) => return None,
            }
        }
        if batch_allowed(batch, &outcomes) {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Ok(outcomes))
    }

    /// Remembers a bucket of a denied batch.
    fn remember(&self, key: &BucketKey, tat: u64, now: u64) {
        if let Some(mut v) = self.map.get_mut(key) {
            *v = tat;
            return;
        }
        if self.map.len() >= self.capacity {
            self.map.retain(|_, t| *t > now);
            if self.map.len() >= self.capacity {
                return;
            }
        }
        self.map.insert(key.clone(), tat);
    }

    /// Updates a bucket if it is remembered.
    fn refresh(&self, key: &BucketKey, tat: u64) {
        if self.map.is_empty() {
            return;
        }
        if let Some(mut v) = self.map.get_mut(key) {
            *v = tat;
        }
    }

    fn forget(&self, key: &BucketKey) {
        self.map.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Id, Limit, Limits};

    #[test]
    fn keys_name_the_limit_and_escape_the_id() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(1, 1, 1_000_000).unwrap())
            .build()
            .unwrap();
        let key = BucketKey::new(limits.name("Api").unwrap(), Id::new("a{b}%c é").unwrap());
        assert_eq!(redis_key("rl:", &key), "rl:{Api:a%7Bb%7D%25c%20%C3%A9}");
    }
}
