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

#[cfg(test)]
mod tests {
    use super::*;

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
}
