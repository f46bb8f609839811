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
//! a region store losing its records, a region joining.
//!
//! A region has one or more instances. They share the region's record of each key (requests
//! are numbered, grants applied and leases kept there, by whichever instance holds the lock or
//! thinks it does: every interleaving of their sends is one of the region's), and each holds
//! what is its own: whether it uses the floor (the confirmation it last learned, from the
//! global store's answer to its registration or from the region's record of it) and the
//! registry it has seen, from which it makes a lost registry again. A registration is sent by
//! any instance at any time its answer could change something; its answer is written to the
//! region's store (any number of such writes in flight, in any order: two instances that both
//! think they hold the lock), and any instance reads it at any time. A region cut off is a region whose
//! messages are all lost; a global store unreachable is every message lost; a lease expiring
//! is the clock passing its end. Each store has a fixed clock offset of its own (they add
//! nothing: each record compares only its own store's times).
//!
//! The bounds each run covers are in its test's name and settings; `docs/regions.md` lists
//! them. Each safety rule is also removed once (a margin smaller than a clock step, no quiet
//! period after a restart, a lease started on arrival instead of at sending, a joining region's
//! floor used at once, a lost registry made again from one instance's own view without its
//! region's record of it), and the search must find the overshoot.

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
    /// Each region's instances. The first has seen the registry at the start; the others
    /// never held the lock (they have seen none).
    instances: Vec<usize>,
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
    /// An instance makes a lost registry again from the registry it has seen itself, not
    /// also the one its region's store keeps.
    OwnSeenOnly,
}

