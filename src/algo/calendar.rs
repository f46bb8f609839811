//! Calendar quotas: a count of units per calendar period (a day, a week, a month) that renews
//! exactly at the period's boundary, in a time zone. The contract is `docs/calendar.md`.
//!
//! A key's state is the end of the period its units were counted in and the units used; it is
//! current while `now` is before both that end and the end of the period in force (so a
//! changed limit keeps what was used until the earlier of the two). The rule below is the whole
//! decision; every backend stores the pair its own way and the script mirrors it.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::mode::Mode;
use crate::time::{civil_from_days, days_from_civil, days_in_month};

/// The most units one period may count (below 2^53, so the script's doubles hold every count
/// and every sum of two exactly).
pub const MAX_CALENDAR_COUNT: u64 = 1 << 50;

const DAY_S: i64 = 86_400;

/// The length of a calendar quota's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Period {
    /// A day, renewing every day at the quota's time.
    Day,
    /// A week, renewing on its anchor day (Monday = 1 .. Sunday = 7; Monday by default).
    Week,
    /// A month, renewing on its anchor day (1 to 31; a month shorter than the anchor renews on
    /// its last day), or, without one, on the 1st: the calendar month.
    Month,
}

impl Period {
    /// The period's name in a configuration (`day`, `week`, `month`).
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }
}

impl std::str::FromStr for Period {
    type Err = CalendarError;

    /// `day`, `week` or `month`.
    fn from_str(text: &str) -> Result<Self, CalendarError> {
        match text {
            "day" => Ok(Period::Day),
            "week" => Ok(Period::Week),
            "month" => Ok(Period::Month),
            other => Err(CalendarError::Period(other.to_owned())),
        }
    }
}

/// Why a calendar quota was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CalendarError {
    /// A period that is not `day`, `week` or `month`.
    #[error("period must be day, week or month, got {0:?}")]
    Period(String),
    /// The count was zero or above [`MAX_CALENDAR_COUNT`].
    #[error("count must be between 1 and {MAX_CALENDAR_COUNT}, got {0}")]
    Count(u64),
    /// An anchor day outside its period (1-7 for a week, 1-31 for a month; none for a day).
    #[error("anchor_day {day} does not fit a {period} period ({allowed})")]
    AnchorDay {
        /// The day given.
        day: u64,
        /// The period's name.
        period: &'static str,
        /// What fits.
        allowed: &'static str,
    },
    /// A time of day that is not `HH:MM` (00:00 to 23:59).
    #[error("at must be a time of day as \"HH:MM\" (00:00 to 23:59), got {0:?}")]
    At(String),
    /// A zone that is neither a fixed offset (`+02:00`, `UTC`) nor a known IANA name.
    #[error("zone {0:?} is not a fixed offset such as \"+02:00\" or a known IANA time zone name")]
    Zone(String),
    /// An IANA zone name without the feature that knows them.
    #[error(
        "zone {0:?} is an IANA time zone name: enable the feature `time-zones` (or give a fixed offset such as \"+02:00\")"
    )]
    NeedsFeature(String),
}

/// The IANA time zone names of the tz database the feature `time-zones` bundles (jiff's), one a
/// line, sorted: without the feature a build still tells a zone it cannot read from a name
/// that is no zone at all. A test with the feature holds the list to the bundled database.
#[cfg(any(not(feature = "time-zones"), test))]
const IANA_NAMES: &str = include_str!("zone_names.txt");

/// Whether `name` is an IANA time zone name (case aside, as the database reads names).
#[cfg(not(feature = "time-zones"))]
fn is_iana_name(name: &str) -> bool {
    IANA_NAMES.lines().any(|n| n.eq_ignore_ascii_case(name))
}

/// Where a quota's periods are counted: a fixed offset from UTC, or an IANA time zone (with its
/// daylight-saving rules; feature `time-zones`).
#[derive(Clone)]
enum Zone {
    /// Seconds east of UTC.
    Fixed(i32),
    #[cfg(feature = "time-zones")]
    Named(String, jiff::tz::TimeZone),
}

