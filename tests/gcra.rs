//! GCRA: the worked examples of docs/gcra.md and the reference documents, edge cases, and a
//! property test against an independent token-bucket model.

#[path = "support/cases.rs"]
mod cases;

use proptest::prelude::*;
use tower_ratelimits::__private::gcra::{self, GcraError};
use tower_ratelimits::{Limit, LimitError};

const MS: u64 = 1_000;
const S: u64 = 1_000_000;
const T0: u64 = 1_700_000_000 * S;

fn per_second_20() -> Limit {
    Limit::from_micros(20, 20, S).unwrap()
}

/// Spends and returns (outcome, stored TAT after).
fn spend(l: &Limit, tat: Option<u64>, now: u64, cost: u64) -> (gcra::GcraOutcome, Option<u64>) {
    let o = gcra::spend(l, tat, now, cost).unwrap();
    (o, o.new_tat.or(tat))
}

#[test]
fn first_request_sets_tat_and_leaves_burst_minus_one() {
    let (o, tat) = spend(&per_second_20(), None, T0, 1);
    assert!(o.allowed);
    assert_eq!(tat, Some(T0 + 50 * MS));
    assert_eq!(o.remaining, 19);
    assert_eq!(o.retry_after_us, 0);
    assert_eq!(o.reset_after_us, 50 * MS);
}

#[test]
fn a_full_bucket_of_burst_20_admits_exactly_20() {
    let l = per_second_20();
    let mut tat = None;
    for i in 0..20 {
        let (o, t) = spend(&l, tat, T0, 1);
        assert!(o.allowed, "request {i}");
        assert_eq!(o.remaining, 19 - i);
        tat = t;
    }
    assert_eq!(tat, Some(T0 + S));
    let (o, t) = spend(&l, tat, T0, 1);
    assert!(!o.allowed);
    assert_eq!(t, tat, "a denial writes nothing");
    assert_eq!(o.new_tat, None);
    // retry_after is the time until TAT - BO: the next token, 50ms away.
    assert_eq!(o.retry_after_us, 50 * MS);
    assert_eq!(o.reset_after_us, S);
    assert_eq!(o.remaining, 0);
    // The last allowed one said when the next would fit.
    let (last, _) = spend(&l, Some(T0 + 19 * 50 * MS), T0, 1);
    assert_eq!(last.remaining, 0);
    assert_eq!(last.retry_after_us, 50 * MS);
}

#[test]
fn reference_walk_through_with_spread_requests() {
    // 20 requests over the first 49ms, then one at 49ms (denied, 1ms early), one at 51ms.
    let l = per_second_20();
    let mut tat = None;
    for i in 0..20u64 {
        let (o, t) = spend(&l, tat, T0 + i * 49 * MS / 19, 1);
        assert!(o.allowed, "request {i}");
        tat = t;
    }
    assert_eq!(tat, Some(T0 + 1000 * MS));
    let (o, t) = spend(&l, tat, T0 + 49 * MS, 1);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, MS);
    let (o, t) = spend(&l, t, T0 + 51 * MS, 1);
    assert!(o.allowed);
    assert_eq!(t, Some(T0 + 1050 * MS));
}

#[test]
fn exhausted_bucket_admits_exactly_one_per_emission_interval() {
    let l = per_second_20();
    let mut tat = Some(T0 + S); // exhausted at T0
    for k in 1..=200u64 {
        let now = T0 + k * 50 * MS;
        let (o, t) = spend(&l, tat, now - 1, 1);
        assert!(!o.allowed, "1us early at step {k}");
        assert_eq!(o.retry_after_us, 1);
        let (o, t2) = spend(&l, t, now, 1);
        assert!(o.allowed, "on time at step {k}");
        let (o, _) = spend(&l, t2, now, 1);
        assert!(!o.allowed, "second in the same interval at step {k}");
        tat = t2;
    }
}

