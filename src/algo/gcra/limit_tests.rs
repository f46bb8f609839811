use super::*;

/// A limit is copied on every request's road (in its quota and decision): one cache line
/// (the debt offset has a field of its own since a decision may widen the foreign bound to
/// a larger writer's: `Limit::reading`).
#[test]
fn a_limit_is_64_bytes() {
    assert_eq!(std::mem::size_of::<Limit>(), 64);
}

/// `max_debt` survives being stored inside the foreign bound, and prefetching does not
/// change it.
#[test]
fn max_debt_round_trips() {
    let limit = Limit::from_micros(10, 3, 1_000_000).unwrap();
    assert_eq!(limit.max_debt(), 10);
    let limit = limit.with_max_debt(7).unwrap();
    let limit = limit.with_prefetch(5, Duration::from_secs(1)).unwrap();
    assert_eq!((limit.max_debt(), limit.debt_offset_us()), (7, 7 * 333_334));
}

#[test]
fn validates() {
    assert_eq!(
        Limit::from_micros(0, 1, 1),
        Err(LimitError::Zero { field: "burst" })
    );
    assert_eq!(
        Limit::from_micros(1, 0, 1),
        Err(LimitError::Zero { field: "count" })
    );
    assert_eq!(
        Limit::from_micros(1, 1, 0),
        Err(LimitError::Zero { field: "period" })
    );
    assert!(matches!(
        Limit::from_micros(1, 1001, 1000),
        Err(LimitError::TooFast { .. })
    ));
    assert!(matches!(
        Limit::from_micros(u64::MAX, 1, 2),
        Err(LimitError::BurstOffsetTooLarge { .. })
    ));
    assert!(matches!(
        Limit::from_micros(2, 1, MAX_BURST_OFFSET_US),
        Err(LimitError::BurstOffsetTooLarge { .. })
    ));
    let l = Limit::from_micros(1, 1, MAX_BURST_OFFSET_US).unwrap();
    assert_eq!(l.burst_offset_us(), MAX_BURST_OFFSET_US);
    // EI rounds up (never admits more than configured): 1s / 3 = 333_334us.
    let l = Limit::from_micros(3, 3, 1_000_000).unwrap();
    assert_eq!(l.emission_interval_us(), 333_334);
    assert_eq!(l.burst_offset_us(), 1_000_002);
}

/// A TAT as far ahead as the crate writes (burst offset, debt, the slack) is a bucket in
/// debt; one microsecond further it is foreign: a bucket drained under this limit for every
/// computation, replaced by that drained state (a TAT decades ahead blocked its key for
/// decades before, since a denial writes nothing; read as fresh, a bucket drained under a
/// larger limit was handed a full burst).
#[test]
fn a_tat_beyond_what_the_crate_writes_is_a_drained_bucket() {
    let l = Limit::from_micros(3, 3, 1_000_000)
        .unwrap()
        .with_max_debt(2)
        .unwrap();
    let now = 1_000_000_000_000;
    let bo = l.burst_offset_us();
    let furthest = l.bound_us() + FOREIGN_SLACK_US;
    let ours = Some(now + furthest);
    assert!(!check(&l, ours, now, 0).unwrap().allowed);
    assert_eq!(charge(&l, ours, now, 5).unwrap().1, 0);
    assert!(refund(&l, ours, now, 1).unwrap().allowed);
    assert_eq!(l.repair(ours, now), None);
    let drained = Some(now + bo);
    for foreign in [
        now + furthest + 1,
        now + 30 * 365 * 86_400_000_000,
        u64::MAX,
    ] {
        let d = check(&l, Some(foreign), now, 1).unwrap();
        assert_eq!(d, check(&l, drained, now, 1).unwrap(), "{foreign}");
        assert!(!d.allowed);
        assert_eq!(
            (d.remaining, d.retry_after_us),
            (0, l.emission_interval_us())
        );
        // A probe sees the drained bucket; a range gets nothing; a charge goes into debt.
        assert!(check(&l, Some(foreign), now, 0).unwrap().allowed);
        assert_eq!(check_range(&l, Some(foreign), now, 0, 9).unwrap().1, 0);
        assert_eq!(charge(&l, Some(foreign), now, 9).unwrap().1, 2);
        // A refund gives back from the drained bucket, and its write replaces the value.
        let r = refund(&l, Some(foreign), now, 1).unwrap();
        assert!(r.allowed);
        assert_eq!(r.new_tat, Some(now + bo - l.emission_interval_us()));
        assert_eq!(l.repair(Some(foreign), now), drained);
        // Read by a limit that knows its writer's bound, it is the crate's.
        let wide = l.reading(foreign - now);
        assert!(!wide.is_foreign(Some(foreign), now));
        assert_eq!(
            check(&wide, Some(foreign), now, 0).unwrap().reset_after_us,
            foreign - now
        );
    }
}

/// The configured rate is a promise: at most `count` per `period`, and within 0.1% of it,
/// or the limit is refused. Before, `period / count` was truncated: 600,000/s admitted
/// 1,000,000/s and 300,000/s admitted 11% too many.
#[test]
fn never_admits_more_than_configured_and_refuses_what_microseconds_cannot_express() {
    for (count, period_us) in [
        (600_000u64, 1_000_000u64),
        (300_000, 1_000_000),
        (3_000, 1_000_000 - 1),
        (999_999, 1_000_000),
    ] {
        assert!(
            matches!(
                Limit::from_micros(count, count, period_us),
                Err(LimitError::Inexact { .. })
            ),
            "{count}/{period_us}us"
        );
    }
    let e = Limit::from_micros(600_000, 600_000, 1_000_000).unwrap_err();
    assert_eq!(
        e,
        LimitError::Inexact {
            period_us: 1_000_000,
            count: 600_000,
            emission_interval_us: 2,
            shortfall_permille: 166,
        }
    );
    // Over any span, the admitted rate never exceeds count/period, and is within 0.1%.
    for count in (1u64..=20_000).chain([100_000, 500_000, 1_000_000]) {
        let period_us = 1_000_000;
        let Ok(l) = Limit::from_micros(1, count, period_us) else {
            continue;
        };
        let ei = u128::from(l.emission_interval_us());
        assert!(ei * u128::from(count) >= u128::from(period_us), "{count}");
        assert!(
            ei * u128::from(count) * 1000 <= u128::from(period_us) * 1001,
            "{count}"
        );
    }
    // Boulder's limits are exact.
    assert_eq!(
        Limit::from_micros(20, 20, 1_000_000)
            .unwrap()
            .emission_interval_us(),
        50_000
    );
    assert_eq!(
        Limit::from_micros(300, 300, 180 * 60_000_000)
            .unwrap()
            .emission_interval_us(),
        36_000_000
    );
}
