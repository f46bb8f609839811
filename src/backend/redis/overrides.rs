//! Overrides set at run time, on Redis: one hash of them, a version bumped by every change, an
//! epoch naming the store's life, and a channel telling every instance what changed.
//!
//! - `<prefix>{overrides}`: a hash, field `<limit>:<id>` (the id's canonical text), value the
//!   override's stored form ([`StoredOverride::encode`]: JSON with a version, its expiry inside,
//!   never a key TTL, so no `volatile-*` eviction policy removes it).
//! - `<prefix>{overrides}:v`: the hash's version, bumped by every change (same slot).
//! - `<prefix>{overrides}:e`: the store's epoch, a random text the first change after the
//!   store was empty sets: a store that lost its data (a restart without persistence,
//!   `FLUSHALL`, a failover to an empty replica) has another epoch, or none, and its version
//!   starts again; every instance sees it and follows the store, not what it held before.
//! - channel `<prefix>overrides`: `{"op": "change", "v": <version>, "e": <epoch>, "keys":
//!   [[limit, id], ...]}` after every change (and `{"op": "reset", "keys": ...}` after every
//!   reset through [`Backend::reset`](crate::Backend::reset)).
//!
//! Each instance runs one task. A change's notification makes it read **the fields named**
//! (`HMGET`) and apply them; the versions it has applied are tracked, so a notification lost
//! (a subscriber reconnecting, a lagging reader) shows as a gap. Every second it reads the
//! version and the epoch (one `MGET`): an epoch that changed, or a version it has not applied
//! for a whole second, makes it read the hash again, in pages (`HSCAN`, a thousand fields a
//! call, so no command holds the server long) applied as they come, overrides the pages did
//! not name removed at the end. Nothing else reads the whole hash: a change costs the store
//! what it changes, whatever the number of overrides (`BENCHMARKS.md`, "Stored overrides at
//! scale"). It also removes the overrides that have expired (one script call for all of them,
//! which removes only what has expired in the store). With Redis down, the overrides last read
//! stay in force. These commands bypass the circuit breakers: they are not requests, and a
//! reconcile failing while nobody asks must not open (or close) a circuit the requests see.

use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use fred::prelude::{
    ClientLike, EventInterface, HashesInterface, KeysInterface, LuaInterface, PubsubInterface,
    Value,
};

use super::{Inner, RedisBackend};
use crate::backend::{BackendError, Delta, OverrideStore, PutError, StoreEvent, Watcher};
use crate::key::BucketKey;
use crate::overrides::StoredOverride;
use crate::time::Clock;

/// How often each instance reads the version and the epoch (and so the longest a lost
/// notification delays a change: two of these).
const RECONCILE_EVERY: Duration = Duration::from_secs(1);
/// Fields asked for per `HSCAN` call and per `HMGET`: each call short, so requests on the same
/// server wait for none of them long.
const PAGE: usize = 1_000;
/// Fields a notification names that an instance reads (a change names one; expiries a batch).
const MOST_KEYS_TOLD: usize = 10_000;

/// Stores one override unless the store is full (answers `{-1, ''}` then), bumps the version,
/// sets the epoch if there is none, tells every instance; answers `{version, epoch}`.
const PUT: &str = "\
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 \
    and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[6]) then return {-1, ''} end \
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) \
local v = redis.call('INCR', KEYS[2]) \
local e = redis.call('GET', KEYS[3]) \
if not e then e = ARGV[7] redis.call('SET', KEYS[3], e) end \
redis.call('PUBLISH', ARGV[3], cjson.encode({op = 'change', v = v, e = e, \
    keys = {{ARGV[4], ARGV[5]}}})) \
return {v, e}";

