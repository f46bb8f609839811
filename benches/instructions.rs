//! Deterministic costs, for a noisy machine: heap allocations per operation (counted here) and
//! CPU instructions per operation (counted by `valgrind --tool=callgrind`, which counts the
//! same for the same binary whatever else the machine is doing).
//!
//! `cargo bench -p tower-ratelimits-benches --bench instructions` prints allocations per operation for every variant.
//! `benches/instructions.sh` runs each variant under callgrind and prints instructions per
//! operation and the ratios. One variant alone:
//! `instructions --variant ours_spend_one --ops 100000` (only `trl_measured` is timed by
//! callgrind: `--toggle-collect=trl_measured`). `--keys N` cycles through N keys (1,000 unless
//! told; the in-memory variants warm every one of them first).
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use governor::{Quota as GovernorQuota, RateLimiter};
use tower::ServiceExt;
use tower_ratelimits::BucketTx;
use tower_ratelimits::{
    BucketKey, ErrorBody, Id, Limit, Limiter, Limits, MemoryBackend, Mode, Quota, Transaction,
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

/// Keys cycled through (`--keys N`; 1,000 unless told).
static KEYS: AtomicU64 = AtomicU64::new(1_000);
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
    (
        "ours_calendar_spend",
        "MemoryBackend as Backend: spend, 1 transaction on a calendar quota",
    ),
    (
        "ours_fair_share_spend",
        "MemoryBackend as Backend: spend, 1 transaction on a fair share (every key an id of it)",
    ),
    (
        "ours_concurrency_slot",
        "MemoryBackend as Backend: a slot taken and given back on a concurrency limit",
    ),
    (
        "ours_adaptive_slot",
        "MemoryBackend as Backend: a slot taken and given back with its completion on an adaptive concurrency limit",
    ),
    (
        "ours_adaptive_pool_slot",
        "MemoryBackend as Backend: the same on an adaptive limit whose keys share a capacity (every key in its pool)",
    ),
    ("ours_limiter", "Limiter::spend, 1 transaction"),
    (
        "ours_limiter_penalty",
        "Limiter::spend, 1 transaction on a limit with a penalty ladder (its companion counts the unit; no ban)",
    ),
    (
        "ours_stream_message",
        "StreamMeter::admit: one message of a stream (a meter per key), 1 per-message key",
    ),
    (
        "ours_stream_message_ahead",
        "the same with grants of 99 messages ahead (one decision per 100 messages)",
    ),
    ("http_request_only", "building the request alone"),
    (
        "http_ours_1_rule_refused",
        "axum + ours, 1 rule, every request refused (429, JSON body, fields)",
    ),
    (
        "http_ours_1_rule_refused_no_body",
        "axum + ours, 1 rule, every request refused (429, no body: ErrorBody::Empty, fields)",
    ),
    (
        "http_tower_governor_refused",
        "axum + tower_governor, every request refused (429)",
    ),
    ("http_bare", "axum, no limit"),
    ("http_ours_1_rule", "axum + ours, 1 rule, RateLimit headers"),
    (
        "http_ours_1_rule_no_headers",
        "axum + ours, 1 rule, no headers on allowed",
    ),
    (
        "http_ours_1_rule_count_when",
        "axum + ours, 1 rule counting only 401s (each 200 gives its unit back), RateLimit headers",
    ),
    (
        "http_ours_1_rule_count_when_penalty",
        "axum + ours, the same rule counting only 401s on a limit with a penalty ladder (reserved and settled on it too)",
    ),
    (
        "http_ours_3_rules",
        "axum + ours, 3 rules, RateLimit headers",
    ),
    (
        "http_ours_2_rules",
        "axum + ours, 2 rules, RateLimit headers",
    ),
    (
        "http_ours_2_rules_same_header",
        "axum + ours, 2 rules keyed by one header (read once), RateLimit headers",
    ),
    (
        "http_ours_4_rules",
        "axum + ours, 4 rules, RateLimit headers",
    ),
    (
        "http_ours_8_rules",
        "axum + ours, 8 rules, RateLimit headers",
    ),
    ("http_tower_governor", "axum + tower_governor, per IP"),
    (
        "http_handwritten",
        "axum + a hand-written Mutex<HashMap> GCRA layer, per IP, empty 429",
    ),
    (
        "http_handwritten_fields",
        "axum + the hand-written layer writing RateLimit and RateLimit-Policy",
    ),
    (
        "http_handwritten_refused",
        "axum + the hand-written layer, every request refused (429)",
    ),
];

/// One limit, `Bench`: `RATE` per second, burst `RATE` (every call of the benches allowed).
fn bench_limits() -> Limits {
    Limits::builder()
        .limit(
            "Bench",
            Limit::new(RATE.into(), RATE.into(), Duration::from_secs(1)).unwrap(),
        )
        .build()
        .unwrap()
}

