//! The middleware and the tools on Redis.

mod support;

use std::time::{Duration, Instant};

use support::redis::{RedisServer, TestRedis, unique_prefix};
use tower_ratelimits::{Limiter, Limits, MemoryBackend};

use tower_ratelimits::RedisBackend;

// ---------------------------------------------------------------------------------------------
// Through the middleware and the tools.
// ---------------------------------------------------------------------------------------------

mod through_http {
    use super::*;
    use axum::{Router, routing::get};
    use support::http::{HttpClient, serve};
    use tower_ratelimits::{ClientIp, FailurePolicy, LayerError, RateLimitLayer, Rule};

    const LIMITS: &str = "\
RequestsPerIPAddress:
  kind: ip
  burst: 7
  count: 7
  period: 1h
";

    async fn app(url: &str, prefix: &str, policy: FailurePolicy, timeout: Duration) -> Router {
        let backend = RedisBackend::from_url(url)
            .prefix(prefix)
            .command_timeout(timeout)
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), backend);
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
            .on_backend_failure(policy)
            .build()
            .unwrap();
        Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer)
    }

    /// One road: a request on Redis has its key extracted once and is decided by one spend,
    /// whether Redis answers (allowed) or the deny cache does (denied). Before the one road, a
    /// one-rule request was tried on a fast path first and prepared again when Redis could not
    /// answer at once: its key was extracted twice.
    #[tokio::test]
    async fn every_request_on_redis_extracts_its_key_once() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tower_ratelimits::{Header, Id, KeyError, key_fn};
        let redis = TestRedis::single();
        let backend = RedisBackend::from_url(&redis.url)
            .prefix(unique_prefix("once"))
            .command_timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        let limits = Limits::from_yaml_str("PerClient: {burst: 3, count: 3, period: 1h}\n", None);
        let limiter = Limiter::new(limits.unwrap(), backend.clone());
        let extracted = Arc::new(AtomicUsize::new(0));
        let header = Header::new("x-client");
        let counted = extracted.clone();
        let extractor = key_fn(
            move |req: &http::request::Parts| -> Result<Option<Id>, KeyError> {
                counted.fetch_add(1, Ordering::SeqCst);
                tower_ratelimits::KeyExtractor::extract(&header, req)
            },
        );
        let layer = RateLimitLayer::builder(limiter)
            .rule(Rule::new("PerClient", extractor))
            .build()
            .unwrap();
        let server = serve(
            Router::new()
                .route("/", get(|| async { "hello" }))
                .layer(layer),
        )
        .await;
        let client = HttpClient::new(&server);
        let mut statuses = Vec::new();
        for _ in 0..10 {
            statuses.push(client.get("/", &[("x-client", "c1")]).await.status);
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
        assert_eq!(
            extracted.load(Ordering::SeqCst),
            10,
            "one extraction per request"
        );
        assert_eq!(
            backend.deny_cache_hits(),
            6,
            "the first denial came from Redis, the six after it from the deny cache"
        );
    }

    #[tokio::test]
    async fn two_app_instances_on_one_redis_share_one_limit() {
        let redis = TestRedis::single();
        let prefix = unique_prefix("shared");
        let timeout = Duration::from_secs(2);
        let a = serve(app(&redis.url, &prefix, FailurePolicy::FailOpen, timeout).await).await;
        let b = serve(app(&redis.url, &prefix, FailurePolicy::FailOpen, timeout).await).await;
        let (ca, cb) = (HttpClient::new(&a), HttpClient::new(&b));
        let mut ok = 0;
        let mut limited = 0;
        for i in 0..20 {
            let reply = if i % 2 == 0 {
                ca.get("/", &[]).await
            } else {
                cb.get("/", &[]).await
            };
            match reply.status {
                200 => ok += 1,
                429 => {
                    limited += 1;
                    assert!(reply.header("retry-after").is_some());
                }
                s => panic!("unexpected status {s}"),
            }
        }
        assert_eq!(
            (ok, limited),
            (7, 13),
            "7 requests in all, whichever instance serves them"
        );
    }

    #[tokio::test]
    async fn a_dead_redis_follows_the_failure_policy_within_the_timeout() {
        let mut server = RedisServer::start();
        let timeout = Duration::from_millis(300);
        let closed =
            serve(app(&server.url(), "rl:", FailurePolicy::FailClosed, timeout).await).await;
        let open = serve(app(&server.url(), "rl:", FailurePolicy::FailOpen, timeout).await).await;
        let (cc, co) = (HttpClient::new(&closed), HttpClient::new(&open));
        assert_eq!(cc.get("/", &[]).await.status, 200);
        assert_eq!(co.get("/", &[]).await.status, 200);
        server.kill();
        for _ in 0..3 {
            let started = Instant::now();
            assert_eq!(cc.get("/", &[]).await.status, 503);
            assert_eq!(co.get("/", &[]).await.status, 200);
            let elapsed = started.elapsed();
            assert!(
                elapsed < 2 * timeout + Duration::from_secs(1),
                "took {elapsed:?}"
            );
        }
    }

    /// The third failure policy. While Redis is down, each instance decides
    /// in memory at a share of every limit (burst 7 at 43% is 3): neither unlimited (fail
    /// open) nor refused (fail closed). A limit of an hour starts from the share of what Redis
    /// last said was left: 6 of 7 left, 43% of them is 2.
    #[tokio::test]
    async fn a_dead_redis_falls_back_to_memory_at_a_share_of_each_limit() {
        let mut server = RedisServer::start();
        let timeout = Duration::from_millis(300);
        let fallback = FailurePolicy::FallbackToMemory { percent: 43 };
        let server_app = serve(app(&server.url(), "rl:", fallback, timeout).await).await;
        let client = HttpClient::new(&server_app);
        assert_eq!(client.get("/", &[]).await.status, 200);
        server.kill();
        for _ in 0..2 {
            let r = client.get("/", &[]).await;
            assert_eq!(r.status, 200, "{}", r.body);
            // The fallback's own limit: burst 3, refilled over 3,589 s (7 per 8,372 s, 43% of
            // 7 per hour).
            assert_eq!(
                r.header("ratelimit-policy"),
                Some("\"RequestsPerIPAddress\";q=3;w=3589")
            );
        }
        let r = client.get("/", &[]).await;
        assert_eq!(r.status, 429, "{}", r.body);
        // An invalid share is refused when the layer is built.
        let limiter = Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            MemoryBackend::new(),
        );
        let err = RateLimitLayer::builder(limiter)
            .rule(Rule::new("RequestsPerIPAddress", ClientIp::new()))
            .on_backend_failure(FailurePolicy::FallbackToMemory { percent: 0 })
            .build()
            .unwrap_err();
        assert!(matches!(err, LayerError::Fallback(_)), "{err}");
    }
}

