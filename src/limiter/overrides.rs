//! Overrides set while the service runs, through the limiter: checked as file overrides are,
//! kept in the backend's store, applied at once here and, through the store, on every instance.

use std::sync::Arc;
use std::time::Duration;

use super::Limiter;
use crate::backend::{BackendError, OverrideStore, PutError, StoreEvent};
use crate::config::{Limits, NameEntry, OverrideRefusal, StoredSet};
use crate::key::IdError;
use crate::overrides::{Delta, OverrideKind, StoredOverride};

/// The longest expiry an override may be given: ten years.
const MAX_EXPIRY: Duration = Duration::from_secs(10 * 365 * 86_400);

/// Why an override could not be set, removed or listed. Nothing was changed.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum OverrideError {
    /// The configuration defines no limit of this name.
    #[error("unknown limit {0:?}")]
    UnknownName(String),
    /// The id is not of the limit's id kind.
    #[error("limit {limit}: invalid id: {source}")]
    InvalidId {
        /// The limit's name.
        limit: String,
        /// Why the id was refused.
        #[source]
        source: IdError,
    },
    /// The limit cannot replace this limit's: a request costs more than its size, or its
    /// shape is not the default's (which only `unlimited`, `block` or a limit of its own shape
    /// replace).
    #[error("limit {limit}: {reason}")]
    Refused {
        /// The limit's name.
        limit: String,
        /// Why.
        reason: OverrideRefusal,
    },
    /// An expiry of zero or above ten years.
    #[error("an override's expiry must be above zero and at most ten years, not {0:?}")]
    Expiry(Duration),
    /// The store holds its most overrides (`max_overrides` on the backend's builder, a million
    /// by default) and this one is new: remove some, or raise the cap.
    #[error("the store holds its most overrides ({max}); remove some, or raise max_overrides")]
    TooMany {
        /// The cap.
        max: usize,
    },
    /// The limiter's backend keeps no overrides (a custom backend).
    #[error("this limiter's backend keeps no overrides")]
    NoStore,
    /// The store could not be reached or refused the change: nothing changed, and the
    /// overrides last known stay in force.
    #[error("the override store cannot be reached: {0}")]
    Store(#[from] BackendError),
}

readable_debug!(OverrideError { UnknownName(name), InvalidId { limit, source }, Refused { limit, reason }, Expiry(expiry), TooMany { max }, NoStore, Store(error) });

/// The entry of `limit` in `limits` and `id` in its canonical text, checked against its kind.
fn canonical<'a>(
    limits: &'a Limits,
    limit: &str,
    id: &str,
) -> Result<(&'a NameEntry, String), OverrideError> {
    let entry = limits
        .name(limit)
        .and_then(|name| limits.entry(name))
        .ok_or_else(|| OverrideError::UnknownName(limit.to_owned()))?;
    let id = entry
        .kind
        .parse(id)
        .map_err(|source| OverrideError::InvalidId {
            limit: limit.to_owned(),
            source,
        })?;
    Ok((entry, id.to_string()))
}

/// `limits` with the stored overrides of `list` applied, the gauge set.
pub(super) fn applied(
    limits: &Limits,
    store: &dyn OverrideStore,
    list: &[StoredOverride],
) -> Limits {
    let stored = StoredSet::build(limits, list, store.clock());
    crate::telemetry::stored_overrides(stored.as_ref().map_or(0, |s| s.len()));
    limits.with_stored(stored)
}

/// `limits` with `delta` applied to its stored overrides (in time that grows with the delta),
/// the gauge set.
fn changed(limits: &Limits, store: &dyn OverrideStore, delta: &Delta) -> Limits {
    let stored = StoredSet::apply(limits.stored(), limits, delta, store.clock());
    crate::telemetry::stored_overrides(stored.as_ref().map_or(0, |s| s.len()));
    limits.with_stored(stored)
}

