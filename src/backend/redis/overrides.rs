//! Overrides set at run time, on Redis: one hash of them, a version bumped by every change, and
//! a channel telling every instance what changed.
//!
//! - `<prefix>{overrides}`: a hash, field `<limit>:<id>` (the id's canonical text), value the
//!   override's stored form ([`StoredOverride::encode`]: JSON with a version, its expiry inside,
//!   never a key TTL, so no `volatile-*` eviction policy removes it).
//! - `<prefix>{overrides}:v`: the hash's version, bumped by every change (same slot).
//! - channel `<prefix>overrides`: `{"op": "change" | "reset", "keys": [[limit, id], ...]}` after
//!   every change (and every reset through [`Backend::reset`](crate::Backend::reset)).
//!
//! Each instance runs one task: it listens on the channel (a change: read the hash, apply it,
//! forget the bucket; a reset: forget it) and every second reads the version (read the hash
//! when it moved, or every 30 s) and removes expired overrides. A lost notification is so
//! caught within a second; with Redis down, the overrides last read stay in force. These
//! commands bypass the circuit breakers: they are not requests, and a reconcile failing while
//! nobody asks must not open (or close) a circuit the requests see.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use fred::prelude::{
    ClientLike, EventInterface, HashesInterface, KeysInterface, LuaInterface, PubsubInterface,
    Value,
};

use super::{Inner, RedisBackend};
use crate::backend::{BackendError, OverrideStore, StoreEvent, Watcher};
use crate::key::BucketKey;
use crate::overrides::StoredOverride;
use crate::time::Clock;

/// How often each instance reads the version (and so the longest a lost notification delays a
/// change).
const RECONCILE_EVERY: Duration = Duration::from_secs(1);
/// Every this many ticks, the hash is read whatever the version says.
const FULL_READ_EVERY: u32 = 30;

/// Stores one override, bumps the version, tells every instance.
const PUT: &str = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) \
    local v = redis.call('INCR', KEYS[2]) \
    redis.call('PUBLISH', ARGV[3], ARGV[4]) return v";
/// Removes one override (only if its value is still `ARGV[2]`, when given), bumps the version
/// and tells every instance if it was there; answers the new version, or 0.
const REMOVE: &str = "if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then \
    return 0 end \
    if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end \
    local v = redis.call('INCR', KEYS[2]) \
    redis.call('PUBLISH', ARGV[3], ARGV[4]) return v";

/// The names of the hash, the version and the channel.
pub(super) struct Names {
    hash: String,
    version: String,
    channel: String,
    slot: u16,
}

impl Names {
    pub(super) fn new(prefix: &str) -> Self {
        let hash = format!("{prefix}{{overrides}}");
        Self {
            slot: fred::util::redis_keyslot(hash.as_bytes()),
            version: format!("{hash}:v"),
            channel: format!("{prefix}overrides"),
            hash,
        }
    }
}

/// A notification: what changed.
fn message(op: &str, keys: &[(&str, &str)]) -> String {
    serde_json::json!({"op": op, "keys": keys}).to_string()
}

/// The store of one Redis backend (what [`Backend::override_store`](crate::Backend) gives).
pub(super) struct RedisOverrides {
    pub(super) backend: RedisBackend,
}

impl RedisBackend {
    fn now_ms(&self) -> u64 {
        self.inner.local.now_us() / 1_000
    }

    /// Runs `script` on the overrides' slot.
    async fn run_overrides(
        &self,
        script: &'static str,
        args: Vec<String>,
    ) -> Result<Value, BackendError> {
        let names = &self.inner.override_names;
        let keys = vec![names.hash.clone(), names.version.clone()];
        self.call(names.slot, move |client| {
            let (keys, args) = (keys.clone(), args.clone());
            async move { client.eval::<Value, _, _, _>(script, keys, args).await }
        })
        .await
    }

    /// Reads the hash; applies it unless a change made here since is newer. Removes what has
    /// expired (each removal tells every instance).
    pub(super) async fn read_overrides(&self) -> Result<Arc<[StoredOverride]>, BackendError> {
        // The version first, then the hash: the hash is at least as new as the version read (a
        // change in between is seen again at the next tick). Plain commands, not a script: the
        // reconcile of every instance adds nothing to a server's script calls.
        let names = &self.inner.override_names;
        let (version_key, hash) = (names.version.clone(), names.hash.clone());
        let version = self
            .call(names.slot, move |client| {
                let key = version_key.clone();
                async move { client.get::<Option<u64>, _>(key).await }
            })
            .await?
            .unwrap_or(0);
        let fields = self
            .call(names.slot, move |client| {
                let key = hash.clone();
                async move {
                    client
                        .hgetall::<std::collections::HashMap<fred::types::Key, Value>, _>(key)
                        .await
                }
            })
            .await?;
        let now_ms = self.now_ms();
        let mut list = Vec::with_capacity(fields.len());
        for (field, value) in fields {
            let (Some(field), Some(value)) = (field.as_str(), value.as_string()) else {
                tracing::warn!("skipping a stored override that is not text");
                continue;
            };
            match StoredOverride::decode(&value) {
                Some(o) if StoredOverride::field(&o.limit, &o.id) == field => {
                    if o.expired(now_ms) {
                        self.remove_field(&o.limit, &o.id, &value).await?;
                    } else {
                        list.push(o);
                    }
                }
                _ => tracing::warn!(
                    field,
                    "skipping a stored override this crate could not have written"
                ),
            }
        }
        let inner = &self.inner;
        if version >= inner.overrides_version.load(Ordering::Acquire) {
            inner.overrides_version.fetch_max(version, Ordering::AcqRel);
            inner.overrides.update(|current| *current = list);
        }
        Ok(inner.overrides.current())
    }

