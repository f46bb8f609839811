//! Key extractors: client IPs behind no, one and two trusted proxies; hostile headers.

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
    // Garbage written by (or passed through) a trusted hop: keyed by the nearest real address.
    assert_eq!(
        ip(
            &two,
            "10.0.0.1:1",
            &[("x-forwarded-for", b"203.0.113.5, junk")]
        ),
        "10.0.0.1"
    );
    assert_eq!(
        ip(
            &two,
            "10.0.0.1:1",
            &[("x-forwarded-for", b"junk, 10.2.2.2")]
        ),
        "10.2.2.2"
    );
    assert_eq!(
        ip(&two, "10.0.0.1:1", &[("x-forwarded-for", b",")]),
        "10.0.0.1"
    );
}

#[test]
fn forwarded_and_x_real_ip() {
    let fwd = trusting(&["10.0.0.0/8"]).header(ForwardedHeader::Forwarded);
    let cases: &[(&[u8], &str)] = &[
        (b"for=192.0.2.60;proto=http;by=203.0.113.43", "192.0.2.60"),
        (b"for=\"[2001:db8:cafe::17]:4711\"", "2001:db8:cafe::17"),
        (b"For=\"192.0.2.43:47011\", for=10.1.1.1", "192.0.2.43"),
        (b"for=unknown", "10.0.0.1"),
        (b"for=_hidden, for=198.51.100.17", "198.51.100.17"),
        (b"proto=https", "10.0.0.1"),
    ];
    for (h, want) in cases {
        assert_eq!(
            ip(&fwd, "10.0.0.1:1", &[("forwarded", h)]),
            *want,
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
        ip(
            &real,
            "10.0.0.1:1",
            &[("x-real-ip", b"203.0.113.9"), ("x-real-ip", b"1.1.1.1")]
        ),
        "10.0.0.1"
    );
    assert_eq!(
        ip(&real, "10.0.0.1:1", &[("x-real-ip", b"nope")]),
        "10.0.0.1"
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
        (b"[2001:db8::1", "127.0.0.1"),
        (b"300.1.1.1", "127.0.0.1"),
        (b"1.2.3.4.5", "127.0.0.1"),
        (b"::ffff:1.2.3.4:80", "127.0.0.1"),
    ];
    for (h, want) in cases {
        assert_eq!(
            ip(&e, "127.0.0.1:1", &[("x-forwarded-for", h)]),
            *want,
            "{}",
            String::from_utf8_lossy(h)
        );
    }
    // Not text (obs-text bytes) and over-long values: the peer.
    assert_eq!(
        ip(&e, "127.0.0.1:1", &[("x-forwarded-for", b"\xff1.2.3.4")]),
        "127.0.0.1"
    );
    let long = format!("{}203.0.113.1", "1.1.1.1, ".repeat(2000));
    assert_eq!(
        ip(&e, "127.0.0.1:1", &[("x-forwarded-for", long.as_bytes())]),
        "127.0.0.1"
    );
    // Many trusted hops: the walk is bounded and ends at the last trusted address examined.
    let hops = vec!["127.0.0.1"; 100].join(",");
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
