//! The penalty rule's unit tests: the ladder's lengths against the closed form, hostile
//! settings, the sliding window against a naive model, the level's decay and the jitter.

use super::*;

const S: u64 = 1_000_000;
const DAY: u64 = 86_400 * S;

fn ladder(after: u64, within: u64) -> Ladder {
    Ladder::new(after, within, 60 * S, 5, DAY).unwrap()
}

#[test]
fn the_nth_ban_lasts_base_times_factor_to_the_n_minus_1_up_to_max() {
    for (base, factor, max) in [
        (60 * S, 5, DAY),
        (1, 1, 1),
        (1, 1_000, MAX_BAN_US),
        (7, 3, MAX_BAN_US),
        (S, 2, 3 * S + 1),
        (MAX_BAN_US, 1_000, MAX_BAN_US),
    ] {
        let l = Ladder::new(1, S, base, factor, max).unwrap();
        for n in 1..200u32 {
            let closed = u128::from(base)
                .saturating_mul(u128::from(factor).saturating_pow(n - 1))
                .min(u128::from(max));
            assert_eq!(
                u128::from(l.ban_us(n)),
                closed,
                "{base} {factor} {max} n={n}"
            );
        }
    }
    let l = ladder(5, 600 * S);
    let minutes: Vec<u64> = (1..=5).map(|n| l.ban_us(n) / (60 * S)).collect();
    assert_eq!(minutes, [1, 5, 25, 125, 625]);
    assert_eq!(l.ban_us(6), DAY);
    assert_eq!(l.ban_us(u32::MAX), DAY);
}

#[test]
fn hostile_settings_are_refused_with_their_reason() {
    assert_eq!(Ladder::new(0, S, S, 2, S), Err(PenaltyError::After(0)));
    assert_eq!(
        Ladder::new(MAX_AFTER + 1, S, S, 2, S),
        Err(PenaltyError::After(MAX_AFTER + 1))
    );
    assert_eq!(
        Ladder::new(1, 0, S, 2, S),
        Err(PenaltyError::Window("within"))
    );
    assert_eq!(
        Ladder::new(1, MAX_WINDOW_US + 1, S, 2, S),
        Err(PenaltyError::Window("within"))
    );
    assert_eq!(Ladder::new(1, S, 0, 2, S), Err(PenaltyError::Length));
    assert_eq!(Ladder::new(1, S, 2 * S, 2, S), Err(PenaltyError::Length));
    assert_eq!(
        Ladder::new(1, S, S, 2, MAX_BAN_US + 1),
        Err(PenaltyError::Length)
    );
    assert_eq!(Ladder::new(1, S, S, 0, S), Err(PenaltyError::Factor(0)));
    assert_eq!(
        Ladder::new(1, S, S, 1_001, S),
        Err(PenaltyError::Factor(1_001))
    );
    let l = ladder(1, S);
    assert_eq!(l.forget_after(0), Err(PenaltyError::Window("forget_after")));
    assert_eq!(l.jitter(1_001), Err(PenaltyError::Jitter(1_001)));
    // Every accepted ban times the factor stays below 2^53 (the script's doubles).
    assert!(u128::from(MAX_BAN_US) * u128::from(MAX_FACTOR) < 1 << 53);
}

#[test]
fn the_unit_that_makes_after_within_the_window_bans_and_clears_it() {
    let l = ladder(3, 10 * S);
    let mut s = PenaltyState::default();
    assert_eq!(s.count(&l, b"k", 1, 0), Tally::Counted(1));
    assert_eq!(s.count(&l, b"k", 1, S), Tally::Counted(2));
    assert_eq!(
        s.count(&l, b"k", 1, 2 * S),
        Tally::Banned {
            until: 62 * S,
            level: 1
        }
    );
    assert!(s.events.is_empty());
    // Banned: nothing counts, nothing changes.
    let before = s.clone();
    assert_eq!(s.count(&l, b"k", 5, 61 * S), Tally::Ignored);
    assert_eq!(s, before);
    assert_eq!(
        s.standing(&l, 62 * S - 1),
        Standing::Banned {
            until: 62 * S,
            level: 1
        }
    );
    assert_eq!(s.standing(&l, 62 * S), Standing::Free);
    // The second ban, five times the first.
    for t in [63, 64] {
        s.count(&l, b"k", 1, t * S);
    }
    assert_eq!(
        s.count(&l, b"k", 1, 65 * S),
        Tally::Banned {
            until: 65 * S + 300 * S,
            level: 2
        }
    );
}

