//! Reading the stored states of some limits, read only, for a replay's warm start (feature
//! `replay`; `docs/replay.md`, "Starting warm"): every master is walked with `SCAN` for the
//! keys of each limit name, and each value is read as the kit keeps it ([`kit::Stored`]).
//! Nothing is written: `SCAN`, `GET`, `PEXPIRETIME`, `ZCARD`, `ZRANGE` and `TIME` only.
//!
//! The values' formats are the script's (`ratelimit.lua`, `general_read.lua`,
//! `general_decide.lua`): a GCRA key holds its TAT and expires, on the server's clock, `k`
//! milliseconds after it (k: the bit length of its writer's bound); a tiered key a MessagePack
//! array `{1, base, n, per tier: entry - base (or -1), grants, per grant: time - base, units}`;
//! a concurrency key a sorted set of lease ids scored by deadline; a calendar key
//! `"<end> <used>"`. A value that is not one of ours is counted and left out, as the script
//! would replace it.

use fred::prelude::{Client, ClientLike, Value};
use futures_util::future::join_all;

use super::keys::{
    ADAPTIVE_POOL_SUFFIX, ADAPTIVE_SUFFIX, CALENDAR_SUFFIX, CONCURRENCY_SUFFIX, FAIR_SHARE_SUFFIX,
    KeyBuf, TIERS_SUFFIX,
};
use super::{Connection, RedisBackend};
use crate::algo::calendar::CalendarState;
use crate::algo::tiers::{TierLog, TierState};
use crate::backend::{BackendError, kit};

/// Keys asked for per `SCAN` call (a hint to the server), and read at once.
const PAGE: usize = 1_000;
/// The largest stored number the script writes (2^52).
const LIMIT: u64 = 1 << 52;
/// The most leases read from one concurrency key: more is not a state of ours.
const MAX_LEASES: u64 = 1 << 16;

/// One key's state as read.
pub(crate) struct StoredKey {
    /// The limit's name.
    pub(crate) limit: String,
    /// The id's text (unescaped).
    pub(crate) id: String,
    /// The state.
    pub(crate) state: kit::Stored,
}

/// What a read found.
pub(crate) struct States {
    /// The store's clock when the read began (the caller's, with `caller_time`), in
    /// microseconds since the Unix epoch.
    pub(crate) instant_us: u64,
    /// The states, in no particular order.
    pub(crate) keys: Vec<StoredKey>,
    /// Keys whose value is not a state of ours (another program's, a future format), left out.
    pub(crate) foreign: u64,
}

/// Why a read stopped.
pub(crate) enum ReadError {
    /// The store failed.
    Store(BackendError),
    /// More than the bound of keys.
    TooMany(usize),
}

impl From<BackendError> for ReadError {
    fn from(e: BackendError) -> Self {
        ReadError::Store(e)
    }
}

fn failed(e: fred::prelude::Error) -> ReadError {
    ReadError::Store(BackendError::Unavailable(e.to_string()))
}

impl RedisBackend {
    /// Reads the states of every key of the limits `names`, at most `max_keys` of them.
    pub(crate) async fn read_states(
        &self,
        names: &[&str],
        max_keys: usize,
    ) -> Result<States, ReadError> {
        let masters = match &self.inner.conn {
            Connection::Client(c) => vec![c.clone()],
            Connection::Pool(p) => vec![p.next().clone()],
            Connection::Cluster(r) => r.masters(),
        };
        let instant_us = if self.inner.caller_time {
            self.inner.local.now_us()
        } else {
            let any = masters.first().ok_or_else(|| {
                ReadError::Store(BackendError::Unavailable("no Redis master".into()))
            })?;
            server_time(any).await?
        };
        let mut found = States {
            instant_us,
            keys: Vec::new(),
            foreign: 0,
        };
        for name in names {
            let head = KeyBuf::head(&self.inner.prefix, name);
            let pattern = glob_escaped(&head);
            for client in &masters {
                scan_limit(client, name, &head, &pattern, max_keys, &mut found).await?;
            }
        }
        Ok(found)
    }
}

