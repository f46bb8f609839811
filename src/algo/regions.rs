//! One limit across regions: the share protocol, as pure functions of integers
//! (`docs/regions.md`).
//!
//! Each region decides a marked limit's requests in its own store, on a share of the limit: its
//! floor (reserved, never lent) plus a part of what moves (the limit minus every registered
//! region's floor). The parts are granted per key by the global store, through these two
//! records and nothing else:
//!
//! - [`GlobalKey`], kept in the global store for one (limit, id): for each region the latest
//!   request it answered, the share granted, the most the region may still be using (`held`)
//!   and when the answer was issued, on the global store's clock. [`GlobalKey::on_request`] is
//!   the one transition: expire what has lapsed, confirm what the region says it applied,
//!   grant at most what no other region may be using.
//! - [`RegionKey`], kept in the region's store for the same key: the share applied, the request
//!   it answered and the lease's end, on the region store's clock. [`RegionKey::request`] and
//!   [`RegionKey::on_grant`] are its transitions, [`RegionKey::in_use`] what it may spend.
//!
//! The invariant (checked over every interleaving by `regions/model.rs`): at every instant the
//! parts the regions may be using sum to at most the movable part, in rate and in burst. It
//! rests on four rules. Give before take: a region's part counts at the most it was granted
//! until the region confirms (a later request naming the grant it applied) or the grant's lease
//! has expired, and only then is the difference free for another region. A lease is a duration
//! started on the region's clock when the request left, before the grant was issued, so a
//! region's lease always ends before the global store's count of it, by the margin that covers
//! clock drift and steps. A global store that lost its records grants nothing for one lease and
//! the margin from when it finds out, so every grant it forgot has lapsed before it grants
//! again. A newly registered region uses its floor only after one lease and the margin, so every
//! grant issued from the larger movable part has lapsed by then.
//!
//! Nothing here reads a clock, a store or a configuration: times are microseconds on the clock
//! of the store that holds the record (each record compares only its own store's times), and
//! regions are positions in the caller's list of registered regions (the stored records name
//! them).

// The Redis backend's regional mode decides the global store's records with these functions;
// the region's side (`RegionKey::request`, `on_grant`, `bucket`) runs in its script, mirrored
// in Lua, and is the tests' oracle here. Without the `redis` feature only the tests call them.
#![cfg_attr(not(test), allow(dead_code))]

use crate::algo::gcra::Limit;

/// A part of a limit: a rate (requests per the limit's period) and a burst.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Share {
    /// Requests per the limit's period.
    pub rate: u64,
    /// Tokens that may be spent at once.
    pub burst: u64,
}

impl Share {
    /// Nothing: no rate, no burst.
    pub const ZERO: Share = Share { rate: 0, burst: 0 };

    /// The smaller in each dimension.
    pub fn min(self, other: Share) -> Share {
        Share {
            rate: self.rate.min(other.rate),
            burst: self.burst.min(other.burst),
        }
    }

    /// The larger in each dimension.
    pub fn max(self, other: Share) -> Share {
        Share {
            rate: self.rate.max(other.rate),
            burst: self.burst.max(other.burst),
        }
    }

    /// The sum in each dimension, saturating.
    pub fn plus(self, other: Share) -> Share {
        Share {
            rate: self.rate.saturating_add(other.rate),
            burst: self.burst.saturating_add(other.burst),
        }
    }

    /// `self - other` in each dimension, at least zero.
    pub fn less(self, other: Share) -> Share {
        Share {
            rate: self.rate.saturating_sub(other.rate),
            burst: self.burst.saturating_sub(other.burst),
        }
    }

    /// Whether `self` is at most `other` in both dimensions.
    pub fn within(self, other: Share) -> bool {
        self.rate <= other.rate && self.burst <= other.burst
    }
}

/// What the protocol needs to know of one marked limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    /// The whole limit: its rate and burst.
    pub total: Share,
    /// How long a grant may be used, from when its request left the region (region clock).
    pub lease_us: u64,
    /// How much longer the global store counts a grant than its lease (global clock): at least
    /// the clocks' drift over a lease plus the largest backward step of a region store's clock
    /// and the largest forward step of the global store's.
    pub margin_us: u64,
}

