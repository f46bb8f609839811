//! The share protocol's model check: a breadth-first search over every state the protocol's own
//! transition functions ([`GlobalKey::on_request`], [`RegionKey::request`],
//! [`RegionKey::on_grant`], [`Registry`]) reach, for small integers, asserting the envelope in
//! every state: the floors and shares the regions may be using at that instant sum to at most
//! the limit, in rate and in burst.
//!
//! What a run explores, in any order: the reference clock's ticks; each region's requests with
//! any demand (so every transfer the allocation makes), up to a bound; every message (request,
//! grant, registration, confirmation) delivered any number of times, in any order, or lost;
//! and, by the run's faults, the global store restarting with its records lost (any number of
//! times up to a bound), a record forgotten at its expiry, a region store's clock stepping back,
//! a region store losing its records, a region joining. A region cut off is a region whose
//! messages are all lost; a global store unreachable is every message lost; a lease expiring
//! is the clock passing its end. Each store has a fixed clock offset of its own (they add
//! nothing: each record compares only its own store's times).
//!
//! The bounds each run covers are in its test's name and settings; `docs/regions.md` lists
//! them. Each safety rule is also removed once (a margin smaller than a clock step, no quiet
//! period after a restart, a lease started on arrival instead of at sending, a joining region's
//! floor used at once), and the search must find the overshoot.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashSet, VecDeque};
use std::hash::{Hash, Hasher};

use super::*;