/// Removes overrides: ARGV[1] the channel, ARGV[2] an epoch to set if there is none, ARGV[3]
/// `''` (remove each) or now in Unix milliseconds (remove each only if its stored expiry has
/// passed then: another instance may have replaced it), then per override its field, limit and
/// id. Bumps the version and tells every instance when one went; answers `{version, epoch}`, or
/// `{0, ''}` when none did.
const REMOVE: &str = "\
local gone = {} \
for i = 4, #ARGV, 3 do \
  local ok = ARGV[3] == '' \
  if not ok then \
    local raw = redis.call('HGET', KEYS[1], ARGV[i]) \
    if raw then \
      local good, o = pcall(cjson.decode, raw) \
      ok = good and type(o) == 'table' and type(o.expires_at_ms) == 'number' \
        and o.expires_at_ms <= tonumber(ARGV[3]) \
    end \
  end \
  if ok and redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then \
    gone[#gone + 1] = {ARGV[i + 1], ARGV[i + 2]} \
  end \
end \
if #gone == 0 then return {0, ''} end \
local v = redis.call('INCR', KEYS[2]) \
local e = redis.call('GET', KEYS[3]) \
if not e then e = ARGV[2] redis.call('SET', KEYS[3], e) end \
redis.call('PUBLISH', ARGV[1], cjson.encode({op = 'change', v = v, e = e, keys = gone})) \
return {v, e}";

/// Counts a reset (`{<prefix>overrides}:r`) and tells every instance which keys it reset:
/// ARGV[1] the channel, then limit and id per key; answers `{count, epoch}`.
const RESET: &str = "\
local keys = {} \
for i = 2, #ARGV, 2 do keys[#keys + 1] = {ARGV[i], ARGV[i + 1]} end \
local r = redis.call('INCR', KEYS[1]) \
local e = redis.call('GET', KEYS[2]) or '' \
redis.call('PUBLISH', ARGV[1], cjson.encode({op = 'reset', r = r, e = e, keys = keys})) \
return {r, e}";

/// The names of the hash, the version, the epoch and the channel.
pub(super) struct Names {
    hash: String,
    version: String,
    epoch: String,
    resets: String,
    channel: String,
    slot: u16,
}

impl Names {
    pub(super) fn new(prefix: &str) -> Self {
        let hash = format!("{prefix}{{overrides}}");
        Self {
            slot: fred::util::redis_keyslot(hash.as_bytes()),
            version: format!("{hash}:v"),
            epoch: format!("{hash}:e"),
            resets: format!("{hash}:r"),
            channel: format!("{prefix}overrides"),
            hash,
        }
    }
}

/// Where an instance stands with the store: the epoch it follows and the versions it applied.
#[derive(Default)]
pub(super) struct Synced {
    /// The store's epoch as last read (`None`: the store had none).
    epoch: Option<String>,
    /// Every version up to this one is applied here.
    applied: u64,
    /// Versions beyond `applied` applied here (told out of order).
    ahead: std::collections::BTreeSet<u64>,
    /// Whether the store was read whole at least once.
    read: bool,
    /// A change of another epoch was seen (told by a notification, or answered to a change
    /// made here): the store must be read whole again.
    stale: bool,
    /// Every reset up to this one (the store's count of resets) is applied here: what this
    /// instance remembers of its keys (prefetched tokens, denials) is dropped.
    resets: Counted,
}

/// Numbers told one by one, perhaps out of order: every one up to `upto` was told, and these
/// beyond it.
#[derive(Default)]
struct Counted {
    upto: u64,
    ahead: std::collections::BTreeSet<u64>,
}

impl Counted {
    fn told(&mut self, n: u64) {
        if n > self.upto {
            self.ahead.insert(n);
            while self.ahead.remove(&(self.upto + 1)) {
                self.upto += 1;
            }
        }
    }

    /// From here on, `n` and every number before it count as told.
    fn start_at(&mut self, n: u64) {
        self.upto = n;
        self.ahead.retain(|&a| a > n);
    }
}

impl Synced {
    /// Version `v` of epoch `e` is applied here. Whether `e` is the epoch followed (if not, the
    /// store must be read again).
    fn applied(&mut self, v: u64, e: &str) -> bool {
        if self.epoch.as_deref() != Some(e) {
            self.stale = true;
            return false;
        }
        if v > self.applied {
            self.ahead.insert(v);
            while self.ahead.remove(&(self.applied + 1)) {
                self.applied += 1;
            }
        }
        true
    }
}

/// What an instance reads of the store every second.
struct State {
    version: u64,
    epoch: Option<String>,
    /// The store's count of resets.
    resets: u64,
    /// Fields in the hash.
    fields: u64,
}

impl Synced {
    /// Whether version `v` (of the epoch followed) is applied here.
    fn has(&self, v: u64) -> bool {
        v <= self.applied || self.ahead.contains(&v)
    }
}