impl Zone {
    /// Parses `UTC`, `Z`, `+HH:MM` / `-HH:MM`, or an IANA name.
    fn parse(text: &str) -> Result<Zone, CalendarError> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("utc") || t == "Z" {
            return Ok(Zone::Fixed(0));
        }
        if let Some(rest) = t.strip_prefix('+').or_else(|| t.strip_prefix('-')) {
            let sign = if t.starts_with('-') { -1 } else { 1 };
            let bad = || CalendarError::Zone(text.to_owned());
            let (h, m) = rest.split_once(':').ok_or_else(bad)?;
            let two = |s: &str| {
                (s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| s.parse::<i32>().ok())
                    .flatten()
            };
            let (h, m) = (two(h).ok_or_else(bad)?, two(m).ok_or_else(bad)?);
            if h > 18 || m > 59 {
                return Err(bad());
            }
            return Ok(Zone::Fixed(sign * (h * 3600 + m * 60)));
        }
        Self::named(t)
    }

    #[cfg(feature = "time-zones")]
    fn named(name: &str) -> Result<Zone, CalendarError> {
        jiff::tz::db()
            .get(name)
            .map(|tz| Zone::Named(name.to_owned(), tz))
            .map_err(|_| CalendarError::Zone(name.to_owned()))
    }

    #[cfg(not(feature = "time-zones"))]
    fn named(name: &str) -> Result<Zone, CalendarError> {
        // An IANA name: say which feature knows its rules. Any other name is no zone at all.
        if is_iana_name(name) {
            Err(CalendarError::NeedsFeature(name.to_owned()))
        } else {
            Err(CalendarError::Zone(name.to_owned()))
        }
    }

    /// The instant (Unix seconds) of a local wall-clock time (seconds since 1970-01-01 00:00
    /// local). A time a daylight-saving change skips is read with the offset before the change
    /// (02:30 on a spring-forward night is 03:30), a time it repeats as the first of the two.
    fn utc_of_local(&self, local_s: i64) -> i64 {
        match self {
            Zone::Fixed(off) => local_s - i64::from(*off),
            #[cfg(feature = "time-zones")]
            Zone::Named(_, tz) => {
                let Ok(civil) = jiff::Timestamp::from_second(local_s)
                    .map(|t| t.to_zoned(jiff::tz::TimeZone::UTC).datetime())
                else {
                    return local_s;
                };
                tz.to_ambiguous_timestamp(civil)
                    .compatible()
                    .map_or(local_s, |t| t.as_second())
            }
        }
    }

    /// The offset (seconds east of UTC) in force at an instant.
    fn offset_at(&self, utc_s: i64) -> i64 {
        // A fixed offset does not depend on the instant.
        let _ = utc_s;
        match self {
            Zone::Fixed(off) => i64::from(*off),
            #[cfg(feature = "time-zones")]
            Zone::Named(_, tz) => jiff::Timestamp::from_second(utc_s)
                .map_or(0, |t| i64::from(tz.to_offset(t).seconds())),
        }
    }

    fn name(&self) -> String {
        match self {
            Zone::Fixed(0) => "UTC".to_owned(),
            Zone::Fixed(off) => {
                let a = off.unsigned_abs();
                format!(
                    "{}{:02}:{:02}",
                    if *off < 0 { '-' } else { '+' },
                    a / 3600,
                    a % 3600 / 60
                )
            }
            #[cfg(feature = "time-zones")]
            Zone::Named(name, _) => name.clone(),
        }
    }
}

/// A count of units per calendar period, renewing exactly at the period's boundary: every day,
/// every week on a weekday or every month on a billing day, at a time of day, in a time zone
/// (`docs/calendar.md`).
///
/// ```
/// use tower_ratelimits::{CalendarQuota, Period};
///
/// // 100,000 a month, renewing on the 15th at midnight in UTC+2.
/// let quota = CalendarQuota::new(100_000, Period::Month)?.anchor_day(15)?.zone("+02:00")?;
/// // 2026-11-20 12:00 UTC is in the period from 2026-11-14 22:00 UTC to 2026-12-14 22:00 UTC.
/// let (start, end) = quota.period_at(1_795_176_000_000_000);
/// assert_eq!((start, end), (1_794_693_600_000_000, 1_797_285_600_000_000));
/// # Ok::<(), tower_ratelimits::CalendarError>(())
/// ```
pub struct CalendarQuota {
    count: u64,
    period: Period,
    anchor_day: Option<u8>,
    /// Minutes after midnight.
    at_min: u16,
    zone: Zone,
    /// The period last computed, in whole seconds (start in the high half, end in the low):
    /// most decisions fall in it and compute nothing. 0: none yet.
    cache: AtomicU64,
}

impl CalendarQuota {
    /// `count` units per `period`, renewing at midnight UTC (a month on the 1st, a week on
    /// Monday).
    pub fn new(count: u64, period: Period) -> Result<Self, CalendarError> {
        if count == 0 || count > MAX_CALENDAR_COUNT {
            return Err(CalendarError::Count(count));
        }
        Ok(Self {
            count,
            period,
            anchor_day: None,
            at_min: 0,
            zone: Zone::Fixed(0),
            cache: AtomicU64::new(0),
        })
    }

