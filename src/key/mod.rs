//! Ids, id kinds and bucket keys.
//!
//! A bucket is named by a [`BucketKey`]: a limit's name plus an [`Id`]
//! (`RequestsPerIPAddress:10.0.0.1`). Ids have one canonical form each, so an id taken from a request and the same
//! id written in an overrides file always name the same bucket: IP addresses and numbers are
//! stored as values (no allocation, no string hashing on the request path), other ids as text.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher as _;
use std::net::IpAddr;
use std::sync::{Mutex, OnceLock, PoisonError};

#[cfg(feature = "acme")]
use sha2::{Digest, Sha256};

/// The longest id accepted, in bytes.
mod id;
mod kind;
mod text;

pub use id::Id;
use id::*;
use kind::*;
pub use kind::{IdError, IdKind};
pub(crate) use text::KeyText;

pub const MAX_ID_LEN: usize = 256;

/// A limit's name: the identity of its buckets, in memory and in Redis.
///
/// Buckets are keyed by the name itself, never by where the name stands in a configuration
/// file: reordering, extending or reloading the file keeps every bucket's state where it was.
/// Names are interned once per process (the set of names is the configuration's, so it is
/// small and bounded), which makes a `LimitName` a copyable pointer: comparing two names or
/// hashing one costs no string work on the request path.
///
/// Names come from a [`Limits`](crate::Limits) (`limits.name("Api")`) or a
/// [`Limiter`](crate::Limiter) (`limiter.name("Api")`).
#[derive(Clone, Copy)]
pub struct LimitName(&'static NameData);

struct NameData {
    text: Box<str>,
    /// A hash of the text, computed once (used for in-process hashing only, never stored).
    hash: u64,
    /// The high bits of this name's one-word bucket keys ([`BucketKey::packed`]): the count
    /// of names interned before it, shifted; `None` from the 2^14th name on. In-process only
    /// (it depends on the order names were first seen), so never stored.
    packed_base: Option<u64>,
    /// The count of names interned before it: a dense index for the first
    /// [`DENSE_NAMES`] names' per-configuration tables. In-process only. (`packed_base` is
    /// derived from it and kept: deriving it per key cost a decision 2 instructions.)
    number: usize,
}

/// Names numbered below this are found in a configuration by their number (a table of that
/// many entries at most), the others by a hash of the name.
pub(crate) const DENSE_NAMES: usize = 1 << 14;

/// The slot of name number `n` in a table by number, grown to hold it; `None` from
/// [`DENSE_NAMES`] on.
pub(crate) fn dense_slot(table: &mut Vec<u32>, n: usize) -> Option<&mut u32> {
    if n >= DENSE_NAMES {
        return None;
    }
    if table.len() <= n {
        table.resize(n + 1, 0);
    }
    table.get_mut(n)
}

/// The bits of a one-word bucket key's value; two more name the id's kind, the rest the limit.
const PACKED_VALUE_BITS: u32 = 48;

type Interned = HashMap<&'static str, &'static NameData>;

fn interned() -> &'static Mutex<Interned> {
    static NAMES: OnceLock<Mutex<Interned>> = OnceLock::new();
    NAMES.get_or_init(Mutex::default)
}

impl LimitName {
    /// The name for `text`, interned on first use. Only configuration (a checked name) calls
    /// this, so the interned set stays as small as the set of configured names.
    pub(crate) fn intern(text: &str) -> Self {
        let mut names = interned().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(data) = names.get(text) {
            return Self(data);
        }
        let hash = foldhash::fast::FixedState::with_seed(0x7472_6c5f_6e61_6d65).hash_one(text);
        let data: &'static NameData = Box::leak(Box::new(NameData {
            text: text.into(),
            hash,
            packed_base: u64::try_from(names.len())
                .ok()
                .filter(|&n| n < 1 << 14)
                .map(|n| n << (PACKED_VALUE_BITS + 2)),
            number: names.len(),
        }));
        names.insert(&data.text, data);
        Self(data)
    }

    /// The count of names interned before this one (in-process only: never stored).
    #[inline]
    pub(crate) fn number(self) -> usize {
        self.0.number
    }

    /// The name's text.
    pub fn as_str(&self) -> &'static str {
        &self.0.text
    }

    fn hash64(self) -> u64 {
        self.0.hash
    }
}