/// Whether the server refused a command for the key's type (`WRONGTYPE`): a value of
/// another type, not ours. Any other error is the store failing, and stops the read.
fn wrong_type(e: &fred::prelude::Error) -> bool {
    e.details().contains("WRONGTYPE")
}

/// The server's clock, in microseconds since the Unix epoch.
async fn server_time(client: &Client) -> Result<u64, ReadError> {
    let reply: Value = client
        .custom(fred::cmd!("TIME"), Vec::<String>::new())
        .await
        .map_err(failed)?;
    let parts = match reply {
        Value::Array(parts) => parts,
        other => {
            return Err(ReadError::Store(BackendError::Unavailable(format!(
                "unexpected TIME reply {other:?}"
            ))));
        }
    };
    let number = |i: usize| parts.get(i).and_then(number);
    match (number(0), number(1)) {
        (Some(s), Some(us)) => Ok(s.saturating_mul(1_000_000).saturating_add(us)),
        _ => Err(ReadError::Store(BackendError::Unavailable(
            "unexpected TIME reply".into(),
        ))),
    }
}

/// A whole number from a reply (an integer, or its digits).
fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => u64::try_from(*i).ok(),
        other => digits(other.as_bytes()?),
    }
}

/// The number `bytes` spell in decimal digits (no sign, no leading `+`).
fn digits(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || bytes.len() > 20 || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// `text` with the glob's special characters escaped, then `*`.
fn glob_escaped(text: &str) -> String {
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

/// Walks one master's keys of limit `name` (`head`: `<prefix>{<escaped name>:`).
async fn scan_limit(
    client: &Client,
    name: &str,
    head: &str,
    pattern: &str,
    max_keys: usize,
    found: &mut States,
) -> Result<(), ReadError> {
    let mut cursor = String::from("0");
    loop {
        let count = PAGE.to_string();
        let args = vec![cursor.as_str(), "MATCH", pattern, "COUNT", count.as_str()];
        let reply: Value = client
            .custom(fred::cmd!("SCAN"), args)
            .await
            .map_err(failed)?;
        let (next, keys) = scan_page(reply)?;
        let reads = keys.iter().filter_map(|key| {
            let (id, suffix) = parse_key(key.strip_prefix(head.as_bytes())?)?;
            Some(async move { (id, read_value(client, key, suffix).await) })
        });
        for (id, value) in join_all(reads).await {
            match value? {
                Some(Some(state)) => {
                    if found.keys.len() >= max_keys {
                        return Err(ReadError::TooMany(max_keys));
                    }
                    found.keys.push(StoredKey {
                        limit: name.to_owned(),
                        id,
                        state,
                    });
                }
                // Gone since the scan.
                None => {}
                Some(None) => found.foreign += 1,
            }
        }
        if next == "0" {
            return Ok(());
        }
        cursor = next;
    }
}

/// A `SCAN` reply: the next cursor and the page's keys.
fn scan_page(reply: Value) -> Result<(String, Vec<Vec<u8>>), ReadError> {
    let bad = || ReadError::Store(BackendError::Unavailable("unexpected SCAN reply".into()));
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

/// A key's rest after `<prefix>{<name>:`: its id (unescaped) and its suffix (`""`, `:t`,
/// `:c`, `:q`); `None` for a key that is not one of ours.
pub(super) fn parse_key(rest: &[u8]) -> Option<(String, &'static str)> {
    let close = rest.iter().position(|&b| b == b'}')?;
    let suffix = match &rest[close + 1..] {
        b"" => "",
        b":t" => TIERS_SUFFIX,
        b":c" => CONCURRENCY_SUFFIX,
        b":q" => CALENDAR_SUFFIX,
        b":f" => FAIR_SHARE_SUFFIX,
        b":a" => ADAPTIVE_SUFFIX,
        b":p" => ADAPTIVE_POOL_SUFFIX,
        _ => return None,
    };
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
    Some((String::from_utf8(id).ok()?, suffix))
}

/// A hash's state from its fields and values by turns.
type HashParser = fn(&[Value]) -> Option<kit::Stored>;

/// One key's state: `None` when it is gone, `Some(None)` when it is not a state of ours.
async fn read_value(
    client: &Client,
    key: &[u8],
    suffix: &str,
) -> Result<Option<Option<kit::Stored>>, ReadError> {
    let key = fred::prelude::Key::from(key);
    match suffix {
        FAIR_SHARE_SUFFIX => read_hash(client, key, FAIR_SHARE_MOST_FIELDS, fair_pool).await,
        ADAPTIVE_POOL_SUFFIX => {
            read_hash(client, key, ADAPTIVE_POOL_MOST_FIELDS, adaptive_pool).await
        }
        CONCURRENCY_SUFFIX => read_sorted_set(client, key, leases).await,
        ADAPTIVE_SUFFIX => read_sorted_set(client, key, adaptive).await,
        _ => read_string(client, key, suffix).await,
    }
}

/// A value read from a key, `Some(None)` (not ours) when it holds another type.
type Read = Result<Option<Option<kit::Stored>>, ReadError>;

/// A hash's state (a fair share's, an adaptive pool's), read whole only when it holds no more
/// than the script leaves (`most` fields: its ids are swept past twice the ids a limit counts,
/// a page a call): a bigger hash is not ours.
async fn read_hash(client: &Client, key: fred::prelude::Key, most: u64, parse: HashParser) -> Read {
    let fields: Value = match client.custom(fred::cmd!("HLEN"), vec![key.clone()]).await {
        Ok(n) => n,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e)),
    };
    if number(&fields).is_none_or(|n| n > most) {
        return Ok(Some(None));
    }
    let all: Value = match client.custom(fred::cmd!("HGETALL"), vec![key]).await {
        Ok(v) => v,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e)),
    };
    Ok(match all {
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) => Some(parse(&items)),
        Value::Map(map) if map.is_empty() => None,
        Value::Map(map) => {
            let items: Vec<Value> = map
                .iter()
                .flat_map(|(k, v)| [Value::from(k.clone()), v.clone()])
                .collect();
            Some(parse(&items))
        }
        _ => Some(None),
    })
}

