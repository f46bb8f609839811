//! Key extractors: client IPs behind no, one and two trusted proxies; hostile headers.

#[path = "support/cases.rs"]
mod cases;

use std::net::SocketAddr;

use http::Request;
use tower_ratelimits::Id;
use tower_ratelimits::{ClientIp, ForwardedHeader, Header, Ipv6Range48, KeyExtractor};

fn parts(peer: &str, headers: &[(&str, &[u8])]) -> http::request::Parts {
    let mut b = Request::get("/").extension(peer.parse::<SocketAddr>().unwrap());
    for (k, v) in headers {
        b = b.header(*k, http::HeaderValue::from_bytes(v).unwrap());
    }
    b.body(()).unwrap().into_parts().0
}

fn ip(e: &impl KeyExtractor, peer: &str, headers: &[(&str, &[u8])]) -> String {
    e.extract(&parts(peer, headers))
        .unwrap()
        .unwrap()
        .to_string()
}

/// The status a request is refused with, when the extractor refuses it.
fn refused(e: &impl KeyExtractor, peer: &str, headers: &[(&str, &[u8])]) -> Option<u16> {
    e.extract(&parts(peer, headers))
        .err()
        .map(|k| k.status.as_u16())
}

fn trusting(nets: &[&str]) -> ClientIp {
    ClientIp::new().trusted_proxies(nets.iter().map(|n| n.parse().unwrap()))
}

#[test]
fn a_direct_client_cannot_change_its_key_with_any_header() {
    let hostile: Vec<(&str, &[u8])> = vec![
        ("x-forwarded-for", b"1.2.3.4"),
        ("x-forwarded-for", b"1.2.3.4, 5.6.7.8"),
        ("forwarded", b"for=1.2.3.4"),
        ("x-real-ip", b"1.2.3.4"),
        ("x-forwarded-for", b""),
        ("x-forwarded-for", b"not an ip"),
        ("x-forwarded-for", "\u{1F980}".as_bytes()),
    ];
    for e in [
        ClientIp::new(),
        trusting(&["10.0.0.0/8"]),
        trusting(&["10.0.0.0/8"]).header(ForwardedHeader::XRealIp),
    ] {
        for h in &hostile {
            assert_eq!(
                ip(&e, "198.51.100.7:5000", std::slice::from_ref(h)),
                "198.51.100.7",
                "{h:?}"
            );
        }
    }
}

#[test]
fn clients_behind_trusted_proxies_are_keyed_by_their_real_address() {
    let one = trusting(&["10.0.0.1/32"]);
    assert_eq!(
        ip(&one, "10.0.0.1:1", &[("x-forwarded-for", b"203.0.113.5")]),
        "203.0.113.5"
    );
    // The client forged a left entry: ignored, the proxy's entry is on the right.
    assert_eq!(
        ip(
            &one,
            "10.0.0.1:1",
            &[("x-forwarded-for", b"1.1.1.1, 203.0.113.5")]
        ),
        "203.0.113.5"
    );
    // Two proxies: the inner one is trusted and skipped.
    let two = trusting(&["10.0.0.0/8"]);
    assert_eq!(
        ip(
            &two,
            "10.0.0.1:1",
            &[("x-forwarded-for", b"203.0.113.5, 10.9.9.9")]
        ),
        "203.0.113.5"
    );
    // Split over several header lines: the last line is the rightmost.
    assert_eq!(
        ip(
            &two,
            "10.0.0.1:1",
            &[
                ("x-forwarded-for", b"1.1.1.1"),
                ("x-forwarded-for", b"203.0.113.5, 10.2.2.2")
            ]
        ),
        "203.0.113.5"
    );
    // No header at all: the peer.
    assert_eq!(ip(&two, "10.0.0.1:1", &[]), "10.0.0.1");
    // Every entry trusted: the leftmost trusted address.
    assert_eq!(
        ip(
            &two,
            "10.0.0.1:1",
            &[("x-forwarded-for", b"10.3.3.3, 10.2.2.2")]
        ),
        "10.3.3.3"
    );
    // Garbage written by (or passed through) a trusted hop: refused, never the proxy.
    for h in [&b"203.0.113.5, junk"[..], b"junk, 10.2.2.2", b","] {
        assert_eq!(
            refused(&two, "10.0.0.1:1", &[("x-forwarded-for", h)]),
            Some(400),
            "{}",
            String::from_utf8_lossy(h)
        );
    }
}

