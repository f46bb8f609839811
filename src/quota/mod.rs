//! What limits one bucket: a GCRA [`Limit`], burst tiers ([`TieredLimit`]), a concurrency
//! limit ([`ConcurrencyLimit`]), a calendar quota ([`CalendarQuota`]), a fair share
//! ([`FairShare`]) or an adaptive concurrency limit ([`AdaptiveConcurrency`]).
//!
//! The shape seam: everything outside the algorithms, the kit and the script asks a `Quota`
//! what its shape means (the policy's numbers, the effective window, its size, how it is shown
//! to an operator, what an unspent or later state reports, how it scales, whether it is settled,
//! waited for, holds leases, is charged back after an outage) through the methods here, and
//! never matches on its variants. What every shape answers is a method of [`Shape`], which no
//! shape answers by default; what only some shapes do is a field of [`Capabilities`], which
//! each shape states whole in one struct literal. Each shape answers in its own file beside
//! this one, and each method here dispatches with one exhaustive `match` (`each!`). A new
//! variant makes the compiler list every answer it owes, and a new capability every shape
//! that must say yes or no (`docs/design.md`, "A new limit shape: MUST update").

use std::fmt;
use std::sync::Arc;

use crate::algo::adaptive::AdaptiveConcurrency;
use crate::algo::calendar::CalendarQuota;
use crate::algo::concurrency::ConcurrencyLimit;
use crate::algo::fair_share::FairShare;
use crate::algo::gcra::Limit;
use crate::algo::tiers::{TierGrant, TieredLimit};
use crate::completion::Measure;

mod adaptive;
mod calendar;
mod capabilities;
mod concurrency;
#[cfg(any(feature = "yaml", feature = "admin"))]
pub(crate) mod entry;
#[cfg(any(feature = "yaml", feature = "admin"))]
use entry::{Entry, FieldError, Problem, Value, at};
mod fair_share;
mod gcra;
mod tiers;

/// `$e` for the shape `$quota` holds, bound to `$s` (one exhaustive `match`: a new variant is a
/// compile error here, and its `impl Shape` the list of what it must answer).
pub(crate) use capabilities::{Capabilities, Settles, Waits};

macro_rules! each {
    ($quota:expr, $s:ident => $e:expr) => {
        match $quota {
            Quota::Gcra(shape) => {
                let $s: &Limit = shape;
                $e
            }
            Quota::Tiered(shape) => {
                let $s: &TieredLimit = shape;
                $e
            }
            Quota::Concurrency(shape) => {
                let $s: &ConcurrencyLimit = shape;
                $e
            }
            Quota::Calendar(shape) => {
                let $s: &CalendarQuota = shape;
                $e
            }
            Quota::FairShare(shape) => {
                let $s: &FairShare = shape;
                $e
            }
            Quota::Adaptive(shape) => {
                let $s: &AdaptiveConcurrency = shape;
                $e
            }
        }
    };
}