/// A sorted set's state (a concurrency key's leases, an adaptive key's), read whole when it
/// holds at most `MAX_LEASES` members, parsed by `parse` from `ZRANGE ... WITHSCORES`.
async fn read_sorted_set(
    client: &Client,
    key: fred::prelude::Key,
    parse: fn(Value) -> Option<kit::Stored>,
) -> Read {
    let count: Value = match client.custom(fred::cmd!("ZCARD"), vec![key.clone()]).await {
        Ok(c) => c,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e)),
    };
    let Some(count) = number(&count) else {
        return Ok(Some(None));
    };
    if count == 0 {
        return Ok(None);
    }
    if count > MAX_LEASES {
        return Ok(Some(None));
    }
    let args: Vec<Value> = vec![
        Value::from(key),
        Value::from("0"),
        Value::from("-1"),
        Value::from("WITHSCORES"),
    ];
    let reply: Value = client
        .custom(fred::cmd!("ZRANGE"), args)
        .await
        .map_err(failed)?;
    Ok(Some(parse(reply)))
}

/// A string's state: a GCRA word (with its expiry, `PEXPIRETIME`), a tiered key's
/// MessagePack, a calendar count.
async fn read_string(client: &Client, key: fred::prelude::Key, suffix: &str) -> Read {
    let raw: Value = match client.custom(fred::cmd!("GET"), vec![key.clone()]).await {
        Ok(v) => v,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e)),
    };
    let Some(raw) = raw.as_bytes().map(<[u8]>::to_vec) else {
        return Ok(if raw.is_null() { None } else { Some(None) });
    };
    Ok(Some(match suffix {
        "" => {
            let expires: Value = client
                .custom(fred::cmd!("PEXPIRETIME"), vec![key])
                .await
                .map_err(failed)?;
            let expires = match expires {
                Value::Integer(ms) => ms,
                _ => -1,
            };
            tat(&raw, expires)
        }
        TIERS_SUFFIX => tiers(&raw),
        _ => calendar(&raw),
    }))
}

