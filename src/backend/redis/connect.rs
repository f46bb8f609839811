//! Connecting: the builder, the connection (a client, a pool, or one client per cluster
//! master), loading the script, closing what the backend opened.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::{Client, ClientLike, Config, LuaInterface, Pool, ServerConfig};

use super::breaker;
use super::cluster::ClusterRouter;
use super::deny_cache::DenyCache;
use super::script::SCRIPT;
use super::setup::{RedisSetupError, configured_builder};
use super::{Inner, RedisBackend};
use crate::backend::BackendError;
use crate::time::{Clock, SystemClock};

/// The default key prefix.
pub(super) const DEFAULT_PREFIX: &str = "rl:";

/// The default timeout of every Redis command.
pub(super) const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a request waits for a lazy backend's first read of the stored overrides.
const DEFAULT_READY_WAIT: Duration = Duration::from_secs(30);

/// The default number of buckets the local deny cache remembers.
pub(super) const DEFAULT_DENY_CACHE_CAPACITY: usize = 100_000;

pub(super) enum Connection {
    Client(Client),
    Pool(Pool),
    Cluster(ClusterRouter),
}

impl Connection {
    /// The client for `slot` (any client when not clustered).
    pub(super) fn client(&self, slot: u16) -> Result<Client, BackendError> {
        match self {
            Connection::Client(c) => Ok(c.clone()),
            Connection::Pool(p) => Ok(p.next().clone()),
            Connection::Cluster(r) => r.client_for_slot(slot),
        }
    }
}

pub(super) enum Source {
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
    prefetch: bool,
    deny_cache_capacity: usize,
    breaker: breaker::Settings,
    lazy: bool,
    ready_wait: Duration,
    coalesce: Option<super::coalesce::Settings>,
    max_overrides: usize,
    /// Connect to read only (a replay's snapshot): neither the stored overrides' read (which
    /// sets the store's epoch and removes expired overrides) nor their follower.
    read_only: bool,
    /// Regional mode (`docs/regions.md`): this region's name, the global store and how shares
    /// move.
    regional: Option<(String, super::RedisBackend)>,
    /// How regional mode moves shares.
    regional_settings: super::regions::RegionalSettings,
    /// The tests' instance clock that runs apart from the store's (the script still reads
    /// the server's).
    #[cfg(test)]
    skewed: Option<Arc<dyn Clock>>,
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackendBuilder")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.command_timeout)
            .field("pool_size", &self.pool_size)
            .field("caller_time", &self.clock.is_some())
            .field("deny_cache", &self.deny_cache)
            .field("coalesce", &self.coalesce)
            .finish()
    }
}