#[test]
fn idle_longer_than_burst_offset_refills_the_bucket() {
    let l = per_second_20();
    let (o, _) = spend(&l, Some(T0 + S), T0 + S + 1, 1);
    assert!(o.allowed);
    assert_eq!(o.remaining, 19);
    // A TAT far in the past banks nothing.
    let (o, t) = spend(&l, Some(1), T0, 20);
    assert!(o.allowed);
    assert_eq!(o.remaining, 0);
    assert_eq!(t, Some(T0 + S));
}

#[test]
fn redis_reference_60_per_minute_burst_100() {
    let l = Limit::from_micros(100, 60, 60 * S).unwrap();
    assert_eq!(l.emission_interval_us(), S);
    let mut tat = None;
    for i in 0..100u64 {
        let (o, t) = spend(&l, tat, T0, 1);
        assert!(o.allowed, "request {i}");
        assert_eq!(
            t,
            Some(T0 + (i + 1) * S),
            "TAT advances one second per request"
        );
        tat = t;
    }
    let (o, _) = spend(&l, tat, T0, 1);
    assert!(!o.allowed);
    // Denied until T >= TAT - BO, i.e. one second after T1.
    let (o, _) = spend(&l, tat, T0 + S - 1, 1);
    assert!(!o.allowed);
    let (o, _) = spend(&l, tat, T0 + S, 1);
    assert!(o.allowed);
}

#[test]
fn cost_zero_is_a_probe() {
    let l = per_second_20();
    let (o, t) = spend(&l, Some(T0 + 500 * MS), T0, 0);
    assert!(o.allowed);
    assert_eq!(o.remaining, 10);
    assert_eq!(t, Some(T0 + 500 * MS), "nothing consumed");
    let (o, _) = spend(&l, Some(T0 + S), T0, 0);
    assert!(o.allowed, "a probe fits even an empty bucket");
    assert_eq!(o.remaining, 0);
}

#[test]
fn cost_equal_to_burst_and_above() {
    let l = per_second_20();
    let (o, _) = spend(&l, None, T0, 20);
    assert!(o.allowed);
    assert_eq!(o.remaining, 0);
    assert_eq!(o.retry_after_us, S);
    let (o, _) = spend(&l, Some(T0 + 50 * MS), T0, 20);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, 50 * MS);
    // A cost above the burst is refused when the transaction is built (`BucketTx::new`); the
    // rule itself, given one, can never allow it: it needs more than a full bucket.
    let o = gcra::spend(&l, None, T0, 21).unwrap();
    assert!(!o.allowed);
    assert_eq!(o.new_tat, None);
    assert_eq!(o.remaining, 20);
}

#[test]
fn check_computes_without_writing() {
    let l = per_second_20();
    let c = gcra::check(&l, Some(T0 + 100 * MS), T0, 1).unwrap();
    let s = gcra::spend(&l, Some(T0 + 100 * MS), T0, 1).unwrap();
    assert_eq!(c, s, "check reports exactly what spend would do");
}

#[test]
fn refunds() {
    let l = per_second_20();
    // Nothing stored or TAT in the past: nothing to refund.
    for tat in [None, Some(T0 - 1)] {
        let o = gcra::refund(&l, tat, T0, 1).unwrap();
        assert!(!o.allowed);
        assert_eq!(o.remaining, 20);
        assert_eq!((o.retry_after_us, o.reset_after_us), (0, 0));
        assert_eq!(o.new_tat, None);
    }
    // A spent bucket gets its tokens back.
    let o = gcra::refund(&l, Some(T0 + 500 * MS), T0, 3).unwrap();
    assert!(o.allowed);
    assert_eq!(o.new_tat, Some(T0 + 350 * MS));
    assert_eq!(o.remaining, 13);
    assert_eq!(o.reset_after_us, 350 * MS);
    // Never above a full bucket: the TAT stops at now.
    let o = gcra::refund(&l, Some(T0 + 100 * MS), T0, 20).unwrap();
    assert!(o.allowed);
    assert_eq!(o.new_tat, Some(T0));
    assert_eq!(o.remaining, 20);
    // TAT exactly now: already full.
    let o = gcra::refund(&l, Some(T0), T0, 1).unwrap();
    assert!(!o.allowed);
    assert_eq!(o.remaining, 20);
}