/// The most fields a fair share's hash holds (`fair_share.lua` sweeps ended ids once it holds
/// twice the ids a limit counts, one page a call; live ids above that are not ours).
const FAIR_SHARE_MOST_FIELDS: u64 = 4 * crate::algo::fair_share::MAX_MEMBERS as u64 + 64;

/// A fair share's hash (`fair_share.lua`), field and value by turns: the pool (the budget's TAT
/// and its writer's bound as a bit length, the counts by period, the waiters) and each id's
/// member; `None` for anything the script does not write.
pub(super) fn fair_pool(items: &[Value]) -> Option<kit::Stored> {
    use crate::algo::fair_share::{MAX_WAITERS, Member, Pool, Waiter};
    let mut pool = Pool::default();
    let mut bits = 0u64;
    let mut members = std::collections::HashMap::new();
    for pair in items.chunks(2) {
        let [field, value] = pair else { return None };
        let field = std::str::from_utf8(field.as_bytes()?).ok()?;
        let value = std::str::from_utf8(value.as_bytes()?).ok()?;
        let n = || value.parse::<u64>().ok().filter(|&v| v <= LIMIT);
        match field {
            "t" => pool.tat = n()?,
            "k" => bits = n()?,
            "e" => pool.epoch = n()?,
            "w0" => pool.weights.0 = n()?,
            "w1" => pool.weights.1 = n()?,
            "m0" => pool.mins.0 = n()?,
            "m1" => pool.mins.1 = n()?,
            "n0" => pool.ids.0 = n()?,
            "n1" => pool.ids.1 = n()?,
            "h0" => pool.held[0] = n()?,
            "h1" => pool.held[1] = n()?,
            "h2" => pool.held[2] = n()?,
            "p" => pool.pressed = n()?,
            "f" => pool.fresh = n()?,
            "x" | "c" => {}
            "q" => {
                for line in value.lines() {
                    let mut parts = line.split('\t');
                    let id = crate::key::Id::new(parts.next()?).ok()?;
                    let until_us = parts.next()?.parse().ok()?;
                    let cost = parts.next()?.parse().ok()?;
                    pool.waiting.push(Waiter { id, until_us, cost });
                }
            }
            _ => {
                let id = crate::key::Id::new(field.strip_prefix("m:")?).ok()?;
                let mut parts = value.split(' ').map(|p| p.parse::<u64>().ok());
                let mut next = || parts.next().flatten();
                let mut member = Member {
                    tat: next()?,
                    epoch: next()?,
                    weight: next()?,
                    min: next()?,
                    ..Member::default()
                };
                // The units admitted below its share by period, and the latest's period
                // (written since the rule for ids asking below their share).
                if let Some(b0) = next() {
                    member.below = [b0, next()?, next()?];
                    member.below_at = next()?;
                }
                // The period it was first counted in (written since new ids have a part).
                if let Some(since) = next() {
                    member.since = since;
                }
                members.insert(id, member);
            }
        }
    }
    if pool.waiting.len() > MAX_WAITERS || members.len() as u64 > FAIR_SHARE_MOST_FIELDS {
        return None;
    }
    let bound_us = if (1..=52).contains(&bits) {
        (1u64 << bits) - 1
    } else {
        0
    };
    pool.tat = kit::gcra_word_bound(pool.tat, bound_us).ok()?;
    Some(kit::Stored::FairShare(Box::new(kit::FairPool::new(
        pool, members,
    ))))
}

/// The most fields an adaptive pool's hash holds (`adaptive.lua` sweeps the states of keys
/// holding no slot past [`kit::MAX_POOL_KEYS`], a page a call).
const ADAPTIVE_POOL_MOST_FIELDS: u64 = 2 * kit::MAX_POOL_KEYS as u64 + 64;

