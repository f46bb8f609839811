//! A driver for `benches/redis_instructions.sh`: runs `--ops` decisions of one variant against
//! the Redis at `--url`, `--concurrency` at a time, and counts the client's own instructions
//! under callgrind (`trl_measured`), so the server's and the client's cost per decision are
//! both counted, not timed.
//!
//! `redis_calls --url redis://127.0.0.1:6379 --variant ours_1_rule --ops 10000 --concurrency 16`
//!
//! Variants: `baseline_evalsha` (a `return 1` script), `ours_1_rule` (the default settings:
//! coalescing while Redis is busy), `ours_1_rule_uncoalesced` (`coalesce(0)`),
//! `ours_1_rule_hot_key` (every decision on one key; `ours_1_rule_hot_key_uncoalesced` with `coalesce(0)`), `ours_1_rule_hot_key_prefetch` (the same
//! under a limit with `prefetch: 50`), `ours_3_rules` (and `ours_3_rules_uncoalesced`), `tower_rate_limit_fred` (the peer's GCRA
//! script over the same fred client), `ours_1_rule_coalesced` (`coalesce(64)` with
//! `coalesce_in_flight(2)`: always queueing behind 2 calls, as coalescing was before it
//! adapted), `ours_penalty` (one GCRA limit with a penalty ladder no run reaches: its companion decided in the same call), `ours_calendar` (one monthly calendar quota; `ours_calendar_uncoalesced` with `coalesce(0)`), `ours_fair_share` (one fair share,
//! every key an id of it), `ours_concurrency_slot`, `ours_adaptive_slot` and `ours_adaptive_pool_slot` (a slot taken and
//! given back: two calls, the release of an adaptive one with its completion).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis_ops::{KEYS, RedisOps};
use futures_util::future::join_all;

async fn run(s: Arc<RedisOps>, variant: String, ops: u64, concurrency: u64) {
    let mut next = 0;
    while next < ops {
        let n = concurrency.min(ops - next);
        join_all((next..next + n).map(|i| {
            let s = s.clone();
            let variant = variant.clone();
            async move { s.one(&variant, i).await }
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
    let arg = |flag: &str| common::arg(&args, flag);
    let url = arg("--url").expect("--url redis://..");
    let variant = arg("--variant").expect("--variant NAME");
    let ops: u64 = arg("--ops").map_or(10_000, |s| s.parse().expect("--ops N"));
    let concurrency: u64 = arg("--concurrency").map_or(1, |s| s.parse().expect("--concurrency N"));
    // One thread: the client's instructions are counted in one place, and comparable.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let setup = Arc::new(rt.block_on(RedisOps::connect(&url)));
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
