//! Key extractors: how a rule finds the id of a request.
//!
//! A [`KeyExtractor`] looks at the request's head and returns an [`Id`] (`Ok(Some(..))`), no id
//! (`Ok(None)`: the rule's [`OnMissingKey`](super::OnMissingKey) policy applies), or an error
//! (the request is rejected with the error's status). Closures of the same shape work too.
//!
//! Built in: [`ClientIp`] (the peer address, or the forwarded client address when the peer
//! is a trusted proxy), [`Ipv6Range48`] (the client's /48 range; IPv4 clients by address) and
//! [`Header`] (an id from a header, e.g. an account). Rules whose extractors read the same
//! client address (a `ClientIp` or an `Ipv6Range48` of equal settings) read it once per request
//! ([`Readers`]).

use std::any::Any;
use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};

use http::request::Parts;
use http::{HeaderName, HeaderValue, StatusCode};
use ipnet::IpNet;

use crate::key::Id;

/// Why an extractor could not produce a key. The request is answered with `status` and a JSON
/// body carrying `message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
#[non_exhaustive]
pub struct KeyError {
    /// The response status (400 for a malformed value, 500 for a server set-up problem).
    pub status: StatusCode,
    /// What went wrong, for the client.
    pub message: Cow<'static, str>,
}

impl KeyError {
    /// A 400 Bad Request.
    pub fn bad_request(message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// A 500 Internal Server Error: the server is not set up to find the key.
    pub fn internal(message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }
}

/// Finds the id a rule counts for a request.
///
/// ```
/// use http::request::Parts;
/// use tower_ratelimits::{Id, KeyError, KeyExtractor};
///
/// /// Keys requests by the `x-api-token` header.
/// struct ApiToken;
///
/// impl KeyExtractor for ApiToken {
///     fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError> {
///         let Some(value) = req.headers.get("x-api-token") else { return Ok(None) };
///         let text = value.to_str().map_err(|_| KeyError::bad_request("x-api-token is not text"))?;
///         Id::new(text).map(Some).map_err(|e| KeyError::bad_request(e.to_string()))
///     }
/// }
///
/// // A closure works as well; `key_fn` spares naming its argument's type.
/// let by_method = tower_ratelimits::key_fn(|req| Ok(Id::new(req.method.as_str()).ok()));
/// # fn takes(_: impl KeyExtractor) {}
/// # takes(ApiToken); takes(by_method);
/// ```
pub trait KeyExtractor: Any + Send + Sync + 'static {
    /// The id of this request, if it has one.
    fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError>;
}

impl<F> KeyExtractor for F
where
    F: Fn(&Parts) -> Result<Option<Id>, KeyError> + Send + Sync + 'static,
{
    fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError> {
        self(req)
    }
}

/// A [`KeyExtractor`] from a closure over the request head, whose argument's type is inferred
/// (`|req| ...` rather than `|req: &http::request::Parts| ...`). It returns the closure itself:
/// any such closure is an extractor.
///
/// ```
/// use tower_ratelimits::{Id, KeyError, Rule, key_fn};
///
/// /// What an authentication layer put into the request's extensions.
/// #[derive(Clone)]
/// struct AccountId(String);
///
/// let rule = Rule::new(
///     "ApiCallsPerAccount",
///     key_fn(|req| match req.extensions.get::<AccountId>() {
///         Some(AccountId(id)) => Id::new(id).map(Some).map_err(|e| KeyError::bad_request(e.to_string())),
///         None => Err(KeyError::internal("no account: is the authentication layer outside this one?")),
///     }),
/// );
/// ```
pub fn key_fn<F>(f: F) -> F
where
    F: Fn(&Parts) -> Result<Option<Id>, KeyError> + Send + Sync + 'static,
{
    f
}

/// Which forwarding header a trusted proxy sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// `Forwarded: for=client, for=proxy1` (RFC 7239).
    Forwarded,
    /// `X-Real-IP: client` (a single address, set by the nearest proxy).
    XRealIp,
}

/// The most forwarded entries examined, from the right: enough for any real proxy chain.
const MAX_HOPS: usize = 32;
/// The longest forwarded entry examined, in bytes (`[v6 address%zone]:port` fits easily).
const MAX_ENTRY_BYTES: usize = 128;

