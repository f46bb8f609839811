//! Adaptive concurrency per key (`docs/adaptive-concurrency.md`): how a key's number of slots
//! moves between `min` and `max` from what its own requests showed in one window, as pure
//! integer functions, so that every store can run it on the samples all instances merged
//! there; and the limit shape ([`AdaptiveConcurrency`]) with a key's state
//! ([`AdaptiveState`]: its leases, its controller, the window being filled).
//!
//! Two algorithms, as Netflix's concurrency-limits names them:
//! - **gradient** (after Gradient2): the window's mean latency (`short`) against the key's
//!   unloaded latency (`long`): the limit is multiplied by `tolerance * long / short` (between
//!   1/2 and 1), plus a queue of `sqrt(limit)` slots, and smoothed; a window whose requests
//!   never filled half the limit leaves it as it is (the key was not limited by it, so its
//!   latency says nothing about it) and its latency becomes `long`, up or down; `long` is the
//!   least window's latency since. So that a key always busy learns it too, every
//!   [`PROBE_EVERY`]th window is a **probe**: the key runs at half its limit. A limit above
//!   the service's knee keeps the latency up in every window, so only a window run below it
//!   shows the unloaded latency
//!   (a best latency that drifted up instead read a slow service as a fast one, and the limit
//!   climbed without end); a limit about 1.5 times the knee probes at about the knee, where
//!   the service still runs at its full rate;
//! - **aimd**: a window with a failure multiplies the limit by `backoff`; one without that
//!   filled the limit adds `increase` slots.
//!
//! The limit is kept in thousandths of a slot, so that smoothing keeps what one window moves.

use std::fmt;
use std::time::Duration;

pub mod capacity;

use crate::algo::concurrency::ConcurrencyLimit;
use crate::completion::Measure;
use crate::time::duration_us;

/// The most slots an adaptive limit gives a key (a decision carries its number in two bytes).
pub const MAX_ADAPTIVE_SLOTS: u64 = 65_535;

/// A gradient limit's every `PROBE_EVERY`th window (by its start: `start / window`) is a
/// probe: run at half the limit, its latency taken as the unloaded one.
pub const PROBE_EVERY: u64 = 10;

/// How the limit moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Netflix's Gradient2: latency against the key's long-run latency.
    Gradient {
        /// How much of a window's new limit is taken, in thousandths (Netflix: 200).
        smoothing_pm: u64,
        /// How much slower than the long run a window may be before the limit falls, in
        /// thousandths (Netflix: 1,500: half as slow again).
        tolerance_pm: u64,
    },
    /// Additive increase, multiplicative decrease on failures.
    Aimd {
        /// What a window with a failure keeps of the limit, in thousandths (Netflix: 900).
        backoff_pm: u64,
        /// Slots a full window without a failure adds.
        increase: u64,
    },
}

impl Algorithm {
    /// Its name in the configuration (`algorithm: gradient`, `aimd`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Algorithm::Gradient { .. } => "gradient",
            Algorithm::Aimd { .. } => "aimd",
        }
    }
}

/// Why an adaptive limit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdaptiveError {
    /// `min`, `initial` and `max` out of order, `min` of 0, or `max` above
    /// [`MAX_ADAPTIVE_SLOTS`]: the message names the field that is wrong.
    #[error("{}", bounds_message(*min, *initial, *max))]
    Bounds {
        /// The least.
        min: u64,
        /// The start.
        initial: u64,
        /// The most.
        max: u64,
    },
    /// A parameter out of its range.
    #[error("{field} is out of range: it must be {allowed}")]
    Parameter {
        /// The field.
        field: &'static str,
        /// The values it takes (`1 to 4096`).
        allowed: String,
    },
    /// The slots' lease or retry hint refused.
    #[error(transparent)]
    Slots(#[from] crate::algo::concurrency::ConcurrencyError),
}

/// A concurrency limit that finds its number: `min` to `max` slots, starting at `initial`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Adaptive {
    min: u64,
    max: u64,
    initial: u64,
    algorithm: Algorithm,
}

/// The most a window's latencies sum to: 2^52 - 1 microseconds (143 years), the most a Redis
/// script keeps exactly (`adaptive.lua` caps it alike, so every store moves a key alike).
const MAX_LATENCY_SUM_US: u64 = (1 << 52) - 1;

