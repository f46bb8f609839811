//! The budget against an exhaustive search of every way a key can ask, on small ladders in a
//! short span: at each microsecond, any number of units, each counted by the rule itself.

use std::collections::HashMap;

use super::super::{Ladder, PenaltyState, Tally};

/// The most units counted in `[t, span)` from `state`, every choice tried.
fn exhaustive(
    l: &Ladder,
    span: u64,
    t: u64,
    state: PenaltyState,
    memo: &mut HashMap<(u64, PenaltyState), u64>,
) -> u64 {
    if t >= span {
        return 0;
    }
    if let Some(&v) = memo.get(&(t, state.clone())) {
        return v;
    }
    let mut best = 0;
    let mut s = state.clone();
    let mut got = 0;
    // n units at t, one after the other (a unit refused by a ban counts nothing), then on.
    for _ in 0..=l.after {
        best = best.max(got + exhaustive(l, span, t + 1, s.clone(), memo));
        match s.count(l, b"k", 1, t) {
            Tally::Ignored => break,
            _ => got += 1,
        }
    }
    memo.insert((t, state), best);
    best
}

#[test]
fn the_budget_is_the_most_an_exhaustive_search_finds() {
    let mut cases = 0;
    for after in 1..=3 {
        for within in 1..=4 {
            for (base, factor, max) in [(1, 1, 1), (1, 2, 8), (2, 3, 18), (3, 1, 3), (1, 5, 25)] {
                for forget in [1, 2, 5, 100] {
                    let l = Ladder::new(after, within, base, factor, max)
                        .unwrap()
                        .forget_after(forget)
                        .unwrap();
                    for span in [1, 6, 17] {
                        let mut memo = HashMap::new();
                        let most = exhaustive(&l, span, 0, PenaltyState::default(), &mut memo);
                        let b = l.budget(span);
                        assert!(b.exact);
                        assert_eq!(
                            b.units, most,
                            "after {after} within {within} base {base} factor {factor} max {max} forget {forget} span {span}"
                        );
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 3 * 4 * 5 * 4 * 3);
}

#[test]
fn a_login_ladder_allows_a_few_hundred_a_day() {
    const S: u64 = 1_000_000;
    const DAY: u64 = 86_400 * S;
    // 5 failures in 10 minutes bans for 1, 5, 25 minutes... up to a day; a day of quiet
    // forgets a step.
    let l = Ladder::new(5, 600 * S, 60 * S, 5, DAY)
        .unwrap()
        .forget_after(DAY)
        .unwrap();
    let b = l.budget(DAY);
    assert!(b.exact);
    // Never banned: 4 every 10 minutes, 144 times, and a fifth at the last: 577. Two bans
    // first (1 and 5 minutes, 10 units) cost 6 minutes, which the day's 144 bursts still fit.
    assert_eq!(b.units, 587);
}

#[test]
fn ladders_too_fine_to_search_get_a_bound_above_every_schedule() {
    // Bans of a microsecond, a window of a day: a ban every microsecond.
    let l = Ladder::new(1_000, 86_400_000_000, 1, 1, 1).unwrap();
    let b = l.budget(86_400_000_000);
    assert!(!b.exact);
    // One ban per microsecond, 1,000 units each, is what a key could do at most.
    assert!(b.units >= 1_000 * 86_400_000_000);
    // The bound is bounded work: it returns, and saturates rather than overflows.
    let l = Ladder::new(1_000, 1, 1, 1, 1).unwrap();
    assert!(!l.budget(u64::MAX).exact);
}

/// The budget's recursion with every ban time tried (no pruning), for longer spans than the
/// exhaustive search reaches.
fn every_time(
    l: &Ladder,
    span: u64,
    e: u64,
    level: u32,
    memo: &mut HashMap<(u64, u32), u64>,
) -> u64 {
    if e >= span {
        return 0;
    }
    if let Some(&v) = memo.get(&(e, level)) {
        return v;
    }
    let mut best = 0;
    for at in e..span {
        let now_level = level.saturating_sub(((at - e) / l.forget_after_us) as u32) + 1;
        let units = ((at - e) / l.within_us + 1) * (l.after - 1) + 1;
        let end = at + l.ban_us(now_level);
        best = best.max(units + every_time(l, span, end, now_level, memo));
    }
    memo.insert((e, level), best);
    best
}

#[test]
fn the_times_the_budget_tries_find_what_trying_every_time_finds() {
    let mut rng = crate::algo::Rng(0x2545_f491_4f6c_dd1d);
    let mut next = |n: u64| rng.below(n);
    for case in 0..120 {
        let base = 1 + next(10);
        let l = Ladder::new(
            1 + next(6),
            1 + next(25),
            base,
            1 + next(4),
            base * (1 + next(30)),
        )
        .unwrap()
        .forget_after(1 + next(40))
        .unwrap();
        let span = 1 + next(200);
        let most = every_time(&l, span, 0, 0, &mut HashMap::new());
        assert_eq!(l.budget(span).units, most, "case {case}: {l:?} span {span}");
    }
}
