//! The Redis / Redis Cluster backend (feature `redis`), over [fred].
//!
//! # How a request is decided
//!
//! Every transaction of a batch whose keys share a slot is decided **and** written by one Lua
//! script, run with `EVALSHA` (and `EVAL` once, when the server answers `NOSCRIPT`, e.g. after
//! `SCRIPT FLUSH` or a failover). The script mirrors [`gcra`](crate::algo::gcra) in integer
//! microseconds, so Redis decides exactly as the in-memory backend does. On a single Redis server
//! the whole batch is one script, one round trip.
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
//! (translated to the local clock, rounded toward "earlier"). A later batch in which one counting
//! transaction's remembered TAT already denies it is denied locally, with no round trip (a batch
//! is all or nothing, so that one denial decides it): a client flooding a denied key, or
//! rotating addresses inside an exhausted /48, costs Redis nothing. Remembered buckets report
//! what their TATs say; the batch's other transactions are not evaluated and come back
//! [skipped](crate::Outcome::skipped), so the 429's `Retry-After` is the remembered denial's
//! (Redis may know a longer one). Remembered TATs are lower bounds of the
//! real ones (spends only move a TAT forward), so the cache never denies what Redis would allow,
//! with one exception it cannot see: a refund made **by another app instance**. Refunds made
//! through this backend update the cache; a reset, or a change of a stored override, is
//! published to every instance (the channel `<prefix>overrides`), each of which forgets the
//! key. Turn it off with [`RedisBackendBuilder::deny_cache`] if other instances refund and a
//! wrong denial of up to `retry_after` is not acceptable. The cache holds at most
//! [`deny_cache_capacity`](RedisBackendBuilder::deny_cache_capacity) buckets (100,000 by
//! default) and evicts in O(1) (quick_cache), so a flood of new denied keys neither grows it nor
//! slows it down.
//!
//! # Coalescing
//!
//! On by default ([`RedisBackendBuilder::coalesce`]). While Redis is busy (the recent round
//! trips run well above the shortest seen lately), a request that finds 2 calls outstanding
//! queues, and the next call to end sends the queue as one script call: each request is still
//! its own all-or-nothing batch, decided and written in queue order as if sent alone, and
//! Redis runs one script for many decisions (GCRA spends together, a calendar quota's spends
//! alone in their batch together). On a cluster a call carries the keys of one hash slot: a
//! request with one rule queues only behind calls of its own slot, so the requests of one hot
//! key share calls, and keys spread over the slots call as without coalescing. A request that finds a call free makes its own,
//! and no request queues while the round trips are the network's (a remote Redis), so
//! coalescing costs nothing at low concurrency or far from Redis. A queued request waits at
//! most for one call and never beyond the command timeout; if it times out, it may still be
//! sent later (as a timed-out call may still be applied: it can only under-admit). One
//! request's failure is its own (a write refused, a key the server's ACL refuses).
//! [`RedisBackend::coalesce_stats`] counts what it shared.
//!
//! # Prefetched tokens
//!
//! For a limit with [`prefetch`](crate::Limit::with_prefetch), a hot key's requests are
//! answered from tokens this instance took from Redis in one call (a refill: a partial grant
//! riding the request's own script call), without a round trip; what is not used goes back
//! when it expires (within 50 ms) or on [`RedisBackend::return_prefetched`]. A key seen once
//! per TTL is sent as it is. All instances together never admit more than the limit; the
//! timing and under-admission bounds, and the refill rule, are in `docs/gcra.md` ("Prefetched
//! tokens"). [`RedisBackendBuilder::prefetch`] turns it off.
//!
//! # Failures
//!
//! Every command has a timeout ([`RedisBackendBuilder::command_timeout`], 500 ms by default;
//! fred's own default is none). An unreachable server gives [`BackendError::Unavailable`] or
//! [`BackendError::Timeout`], and the middleware applies its failure policy; after repeated
//! failures the circuit breaker answers at once
//! ([`circuit_breaker`](RedisBackendBuilder::circuit_breaker)); the client reconnects by
//! itself, so the backend recovers without restarting the app. Another program's data at a
//! bucket's key (a wrong type, a value that is not a state of ours) is decided as a fresh bucket
//! and replaced by the first spend that writes: keys under the prefix are the limiter's.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use fred::prelude::{
    Client, ClientLike, Error as FredError, ErrorKind, Key, KeysInterface, LuaInterface, Pool,
    Value,
};

