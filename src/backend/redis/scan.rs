//! Walking a limit's keys on every master with `SCAN`, read only: a replay's snapshot reads
//! them whole (`snapshot.rs`), the admin API's ban list a page at a time
//! ([`Backend::penalty_page`](crate::Backend::penalty_page)). A key is
//! `<prefix>{<escaped limit name>:<escaped id>}<suffix>` (`keys.rs`); `SCAN`, `GET` and
//! `TIME` only.

use fred::prelude::{Client, ClientLike, Value};
use futures_util::future::join_all;

use super::keys::{self, KeyBuf};
use super::reply::number;
use super::{Connection, RedisBackend};
use crate::backend::kit::{Kept, Stored};
use crate::backend::{BackendError, StatesPage};

/// The store failed.
pub(super) fn failed(e: fred::prelude::Error) -> BackendError {
    BackendError::Unavailable(e.to_string())
}

impl RedisBackend {
    /// A client of every master, in the topology's order (a pool's servers are one).
    pub(super) fn masters(&self) -> Vec<Client> {
        match &self.inner.conn {
            Connection::Client(c) => vec![c.clone()],
            Connection::Pool(p) => vec![p.next().clone()],
            Connection::Cluster(r) => r.masters(),
        }
    }

    /// The store's clock now (the caller's, with `caller_time`), in microseconds since the
    /// Unix epoch.
    pub(super) async fn store_now(&self, masters: &[Client]) -> Result<u64, BackendError> {
        if self.inner.caller_time {
            return Ok(self.inner.local.now_us());
        }
        let any = masters
            .first()
            .ok_or_else(|| BackendError::Unavailable("no Redis master".into()))?;
        server_time(any).await
    }

    /// A page of limit `limit`'s penalty states: one `SCAN` call of `count` keys on one
    /// master, from `cursor` (`<master>.<scan cursor>`; `None`: the first master's start),
    /// each penalty key it finds read (`GET`). A page may hold none while more follow; a key
    /// written while the walk goes on may be missed or seen twice (`SCAN`'s promise).
    pub(super) async fn penalty_states(
        &self,
        limit: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<Option<StatesPage>, BackendError> {
        let Some((master, scan)) = cursor.map_or(Some((0, "0")), parse_cursor) else {
            return Ok(None);
        };
        let masters = self.masters();
        let now_us = self.store_now(&masters).await?;
        let Some(client) = masters.get(master) else {
            return Ok(None);
        };
        let head = KeyBuf::head(&self.inner.prefix, limit);
        let pattern = glob_escaped(&head);
        let (next, keys) = scan_page(client, scan, &pattern, count).await?;
        let reads = keys.iter().filter_map(|key| {
            let (id, kept) = parse_key(key.strip_prefix(head.as_bytes())?)?;
            (kept == Kept::Penalty).then_some(async move { (id, read_penalty(client, key).await) })
        });
        let mut states = Vec::new();
        for (id, state) in join_all(reads).await {
            if let Some(Stored::Penalty(p)) = state? {
                states.push((id, *p));
            }
        }
        let next = match (next.as_str(), master + 1 < masters.len()) {
            ("0", false) => None,
            ("0", true) => Some(format!("{}.0", master + 1)),
            (scan, _) => Some(format!("{master}.{scan}")),
        };
        Ok(Some(StatesPage {
            states,
            now_us,
            next,
        }))
    }
}

/// A page cursor `<master>.<scan cursor>`, each whole decimal (as this backend writes them).
fn parse_cursor(cursor: &str) -> Option<(usize, &str)> {
    let (master, scan) = cursor.split_once('.')?;
    let digits = |t: &str| !t.is_empty() && t.len() <= 20 && t.bytes().all(|b| b.is_ascii_digit());
    (digits(master) && digits(scan)).then_some((master.parse().ok()?, scan))
}

/// A penalty key's state: `None` when it is gone or holds what is not ours (the script
/// replaces it; its key never holds a ban).
async fn read_penalty(client: &Client, key: &[u8]) -> Result<Option<Stored>, BackendError> {
    let raw: Value = match client
        .custom(fred::cmd!("GET"), vec![fred::prelude::Key::from(key)])
        .await
    {
        Ok(v) => v,
        Err(e) if e.details().contains("WRONGTYPE") => return Ok(None),
        Err(e) => return Err(failed(e)),
    };
    Ok(raw.as_bytes().and_then(super::script::read_penalty))
}

/// The server's clock, in microseconds since the Unix epoch.
pub(super) async fn server_time(client: &Client) -> Result<u64, BackendError> {
    let reply: Value = client
        .custom(fred::cmd!("TIME"), Vec::<String>::new())
        .await
        .map_err(failed)?;
    let parts = match reply {
        Value::Array(parts) => parts,
        other => {
            return Err(BackendError::Unavailable(format!(
                "unexpected TIME reply {other:?}"
            )));
        }
    };
    let number = |i: usize| parts.get(i).and_then(number);
    match (number(0), number(1)) {
        (Some(s), Some(us)) => Ok(s.saturating_mul(1_000_000).saturating_add(us)),
        _ => Err(BackendError::Unavailable("unexpected TIME reply".into())),
    }
}

/// `text` with the glob's special characters escaped, then `*`.
pub(super) fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

/// One `SCAN` call on `client` from `cursor`: the next cursor (`"0"`: the walk is over) and
/// the keys matching `pattern` among the `count` or so it looked at.
pub(super) async fn scan_page(
    client: &Client,
    cursor: &str,
    pattern: &str,
    count: usize,
) -> Result<(String, Vec<Vec<u8>>), BackendError> {
    let count = count.to_string();
    let args = vec![cursor, "MATCH", pattern, "COUNT", count.as_str()];
    let reply: Value = client
        .custom(fred::cmd!("SCAN"), args)
        .await
        .map_err(failed)?;
    let bad = || BackendError::Unavailable("unexpected SCAN reply".into());
    let Value::Array(mut parts) = reply else {
        return Err(bad());
    };
    if parts.len() != 2 {
        return Err(bad());
    }
    let keys = match parts.pop() {
        Some(Value::Array(keys)) => keys,
        _ => return Err(bad()),
    };
    let cursor = parts
        .pop()
        .and_then(|c| {
            c.as_bytes()
                .map(|b| String::from_utf8_lossy(b).into_owned())
        })
        .ok_or_else(bad)?;
    let keys = keys
        .into_iter()
        .filter_map(|k| k.as_bytes().map(<[u8]>::to_vec))
        .collect();
    Ok((cursor, keys))
}

/// A key's rest after `<prefix>{<name>:`: its id (unescaped) and the state its suffix keeps
/// ([`keys::kept_at`]); `None` for a key that is not one of ours.
pub(super) fn parse_key(rest: &[u8]) -> Option<(String, Kept)> {
    let close = rest.iter().position(|&b| b == b'}')?;
    let kept = keys::kept_at(&rest[close + 1..])?;
    let escaped = &rest[..close];
    let mut id = Vec::with_capacity(escaped.len());
    let mut i = 0;
    while i < escaped.len() {
        let b = escaped[i];
        if b == b'%' {
            let hex = escaped.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            id.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if KeyBuf::plain(b) {
            id.push(b);
            i += 1;
        } else {
            return None;
        }
    }
    Some((String::from_utf8(id).ok()?, kept))
}
