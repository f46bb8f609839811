//! The log readers' unit tests: instants, both formats, merging, the window, bad lines, gzip refused.
use super::*;

fn read(text: &str, reorder_s: u64) -> Vec<Result<LoggedRequest, BadLine>> {
    LogReader::from_readers(
        vec![(
            "log".into(),
            Box::new(std::io::Cursor::new(text.to_owned())),
        )],
        None,
        Duration::from_secs(reorder_s),
    )
    .collect()
}

#[test]
fn rfc3339_instants_read_to_the_microsecond_at_any_offset() {
    assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Ok(0));
    assert_eq!(
        parse_rfc3339("2026-11-25T10:00:00.123456789Z"),
        Ok(1_795_600_800_123_456)
    );
    assert_eq!(
        parse_rfc3339("2026-11-25T12:00:00.5+02:00"),
        Ok(1_795_600_800_500_000)
    );
    assert_eq!(
        parse_rfc3339("2026-11-25 05:30:00-04:30"),
        Ok(1_795_600_800_000_000)
    );
    for bad in [
        "2026-11-25T10:00:00",
        "2026-13-01T00:00:00Z",
        "2026-02-30T00:00:00Z",
        "x",
        "2026-11-25T10:00:00.Z",
    ] {
        let e = parse_rfc3339(bad).unwrap_err();
        assert_eq!(e, LineError::Time(bad.into()));
        assert!(e.to_string().contains("write RFC 3339"), "{bad}: {e}");
    }
    assert_eq!(
        parse_rfc3339("9999-12-31T23:59:59.999999Z"),
        Ok(253_402_300_799_999_999)
    );
    assert_eq!(parse_rfc3339("1970-01-01T01:00:00+01:00"), Ok(0));
}

/// An instant outside 1970 to 9999 in UTC is RFC 3339 all the same: refused saying what the
/// range is (before, "write RFC 3339"; and 9999's last hour at a negative offset was read, and
/// written in the plan's `to` as `10000-01-01T...`).
#[test]
fn an_instant_outside_the_range_is_refused_with_the_range() {
    for text in [
        "1969-12-31T23:59:59Z",
        "1970-01-01T00:30:00+01:00",
        "9999-12-31T23:30:00-01:00",
        "0001-01-01T00:00:00Z",
    ] {
        let e = parse_rfc3339(text).unwrap_err();
        assert_eq!(e, LineError::TimeOutOfRange(text.into()));
        assert!(
            e.to_string().contains("out of range: a replay reads times from 1970-01-01T00:00:00Z to 9999-12-31T23:59:59Z"),
            "{text}: {e}"
        );
    }
    let e = parse_combined(
        r#"192.0.2.1 - - [31/Dec/9999:23:30:00 -0100] "GET / HTTP/1.1" 200 1 "-" "-""#,
    )
    .unwrap_err();
    assert!(matches!(e, LineError::TimeOutOfRange(_)), "{e}");
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = parse_combined(
        r#"192.0.2.1 - - [31/Foo/2026:23:30:00 -0100] "GET / HTTP/1.1" 200 1 "-" "-""#,
    )
    .unwrap_err();
    assert!(matches!(e, LineError::NotCombined(_)), "{e}");
    assert!(e.to_string().contains("dd/Mon/yyyy"), "{e}");
}