#[test]
fn a_unit_counts_for_exactly_within_after_it() {
    let l = ladder(2, 10 * S);
    let mut s = PenaltyState::default();
    assert_eq!(s.count(&l, b"k", 1, 5 * S), Tally::Counted(1));
    // 10 s later the first unit has left the window (it is (now - within, now]).
    assert_eq!(s.count(&l, b"k", 1, 15 * S), Tally::Counted(1));
    assert!(matches!(
        s.count(&l, b"k", 1, 25 * S - 1),
        Tally::Banned { .. }
    ));
    // Early times (below `within`) keep every unit.
    let mut s = PenaltyState::default();
    assert_eq!(s.count(&l, b"k", 1, 0), Tally::Counted(1));
    assert!(matches!(s.count(&l, b"k", 1, S), Tally::Banned { .. }));
}

#[test]
fn weights_of_zero_count_nothing_and_weights_past_after_ban_at_once() {
    let l = ladder(10, 10 * S);
    let mut s = PenaltyState::default();
    assert_eq!(s.count(&l, b"k", 0, 0), Tally::Counted(0));
    assert!(s.events.is_empty());
    assert_eq!(s.count(&l, b"k", 3, 1), Tally::Counted(3));
    assert!(matches!(
        s.count(&l, b"k", 1 << 40, 2),
        Tally::Banned { level: 1, .. }
    ));
}

#[test]
fn the_level_falls_one_step_for_each_quiet_forget_after_after_a_ban() {
    let l = Ladder::new(1, S, S, 2, DAY)
        .unwrap()
        .forget_after(100 * S)
        .unwrap();
    let mut s = PenaltyState::default();
    let mut now = 0;
    for level in 1..=3 {
        assert_eq!(
            s.count(&l, b"k", 1, now),
            Tally::Banned {
                until: now + (1 << (level - 1)) * S,
                level
            }
        );
        now = s.banned_until;
    }
    let end = s.banned_until;
    let level_at = |t: u64| {
        let mut s = s.clone();
        s.standing(&l, t);
        s.level
    };
    assert_eq!(level_at(end + 100 * S - 1), 3);
    assert_eq!(level_at(end + 100 * S), 2);
    assert_eq!(level_at(end + 250 * S), 1);
    assert_eq!(level_at(end + 300 * S), 0);
    assert_eq!(level_at(end + 10_000 * S), 0);
    // After a step down, the next ban is one level above what is left: 2 s, not 8 s.
    let mut s2 = s.clone();
    let t = end + 250 * S;
    assert_eq!(
        s2.count(&l, b"k", 1, t),
        Tally::Banned {
            until: t + 2 * S,
            level: 2
        }
    );
    // A quiet stretch spread over several reads falls as far as one read of its end.
    let mut s3 = s.clone();
    for t in (end..=end + 300 * S).step_by(7 * S as usize) {
        s3.standing(&l, t);
    }
    s3.standing(&l, end + 300 * S);
    assert_eq!(s3.level, 0);
}