/// The client's IP address.
///
/// The peer address comes from axum's `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), tonic's `TcpConnectInfo` (feature
/// `tonic`), or a plain `SocketAddr` in the request extensions. Without one, and without a
/// [`fallback`](ClientIp::fallback), the request is refused with a 500: it is never keyed as
/// "unknown" by accident.
///
/// Forwarding headers are read **only when the peer is a trusted proxy**. Then the chosen
/// header is walked from the right, on its raw bytes, skipping trusted addresses; the first
/// untrusted address is the client. Only the entries written by the trusted proxies and the
/// client's own address are ever looked at: whatever the client wrote to the left of them (any
/// length, any bytes) cannot change its key. A client talking to the server directly cannot
/// change its key with any header. IPv4-mapped IPv6 addresses are folded to IPv4; ports,
/// brackets and IPv6 zone ids are stripped.
///
/// What cannot be keyed is refused with **400**, never keyed as the proxy (whose bucket every
/// client behind it shares): an entry a trusted proxy passed on that is not an address
/// (`unknown`, garbage, not text, over 128 bytes), a `Forwarded` element without `for=`, more
/// than 32 trusted hops, or several `X-Real-IP` headers. A trusted peer that sends no
/// forwarding header at all is itself the client (a health check from the proxy's host).
///
/// ```
/// use tower_ratelimits::{ClientIp, ForwardedHeader};
/// let ip = ClientIp::new()
///     .trusted_proxies(["10.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()])
///     .header(ForwardedHeader::XForwardedFor);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ForwardedHeader,
    fallback: Option<IpAddr>,
}

fn fold(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// A network in the form addresses are compared in: an IPv4-mapped network
/// (`::ffff:10.0.0.0/104`) as the IPv4 network it maps (`10.0.0.0/8`), since addresses are
/// folded to IPv4 first ([`fold`]) and would never match it. A network that covers more than
/// mapped addresses (a prefix under 96 bits) is kept as written.
pub(crate) fn fold_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => {
                ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, |n| IpNet::V4(n.trunc()))
            }
            None => net,
        },
        net => net,
    }
}

/// Parses one forwarded address: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:443`,
/// `fe80::1%eth0`, optionally quoted. Anything else (`unknown`, `_hidden`, garbage) is `None`.
pub(crate) fn parse_forwarded_ip(text: &str) -> Option<IpAddr> {
    let t = text.trim().trim_matches('"');
    let t = if let Some(rest) = t.strip_prefix('[') {
        rest.split_once(']')?.0
    } else if t.matches(':').count() == 1 {
        t.split_once(':')?.0 // IPv4 with a port
    } else {
        t
    };
    let t = t.split_once('%').map_or(t, |(addr, _zone)| addr);
    t.parse::<IpAddr>().ok().map(fold)
}

impl ClientIp {
    /// No trusted proxies: the peer address is the client.
    pub fn new() -> Self {
        Self::default()
    }

    /// Proxies whose forwarding headers are believed. A network in IPv4-mapped form
    /// (`::ffff:10.0.0.0/104`) is taken as the IPv4 network it maps, as addresses are.
    pub fn trusted_proxies(mut self, nets: impl IntoIterator<Item = IpNet>) -> Self {
        self.trusted = nets.into_iter().map(fold_net).collect();
        self
    }

