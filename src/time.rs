//! Time: integer microseconds, a [`Clock`] trait, and duration parsing.
//!
//! Every time in this crate is an integer count of microseconds. Microseconds since the Unix
//! epoch (about 1.8e15 today) stay exact in the 53-bit mantissa of a Lua number, so the Redis
//! scripts compute the same integers as Rust does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of "now", in microseconds since the Unix epoch.
///
/// The default is [`SystemClock`]. Tests and the simulator use [`ManualClock`] so that time
/// only moves when they say so.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The wall clock, read cheaply: the system time is taken once, then advanced by a
/// monotonic, TSC-calibrated counter (`quanta`). Reading it costs a few nanoseconds instead of
/// a `clock_gettime` call, and it never jumps backwards when the system clock is stepped.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

fn wall_clock_us() -> u64 {
    // A clock set before 1970 reads as the epoch rather than panicking.
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(duration_us)
        .unwrap_or(0)
}

/// The wall time at start-up, the TSC reading taken with it, and the calibrated counter.
struct Anchor {
    wall_us: u64,
    raw: u64,
    counter: quanta::Clock,
}

static ANCHOR: std::sync::OnceLock<Anchor> = std::sync::OnceLock::new();

impl Clock for SystemClock {
    #[inline]
    fn now_us(&self) -> u64 {
        let anchor = ANCHOR.get_or_init(|| {
            let counter = quanta::Clock::new();
            Anchor {
                wall_us: wall_clock_us(),
                raw: counter.raw(),
                counter,
            }
        });
        // `delta_as_nanos` saturates at 0 if the counter reads below the anchor.
        let elapsed_ns = anchor
            .counter
            .delta_as_nanos(anchor.raw, anchor.counter.raw());
        anchor.wall_us.saturating_add(elapsed_ns / 1_000)
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use tower_ratelimits::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(clock.now_us(), 6_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `now_us` microseconds since the epoch.
    pub fn new(now_us: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(now_us)),
        }
    }

    /// Sets the time.
    pub fn set(&self, now_us: u64) {
        self.now.store(now_us, Ordering::SeqCst);
    }

    /// Moves the time forward (saturating at `u64::MAX`).
    pub fn advance(&self, by: Duration) {
        let by = duration_us(by);
        let _ = self
            .now
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(by))
            });
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }
}

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    /// The string was empty.
    #[error("empty duration")]
    Empty,
    /// A number had no unit, or a unit no number.
    #[error("malformed duration {0:?}: expected numbers with units, like 1s, 250ms, 1h30m")]
    Malformed(String),
    /// A unit that is not one of `us`, `ms`, `s`, `m`, `h`, `d`.
    #[error("unknown unit {unit:?} in duration {input:?}: use us, ms, s, m, h or d")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The unit that was not recognised.
        unit: String,
    },
    /// The value does not fit in 64-bit microseconds.
    #[error("duration {0:?} is too large")]
    Overflow(String),
    /// A unit given twice, or after a smaller one (`1s1s`, `30m1h`): almost always a typo.
    #[error(
        "duration {0:?}: each unit at most once, from the largest to the smallest (like 1h30m)"
    )]
    UnitOrder(String),
}