fn capped_sum(a: u64, b: u64) -> u64 {
    a.saturating_add(b).min(MAX_LATENCY_SUM_US)
}

/// What one window of a key's completions showed, summed over every instance (windows
/// merge by adding: [`Window::merge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    /// Requests that completed.
    pub completions: u64,
    /// Of them, failures (a 5xx, a gRPC `UNAVAILABLE`, `RESOURCE_EXHAUSTED` or
    /// `DEADLINE_EXCEEDED`, a timeout).
    pub failures: u64,
    /// Their latencies, summed (microseconds), at most 2^52 - 1 (what every store keeps
    /// exactly).
    pub latency_sum_us: u64,
    /// The most requests in flight at once.
    pub max_in_flight: u64,
}

impl Window {
    /// Two instances' windows as one.
    pub fn merge(self, other: Window) -> Window {
        Window {
            completions: self.completions.saturating_add(other.completions),
            failures: self.failures.saturating_add(other.failures),
            latency_sum_us: capped_sum(self.latency_sum_us, other.latency_sum_us),
            max_in_flight: self.max_in_flight.saturating_add(other.max_in_flight),
        }
    }

    /// One completion added.
    pub fn record(&mut self, latency_us: u64, failed: bool, in_flight: u64) {
        self.completions = self.completions.saturating_add(1);
        self.failures = self.failures.saturating_add(u64::from(failed));
        self.latency_sum_us = capped_sum(self.latency_sum_us, latency_us);
        self.max_in_flight = self.max_in_flight.max(in_flight);
    }
}

/// A key's controller: its limit in thousandths of a slot, and its unloaded latency (0:
/// none yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Controller {
    /// The limit, in thousandths of a slot.
    pub limit_milli: u64,
    /// The unloaded latency: the last window's held at half the limit or below, or a lesser
    /// one since (microseconds; 0: no window yet).
    pub long_us: u64,
}

impl Adaptive {
    /// `min` to `max` slots, starting at `initial`, moved by `algorithm`.
    pub fn new(
        min: u64,
        initial: u64,
        max: u64,
        algorithm: Algorithm,
    ) -> Result<Self, AdaptiveError> {
        if min == 0 || min > initial || initial > max || max > MAX_ADAPTIVE_SLOTS {
            return Err(AdaptiveError::Bounds { min, initial, max });
        }
        match algorithm {
            Algorithm::Gradient {
                smoothing_pm,
                tolerance_pm,
            } => {
                if smoothing_pm == 0 || smoothing_pm > 1000 {
                    return Err(parameter("smoothing", "0.1% to 100%"));
                }
                if !(1000..=10_000).contains(&tolerance_pm) {
                    return Err(parameter("tolerance", "100% to 1000%"));
                }
            }
            Algorithm::Aimd {
                backoff_pm,
                increase,
            } => {
                if !(1..1000).contains(&backoff_pm) {
                    return Err(parameter("backoff", "0.1% to 99.9%"));
                }
                if increase == 0 || increase > max {
                    return Err(parameter("increase", format!("1 to max ({max})")));
                }
            }
        }
        Ok(Self {
            min,
            max,
            initial,
            algorithm,
        })
    }

    /// The gradient with Netflix's defaults (smoothing 0.2, tolerance 1.5).
    pub fn gradient(min: u64, initial: u64, max: u64) -> Result<Self, AdaptiveError> {
        Self::new(
            min,
            initial,
            max,
            Algorithm::Gradient {
                smoothing_pm: DEFAULT_SMOOTHING_PM,
                tolerance_pm: DEFAULT_TOLERANCE_PM,
            },
        )
    }

    /// AIMD with Netflix's defaults (backoff 0.9, one slot more a window).
    pub fn aimd(min: u64, initial: u64, max: u64) -> Result<Self, AdaptiveError> {
        Self::new(
            min,
            initial,
            max,
            Algorithm::Aimd {
                backoff_pm: DEFAULT_BACKOFF_PM,
                increase: DEFAULT_INCREASE,
            },
        )
    }

    /// A key's controller before any window (and after it was idle long enough).
    pub fn start(&self) -> Controller {
        Controller {
            limit_milli: self.initial * 1000,
            long_us: 0,
        }
    }

    /// The slots a controller gives now: its limit, whole, within `min..=max`.
    pub fn slots(&self, c: &Controller) -> u64 {
        (c.limit_milli / 1000).clamp(self.min, self.max)
    }

