//! The quickstart examples as an operator runs them: the real binaries (`axum_memory`,
//! `axum_redis`), their `GET /metrics` scraped over HTTP and parsed by a Prometheus text
//! parser, `RATELIMITS_SHADOW`, and their overrides file edited while they run.
//!
//! The binaries are built by `cargo test` (examples are test targets' companions); the
//! limits here refill once an hour, so counts do not depend on the machine's speed.

mod support;

use support::examples::example_binary;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const DEFAULTS: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 5
  count: 5
  period: 1h
RequestsPerIPv6Range:
  kind: ipv6_range
  burst: 100
  count: 100
  period: 1h
";

/// A running example: killed when dropped.
struct Example {
    child: Child,
    base: String,
    stderr: mpsc::Receiver<String>,
    dir: PathBuf,
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            // What the example logged, to read why a test failed.
            for line in self.stderr.try_iter() {
                eprintln!("[{}] {line}", self.base);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Example {
    /// Starts `name` on a free port with `DEFAULTS`, empty overrides, 127.0.0.1 trusted as a
    /// proxy (so the test names clients in `X-Forwarded-For`), and `env`.
    fn start(name: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(name, DEFAULTS, env)
    }

    /// [`start`](Self::start) with other default limits.
    fn start_with(name: &str, defaults: &str, env: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "trl-example-{name}-{}-{}",
            std::process::id(),
            support::redis::free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("defaults.yaml"), defaults).unwrap();
        std::fs::write(dir.join("overrides.yaml"), "[]\n").unwrap();
        let mut command = Command::new(example_binary(name));
        command
            .env("ADDR", "127.0.0.1:0")
            .env("RATELIMITS_DEFAULTS", dir.join("defaults.yaml"))
            .env("RATELIMITS_OVERRIDES", dir.join("overrides.yaml"))
            .env("RATELIMITS_TRUSTED_PROXIES", "127.0.0.1/32")
            .env("RUST_LOG", "info")
            .env_remove("RATELIMITS_SHADOW")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e} (built by `cargo test --all-features`)"));
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (addr_tx, addr_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("listening on ") {
                    let base = rest.split_whitespace().next().unwrap_or("").to_owned();
                    let _ = addr_tx.send(base);
                }
            }
        });
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (err_tx, err_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let _ = err_tx.send(line);
            }
        });
        let base = match addr_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                let logs: Vec<String> = err_rx.try_iter().collect();
                panic!("{name} did not start: {logs:?}");
            }
        };
        Self {
            child,
            base,
            stderr: err_rx,
            dir,
        }
    }

    fn overrides(&self) -> PathBuf {
        self.dir.join("overrides.yaml")
    }

    /// Waits (bounded) until `GET /ready` answers 200: on Redis, once the instance read the
    /// stored overrides whole (a lazy connection reads them in the background).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    async fn until_ready(&self) {
        let client = reqwest_like::Client::new();
        for _ in 0..600 {
            if get(&client, &self.base, "/ready", None).await.0 == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} never became ready", self.base);
    }

    /// Waits for a log line containing `needle` (the reload is asynchronous), returning it.
    fn log_line(&self, needle: &str) -> String {
        loop {
            match self.stderr.recv_timeout(Duration::from_secs(30)) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => continue,
                Err(_) => panic!("no log line with {needle:?}"),
            }
        }
    }
}

async fn get(
    client: &reqwest_like::Client,
    base: &str,
    path: &str,
    forwarded: Option<&str>,
) -> (u16, String) {
    client.get(base, path, forwarded).await
}

/// A minimal HTTP/1.1 client over hyper.
mod reqwest_like {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client as Hyper;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    pub struct Client(Hyper<HttpConnector, Full<Bytes>>);

    impl Client {
        pub fn new() -> Self {
            Self(Hyper::builder(TokioExecutor::new()).build_http())
        }

        pub async fn get(&self, base: &str, path: &str, forwarded: Option<&str>) -> (u16, String) {
            let (status, _, body) = self.get_with_headers(base, path, forwarded).await;
            (status, body)
        }

        pub async fn get_with_headers(
            &self,
            base: &str,
            path: &str,
            forwarded: Option<&str>,
        ) -> (u16, http::HeaderMap, String) {
            let mut req = http::Request::get(format!("{base}{path}"));
            if let Some(f) = forwarded {
                req = req.header("x-forwarded-for", f);
            }
            let res = self
                .0
                .request(req.body(Full::new(Bytes::new())).unwrap())
                .await
                .unwrap();
            let status = res.status().as_u16();
            let headers = res.headers().clone();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (status, headers, String::from_utf8_lossy(&body).into_owned())
        }
    }
}

/// The scrape, parsed by `prometheus-parse`: value by metric name and sorted labels.
struct Scrape(HashMap<String, f64>);

impl Scrape {
    async fn of(client: &reqwest_like::Client, base: &str) -> Self {
        let (status, text) = get(client, base, "/metrics", None).await;
        assert_eq!(status, 200);
        Scrape(support::scrape::samples(&text))
    }

    /// A sample's value; a series never written is 0.
    fn get(&self, key: &str) -> f64 {
        self.0.get(key).copied().unwrap_or(0.0)
    }

    fn decisions(&self, limit: &str, outcome: &str) -> f64 {
        self.get(&format!(
            "tower_ratelimits_decisions_total{{limit={limit},outcome={outcome}}}"
        ))
    }

    fn requests(&self, outcome: &str) -> f64 {
        self.get(&format!(
            "tower_ratelimits_requests_total{{outcome={outcome}}}"
        ))
    }
}

/// The scripted sequence: 7 requests from one client (5 allowed, 2 denied by the per-IP
/// limit) and one whose forwarded address is garbage (400, rejected by the per-IP rule).
async fn script(client: &reqwest_like::Client, base: &str, expect_denials: bool) {
    for n in 0..7 {
        let (status, _) = get(client, base, "/", Some("198.51.100.1")).await;
        let expected = if n < 5 || !expect_denials { 200 } else { 429 };
        assert_eq!(status, expected, "request {n}");
    }
    let (status, _) = get(client, base, "/", Some("not-an-address")).await;
    assert_eq!(status, 400);
}

fn assert_counts(m: &Scrape, shadow: bool) {
    let ip = "RequestsPerIPAddress";
    assert_eq!(m.decisions(ip, "allowed"), 5.0);
    assert_eq!(
        m.decisions(ip, if shadow { "shadow_denied" } else { "denied" }),
        2.0
    );
    assert_eq!(
        m.decisions(ip, if shadow { "denied" } else { "shadow_denied" }),
        0.0
    );
    assert_eq!(m.decisions(ip, "rejected"), 1.0);
    // The range rule's own limit allowed all 7: a request another rule denied is not its
    // denial, but nothing was spent either (`batch_denied`, not `allowed`).
    let range = "RequestsPerIPv6Range";
    assert_eq!(
        m.decisions(range, "allowed"),
        if shadow { 7.0 } else { 5.0 }
    );
    assert_eq!(
        m.decisions(range, "batch_denied"),
        if shadow { 0.0 } else { 2.0 }
    );
    assert_eq!(m.decisions(range, "denied"), 0.0);
    assert_eq!(m.requests("allowed"), if shadow { 7.0 } else { 5.0 });
    assert_eq!(m.requests("denied"), if shadow { 0.0 } else { 2.0 });
    assert_eq!(m.requests("rejected"), 1.0);
}

