//! The timeline drawing behind `simulate --svg FILE` and `--html FILE`: every bucket of a
//! trace on one time axis, with its requests and its quota over time.
//!
//! The drawing watches the same run that prints the JSON ([`Observer`]): the marks carry the
//! decisions' own numbers, and the quota is read from the in-memory backend's state (a GCRA
//! bucket's TAT, a tiered key's log, a concurrency key's leases) through the library's own
//! derivations, sampled once per pixel column and just before and after every request. Nothing
//! here decides anything.
//!
//! Layout, per bucket (a "lane"): a header, one row per drawn quantity (tokens for GCRA; per
//! tier, the grants its window counts and its active and cooldown periods; slots in use for a
//! concurrency limit, and for an adaptive one also the key's number of slots moving; units used of the count for a calendar quota, its renewals marked across
//! the lane), and a row of marks. A trace whose first line is dated is drawn on an axis of UTC
//! dates (ticks on whole minutes, hours or days). Idle stretches (every bucket back to a fresh state
//! and nothing happening) longer than a twentieth of the trace are cut out of the axis and
//! drawn as a break. Marks closer than [`BIN_PX`] pixels are stacked, up to [`STACK`] of
//! them, or drawn as one aggregate mark with their counts, and a quantity's curve keeps at most four points per pixel column, so a
//! trace of any length draws into a file of bounded size.
//!
//! Every mark and quota point carries its numbers as `data-*` attributes and in a `<title>`
//! (a tooltip); `tests/timeline.rs` reads them back and compares them with the JSON output.

use std::collections::HashMap;
use std::fmt::Write as _;

use tower_ratelimits::__private::tiers::MAX_TIERS;
use tower_ratelimits::__private::{calendar, gcra, tiers};
use tower_ratelimits::{
    BatchDecision, BucketKey, LimitName, Limiter, Limits, ManualClock, MemoryBackend, Quota,
    TierGrant, Transaction,
};

use crate::trace::{EPOCH_US, Observer};

mod axis;
mod draw;

pub use axis::Axis;

/// Marks closer than this (in pixels, in one lane) share a place: up to [`STACK`] of them are
/// drawn stacked, more as one aggregate mark.
pub const BIN_PX: f64 = 4.0;
pub const STACK: usize = 3;
/// The width of a cut in the time axis, in pixels.
const BREAK_PX: f64 = 22.0;
/// Left margin (lane labels) and right margin, in pixels.
const LEFT: f64 = 210.0;
const RIGHT: f64 = 30.0;
/// The height of one quantity's row, of a lane's mark row, of a lane header.
const ROW_H: f64 = 54.0;
const MARKS_H: f64 = 34.0;
const HEAD_H: f64 = 22.0;
const LANE_GAP: f64 = 16.0;
/// Top of the first lane (title, legend and the time axis above it).
const TOP: f64 = 110.0;

/// The most buckets drawn (in the order of their first request); decisions on others are
/// counted, not drawn.
pub const MAX_LANES: usize = 100;
/// The default drawing width, and the accepted range, in pixels.
pub const DEFAULT_WIDTH: u32 = 1400;
pub const WIDTH_RANGE: std::ops::RangeInclusive<u32> = 600..=100_000;

/// How long a bucket of this quota remembers a request (after it, the state is a fresh one).
/// Each trace line's time and how long its buckets remember it (what [`Axis::new`] takes).
pub fn events(limiter: &tower_ratelimits::Limiter, text: &str) -> Vec<(u64, u64)> {
    let limits = limiter.limits();
    text.lines()
        .filter_map(|line| crate::trace::peek(limiter, line))
        .map(|(at, keys)| {
            let memory = keys
                .iter()
                .map(|k| memory_us(limits.resolve(k)))
                .max()
                .unwrap_or(0);
            (at, at.saturating_add(memory))
        })
        .collect()
}