/// An adaptive pool's hash (`adaptive.lua`), field and value by turns: every lease by its key,
/// the waiters, and each key's state; `None` for anything the script does not write.
pub(super) fn adaptive_pool(items: &[Value]) -> Option<kit::Stored> {
    use crate::algo::adaptive::AdaptiveState;
    use crate::key::Id;
    let mut keys: std::collections::HashMap<Id, AdaptiveState> = Default::default();
    let mut waiters = Vec::new();
    let mut leases = Vec::new();
    for pair in items.chunks(2) {
        let [field, value] = pair else { return None };
        let field = std::str::from_utf8(field.as_bytes()?).ok()?;
        let value = std::str::from_utf8(value.as_bytes()?).ok()?;
        match field {
            "x" | "c" => {}
            "L" => {
                for line in value.lines() {
                    let mut parts = line.split('\t');
                    let id = Id::new(parts.next()?).ok()?;
                    let lease = parts.next()?.parse().ok()?;
                    let deadline: u64 = parts.next()?.parse().ok()?;
                    leases.push((id, (lease, deadline)));
                }
            }
            "q" => {
                for line in value.lines() {
                    let (id, until) = line.split_once('\t')?;
                    waiters.push((Id::new(id).ok()?, until.parse().ok()?));
                }
            }
            _ => {
                let id = Id::new(field.strip_prefix("k:")?).ok()?;
                let v: Vec<u64> = value
                    .split(' ')
                    .map(|p| p.parse().ok().filter(|&v| v < LIMIT))
                    .collect::<Option<_>>()?;
                let [c, g, n, f, s, m, w, t] = v[..] else {
                    return None;
                };
                let state = keys.entry(id).or_default();
                state.controller.limit_milli = c;
                state.controller.long_us = g;
                state.window.completions = n;
                state.window.failures = f;
                state.window.latency_sum_us = s;
                state.window.max_in_flight = m;
                state.window_start_us = w;
                state.last_us = t;
            }
        }
    }
    for (id, lease) in leases {
        keys.entry(id).or_default().leases.push(lease);
    }
    if waiters.len() > kit::MAX_POOL_WAITERS || keys.len() > kit::MAX_POOL_KEYS * 2 {
        return None;
    }
    Some(kit::Stored::AdaptivePool(Box::new(kit::AdaptivePool::new(
        keys, waiters,
    ))))
}

/// A GCRA key: its TAT and its writer's bound, from when the key expires (`PXAT` of the TAT's
/// millisecond, rounded up, plus the bound's bit length `k`; a key written with caller time
/// expires relative to its write and records no bound: read as written by the limit in force).
pub(super) fn tat(raw: &[u8], expires_ms: i64) -> Option<kit::Stored> {
    let tat = digits(raw).filter(|&t| t < LIMIT)?;
    let k = expires_ms - i64::try_from(tat.div_ceil(1_000)).ok()?;
    let bound_us = if (1..=52).contains(&k) {
        (1u64 << k) - 1
    } else {
        0
    };
    kit::gcra_word_bound(tat, bound_us)
        .ok()
        .map(kit::Stored::Tat)
}

/// A calendar key: `"<end> <used>"` (units used above 2^52 read as 2^52, as the script reads
/// them).
pub(super) fn calendar(raw: &[u8]) -> Option<kit::Stored> {
    let space = raw.iter().position(|&b| b == b' ')?;
    let end_us = digits(&raw[..space]).filter(|&e| e < LIMIT)?;
    let used = &raw[space + 1..];
    let used = match digits(used) {
        Some(u) => u.min(LIMIT),
        // More digits than a u64 holds: a number past 2^52 all the same.
        None if !used.is_empty() && used.iter().all(u8::is_ascii_digit) => LIMIT,
        None => return None,
    };
    Some(kit::Stored::Calendar(CalendarState { end_us, used }))
}

/// A concurrency key's leases from `ZRANGE .. WITHSCORES` (flat pairs, or pairs in arrays).
fn leases(reply: Value) -> Option<kit::Stored> {
    let mut out = Vec::new();
    for (member, score) in scored(reply)? {
        out.push((digits(&member)?, whole(score)?));
    }
    Some(kit::Stored::Leases(out))
}

