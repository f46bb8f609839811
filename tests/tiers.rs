//! The burst-tier state machine: the spec's examples V1-V8, the named patterns as scenarios,
//! and property tests against a naive model that keeps every single unit it grants.

#[path = "support/cases.rs"]
mod cases;

use proptest::prelude::*;
use tower_ratelimits::__private::tiers::{self, Tier, TierLog, TierState, TieredLimit};

const S: u64 = 1_000_000;

fn limit(tiers: &[(u64, f64, f64, f64)]) -> TieredLimit {
    TieredLimit::new(
        tiers
            .iter()
            .map(|&(l, w, a, c)| Tier::from_micros(l, us(w), us(a), us(c))),
    )
    .unwrap()
}

fn us(seconds: f64) -> u64 {
    (seconds * 1e6).round() as u64
}

/// `(time in seconds, min, max, units per tier or None for a rejection)`.
type Step<'a> = (f64, u64, u64, Option<&'a [u64]>);

fn run(limit: &TieredLimit, steps: &[Step<'_>]) {
    let mut state = TierState::new();
    for (n, &(t, min, max, expect)) in steps.iter().enumerate() {
        let d = tiers::spend(limit, &mut state, us(t), min, max).unwrap();
        match expect {
            None => assert!(!d.allowed, "step {n} at {t}s: expected R, got {d:?}"),
            Some(units) => {
                assert!(
                    d.allowed,
                    "step {n} at {t}s: expected G {units:?}, got {d:?}"
                );
                assert_eq!(d.units(limit), units, "step {n} at {t}s");
                assert_eq!(d.granted, units.iter().sum::<u64>(), "step {n} at {t}s");
            }
        }
    }
}

const SIMPLE: &[(u64, f64, f64, f64)] = &[(5, 1.0, 1.0, 0.0)];
const PENALTY: &[(u64, f64, f64, f64)] = &[(5, 1.0, 1.0, 0.0), (50, 5.0, 5.0, 15.0)];
const PUNISHMENT: &[(u64, f64, f64, f64)] = &[(5, 1.0, 1.0, 0.0), (1, 15.0, 15.0, 0.0)];
const BATCH: &[(u64, f64, f64, f64)] = &[(50, 15.0, 15.0, 30.0)];

const T1: Option<&[u64]> = Some(&[1]);
const A1: Option<&[u64]> = Some(&[1, 0]);
const B1: Option<&[u64]> = Some(&[0, 1]);

#[test]
fn v1_simple() {
    run(
        &limit(SIMPLE),
        &[
            (0.0, 1, 1, T1),
            (0.1, 1, 1, T1),
            (0.2, 1, 1, T1),
            (0.3, 1, 1, T1),
            (0.4, 1, 1, T1),
            (0.5, 1, 1, None),
            (0.99, 1, 1, None),
            (1.00, 1, 1, None),
            (1.01, 1, 1, T1),
            (1.05, 1, 1, None),
            (1.10, 1, 1, None),
            (1.11, 1, 1, T1),
        ],
    );
}

#[test]
fn v2_penalty() {
    let mut steps: Vec<Step<'_>> = (0..5).map(|i| (f64::from(i) / 10.0, 1, 1, A1)).collect();
    steps.extend([
        (0.5, 1, 1, B1),
        (0.6, 1, 1, B1),
        (1.0, 48, 48, Some(&[0, 48][..])),
        (1.5, 1, 1, None),
        (5.5, 1, 1, None),
        (5.51, 1, 1, A1),
        (5.52, 1, 1, A1),
        (5.53, 1, 1, A1),
        (5.54, 1, 1, A1),
        (5.55, 1, 1, A1),
        (5.56, 1, 1, None),
        (6.52, 1, 1, A1),
        (20.0, 5, 5, Some(&[5, 0][..])),
        (20.5, 1, 1, None),
        (20.51, 1, 1, B1),
        (20.52, 1, 1, B1),
    ]);
    run(&limit(PENALTY), &steps);
}

#[test]
fn v3_punishment() {
    let mut steps: Vec<Step<'_>> = (0..5).map(|i| (f64::from(i) / 10.0, 1, 1, A1)).collect();
    steps.extend([
        (0.5, 1, 1, B1),
        (0.6, 1, 1, None),
        (5.0, 1, 1, None),
        (15.5, 1, 1, None),
        (15.51, 1, 1, A1),
        (15.52, 1, 1, A1),
        (15.53, 1, 1, A1),
        (15.54, 1, 1, A1),
        (15.55, 1, 1, A1),
        (15.56, 1, 1, B1),
        (15.57, 1, 1, None),
    ]);
    run(&limit(PUNISHMENT), &steps);
}

#[test]
fn v4_batch() {
    let mut steps: Vec<Step<'_>> = vec![(0.0, 1, 1, T1), (1.0, 49, 49, Some(&[49]))];
    for t in [2.0, 14.99, 15.0, 15.01, 30.0, 45.0] {
        steps.push((t, 1, 1, None));
    }
    steps.extend([
        (45.01, 1, 1, T1),
        (45.02, 49, 49, Some(&[49][..])),
        (45.03, 1, 1, None),
    ]);
    run(&limit(BATCH), &steps);
}

#[test]
fn v4b_batch_quota_unused() {
    run(
        &limit(BATCH),
        &[
            (0.0, 10, 10, Some(&[10])),
            (14.0, 1, 1, T1),
            (15.01, 1, 1, None),
            (45.01, 1, 1, T1),
        ],
    );
}

#[test]
fn v5_group_requests() {
    run(
        &limit(PENALTY),
        &[
            (0.0, 3, 3, Some(&[3, 0])),
            (0.1, 1, 10, Some(&[2, 8])),
            (0.2, 45, 45, None),
            (0.3, 1, 45, Some(&[0, 42])),
            (0.4, 1, 1, None),
            (5.6, 3, 8, Some(&[5, 0])),
            (5.7, 1, 1, None),
            (5.8, 6, 6, None),
        ],
    );
}

#[test]
fn v6_unshadowing() {
    run(
        &limit(&[(2, 1.0, 10.0, 0.0), (4, 1.0, 2.0, 5.0)]),
        &[
            (0.0, 1, 1, A1),
            (0.1, 1, 1, A1),
            (0.2, 1, 1, B1),
            (1.5, 1, 1, B1),
            (2.2, 1, 1, B1),
            (2.3, 1, 1, A1),
            (2.4, 1, 1, A1),
            (2.5, 1, 1, None),
            (3.31, 1, 1, A1),
            (7.0, 1, 1, A1),
            (7.1, 1, 1, A1),
            (7.2, 1, 1, None),
            (7.21, 1, 1, B1),
        ],
    );
}

#[test]
fn v7_multi_level_fallback() {
    let t1: Option<&[u64]> = Some(&[1, 0, 0]);
    let t2: Option<&[u64]> = Some(&[0, 1, 0]);
    let t3: Option<&[u64]> = Some(&[0, 0, 1]);
    run(
        &limit(&[(2, 1.0, 1.0, 0.0), (3, 1.0, 2.0, 4.0), (5, 1.0, 3.0, 0.0)]),
        &[
            (0.0, 1, 1, t1),
            (0.1, 1, 1, t1),
            (0.2, 1, 1, t2),
            (0.3, 1, 1, t2),
            (0.4, 1, 1, t2),
            (0.5, 1, 1, t3),
            (0.6, 1, 1, t3),
            (3.5, 1, 1, t3),
            (3.51, 1, 1, t1),
            (3.52, 1, 1, t1),
            (3.53, 1, 1, None),
            (6.2, 1, 1, t1),
            (6.21, 1, 1, t1),
        ],
    );
}

#[test]
fn v8_upper_windows_start_empty() {
    run(
        &limit(&[(1, 1.0, 1.0, 0.0), (2, 10.0, 1.0, 0.0)]),
        &[
            (0.0, 1, 1, A1),
            (0.1, 1, 1, B1),
            (0.2, 1, 1, B1),
            (0.3, 1, 1, None),
            (1.2, 1, 1, A1),
            (1.3, 1, 1, B1),
            (1.4, 1, 1, B1),
        ],
    );
}

// The named patterns, as scenarios a reader can follow.

#[test]
fn simple_pattern_allows_five_per_sliding_second() {
    let l = limit(SIMPLE);
    let mut state = TierState::new();
    for i in 0..5 {
        let d = tiers::spend(&l, &mut state, i * 1000, 1, 1).unwrap();
        assert!(d.allowed);
        assert_eq!(d.remaining, 4 - i);
    }
    let denied = tiers::spend(&l, &mut state, 5000, 1, 1).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.tier, 1);
    // The grant at 0 leaves the closed window at 1s + 1us.
    assert_eq!(denied.retry_after_us, S + 1 - 5000);
    assert!(!tiers::spend(&l, &mut state, S, 1, 1).unwrap().allowed);
    assert!(tiers::spend(&l, &mut state, S + 1, 1, 1).unwrap().allowed);
}