    /// Whether the window numbered `index` (its start over the window's length) is a probe:
    /// every [`PROBE_EVERY`]th, for the gradient.
    pub fn probes(&self, index: u64) -> bool {
        matches!(self.algorithm, Algorithm::Gradient { .. })
            && index % PROBE_EVERY == PROBE_EVERY - 1
    }

    /// The slots a controller gives in a window that is a probe (`probe`) or not: in a probe,
    /// half of them (at least `min`).
    pub fn slots_in(&self, c: &Controller, probe: bool) -> u64 {
        let slots = self.slots(c);
        if probe {
            (slots / 2).max(self.min)
        } else {
            slots
        }
    }

    /// The controller after a window of `w`. For the gradient, a window whose requests never
    /// passed half the limit (a [probe](Self::probes), or a key not limited by its number)
    /// leaves the limit as it is, and its latency is the unloaded latency from then on.
    pub fn update(&self, c: &Controller, w: &Window) -> Controller {
        if w.completions == 0 {
            return *c;
        }
        let (lo, hi) = (self.min * 1000, self.max * 1000);
        let limit = c.limit_milli.clamp(lo, hi);
        match self.algorithm {
            Algorithm::Aimd {
                backoff_pm,
                increase,
            } => {
                let next = if w.failures > 0 {
                    limit / 1000 * backoff_pm
                } else if w.max_in_flight >= limit / 1000 {
                    limit + increase * 1000
                } else {
                    limit
                };
                Controller {
                    limit_milli: next.clamp(lo, hi),
                    long_us: c.long_us,
                }
            }
            Algorithm::Gradient {
                smoothing_pm,
                tolerance_pm,
            } => {
                let short = (w.latency_sum_us / w.completions).max(1);
                // Never past half the limit (a probe, or a key its number did not limit): its
                // latency says nothing of the limit, and is the unloaded latency (a lasting
                // slowdown, or a service faster than before, is learnt here).
                if w.max_in_flight.saturating_mul(2000) <= limit {
                    return Controller {
                        limit_milli: limit,
                        long_us: short,
                    };
                }
                // Else the least latency seen since.
                let long = if c.long_us == 0 {
                    short
                } else {
                    short.min(c.long_us)
                };
                let gradient_pm = (u128::from(tolerance_pm) * u128::from(long) / u128::from(short))
                    .clamp(500, 1000) as u64;
                let queue_milli = (limit / 1000).isqrt().max(1) * 1000;
                // In thousandths of a slot throughout: a limit of 1.2 slots at a gradient of 1
                // targets 2.2, not 2 (whole slots kept a limit of 1 to 3 from ever moving).
                let target =
                    (u128::from(limit) * u128::from(gradient_pm) / 1000) as u64 + queue_milli;
                let next = (u128::from(limit) * u128::from(1000 - smoothing_pm)
                    + u128::from(target) * u128::from(smoothing_pm))
                    / 1000;
                Controller {
                    limit_milli: (next as u64).clamp(lo, hi),
                    long_us: long,
                }
            }
        }
    }
}

impl Adaptive {
    /// The least slots.
    pub fn min(&self) -> u64 {
        self.min
    }

    /// The most slots.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The slots before any window.
    pub fn initial(&self) -> u64 {
        self.initial
    }

    /// How the slots move.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
}

/// The defaults of an adaptive limit, used by its constructors and by every reader of its
/// fields (the YAML file, the admin API): the gradient's smoothing and tolerance and AIMD's
/// backoff, in thousandths (Netflix's 0.2, 1.5 and 0.9), AIMD's slots more a window, the
/// window and the idle time before a key starts again at `initial`.
pub(crate) const DEFAULT_SMOOTHING_PM: u64 = 200;
pub(crate) const DEFAULT_TOLERANCE_PM: u64 = 1500;
pub(crate) const DEFAULT_BACKOFF_PM: u64 = 900;
pub(crate) const DEFAULT_INCREASE: u64 = 1;
pub(crate) const DEFAULT_WINDOW_US: u64 = 1_000_000;
pub(crate) const DEFAULT_IDLE_RESET_US: u64 = 300_000_000;

/// The longest window, and the longest idle time before a key starts again.
const MAX_WINDOW_US: u64 = 3_600_000_000;

