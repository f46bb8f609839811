//! The Limiter on the in-memory backend: batches, modes, atomicity under concurrency, the
//! sweep and the key cap.

#[path = "support/cases.rs"]
mod cases;

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use tower_ratelimits::BackendError;
use tower_ratelimits::{
    BucketKey, Id, IdKind, Limit, Limiter, LimiterError, Limits, ManualClock, MemoryBackend, Mode,
    Transaction,
};

const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;

fn limits() -> Limits {
    let l = |b, c, ms| Limit::from_micros(b, c, ms * MS).unwrap();
    Limits::builder()
        .limit("A", l(50, 50, 1_000))
        .limit("B", l(30, 30, 1_000))
        .limit("Slow", l(3, 1, 3_600_000))
        .limit_for("PerAccount", IdKind::Account, l(5, 5, 1_000))
        .define("OverrideOnly", IdKind::Any, 1, None)
        .override_for("OverrideOnly", "vip", l(2, 2, 1_000))
        .build()
        .unwrap()
}

fn setup() -> (Limiter, MemoryBackend, ManualClock) {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    (Limiter::new(limits(), backend.clone()), backend, clock)
}

fn key(l: &Limiter, name: &str, id: &str) -> BucketKey {
    l.key(name, Id::new(id).unwrap()).unwrap()
}

fn tx(l: &Limiter, name: &str, id: &str) -> Transaction {
    Transaction::new(key(l, name, id))
}

#[tokio::test]
async fn a_denial_in_one_key_leaves_the_others_untouched() {
    let (l, backend, _) = setup();
    for _ in 0..3 {
        assert!(l.spend(&[tx(&l, "Slow", "x")]).await.unwrap().allowed());
    }
    let a = key(&l, "A", "x");
    let before = backend.tat(&a);
    let batch = l
        .spend(&[tx(&l, "A", "x"), tx(&l, "Slow", "x")])
        .await
        .unwrap();
    assert!(!batch.allowed());
    assert!(batch.decisions()[0].allowed(), "A alone would pass");
    assert_eq!(batch.strictest().unwrap().name().as_ref(), "Slow");
    assert_eq!(
        backend.tat(&a),
        before,
        "nothing written for a denied batch"
    );
    assert_eq!(before, None);
}

/// A batch of GCRA keys is decided from their words alone unless one holds a foreign value
/// (here: a clock stepped back a day leaves A's TAT a day ahead). That one is read as drained
/// under its limit and replaced by what it was read as, even though the batch is denied; the
/// fresh key beside it is left untouched.
#[tokio::test]
async fn a_denied_batch_still_replaces_a_foreign_value() {
    let (l, backend, clock) = setup();
    assert!(l.spend(&[tx(&l, "A", "x")]).await.unwrap().allowed());
    clock.set(T0 - 86_400_000 * MS);
    let batch = l
        .spend(&[tx(&l, "A", "x"), tx(&l, "B", "x")])
        .await
        .unwrap();
    assert!(!batch.allowed(), "A is read as drained, not fresh");
    assert!(batch.decisions()[1].allowed(), "B alone would pass");
    let a = backend.tat(&key(&l, "A", "x")).unwrap();
    assert!(
        a <= T0 - 86_400_000 * MS + 1_000 * MS,
        "A's day-ahead TAT is replaced by one within its limit: {a}"
    );
    assert_eq!(backend.tat(&key(&l, "B", "x")), None, "nothing spent of B");
}

