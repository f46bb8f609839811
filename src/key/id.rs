//! `Id`: what a bucket is keyed by within a limit (an address, a /48 range, a number, text).

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;
use std::sync::Arc;

use super::*;

#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) enum Repr {
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
pub struct Id(pub(super) Repr);

impl Id {
    /// An id from text: non-empty, at most 256 bytes, no control characters.
    pub fn new(text: &str) -> Result<Self, IdError> {
        check_text(text)?;
        Ok(Self::from_checked_text(text))
    }

    /// The empty id: a limit's own state (`BucketKey::limit_wide`), never a request's
    /// ([`Id::new`] refuses empty text).
    pub(super) fn limit_wide() -> Self {
        static EMPTY: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(""));
        Self(Repr::Text(EMPTY.clone()))
    }

    pub(super) fn from_checked_text(text: &str) -> Self {
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
    pub(super) fn push(&mut self, bytes: &[u8]) {
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