#[test]
fn penalty_pattern_bursts_once_then_waits_for_the_cooldown() {
    let l = limit(PENALTY);
    let mut state = TierState::new();
    let first = tiers::spend(&l, &mut state, 0, 5, 5).unwrap();
    assert!(first.allowed && !first.burst);
    // The burst: 50 more within the next 5 seconds, served by tier 2.
    let burst = tiers::spend(&l, &mut state, 100_000, 50, 50).unwrap();
    assert!(burst.allowed && burst.burst);
    assert_eq!((burst.tier, burst.remaining), (2, 0));
    let denied = tiers::spend(&l, &mut state, 200_000, 1, 1).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.tier, 2);
    // Tier 2 is active until 5.1s; then tier 1 serves again.
    assert_eq!(denied.retry_after_us, 5_100_001 - 200_000);
    // After tier 2's active period, tier 1 serves 5 per second and no further burst happens
    // until tier 2's cooldown ends at 20.1s.
    for i in 0..5 {
        assert!(
            tiers::spend(&l, &mut state, 6 * S + i, 1, 1)
                .unwrap()
                .allowed
        );
    }
    let no_burst = tiers::spend(&l, &mut state, 6 * S + 10, 1, 1).unwrap();
    assert!(!no_burst.allowed);
    assert_eq!(no_burst.retry_after_us, 7 * S + 1 - (6 * S + 10));
    // Full again at 20.1s (tier 2's cooldown) at the latest.
    assert_eq!(no_burst.reset_after_us, 20_100_001 - (6 * S + 10));
}