impl Settings {
    /// How long a grant counts in the global store after it was issued, and how long a global
    /// store that lost its records, or a newly registered region, waits.
    pub fn hold_us(&self) -> u64 {
        self.lease_us.saturating_add(self.margin_us)
    }
}

/// What a region asks for one key: sent by the region, answered by [`GlobalKey::on_request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Request {
    /// The region's position in the registered list.
    pub region: usize,
    /// The request's number: larger than every earlier request of this region for this key.
    pub seq: u64,
    /// The number of the grant the region was using when the request left (0: none).
    pub applied: u64,
    /// The region's demand above its floor over the last period (admitted and refused), in
    /// requests per the limit's period.
    pub demand: u64,
    /// When the request left, on the region store's clock: the grant's lease starts here.
    pub sent_at: u64,
}

/// The global store's answer to one [`Request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Grant {
    /// The region's position in the registered list.
    pub region: usize,
    /// The request answered.
    pub seq: u64,
    /// The region's part of the movable share (its floor not included).
    pub share: Share,
    /// The request's `sent_at`, echoed: the lease starts there.
    pub sent_at: u64,
    /// Whether the answer may change once the other regions have reported and confirmed in
    /// this period (the region asks again later in it): the share falls short of the region's
    /// target while another region holds the rest; or, the region's demand having risen by
    /// more than an eighth since its last request while another region holds a part, short
    /// of the target it would have were the others' demands an eighth lower (their reports may
    /// predate a fall; a fall too small to move the target, as a key of a few requests a
    /// period shows from period to period, asks nothing). Short means by more than a
    /// sixteenth of the movable part (`short_of`).
    pub short: bool,
}

/// The regions registered in the global store, and what its records' loss makes it wait.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Registry {
    /// When each region registered (global clock), by position; `None`: not registered.
    pub registered_at: Vec<Option<u64>>,
    /// Until when the store grants nothing above the floors, once its first call after its
    /// records were lost (or a new store's first call) has found out; `None` until then.
    pub quiet_until: Option<u64>,
}

impl Registry {
    /// A store that knows no region and has not found out that its records are new.
    pub fn new(regions: usize) -> Registry {
        Registry {
            registered_at: vec![None; regions],
            quiet_until: None,
        }
    }

    /// Registers `region` at `now`, unless it already is. Refused (`false`, nothing changes)
    /// when its floor with the registered regions' would sum above `total`: the floors are
    /// always in use, so they must fit (`floors` by position).
    pub fn register(&mut self, region: usize, now: u64, total: Share, floors: &[Share]) -> bool {
        let Some(floor) = floors.get(region) else {
            return false;
        };
        if self.registered_at.get(region).copied().flatten().is_some() {
            return true;
        }
        let reserved = self
            .registered_at
            .iter()
            .zip(floors)
            .filter(|(at, _)| at.is_some())
            .fold(*floor, |sum, (_, f)| sum.plus(*f));
        if !reserved.within(total) {
            return false;
        }
        match self.registered_at.get_mut(region) {
            Some(slot) => {
                *slot = Some(now);
                true
            }
            None => false,
        }
    }

    /// Whether `region` may use its floor: registered at least one lease and the margin ago, so
    /// every grant issued before its floor was taken out of the movable part has lapsed.
    pub fn confirmed(&self, region: usize, now: u64, settings: &Settings) -> bool {
        self.registered_at
            .get(region)
            .copied()
            .flatten()
            .and_then(|at| now.checked_sub(at))
            .is_some_and(|age| age >= settings.hold_us())
    }

    /// What moves: `total` less the floor of every registered region (confirmed or not).
    pub fn movable(&self, total: Share, floors: &[Share]) -> Share {
        self.registered_at
            .iter()
            .zip(floors)
            .filter(|(at, _)| at.is_some())
            .fold(total, |left, (_, floor)| left.less(*floor))
    }

