//! Stored overrides at scale: what one change costs the store with many
//! overrides and many instances, what the instances cost it when nothing changes, and the
//! memory each instance holds per override.
//!
//! `cargo bench -p tower-ratelimits-benches --bench overrides_scale -- --overrides 200000 --instances 20`
//!
//! Fills the hash with `--overrides` blocks (straight into Redis, as a store of that size holds
//! them), connects `--instances` backends with a limiter each (every one its own connections
//! and its own copy of the overrides, in this one process), then:
//! - the start-up of a fresh instance: `connect` returns once it read the stored overrides
//!   whole,
//! - the memory the instances hold, per override per instance (the process's resident size
//!   before and after they loaded the store),
//! - the store's time over 5 quiet seconds (`INFO commandstats`, after `CONFIG RESETSTAT`),
//! - one change through the first instance, until every instance applied it: its wall time and
//!   the store's time spent on it, by command.
//!
//! Uses `--url` (or `REDIS_URL`) when given, otherwise spawns a `redis-server` on a free
//! loopback port. The store's times are what Redis measured itself (`usec`), so they do not
//! depend on this process's load.

mod common;
#[path = "../tests/support/redis.rs"]
mod redis_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use fred::prelude::{ClientLike, LuaInterface};
use tower_ratelimits::{Limiter, Limits, OverrideKind, RedisBackend};

const LIMITS: &str = "Api: {kind: any, burst: 10, count: 10, period: 1s}\n";
const PREFIX: &str = "scale:";

/// Counts the bytes allocated and not freed: the heap the instances hold, whatever the
/// allocator keeps of what was freed (which the resident size also counts).
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The process's resident memory, in bytes.
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// `INFO commandstats`: per command, (calls, usec).
async fn commandstats(client: &fred::clients::Client) -> BTreeMap<String, (u64, u64)> {
    let info: String = client
        .custom(fred::cmd!("INFO"), vec!["commandstats"])
        .await
        .unwrap();
    let mut stats = BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, fields)) = rest.split_once(':') else {
            continue;
        };
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(key))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        stats.insert(name.to_owned(), (field("calls="), field("usec=")));
    }
    stats
}

async fn reset_stats(client: &fred::clients::Client) {
    let _: String = client
        .custom(fred::cmd!("CONFIG"), vec!["RESETSTAT"])
        .await
        .unwrap();
}