pub fn memory_us(quota: Option<&Quota>) -> u64 {
    match quota {
        None => 0,
        Some(Quota::Gcra(l)) => l.burst_offset_us(),
        Some(Quota::Tiered(t)) => t
            .tiers()
            .iter()
            .map(|tier| {
                tier.window_us()
                    .max(tier.active_us().saturating_add(tier.cooldown_us()))
            })
            .max()
            .unwrap_or(0),
        Some(Quota::Concurrency(c)) => c.lease_us(),
        // Units used count until the renewal, drawn as such; a stretch with no request is cut
        // out all the same (a calendar trace spans months, its lines hours or days apart).
        Some(Quota::Calendar(_)) => 0,
        Some(Quota::FairShare(s)) => s.budget().burst_offset_us(),
        // Its number holds while a request is in flight, and returns to `initial` only after
        // `idle_reset`: a stretch without requests shorter than that is drawn whole.
        Some(Quota::Adaptive(a)) => a.slots().lease_us().max(a.idle_reset_us()),
        Some(_) => 0,
    }
}

/// What a mark stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Granted in full.
    Allowed,
    /// A range granted less than its maximum.
    Partial,
    /// Refused by this limit.
    Denied,
    /// This limit allowed it, another limit of the batch refused it.
    Blocked,
    /// A refund, reset or release.
    Other,
}

impl Class {
    fn css(self) -> &'static str {
        match self {
            Class::Allowed => "ok",
            Class::Partial => "part",
            Class::Denied => "deny",
            Class::Blocked => "blocked",
            Class::Other => "other",
        }
    }
}

/// One request (or reset, release) on one bucket.
#[derive(Debug, Clone, Copy)]
struct Mark {
    line: usize,
    at: u64,
    op: &'static str,
    class: Class,
    allowed: bool,
    batch_allowed: bool,
    cost: u64,
    min_cost: u64,
    granted: u64,
    remaining: u64,
    retry_us: u64,
    reset_us: u64,
    refused_by: Option<LimitName>,
    tiers: Option<TierGrant>,
    skipped: bool,
    lease: bool,
    /// Each quantity of the lane just after the line (the first `series.len()`).
    after: [u64; MAX_TIERS],
}

/// The marks that share a place on the axis (within [`BIN_PX`] of the first).
#[derive(Debug, Clone)]
enum Group {
    /// Up to [`STACK`] marks, drawn each on its own.
    Marks(Vec<Mark>),
    /// More: drawn as one mark with their counts.
    Aggregate(Counts),
}

/// Counts of marks, for an aggregate mark and a lane's summary.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    count: u64,
    allowed: u64,
    partial: u64,
    denied: u64,
    blocked: u64,
    other: u64,
    granted: u64,
    from: u64,
    to: u64,
    first_line: usize,
    last_line: usize,
}

impl Counts {
    fn add(&mut self, m: &Mark) {
        if self.count == 0 {
            self.from = m.at;
            self.first_line = m.line;
        }
        self.count += 1;
        self.to = m.at;
        self.last_line = m.line;
        match m.class {
            Class::Allowed => self.allowed += 1,
            Class::Partial => self.partial += 1,
            Class::Denied => self.denied += 1,
            Class::Blocked => self.blocked += 1,
            Class::Other => self.other += 1,
        }
        if m.class != Class::Other {
            self.granted += m.granted;
        }
    }
}

impl Group {
    fn add(&mut self, m: Mark) {
        match self {
            Group::Marks(marks) if marks.len() < STACK => marks.push(m),
            Group::Marks(marks) => {
                let mut counts = Counts::default();
                for old in marks.iter() {
                    counts.add(old);
                }
                counts.add(&m);
                *self = Group::Aggregate(counts);
            }
            Group::Aggregate(counts) => counts.add(&m),
        }
    }

    fn marks(&self) -> &[Mark] {
        match self {
            Group::Marks(m) => m,
            Group::Aggregate(_) => &[],
        }
    }
}

/// One drawn quantity of a lane.
#[derive(Debug, Clone)]
struct Series {
    label: String,
    max: u64,
    /// Per pixel column touched, in time order: the value at the column's first point, the
    /// lowest and highest, and the last (which holds until the next column's first).
    columns: Vec<Column>,
}

#[derive(Debug, Clone, Copy)]
struct Column {
    x: f64,
    first: u64,
    low: u64,
    high: u64,
    last: u64,
}

impl Series {
    fn new(label: String, max: u64) -> Series {
        Series {
            label,
            max,
            columns: Vec::new(),
        }
    }

    fn push(&mut self, x: f64, v: u64) {
        match self.columns.last_mut() {
            Some(c) if c.x.round() == x.round() => {
                c.low = c.low.min(v);
                c.high = c.high.max(v);
                c.last = v;
            }
            _ => self.columns.push(Column {
                x,
                first: v,
                low: v,
                high: v,
                last: v,
            }),
        }
    }

