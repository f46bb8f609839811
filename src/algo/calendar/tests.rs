//! The calendar rule's unit tests: the spec's worked examples (`docs/calendar.md`) as tests
//! named as sentences, the read rule, the zones.

use super::*;

fn month(anchor: Option<u64>) -> CalendarQuota {
    let q = CalendarQuota::new(10, Period::Month).unwrap();
    match anchor {
        Some(a) => q.anchor_day(a).unwrap(),
        None => q,
    }
}

#[test]
fn a_month_without_an_anchor_is_the_calendar_month() {
    let q = month(None);
    assert_eq!(
        q.period_at(utc(2026, 11, 24, 0, 0)),
        (utc(2026, 11, 1, 0, 0), utc(2026, 12, 1, 0, 0))
    );
    // The last day of a month belongs to it, the 1st to the next one.
    assert_eq!(
        q.period_at(utc(2026, 11, 30, 23, 59)).1,
        utc(2026, 12, 1, 0, 0)
    );
    assert_eq!(
        q.period_at(utc(2026, 12, 1, 0, 0)).0,
        utc(2026, 12, 1, 0, 0)
    );
    // February of a leap year and of a common one, and a year's turn.
    assert_eq!(
        q.period_at(utc(2028, 2, 10, 0, 0)),
        (utc(2028, 2, 1, 0, 0), utc(2028, 3, 1, 0, 0))
    );
    assert_eq!(
        q.period_at(utc(2027, 2, 28, 12, 0)),
        (utc(2027, 2, 1, 0, 0), utc(2027, 3, 1, 0, 0))
    );
    assert_eq!(
        q.period_at(utc(2026, 12, 31, 12, 0)).1,
        utc(2027, 1, 1, 0, 0)
    );
    // The same as anchor_day 1.
    let first = month(Some(1));
    for day in 1..=31 {
        let t = utc(2026, 12, day, 7, 0);
        assert_eq!(q.period_at(t), first.period_at(t));
    }
}

#[test]
fn anchor_31_renews_on_the_last_day_of_shorter_months() {
    let q = month(Some(31));
    assert_eq!(
        q.period_at(utc(2027, 2, 1, 0, 0)),
        (utc(2027, 1, 31, 0, 0), utc(2027, 2, 28, 0, 0))
    );
    assert_eq!(
        q.period_at(utc(2027, 3, 1, 0, 0)),
        (utc(2027, 2, 28, 0, 0), utc(2027, 3, 31, 0, 0))
    );
    assert_eq!(
        q.period_at(utc(2028, 2, 29, 0, 0)).0,
        utc(2028, 2, 29, 0, 0)
    );
    assert_eq!(
        q.period_at(utc(2027, 4, 30, 12, 0)).0,
        utc(2027, 4, 30, 0, 0)
    );
}

#[test]
fn the_boundary_is_exact_to_the_microsecond() {
    let q = month(Some(15)).at("06:30").unwrap().zone("+02:00").unwrap();
    let renewal = utc(2026, 12, 15, 4, 30);
    assert_eq!(q.period_at(renewal - 1).1, renewal);
    assert_eq!(q.period_at(renewal).0, renewal);
    let s = CalendarState {
        end_us: renewal,
        used: 10,
    };
    assert!(
        !decide(
            &q,
            Some(s),
            q.period_at(renewal - 1).1,
            renewal - 1,
            1,
            1,
            Mode::CheckAndSpend
        )
        .allowed
    );
    assert!(
        decide(
            &q,
            Some(s),
            q.period_at(renewal).1,
            renewal,
            1,
            1,
            Mode::CheckAndSpend
        )
        .allowed
    );
}

