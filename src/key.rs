//! Ids, id kinds and bucket keys.
//!
//! A bucket is named by a [`BucketKey`]: a limit's name plus an [`Id`]
//! (`RequestsPerIPAddress:10.0.0.1`). Ids have one canonical form each, so an id taken from a request and the same
//! id written in an overrides file always name the same bucket: IP addresses and numbers are
//! stored as values (no allocation, no string hashing on the request path), other ids as text.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher as _;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

#[cfg(feature = "acme")]
use sha2::{Digest, Sha256};

/// The longest id accepted, in bytes.
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
        }));
        names.insert(&data.text, data);
        Self(data)
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

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    Ip(IpAddr),
    Ipv6Range48(Ipv6Addr),
    Number(u64),
    Text(Arc<str>),
}

/// The subject a limit counts: an IP address, a /48 range, an account number or a text id.
///
/// Build ids from values (`Id::from(ip)`, `Id::from(42u64)`, [`Id::ipv6_range48`]) or from text
/// with [`Id::new`] (any text) or [`IdKind::parse`] (text checked against a kind). Text that is
/// the canonical form of an IP address or an unsigned number becomes that value, so `"10.0.0.1"`
/// and `IpAddr::from([10, 0, 0, 1])` are the same id. IPv4-mapped IPv6 addresses
/// (`::ffff:10.0.0.1`) are folded to IPv4.
///
/// ```
/// use tower_ratelimits::Id;
/// use std::net::IpAddr;
///
/// let ip: IpAddr = "10.0.0.1".parse().unwrap();
/// assert_eq!(Id::new("10.0.0.1").unwrap(), Id::from(ip));
/// assert_eq!(Id::new("::ffff:10.0.0.1").unwrap(), Id::from(ip));
/// assert_eq!(Id::from(42u64).to_string(), "42");
/// assert!(Id::new("").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Id(Repr);

impl Id {
    /// An id from text: non-empty, at most 256 bytes, no control characters.
    pub fn new(text: &str) -> Result<Self, IdError> {
        check_text(text)?;
        Ok(Self::from_checked_text(text))
    }

    fn from_checked_text(text: &str) -> Self {
        let bytes = text.as_bytes();
        if bytes.iter().all(u8::is_ascii_digit) {
            // Digits alone are never an address, and a number in canonical form has no leading
            // zero (`"0"` aside): checked without parsing an address or formatting the number.
            if (bytes.len() == 1 || bytes[0] != b'0')
                && let Ok(n) = u64::from_str(text)
            {
                return Self(Repr::Number(n));
            }
            return Self(Repr::Text(Arc::from(text)));
        }
        if let Ok(ip) = IpAddr::from_str(text)
            && ip.to_string() == text
        {
            return Self::from(ip);
        }
        if let Ok(n) = u64::from_str(text)
            && n.to_string() == text
        {
            return Self(Repr::Number(n));
        }
        Self(Repr::Text(Arc::from(text)))
    }

    /// The /48 range holding `addr` (the address masked to its first 48 bits). An IPv4-mapped
    /// address gives the IPv4 address itself, as range rules key IPv4 clients by address.
    pub fn ipv6_range48(addr: Ipv6Addr) -> Self {
        if let Some(v4) = addr.to_ipv4_mapped() {
            return Self(Repr::Ip(IpAddr::V4(v4)));
        }
        let masked = u128::from(addr) & !((1u128 << 80) - 1);
        Self(Repr::Ipv6Range48(Ipv6Addr::from(masked)))
    }

    /// The IP address, when this id is one.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.0 {
            Repr::Ip(ip) => Some(ip),
            _ => None,
        }
    }

    /// The number, when this id is one.
    pub fn as_number(&self) -> Option<u64> {
        match self.0 {
            Repr::Number(n) => Some(n),
            _ => None,
        }
    }

    /// The text, when this id is neither an address, a range nor a number.
    pub fn as_text(&self) -> Option<&str> {
        match &self.0 {
            Repr::Text(t) => Some(t),
            _ => None,
        }
    }

    /// The `Display` text of an IPv4 address or a number, written with integer digits and no
    /// formatter (an address's `Display` makes four formatter calls): what a Redis key and a
    /// 429's body write for the commonest ids. `None` for other ids.
    pub(crate) fn digits(&self) -> Option<Digits> {
        let mut out = Digits {
            buf: [0; 20],
            len: 0,
        };
        match self.0 {
            Repr::Ip(IpAddr::V4(ip)) => {
                for (n, octet) in ip.octets().into_iter().enumerate() {
                    if n > 0 {
                        out.push(b".");
                    }
                    out.push(itoa::Buffer::new().format(octet).as_bytes());
                }
            }
            Repr::Number(n) => out.push(itoa::Buffer::new().format(n).as_bytes()),
            _ => return None,
        }
        Some(out)
    }
}