    fn last(&self) -> u64 {
        self.columns.last().map_or(0, |c| c.last)
    }
}

/// A tier's activation: entered at `entry`, active for `active`, then cooling for `cooldown`.
#[derive(Debug, Clone, Copy)]
struct Band {
    tier: usize,
    entry: u64,
    active: u64,
    cooldown: u64,
}

/// One bucket.
struct Lane {
    key: BucketKey,
    /// Its region (0 in a run in no region).
    region: usize,
    /// A region's share bucket of a limit across regions: drawn with its share of the rate.
    share: bool,
    label: String,
    quota: Option<Quota>,
    series: Vec<Series>,
    /// Closed groups of marks, in time order, and the open one with its first mark's x.
    groups: Vec<Group>,
    open: Option<(f64, Group)>,
    totals: Counts,
    bands: Vec<Band>,
    /// Per tier, the last entry seen (so each activation is one band).
    entries: Vec<Option<u64>>,
}

/// Collects a run for drawing; see the module documentation.
pub struct Timeline {
    axis: Axis,
    columns: Vec<u64>,
    next_column: usize,
    /// Each region's backend and name (one, unnamed, for a run in no region).
    backends: Vec<(String, MemoryBackend)>,
    /// The region of the line being drawn.
    region: usize,
    clock: ManualClock,
    limits: std::sync::Arc<Limits>,
    lanes: Vec<Lane>,
    index: HashMap<(usize, BucketKey), usize>,
    title: String,
    lines: usize,
    /// Decisions on buckets beyond [`MAX_LANES`], not drawn.
    undrawn: u64,
    /// The trace's times are dates: the axis is labelled in UTC dates, its ticks on whole
    /// minutes, hours or days.
    dated: bool,
}

impl Timeline {
    /// A timeline for a run of `limiter` on `backend` and `clock`, over `axis`.
    pub fn new(
        axis: Axis,
        limiter: &Limiter,
        backend: MemoryBackend,
        clock: ManualClock,
        title: String,
    ) -> Timeline {
        Timeline {
            columns: axis.columns(),
            axis,
            next_column: 0,
            backends: vec![(String::new(), backend)],
            region: 0,
            clock,
            limits: limiter.limits(),
            lanes: Vec::new(),
            index: HashMap::new(),
            title,
            lines: 0,
            undrawn: 0,
            dated: false,
        }
    }

    /// Draws a run in regions (`--regions`): each region's backend by name, in its order; a
    /// bucket is a lane per region, and a marked limit's lane draws the region's share.
    pub fn regions(mut self, backends: Vec<(String, MemoryBackend)>) -> Timeline {
        if !backends.is_empty() {
            self.backends = backends;
        }
        self
    }

    /// Labels the axis in UTC dates (a trace whose lines are dated).
    pub fn dated(mut self, dated: bool) -> Timeline {
        self.dated = dated;
        self
    }