#[test]
fn punishment_pattern_jails_the_client_that_bursts() {
    let l = limit(PUNISHMENT);
    let mut state = TierState::new();
    assert!(tiers::spend(&l, &mut state, 0, 5, 5).unwrap().allowed);
    let jail = tiers::spend(&l, &mut state, 1, 1, 1).unwrap();
    assert!(jail.allowed && jail.burst && jail.tier == 2);
    let denied = tiers::spend(&l, &mut state, 2, 1, 1).unwrap();
    assert!(!denied.allowed);
    // Released when the prison's active period ends (15 s after entering, plus 1us).
    assert_eq!(denied.retry_after_us, 15 * S + 1 + 1 - 2);
    assert!(
        !tiers::spend(&l, &mut state, 15 * S + 1, 1, 1)
            .unwrap()
            .allowed
    );
    assert!(
        tiers::spend(&l, &mut state, 15 * S + 2, 1, 1)
            .unwrap()
            .allowed
    );
}

#[test]
fn batch_pattern_grants_fifty_then_nothing_for_thirty_seconds() {
    let l = limit(BATCH);
    let mut state = TierState::new();
    assert!(tiers::spend(&l, &mut state, 0, 20, 20).unwrap().allowed);
    // Unused quota does not survive the active period.
    let late = tiers::spend(&l, &mut state, 15 * S + 1, 1, 1).unwrap();
    assert!(!late.allowed);
    assert_eq!(late.retry_after_us, 45 * S + 1 - (15 * S + 1));
    let next = tiers::spend(&l, &mut state, 45 * S + 1, 50, 50).unwrap();
    assert!(next.allowed);
}