/// A notification: what changed.
#[derive(serde::Deserialize)]
struct Note {
    op: String,
    #[serde(default)]
    v: Option<u64>,
    /// A reset's number (the store's count of resets).
    #[serde(default)]
    r: Option<u64>,
    #[serde(default)]
    e: Option<String>,
    keys: Vec<(String, String)>,
}

/// The store of one Redis backend (what [`Backend::override_store`](crate::Backend) gives).
pub(super) struct RedisOverrides {
    pub(super) backend: RedisBackend,
}

/// What one reconcile saw, for the next.
#[derive(Default)]
struct Seen {
    /// The store's version, when it was ahead of what was applied here.
    behind: Option<u64>,
    /// The store's count of resets, when it was ahead of those told here.
    resets_behind: Option<u64>,
    /// The hash's size, and the version then.
    fields: Option<(u64, u64)>,
}

/// A random epoch, should this change be the store's first.
fn new_epoch() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{:016x}", h.finish())
}

/// A script's `{version, epoch}` answer.
fn version_and_epoch(v: Value) -> (i64, String) {
    let Value::Array(items) = v else {
        return (0, String::new());
    };
    let mut items = items.into_iter();
    let version = items.next().and_then(|v| v.as_i64()).unwrap_or(0);
    let epoch = items.next().and_then(|e| e.as_string()).unwrap_or_default();
    (version, epoch)
}

impl RedisBackend {
    fn now_ms(&self) -> u64 {
        self.inner.local.now_us() / 1_000
    }

    fn synced(&self) -> std::sync::MutexGuard<'_, Synced> {
        self.inner
            .override_sync
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `script` on the overrides' slot.
    async fn run_overrides(
        &self,
        script: &'static str,
        args: Vec<String>,
    ) -> Result<Value, BackendError> {
        let names = &self.inner.override_names;
        let keys = vec![
            names.hash.clone(),
            names.version.clone(),
            names.epoch.clone(),
        ];
        self.call(names.slot, move |client| {
            let (keys, args) = (keys.clone(), args.clone());
            async move { client.eval::<Value, _, _, _>(script, keys, args).await }
        })
        .await
    }

    /// The store's version and epoch (one `MGET`), and how many fields its hash holds (one
    /// `HLEN`: a hash changed by hand, without a version, shows there; another type of key at
    /// its name is an error).
    async fn store_state(&self) -> Result<State, BackendError> {
        let names = &self.inner.override_names;
        let keys = vec![
            names.version.clone(),
            names.epoch.clone(),
            names.resets.clone(),
        ];
        let got = self
            .call(names.slot, move |client| {
                let keys = keys.clone();
                async move { client.mget::<Vec<Option<String>>, _>(keys).await }
            })
            .await?;
        let hash = names.hash.clone();
        let fields = self
            .call(names.slot, move |client| {
                let hash = hash.clone();
                async move { client.hlen::<u64, _>(hash).await }
            })
            .await?;
        let mut got = got.into_iter();
        let number = |v: Option<Option<String>>| v.flatten().and_then(|v| v.parse().ok());
        let version = number(got.next()).unwrap_or(0);
        let epoch = got.next().flatten();
        Ok(State {
            version,
            epoch,
            resets: number(got.next()).unwrap_or(0),
            fields,
        })
    }

    /// The stored values of `fields` (one `HMGET` per page).
    async fn fetch(&self, fields: &[String]) -> Result<Vec<Option<String>>, BackendError> {
        let names = &self.inner.override_names;
        let mut values = Vec::with_capacity(fields.len());
        for page in fields.chunks(PAGE) {
            let (hash, page) = (names.hash.clone(), page.to_vec());
            let got = self
                .call(names.slot, move |client| {
                    let (hash, page) = (hash.clone(), page.clone());
                    async move { client.hmget::<Vec<Option<String>>, _, _>(hash, page).await }
                })
                .await?;
            values.extend(got);
        }
        Ok(values)
    }