impl PartialEq for LimitName {
    fn eq(&self, other: &Self) -> bool {
        // Interned: one allocation per text.
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for LimitName {}

impl PartialEq<str> for LimitName {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for LimitName {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::hash::Hash for LimitName {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

/// A name hashes as its precomputed hash, one `write_u64`: a map keyed by names needs no
/// hasher of its own.
impl nohash_hasher::IsEnabled for LimitName {}

impl PartialOrd for LimitName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LimitName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl AsRef<str> for LimitName {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for LimitName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for LimitName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LimitName({:?})", self.as_str())
    }
}

/// The bucket of one limit for one id: `<limit name>:<id>`.
#[derive(Clone, PartialEq, Eq)]
pub struct BucketKey {
    name: LimitName,
    id: Id,
}

impl BucketKey {
    /// The key of `name`'s bucket for `id`.
    pub fn new(name: LimitName, id: Id) -> Self {
        Self { name, id }
    }

    /// The key of a state `name` keeps for all its ids (a fair share's pool,
    /// [`kit::state_key`](crate::kit::state_key)): an empty id, which no request can name.
    pub fn limit_wide(name: LimitName) -> Self {
        Self {
            name,
            id: Id::limit_wide(),
        }
    }

    /// The limit's name.
    pub fn name(&self) -> LimitName {
        self.name
    }

    /// The id.
    pub fn id(&self) -> &Id {
        &self.id
    }

    /// The key in one word, for the ids that fit one (an IPv4 address, an IPv6 /48 range, a
    /// number below 2^48) of the first 2^14 names: the name's process number (14 bits), the
    /// id's kind (2 bits) and its value (48 bits). Two keys pack to the same word exactly when
    /// they are equal. In-process only (the name's number depends on the order names were
    /// interned): for the in-memory tables, never for anything stored.
    #[inline]
    pub(crate) fn packed(&self) -> Option<u64> {
        const KIND: u32 = PACKED_VALUE_BITS;
        let value = match &self.id.0 {
            Repr::Ip(IpAddr::V4(v4)) => u64::from(u32::from(*v4)),
            // The range's 48 network bits (the rest are zero).
            Repr::Ipv6Range48(net) => 1 << KIND | (u128::from(*net) >> 80) as u64,
            Repr::Number(n) if *n < 1 << PACKED_VALUE_BITS => 2 << KIND | *n,
            _ => return None,
        };
        Some(self.name.0.packed_base? | value)
    }
}

/// One hasher write per key for addresses and numbers (the request path's ids): the name's
/// precomputed hash, the id's kind and its value packed into one `u128`. Equal keys hash
/// equally, as `Eq` compares the same parts.
impl std::hash::Hash for BucketKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let name = self.name.hash64();
        let high = |kind: u64| u128::from(name ^ kind) << 64;
        match &self.id.0 {
            Repr::Number(n) => state.write_u128(high(1) | u128::from(*n)),
            Repr::Ip(IpAddr::V4(v4)) => state.write_u128(high(2) | u128::from(v4.to_bits())),
            Repr::Ip(IpAddr::V6(v6)) => {
                state.write_u128(v6.to_bits());
                state.write_u64(name ^ 3);
            }
            Repr::Ipv6Range48(v6) => {
                state.write_u128(v6.to_bits());
                state.write_u64(name ^ 4);
            }
            Repr::Text(t) => {
                state.write_u64(name ^ 5);
                state.write(t.as_bytes());
            }
        }
    }
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.id)
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BucketKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;
    use std::str::FromStr;
    use std::sync::Arc;

    /// Two keys pack into the same word exactly when they are equal: ids whose values share
    /// their low bits but differ in kind, and names, stay apart; ids that do not fit one word
    /// (a full IPv6 address, a number from 2^48, text) do not pack.
    #[test]
    fn one_word_keys_are_equal_only_for_equal_keys() {
        let (a, b) = (LimitName::intern("PackA"), LimitName::intern("PackB"));
        let v6 = |s: &str| Id::ipv6_range48(s.parse().unwrap());
        let fits = [
            Id::from(IpAddr::from([1, 2, 3, 4])),
            Id::from(0x0102_0304u64),
            v6("0:102:304::"),
            Id::from(0u64),
            Id::from(IpAddr::from([0, 0, 0, 0])),
            v6("::"),
            Id::from((1u64 << 48) - 1),
            v6("ffff:ffff:ffff::"),
        ];
        let mut words = std::collections::HashMap::new();
        for name in [a, b] {
            for id in &fits {
                let key = BucketKey::new(name, id.clone());
                let word = key.packed().unwrap_or_else(|| panic!("{id} packs"));
                assert_eq!(words.insert(word, key.clone()), None, "{id} collides");
            }
        }
        for id in [
            Id::from(1u64 << 48),
            Id::from(u64::MAX),
            Id::from(IpAddr::from("2001:db8::1".parse::<Ipv6Addr>().unwrap())),
            Id::new("user-1").unwrap(),
        ] {
            assert_eq!(BucketKey::new(a, id.clone()).packed(), None, "{id}");
        }
    }

    #[test]
    fn canonical_ids_by_kind() {
        let ok = [
            (IdKind::Ip, "10.0.0.1", "10.0.0.1"),
            (
                IdKind::Ip,
                "2001:db8::ff00:42:8329",
                "2001:db8::ff00:42:8329",
            ),
            (IdKind::Ip, "::ffff:10.0.0.1", "10.0.0.1"),
            (
                IdKind::Ipv6Range,
                "2001:db8:1234::/48",
                "2001:db8:1234::/48",
            ),
            (IdKind::Ipv6Range, "192.0.2.1", "192.0.2.1"),
            (IdKind::Account, "12345678", "12345678"),
            (IdKind::Account, "0", "0"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "example.com", "example.com"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "example.co.uk", "example.co.uk"),
            #[cfg(feature = "acme")]
            (
                IdKind::AccountDomain,
                "12345678:example.com",
                "12345678:example.com",
            ),
            (IdKind::Any, "anything goes", "anything goes"),
        ];
        for (kind, text, shown) in ok {
            let id = kind
                .parse(text)
                .unwrap_or_else(|e| panic!("{kind} {text}: {e}"));
            assert_eq!(id.to_string(), shown, "{kind} {text}");
        }
    }

    /// The digits-only shortcut of `Id::new` gives the id that parsing the text as an address,
    /// then as a number, and comparing with the canonical form gives.
    #[test]
    fn digit_ids_are_numbers_only_in_canonical_form() {
        fn reference(text: &str) -> Id {
            if let Ok(ip) = IpAddr::from_str(text)
                && ip.to_string() == text
            {
                return Id::from(ip);
            }
            match u64::from_str(text) {
                Ok(n) if n.to_string() == text => Id(Repr::Number(n)),
                _ => Id(Repr::Text(Arc::from(text))),
            }
        }
        let cases = [
            "0",
            "7",
            "00",
            "007",
            "10",
            "12345678",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999",
        ];
        for text in cases {
            assert_eq!(Id::new(text).unwrap(), reference(text), "{text}");
        }
        assert_eq!(Id::new("42").unwrap(), Id::from(42u64));
        assert!(Id::new("007").unwrap().as_number().is_none());
        // tests/extract.rs holds the same rule for any digits, through the public API.
    }

    #[test]
    fn refuses_non_canonical_and_malformed_ids() {
        let bad = [
            (IdKind::Ip, "2001:0db8:0000:0000:0000:ff00:0042:8329"),
            (IdKind::Ip, "010.0.0.1"),
            (IdKind::Ip, "10.0.0"),
            (IdKind::Ip, "10.0.0.1 "),
            (IdKind::Ip, "fe80::1%eth0"),
            (IdKind::Ipv6Range, "2001:db8:1234::/64"),
            (IdKind::Ipv6Range, "2001:db8:1234::1/48"),
            (IdKind::Ipv6Range, "2001:0db8:0000::/48"),
            (IdKind::Ipv6Range, "2001:db8::1"),
            (IdKind::Ipv6Range, "::ffff:10.0.0.0/48"),
            (IdKind::Account, "-1"),
            (IdKind::Account, "+1"),
            (IdKind::Account, "007"),
            (IdKind::Account, "18446744073709551616"),
            (IdKind::Account, "12a"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "Example.com"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "www.example.com"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "com"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "exa_mple.com"),
            #[cfg(feature = "acme")]
            (IdKind::Domain, "-example.com"),
            #[cfg(feature = "acme")]
            (IdKind::FqdnSet, "example.com,,example.org"),
            #[cfg(feature = "acme")]
            (IdKind::FqdnSet, "example.com,not a domain"),
            #[cfg(feature = "acme")]
            (IdKind::AccountDomain, "example.com"),
            #[cfg(feature = "acme")]
            (IdKind::AccountDomain, "x:example.com"),
            #[cfg(feature = "acme")]
            (IdKind::AccountFqdnSet, "12:"),
            (IdKind::Any, ""),
            (IdKind::Any, "a\nb"),
            (IdKind::Any, "\u{7f}"),
        ];
        for (kind, text) in bad {
            assert!(kind.parse(text).is_err(), "{kind} accepted {text:?}");
        }
        assert_eq!(
            IdKind::Any.parse(&"a".repeat(257)),
            Err(IdError::TooLong(257))
        );
        assert!(IdKind::Any.parse(&"a".repeat(256)).is_ok());
        // Multi-byte characters are fine in `any`, and errors truncate on a char boundary.
        assert!(IdKind::Any.parse("é🦀").is_ok());
        let e = IdKind::Ip.parse(&"é".repeat(100)).unwrap_err();
        assert!(e.to_string().len() < 200);
    }

    #[test]
    fn names_are_interned_by_text() {
        let a = LimitName::intern("SameName");
        let b = LimitName::intern(&String::from("SameName"));
        assert_eq!(a, b);
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        assert_ne!(a, LimitName::intern("OtherName"));
        assert_eq!(a, "SameName");
        let key = |n| BucketKey::new(n, Id::from(7u64));
        assert_eq!(key(a), key(b));
        assert_ne!(key(a), key(LimitName::intern("OtherName")));
    }

    #[test]
    #[cfg(feature = "acme")]
    fn fqdn_sets_are_normalized_then_hashed() {
        assert!(IdKind::Domain.parse("www.example.com").is_err()); // not eTLD+1
        let a = IdKind::FqdnSet
            .parse("b.example.com,A.example.com,a.example.com")
            .unwrap();
        let b = IdKind::FqdnSet
            .parse("a.example.com,b.example.com")
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(a.to_string().len(), 64);
        let c = IdKind::AccountFqdnSet
            .parse("7:a.example.com,b.example.com")
            .unwrap();
        assert_eq!(c.to_string(), format!("7:{b}"));
    }

    #[test]
    fn text_ids_equal_value_ids() {
        let v6: Ipv6Addr = "2001:db8:1234:5678::1".parse().unwrap();
        assert_eq!(
            Id::ipv6_range48(v6),
            IdKind::Ipv6Range.parse("2001:db8:1234::/48").unwrap()
        );
        assert_eq!(Id::new("42").unwrap(), Id::from(42u64));
        assert_ne!(Id::new("042").unwrap(), Id::from(42u64));
        assert_eq!(Id::new("042").unwrap().as_text(), Some("042"));
        let k = BucketKey::new(LimitName::intern("PerAccount"), Id::from(12345678u64));
        assert_eq!(k.to_string(), "PerAccount:12345678");
    }

    #[test]
    fn the_unknown_kind_message_names_every_kind_in_order() {
        let e = "ipv7".parse::<IdKind>().unwrap_err().to_string();
        let names: Vec<&str> = IdKind::ALL.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            e,
            format!(
                "unknown id kind \"ipv7\"; expected one of {}",
                names.join(", ")
            )
        );
        #[cfg(feature = "acme")]
        assert_eq!(
            e,
            "unknown id kind \"ipv7\"; expected one of ip, ipv6_range, account, domain, \
             fqdn_set, account_domain, account_fqdn_set, any"
        );
        #[cfg(not(feature = "acme"))]
        assert_eq!(
            e,
            "unknown id kind \"ipv7\"; expected one of ip, ipv6_range, account, any"
        );
    }

    /// A kind this build leaves out says which feature brings it, not that it does not exist.
    #[test]
    fn the_domain_kinds_name_their_feature() {
        for name in IdKind::ACME {
            let parsed = name.parse::<IdKind>();
            #[cfg(feature = "acme")]
            assert_eq!(parsed.map(IdKind::as_str), Ok(name));
            #[cfg(not(feature = "acme"))]
            assert_eq!(
                parsed.unwrap_err().to_string(),
                format!("id kind {name:?} needs the `acme` feature of tower-ratelimits")
            );
        }
    }
}
