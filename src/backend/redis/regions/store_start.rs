//! When the region's own store started (`docs/regions.md`, "Faults"): a store that restarted
//! empty, or lost its records some other way at a restart, holds no record of a share bucket
//! that was spent just before. Read as full, such a bucket would hand its floor's burst out a
//! second time: over the envelope. So a share bucket the store holds no record of is read as
//! empty at the store's start (its tokens refilled at the floor's rate since), which is the same
//! as full once the store has run for one refill of the floor; a store that has run longer
//! changes nothing.
//!
//! The start is `INFO server`'s `server_time_usec - uptime_in_seconds` (the uptime rounded
//! down: the start read is at or after the real one, never before), on the clock the script
//! decides with (the caller's in caller-time mode), the latest of every master's. It is read
//! when the backend connects and again at every connection the client makes (fred's
//! reconnection events); until it is read the region's floors are 0, and a store whose start
//! cannot be read is taken as started when the read failed.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use fred::interfaces::{ClientLike, EventInterface};
use fred::prelude::Client;
use fred::types::InfoKind;

use super::Regional;
use crate::backend::BackendError;
use crate::backend::redis::RedisBackend;
use crate::backend::redis::connect::Connection;

/// The store's start, not read yet.
pub(super) const UNKNOWN: u64 = u64::MAX;

impl Regional {
    /// When the region's store started (the script's clock), once read.
    pub(crate) fn store_start(&self) -> Option<u64> {
        Some(self.store_start.load(Ordering::Acquire)).filter(|&s| s != UNKNOWN)
    }

    fn set_store_start(&self, start: u64) {
        self.store_start.store(start, Ordering::Release);
    }
}

/// A server's start from its `INFO server` text, with `now` for a server that does not say
/// its time (`server_time_usec`, Redis 5 and later; always `now` in caller-time mode).
fn start_of(info: &str, now: Option<u64>) -> Option<u64> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let uptime = field("uptime_in_seconds")?;
    let at = now.or_else(|| field("server_time_usec"))?;
    Some(at.saturating_sub(uptime.saturating_mul(1_000_000)))
}

impl RedisBackend {
    /// The clients of the region's store: one per master, or every client of a pool (`all`).
    fn store_clients(&self, all: bool) -> Vec<Client> {
        match &self.inner.conn {
            Connection::Client(c) => vec![c.clone()],
            Connection::Pool(p) if all => p.clients().to_vec(),
            Connection::Pool(p) => vec![p.next().clone()],
            Connection::Cluster(r) => r.masters(),
        }
    }

    /// Reads when the region's store started (the latest of its masters) and keeps it.
    pub(crate) async fn read_store_start(&self) -> Result<u64, BackendError> {
        let failed = |e: fred::error::Error| BackendError::Unavailable(e.to_string());
        let mut latest = 0;
        for client in self.store_clients(false) {
            let info: String = client.info(Some(InfoKind::Server)).await.map_err(failed)?;
            let now = self.inner.caller_time.then(|| self.inner.local.now_us());
            let start = start_of(&info, now).ok_or_else(|| {
                BackendError::Unavailable("INFO server without uptime_in_seconds".into())
            })?;
            latest = latest.max(start);
        }
        if let Some(regional) = self.regional_mode() {
            regional.set_store_start(latest);
        }
        Ok(latest)
    }

    /// Follows the region's store's starts: read now (awaited unless the connection is lazy)
    /// and at every connection a client of it makes. Nothing when not regional.
    pub(crate) async fn follow_store_start(&self, lazy: bool) {
        let Some(regional) = self.regional_mode() else {
            return;
        };
        let weak = Arc::downgrade(&self.inner);
        for client in self.store_clients(true) {
            let (weak, regional) = (Weak::clone(&weak), Arc::downgrade(regional));
            // The listener ends with the client (its events' sender).
            drop(client.on_reconnect(move |_server| {
                let (weak, regional) = (Weak::clone(&weak), Weak::clone(&regional));
                async move {
                    // Unknown until read again: the floors are 0 meanwhile.
                    if let Some(r) = regional.upgrade() {
                        r.set_store_start(UNKNOWN);
                    }
                    if let Some(inner) = weak.upgrade() {
                        read_or_warn(&RedisBackend { inner }).await;
                    }
                    Ok(())
                }
            }));
        }
        if lazy {
            let backend = self.clone();
            tokio::spawn(async move { read_or_warn(&backend).await });
        } else {
            read_or_warn(self).await;
        }
    }
}

/// Reads when the region's store started. When it cannot be read (the store down again, or
/// `INFO` refused), the store is taken as started now: its keys start empty, full a refill
/// later, and the next connection reads it again.
pub(super) async fn read_or_warn(backend: &RedisBackend) {
    if let Err(e) = backend.read_store_start().await {
        if let Some(regional) = backend.regional_mode() {
            regional.set_store_start(backend.inner.local.now_us());
        }
        tracing::warn!(target: crate::telemetry::target::BACKEND, error = %e,
            "reading when the region's store started failed: taken as started now (the keys \
             of marked limits it holds no record of start empty)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_is_the_servers_time_less_its_whole_seconds_up() {
        let info = "# Server\r\nredis_version:7.0.15\r\nserver_time_usec:1795737274342917\r\n\
                    uptime_in_seconds:1186\r\n";
        assert_eq!(
            start_of(info, None),
            Some(1_795_737_274_342_917 - 1_186_000_000)
        );
        // In caller-time mode the caller's clock.
        assert_eq!(
            start_of(info, Some(5_000_000_000)),
            Some(5_000_000_000 - 1_186_000_000)
        );
        assert_eq!(
            start_of("# Server\r\nuptime_in_seconds:x\r\n", Some(1)),
            None
        );
        assert_eq!(start_of("uptime_in_seconds:3\r\n", None), None, "no time");
    }
}
