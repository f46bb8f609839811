//! The fair-share rule's pieces case by case: the active weights by refresh period, an id's
//! share (its weight, or its minimum scaled down), the reserve, an id's own bucket.

use super::*;

const S: u64 = 1_000_000;

fn share(weight: u64, min: u64) -> FairShare {
    let budget = Limit::from_micros(100, 100, S).unwrap();
    FairShare::new(budget)
        .unwrap()
        .with_weight(weight)
        .unwrap()
        .with_min(min)
        .unwrap()
}

fn id(text: &str) -> Id {
    Id::new(text).unwrap()
}

#[test]
fn an_id_counts_once_per_period_in_the_shares_of_its_period_and_is_kept_to_the_next() {
    let a = share(2, 0);
    let b = share(3, 0);
    let mut pool = Pool::default().rolled(&a, 10 * S);
    let (mut ma, mut mb) = (Member::default(), Member::default());
    pool.count(&a, &mut ma);
    pool.count(&a, &mut ma);
    pool.count(&b, &mut mb);
    assert_eq!(pool.weights, (5, 0));
    assert_eq!(pool.share_of(&a), ShareOf { num: 2, den: 5 });
    // The next period: both kept as "previous" until seen again, in the shares only once
    // seen (b, idle so far in this period, has no share in it).
    let mut pool = pool.clone().rolled(&a, 11 * S);
    assert_eq!(pool.weights, (0, 5));
    pool.count(&a, &mut ma);
    assert_eq!(pool.weights, (2, 3));
    assert_eq!(pool.share_of(&a), ShareOf { num: 2, den: 2 });
    pool.count(&b, &mut mb);
    assert_eq!(pool.share_of(&a), ShareOf { num: 2, den: 5 });
    // The period after: both kept, in no share until seen again; then forgotten.
    let pool = pool.clone().rolled(&a, 12 * S);
    assert_eq!(pool.weights, (0, 5));
    assert_eq!(pool.share_of(&a), ShareOf { num: 2, den: 2 });
    assert_eq!(pool.clone().rolled(&a, 14 * S).weights, (0, 0));
}

#[test]
fn a_weight_changed_within_a_period_replaces_the_old_one() {
    let mut pool = Pool::default().rolled(&share(1, 0), 0);
    let mut m = Member::default();
    pool.count(&share(1, 0), &mut m);
    pool.count(&share(4, 0), &mut m);
    assert_eq!(pool.weights, (4, 0));
}

#[test]
fn a_clock_behind_the_pool_counts_in_the_stored_period() {
    let a = share(1, 0);
    let mut pool = Pool::default().rolled(&a, 10 * S);
    let mut m = Member::default();
    pool.count(&a, &mut m);
    let back = pool.clone().rolled(&a, 9 * S);
    assert_eq!((back.epoch, back.weights), (pool.epoch, (1, 0)));
}

#[test]
fn a_minimum_above_the_weighted_share_is_the_share_scaled_down_when_minimums_exceed_the_count() {
    let small = share(1, 40);
    let big = share(9, 0);
    let mut pool = Pool::default().rolled(&small, 0);
    let (mut ms, mut mb) = (Member::default(), Member::default());
    pool.count(&small, &mut ms);
    pool.count(&big, &mut mb);
    // Weighted 1/10; its minimum 40 of the 100 a second is more.
    assert_eq!(pool.share_of(&small), ShareOf { num: 40, den: 100 });
    // Three more ids with 40 each: 160 asked of 100, each 40/160.
    for n in 0..3 {
        let mut m = Member::default();
        let _ = n;
        pool.count(&small, &mut m);
    }
    assert_eq!(pool.share_of(&small), ShareOf { num: 40, den: 160 });
}

#[test]
fn the_reserve_is_what_the_other_waiters_asked_for_at_most_the_burst_less_the_request() {
    let a = share(1, 0);
    let mut pool = Pool::default();
    pool.wait(&id("x"), 5 * S, 30);
    pool.wait(&id("y"), 5 * S, 90);
    assert_eq!(
        pool.reserve_for(&a, (&id("z"), &Member::default()), 1, (false, true)),
        99
    );
    assert_eq!(
        pool.reserve_for(&a, (&id("y"), &Member::default()), 1, (false, true)),
        30
    );
    pool.served(&id("y"));
    assert_eq!(
        pool.reserve_for(&a, (&id("z"), &Member::default()), 1, (false, true)),
        30
    );
    // Refused again: the entry is replaced, not added.
    pool.wait(&id("x"), 6 * S, 2);
    assert_eq!(
        pool.reserve_for(&a, (&id("z"), &Member::default()), 1, (false, true)),
        2
    );
    // Past its retry_after, a waiter holds nothing.
    assert!(pool.clone().rolled(&a, 6 * S + 1).waiting.is_empty());
    assert_eq!(pool.clone().rolled(&a, 6 * S).waiting.len(), 1);
}