    /// Until when nothing is granted: found out at the first call after the records were lost,
    /// one lease and the margin from then (every grant the store forgot has lapsed by then).
    pub fn quiet_until(&mut self, now: u64, settings: &Settings) -> u64 {
        *self
            .quiet_until
            .get_or_insert(now.saturating_add(settings.hold_us()))
    }
}

/// One region's registration as two instances saw it (global clock; `None`: not seen), made
/// one when an instance merges its region's record of the registry into its own, from which
/// it makes a lost registry again: the later (a region registered again after a loss is
/// confirmed from its new time, never before), or the one seen.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn later_registration(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    a.max(b)
}

/// One region in a [`GlobalKey`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Held {
    /// The latest request answered (0: none).
    pub answered: u64,
    /// What that answer granted.
    pub granted: Share,
    /// The most the region may be using: at least every unexpired grant it has not confirmed
    /// giving up.
    pub held: Share,
    /// When the latest answer was issued (global clock).
    pub issued_at: u64,
    /// The demand the latest request reported.
    pub demand: u64,
}

/// One key's shares, as the global store keeps them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GlobalKey {
    /// Each registered region, by position.
    pub regions: Vec<Held>,
}

impl GlobalKey {
    /// An empty record for `regions` regions.
    pub fn new(regions: usize) -> GlobalKey {
        GlobalKey {
            regions: vec![Held::default(); regions],
        }
    }

    /// Each region's latest demand and the part it may still be using: what
    /// [`allocate`] sets the targets from.
    pub fn bids(&self) -> Vec<(u64, Share)> {
        self.regions.iter().map(|h| (h.demand, h.held)).collect()
    }

    /// Whether every region's grants have lapsed at `now`: the record may be forgotten (the
    /// global store's expiry), since nothing it counts can be in use.
    pub fn lapsed(&self, now: u64, settings: &Settings) -> bool {
        self.regions
            .iter()
            .all(|h| h.held == Share::ZERO || lapsed(h, now, settings))
    }

    /// Answers `request` at `now` (global clock), or `None` for a request already answered or
    /// older than one that was (a duplicate, a late one) or from a region not in the record.
    ///
    /// `movable` is the limit minus every registered region's floor. `quiet_until` is when a
    /// global store that found its records gone may grant again (0 when it never lost them):
    /// until then every grant is zero. The grant is the region's target (`allocate` over every
    /// region's latest demand, its current part kept where within a sixteenth of the movable
    /// part of it: `settle`), but never more than what no other region may be using.
    pub fn on_request(
        &mut self,
        request: &Request,
        now: u64,
        movable: Share,
        quiet_until: u64,
        settings: &Settings,
    ) -> Option<Grant> {
        if request.region >= self.regions.len() {
            return None;
        }
        for h in &mut self.regions {
            if lapsed(h, now, settings) {
                // Nothing it was granted can be in use, and its demand is as old.
                h.held = Share::ZERO;
                h.granted = Share::ZERO;
                h.demand = 0;
            }
        }
        let h = &mut self.regions[request.region];
        if request.seq <= h.answered {
            return None;
        }
        if request.applied == h.answered {
            // The region has applied the latest grant (or none was issued): it never goes back
            // to an older one, so it uses at most this one from now on.
            h.held = h.granted;
        }
        let (reported, current) = (h.demand, h.granted);
        h.answered = request.seq;
        h.issued_at = now;
        h.demand = request.demand;
        let (share, short) = if now < quiet_until {
            (Share::ZERO, false)
        } else {
            let r = request.region;
            let others = (self.regions.iter().enumerate())
                .filter(|(i, _)| *i != r)
                .fold(Share::ZERO, |sum, (_, h)| sum.plus(h.held));
            let bids = self.bids();
            let target = settle(allocate(movable, &bids, r), current, movable);
            let share = target.min(movable.less(others));
            // Were the others' demands an eighth lower (a report from before their fall).
            let fallen: Vec<(u64, Share)> = (bids.iter().enumerate())
                .map(|(i, &(d, h))| (if i == r { d } else { d - d / 8 }, h))
                .collect();
            let rose = request.demand > reported.saturating_add(reported / 8);
            let short = short_of(target, share, movable)
                || (rose
                    && others != Share::ZERO
                    && short_of(
                        settle(allocate(movable, &fallen, r), current, movable),
                        share,
                        movable,
                    ));
            (share, short)
        };
        let h = &mut self.regions[request.region];
        h.granted = share;
        h.held = h.held.max(share);
        Some(Grant {
            region: request.region,
            seq: request.seq,
            share,
            sent_at: request.sent_at,
            short,
        })
    }
}