#[test]
fn forwarded_and_x_real_ip() {
    let fwd = trusting(&["10.0.0.0/8"]).header(ForwardedHeader::Forwarded);
    let cases: &[(&[u8], &str)] = &[
        (b"for=192.0.2.60;proto=http;by=203.0.113.43", "192.0.2.60"),
        (b"for=\"[2001:db8:cafe::17]:4711\"", "2001:db8:cafe::17"),
        (b"For=\"192.0.2.43:47011\", for=10.1.1.1", "192.0.2.43"),
        (b"for=_hidden, for=198.51.100.17", "198.51.100.17"),
    ];
    for (h, want) in cases {
        assert_eq!(
            ip(&fwd, "10.0.0.1:1", &[("forwarded", h)]),
            *want,
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    for h in [&b"for=unknown"[..], b"proto=https", b"for=_hidden"] {
        assert_eq!(
            refused(&fwd, "10.0.0.1:1", &[("forwarded", h)]),
            Some(400),
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    let real = trusting(&["10.0.0.0/8"]).header(ForwardedHeader::XRealIp);
    assert_eq!(
        ip(&real, "10.0.0.1:1", &[("x-real-ip", b"203.0.113.9")]),
        "203.0.113.9"
    );
    assert_eq!(
        refused(
            &real,
            "10.0.0.1:1",
            &[("x-real-ip", b"203.0.113.9"), ("x-real-ip", b"1.1.1.1")]
        ),
        Some(400)
    );
    assert_eq!(
        refused(&real, "10.0.0.1:1", &[("x-real-ip", b"nope")]),
        Some(400)
    );
    // X-Forwarded-For is ignored when X-Real-IP is the configured header.
    assert_eq!(
        ip(&real, "10.0.0.1:1", &[("x-forwarded-for", b"1.1.1.1")]),
        "10.0.0.1"
    );
}

#[test]
fn address_forms_and_hostile_values() {
    let e = trusting(&["::1/128", "127.0.0.1/32"]);
    let cases: &[(&[u8], &str)] = &[
        (b"[2001:db8::1]:443", "2001:db8::1"),
        (b"2001:db8::1", "2001:db8::1"),
        (b"fe80::1%eth0", "fe80::1"),
        (b"[fe80::1%25eth0]:80", "fe80::1"),
        (b"192.0.2.1:8080", "192.0.2.1"),
        (b"::ffff:192.0.2.1", "192.0.2.1"),
        (b"  192.0.2.2  ", "192.0.2.2"),
        (b"2001:DB8::A", "2001:db8::a"),
    ];
    for (h, want) in cases {
        assert_eq!(
            ip(&e, "127.0.0.1:1", &[("x-forwarded-for", h)]),
            *want,
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    // What a trusted proxy passed on and is not an address is refused (400), never keyed as
    // the proxy, whose bucket every client behind it shares.
    let unusable: &[&[u8]] = &[
        b"[2001:db8::1",
        b"300.1.1.1",
        b"1.2.3.4.5",
        b"::ffff:1.2.3.4:80",
        b"\xff1.2.3.4",
        b"",
        b"unknown",
    ];
    for h in unusable {
        assert_eq!(
            refused(&e, "127.0.0.1:1", &[("x-forwarded-for", h)]),
            Some(400),
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    let long_entry = format!("1.1.1.1{}", " ".repeat(200));
    assert_eq!(
        refused(
            &e,
            "127.0.0.1:1",
            &[("x-forwarded-for", long_entry.as_bytes())]
        ),
        Some(400)
    );
    // Many trusted hops: the walk is bounded, and what it cannot finish is refused.
    let hops = vec!["127.0.0.1"; 100].join(",");
    assert_eq!(
        refused(&e, "127.0.0.1:1", &[("x-forwarded-for", hops.as_bytes())]),
        Some(400)
    );
    let hops = vec!["127.0.0.1"; 31].join(",");
    assert_eq!(
        ip(&e, "127.0.0.1:1", &[("x-forwarded-for", hops.as_bytes())]),
        "127.0.0.1"
    );
    // An IPv4-mapped peer is IPv4.
    assert_eq!(
        ip(&ClientIp::new(), "[::ffff:192.0.2.9]:1", &[]),
        "192.0.2.9"
    );
}

#[test]
fn ranges_and_headers() {
    let r = Ipv6Range48::new(ClientIp::new());
    assert_eq!(
        ip(&r, "[2001:db8:1234:5678::1]:1", &[]),
        "2001:db8:1234::/48"
    );
    assert_eq!(ip(&r, "192.0.2.1:1", &[]), "192.0.2.1");
    assert_eq!(ip(&r, "[::ffff:192.0.2.1]:1", &[]), "192.0.2.1");
    let h = Header::new("x-account-id");
    assert_eq!(h.extract(&parts("1.1.1.1:1", &[])).unwrap(), None);
    assert_eq!(
        h.extract(&parts("1.1.1.1:1", &[("x-account-id", b"42")]))
            .unwrap(),
        Some(Id::from(42u64))
    );
    assert!(
        h.extract(&parts("1.1.1.1:1", &[("x-account-id", b"")]))
            .is_err()
    );
    assert!(Header::try_new("Not A Header").is_err());
}

#[test]
fn a_header_name_is_accepted_in_any_case() {
    let h = Header::new("X-Account-Id");
    assert_eq!(
        h.extract(&parts("1.1.1.1:1", &[("x-account-id", b"42")]))
            .unwrap(),
        Some(Id::from(42u64))
    );
    assert!(Header::try_new("X-Account-Id").is_ok());
    assert!(Header::try_new("not a header").is_err());
}

#[test]
fn a_closure_extractor_needs_no_type_annotations() {
    let by_method = tower_ratelimits::key_fn(|req| Ok(Id::new(req.method.as_str()).ok()));
    assert_eq!(
        by_method.extract(&parts("1.1.1.1:1", &[])).unwrap(),
        Some(Id::new("GET").unwrap())
    );
}

/// A client behind a trusted proxy (which appends the address it saw on the right, as nginx
/// and most proxies do) controls everything to the left: no length and no bytes there can
/// move its key to the proxy or to anyone else. Before, more than 8 KiB or one non-UTF-8 byte
/// anywhere in the header keyed the client as the proxy.
#[test]
fn whatever_a_client_writes_left_of_the_proxys_entry_cannot_move_its_key() {
    let proxy = trusting(&["10.0.0.0/8"]);
    let client = "203.0.113.77";
    let lefts: Vec<Vec<u8>> = vec![
        "1.1.1.1, ".repeat(2_000).into_bytes(),
        b"\xff\xfe not text at all".to_vec(),
        vec![b'a'; 64 * 1024],
        b"10.0.0.1, 10.0.0.2".to_vec(),
        b"unknown".to_vec(),
        b",,,,".to_vec(),
    ];
    for left in &lefts {
        let mut header = left.clone();
        header.extend_from_slice(format!(", {client}").as_bytes());
        assert_eq!(
            ip(&proxy, "10.0.0.1:1", &[("x-forwarded-for", &header)]),
            client,
            "left part of {} bytes",
            left.len()
        );
        // The same client's own header line, before the proxy's.
        assert_eq!(
            ip(
                &proxy,
                "10.0.0.1:1",
                &[
                    ("x-forwarded-for", left),
                    ("x-forwarded-for", client.as_bytes())
                ]
            ),
            client
        );
        let forwarded = [left.as_slice(), format!(", for={client}").as_bytes()].concat();
        assert_eq!(
            ip(
                &proxy.clone().header(ForwardedHeader::Forwarded),
                "10.0.0.1:1",
                &[("forwarded", &forwarded)]
            ),
            client
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(cases::cases(64)))]
    /// The trust rule, for any bytes a client can put in a header value: nothing to the left of
    /// the proxy's entry changes the key.
    #[test]
    fn no_left_part_changes_the_key(
        left in proptest::collection::vec(
            proptest::prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, proptest::strategy::Just(b'\t')],
            0..10_000,
        ),
        client in proptest::prelude::any::<u32>(),
    ) {
        let client = std::net::Ipv4Addr::from(client);
        proptest::prop_assume!(!client.is_private());
        let proxy = trusting(&["10.0.0.0/8"]);
        let mut header = left.clone();
        header.extend_from_slice(format!(",{client}").as_bytes());
        proptest::prop_assert_eq!(
            ip(&proxy, "10.0.0.1:1", &[("x-forwarded-for", &header)]),
            client.to_string()
        );
    }
}

/// The `Header` extractor takes UTF-8 ids, as the `any` kind does (it refused them as "not
/// text"); bytes that are not UTF-8 are a 400.
#[test]
fn a_header_id_may_be_any_utf8_text() {
    let h = Header::new("x-tenant");
    assert_eq!(
        h.extract(&parts(
            "1.1.1.1:1",
            &[("x-tenant", "caf\u{e9}-m\u{fc}nchen".as_bytes())]
        ))
        .unwrap(),
        Some(Id::new("caf\u{e9}-m\u{fc}nchen").unwrap())
    );
    let err = h
        .extract(&parts("1.1.1.1:1", &[("x-tenant", b"\xff\xfe")]))
        .unwrap_err();
    assert_eq!(err.status.as_u16(), 400);
}

proptest::proptest! {
    /// Any digits make the id that parsing them as an address, then as a number, then as text
    /// makes: a number only in canonical form (`007` stays text, so it never shares a bucket
    /// with `7`), text beyond `u64`.
    #[test]
    fn digit_ids_are_numbers_only_in_canonical_form(text in "[0-9]{1,22}") {
        let reference = match text.parse::<std::net::IpAddr>() {
            Ok(ip) if ip.to_string() == text => Id::from(ip),
            _ => match text.parse::<u64>() {
                Ok(n) if n.to_string() == text => Id::from(n),
                _ => tower_ratelimits::IdKind::Any.parse(&text).unwrap(),
            },
        };
        proptest::prop_assert_eq!(Id::new(&text).unwrap(), reference);
    }
}

/// Rules that read the client address with the same settings read it once per request; rules
/// with other settings (here: one trusting the proxy, one not) never share it. Each rule's
/// bucket is the one its own extractor names, alone or beside the others.
#[tokio::test]
async fn rules_share_an_address_read_only_with_the_same_settings() {
    use tower::{Layer, ServiceExt};
    use tower_ratelimits::{Limiter, Limits, MemoryBackend, RateLimitLayer, Rule};

    let limits = "\
Trusting: {kind: ip, burst: 5, count: 5, period: 1h}
TrustingRange: {kind: ipv6_range, burst: 5, count: 5, period: 1h}
TrustingAgain: {kind: ip, burst: 5, count: 5, period: 1h}
Direct: {kind: ip, burst: 5, count: 5, period: 1h}
DirectRange: {kind: ipv6_range, burst: 5, count: 5, period: 1h}
";
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(limits, None).unwrap(),
        backend.clone(),
    );
    let proxy = || trusting(&["10.0.0.0/8"]);
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("Trusting", proxy()))
        .rule(Rule::new("Direct", ClientIp::new()))
        .rule(Rule::new("TrustingRange", Ipv6Range48::new(proxy())))
        .rule(Rule::new("DirectRange", Ipv6Range48::new(ClientIp::new())))
        .rule(Rule::new("TrustingAgain", proxy()))
        .build()
        .unwrap();
    let service = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    }));
    let request = Request::get("/")
        .extension("10.1.2.3:4000".parse::<SocketAddr>().unwrap())
        .header("x-forwarded-for", "2001:db8:aa:bb::7")
        .body(())
        .unwrap();
    let response = service.oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let client: std::net::IpAddr = "2001:db8:aa:bb::7".parse().unwrap();
    let std::net::IpAddr::V6(v6) = client else {
        unreachable!()
    };
    let proxy_ip: std::net::IpAddr = "10.1.2.3".parse().unwrap();
    let spent = |name: &str, id: Id| backend.tat(&limiter.key(name, id).unwrap()).is_some();
    assert!(spent("Trusting", Id::from(client)));
    assert!(spent("TrustingAgain", Id::from(client)));
    assert!(spent("TrustingRange", Id::ipv6_range48(v6)));
    assert!(
        spent("Direct", Id::from(proxy_ip)),
        "not the forwarded address"
    );
    assert!(spent("DirectRange", Id::from(proxy_ip)));
    assert!(!spent("Direct", Id::from(client)));
}

/// Rules that read one header read it once per request, and each still applies its own id
/// kind and its own policy for a missing header; a rule reading another header reads its own.
#[tokio::test]
async fn rules_reading_one_header_share_its_id_and_keep_their_own_policies() {
    use tower::{Layer, ServiceExt};
    use tower_ratelimits::{Limiter, Limits, MemoryBackend, OnMissingKey, RateLimitLayer, Rule};

    let limits = "\
PerSecond: {kind: any, burst: 5, count: 5, period: 1s}
PerDay: {kind: account, burst: 5, count: 5, period: 1d}
Team: {kind: any, burst: 5, count: 5, period: 1h}
";
    let backend = MemoryBackend::new();
    let limiter = Limiter::new(
        Limits::from_yaml_str(limits, None).unwrap(),
        backend.clone(),
    );
    let layer = RateLimitLayer::builder(limiter.clone())
        .rule(Rule::new("PerSecond", Header::new("x-account")).on_missing_key(OnMissingKey::Skip))
        .rule(Rule::new("Team", Header::new("x-team")).on_missing_key(OnMissingKey::Skip))
        .rule(
            Rule::new("PerDay", Header::new("X-Account"))
                .on_missing_key(OnMissingKey::Reject(http::StatusCode::UNAUTHORIZED)),
        )
        .build()
        .unwrap();
    let service = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    }));
    let send = |headers: &[(&str, &str)]| {
        let mut request = Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        service.clone().oneshot(request.body(()).unwrap())
    };
    let spent = |name: &str, id: Id| backend.tat(&limiter.key(name, id).unwrap()).is_some();

    let ok = send(&[("x-account", "42"), ("x-team", "blue")])
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert!(spent("PerSecond", Id::from(42u64)) && spent("PerDay", Id::from(42u64)));
    assert!(spent("Team", Id::new("blue").unwrap()));
    assert!(!spent("Team", Id::from(42u64)) && !spent("PerSecond", Id::new("blue").unwrap()));

    // Missing: the first rule skips, the last one refuses as it says.
    let missing = send(&[("x-team", "blue")]).await.unwrap();
    assert_eq!(missing.status(), 401);
    // One rule's id kind refuses what the other's takes.
    let text = send(&[("x-account", "abc")]).await.unwrap();
    assert_eq!(text.status(), 400);
    assert!(
        !spent("PerSecond", Id::new("abc").unwrap()),
        "a refused request spends nothing"
    );
    // Sent twice: refused by the first rule that reads it.
    let twice = send(&[("x-account", "1"), ("x-account", "2")])
        .await
        .unwrap();
    assert_eq!(twice.status(), 400);
}