#[test]
fn the_waiters_are_bounded() {
    let mut pool = Pool::default();
    for n in 0..(MAX_WAITERS + 10) {
        pool.wait(&id(&format!("w{n}")), S, 1);
    }
    assert_eq!(pool.waiting.len(), MAX_WAITERS);
}

#[test]
fn an_id_is_under_its_share_while_its_own_bucket_holds_the_request() {
    let limit = Limit::from_micros(100, 100, S).unwrap();
    // A quarter of 100 a second: 25 a second, a burst of 25.
    let s = ShareOf { num: 1, den: 4 };
    assert_eq!(share_interval_us(&limit, s), 40_000);
    let now = 50 * S;
    let mut tat = 0;
    for _ in 0..25 {
        assert!(under_share(&limit, s, tat, 1, now));
        tat = member_spent(&limit, s, tat, 1, now);
    }
    assert!(!under_share(&limit, s, tat, 1, now));
    assert!(under_share(&limit, s, tat, 1, now + 40_000));
    // Given back: under again at once.
    let back = member_refunded(&limit, s, tat, 1, now);
    assert!(under_share(&limit, s, back, 1, now));
}

#[test]
fn a_tiny_share_still_admits_one_unit_per_its_interval() {
    let limit = Limit::from_micros(10, 10, S).unwrap();
    let s = ShareOf { num: 1, den: 1000 };
    assert!(under_share(&limit, s, 0, 1, S));
    let tat = member_spent(&limit, s, 0, 1, S);
    assert!(!under_share(&limit, s, tat, 1, S + 99 * S));
    assert!(under_share(&limit, s, tat, 1, S + 100 * S));
}

#[test]
fn the_fields_are_checked() {
    let budget = Limit::from_micros(10, 10, S).unwrap();
    let s = FairShare::new(budget).unwrap();
    assert_eq!(s.clone().with_weight(0), Err(FairShareError::Weight(0)));
    assert_eq!(
        s.clone().with_min(11),
        Err(FairShareError::MinAboveCount { min: 11, count: 10 })
    );
    assert_eq!(
        s.clone().with_refresh(Duration::from_micros(10)),
        Err(FairShareError::Refresh)
    );
    let prefetched = budget.with_prefetch(2, Duration::from_secs(1)).unwrap();
    assert_eq!(FairShare::new(prefetched), Err(FairShareError::Prefetch));
    assert_eq!(
        s.clone().with_new_ids(101),
        Err(FairShareError::NewIds(101))
    );
}

/// New ids' part: a percentage of what the budget refills in a refresh period, rounded up;
/// 0 leaves them nothing while a known id is refused, 100 the whole rate.
#[test]
fn the_new_ids_part_is_a_share_of_a_refresh_periods_refill() {
    let budget = Limit::from_micros(10, 100, S).unwrap();
    let s = FairShare::new(budget).unwrap();
    assert_eq!((s.new_ids(), s.new_ids_cap()), (10, 10));
    assert_eq!(s.clone().with_new_ids(0).unwrap().new_ids_cap(), 0);
    assert_eq!(s.clone().with_new_ids(100).unwrap().new_ids_cap(), 100);
    assert_eq!(s.clone().with_new_ids(1).unwrap().new_ids_cap(), 1);
    let quick = s.clone().with_refresh(Duration::from_millis(250)).unwrap();
    assert_eq!(
        quick.with_new_ids(3).unwrap().new_ids_cap(),
        1,
        "0.75 rounded up"
    );
    assert!(!s.same_budget(&s.clone().with_new_ids(20).unwrap()));
}

/// The gate opens only while an id seen before was refused in this period or the one
/// before, and only for new ids once their part is taken.
#[test]
fn new_ids_are_gated_only_while_a_known_id_is_refused() {
    let a = share(1, 0);
    let mut pool = Pool::default().rolled(&a, 10 * S);
    let e = pool.epoch;
    pool.fresh = 100;
    assert!(!pool.gates_newcomers(&a), "no one refused");
    pool.pressed = e - 1;
    assert!(pool.gates_newcomers(&a));
    let later = pool.clone().rolled(&a, 11 * S);
    assert!(
        !later.gates_newcomers(&a),
        "the part is whole again in a new period"
    );
    let mut m = Member::default();
    assert!(m.newcomer(e));
    pool.count(&a, &mut m);
    assert!(m.newcomer(e), "first counted in this period");
    assert!(!m.newcomer(e + 1), "seen before the next");
}

