//! Real Redis servers for the tests: a single `redis-server` and a 3-master Redis Cluster on
//! loopback, spawned by the test and stopped when dropped.
//!
//! Each server runs under a small `sh` watchdog that holds the server's pid and kills it
//! (SIGKILL) when its stdin closes: when the handle is dropped, and also when the test process
//! dies without running destructors, so no server outlives the tests.
//!
//! `.ci/run` may start the servers itself and pass `TRL_TEST_REDIS_URL` and
//! `TRL_TEST_REDIS_CLUSTER_URL`; tests that only need *a* server use those when set (each test
//! uses its own key prefix), tests that kill servers always spawn their own.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    stdin: Option<ChildStdin>,
    dir: PathBuf,
    /// The arguments beyond the port and the directory, for a restart.
    extra: Vec<String>,
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A free loopback port `p` whose cluster bus port `p + 10000` is free as well, both below the
/// kernel's ephemeral range (32768 and up by default), where an outgoing connection's local
/// port could take one after the check.
pub fn free_port() -> u16 {
    let seed = std::process::id() as u64 * 7919 + NEXT.fetch_add(1, Ordering::Relaxed) as u64;
    for i in 0..2000u64 {
        let port = 10000 + ((seed * 31 + i * 97) % 12000) as u16;
        if port_free(port) && port_free(port + 10000) {
            return port;
        }
    }
    panic!("no free port pair found");
}

/// Sends one inline command and returns the raw reply (first read).
pub fn command(port: u16, cmd: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("{cmd}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl RedisServer {
    /// A server on a free port.
    pub fn start() -> Self {
        Self::start_on(free_port(), &[])
    }

    /// A server that writes every command to its append-only file before answering: killed
    /// and [restarted](Self::restart), it holds what it held.
    pub fn start_durable() -> Self {
        Self::start_on(
            free_port(),
            &["--appendonly", "yes", "--appendfsync", "always"],
        )
    }

    /// A server on `port` with extra arguments.
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "trl-redis-{}-{}-{}",
            std::process::id(),
            port,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        let (child, stdin) = Self::spawn(port, &dir, &extra);
        Self {
            port,
            child,
            stdin,
            dir,
            extra,
        }
    }

    /// Starts the server again, on its port and in its directory, after a [`kill`](Self::kill).
    pub fn restart(&mut self) {
        let (child, stdin) = Self::spawn(self.port, &self.dir, &self.extra);
        self.child = child;
        self.stdin = stdin;
    }

    fn spawn(port: u16, dir: &std::path::Path, extra: &[String]) -> (Child, Option<ChildStdin>) {
        let port_s = port.to_string();
        let dir_s = dir.display().to_string();
        let mut args = vec![
            "--port",
            &port_s,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            &dir_s,
            "--loglevel",
            "warning",
        ];
        args.extend(extra.iter().map(String::as_str));
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(r#"redis-server "$@" >/dev/null 2>&1 & pid=$!; read _; kill -9 $pid; wait $pid"#)
            .arg("sh")
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed? `apt-get install -y redis-server`)");
        let stdin = child.stdin.take();
        wait_until(&format!("redis-server on port {port}"), || {
            command(port, "PING").is_ok_and(|r| r.starts_with("+PONG"))
        });
        (child, stdin)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the server as an operator does (`SHUTDOWN SAVE`: its data saved to its dump,
    /// which a [`restart`](Self::restart) loads), and waits until it is gone.
    pub fn shutdown_save(&mut self) {
        let _ = command(self.port, "SHUTDOWN SAVE");
        self.kill();
    }

    /// Kills the server (SIGKILL) and waits until it is gone.
    pub fn kill(&mut self) {
        self.stdin.take();
        let _ = self.child.wait();
        let port = self.port;
        wait_until("the server to stop", || command(port, "PING").is_err());
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stdin.take();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of 3 masters and no replicas on loopback. A node that is down leaves only
/// its own slots unavailable (`cluster-require-full-coverage no`).
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_on(
                    free_port(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-require-full-coverage",
                        "no",
                    ],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for n in &nodes {
            let port = n.port;
            wait_until("cluster_state:ok", || {
                command(port, "CLUSTER INFO").is_ok_and(|r| {
                    r.contains("cluster_state:ok") && r.contains("cluster_known_nodes:3")
                })
            });
        }
        Self { nodes }
    }

    pub fn url(&self) -> String {
        let mut url = format!("redis-cluster://127.0.0.1:{}", self.nodes[0].port);
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            url.push_str(if i == 1 { "?" } else { "&" });
            url.push_str(&format!("node=127.0.0.1:{}", n.port));
        }
        url
    }

    /// The index of the node serving `slot`.
    pub fn node_of_slot(&self, slot: u16) -> usize {
        // CLUSTER NODES is easier to parse: "<id> <ip:port@bus> <flags> ... <slot ranges>".
        let nodes = command(self.nodes[0].port, "CLUSTER NODES").expect("CLUSTER NODES");
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 {
                continue;
            }
            let port: u16 = fields[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            for range in &fields[8..] {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>())
                    && (a..=b).contains(&slot)
                {
                    return self
                        .nodes
                        .iter()
                        .position(|n| n.port == port)
                        .expect("a node of this cluster");
                }
            }
        }
        panic!("slot {slot} is not served");
    }
}

/// A server to run tests against: the one `.ci/run` started, or a new one.
pub struct TestRedis {
    pub url: String,
    _single: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

impl TestRedis {
    pub fn single() -> Self {
        if let Ok(url) = std::env::var("TRL_TEST_REDIS_URL") {
            return Self {
                url,
                _single: None,
                _cluster: None,
            };
        }
        let server = RedisServer::start();
        Self {
            url: server.url(),
            _single: Some(server),
            _cluster: None,
        }
    }

    /// The store matrix of the Redis tests: a single server, then the cluster, each with
    /// the name a failing test prints (`on <name>`) before it runs there.
    pub fn each() -> impl Iterator<Item = Self> {
        [
            ("a single Redis", Self::single as fn() -> Self),
            ("the cluster", Self::cluster),
        ]
        .into_iter()
        .map(|(name, start)| {
            eprintln!("on {name}");
            start()
        })
    }

    pub fn cluster() -> Self {
        if let Ok(url) = std::env::var("TRL_TEST_REDIS_CLUSTER_URL") {
            return Self {
                url,
                _single: None,
                _cluster: None,
            };
        }
        let cluster = RedisCluster::start();
        Self {
            url: cluster.url(),
            _single: None,
            _cluster: Some(cluster),
        }
    }
}

/// A key prefix no other test uses.
pub fn unique_prefix(test: &str) -> String {
    format!(
        "t:{}:{}:{}:",
        test,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