fn table(stats: &BTreeMap<String, (u64, u64)>) -> String {
    let mut out = String::new();
    let total: u64 = stats.values().map(|(_, us)| us).sum();
    for (name, (calls, us)) in stats {
        out.push_str(&format!("  {name}: {calls} calls, {us} us\n"));
    }
    out.push_str(&format!("  total: {} us\n", total));
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| common::arg(&args, flag);
    let n: u64 = arg("--overrides").map_or(200_000, |s| s.parse().expect("--overrides N"));
    let instances: usize = arg("--instances").map_or(20, |s| s.parse().expect("--instances N"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (_server, url) = match arg("--url").or_else(|| std::env::var("REDIS_URL").ok()) {
        Some(url) => (None, url),
        None => {
            let s = redis_support::RedisServer::start();
            let url = s.url();
            (Some(s), url)
        }
    };
    rt.block_on(async move {
        let client = fred::prelude::Builder::from_config(
            fred::prelude::Config::from_url(&url).expect("a Redis URL"),
        )
        .build()
        .unwrap();
        client.init().await.unwrap();
        let hash = format!("{PREFIX}{{overrides}}");
        for key in [hash.clone(), format!("{hash}:v"), format!("{hash}:e")] {
            let _: i64 = client.custom(fred::cmd!("DEL"), vec![key]).await.unwrap();
        }
        let fill = "for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do \
            redis.call('HSET', KEYS[1], 'Api:' .. i, \
            '{\"v\":1,\"limit\":\"Api\",\"id\":\"' .. i .. '\",\"block\":true}') end";
        let mut from = 1;
        while from <= n {
            let to = (from + 9_999).min(n);
            let _: () = client
                .eval(fill, vec![hash.clone()], vec![from.to_string(), to.to_string()])
                .await
                .unwrap();
            from = to + 1;
        }
        println!("Stored overrides at scale: {n} overrides, {instances} instances (one process)");
        let before = rss();
        let live_before = LIVE.load(Ordering::Relaxed);
        let started = Instant::now();
        let mut limiters = Vec::with_capacity(instances);
        for i in 0..instances {
            let connecting = Instant::now();
            let backend = RedisBackend::from_url(&url)
                .prefix(PREFIX)
                .max_overrides(n as usize + 100)
                .command_timeout(Duration::from_secs(10))
                .connect()
                .await
                .unwrap();
            if i == 0 {
                // A fresh instance starts once it read the stored overrides whole (it decides
                // no request before).
                println!(
                    "start-up: connect returned ready after {:.2} s (the stored overrides read whole)",
                    connecting.elapsed().as_secs_f64()
                );
                assert!(backend_ready(&backend));
            }
            limiters.push(Limiter::new(
                Limits::from_yaml_str(LIMITS, None).unwrap(),
                backend,
            ));
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        while limiters
            .iter()
            .any(|l| l.limits().stored_override_count() as u64 != n)
        {
            assert!(Instant::now() < deadline, "the instances never loaded the store");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let loaded = started.elapsed();
        let held = rss().saturating_sub(before);
        let live = u64::try_from(LIVE.load(Ordering::Relaxed) - live_before).unwrap_or(0);
        let per = |bytes: u64| bytes / (n * instances as u64).max(1);
        println!(
            "load: {:.1} s for {instances} instances; heap held +{} MiB: {} bytes per override per instance (resident +{} MiB: {} bytes)",
            loaded.as_secs_f64(),
            live / (1 << 20),
            per(live),
            held / (1 << 20),
            per(held)
        );

        reset_stats(&client).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let quiet = commandstats(&client).await;
        println!("the store's time over 5 quiet seconds:\n{}", table(&quiet));

        // Eleven changes, one after another (each applied by every instance before the next):
        // the first (which loads the script) and the ten after.
        let mut first = None;
        let mut walls = Vec::new();
        reset_stats(&client).await;
        for c in 0..=10u64 {
            if c == 1 {
                first = Some(commandstats(&client).await);
                reset_stats(&client).await;
            }
            let started = Instant::now();
            limiters[(c as usize) % instances]
                .set_override("Api", &format!("new{c}"), OverrideKind::Block, None)
                .await
                .unwrap();
            while limiters
                .iter()
                .any(|l| l.limits().stored_override_count() as u64 != n + 1 + c)
            {
                assert!(Instant::now() < deadline, "the change never reached every instance");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            walls.push(started.elapsed().as_secs_f64() * 1e3);
        }
        let ten = commandstats(&client).await;
        let spent = |stats: &BTreeMap<String, (u64, u64)>| -> u64 {
            stats
                .iter()
                .filter(|(name, _)| !matches!(name.as_str(), "mget" | "hlen" | "info" | "config|resetstat"))
                .map(|(_, (_, us))| us)
                .sum()
        };
        let first = first.unwrap_or_default();
        walls[1..].sort_by(f64::total_cmp);
        println!(
            "the first change: applied by all {instances} instances in {:.1} ms; the store's time on it {} us (the reconciles' MGET and HLEN left out):\n{}",
            walls[0],
            spent(&first),
            table(&first)
        );
        println!(
            "ten changes after it: applied by all in {:.1} ms (median), the store's time {} us each on average:\n{}",
            walls[1 + walls.len().saturating_sub(1) / 2],
            spent(&ten) / 10,
            table(&ten)
        );
        let _ = client.quit().await;
    });
}

fn backend_ready(backend: &RedisBackend) -> bool {
    use tower_ratelimits::Backend;
    backend.ready()
}