#[test]
fn overflow_is_an_error_never_a_wrap_or_panic() {
    assert!(matches!(
        Limit::from_micros(u64::MAX, 1, 1_000),
        Err(LimitError::BurstOffsetTooLarge { .. })
    ));
    let l = Limit::from_micros(10, 1, 365 * 86_400 * S).unwrap();
    // tat + incr beyond u64: an error on allow.
    assert_eq!(
        gcra::spend(&l, None, u64::MAX - 5, 1),
        Err(GcraError::TimeOverflow)
    );
    // A TAT as far ahead as the crate writes (burst offset and debt), near the end of u64
    // time: a plain denial, whose wait saturates rather than wraps.
    let furthest = l.burst_offset_us() + l.debt_offset_us();
    let o = gcra::spend(&l, Some(u64::MAX), u64::MAX - furthest, 1).unwrap();
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
    let o = gcra::refund(&l, Some(u64::MAX), u64::MAX, 10).unwrap();
    assert!(!o.allowed);
    // Further ahead than the crate writes: foreign, a bucket drained under this limit (it was
    // a denial for centuries before, then a fresh bucket, which handed a drained client a
    // full burst).
    let o = gcra::spend(&l, Some(u64::MAX), T0, 1).unwrap();
    assert!(!o.allowed);
    assert_eq!(
        (o.remaining, o.retry_after_us),
        (0, l.emission_interval_us())
    );
    assert_eq!(o.reset_after_us, l.burst_offset_us());
    // A refund gives back from the drained bucket (and replaces the value).
    let o = gcra::refund(&l, Some(u64::MAX), 0, 10).unwrap();
    assert!(o.allowed);
    assert_eq!(o.new_tat, Some(0));
}

#[test]
fn a_limit_lowered_below_the_stored_tat_denies_without_underflow() {
    // TAT far ahead (stored under a bigger burst): remaining clamps to 0.
    let l = per_second_20();
    let o = gcra::spend(&l, Some(T0 + 10 * S), T0, 1).unwrap();
    assert!(!o.allowed);
    assert_eq!(o.remaining, 0);
    assert_eq!(o.retry_after_us, 9 * S + 50 * MS);
    let o = gcra::spend(&l, Some(T0 + 10 * S), T0, 0).unwrap();
    assert!(!o.allowed);
}

/// An independent model: a token bucket holding `credit` microseconds of capacity (one token is
/// `EI` microseconds), refilled one microsecond per microsecond up to `burst * EI`. Exact
/// integer arithmetic; written from the token-bucket description, not from the GCRA code.
#[derive(Debug, Clone)]
struct TokenBucket {
    token_us: u64,
    capacity_us: u64,
    credit_us: u64,
    last: u64,
}