impl RedisBackendBuilder {
    pub(super) fn new(source: Source) -> Self {
        Self {
            source,
            prefix: DEFAULT_PREFIX.to_owned(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            pool_size: 1,
            clock: None,
            deny_cache: true,
            prefetch: true,
            deny_cache_capacity: DEFAULT_DENY_CACHE_CAPACITY,
            breaker: breaker::Settings::default(),
            lazy: false,
            ready_wait: DEFAULT_READY_WAIT,
            coalesce: Some(super::coalesce::Settings::default()),
            max_overrides: crate::backend::DEFAULT_MAX_OVERRIDES,
            read_only: false,
            regional: None,
            regional_settings: super::regions::RegionalSettings::default(),
            #[cfg(test)]
            skewed: None,
        }
    }

    /// An instance whose own clock is `clock` while the script reads the server's (a clock
    /// skew between an instance and the store), for the tests.
    #[cfg(test)]
    pub(crate) fn skewed_clock(mut self, clock: impl Clock) -> Self {
        self.skewed = Some(Arc::new(clock));
        self
    }

    /// Regional mode ([`docs/regions.md`](crate::specs::regions)): this backend is the store
    /// of region `region`, where every request is decided, and `global` (a backend of its own,
    /// on a Redis or cluster every region reaches, with a prefix of its own) is the global
    /// store the shares of the limits marked `across_regions` move through. A marked limit is
    /// then one limit for every region: this region decides it on its floor plus the part the
    /// global store granted it, rebalanced every [`rebalance_period`](Self::rebalance_period)
    /// by one instance of the region. Limits not marked stay per region, as without it.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), tower_ratelimits::RedisSetupError> {
    /// use tower_ratelimits::RedisBackend;
    /// let global = RedisBackend::from_url("redis://global.example:6379").prefix("rlg:").connect().await?;
    /// let eu = RedisBackend::from_url("redis://eu.example:6379")
    ///     .regional("eu", global)
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn regional(mut self, region: impl Into<String>, global: super::RedisBackend) -> Self {
        self.regional = Some((region.into(), global));
        self
    }

    /// How often a region rebalances its shares (regional mode; 1 s by default): one instance
    /// of the region sends one call per slot of the global store each period. A grant's lease
    /// is three periods.
    pub fn rebalance_period(self, period: Duration) -> Self {
        let period_us = u64::try_from(period.as_micros()).unwrap_or(u64::MAX);
        self.regional_settings(|s| {
            s.period_us = period_us;
            s.lease_us = period_us.saturating_mul(3);
        })
    }

    /// How much longer the global store counts a grant than its lease (regional mode; one
    /// second by default): at least the clocks' drift over a lease, plus the largest backward
    /// step of a region store's clock and the largest forward step of the global store's
    /// ([`docs/regions.md`](crate::specs::regions), "The bound").
    pub fn lease_margin(self, margin: Duration) -> Self {
        let margin_us = u64::try_from(margin.as_micros()).unwrap_or(u64::MAX);
        self.regional_settings(|s| s.margin_us = margin_us)
    }

    /// Changes regional mode's settings.
    fn regional_settings(
        mut self,
        change: impl FnOnce(&mut super::regions::RegionalSettings),
    ) -> Self {
        change(&mut self.regional_settings);
        self
    }

    /// Regional mode with every setting given, for the tests (periods shorter than the API
    /// allows to name).
    #[cfg(test)]
    pub(crate) fn regional_with(
        mut self,
        region: &str,
        global: super::RedisBackend,
        settings: super::regions::RegionalSettings,
    ) -> Self {
        self.regional = Some((region.to_owned(), global));
        self.regional_settings = settings;
        self
    }

    /// Coalescing (on by default, `max_batch` 64): while Redis is busy, a request that finds
    /// [`coalesce_in_flight`](Self::coalesce_in_flight) script calls already outstanding queues,
    /// and the next call to end sends up to `max_batch` queued requests as one call, so Redis runs
    /// one script for many decisions (each request still its own all-or-nothing batch, decided in
    /// queue order as if sent alone; `BENCHMARKS.md` has what it saves). A request that finds a
    /// call free makes its own, as without coalescing; a queued one waits for one call at most,
    /// never beyond the command timeout. "Busy" is read from the round trips: while they stay near
    /// the shortest seen lately (a remote Redis, whose round trip is the network's, or a light
    /// load), no request queues. It applies to a single server or a pool, to spends whose keys are
    /// all GCRA and check-and-spend on the server's clock (a request's usual batch), and to a
    /// calendar quota's spends alone in their batch (in a queue of their own: a call carries one
    /// kind); others and [`caller_time`](Self::caller_time) call as without it. On a cluster it
    /// applies to a request with one rule, per hash slot: a call carries one slot's keys, so a
    /// request queues only behind calls of its own slot (the requests of a hot key share calls;
    /// keys spread over the slots rarely meet). `max_batch` bounds how long one call holds Redis's
    /// single thread, which every other user of that Redis waits behind: about 40,000 server
    /// instructions a request (`BENCHMARKS.md`), so 64 requests hold it about as long as 40
    /// uncoalesced calls would, one after the other. `max_batch` 0 or 1 turns coalescing off.
    pub fn coalesce(mut self, max_batch: usize) -> Self {
        self.coalesce = (max_batch > 1).then(|| super::coalesce::Settings {
            max_batch,
            ..self.coalesce.unwrap_or_default()
        });
        self
    }

    /// With [`coalesce`](Self::coalesce): queue behind this many calls in flight always, not
    /// only while the round trips say Redis is busy (by default 2, then). Fewer means larger
    /// batches and more waiting.
    pub fn coalesce_in_flight(mut self, calls: usize) -> Self {
        if let Some(c) = &mut self.coalesce {
            c.in_flight = calls.max(1);
            c.adaptive = false;
        }
        self
    }

    /// Connects in the background (default off): [`connect`](Self::connect) returns at once,
    /// even while Redis is down or still starting, so an app that fails open starts and
    /// serves; requests fail (fast, once the circuit breaker opens) while Redis is
    /// unreachable, wait for the first read of the stored overrides while it answers
    /// ([`ready_wait`](Self::ready_wait)), and the script is loaded by the first request that
    /// needs it. For a URL of a
    /// single server (or a pool); a cluster's topology is read at `connect`, so a
    /// `redis-cluster://` URL is refused with `lazy`.
    pub fn lazy(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }

    /// How long a request that reaches a [`lazy`](Self::lazy) backend before its first read
    /// of the stored overrides is done waits for that read (default 30 s, enough for a
    /// million stored overrides: `docs/operating.md`). While the store answers, such a request
    /// waits and is then decided by the store, so a fresh instance decides by its limits and
    /// its blocks from its first request; while the store is unreachable (no connection, or a
    /// command of the read failed), or once the wait is over, the layer's failure policy
    /// answers it at once. A backend that is not lazy reads the overrides in
    /// [`connect`](Self::connect), so no request ever waits.
    pub fn ready_wait(mut self, wait: Duration) -> Self {
        self.ready_wait = wait;
        self
    }

    /// The circuit breaker (default: 5 consecutive failures open it for 1 s), one per server
    /// (on a cluster, per master: a dead master opens only its own slots' circuit). While open, a
    /// request that needs Redis gets [`BackendError::CircuitOpen`] at once, so the
    /// middleware's failure policy applies without waiting for the command timeout; when the
    /// cool-off ends, Redis is probed in the background (a `PING` within the command timeout;
    /// no request waits for it), and its answer closes the circuit. Failures are timeouts and
    /// unreachable servers, not answers. `failures = 0` turns it off.
    pub fn circuit_breaker(mut self, failures: u32, cool_off: Duration) -> Self {
        self.breaker = breaker::Settings { failures, cool_off };
        self
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

    /// The most overrides set at run time the store keeps
    /// ([`Limiter::set_override`](crate::Limiter::set_override); default
    /// [`DEFAULT_MAX_OVERRIDES`](crate::DEFAULT_MAX_OVERRIDES), a million): a new one past it is
    /// refused ([`OverrideError::TooMany`](crate::OverrideError::TooMany)), checked in the store
    /// by the change itself, so every instance agrees. An instance also applies at most this
    /// many of what the store holds (another program's, or an instance with a larger cap):
    /// the rest are left out with a warning.
    pub fn max_overrides(mut self, max: usize) -> Self {
        self.max_overrides = max;
        self
    }

    /// Turns prefetched tokens on or off (default on: limits with
    /// [`prefetch`](crate::Limit::with_prefetch) prefetch). Off, every request of every limit
    /// is decided by the store, as if no limit had `prefetch`: what a harness that compares
    /// decisions with another backend (the simulator's `--redis`) needs.
    pub fn prefetch(mut self, enabled: bool) -> Self {
        self.prefetch = enabled;
        self
    }

    /// How many buckets the deny cache remembers at most (default
    /// 100,000).
    pub fn deny_cache_capacity(mut self, capacity: usize) -> Self {
        self.deny_cache_capacity = capacity;
        self
    }

    /// Connects to read only: no stored override is read or followed, so nothing is written
    /// (`SCRIPT LOAD` aside, which writes no key). For a replay's snapshot, which decides
    /// nothing.
    #[cfg(feature = "replay")]
    pub(crate) fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Connects (when built from a URL) and loads the script.
    pub async fn connect(self) -> Result<RedisBackend, RedisSetupError> {
        let lazy = self.lazy;
        let backend = self.open().await?;
        // Regional mode: when the region's store started (`regions/store_start.rs`).
        backend.follow_store_start(lazy).await;
        Ok(backend)
    }

    async fn open(mut self) -> Result<RedisBackend, RedisSetupError> {
        self.check()?;
        let timeout = self.command_timeout;
        let connect_timeout = timeout.max(Duration::from_secs(2));
        // Connections the backend opened itself are closed when it is dropped.
        let owned = matches!(self.source, Source::Url(_));
        let source = std::mem::replace(&mut self.source, Source::Url(String::new()));
        // Where, for the errors: never the credentials.
        let (conn, mut at) = match source {
            Source::Url(url) => match self.connect_url(&url, timeout, connect_timeout).await? {
                Opened::Lazy(conn, at) => return Ok(self.finish(conn, owned, false, timeout, at)),
                Opened::Ready(conn, at) => (conn, at),
            },
            Source::Client(c) => (self.connect_client(c, timeout).await?, String::new()),
            Source::Pool(p) => (self.connect_pool(p, timeout).await?, String::new()),
        };
        let clustered = matches!(conn, Connection::Cluster(_));
        load_script(&conn, &mut at, connect_timeout).await?;
        let read_only = self.read_only;
        let backend = self.finish(conn, owned || clustered, clustered, timeout, at.clone());
        // The overrides set at run time, read whole before the first request: a fresh instance
        // never decides an overridden id without its override (one that served while
        // it read 1,000,000 stored blocks admitted blocked ids for 29 s). Each page is bounded
        // by the command timeout; the read as a whole by what the store holds.
        if read_only {
            return Ok(backend);
        }
        if let Err(e) = backend.read_overrides().await {
            return Err(RedisSetupError::connect(
                &at,
                format!("the stored overrides could not be read: {e}"),
                !clustered,
            ));
        }
        Ok(backend)
    }

    /// The settings no connection can make right: the prefix, the regional mode's.
    fn check(&self) -> Result<(), RedisSetupError> {
        if self.prefix.contains(['{', '}']) {
            return Err(RedisSetupError::InvalidPrefix {
                prefix: self.prefix.clone(),
                reason: "it must not contain '{' or '}'",
            });
        }
        if self.prefix.len() > 128 {
            return Err(RedisSetupError::InvalidPrefix {
                prefix: self.prefix.clone(),
                reason: "it is longer than 128 bytes",
            });
        }
        if let Some((region, global)) = &self.regional {
            super::regions::check(
                region,
                global.prefix(),
                &self.regional_settings,
                &self.prefix,
            )
            .map_err(RedisSetupError::InvalidRegional)?;
        }
        Ok(())
    }

    /// A client the caller built: a cluster's gets one connection per master from its
    /// configuration.
    async fn connect_client(
        &self,
        c: Client,
        timeout: Duration,
    ) -> Result<Connection, RedisSetupError> {
        if c.is_clustered() {
            let config = c.client_config();
            return Ok(Connection::Cluster(
                ClusterRouter::connect(config, timeout, self.breaker).await?,
            ));
        }
        Ok(Connection::Client(c))
    }

    /// A pool the caller built, as [`connect_client`](Self::connect_client).
    async fn connect_pool(
        &self,
        p: Pool,
        timeout: Duration,
    ) -> Result<Connection, RedisSetupError> {
        if p.next().is_clustered() {
            let config = p.next().client_config();
            return Ok(Connection::Cluster(
                ClusterRouter::connect(config, timeout, self.breaker).await?,
            ));
        }
        Ok(Connection::Pool(p))
    }

    /// The connection a URL names, and the server it names (without credentials): a cluster's
    /// topology read now; a single server's first connection made now, or, lazy, in the
    /// background.
    async fn connect_url(
        &self,
        url: &str,
        timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<Opened, RedisSetupError> {
        check_scheme(url)?;
        let config =
            Config::from_url(url).map_err(|e| RedisSetupError::InvalidUrl(e.to_string()))?;
        let at = super::setup::address(&config);
        if matches!(config.server, ServerConfig::Clustered { .. }) {
            if self.lazy {
                return Err(RedisSetupError::InvalidUrl(
                    "a lazy connection needs a single server: a cluster's topology is read when connecting".into(),
                ));
            }
            let router = ClusterRouter::connect(config, timeout, self.breaker).await?;
            return Ok(Opened::Ready(Connection::Cluster(router), at));
        }
        let mut config = config;
        // Lazy: the first connection is retried like any lost one.
        config.fail_fast = !self.lazy;
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
        if self.lazy {
            // Connect (and reconnect) in the background; nothing waits for it.
            match &conn {
                Connection::Client(c) => drop(c.connect()),
                Connection::Pool(p) => drop(p.connect()),
                Connection::Cluster(_) => {}
            }
            return Ok(Opened::Lazy(conn, at));
        }
        let init = async {
            match &conn {
                Connection::Client(c) => c.init().await.map(drop),
                Connection::Pool(p) => p.init().await.map(drop),
                Connection::Cluster(_) => Ok(()),
            }
        };
        match tokio::time::timeout(connect_timeout, init).await {
            Ok(Ok(())) => Ok(Opened::Ready(conn, at)),
            Ok(Err(e)) => Err(RedisSetupError::connect(&at, e.to_string(), true)),
            Err(_) => Err(RedisSetupError::connect(
                &at,
                format!("no connection within {connect_timeout:?}"),
                true,
            )),
        }
    }

    /// `at`: the server, as the circuit breaker's log lines name it.
    fn finish(
        self,
        conn: Connection,
        owned: bool,
        clustered: bool,
        timeout: Duration,
        at: String,
    ) -> RedisBackend {
        let local: Arc<dyn Clock> = match &self.clock {
            Some(c) => c.clone(),
            None => Arc::new(SystemClock),
        };
        #[cfg(test)]
        let local = self.skewed.clone().unwrap_or(local);
        let follow = !self.read_only;
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                conn,
                owned,
                caller_time: self.clock.is_some(),
                local,
                clustered,
                timeout,
                // The clients built here carry the command timeout themselves.
                fred_timeout: owned || clustered,
                sha: fred::util::sha1_hash(SCRIPT).into(),
                cache: self
                    .deny_cache
                    .then(|| DenyCache::new(self.deny_cache_capacity)),
                breaker: Arc::new(breaker::Breaker::new(self.breaker, at)),
                coalescer: self
                    .coalesce
                    .map(|c| super::coalesce::Coalescer::new(c, timeout, clustered)),
                pools: super::prefetch::Pools::new(),
                prefetch: self.prefetch,
                regional: self.regional.map(|(region, global)| {
                    Arc::new(super::regions::Regional::new(
                        region,
                        global,
                        self.regional_settings,
                    ))
                }),
                overrides: crate::backend::Watched::default(),
                override_sync: std::sync::Mutex::default(),
                max_overrides: self.max_overrides,
                override_read: tokio::sync::Mutex::new(()),
                overrides_ready: std::sync::atomic::AtomicBool::new(false),
                first_read: tokio::sync::watch::Sender::new(super::overrides::FirstRead::Reading),
                ready_wait: self.ready_wait,
                override_names: super::overrides::Names::new(&self.prefix),
                prefix: self.prefix,
            }),
        };
        if follow {
            backend.follow_overrides();
        }
        backend
    }
}

/// Accepts the schemes the backend supports, with a clear error for the others.
/// A connection a URL opened: ready, or connecting in the background (lazy); with its server.
enum Opened {
    Ready(Connection, String),
    Lazy(Connection, String),
}

/// Loads the script on every master (a cluster) or on the server, naming the server in the
/// error (`at` is filled in from the client when the caller built it).
async fn load_script(
    conn: &Connection,
    at: &mut String,
    connect_timeout: Duration,
) -> Result<(), RedisSetupError> {
    if let Connection::Cluster(router) = conn {
        return router.load_script(connect_timeout).await;
    }
    let client = conn
        .client(0)
        .map_err(|e| RedisSetupError::connect(at, e.to_string(), true))?;
    if at.is_empty() {
        *at = super::setup::address(&client.client_config());
    }
    match tokio::time::timeout(connect_timeout, client.script_load::<String, _>(SCRIPT)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(RedisSetupError::connect(at, e.to_string(), true)),
        Err(_) => Err(RedisSetupError::connect(at, "SCRIPT LOAD timed out", true)),
    }
}

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
