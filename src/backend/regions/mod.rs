//! What every regional mode shares (`docs/regions.md`), whatever holds its records: the global
//! store's records and decisions (`global.rs`), how a region moves shares (its settings, the
//! schedule of a period's rebalance, a key's demand), and regional mode in memory (`memory.rs`:
//! the regions of one process, for the simulator and tests). The Redis backend's regional mode
//! (`backend/redis/regions/`) keeps the same records in Redis.

#[cfg(test)]
pub(crate) mod cases;
pub(crate) mod global;
#[cfg(test)]
mod instances_model;
mod memory;

pub(crate) use memory::MemoryRegion;
pub use memory::{Moved, ShareNow, SimulatedRegions};

use std::time::Duration;

use crate::algo::gcra::Limit;
use crate::config::RegionFloor;
use crate::key::BucketKey;

/// A region's share of one key of a limit marked `across_regions`
/// ([`Inspection::region_share`](crate::limiter::Inspection::region_share)): its floor, and the part the global store granted it while
/// the part's lease runs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionShare {
    /// This region's name.
    pub region: String,
    /// Whether the region's registration is confirmed: until then its floor is 0 and the key is
    /// closed here.
    pub confirmed: bool,
    /// The floor's rate (requests per the limit's period) and burst.
    pub floor: (u64, u64),
    /// The part granted, its rate and burst (zero when none, or its lease ended).
    pub part: (u64, u64),
    /// How long the part's lease runs still, by this instance's clock (zero: none).
    pub lease_left: Duration,
}

/// How a regional instance moves shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionalSettings {
    /// How often the region rebalances (one call per global slot each time).
    pub(crate) period_us: u64,
    /// How long a grant may be used, from when its request left the region.
    pub(crate) lease_us: u64,
    /// How much longer the global store counts a grant (clock drift and steps).
    pub(crate) margin_us: u64,
    /// The most keys one rebalance asks for, the busiest first.
    pub(crate) max_keys: usize,
}

impl Default for RegionalSettings {
    fn default() -> Self {
        Self {
            period_us: 1_000_000,
            lease_us: 3_000_000,
            margin_us: 1_000_000,
            max_keys: 10_000,
        }
    }
}

impl RegionalSettings {
    /// The most distinct keys an instance counts demand for in one period (more are not
    /// counted until the next period): four times the keys a rebalance asks for.
    pub(crate) fn demand_cap(&self) -> usize {
        self.max_keys.saturating_mul(4)
    }

    /// The protocol's settings for one marked limit.
    pub(crate) fn protocol(&self, limit: &Limit) -> crate::algo::regions::Settings {
        crate::algo::regions::Settings {
            total: crate::algo::regions::Share {
                rate: limit.count(),
                burst: limit.burst(),
            },
            lease_us: self.lease_us,
            margin_us: self.margin_us,
        }
    }
}

/// When a period's rebalance runs, in hundredths of a period after its end: 15% into the next
/// period in every region, so every instance's demand is in (they add it a twentieth of a
/// period in), and a region giving up a part and one taking it ask in the same instant.
pub(crate) const REBALANCE_AT_PERCENT: u64 = 15;

/// When the keys whose answer may change this period are asked again, in quarters of a period
/// after its end: half and three quarters in (`global::Answered::ask_again`).
pub(crate) const ASK_AGAIN_QUARTERS: [u64; 2] = [2, 3];

/// When the keys whose demand surged in the period under way are asked for (`surging`), in
/// quarters of a period after its start: half way, with the first asking again.
pub(crate) const SURGE_QUARTER: u64 = 2;

/// `key`'s limit when it is marked `across_regions` (a GCRA limit: the only one a share bucket
/// decides): its quota, its limit and the region floor.
pub(crate) fn marked<'l>(
    limits: &'l crate::config::Limits,
    key: &BucketKey,
) -> Option<(&'l crate::quota::Quota, &'l Limit, RegionFloor)> {
    let quota = limits.resolve(key)?;
    Some((quota, quota.as_gcra()?, limits.across_regions(key.name())?))
}

/// A key's demand above its floor, in requests per its limit's period, from the `units` its
/// requests asked (admitted and refused) over one rebalance period of `period_us`.
pub(crate) fn demand_above_floor(
    units: u64,
    limit: &Limit,
    floor: RegionFloor,
    period_us: u64,
) -> u64 {
    let per_period =
        u128::from(units) * u128::from(limit.period_us()) / u128::from(period_us.max(1));
    u64::try_from(per_period)
        .unwrap_or(u64::MAX)
        .saturating_sub(floor.of(limit.count()))
}

/// The fewest units a surge is measured on.
const MIN_SURGE_UNITS: u64 = 8;

/// `again` (keys asked again in the period, with their demands) with `surged` added: a key
/// already in it asks for the larger demand.
pub(crate) fn with_surges(
    again: &mut Vec<(BucketKey, u64)>,
    surged: impl IntoIterator<Item = (BucketKey, u64)>,
) {
    let mut at: std::collections::HashMap<BucketKey, usize> = (again.iter().enumerate())
        .map(|(i, (k, _))| (k.clone(), i))
        .collect();
    for (key, demand) in surged {
        match at.get(&key) {
            Some(&i) => again[i].1 = again[i].1.max(demand),
            None => {
                at.insert(key.clone(), again.len());
                again.push((key, demand));
            }
        }
    }
}

