//! Deterministic costs, for a noisy machine: heap allocations per operation (counted here) and
//! CPU instructions per operation (counted by `valgrind --tool=callgrind`, which counts the
//! same for the same binary whatever else the machine is doing).
//!
//! `cargo bench -p tower-ratelimits-benches --bench instructions` prints allocations per operation for every variant.
//! `benches/instructions.sh` runs each variant under callgrind and prints instructions per
//! operation and the ratios. One variant alone:
//! `instructions --variant ours_spend_one --ops 100000` (only `trl_measured` is timed by
//! callgrind: `--toggle-collect=trl_measured`).
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use governor::{Quota as GovernorQuota, RateLimiter};
use tower::ServiceExt;
use tower_ratelimits::BucketTx;
use tower_ratelimits::{
    BucketKey, Id, Limit, Limiter, Limits, MemoryBackend, Mode, Quota, Transaction,
};

/// Counts allocations (not frees: an operation that allocates and frees still pays for it).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const KEYS: u64 = 1_000;
const RATE: u32 = 1_000_000;

/// The measured loop: callgrind collects only inside this function.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn trl_measured(op: &mut dyn FnMut(u64), ops: u64) {
    for i in 0..ops {
        op(i);
    }
}

const VARIANTS: &[(&str, &str)] = &[
    ("governor_check_key", "governor keyed check_key (u64 keys)"),
    (
        "ours_spend_one",
        "MemoryBackend as Backend: spend, 1 transaction",
    ),
    ("ours_limiter", "Limiter::spend, 1 transaction"),
    ("http_request_only", "building the request alone"),
    ("http_bare", "axum, no limit"),
    ("http_ours_1_rule", "axum + ours, 1 rule, RateLimit headers"),
    (
        "http_ours_1_rule_no_headers",
        "axum + ours, 1 rule, no headers on allowed",
    ),
    (
        "http_ours_3_rules",
        "axum + ours, 3 rules, RateLimit headers",
    ),
    ("http_tower_governor", "axum + tower_governor, per IP"),
];

/// Builds the variant's operation, warmed (every key seen once).
fn operation(variant: &str) -> Box<dyn FnMut(u64)> {
    let limits = Limits::builder()
        .limit(
            "Bench",
            Limit::new(RATE.into(), RATE.into(), Duration::from_secs(1)).unwrap(),
        )
        .build()
        .unwrap();
    let name = limits.name("Bench").unwrap();
    let keys: Vec<BucketKey> = (0..KEYS)
        .map(|k| BucketKey::new(name, Id::from(k)))
        .collect();
    let mut op: Box<dyn FnMut(u64)> = match variant {
        "governor_check_key" => {
            let quota = GovernorQuota::per_second(NonZeroU32::new(RATE).unwrap())
                .allow_burst(NonZeroU32::new(RATE).unwrap());
            let governor = RateLimiter::keyed(quota);
            Box::new(move |i| {
                let _ = std::hint::black_box(governor.check_key(&(i % KEYS)));
            })
        }
        "ours_spend_one" => {
            let backend = MemoryBackend::new();
            let quota = limits.default_limit(name).unwrap().clone();
            // Built (and checked) once, outside the measured loop, as the limiter does per
            // request before calling the backend.
            let keys: &'static [BucketKey] = Box::leak(keys.into_boxed_slice());
            let quota: &'static Quota = Box::leak(Box::new(quota));
            let txs: Vec<BucketTx<'static>> = keys
                .iter()
                .map(|k| BucketTx::new(k, quota, 1..=1, Mode::CheckAndSpend).unwrap())
                .collect();
            Box::new(move |i| {
                let _ =
                    std::hint::black_box(common::spend_one(&backend, &txs[(i % KEYS) as usize]));
            })
        }
        "ours_limiter" => {
            let limiter = Limiter::new(limits, MemoryBackend::new());
            let txs: Vec<Transaction> = keys.into_iter().map(Transaction::new).collect();
            Box::new(move |i| {
                let tx = std::slice::from_ref(&txs[(i % KEYS) as usize]);
                let _ = std::hint::black_box(common::ready(limiter.spend(tx)));
            })
        }
        "http_request_only" => Box::new(move |i| {
            drop(std::hint::black_box(common::apps::request(
                (i % KEYS) as u32,
            )));
        }),
        http => {
            let app = match http {
                "http_bare" => common::apps::bare(),
                "http_ours_1_rule" => common::apps::ours(1, true),
                "http_ours_1_rule_no_headers" => common::apps::ours(1, false),
                "http_ours_3_rules" => common::apps::ours(3, true),
                "http_tower_governor" => common::apps::governor(),
                other => panic!("unknown variant {other}"),
            };
            // Building the request is counted in every variant (`http_request_only` alone).
            Box::new(move |i| {
                let req = common::apps::request((i % KEYS) as u32);
                let response = common::ready(app.clone().oneshot(req)).unwrap();
                assert!(response.status().is_success());
                drop(std::hint::black_box(response));
            })
        }
    };
    for i in 0..KEYS {
        op(i);
    }
    op
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| common::arg(&args, flag);
    let ops: u64 = arg("--ops").map_or(100_000, |s| s.parse().expect("--ops N"));
    if let Some(variant) = arg("--variant") {
        let mut op = operation(&variant);
        trl_measured(&mut op, ops);
        return;
    }
    println!("{:<30} {:>14}  what", "variant", "allocs per op");
    for (variant, what) in VARIANTS {
        let mut op = operation(variant);
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        trl_measured(&mut op, ops);
        let allocs = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / ops as f64;
        println!("{variant:<30} {allocs:>14.2}  {what}");
    }
}