#[tokio::test]
async fn modes_follow_the_spec() {
    let (l, backend, _) = setup();
    // check-only counts but is never written.
    let b = l
        .spend(&[tx(&l, "A", "m").mode(Mode::CheckOnly), tx(&l, "B", "m")])
        .await
        .unwrap();
    assert!(b.allowed());
    assert_eq!(backend.tat(&key(&l, "A", "m")), None);
    assert!(backend.tat(&key(&l, "B", "m")).is_some());
    // spend-only does not count: an exhausted spend-only bucket does not deny the batch...
    for _ in 0..3 {
        l.spend(&[tx(&l, "Slow", "m")]).await.unwrap();
    }
    let slow_tat = backend.tat(&key(&l, "Slow", "m"));
    let b = l
        .spend(&[tx(&l, "A", "m"), tx(&l, "Slow", "m").mode(Mode::SpendOnly)])
        .await
        .unwrap();
    assert!(b.allowed());
    assert!(!b.decisions()[1].allowed());
    assert_eq!(b.strictest().unwrap().name().as_ref(), "A");
    // ... and is not written when its own decision denies.
    assert_eq!(backend.tat(&key(&l, "Slow", "m")), slow_tat);
    // spend-only is written when it allows and the batch allows.
    let b = l
        .spend(&[tx(&l, "A", "n"), tx(&l, "B", "n").mode(Mode::SpendOnly)])
        .await
        .unwrap();
    assert!(b.allowed());
    assert!(backend.tat(&key(&l, "B", "n")).is_some());
    // ... and not when the batch is denied.
    let b = l
        .spend(&[tx(&l, "Slow", "m"), tx(&l, "B", "o").mode(Mode::SpendOnly)])
        .await
        .unwrap();
    assert!(!b.allowed());
    assert_eq!(backend.tat(&key(&l, "B", "o")), None);
    // check never writes, whatever the modes.
    let b = l
        .check(&[tx(&l, "A", "p"), tx(&l, "B", "p")])
        .await
        .unwrap();
    assert!(b.allowed());
    // Written: B:m, Slow:m, A:m (second batch), A:n, B:n.
    assert_eq!(backend.len(), 5);
}

#[tokio::test]
async fn the_strictest_decision_speaks_for_the_batch() {
    let (l, _, _) = setup();
    // A: 50 tokens, B: 30 tokens. Spend 10 on each: remaining 40 vs 20 -> B is stricter.
    let b = l
        .spend(&[tx(&l, "A", "s").cost(10), tx(&l, "B", "s").cost(10)])
        .await
        .unwrap();
    assert!(b.allowed());
    assert_eq!(b.strictest().unwrap().name().as_ref(), "B");
    assert_eq!(b.strictest().unwrap().remaining(), 20);
    // Two denials: the longer retry_after wins.
    let b = l
        .spend(&[tx(&l, "A", "s").cost(45), tx(&l, "B", "s").cost(30)])
        .await
        .unwrap();
    assert!(!b.allowed());
    let s = b.strictest().unwrap();
    assert_eq!(s.name().as_ref(), "B");
    // B's EI is 1s/30 rounded up, 33_334us: 10 spent + 30 wanted - 30 burst = 10 tokens short.
    assert_eq!(s.retry_after(), Duration::from_micros(333_340));
    assert_eq!(b.decisions()[0].retry_after(), Duration::from_millis(100));
}

