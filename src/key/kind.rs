//! `IdKind` (with its MUST-update list), its parsers and `IdError`.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;
#[cfg(feature = "acme")]
use std::sync::Arc;

use super::*;

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
    pub(super) const ACME: [&'static str; 4] =
        ["domain", "fqdn_set", "account_domain", "account_fqdn_set"];

    /// Every kind's configuration name, comma-separated (for messages).
    pub(super) fn names() -> String {
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
    #[inline(always)]
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

pub(super) fn truncated(s: &str) -> String {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

pub(super) fn invalid(kind: IdKind, given: &str, reason: &'static str) -> IdError {
    IdError::Invalid {
        kind,
        given: truncated(given),
        reason,
    }
}

pub(super) fn check_text(text: &str) -> Result<(), IdError> {
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

pub(super) fn parse_ip(text: &str) -> Result<IpAddr, IdError> {
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

pub(super) fn parse_range(text: &str) -> Result<Id, IdError> {
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

pub(super) fn parse_account(text: &str) -> Result<u64, IdError> {
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
pub(super) fn split_account(text: &str) -> Result<(u64, &str), IdError> {
    let (account, rest) = text
        .split_once(':')
        .ok_or_else(|| invalid(IdKind::AccountDomain, text, "expected <account>:<domain>"))?;
    Ok((parse_account(account)?, rest))
}

#[cfg(feature = "acme")]
/// A host name: labels of 1..=63 lower-case letters, digits and hyphens (not at either end),
/// at least two labels, at most 253 bytes.
pub(super) fn check_hostname(name: &str) -> bool {
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
pub(super) fn parse_domain(text: &str) -> Result<(), IdError> {
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