    /// Which header trusted proxies set (default `X-Forwarded-For`).
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// The address to use when the request carries no peer address (e.g. a Unix socket
    /// server behind a local proxy). Without it such requests are refused with a 500.
    pub fn fallback(mut self, ip: IpAddr) -> Self {
        self.fallback = Some(ip);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    fn peer(&self, req: &Parts) -> Option<IpAddr> {
        #[cfg(feature = "axum")]
        if let Some(info) = req
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(info.0.ip());
        }
        #[cfg(feature = "tonic")]
        if let Some(addr) = req
            .extensions
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|i| i.remote_addr())
        {
            return Some(addr.ip());
        }
        req.extensions
            .get::<SocketAddr>()
            .map(|a| a.ip())
            .or(self.fallback)
    }

    /// The client address of a request.
    pub fn client_ip(&self, req: &Parts) -> Result<IpAddr, KeyError> {
        let peer = self.peer(req).map(fold).ok_or_else(|| {
            KeyError::internal(
                "no peer address: serve with connect info (axum: into_make_service_with_connect_info) or set ClientIp::fallback",
            )
        })?;
        if self.trusted.is_empty() || !self.is_trusted(peer) {
            return Ok(peer);
        }
        self.walk(req, peer)
    }

    /// Walks the forwarding header from the right, starting at a trusted peer.
    fn walk(&self, req: &Parts, peer: IpAddr) -> Result<IpAddr, KeyError> {
        let name: HeaderName = match self.header {
            ForwardedHeader::XForwardedFor => HeaderName::from_static("x-forwarded-for"),
            ForwardedHeader::Forwarded => http::header::FORWARDED,
            ForwardedHeader::XRealIp => HeaderName::from_static("x-real-ip"),
        };
        let unusable = |what: String| KeyError::bad_request(format!("{name}: {what}"));
        let mut values = req.headers.get_all(&name).iter();
        if self.header == ForwardedHeader::XRealIp {
            // One address, set by the nearest proxy.
            return match (values.next(), values.next()) {
                (None, _) => Ok(peer),
                (Some(one), None) => parse_entry(one.as_bytes()).ok_or_else(|| {
                    unusable(format!("set by trusted proxy {peer}, not an address"))
                }),
                (Some(_), Some(_)) => Err(unusable(
                    "given more than once: which one the proxy set is unknown".into(),
                )),
            };
        }
        let mut nearest = peer;
        let mut hops = 0;
        // Header lines from the last, each line's entries from the right: only as far as the
        // first untrusted address, so nothing to its left is even read.
        for value in values.rev() {
            for entry in value.as_bytes().rsplit(|&b| b == b',') {
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(unusable(format!("more than {MAX_HOPS} trusted proxies")));
                }
                let address = match self.header {
                    ForwardedHeader::Forwarded => forwarded_for(entry),
                    _ => parse_entry(entry),
                };
                match address {
                    Some(ip) if self.is_trusted(ip) => nearest = ip,
                    Some(ip) => return Ok(ip),
                    None => {
                        return Err(unusable(format!(
                            "the entry trusted proxy {nearest} passed on is not an address"
                        )));
                    }
                }
            }
        }
        // Every entry was a trusted proxy: the request comes from one of them.
        Ok(nearest)
    }
}

/// One forwarded entry's address, from raw bytes: `None` when it is not one (too long, not
/// text, `unknown`, an obfuscated `_name`, garbage).
fn parse_entry(entry: &[u8]) -> Option<IpAddr> {
    if entry.len() > MAX_ENTRY_BYTES {
        return None;
    }
    parse_forwarded_ip(std::str::from_utf8(entry).ok()?)
}

/// The `for=` address of one `Forwarded` element (RFC 7239: `for=..;proto=..;by=..`).
fn forwarded_for(element: &[u8]) -> Option<IpAddr> {
    element.split(|&b| b == b';').find_map(|pair| {
        let eq = pair.iter().position(|&b| b == b'=')?;
        let (key, value) = (pair[..eq].trim_ascii(), &pair[eq + 1..]);
        key.eq_ignore_ascii_case(b"for")
            .then(|| parse_entry(value))?
    })
}

impl KeyExtractor for ClientIp {
    fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError> {
        self.client_ip(req).map(|ip| Some(Id::from(ip)))
    }
}

/// The client's IPv6 /48 range, or its IPv4 address (an attacker holds 2^80 addresses in one
/// /48: limiting IPv6 clients per address is no limit at all).
///
/// ```
/// use tower_ratelimits::{ClientIp, Ipv6Range48};
/// let range = Ipv6Range48::new(ClientIp::new());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Ipv6Range48 {
    client: ClientIp,
}

impl Ipv6Range48 {
    /// Ranges of the addresses `client` finds.
    pub fn new(client: ClientIp) -> Self {
        Self { client }
    }
}

impl KeyExtractor for Ipv6Range48 {
    fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError> {
        Ok(Some(range48_id(self.client.client_ip(req)?)))
    }
}

/// The id of an address's /48 range (an IPv4 address is its own).
fn range48_id(ip: IpAddr) -> Id {
    match ip {
        IpAddr::V6(v6) => Id::ipv6_range48(v6),
        v4 => Id::from(v4),
    }
}