#[test]
fn days_and_weeks() {
    let d = CalendarQuota::new(5, Period::Day)
        .unwrap()
        .at("23:59")
        .unwrap();
    assert_eq!(
        d.period_at(utc(2026, 11, 24, 12, 0)),
        (utc(2026, 11, 23, 23, 59), utc(2026, 11, 24, 23, 59))
    );
    // 2026-11-24 is a Tuesday; a week renewing on Wednesday (3).
    let w = CalendarQuota::new(5, Period::Week)
        .unwrap()
        .anchor_day(3)
        .unwrap();
    assert_eq!(
        w.period_at(utc(2026, 11, 24, 12, 0)),
        (utc(2026, 11, 18, 0, 0), utc(2026, 11, 25, 0, 0))
    );
    let monday = CalendarQuota::new(5, Period::Week).unwrap();
    assert_eq!(
        monday.period_at(utc(2026, 11, 24, 0, 0)).0,
        utc(2026, 11, 23, 0, 0)
    );
    assert!(
        CalendarQuota::new(5, Period::Day)
            .unwrap()
            .anchor_day(1)
            .is_err()
    );
    assert!(
        CalendarQuota::new(5, Period::Week)
            .unwrap()
            .anchor_day(8)
            .is_err()
    );
}

#[test]
fn bad_values_are_refused_with_the_reason() {
    assert_eq!(
        CalendarQuota::new(0, Period::Day).unwrap_err(),
        CalendarError::Count(0)
    );
    for at in ["24:00", "7:00", "07:60", "0700", ""] {
        assert!(
            matches!(month(None).at(at), Err(CalendarError::At(_))),
            "{at}"
        );
    }
    for zone in ["+2", "+19:00", "02:00", "Mars"] {
        assert!(
            matches!(month(None).zone(zone), Err(CalendarError::Zone(_))),
            "{zone}"
        );
    }
}

#[test]
fn what_was_used_stays_until_the_earlier_end() {
    let q = CalendarQuota::new(100, Period::Month).unwrap();
    let now = utc(2026, 11, 24, 0, 0);
    let (_, end) = q.period_at(now);
    // Counted under a daily limit ending tonight: kept until then, under the monthly one.
    let s = CalendarState {
        end_us: utc(2026, 11, 25, 0, 0),
        used: 40,
    };
    assert_eq!(used(Some(s), end, now), 40);
    assert_eq!(used(Some(s), end, utc(2026, 11, 25, 0, 0)), 0);
    // Counted under a monthly limit, read under a daily one: until the day ends.
    let s = CalendarState {
        end_us: end,
        used: 40,
    };
    assert_eq!(used(Some(s), utc(2026, 11, 25, 0, 0), now), 40);
    assert_eq!(
        used(Some(s), utc(2026, 11, 25, 0, 0), utc(2026, 11, 25, 0, 0)),
        0
    );
}

#[test]
fn a_stored_end_past_the_period_in_force_is_cut_and_one_past_the_horizon_is_foreign() {
    let q = CalendarQuota::new(10, Period::Day).unwrap();
    let now = utc(2026, 11, 24, 12, 0);
    let (_, end) = q.period_at(now);
    let state = |end_us, used| Some(CalendarState { end_us, used });
    // Its own period: counts, nothing to write back.
    assert_eq!(read(&q, state(end, 4), end, now), (4, None));
    // A day later than the period in force: counts now, cut to the end in force.
    let later = end + 86_400_000_000;
    assert_eq!(read(&q, state(later, 4), end, now), (4, state(end, 4)));
    // At the horizon (two days ahead of now) still read; past it, the period drained.
    let horizon = now + q.horizon_us();
    assert_eq!(read(&q, state(horizon, 4), end, now), (4, state(end, 4)));
    assert_eq!(
        read(&q, state(horizon + 1, 4), end, now),
        (10, state(end, 10))
    );
    // Ended: nothing counts.
    assert_eq!(read(&q, state(now, 4), end, now), (0, None));
    assert_eq!(read(&q, None, end, now), (0, None));
}