/// A memory backend without its background sweep: under callgrind a run outlasts the sweep's
/// 10 s, and a sweep of a million keys holds shard locks the measured thread then spins on,
/// so the count would depend on timing (the sweep is off the request path by design).
fn unswept() -> MemoryBackend {
    MemoryBackend::builder().no_background_sweep().build()
}

/// Builds the variant's operation, warmed (every key seen once).
fn operation(variant: &str) -> Box<dyn FnMut(u64)> {
    let keys_n = KEYS.load(Ordering::Relaxed);
    let limits = bench_limits();
    let name = limits.name("Bench").unwrap();
    let keys: Vec<BucketKey> = (0..keys_n)
        .map(|k| BucketKey::new(name, Id::from(k)))
        .collect();
    let mut op: Box<dyn FnMut(u64)> = match variant {
        "governor_check_key" => {
            let quota = GovernorQuota::per_second(NonZeroU32::new(RATE).unwrap())
                .allow_burst(NonZeroU32::new(RATE).unwrap());
            let governor = RateLimiter::keyed(quota);
            Box::new(move |i| {
                let _ = std::hint::black_box(governor.check_key(&(i % keys_n)));
            })
        }
        "ours_spend_one" => {
            let quota = limits.default_limit(name).unwrap().clone();
            spend_one_on(quota, keys, keys_n)
        }
        // A monthly count no run uses up: every call allowed, as for the others.
        "ours_calendar_spend" => spend_one_on(
            Quota::from(
                tower_ratelimits::CalendarQuota::new(1 << 50, tower_ratelimits::Period::Month)
                    .unwrap(),
            ),
            keys,
            keys_n,
        ),
        // A budget no run uses up, shared by every key's id: every call allowed.
        "ours_fair_share_spend" => spend_one_on(
            Quota::from(
                tower_ratelimits::FairShare::new(
                    tower_ratelimits::Limit::from_micros(1 << 20, 1_000_000, 1_000_000).unwrap(),
                )
                .unwrap(),
            ),
            keys,
            keys_n,
        ),
        // A slot taken, then given back (a lease id per call): what a request holding one costs
        // the store.
        "ours_concurrency_slot" => slot_on(
            Quota::from(
                tower_ratelimits::ConcurrencyLimit::new(100, Duration::from_secs(60)).unwrap(),
            ),
            keys,
            keys_n,
        ),
        // The same with the request's completion recorded (a window of 100 completions).
        "ours_adaptive_slot" => slot_on(
            Quota::from(
                tower_ratelimits::AdaptiveConcurrency::new(
                    tower_ratelimits::Adaptive::gradient(10, 50, 100).unwrap(),
                )
                .window_completions(100)
                .unwrap(),
            ),
            keys,
            keys_n,
        ),
        // The same with the limit's keys sharing 4,096 slots: one pool holds every key.
        "ours_adaptive_pool_slot" => slot_on(
            Quota::from(
                tower_ratelimits::AdaptiveConcurrency::new(
                    tower_ratelimits::Adaptive::gradient(10, 50, 100).unwrap(),
                )
                .window_completions(100)
                .unwrap()
                .capacity(4_096)
                .unwrap(),
            ),
            keys,
            keys_n,
        ),
        "ours_limiter" => {
            let limiter = Limiter::new(limits, unswept());
            let txs: Vec<Transaction> = keys.into_iter().map(Transaction::new).collect();
            Box::new(move |i| {
                let tx = std::slice::from_ref(&txs[(i % keys_n) as usize]);
                let _ = std::hint::black_box(common::ready(limiter.spend(tx)));
            })
        }
        // A ladder no run reaches (1,000 units a second, each key counted some twenty times).
        "ours_limiter_penalty" => {
            let ladder =
                tower_ratelimits::Ladder::new(1_000, 1_000_000, 1_000_000, 2, 3_600_000_000)
                    .unwrap();
            let limiter = Limiter::new(laddered_limits(ladder), unswept());
            let txs: Vec<Transaction> = keys.into_iter().map(Transaction::new).collect();
            Box::new(move |i| {
                let tx = std::slice::from_ref(&txs[(i % keys_n) as usize]);
                let _ = std::hint::black_box(common::ready(limiter.spend(tx)));
            })
        }
        // A stream per key, each message one batch on the limiter's road (or, with grants
        // ahead, one batch per 100 messages).
        "ours_stream_message" | "ours_stream_message_ahead" => {
            let limiter = Limiter::new(limits, unswept());
            let ahead = if variant.ends_with("ahead") { 99 } else { 0 };
            let mut meters: Vec<tower_ratelimits::StreamMeter> = keys
                .into_iter()
                .map(|k| {
                    tower_ratelimits::StreamMeter::builder(&limiter)
                        .per_message(k)
                        .ahead(ahead)
                        .build()
                        .unwrap()
                })
                .collect();
            Box::new(move |i| {
                let meter = &mut meters[(i % keys_n) as usize];
                let _ = std::hint::black_box(common::ready(meter.admit(1)));
            })
        }
        "http_request_only" => Box::new(move |i| {
            drop(std::hint::black_box(common::apps::request(
                (i % keys_n) as u32,
            )));
        }),
        http => {
            let app = match http {
                "http_bare" => common::apps::bare(),
                "http_ours_1_rule" => common::apps::ours(1, true),
                "http_ours_1_rule_no_headers" => common::apps::ours(1, false),
                "http_ours_1_rule_count_when" => common::apps::ours_count_when(false),
                "http_ours_1_rule_count_when_penalty" => common::apps::ours_count_when(true),
                "http_ours_2_rules" => common::apps::ours(2, true),
                "http_ours_2_rules_same_header" => common::apps::ours_same_header(),
                "http_ours_3_rules" => common::apps::ours(3, true),
                "http_ours_4_rules" => common::apps::ours(4, true),
                "http_ours_8_rules" => common::apps::ours(8, true),
                "http_tower_governor" => common::apps::governor(),
                "http_ours_1_rule_refused" => common::apps::ours_refusing(ErrorBody::Json),
                "http_ours_1_rule_refused_no_body" => common::apps::ours_refusing(ErrorBody::Empty),
                "http_tower_governor_refused" => common::apps::governor_refusing(),
                "http_handwritten" => common::apps::handwritten(false),
                "http_handwritten_fields" => common::apps::handwritten(true),
                "http_handwritten_refused" => common::apps::handwritten_refusing(),
                other => panic!("unknown variant {other}"),
            };
            // A `_refused` variant's warm-up (one request per client) is allowed; every
            // measured request is refused.
            let refused = http.contains("_refused");
            let mut calls = 0u64;
            // Building the request is counted in every variant (`http_request_only` alone).
            Box::new(move |i| {
                let req = common::apps::request((i % keys_n) as u32);
                let response = common::ready(app.clone().oneshot(req)).unwrap();
                calls += 1;
                if !refused {
                    assert!(response.status().is_success());
                } else if calls > keys_n {
                    assert_eq!(response.status(), http::StatusCode::TOO_MANY_REQUESTS);
                }
                drop(std::hint::black_box(response));
            })
        }
    };
    for i in 0..keys_n {
        op(i);
    }
    op
}