/// Where a rule's id comes from: its own extractor, the client address its layer's rules
/// read once per request (a `ClientIp`, or an `Ipv6Range48` of one, with the settings two or
/// more of the rules share: the address itself or its /48 range), or the header two or more
/// of its rules read (a [`Header`] of one name: per second and per day by account).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source {
    Own,
    Address { range48: bool },
    Header,
}

/// The client address settings and the header two or more of a layer's rules read, if any:
/// each is read once per request. Found when the layer is built.
#[derive(Debug, Default)]
pub(crate) struct Readers {
    shared: Option<ClientIp>,
    header: Option<HeaderName>,
}

/// The shared client address, once a request's first rule that reads it has read it.
pub(crate) type Read = Option<IpAddr>;

/// The shared header's value (`Some(None)`: the header is missing), once a request's first rule
/// that reads it has read it. Borrowed from the request: nothing to drop.
pub(crate) type ReadHeader<'p> = Option<Option<&'p HeaderValue>>;

/// The client address settings of one of the crate's address extractors, and whether it keys
/// by the /48 range; `None` for any other extractor.
fn address_of(extractor: &dyn KeyExtractor) -> Option<(&ClientIp, bool)> {
    let any: &dyn Any = extractor;
    if let Some(client) = any.downcast_ref::<ClientIp>() {
        Some((client, false))
    } else {
        any.downcast_ref::<Ipv6Range48>()
            .map(|range| (&range.client, true))
    }
}

/// The name of the crate's header extractor; `None` for any other extractor.
fn header_of(extractor: &dyn KeyExtractor) -> Option<&HeaderName> {
    let any: &dyn Any = extractor;
    any.downcast_ref::<Header>().map(|h| &h.name)
}

/// The first item two of `items` share (a lone reader reads for itself: nothing to share).
fn first_shared<T: PartialEq>(items: impl Iterator<Item = T>) -> Option<T> {
    let mut seen: Vec<T> = Vec::new();
    for item in items {
        if seen.contains(&item) {
            return Some(item);
        }
        seen.push(item);
    }
    None
}

impl Readers {
    /// The readers of rules with these extractors: the first address settings two of them
    /// share, and the first header two of them read.
    pub(crate) fn shared<'a>(
        extractors: impl Iterator<Item = &'a dyn KeyExtractor> + Clone,
    ) -> Self {
        Self {
            shared: first_shared(extractors.clone().filter_map(address_of).map(|(c, _)| c))
                .cloned(),
            header: first_shared(extractors.filter_map(header_of)).cloned(),
        }
    }

    /// Where the id of a rule with `extractor` comes from.
    pub(crate) fn source(&self, extractor: &dyn KeyExtractor) -> Source {
        if let (Some(name), Some(shared)) = (header_of(extractor), &self.header)
            && name == shared
        {
            return Source::Header;
        }
        match (address_of(extractor), &self.shared) {
            (Some((client, range48)), Some(shared)) if client == shared => {
                Source::Address { range48 }
            }
            _ => Source::Own,
        }
    }

    /// The id of a request for a rule whose id comes from `source`: the shared address, read
    /// once (kept in `read` for the request's other rules), or what `extractor` finds.
    #[inline(always)]
    pub(crate) fn extract(
        &self,
        source: Source,
        extractor: &dyn KeyExtractor,
        req: &Parts,
        read: &mut Read,
    ) -> Result<Option<Id>, KeyError> {
        let (Source::Address { range48 }, Some(client)) = (source, &self.shared) else {
            return extractor.extract(req);
        };
        let ip = match *read {
            Some(ip) => ip,
            None => *read.insert(client.client_ip(req)?),
        };
        Ok(Some(if range48 {
            range48_id(ip)
        } else {
            Id::from(ip)
        }))
    }

    /// The shared header's id: its value found by the request's first rule that reads it (its
    /// error, a 400, answers the request there), each rule's id taken from it as
    /// [`Header::extract`] takes it. Out of line: the address readers' road stays as small as
    /// before.
    #[inline(never)]
    pub(crate) fn header<'p>(
        &self,
        req: &'p Parts,
        read: &mut ReadHeader<'p>,
    ) -> Result<Option<Id>, KeyError> {
        let Some(name) = &self.header else {
            return Ok(None);
        };
        let value = match *read {
            Some(value) => value,
            None => *read.insert(header_value(name, req)?),
        };
        value.map(|v| header_id(name, v)).transpose()
    }
}