/// One run's sizes and faults.
#[derive(Clone)]
struct Run {
    settings: Settings,
    /// Each region's floor.
    floors: Vec<Share>,
    /// Each region's store clock offset from the reference clock.
    offsets: Vec<u64>,
    /// The global store's clock offset.
    global_offset: u64,
    /// The last reference tick explored.
    horizon: u64,
    /// Requests of each region.
    requests: Vec<u8>,
    /// The demands each region's requests may report.
    demands: Vec<Vec<u64>>,
    /// Global restarts (records and epoch lost).
    restarts: u8,
    /// Whether a record may be forgotten once lapsed (its expiry).
    forget: bool,
    /// Backward steps of one tick of each region's store clock.
    steps_back: u8,
    /// Region store losses (its records forgotten).
    region_losses: u8,
    /// Regions that are not registered at the start (they join).
    joining: Vec<usize>,
    /// A sabotage: the safety rule removed, for the negative runs.
    sabotage: Sabotage,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Sabotage {
    None,
    /// A restarted global store grants at once.
    NoQuiet,
    /// A region starts its lease when the grant arrives.
    LeaseOnArrival,
    /// A joining region uses its floor as soon as it is registered.
    FloorAtOnce,
}

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Message {
    Request(Request),
    Grant(Grant),
    Register(usize),
    Confirmed(usize),
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Region {
    key: RegionKey,
    /// Whether its floor is in use (registration confirmed).
    floor: bool,
    sent: u8,
    back: u64,
    steps_back: u8,
    losses: u8,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    t: u64,
    key: Option<GlobalKey>,
    registry: Registry,
    restarts: u8,
    regions: Vec<Region>,
    /// The messages in flight, sorted, each once.
    flight: Vec<Message>,
}

impl Run {
    fn two(lease: u64, margin: u64) -> Run {
        Run {
            settings: Settings {
                total: Share { rate: 4, burst: 4 },
                lease_us: lease,
                margin_us: margin,
            },
            floors: vec![Share { rate: 1, burst: 1 }; 2],
            offsets: vec![7, 3],
            global_offset: 5,
            horizon: 5,
            requests: vec![2, 2],
            demands: vec![vec![0, 2]; 2],
            restarts: 0,
            forget: false,
            steps_back: 0,
            region_losses: 0,
            joining: vec![],
            sabotage: Sabotage::None,
        }
    }

    fn local(&self, state: &State, region: usize) -> u64 {
        state.t + self.offsets[region] - state.regions[region].back
    }

    fn global(&self, state: &State) -> u64 {
        state.t + self.global_offset
    }

    fn start(&self) -> State {
        let n = self.floors.len();
        let mut registry = Registry::new(n);
        for r in 0..n {
            if !self.joining.contains(&r) {
                // Registered long ago: confirmed from the start.
                registry.registered_at[r] = Some(0);
            }
        }
        registry.quiet_until = Some(0);
        State {
            t: 0,
            key: None,
            registry,
            restarts: 0,
            regions: (0..n)
                .map(|r| Region {
                    key: RegionKey::default(),
                    floor: !self.joining.contains(&r),
                    sent: 0,
                    back: 0,
                    steps_back: 0,
                    losses: 0,
                })
                .collect(),
            flight: Vec::new(),
        }
    }

    /// The envelope at this state's instant, or what broke it.
    fn check(&self, state: &State) -> Result<(), String> {
        let mut sum = Share::ZERO;
        for (r, region) in state.regions.iter().enumerate() {
            if region.floor {
                sum = sum.plus(self.floors[r]);
            }
            sum = sum.plus(region.key.in_use(self.local(state, r)));
        }
        if sum.within(self.settings.total) {
            Ok(())
        } else {
            Err(format!("in use {sum:?} over {:?}", self.settings.total))
        }
    }

    /// Every state one step from `state`.
    fn next(&self, state: &State, out: &mut Vec<State>) {
        let n = state.regions.len();
        let now = self.global(state);
        if state.t < self.horizon {
            let mut s = state.clone();
            s.t += 1;
            out.push(s);
        }
        for r in 0..n {
            let region = &state.regions[r];
            // At most one request a tick, as the rebalancer sends one a period.
            if region.sent < self.requests[r] && region.key.last_seq < self.local(state, r) {
                for &demand in &self.demands[r] {
                    let mut s = state.clone();
                    let local = self.local(&s, r);
                    let request = s.regions[r].key.request(r, demand, local);
                    s.regions[r].sent += 1;
                    insert(&mut s.flight, Message::Request(request));
                    out.push(s);
                }
            }
            if !region.floor && !state.flight.contains(&Message::Register(r)) {
                let mut s = state.clone();
                insert(&mut s.flight, Message::Register(r));
                out.push(s);
            }
            if region.steps_back < self.steps_back {
                let mut s = state.clone();
                s.regions[r].back += 1;
                s.regions[r].steps_back += 1;
                out.push(s);
            }
            if region.losses < self.region_losses {
                let mut s = state.clone();
                let last_seq = s.regions[r].key.last_seq;
                // The store's records are gone; the next request is numbered from its clock,
                // which in this model has not passed the last number: the worst case.
                s.regions[r].key = RegionKey {
                    last_seq,
                    ..RegionKey::default()
                };
                s.regions[r].losses += 1;
                out.push(s);
            }
        }
        if state.restarts < self.restarts {
            let mut s = state.clone();
            s.key = None;
            s.registry.quiet_until = match self.sabotage {
                Sabotage::NoQuiet => Some(0),
                _ => None,
            };
            s.restarts += 1;
            out.push(s);
        }
        if self.forget
            && let Some(key) = &state.key
            && key.lapsed(now, &self.settings)
        {
            let mut s = state.clone();
            s.key = None;
            out.push(s);
        }
        for m in state.flight.iter() {
            // Delivered, and kept: it may be delivered again (a duplicate). A lost message is
            // one never delivered again: every state with it lost is covered by the same state
            // with it still in flight, from which nothing forces its delivery.
            let mut s = state.clone();
            match m {
                Message::Request(request) => {
                    let quiet_until = s.registry.quiet_until(now, &self.settings);
                    let movable = s.registry.movable(self.settings.total, &self.floors);
                    let key = s.key.get_or_insert_with(|| GlobalKey::new(n));
                    if let Some(grant) =
                        key.on_request(request, now, movable, quiet_until, &self.settings)
                    {
                        insert(&mut s.flight, Message::Grant(grant));
                    }
                }
                Message::Grant(grant) => {
                    let mut grant = *grant;
                    if self.sabotage == Sabotage::LeaseOnArrival {
                        grant.sent_at = self.local(&s, grant.region);
                    }
                    s.regions[grant.region].key.on_grant(&grant, &self.settings);
                }
                Message::Register(r) => {
                    s.registry
                        .register(*r, now, self.settings.total, &self.floors);
                    if self.sabotage == Sabotage::FloorAtOnce {
                        s.regions[*r].floor = true;
                    }
                    if s.registry.confirmed(*r, now, &self.settings) {
                        insert(&mut s.flight, Message::Confirmed(*r));
                    }
                }
                Message::Confirmed(r) => s.regions[*r].floor = true,
            }
            out.push(s);
        }
        for s in out.iter_mut() {
            self.prune(s);
        }
    }

    /// Drops the messages whose delivery can change nothing any more, so two states that
    /// differ only by them are one: a request already answered while no record can be lost, a
    /// grant already applied (or older) while the region's store cannot lose its records, a
    /// registration or confirmation of a region already using its floor.
    fn prune(&self, s: &mut State) {
        // Times that can no longer matter, made one: once a clock can no longer step back, a
        // lease that has ended and a grant whose lease ended before it arrives are no use
        // whatever their numbers; a global record's lapsed region is lapsed from any time.
        let now = self.global(s);
        for r in 0..s.regions.len() {
            let local = self.local(s, r);
            let region = &mut s.regions[r];
            if region.steps_back < self.steps_back {
                continue;
            }
            if region.key.lease_end <= local {
                region.key.lease_end = 0;
                region.key.share = Share::ZERO;
            }
            for m in s.flight.iter_mut() {
                if let Message::Grant(g) = m {
                    let late = g.sent_at + self.settings.lease_us <= local;
                    if g.region == r && late && self.sabotage != Sabotage::LeaseOnArrival {
                        g.sent_at = 0;
                        g.share = Share::ZERO;
                    }
                }
            }
        }
        s.flight.sort();
        s.flight.dedup();
        if let Some(key) = &mut s.key {
            for h in &mut key.regions {
                if now.saturating_sub(h.issued_at) >= self.settings.hold_us() {
                    h.issued_at = 0;
                }
            }
        }
        let records_kept = s.restarts >= self.restarts && !self.forget;
        let key = s.key.as_ref();
        let regions = &s.regions;
        let losses = self.region_losses;
        s.flight.retain(|m| match m {
            Message::Request(q) => {
                !(records_kept && key.is_some_and(|k| q.seq <= k.regions[q.region].answered))
            }
            Message::Grant(g) => {
                let r = &regions[g.region];
                !(r.losses >= losses && g.seq <= r.key.applied)
            }
            Message::Register(r) | Message::Confirmed(r) => !regions[*r].floor,
        });
    }

    /// Searches every reachable state; the number of states, or the first that breaks the
    /// envelope. States are remembered by a 64-bit fingerprint (hash compaction): two states
    /// sharing one would hide the second's successors, with a chance under 10^-7 at these
    /// sizes.
    fn search(&self) -> Result<usize, String> {
        let start = self.start();
        self.check(&start)?;
        let mut seen: HashSet<u64> = HashSet::new();
        let mut queue: VecDeque<(State, u32)> = VecDeque::new();
        seen.insert(fingerprint(&start));
        queue.push_back((start, 0));
        let mut next = Vec::new();
        while let Some((state, depth)) = queue.pop_front() {
            if seen.len() > MAX_STATES {
                return Err(format!(
                    "more than {MAX_STATES} states: make the run smaller"
                ));
            }
            next.clear();
            self.next(&state, &mut next);
            for s in next.drain(..) {
                if !seen.insert(fingerprint(&s)) {
                    continue;
                }
                if let Err(e) = self.check(&s) {
                    return Err(format!(
                        "{e} at depth {}: t={} key={:?} regions={:?} flight={:?}",
                        depth + 1,
                        s.t,
                        s.key,
                        s.regions
                            .iter()
                            .map(|r| (r.key, r.floor))
                            .collect::<Vec<_>>(),
                        s.flight
                    ));
                }
                queue.push_back((s, depth + 1));
            }
        }
        Ok(seen.len())
    }
}

fn fingerprint(state: &State) -> u64 {
    let mut h = DefaultHasher::new();
    state.hash(&mut h);
    h.finish()
}

fn insert(flight: &mut Vec<Message>, m: Message) {
    if let Err(at) = flight.binary_search(&m) {
        flight.insert(at, m);
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Message::Request(r) => write!(
                f,
                "req(r{} #{} a{} d{} @{})",
                r.region, r.seq, r.applied, r.demand, r.sent_at
            ),
            Message::Grant(g) => write!(
                f,
                "grant(r{} #{} {:?} @{})",
                g.region, g.seq, g.share, g.sent_at
            ),
            Message::Register(r) => write!(f, "register(r{r})"),
            Message::Confirmed(r) => write!(f, "confirmed(r{r})"),
        }
    }
}

/// A run larger than this is a mistake in the test (it would take minutes in a debug build).
const MAX_STATES: usize = 12_000_000;

fn holds(run: &Run) -> usize {
    match run.search() {
        Ok(states) => states,
        Err(e) => panic!("the envelope broke: {e}"),
    }
}

fn breaks(run: &Run) -> String {
    match run.search() {
        Ok(states) => panic!("no overshoot found in {states} states"),
        Err(e) => e,
    }
}

impl Run {
    fn requests(mut self, requests: &[u8]) -> Run {
        self.requests = requests.to_vec();
        self
    }