#[tokio::test]
async fn errors_and_disabled_limits() {
    let (l, backend, _) = setup();
    let e = l
        .spend(&[tx(&l, "A", "d"), tx(&l, "A", "d")])
        .await
        .unwrap_err();
    assert!(matches!(e, LimiterError::DuplicateKey(_)), "{e}");
    let e = l.spend(&[tx(&l, "B", "d").cost(31)]).await.unwrap_err();
    assert!(
        matches!(
            e,
            LimiterError::CostAboveBurst {
                cost: 31,
                burst: 30,
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(l.name("Nope"), Err(LimiterError::UnknownName(_))));
    assert!(matches!(
        l.parse_key("PerAccount", "x"),
        Err(LimiterError::InvalidId { .. })
    ));
    // No default and no override: allowed, and the store is not touched.
    for _ in 0..10 {
        let b = l.spend(&[tx(&l, "OverrideOnly", "anyone")]).await.unwrap();
        assert!(b.allowed());
        assert!(b.strictest().is_none());
        assert_eq!(b.decisions()[0].limit(), None);
    }
    assert_eq!(backend.len(), 0);
    // The override applies to its id.
    for _ in 0..2 {
        assert!(
            l.spend(&[tx(&l, "OverrideOnly", "vip")])
                .await
                .unwrap()
                .allowed()
        );
    }
    assert!(
        !l.spend(&[tx(&l, "OverrideOnly", "vip")])
            .await
            .unwrap()
            .allowed()
    );
    // An empty batch is allowed.
    assert!(l.spend(&[]).await.unwrap().allowed());
}

#[tokio::test]
async fn refund_and_reset() {
    let (l, backend, clock) = setup();
    let k = key(&l, "Slow", "r");
    for _ in 0..3 {
        l.spend(&[Transaction::new(k.clone())]).await.unwrap();
    }
    assert!(
        !l.spend(&[Transaction::new(k.clone())])
            .await
            .unwrap()
            .allowed()
    );
    let r = l.refund(&[Transaction::new(k.clone())]).await.unwrap();
    assert!(r.allowed());
    assert_eq!(r.decisions()[0].remaining(), 1);
    assert!(
        l.spend(&[Transaction::new(k.clone())])
            .await
            .unwrap()
            .allowed()
    );
    // Refunding more than was spent stops at a full bucket.
    let r = l
        .refund(&[Transaction::new(k.clone()).cost(3)])
        .await
        .unwrap();
    assert_eq!(r.decisions()[0].remaining(), 3);
    assert_eq!(backend.tat(&k), Some(T0));
    // Refunding a fresh bucket does nothing and stores nothing.
    let fresh = key(&l, "Slow", "fresh");
    let r = l.refund(&[Transaction::new(fresh.clone())]).await.unwrap();
    assert!(!r.allowed());
    assert_eq!(backend.tat(&fresh), None);
    // Reset empties the bucket.
    clock.advance(Duration::from_secs(1));
    l.spend(&[Transaction::new(k.clone()).cost(3)])
        .await
        .unwrap();
    l.reset(std::slice::from_ref(&k)).await.unwrap();
    assert_eq!(backend.tat(&k), None);
    let b = l.spend(&[Transaction::new(k.clone())]).await.unwrap();
    assert_eq!(b.decisions()[0].remaining(), 2);
}

#[test]
fn concurrent_spenders_on_one_key_admit_exactly_the_burst() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = ManualClock::new(T0); // frozen
        let backend = MemoryBackend::builder().clock(clock).build();
        let limiter = Limiter::new(limits(), backend);
        let admitted = Arc::new(AtomicU64::new(0));
        let k = key(&limiter, "A", "hot");
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let (limiter, admitted, k) = (limiter.clone(), admitted.clone(), k.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..20 {
                    if limiter
                        .spend(&[Transaction::new(k.clone())])
                        .await
                        .unwrap()
                        .allowed()
                    {
                        admitted.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(admitted.load(Ordering::SeqCst), 50);
    });
}

/// A batch holds its buckets from the read to the write, and a new bucket needs its shard's
/// write lock: batches that mix held and new keys, beside sweeps and resets, all finish (a
/// deadlock fails after a minute instead of hanging) and spend the shared key exactly.
#[test]
fn batches_mixing_new_and_held_keys_beside_sweeps_never_deadlock() {
    let clock = ManualClock::new(T0); // frozen
    let backend = MemoryBackend::builder()
        .clock(clock)
        .no_background_sweep()
        .build();
    let limiter = Limiter::new(limits(), backend.clone());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // Numbers, as the new keys: one table, so held and new buckets share its shards.
    let shared = key(&limiter, "B", "999999999");
    let worker = {
        let (limiter, backend, shared) = (limiter.clone(), backend.clone(), shared.clone());
        std::thread::spawn(move || {
            let admitted: u64 = std::thread::scope(|s| {
                let spenders: Vec<_> = (0..4u64)
                    .map(|t| {
                        let (limiter, shared) = (limiter.clone(), shared.clone());
                        s.spawn(move || {
                            let rt = tokio::runtime::Builder::new_current_thread()
                                .build()
                                .unwrap();
                            let mut admitted = 0;
                            for i in 0..300u64 {
                                let fresh = |n: u64| {
                                    tx(&limiter, "A", &(t * 100_000 + i * 4 + n).to_string())
                                };
                                let batch = [
                                    fresh(0),
                                    Transaction::new(shared.clone()),
                                    fresh(1),
                                    tx(&limiter, "A", "hot"),
                                ];
                                if rt.block_on(limiter.spend(&batch)).unwrap().allowed() {
                                    admitted += 1;
                                }
                            }
                            admitted
                        })
                    })
                    .collect();
                let sweeper = s.spawn(|| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    for i in 0..300u64 {
                        backend.sweep();
                        let gone = key(&limiter, "A", &(i * 4).to_string());
                        rt.block_on(limiter.reset(&[gone])).unwrap();
                    }
                });
                sweeper.join().unwrap();
                spenders.into_iter().map(|h| h.join().unwrap()).sum()
            });
            let _ = done_tx.send(admitted);
        })
    };
    let admitted = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the batches finished (no deadlock)");
    worker.join().unwrap();
    // "B" holds 30 and "A"'s hot key 50: the shared key is the tighter, and every admitted
    // batch spent it once.
    assert_eq!(admitted, 30);
    assert_eq!(
        backend.tat(&shared),
        Some(T0 + (1_000 * MS).div_ceil(30) * 30)
    );
}

#[test]
fn concurrent_overlapping_batches_never_over_admit_or_lose_writes() {
    let clock = ManualClock::new(T0); // frozen
    let backend = MemoryBackend::builder().clock(clock).build();
    let limiter = Limiter::new(limits(), backend.clone());
    let a = key(&limiter, "A", "shared");
    let b = key(&limiter, "B", "shared");
    // Per thread: (batches admitted with A, with B).
    let counts: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|t| {
                let (limiter, a, b) = (limiter.clone(), a.clone(), b.clone());
                s.spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    let (mut with_a, mut with_b) = (0, 0);
                    for i in 0..200u64 {
                        let batch: Vec<Transaction> = match (t + i) % 3 {
                            0 => vec![Transaction::new(a.clone()), Transaction::new(b.clone())],
                            1 => vec![Transaction::new(a.clone())],
                            _ => vec![Transaction::new(b.clone()).cost(2)],
                        };
                        let d = rt.block_on(limiter.spend(&batch)).unwrap();
                        if d.allowed() {
                            for tx in &batch {
                                if tx.key() == &a {
                                    with_a += 1;
                                } else {
                                    with_b += tx.cost_or(1);
                                }
                            }
                        }
                    }
                    (with_a, with_b)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let spent_a: u64 = counts.iter().map(|c| c.0).sum();
    let spent_b: u64 = counts.iter().map(|c| c.1).sum();
    assert!(
        spent_a <= 50 && spent_b <= 30,
        "over-admission: {spent_a} {spent_b}"
    );
    // Every admitted spend is in the store, and nothing else is: TAT = T0 + EI * spent.
    assert_eq!(backend.tat(&a), Some(T0 + 20 * MS * spent_a));
    assert_eq!(
        backend.tat(&b).unwrap_or(T0),
        T0 + (1_000 * MS).div_ceil(30) * spent_b
    );
    assert!(spent_b >= 29, "B is drained by the end ({spent_b})");
}

#[tokio::test]
async fn the_key_cap_refuses_new_keys_and_frees_expired_ones() {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .max_keys(3)
        .build();
    let l = Limiter::new(limits(), backend.clone());
    for id in ["1", "2", "3"] {
        assert!(l.spend(&[tx(&l, "A", id)]).await.unwrap().allowed());
    }
    let e = l.spend(&[tx(&l, "A", "4")]).await.unwrap_err();
    assert!(
        matches!(e, LimiterError::Backend(BackendError::Full { max_keys: 3 })),
        "{e}"
    );
    // Keys already held keep working; a probe on a new key needs no room.
    assert!(l.spend(&[tx(&l, "A", "1")]).await.unwrap().allowed());
    assert!(
        l.spend(&[tx(&l, "A", "9").cost(0)])
            .await
            .unwrap()
            .allowed()
    );
    assert_eq!(backend.len(), 3);
    assert_eq!(backend.full_refusals(), 1);
    // Once the held buckets are full again (TAT <= now), a refusal wakes the background sweep,
    // which makes room; the request itself never sweeps.
    clock.advance(Duration::from_secs(2));
    let e = l.spend(&[tx(&l, "A", "4")]).await.unwrap_err();
    assert!(
        matches!(e, LimiterError::Backend(BackendError::Full { .. })),
        "{e}"
    );
    assert_eq!(backend.len(), 3, "the refused request did not sweep");
    // The sweep runs on its own thread: waited for (an event), up to a generous bound.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !backend.is_empty() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert!(backend.is_empty(), "the woken sweep made room");
    assert!(l.spend(&[tx(&l, "A", "4")]).await.unwrap().allowed());
    assert_eq!(backend.len(), 1);
}

/// Built inside a tokio runtime, the backend sweeps by itself (nothing started by hand), on a
/// thread of its own: none of the runtime's timers or workers.
#[tokio::test]
async fn the_background_sweeper_drops_idle_buckets() {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_millis(5))
        .build();
    let l = Limiter::new(limits(), backend.clone());
    for i in 0..100 {
        l.spend(&[tx(&l, "A", &i.to_string())]).await.unwrap();
    }
    l.spend(&[tx(&l, "Slow", "long")]).await.unwrap();
    assert_eq!(backend.len(), 101);
    clock.advance(Duration::from_secs(1));
    // Waits for the sweep (an event), up to a generous bound; the runtime is never yielded to.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while backend.len() > 1 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        backend.len(),
        1,
        "only the bucket still ahead of now is kept"
    );
    assert!(backend.tat(&key(&l, "Slow", "long")).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases::cases(64)))]
    /// Sweeping drops only buckets equal to fresh ones: the decisions of any trace are the same
    /// with sweeps between every step as without.
    #[test]
    fn the_sweep_is_lossless(steps in proptest::collection::vec((0u64..400, 0u8..4, 0u64..4, prop::bool::ANY), 1..150)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let (l1, _, c1) = setup();
            let (l2, b2, c2) = setup();
            for (dt, who, cost, refund) in steps {
                c1.advance(Duration::from_millis(dt));
                c2.advance(Duration::from_millis(dt));
                let batch = [tx(&l1, "B", &who.to_string()).cost(cost), tx(&l1, "Slow", "z").mode(Mode::SpendOnly).cost(cost.min(3))];
                let (d1, d2) = if refund {
                    (l1.refund(&batch).await.unwrap(), l2.refund(&batch).await.unwrap())
                } else {
                    (l1.spend(&batch).await.unwrap(), l2.spend(&batch).await.unwrap())
                };
                prop_assert_eq!(d1, d2);
                b2.sweep();
            }
            Ok(())
        })?;
    }
}