#[test]
fn a_lowered_limit_does_not_underflow() {
    let wide = limit(&[(10, 1.0, 1.0, 0.0), (10, 1.0, 1.0, 5.0)]);
    let mut state = TierState::new();
    assert!(tiers::spend(&wide, &mut state, 0, 15, 15).unwrap().allowed);
    // The operator lowers both tiers below what is already used, and drops a tier.
    let narrow = limit(&[(3, 1.0, 1.0, 0.0)]);
    let d = tiers::spend(&narrow, &mut state, 10, 1, 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.remaining, 0);
    assert_eq!(d.retry_after_us, S + 1 - 10);
    // Raising it again reads the same state.
    let more = limit(&[(20, 1.0, 1.0, 0.0), (10, 1.0, 1.0, 5.0), (1, 1.0, 1.0, 0.0)]);
    let d = tiers::spend(&more, &mut state, 20, 1, 12).unwrap();
    assert!(d.allowed);
    // Tier 2 is still active (entered at 0 under the old configuration), so it serves.
    assert_eq!(d.units(&more), &[0, 5, 1]);
}

#[test]
fn bad_requests_are_errors() {
    let l = limit(PENALTY);
    let mut state = TierState::new();
    assert!(tiers::spend(&l, &mut state, 0, 3, 2).is_err());
    assert!(tiers::spend(&l, &mut state, 0, 56, 56).is_err());
    assert!(tiers::spend(&l, &mut state, 0, 55, 1000).unwrap().allowed);
    assert!(state.tiers().iter().all(|t| t.grants().len() <= 1));
}

#[test]
fn refund_takes_back_the_newest_grants() {
    let l = limit(PENALTY);
    let mut state = TierState::new();
    tiers::spend(&l, &mut state, 0, 5, 5).unwrap();
    tiers::spend(&l, &mut state, 10, 3, 3).unwrap();
    let r = tiers::refund(&l, &mut state, 20, 4);
    assert!(r.allowed);
    assert_eq!((r.granted, r.units(&l)), (4, &[1, 3][..]));
    // Tier 2 stays entered (it serves), with 50 free again.
    assert_eq!((r.tier, r.remaining), (2, 50));
    let nothing = tiers::refund(&l, &mut TierState::new(), 20, 4);
    assert!(!nothing.allowed);
}

#[test]
fn state_is_dropped_once_it_equals_a_fresh_one() {
    let l = limit(PENALTY);
    let mut state = TierState::new();
    tiers::spend(&l, &mut state, 0, 6, 6).unwrap();
    // Tier 2 was entered at 0: active 5 s, cooldown 15 s.
    assert_eq!(tiers::fresh_at(&l, &state, 0, None), 20 * S + 1);
    assert!(!tiers::is_fresh(&l, &state, 20 * S));
    assert!(tiers::is_fresh(&l, &state, 20 * S + 1));
    // Memory bound: one pair per group grant, only grants that can still count.
    for i in 0..200 {
        tiers::spend(&l, &mut state, 21 * S + i * 100_000, 1, 1).unwrap();
    }
    for (tier, log) in l.tiers().iter().zip(state.tiers()) {
        assert!(log.grants().len() as u64 <= tier.limit(), "{state:?}");
    }
}

// ---------------------------------------------------------------------------------------
// The naive model: every unit granted is kept with its time and tier, every entry time is
// kept, and everything is recomputed from scratch from the spec's definitions.

#[derive(Clone, Debug)]
struct Naive {
    tiers: Vec<(u64, u64, u64, u64)>,
    entries: Vec<Option<u64>>,
    units: Vec<(u64, usize)>,
}

#[derive(Debug, PartialEq, Eq)]
enum P {
    Inactive,
    Active,
    Cooldown,
}