/// A concurrency limit per key whose number of slots moves between [`Adaptive`]'s `min` and
/// `max` from what the key's own requests show: each completion (its latency, whether it
/// failed) is recorded in the key's window in the store, merged there from every instance;
/// the window moves the number every `window` (default 1 s) or every `completions` completions
/// if set; a key idle for `idle_reset` (default 5 minutes) starts again at `initial`. Slots
/// are leases, as [`ConcurrencyLimit`]'s (`docs/adaptive-concurrency.md`).
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{Adaptive, AdaptiveConcurrency};
///
/// let limit = AdaptiveConcurrency::new(Adaptive::gradient(2, 10, 100).unwrap())
///     .window(Duration::from_millis(500))
///     .unwrap();
/// assert_eq!((limit.adaptive().initial(), limit.window_us()), (10, 500_000));
/// assert!(AdaptiveConcurrency::new(Adaptive::aimd(1, 5, 20).unwrap())
///     .window(Duration::ZERO)
///     .is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdaptiveConcurrency {
    adaptive: Adaptive,
    /// The lease and retry hint of its slots (its `max` the adaptive `max`).
    slots: ConcurrencyLimit,
    window_us: u64,
    window_completions: u64,
    idle_reset_us: u64,
    measure: Measure,
    /// The slots all keys share (0: none), by [`capacity`](self::capacity)'s rule.
    capacity: u64,
    /// Of them, the free slots lent only to keys holding none.
    headroom: u64,
}

impl AdaptiveConcurrency {
    /// Slots moved by `adaptive`, with the defaults: a lease of a minute, a `retry_after` hint
    /// of a second, a window of a second, back to `initial` after five idle minutes, latency to
    /// the response's head.
    pub fn new(adaptive: Adaptive) -> Self {
        let slots = ConcurrencyLimit::with_defaults(adaptive.max);
        Self {
            adaptive,
            slots,
            window_us: DEFAULT_WINDOW_US,
            window_completions: 0,
            idle_reset_us: DEFAULT_IDLE_RESET_US,
            measure: Measure::Head,
            capacity: 0,
            headroom: 0,
        }
    }

    /// A capacity of `slots` shared by all the limit's keys (1 to
    /// [`MAX_CAPACITY`](capacity::MAX_CAPACITY)): the slots they hold together never exceed
    /// it, and the keys active now share it equally (`docs/adaptive-concurrency.md`). The
    /// limit's state is then kept once per limit (one slot on a cluster).
    ///
    /// It keeps a headroom, lent only to keys that hold no slot (default a fifth of it, at
    /// least one: [`headroom`](Self::headroom)). A key's `min`, `initial` or `max` above the
    /// capacity is held to it, with a warning naming the field: no key may hold more.
    ///
    /// ```
    /// use tower_ratelimits::{Adaptive, AdaptiveConcurrency};
    ///
    /// let limit = AdaptiveConcurrency::new(Adaptive::gradient(1, 30, 100).unwrap())
    ///     .capacity(20)
    ///     .unwrap();
    /// assert_eq!((limit.adaptive().initial(), limit.adaptive().max()), (20, 20));
    /// assert_eq!(limit.shared_headroom(), Some(4));
    /// ```
    pub fn capacity(mut self, slots: u64) -> Result<Self, AdaptiveError> {
        if !(1..=capacity::MAX_CAPACITY).contains(&slots) {
            return Err(parameter(
                "capacity",
                format!("1 to {}", capacity::MAX_CAPACITY),
            ));
        }
        let a = &mut self.adaptive;
        for (field, value) in [
            ("min", &mut a.min),
            ("initial", &mut a.initial),
            ("max", &mut a.max),
        ] {
            if *value > slots {
                tracing::warn!(
                    field,
                    value = *value,
                    capacity = slots,
                    "an adaptive limit's {field} is above the capacity its keys share: held to it"
                );
                *value = slots;
            }
        }
        self.slots = self.slots.with_max(self.adaptive.max);
        self.capacity = slots;
        self.headroom = capacity::default_headroom(slots);
        Ok(self)
    }

    /// The free slots of the capacity lent only to keys that hold no slot (0 to the capacity;
    /// set after [`capacity`](Self::capacity), which sets the default, a fifth of it, at least
    /// one). A key that holds a slot takes another only while this many stay free after it, so
    /// while fewer keys than this hold slots, a key holding none is admitted at once however
    /// long the others' requests run; alone, a key holds at most `capacity - headroom`
    /// (`docs/adaptive-concurrency.md`, "A global capacity"). 0 lends every slot.
    pub fn headroom(mut self, slots: u64) -> Result<Self, AdaptiveError> {
        if self.capacity == 0 || slots > self.capacity {
            return Err(parameter(
                "headroom",
                match self.capacity {
                    0 => "given with a capacity only".to_owned(),
                    c => format!("0 to the capacity ({c})"),
                },
            ));
        }
        self.headroom = slots;
        Ok(self)
    }

