//! The suggestion models, one shape at a time, through the plan's tallies.

use super::super::plan::{LimitPlan, Tally, note_of};
use super::Arrival;

/// A second, in microseconds.
const S: u64 = 1_000_000;
/// 2024-10-04T01:00:00Z: an hour into a day.
const T0: u64 = 20_000 * 86_400 * S + 3_600 * S;

/// A request: its time after `T0`, its cost, its duration.
type Ask = (u64, u64, u64);

/// The plan of one limit (`yaml`, the candidate's) after `asks`: per client (the last byte of
/// its address), its requests as (time after `T0`, cost, duration).
fn sized(yaml: &str, target: f64, asks: &[(u8, &[Ask])]) -> LimitPlan {
    let limits = crate::config::Limits::from_yaml_str(yaml, None).unwrap();
    let name = limits.names().next().unwrap();
    let mut tally = Tally::new(T0, target, 10, 10, 10);
    tally.size(name, limits.default_limit(name).unwrap());
    let mut arrivals: Vec<(u64, u8, u64, u64)> = Vec::new();
    for &(client, times) in asks {
        for &(at, cost, duration_us) in times {
            arrivals.push((at, client, cost, duration_us));
        }
    }
    arrivals.sort();
    for (at, client, cost, duration_us) in arrivals {
        let note = note_of(name, client, 5);
        let arrival = Arrival { cost, duration_us };
        tally.noted(1, &[note], T0 + at, Some(arrival));
    }
    let plan = tally.plan();
    plan.limits.into_values().next().unwrap()
}

fn heaviest(plan: &LimitPlan) -> Vec<(String, u64)> {
    plan.heaviest
        .iter()
        .map(|h| (h.id.clone(), h.needed))
        .collect()
}

#[test]
fn a_calendar_quota_s_count_is_sized_from_what_each_key_asked_in_one_period() {
    let day = 86_400 * S;
    // Four keys: 2, 4, 7 and 30 units in their busiest day; the last spread over two days
    // asks 12 and 18, so its most is 18. Refused requests count: the model is uncapped.
    let plan = sized(
        "Daily: {kind: ip, calendar: {count: 5, period: day}}\n",
        0.25,
        &[
            (1, &[(0, 1, 0), (1, 1, 0)]),
            (2, &[(0, 2, 0), (1, 2, 0)]),
            (3, &[(0, 3, 0), (2, 4, 0), (day, 1, 0)]),
            (4, &[(0, 12, 0), (day, 10, 0), (day + 5, 8, 0)]),
        ],
    );
    let s = plan.suggested_count.clone().unwrap();
    // A quarter of 4 keys may be refused: the count the third key needs, 7.
    assert_eq!((s.keys, s.count, s.candidate_count), (4, 7, 5));
    assert_eq!(s.period, "day");
    assert!(plan.suggested.is_none());
    // The one key left above it, named apart.
    assert_eq!(heaviest(&plan), [("192.0.2.4".to_owned(), 18)]);
}

#[test]
fn a_concurrency_limit_s_max_is_sized_from_the_requests_each_key_had_in_flight() {
    // Key 1: three requests of 10 s a second apart: 3 in flight. Key 2: two of 1 s, the
    // second starting as the first ends: 1 (a slot given back at its end is free). Key 3:
    // requests served at once never overlap: 1. Key 4: five at the same instant, each held
    // an hour: the lease (30 s) does not end them, the layer renews it while a request lives,
    // so one more 40 s later finds all five still in flight: 6.
    let plan = sized(
        "Slots: {kind: ip, concurrency: 2, lease: 30s}\n",
        0.25,
        &[
            (1, &[(0, 1, 10 * S), (S, 1, 10 * S), (2 * S, 1, 10 * S)]),
            (2, &[(0, 1, S), (S, 1, S)]),
            (3, &[(0, 1, 0), (0, 1, 0), (0, 1, 0)]),
            (4, &[(0, 1, 3600 * S); 5]),
            (4, &[(40 * S, 1, S)]),
        ],
    );
    let s = plan.suggested_max.clone().unwrap();
    assert_eq!((s.keys, s.max, s.candidate_max), (4, 3, 2));
    assert_eq!((s.adaptive, s.at_least), (false, false));
    assert_eq!(heaviest(&plan), [("192.0.2.4".to_owned(), 6)]);
}

#[test]
fn an_adaptive_limit_s_max_is_sized_like_a_concurrency_limit() {
    let plan = sized(
        "Adaptive: {kind: ip, concurrency: {adaptive: {min: 1, max: 4}}}\n",
        0.0,
        &[(1, &[(0, 1, 5 * S), (S, 1, 5 * S)])],
    );
    let s = plan.suggested_max.clone().unwrap();
    assert_eq!((s.max, s.candidate_max, s.adaptive), (2, 4, true));
    assert!(plan.heaviest.is_empty());
}

