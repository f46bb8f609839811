//! Following the stored overrides: the whole hash read in pages, expired ones removed, resets
//! told to every instance, and the task each instance runs (a notification's keys read at
//! once; every second the version, the epoch and the size, and the whole hash read again only
//! when they say this instance missed something).

use super::*;

impl RedisBackend {
    /// Reads the whole hash, in pages applied as they come, and removes here what it no
    /// longer holds: the store as it is, whatever this instance held (after a store lost its
    /// data, at start, after a gap in the versions). Then follows the store's epoch from the
    /// version read first (changes made during the read are told again or read again).
    pub(in crate::backend::redis) async fn read_overrides(
        &self,
    ) -> Result<Vec<StoredOverride>, BackendError> {
        // One read at a time (its marks are one pass's); one that waited for another finds the
        // store as that one read it.
        let Ok(_one) = self.inner.override_read.try_lock() else {
            let _after = self.inner.override_read.lock().await;
            return Ok(self.inner.overrides.current());
        };
        self.set_epoch_if_none().await?;
        // The store answers: a request arriving before the first read is done waits for it.
        self.first_read(FirstRead::Reading);
        let State {
            version,
            epoch,
            resets,
            ..
        } = self.store_state().await?;
        let watched = &self.inner.overrides;
        let held = watched.len();
        let pass = watched.begin_pass();
        self.read_pages().await?;
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
        self.synced_to(epoch, version, resets);
        self.inner
            .overrides_ready
            .store(true, std::sync::atomic::Ordering::Release);
        self.first_read(FirstRead::Done);
        Ok(watched.current())
    }

    /// Sets the store's epoch if it has none (empty, or emptied): every instance reads the
    /// same one from here on, so the first change after does not make them all read the whole
    /// hash again.
    async fn set_epoch_if_none(&self) -> Result<(), BackendError> {
        let names = &self.inner.override_names;
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
        Ok(())
    }

    /// Reads the whole hash in `HSCAN` pages, applied `APPLY_AT` fields at a time: each
    /// application copies the parts of the limits' table it changes, so a page at a time made
    /// reading a million overrides quadratic (4.0 s in a release build, 36 s in a debug one).
    /// Applying marks what it finds (or sets) as the pass's.
    async fn read_pages(&self) -> Result<(), BackendError> {
        let names = &self.inner.override_names;
        let mut cursor = String::from("0");
        let mut applying = Delta::default();
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
            let (next, fields) = scan_page(page)?;
            let now_ms = self.now_ms();
            for (field, value) in fields {
                if let Some(o) = Self::decode(&field, &value, now_ms) {
                    applying.set.push(o);
                }
            }
            if next == "0" || applying.set.len() >= APPLY_AT {
                self.apply_capped(std::mem::take(&mut applying));
            }
            if next == "0" {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// What this instance has applied after a whole read at `version` of the store of
    /// `epoch`: another store than the one read before (not the first read: a lazy connection
    /// may serve requests before it) makes it forget what it remembers of its keys (tokens
    /// taken from the store before, denials it saw), which are not of this one.
    fn synced_to(&self, epoch: Option<String>, version: u64, resets: u64) {
        let mut synced = self.synced();
        if synced.epoch != epoch {
            synced.ahead.clear();
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
    }

    /// Removes from the store the overrides that have expired here (each only if its stored
    /// value has expired too), telling every instance.
    pub(super) async fn remove_expired(&self) -> Result<(), BackendError> {
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
    pub(super) fn forget_every_key(&self) {
        if let Some(cache) = &self.inner.cache {
            cache.clear();
        }
        self.inner.pools.forget_all();
    }

    /// A change made here was stored as version `v` of epoch `e` (`v` 0: none).
    pub(super) fn told(&self, v: i64, e: &str) {
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
    pub(in crate::backend::redis) async fn publish_reset(&self, keys: &[&BucketKey]) {
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
    pub(super) async fn reconcile(&self, seen: &mut Seen) -> Result<(), BackendError> {
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
    pub(in crate::backend::redis) fn follow_overrides(&self) {
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
pub(super) fn scan_page(page: Value) -> Result<(String, Vec<(String, String)>), BackendError> {
    let bad = || BackendError::Unavailable(format!("unexpected HSCAN reply: {:?}", page.kind()));
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

pub(super) async fn follow(
    weak: Weak<Inner>,
    config: fred::prelude::Config,
    timeout: Duration,
    channel: String,
) {
    let subscriber = crate::backend::redis::setup::configured_builder(config, timeout)
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
        } else if let Some(inner) = weak.upgrade() {
            // No connection to the store: a request before the first read is answered by the
            // failure policy at once, not after a wait.
            RedisBackend { inner }.first_read(FirstRead::Unreachable);
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
                if let Some(note) = m
                    .value
                    .as_string()
                    .and_then(|t| serde_json::from_str(&t).ok())
                {
                    backend.on_note(note).await;
                }
            }
            Some(_) => {}
            None => {
                if let Err(e) = backend.reconcile(&mut seen).await {
                    backend.first_read(FirstRead::Unreachable);
                    tracing::debug!(error = %e, "stored overrides could not be reconciled: tried again in a second");
                }
            }
        }
    }
    if let Some(s) = subscriber {
        let _ = s.quit().await;
    }
}

impl RedisBackend {
    /// A notification of the overrides' channel: a change of the epoch followed read by its
    /// keys (of another epoch, caught by the next tick, which reads the whole store; one this
    /// instance made and applied already, nothing to read), the keys it names forgotten by
    /// every watcher, a reset counted.
    async fn on_note(&self, note: Note) {
        if note.op == "change" {
            let ours = match (&note.v, &note.e) {
                (Some(v), Some(e)) => {
                    let mut s = self.synced();
                    let ours = s.epoch.as_deref() == Some(e);
                    s.stale |= !ours;
                    ours && !s.has(*v)
                }
                _ => false,
            };
            if ours
                && self.read_keys(&note.keys).await.is_ok()
                && let (Some(v), Some(e)) = (note.v, &note.e)
            {
                self.synced().applied(v, e);
            }
        }
        for (limit, id) in note.keys.iter().take(MOST_KEYS_TOLD) {
            self.inner.overrides.tell(&StoreEvent::Forget { limit, id });
        }
        if let (Some(r), Some(e)) = (note.r, &note.e) {
            let mut synced = self.synced();
            if synced.epoch.as_deref() == Some(e.as_str()) {
                synced.resets.told(r);
            }
        }
    }
}

/// The next notification; `None` after a lag (the reconcile catches up) and once the
/// receiver is closed (it is then dropped: only the reconcile follows the store).
pub(super) async fn next_message<T: Clone>(
    rx: &mut Option<tokio::sync::broadcast::Receiver<T>>,
) -> Option<T> {
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