#[test]
fn a_json_line_reads_every_field() {
    let r = parse_json(r#"{"time":"2026-11-25T10:00:00Z","ip":"2001:db8::1","method":"POST","path":"/api/x?a=1","status":201,"headers":{"X-Account":"42","x-b":"c"},"duration_ms":12.5,"cost":3,"extra":[1]}"#).unwrap();
    assert_eq!(r.ip, "2001:db8::1".parse::<IpAddr>().unwrap());
    assert_eq!(
        (r.method, r.path.as_str(), r.status),
        (Method::POST, "/api/x?a=1", Some(201))
    );
    assert_eq!(r.headers["x-account"], "42");
    assert_eq!((r.duration_us, r.cost), (12_500, Some(3)));
    let minimal = parse_json(r#"{"time":"2026-11-25T10:00:00Z","ip":"192.0.2.1"}"#).unwrap();
    assert_eq!((minimal.method, minimal.path.as_str()), (Method::GET, "/"));
    for (line, says) in [
        (r#"{"ip":"192.0.2.1"}"#, "missing field `time`"),
        (
            r#"{"time":"2026-11-25T10:00:00Z","ip":"nobody"}"#,
            "not an address",
        ),
        (
            r#"{"time":"2026-11-25T10:00:00Z","ip":"192.0.2.1","path":"x"}"#,
            "not a path",
        ),
        (
            r#"{"time":"2026-11-25T10:00:00Z","ip":"192.0.2.1","duration_ms":-1}"#,
            "duration_ms",
        ),
        (
            r#"{"time":"2026-11-25T10:00:00Z","ip":"192.0.2.1","headers":{"a b":"c"}}"#,
            "not a header name",
        ),
        ("{", "not a log line"),
    ] {
        let e = parse_json(line).unwrap_err();
        assert!(e.to_string().contains(says), "{line}: {e}");
    }
}

#[test]
fn a_combined_line_reads_its_request_and_an_nginx_request_time_moves_its_start() {
    let r = parse_combined(r#"192.0.2.7 - frank [25/Nov/2026:10:00:01 +0000] "GET /a?b=c HTTP/1.1" 200 2326 "https://example.com/" "curl \"8\"" 0.250"#).unwrap();
    assert_eq!(r.time_us, 1_795_600_800_750_000);
    assert_eq!(
        (r.duration_us, r.status, r.path.as_str()),
        (250_000, Some(200), "/a?b=c")
    );
    assert_eq!(r.headers["user-agent"], "curl \"8\"");
    let apache =
        parse_combined(r#"::1 - - [25/Nov/2026:11:00:00 +0100] "POST / HTTP/1.0" 429 - "-" "-""#)
            .unwrap();
    assert_eq!(
        (apache.time_us, apache.duration_us),
        (1_795_600_800_000_000, 0)
    );
    assert!(apache.headers.is_empty());
    let rt = parse_combined(
        r#"192.0.2.7 - - [25/Nov/2026:10:00:01 +0000] "GET / HTTP/1.1" 200 1 "-" "-" rt=1.5"#,
    )
    .unwrap();
    assert_eq!(rt.duration_us, 1_500_000);
    for line in [
        "192.0.2.7 - - [25/Nov/2026:10:00:01 +0000] \"-\" 400 0 \"-\" \"-\"",
        "host.example - - [25/Nov/2026:10:00:01 +0000] \"GET / HTTP/1.1\" 200 1",
        "192.0.2.7 - - [25/Foo/2026:10:00:01 +0000] \"GET / HTTP/1.1\" 200 1",
        "192.0.2.7 - - [25/Nov/2026:10:00:01 +0000] \"GET / HTTP/1.1\" OK 1",
    ] {
        assert!(parse_combined(line).is_err(), "{line}");
    }
}

#[test]
fn logs_merge_by_time_and_the_window_sorts_late_lines() {
    let a = "{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"192.0.2.1\"}\n{\"time\":\"2026-11-25T10:00:02Z\",\"ip\":\"192.0.2.1\"}\n";
    let b = "{\"time\":\"2026-11-25T10:00:01Z\",\"ip\":\"192.0.2.2\"}\n{\"time\":\"2026-11-25T10:00:03Z\",\"ip\":\"192.0.2.2\"}\n";
    let times: Vec<u64> = LogReader::from_readers(
        vec![
            ("a".into(), Box::new(a.as_bytes())),
            ("b".into(), Box::new(b.as_bytes())),
        ],
        None,
        Duration::ZERO,
    )
    .map(|r| r.unwrap().time_us % 10_000_000 / 1_000_000)
    .collect();
    assert_eq!(times, [0, 1, 2, 3]);
    // One file out of order: without a window, in file order; with one, sorted.
    let late = "{\"time\":\"2026-11-25T10:00:05Z\",\"ip\":\"192.0.2.1\"}\n{\"time\":\"2026-11-25T10:00:04Z\",\"ip\":\"192.0.2.1\"}\n{\"time\":\"2026-11-25T10:00:09Z\",\"ip\":\"192.0.2.1\"}\n";
    let seconds = |w| -> Vec<u64> {
        read(late, w)
            .into_iter()
            .map(|r| r.unwrap().time_us / 1_000_000 % 10)
            .collect()
    };
    assert_eq!(seconds(0), [5, 4, 9]);
    assert_eq!(seconds(60), [4, 5, 9]);
}

#[test]
fn bad_lines_are_handed_on_with_their_numbers_and_a_line_without_end_is_bounded() {
    let mut text = String::from("{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"192.0.2.1\"}\n\n");
    text.push_str(&"x".repeat(MAX_LINE_BYTES * 3));
    text.push('\n');
    text.push_str("{\"time\":\"2026-11-25T10:00:01Z\",\"ip\":\"192.0.2.1\"}\n\u{0}\u{ff}\n");
    let lines = read(&text, 0);
    assert!(lines[0].is_ok());
    let bad = lines[1].as_ref().unwrap_err();
    assert_eq!(bad.line, 3);
    assert_eq!(bad.reason, LineError::TooLong);
    assert!(bad.to_string().contains("longer than"), "{bad}");
    assert!(lines[2].is_ok());
    assert_eq!(lines[3].as_ref().unwrap_err().line, 5);
    assert_eq!(lines.len(), 4);
    // The last line without a newline still counts.
    assert_eq!(
        read(
            "{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"192.0.2.1\"}",
            0
        )
        .len(),
        1
    );
}

#[test]
fn a_gzip_log_is_one_bad_line_saying_how_to_read_it() {
    // Gzip's header and a few bytes: this crate has no decompressor (the simulator has one).
    let bytes = vec![
        0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0, 0xff, b'\n', b'x', b'\n',
    ];
    let lines: Vec<_> = LogReader::from_readers(
        vec![("a.gz".into(), Box::new(std::io::Cursor::new(bytes)))],
        None,
        Duration::ZERO,
    )
    .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let bad = lines[0].as_ref().unwrap_err();
    assert_eq!((bad.file.as_str(), bad.line), ("a.gz", 1));
    assert!(
        bad.reason == LineError::Gzip
            && bad.to_string().contains("gzip")
            && bad.to_string().contains("open_with"),
        "{}",
        bad.reason
    );
}