    /// An override read from the store under `field`, if it is one of ours and in force at
    /// `now_ms` (an expired one is left for [`remove_expired`](Self::remove_expired)).
    fn decode(field: &str, value: &str, now_ms: u64) -> Option<StoredOverride> {
        match StoredOverride::decode(value) {
            Some(o) if StoredOverride::field(&o.limit, &o.id) == field => {
                (!o.expired(now_ms)).then_some(o)
            }
            _ => {
                tracing::warn!(
                    field,
                    "skipping a stored override this crate could not have written"
                );
                None
            }
        }
    }

    /// Reads the overrides `keys` names and applies what the store holds for them now (a
    /// notification's keys; an override gone from the store is gone here).
    async fn read_keys(&self, keys: &[(String, String)]) -> Result<(), BackendError> {
        let keys = &keys[..keys.len().min(MOST_KEYS_TOLD)];
        let fields: Vec<String> = keys
            .iter()
            .map(|(l, i)| StoredOverride::field(l, i))
            .collect();
        let values = self.fetch(&fields).await?;
        let now_ms = self.now_ms();
        let mut delta = Delta::default();
        for ((key, field), value) in keys.iter().zip(&fields).zip(values) {
            match value.and_then(|v| Self::decode(field, &v, now_ms)) {
                Some(o) => delta.set.push(o),
                None => delta.gone.push(key.clone()),
            }
        }
        self.apply_capped(delta);
        Ok(())
    }

    /// Applies `delta`, new overrides beyond this instance's cap left out (with a warning).
    fn apply_capped(&self, mut delta: Delta) {
        let watched = &self.inner.overrides;
        let room = self.inner.max_overrides.saturating_sub(watched.len());
        let new = delta
            .set
            .iter()
            .filter(|o| !watched.contains(&o.limit, &o.id))
            .count();
        if new > room {
            let mut left = room;
            let before = delta.set.len();
            delta.set.retain(|o| {
                if watched.contains(&o.limit, &o.id) {
                    return true;
                }
                if left > 0 {
                    left -= 1;
                    return true;
                }
                false
            });
            tracing::warn!(
                max_overrides = self.inner.max_overrides,
                skipped = before - delta.set.len(),
                "the override store holds more overrides than this instance keeps: the rest are not applied"
            );
        }
        watched.apply(delta);
    }

    /// Reads the whole hash, in pages applied as they come, and removes here what it no
    /// longer holds: the store as it is, whatever this instance held (after a store lost its
    /// data, at start, after a gap in the versions). Then follows the store's epoch from the
    /// version read first (changes made during the read are told again or read again).
    pub(super) async fn read_overrides(&self) -> Result<Vec<StoredOverride>, BackendError> {
        // One read at a time (its marks are one pass's); one that waited for another finds the
        // store as that one read it.
        let Ok(_one) = self.inner.override_read.try_lock() else {
            let _after = self.inner.override_read.lock().await;
            return Ok(self.inner.overrides.current());
        };
        let names = &self.inner.override_names;
        // The store's epoch, set now if it has none (empty, or emptied): every instance reads
        // the same one from here on, so the first change after does not make them all read
        // the whole hash again.
        let (epoch_key, token) = (names.epoch.clone(), new_epoch());
        self.call(names.slot, move |client| {
            let (key, token) = (epoch_key.clone(), token.clone());
            async move {
                client
                    .set::<Value, _, _>(key, token, None, Some(fred::types::SetOptions::NX), false)
                    .await
            }
        })
        .await?;
        let State {
            version,
            epoch,
            resets,
            ..
        } = self.store_state().await?;
        let watched = &self.inner.overrides;
        let held = watched.len();
        let pass = watched.begin_pass();
        let mut cursor = String::from("0");
        loop {
            let (hash, at) = (names.hash.clone(), cursor.clone());
            let page = self
                .call(names.slot, move |client| {
                    let (hash, at) = (hash.clone(), at.clone());
                    let hscan = fred::types::CustomCommand::new_static(
                        "HSCAN",
                        fred::types::ClusterHash::FirstKey,
                        false,
                    );
                    async move {
                        client
                            .custom::<Value, _>(
                                hscan,
                                vec![hash, at, "COUNT".into(), PAGE.to_string()],
                            )
                            .await
                    }
                })
                .await?;
            let (next, fields) = scan_page(page).map_err(BackendError::Unavailable)?;
            let now_ms = self.now_ms();
            let mut delta = Delta::default();
            for (field, value) in fields {
                if let Some(o) = Self::decode(&field, &value, now_ms) {
                    delta.set.push(o);
                }
            }
            // Applying marks what it finds (or sets) as this pass's.
            self.apply_capped(delta);
            if next == "0" {
                break;
            }
            cursor = next;
        }
        let gone = watched.end_pass(pass);
        if self
            .synced()
            .epoch
            .as_ref()
            .is_some_and(|e| Some(e) != epoch.as_ref())
            && held > 0
            && !gone.is_empty()
        {
            tracing::warn!(
                dropped = gone.len(),
                "the override store is not the one this instance followed (its data was lost: a restart without persistence, a flush, a failover to an empty replica): the overrides it no longer holds are dropped here, as the store says"
            );
        }
        watched.apply(Delta {
            set: Vec::new(),
            gone,
        });
        let mut synced = self.synced();
        if synced.epoch != epoch {
            synced.ahead.clear();
            // Another store than the one read before (not the first read: a lazy connection
            // may serve requests before it): what this instance remembers of its keys (tokens
            // taken from the store before, denials it saw) is not of this one.
            if synced.read {
                self.forget_every_key();
            }
        }
        synced.resets.start_at(resets);
        synced.epoch = epoch;
        synced.applied = version;
        synced.ahead.retain(|&v| v > version);
        synced.read = true;
        synced.stale = false;
        drop(synced);
        self.inner
            .overrides_ready
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(watched.current())
    }