impl TokenBucket {
    fn new(l: &Limit, now: u64) -> Self {
        let capacity_us = l.burst() * l.emission_interval_us();
        Self {
            token_us: l.emission_interval_us(),
            capacity_us,
            credit_us: capacity_us,
            last: now,
        }
    }
    fn refill(&mut self, now: u64) {
        self.credit_us = (self.credit_us + (now - self.last)).min(self.capacity_us);
        self.last = now;
    }
    /// (allowed, remaining tokens, retry_after)
    fn spend(&mut self, now: u64, cost: u64) -> (bool, u64, u64) {
        self.refill(now);
        let need = cost * self.token_us;
        if self.credit_us >= need {
            self.credit_us -= need;
            let retry = need.saturating_sub(self.credit_us);
            (true, self.credit_us / self.token_us, retry)
        } else {
            (false, self.credit_us / self.token_us, need - self.credit_us)
        }
    }
    fn refund(&mut self, now: u64, cost: u64) -> bool {
        self.refill(now);
        let before = self.credit_us;
        self.credit_us = (self.credit_us + cost * self.token_us).min(self.capacity_us);
        before != self.credit_us
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases::cases(400)))]
    #[test]
    fn gcra_agrees_with_a_token_bucket(
        burst in 1u64..30,
        count in 1u64..30,
        ei in 1u64..5_000,
        steps in proptest::collection::vec((0u64..20_000, 0u64..40, prop::bool::weighted(0.15)), 1..120),
    ) {
        let l = Limit::from_micros(burst, count, ei * count).unwrap();
        let mut now = T0;
        let mut model = TokenBucket::new(&l, now);
        let mut tat: Option<u64> = None;
        for (dt, raw_cost, is_refund) in steps {
            now += dt;
            let cost = raw_cost % (burst + 1);
            if is_refund {
                let o = gcra::refund(&l, tat, now, cost).unwrap();
                let refunded = model.refund(now, cost);
                prop_assert_eq!(o.allowed, refunded);
                tat = o.new_tat.or(tat);
                continue;
            }
            let o = gcra::spend(&l, tat, now, cost).unwrap();
            let (allowed, remaining, retry) = model.spend(now, cost);
            prop_assert_eq!(o.allowed, allowed, "allow/deny at {} cost {}", now - T0, cost);
            prop_assert_eq!(o.remaining, remaining);
            prop_assert_eq!(o.retry_after_us, retry);
            tat = o.new_tat.or(tat);
        }
    }
}

/// The one GCRA rule (`check`, `check_range`, `refund`) against `docs/gcra.md`'s formulas,
/// transcribed literally in `i128`.
mod spec {
    use super::*;
    use std::time::Duration;
    use tower_ratelimits::__private::gcra::{
        FOREIGN_SLACK_US, GcraOutcome, check, check_range, refund,
    };

    fn clamp(v: i128) -> u64 {
        u64::try_from(v.max(0)).unwrap_or(u64::MAX)
    }

    /// The spec's stored TAT (`docs/gcra.md`, "Foreign values"): one further ahead than the
    /// crate writes is read as the bucket drained under the limit, `now + BO`.
    fn ours(limit: &Limit, stored: Option<u64>, now: u64) -> Option<i128> {
        stored.map(|t| {
            let foreign = t > now
                && t - now > limit.burst_offset_us() + limit.debt_offset_us() + FOREIGN_SLACK_US;
            if foreign {
                i128::from(now) + i128::from(limit.burst_offset_us())
            } else {
                i128::from(t)
            }
        })
    }

    /// `docs/gcra.md`'s spend, transcribed literally in `i128` (where nothing overflows): the
    /// reference `check` must equal. Not used by the library.
    fn spec_check(limit: &Limit, stored: Option<u64>, now: u64, cost: u64) -> GcraOutcome {
        let stored = ours(limit, stored, now);
        let (ei, bo) = (
            i128::from(limit.emission_interval_us()),
            i128::from(limit.burst_offset_us()),
        );
        let now = i128::from(now);
        let tat = stored.unwrap_or(0).max(now);
        let incr = ei * i128::from(cost);
        let new_tat = tat + incr;
        let difference = now - (new_tat - bo);
        let tokens = |v: i128| clamp(v) / limit.emission_interval_us();
        if difference < 0 {
            GcraOutcome {
                allowed: false,
                remaining: tokens(now - (tat - bo)),
                retry_after_us: clamp(-difference),
                reset_after_us: clamp(tat - now),
                new_tat: None,
            }
        } else {
            GcraOutcome {
                allowed: true,
                remaining: tokens(difference),
                retry_after_us: if difference < incr {
                    clamp(incr - difference)
                } else {
                    0
                },
                reset_after_us: clamp(new_tat - now),
                new_tat: u64::try_from(new_tat).ok(),
            }
        }
    }