/// An adaptive key's sorted set (`adaptive.lua`): its leases (ids scored by deadlines), and
/// its state (`~f` scored `-(value + 1)`); a member of neither form is not ours.
fn adaptive(reply: Value) -> Option<kit::Stored> {
    use crate::algo::adaptive::AdaptiveState;
    let mut state = AdaptiveState::default();
    for (member, score) in scored(reply)? {
        if score > 0.0 {
            state.leases.push((digits(&member)?, whole(score)?));
            continue;
        }
        let v = whole(-score - 1.0)?;
        let field = match member.as_slice() {
            b"~c" => &mut state.controller.limit_milli,
            b"~g" => &mut state.controller.long_us,
            b"~n" => &mut state.window.completions,
            b"~f" => &mut state.window.failures,
            b"~s" => &mut state.window.latency_sum_us,
            b"~m" => &mut state.window.max_in_flight,
            b"~w" => &mut state.window_start_us,
            b"~t" => &mut state.last_us,
            _ => return None,
        };
        *field = v;
    }
    Some(kit::Stored::Adaptive(Box::new(state)))
}

/// A sorted set's members and scores, from `ZRANGE ... WITHSCORES` (flat, or in pairs).
fn scored(reply: Value) -> Option<Vec<(Vec<u8>, f64)>> {
    let Value::Array(items) = reply else {
        return None;
    };
    let mut flat = Vec::with_capacity(items.len());
    for item in items {
        match item {
            Value::Array(pair) => flat.extend(pair),
            other => flat.push(other),
        }
    }
    if flat.len() % 2 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(flat.len() / 2);
    for pair in flat.chunks(2) {
        let member = pair[0].as_bytes()?.to_vec();
        let score = match &pair[1] {
            Value::Double(d) => *d,
            Value::Integer(i) => *i as f64,
            other => std::str::from_utf8(other.as_bytes()?).ok()?.parse().ok()?,
        };
        out.push((member, score));
    }
    Some(out)
}

/// A score that is a whole number of microseconds.
fn whole(d: f64) -> Option<u64> {
    (d.is_finite() && d >= 0.0 && d.fract() == 0.0 && d < LIMIT as f64).then_some(d as u64)
}