    /// The day the period renews on: a weekday for a week (Monday = 1 .. Sunday = 7), a day of
    /// the month for a month (1 to 31; a shorter month renews on its last day). Refused for a
    /// day.
    pub fn anchor_day(mut self, day: u64) -> Result<Self, CalendarError> {
        let (max, allowed) = match self.period {
            Period::Day => (0, "a day has no anchor_day"),
            Period::Week => (7, "1 to 7, Monday = 1"),
            Period::Month => (31, "1 to 31"),
        };
        if day == 0 || day > max {
            return Err(CalendarError::AnchorDay {
                day,
                period: self.period.as_str(),
                allowed,
            });
        }
        self.anchor_day = Some(day as u8);
        Ok(self.fresh())
    }

    /// The time of day the period renews at, `"HH:MM"` (default `"00:00"`).
    pub fn at(mut self, time: &str) -> Result<Self, CalendarError> {
        let bad = || CalendarError::At(time.to_owned());
        let (h, m) = time.split_once(':').ok_or_else(bad)?;
        let num = |s: &str, max: u16| {
            (s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u16>().ok())
                .flatten()
                .filter(|&v| v <= max)
        };
        let (h, m) = (num(h, 23).ok_or_else(bad)?, num(m, 59).ok_or_else(bad)?);
        self.at_min = h * 60 + m;
        Ok(self.fresh())
    }

    /// The time zone the period is counted in: a fixed offset (`"+02:00"`, `"-05:30"`,
    /// `"UTC"`) or, with the feature `time-zones`, an IANA name (`"Europe/Berlin"`, its
    /// daylight-saving changes included). Default UTC.
    pub fn zone(mut self, zone: &str) -> Result<Self, CalendarError> {
        self.zone = Zone::parse(zone)?;
        Ok(self.fresh())
    }

    fn fresh(self) -> Self {
        self.cache.store(0, Ordering::Relaxed);
        self
    }

    /// Units per period.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The period.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The anchor day, if one was given.
    pub fn anchor(&self) -> Option<u64> {
        self.anchor_day.map(u64::from)
    }

    /// The time of day it renews at, `"HH:MM"`.
    pub fn renews_at(&self) -> String {
        format!("{:02}:{:02}", self.at_min / 60, self.at_min % 60)
    }

    /// The time zone's name (`"UTC"`, `"+02:00"`, `"Europe/Berlin"`).
    pub fn zone_name(&self) -> String {
        self.zone.name()
    }

    /// The period holding `now_us` (Unix microseconds): its start and its end (the renewal),
    /// in Unix microseconds.
    pub fn period_at(&self, now_us: u64) -> (u64, u64) {
        let cached = self.cache.load(Ordering::Relaxed);
        let (start_s, end_s) = (cached >> 32, cached & 0xffff_ffff);
        if cached != 0 && start_s * 1_000_000 <= now_us && now_us < end_s * 1_000_000 {
            return (start_s * 1_000_000, end_s * 1_000_000);
        }
        let now_s = i64::try_from(now_us / 1_000_000).unwrap_or(i64::MAX / 4);
        let k = self.index_at(now_s);
        let (start, end) = (self.boundary(k), self.boundary(k + 1));
        if let (Ok(s), Ok(e)) = (u32::try_from(start), u32::try_from(end))
            && s > 0
        {
            self.cache
                .store(u64::from(s) << 32 | u64::from(e), Ordering::Relaxed);
        }
        let at = |s: i64| u64::try_from(s).unwrap_or(0).saturating_mul(1_000_000);
        (at(start), at(end))
    }

    /// The length of the period that ends at `end_us` (a renewal), in microseconds: what a
    /// decision in that period shows as its window (`w`). A pure function of the period, so
    /// every store and every instance answers the same for it.
    pub fn length_of_period_ending(&self, end_us: u64) -> u64 {
        let (start, end) = self.period_at(end_us.saturating_sub(1));
        end.saturating_sub(start)
    }

    /// How far ahead of now a stored period's end may lie and still be read as this crate's:
    /// the longest period of its kind (a day of a daylight-saving change, a week, a month of
    /// 31 days) with room to spare. A later end is a value the crate could not have written.
    pub fn horizon_us(&self) -> u64 {
        const H: u64 = 3_600_000_000;
        match self.period {
            Period::Day => 48 * H,
            Period::Week => 8 * 24 * H,
            Period::Month => 32 * 24 * H,
        }
    }