    /// The lane of `key`, made on its first request; `None` past [`MAX_LANES`].
    fn lane(&mut self, key: &BucketKey) -> Option<usize> {
        let region = self.region;
        if let Some(&i) = self.index.get(&(region, key.clone())) {
            return Some(i);
        }
        if self.lanes.len() >= MAX_LANES {
            self.undrawn += 1;
            return None;
        }
        let quota = self.limits.resolve(key).cloned();
        let (name, backend) = &self.backends[region];
        let share = backend.share_now(key);
        let series = match &quota {
            None => Vec::new(),
            // A region's share bucket: its tokens, and its share of the rate (the floor and
            // the part granted while its lease runs).
            Some(Quota::Gcra(l)) if share.is_some() => vec![
                Series::new("tokens".into(), l.burst()),
                Series::new("share of rate".into(), l.count()),
            ],
            Some(Quota::Gcra(l)) => vec![Series::new("tokens".into(), l.burst())],
            Some(Quota::Tiered(t)) => t
                .tiers()
                .iter()
                .enumerate()
                .map(|(i, tier)| Series::new(format!("T{} used", i + 1), tier.limit()))
                .collect(),
            Some(Quota::Concurrency(c)) => vec![Series::new("slots in use".into(), c.max())],
            // The slots in use under the key's number, and the number moving.
            Some(Quota::Adaptive(a)) => vec![
                Series::new("slots in use".into(), a.adaptive().max()),
                Series::new("slots (its number)".into(), a.adaptive().max()),
            ],
            Some(Quota::Calendar(c)) => vec![Series::new("used".into(), c.count())],
            // The budget all ids share (every id's lane draws the same tokens).
            Some(Quota::FairShare(s)) => {
                vec![Series::new("budget tokens".into(), s.budget().burst())]
            }
            Some(_) => Vec::new(),
        };
        let tiers = quota
            .as_ref()
            .and_then(Quota::as_tiered)
            .map_or(0, |t| t.tiers().len());
        let mut lane = Lane {
            label: if name.is_empty() {
                format!("{}={}", key.name().as_str(), key.id())
            } else {
                format!("{name} · {}={}", key.name().as_str(), key.id())
            },
            region,
            share: share.is_some(),
            key: key.clone(),
            quota,
            series,
            groups: Vec::new(),
            open: None,
            totals: Counts::default(),
            bands: Vec::new(),
            entries: vec![None; tiers],
        };
        // Before its first request a bucket is fresh (the backend already holds the request);
        // a share bucket full under its floor.
        let start = self.axis.start();
        let mut fresh = lane.values(None, start);
        if let Some(share) = share {
            fresh[0] = share.floor.1;
            fresh[1] = share.floor.0;
        }
        let x = self.axis.x(start);
        for (s, v) in lane.series.iter_mut().zip(fresh) {
            s.push(x, v);
        }
        self.lanes.push(lane);
        self.index
            .insert((region, key.clone()), self.lanes.len() - 1);
        Some(self.lanes.len() - 1)
    }

    /// Samples every lane at trace time `t` (the backend's clock must be there).
    fn sample_all(&mut self, t: u64) {
        for lane in &mut self.lanes {
            lane.sample(&self.axis, &self.backends[lane.region].1, t);
        }
    }

    /// Adds `mark` to the lane of `key`, sampling the lane's state just after it.
    fn mark(&mut self, key: &BucketKey, mut mark: Mark) {
        let Some(i) = self.lane(key) else {
            return;
        };
        let lane = &mut self.lanes[i];
        let backend = &self.backends[lane.region].1;
        lane.sample(&self.axis, backend, mark.at);
        lane.note_activations(backend);
        for (slot, s) in mark.after.iter_mut().zip(&lane.series) {
            *slot = s.last();
        }
        lane.totals.add(&mark);
        let x = self.axis.x(mark.at);
        match &mut lane.open {
            Some((x0, group)) if x - *x0 < BIN_PX => group.add(mark),
            open => {
                if let Some((_, group)) = open.take() {
                    lane.groups.push(group);
                }
                *open = Some((x, Group::Marks(vec![mark])));
            }
        }
    }
}

fn op_name(op: &str) -> &'static str {
    match op {
        "spend" => "spend",
        "check" => "check",
        "refund" => "refund",
        "charge" => "charge",
        "reset" => "reset",
        _ => "release",
    }
}

impl Observer for Timeline {
    fn in_region(&mut self, region: usize) {
        self.region = region.min(self.backends.len().saturating_sub(1));
    }

    fn advance(&mut self, at_us: u64) {
        while let Some(&t) = self.columns.get(self.next_column) {
            if t >= at_us {
                break;
            }
            self.next_column += 1;
            self.clock.set(EPOCH_US.saturating_add(t));
            self.sample_all(t);
        }
        self.clock.set(EPOCH_US.saturating_add(at_us));
        self.sample_all(at_us);
    }