/// The keys whose demand surged in the period under way, with their demands: `units` asked of
/// each so far (admitted and refused; at least [`MIN_SURGE_UNITS`]), `elapsed_us` into the
/// period, at that pace above its floor (`demand_above_floor`), more than an eighth above the
/// demand `reported` at the period's rebalance (none: 0) and by more than an eighth of the
/// limit. Asked for half a period in, so a region whose demand rose
/// (one idle that bursts) reports it a period sooner, and the regions holding the rest see it
/// at the next rebalance.
pub(crate) fn surging(
    units: impl IntoIterator<Item = (BucketKey, u64)>,
    limits: &crate::config::Limits,
    elapsed_us: u64,
    reported: &std::collections::HashMap<BucketKey, u64>,
) -> Vec<(BucketKey, u64)> {
    units
        .into_iter()
        .filter_map(|(key, units)| {
            let (_, limit, floor) = marked(limits, &key)?;
            let demand = demand_above_floor(units, limit, floor, elapsed_us);
            let before = reported.get(&key).copied().unwrap_or(0);
            // An eighth more, and an eighth of the limit more, on 8 units at least: a request
            // or two early in a period is not a surge (asked for, it would be given back at the
            // next rebalance, every period: 10,000 keys of 1 a second measured 5.15 global
            // commands a second without the 8 units, 3.4 with none of this).
            let rise = demand.saturating_sub(before);
            (units >= MIN_SURGE_UNITS && rise > before / 8 && rise > limit.count() / 8)
                .then_some((key, demand))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Id, Limits};

    /// A surge of a key already asked again asks for the larger demand; a new key is added.
    #[test]
    fn surges_join_the_keys_asked_again_once_each() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(100, 100, 1_000_000).unwrap())
            .build()
            .unwrap();
        let key = |id: u64| BucketKey::new(limits.name("Api").unwrap(), Id::from(id));
        let mut again = vec![(key(1), 30), (key(2), 50)];
        with_surges(&mut again, [(key(2), 40), (key(1), 35), (key(3), 9)]);
        assert_eq!(again, vec![(key(1), 35), (key(2), 50), (key(3), 9)]);
    }

    /// A surge is a demand at this period's pace more than an eighth above the one reported
    /// and by more than an eighth of the limit, on 8 units at least: an idle region that
    /// bursts, not a steady one or a request early in a period.
    #[test]
    fn a_surge_is_a_rise_of_an_eighth_and_of_an_eighth_of_the_limit() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(100, 100, 1_000_000).unwrap())
            .across_regions("Api", RegionFloor::default())
            .build()
            .unwrap();
        let key = BucketKey::new(limits.name("Api").unwrap(), Id::from(1u64));
        let half = 500_000;
        let reported = |d: u64| std::collections::HashMap::from([(key.clone(), d)]);
        let at = |units: u64, before: u64| {
            surging([(key.clone(), units)], &limits, half, &reported(before))
        };
        // 75 a second (37 in half a second) above a floor of 10: 64 a second.
        assert_eq!(at(37, 0), vec![(key.clone(), 64)], "from idle");
        assert_eq!(at(37, 64), vec![], "steady");
        assert_eq!(at(37, 56), vec![], "an eighth more, not above it");
        assert_eq!(
            at(37, 50),
            vec![(key.clone(), 64)],
            "more than an eighth more"
        );
        // Two requests early in a period: 4 a second, below the floor.
        assert_eq!(at(2, 0), vec![], "a request or two");
        // 11 in half a second (22 a second, 12 above the floor): not an eighth of the limit.
        assert_eq!(at(11, 0), vec![], "less than an eighth of the limit");
        assert_eq!(
            at(12, 0),
            vec![(key.clone(), 14)],
            "more than an eighth of it"
        );
        // 10 a second (floor 1): 7 units in half a second are too few to tell, 8 a surge.
        let small = Limits::builder()
            .limit("Api", Limit::from_micros(10, 10, 1_000_000).unwrap())
            .across_regions("Api", RegionFloor::default())
            .build()
            .unwrap();
        let key = BucketKey::new(small.name("Api").unwrap(), Id::from(1u64));
        let none = std::collections::HashMap::new();
        assert!(surging([(key.clone(), 7)], &small, half, &none).is_empty());
        assert_eq!(
            surging([(key.clone(), 8)], &small, half, &none),
            vec![(key, 15)]
        );
        // Not a marked limit: never.
        let plain = Limits::builder()
            .limit("Api", Limit::from_micros(100, 100, 1_000_000).unwrap())
            .build()
            .unwrap();
        let key = BucketKey::new(plain.name("Api").unwrap(), Id::from(1u64));
        assert!(surging([(key, 50)], &plain, half, &Default::default()).is_empty());
    }
}
