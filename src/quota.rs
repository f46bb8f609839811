//! What limits one bucket: a GCRA [`Limit`], burst tiers ([`TieredLimit`]) or a concurrency
//! limit ([`ConcurrencyLimit`]).
//!
//! The shape seam: everything outside the algorithms, the kit and the script asks a `Quota`
//! what its shape means (the policy's numbers, the effective window, its size, how it is shown
//! to an operator, what an unspent or later state reports, how it scales) through the methods
//! here, and never matches on its variants. A new shape is its algorithm, its arms here, in the
//! kit and in the script, and its configuration (`docs/design.md`, "A new limit shape: MUST
//! update").

use std::fmt;
use std::sync::Arc;

use crate::algo::calendar::CalendarQuota;
use crate::algo::concurrency::ConcurrencyLimit;
use crate::algo::gcra::Limit;
use crate::algo::tiers::{Tier, TierGrant, TieredLimit};

/// What limits one bucket: a GCRA [`Limit`], a [`TieredLimit`] (burst tiers) or a
/// [`ConcurrencyLimit`] (requests in flight).
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

    /// The largest cost a request can ever be granted: the burst, the sum of the tiers'
    /// limits, 1 for a concurrency limit (a request holds one slot), a period's count.
    pub fn max_cost(&self) -> u64 {
        match self {
            Quota::Gcra(l) => l.burst(),
            Quota::Tiered(t) => t.capacity(),
            Quota::Concurrency(_) => 1,
            Quota::Calendar(c) => c.count(),
        }
    }

    /// Whether a charge (units reported after the response) of any size is taken: a GCRA
    /// limit takes what fits within its debt, a calendar quota the whole cost (the overrun
    /// ends with the period). Elsewhere a charge above [`max_cost`](Self::max_cost) is
    /// refused.
    pub(crate) fn charges_any_cost(&self) -> bool {
        matches!(self, Quota::Gcra(_) | Quota::Calendar(_))
    }
}

/// A decision's numbers as a shape reads them ([`Quota::shown`]).
#[derive(Clone, Copy)]
pub(crate) struct Numbers<'a> {
    pub(crate) allowed: bool,
    pub(crate) remaining: u64,
    pub(crate) retry_after_us: u64,
    pub(crate) reset_after_us: u64,
    /// For a tiered limit: units per tier and the tier serving the client.
    pub(crate) tiers: Option<&'a TierGrant>,
    /// For a calendar quota: the length of the period decided in (whole seconds).
    pub(crate) period_s: u32,
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

impl Quota {
    /// The `RateLimit-Policy` member's `q` and `w` (seconds) when they do not depend on the
    /// decision (GCRA: the burst and the burst offset rounded up), so a layer writes them once.
    pub(crate) fn fixed_policy(&self) -> Option<(u64, u64)> {
        match self {
            Quota::Gcra(l) => Some((l.burst(), ceil_secs_us(l.burst_offset_us()))),
            _ => None,
        }
    }

    /// What a decision (`n`) shows of this limit: GCRA, the burst and the burst offset, and
    /// `Limit::window_us`; tiered, the serving tier's limit and window, and on a denial the wait
    /// before the request passes, else the time until the serving tier is fresh (a client
    /// whose tier is used up may still burst into the next one, so `r` is not a ceiling);
    /// concurrency, the slots, and a denial's hint. `window`: whether `w` is wanted (a member
    /// whose policy is precomputed needs none). `None`: nothing to show (a tiered limit
    /// without tiers).
    pub(crate) fn shown(&self, n: &Numbers<'_>, window: bool) -> Option<Shown> {
        Some(match self {
            Quota::Gcra(l) => Shown {
                q: l.burst(),
                w: if window {
                    ceil_secs_us(l.burst_offset_us())
                } else {
                    0
                },
                t_us: l.window_us(n.reset_after_us, n.remaining),
                concurrency: false,
            },
            Quota::Tiered(t) => {
                let (q, w) = serving_tier(t, n)?;
                Shown {
                    q,
                    w: ceil_secs_us(w),
                    t_us: if n.allowed {
                        n.reset_after_us
                    } else {
                        n.retry_after_us
                    },
                    concurrency: false,
                }
            }
            // Slots in flight: a denial's hint, else nothing to wait for.
            Quota::Concurrency(c) => Shown {
                q: c.max(),
                w: 0,
                t_us: n.retry_after_us,
                concurrency: true,
            },
            // The period's count and length (of the period decided in, by the store's clock);
            // `r` holds until the renewal.
            Quota::Calendar(c) => Shown {
                q: c.count(),
                w: if window { u64::from(n.period_s) } else { 0 },
                t_us: n.reset_after_us,
                concurrency: false,
            },
        })
    }