/// What limits one bucket: a GCRA [`Limit`], a [`TieredLimit`] (burst tiers), a
/// [`ConcurrencyLimit`] (requests in flight) or a [`CalendarQuota`] (a count per calendar
/// period).
///
/// Anything that takes a quota takes any of them, through `Into<Quota>`:
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{Limit, Limits, Quota};
/// use tower_ratelimits::{Tier, TieredLimit};
///
/// let s = Duration::from_secs;
/// let tiers = TieredLimit::new([Tier::new(5, s(1), s(1), s(0)), Tier::new(50, s(5), s(5), s(15))])
///     .unwrap();
/// let limits = Limits::builder()
///     .limit("PerIp", Limit::new(20, 20, s(1)).unwrap())
///     .limit("PerAccount", tiers)
///     .build()
///     .unwrap();
/// let quota = limits.default_limit(limits.name("PerAccount").unwrap()).unwrap();
/// assert!(matches!(quota, Quota::Tiered(_)));
/// assert_eq!(quota.max_cost(), 55);
/// ```
///
/// Adding a shape, every place it MUST be added (the compiler lists the sites marked *; the
/// rest are named here and in `docs/design.md`, "A new limit shape: MUST update", which names
/// the same files: `tests/design.rs` compares the two lists):
/// - its algorithm in `src/algo/<shape>.rs`, with its unit and property tests (and its line in
///   `src/algo/mod.rs`);
/// - a variant here* (`src/quota/mod.rs`, with its `ShapeError` variant), its `impl Shape` in
///   `src/quota/<shape>.rs`* (every answer it owes: no method has a default; a replay's
///   suggestion sizes it by its `sized_as`), its stored form's reader
///   in `Quota::read_json`'s list (or the denied dead-code warning names it), its `From` and
///   its `pub use` in `src/lib.rs`;
/// - the kit: its `Stored` and `Read` variants and arms* (`src/backend/kit/mod.rs`), its own
///   `src/backend/kit/<shape>.rs` (with its snapshot line's form, the variant's serde `with`);
/// - the script: its codes and arguments, and its Lua file joined in `SCRIPT`
///   (`src/backend/redis/script.rs`), that file (`src/backend/redis/<shape>.lua`: its records
///   parsed, read, decided and written, its handler registered under its kinds; the general
///   path names no shape), its key suffix and how a snapshot reads it back
///   (`src/backend/redis/keys.rs`, with its decoder in its own script file);
/// - its configuration: its fields in the one table and its place in the entry's dispatch
///   (`src/quota/entry.rs`), its reader (`read_entry` in its own file); its error is its
///   `ShapeError` variant here, which a configuration error carries as is
///   (`ConfigErrorKind::Shape`);
/// - outside `src/`: its spec in `docs/`, a conformance trace, the simulator's drawing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Quota {
    /// A GCRA bucket.
    Gcra(Limit),
    /// Burst tiers (`docs/burst-tiers.md`).
    Tiered(Arc<TieredLimit>),
    /// Requests in flight per key (`docs/concurrency.md`).
    Concurrency(ConcurrencyLimit),
    /// A count per calendar period, renewing at the period's boundary (`docs/calendar.md`).
    Calendar(Arc<CalendarQuota>),
    /// One GCRA budget shared by weight among the ids active now (`docs/fair-share.md`).
    FairShare(Arc<FairShare>),
    /// Requests in flight per key, their number moved by the key's latency and failures
    /// (`docs/adaptive-concurrency.md`).
    Adaptive(Arc<AdaptiveConcurrency>),
}

impl Quota {
    /// The GCRA limit, if this is one.
    pub fn as_gcra(&self) -> Option<&Limit> {
        match self {
            Quota::Gcra(l) => Some(l),
            _ => None,
        }
    }

    /// The tiers, if this is a tiered limit.
    pub fn as_tiered(&self) -> Option<&TieredLimit> {
        match self {
            Quota::Tiered(t) => Some(t),
            _ => None,
        }
    }

    /// The concurrency limit, if this is one.
    pub fn as_concurrency(&self) -> Option<&ConcurrencyLimit> {
        match self {
            Quota::Concurrency(c) => Some(c),
            _ => None,
        }
    }

    /// The calendar quota, if this is one.
    pub fn as_calendar(&self) -> Option<&CalendarQuota> {
        match self {
            Quota::Calendar(c) => Some(c),
            _ => None,
        }
    }