mod breaker;
mod calls;
mod cluster;
mod coalesce;
mod compensation;
mod connect;
mod deny_cache;
mod keys;
mod overrides;
mod prefetch;
mod regions;
mod reply;
mod scan;
mod script;
mod setup;
#[cfg(feature = "replay")]
pub(crate) mod snapshot;

pub use coalesce::CoalesceStats;
pub use connect::RedisBackendBuilder;
pub use regions::RegionalError;
pub use setup::RedisSetupError;

use connect::{Connection, Source};
use deny_cache::DenyCache;
use keys::{CONCURRENCY_SUFFIX, KeyBuf, TIERS_SUFFIX, redis_key};
use script::{Call, Expiry, MAX_TIME_US, Op, RawChange, SCRIPT, ScriptReply};

use super::{Backend, BackendError, BucketTx, Outcome, Outcomes, Spend, batch_allowed};
use crate::algo::gcra::GcraError;
use crate::key::BucketKey;
use crate::quota::Quota;
use crate::time::Clock;

/// In caller-time mode a key expires this long after the moment its bucket is full again,
/// counted on the server's clock from the write: the server cannot follow the caller's clock,
/// and a run slower than its own time must not lose state.
const CALLER_TIME_EXPIRY_MARGIN_MS: i64 = 3_600_000;

/// The backend's shared state.
struct Inner {
    conn: Connection,
    /// Whether the backend opened its connections itself (and so closes them).
    owned: bool,
    prefix: String,
    caller_time: bool,
    local: Arc<dyn Clock>,
    clustered: bool,
    timeout: Duration,
    /// Whether fred's own command timeout is [`timeout`](Self::timeout) (the clients the
    /// backend built); else each command is also bounded by a tokio timeout.
    fred_timeout: bool,
    /// The script's SHA-1, shared (not copied) into every `EVALSHA`.
    sha: fred::bytes_utils::Str,
    cache: Option<DenyCache>,
    /// The circuit breaker of a single server or pool (a cluster has one per master).
    breaker: Arc<breaker::Breaker>,
    /// The queues of spends waiting to share a call, when coalescing is on.
    coalescer: Option<coalesce::Coalescer>,
    /// Prefetched tokens of hot keys, per key.
    pools: prefetch::Pools,
    /// Whether limits with `prefetch` prefetch ([`RedisBackendBuilder::prefetch`]).
    prefetch: bool,
    /// Regional mode (`docs/regions.md`): a limit marked `across_regions` is decided as this
    /// region's share bucket, whose share the rebalance moves.
    regional: Option<Arc<regions::Regional>>,
    /// The overrides set at run time, as last read, and who follows them.
    overrides: super::Watched,
    /// Where this instance stands with the store's overrides (the epoch and versions applied).
    override_sync: std::sync::Mutex<overrides::Synced>,
    /// The most overrides kept (`RedisBackendBuilder::max_overrides`).
    max_overrides: usize,
    /// Held by the read of the whole hash under way (one at a time).
    override_read: tokio::sync::Mutex<()>,
    /// Whether the stored overrides were read whole once: until then no spend is decided
    /// (an overridden id must never be decided without its override).
    overrides_ready: std::sync::atomic::AtomicBool,
    /// The first whole read as requests arriving before it see it, and how long they wait
    /// for it (`RedisBackendBuilder::ready_wait`).
    first_read: tokio::sync::watch::Sender<overrides::FirstRead>,
    ready_wait: Duration,
    override_names: overrides::Names,
}