/// The part of the movable part within which a region's part is kept as it is (a sixteenth):
/// demands that move by a few requests from period to period move no part, and so cost no
/// confirmation and no asking again (`settle`, `short_of`).
const SLACK_DIVISOR: u64 = 16;

/// `target`, or the region's `current` part in each dimension where the two differ by at most
/// a sixteenth of `movable` (no slack below 16 units: a part of a small limit always moves).
/// A target of nothing is never settled near: a region kept a sliver it never used, and asked
/// again every period to give it back.
fn settle(target: Share, current: Share, movable: Share) -> Share {
    let keep = |t: u64, c: u64, m: u64| {
        if t != 0 && t.abs_diff(c) <= m / SLACK_DIVISOR {
            c
        } else {
            t
        }
    };
    Share {
        rate: keep(target.rate, current.rate, movable.rate),
        burst: keep(target.burst, current.burst, movable.burst),
    }
}

/// Whether `share` falls short of `target` by more than a sixteenth of `movable` in either
/// dimension: the answer may change once the other regions have reported and confirmed.
fn short_of(target: Share, share: Share, movable: Share) -> bool {
    target.rate > share.rate.saturating_add(movable.rate / SLACK_DIVISOR)
        || target.burst > share.burst.saturating_add(movable.burst / SLACK_DIVISOR)
}

/// Whether a region's grants have all lapsed at `now`: its latest was issued at least one lease
/// and the margin ago. A clock that went back before the issue says no.
fn lapsed(h: &Held, now: u64, settings: &Settings) -> bool {
    now.checked_sub(h.issued_at)
        .is_some_and(|age| age >= settings.hold_us())
}

/// Region `region`'s target part of `movable`, from every region's latest demand and the
/// part it may still be using (`regions`, by position: `(demand, held)`): each region's demand
/// and an even part of what is spare when the demands fit, else parts in proportion to demand;
/// the burst in proportion to the rate parts (evenly when no rate moves). Each is rounded down,
/// and the units that rounding leaves go one each to the largest remainders (a tie to the region
/// holding more, then the busier, then the first), so the parts sum to `movable` exactly: a
/// limit of 1 that two regions want goes whole to one of them, and stays with its holder while
/// their demands tie.
pub(crate) fn allocate(movable: Share, regions: &[(u64, Share)], region: usize) -> Share {
    if region >= regions.len() {
        return Share::ZERO;
    }
    let n = regions.len() as u128;
    let demands: Vec<u128> = regions.iter().map(|(d, _)| u128::from(*d)).collect();
    let total: u128 = demands.iter().sum();
    let rate = u128::from(movable.rate);
    // Each region's part as a fraction over one denominator.
    let (rate_num, rate_den): (Vec<u128>, u128) = if total <= rate {
        (demands.iter().map(|d| d * n + (rate - total)).collect(), n)
    } else {
        (demands.iter().map(|d| rate * d).collect(), total)
    };
    let held_rate: Vec<u64> = regions.iter().map(|(_, h)| h.rate).collect();
    let rates = apportion(rate, &rate_num, rate_den, &held_rate, &demands);
    let burst = u128::from(movable.burst);
    let (burst_num, burst_den): (Vec<u128>, u128) = if rate == 0 {
        (vec![burst; regions.len()], n)
    } else {
        (rates.iter().map(|r| burst * r).collect(), rate)
    };
    let held_burst: Vec<u64> = regions.iter().map(|(_, h)| h.burst).collect();
    let bursts = apportion(burst, &burst_num, burst_den, &held_burst, &demands);
    Share {
        rate: u64::try_from(rates[region]).unwrap_or(u64::MAX),
        burst: u64::try_from(bursts[region]).unwrap_or(u64::MAX),
    }
}

