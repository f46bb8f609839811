//! The model check of a region's share bucket decided by several instances of the region on
//! one store (`docs/regions.md`, "Several instances in a region"): a breadth-first search over
//! every interleaving of the instances' requests, each instance opening (its registration's
//! confirmation learned) at any point, and the clock's ticks, asserting in every state that
//! the requests the instances admitted together in every window of ticks fit the envelope of
//! the largest floor in use: its burst plus its rate per tick.
//!
//! The record is the script's (`share.lua`'s `read_share` and `write_share`): a TAT
//! with the limit it was written under, read under the reader's limit by the change rule of
//! shares (`gcra::keep_tokens`, as `read_share` in `memory.rs`); no record is a bucket full
//! under the reader's floor. What the rules under test decide: an instance that is closed
//! (no floor yet) writes nothing, and a record is kept for a refill of its whole burst after
//! each write. The parts and their leases are the protocol's (`algo::regions::model`), left
//! out here: every instance reads the same lease from the same record.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::algo::gcra::{self, Limit};

/// The floors' period, in microseconds; the model's clock steps half of it.
const TICK: u64 = 1_000;
const STEP: u64 = TICK / 2;

/// A run's sizes, and the rule removed in its negative twin.
#[derive(Clone)]
struct Run {
    /// Each instance's floor, `(rate a tick, burst)`, and whether it is open at the start.
    instances: Vec<((u64, u64), bool)>,
    /// The last step explored.
    horizon: u64,
    /// The most requests all instances send within one step.
    per_tick: u8,
    sabotage: Sabotage,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Sabotage {
    None,
    /// A closed instance writes the bucket under its limit (no token), which removes a record
    /// whose TAT has passed, as the script did before.
    ClosedWrites,
    /// A record is removed once its TAT has passed (full under the writer's limit), as the
    /// script did before.
    RemovedWhenFull,
}

/// The record of the key in the region's store.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Record {
    /// The limit it was written under: `(rate a tick, burst)`.
    written: (u64, u64),
    tat: Option<u64>,
    /// When the store forgets it.
    expires: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    t: u64,
    record: Option<Record>,
    open: Vec<bool>,
    /// Requests admitted in each step so far.
    admitted: Vec<u8>,
    /// Requests sent in the current step.
    sent: u8,
}

fn limit((rate, burst): (u64, u64)) -> Limit {
    Limit::share(burst, rate, TICK).expect("the model's floors have a rate and a burst")
}

impl Run {
    fn start(&self) -> State {
        State {
            t: 0,
            record: None,
            open: self.instances.iter().map(|&(_, open)| open).collect(),
            admitted: vec![0; usize::try_from(self.horizon).unwrap_or(0) + 1],
            sent: 0,
        }
    }

    /// Instance `i`'s request at the state's instant (`spend`; else the bucket read and
    /// written back without a unit: the rebalancer numbering a request, a cost above the
    /// burst refused): the state after it.
    fn request(&self, s: &State, i: usize, spend: bool) -> State {
        let mut next = s.clone();
        next.sent += 1;
        let now = s.t * STEP;
        let record = s.record.filter(|r| r.expires > now);
        if !s.open[i] {
            // Closed: refused. The rule: nothing written; before, the bucket written drained
            // under a closed limit, a TAT not ahead of now: the record removed.
            if self.sabotage == Sabotage::ClosedWrites {
                next.record = None;
            } else {
                next.record = record;
            }
            return next;
        }
        let floor = self.instances[i].0;
        let mine = limit(floor);
        let tat = match record {
            None => None,
            Some(r) if r.written == floor => r.tat,
            Some(r) => gcra::keep_tokens(&limit(r.written), &mine, r.tat, now).unwrap(),
        };
        let outcome = gcra::check(&mine, tat, now, 1).unwrap();
        let tat = if spend && outcome.allowed {
            next.admitted[usize::try_from(s.t).unwrap()] += 1;
            outcome.new_tat.or(tat)
        } else {
            tat
        };
        let tat = tat.filter(|&t| t > now);
        let expires = match self.sabotage {
            Sabotage::RemovedWhenFull => tat.unwrap_or(now),
            _ => now + mine.burst_offset_us(),
        };
        next.record = (expires > now).then_some(Record {
            written: floor,
            tat,
            expires,
        });
        next
    }

