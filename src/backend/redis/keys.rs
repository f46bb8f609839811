//! Where a bucket lives: `<prefix>{<limit name>:<escaped id>}`, and `:t` after the hash tag
//! for a tiered state, `:c` for a concurrency key's leases, `:q` for a calendar quota's count,
//! `:r` for a region's share bucket, `:a` for an adaptive key; a fair share's state is the
//! limit's, `<prefix>{<limit name>:}:f`, and so is an adaptive pool's, `<prefix>{<limit name>:}:p`.

use crate::backend::kit::Kept;
#[cfg(feature = "replay")]
use crate::backend::kit::Stored;
use crate::key::BucketKey;

/// The suffix of a tiered key's Redis key (after the hash tag, so it stays in the same slot):
/// a name switched between GCRA and tiers never reads the other algorithm's state.
pub(super) const TIERS_SUFFIX: &str = ":t";

/// The suffix of a concurrency key's Redis key (a sorted set of leases scored by deadline),
/// after the hash tag: a name switched to or from a concurrency limit never reads the other
/// kind's state.
pub(super) const CONCURRENCY_SUFFIX: &str = ":c";

/// The suffix of a calendar key's Redis key (the period's end and the units used), after the
/// hash tag: a name switched to or from a calendar quota never reads another shape's state.
pub(super) const CALENDAR_SUFFIX: &str = ":q";

/// The suffix of a region's share bucket (a limit marked `across_regions` in regional mode,
/// `docs/regions.md`: the TAT with the limit it was written under, and the region's part of
/// the key with its lease), after the hash tag: an instance not in regional mode, deciding the
/// same name as a limit per region during a rolling deploy, never reads it, nor it theirs.
pub(super) const SHARE_SUFFIX: &str = ":r";

/// The suffix of a fair-share limit's state (`docs/fair-share.md`: one hash for all its ids,
/// at the limit's own key `<prefix>{<name>:}`, one slot per limit).
pub(super) const FAIR_SHARE_SUFFIX: &str = ":f";

/// An adaptive concurrency key's suffix: a sorted set of its leases and its state
/// (`adaptive.lua`). A reset keeps its leases and forgets what it learned.
pub(super) const ADAPTIVE_SUFFIX: &str = ":a";

/// The suffix of an adaptive limit's pool (its keys share a capacity: one hash for all of them
/// at the limit's own key, `adaptive.lua`): a limit given a capacity, or losing it, never reads
/// the other form's state.
pub(super) const ADAPTIVE_POOL_SUFFIX: &str = ":p";

/// The suffix of a key's penalty state (`docs/penalties.md`, "How a store keeps it"), after
/// the hash tag of the limit's bucket: in its slot.
pub(super) const PENALTY_SUFFIX: &str = ":pen";

/// The keys a reset deletes, by suffix: every shape's state (and a penalty's: a reset lifts a
/// key's ban and forgets its level) but a concurrency key's leases,
/// which are requests in flight (forgetting them would admit more at once than the limit; they
/// end when their requests do, or at their deadlines). A share bucket is forgotten with its
/// part: the region decides on its floor, full (the stated exception of `docs/regions.md`),
/// until its next grant.
pub(super) const FORGOTTEN_BY_RESET: &[&str] = &[
    "",
    TIERS_SUFFIX,
    CALENDAR_SUFFIX,
    SHARE_SUFFIX,
    FAIR_SHARE_SUFFIX,
    PENALTY_SUFFIX,
];

/// The suffix of the Redis key a transaction decides on: its quota's ([`suffix`]), or a share
/// bucket's.
pub(super) fn tx_suffix(tx: &crate::backend::BucketTx<'_>) -> &'static str {
    if tx.floor.is_some() {
        SHARE_SUFFIX
    } else {
        suffix(tx.quota)
    }
}

/// The suffix of the Redis key holding a quota's state.
pub(super) fn suffix(quota: &crate::quota::Quota) -> &'static str {
    suffix_of(Kept::of(quota))
}

/// The state a key of `suffix` keeps (`None`: a key of no state of ours).
pub(super) fn kept_at(suffix: &[u8]) -> Option<Kept> {
    Kept::ALL
        .into_iter()
        .find(|&kept| suffix_of(kept).as_bytes() == suffix)
}

/// A hash's state from its fields and values by turns.
#[cfg(feature = "replay")]
pub(super) type HashParser = fn(&[fred::prelude::Value]) -> Option<Stored>;

/// A string's state from its value.
#[cfg(feature = "replay")]
pub(super) type StringParser = fn(&[u8]) -> Option<Stored>;

/// A sorted set's state from `ZRANGE ... WITHSCORES`.
#[cfg(feature = "replay")]
pub(super) type SortedSetParser = fn(fred::prelude::Value) -> Option<Stored>;