// ---------------------------------------------------------------------------------------------
// Burst tiers in memory.
// ---------------------------------------------------------------------------------------------

fn tiered_setup() -> (Limiter, MemoryBackend, ManualClock) {
    use tower_ratelimits::{Tier, TieredLimit};
    let s = Duration::from_secs;
    let tiers = TieredLimit::new([
        Tier::new(5, s(1), s(1), s(0)),
        Tier::new(50, s(5), s(5), s(15)),
    ])
    .unwrap();
    let limits = Limits::builder()
        .limit("Penalty", tiers)
        .limit("G", Limit::new(3, 3, s(1)).unwrap())
        .build()
        .unwrap();
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    (Limiter::new(limits, backend.clone()), backend, clock)
}

#[test]
fn concurrent_tiered_requests_never_over_grant() {
    let (limiter, backend, _clock) = tiered_setup();
    let k = key(&limiter, "Penalty", "hot");
    let granted = Arc::new(AtomicU64::new(0));
    std::thread::scope(|scope| {
        for _ in 0..4 {
            let (limiter, k, granted) = (limiter.clone(), k.clone(), granted.clone());
            scope.spawn(move || {
                for _ in 0..100 {
                    let tx = Transaction::new(k.clone()).cost_range(1..=3);
                    let d = support::ready(limiter.spend(&[tx])).unwrap();
                    granted.fetch_add(d.decisions()[0].granted(), Ordering::Relaxed);
                }
            });
        }
    });
    // At one instant: 5 from tier 1 and 50 from tier 2, never more.
    assert_eq!(granted.load(Ordering::Relaxed), 55);
    let state = backend.tier_state(&k).unwrap();
    let units: u64 = state
        .tiers()
        .iter()
        .flat_map(|t| t.grants())
        .map(|g| g.1)
        .sum();
    assert_eq!(units, 55);
    // Same instant: one (t, units) pair per tier.
    assert!(state.tiers().iter().all(|t| t.grants().len() == 1));
}