/// An id's text of at most 20 bytes ([`Id::digits`]): a dotted IPv4 address or a number's
/// decimal digits.
pub(crate) struct Digits {
    buf: [u8; 20],
    len: usize,
}

impl Digits {
    fn push(&mut self, bytes: &[u8]) {
        let end = (self.len + bytes.len()).min(self.buf.len());
        if let Some(to) = self.buf.get_mut(self.len..end) {
            to.copy_from_slice(&bytes[..end - self.len]);
        }
        self.len = end;
    }

    /// The text's bytes (ASCII digits and dots).
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl From<IpAddr> for Id {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self(Repr::Ip(IpAddr::V4(v4))),
                None => Self(Repr::Ip(ip)),
            },
            IpAddr::V4(_) => Self(Repr::Ip(ip)),
        }
    }
}

impl From<u64> for Id {
    fn from(n: u64) -> Self {
        Self(Repr::Number(n))
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Ip(ip) => ip.fmt(f),
            Repr::Ipv6Range48(net) => write!(f, "{net}/48"),
            Repr::Number(n) => n.fmt(f),
            Repr::Text(t) => f.write_str(t),
        }
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({self})")
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

/// What kind of id a limit name is keyed by. Override ids are checked against it when limits
/// are loaded, and ids taken from requests (e.g. a header) when they are extracted.
///
/// Adding a kind, every place it MUST be added (as Boulder's `names.go` keeps it):
/// - a variant here, documented with its canonical form;
/// - [`IdKind::ALL`], with its configuration name (`as_str`, `FromStr` and the unknown-kind
///   message derive from it);
/// - a kind behind a feature: `#[cfg]` on its variant and its `ALL` entry, and its name in
///   `IdKind::ACME` (or a list like it), so a build without the feature names the feature;
/// - [`IdKind::parse`] (the canonical form, refused otherwise) and `IdKind::conform` (an id
///   from a request, folded to that form);
/// - `simulator/src/lib.rs`: an id the kind accepts, for `--generate`'s default keys;
/// - the kinds table of `docs/operating.md` ("Configuration") and of `docs/keys-and-http.md`;
/// - `tests/config.rs` (an override id of the kind is checked at load) and
///   `tests/support/identity.rs` (its ids keep their Redis slot and never collide).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum IdKind {
    /// An IPv4 or IPv6 address in canonical text form.
    Ip,
    /// An IPv6 /48 prefix in canonical masked form (`2001:db8:1234::/48`), or an IPv4 address.
    Ipv6Range,
    /// An unsigned 64-bit integer (numeric account ids, as Boulder's). Account ids that are
    /// UUIDs, slugs or other text take [`IdKind::Any`].
    Account,
    /// A registrable domain (eTLD+1), lower case.
    ///
    /// Feature `acme`.
    #[cfg(feature = "acme")]
    #[cfg_attr(docsrs, doc(cfg(feature = "acme")))]
    Domain,
    /// A comma-separated set of domain names, normalized and hashed (SHA-256, hex).
    ///
    /// Feature `acme`.
    #[cfg(feature = "acme")]
    #[cfg_attr(docsrs, doc(cfg(feature = "acme")))]
    FqdnSet,
    /// `<account>:<domain>`.
    ///
    /// Feature `acme`.
    #[cfg(feature = "acme")]
    #[cfg_attr(docsrs, doc(cfg(feature = "acme")))]
    AccountDomain,
    /// `<account>:<fqdn set>`, the set normalized and hashed.
    ///
    /// Feature `acme`.
    #[cfg(feature = "acme")]
    #[cfg_attr(docsrs, doc(cfg(feature = "acme")))]
    AccountFqdnSet,
    /// Any non-empty text up to 256 bytes without control characters.
    #[default]
    Any,
}