/// A tiered key's MessagePack array of whole numbers.
pub(super) fn tiers(raw: &[u8]) -> Option<kit::Stored> {
    /// The array's numbers, one at a time, no more than its length.
    struct Numbers<'a> {
        input: &'a [u8],
        left: u32,
    }
    impl Numbers<'_> {
        /// The next number, at least `lo` and below 2^52.
        fn next(&mut self, lo: i64) -> Option<i64> {
            self.left = self.left.checked_sub(1)?;
            let v: i64 = rmp::decode::read_int(&mut self.input).ok()?;
            (v >= lo && v < LIMIT as i64).then_some(v)
        }
        /// The next number, at least `lo` (0 or more) and below 2^52.
        fn whole(&mut self, lo: i64) -> Option<u64> {
            self.next(lo).map(i64::unsigned_abs)
        }
    }
    let mut input = raw;
    let left = rmp::decode::read_array_len(&mut input).ok()?;
    let mut n = Numbers { input, left };
    if n.whole(1)? != 1 {
        return None;
    }
    let base = n.whole(0)?;
    let count = n.whole(0)?;
    if count > 64 {
        return None;
    }
    let mut logs = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let entry = match n.next(-1)? {
            -1 => None,
            e => Some(base.checked_add(e.unsigned_abs())?),
        };
        let grants = n.whole(0)?;
        if grants > u64::from(n.left) {
            return None;
        }
        let mut log = Vec::with_capacity(grants as usize);
        for _ in 0..grants {
            let t = base.checked_add(n.whole(0)?).filter(|&t| t < LIMIT)?;
            log.push((t, n.whole(1)?));
        }
        logs.push(TierLog::new(entry, log));
    }
    (n.left == 0 && n.input.is_empty()).then(|| kit::Stored::Tiers(TierState::from_tiers(logs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gives_its_id_unescaped_and_its_shape_by_suffix() {
        assert_eq!(parse_key(b"192.0.2.1}"), Some(("192.0.2.1".into(), "")));
        assert_eq!(
            parse_key(b"a%7Bb%7D%25c%20%C3%A9}:t"),
            Some(("a{b}%c é".into(), ":t"))
        );
        assert_eq!(
            parse_key(b"2001:db8::1}:c"),
            Some(("2001:db8::1".into(), ":c"))
        );
        assert_eq!(parse_key(b"42}:q"), Some(("42".into(), ":q")));
        for foreign in [&b"x}:zz"[..], b"x", b"%4}", b"%ZZ}", b"a b}", b"%FF}"] {
            assert_eq!(parse_key(foreign), None, "{foreign:?}");
        }
    }

    #[test]
    fn a_tat_reads_its_writers_bound_from_when_it_expires() {
        // Written with PXAT ceil(tat / 1000) + k (k = 23: a bound of 2^23 us).
        let tat = 1_764_064_800_123_456u64;
        let word = |expires: i64| match super::tat(tat.to_string().as_bytes(), expires) {
            Some(kit::Stored::Tat(w)) => kit::gcra_unword(w),
            other => panic!("{other:?}"),
        };
        let ms = i64::try_from(tat.div_ceil(1_000)).unwrap();
        assert_eq!(word(ms + 23), (tat, 1 << 23));
        // No bound recorded (caller time: an expiry relative to the write), none read.
        assert_eq!(word(-1), (tat, 0));
        assert_eq!(word(ms + 60), (tat, 0));
        for foreign in [&b"x"[..], b"-5", b"1.5", b"", b"4503599627370496"] {
            assert!(super::tat(foreign, -1).is_none(), "{foreign:?}");
        }
    }

    #[test]
    fn a_calendar_value_is_its_end_and_units() {
        assert_eq!(
            calendar(b"1764115200000000 7"),
            Some(kit::Stored::Calendar(CalendarState {
                end_us: 1_764_115_200_000_000,
                used: 7
            }))
        );
        // Units past 2^52 read as 2^52, as the script reads them.
        assert!(matches!(
            calendar(b"5 99999999999999999999"),
            Some(kit::Stored::Calendar(CalendarState { used: LIMIT, .. }))
        ));
        for foreign in [&b"5"[..], b"5 x", b" 5", b"5  6", b"-1 2"] {
            assert!(calendar(foreign).is_none(), "{foreign:?}");
        }
    }

    /// What the script's `cmsgpack.pack` writes for an array of whole numbers.
    fn pack(values: &[i64]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_array_len(&mut out, values.len() as u32).unwrap();
        for &v in values {
            rmp::encode::write_sint(&mut out, v).unwrap();
        }
        out
    }

    #[test]
    fn a_tier_state_is_read_from_its_array() {
        let base = 1_764_064_800_000_000i64;
        // Two tiers: the first entered at base + 5 with grants (base, 2) and (base + 9, 1),
        // the second never entered, no grants.
        let raw = pack(&[1, base, 2, 5, 2, 0, 2, 9, 1, -1, 0]);
        let Some(kit::Stored::Tiers(state)) = tiers(&raw) else {
            panic!("not read");
        };
        let base = base as u64;
        assert_eq!(state.tiers()[0].entry(), Some(base + 5));
        assert_eq!(state.tiers()[0].grants(), &[(base, 2), (base + 9, 1)]);
        assert_eq!(state.tiers()[1].entry(), None);
        assert!(state.tiers()[1].grants().is_empty());
        for foreign in [
            pack(&[2, base as i64, 0]),
            pack(&[1, base as i64, 1, -1, 1, 0]),
            pack(&[1, base as i64, 1, -2, 0]),
            pack(&[1, base as i64, 65]),
            pack(&[1, base as i64, 0, 7]),
            pack(&[1, base as i64, 1, 0, 1, 0, 0]),
            b"12".to_vec(),
        ] {
            assert!(tiers(&foreign).is_none(), "{foreign:?}");
        }
    }
}