impl Limiter {
    /// Sets an override kept in the backend's store, for every instance on it: a limit of its
    /// own, `unlimited` or `block` for `id` on `limit`, ended after `expires_in` if given. It
    /// wins over the configuration's overrides and its default; this limiter applies it before
    /// returning, the others on the same Redis within two seconds (a notification, and a
    /// reconcile every second as the safety net). Bucket state is kept, as across a reload:
    /// what was spent stays spent (`docs/gcra.md`, "Changing a limit"); what instances
    /// remember of the bucket (denials, prefetched tokens) is dropped. A new override past the
    /// store's cap is refused ([`OverrideError::TooMany`]).
    ///
    /// The id is checked against the limit's kind and stored in its canonical text. Answers
    /// the override stored.
    ///
    /// ```
    /// # use tower_ratelimits::{Id, Limit, Limiter, Limits, LimitSource, MemoryBackend, OverrideKind, Transaction};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::from_yaml_str("Api: {kind: ip, burst: 2, count: 2, period: 1m}", None)?;
    /// let limiter = Limiter::new(limits, MemoryBackend::new());
    /// let vip = Limit::new(100, 100, Duration::from_secs(60))?;
    /// let set = limiter
    ///     .set_override("Api", "10.0.0.7", OverrideKind::Quota(vip.into()), None)
    ///     .await?;
    /// assert_eq!((set.limit(), set.id()), ("Api", "10.0.0.7"));
    /// let key = limiter.parse_key("Api", "10.0.0.7")?;
    /// let seen = limiter.inspect(&key).await?;
    /// assert_eq!((seen.source, seen.remaining), (LimitSource::Store, 100));
    ///
    /// limiter.set_override("Api", "10.0.0.8", OverrideKind::Block, Some(Duration::from_secs(3600))).await?;
    /// let denied = limiter.spend(&[Transaction::new(limiter.parse_key("Api", "10.0.0.8")?)]).await?;
    /// assert!(!denied.allowed());
    /// assert_eq!(denied.strictest().unwrap().retry_after(), Duration::from_secs(3600));
    /// assert!(limiter.remove_override("Api", "10.0.0.8").await?);
    /// # Ok(()) }
    /// ```
    pub async fn set_override(
        &self,
        limit: &str,
        id: &str,
        kind: OverrideKind,
        expires_in: Option<Duration>,
    ) -> Result<StoredOverride, OverrideError> {
        let store = self.store()?;
        let id = {
            let limits = self.load();
            let (entry, id) = canonical(&limits, limit, id)?;
            crate::config::check_override(entry, &kind).map_err(|reason| {
                OverrideError::Refused {
                    limit: limit.to_owned(),
                    reason,
                }
            })?;
            id
        };
        let expires_at_ms = match expires_in {
            None => None,
            Some(d) if d.is_zero() || d > MAX_EXPIRY => return Err(OverrideError::Expiry(d)),
            Some(d) => {
                let ms = u64::try_from(d.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX);
                Some(store.now_ms().saturating_add(ms))
            }
        };
        // What every instance applies is what the store keeps of it (a GCRA limit of its own
        // keeps neither a debt nor prefetching): this one too.
        let o = StoredOverride {
            limit: limit.to_owned(),
            id,
            kind,
            expires_at_ms,
        }
        .into_stored();
        store.put(&o).await.map_err(|e| match e {
            PutError::Full { max } => OverrideError::TooMany { max },
            PutError::Store(e) => OverrideError::Store(e),
        })?;
        Ok(o)
    }

    /// Removes the stored override of `limit` and `id` (the id in any text of its kind), on
    /// every instance as [`set_override`](Self::set_override) sets one; whether there was one.
    pub async fn remove_override(&self, limit: &str, id: &str) -> Result<bool, OverrideError> {
        let store = self.store()?;
        let id = match canonical(&self.load(), limit, id) {
            Ok((_, id)) => id,
            // A limit the configuration no longer defines: its overrides can still go.
            Err(OverrideError::UnknownName(_)) if store.has_limit(limit) => id.to_owned(),
            Err(e) => return Err(e),
        };
        Ok(store.remove(limit, &id).await?)
    }

    /// The stored overrides, read from the store now (an error when it cannot be reached; the
    /// last known stay in force), expired ones left out. Reading them also brings this limiter
    /// up to date.
    pub async fn stored_overrides(&self) -> Result<Vec<StoredOverride>, OverrideError> {
        let store = self.store()?;
        let list = store.refresh().await?;
        let now_ms = store.now_ms();
        Ok(list.into_iter().filter(|o| !o.expired(now_ms)).collect())
    }

    fn store(&self) -> Result<&Arc<dyn OverrideStore>, OverrideError> {
        self.inner.store.as_ref().ok_or(OverrideError::NoStore)
    }

    /// Follows the backend's store: its changes are applied to the limits in force, its
    /// forgotten buckets dropped from what the backend remembers.
    pub(super) fn watch_store(&self) {
        let Some(store) = &self.inner.store else {
            return;
        };
        let limiter = Arc::downgrade(&self.inner);
        store.watch(Box::new(move |event| {
            if let Some(inner) = limiter.upgrade() {
                Limiter { inner }.on_store_event(event);
            }
        }));
    }

    fn on_store_event(&self, event: &StoreEvent<'_>) {
        let Some(store) = &self.inner.store else {
            return;
        };
        match event {
            StoreEvent::Changed(delta) => {
                let applied: Result<(), std::convert::Infallible> = self
                    .replace_limits(|current| Ok((changed(current, store.as_ref(), delta), ())));
                let Ok(()) = applied;
            }
            StoreEvent::Forget { limit, id } => {
                if let Ok(key) = self.parse_key(limit, id) {
                    store.forget_local(&key);
                }
            }
        }
    }
}