/// Parses a duration such as `1s`, `250ms`, `180m`, `1h30m`, `2d` or `500us` into microseconds.
///
/// Each part is a whole number followed by a unit; parts are added. Units: `us`, `ms`, `s`,
/// `m`, `h`, `d`, each at most once and from the largest to the smallest (`1h30m`, not
/// `30m1h` or `1s1s`). Signs, fractions and spaces are refused.
///
/// ```
/// use tower_ratelimits::__private::parse_duration_us;
/// assert_eq!(parse_duration_us("1h30m"), Ok(5_400_000_000));
/// assert_eq!(parse_duration_us("250ms"), Ok(250_000));
/// assert!(parse_duration_us("-1s").is_err());
/// assert!(parse_duration_us("1s1s").is_err());
/// ```
pub fn parse_duration_us(input: &str) -> Result<u64, DurationError> {
    if input.is_empty() {
        return Err(DurationError::Empty);
    }
    let malformed = || DurationError::Malformed(input.to_owned());
    let overflow = || DurationError::Overflow(input.to_owned());
    let bytes = input.as_bytes();
    let mut i = 0;
    let mut total: u64 = 0;
    let mut last_scale = u64::MAX;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return Err(malformed());
        }
        let number: u64 = input[start..i].parse().map_err(|_| overflow())?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit = &input[unit_start..i];
        let scale: u64 = match unit {
            "us" => 1,
            "ms" => 1_000,
            "s" => 1_000_000,
            "m" => 60_000_000,
            "h" => 3_600_000_000,
            "d" => 86_400_000_000,
            "" => return Err(malformed()),
            other => {
                return Err(DurationError::UnknownUnit {
                    input: input.to_owned(),
                    unit: other.to_owned(),
                });
            }
        };
        if scale >= last_scale {
            return Err(DurationError::UnitOrder(input.to_owned()));
        }
        last_scale = scale;
        let part = number.checked_mul(scale).ok_or_else(overflow)?;
        total = total.checked_add(part).ok_or_else(overflow)?;
    }
    Ok(total)
}

/// Converts microseconds to a [`Duration`].
pub(crate) fn us(us: u64) -> Duration {
    Duration::from_micros(us)
}

/// Converts a [`Duration`] to microseconds, saturating.
pub(crate) fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A duration in microseconds written as [`parse_duration_us`] reads it, largest units first
/// (`1h`, `1h30m`, `1s500ms`, `0s`).
pub(crate) fn format_duration_us(mut us: u64) -> String {
    if us == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    for (unit, size) in [
        ("d", 86_400_000_000),
        ("h", 3_600_000_000),
        ("m", 60_000_000),
        ("s", 1_000_000),
        ("ms", 1_000),
        ("us", 1),
    ] {
        if us >= size {
            out.push_str(itoa::Buffer::new().format(us / size));
            out.push_str(unit);
            us %= size;
        }
    }
    out
}

/// 64 random bits (a start for lease ids, a new store's epoch): the standard library's
/// per-process random hash keys, mixed with the time and the process id (no dependency for 8
/// random bytes).
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Seconds in a day.
const DAY_S: i64 = 86_400;

/// A UTC instant as text, to the microsecond when it has a fraction (`2028-02-29T00:00:00Z`,
/// `2028-02-28T23:59:59.999999Z`): the admin API's renewal time.
pub fn instant_text(us: u64) -> String {
    let s = (us / 1_000_000) as i64;
    let (y, m, d) = civil_from_days(s.div_euclid(DAY_S));
    let t = s.rem_euclid(DAY_S);
    let (h, min, sec) = (t / 3600, t / 60 % 60, t % 60);
    let mut text = format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{sec:02}");
    if !us.is_multiple_of(1_000_000) {
        text.push_str(&format!(".{:06}", us % 1_000_000));
    }
    text.push('Z');
    text
}

/// Why a text is not an instant [`parse_instant`] reads (each with the text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstantError {
    /// Not of the form `YYYY-MM-DDTHH:MM:SS[.ffffff]Z`.
    #[error("malformed instant {0:?}: write YYYY-MM-DDTHH:MM:SS[.ffffff]Z (UTC)")]
    Malformed(String),
    /// A date that does not exist, or one before 1970.
    #[error("{0:?}: no such date (1970 to 9999)")]
    NoSuchDate(String),
    /// An hour, minute or second out of its range.
    #[error("{0:?}: no such time of day")]
    NoSuchTime(String),
}