    /// `docs/gcra.md`'s refund, transcribed literally: `None` when the TAT it writes does not
    /// fit in a `u64` (the library's `TimeOverflow`).
    fn spec_refund(limit: &Limit, stored: Option<u64>, now: u64, cost: u64) -> Option<GcraOutcome> {
        let now_i = i128::from(now);
        let Some(read) = ours(limit, stored, now).filter(|&t| t > now_i) else {
            return Some(GcraOutcome {
                allowed: false,
                remaining: limit.burst(),
                retry_after_us: 0,
                reset_after_us: 0,
                new_tat: None,
            });
        };
        let (ei, bo) = (
            i128::from(limit.emission_interval_us()),
            i128::from(limit.burst_offset_us()),
        );
        let new_tat = (read - ei * i128::from(cost)).max(now_i);
        // Written when it changes the store: a refund, or a foreign value replaced.
        let changed = Some(new_tat) != stored.map(i128::from);
        Some(GcraOutcome {
            allowed: new_tat < read,
            remaining: clamp(now_i - (new_tat - bo)) / limit.emission_interval_us(),
            retry_after_us: 0,
            reset_after_us: clamp(new_tat - now_i),
            new_tat: if changed {
                Some(u64::try_from(new_tat).ok()?)
            } else {
                None
            },
        })
    }

    proptest! {
        /// A partial grant is the naive search: the largest `k` from `max` down to `min` whose
        /// plain spend the spec allows, with that spend's numbers; else the spec's denial of
        /// `min`.
        #[test]
        fn a_range_grants_the_most_units_a_plain_spend_would_allow(
            burst in 1u64..40,
            count in 1u64..40,
            period_us in 1_000u64..10_000_000,
            tat_ahead in 0u64..20_000_000,
            tat_behind in any::<bool>(),
            min in 0u64..40,
            extra in 0u64..60,
        ) {
            let Ok(limit) = Limit::new(burst, count, Duration::from_micros(period_us)) else {
                return Ok(());
            };
            let now = 5_000_000_000u64;
            let tat = if tat_behind { now - tat_ahead } else { now + tat_ahead };
            let min = min.min(burst);
            let max = min + extra;
            let naive = (min..=max)
                .rev()
                .map(|k| (spec_check(&limit, Some(tat), now, k), k))
                .find(|(o, _)| o.allowed)
                .unwrap_or((spec_check(&limit, Some(tat), now, min), 0));
            prop_assert_eq!(check_range(&limit, Some(tat), now, min, max).unwrap(), naive);
        }

        /// The one GCRA rule decides exactly as the spec's formulas, near the edges of u64 too.
        #[test]
        fn check_and_refund_equal_the_spec(
            burst in 1u64..2_000_000,
            count in 1u64..2_000_000,
            period_us in 1u64..10_000_000_000,
            tat in prop_oneof![0u64..4_000_000_000_000_000, (u64::MAX - 1_000_000_000_000)..=u64::MAX],
            now in prop_oneof![0u64..4_000_000_000_000_000, (u64::MAX - 1_000_000_000_000)..=u64::MAX],
            cost_frac in 0.0f64..=1.0,
        ) {
            let Ok(limit) = Limit::new(burst, count, Duration::from_micros(period_us)) else {
                return Ok(());
            };
            let cost = (cost_frac * limit.burst() as f64) as u64;
            let spec = spec_check(&limit, Some(tat), now, cost);
            match check(&limit, Some(tat), now, cost) {
                Ok(o) => prop_assert_eq!(o, spec),
                // Only an allowed TAT past u64 is an error.
                Err(GcraError::TimeOverflow) => prop_assert!(spec.allowed && spec.new_tat.is_none()),
                Err(e) => prop_assert!(false, "{e}"),
            }
            // Only a refund whose TAT would not fit in a u64 is an error.
            prop_assert_eq!(refund(&limit, Some(tat), now, cost).ok(), spec_refund(&limit, Some(tat), now, cost));
        }
    }
}