mod simulator {
    use super::*;
    use std::process::Command;

    fn simulator() -> std::path::PathBuf {
        super::support::examples::example_binary("simulate")
    }

    fn root() -> &'static std::path::Path {
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
    }

    fn run(extra: &[&str]) -> String {
        run_with(
            &root().join("examples/traces/gcra-20-per-second.yaml"),
            extra,
        )
    }

    /// The worked examples' trace under the limits of `defaults`.
    fn run_with(defaults: &std::path::Path, extra: &[&str]) -> String {
        let out = Command::new(simulator())
            .args(extra)
            .arg("--defaults")
            .arg(defaults)
            .arg(root().join("examples/traces/gcra-worked-examples.trace"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn the_command_line_prints_the_same_decisions_with_redis() {
        let memory = run(&[]);
        assert!(memory.lines().count() > 5);
        let single = TestRedis::single();
        assert_eq!(run(&["--redis", &single.url]), memory);
        let cluster = TestRedis::cluster();
        assert_eq!(run(&["--redis", &cluster.url]), memory);
    }

    /// Prefetched tokens are a deployment's optimisation; the simulator decides a
    /// trace as if no limit had `prefetch`, on Redis as in memory.
    #[test]
    fn the_simulator_decides_as_if_prefetch_were_absent() {
        let yaml = std::fs::read_to_string(root().join("examples/traces/gcra-20-per-second.yaml"))
            .unwrap();
        let prefetching = yaml.replace("  period: 1s\n", "  period: 1s\n  prefetch: 20\n");
        assert_ne!(prefetching, yaml);
        let dir = std::env::temp_dir().join(format!("trl-sim-prefetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let defaults = dir.join("defaults.yaml");
        std::fs::write(&defaults, prefetching).unwrap();
        let memory = run(&[]);
        assert_eq!(run_with(&defaults, &[]), memory);
        let single = TestRedis::single();
        assert_eq!(run_with(&defaults, &["--redis", &single.url]), memory);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unreachable_redis_is_exit_code_2() {
        let port = support::redis::free_port();
        let root = root();
        let out = Command::new(simulator())
            .args(["--redis", &format!("redis://127.0.0.1:{port}")])
            .arg("--defaults")
            .arg(root.join("examples/traces/gcra-20-per-second.yaml"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--redis"));
        assert!(out.stdout.is_empty());
    }
}
