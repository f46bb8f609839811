//! A driver for `benches/redis_instructions.sh`: runs `--ops` decisions of one variant against
//! the Redis at `--url`, `--concurrency` at a time, and counts the client's own instructions
//! under callgrind (`trl_measured`), so the server's and the client's cost per decision are
//! both counted, not timed.
//!
//! `redis_calls --url redis://127.0.0.1:6379 --variant ours_1_rule --ops 10000 --concurrency 16`
//!
//! Variants: `baseline_evalsha` (a `return 1` script), `ours_1_rule`, `ours_3_rules`,
//! `tower_rate_limit_fred` (the peer's GCRA script over the same fred client).

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::{LuaInterface, Value};
use futures_util::future::join_all;
use tower_ratelimits::{Id, Limiter, Limits, RedisBackend, Transaction};

const LIMITS: &str = "\
A: {burst: 100000000, count: 1000000, period: 1s}
B: {kind: ip, burst: 100000000, count: 1000000, period: 1s}
C: {kind: account, burst: 100000000, count: 1000000, period: 1s}
";
const KEYS: u64 = 1000;

struct Setup {
    limiter: Limiter,
    backend: RedisBackend,
    trivial_sha: String,
}

async fn one(s: &Setup, variant: &str, i: u64) {
    let id = i % KEYS;
    match variant {
        "baseline_evalsha" => {
            let key = format!("rl:bench:{{0:{id}}}");
            let _: Value = s
                .backend
                .client()
                .evalsha(s.trivial_sha.as_str(), vec![key], Vec::<Value>::new())
                .await
                .unwrap();
        }
        "ours_1_rule" => {
            let key = s.limiter.key("A", Id::from(id)).unwrap();
            assert!(
                s.limiter
                    .spend(&[Transaction::new(key)])
                    .await
                    .unwrap()
                    .allowed()
            );
        }
        "ours_3_rules" => {
            let ip = std::net::IpAddr::from([10, 0, (id >> 8) as u8, id as u8]);
            let batch = [
                Transaction::new(s.limiter.key("A", Id::from(id)).unwrap()),
                Transaction::new(s.limiter.key("B", Id::from(ip)).unwrap()),
                Transaction::new(s.limiter.key("C", Id::from(id)).unwrap()),
            ];
            assert!(s.limiter.spend(&batch).await.unwrap().allowed());
        }
        "tower_rate_limit_fred" => {
            let retry = tower_rate_limit_fred::rate_limit(
                &s.backend.client(),
                format!("trlf:bench:{id}"),
                u16::MAX,
                Duration::from_millis(1),
            )
            .await
            .unwrap();
            assert_eq!(retry, None);
        }
        other => panic!("unknown variant {other}"),
    }
}

async fn run(s: Arc<Setup>, variant: String, ops: u64, concurrency: u64) {
    let mut next = 0;
    while next < ops {
        let n = concurrency.min(ops - next);
        join_all((next..next + n).map(|i| {
            let s = s.clone();
            let variant = variant.clone();
            async move { one(&s, &variant, i).await }
        }))
        .await;
        next += n;
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub fn trl_measured(rt: &tokio::runtime::Runtime, f: &mut dyn FnMut(&tokio::runtime::Runtime)) {
    f(rt);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|p| args.get(p + 1))
            .cloned()
    };
    let url = arg("--url").expect("--url redis://..");
    let variant = arg("--variant").expect("--variant NAME");
    let ops: u64 = arg("--ops").map_or(10_000, |s| s.parse().expect("--ops N"));
    let concurrency: u64 = arg("--concurrency").map_or(1, |s| s.parse().expect("--concurrency N"));
    // One thread: the client's instructions are counted in one place, and comparable.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let setup = rt.block_on(async {
        let backend = RedisBackend::from_url(url.as_str())
            .prefix("rl:bench:")
            .deny_cache(false)
            .connect()
            .await
            .expect("connect to Redis");
        let trivial_sha: String = backend.client().script_load("return 1").await.unwrap();
        let limiter = Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            backend.clone(),
        );
        Arc::new(Setup {
            limiter,
            backend,
            trivial_sha,
        })
    });
    // Warm: every key exists, every script is loaded.
    rt.block_on(run(setup.clone(), variant.clone(), KEYS, concurrency));
    if std::env::var_os("TRL_READY_FILE").is_some() {
        // Tell the script the warm-up is over (it zeroes the server's counters now) and wait
        // for its go.
        let ready = std::env::var("TRL_READY_FILE").unwrap();
        std::fs::write(&ready, "ready").unwrap();
        while std::fs::read_to_string(&ready)
            .map(|s| s.trim() != "go")
            .unwrap_or(true)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    trl_measured(&rt, &mut |rt| {
        rt.block_on(run(setup.clone(), variant.clone(), ops, concurrency))
    });
    println!("done {variant} {ops} ops at concurrency {concurrency}");
}