    fn decided(
        &mut self,
        line: usize,
        at_us: u64,
        op: &str,
        txs: &[Transaction],
        batch: &BatchDecision,
    ) {
        self.lines += 1;
        let refused_by = (!batch.allowed())
            .then(|| batch.strictest().map(|d| d.name()))
            .flatten();
        for (d, tx) in batch.decisions().iter().zip(txs) {
            let default = self.limits.default_cost(d.name());
            let cost = tx.cost_or(default);
            let class = if op == "refund" {
                Class::Other
            } else if !d.allowed() {
                Class::Denied
            } else if !batch.allowed() {
                Class::Blocked
            } else if d.granted() < cost {
                Class::Partial
            } else {
                Class::Allowed
            };
            let mark = Mark {
                line,
                at: at_us,
                op: op_name(op),
                class,
                allowed: d.allowed(),
                batch_allowed: batch.allowed(),
                cost,
                min_cost: tx.min_cost_or(default),
                granted: d.granted(),
                remaining: d.remaining(),
                retry_us: u64::try_from(d.retry_after().as_micros()).unwrap_or(u64::MAX),
                reset_us: u64::try_from(d.reset_after().as_micros()).unwrap_or(u64::MAX),
                refused_by: refused_by.filter(|_| class == Class::Blocked),
                tiers: d.tiers().copied(),
                skipped: d.skipped(),
                lease: d.lease_id().is_some(),
                after: [0; MAX_TIERS],
            };
            self.mark(d.key(), mark);
        }
    }

    fn changed(&mut self, line: usize, at_us: u64, op: &str, keys: &[BucketKey]) {
        self.lines += 1;
        for key in keys {
            let mark = Mark {
                line,
                at: at_us,
                op: op_name(op),
                class: Class::Other,
                allowed: true,
                batch_allowed: true,
                cost: 0,
                min_cost: 0,
                granted: 0,
                remaining: 0,
                retry_us: 0,
                reset_us: 0,
                refused_by: None,
                tiers: None,
                skipped: false,
                lease: false,
                after: [0; MAX_TIERS],
            };
            self.mark(key, mark);
        }
    }
}

impl Lane {
    /// Each quantity of this bucket at trace time `t` (the first `series.len()`), as the
    /// backend's state says (`None`: a fresh bucket's).
    fn values(&self, backend: Option<&MemoryBackend>, t: u64) -> [u64; MAX_TIERS] {
        let now = EPOCH_US.saturating_add(t);
        let mut out = [0; MAX_TIERS];
        match &self.quota {
            None => {}
            Some(Quota::Gcra(_)) if self.share => {
                if let Some(share) = backend.and_then(|b| b.share_now(&self.key)) {
                    out[0] = share.tokens;
                    out[1] = share.floor.0.saturating_add(share.part.0);
                }
            }
            Some(Quota::Gcra(l)) => {
                let tat = backend.and_then(|b| b.tat(&self.key));
                out[0] = gcra::check(l, tat, now, 0).map_or(0, |o| o.remaining);
            }
            Some(Quota::Tiered(limit)) => {
                let state = backend
                    .and_then(|b| b.tier_state(&self.key))
                    .unwrap_or_default();
                for (i, v) in out.iter_mut().enumerate().take(limit.tiers().len()) {
                    *v = tiers::tier_at(limit, &state, i, now).1;
                }
            }
            Some(Quota::Concurrency(_)) => {
                out[0] = backend.map_or(0, |b| b.leases(&self.key) as u64);
            }
            Some(Quota::Adaptive(a)) => {
                out[0] = backend.map_or(0, |b| b.leases(&self.key) as u64);
                let state = backend
                    .and_then(|b| b.adaptive_state(&self.key))
                    .unwrap_or_default();
                out[1] = a.slots_at(&state, now).max();
            }
            Some(Quota::Calendar(c)) => {
                // The units used in the period in force (an overrun drawn at the count).
                let state = backend.and_then(|b| b.calendar_state(&self.key));
                let (_, end) = c.period_at(now);
                out[0] = calendar::used(state, end, now).min(c.count());
            }
            Some(Quota::FairShare(s)) => {
                let pool = backend.and_then(|b| b.fair_share_state(self.key.name()));
                let tat = pool.as_ref().map(|p| p.budget_tat()).filter(|&t| t != 0);
                out[0] = gcra::check(s.budget(), tat, now, 0).map_or(0, |o| o.remaining);
            }
            Some(_) => {}
        }
        out
    }

    /// The renewals of a calendar quota inside `[from, to]` (trace time), at most `MAX`.
    fn renewals(&self, from: u64, to: u64) -> Vec<u64> {
        const MAX: usize = 400;
        let Some(Quota::Calendar(c)) = &self.quota else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let (_, mut end) = c.period_at(EPOCH_US.saturating_add(from));
        while out.len() < MAX {
            let t = end.saturating_sub(EPOCH_US);
            if t > to || end <= EPOCH_US {
                break;
            }
            out.push(t);
            let next = c.period_at(end).1;
            if next <= end {
                break;
            }
            end = next;
        }
        out
    }