    /// The same quota with another count (a fallback's share).
    pub(crate) fn scaled(&self, count: u64) -> Result<Self, CalendarError> {
        let mut q = CalendarQuota::new(count, self.period)?;
        q.anchor_day = self.anchor_day;
        q.at_min = self.at_min;
        q.zone = self.zone.clone();
        Ok(q)
    }

    /// The number of the period holding `now_s`: the `k` with `boundary(k) <= now_s <
    /// boundary(k + 1)`, estimated on the local clock and corrected on the instant.
    fn index_at(&self, now_s: i64) -> i64 {
        let local = now_s + self.zone.offset_at(now_s);
        let at_s = i64::from(self.at_min) * 60;
        let mut k = match self.period {
            Period::Day => (local - at_s).div_euclid(DAY_S),
            Period::Week => (local - at_s - self.week_shift() * DAY_S).div_euclid(7 * DAY_S),
            Period::Month => {
                let (y, m, _) = civil_from_days(local.div_euclid(DAY_S));
                y * 12 + (m - 1)
            }
        };
        // At most a step or two either way (a month's boundary later in the month, an offset
        // change): bounded, whatever the zone.
        for _ in 0..4 {
            if self.boundary(k) > now_s {
                k -= 1;
            } else if self.boundary(k + 1) <= now_s {
                k += 1;
            } else {
                break;
            }
        }
        k
    }

    /// Days from a Thursday (1970-01-01) to the week's anchor weekday.
    fn week_shift(&self) -> i64 {
        (i64::from(self.anchor_day.unwrap_or(1)) - 4).rem_euclid(7)
    }

    /// The instant (Unix seconds) period `k` begins.
    fn boundary(&self, k: i64) -> i64 {
        let day = match self.period {
            Period::Day => k,
            Period::Week => 7 * k + self.week_shift(),
            Period::Month => {
                let (y, m) = (k.div_euclid(12), k.rem_euclid(12) + 1);
                let last = days_in_month(y, m);
                // Without an anchor, the calendar month: from the 1st to the next 1st.
                let d = i64::from(self.anchor_day.unwrap_or(1)).min(last);
                days_from_civil(y, m, d)
            }
        };
        self.zone
            .utc_of_local(day * DAY_S + i64::from(self.at_min) * 60)
    }
}

impl Clone for CalendarQuota {
    fn clone(&self) -> Self {
        Self {
            count: self.count,
            period: self.period,
            anchor_day: self.anchor_day,
            at_min: self.at_min,
            zone: self.zone.clone(),
            cache: AtomicU64::new(self.cache.load(Ordering::Relaxed)),
        }
    }
}

impl PartialEq for CalendarQuota {
    fn eq(&self, other: &Self) -> bool {
        (
            self.count,
            self.period,
            self.anchor_day,
            self.at_min,
            self.zone.name(),
        ) == (
            other.count,
            other.period,
            other.anchor_day,
            other.at_min,
            other.zone.name(),
        )
    }
}

impl Eq for CalendarQuota {}

impl Hash for CalendarQuota {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (
            self.count,
            self.period,
            self.anchor_day,
            self.at_min,
            self.zone.name(),
        )
            .hash(state);
    }
}

impl fmt::Debug for CalendarQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CalendarQuota")
            .field("count", &self.count)
            .field("period", &self.period)
            .field("anchor_day", &self.anchor_day)
            .field("at", &self.renews_at())
            .field("zone", &self.zone.name())
            .finish()
    }
}

impl fmt::Display for CalendarQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {}", self.count, self.period.as_str())?;
        if let Some(a) = self.anchor_day {
            write!(f, " from day {a}")?;
        }
        write!(f, " at {} {}", self.renews_at(), self.zone.name())
    }
}

/// A calendar key's stored state: the end of the period its units were counted in (Unix
/// microseconds) and the units used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CalendarState {
    /// The end of the period the units were counted in.
    pub end_us: u64,
    /// Units used in it.
    pub used: u64,
}

/// A calendar decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalendarOutcome {
    /// Whether it fits (a spend, a check) or something was refunded.
    pub allowed: bool,
    /// Units granted (a spend or a check; the whole cost of a charge).
    pub granted: u64,
    /// Units left this period after it.
    pub remaining: u64,
    /// Microseconds until an equal request fits (the renewal, on a denial; 0 when allowed).
    pub retry_after_us: u64,
    /// Microseconds until the renewal.
    pub reset_after_us: u64,
    /// What to store when it is written.
    pub write: Option<CalendarState>,
}