#[test]
fn jitter_is_the_same_for_the_same_key_level_and_start_and_stays_in_its_span() {
    let l = ladder(1, S).jitter(250).unwrap();
    let mut seen = std::collections::HashSet::new();
    for i in 0..200u64 {
        let key = format!("Login:user{i}");
        let mut s = PenaltyState::default();
        let Tally::Banned { until, level } = s.count(&l, key.as_bytes(), 1, 1_000 + i) else {
            panic!("banned")
        };
        let ban = until - (1_000 + i);
        assert!((60 * S..=75 * S).contains(&ban), "{ban}");
        assert_eq!(
            ban - 60 * S,
            jitter(key.as_bytes(), level, 1_000 + i, 60 * S, 250)
        );
        seen.insert(ban);
    }
    assert!(seen.len() > 150, "jitter spreads the bans: {}", seen.len());
    // Never beyond max; none without a span.
    let capped = Ladder::new(1, S, DAY, 2, DAY)
        .unwrap()
        .jitter(1_000)
        .unwrap();
    let mut s = PenaltyState::default();
    assert_eq!(
        s.count(&capped, b"k", 1, 0),
        Tally::Banned {
            until: DAY,
            level: 1
        }
    );
    assert_eq!(jitter(b"k", 1, 5, 999, 1), 0);
    assert_eq!(jitter(b"k", 1, 5, 1_000, 0), 0);
}

/// A naive model: every counted unit kept with its time, the window summed from scratch.
#[derive(Default)]
struct Naive {
    units: Vec<(u64, u64)>,
    banned_until: u64,
}

#[test]
fn the_window_decides_as_a_naive_model_and_never_lets_after_units_through() {
    let mut rng = crate::algo::Rng(0x2545_f491_4f6c_dd1d);
    let mut next = |n: u64| rng.below(n);
    for case in 0..300 {
        let after = 1 + next(6);
        let within = 1 + next(20);
        let l = Ladder::new(after, within, 1 + next(30), 1 + next(3), 200)
            .unwrap()
            .forget_after(1 + next(50))
            .unwrap();
        let (mut s, mut m, mut now) = (PenaltyState::default(), Naive::default(), 0u64);
        // The counted events (time, units), per stretch between two bans (a ban clears the
        // window); a stretch that ended in a ban ends with the event that made it.
        let mut stretches: Vec<Vec<(u64, u64)>> = vec![Vec::new()];
        for _ in 0..200 {
            now += next(4);
            let units = next(3);
            let got = s.count(&l, b"k", units, now);
            // The model: banned, or the window's units (time in (now - within, now]) plus these.
            let expect = if now < m.banned_until {
                Tally::Ignored
            } else {
                let units = units.min(after);
                let held: u64 = m
                    .units
                    .iter()
                    .filter(|&&(t, _)| t + within > now)
                    .map(|&(_, u)| u)
                    .sum();
                if units == 0 {
                    Tally::Counted(held)
                } else if held + units < after {
                    m.units.push((now, units));
                    stretches.last_mut().unwrap().push((now, units));
                    Tally::Counted(held + units)
                } else {
                    m.banned_until = s.banned_until;
                    m.units.clear();
                    stretches.last_mut().unwrap().push((now, units));
                    stretches.push(Vec::new());
                    Tally::Banned {
                        until: s.banned_until,
                        level: s.level,
                    }
                }
            };
            assert_eq!(got, expect, "case {case} at {now}");
        }
        // Before each ban no window of `within` held `after` units: only the event that made
        // the ban brought its window to `after` (or past it, by its own weight).
        let banned = stretches.len() - 1;
        for (i, through) in stretches.iter().enumerate() {
            let before_ban = if i < banned {
                &through[..through.len() - 1]
            } else {
                &through[..]
            };
            for &(t, _) in before_ban {
                let inside: u64 = before_ban
                    .iter()
                    .filter(|&&(u, _)| u >= t && u < t + within)
                    .map(|&(_, n)| n)
                    .sum();
                assert!(
                    inside < after,
                    "case {case}: {inside} units from {t}: {through:?}"
                );
            }
        }
    }
}

#[test]
fn a_thousand_requests_in_flight_admit_after_and_the_last_failure_bans() {
    let l = ladder(10, 600 * S);
    let mut s = PenaltyState::default();
    let admitted = (0..1_000)
        .filter(|&id| s.admit(&l, (id, 1), 5) == Admission::Admitted)
        .count();
    assert_eq!(admitted, 10);
    let full = Admission::Full { until: 5 + 600 * S };
    assert_eq!(s.admit(&l, (1_000, 1), 6), full);
    for id in 0..9 {
        assert_eq!(s.settle(&l, b"k", id, 1, 10 + id), Tally::Counted(id + 1));
    }
    let ban = (20 + 60 * S, 1);
    assert_eq!(
        s.settle(&l, b"k", 9, 1, 20),
        Tally::Banned {
            until: ban.0,
            level: ban.1
        }
    );
    assert_eq!(
        s.admit(&l, (1_001, 1), 21),
        Admission::Banned {
            until: ban.0,
            level: ban.1
        }
    );
}