#[test]
fn ranges_charges_and_refunds() {
    let q = CalendarQuota::new(10, Period::Day).unwrap();
    let now = utc(2026, 11, 24, 12, 0);
    let (_, end) = q.period_at(now);
    let s = Some(CalendarState {
        end_us: end,
        used: 7,
    });
    let r = decide(&q, s, end, now, 2, 5, Mode::CheckAndSpend);
    assert_eq!((r.allowed, r.granted, r.remaining), (true, 3, 0));
    assert_eq!(
        r.write,
        Some(CalendarState {
            end_us: end,
            used: 10
        })
    );
    let r = decide(&q, s, end, now, 4, 5, Mode::CheckAndSpend);
    assert_eq!(
        (r.allowed, r.remaining, r.retry_after_us),
        (false, 3, end - now)
    );
    assert_eq!(decide(&q, s, end, now, 1, 1, Mode::CheckOnly).write, None);
    let c = decide(&q, s, end, now, 9, 9, Mode::Charge);
    assert_eq!(
        (c.allowed, c.remaining, c.write.map(|w| w.used)),
        (true, 0, Some(16))
    );
    let back = refund(&q, s, end, now, 9);
    assert_eq!(
        (back.allowed, back.remaining, back.write.map(|w| w.used)),
        (true, 10, Some(0))
    );
    assert!(!refund(&q, None, end, now, 1).allowed);
}

#[cfg(feature = "time-zones")]
#[test]
fn daylight_saving_changes_in_berlin() {
    let day = CalendarQuota::new(5, Period::Day)
        .unwrap()
        .zone("Europe/Berlin")
        .unwrap();
    // The night clocks go back (2026-10-25): a day of 25 hours, midnight to midnight.
    let (start, end) = day.period_at(utc(2026, 10, 25, 12, 0));
    assert_eq!(
        (start, end),
        (utc(2026, 10, 24, 22, 0), utc(2026, 10, 25, 23, 0))
    );
    assert_eq!(day.length_of_period_ending(end), 25 * 3600 * 1_000_000);
    // The night they go forward (2026-03-29), 02:30 does not exist: 03:30 local.
    let at = CalendarQuota::new(5, Period::Day)
        .unwrap()
        .at("02:30")
        .unwrap()
        .zone("Europe/Berlin")
        .unwrap();
    assert_eq!(
        at.period_at(utc(2026, 3, 29, 12, 0)).0,
        utc(2026, 3, 29, 1, 30)
    );
    // A month in summer time ends at midnight local, 22:00 UTC.
    let month = CalendarQuota::new(5, Period::Month)
        .unwrap()
        .anchor_day(1)
        .unwrap()
        .zone("Europe/Berlin")
        .unwrap();
    assert_eq!(
        month.period_at(utc(2026, 7, 10, 0, 0)),
        (utc(2026, 6, 30, 22, 0), utc(2026, 7, 31, 22, 0))
    );
}

/// The names a build without the feature knows are the bundled database's.
#[cfg(feature = "time-zones")]
#[test]
fn the_iana_names_are_the_bundled_databases() {
    let mut names: Vec<String> = jiff::tz::db().available().map(|n| n.to_string()).collect();
    names.sort();
    let listed: Vec<&str> = IANA_NAMES.lines().collect();
    assert_eq!(
        listed, names,
        "src/algo/zone_names.txt: one name a line, from jiff::tz::db().available(), sorted"
    );
}

/// A name that is no zone at all is "not a known zone", with the feature or without it.
#[test]
fn a_name_that_is_no_zone_is_not_a_known_zone() {
    for name in ["Mars/Olympus", "Europe/Atlantis", "Berlin"] {
        assert_eq!(
            CalendarQuota::new(5, Period::Day)
                .unwrap()
                .zone(name)
                .unwrap_err(),
            CalendarError::Zone(name.into()),
            "{name}"
        );
    }
}

#[cfg(not(feature = "time-zones"))]
#[test]
fn an_iana_name_without_the_feature_names_it() {
    assert_eq!(
        CalendarQuota::new(5, Period::Day)
            .unwrap()
            .zone("Europe/Berlin")
            .unwrap_err(),
        CalendarError::NeedsFeature("Europe/Berlin".into())
    );
}
