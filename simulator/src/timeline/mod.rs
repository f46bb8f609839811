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
use tower_ratelimits::__private::{ShapeRef, calendar, gcra, tiers};
use tower_ratelimits::{
    BatchDecision, BucketKey, Ladder, LimitName, Limiter, Limits, ManualClock, MemoryBackend,
    Quota, TierGrant, Transaction,
};

use crate::trace::{EPOCH_US, Observer};

mod axis;
mod draw;
mod lane;
use lane::{Ban, Class, Column, Counts, Group, Lane, Mark, Series};

pub use axis::Axis;

/// Marks closer than this (in pixels, in one lane) share a place: up to [`STACK`] of them are
/// drawn stacked, more as one aggregate mark.
pub const BIN_PX: f64 = 4.0;
pub const STACK: usize = 3;
/// The width of a cut in the time axis, in pixels.
const BREAK_PX: f64 = 22.0;
/// The most quantities a lane draws: a tiered limit's tiers, and a penalty ladder's level.
const MAX_SERIES: usize = MAX_TIERS + 1;
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
    match quota.map(Quota::shape_ref) {
        None => 0,
        Some(ShapeRef::Gcra(l)) => l.burst_offset_us(),
        Some(ShapeRef::Tiered(t)) => t
            .tiers()
            .iter()
            .map(|tier| {
                tier.window_us()
                    .max(tier.active_us().saturating_add(tier.cooldown_us()))
            })
            .max()
            .unwrap_or(0),
        Some(ShapeRef::Concurrency(c)) => c.lease_us(),
        // Units used count until the renewal, drawn as such; a stretch with no request is cut
        // out all the same (a calendar trace spans months, its lines hours or days apart).
        Some(ShapeRef::Calendar(_)) => 0,
        Some(ShapeRef::FairShare(s)) => s.budget().burst_offset_us(),
        // Its number holds while a request is in flight, and returns to `initial` only after
        // `idle_reset`: a stretch without requests shorter than that is drawn whole.
        Some(ShapeRef::Adaptive(a)) => a.slots().lease_us().max(a.idle_reset_us()),
    }
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
        let ladder = self.limits.penalty(key.name()).copied();
        let series = series_of(quota.as_ref(), share.is_some(), ladder.as_ref());
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
            penalty: ladder.map(|_| self.limits.clone()),
            bans: Vec::new(),
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
        lane.note_bans(backend, mark.at);
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

/// The quantities a lane of a limit of `quota` draws (`share`: a region's share bucket), and
/// under them, for a limit with a penalty `ladder`, the key's level.
fn series_of(quota: Option<&Quota>, share: bool, ladder: Option<&Ladder>) -> Vec<Series> {
    let mut series = match quota.map(Quota::shape_ref) {
        None => Vec::new(),
        // A region's share bucket: its tokens, and its share of the rate (the floor and
        // the part granted while its lease runs).
        Some(ShapeRef::Gcra(l)) if share => vec![
            Series::new("tokens".into(), l.burst()),
            Series::new("share of rate".into(), l.count()),
        ],
        Some(ShapeRef::Gcra(l)) => vec![Series::new("tokens".into(), l.burst())],
        Some(ShapeRef::Tiered(t)) => t
            .tiers()
            .iter()
            .enumerate()
            .map(|(i, tier)| Series::new(format!("T{} used", i + 1), tier.limit()))
            .collect(),
        Some(ShapeRef::Concurrency(c)) => vec![Series::new("slots in use".into(), c.max())],
        // The slots in use under the key's number, and the number moving.
        Some(ShapeRef::Adaptive(a)) => vec![
            Series::new("slots in use".into(), a.adaptive().max()),
            Series::new("slots (its number)".into(), a.adaptive().max()),
        ],
        Some(ShapeRef::Calendar(c)) => vec![Series::new("used".into(), c.count())],
        // The budget all ids share (every id's lane draws the same tokens).
        Some(ShapeRef::FairShare(s)) => {
            vec![Series::new("budget tokens".into(), s.budget().burst())]
        }
    };
    // A limit with a penalty ladder: the key's level too (its bans drawn behind it), up to
    // the first level whose ban is the ladder's longest.
    if let Some(l) = ladder {
        let top = (1..32).find(|&n| l.ban_us(n) >= l.max_us()).unwrap_or(32);
        series.push(Series::new("ban level".into(), u64::from(top)));
    }
    series
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
                after: [0; MAX_SERIES],
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
                after: [0; MAX_SERIES],
            };
            self.mark(key, mark);
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