#[test]
fn an_outcome_that_does_not_count_gives_its_reservation_back() {
    let l = ladder(2, 600 * S);
    let mut s = PenaltyState::default();
    for t in 0..100 {
        // A success, many times: each gives its reservation back, nothing is left.
        assert_eq!(s.admit(&l, (t, 3), t), Admission::Admitted);
        assert_eq!(s.settle(&l, b"k", t, 0, t), Tally::Counted(0));
        assert_eq!(s, PenaltyState::default());
    }
    // A weight of 3 reserves 2 (`after`): the next waits for its outcome.
    assert_eq!(s.admit(&l, (100, 3), 100), Admission::Admitted);
    assert!(matches!(s.admit(&l, (101, 1), 100), Admission::Full { .. }));
    assert_eq!(s.settle(&l, b"k", 100, 1, 101), Tally::Counted(1));
    assert_eq!(s.admit(&l, (102, 1), 102), Admission::Admitted);
    // An outcome named twice counts once.
    assert_eq!(s.settle(&l, b"k", 100, 1, 103), Tally::Ignored);
    assert_eq!(s.units(), 1);
}

#[test]
fn a_request_that_never_settles_holds_its_units_for_within_then_they_leave() {
    let l = ladder(1, 10 * S);
    let mut s = PenaltyState::default();
    assert_eq!(s.admit(&l, (1, 1), 0), Admission::Admitted);
    let full = Admission::Full { until: 10 * S };
    assert_eq!(s.admit(&l, (2, 1), 10 * S - 1), full);
    assert_eq!(s.admit(&l, (3, 1), 10 * S), Admission::Admitted);
    // Its outcome, arriving after its window: counts nothing (its time is out of the window).
    assert_eq!(s.settle(&l, b"k", 1, 1, 10 * S + 5), Tally::Ignored);
    assert_eq!(s.units(), 0);
}

#[test]
fn a_ban_clears_the_reservations_in_flight_whose_outcomes_then_count_nothing() {
    let l = ladder(2, 600 * S);
    let mut s = PenaltyState::default();
    assert_eq!(s.admit(&l, (1, 1), 0), Admission::Admitted);
    assert_eq!(s.admit(&l, (2, 1), 1), Admission::Admitted);
    assert_eq!(s.settle(&l, b"k", 1, 1, 2), Tally::Counted(1));
    let ban = Tally::Banned {
        until: 3 + 60 * S,
        level: 1,
    };
    assert_eq!(s.count(&l, b"k", 1, 3), ban);
    assert_eq!(s.settle(&l, b"k", 2, 1, 4), Tally::Ignored);
    assert_eq!(s.settle(&l, b"k", 2, 1, 61 * S), Tally::Ignored);
    assert!(s.events.is_empty() && s.reservations.is_empty());
}

/// A request of the random interleaving: admitted at `at`, reserving `reserve`, its outcome's
/// weight when it settled, and the number of bans before its admission.
#[derive(Debug, Clone, Copy)]
struct Flight {
    at: u64,
    reserve: u64,
    weight: u64,
    settled: Option<u64>,
    cleared: bool,
    bans_before: usize,
}

/// The naive model of requests in flight: every request kept, each decision summed from
/// scratch, beside the state under test.
struct InFlight {
    l: Ladder,
    after: u64,
    within: u64,
    s: PenaltyState,
    now: u64,
    bans: usize,
    flights: Vec<Flight>,
}

impl InFlight {
    fn in_window(&self, f: &Flight) -> bool {
        !f.cleared && f.at + self.within > self.now
    }