/// Replaces a watched file whole: written beside it, then renamed over it, so the watcher
/// never reads it half-written (`std::fs::write` truncates first: a watcher that read the
/// empty file in between refused "the file is empty" instead of the error under test).
fn replace_file(path: &Path, text: &str) {
    let next = path.with_extension("yaml.next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// Edits the overrides while the example runs: the log says what changed, and the client
/// denied above gets the override's room from the next request; then a broken file is
/// refused with its location and the override keeps working.
async fn reload(example: &Example, client: &reqwest_like::Client) {
    replace_file(
        &example.overrides(),
        "- RequestsPerIPAddress: {burst: 8, count: 8, period: 2h, ids: [198.51.100.1]}\n",
    );
    let line = example.log_line("rate limits reloaded");
    assert!(line.contains("changed: RequestsPerIPAddress"), "{line}");
    // The drained bucket's state is kept and read under the override: its stored TAT is an
    // hour ahead (5 spends at 12 min), and 8 per 2 h (15 min each, a 2 h burst offset) leaves
    // room for 4 more.
    for n in 0..4 {
        let (status, _) = get(client, &example.base, "/", Some("198.51.100.1")).await;
        assert_eq!(status, 200, "request {n} under the override");
    }
    let (status, _) = get(client, &example.base, "/", Some("198.51.100.1")).await;
    assert_eq!(status, 429);

    replace_file(
        &example.overrides(),
        "- RequestsPerIPAddress: {burst: -1}\n",
    );
    let line = example.log_line("not reloaded");
    let location = format!("{}:1", example.overrides().display());
    assert!(line.contains(&location), "{line}");
    let (status, _) = get(client, &example.base, "/", Some("198.51.100.2")).await;
    assert_eq!(status, 200, "the previous limits keep deciding");
}

fn skip_unless_built(name: &str) -> bool {
    let built = Path::new(&example_binary(name)).exists();
    assert!(
        built,
        "{} is missing: run the tests with `cargo test --workspace --all-features`",
        example_binary(name).display()
    );
    built
}

#[tokio::test]
async fn axum_memory_counts_every_outcome_on_metrics_and_reloads_its_overrides() {
    skip_unless_built("axum_memory");
    let example = Example::start("axum_memory", &[]);
    let client = reqwest_like::Client::new();
    script(&client, &example.base, true).await;
    let m = Scrape::of(&client, &example.base).await;
    assert_counts(&m, false);
    reload(&example, &client).await;
    replace_file(&example.overrides(), "[]\n");
    let line = example.log_line("rate limits reloaded");
    assert!(line.contains("changed: RequestsPerIPAddress"), "{line}");
    // SIGHUP reloads even when nothing changed.
    let hup = Command::new("kill")
        .args(["-HUP", &example.child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let line = example.log_line("rate limits reloaded");
    assert!(line.contains("no limit changed"), "{line}");
}

/// `RATELIMITS_ADMIN_ADDR` serves the admin API: a block set through it denies with its
/// `Retry-After`, is logged with the principal, and counts on the stored-overrides gauge (a
/// real Prometheus scrape); removing it lets the client through again.
#[tokio::test]
async fn axum_memory_serves_the_admin_api_on_ratelimits_admin_addr() {
    skip_unless_built("axum_memory");
    let port = support::redis::free_port();
    let admin_addr = format!("127.0.0.1:{port}");
    let example = Example::start("axum_memory", &[("RATELIMITS_ADMIN_ADDR", &admin_addr)]);
    let admin = support::http::HttpClient::for_base(&format!("http://{admin_addr}"));
    let client = reqwest_like::Client::new();
    let put = admin
        .send(
            http::Method::PUT,
            "/overrides/RequestsPerIPAddress/198.51.100.9",
            &[("x-admin-principal", "ops@example.com")],
            r#"{"block": true, "expires_in": "1h"}"#,
        )
        .await;
    assert_eq!(put.status, 200, "{}", put.body);
    let line = example.log_line("override set");
    assert!(line.contains("ops@example.com"), "{line}");
    assert!(line.contains("198.51.100.9"), "{line}");
    let (status, headers, _) = client
        .get_with_headers(&example.base, "/", Some("198.51.100.9"))
        .await;
    assert_eq!(status, 429);
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3595..=3600).contains(&retry), "Retry-After {retry}");
    let m = Scrape::of(&client, &example.base).await;
    assert_eq!(m.get("tower_ratelimits_stored_overrides{}"), 1.0);
    let delete = admin
        .request(
            http::Method::DELETE,
            "/overrides/RequestsPerIPAddress/198.51.100.9",
            &[("x-admin-principal", "ops@example.com")],
        )
        .await;
    assert_eq!(delete.status, 204);
    let (status, _) = get(&client, &example.base, "/", Some("198.51.100.9")).await;
    assert_eq!(status, 200);
    let m = Scrape::of(&client, &example.base).await;
    // Set back to 0, not absent (`get` reads an absent series as 0).
    assert_eq!(m.0.get("tower_ratelimits_stored_overrides{}"), Some(&0.0));
}

#[tokio::test]
async fn axum_memory_in_shadow_answers_everything_and_counts_what_it_would_deny() {
    skip_unless_built("axum_memory");
    let example = Example::start("axum_memory", &[("RATELIMITS_SHADOW", "on")]);
    let client = reqwest_like::Client::new();
    script(&client, &example.base, false).await;
    assert_counts(&Scrape::of(&client, &example.base).await, true);
}

#[tokio::test]
async fn an_unknown_name_in_ratelimits_shadow_is_refused() {
    skip_unless_built("axum_memory");
    let out = Command::new(example_binary("axum_memory"))
        .env("ADDR", "127.0.0.1:0")
        .env("RATELIMITS_SHADOW", "RequestsPerIPAddress,NoSuchLimit")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("\"NoSuchLimit\" is not a configured limit"),
        "{stderr}"
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn axum_redis_counts_outcomes_round_trips_and_deny_cache_hits_and_reloads() {
    skip_unless_built("axum_redis");
    // A private server: the example writes under the default prefix.
    let redis = support::redis::RedisServer::start();
    let url = redis.url();
    let example = Example::start("axum_redis", &[("REDIS_URL", url.as_str())]);
    example.until_ready().await;
    let client = reqwest_like::Client::new();
    script(&client, &example.base, true).await;
    let m = Scrape::of(&client, &example.base).await;
    assert_counts(&m, false);
    // Requests 1-6 went to Redis (one script each); the 7th was denied by the deny cache.
    assert_eq!(m.get("tower_ratelimits_redis_round_trips_total{}"), 6.0);
    assert_eq!(m.get("tower_ratelimits_redis_deny_cache_hits_total{}"), 1.0);
    assert_eq!(
        m.get("tower_ratelimits_backend_duration_seconds_count{op=spend}"),
        6.0
    );
    reload(&example, &client).await;
}

/// The measure over TCP: one hot key behind two `axum_redis` processes on one Redis
/// (and on a 3-master cluster), both of the example's limits with `prefetch: 50` (burst 500,
/// 300 per second), loaded for 3 s by 16 keep-alive clients spread over both, above the limit
/// (600/s) and at half of it (150/s). Admitted never above burst + rate x elapsed (elapsed
/// from the first request sent to the last answer, so the bound is generous to the server,
/// never to the test), at least 80% of it above the limit and every request at half of it,
/// and at most one script call (`INFO commandstats`) per 10 admitted. On the cluster the two
/// limits' keys live in two slots, so a request that refills both makes two calls: there the
/// bound is one call per 10 admitted per slot (summed over the masters).
#[cfg(feature = "redis")]
#[tokio::test]
async fn two_axum_redis_instances_share_a_hot_key_with_prefetched_tokens() {
    skip_unless_built("axum_redis");
    for (per_second, client) in [(600, "198.51.100.7"), (150, "198.51.100.8")] {
        let redis = support::redis::RedisServer::start();
        hot_key_over_tcp(&redis.url(), &[redis.port], 1, per_second, client, 2, 3).await;
        let cluster = support::redis::RedisCluster::start();
        let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
        hot_key_over_tcp(&cluster.url(), &ports, 2, per_second, client, 2, 3).await;
    }
}

/// The same hot key behind eight `axum_redis` processes on one Redis, above the limit (600/s,
/// 75/s each) for 6 s: the bounds above, and still at most one script call per 10 admitted.
/// Each instance waits for its refill expecting the others' part of the refill to be taken:
/// about 0.045 calls per admitted. Before, an instance called when Redis's last word alone said
/// its refill fitted, and most of the eight instances' calls were denied refills: 0.125.
#[cfg(feature = "redis")]
#[tokio::test]
async fn eight_axum_redis_instances_share_a_hot_key_with_few_calls() {
    skip_unless_built("axum_redis");
    let redis = support::redis::RedisServer::start();
    let (admitted, calls) =
        hot_key_over_tcp(&redis.url(), &[redis.port], 1, 600, "198.51.100.9", 8, 6).await;
    eprintln!(
        "{:.3} script calls per admitted",
        calls as f64 / admitted as f64
    );
}

/// Two `axum_redis` processes, each serving the admin API on `RATELIMITS_ADMIN_ADDR`: a block
/// set through the first applies on the second within two seconds (polled), with its
/// `Retry-After`; deleted through the second, it ends on the first. On a single Redis and on a
/// cluster, each its own (the examples' key prefix is fixed).
#[cfg(feature = "redis")]
#[tokio::test]
async fn two_axum_redis_instances_share_overrides_set_through_either_admin_api() {
    skip_unless_built("axum_redis");
    let single = support::redis::RedisServer::start();
    let cluster = support::redis::RedisCluster::start();
    for url in [single.url(), cluster.url()] {
        let admins: Vec<String> = (0..2)
            .map(|_| format!("127.0.0.1:{}", support::redis::free_port()))
            .collect();
        let instances: Vec<Example> = admins
            .iter()
            .map(|admin| {
                Example::start(
                    "axum_redis",
                    &[
                        ("REDIS_URL", url.as_str()),
                        ("RATELIMITS_ADMIN_ADDR", admin),
                    ],
                )
            })
            .collect();
        for instance in &instances {
            instance.until_ready().await;
        }
        let admin =
            |i: usize| support::http::HttpClient::for_base(&format!("http://{}", admins[i]));
        let client = reqwest_like::Client::new();
        let path = "/overrides/RequestsPerIPAddress/198.51.100.66";
        let put = admin(0)
            .send(
                http::Method::PUT,
                path,
                &[("x-admin-principal", "ops")],
                r#"{"block": true, "expires_in": "10m"}"#,
            )
            .await;
        assert_eq!(put.status, 200, "{}", put.body);
        // Polled by inspection (nothing spent), then asked once.
        let bucket = "/buckets/RequestsPerIPAddress/198.51.100.66";
        let start = std::time::Instant::now();
        while !admin(1)
            .get(bucket, &[])
            .await
            .body
            .contains(r#""block":true"#)
        {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "the second instance did not apply the block within 2 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (status, headers, _) = client
            .get_with_headers(&instances[1].base, "/", Some("198.51.100.66"))
            .await;
        assert_eq!(status, 429);
        let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((595..=600).contains(&retry), "Retry-After {retry}");
        let delete = admin(1).request(http::Method::DELETE, path, &[]).await;
        assert_eq!(delete.status, 204);
        let start = std::time::Instant::now();
        while !admin(0)
            .get(bucket, &[])
            .await
            .body
            .contains(r#""source":"default""#)
        {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "the first instance kept the deleted block"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (status, _) = get(&client, &instances[0].base, "/", Some("198.51.100.66")).await;
        assert_eq!(status, 200);
    }
}

/// One run of the measure above on the store at `url` (whose servers listen on `ports`; a
/// request's keys span `slots` slots there).
#[cfg(feature = "redis")]
async fn hot_key_over_tcp(
    url: &str,
    ports: &[u16],
    slots: u64,
    per_second: u64,
    client: &str,
    count: usize,
    seconds: u64,
) -> (u64, u64) {
    const PREFETCHING: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 500
  count: 300
  period: 1s
  prefetch: 50
RequestsPerIPv6Range:
  kind: ipv6_range
  burst: 500
  count: 300
  period: 1s
  prefetch: 50
";
    let env = [("REDIS_URL", url)];
    let instances: Vec<Example> = (0..count)
        .map(|_| Example::start_with("axum_redis", PREFETCHING, &env))
        .collect();
    for instance in &instances {
        instance.until_ready().await;
    }
    let calls = || -> u64 {
        ports
            .iter()
            .map(|&port| {
                support::redis_backend::commandstat(port, "evalsha")
                    + support::redis_backend::commandstat(port, "eval")
            })
            .sum()
    };
    let before = calls();
    let bases: Vec<String> = instances.iter().map(|e| e.base.clone()).collect();
    let (admitted, sent, elapsed) = paced_load(&bases, client, per_second, seconds).await;
    let calls = calls() - before;
    let bound = 500 + (300.0 * elapsed.as_secs_f64()).ceil() as u64;
    eprintln!(
        "{url}, {count} instances, {per_second}/s: {admitted} admitted of {sent} in {elapsed:?} \
         (bound {bound}), {calls} script calls"
    );
    assert!(admitted <= bound, "{admitted} admitted, above {bound}");
    let expected = bound.min(sent);
    let least = if per_second > 300 {
        expected * 8 / 10
    } else {
        sent
    };
    assert!(admitted >= least, "{admitted} admitted, fewer than {least}");
    assert!(
        calls * 10 <= admitted * slots,
        "{calls} script calls for {admitted} admitted ({slots} slots)"
    );
    let http = reqwest_like::Client::new();
    let local = "tower_ratelimits_prefetch_local_decisions_total{decision=allowed,limit=RequestsPerIPAddress}";
    for example in &instances {
        let m = Scrape::of(&http, &example.base).await;
        assert!(m.get(local) > 0.0, "{}: no local decision", example.base);
        assert!(m.get("tower_ratelimits_prefetch_refills_total{limit=RequestsPerIPAddress}") > 0.0);
    }
    (admitted, calls)
}

/// Chaos over TCP: two `axum_redis` processes take prefetched tokens of one key (a limit that
/// refills one token in 7.2 s, so the counts are the burst's), then one stops. Killed
/// (`SIGKILL`), the tokens it held are lost to the other: together they admit fewer than the
/// burst, never more. Interrupted (Ctrl-C), it gives them back as it shuts down: the other
/// then admits the whole rest of the burst.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_stopped_axum_redis_instance_never_lets_its_prefetched_tokens_over_admit() {
    const SLOW: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 500
  count: 500
  period: 1h
  prefetch: 50
RequestsPerIPv6Range:
  kind: ipv6_range
  burst: 500
  count: 500
  period: 1h
";
    skip_unless_built("axum_redis");
    let client = reqwest_like::Client::new();
    for killed in [true, false] {
        let redis = support::redis::RedisServer::start();
        let url = redis.url();
        let env = [("REDIS_URL", url.as_str())];
        let mut a = Example::start_with("axum_redis", SLOW, &env);
        let b = Example::start_with("axum_redis", SLOW, &env);
        a.until_ready().await;
        b.until_ready().await;
        let started = std::time::Instant::now();
        let mut admitted = 0;
        for _ in 0..60 {
            for example in [&a, &b] {
                let (status, _) = get(&client, &example.base, "/", Some("198.51.100.9")).await;
                admitted += u64::from(status == 200);
            }
        }
        assert_eq!(admitted, 120);
        if killed {
            a.child.kill().unwrap();
        } else {
            let pid = a.child.id().to_string();
            assert!(
                Command::new("kill")
                    .args(["-INT", &pid])
                    .status()
                    .unwrap()
                    .success()
            );
        }
        a.child.wait().unwrap();
        loop {
            let (status, _) = get(&client, &b.base, "/", Some("198.51.100.9")).await;
            if status != 200 {
                break;
            }
            admitted += 1;
            assert!(admitted <= 501, "more than the burst admitted");
        }
        // One token refills every 7.2 s.
        let refilled = started.elapsed().as_secs() / 7 + 1;
        assert!(admitted <= 500 + refilled, "{admitted} admitted");
        if killed {
            assert!(
                admitted >= 500 - 50,
                "{admitted}: at most what `a` held is lost"
            );
            assert!(admitted < 500, "{admitted}: what `a` held is lost");
        } else {
            assert!(admitted >= 500, "{admitted}: `a` gave its tokens back");
        }
    }
}

/// Sends `per_second` requests a second for `seconds` from `client` (an `X-Forwarded-For`
/// address: one hot key) over 8 keep-alive connections per instance: the requests admitted,
/// sent, and the time from the first request to the last answer.
#[cfg(feature = "redis")]
async fn paced_load(
    bases: &[String],
    client: &str,
    per_second: u64,
    seconds: u64,
) -> (u64, u64, Duration) {
    const PER_INSTANCE: u64 = 8;
    let connections = PER_INSTANCE * bases.len() as u64;
    let period = Duration::from_secs_f64(connections as f64 / per_second as f64);
    let each = per_second * seconds / connections;
    let start = std::time::Instant::now();
    let tasks = bases.iter().flat_map(|base| {
        (0..PER_INSTANCE).map(move |_| {
            let (base, client) = (base.clone(), client.to_owned());
            tokio::spawn(async move {
                let http = reqwest_like::Client::new();
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut admitted = 0;
                for _ in 0..each {
                    tick.tick().await;
                    let (status, _) = get(&http, &base, "/", Some(&client)).await;
                    assert!(status == 200 || status == 429, "{status}");
                    admitted += u64::from(status == 200);
                }
                admitted
            })
        })
    });
    let tasks: Vec<_> = tasks.collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    (admitted, each * connections, start.elapsed())
}

/// A dead Redis: under `open` each rule of each request counts `failed_open` and the request
/// passes; under `memory:50` the in-memory fallback decides (at half the limits: burst 2 of 5)
/// and each rule counts `fallback`.
#[cfg(feature = "redis")]
#[tokio::test]
async fn axum_redis_counts_backend_failures_with_the_policy_applied() {
    skip_unless_built("axum_redis");
    let dead = format!("redis://127.0.0.1:{}", support::redis::free_port());
    let client = reqwest_like::Client::new();

    let open = Example::start("axum_redis", &[("REDIS_URL", dead.as_str())]);
    for n in 0..3 {
        let (status, _) = get(&client, &open.base, "/", Some("198.51.100.7")).await;
        assert_eq!(status, 200, "fail open, request {n}");
    }
    let m = Scrape::of(&client, &open.base).await;
    for limit in ["RequestsPerIPAddress", "RequestsPerIPv6Range"] {
        assert_eq!(m.decisions(limit, "failed_open"), 3.0, "{limit}");
        assert_eq!(m.decisions(limit, "allowed"), 0.0, "{limit}");
    }
    assert_eq!(m.requests("backend_failure"), 3.0);
    drop(open);

    let fallback = Example::start(
        "axum_redis",
        &[
            ("REDIS_URL", dead.as_str()),
            ("RATELIMITS_ON_BACKEND_ERROR", "memory:50"),
        ],
    );
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let (status, _) = get(&client, &fallback.base, "/", Some("198.51.100.8")).await;
        statuses.push(status);
    }
    assert_eq!(
        statuses,
        [200, 200, 429, 429],
        "half of a burst of 5, rounded down"
    );
    let m = Scrape::of(&client, &fallback.base).await;
    assert_eq!(m.decisions("RequestsPerIPAddress", "fallback"), 4.0);
    assert_eq!(m.requests("fallback"), 4.0);
}

#[tokio::test]
async fn ratelimits_problem_json_on_makes_the_429_a_problem() {
    skip_unless_built("axum_memory");
    let example = Example::start("axum_memory", &[("RATELIMITS_PROBLEM_JSON", "on")]);
    let client = reqwest_like::Client::new();
    for _ in 0..5 {
        get(&client, &example.base, "/", Some("198.51.100.9")).await;
    }
    let (status, body) = get(&client, &example.base, "/", Some("198.51.100.9")).await;
    assert_eq!(status, 429);
    let p: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        p["violated-policies"],
        serde_json::json!(["RequestsPerIPAddress"])
    );
}

#[tokio::test]
async fn ratelimits_exempt_lets_its_clients_bypass_every_rule() {
    skip_unless_built("axum_memory");
    let example = Example::start("axum_memory", &[("RATELIMITS_EXEMPT", "203.0.113.0/24")]);
    let client = reqwest_like::Client::new();
    for _ in 0..8 {
        let (status, _) = get(&client, &example.base, "/", Some("203.0.113.5")).await;
        assert_eq!(status, 200, "exempt");
    }
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(
            get(&client, &example.base, "/", Some("198.51.100.50"))
                .await
                .0,
        );
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);
}

/// `axum_routes`: two routes with their own limits in one layer, and `/generate` reserving
/// `max_tokens` and settled to the `x-tokens-used` its handler reports, with the settlements on
/// `/metrics`. The limits refill once an hour per unit: every number is exact.
#[tokio::test]
async fn axum_routes_limits_each_route_and_settles_tokens_from_the_response() {
    skip_unless_built("axum_routes");
    let example = Example::start_with(
        "axum_routes",
        "SearchesPerIP: {kind: ip, burst: 3, count: 3, period: 3h}\n\
         TokensPerIP: {kind: ip, burst: 1000, count: 1000, period: 1000h}\n",
        &[],
    );
    let client = reqwest_like::Client::new();
    let who = Some("198.51.100.7");
    let tokens_left = |headers: &http::HeaderMap| -> String {
        let field = headers.get("ratelimit").unwrap().to_str().unwrap();
        assert!(field.starts_with("\"TokensPerIP\";"), "{field}");
        field.split(';').nth(1).unwrap().to_owned()
    };
    // 300 reserved, 10 used: the response already shows 990.
    let (status, headers, body) = client
        .get_with_headers(
            &example.base,
            "/generate?prompt=abcdefghij&max_tokens=300",
            who,
        )
        .await;
    assert_eq!((status, body.as_str()), (200, "generated 10 tokens\n"));
    assert_eq!(headers.get("x-tokens-used").unwrap(), "10");
    assert_eq!(tokens_left(&headers), "r=990");
    // A reservation must fit whole: 995 do not.
    let (status, _, _) = client
        .get_with_headers(
            &example.base,
            "/generate?prompt=abcdefghij&max_tokens=995",
            who,
        )
        .await;
    assert_eq!(status, 429);
    let (status, headers, _) = client
        .get_with_headers(
            &example.base,
            "/generate?prompt=abcdefghij&max_tokens=990",
            who,
        )
        .await;
    assert_eq!((status, tokens_left(&headers)), (200, "r=980".into()));
    // Searches have their own limit; drained, they do not touch the tokens.
    let mut searches = Vec::new();
    for _ in 0..4 {
        searches.push(get(&client, &example.base, "/search?q=rust", who).await.0);
    }
    assert_eq!(searches, [200, 200, 200, 429]);
    let (status, headers, _) = client
        .get_with_headers(&example.base, "/generate?prompt=abcdefghij", who)
        .await;
    assert_eq!((status, tokens_left(&headers)), (200, "r=970".into()));

    let m = Scrape::of(&client, &example.base).await;
    let settled = |what: &str, outcome: &str| {
        m.get(&format!(
            "tower_ratelimits_{what}{{limit=TokensPerIP,outcome={outcome}}}"
        ))
    };
    assert_eq!(settled("settlements_total", "refunded"), 3.0);
    assert_eq!(
        settled("settled_units_total", "refunded"),
        (290 + 980 + 246) as f64,
        "300, 990 and the default 256 reserved, 10 used each"
    );
    assert_eq!(m.decisions("SearchesPerIP", "denied"), 1.0);
    assert_eq!(m.decisions("TokensPerIP", "denied"), 1.0);
    assert_eq!(m.decisions("TokensPerIP", "allowed"), 3.0);
}

/// `axum_calendar`: per account, a monthly quota (3 here) beside a throttle; the quota's
/// fields say what is left and when it renews, and once it is used the 429's `Retry-After`
/// points at the renewal (the 15th at 00:00 UTC, by the wall clock both sides read).
#[tokio::test]
async fn axum_calendar_refuses_at_the_quota_until_the_renewal() {
    if !skip_unless_built("axum_calendar") {
        return;
    }
    let example = Example::start_with(
        "axum_calendar",
        "ApiCallsPerMonth: {kind: account, calendar: {count: 3, period: month, anchor_day: 15}}\n\
         ApiCallsPerSecond: {kind: account, burst: 10, count: 10, period: 1s}\n",
        &[],
    );
    let client = support::http::HttpClient::for_base(&example.base);
    let to_renewal = || {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        let quota = tower_ratelimits::CalendarQuota::new(3, tower_ratelimits::Period::Month)
            .and_then(|q| q.anchor_day(15))
            .unwrap();
        (quota.period_at(now).1 - now).div_ceil(1_000_000)
    };
    for left in [2, 1, 0] {
        let r = client.get("/", &[("x-account", "42")]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let fields = r.header("ratelimit").unwrap().to_owned();
        let t = to_renewal();
        // The seconds to the renewal, read a moment apart on both sides.
        assert!(
            (t.saturating_sub(1)..=t + 1)
                .any(|t| fields.contains(&format!("\"ApiCallsPerMonth\";r={left};t={t}"))),
            "{fields} (t about {t})"
        );
    }
    let r = client.get("/", &[("x-account", "42")]).await;
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(
        retry.abs_diff(to_renewal()) <= 1,
        "{retry} vs {}",
        to_renewal()
    );
    // Another account has its own quota; a request without one is refused with a 400.
    assert_eq!(client.get("/", &[("x-account", "7")]).await.status, 200);
    assert_eq!(client.get("/", &[]).await.status, 400);
}

/// `axum_fair_share`: a tenant alone takes the whole budget (6 here, refilled once an hour, so
/// nothing refills during the test); a second tenant, under its share, is then refused with
/// the budget's fields and a `Retry-After` of the budget's refill; an override's weight is
/// read from `RATELIMITS_OVERRIDES`, and a budget changed by an override is refused at start.
#[tokio::test]
async fn axum_fair_share_lends_the_whole_budget_to_a_tenant_alone() {
    if !skip_unless_built("axum_fair_share") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("trl-fair-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let overrides = dir.join("overrides.yaml");
    std::fs::write(
        &overrides,
        "- ApiPerTenant: {burst: 6, count: 6, period: 1h, fair_share: {weight: 3}, ids: [acme]}\n",
    )
    .unwrap();
    let overrides = overrides.display().to_string();
    let example = Example::start_with(
        "axum_fair_share",
        "ApiPerTenant: {kind: any, burst: 6, count: 6, period: 1h, fair_share: {}}\n",
        &[("RATELIMITS_OVERRIDES", &overrides)],
    );
    let client = support::http::HttpClient::for_base(&example.base);
    for left in (0..6).rev() {
        let r = client.get("/", &[("x-tenant", "acme")]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let fields = r.header("ratelimit").unwrap().to_owned();
        assert!(
            fields.contains(&format!("\"ApiPerTenant\";r={left};")),
            "{fields}"
        );
    }
    let r = client.get("/", &[("x-tenant", "globex")]).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("600"), "an hour over 6 units");
    let policy = r.header("ratelimit-policy").unwrap().to_owned();
    assert!(policy.contains("\"ApiPerTenant\";q=6;w=3600"), "{policy}");
    assert_eq!(client.get("/", &[]).await.status, 400);
    // An override that changes the budget is refused when the example starts.
    std::fs::write(
        &overrides,
        "- ApiPerTenant: {burst: 9, count: 6, period: 1h, fair_share: {weight: 3}, ids: [acme]}\n",
    )
    .unwrap();
    let out = Command::new(example_binary("axum_fair_share"))
        .env("ADDR", "127.0.0.1:0")
        .env("RATELIMITS_DEFAULTS", example.dir.join("defaults.yaml"))
        .env("RATELIMITS_OVERRIDES", &overrides)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("must keep the fair share's budget"), "{err}");
}

/// `axum_adaptive`: a tenant whose requests fail backs off (AIMD, a window of 5 failures:
/// 10 x 0.9), shown as `q` in `RateLimit-Policy`; another tenant keeps its own number.
#[tokio::test]
async fn axum_adaptive_backs_a_failing_tenant_off() {
    if !skip_unless_built("axum_adaptive") {
        return;
    }
    let example = Example::start_with(
        "axum_adaptive",
        "SearchPerTenant: {kind: any, concurrency: {adaptive: {min: 2, initial: 10, max: 50, algorithm: aimd, completions: 5}}}\n",
        &[],
    );
    let client = support::http::HttpClient::for_base(&example.base);
    let policy = |r: &support::http::Reply| r.header("ratelimit-policy").unwrap().to_owned();
    let r = client.get("/search", &[("x-tenant", "acme")]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        policy(&r).contains("\"SearchPerTenant\";q=10"),
        "{}",
        policy(&r)
    );
    for _ in 0..5 {
        let r = client.get("/busy", &[("x-tenant", "acme")]).await;
        assert_eq!(r.status, 503);
    }
    // Each slot is given back when the server drops the body, just after the client read it.
    let mut seen = String::new();
    for _ in 0..200 {
        let r = client.get("/search", &[("x-tenant", "acme")]).await;
        seen = policy(&r);
        if seen.contains("q=9") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen.contains("\"SearchPerTenant\";q=9"), "{seen}");
    let r = client.get("/search", &[("x-tenant", "globex")]).await;
    assert!(policy(&r).contains("q=10"), "{}", policy(&r));
}

/// `axum_redis` in regional mode (`RATELIMITS_REGION`, `RATELIMITS_GLOBAL_REDIS_URL`): two
/// regions, each on its own Redis, one global Redis, and the per-address limit marked
/// `across_regions` (20 a second, burst 20; floors of 2). Until a region's registration is
/// confirmed the marked limit is closed there; then one client's requests, all in eu at 50 a
/// second, move the movable part (16) to eu, which then admits well above its floor, while
/// both regions together never admit more than one limit's envelope (burst + rate x elapsed,
/// elapsed from the first request sent to the last answer).
#[cfg(feature = "redis")]
#[tokio::test]
async fn two_axum_redis_regions_share_one_limit_across_regions() {
    skip_unless_built("axum_redis");
    const MARKED: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 20
  count: 20
  period: 1s
  across_regions: true
RequestsPerIPv6Range:
  kind: ipv6_range
  burst: 100
  count: 100
  period: 1h
";
    let (eu_redis, us_redis, global) = (
        support::redis::RedisServer::start(),
        support::redis::RedisServer::start(),
        support::redis::RedisServer::start(),
    );
    let global_url = global.url();
    let eu_admin = format!("127.0.0.1:{}", support::redis::free_port());
    // Region `region` on `redis`, serving the admin API on `admin` if given.
    let start = |region: &str, redis: &support::redis::RedisServer, admin: Option<&str>| {
        let url = redis.url();
        let mut env = vec![
            ("REDIS_URL", url.as_str()),
            ("RATELIMITS_REGION", region),
            ("RATELIMITS_GLOBAL_REDIS_URL", global_url.as_str()),
        ];
        env.extend(admin.map(|a| ("RATELIMITS_ADMIN_ADDR", a)));
        Example::start_with("axum_redis", MARKED, &env)
    };
    let eu = start("eu", &eu_redis, Some(eu_admin.as_str()));
    let us = start("us", &us_redis, None);
    eu.until_ready().await;
    us.until_ready().await;
    let client = reqwest_like::Client::new();
    let who = Some("198.51.100.20");
    let began = std::time::Instant::now();
    let (mut eu_admitted, mut us_admitted) = (0u32, 0u32);
    // Admitted by eu in each 1 s window from its first admission.
    let mut windows: Vec<u32> = Vec::new();
    let mut first_admitted = None;
    let mut ticks = tokio::time::interval(Duration::from_millis(20));
    for i in 0..1_000 {
        ticks.tick().await;
        if get(&client, &eu.base, "/", who).await.0 == 200 {
            eu_admitted += 1;
            let since = *first_admitted.get_or_insert_with(std::time::Instant::now);
            let w = since.elapsed().as_secs() as usize;
            windows.resize(windows.len().max(w + 1), 0);
            windows[w] += 1;
        }
        if i % 50 == 0 && get(&client, &us.base, "/", who).await.0 == 200 {
            us_admitted += 1;
        }
        // Enough once eu admitted above its floor's rate (2 a second) for a whole second.
        if windows.iter().rev().skip(1).any(|&n| n >= 8) {
            break;
        }
    }
    let elapsed = began.elapsed().as_secs_f64();
    let admitted = f64::from(eu_admitted + us_admitted);
    eprintln!(
        "eu admitted {eu_admitted} (per second from its first: {windows:?}), us {us_admitted}, \
         in {elapsed:.1} s"
    );
    assert!(
        admitted <= 20.0 + 20.0 * elapsed,
        "{admitted} admitted in {elapsed:.1} s"
    );
    assert!(
        windows.iter().rev().skip(1).any(|&n| n >= 8),
        "eu never admitted above its floor: {windows:?} (us {us_admitted})"
    );
    // What eu's metrics say: confirmed, rebalanced, its part of the limit (all of the movable
    // 16 while the key's demand is far above it; half of it, the spare split evenly, once its
    // demand has stopped), and the global store's calls.
    // Confirmed one lease and the margin (4 s) after eu registered: a part granted from the
    // movable part (which left out eu's floor when eu registered) may come first, when eu's
    // first registration met us's and was written a period later.
    let mut m = Scrape::of(&client, &eu.base).await;
    for _ in 0..300 {
        if m.get("tower_ratelimits_region_confirmed{region=eu}") == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        m = Scrape::of(&client, &eu.base).await;
    }
    assert_eq!(m.get("tower_ratelimits_region_confirmed{region=eu}"), 1.0);
    assert!(m.get("tower_ratelimits_region_rebalances_total{outcome=ok,region=eu}") >= 1.0);
    let part = m.get("tower_ratelimits_region_share{limit=RequestsPerIPAddress,of=rate,region=eu}");
    assert!((8.0..=16.0).contains(&part), "{part}");
    assert!(m.get("tower_ratelimits_region_global_calls_total{region=eu}") >= 3.0);
    // And its admin API shows the key's share in eu.
    let admin = support::http::HttpClient::for_base(&format!("http://{eu_admin}"));
    let bucket = admin
        .get("/buckets/RequestsPerIPAddress/198.51.100.20", &[])
        .await;
    assert_eq!(bucket.status, 200, "{}", bucket.body);
    let v: serde_json::Value = serde_json::from_str(&bucket.body).unwrap();
    assert_eq!(v["region"]["name"], "eu", "{v}");
    assert_eq!(v["region"]["confirmed"], true, "{v}");
    assert_eq!(
        v["region"]["floor"],
        serde_json::json!({"rate": 2, "burst": 2}),
        "{v}"
    );
    let part = v["region"]["part"]["rate"].as_u64().unwrap();
    assert!((8..=16).contains(&part), "{v}");
}

/// Item 6 of the faults issue: a fresh `axum_redis` (lazy, failing open) whose store answers
/// decides by its limits from its first request. Requests sent from the moment it listens
/// (four clients flooding one address, two asking as blocked addresses) until half a second
/// after it says it is ready: the limit of burst 20, 10 a second admits at most 20 plus its
/// rate over that time, and no blocked address passes, with `blocks` stored blocks.
#[cfg(feature = "redis")]
async fn a_fresh_instance_decides_by_its_limits(blocks: u32) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::time::Instant;

    // The example's second rule, per /48, far above what the test asks.
    const LIMITS: &str = "RequestsPerIPAddress:\n  kind: ip\n  burst: 20\n  count: 10\n  \
        period: 1s\nRequestsPerIPv6Range:\n  kind: ipv6_range\n  burst: 100000\n  \
        count: 100000\n  period: 1s\n";
    let server = support::redis::RedisServer::start();
    store_blocks(&server.url(), blocks).await;
    let example = Example::start_with("axum_redis", LIMITS, &[("REDIS_URL", &server.url())]);
    let base = Arc::new(example.base.clone());
    let (done, admitted, blocked_admitted) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicU32::new(0)),
    );
    let started = Instant::now();
    let mut clients = Vec::new();
    for n in 0..6u32 {
        let (base, done) = (Arc::clone(&base), Arc::clone(&done));
        let (admitted, blocked_admitted) = (Arc::clone(&admitted), Arc::clone(&blocked_admitted));
        clients.push(tokio::spawn(async move {
            let client = reqwest_like::Client::new();
            // Clients 4 and 5 ask as the first and the last address blocked (when any is).
            let from = match n {
                4 if blocks > 0 => blocked_address(1),
                5 if blocks > 0 => blocked_address(blocks),
                _ => "198.51.100.7".to_owned(),
            };
            let blocked = n >= 4 && blocks > 0;
            while !done.load(Ordering::Acquire) {
                if get(&client, &base, "/", Some(&from)).await.0 == 200 {
                    let counter = if blocked {
                        &blocked_admitted
                    } else {
                        &admitted
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let client = reqwest_like::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while get(&client, &base, "/ready", None).await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "never ready with {blocks} blocks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ready_after = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, Ordering::Release);
    for c in clients {
        c.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (admitted, blocked_admitted) = (
        admitted.load(Ordering::Relaxed),
        blocked_admitted.load(Ordering::Relaxed),
    );
    eprintln!(
        "{blocks} blocks: ready after {ready_after:?}; {admitted} admitted of one address, \
         {blocked_admitted} of blocked ones, in {elapsed:.2} s"
    );
    let most = 20 + (10.0 * elapsed).ceil() as u32;
    assert!(
        admitted <= most,
        "{blocks} blocks: {admitted} admitted in {elapsed:.2} s, at most {most}"
    );
    assert!(
        admitted >= 20,
        "{blocks} blocks: the burst is served ({admitted})"
    );
    assert_eq!(
        blocked_admitted, 0,
        "{blocks} blocks: blocked addresses admitted"
    );
}

/// The `n`th address blocked by [`store_blocks`] (1-based), in 10.0.0.0/8.
#[cfg(feature = "redis")]
fn blocked_address(n: u32) -> String {
    format!("10.{}.{}.{}", (n >> 16) & 255, (n >> 8) & 255, n & 255)
}

/// Stores `n` blocks of `RequestsPerIPAddress` under the example's prefix, as the admin API
/// writes them, in calls of 10,000.
#[cfg(feature = "redis")]
async fn store_blocks(url: &str, n: u32) {
    use fred::interfaces::{ClientLike, LuaInterface};
    let client = fred::prelude::Builder::from_config(fred::prelude::Config::from_url(url).unwrap())
        .build()
        .unwrap();
    client.init().await.unwrap();
    let fill = "for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do \
        local ip = string.format('10.%d.%d.%d', math.floor(i / 65536) % 256, \
          math.floor(i / 256) % 256, i % 256) \
        redis.call('HSET', KEYS[1], 'RequestsPerIPAddress:' .. ip, \
        '{\"v\":1,\"limit\":\"RequestsPerIPAddress\",\"id\":\"' .. ip .. '\",\"block\":true}') end";
    let mut from = 1;
    while from <= n {
        let to = (from + 9_999).min(n);
        let _: () = client
            .eval(
                fill,
                vec!["rl:{overrides}"],
                vec![from.to_string(), to.to_string()],
            )
            .await
            .unwrap();
        from = to + 1;
    }
    let _ = client.quit().await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_axum_redis_decides_by_its_limits_from_the_first_request() {
    skip_unless_built("axum_redis");
    a_fresh_instance_decides_by_its_limits(0).await;
    a_fresh_instance_decides_by_its_limits(200_000).await;
}

/// The same with 1,000,000 stored blocks (the instance reads them in about 14 s on a debug
/// build; requests wait for the read, `ready_wait` being 30 s).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_axum_redis_decides_by_its_limits_with_a_million_blocks() {
    skip_unless_built("axum_redis");
    a_fresh_instance_decides_by_its_limits(1_000_000).await;
}

/// Item 5 of the faults issue, as an operator meets it: `axum_redis` with
/// `RATELIMITS_ON_BACKEND_ERROR=memory:50` and a calendar quota of 10 a month per address.
/// Redis is stopped with `SHUTDOWN SAVE` and started again from its dump on the same port, on
/// the real clock.
#[cfg(feature = "redis")]
const MONTHLY_10: &str = "RequestsPerIPAddress:\n  kind: ip\n  calendar: {count: 10, period: month}\n\
    RequestsPerIPv6Range:\n  kind: ipv6_range\n  burst: 100000\n  count: 100000\n  period: 1s\n";

/// The address the outage tests ask as.
#[cfg(feature = "redis")]
const OUTAGE_CLIENT: &str = "198.51.100.40";

/// One request as [`OUTAGE_CLIENT`]: whether it was allowed, and the `q` it was answered under
/// (10: the store's quota, 5: the fallback's half).
#[cfg(feature = "redis")]
async fn ask_q(client: &reqwest_like::Client, base: &str) -> (bool, u64) {
    let (status, headers, _) = client
        .get_with_headers(base, "/", Some(OUTAGE_CLIENT))
        .await;
    let policy = headers
        .get("ratelimit-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let q = policy
        .split(';')
        .find_map(|p| p.strip_prefix("q="))
        .and_then(|q| q.parse().ok())
        .unwrap_or_else(|| panic!("no q in {policy:?} ({status})"));
    (status == 200, q)
}

/// What the store counts of [`OUTAGE_CLIENT`]'s monthly quota (its `:q` record, "<end> <used>").
#[cfg(feature = "redis")]
fn stored_count(server: &support::redis::RedisServer) -> u64 {
    let reply = support::redis::command(
        server.port,
        &format!("GET rl:{{RequestsPerIPAddress:{OUTAGE_CLIENT}}}:q"),
    )
    .unwrap();
    reply
        .lines()
        .nth(1)
        .and_then(|v| v.split(' ').nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {reply:?}"))
}

/// `axum_redis` with the memory fallback at 50% on `server`.
#[cfg(feature = "redis")]
fn outage_instance(server: &support::redis::RedisServer) -> Example {
    Example::start_with(
        "axum_redis",
        MONTHLY_10,
        &[
            ("REDIS_URL", &server.url()),
            ("RATELIMITS_ON_BACKEND_ERROR", "memory:50"),
        ],
    )
}

/// Asks `n` times through `base` while the store is down: how many the fallback allowed.
#[cfg(feature = "redis")]
async fn during_the_outage(client: &reqwest_like::Client, base: &str, n: usize) -> u64 {
    let mut allowed = 0;
    for _ in 0..n {
        let (ok, q) = ask_q(client, base).await;
        assert_eq!(q, 5, "decided by the fallback");
        allowed += u64::from(ok);
    }
    allowed
}

/// One instance: 4 spent on Redis, the fallback grants half of the 6 left (3), and once the
/// store answers again the client asks until the store refuses: 10 in all (9 if a charge's
/// answer was lost, never more), and the store counts every unit admitted. At 8795f94: 11 and
/// 12 (a grant whose period end read a microsecond later replaced what was owed: 1 of the 3
/// charged).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_with_a_memory_fallback_grants_nothing_beyond_a_monthly_quota() {
    skip_unless_built("axum_redis");
    let mut server = support::redis::RedisServer::start();
    let example = outage_instance(&server);
    example.until_ready().await;
    let client = reqwest_like::Client::new();
    let mut allowed = 0;
    for _ in 0..4 {
        assert_eq!(ask_q(&client, &example.base).await, (true, 10));
        allowed += 1;
    }
    server.shutdown_save();
    let during = during_the_outage(&client, &example.base, 6).await;
    assert_eq!(during, 3, "half of the 6 left");
    allowed += during;
    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (ok, q) = ask_q(&client, &example.base).await;
        allowed += u64::from(ok);
        if q == 10 && !ok {
            break;
        }
        assert!(q == 10 || !ok, "the fallback granted more than its share");
        assert!(
            std::time::Instant::now() < deadline,
            "the store did not answer again"
        );
        if q != 10 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert!(
        allowed == 10 || allowed == 9,
        "{allowed} admitted of a quota of 10"
    );
    assert_eq!(stored_count(&server), 10, "the store counts every unit");
    for _ in 0..3 {
        assert_eq!(ask_q(&client, &example.base).await, (false, 10));
    }
}

/// Two instances: A spent 4 before the outage and grants half of the 6 it knew were left (3);
/// B, which never heard of the key, half of the full count (5): the documented bound per
/// instance. Once the store is back both charge what they granted (B with no request of that
/// key, within a second), the store counts the 12 units admitted, and both refuse from then on.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_charge_every_unit_their_fallbacks_granted() {
    skip_unless_built("axum_redis");
    let mut server = support::redis::RedisServer::start();
    let (a, b) = (outage_instance(&server), outage_instance(&server));
    a.until_ready().await;
    b.until_ready().await;
    let client = reqwest_like::Client::new();
    for _ in 0..4 {
        assert_eq!(ask_q(&client, &a.base).await, (true, 10));
    }
    server.shutdown_save();
    let on_a = during_the_outage(&client, &a.base, 6).await;
    let on_b = during_the_outage(&client, &b.base, 8).await;
    assert_eq!((on_a, on_b), (3, 5), "half of what each knew was left");
    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while stored_count(&server) < 4 + on_a + on_b {
        assert!(
            std::time::Instant::now() < deadline,
            "not charged: {}",
            stored_count(&server)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        stored_count(&server),
        12,
        "the units admitted, each counted once"
    );
    for base in [&a.base, &b.base] {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (ok, q) = ask_q(&client, base).await;
            assert!(!ok, "admitted past the quota");
            if q == 10 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the store did not answer again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(stored_count(&server), 12);
}

/// `axum_login` with its own limits (`examples/config/login.yaml`), over TCP: five failed
/// logins ban the account for a minute, even the right password is refused there and told
/// when the ban ends, successes count nothing, another account and the same address go on, and
/// `/metrics` counts the ban at its level (and no settle that failed).
#[tokio::test]
async fn axum_login_bans_an_account_after_its_failures_and_says_until_when() {
    skip_unless_built("axum_login");
    let config = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/config/login.yaml"),
    )
    .unwrap();
    let example = Example::start_with("axum_login", &config, &[]);
    let client = support::http::HttpClient::for_base(&example.base);
    let login = |account: &'static str, password: &'static str| {
        let headers = [
            ("x-account", account),
            ("x-password", password),
            ("x-forwarded-for", "198.51.100.7"),
        ];
        let client = &client;
        async move { client.request(http::Method::POST, "/login", &headers).await }
    };
    for _ in 0..10 {
        assert_eq!(
            login("ann", "hunter2").await.status,
            200,
            "successes count nothing"
        );
    }
    for left in (0..5).rev() {
        let failed = login("ann", "guess").await;
        assert_eq!(failed.status, 401);
        let fields = failed.header("ratelimit").unwrap().to_owned();
        assert!(
            fields.contains(&format!("\"FailedLoginsPerAccount\";r={left};")),
            "{fields}"
        );
    }
    let banned = login("ann", "hunter2").await;
    assert_eq!(banned.status, 429, "{}", banned.body);
    let retry: u64 = banned.header("retry-after").unwrap().parse().unwrap();
    assert!((59..=60).contains(&retry), "a minute's ban: {retry}");
    let fields = banned.header("ratelimit").unwrap();
    assert!(
        fields.contains(&format!("\"FailedLoginsPerAccount\";r=0;t={retry}")),
        "{fields}"
    );
    let body: serde_json::Value = serde_json::from_str(&banned.body).unwrap();
    assert_eq!(body["errors"][0]["detail"]["banned"], true, "{body}");
    // The address's own ladder is far from its ban: another account logs in from it.
    assert_eq!(login("bob", "hunter2").await.status, 200);
    let m = Scrape::of(&reqwest_like::Client::new(), &example.base).await;
    assert_eq!(
        m.get("tower_ratelimits_bans_total{level=1,limit=FailedLoginsPerAccount}"),
        1.0
    );
    assert_eq!(
        m.get("tower_ratelimits_settlements_total{limit=FailedLoginsPerAccount,outcome=failed}"),
        0.0
    );
}