/// A share bucket of a limit across regions keeps its tokens when its share changes
/// (`docs/regions.md`), where every other limit keeps its TAT (`limit_changes.rs`).
mod share_changes {
    use super::*;

    fn tokens(l: &Limit, tat: Option<u64>, now: u64) -> u64 {
        gcra::check(l, tat, now, 0).unwrap().remaining
    }

    #[test]
    fn a_region_giving_up_rate_gains_no_token() {
        // 4 of 10 tokens left at 10/s; the rate halves, the burst stays.
        let old = Limit::from_micros(10, 10, S).unwrap();
        let new = Limit::from_micros(10, 5, S).unwrap();
        let tat = Some(T0 + 6 * 100 * MS);
        let kept = gcra::keep_tokens(&old, &new, tat, T0).unwrap();
        assert_eq!(tokens(&new, kept, T0), 4);
        // Keeping the TAT (600 ms ahead of a 2 s burst offset) would have given 7 tokens.
        assert_eq!(tokens(&new, tat, T0), 7);
        // And it refills at the new rate: one token 200 ms later.
        assert_eq!(tokens(&new, kept, T0 + 200 * MS), 5);
    }

    #[test]
    fn burst_given_to_a_region_arrives_empty() {
        let old = Limit::from_micros(2, 10, S).unwrap();
        let new = Limit::from_micros(8, 10, S).unwrap();
        assert_eq!(
            tokens(&new, gcra::keep_tokens(&old, &new, None, T0).unwrap(), T0),
            2
        );
    }

    #[test]
    fn a_smaller_burst_caps_the_tokens_and_a_full_bucket_stays_full() {
        let old = Limit::from_micros(10, 10, S).unwrap();
        let new = Limit::from_micros(3, 3, S).unwrap();
        assert_eq!(gcra::keep_tokens(&old, &new, None, T0), Ok(None));
        let tat = Some(T0 + 5 * 100 * MS);
        assert_eq!(gcra::keep_tokens(&old, &new, tat, T0), Ok(None));
    }

    #[test]
    fn a_debt_stays_owed_and_a_partial_token_is_not_kept() {
        let old = Limit::from_micros(4, 10, S)
            .unwrap()
            .with_max_debt(4)
            .unwrap();
        let new = Limit::from_micros(4, 20, S)
            .unwrap()
            .with_max_debt(4)
            .unwrap();
        // Two units owed beyond an empty bucket: still two, at the new interval.
        let tat = Some(T0 + 6 * 100 * MS);
        assert_eq!(
            gcra::keep_tokens(&old, &new, tat, T0),
            Ok(Some(T0 + 6 * 50 * MS))
        );
        // 2.5 tokens: 2 kept.
        let tat = Some(T0 + 150 * MS);
        let kept = gcra::keep_tokens(&old, &new, tat, T0).unwrap();
        assert_eq!(kept, Some(T0 + 2 * 50 * MS));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases::cases(400)))]
        /// Never more tokens than before nor than the new burst, and exactly that many whole
        /// tokens when both allow.
        #[test]
        fn a_share_change_keeps_at_most_the_tokens_it_had(
            b1 in 1u64..40, c1 in 1u64..40, b2 in 1u64..40, c2 in 1u64..40,
            ei1 in 1u64..5_000, ei2 in 1u64..5_000, ahead in 0u64..400_000,
        ) {
            let old = Limit::from_micros(b1, c1, ei1 * c1).unwrap();
            let new = Limit::from_micros(b2, c2, ei2 * c2).unwrap();
            let tat = Some(T0 + ahead);
            let before = tokens(&old, tat, T0);
            let kept = gcra::keep_tokens(&old, &new, tat, T0).unwrap();
            let after = tokens(&new, kept, T0);
            prop_assert!(after <= before.min(b2));
            prop_assert_eq!(after, before.min(b2));
        }
    }
}