impl RedisBackend {
    /// A spend before the stored overrides were read whole: while the store answers, the
    /// caller waits for the read ([`Backend::until_ready`]) and takes its batch again; while
    /// the store is unreachable, the failure policy answers it.
    #[cold]
    #[inline(never)]
    fn not_read_yet(&self) -> Spend {
        Spend::Ready(Err(match *self.inner.first_read.borrow() {
            overrides::FirstRead::Unreachable => BackendError::not_read(),
            overrides::FirstRead::Reading | overrides::FirstRead::Done => BackendError::NotReady,
        }))
    }
}

/// A TAT the script answered (on the server's clock, `server_now` then), on the local clock
/// for the deny cache: 0 when it is not in the future.
fn local_tat(tat: u64, server_now: u64, local_now: u64) -> u64 {
    if tat > server_now {
        local_now.saturating_add(tat - server_now)
    } else {
        0
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

    /// What coalescing did so far ([`RedisBackendBuilder::coalesce`]); `None` when it is off.
    pub fn coalesce_stats(&self) -> Option<CoalesceStats> {
        self.inner
            .coalescer
            .as_ref()
            .map(coalesce::Coalescer::stats)
    }

    /// Buckets the local deny cache remembers now (at most its capacity; 0 when it is off).
    pub fn deny_cache_len(&self) -> usize {
        self.inner.cache.as_ref().map_or(0, DenyCache::len)
    }

    /// Whether a circuit breaker is open (on a cluster: any master's): that server failed
    /// repeatedly, and requests for it are answered at once ([`BackendError::CircuitOpen`])
    /// until a probe succeeds.
    pub fn circuit_open(&self) -> bool {
        self.breakers().iter().any(|b| b.is_open())
    }

    /// How many times a circuit breaker opened since the backend was built (on a cluster: all
    /// masters').
    pub fn circuit_opened_count(&self) -> u64 {
        self.breakers()
            .iter()
            .map(|b| b.opened.load(Ordering::Relaxed))
            .sum()
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
        redis_key(&self.inner.prefix, key, "")
    }

    /// The Redis key of a tiered key's state: [`redis_key`](Self::redis_key) followed by `:t`
    /// (same slot; a name switched between GCRA and tiers never reads the other's state).
    pub fn redis_tier_key(&self, key: &BucketKey) -> String {
        redis_key(&self.inner.prefix, key, TIERS_SUFFIX)
    }

    /// The Redis key of a concurrency key's leases: [`redis_key`](Self::redis_key) followed
    /// by `:c` (same slot), a sorted set of lease ids scored by their deadlines.
    pub fn redis_concurrency_key(&self, key: &BucketKey) -> String {
        redis_key(&self.inner.prefix, key, CONCURRENCY_SUFFIX)
    }

    /// The Redis key of `key`'s state under a quota of the kind whose `suffix` it takes
    /// ([`keys::suffix`]), for a command.
    fn command_key(&self, key: &BucketKey, suffix: &str) -> Key {
        KeyBuf::new(&self.inner.prefix, key, suffix).key()
    }

    /// The time the script decides at (`None`: the server's clock) and the local time.
    fn now_arg(&self) -> Result<(Option<u64>, u64), BackendError> {
        let local = self.inner.local.now_us();
        if !self.inner.caller_time {
            return Ok((None, local));
        }
        if local >= MAX_TIME_US {
            return Err(GcraError::TimeOverflow.into());
        }
        Ok((Some(local), local))
    }

    fn expiry(&self) -> Expiry {
        if self.inner.caller_time {
            Expiry::AfterMargin(CALLER_TIME_EXPIRY_MARGIN_MS)
        } else {
            Expiry::AtFresh
        }
    }

    /// The Redis key of a transaction's state: a penalty's beside its limit's bucket, at the
    /// limit's key and `:pen` (in its slot).
    fn script_key(&self, tx: &BucketTx<'_>) -> Key {
        if tx.penalty.is_some() {
            return self.command_key(tx.key, keys::PENALTY_SUFFIX);
        }
        self.command_key(&crate::backend::kit::state_key(tx), keys::tx_suffix(tx))
    }

    fn keys(&self, batch: &[BucketTx<'_>]) -> Vec<Key> {
        batch.iter().map(|tx| self.script_key(tx)).collect()
    }

    /// A spend whose keys all live on one node (a single server, or one key): one script
    /// call, whose answer is the batch's, with no grouping and nothing to undo.
    async fn spend_one_call(
        &self,
        batch: &[BucketTx<'_>],
        now: Option<u64>,
        local_now: u64,
    ) -> Result<Outcomes, BackendError> {
        let slot = match batch {
            [tx] if self.inner.clustered => {
                fred::util::redis_keyslot(self.script_key(tx).as_bytes())
            }
            _ => 0,
        };
        let call = Call {
            op: Op::Spend,
            now,
            local: local_now,
            expiry: self.expiry(),
            want_raw: false,
            shares: self.share_call(),
        };
        // A coalescing call slot, held until this call ends (then given back).
        let mut held = None;
        let path = script::path(call, batch.iter());
        if let Some(coalescer) = &self.inner.coalescer
            && let Some(kind) = script::coalescible(call, path, batch.iter())
        {
            let make = || (self.keys(batch), script::encode(call, path, batch.iter()));
            match self.coalesce(coalescer, (kind, slot), make).await {
                coalesce::Route::Direct(slot) => held = slot,
                coalesce::Route::Queued(answer) => {
                    let reply = script::decode(Value::Array(answer?), path, batch.iter(), call)?;
                    return Ok(self.after_spend(batch, reply, local_now));
                }
            }
        }
        let reply = self
            .run_script((call, path), slot, batch.iter(), || self.keys(batch))
            .await;
        if let Some(slot) = held {
            slot.ended(reply.is_ok());
        }
        Ok(self.after_spend(batch, reply?, local_now))
    }

    /// Updates the deny cache from a one-call spend's reply; its outcomes.
    fn after_spend(&self, batch: &[BucketTx<'_>], reply: ScriptReply, local_now: u64) -> Outcomes {
        if let Some(cache) = &self.inner.cache {
            let all_allowed = batch_allowed(batch.iter().zip(&reply.outcomes));
            for (tx, &tat) in batch.iter().zip(&reply.tats) {
                if tx.plain_gcra().is_none() {
                    continue;
                }
                let local_tat = local_tat(tat, reply.now, local_now);
                if all_allowed {
                    cache.refresh(tx.key, local_tat);
                } else {
                    cache.remember(tx.key, local_tat);
                }
            }
        }
        reply.outcomes
    }

    pub(super) async fn refund_batch(
        &self,
        batch: &[BucketTx<'_>],
    ) -> Result<Outcomes, BackendError> {
        if batch.is_empty() {
            return Ok(Outcomes::new());
        }
        let keys = self.keys(batch);
        let now = self.now_arg()?;
        if let Some(cache) = &self.inner.cache {
            for tx in batch {
                cache.forget(tx.key);
            }
        }
        let groups = self.groups(&keys);
        let replies = self
            .run_groups(Op::Refund, now, batch, &keys, &groups)
            .await;
        let mut outcomes = Outcomes::filled(batch.len(), Outcome::new(false, 0, 0, 0));
        for ((_, group), reply) in groups.iter().zip(replies) {
            let reply = reply?;
            for (&i, (o, grant)) in group.iter().zip(reply.outcomes.into_tiered()) {
                outcomes.set(i, o, grant);
            }
        }
        Ok(outcomes)
    }
}

/// A transaction owned by a spend under way: the pending future outlives the batch it was
/// asked for.
struct OwnedTx {
    key: BucketKey,
    quota: Quota,
    cost: u64,
    min_cost: u64,
    mode: super::Mode,
    lease: u64,
    /// A renewal's leases (empty: `lease` alone; no allocation then).
    leases: Vec<u64>,
    floor: Option<crate::config::RegionFloor>,
    penalty: Option<crate::config::PenaltyEntry>,
}

impl OwnedTx {
    fn of(tx: &BucketTx<'_>) -> Self {
        Self {
            key: tx.key.clone(),
            quota: tx.quota.clone(),
            cost: tx.cost,
            min_cost: tx.min_cost,
            mode: tx.mode,
            lease: tx.lease,
            leases: tx.leases.to_vec(),
            floor: tx.floor,
            penalty: tx.penalty.copied(),
        }
    }

    fn tx(&self) -> BucketTx<'_> {
        BucketTx {
            completion: None,
            penalty: self.penalty.as_ref(),
            key: &self.key,
            quota: &self.quota,
            cost: self.cost,
            min_cost: self.min_cost,
            mode: self.mode,
            lease: self.lease,
            leases: &self.leases,
            floor: self.floor,
        }
    }
}

impl RedisBackend {
    /// A spend the deny cache could not answer: one script per slot, at `now`.
    async fn spend_remote(
        &self,
        batch: &[BucketTx<'_>],
        now: Option<u64>,
        local_now: u64,
    ) -> Result<Outcomes, BackendError> {
        if !self.inner.clustered || batch.len() == 1 {
            return self.spend_one_call(batch, now, local_now).await;
        }
        let keys = self.keys(batch);
        let groups = self.groups(&keys);
        let replies = self
            .run_groups(Op::Spend, (now, local_now), batch, &keys, &groups)
            .await;

        let mut outcomes = Outcomes::filled(batch.len(), Outcome::new(false, 0, 0, 0));
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
                    let allowed =
                        batch_allowed(group.iter().map(|&i| &batch[i]).zip(&reply.outcomes));
                    group_allowed.push(Some(allowed));
                    let answered = reply.outcomes.into_tiered();
                    for ((&i, (o, grant)), tat) in group.iter().zip(answered).zip(reply.tats) {
                        outcomes.set(i, o, grant);
                        local_tats[i] = local_tat(tat, reply.now, local_now);
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
                .filter(|&i| batch[i].mode.spends() && outcomes[i].allowed)
                .collect();
            if !spent.is_empty() {
                self.compensate(batch, &keys, &spent, &outcomes, &raws)
                    .await;
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if let Some(cache) = &self.inner.cache {
            for (i, tx) in batch.iter().enumerate() {
                if tx.plain_gcra().is_none() {
                    continue;
                }
                if all_allowed {
                    cache.refresh(tx.key, local_tats[i]);
                } else if spent.contains(&i) {
                    // Refunded: its TAT is no longer the one the script returned.
                    cache.forget(tx.key);
                } else {
                    cache.remember(tx.key, local_tats[i]);
                }
            }
        }
        Ok(outcomes)
    }
}

#[async_trait]
impl Backend for RedisBackend {
    /// Ready when the deny cache is sure of a denial (no round trip); otherwise a future that
    /// owns a copy of the batch and calls the script.
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        if batch.is_empty() {
            return Spend::Ready(Ok(Outcomes::new()));
        }
        if !self.ready() {
            return self.not_read_yet();
        }
        let (now, local_now) = match self.now_arg() {
            Ok(t) => t,
            Err(e) => return Spend::Ready(Err(e)),
        };
        if let Some(regional) = &self.inner.regional {
            // A marked key's demand: what its requests ask, admitted or refused.
            for tx in batch
                .iter()
                .filter(|tx| tx.floor.is_some() && tx.mode.counts())
            {
                regional.count_demand(tx.key, tx.cost);
            }
        }
        if self.inner.prefetch
            && batch
                .iter()
                .any(|tx| prefetch::eligible(tx).is_some() || prefetch::drops_pool(tx))
        {
            return self.spend_prefetching(batch, local_now);
        }
        if let Some(cache) = &self.inner.cache
            && let Some(answer) = cache.answer(batch, local_now)
        {
            return Spend::Ready(answer);
        }
        let this = self.clone();
        let owned: Vec<OwnedTx> = batch.iter().map(OwnedTx::of).collect();
        Spend::Pending(Box::pin(async move {
            let batch: Vec<BucketTx<'_>> = owned.iter().map(OwnedTx::tx).collect();
            this.spend_remote(&batch, now, local_now).await
        }))
    }

    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        self.refund_batch(batch).await
    }

    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        if keys.is_empty() {
            return Ok(());
        }
        for key in keys {
            if let Some(cache) = &self.inner.cache {
                cache.forget(key);
            }
            self.inner.pools.forget(key);
        }
        let redis_keys: Vec<Key> = keys
            .iter()
            .flat_map(|k| {
                keys::FORGOTTEN_BY_RESET
                    .iter()
                    .map(|suffix| self.command_key(k, suffix))
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
        // An adaptive key keeps its leases (requests in flight) and forgets what it learned:
        // its state members, scored below 0 (`adaptive.lua`). Another type there is not ours.
        let learned = keys.iter().map(|k| {
            let key = self.command_key(k, keys::ADAPTIVE_SUFFIX);
            let slot = if self.inner.clustered {
                fred::util::redis_keyslot(key.as_bytes())
            } else {
                0
            };
            self.with_client(slot, move |client| {
                let key = key.clone();
                async move {
                    let args: Vec<fred::prelude::Value> =
                        vec![key.into(), "-inf".into(), "(0".into()];
                    match client
                        .custom::<fred::prelude::Value, _>(fred::cmd!("ZREMRANGEBYSCORE"), args)
                        .await
                    {
                        Err(e) if e.details().contains("WRONGTYPE") => Ok(()),
                        other => other.map(drop),
                    }
                }
            })
        });
        for r in futures_util::future::join_all(learned).await {
            r?;
        }
        self.publish_reset(keys).await;
        Ok(())
    }

    fn prefetches(&self) -> bool {
        self.inner.prefetch
    }

    fn decides_penalties(&self) -> bool {
        true
    }

    async fn penalty_page(
        &self,
        limit: crate::key::LimitName,
        _state: crate::key::LimitName,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<Option<super::StatesPage>, BackendError> {
        self.penalty_states(limit.as_str(), cursor, count).await
    }

    fn regional(&self) -> bool {
        self.inner.regional.is_some()
    }

    fn follow_limits(&self, limits: crate::backend::FollowedLimits) {
        if let Some(regional) = self.regional_mode() {
            regional.follow(Arc::clone(&limits));
        }
        self.start_rebalancing(limits);
    }

    async fn region_share(
        &self,
        key: &BucketKey,
        quota: &Quota,
        floor: crate::config::RegionFloor,
    ) -> Result<Option<crate::backend::regions::RegionShare>, BackendError> {
        match quota.as_gcra() {
            Some(limit) => self.share_of(key, limit, floor).await,
            None => Ok(None),
        }
    }

    /// Ready once the stored overrides were read whole (`connect` waits for that read; a lazy
    /// backend is ready once its first read, in the background, completes).
    fn ready(&self) -> bool {
        self.inner
            .overrides_ready
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits for the first whole read of the stored overrides while the store answers, at
    /// most `ready_wait`; at once while the store is unreachable.
    async fn until_ready(&self) -> bool {
        if self.ready() {
            return true;
        }
        let mut first_read = self.inner.first_read.subscribe();
        let read = first_read.wait_for(|s| *s != overrides::FirstRead::Reading);
        let _ = tokio::time::timeout(self.inner.ready_wait, read).await;
        self.ready()
    }

    /// The instance's clock: the caller's time, when the backend was given one.
    fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.inner.caller_time.then(|| self.inner.local.clone())
    }

    fn override_store(&self) -> Option<crate::backend::OverrideStoreRef> {
        let region = overrides::RedisOverrides {
            backend: self.clone(),
        };
        Some(crate::backend::OverrideStoreRef(
            match self.regional_mode() {
                Some(regional) => Arc::new(regions::RegionalOverrides {
                    region,
                    global: overrides::RedisOverrides {
                        backend: regional.global.clone(),
                    },
                    regional: Arc::clone(regional),
                }),
                None => Arc::new(region),
            },
        ))
    }
}

#[cfg(test)]
mod tests;