    fn sample(&mut self, axis: &Axis, backend: &MemoryBackend, t: u64) {
        let values = self.values(Some(backend), t);
        let x = axis.x(t);
        for (s, v) in self.series.iter_mut().zip(values) {
            s.push(x, v);
        }
    }

    /// Records the tier activations a request made (a tier is entered only by a request).
    fn note_activations(&mut self, backend: &MemoryBackend) {
        let Some(Quota::Tiered(limit)) = &self.quota else {
            return;
        };
        let Some(state) = backend.tier_state(&self.key) else {
            return;
        };
        for (i, log) in state.tiers().iter().enumerate().take(self.entries.len()) {
            if let Some(e) = log.entry()
                && self.entries[i] != Some(e)
            {
                self.entries[i] = Some(e);
                let tier = &limit.tiers()[i];
                self.bands.push(Band {
                    tier: i,
                    entry: e.saturating_sub(EPOCH_US),
                    active: tier.active_us(),
                    cooldown: tier.cooldown_us(),
                });
            }
        }
    }

    /// The groups of marks, the open one last.
    fn all_groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter().chain(self.open.as_ref().map(|(_, g)| g))
    }

    fn height(&self) -> f64 {
        HEAD_H + ROW_H * self.series.len() as f64 + MARKS_H
    }

    fn quota_text(&self) -> String {
        match &self.quota {
            None => "unlimited".into(),
            Some(Quota::Gcra(l)) => format!(
                "GCRA: burst {}, {} per {}{}",
                l.burst(),
                l.count(),
                seconds(l.period_us()),
                if self.share {
                    " across regions: this region's share"
                } else {
                    ""
                }
            ),
            Some(Quota::Tiered(t)) => {
                let tiers: Vec<String> = t
                    .tiers()
                    .iter()
                    .map(|tier| {
                        format!(
                            "{}/{} active {} cooldown {}",
                            tier.limit(),
                            seconds(tier.window_us()),
                            seconds(tier.active_us()),
                            seconds(tier.cooldown_us())
                        )
                    })
                    .collect();
                format!("tiers: {}", tiers.join(" | "))
            }
            Some(Quota::Concurrency(c)) => format!(
                "concurrency: {} in flight, lease {}",
                c.max(),
                seconds(c.lease_us())
            ),
            Some(Quota::Calendar(c)) => format!(
                "calendar: {} per {}{}, at {} {}",
                c.count(),
                c.period().as_str(),
                c.anchor()
                    .map_or(String::new(), |a| format!(", renewing on day {a}")),
                c.renews_at(),
                c.zone_name()
            ),
            Some(Quota::FairShare(s)) => format!(
                "fair share: {} per {}, burst {}, weight {}{}",
                s.budget().count(),
                seconds(s.budget().period_us()),
                s.budget().burst(),
                s.weight(),
                if s.min() > 0 {
                    format!(", minimum {}", s.min())
                } else {
                    String::new()
                }
            ),
            Some(Quota::Adaptive(a)) => format!(
                "adaptive concurrency: {}, lease {}",
                a.adaptive(),
                seconds(a.slots().lease_us())
            ),
            Some(_) => "a limit of another shape".into(),
        }
    }
}

/// A UTC instant as an axis label: the day (`2028-02-01`) when ticks are days apart, else the
/// day and the minute (`2028-01-31 12:00`).
fn date_label(us: u64, step: u64) -> String {
    let text = tower_ratelimits::__private::instant_text(us);
    let day = &text[..text.len().min(10)];
    if step >= 86_400_000_000 {
        day.to_owned()
    } else {
        format!("{day} {}", &text[11..text.len().min(16)])
    }
}

/// Trace time as seconds, without trailing zeros (`1.5s`, `0.000250s`).
pub fn seconds(us: u64) -> String {
    let whole = us / 1_000_000;
    let frac = us % 1_000_000;
    if frac == 0 {
        return format!("{whole}s");
    }
    let f = format!("{frac:06}");
    format!("{whole}.{}s", f.trim_end_matches('0'))
}

/// Escapes text for XML content and attribute values.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}
