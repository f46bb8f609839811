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
use crate::backend::{BackendError, OverrideStore, PutError, StoreEvent, Watcher};
use crate::key::BucketKey;
use crate::overrides::Delta;
use crate::overrides::StoredOverride;
use crate::time::Clock;

mod follow;

/// How often each instance reads the version and the epoch (and so the longest a lost
/// notification delays a change: two of these).
const RECONCILE_EVERY: Duration = Duration::from_secs(1);
/// Fields asked for per `HSCAN` call and per `HMGET`: each call short, so requests on the same
/// server wait for none of them long.
const PAGE: usize = 1_000;
/// Overrides read whole applied to the limits in force together (`read_overrides`).
const APPLY_AT: usize = 16 * PAGE;
/// Fields a notification names that an instance reads (a change names one; expiries a batch).
const MOST_KEYS_TOLD: usize = 10_000;

/// Where a fresh instance stands with its first whole read of the stored overrides, as a
/// request arriving before it sees it (`RedisBackendBuilder::ready_wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FirstRead {
    /// Under way, or not started: the store has not failed to answer. A request waits.
    Reading,
    /// The store did not answer (no connection, or a command of the read failed): the failure
    /// policy answers at once, until the store answers again.
    Unreachable,
    /// Read whole: every request is decided by the store.
    Done,
}

impl RedisBackend {
    /// Says where the first read stands (nothing once it is done: later reads do not gate
    /// requests).
    pub(super) fn first_read(&self, state: FirstRead) {
        self.inner.first_read.send_if_modified(|now| {
            let changed = *now != FirstRead::Done && *now != state;
            if changed {
                *now = state;
            }
            changed
        });
    }
}

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
