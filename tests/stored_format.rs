//! What the crate leaves in Redis and in a replay's snapshot file, held byte for byte to what
//! the start commit of the shape re-cut (issue 79, c091fd1) wrote: every conformance trace
//! (every shape, op and mode) and a pooled adaptive limit's, run on a real Redis on a manual
//! clock; then each key's type, value and whether it expires, and the snapshot of the keys
//! written as its file. `tests/data/stored-c091fd1.txt` is that commit's output (this file
//! run there with `TRL_WRITE_STORED=1`): a change to it is a format change, which the
//! CHANGELOG says with what operators do. A trace newer than that commit (a penalty ladder's)
//! is held the same way to `tests/data/stored-penalty.txt`, what the commit that brought it
//! wrote.

mod support;

/// The trace simulator, from the `simulate` example.
#[allow(dead_code)]
#[path = "../simulator/src/trace.rs"]
mod simulate;

#[allow(dead_code)]
#[path = "support/conformance.rs"]
mod conformance;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use support::redis::RedisServer;
use support::redis_backend::caller_time_backend;
use tower_ratelimits::{Limiter, Limits, ManualClock, RedisBackend, Snapshot};

const WRITTEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/stored-c091fd1.txt");

/// What the traces newer than the start commit leave, held the same way to what the commit
/// that brought each wrote (`NEWER`): the penalty ladder's (issue 81, its states at
/// `{<name>:<id>}:pen` and its snapshot lines), as first written at 9097dc1.
const WRITTEN_NEWER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/stored-penalty.txt");

/// The conformance traces newer than the start commit: held to `WRITTEN_NEWER`.
const NEWER: [&str; 1] = ["penalty"];

/// An adaptive limit whose keys share a capacity: a state of its own (the pool) beside the
/// keys'.
const POOLED: &str = "\
Pool4:
  concurrency:
    adaptive: {min: 1, initial: 4, max: 8, algorithm: aimd, completions: 4, capacity: 6, headroom: 1}
  lease: 30s
  retry_after: 200ms
";

/// The conformance limits and the pooled one.
fn limits() -> Limits {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/traces/");
    let read = |name: &str| std::fs::read_to_string(format!("{dir}{name}")).unwrap();
    let files = [
        "gcra-20-per-second.yaml",
        "burst-tiers.yaml",
        "partial-grants.yaml",
        "concurrency.yaml",
        "debt.yaml",
        "calendar.yaml",
        "fair-share.yaml",
        "adaptive.yaml",
        "penalty.yaml",
    ];
    let mut yaml: String = files.iter().map(|f| read(f) + "\n").collect();
    yaml.push_str(conformance::CONFORMANCE_LIMITS);
    yaml.push_str(POOLED);
    Limits::from_yaml_str(&yaml, Some(&read("fair-share-overrides.yaml"))).unwrap()
}

/// The traces: the conformance set and the adaptive trace on the pooled limit. Not the
/// streams trace: its keys are plain keys of GCRA limits, in the states the GCRA traces hold
/// to their files already (it writes nothing of its own).
fn traces() -> Vec<(String, String)> {
    let mut traces = conformance::traces();
    traces.retain(|(name, _)| name != "streams");
    let adaptive = traces
        .iter()
        .find(|(name, _)| name == "adaptive")
        .map(|(_, text)| text.replace("Aimd4", "Pool4"))
        .unwrap();
    traces.push(("adaptive, pooled".into(), adaptive));
    traces
}

/// One reply of the Redis protocol.
enum Reply {
    Bulk(Option<Vec<u8>>),
    Int(i64),
    Line(String),
    Array(Vec<Reply>),
}

/// A connection that speaks the protocol itself: values arrive as the server holds them,
/// bytes and all.
struct Raw(BufReader<TcpStream>);