    /// The capacity the keys share, if any.
    pub fn shared_capacity(&self) -> Option<u64> {
        (self.capacity > 0).then_some(self.capacity)
    }

    /// The headroom of the capacity the keys share, if any.
    pub fn shared_headroom(&self) -> Option<u64> {
        (self.capacity > 0).then_some(self.headroom)
    }

    /// The capacity with its headroom, as its rule reads them.
    pub(crate) fn shared(&self) -> Option<capacity::Capacity> {
        (self.capacity > 0).then_some(capacity::Capacity {
            slots: self.capacity,
            headroom: self.headroom,
        })
    }

    /// The window: how often the number moves (1 ms to 1 h).
    pub fn window(mut self, every: Duration) -> Result<Self, AdaptiveError> {
        self.window_us = bounded("window", duration_us(every))?;
        Ok(self)
    }

    /// Moves the number every `n` completions too (0: by time only).
    pub fn window_completions(mut self, n: u64) -> Result<Self, AdaptiveError> {
        if n > 1_000_000 {
            return Err(parameter("completions", "0 to 1000000"));
        }
        self.window_completions = n;
        Ok(self)
    }

    /// How long a key may be idle before it starts again at `initial` (1 ms to 1 h).
    pub fn idle_reset(mut self, after: Duration) -> Result<Self, AdaptiveError> {
        self.idle_reset_us = bounded("idle_reset", duration_us(after))?;
        Ok(self)
    }

    /// Where a request's latency ends.
    pub fn measure(mut self, measure: Measure) -> Self {
        self.measure = measure;
        self
    }

    /// How long a slot lives unless renewed (as [`ConcurrencyLimit::new`]'s lease).
    pub fn lease(mut self, lease: Duration) -> Result<Self, AdaptiveError> {
        let hint = Duration::from_micros(self.slots.retry_after_us());
        self.slots = ConcurrencyLimit::new(self.adaptive.max, lease)?.retry_after(hint)?;
        Ok(self)
    }

    /// The `retry_after` a denial reports.
    pub fn retry_after(mut self, hint: Duration) -> Result<Self, AdaptiveError> {
        self.slots = self.slots.retry_after(hint)?;
        Ok(self)
    }

    /// How the slots move.
    pub fn adaptive(&self) -> &Adaptive {
        &self.adaptive
    }

    /// The slots' lease and hint, with the most slots.
    pub fn slots(&self) -> &ConcurrencyLimit {
        &self.slots
    }

    /// The window, in microseconds.
    pub fn window_us(&self) -> u64 {
        self.window_us
    }

    /// Completions that end a window early (0: none).
    pub fn window_completions_count(&self) -> u64 {
        self.window_completions
    }

    /// The idle time after which a key starts again, in microseconds.
    pub fn idle_reset_us(&self) -> u64 {
        self.idle_reset_us
    }

    /// Where a request's latency ends.
    pub fn measured(&self) -> Measure {
        self.measure
    }

    /// The slots `state` gives at `now` (its controller; `initial` once idle), with its lease
    /// and hint: what a decision counts against.
    pub fn slots_at(&self, state: &AdaptiveState, now: u64) -> ConcurrencyLimit {
        let controller = self.controller_at(state, now);
        let probe = self
            .adaptive
            .probes(self.window_index(state.window_start_us));
        self.slots
            .with_max(self.adaptive.slots_in(&controller, probe))
    }

    /// The number of the window that starts at `start_us`: its start over the window's length
    /// (what [`Adaptive::probes`] reads).
    pub fn window_index(&self, start_us: u64) -> u64 {
        start_us / self.window_us
    }

    fn controller_at(&self, state: &AdaptiveState, now: u64) -> Controller {
        if self.idle(state, now) || state.controller.limit_milli == 0 {
            self.adaptive.start()
        } else {
            state.controller
        }
    }

