//! Random share-bucket records and what the Rust rule decides of them: the oracle both stores'
//! share buckets are held to (the Redis script in `backend/redis/tests/shares.rs`, memory in
//! `regions/memory/tests.rs`), from the same cases.

use crate::algo::gcra::{self, GcraOutcome, Limit};
use crate::algo::regions::{RegionKey, Share};
use crate::config::RegionFloor;

// The cases' generator: the property tests' one (`algo::Rng`).
pub(crate) use crate::algo::Rng;

/// One share bucket's record and one spend on it at `now`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShareCase {
    /// The marked limit (per `period`).
    pub(crate) limit: Limit,
    pub(crate) floor: RegionFloor,
    /// The region's record of the key (a grant applied, its lease).
    pub(crate) region: RegionKey,
    /// The limit the bucket's TAT was written under, and when.
    pub(crate) written: Limit,
    pub(crate) written_at: u64,
    /// The stored TAT (0: none).
    pub(crate) tat: u64,
    pub(crate) cost: u64,
}

/// What the Rust rule decides of a [`ShareCase`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expected {
    /// No rate or no burst: denied.
    Closed,
    /// The cost is above the share's burst: denied.
    NeverFits,
    /// Decided by `gcra::check` on the TAT read (`same`: under the limit it was written
    /// under); `tat`: the TAT the bucket holds after it (0: full).
    Decided {
        same: bool,
        outcome: GcraOutcome,
        tat: u64,
    },
}

impl ShareCase {
    /// A random case at `now` with periods of `period`.
    pub(crate) fn random(rng: &mut Rng, period: u64, now: u64) -> ShareCase {
        let limit = Limit::from_micros(1 + rng.below(60), 1 + rng.below(60), period).unwrap();
        let floor = RegionFloor::from_basis_points(rng.below(5_001) as u16).unwrap();
        let region = RegionKey {
            share: Share {
                rate: rng.below(40),
                burst: rng.below(40),
            },
            applied: 1,
            lease_end: now - period + rng.below(2 * period),
            last_seq: 1,
        };
        let mut case = ShareCase {
            limit,
            floor,
            region,
            written: limit,
            written_at: 0,
            tat: 0,
            cost: 0,
        };
        // Written under the limit in force (a third of the cases), or another.
        case.written = match region.bucket(case.floor_share(), period, now) {
            Some(same) if rng.below(3) == 0 => same,
            _ => Limit::share(1 + rng.below(60), 1 + rng.below(60), period).unwrap(),
        };
        case.tat = match rng.below(3) {
            0 => 0,
            1 => now - rng.below(period),
            _ => now + rng.below(case.written.burst_offset_us() + 1),
        };
        // Within the limit's burst (the transaction is checked against it), not always within
        // the share's.
        case.cost = 1 + rng.below(limit.burst().min(5));
        case.written_at = now - rng.below(2 * period);
        case
    }

    /// The floor's rate and burst.
    pub(crate) fn floor_share(&self) -> Share {
        Share {
            rate: self.floor.of(self.limit.count()),
            burst: self.floor.of(self.limit.burst()),
        }
    }

    /// What the Rust rule decides: `RegionKey::bucket`, then `gcra::keep_tokens` from
    /// `RegionKey::changed_at` when the limit changed, then `gcra::check`.
    pub(crate) fn expected(&self, period: u64, now: u64) -> Expected {
        let Some(new) = self.region.bucket(self.floor_share(), period, now) else {
            return Expected::Closed;
        };
        let same = new.emission_interval_us() == self.written.emission_interval_us()
            && new.burst() == self.written.burst();
        let read = if same {
            (self.tat > now).then_some(self.tat)
        } else {
            let at = self.region.changed_at(self.written_at, now);
            gcra::keep_tokens(&self.written, &new, (self.tat != 0).then_some(self.tat), at)
                .unwrap()
                .filter(|&t| t > now)
        };
        if self.cost > new.burst() {
            return Expected::NeverFits;
        }
        let outcome = gcra::check(&new, read, now, self.cost).unwrap();
        let tat = match (outcome.allowed, outcome.new_tat) {
            (true, Some(t)) => t,
            _ => read.unwrap_or(0),
        };
        Expected::Decided { same, outcome, tat }
    }

    /// Holds what a store decided of this case (`got`, and the TAT it left: 0 for none, a TAT
    /// in the past read as now) to the Rust rule, and counts the case by what it exercised in
    /// `seen`: closed, beyond the share's burst, the same limit, a changed limit allowed, a
    /// changed limit denied.
    pub(crate) fn check(
        &self,
        period: u64,
        now: u64,
        got: &crate::backend::Outcome,
        stored_tat: u64,
        seen: &mut [u32; 5],
        context: &str,
    ) {
        match self.expected(period, now) {
            Expected::Closed => {
                assert!(!got.allowed, "{context}: closed");
                seen[0] += 1;
            }
            Expected::NeverFits => {
                assert!(!got.allowed, "{context}: never fits the share");
                seen[1] += 1;
            }
            Expected::Decided { same, outcome, tat } => {
                seen[match (same, outcome.allowed) {
                    (true, _) => 2,
                    (false, true) => 3,
                    (false, false) => 4,
                }] += 1;
                assert_eq!(
                    (
                        got.allowed,
                        got.remaining,
                        got.retry_after_us,
                        got.reset_after_us
                    ),
                    (
                        outcome.allowed,
                        outcome.remaining,
                        outcome.retry_after_us,
                        outcome.reset_after_us
                    ),
                    "{context}"
                );
                assert_eq!(stored_tat.max(now), tat.max(now), "{context}");
            }
        }
    }
}
