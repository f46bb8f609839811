//! Reading the stored states of some limits, read only, for a replay's warm start (feature
//! `replay`; `docs/replay.md`, "Starting warm"): every master is walked with `SCAN` for the
//! keys of each limit name, and each value is read as the kit keeps it ([`kit::Stored`]).
//! Nothing is written: `SCAN`, `GET`, `PEXPIRETIME`, `ZCARD`, `ZRANGE` and `TIME` only.
//!
//! The values' formats are the script's (each shape's own file: `gcra.lua`, `tiers.lua`,
//! `concurrency.lua`, `calendar.lua`, ...): a GCRA key holds its TAT and expires, on the server's clock, `k`
//! milliseconds after it (k: the bit length of its writer's bound); a tiered key a MessagePack
//! array `{1, base, n, per tier: entry - base (or -1), grants, per grant: time - base, units}`;
//! a concurrency key a sorted set of lease ids scored by deadline; a calendar key
//! `"<end> <used>"`. A value that is not one of ours is counted and left out, as the script
//! would replace it.

use fred::prelude::{Client, ClientLike, Value};
use futures_util::future::join_all;

use super::RedisBackend;
use super::keys::{self, HashParser, KeyBuf, Reading, SortedSetParser, StringParser};
use super::reply::number;
use super::scan::{failed, glob_escaped, parse_key, scan_page};
use crate::backend::kit::Kept;
use crate::backend::{BackendError, kit};

/// Keys asked for per `SCAN` call (a hint to the server), and read at once.
const PAGE: usize = 1_000;
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

impl RedisBackend {
    /// Reads the states of every key of the limits `names`, at most `max_keys` of them.
    pub(crate) async fn read_states(
        &self,
        names: &[&str],
        max_keys: usize,
    ) -> Result<States, ReadError> {
        let masters = self.masters();
        let instant_us = self.store_now(&masters).await?;
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
        let (next, keys) = scan_page(client, &cursor, pattern, PAGE).await?;
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

/// One key's state: `None` when it is gone, `Some(None)` when it is not a state of ours.
async fn read_value(
    client: &Client,
    key: &[u8],
    kept: Kept,
) -> Result<Option<Option<kit::Stored>>, ReadError> {
    let key = fred::prelude::Key::from(key);
    match keys::reading_of(kept) {
        Reading::Hash(most, parse) => read_hash(client, key, most, parse).await,
        Reading::SortedSet(parse) => read_sorted_set(client, key, parse).await,
        Reading::String(parse) => read_string(client, key, Some(parse)).await,
        Reading::Word => read_string(client, key, None).await,
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
        Err(e) => return Err(failed(e).into()),
    };
    if number(&fields).is_none_or(|n| n > most) {
        return Ok(Some(None));
    }
    let all: Value = match client.custom(fred::cmd!("HGETALL"), vec![key]).await {
        Ok(v) => v,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e).into()),
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
async fn read_sorted_set(client: &Client, key: fred::prelude::Key, parse: SortedSetParser) -> Read {
    let count: Value = match client.custom(fred::cmd!("ZCARD"), vec![key.clone()]).await {
        Ok(c) => c,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e).into()),
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

/// A string's state, read by `parse`, or (`None`) a GCRA word with its expiry
/// (`PEXPIRETIME`).
async fn read_string(
    client: &Client,
    key: fred::prelude::Key,
    parse: Option<StringParser>,
) -> Read {
    let raw: Value = match client.custom(fred::cmd!("GET"), vec![key.clone()]).await {
        Ok(v) => v,
        Err(e) if wrong_type(&e) => return Ok(Some(None)),
        Err(e) => return Err(failed(e).into()),
    };
    let Some(raw) = raw.as_bytes().map(<[u8]>::to_vec) else {
        return Ok(if raw.is_null() { None } else { Some(None) });
    };
    if let Some(parse) = parse {
        return Ok(Some(parse(&raw)));
    }
    let expires: Value = client
        .custom(fred::cmd!("PEXPIRETIME"), vec![key])
        .await
        .map_err(failed)?;
    let expires = match expires {
        Value::Integer(ms) => ms,
        _ => -1,
    };
    Ok(Some(super::script::read_tat(&raw, expires)))
}

#[cfg(test)]
mod tests {
    use super::*;
    // The decoders of the older shapes, in the script's records (`script/records.rs`).
    use crate::algo::calendar::CalendarState;
    use crate::backend::redis::reply::LIMIT;
    use crate::backend::redis::script::{read_calendar as calendar, read_tat, read_tiers as tiers};

    #[test]
    fn a_key_gives_its_id_unescaped_and_its_shape_by_suffix() {
        assert_eq!(
            parse_key(b"192.0.2.1}"),
            Some(("192.0.2.1".into(), Kept::Word))
        );
        assert_eq!(
            parse_key(b"a%7Bb%7D%25c%20%C3%A9}:t"),
            Some(("a{b}%c é".into(), Kept::Tiers))
        );
        assert_eq!(
            parse_key(b"2001:db8::1}:c"),
            Some(("2001:db8::1".into(), Kept::Leases))
        );
        assert_eq!(parse_key(b"42}:q"), Some(("42".into(), Kept::Calendar)));
        assert_eq!(parse_key(b"}:p"), Some(("".into(), Kept::AdaptivePool)));
        // A share bucket (`:r`) is a region's, not a state a snapshot carries.
        for foreign in [
            &b"x}:zz"[..],
            b"x",
            b"%4}",
            b"%ZZ}",
            b"a b}",
            b"%FF}",
            b"x}:r",
        ] {
            assert_eq!(parse_key(foreign), None, "{foreign:?}");
        }
        // Every state is found again by its suffix, each at a key of its own.
        for kept in Kept::ALL {
            assert_eq!(Kept::ALL[kept.index()], kept);
            let key = format!("x}}{}", keys::suffix_of(kept));
            assert_eq!(parse_key(key.as_bytes()), Some(("x".into(), kept)));
        }
    }

    #[test]
    fn a_tat_reads_its_writers_bound_from_when_it_expires() {
        // Written with PXAT ceil(tat / 1000) + k (k = 23: a bound of 2^23 us).
        let tat = 1_764_064_800_123_456u64;
        let word = |expires: i64| match read_tat(tat.to_string().as_bytes(), expires) {
            Some(kit::Stored::Tat(w)) => kit::gcra_unword(w),
            other => panic!("{other:?}"),
        };
        let ms = i64::try_from(tat.div_ceil(1_000)).unwrap();
        assert_eq!(word(ms + 23), (tat, 1 << 23));
        // No bound recorded (caller time: an expiry relative to the write), none read.
        assert_eq!(word(-1), (tat, 0));
        assert_eq!(word(ms + 60), (tat, 0));
        for foreign in [&b"x"[..], b"-5", b"1.5", b"", b"4503599627370496"] {
            assert!(read_tat(foreign, -1).is_none(), "{foreign:?}");
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