    /// Whether `state` was idle long enough at `now` to start again: no request in flight,
    /// and none taken or ended for `idle_reset`.
    fn idle(&self, state: &AdaptiveState, now: u64) -> bool {
        now.saturating_sub(state.last_us) >= self.idle_reset_us
            && !state
                .leases
                .iter()
                .any(|&(_, deadline)| crate::algo::concurrency::holds(deadline, now))
    }

    /// `state` at `now` as a decision reads it: back at the start when it was idle.
    pub fn rolled(&self, state: &AdaptiveState, now: u64) -> AdaptiveState {
        // With room for the lease a spend takes (no second allocation to push it).
        let mut leases = Vec::with_capacity(state.leases.len() + 1);
        leases.extend_from_slice(&state.leases);
        if !self.idle(state, now) && state.controller.limit_milli != 0 {
            return AdaptiveState {
                leases,
                controller: state.controller,
                window: state.window,
                window_start_us: state.window_start_us,
                last_us: state.last_us,
            };
        }
        AdaptiveState {
            leases,
            controller: self.adaptive.start(),
            window: Window::default(),
            window_start_us: now,
            last_us: now,
        }
    }

    /// A request that held a slot ended at `now` after `latency_us` (`failed` as the layer's
    /// predicate said): recorded in `state`'s window, with the slots in flight when it ended
    /// (`in_flight`, its own included); a window that is over moves the number and starts
    /// again.
    pub fn complete(
        &self,
        state: &mut AdaptiveState,
        latency_us: u64,
        failed: bool,
        in_flight: u64,
        now: u64,
    ) {
        // A window starts with its first completion: time with none teaches nothing.
        if state.window.completions == 0 {
            state.window_start_us = now;
        }
        state.window.record(latency_us, failed, in_flight);
        state.last_us = state.last_us.max(now);
        let by_count =
            self.window_completions > 0 && state.window.completions >= self.window_completions;
        let by_time = now.saturating_sub(state.window_start_us) >= self.window_us;
        if by_count || by_time {
            state.controller = self.adaptive.update(&state.controller, &state.window);
            state.window = Window::default();
            state.window_start_us = now;
        }
    }
}

/// One key's state under an [`AdaptiveConcurrency`] limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdaptiveState {
    /// Its leases, `(lease id, deadline)`, as a concurrency key's.
    pub leases: Vec<(u64, u64)>,
    /// Its controller (`limit_milli` 0: none yet, `initial`).
    pub controller: Controller,
    /// The window being filled.
    pub window: Window,
    /// When that window started (microseconds).
    pub window_start_us: u64,
    /// The last time a request of the key took a slot or ended (microseconds).
    pub last_us: u64,
}

fn bounded(field: &'static str, us: u64) -> Result<u64, AdaptiveError> {
    if !(1_000..=MAX_WINDOW_US).contains(&us) {
        return Err(parameter(field, "1ms to 1h"));
    }
    Ok(us)
}

fn parameter(field: &'static str, allowed: impl Into<String>) -> AdaptiveError {
    AdaptiveError::Parameter {
        field,
        allowed: allowed.into(),
    }
}

/// What is wrong with `min`, `initial` and `max`, field first (the first rule they break).
fn bounds_message(min: u64, initial: u64, max: u64) -> String {
    let why = if min == 0 {
        "min is 0: it must be at least 1".to_owned()
    } else if max > MAX_ADAPTIVE_SLOTS {
        format!("max ({max}) is above {MAX_ADAPTIVE_SLOTS}, the most slots a key may have")
    } else if min > max {
        format!("min ({min}) is above max ({max})")
    } else if initial < min {
        format!("initial ({initial}) is below min ({min})")
    } else {
        format!("initial ({initial}) is above max ({max})")
    };
    format!("{why} (1 <= min <= initial <= max <= {MAX_ADAPTIVE_SLOTS})")
}

impl fmt::Display for AdaptiveConcurrency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (window {})",
            self.adaptive,
            crate::time::format_duration_us(self.window_us)
        )?;
        if let Some(c) = self.shared_capacity() {
            write!(f, ", {c} slots shared")?;
        }
        Ok(())
    }
}

impl fmt::Display for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.algorithm {
            Algorithm::Gradient { .. } => "gradient",
            Algorithm::Aimd { .. } => "aimd",
        };
        write!(
            f,
            "{}..{} slots from {} ({name})",
            self.min, self.max, self.initial
        )
    }
}

#[cfg(test)]
mod tests;