    /// The size `remaining` is measured against (for the near-limit counter): the burst, the
    /// serving tier's limit, or the slots.
    #[cfg(feature = "metrics")]
    pub(crate) fn size(&self, n: &Numbers<'_>) -> u64 {
        match self {
            Quota::Gcra(l) => l.burst(),
            Quota::Tiered(t) => serving_tier(t, n).map_or(0, |(limit, _)| limit),
            Quota::Concurrency(c) => c.max(),
            Quota::Calendar(c) => c.count(),
        }
    }

    /// The limit as the admin API shows it, field by field.
    #[cfg(feature = "admin")]
    pub(crate) fn describe(&self) -> Vec<(&'static str, Described)> {
        use Described::{Number, Text};
        let duration = |us| Text(crate::time::format_duration_us(us));
        match self {
            Quota::Gcra(l) => vec![
                ("burst", Number(l.burst())),
                ("count", Number(l.count())),
                ("period", duration(l.period_us())),
            ],
            Quota::Tiered(t) => vec![
                ("kind", Text("tiered".into())),
                ("burst", Number(t.capacity())),
            ],
            Quota::Concurrency(c) => vec![
                ("kind", Text("concurrency".into())),
                ("concurrency", Number(c.max())),
                ("lease", duration(c.lease_us())),
            ],
            Quota::Calendar(c) => {
                let mut v = vec![
                    ("kind", Text("calendar".into())),
                    ("count", Number(c.count())),
                    ("period", Text(c.period().as_str().into())),
                    ("at", Text(c.renews_at())),
                    ("zone", Text(c.zone_name())),
                ];
                if let Some(a) = c.anchor() {
                    v.push(("anchor_day", Number(a)));
                }
                v
            }
        }
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
        match self {
            // Exact: `remaining` and `reset_after` move by whole emission intervals.
            Quota::Gcra(l) => Some((
                remaining.saturating_add(granted).min(l.burst()),
                reset_after_us.saturating_sub(granted.saturating_mul(l.emission_interval_us())),
            )),
            // A slot was not taken: it is still free.
            Quota::Concurrency(c) => {
                Some((remaining.saturating_add(1).min(c.max()), reset_after_us))
            }
            // What the period had left, the units back (the renewal does not move).
            Quota::Calendar(c) => Some((
                remaining.saturating_add(granted).min(c.count()),
                reset_after_us,
            )),
            Quota::Tiered(_) => None,
        }
    }

    /// What a key's state adds to [`describe`](Self::describe) for an operator, with
    /// `remaining` units left at `now_us` (Unix microseconds, the caller's clock): a calendar
    /// quota's `used` (the count less what remains: an overrun shows as the whole count) and
    /// `renews_at` (the end of the period in force, a UTC instant); nothing for the others.
    #[cfg(feature = "admin")]
    pub(crate) fn describe_seen(
        &self,
        remaining: u64,
        now_us: u64,
    ) -> Vec<(&'static str, Described)> {
        match self {
            Quota::Calendar(c) => vec![
                (
                    "used",
                    Described::Number(c.count().saturating_sub(remaining)),
                ),
                (
                    "renews_at",
                    Described::Text(crate::algo::calendar::instant_text(c.period_at(now_us).1)),
                ),
            ],
            _ => Vec::new(),
        }
    }

    /// The wait before a request of `granted` units fits again, from a bucket's later state
    /// (`reset_after_us`, after a settle); `None`: the state's own `retry_after` says it.
    pub(crate) fn retry_after_again(&self, reset_after_us: u64, granted: u64) -> Option<u64> {
        match self {
            Quota::Gcra(l) => Some(
                reset_after_us
                    .saturating_add(granted.saturating_mul(l.emission_interval_us()))
                    .saturating_sub(l.burst_offset_us()),
            ),
            _ => None,
        }
    }