/// How a state's key is read back ([`reading_of`]), with the decoder of what its script
/// writes there.
#[cfg(feature = "replay")]
pub(super) enum Reading {
    /// A GCRA word: the string and, for its writer's bound, when it expires (`PEXPIRETIME`).
    Word,
    /// A string's value.
    String(StringParser),
    /// A sorted set, `ZRANGE ... WITHSCORES`.
    SortedSet(SortedSetParser),
    /// A hash of at most so many fields, field and value by turns.
    Hash(u64, HashParser),
}

/// How a snapshot reads a state's key back: the one place the Redis floor tells the states
/// apart by their keys (with [`suffix_of`]); each decoder reads what the state's script writes.
#[cfg(feature = "replay")]
pub(super) fn reading_of(kept: Kept) -> Reading {
    use super::script as read;
    match kept {
        Kept::Word => Reading::Word,
        Kept::Tiers => Reading::String(read::read_tiers),
        Kept::Leases => Reading::SortedSet(read::read_leases),
        Kept::Calendar => Reading::String(read::read_calendar),
        Kept::FairShare => Reading::Hash(read::FAIR_SHARE_MOST_FIELDS, read::read_fair_pool),
        Kept::Adaptive => Reading::SortedSet(read::read_adaptive),
        Kept::AdaptivePool => {
            Reading::Hash(read::ADAPTIVE_POOL_MOST_FIELDS, read::read_adaptive_pool)
        }
        Kept::Penalty => Reading::String(read::read_penalty),
    }
}

/// The suffix of the Redis key holding a state.
pub(super) fn suffix_of(kept: Kept) -> &'static str {
    match kept {
        Kept::Word => "",
        Kept::Tiers => TIERS_SUFFIX,
        Kept::Leases => CONCURRENCY_SUFFIX,
        Kept::Calendar => CALENDAR_SUFFIX,
        Kept::FairShare => FAIR_SHARE_SUFFIX,
        Kept::Adaptive => ADAPTIVE_SUFFIX,
        Kept::AdaptivePool => ADAPTIVE_POOL_SUFFIX,
        Kept::Penalty => PENALTY_SUFFIX,
    }
}

/// A key being built ([`KeyText`], the key's text, in its prefix, hash tag and suffix).
pub(super) use crate::key::KeyText as KeyBuf;

impl KeyBuf {
    /// What every key of limit `name` starts with, under `prefix` (a replay's snapshot scans
    /// for it).
    pub(super) fn head(prefix: &str, name: &str) -> String {
        String::from_utf8_lossy(Self::opened(prefix, name).bytes()).into_owned()
    }

    /// The key, for fred.
    pub(super) fn key(&self) -> fred::prelude::Key {
        fred::prelude::Key::from(self.bytes())
    }
}

/// The Redis key of `key` under `prefix`, then `suffix` (see [`RedisBackend::redis_key`]).
pub(crate) fn redis_key(prefix: &str, key: &BucketKey, suffix: &str) -> String {
    // Only whole `str`s and escaped ASCII were written: the bytes are UTF-8.
    String::from_utf8_lossy(KeyBuf::new(prefix, key, suffix).bytes()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Id, Limit, Limits};

    #[test]
    fn keys_name_the_limit_and_escape_the_id() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(1, 1, 1_000_000).unwrap())
            .build()
            .unwrap();
        let key = BucketKey::new(limits.name("Api").unwrap(), Id::new("a{b}%c é").unwrap());
        assert_eq!(redis_key("rl:", &key, ""), "rl:{Api:a%7Bb%7D%25c%20%C3%A9}");
    }

    /// Stored keys never change: an id written from its digits (an IPv4 address, a number)
    /// or as plain text gives the key its `Display` text gives, escaped the same way.
    #[test]
    fn every_kind_of_id_gives_the_key_of_its_text() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(1, 1, 1_000_000).unwrap())
            .build()
            .unwrap();
        let name = limits.name("Api").unwrap();
        let ids = [
            Id::from(std::net::IpAddr::from([0, 0, 0, 0])),
            Id::from(std::net::IpAddr::from([10, 0, 255, 7])),
            Id::from(std::net::IpAddr::from([255, 255, 255, 255])),
            Id::from("2001:db8::1".parse::<std::net::IpAddr>().unwrap()),
            Id::ipv6_range48("2001:db8:1:2::9".parse().unwrap()),
            Id::from(0u64),
            Id::from(1_000_000u64),
            Id::from(u64::MAX),
            Id::new("user-42").unwrap(),
            Id::new("a{b}%c é").unwrap(),
        ];
        for id in ids {
            let mut expected = String::from("rl:{Api:");
            for b in id.to_string().bytes() {
                if KeyBuf::plain(b) {
                    expected.push(char::from(b));
                } else {
                    expected.push_str(&format!("%{b:02X}"));
                }
            }
            expected.push_str("}:t");
            let key = BucketKey::new(name, id);
            assert_eq!(redis_key("rl:", &key, ":t"), expected);
        }
    }
}