impl IdKind {
    /// All kinds this build knows, with their configuration names (the four domain kinds only
    /// with the feature `acme`).
    pub const ALL: &'static [(&'static str, IdKind)] = &[
        ("ip", IdKind::Ip),
        ("ipv6_range", IdKind::Ipv6Range),
        ("account", IdKind::Account),
        #[cfg(feature = "acme")]
        ("domain", IdKind::Domain),
        #[cfg(feature = "acme")]
        ("fqdn_set", IdKind::FqdnSet),
        #[cfg(feature = "acme")]
        ("account_domain", IdKind::AccountDomain),
        #[cfg(feature = "acme")]
        ("account_fqdn_set", IdKind::AccountFqdnSet),
        ("any", IdKind::Any),
    ];

    /// The kinds that need the feature `acme` (named in the error a build without it gives).
    const ACME: [&'static str; 4] = ["domain", "fqdn_set", "account_domain", "account_fqdn_set"];

    /// Every kind's configuration name, comma-separated (for messages).
    fn names() -> String {
        Self::ALL
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The kind's name in configuration files.
    pub fn as_str(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("any", |(n, _)| n)
    }

    /// Parses an id of this kind from its text, requiring the canonical form (sets of domains
    /// are normalized instead).
    ///
    /// ```
    /// use tower_ratelimits::IdKind;
    /// assert!(IdKind::Ip.parse("10.0.0.1").is_ok());
    /// assert!(IdKind::Ip.parse("2001:0db8::1").is_err()); // not canonical: 2001:db8::1
    /// assert_eq!(IdKind::Ipv6Range.parse("2001:db8:1234::/48").unwrap().to_string(), "2001:db8:1234::/48");
    /// assert!(IdKind::Account.parse("0123").is_err());
    /// ```
    pub fn parse(self, text: &str) -> Result<Id, IdError> {
        check_text(text)?;
        match self {
            IdKind::Any => Ok(Id::from_checked_text(text)),
            IdKind::Ip => parse_ip(text).map(Id::from),
            IdKind::Ipv6Range => parse_range(text),
            IdKind::Account => parse_account(text).map(Id::from),
            #[cfg(feature = "acme")]
            IdKind::Domain => {
                parse_domain(text)?;
                Ok(Id(Repr::Text(Arc::from(text))))
            }
            #[cfg(feature = "acme")]
            IdKind::FqdnSet => Ok(Id(Repr::Text(Arc::from(hash_fqdn_set(text)?)))),
            #[cfg(feature = "acme")]
            IdKind::AccountDomain => {
                let (account, domain) = split_account(text)?;
                parse_domain(domain)?;
                Ok(Id(Repr::Text(Arc::from(format!("{account}:{domain}")))))
            }
            #[cfg(feature = "acme")]
            IdKind::AccountFqdnSet => {
                let (account, set) = split_account(text)?;
                let hash = hash_fqdn_set(set)?;
                Ok(Id(Repr::Text(Arc::from(format!("{account}:{hash}")))))
            }
        }
    }
}

impl IdKind {
    /// Checks an id built elsewhere (e.g. by a key extractor) against this kind, returning its
    /// canonical form for the kind: an IPv6 address becomes its /48 range for `ipv6_range`,
    /// sets of domains are normalized and hashed, other text is parsed as [`IdKind::parse`]
    /// would.
    #[inline]
    pub fn conform(self, id: Id) -> Result<Id, IdError> {
        let wrong = |kind, id: &Id| Err(invalid(kind, &id.to_string(), "wrong kind of id"));
        match (self, &id.0) {
            (IdKind::Any, _)
            | (IdKind::Ip, Repr::Ip(_))
            | (IdKind::Account, Repr::Number(_))
            | (IdKind::Ipv6Range, Repr::Ipv6Range48(_) | Repr::Ip(IpAddr::V4(_))) => Ok(id),
            (IdKind::Ipv6Range, Repr::Ip(IpAddr::V6(v6))) => Ok(Id::ipv6_range48(*v6)),
            (IdKind::Ip | IdKind::Account | IdKind::Ipv6Range, _) => wrong(self, &id),
            #[cfg(feature = "acme")]
            (_, Repr::Text(t)) => self.parse(t),
            #[cfg(feature = "acme")]
            (_, _) => wrong(self, &id),
        }
    }
}

impl FromStr for IdKind {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, k)| *k)
            .ok_or_else(|| match Self::ACME.contains(&s) {
                true => IdError::NeedsFeature {
                    kind: s.to_owned(),
                    feature: "acme",
                },
                false => IdError::UnknownKind(s.to_owned()),
            })
    }
}

impl fmt::Display for IdKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The id was empty.
    #[error("the id is empty")]
    Empty,
    /// The id is longer than 256 bytes.
    #[error("the id is {0} bytes long; at most 256 are allowed")]
    TooLong(usize),
    /// The id contains a control character.
    #[error("the id contains a control character")]
    ControlCharacter,
    /// The id is valid but not written in canonical form.
    #[error("{given:?} is not in canonical form; write {canonical:?}")]
    NotCanonical {
        /// What was given.
        given: String,
        /// How to write it.
        canonical: String,
    },
    /// The id is not of the expected kind.
    #[error("{given:?} is not a valid {kind} id: {reason}")]
    Invalid {
        /// The kind expected.
        kind: IdKind,
        /// What was given (truncated to 64 bytes).
        given: String,
        /// Why it does not fit.
        reason: &'static str,
    },
    /// An id kind name that does not exist.
    #[error("unknown id kind {0:?}; expected one of {names}", names = IdKind::names())]
    UnknownKind(String),
    /// An id kind this build leaves out: the crate's `feature` enables it.
    #[error("id kind {kind:?} needs the `{feature}` feature of tower-ratelimits")]
    NeedsFeature {
        /// The kind's name.
        kind: String,
        /// The feature that enables it.
        feature: &'static str,
    },
}