#[tokio::test]
async fn mixed_batches_are_all_or_nothing() {
    let (limiter, backend, _clock) = tiered_setup();
    let t = key(&limiter, "Penalty", "a");
    let g = key(&limiter, "G", "a");
    // GCRA allows 3; the tiered limit allows 55 at once.
    let ok = limiter
        .spend(&[
            Transaction::new(t.clone()).cost(5),
            Transaction::new(g.clone()).cost(3),
        ])
        .await
        .unwrap();
    assert!(ok.allowed());
    let before = backend.tier_state(&t).unwrap();
    // The GCRA bucket is empty: the tiered part must not be written.
    let denied = limiter
        .spend(&[
            Transaction::new(t.clone()).cost_range(1..=10),
            Transaction::new(g.clone()),
        ])
        .await
        .unwrap();
    assert!(!denied.allowed());
    assert!(
        denied.decisions()[0].allowed(),
        "the tier alone would grant"
    );
    assert_eq!(backend.tier_state(&t).unwrap(), before);
    // The tiered part denies (min above what is left): the GCRA bucket is untouched.
    let tat = backend.tat(&g);
    let denied = limiter
        .spend(&[
            Transaction::new(t.clone()).cost(51),
            Transaction::new(g.clone()).cost(0),
        ])
        .await
        .unwrap();
    assert!(!denied.allowed());
    assert_eq!(denied.strictest().unwrap().key(), &t);
    assert_eq!(backend.tat(&g), tat);
    assert_eq!(backend.tier_state(&t).unwrap(), before);
    // Check-only writes nothing, even for a key never seen.
    let fresh = key(&limiter, "Penalty", "never");
    assert!(
        limiter
            .check(&[Transaction::new(fresh.clone())])
            .await
            .unwrap()
            .allowed()
    );
    assert!(backend.tier_state(&fresh).is_none());
}

