//! What every regional mode shares (`docs/regions.md`), whatever holds its records: the global
//! store's records and decisions (`global.rs`), how a region moves shares (its settings, the
//! schedule of a period's rebalance, a key's demand), and regional mode in memory (`memory.rs`:
//! the regions of one process, for the simulator and tests). The Redis backend's regional mode
//! (`backend/redis/regions/`) keeps the same records in Redis.

#[cfg(test)]
pub(crate) mod cases;
pub(crate) mod global;
mod memory;

pub(crate) use memory::MemoryRegion;
pub use memory::{Moved, ShareNow, SimulatedRegions};

use crate::Limit;
use crate::config::RegionFloor;

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