/// A period's length (microseconds, [`CalendarQuota::length_of_period_ending`]) in whole seconds,
/// as a decision reports it (`Outcome::period_s`): boundaries are whole seconds, and a period is
/// at most 32 days.
pub fn period_seconds(length_us: u64) -> u32 {
    u32::try_from(length_us.div_ceil(1_000_000)).unwrap_or(u32::MAX)
}

/// The units of `state` that count at `now` in the period in force (ending at `end_us`): those
/// of a state whose period has not ended (before both its own end and `end_us`), else none.
pub fn used(state: Option<CalendarState>, end_us: u64, now: u64) -> u64 {
    match state {
        Some(s) if now < s.end_us.min(end_us) => s.used,
        _ => 0,
    }
}

/// How a stored state reads at `now` in the period in force (ending at `end_us`): the units
/// that count ([`used`]) and what to write back in its place, whatever the decision:
///
/// - an end more than [`CalendarQuota::horizon_us`] ahead of now is a value the crate could
///   not have written (foreign): read as the period in force drained, and replaced by that;
/// - an end later than the period in force (counted under a plan that renews later, or by an
///   instance whose clock ran ahead) is cut to the end in force and written back at this first
///   read, so its units never count past a renewal of the quota in force.
pub fn read(
    quota: &CalendarQuota,
    state: Option<CalendarState>,
    end_us: u64,
    now: u64,
) -> (u64, Option<CalendarState>) {
    match state {
        Some(s) if s.end_us > now.saturating_add(quota.horizon_us()) => {
            (quota.count, Some(drained(quota, end_us)))
        }
        Some(s) if s.end_us > end_us => (
            s.used,
            Some(CalendarState {
                end_us,
                used: s.used,
            }),
        ),
        state => (used(state, end_us, now), None),
    }
}

/// Decides a transaction of `min..=max` units in `mode` on a key whose stored state is `state`
/// at `now`, under `quota`. `end_us` is the end of the period in force at `now`
/// ([`CalendarQuota::period_at`]). A spend or check grants the most units that fit, at least
/// `min`; a charge takes its whole cost (an overrun is denied the rest of the period and ends
/// with it).
pub fn decide(
    quota: &CalendarQuota,
    state: Option<CalendarState>,
    end_us: u64,
    now: u64,
    min: u64,
    max: u64,
    mode: Mode,
) -> CalendarOutcome {
    let used = read(quota, state, end_us, now).0;
    decide_used(quota, used, end_us, now, min, max, mode)
}

/// [`decide`] on the units that count in the period in force, as [`read`] gives them (the
/// Redis script's calendar path answers those, and the client decides from them).
pub fn decide_used(
    quota: &CalendarQuota,
    used: u64,
    end_us: u64,
    now: u64,
    min: u64,
    max: u64,
    mode: Mode,
) -> CalendarOutcome {
    let left = quota.count.saturating_sub(used);
    let reset = end_us.saturating_sub(now);
    let granted = if mode == Mode::Charge {
        max
    } else {
        max.min(left)
    };
    let allowed = mode == Mode::Charge || (granted >= min && left >= min);
    if !allowed {
        return CalendarOutcome {
            allowed,
            granted: 0,
            remaining: left,
            retry_after_us: reset,
            reset_after_us: reset,
            write: None,
        };
    }
    let now_used = used.saturating_add(granted);
    CalendarOutcome {
        allowed,
        granted,
        remaining: quota.count.saturating_sub(now_used),
        retry_after_us: 0,
        reset_after_us: reset,
        write: (mode.spends() && granted > 0).then_some(CalendarState {
            end_us,
            used: now_used,
        }),
    }
}

/// Gives back `cost` units of the period in force (never below none used): allowed when
/// something was given back.
pub fn refund(
    quota: &CalendarQuota,
    state: Option<CalendarState>,
    end_us: u64,
    now: u64,
    cost: u64,
) -> CalendarOutcome {
    let used = read(quota, state, end_us, now).0;
    let back = cost.min(used);
    let left = used - back;
    let reset = end_us.saturating_sub(now);
    CalendarOutcome {
        allowed: back > 0,
        granted: back,
        remaining: quota.count.saturating_sub(left),
        retry_after_us: 0,
        reset_after_us: reset,
        write: (back > 0).then_some(CalendarState { end_us, used: left }),
    }
}

/// What replaces a stored value the crate could not have written: the period in force drained.
pub fn drained(quota: &CalendarQuota, end_us: u64) -> CalendarState {
    CalendarState {
        end_us,
        used: quota.count,
    }
}

#[cfg(test)]
use crate::time::utc;

#[cfg(test)]
mod tests;