/// `MemoryBackend` as `Backend`, one transaction of `quota` per call on each of `keys` in turn,
/// the transactions built (and checked) once outside the measured loop, as the limiter does
/// per request before calling the backend.
fn spend_one_on(quota: Quota, keys: Vec<BucketKey>, keys_n: u64) -> Box<dyn FnMut(u64)> {
    let backend = unswept();
    let keys: &'static [BucketKey] = Box::leak(keys.into_boxed_slice());
    let quota: &'static Quota = Box::leak(Box::new(quota));
    let txs: Vec<BucketTx<'static>> = keys
        .iter()
        .map(|k| BucketTx::new(k, quota, 1..=1, Mode::CheckAndSpend).unwrap())
        .collect();
    Box::new(move |i| {
        let _ = std::hint::black_box(common::spend_one(&backend, &txs[(i % keys_n) as usize]));
    })
}

fn slot_on(quota: Quota, keys: Vec<BucketKey>, keys_n: u64) -> Box<dyn FnMut(u64)> {
    let backend = unswept();
    let keys: &'static [BucketKey] = Box::leak(keys.into_boxed_slice());
    let quota: &'static Quota = Box::leak(Box::new(quota));
    let done = tower_ratelimits::Completion::new(Duration::from_millis(5), false);
    Box::new(move |i| {
        let key = &keys[(i % keys_n) as usize];
        let Ok(tx) = BucketTx::new(key, quota, 1..=1, Mode::CheckAndSpend) else {
            return;
        };
        let tx = tx.with_lease(i + 1);
        let _ = std::hint::black_box(common::spend_one(&backend, &tx));
        let back = [tx.with_completion(&done)];
        let _ = std::hint::black_box(common::ready(tower_ratelimits::Backend::refund(
            &backend, &back,
        )));
    })
}

/// Resident set size in bytes (Linux), or 0 elsewhere.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// The bench's limit `Bench` (`RATE` a second, burst `RATE`) with a penalty `ladder`.
fn laddered_limits(ladder: tower_ratelimits::Ladder) -> Limits {
    Limits::builder()
        .limit(
            "Bench",
            Limit::new(RATE.into(), RATE.into(), Duration::from_secs(1)).unwrap(),
        )
        .penalty("Bench", ladder)
        .build()
        .unwrap()
}