impl Naive {
    fn new(tiers: &[(u64, u64, u64, u64)]) -> Self {
        Self {
            tiers: tiers.to_vec(),
            entries: vec![None; tiers.len()],
            units: Vec::new(),
        }
    }

    fn phase(&self, i: usize, now: u64) -> P {
        let (_, _, a, c) = self.tiers[i];
        match self.entries[i] {
            None => P::Inactive,
            Some(e) if now > e + a + c => P::Inactive,
            Some(e) if now <= e + a => P::Active,
            Some(_) => P::Cooldown,
        }
    }

    fn used(&self, i: usize, now: u64) -> u64 {
        let w = self.tiers[i].1;
        let counts = |t: u64| t + w >= now;
        if i == 0 {
            return self
                .units
                .iter()
                .filter(|&&(t, k)| k == 0 && counts(t))
                .count() as u64;
        }
        if self.phase(i, now) == P::Inactive {
            return 0;
        }
        let e = self.entries[i].unwrap();
        self.units
            .iter()
            .filter(|&&(t, k)| k == i && counts(t) && t >= e)
            .count() as u64
    }

    fn current(&self, now: u64) -> usize {
        (0..self.tiers.len())
            .filter(|&i| self.phase(i, now) == P::Active)
            .max()
            .unwrap_or(0)
    }

    /// Grants unit by unit; returns (units per tier, visited tiers) or None.
    #[allow(clippy::needless_range_loop)]
    fn try_grant(&self, now: u64, min: u64, max: u64) -> Option<(Vec<u64>, Vec<usize>)> {
        let mut per = vec![0; self.tiers.len()];
        let mut visited = Vec::new();
        let mut granted = 0;
        let cur = self.current(now);
        for i in cur..self.tiers.len() {
            if granted == max {
                break;
            }
            if self.phase(i, now) == P::Cooldown {
                break;
            }
            visited.push(i);
            while granted < max && self.used(i, now) + per[i] < self.tiers[i].0 {
                per[i] += 1;
                granted += 1;
            }
        }
        (granted >= min).then_some((per, visited))
    }

    fn fresh(&self, at: u64) -> bool {
        (0..self.tiers.len()).all(|i| match self.entries[i] {
            None => true,
            Some(e) => at > e + self.tiers[i].2 + self.tiers[i].3,
        }) && self
            .units
            .iter()
            .all(|&(t, k)| k != 0 || t + self.tiers[0].1 < at)
    }

    /// (allowed, units, burst, tier, remaining, retry_after, reset_after)
    fn spend(&mut self, now: u64, min: u64, max: u64, write: bool) -> Out {
        let cur = self.current(now);
        match self.try_grant(now, min, max) {
            None => {
                let retry = (now + 1..)
                    .find(|&t| self.try_grant(t, min, min).is_some())
                    .unwrap()
                    - now;
                let reset = (now..).find(|&t| self.fresh(t)).unwrap() - now;
                Out {
                    allowed: false,
                    units: vec![0; self.tiers.len()],
                    burst: false,
                    tier: cur + 1,
                    remaining: self.tiers[cur].0.saturating_sub(self.used(cur, now)),
                    retry,
                    reset,
                }
            }
            Some((per, visited)) => {
                let mut after = self.clone();
                for &i in &visited {
                    if after.phase(i, now) == P::Inactive {
                        after.entries[i] = Some(now);
                    }
                    for _ in 0..per[i] {
                        after.units.push((now, i));
                    }
                }
                let serving = after.current(now);
                let out = Out {
                    allowed: true,
                    burst: per[cur + 1..].iter().any(|&d| d > 0),
                    tier: serving + 1,
                    remaining: after.tiers[serving]
                        .0
                        .saturating_sub(after.used(serving, now)),
                    retry: 0,
                    reset: (now..).find(|&t| after.fresh(t)).unwrap() - now,
                    units: per,
                };
                if write {
                    *self = after;
                }
                out
            }
        }
    }