/// `amount` apportioned by the largest remainder: each part `num / den` rounded down, then one
/// unit each, until `amount` is reached, to the largest remainders, a tie to the larger `held`,
/// then the larger `demand`, then the first. The parts never sum above `amount`.
fn apportion(amount: u128, num: &[u128], den: u128, held: &[u64], demand: &[u128]) -> Vec<u128> {
    if den == 0 {
        return vec![0; num.len()];
    }
    let mut parts: Vec<u128> = num.iter().map(|x| x / den).collect();
    let mut left = amount.saturating_sub(parts.iter().sum());
    let mut order: Vec<usize> = (0..num.len())
        .filter(|&i| !num[i].is_multiple_of(den))
        .collect();
    order.sort_by_key(|&i| {
        (
            std::cmp::Reverse(num[i] % den),
            std::cmp::Reverse(held[i]),
            std::cmp::Reverse(demand[i]),
            i,
        )
    });
    for i in order {
        if left == 0 {
            break;
        }
        parts[i] += 1;
        left -= 1;
    }
    parts
}

/// One key's share, as a region's store keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct RegionKey {
    /// The part of the movable share applied (the floor not included).
    pub share: Share,
    /// The number of the grant applied (0: none).
    pub applied: u64,
    /// When the applied grant's lease ends (region clock).
    pub lease_end: u64,
    /// The number of the latest request sent.
    pub last_seq: u64,
}

impl RegionKey {
    /// The request to send at `now` (region clock), numbered after every earlier one: at least
    /// `now`, so a region store that lost its records numbers on from its clock.
    pub fn request(&mut self, region: usize, demand: u64, now: u64) -> Request {
        let seq = self.last_seq.saturating_add(1).max(now);
        self.last_seq = seq;
        Request {
            region,
            seq,
            applied: self.applied,
            demand,
            sent_at: now,
        }
    }

    /// Applies `grant` if it answers a request sent after the applied grant's; a late or
    /// duplicated grant changes nothing. Its lease runs from when its request left.
    pub fn on_grant(&mut self, grant: &Grant, settings: &Settings) {
        if grant.seq <= self.applied {
            return;
        }
        self.applied = grant.seq;
        self.share = grant.share;
        self.lease_end = grant.sent_at.saturating_add(settings.lease_us);
    }

    /// The limit the region's bucket of this key decides with at `now` (region clock): its
    /// floor plus its part while the lease runs, per the limit's period (`Limit::share`: never
    /// more than that). `None`: no rate or no burst at all, the key is closed in this region.
    /// When it differs from the limit the bucket's state was written under, the state is read
    /// by `gcra::keep_tokens` (its tokens kept, never its TAT).
    pub fn bucket(&self, floor: Share, period_us: u64, now: u64) -> Option<Limit> {
        let share = floor.plus(self.in_use(now));
        Limit::share(share.burst, share.rate, period_us)
    }

    /// When the limit of a bucket written at `written_at` last changed by itself, as of `now`
    /// (region clock): at the lease's end when the lease ended since the write, else `now` (a
    /// grant is applied when it arrives, a reload when the bucket is next read). The bucket's
    /// tokens are kept from then (`gcra::keep_tokens`), so a part whose lease ended refills
    /// nothing after its end.
    pub fn changed_at(&self, written_at: u64, now: u64) -> u64 {
        if self.lease_end > written_at && self.lease_end <= now {
            self.lease_end
        } else {
            now
        }
    }

    /// What the region may use at `now` (region clock) above its floor: its share while the
    /// lease runs, nothing after.
    pub fn in_use(&self, now: u64) -> Share {
        if now < self.lease_end {
            self.share
        } else {
            Share::ZERO
        }
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests;