/// Reads a UTC instant written as [`instant_text`] writes it (`YYYY-MM-DDTHH:MM:SS`, an
/// optional fraction of 1 to 6 digits, then `Z`; 1970 to 9999) as Unix microseconds: the
/// simulator's dated trace lines.
pub fn parse_instant(text: &str) -> Result<u64, InstantError> {
    let bad = || InstantError::Malformed(text.to_owned());
    let body = text.strip_suffix('Z').ok_or_else(bad)?;
    let (whole, frac) = body.split_once('.').unwrap_or((body, ""));
    let b = whole.as_bytes();
    let shape = b.len() == 19
        && [4, 7].iter().all(|&i| b[i] == b'-')
        && b[10] == b'T'
        && [13, 16].iter().all(|&i| b[i] == b':');
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit());
    if !shape || (body.contains('.') && (!digits(frac) || frac.len() > 6)) {
        return Err(bad());
    }
    let field = |from: usize, to: usize| -> Result<i64, InstantError> {
        let t = &whole[from..to];
        if !digits(t) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    };
    let (y, m, d) = (field(0, 4)?, field(5, 7)?, field(8, 10)?);
    let (h, min, sec) = (field(11, 13)?, field(14, 16)?, field(17, 19)?);
    if y < 1970 || !(1..=12).contains(&m) || d < 1 || d > days_in_month(y, m) {
        return Err(InstantError::NoSuchDate(text.to_owned()));
    }
    if h > 23 || min > 59 || sec > 59 {
        return Err(InstantError::NoSuchTime(text.to_owned()));
    }
    let frac_us = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().map_err(|_| bad())? * 10u64.pow(6 - frac.len() as u32)
    };
    let s = days_from_civil(y, m, d) * DAY_S + h * 3600 + min * 60 + sec;
    Ok(s as u64 * 1_000_000 + frac_us)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
pub(crate) fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date of a day since 1970-01-01 (`civil_from_days`).
pub(crate) fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

pub(crate) fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Unix microseconds of a UTC date and time (for tests and docs).
/// Whole milliseconds of a duration, rounded up.
pub(crate) fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// A wait in whole milliseconds as a person reads it, the same wait every millisecond field
/// gives: `50 ms`, `2.5 s`, `3600 s`.
pub(crate) struct WaitText(pub(crate) u64);

impl std::fmt::Display for WaitText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0;
        if ms < 1000 {
            return write!(f, "{ms} ms");
        }
        let (s, frac) = (ms / 1000, ms % 1000);
        match frac {
            0 => write!(f, "{s} s"),
            _ if frac % 100 == 0 => write!(f, "{s}.{} s", frac / 100),
            _ if frac % 10 == 0 => write!(f, "{s}.{:02} s", frac / 10),
            _ => write!(f, "{s}.{frac:03} s"),
        }
    }
}