#[tokio::test]
async fn tiered_state_is_swept_once_fresh_and_reset_clears_it() {
    let (limiter, backend, clock) = tiered_setup();
    let t = key(&limiter, "Penalty", "s");
    let d = limiter
        .spend(&[Transaction::new(t.clone()).cost(6)])
        .await
        .unwrap();
    let d = &d.decisions()[0];
    assert!(d.allowed() && d.tiers().unwrap().burst);
    // Tier 2 entered now: fresh again after 5 s + 15 s (+1us).
    assert_eq!(d.reset_after(), Duration::from_micros(20_000_001));
    clock.advance(Duration::from_micros(20_000_000));
    assert_eq!(backend.sweep(), 0);
    clock.advance(Duration::from_micros(1));
    assert_eq!(backend.sweep(), 1);
    assert!(backend.is_empty());
    limiter.spend(&[Transaction::new(t.clone())]).await.unwrap();
    assert_eq!(backend.len(), 1);
    limiter.reset(std::slice::from_ref(&t)).await.unwrap();
    assert!(backend.tier_state(&t).is_none());
    assert!(backend.is_empty());
    // A refund of a tiered key takes back units.
    limiter
        .spend(&[Transaction::new(t.clone()).cost(5)])
        .await
        .unwrap();
    let r = limiter
        .refund(&[Transaction::new(t.clone()).cost(2)])
        .await
        .unwrap();
    assert_eq!(r.decisions()[0].granted(), 2);
    assert_eq!(r.decisions()[0].remaining(), 2);
}

#[tokio::test]
async fn cost_ranges_are_checked() {
    let (limiter, _backend, _clock) = tiered_setup();
    let t = key(&limiter, "Penalty", "c");
    let g = key(&limiter, "G", "c");
    // A GCRA range's lower end must fit the burst; its upper end need not.
    let e = limiter
        .spend(&[Transaction::new(g.clone()).cost_range(4..=7)])
        .await;
    assert!(
        matches!(e, Err(LimiterError::CostAboveBurst { cost: 4, .. })),
        "{e:?}"
    );
    let d = limiter
        .spend(&[Transaction::new(g).cost_range(1..=7)])
        .await
        .unwrap();
    assert_eq!(d.decisions()[0].granted(), 3);
    let e = limiter
        .spend(&[Transaction::new(t.clone()).cost_range(std::ops::RangeInclusive::new(3, 2))])
        .await;
    assert!(
        matches!(e, Err(LimiterError::EmptyCostRange { .. })),
        "{e:?}"
    );
    let e = limiter.spend(&[Transaction::new(t.clone()).cost(56)]).await;
    assert!(
        matches!(
            e,
            Err(LimiterError::CostAboveBurst {
                cost: 56,
                burst: 55,
                ..
            })
        ),
        "{e:?}"
    );
    // A range may ask for more than the capacity; it gets what there is.
    let d = limiter
        .spend(&[Transaction::new(t).cost_range(1..=1000)])
        .await
        .unwrap();
    assert_eq!(d.decisions()[0].granted(), 55);
}