    /// What the in-memory fallback grants of this quota weighs once the store answers again
    /// (`layer/charge.rs`): a calendar quota's units count until their period ends, a GCRA
    /// limit's of an hour or longer until time repays them; `None` for the rest (a throttle of
    /// seconds is repaid before an outage ends, tiers are not carried back, and a concurrency
    /// slot is recorded as a lease of its own).
    pub(crate) fn charge_back(&self) -> Option<ChargeBack> {
        match self {
            Quota::Calendar(c) => Some(ChargeBack {
                count: c.count(),
                repaid_every_us: 0,
            }),
            Quota::Gcra(l) if l.period_us() >= CHARGED_BACK_FROM_US => Some(ChargeBack {
                count: l.burst(),
                repaid_every_us: l.emission_interval_us(),
            }),
            _ => None,
        }
    }

    /// The same limit at `percent` (1 to 100) of its size, for an in-memory fallback per
    /// instance: GCRA keeps `count` and stretches the period by `100 / percent` (so the rate
    /// scales without a new rounding of the emission interval) and scales the burst and the
    /// debt; tiers scale their limits; a concurrency limit its slots. Nothing scales below 1 or
    /// below `cost`, a request's configured cost.
    pub(crate) fn scaled(&self, percent: u8, cost: u64) -> Result<Quota, ShapeError> {
        let p = u64::from(percent.clamp(1, 100));
        let scale = |v: u64, floor: u64| (v.saturating_mul(p) / 100).max(floor).max(1);
        Ok(match self {
            Quota::Gcra(l) => Quota::Gcra(
                Limit::from_micros(
                    scale(l.burst(), cost),
                    l.count(),
                    l.period_us().saturating_mul(100) / p,
                )?
                .with_max_debt(l.max_debt().saturating_mul(p) / 100)?,
            ),
            Quota::Tiered(t) => {
                let tiers = t.tiers().iter().map(|tier| {
                    Tier::from_micros(
                        if tier.limit() == 0 {
                            0
                        } else {
                            scale(tier.limit(), 1)
                        },
                        tier.window_us(),
                        tier.active_us(),
                        tier.cooldown_us(),
                    )
                });
                Quota::from(TieredLimit::new(tiers)?)
            }
            Quota::Concurrency(c) => Quota::Concurrency(
                ConcurrencyLimit::from_micros(scale(c.max(), 1), c.lease_us())?
                    .retry_after(crate::time::us(c.retry_after_us()))?,
            ),
            Quota::Calendar(c) => Quota::Calendar(Arc::new(c.scaled(scale(c.count(), cost))?)),
        })
    }
}

/// A GCRA limit whose period is at least this long (an hour) has what the fallback grants
/// charged back to the store.
pub(crate) const CHARGED_BACK_FROM_US: u64 = 3_600_000_000;

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

/// Why a shape could not be made (a fallback's scaled limit): its own error.
#[derive(Debug)]
pub(crate) enum ShapeError {
    Limit(crate::algo::gcra::LimitError),
    Tiers(crate::algo::tiers::TierError),
    Concurrency(crate::algo::concurrency::ConcurrencyError),
    Calendar(crate::algo::calendar::CalendarError),
}

impl From<crate::algo::calendar::CalendarError> for ShapeError {
    fn from(e: crate::algo::calendar::CalendarError) -> Self {
        ShapeError::Calendar(e)
    }
}

impl From<crate::algo::gcra::LimitError> for ShapeError {
    fn from(e: crate::algo::gcra::LimitError) -> Self {
        ShapeError::Limit(e)
    }
}

impl From<crate::algo::tiers::TierError> for ShapeError {
    fn from(e: crate::algo::tiers::TierError) -> Self {
        ShapeError::Tiers(e)
    }
}

impl From<crate::algo::concurrency::ConcurrencyError> for ShapeError {
    fn from(e: crate::algo::concurrency::ConcurrencyError) -> Self {
        ShapeError::Concurrency(e)
    }
}

/// The limit and the window (microseconds) of the tier serving the client (the first when
/// none is named).
fn serving_tier(t: &TieredLimit, n: &Numbers<'_>) -> Option<(u64, u64)> {
    let number = n.tiers.map_or(1, |g| usize::from(g.tier));
    let tier = t.tier(number).or(t.tiers().first())?;
    Some((tier.limit(), tier.window_us()))
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
        }
    }
}