    fn horizon(mut self, horizon: u64) -> Run {
        self.horizon = horizon;
        self
    }

    /// Every request of every region reports `demand`.
    fn demand(mut self, demand: u64) -> Run {
        self.demands = vec![vec![demand]; self.floors.len()];
        self
    }

    fn three(lease: u64, margin: u64) -> Run {
        let mut run = Run::two(lease, margin);
        run.floors = vec![Share { rate: 1, burst: 1 }; 3];
        run.settings.total = Share { rate: 5, burst: 5 };
        run.offsets = vec![7, 3, 4];
        run.demands = vec![vec![0, 2]; 3];
        run
    }

    fn restarts(mut self, restarts: u8) -> Run {
        self.restarts = restarts;
        self.forget = true;
        self
    }

    fn steps_back(mut self, steps: u8) -> Run {
        self.steps_back = steps;
        self
    }

    fn region_losses(mut self, losses: u8) -> Run {
        self.region_losses = losses;
        self
    }

    fn joining(mut self, region: usize) -> Run {
        self.joining = vec![region];
        self
    }

    fn sabotage(mut self, sabotage: Sabotage) -> Run {
        self.sabotage = sabotage;
        self
    }
}

// The runs of the test command: each explores every interleaving at its sizes in seconds in a
// debug build. Two regions, floors 1 of a limit of 4 (2 move), or three regions, floors 1 of 5.

#[test]
fn two_regions_lapsed_leases_losses_and_reordering_never_overshoot() {
    // Requests of demand 0 or 2; leases of 1 tick; every message late, lost or reordered.
    holds(&Run::two(1, 0).requests(&[2, 2]).horizon(3));
}

#[test]
fn a_share_moves_only_after_its_holder_confirms_giving_it_up() {
    // Leases long enough that nothing lapses: every transfer goes through a confirmation.
    holds(&Run::two(3, 0).requests(&[3, 2]).horizon(3).demand(2));
}

#[test]
fn three_regions_never_overshoot() {
    holds(&Run::three(1, 0).requests(&[1, 1, 1]).horizon(3));
}

#[test]
fn a_global_store_that_loses_its_records_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .restarts(1),
    );
}