/// Ids that fit one word (addresses, /48 ranges, small numbers) and ids that do not (text,
/// full IPv6 addresses, large numbers) live in two tables: each keeps its own bucket, however
/// alike their values, and a reset or a sweep reaches both.
#[tokio::test]
async fn ids_of_every_shape_keep_their_own_buckets() {
    let (l, backend, clock) = setup();
    let ids = [
        Id::from(std::net::IpAddr::from([1, 2, 3, 4])),
        Id::from(0x0102_0304u64),
        Id::ipv6_range48("0:102:304::".parse().unwrap()),
        Id::from((1u64 << 48) + 0x0102_0304),
        Id::new("2001:db8::1").unwrap(),
        Id::new("16909060-text").unwrap(),
    ];
    let keys: Vec<BucketKey> = ["Slow", "B"]
        .iter()
        .flat_map(|name| ids.iter().map(|id| l.key(name, id.clone()).unwrap()))
        .collect();
    let spend = |k: &BucketKey, cost| Transaction::new(k.clone()).cost(cost);
    // "Slow" holds 3: each of its keys takes all 3 once; "B" (30) takes 3 of its 30.
    for k in &keys {
        assert!(l.spend(&[spend(k, 3)]).await.unwrap().allowed(), "{k:?}");
    }
    for (i, k) in keys.iter().enumerate() {
        let again = l.spend(&[spend(k, 1)]).await.unwrap().allowed();
        assert_eq!(
            again,
            i >= ids.len(),
            "{k:?}: only B's keys have tokens left"
        );
    }
    assert_eq!(backend.len(), keys.len());
    l.reset(&keys[..ids.len()]).await.unwrap();
    for k in &keys[..ids.len()] {
        assert_eq!(backend.tat(k), None, "{k:?} reset");
        assert!(l.spend(&[spend(k, 3)]).await.unwrap().allowed(), "{k:?}");
    }
    clock.advance(Duration::from_secs(3 * 3600));
    assert_eq!(backend.sweep(), keys.len());
    assert!(backend.is_empty());
}

#[tokio::test]
async fn inspection_reads_a_bucket_without_spending_in_memory() {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder().clock(clock.clone()).build();
    let limiter = Limiter::new(support::inspect::limits(), backend);
    support::inspect::inspection_reads_without_spending(&limiter, &clock).await;
}

#[tokio::test]
async fn a_sweep_that_empties_the_table_gives_its_memory_back() {
    let (limiter, backend, clock) = setup();
    let name = limiter.limits().name("A").unwrap();
    for i in 0..50_000u64 {
        let k = BucketKey::new(name, tower_ratelimits::Id::from(i));
        assert!(
            limiter
                .spend(&[Transaction::new(k)])
                .await
                .unwrap()
                .allowed()
        );
    }
    assert_eq!(backend.len(), 50_000);
    let grown = backend.capacity();
    assert!(grown >= 50_000, "{grown}");
    clock.advance(Duration::from_secs(3600));
    assert_eq!(backend.sweep(), 50_000);
    assert!(backend.is_empty());
    assert!(
        backend.capacity() < grown / 100,
        "{} slots kept of {grown}",
        backend.capacity()
    );
}

#[tokio::test]
async fn reordered_and_extended_files_share_exactly_the_right_buckets_in_memory() {
    let backend: Arc<dyn tower_ratelimits::Backend> =
        Arc::new(MemoryBackend::builder().clock(ManualClock::new(T0)).build());
    let [a, b, c] = support::identity::three_configurations();
    let a = Limiter::with_shared_backend(a, backend.clone());
    let b = Limiter::with_shared_backend(b, backend.clone());
    let c = Limiter::with_shared_backend(c, backend);
    support::identity::instances_share_exactly_the_right_buckets(&a, &b, &c).await;
}

#[test]
fn without_a_runtime_the_backend_sweeps_on_a_thread_of_its_own() {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_millis(5))
        .build();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let l = Limiter::new(limits(), backend.clone());
    for i in 0..10 {
        rt.block_on(l.spend(&[tx(&l, "A", &i.to_string())]))
            .unwrap();
    }
    assert_eq!(backend.len(), 10);
    clock.advance(Duration::from_secs(2));
    // Waits for the sweep to happen (an event), up to a generous bound; asserts no timing.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !backend.is_empty() && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        backend.len(),
        0,
        "the sweep thread dropped the idle buckets"
    );
}

#[test]
fn no_background_sweep_keeps_idle_buckets_until_swept_by_hand() {
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_millis(1))
        .no_background_sweep()
        .build();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let l = Limiter::new(limits(), backend.clone());
    rt.block_on(l.spend(&[tx(&l, "A", "x")])).unwrap();
    clock.advance(Duration::from_secs(2));
    assert_eq!(backend.len(), 1);
    assert_eq!(backend.sweep(), 1);
}