impl Raw {
    fn call(&mut self, args: &[&[u8]]) -> Reply {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.0.get_mut().write_all(&out).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> Reply {
        let mut line = String::new();
        self.0.read_line(&mut line).unwrap();
        let (kind, rest) = line.trim_end().split_at(1);
        match kind {
            "+" => Reply::Line(rest.to_owned()),
            "-" => panic!("the server answered {rest}"),
            ":" => Reply::Int(rest.parse().unwrap()),
            "$" => {
                let n: i64 = rest.parse().unwrap();
                if n < 0 {
                    return Reply::Bulk(None);
                }
                let mut bytes = vec![0; n as usize + 2];
                self.0.read_exact(&mut bytes).unwrap();
                bytes.truncate(n as usize);
                Reply::Bulk(Some(bytes))
            }
            "*" => {
                let n: i64 = rest.parse().unwrap();
                Reply::Array((0..n.max(0)).map(|_| self.reply()).collect())
            }
            other => panic!("no such reply kind {other:?}"),
        }
    }
}

fn text(reply: &Reply) -> String {
    match reply {
        Reply::Bulk(Some(bytes)) => bytes.escape_ascii().to_string(),
        Reply::Bulk(None) => "(nil)".into(),
        Reply::Int(n) => n.to_string(),
        Reply::Line(s) => s.clone(),
        Reply::Array(items) => items.iter().map(text).collect::<Vec<_>>().join(" "),
    }
}

fn items(reply: Reply) -> Vec<Reply> {
    match reply {
        Reply::Array(items) => items,
        _ => panic!("not an array"),
    }
}

/// Every key under `prefix` (without it), sorted, with its type, its value (a hash's fields
/// and a set's members sorted) and whether it expires.
fn dump(raw: &mut Raw, prefix: &str) -> String {
    let mut keys = Vec::new();
    let mut cursor = b"0".to_vec();
    let pattern = format!("{prefix}*");
    loop {
        let mut reply = items(raw.call(&[b"SCAN", &cursor, b"MATCH", pattern.as_bytes()]));
        for key in items(reply.pop().unwrap()) {
            let Reply::Bulk(Some(key)) = key else {
                panic!("a key that is not a string")
            };
            keys.push(key);
        }
        let Reply::Bulk(Some(next)) = reply.pop().unwrap() else {
            panic!("no cursor")
        };
        if next == b"0" {
            break;
        }
        cursor = next;
    }
    keys.sort();
    let mut out = String::new();
    for key in keys {
        let kind = text(&raw.call(&[b"TYPE", &key]));
        let value = match kind.as_str() {
            "string" => text(&raw.call(&[b"GET", &key])),
            "hash" => pairs(items(raw.call(&[b"HGETALL", &key]))),
            "zset" => text(&raw.call(&[b"ZRANGE", &key, b"0", b"-1", b"WITHSCORES"])),
            "list" => text(&raw.call(&[b"LRANGE", &key, b"0", b"-1"])),
            "set" => {
                let mut members: Vec<String> = items(raw.call(&[b"SMEMBERS", &key]))
                    .iter()
                    .map(text)
                    .collect();
                members.sort();
                members.join(" ")
            }
            other => panic!("a key of type {other}"),
        };
        let Reply::Int(ttl) = raw.call(&[b"PTTL", &key]) else {
            panic!("PTTL")
        };
        let expires = if ttl >= 0 { "expires" } else { "persists" };
        // The overrides' epoch is drawn at random by whoever writes first.
        let value = if key.ends_with(b"{overrides}:e") {
            "(an epoch)".into()
        } else {
            value
        };
        let name = key[prefix.len()..].escape_ascii().to_string();
        out.push_str(&format!("{name} {kind} {expires}: {value}\n"));
    }
    out
}

/// A hash's fields and values, sorted by field.
fn pairs(flat: Vec<Reply>) -> String {
    let mut pairs: Vec<(String, String)> =
        flat.chunks(2).map(|p| (text(&p[0]), text(&p[1]))).collect();
    pairs.sort();
    let pairs: Vec<String> = pairs.into_iter().map(|(f, v)| format!("{f}={v}")).collect();
    pairs.join(" ")
}

/// What each trace leaves: its values, then its snapshot's file; the traces the start commit
/// ran, then those newer than it (`NEWER`).
fn written(url: &str, port: u16) -> (String, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut raw = Raw(BufReader::new(stream));
    let limits = limits();
    let (mut out, mut newer) = (String::new(), String::new());
    for (n, (name, trace)) in traces().into_iter().enumerate() {
        let prefix = format!("fmt{n}:");
        let clock = ManualClock::new(simulate::EPOCH_US);
        let snapshot = runtime.block_on(async {
            let backend = caller_time_backend(url, &prefix, &clock, false).await;
            let limiter = Limiter::new(limits.clone(), backend);
            conformance::simulate_with(&limiter, &clock, &trace).await;
            let reader = RedisBackend::from_url(url)
                .prefix(&prefix)
                .caller_time(clock.clone());
            Snapshot::from_redis(reader, &limits, 100_000)
                .await
                .unwrap()
        });
        let mut file = Vec::new();
        snapshot.write(&mut file).unwrap();
        let file = String::from_utf8(file).unwrap();
        let (header, keys) = file.split_once('\n').unwrap();
        let mut keys: Vec<&str> = keys.lines().collect();
        keys.sort();
        let values = dump(&mut raw, &prefix);
        let section = format!(
            "### {name}: values\n{values}### {name}: snapshot\n{header}\n{}",
            keys.iter().map(|k| format!("{k}\n")).collect::<String>()
        );
        let into = if NEWER.contains(&name.as_str()) {
            &mut newer
        } else {
            &mut out
        };
        into.push_str(&leases_named(&section));
    }
    (out, newer)
}

/// `text` with each lease id, a number a limiter draws from a random start, written as its
/// place among them (1 for the least): the ids are a sorted set's members, the second field
/// of a pool's lease line (`L=`) and the first of each `[id, deadline]` in a snapshot's
/// `leases`.
fn leases_named(text: &str) -> String {
    let mut ids = BTreeSet::new();
    for line in text.lines() {
        if let Some((_, members)) = line.split_once(" zset expires: ") {
            let members = members.split(' ').step_by(2);
            ids.extend(members.filter_map(|m| m.parse::<u64>().ok()));
        }
        if let Some((_, leases)) = line.split_once(" L=") {
            let leases = leases.split(' ').next().unwrap_or("").split("\\n");
            ids.extend(leases.filter_map(|l| l.split("\\t").nth(1)?.parse::<u64>().ok()));
        }
        if let Ok(json) = serde_json::from_str::<serde_json::Value>(line) {
            snapshot_leases(&json, &mut ids);
        }
    }
    let Some(&least) = ids.first() else {
        return text.to_owned();
    };
    let mut out = String::new();
    let mut run = String::new();
    for c in text.chars().chain(['\n']) {
        if c.is_ascii_digit() {
            run.push(c);
            continue;
        }
        match run.parse::<u64>() {
            Ok(n) if ids.contains(&n) => out.push_str(&(n - least + 1).to_string()),
            _ => out.push_str(&run),
        }
        run.clear();
        out.push(c);
    }
    out.pop();
    out
}

/// The lease ids in a snapshot's line: the first of each pair under a `leases` field.
fn snapshot_leases(json: &serde_json::Value, ids: &mut BTreeSet<u64>) {
    match json {
        serde_json::Value::Object(fields) => {
            for (name, value) in fields {
                match (name.as_str(), value.as_array()) {
                    ("leases", Some(pairs)) => {
                        ids.extend(pairs.iter().filter_map(|p| p.as_array()?.first()?.as_u64()))
                    }
                    _ => snapshot_leases(value, ids),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|i| snapshot_leases(i, ids)),
        _ => {}
    }
}

/// The snapshot files in `written`, each as its own text.
fn snapshot_files(written: &str) -> Vec<String> {
    let mut files = Vec::new();
    for section in written.split("### ").skip(1) {
        let (title, body) = section.split_once('\n').unwrap();
        if title.ends_with(": snapshot") {
            files.push(body.to_owned());
        }
    }
    files
}

#[test]
fn the_store_holds_and_a_snapshot_writes_what_the_start_commit_wrote() {
    let server = RedisServer::start();
    let (now, newer) = written(&server.url(), server.port);
    if std::env::var_os("TRL_WRITE_STORED").is_some() {
        std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/data")).unwrap();
        std::fs::write(WRITTEN, &now).unwrap();
        std::fs::write(WRITTEN_NEWER, &newer).unwrap();
        return;
    }
    for (file, now) in [(WRITTEN, &now), (WRITTEN_NEWER, &newer)] {
        let then = std::fs::read_to_string(file).unwrap();
        for (line, (t, n)) in then.lines().zip(now.lines()).enumerate() {
            assert_eq!(n, t, "line {} of {file}", line + 1);
        }
        assert_eq!(now.lines().count(), then.lines().count(), "{file}");
    }
    let then = std::fs::read_to_string(WRITTEN).unwrap();
    assert!(
        std::fs::read_to_string(WRITTEN_NEWER)
            .unwrap()
            .contains("\"penalty\""),
        "no penalty line in the newer snapshots"
    );
    // Every shape left a state, and the pool its own.
    for kind in ["\"gcra\"", "\"tiers\"", "\"leases\"", "\"calendar\""] {
        assert!(then.contains(kind), "no {kind} line in a snapshot");
    }
    assert!(then.contains("Pool4"), "the pooled limit wrote nothing");
}

#[test]
fn a_snapshot_file_the_start_commit_wrote_loads_and_writes_back_the_same() {
    let then = std::fs::read_to_string(WRITTEN).unwrap();
    let mut files = snapshot_files(&then);
    assert!(files.len() >= 9, "{} snapshot files", files.len());
    files.extend(snapshot_files(
        &std::fs::read_to_string(WRITTEN_NEWER).unwrap(),
    ));
    for file in files {
        let read = Snapshot::read(file.as_bytes()).unwrap();
        let mut again = Vec::new();
        read.write(&mut again).unwrap();
        assert_eq!(String::from_utf8(again).unwrap(), file);
    }
}