#[test]
fn a_region_clock_stepped_back_within_the_margin_never_overshoots() {
    holds(
        &Run::two(1, 1)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .steps_back(1),
    );
}

#[test]
fn a_region_store_that_loses_its_records_never_overshoots() {
    holds(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .region_losses(1),
    );
}

#[test]
fn a_joining_region_uses_its_floor_only_after_every_older_grant_lapsed() {
    holds(
        &Run::two(1, 0)
            .requests(&[1, 2])
            .horizon(3)
            .demand(2)
            .joining(1),
    );
}

// Each rule removed once: the search finds the overshoot it prevents.

#[test]
fn without_the_margin_a_clock_stepped_back_overshoots() {
    breaks(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .steps_back(1),
    );
}

#[test]
fn without_the_quiet_period_a_restarted_global_store_overshoots() {
    let run = Run::two(1, 0)
        .requests(&[2, 1])
        .horizon(3)
        .demand(2)
        .restarts(1);
    breaks(&run.sabotage(Sabotage::NoQuiet));
}

#[test]
fn a_lease_started_on_arrival_overshoots() {
    breaks(
        &Run::two(1, 0)
            .requests(&[2, 1])
            .horizon(3)
            .demand(2)
            .sabotage(Sabotage::LeaseOnArrival),
    );
}

#[test]
fn a_joining_region_using_its_floor_at_once_overshoots() {
    let run = Run::two(1, 0)
        .requests(&[1, 2])
        .horizon(3)
        .demand(2)
        .joining(1);
    breaks(&run.sabotage(Sabotage::FloorAtOnce));
}

// Deeper runs, minutes in a debug build: `cargo test --release -p tower-ratelimits --lib
// --all-features regions::model -- --ignored`.

#[test]
#[ignore = "minutes in a debug build; run with --release"]
fn deep_two_regions_any_demand() {
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(4));
    deep(Run::two(3, 0).requests(&[3, 2]).horizon(3));
    deep(Run::two(2, 0).requests(&[3, 2]).horizon(4));
}

fn deep(run: Run) {
    let started = std::time::Instant::now();
    let states = holds(&run);
    eprintln!(
        "requests {:?}, horizon {}, lease {} margin {}, restarts {}, steps back {}, losses {}, joining {:?}: {states} states in {:?}",
        run.requests,
        run.horizon,
        run.settings.lease_us,
        run.settings.margin_us,
        run.restarts,
        run.steps_back,
        run.region_losses,
        run.joining,
        started.elapsed()
    );
}

#[test]
#[ignore = "minutes in a debug build; run with --release"]
fn deep_faults_any_demand() {
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(3).restarts(1));
    deep(Run::two(1, 1).requests(&[2, 2]).horizon(3).steps_back(1));
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(3).region_losses(1));
    deep(Run::two(1, 0).requests(&[2, 2]).horizon(3).joining(1));
    deep(Run::three(1, 0).requests(&[2, 1, 1]).horizon(3));
}