    fn next(&self, s: &State, out: &mut Vec<State>) {
        if s.t < self.horizon {
            let mut n = s.clone();
            n.t += 1;
            n.sent = 0;
            out.push(n);
        }
        for i in 0..s.open.len() {
            if s.sent < self.per_tick {
                out.push(self.request(s, i, true));
                out.push(self.request(s, i, false));
            }
            if !s.open[i] {
                let mut n = s.clone();
                n.open[i] = true;
                out.push(n);
            }
        }
    }

    /// The envelope of the largest floor in use, over every window of ticks ending now.
    fn check(&self, s: &State) -> Result<(), String> {
        let (rate, burst) = (self.instances.iter().zip(&s.open))
            .filter(|(_, open)| **open)
            .map(|((floor, _), _)| *floor)
            .fold((0, 0), |(r, b), (fr, fb)| (r.max(fr), b.max(fb)));
        let end = usize::try_from(s.t).unwrap();
        let mut sum = 0u64;
        for start in (0..=end).rev() {
            sum += u64::from(s.admitted[start]);
            let allowed = burst + rate * (end - start) as u64 * STEP / TICK;
            if sum > allowed {
                return Err(format!(
                    "{sum} admitted in steps {start}..={end}, {allowed} allowed: {:?}",
                    s.admitted
                ));
            }
        }
        Ok(())
    }

    fn search(&self) -> Result<usize, String> {
        let start = self.start();
        let mut seen = HashSet::new();
        let mut queue = VecDeque::from([start]);
        let mut next = Vec::new();
        while let Some(s) = queue.pop_front() {
            self.check(&s)?;
            next.clear();
            self.next(&s, &mut next);
            for n in next.drain(..) {
                let mut h = DefaultHasher::new();
                n.hash(&mut h);
                if seen.insert(h.finish()) {
                    queue.push_back(n);
                }
            }
        }
        Ok(seen.len())
    }
}

fn run(instances: &[((u64, u64), bool)], horizon: u64, sabotage: Sabotage) -> Run {
    Run {
        instances: instances.to_vec(),
        horizon,
        per_tick: 4,
        sabotage,
    }
}

/// Two instances on one floor (1 a tick, burst 2), one open and one that opens at any point:
/// never above the floor's envelope; with a closed instance's write restored, the search
/// finds the overshoot (a deployment's first seconds, two `axum_redis` in a region).
#[test]
fn an_instance_opening_late_never_lets_the_other_pass_the_floor() {
    let pair = [((1, 2), true), ((1, 2), false)];
    let states = run(&pair, 8, Sabotage::None).search().unwrap();
    eprintln!("{states} states");
    assert!(states > 1_000, "{states}");
    let e = run(&pair, 8, Sabotage::ClosedWrites).search().unwrap_err();
    assert!(e.contains("admitted"), "{e}");
}

/// Instances on different floors of one refill time (a rolling deploy of `region_floor`:
/// 2 and 1 a tick, bursts 2 and 1), one opening late besides: never above the larger floor's
/// envelope; with a full record removed at once, the search finds the overshoot. Floors of
/// different refill times are a stated limit (`docs/regions.md`): the record is kept for its
/// writer's refill, which a slower-filling reader outlives.
#[test]
fn instances_on_different_floors_never_pass_the_larger_envelope() {
    let three = [((2, 2), true), ((1, 1), true), ((2, 2), false)];
    let states = run(&three, 6, Sabotage::None).search().unwrap();
    eprintln!("{states} states");
    assert!(states > 1_000, "{states}");
    let e = run(&three, 6, Sabotage::RemovedWhenFull)
        .search()
        .unwrap_err();
    assert!(e.contains("admitted"), "{e}");
}