    /// Removes from the store the overrides that have expired here (each only if its stored
    /// value has expired too), telling every instance.
    async fn remove_expired(&self) -> Result<(), BackendError> {
        let expired = self.inner.overrides.expired(self.now_ms());
        for batch in expired.chunks(PAGE) {
            let mut args = vec![
                self.inner.override_names.channel.clone(),
                new_epoch(),
                self.now_ms().to_string(),
            ];
            for (limit, id) in batch {
                args.extend([StoredOverride::field(limit, id), limit.clone(), id.clone()]);
            }
            let (v, e) = version_and_epoch(self.run_overrides(REMOVE, args).await?);
            self.told(v, &e);
        }
        Ok(())
    }

    /// Drops what this instance remembers of every key: the tokens it prefetched (they are
    /// not given back: a reset made the bucket full, or another store does not know them) and
    /// the denials its deny cache holds.
    fn forget_every_key(&self) {
        if let Some(cache) = &self.inner.cache {
            cache.clear();
        }
        self.inner.pools.forget_all();
    }

    /// A change made here was stored as version `v` of epoch `e` (`v` 0: none).
    fn told(&self, v: i64, e: &str) {
        if let Ok(v) = u64::try_from(v)
            && v > 0
        {
            // Another epoch than the one followed: the next tick reads the store again.
            self.synced().applied(v, e);
        }
    }

    /// Tells every instance that `keys` were reset (their deny caches and prefetched tokens),
    /// counted in the store so that an instance that misses the notification sees it missed
    /// one (the next reconcile but one).
    pub(super) async fn publish_reset(&self, keys: &[&BucketKey]) {
        let names = &self.inner.override_names;
        let mut args = vec![names.channel.clone()];
        for k in keys {
            args.extend([k.name().as_str().to_owned(), k.id().to_string()]);
        }
        let keys = vec![names.resets.clone(), names.epoch.clone()];
        let told = self
            .call(names.slot, move |client| {
                let (keys, args) = (keys.clone(), args.clone());
                async move { client.eval::<Value, _, _, _>(RESET, keys, args).await }
            })
            .await;
        match told {
            Ok(v) => {
                let (r, e) = version_and_epoch(v);
                let mut synced = self.synced();
                if let Ok(r) = u64::try_from(r)
                    && synced.epoch.as_deref() == Some(e.as_str())
                {
                    synced.resets.told(r);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "a reset could not be told to the other instances: their deny caches may deny these keys until their remembered denials end");
            }
        }
    }

