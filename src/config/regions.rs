//! A limit marked `across_regions` (`docs/regions.md`): its floor in each region
//! ([`RegionFloor`]), and which limits may be marked.

use std::fmt;

use super::ConfigErrorKind;
use crate::quota::Quota;

/// The part of a limit marked `across_regions` reserved for each region and never lent: a
/// percentage of its rate and of its burst (rounded down), 10% by default. A key decides on its
/// floor alone before its first grant and in a region cut off from the global store; the floors
/// of every registered region must not sum above 100%.
///
/// ```
/// use tower_ratelimits::RegionFloor;
/// let floor: RegionFloor = "2.5%".parse().unwrap();
/// assert_eq!(floor, RegionFloor::from_basis_points(250).unwrap());
/// assert_eq!(floor.of(1_000), 25);
/// assert_eq!(RegionFloor::default().to_string(), "10%");
/// assert!("101%".parse::<RegionFloor>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionFloor {
    basis_points: u16,
}

impl RegionFloor {
    /// 100% in basis points.
    const WHOLE: u16 = 10_000;

    /// A floor of `basis_points` hundredths of a percent (at most 10,000: the whole limit).
    pub fn from_basis_points(basis_points: u16) -> Option<RegionFloor> {
        (basis_points <= Self::WHOLE).then_some(RegionFloor { basis_points })
    }

    /// The floor in hundredths of a percent.
    pub fn basis_points(self) -> u16 {
        self.basis_points
    }

    /// The floor's part of `amount` (a rate or a burst), rounded down.
    pub fn of(self, amount: u64) -> u64 {
        let part = u128::from(amount) * u128::from(self.basis_points) / u128::from(Self::WHOLE);
        u64::try_from(part).unwrap_or(amount)
    }
}

impl Default for RegionFloor {
    /// A tenth of the limit.
    fn default() -> Self {
        RegionFloor {
            basis_points: 1_000,
        }
    }
}

impl std::str::FromStr for RegionFloor {
    type Err = ConfigErrorKind;

    /// `10%`, `2.5%`, `0%`, `12.75%`: a percentage from 0 to 100 with at most two decimals.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || {
            ConfigErrorKind::RegionFloor(format!("{:?}", text.chars().take(40).collect::<String>()))
        };
        let number = text.trim().strip_suffix('%').ok_or_else(bad)?.trim_end();
        let (whole, decimals) = number.split_once('.').unwrap_or((number, ""));
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 3 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(whole)
            || (!decimals.is_empty() && (decimals.len() > 2 || !digits(decimals)))
            || number.ends_with('.')
        {
            return Err(bad());
        }
        let whole: u16 = whole.parse().map_err(|_| bad())?;
        let hundredths: u16 = format!("{decimals:0<2}").parse().map_err(|_| bad())?;
        whole
            .checked_mul(100)
            .and_then(|w| w.checked_add(hundredths))
            .and_then(RegionFloor::from_basis_points)
            .ok_or_else(bad)
    }
}

impl fmt::Display for RegionFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, hundredths) = (self.basis_points / 100, self.basis_points % 100);
        match hundredths {
            0 => write!(f, "{whole}%"),
            h if h % 10 == 0 => write!(f, "{whole}.{}%", h / 10),
            h => write!(f, "{whole}.{h:02}%"),
        }
    }
}

/// Whether `quota` may be the limit (a default or an override) of a name marked
/// `across_regions`.
pub(crate) fn check_marked(quota: &Quota) -> Result<(), ConfigErrorKind> {
    quota
        .across_regions()
        .map_err(ConfigErrorKind::AcrossRegions)
}