    /// Its shape, borrowed, as an exhaustive enum (`ShapeRef`) for the crate's own tools.
    #[doc(hidden)]
    pub fn shape_ref(&self) -> ShapeRef<'_> {
        match self {
            Quota::Gcra(s) => ShapeRef::Gcra(s),
            Quota::Tiered(s) => ShapeRef::Tiered(s),
            Quota::Concurrency(s) => ShapeRef::Concurrency(s),
            Quota::Calendar(s) => ShapeRef::Calendar(s),
            Quota::FairShare(s) => ShapeRef::FairShare(s),
            Quota::Adaptive(s) => ShapeRef::Adaptive(s),
        }
    }

    /// The fair share, if this is one.
    pub fn as_fair_share(&self) -> Option<&FairShare> {
        match self {
            Quota::FairShare(s) => Some(s),
            _ => None,
        }
    }

    /// Whether a backend keeps one state for the whole limit (all its ids read it: a fair
    /// share's budget and active weights) at the limit's key
    /// ([`kit::state_key`](crate::kit::state_key)), rather than one per id.
    pub fn state_per_limit(&self) -> bool {
        each!(self, s => s.capabilities().state_per_limit)
    }

    /// Whether `other` may replace this default for an id (a file or stored override): `Err`
    /// names what it must keep (a fair share's budget, shared by all ids).
    pub(crate) fn keeps_on_override(&self, other: &Quota) -> Result<(), &'static str> {
        each!(self, s => s.capabilities().keeps_on_override.map_or(Ok(()), |keeps| keeps(s, other)))
    }

    /// The largest cost a request can ever be granted: the burst, the sum of the tiers'
    /// limits, 1 for a concurrency limit (a request holds one slot), a period's count.
    pub fn max_cost(&self) -> u64 {
        each!(self, s => Shape::max_cost(s))
    }

    /// Whether a charge (units reported after the response) of any size is taken: a GCRA
    /// limit takes what fits within its debt, a calendar quota the whole cost (the overrun
    /// ends with the period). Elsewhere a charge above [`max_cost`](Self::max_cost) is
    /// refused.
    pub(crate) fn charges_any_cost(&self) -> bool {
        each!(self, s => s.capabilities().settles == Settles::AnyCost)
    }

    /// The most a settle may charge a spend of this limit after the response: any number
    /// (`u64::MAX`) where [`charges_any_cost`](Self::charges_any_cost), else
    /// [`max_cost`](Self::max_cost); `None`: a spend of it is never settled (a slot in flight
    /// is given back when the request ends).
    pub(crate) fn settle_bound(&self) -> Option<u64> {
        each!(self, s => match s.capabilities().settles {
            Settles::Never => None,
            Settles::UpToMaxCost => Some(s.max_cost()),
            Settles::AnyCost => Some(u64::MAX),
        })
    }

    /// Whether a denial of it may be waited for: a slot frees when a request ends, which no
    /// wait can know.
    pub(crate) fn waits(&self) -> bool {
        each!(self, s => !matches!(s.capabilities().waits, Waits::Never))
    }

    /// From a denial's `retry_after` and `reset_after` (microseconds), how long the units of
    /// one request take to come back, for the line of waiters; 0 when the shape does not say.
    pub(crate) fn units_return_us(&self, retry_after_us: u64, reset_after_us: u64) -> u64 {
        each!(self, s => match s.capabilities().waits {
            Waits::Timed(units_return) => units_return(s, retry_after_us, reset_after_us),
            Waits::Never | Waits::Untimed => 0,
        })
    }

    /// Whether an allowed spend of it holds a lease (a slot in flight until released).
    pub(crate) fn holds_leases(&self) -> bool {
        self.lease_us().is_some()
    }

    /// How long a slot of it lives unless renewed (microseconds), if an allowed spend of it
    /// holds one.
    pub(crate) fn lease_us(&self) -> Option<u64> {
        each!(self, s => s.capabilities().lease_us)
    }

    /// Whether it learns from each request that held one of its slots, and where that
    /// request's latency ends (`None`: it does not; a release need not say how it went). The
    /// layer then gives back the request's leases with its [`Completion`](crate::Completion).
    pub(crate) fn learns(&self) -> Option<Measure> {
        each!(self, s => s.capabilities().learns)
    }

    /// A learning shape's slots when a decision was made, from its number
    /// ([`Own::number`]: a shape that learns shows its number of slots there); `None` for a
    /// shape that does not learn, or a decision without one (skipped).
    pub(crate) fn slots_learned(&self, number: u32) -> Option<u64> {
        self.learns().and((number > 0).then_some(u64::from(number)))
    }

    /// Whether a backend that prefetches takes tokens of it ahead for hot keys
    /// ([`Limit::with_prefetch`]).
    pub(crate) fn prefetches(&self) -> bool {
        each!(self, s => s.capabilities().prefetches)
    }

    /// Whether this limit can be one limit across regions (`docs/regions.md`): `Err` names what
    /// in it cannot (prefetched tokens, or a shape other than GCRA), for the error.
    pub(crate) fn across_regions(&self) -> Result<(), &'static str> {
        each!(self, s => s.capabilities().across_regions)
    }

    /// Whether what a spend of it changed is undone by writing back its stored value from
    /// before (burst tiers, whose tiers entered no refund can take back), not by a refund:
    /// a cross-slot batch's compensation on a Redis cluster.
    #[cfg(feature = "redis")]
    pub(crate) fn undone_by_value(&self) -> bool {
        each!(self, s => s.capabilities().undone_by_value)
    }

    /// The `RateLimit-Policy` member's `q` and `w` (seconds) when they do not depend on the
    /// decision (GCRA: the burst and the burst offset rounded up), so a layer writes them once.
    pub(crate) fn fixed_policy(&self) -> Option<(u64, u64)> {
        each!(self, s => Shape::fixed_policy(s))
    }

    /// What a decision (`n`) shows of this limit: the policy's `q` and `w` and the effective
    /// window (each shape says how). `window`: whether `w` is wanted (a member whose policy is
    /// precomputed needs none). `None`: nothing to show (a tiered limit without tiers).
    pub(crate) fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        each!(self, s => Shape::shown(s, n, window))
    }

    /// The size `remaining` is measured against (for the near-limit counter, and a replay's
    /// headroom).
    #[cfg(any(feature = "metrics", feature = "replay"))]
    pub(crate) fn size(&self, n: &Numbers<'_>) -> u64 {
        each!(self, s => Shape::size(s, n))
    }

    /// What a replay's suggestion sizes the limit by (`replay/suggest.rs`).
    #[cfg(feature = "replay")]
    pub(crate) fn sized_as(&self) -> SizedAs<'_> {
        each!(self, s => Shape::sized_as(s))
    }

    /// The limit as the admin API shows it, field by field.
    #[cfg(feature = "admin")]
    pub(crate) fn describe(&self) -> Vec<(&'static str, Described)> {
        each!(self, s => Shape::describe(s))
    }

    /// What an allowed transaction of a denied batch reports instead (nothing was spent):
    /// `remaining` and `reset_after` (microseconds) with the `granted` units back. `None`: keep
    /// what the backend said (a tiered state, whose later state is not known).
    pub(crate) fn unspent(
        &self,
        remaining: u64,
        reset_after_us: u64,
        granted: u64,
    ) -> Option<(u64, u64)> {
        each!(self, s => Shape::unspent(s, remaining, reset_after_us, granted))
    }

    /// What a key's state adds to [`describe`](Self::describe) for an operator, with
    /// `remaining` units left at `now_us` (Unix microseconds, the caller's clock).
    #[cfg(feature = "admin")]
    pub(crate) fn describe_seen(
        &self,
        remaining: u64,
        now_us: u64,
    ) -> Vec<(&'static str, Described)> {
        each!(self, s => Shape::describe_seen(s, remaining, now_us))
    }

    /// The wait before a request of `granted` units fits again, from a bucket's later state
    /// (`reset_after_us`, after a settle); `None`: the state's own `retry_after` says it.
    pub(crate) fn retry_after_again(&self, reset_after_us: u64, granted: u64) -> Option<u64> {
        each!(self, s => s.capabilities().retry_after_again.map(|again| again(s, reset_after_us, granted)))
    }

    /// What the in-memory fallback grants of this quota weighs once the store answers again
    /// (`layer/charge.rs`); `None`: it is not carried back.
    pub(crate) fn charge_back(&self) -> Option<ChargeBack> {
        each!(self, s => s.capabilities().charge_back)
    }

    /// What the shape is called in an error ("a GCRA limit", "burst tiers").
    pub(crate) fn shape_name(&self) -> &'static str {
        each!(self, s => Shape::shape_name(s))
    }

    /// Its fields as JSON in `form`, added to `v` (an object): what the store keeps of a
    /// stored override, what the admin API shows and takes.
    pub(crate) fn write_json(&self, form: Form, v: &mut serde_json::Value) {
        each!(self, s => Shape::write_json(s, form, v))
    }

    /// The limit `fields` (a JSON object) write in the stored form ([`Form::Stored`]: the
    /// admin API's body, the file's form, is read as an entry, `entry::read_api`), or why they
    /// write none: each shape reads the fields that name it (`burst`/`count`/`period`, `tiers`, `concurrency`,
    /// `calendar`) and refuses any other field beside them.
    pub(crate) fn read_json(fields: &serde_json::Value) -> Result<Quota, StoredFormError> {
        // Each shape's reader (a new shape adds its own: the MUST list).
        let readers: [Reader; 6] = [
            // Before the concurrency limit's: it is `concurrency: {adaptive: ...}`.
            adaptive::read_json,
            // Before GCRA's: a fair share's budget has a GCRA limit's fields.
            fair_share::read_json,
            gcra::read_json,
            tiers::read_json,
            concurrency::read_json,
            calendar::read_json,
        ];
        readers
            .iter()
            .find_map(|read| read(fields))
            .unwrap_or(Err(StoredFormError::NoLimit))
    }

    /// The same limit at `percent` (1 to 100) of its size, for an in-memory fallback per
    /// instance. Nothing scales below 1 or below `cost`, a request's configured cost.
    pub(crate) fn scaled(&self, percent: u8, cost: u64) -> Result<Quota, ShapeError> {
        let p = u64::from(percent.clamp(1, 100));
        each!(self, s => Shape::scaled(s, &Scale { percent: p, cost }))
    }
}