    /// One reconcile: the store's version and epoch against what is applied here; the whole
    /// hash read again when they say this instance missed something (or never read it), or
    /// when the hash's size moved without a version (a change by hand).
    async fn reconcile(&self, seen: &mut Seen) -> Result<(), BackendError> {
        let state = self.store_state().await?;
        let (same_epoch, applied, fresh) = {
            let s = self.synced();
            (s.epoch == state.epoch, s.applied, s.read && !s.stale)
        };
        // A version the store had a tick ago and that is still not applied here: a
        // notification was lost (one in flight is given that long).
        let missed = seen.behind.is_some_and(|before| applied < before);
        // The same for resets: one the store counted a tick ago and this instance was not told
        // of. Which keys it reset is not known: every key's local state is dropped.
        let resets_told = self.synced().resets.upto;
        if seen
            .resets_behind
            .is_some_and(|before| resets_told < before)
        {
            tracing::warn!(
                "a reset was not told to this instance (its notifications are down?): the tokens it prefetched and the denials it remembers are dropped for every key"
            );
            self.forget_every_key();
            self.synced().resets.start_at(state.resets);
        }
        seen.resets_behind = (state.resets > self.synced().resets.upto).then_some(state.resets);
        let by_hand = seen
            .fields
            .is_some_and(|(fields, version)| fields != state.fields && version == state.version);
        seen.behind = (state.version > applied).then_some(state.version);
        seen.fields = Some((state.fields, state.version));
        if !fresh || !same_epoch || state.version < applied || missed || by_hand {
            self.read_overrides().await?;
            seen.behind = None;
        }
        self.remove_expired().await
    }

    /// Starts the task that keeps this instance's overrides up to date.
    pub(super) fn follow_overrides(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no tokio runtime: stored overrides are not followed");
            return;
        };
        let weak = Arc::downgrade(&self.inner);
        let config = self.client().client_config();
        let timeout = self.inner.timeout;
        let channel = self.inner.override_names.channel.clone();
        runtime.spawn(follow(weak, config, timeout, channel));
    }
}

/// An `HSCAN` answer: the next cursor and the page's fields with their values.
fn scan_page(page: Value) -> Result<(String, Vec<(String, String)>), String> {
    let bad = || format!("unexpected HSCAN reply: {:?}", page.kind());
    let Value::Array(parts) = &page else {
        return Err(bad());
    };
    let [cursor, Value::Array(items)] = parts.as_slice() else {
        return Err(bad());
    };
    let cursor = cursor.as_string().ok_or_else(bad)?;
    let mut fields = Vec::with_capacity(items.len() / 2);
    for pair in items.chunks(2) {
        if let [field, value] = pair {
            match (field.as_string(), value.as_string()) {
                (Some(f), Some(v)) => fields.push((f, v)),
                _ => tracing::warn!("skipping a stored override that is not text"),
            }
        }
    }
    Ok((cursor, fields))
}