    /// A request reserving `reserve`: admitted as the model says (its outcome's weight then
    /// `weight`); `Err` with both answers otherwise.
    fn admit(&mut self, reserve: u64, weight: u64) -> Result<(), String> {
        let held: u64 = (self.flights.iter().filter(|f| self.in_window(f)))
            .map(|f| f.settled.unwrap_or(f.reserve.min(self.after)))
            .sum();
        let expect = if self.now < self.s.banned_until {
            "banned"
        } else if held >= self.after {
            "full"
        } else {
            "admitted"
        };
        let id = self.flights.len() as u64;
        let got = match self.s.admit(&self.l, (id, reserve), self.now) {
            Admission::Admitted => "admitted",
            Admission::Banned { .. } => "banned",
            Admission::Full { .. } => "full",
        };
        if got != expect {
            return Err(format!("admission {got}, the model {expect}"));
        }
        if got == "admitted" {
            self.flights.push(Flight {
                at: self.now,
                reserve,
                weight,
                settled: None,
                cleared: false,
                bans_before: self.bans,
            });
        }
        Ok(())
    }

    /// The outcome of request `i`, as the model says; `Err` with both answers otherwise.
    fn settle(&mut self, i: usize) -> Result<(), String> {
        let (f, after) = (self.flights[i], self.after);
        let got = self.s.settle(&self.l, b"k", i as u64, f.weight, self.now);
        let banned_before = self.now < self.s.banned_until && !matches!(got, Tally::Banned { .. });
        let expect = if banned_before || !self.in_window(&f) {
            Tally::Ignored
        } else {
            let counted: u64 = (self.flights.iter().filter(|g| self.in_window(g)))
                .filter_map(|g| g.settled)
                .sum::<u64>()
                + f.weight.min(after);
            if f.weight > 0 && counted >= after {
                Tally::Banned {
                    until: self.s.banned_until,
                    level: self.s.level,
                }
            } else {
                Tally::Counted(counted)
            }
        };
        self.flights[i].settled = Some(f.weight.min(after));
        if got != expect {
            return Err(format!("{f:?}: {got:?}, the model {expect:?}"));
        }
        if let Tally::Banned { .. } = got {
            self.bans += 1;
            for g in &mut self.flights {
                g.cleared = true;
            }
        }
        Ok(())
    }

    /// Between two bans, the requests admitted within any window count at most `after - 1`
    /// plus the last one's weight (at most 3), with any number in flight.
    fn check_windows(&self) -> Result<(), String> {
        for f in &self.flights {
            let through: u64 = (self.flights.iter())
                .filter(|g| g.bans_before == f.bans_before && g.at >= f.at)
                .filter(|g| g.at < f.at + self.within)
                .map(|g| g.weight.min(self.after))
                .sum();
            if through >= self.after + 3 {
                return Err(format!("{through} units through from {f:?}"));
            }
        }
        Ok(())
    }
}

#[test]
fn requests_in_flight_decide_as_a_naive_model_and_never_pass_after_in_a_window() {
    let mut rng = crate::algo::Rng(0x9e37_79b9_7f4a_7c15);
    let mut next = |n: u64| rng.below(n);
    for case in 0..300 {
        let (after, within) = (1 + next(8), 1 + next(30));
        let l = Ladder::new(after, within, 1 + next(20), 1 + next(3), 400)
            .unwrap()
            .forget_after(1 + next(50))
            .unwrap();
        let s = PenaltyState::default();
        let (now, bans, flights) = (0, 0, Vec::new());
        let mut m = InFlight {
            l,
            after,
            within,
            s,
            now,
            bans,
            flights,
        };
        for step in 0..400 {
            m.now += u64::from(next(3) == 0) * next(4);
            let open: Vec<usize> = (0..m.flights.len())
                .filter(|&i| m.flights[i].settled.is_none())
                .collect();
            let result = if open.is_empty() || next(2) == 0 {
                let reserve = 1 + next(3);
                m.admit(reserve, next(reserve + 1))
            } else {
                m.settle(open[next(open.len() as u64) as usize])
            };
            result.unwrap_or_else(|e| panic!("case {case} step {step}: {e}"));
        }
        m.check_windows()
            .unwrap_or_else(|e| panic!("case {case}: {e}"));
    }
}