/// A [`Quota`]'s shape, borrowed, as an exhaustive enum for the crate's own tools outside it
/// (the simulator's drawings, through `__private`): `Quota` is `#[non_exhaustive]` there, so a
/// match on it needs a catch-all that would draw a new shape as "another shape" without a
/// word; a match on this one has none, and a new shape does not build until each site says
/// how it is drawn. Not part of the public API.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum ShapeRef<'a> {
    Gcra(&'a Limit),
    Tiered(&'a TieredLimit),
    Concurrency(&'a ConcurrencyLimit),
    Calendar(&'a CalendarQuota),
    FairShare(&'a FairShare),
    Adaptive(&'a AdaptiveConcurrency),
}

/// What every limit shape answers, each in its own file beside this one: no method has a
/// default, so a new shape's `impl Shape` is the compiler's list of what it must say.
/// [`Quota`]'s methods say what each question means; what only some shapes do is a
/// [`Capabilities`] field instead.
trait Shape: Sized {
    /// What it opts into: one struct literal in the shape's file, every field written.
    fn capabilities(&self) -> Capabilities<Self>;
    fn max_cost(&self) -> u64;
    fn fixed_policy(&self) -> Option<(u64, u64)>;
    fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown>;
    #[cfg(any(feature = "metrics", feature = "replay"))]
    fn size(&self, n: &Numbers<'_>) -> u64;
    #[cfg(feature = "replay")]
    fn sized_as(&self) -> SizedAs<'_>;
    #[cfg(feature = "admin")]
    fn describe(&self) -> Vec<(&'static str, Described)>;
    fn unspent(&self, remaining: u64, reset_after_us: u64, granted: u64) -> Option<(u64, u64)>;
    #[cfg(feature = "admin")]
    fn describe_seen(&self, remaining: u64, now_us: u64) -> Vec<(&'static str, Described)>;
    fn scaled(&self, scale: &Scale) -> Result<Quota, ShapeError>;
    fn write_json(&self, form: Form, v: &mut serde_json::Value);
    fn shape_name(&self) -> &'static str;
}

/// What a replay's suggestion sizes a limit by (`replay/suggest.rs`, feature `replay`): the
/// kinds of model it knows, each shape naming the one its numbers are ([`Quota::sized_as`]),
/// so a new shape sized like one of them touches no file of the replay.
#[cfg(feature = "replay")]
pub(crate) enum SizedAs<'a> {
    /// A rate and a burst (a GCRA limit): the burst each key needed, the counts refused.
    Rate(&'a Limit),
    /// A count per calendar period: the most units any key asked in one period.
    Period(&'a CalendarQuota),
    /// Slots, each held for a request's duration: the most in flight at once.
    Slots {
        /// The limit's slots (an adaptive limit's most).
        max: u64,
        /// Whether the number moves (an adaptive limit).
        adaptive: bool,
    },
    /// Burst tiers: the most units in any tier's window.
    Tiers(&'a TieredLimit),
    /// One budget (a GCRA limit) shared by every id: the whole stream's rate and burst.
    Budget(&'a Limit),
}

/// How a limit is written as JSON ([`Quota::write_json`], [`Quota::read_json`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// As a stored override keeps it: durations in whole microseconds (`period_us`). A
    /// promise across versions: what an older instance wrote, a newer one reads, and back.
    Stored,
    /// As the admin API shows and takes it: the YAML file's fields, durations as YAML writes
    /// them (`"1h"`).
    #[cfg_attr(not(feature = "admin"), allow(dead_code))]
    Api,
}

/// A shape's reader of its JSON fields: `None` when no field names the shape.
type Reader = fn(&serde_json::Value) -> Option<Result<Quota, StoredFormError>>;

/// Why a limit's fields in the stored form make no limit: written by another version, or not
/// ours; the stored override is left out (`overrides.rs`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoredFormError {
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A name the shape does not know (an adaptive limit's algorithm or measure).
    #[error("{field} {found:?} is not one of {known}")]
    Unknown {
        field: &'static str,
        found: String,
        known: &'static str,
    },
    /// A fair share without its budget's fields.
    #[error("fair_share: write its budget (burst, count, period)")]
    NoBudget,
    #[error("no limit: write a limit's fields")]
    NoLimit,
}

/// A shape's own error, in the stored form's.
fn stored_shape(e: impl Into<ShapeError>) -> StoredFormError {
    StoredFormError::Shape(e.into())
}

/// A limit read back in `form` (the tests' round trips): the stored form's reader, or, for the
/// admin API's (the file's form), the entry's.
#[cfg(all(test, any(feature = "yaml", feature = "admin")))]
pub(crate) fn read_in(form: Form, fields: &serde_json::Value) -> Result<Quota, String> {
    match form {
        Form::Stored => Quota::read_json(fields).map_err(|e| e.to_string()),
        Form::Api => entry::read_api(fields).map_err(|e| format!("{e:?}")),
    }
}

/// `fields` read as `T` (its own fields only), or the reader's error.
fn json_fields<'a, T: serde::Deserialize<'a>>(
    fields: &'a serde_json::Value,
) -> Result<T, StoredFormError> {
    Ok(T::deserialize(fields)?)
}

/// Whether any of `names` is a field of `fields`.
fn names_any(fields: &serde_json::Value, names: &[&str]) -> bool {
    names.iter().any(|n| fields.get(n).is_some())
}

/// A fallback's share of a limit ([`Quota::scaled`]).
struct Scale {
    /// 1 to 100.
    percent: u64,
    /// A request's configured cost: nothing scales below it.
    cost: u64,
}

impl Scale {
    /// `v` at the share, never below `floor` nor 1.
    fn of(&self, v: u64, floor: u64) -> u64 {
        (v.saturating_mul(self.percent) / 100).max(floor).max(1)
    }
}

/// A decision's numbers as a shape reads them ([`Quota::shown`]).
#[derive(Clone, Copy)]
pub(crate) struct Numbers<'a> {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) retry_after_us: u64,
    pub(crate) reset_after_us: u64,
    /// Its numbers of its limit's own shape.
    pub(crate) own: Own<'a>,
}

/// What a decision holds of its limit's own shape, in one slot that every decision type
/// carries as it is and only the shape's answers read: a tiered limit's grant per tier (which
/// travels beside its outcome, `Outcomes::tier_grant`), and the shape's number
/// (`Outcome::shape_number`: a calendar quota's period in whole seconds, a learning shape's
/// slots; 0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Own<'a> {
    pub(crate) tiers: Option<&'a TierGrant>,
    pub(crate) number: u32,
}

/// What a decision shows of its limit in the `RateLimit` fields: the policy's `q` and `w`
/// (seconds; 0 when the member's policy is precomputed or has no window) and the effective
/// window `t` (microseconds, draft-11: the time within which no more than `r` units can be
/// used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shown {
    pub(crate) q: u64,
    pub(crate) w: u64,
    pub(crate) t_us: u64,
    /// A concurrency limit's member (`qu="concurrent-requests"`, no window).
    pub(crate) concurrency: bool,
}

/// One value of a limit as an operator sees it ([`Quota::describe`]).
#[cfg(feature = "admin")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Described {
    Number(u64),
    Text(String),
}

/// A GCRA limit whose period is at least this long (an hour) has what the fallback grants
/// charged back to the store.
const CHARGED_BACK_FROM_US: u64 = 3_600_000_000;

/// How a quota's units weigh after they were granted (for the fallback's charge-back): its
/// size, and every how many microseconds time repays one unit (0: never, until the period
/// ends, a calendar quota).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChargeBack {
    /// The units of a full bucket: a GCRA burst, a calendar count.
    pub(crate) count: u64,
    /// A GCRA limit's emission interval; 0 for a calendar quota.
    pub(crate) repaid_every_us: u64,
}

/// A limit's fields that do not make a limit of its shape: the shape's own error, the one
/// error kind for a shape's fields, which a configuration error carries
/// ([`ConfigErrorKind::Shape`](crate::config::ConfigErrorKind::Shape)) and a fallback's scaled
/// limit returns. A new shape adds its variant here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// A GCRA limit (`burst`, `count`, `period`, `debt`) that does not validate.
    #[error("invalid limit: {0}")]
    Limit(#[from] crate::algo::gcra::LimitError),
    /// Tiers that do not validate (the error names the tier and the field).
    #[error("invalid tiers: {0}")]
    Tiers(#[from] crate::algo::tiers::TierError),
    /// A concurrency limit that does not validate.
    #[error("invalid concurrency limit: {0}")]
    Concurrency(#[from] crate::algo::concurrency::ConcurrencyError),
    /// A calendar quota that does not validate (`docs/calendar.md`).
    #[error("invalid calendar quota: {0}")]
    Calendar(#[from] crate::algo::calendar::CalendarError),
    /// An invalid fair share (`fair_share:`): a weight, a minimum or a refresh period.
    #[error("invalid fair share: {0}")]
    FairShare(#[from] crate::algo::fair_share::FairShareError),
    /// An invalid adaptive concurrency limit (`concurrency: {adaptive: ...}`): its bounds or a
    /// parameter.
    #[error("invalid adaptive concurrency: {0}")]
    Adaptive(#[from] crate::algo::adaptive::AdaptiveError),
}

#[cfg(any(feature = "yaml", feature = "admin"))]
impl Quota {
    /// The limit the entry's fields make, each shape reading its own (`read_entry` in its
    /// file): a GCRA limit (`burst`, `count`, `period`), burst tiers (`tiers`), a concurrency
    /// limit (`concurrency`, with `lease` and `retry_after`; a map, an adaptive one), a calendar
    /// quota (`calendar`) or a fair share (`fair_share` beside a GCRA budget). Fields of two
    /// shapes are refused on the later one's line.
    pub(crate) fn of_entry(e: &Entry<'_>) -> Result<Quota, FieldError> {
        shapes_apart(e)?;
        if let Some(max) = e.concurrency {
            if let Value::Map(entries) = &max.value {
                return adaptive::read_entry(e, max, entries).map(Quota::from);
            }
            return concurrency::read_entry(e, max).map(Quota::from);
        }
        // `lease` and `retry_after` belong to a concurrency limit.
        for (name, node) in [("lease", e.lease), ("retry_after", e.retry_after)] {
            if let Some(n) = node {
                let problem = match e.rate_field() {
                    Some((other, _)) => Problem::ConflictingFields(name, other),
                    None => Problem::MissingField("concurrency"),
                };
                return Err(at(problem, n.line));
            }
        }
        if let Some(calendar) = e.calendar {
            if let Some(fair) = e.fair_share {
                return Err(at(
                    Problem::ConflictingFields("fair_share", "calendar"),
                    fair.line,
                ));
            }
            return calendar::read_entry(e, calendar).map(Quota::from);
        }
        if let Some(fair) = e.fair_share {
            if let Some(tiers) = e.tiers {
                return Err(at(
                    Problem::ConflictingFields("fair_share", "tiers"),
                    tiers.line,
                ));
            }
            return fair_share::read_entry(e, fair).map(Quota::from);
        }
        let Some(tiers) = e.tiers else {
            return gcra::read_entry(e).map(Quota::from);
        };
        for (name, node) in [("burst", e.burst), ("count", e.count), ("period", e.period)] {
            if let Some(n) = node {
                return Err(at(Problem::ConflictingFields("tiers", name), n.line));
            }
        }
        tiers::read_entry(tiers).map(Quota::from)
    }
}

/// Fields of two shapes in one entry, refused on the later one's line: a GCRA limit's
/// options (debt and prefetched tokens: tiers forgive overruns and keep a state no instance
/// can split, and slots have no units) beside another shape, a calendar quota or a fair
/// share beside a concurrency limit.
#[cfg(any(feature = "yaml", feature = "admin"))]
fn shapes_apart(e: &Entry<'_>) -> Result<(), FieldError> {
    let gcra_only = [
        ("max_debt", e.max_debt),
        ("prefetch", e.prefetch),
        ("prefetch_ttl", e.prefetch_ttl),
    ];
    for (field, given) in gcra_only {
        let Some(given) = given else { continue };
        for (name, node) in [
            ("tiers", e.tiers),
            ("concurrency", e.concurrency),
            ("calendar", e.calendar),
            ("fair_share", e.fair_share),
        ] {
            if node.is_some() {
                return Err(at(Problem::ConflictingFields(field, name), given.line));
            }
        }
    }
    if let (Some(_), Some(calendar)) = (e.concurrency, e.calendar) {
        return Err(at(
            Problem::ConflictingFields("calendar", "concurrency"),
            calendar.line,
        ));
    }
    if let (Some(_), Some(fair)) = (e.concurrency, e.fair_share) {
        return Err(at(
            Problem::ConflictingFields("fair_share", "concurrency"),
            fair.line,
        ));
    }
    Ok(())
}

/// Whole seconds of a time in microseconds, rounded up.
pub(crate) fn ceil_secs_us(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

impl From<Limit> for Quota {
    fn from(l: Limit) -> Self {
        Quota::Gcra(l)
    }
}

impl From<TieredLimit> for Quota {
    fn from(t: TieredLimit) -> Self {
        Quota::Tiered(Arc::new(t))
    }
}

impl From<Arc<TieredLimit>> for Quota {
    fn from(t: Arc<TieredLimit>) -> Self {
        Quota::Tiered(t)
    }
}

impl From<CalendarQuota> for Quota {
    fn from(c: CalendarQuota) -> Self {
        Quota::Calendar(Arc::new(c))
    }
}

impl From<AdaptiveConcurrency> for Quota {
    fn from(a: AdaptiveConcurrency) -> Self {
        Quota::Adaptive(Arc::new(a))
    }
}

impl From<ConcurrencyLimit> for Quota {
    fn from(c: ConcurrencyLimit) -> Self {
        Quota::Concurrency(c)
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Quota::Gcra(l) => l.fmt(f),
            Quota::Tiered(t) => t.fmt(f),
            Quota::Concurrency(c) => c.fmt(f),
            Quota::Calendar(c) => c.fmt(f),
            Quota::FairShare(s) => s.fmt(f),
            Quota::Adaptive(a) => a.fmt(f),
        }
    }
}