async fn follow(
    weak: Weak<Inner>,
    config: fred::prelude::Config,
    timeout: Duration,
    channel: String,
) {
    let subscriber = super::setup::configured_builder(config, timeout)
        .build_subscriber_client()
        .ok();
    let mut messages = subscriber.as_ref().map(|s| s.message_rx());
    let mut subscribed = false;
    if let Some(s) = &subscriber {
        drop(s.connect());
        drop(s.manage_subscriptions());
        // Listening before the first change an instance could miss (a later start is caught
        // by the next reconcile, within a second).
        let connected =
            tokio::time::timeout(timeout.max(Duration::from_secs(2)), s.wait_for_connect());
        if matches!(connected.await, Ok(Ok(()))) {
            subscribed = s.subscribe(channel.as_str()).await.is_ok();
        }
    }
    let mut tick = tokio::time::interval(RECONCILE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = Seen::default();
    loop {
        let message = tokio::select! {
            m = next_message(&mut messages) => m,
            _ = tick.tick() => None,
        };
        let Some(inner) = weak.upgrade() else { break };
        let backend = RedisBackend { inner };
        if let (Some(s), false) = (&subscriber, subscribed) {
            subscribed = s.subscribe(channel.as_str()).await.is_ok();
        }
        match message {
            Some(m) if *m.channel == *channel => {
                let Some(text) = m.value.as_string() else {
                    continue;
                };
                let Ok(note) = serde_json::from_str::<Note>(&text) else {
                    continue;
                };
                if note.op == "change" {
                    // A change of the epoch followed is read by its keys; of another epoch, it
                    // is caught by the next tick (which reads the whole store).
                    // Applied here already (a change this instance made): nothing to read.
                    let ours = match (&note.v, &note.e) {
                        (Some(v), Some(e)) => {
                            let mut s = backend.synced();
                            let ours = s.epoch.as_deref() == Some(e);
                            s.stale |= !ours;
                            ours && !s.has(*v)
                        }
                        _ => false,
                    };
                    if ours
                        && backend.read_keys(&note.keys).await.is_ok()
                        && let (Some(v), Some(e)) = (note.v, &note.e)
                    {
                        backend.synced().applied(v, e);
                    }
                }
                for (limit, id) in note.keys.iter().take(MOST_KEYS_TOLD) {
                    backend
                        .inner
                        .overrides
                        .tell(&StoreEvent::Forget { limit, id });
                }
                if let (Some(r), Some(e)) = (note.r, &note.e) {
                    let mut synced = backend.synced();
                    if synced.epoch.as_deref() == Some(e.as_str()) {
                        synced.resets.told(r);
                    }
                }
            }
            Some(_) => {}
            None => {
                if let Err(e) = backend.reconcile(&mut seen).await {
                    tracing::debug!(error = %e, "stored overrides could not be reconciled: tried again in a second");
                }
            }
        }
    }
    if let Some(s) = subscriber {
        let _ = s.quit().await;
    }
}

/// The next notification; `None` after a lag (the reconcile catches up) and once the
/// receiver is closed (it is then dropped: only the reconcile follows the store).
async fn next_message<T: Clone>(rx: &mut Option<tokio::sync::broadcast::Receiver<T>>) -> Option<T> {
    let Some(receiver) = rx else {
        return std::future::pending().await;
    };
    match receiver.recv().await {
        Ok(m) => Some(m),
        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => None,
        Err(tokio::sync::broadcast::error::RecvError::Closed) => {
            *rx = None;
            None
        }
    }
}

#[async_trait]
impl OverrideStore for RedisOverrides {
    fn current(&self) -> Vec<StoredOverride> {
        self.backend.inner.overrides.current()
    }

    fn has_limit(&self, limit: &str) -> bool {
        self.backend.inner.overrides.has_limit(limit)
    }

    async fn refresh(&self) -> Result<Vec<StoredOverride>, BackendError> {
        let b = &self.backend;
        b.reconcile(&mut Seen::default()).await?;
        Ok(b.inner.overrides.current())
    }

    async fn put(&self, o: &StoredOverride) -> Result<(), PutError> {
        let b = &self.backend;
        let names = &b.inner.override_names;
        let args = vec![
            StoredOverride::field(&o.limit, &o.id),
            o.encode(),
            names.channel.clone(),
            o.limit.clone(),
            o.id.clone(),
            b.inner.max_overrides.to_string(),
            new_epoch(),
        ];
        let (v, e) = version_and_epoch(b.run_overrides(PUT, args).await?);
        if v < 0 {
            return Err(PutError::Full {
                max: b.inner.max_overrides,
            });
        }
        b.told(v, &e);
        b.inner.overrides.apply(Delta {
            set: vec![o.clone()],
            gone: Vec::new(),
        });
        b.inner.overrides.tell(&StoreEvent::Forget {
            limit: &o.limit,
            id: &o.id,
        });
        Ok(())
    }

    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError> {
        let b = &self.backend;
        let args = vec![
            b.inner.override_names.channel.clone(),
            new_epoch(),
            String::new(),
            StoredOverride::field(limit, id),
            limit.to_owned(),
            id.to_owned(),
        ];
        let (v, e) = version_and_epoch(b.run_overrides(REMOVE, args).await?);
        b.told(v, &e);
        // Gone here whatever the store held: it is what the store says (an override this
        // instance kept after the store lost it goes too).
        b.inner.overrides.apply(Delta {
            set: Vec::new(),
            gone: vec![(limit.to_owned(), id.to_owned())],
        });
        b.inner.overrides.tell(&StoreEvent::Forget { limit, id });
        Ok(v > 0)
    }

    fn watch(&self, w: Watcher) {
        self.backend.inner.overrides.watch(w);
    }

    fn forget_local(&self, key: &BucketKey) {
        if let Some(cache) = &self.backend.inner.cache {
            cache.forget(key);
        }
        self.backend.inner.pools.forget(key);
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.backend.inner.local.clone()
    }
}