/// A registry as an instance saw it: each region's registration time, by position.
type Seen = Vec<Option<u64>>;

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Message {
    Request(Request),
    Grant(Grant),
    /// Instance `.1` of region `.0` registers, with the registry it has seen.
    Register(usize, usize, Seen),
    /// The answer to instance `.1` of region `.0`: confirmed or not, and the registry.
    Confirmed(usize, usize, bool, Seen),
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Instance {
    /// Whether it uses the floor (the confirmation it last learned).
    floor: bool,
    /// The registry it last saw.
    seen: Seen,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Region {
    key: RegionKey,
    instances: Vec<Instance>,
    /// The region store's record of the confirmation and of the registry (`None`: never
    /// written, or lost with the store's records).
    record: Option<(bool, Seen)>,
    sent: u8,
    back: u64,
    steps_back: u8,
    losses: u8,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct State {
    t: u64,
    key: Option<GlobalKey>,
    /// The global store's registry (`None`: lost with its records).
    registry: Option<Registry>,
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
            instances: vec![1, 1],
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
        let seen = registry.registered_at.clone();
        State {
            t: 0,
            key: None,
            regions: (0..n)
                .map(|r| {
                    let floor = !self.joining.contains(&r);
                    Region {
                        key: RegionKey::default(),
                        instances: (0..self.instances[r])
                            .map(|i| Instance {
                                floor,
                                seen: if i == 0 { seen.clone() } else { vec![None; n] },
                            })
                            .collect(),
                        record: floor.then(|| (true, seen.clone())),
                        sent: 0,
                        back: 0,
                        steps_back: 0,
                        losses: 0,
                    }
                })
                .collect(),
            registry: Some(registry),
            restarts: 0,
            flight: Vec::new(),
        }
    }

    /// The envelope at this state's instant, or what broke it.
    fn check(&self, state: &State) -> Result<(), String> {
        let mut sum = Share::ZERO;
        for (r, region) in state.regions.iter().enumerate() {
            // The instances share one bucket: the floor counts once if any uses it.
            if region.instances.iter().any(|i| i.floor) {
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
        let now = self.global(state);
        if state.t < self.horizon {
            let mut s = state.clone();
            s.t += 1;
            out.push(s);
        }
        for r in 0..state.regions.len() {
            self.region_steps(state, r, out);
            for i in 0..state.regions[r].instances.len() {
                self.instance_steps(state, r, i, out);
            }
        }
        if state.restarts < self.restarts {
            let mut s = state.clone();
            s.key = None;
            s.registry = None;
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
            let mut s = state.clone();
            self.deliver(&mut s, m);
            out.push(s);
        }
        for s in out.iter_mut() {
            self.prune(s);
        }
    }

    /// What region `r` does on its own: a request (by any of its instances: they number it in
    /// the region's record), its store's clock stepping back, its store losing its records.
    fn region_steps(&self, state: &State, r: usize, out: &mut Vec<State>) {
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
            s.regions[r].record = None;
            s.regions[r].losses += 1;
            out.push(s);
        }
    }

    /// What instance `i` of region `r` does on its own: registers (with the registry it has
    /// seen, and the one its region's store keeps), or reads its region's record of the
    /// confirmation (a record it does not find changes nothing).
    fn instance_steps(&self, state: &State, r: usize, i: usize, out: &mut Vec<State>) {
        let region = &state.regions[r];
        let instance = &region.instances[i];
        let mut seen = instance.seen.clone();
        if self.sabotage != Sabotage::OwnSeenOnly
            && let Some((_, kept)) = &region.record
        {
            merge_seen(&mut seen, kept);
        }
        let in_flight = state
            .flight
            .iter()
            .any(|m| matches!(m, Message::Register(rr, ii, _) if (*rr, *ii) == (r, i)));
        // Sent when its answer could change something: the registry lost, the region not
        // confirmed in it, this instance off its floor, or (while the registry may still be
        // lost) not knowing it.
        let useful = state.registry.as_ref().is_none_or(|g| {
            !instance.floor
                || (state.restarts < self.restarts && instance.seen != g.registered_at)
                || !g.confirmed(r, self.global(state), &self.settings)
        });
        if !in_flight && useful {
            let mut s = state.clone();
            s.regions[r].instances[i].seen = seen.clone();
            insert(&mut s.flight, Message::Register(r, i, seen));
            out.push(s);
        }
        if let Some((confirmed, _)) = &region.record
            && *confirmed != instance.floor
        {
            let mut s = state.clone();
            s.regions[r].instances[i].floor = *confirmed;
            out.push(s);
        }
    }

    /// `m` delivered. A request or a grant is kept in flight (it may be delivered again: a
    /// duplicate; a lost message is one never delivered again: every state with it lost is
    /// covered by the same state with it still in flight). A registration and its answer are
    /// one call of one instance: delivered once; the answer is written to the region's store
    /// as it arrives (two instances' answers in flight at once, as when both think they hold
    /// the lock, are written in either order: an older answer written over a newer).
    fn deliver(&self, s: &mut State, m: &Message) {
        let now = self.global(s);
        let n = s.regions.len();
        match m {
            Message::Request(request) => {
                let Some(registry) = s.registry.as_mut() else {
                    // A request is answered after its instance's registration (the same
                    // call, or the one before it), which makes a lost registry again.
                    return;
                };
                let quiet_until = registry.quiet_until(now, &self.settings);
                let movable = registry.movable(self.settings.total, &self.floors);
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
                    grant.sent_at = self.local(s, grant.region);
                }
                s.regions[grant.region].key.on_grant(&grant, &self.settings);
            }
            Message::Register(r, i, seen) => {
                remove(&mut s.flight, m);
                let registry = self.registered(s.registry.take(), *r, seen, now);
                if self.sabotage == Sabotage::FloorAtOnce {
                    s.regions[*r].instances[*i].floor = true;
                }
                let confirmed = registry.confirmed(*r, now, &self.settings);
                let answer = Message::Confirmed(*r, *i, confirmed, registry.registered_at.clone());
                s.registry = Some(registry);
                insert(&mut s.flight, answer);
            }
            Message::Confirmed(r, i, confirmed, seen) => {
                remove(&mut s.flight, m);
                let instance = &mut s.regions[*r].instances[*i];
                instance.floor = *confirmed;
                instance.seen = seen.clone();
                s.regions[*r].record = Some((*confirmed, seen.clone()));
            }
        }
    }

    /// The registry after region `r` registers at `now` (global clock) with the registry it
    /// has `seen`, as `global::register` makes it: a lost one made again from `seen`, quiet
    /// for one lease and the margin; then `r` registered unless it is.
    fn registered(&self, stored: Option<Registry>, r: usize, seen: &Seen, now: u64) -> Registry {
        let mut registry = stored.unwrap_or_else(|| Registry {
            registered_at: seen.clone(),
            quiet_until: Some(match self.sabotage {
                Sabotage::NoQuiet => 0,
                _ => now.saturating_add(self.settings.hold_us()),
            }),
        });
        registry.register(r, now, self.settings.total, &self.floors);
        registry
    }

    /// Drops the messages whose delivery can change nothing any more, so two states that
    /// differ only by them are one: a request already answered while no record can be lost, a
    /// grant already applied (or older) while the region's store cannot lose its records.
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
        // The registries seen are used only to make a lost registry again: once none can be
        // lost any more, they are all one.
        if s.restarts >= self.restarts && s.registry.is_some() {
            for region in &mut s.regions {
                for i in &mut region.instances {
                    i.seen.clear();
                }
                if let Some((_, seen)) = &mut region.record {
                    seen.clear();
                }
            }
            for m in &mut s.flight {
                if let Message::Register(_, _, seen) | Message::Confirmed(_, _, _, seen) = m {
                    seen.clear();
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
            Message::Register(..) | Message::Confirmed(..) => true,
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
                            .map(|r| (
                                r.key,
                                r.instances.iter().map(|i| i.floor).collect::<Vec<_>>(),
                                r.record.clone()
                            ))
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

fn remove(flight: &mut Vec<Message>, m: &Message) {
    if let Ok(at) = flight.binary_search(m) {
        flight.remove(at);
    }
}

/// `kept` (a registry another instance saw) merged into `seen`, as an instance merges its
/// region's record of the registry into its own (`later_registration`).
fn merge_seen(seen: &mut Seen, kept: &Seen) {
    for (mine, theirs) in seen.iter_mut().zip(kept) {
        *mine = later_registration(*mine, *theirs);
    }
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
            Message::Register(r, i, seen) => write!(f, "register(r{r}.{i} {seen:?})"),
            Message::Confirmed(r, i, c, seen) => write!(f, "confirmed(r{r}.{i} {c} {seen:?})"),
        }
    }
}

/// A run larger than this is a mistake in the test (it would take minutes in a debug build).
const MAX_STATES: usize = 12_000_000;

mod runs;