/// `--memory ours_banned`: `n` keys each banned by a penalty ladder (`after` 1: its first
/// request bans it for a minute), through the limiter, so each holds its bucket and its
/// ladder's state; then a day later, swept. RSS before, with the keys, after.
fn banned_keys(n: u64) -> (u64, u64, u64) {
    let ladder =
        tower_ratelimits::Ladder::new(1, 60_000_000, 60_000_000, 2, 3_600_000_000).unwrap();
    let limits = laddered_limits(ladder);
    let name = limits.name("Bench").unwrap();
    let clock = tower_ratelimits::ManualClock::new(1_000_000_000_000);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .no_background_sweep()
        .build();
    let limiter = Limiter::new(limits, backend.clone());
    let before = rss_bytes();
    for k in 0..n {
        let tx = Transaction::new(BucketKey::new(name, Id::from(k)));
        let decided = common::ready(limiter.spend(std::slice::from_ref(&tx))).unwrap();
        assert!(decided.allowed(), "the request that bans is let through");
    }
    let live = rss_bytes();
    assert_eq!(
        backend.len() as u64,
        2 * n,
        "a bucket and a ladder's state a key"
    );
    clock.advance(Duration::from_secs(86_400));
    assert_eq!(backend.sweep() as u64, 2 * n);
    (before, live, rss_bytes())
}

/// `--memory STORE`: the RSS growth while `--keys` keys are added, per key, then the RSS once
/// they have gone idle and been cleaned up (ours: `sweep`; governor: `retain_recent` +
/// `shrink_to_fit`, its documented clean-up). One store per process, so no measure reuses
/// memory another freed. Stores: `ours_numbers` (ids that pack into one word), `ours_text`
/// (`user-<k>`: the general table), `ours_banned` (each key banned by a penalty ladder),
/// `governor` (u64 keys).
fn memory(store: &str, n: u64) {
    let mb = |b: u64| b as f64 / 1_048_576.0;
    let (before, live, after) = match store {
        "governor" => {
            let quota = GovernorQuota::per_second(NonZeroU32::new(RATE).unwrap());
            let governor = RateLimiter::keyed(quota);
            let before = rss_bytes();
            for k in 0..n {
                let _ = governor.check_key(&k);
            }
            let live = rss_bytes();
            std::thread::sleep(Duration::from_millis(50)); // every key is full again after 1 us
            governor.retain_recent();
            governor.shrink_to_fit();
            assert_eq!(governor.len(), 0);
            (before, live, rss_bytes())
        }
        "ours_banned" => banned_keys(n),
        ours => {
            let id: fn(u64) -> Id = match ours {
                "ours_numbers" => Id::from,
                "ours_text" => |k| Id::new(&format!("user-{k}")).unwrap(),
                other => panic!("unknown store {other}"),
            };
            let limits = bench_limits();
            let name = limits.name("Bench").unwrap();
            let limit = limits.default_limit(name).unwrap();
            let clock = tower_ratelimits::ManualClock::new(1_000_000_000_000);
            let backend = MemoryBackend::builder()
                .clock(clock.clone())
                .no_background_sweep()
                .build();
            let before = rss_bytes();
            for k in 0..n {
                let key = BucketKey::new(name, id(k));
                let tx = BucketTx::new(&key, limit, 1..=1, Mode::CheckAndSpend).unwrap();
                common::spend_one(&backend, &tx).unwrap();
            }
            let live = rss_bytes();
            assert_eq!(backend.len() as u64, n);
            clock.advance(Duration::from_secs(60));
            assert_eq!(backend.sweep() as u64, n);
            (before, live, rss_bytes())
        }
    };
    println!(
        "{store} {n} {} {:.1} {:.1} {:.1}",
        live.saturating_sub(before) / n,
        mb(before),
        mb(live),
        mb(after)
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| common::arg(&args, flag);
    let ops: u64 = arg("--ops").map_or(100_000, |s| s.parse().expect("--ops N"));
    if let Some(keys) = arg("--keys") {
        KEYS.store(keys.parse().expect("--keys N"), Ordering::Relaxed);
    }
    if let Some(store) = arg("--memory") {
        memory(&store, KEYS.load(Ordering::Relaxed));
        return;
    }
    if let Some(variant) = arg("--variant") {
        let mut op = operation(&variant);
        trl_measured(&mut op, ops);
        return;
    }
    // `--variants a,b`: list only those.
    let only = arg("--variants");
    let listed = |v: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == v));
    println!("{:<30} {:>14}  what", "variant", "allocs per op");
    for (variant, what) in VARIANTS.iter().filter(|(v, _)| listed(v)) {
        let mut op = operation(variant);
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        trl_measured(&mut op, ops);
        let allocs = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / ops as f64;
        println!("{variant:<30} {allocs:>14.2}  {what}");
    }
}