/// The memory backend's metrics, recorded by a real Prometheus recorder (this thread's) and
/// parsed: a sweep counts itself and the buckets it dropped and sets the live-key gauge; a
/// refusal at the key cap is counted.
#[test]
fn sweeps_live_keys_and_full_refusals_are_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let clock = ManualClock::new(1_000_000);
        let backend = MemoryBackend::builder()
            .clock(clock.clone())
            .max_keys(4)
            .build();
        let limiter = Limiter::new(
            Limits::from_yaml_str("A: {burst: 1, count: 1, period: 1s}\n", None).unwrap(),
            backend.clone(),
        );
        let spend = |id: &str| {
            support::ready(limiter.spend(&[Transaction::new(limiter.parse_key("A", id).unwrap())]))
        };
        for id in ["a", "b", "c"] {
            assert!(spend(id).unwrap().allowed());
        }
        clock.advance(std::time::Duration::from_secs(2));
        assert!(spend("d").unwrap().allowed());
        assert_eq!(backend.sweep(), 3, "a, b and c are full again");
        // Only after the sweep: a refusal wakes the background sweep (on its own thread,
        // which this thread's recorder does not see).
        for id in ["e", "f", "g"] {
            assert!(spend(id).unwrap().allowed());
        }
        assert!(spend("h").is_err(), "the fifth key is over the cap of 4");
    });
    let m = support::scrape::samples(&handle.render());
    assert_eq!(m["tower_ratelimits_memory_full_total{}"], 1.0);
    assert_eq!(m["tower_ratelimits_memory_sweeps_total{}"], 1.0);
    assert_eq!(m["tower_ratelimits_memory_swept_keys_total{}"], 3.0);
    assert_eq!(
        m["tower_ratelimits_memory_keys{}"], 1.0,
        "d was held after the sweep"
    );
}

/// Partial grants are counted by outcome, with their units, recorded by a real Prometheus
/// recorder and parsed.
#[test]
fn partial_grants_are_counted() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let clock = ManualClock::new(1_000_000);
        let limiter = Limiter::new(
            Limits::from_yaml_str("A: {burst: 10, count: 10, period: 1s}\n", None).unwrap(),
            MemoryBackend::builder().clock(clock.clone()).build(),
        );
        let key = limiter.parse_key("A", "x").unwrap();
        let spend = |range: std::ops::RangeInclusive<u64>| {
            let tx = Transaction::new(key.clone()).cost_range(range);
            let d = support::ready(limiter.spend(&[tx])).unwrap();
            d.decisions()[0].granted()
        };
        assert_eq!(spend(1..=4), 4, "whole");
        assert_eq!(spend(2..=100), 6, "partial");
        assert_eq!(spend(1..=3), 0, "denied");
        // A single cost is not a range.
        let single = Transaction::new(key.clone()).cost(0);
        support::ready(limiter.spend(&[single])).unwrap();
    });
    let m = support::scrape::samples(&handle.render());
    let grants = |outcome: &str| {
        m[&format!("tower_ratelimits_partial_grants_total{{limit=A,outcome={outcome}}}")]
    };
    assert_eq!(
        (grants("whole"), grants("partial"), grants("denied")),
        (1.0, 1.0, 1.0)
    );
    assert_eq!(
        m["tower_ratelimits_partial_granted_units_total{limit=A}"],
        10.0
    );
}

/// A batch that names one key twice is refused before anything is decided, by a spend, a
/// check and a refund alike (a layer's rules never do: it refuses two rules of one limit when
/// it is built, and its requests skip the search); a batch of two keys of one limit is not.
#[tokio::test]
async fn a_batch_naming_one_key_twice_is_refused_by_every_op() {
    let (limiter, _, _) = setup();
    let twice = [
        tx(&limiter, "A", "1"),
        tx(&limiter, "B", "1"),
        tx(&limiter, "A", "1"),
    ];
    let refused = |r: Result<_, LimiterError>| matches!(r, Err(LimiterError::DuplicateKey(key)) if key.contains('A'));
    assert!(refused(limiter.spend(&twice).await), "spend");
    assert!(refused(limiter.check(&twice).await), "check");
    assert!(refused(limiter.refund(&twice).await), "refund");
    // Nothing was spent by the refused spend: a check of one unit leaves 49 of a full 50.
    let d = limiter.check(&twice[..1]).await.unwrap();
    assert_eq!(d.strictest().unwrap().remaining(), 49);
    let two = [tx(&limiter, "A", "1"), tx(&limiter, "A", "2")];
    assert!(limiter.spend(&two).await.unwrap().allowed());
}