#[cfg(test)]
pub(crate) fn utc(y: i64, m: i64, d: i64, h: i64, min: i64) -> u64 {
    ((days_from_civil(y, m, d) * DAY_S + h * 3600 + min * 60) * 1_000_000) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait reads as the milliseconds every field gives, in the unit a person reads.
    #[test]
    fn a_wait_reads_as_its_milliseconds() {
        for (ms, text) in [
            (1, "1 ms"),
            (50, "50 ms"),
            (999, "999 ms"),
            (1000, "1 s"),
            (1001, "1.001 s"),
            (2500, "2.5 s"),
            (2550, "2.55 s"),
            (3_600_000, "3600 s"),
        ] {
            assert_eq!(WaitText(ms).to_string(), text);
        }
    }

    #[test]
    fn parses_units_and_combinations() {
        assert_eq!(parse_duration_us("1s"), Ok(1_000_000));
        assert_eq!(parse_duration_us("180m"), Ok(10_800_000_000));
        assert_eq!(parse_duration_us("1h30m"), Ok(5_400_000_000));
        assert_eq!(parse_duration_us("1d"), Ok(86_400_000_000));
        assert_eq!(parse_duration_us("1m30s250ms"), Ok(90_250_000));
        assert_eq!(parse_duration_us("0s"), Ok(0));
        assert_eq!(parse_duration_us("7us"), Ok(7));
    }

    #[test]
    fn formatted_durations_read_back() {
        for (us, text) in [
            (0, "0s"),
            (7, "7us"),
            (500_000, "500ms"),
            (1_000_000, "1s"),
            (1_500_000, "1s500ms"),
            (3_600_000_000, "1h"),
            (5_400_000_000, "1h30m"),
            (86_400_000_001, "1d1us"),
        ] {
            assert_eq!(format_duration_us(us), text);
            assert_eq!(parse_duration_us(text), Ok(us));
        }
    }

    #[test]
    fn refuses_bad_durations() {
        assert_eq!(parse_duration_us(""), Err(DurationError::Empty));
        for bad in ["s", "1", "1.5s", "-1s", "1 s", "1s ", "+1s", "ms1", "1sm"] {
            assert!(parse_duration_us(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            parse_duration_us("3w"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration_us("99999999999999999999d"),
            Err(DurationError::Overflow(_))
        ));
        assert!(matches!(
            parse_duration_us("300000000d"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn system_clock_follows_the_wall_clock() {
        let a = SystemClock.now_us();
        let wall = wall_clock_us();
        let b = SystemClock.now_us();
        assert!(b >= a);
        assert!(wall.abs_diff(b) < 1_000_000, "{wall} vs {b}");
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(10);
        let c2 = c.clone();
        assert_eq!(c.now_us(), 10);
        c2.advance(Duration::from_micros(5));
        assert_eq!(c.now_us(), 15);
        c.set(3);
        assert_eq!(c2.now_us(), 3);
        c.advance(Duration::MAX);
        assert_eq!(c.now_us(), u64::MAX);
    }

    #[test]
    fn instants_read_back_as_written_and_bad_ones_say_why() {
        for us in [
            0,
            1,
            999_999,
            utc(2028, 2, 29, 0, 0),
            utc(2028, 2, 29, 0, 0) - 1,
        ] {
            assert_eq!(
                parse_instant(&instant_text(us)),
                Ok(us),
                "{}",
                instant_text(us)
            );
        }
        assert_eq!(instant_text(utc(2028, 2, 29, 0, 0)), "2028-02-29T00:00:00Z");
        assert_eq!(
            instant_text(utc(2028, 2, 29, 0, 0) - 1),
            "2028-02-28T23:59:59.999999Z"
        );
        assert_eq!(
            parse_instant("2028-02-28T23:59:59.5Z"),
            Ok(utc(2028, 2, 28, 23, 59) + 59_500_000)
        );
        type Kind = fn(String) -> InstantError;
        for (bad, kind) in [
            ("2027-02-29T00:00:00Z", InstantError::NoSuchDate as Kind),
            ("2028-02-28T24:00:00Z", InstantError::NoSuchTime),
            ("2028-02-28T23:59:59", InstantError::Malformed),
            ("2028-02-28 23:59:59Z", InstantError::Malformed),
            ("2028-02-28T23:59:59.1234567Z", InstantError::Malformed),
            ("2028-02-28T23:59:59.Z", InstantError::Malformed),
            ("1969-12-31T23:59:59Z", InstantError::NoSuchDate),
            ("+028-02-28T23:59:59Z", InstantError::Malformed),
            ("2028-2-28T23:59:59Z", InstantError::Malformed),
        ] {
            assert_eq!(parse_instant(bad), Err(kind(bad.into())), "{bad}");
        }
    }

    #[test]
    fn civil_dates_round_trip_over_four_centuries() {
        for z in -200_000..200_000 {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
            assert!((1..=days_in_month(y, m)).contains(&d));
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(
            days_from_civil(2000, 3, 1) - days_from_civil(2000, 2, 28),
            2
        );
    }
}