/// An id taken from a request header, e.g. `x-account-id`. A missing header is no id; a value
/// that is not text or not a valid id is a 400. The rule checks the id against the limit's id
/// kind.
///
/// ```
/// use tower_ratelimits::Header;
/// let account = Header::new("x-account-id");
/// ```
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

impl Header {
    /// Reads the header `name`, in any case (`X-Account-Id` and `x-account-id` are the same
    /// header).
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name at all (e.g. it holds a space): a programming
    /// error at set-up, never a request path. [`Header::try_new`] returns the error instead.
    pub fn new(name: &str) -> Self {
        match Self::try_new(name) {
            Ok(h) => h,
            Err(_) => panic!("Header::new: {name:?} is not a valid HTTP header name"),
        }
    }

    /// Reads the header `name`, already checked (a rules file's).
    #[cfg(feature = "yaml")]
    pub(crate) fn named(name: HeaderName) -> Self {
        Self { name }
    }

    /// Reads the header `name` (any case), if it is a valid header name.
    pub fn try_new(name: &str) -> Result<Self, http::header::InvalidHeaderName> {
        Ok(Self {
            name: HeaderName::from_bytes(name.as_bytes())?,
        })
    }
}

impl KeyExtractor for Header {
    fn extract(&self, req: &Parts) -> Result<Option<Id>, KeyError> {
        header_value(&self.name, req)?
            .map(|v| header_id(&self.name, v))
            .transpose()
    }
}

/// The header `name`'s one value, if it is there (sent twice: a 400).
#[inline]
fn header_value<'p>(
    name: &HeaderName,
    req: &'p Parts,
) -> Result<Option<&'p HeaderValue>, KeyError> {
    let mut values = req.headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::bad_request(format!(
            "header {name} given more than once"
        )));
    }
    Ok(Some(value))
}

/// The id a header's value names (not UTF-8, or not an id: a 400).
#[inline]
fn header_id(name: &HeaderName, value: &HeaderValue) -> Result<Id, KeyError> {
    // UTF-8, as the `any` id kind accepts (not only visible ASCII).
    let text = std::str::from_utf8(value.as_bytes())
        .map_err(|_| KeyError::bad_request(format!("header {name} is not UTF-8")))?;
    Id::new(text).map_err(|e| KeyError::bad_request(format!("header {name}: {e}")))
}

/// Clients that bypass every rule of a layer: those whose address (found by `client`, so
/// forwarding headers count only from its trusted proxies) is in one of `nets`.
pub(crate) struct Exemptions {
    pub(crate) client: ClientIp,
    pub(crate) nets: Vec<IpNet>,
}

impl Exemptions {
    /// Whether the request comes from an exempt address (one whose address cannot be found is
    /// not exempt).
    pub(crate) fn cover(&self, parts: &Parts) -> bool {
        self.client
            .client_ip(parts)
            .is_ok_and(|ip| self.nets.iter().any(|n| n.contains(&ip)))
    }
}

#[cfg(test)]
mod tests {
    use super::fold_net;
    use ipnet::IpNet;

    #[test]
    fn mapped_networks_fold_to_the_ipv4_networks_they_map() {
        let fold = |s: &str| fold_net(s.parse::<IpNet>().unwrap()).to_string();
        assert_eq!(fold("::ffff:10.0.0.0/104"), "10.0.0.0/8");
        assert_eq!(fold("::ffff:10.1.2.3/128"), "10.1.2.3/32");
        assert_eq!(fold("::ffff:0.0.0.0/96"), "0.0.0.0/0");
        // Host bits below the prefix are dropped, as IPv4 networks keep them.
        assert_eq!(fold("::ffff:10.1.2.3/104"), "10.0.0.0/8");
        // Wider than the mapped space, or not mapped: kept as written.
        assert_eq!(fold("::ffff:0.0.0.0/95"), "::ffff:0.0.0.0/95");
        assert_eq!(fold("2001:db8::/32"), "2001:db8::/32");
        assert_eq!(fold("10.0.0.0/8"), "10.0.0.0/8");
    }
}