fn truncated(s: &str) -> String {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn invalid(kind: IdKind, given: &str, reason: &'static str) -> IdError {
    IdError::Invalid {
        kind,
        given: truncated(given),
        reason,
    }
}

fn check_text(text: &str) -> Result<(), IdError> {
    if text.is_empty() {
        return Err(IdError::Empty);
    }
    if text.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(text.len()));
    }
    if text.chars().any(char::is_control) {
        return Err(IdError::ControlCharacter);
    }
    Ok(())
}

fn parse_ip(text: &str) -> Result<IpAddr, IdError> {
    let ip = IpAddr::from_str(text).map_err(|_| invalid(IdKind::Ip, text, "not an IP address"))?;
    let canonical = ip.to_string();
    if canonical != text {
        return Err(IdError::NotCanonical {
            given: truncated(text),
            canonical,
        });
    }
    Ok(ip)
}

fn parse_range(text: &str) -> Result<Id, IdError> {
    let kind = IdKind::Ipv6Range;
    let Some((addr, prefix)) = text.split_once('/') else {
        // IPv4 clients are keyed by address in range limits.
        return match IpAddr::from_str(text) {
            Ok(IpAddr::V4(_)) => parse_ip(text).map(Id::from),
            _ => Err(invalid(
                kind,
                text,
                "expected an IPv6 /48 prefix like 2001:db8:1234::/48, or an IPv4 address",
            )),
        };
    };
    if prefix != "48" {
        return Err(invalid(kind, text, "the prefix length must be /48"));
    }
    let addr = Ipv6Addr::from_str(addr).map_err(|_| invalid(kind, text, "not an IPv6 address"))?;
    if addr.to_ipv4_mapped().is_some() {
        return Err(invalid(
            kind,
            text,
            "an IPv4-mapped address is not a /48 range",
        ));
    }
    let id = Id::ipv6_range48(addr);
    let canonical = id.to_string();
    if canonical != text {
        return Err(IdError::NotCanonical {
            given: truncated(text),
            canonical,
        });
    }
    Ok(id)
}

fn parse_account(text: &str) -> Result<u64, IdError> {
    let n = u64::from_str(text)
        .ok()
        .filter(|_| text.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            invalid(
                IdKind::Account,
                text,
                "not an unsigned 64-bit integer (for UUIDs or other text ids, use kind: any)",
            )
        })?;
    if n.to_string() != text {
        return Err(IdError::NotCanonical {
            given: truncated(text),
            canonical: n.to_string(),
        });
    }
    Ok(n)
}

#[cfg(feature = "acme")]
fn split_account(text: &str) -> Result<(u64, &str), IdError> {
    let (account, rest) = text
        .split_once(':')
        .ok_or_else(|| invalid(IdKind::AccountDomain, text, "expected <account>:<domain>"))?;
    Ok((parse_account(account)?, rest))
}

#[cfg(feature = "acme")]
/// A host name: labels of 1..=63 lower-case letters, digits and hyphens (not at either end),
/// at least two labels, at most 253 bytes.
fn check_hostname(name: &str) -> bool {
    name.len() <= 253
        && name.contains('.')
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[cfg(feature = "acme")]
fn parse_domain(text: &str) -> Result<(), IdError> {
    let kind = IdKind::Domain;
    if text.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(IdError::NotCanonical {
            given: truncated(text),
            canonical: text.to_ascii_lowercase(),
        });
    }
    if !check_hostname(text) {
        return Err(invalid(kind, text, "not a domain name"));
    }
    match psl::domain_str(text) {
        Some(registrable) if registrable == text => Ok(()),
        Some(registrable) => Err(IdError::NotCanonical {
            given: truncated(text),
            canonical: registrable.to_owned(),
        }),
        None => Err(invalid(kind, text, "not a registrable domain (eTLD+1)")),
    }
}

#[cfg(feature = "acme")]
/// Normalizes a comma-separated set of domain names (lower case, de-duplicated, sorted) and
/// returns the SHA-256 of the normalized set, in hex.
pub(crate) fn hash_fqdn_set(text: &str) -> Result<String, IdError> {
    let mut names: Vec<String> = text
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .collect();
    if let Some(bad) = names.iter().find(|n| !check_hostname(n)) {
        return Err(invalid(
            IdKind::FqdnSet,
            if bad.is_empty() { text } else { bad },
            "not a comma-separated list of domain names",
        ));
    }
    names.sort_unstable();
    names.dedup();
    let digest = Sha256::digest(names.join(",").as_bytes());
    let mut hex = String::with_capacity(64);
    for b in digest {
        use fmt::Write;
        let _ = write!(hex, "{b:02x}");
    }
    Ok(hex)
}

#[cfg(test)]
mod tests {
    use super::*;

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