    /// Removes the override of `limit` and `id` (only if its stored value is still `only_if`,
    /// unless that is empty), telling every instance; whether it was there.
    async fn remove_field(
        &self,
        limit: &str,
        id: &str,
        only_if: &str,
    ) -> Result<bool, BackendError> {
        let names = &self.inner.override_names;
        let args = vec![
            StoredOverride::field(limit, id),
            only_if.to_owned(),
            names.channel.clone(),
            message("change", &[(limit, id)]),
        ];
        let v = self.run_overrides(REMOVE, args).await?;
        let v = v.as_u64().unwrap_or(0);
        self.inner.overrides_version.fetch_max(v, Ordering::AcqRel);
        Ok(v != 0)
    }

    /// Tells every instance that `keys` were reset (their deny caches and prefetched tokens).
    pub(super) async fn publish_reset(&self, keys: &[&BucketKey]) {
        let ids: Vec<String> = keys.iter().map(|k| k.id().to_string()).collect();
        let pairs: Vec<(&str, &str)> = keys
            .iter()
            .zip(&ids)
            .map(|(k, id)| (k.name().as_str(), id.as_str()))
            .collect();
        let names = &self.inner.override_names;
        let (channel, text) = (names.channel.clone(), message("reset", &pairs));
        let sent = self
            .call(names.slot, move |client| {
                let (channel, text) = (channel.clone(), text.clone());
                async move { client.publish::<i64, _, _>(channel, text).await }
            })
            .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, "a reset could not be told to the other instances: their deny caches may deny these keys until their remembered denials end");
        }
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
    let mut ticks: u32 = 0;
    let mut seen_version: Option<String> = None;
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
                if note.op == "change" && backend.read_overrides().await.is_err() {
                    // Caught by the next tick's read.
                    seen_version = None;
                }
                for (limit, id) in note.keys.iter().take(10_000) {
                    backend
                        .inner
                        .overrides
                        .tell(&StoreEvent::Forget { limit, id });
                }
            }
            Some(_) => {}
            None => {
                ticks = ticks.wrapping_add(1);
                let names = &backend.inner.override_names;
                let key = names.version.clone();
                let version = backend
                    .call(names.slot, move |client| {
                        let key = key.clone();
                        async move { client.get::<Option<String>, _>(key).await }
                    })
                    .await;
                let Ok(version) = version else { continue };
                let now_ms = backend.now_ms();
                let expired = backend
                    .inner
                    .overrides
                    .current()
                    .iter()
                    .any(|o| o.expired(now_ms));
                if (version != seen_version || expired || ticks.is_multiple_of(FULL_READ_EVERY))
                    && backend.read_overrides().await.is_ok()
                {
                    seen_version = version;
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

#[derive(serde::Deserialize)]
struct Note {
    op: String,
    keys: Vec<(String, String)>,
}

#[async_trait]
impl OverrideStore for RedisOverrides {
    fn current(&self) -> Arc<[StoredOverride]> {
        self.backend.inner.overrides.current()
    }

    async fn refresh(&self) -> Result<Arc<[StoredOverride]>, BackendError> {
        self.backend.read_overrides().await
    }

    async fn put(&self, o: &StoredOverride) -> Result<(), BackendError> {
        let b = &self.backend;
        let names = &b.inner.override_names;
        let args = vec![
            StoredOverride::field(&o.limit, &o.id),
            o.encode(),
            names.channel.clone(),
            message("change", &[(&o.limit, &o.id)]),
        ];
        let v = b.run_overrides(PUT, args).await?;
        b.inner
            .overrides_version
            .fetch_max(v.as_u64().unwrap_or(0), Ordering::AcqRel);
        b.inner.overrides.put(o);
        b.inner.overrides.tell(&StoreEvent::Forget {
            limit: &o.limit,
            id: &o.id,
        });
        Ok(())
    }

    async fn remove(&self, limit: &str, id: &str) -> Result<bool, BackendError> {
        let b = &self.backend;
        let removed = b.remove_field(limit, id, "").await?;
        b.inner.overrides.remove(limit, id);
        b.inner.overrides.tell(&StoreEvent::Forget { limit, id });
        Ok(removed)
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