    fn refund(&mut self, now: u64, units: u64) -> (u64, Vec<u64>) {
        let mut taken = vec![0; self.tiers.len()];
        for _ in 0..units {
            let counting: Vec<usize> = (0..self.units.len())
                .filter(|&j| {
                    let (t, k) = self.units[j];
                    let w = self.tiers[k].1;
                    t + w >= now
                        && (k == 0
                            || (self.phase(k, now) != P::Inactive && t >= self.entries[k].unwrap()))
                })
                .collect();
            let Some(&j) = counting
                .iter()
                .max_by_key(|&&j| (self.units[j].0, self.units[j].1))
            else {
                break;
            };
            taken[self.units[j].1] += 1;
            self.units.remove(j);
        }
        (taken.iter().sum(), taken)
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Out {
    allowed: bool,
    units: Vec<u64>,
    burst: bool,
    tier: usize,
    remaining: u64,
    retry: u64,
    reset: u64,
}

#[derive(Debug, Clone)]
enum Op {
    Spend { gap: u64, min: u64, extra: u64 },
    Check { gap: u64, min: u64, extra: u64 },
    Refund { gap: u64, units: u64 },
}

fn tier_strategy() -> impl Strategy<Value = (u64, u64, u64, u64)> {
    (0u64..5, 1u64..12, 1u64..12, 0u64..12)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..6, 0u64..4, 0u64..4).prop_map(|(gap, min, extra)| Op::Spend { gap, min, extra }),
        1 => (0u64..6, 1u64..4, 0u64..4).prop_map(|(gap, min, extra)| Op::Check { gap, min, extra }),
        1 => (0u64..6, 1u64..4).prop_map(|(gap, units)| Op::Refund { gap, units }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases::cases(400)))]

    #[test]
    fn matches_the_naive_model(
        tiers_spec in proptest::collection::vec(tier_strategy(), 1..4),
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        let capacity: u64 = tiers_spec.iter().map(|t| t.0).sum();
        prop_assume!(capacity > 0);
        let limit = TieredLimit::new(
            tiers_spec.iter().map(|&(l, w, a, c)| Tier::from_micros(l, w, a, c)),
        ).unwrap();
        let mut naive = Naive::new(&tiers_spec);
        let mut state = TierState::new();
        let mut now = 1000u64;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Spend { gap, min, extra } | Op::Check { gap, min, extra } => {
                    now += gap;
                    let min = min.min(capacity);
                    let max = min + extra;
                    let write = matches!(op, Op::Spend { .. });
                    let want = naive.spend(now, min, max, write);
                    let got = if write {
                        tiers::spend(&limit, &mut state, now, min, max).unwrap()
                    } else {
                        tiers::decide(&limit, &state, now, min, max).unwrap().0
                    };
                    let got = Out {
                        allowed: got.allowed,
                        units: got.units(&limit).to_vec(),
                        burst: got.burst,
                        tier: got.tier,
                        remaining: got.remaining,
                        retry: got.retry_after_us,
                        reset: got.reset_after_us,
                    };
                    prop_assert_eq!(got, want, "step {} at {}", step, now);
                }
                Op::Refund { gap, units } => {
                    now += gap;
                    let (n_taken, n_units) = naive.refund(now, units);
                    let got = tiers::refund(&limit, &mut state, now, units);
                    prop_assert_eq!((got.granted, got.units(&limit).to_vec()), (n_taken, n_units),
                        "refund at step {} at {}", step, now);
                }
            }
            for (tier, log) in limit.tiers().iter().zip(state.tiers()) {
                prop_assert!(log.grants().len() as u64 <= tier.limit(), "memory bound: {:?}", state);
            }
            prop_assert_eq!(tiers::is_fresh(&limit, &state, now), naive.fresh(now));
        }
    }
}

#[test]
fn a_state_from_parts_is_read_like_a_recorded_one() {
    let l = limit(SIMPLE);
    let state = TierState::from_tiers(vec![TierLog::new(Some(0), vec![(0, 5)])]);
    let (d, _) = tiers::decide(&l, &state, 10, 1, 1).unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after_us, S + 1 - 10);
}