#[test]
fn burst_tiers_are_sized_per_tier_from_the_most_units_in_one_window() {
    // Tier 1: 2 per second; tier 2: 10 per minute. Key 1 sends 3 in one second, then 1 a
    // second later (still inside the closed window of the first: 4 in [0, 1 s]), and 8 more
    // at 30 s: 12 in a minute. Key 2 sends 1 a second for 5 s: at most 2 in a closed second.
    let yaml = "Tiers:\n  kind: ip\n  tiers:\n    - {limit: 2, window: 1s, active: 1m, cooldown: 0s}\n    - {limit: 10, window: 1m, active: 1m, cooldown: 0s}\n";
    let plan = sized(
        yaml,
        0.0,
        &[
            (
                1,
                &[
                    (0, 1, 0),
                    (0, 1, 0),
                    (S / 2, 1, 0),
                    (S, 1, 0),
                    (30 * S, 8, 0),
                ],
            ),
            (
                2,
                &[
                    (0, 1, 0),
                    (S, 1, 0),
                    (2 * S, 1, 0),
                    (3 * S, 1, 0),
                    (4 * S, 1, 0),
                ],
            ),
        ],
    );
    let s = plan.suggested_tiers.clone().unwrap();
    let tiers: Vec<(&str, u64, u64)> = s
        .tiers
        .iter()
        .map(|t| (t.window.as_str(), t.limit, t.candidate_limit))
        .collect();
    // Key 1's 8 units at 30 s are alone in their second: tier 1 needs 8.
    assert_eq!(tiers, [("1s", 8, 2), ("1m", 12, 10)]);
    assert_eq!(s.keys, 2);
}

#[test]
fn a_fair_share_s_budget_is_sized_from_every_id_together() {
    // A budget of 10 a second, burst 10. Two tenants each send 10 at once every second for
    // ten seconds: 20 at once each second, 200 requests.
    let mut asks: Vec<Ask> = Vec::new();
    for second in 0..10 {
        asks.extend(std::iter::repeat_n((second * S, 1, 0), 10));
    }
    let yaml = "Shared: {kind: ip, burst: 10, count: 10, period: 1s, fair_share: {}}\n";
    let plan = sized(yaml, 0.0, &[(1, &asks), (2, &asks)]);
    let s = plan.suggested_budget.clone().unwrap();
    assert_eq!(s.requests, 200);
    assert_eq!(
        (s.candidate_burst, s.candidate_count, s.period.as_str()),
        (10, 10, "1s")
    );
    // 20 at once each second: no count at a burst of 10 lets them all through.
    assert_eq!(s.count, None);
    // At 10 a second the backlog grows by 10 every second: a burst of 110 passes the last
    // second's 20 (the grid's 10 x 2^(14/4) = 114 is the first point at or above 110).
    assert_eq!(s.burst, Some(114));
    // Every id is named, by the units it asked.
    assert_eq!(
        heaviest(&plan),
        [("192.0.2.1".to_owned(), 100), ("192.0.2.2".to_owned(), 100)]
    );
    // With half the requests allowed refused, the candidate's own count is enough: it passes
    // 10 of each second's 20. A quarter of its count (the grid's low end) refuses more.
    let plan = sized(yaml, 0.5, &[(1, &asks), (2, &asks)]);
    let s = plan.suggested_budget.unwrap();
    assert_eq!(s.count, Some(10));
}

#[test]
fn a_gcra_limit_names_the_keys_above_its_suggestion() {
    // Ten keys: key i sends i units at once. At a tenth of keys refused, the burst is 9 and
    // key 10 is named apart.
    let asks: Vec<(u8, Vec<Ask>)> = (1..=10u8)
        .map(|i| (i, vec![(0, u64::from(i), 0)]))
        .collect();
    let asks: Vec<(u8, &[Ask])> = asks.iter().map(|(c, a)| (*c, a.as_slice())).collect();
    let plan = sized(
        "PerIp: {kind: ip, burst: 5, count: 5, period: 1s}\n",
        0.1,
        &asks,
    );
    assert_eq!(plan.suggested.as_ref().unwrap().burst, 9);
    assert_eq!(heaviest(&plan), [("192.0.2.10".to_owned(), 10)]);
}

#[test]
fn costs_at_the_edge_of_64_bits_size_every_shape_without_overflow() {
    // A log may carry any cost a u64 holds: every model saturates, none panics.
    let huge = u64::MAX / 2 + 1;
    let asks: &[Ask] = &[(0, huge, S), (0, huge, S), (2 * S, huge, 0), (3 * S, 1, 0)];
    for yaml in [
        "L: {kind: ip, burst: 5, count: 5, period: 1s}\n",
        "L: {kind: ip, calendar: {count: 5, period: day}}\n",
        "L: {kind: ip, concurrency: 2}\n",
        "L:\n  kind: ip\n  tiers:\n    - {limit: 2, window: 1s, active: 10s, cooldown: 0s}\n",
        "L: {kind: ip, burst: 5, count: 5, period: 1s, fair_share: {}}\n",
    ] {
        let plan = sized(yaml, 0.0, &[(1, asks)]);
        assert!(
            plan.suggested.is_some()
                || plan.suggested_count.is_some()
                || plan.suggested_max.is_some()
                || plan.suggested_tiers.is_some()
                || plan.suggested_budget.is_some(),
            "{yaml}"
        );
    }
}