#[test]
fn a_fresh_pool_counts_in_the_period_of_now() {
    // The first id's count must survive the second's roll (a pool never stored is rolled
    // too: counted in period 0, it would be forgotten by the next request).
    let a = share(2, 0);
    let mut pool = Pool::default().rolled(&a, 10 * S);
    let mut m = Member::default();
    pool.count(&a, &mut m);
    let pool = pool.rolled(&a, 10 * S + 1);
    assert_eq!(pool.weights, (2, 0));
}

/// The units held for the ids asking below their share: the most admitted to the others in
/// one of the last three refresh periods (given back by a refund), left by every id not asking
/// below its own share (under its share too), and by one over its share with the waiters'
/// units; an id's own units are not held against it, and a full budget always admits.
#[test]
fn units_are_held_for_the_ids_asking_below_their_share() {
    let a = share(1, 0);
    let mut pool = Pool::default().rolled(&a, 10 * S);
    let (mut sparse, mut flood) = (Member::default(), Member::default());
    pool.hold(&mut sparse, true, 2, false);
    pool.hold(&mut sparse, true, 1, false);
    pool.hold(&mut flood, false, 5, false);
    assert_eq!((pool.held, sparse.below), ([3, 0, 0], [3, 0, 0]));
    pool.hold(&mut sparse, true, 1, true);
    assert_eq!(
        (pool.held, sparse.below),
        ([2, 0, 0], [2, 0, 0]),
        "a refund gives back"
    );
    pool.hold(&mut sparse, true, 1, false);
    pool.wait(&id("w"), 20 * S, 5);
    let reserve = |p: &Pool, m: &Member, cost, how| p.reserve_for(&a, (&id("f"), m), cost, how);
    assert_eq!(
        reserve(&pool, &flood, 1, (false, false)),
        3,
        "under its share"
    );
    assert_eq!(
        reserve(&pool, &flood, 1, (false, true)),
        8,
        "over its share"
    );
    assert_eq!(
        reserve(&pool, &flood, 1, (true, false)),
        0,
        "below its share"
    );
    assert_eq!(
        reserve(&pool, &flood, 99, (false, false)),
        1,
        "a full budget admits"
    );
    assert_eq!(reserve(&pool, &sparse, 1, (false, false)), 0, "not its own");
    // The most of the last three periods, then nothing.
    let mut later = pool.clone().rolled(&a, 11 * S);
    later.hold(&mut sparse, true, 1, false);
    assert_eq!((later.held, sparse.below), ([1, 3, 0], [1, 3, 0]));
    assert_eq!(reserve(&later, &flood, 1, (false, false)), 3);
    let later = later.rolled(&a, 12 * S);
    assert_eq!(later.held, [0, 1, 3]);
    assert!(later.fresh_at(&a) >= 13 * S && sparse.fresh_at(&a) >= 13 * S);
    assert_eq!(later.rolled(&a, 13 * S).held, [0, 0, 1]);
    assert_eq!(pool.rolled(&a, 13 * S).held, [0; 3]);
}

/// An id's own bucket is at most a burst ahead when it asks (or one request at its share, when
/// that is longer): what it was lent over its share is not owed.
#[test]
fn what_an_id_was_lent_is_not_owed() {
    let budget = Limit::from_micros(10, 100, S).unwrap();
    let quarter = ShareOf { num: 1, den: 4 };
    let bo = budget.burst_offset_us();
    assert_eq!(member_owed(&budget, quarter, 50 * S, 1, S), S + bo);
    assert_eq!(member_owed(&budget, quarter, S + bo, 1, S), S + bo);
    assert_eq!(member_owed(&budget, quarter, 0, 1, S), 0);
    // A share so small one unit is longer than the burst: one unit's length is kept.
    let tiny = ShareOf { num: 1, den: 100 };
    let unit = share_interval_us(&budget, tiny);
    assert!(unit > bo);
    assert_eq!(member_owed(&budget, tiny, S + unit, 1, S), S + unit);
    assert_eq!(member_owed(&budget, tiny, 50 * S, 1, S), S + unit);
}
