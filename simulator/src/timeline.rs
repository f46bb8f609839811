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
//! concurrency limit; units used of the count for a calendar quota, its renewals marked across
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

/// A piece of trace time drawn without a cut: `[start, end]` starting at pixel `x`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    start: u64,
    end: u64,
    x: f64,
}

/// The shared time axis: trace microseconds to pixels, with idle stretches cut out.
#[derive(Debug, Clone)]
pub struct Axis {
    pieces: Vec<Piece>,
    us_per_px: f64,
    width: f64,
}

impl Axis {
    /// An axis for requests at `events` (trace time, sorted), each followed by a stretch during
    /// which its bucket still remembers it (`(at, remembered_until)`), drawn `width` pixels
    /// wide.
    pub fn new(events: &[(u64, u64)], width: u32) -> Axis {
        let width = f64::from(width);
        let first = events.first().map_or(0, |e| e.0);
        let last = events.last().map_or(0, |e| e.0);
        let span = last.saturating_sub(first).max(1_000_000);
        let min_cut = (span / 20).max(1_000_000);
        // Cut [remembered, next) when nothing is remembered and nothing happens for long.
        let mut cuts: Vec<(u64, u64)> = Vec::new();
        let mut remembered = 0u64;
        for pair in events.windows(2) {
            remembered = remembered.max(pair[0].1);
            let (from, to) = (remembered.max(pair[0].0), pair[1].0);
            if to > from && to - from > min_cut {
                // Keep a little of the quiet on both sides, so the refill shows.
                let keep = min_cut / 4;
                cuts.push((from + keep, to - keep));
            }
        }
        remembered = events.iter().map(|e| e.1).max().unwrap_or(0);
        let lead = (span / 50).max(1);
        let start = first.saturating_sub(lead);
        let tail = remembered
            .saturating_sub(last)
            .clamp(span / 50, (span / 8).max(1));
        let end = last.saturating_add(tail).max(start + 1);
        let mut bounds = Vec::with_capacity(cuts.len() + 1);
        let mut from = start;
        for &(a, b) in &cuts {
            bounds.push((from, a));
            from = b;
        }
        bounds.push((from, end));
        let drawn: u64 = bounds.iter().map(|(a, b)| b - a).sum();
        let plot = (width - LEFT - RIGHT - BREAK_PX * cuts.len() as f64).max(100.0);
        let us_per_px = drawn.max(1) as f64 / plot;
        let mut x = LEFT;
        let pieces = bounds
            .into_iter()
            .map(|(a, b)| {
                let p = Piece {
                    start: a,
                    end: b,
                    x,
                };
                x += (b - a) as f64 / us_per_px + BREAK_PX;
                p
            })
            .collect();
        Axis {
            pieces,
            us_per_px,
            width,
        }
    }

    /// The pixel of trace time `t` (inside a cut: the cut's middle).
    pub fn x(&self, t: u64) -> f64 {
        let i = self.pieces.partition_point(|p| p.start <= t);
        if i == 0 {
            return self.pieces[0].x;
        }
        let p = self.pieces[i - 1];
        if t <= p.end {
            p.x + (t - p.start) as f64 / self.us_per_px
        } else if i < self.pieces.len() {
            self.piece_end_x(&p) + BREAK_PX / 2.0
        } else {
            self.piece_end_x(&p)
        }
    }

    fn piece_end_x(&self, p: &Piece) -> f64 {
        p.x + (p.end - p.start) as f64 / self.us_per_px
    }

    /// One time per pixel column, in order.
    fn columns(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for p in &self.pieces {
            let n = ((p.end - p.start) as f64 / self.us_per_px).ceil() as u64;
            out.extend((0..=n).map(|k| p.start + (k as f64 * self.us_per_px) as u64));
        }
        out.dedup();
        out
    }

    fn start(&self) -> u64 {
        self.pieces[0].start
    }

    /// The axis as `start:end:x` pieces, for readers of the file (the tests).
    fn describe(&self) -> String {
        let mut s = String::new();
        for p in &self.pieces {
            let _ = write!(s, "{}:{}:{:.3};", p.start, p.end, p.x);
        }
        s.pop();
        s
    }
}

/// How long a bucket of this quota remembers a request (after it, the state is a fresh one).
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
    backend: MemoryBackend,
    clock: ManualClock,
    limits: std::sync::Arc<Limits>,
    lanes: Vec<Lane>,
    index: HashMap<BucketKey, usize>,
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
            backend,
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

    /// Labels the axis in UTC dates (a trace whose lines are dated).
    pub fn dated(mut self, dated: bool) -> Timeline {
        self.dated = dated;
        self
    }

    /// The lane of `key`, made on its first request; `None` past [`MAX_LANES`].
    fn lane(&mut self, key: &BucketKey) -> Option<usize> {
        if let Some(&i) = self.index.get(key) {
            return Some(i);
        }
        if self.lanes.len() >= MAX_LANES {
            self.undrawn += 1;
            return None;
        }
        let quota = self.limits.resolve(key).cloned();
        let series = match &quota {
            None => Vec::new(),
            Some(Quota::Gcra(l)) => vec![Series::new("tokens".into(), l.burst())],
            Some(Quota::Tiered(t)) => t
                .tiers()
                .iter()
                .enumerate()
                .map(|(i, tier)| Series::new(format!("T{} used", i + 1), tier.limit()))
                .collect(),
            Some(Quota::Concurrency(c)) => vec![Series::new("slots in use".into(), c.max())],
            Some(Quota::Calendar(c)) => vec![Series::new("used".into(), c.count())],
            Some(_) => Vec::new(),
        };
        let tiers = quota
            .as_ref()
            .and_then(Quota::as_tiered)
            .map_or(0, |t| t.tiers().len());
        let mut lane = Lane {
            label: format!("{}={}", key.name().as_str(), key.id()),
            key: key.clone(),
            quota,
            series,
            groups: Vec::new(),
            open: None,
            totals: Counts::default(),
            bands: Vec::new(),
            entries: vec![None; tiers],
        };
        // Before its first request a bucket is fresh (the backend already holds the request).
        let start = self.axis.start();
        let fresh = lane.values(None, start);
        let x = self.axis.x(start);
        for (s, v) in lane.series.iter_mut().zip(fresh) {
            s.push(x, v);
        }
        self.lanes.push(lane);
        self.index.insert(key.clone(), self.lanes.len() - 1);
        Some(self.lanes.len() - 1)
    }

    /// Samples every lane at trace time `t` (the backend's clock must be there).
    fn sample_all(&mut self, t: u64) {
        for lane in &mut self.lanes {
            lane.sample(&self.axis, &self.backend, t);
        }
    }

    /// Adds `mark` to the lane of `key`, sampling the lane's state just after it.
    fn mark(&mut self, key: &BucketKey, mut mark: Mark) {
        let Some(i) = self.lane(key) else {
            return;
        };
        let lane = &mut self.lanes[i];
        lane.sample(&self.axis, &self.backend, mark.at);
        lane.note_activations(&self.backend);
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
            Some(Quota::Calendar(c)) => {
                // The units used in the period in force (an overrun drawn at the count).
                let state = backend.and_then(|b| b.calendar_state(&self.key));
                let (_, end) = c.period_at(now);
                out[0] = calendar::used(state, end, now).min(c.count());
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
                "GCRA: burst {}, {} per {}",
                l.burst(),
                l.count(),
                seconds(l.period_us())
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
            Some(_) => "a limit of another shape".into(),
        }
    }
}

/// A UTC instant as an axis label: the day (`2028-02-01`) when ticks are days apart, else the
/// day and the minute (`2028-01-31 12:00`).
fn date_label(us: u64, step: u64) -> String {
    let text = calendar::instant_text(us);
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

const STYLE: &str = "
svg{font:12px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;background:#fff}
.title{font-size:16px;font-weight:600}
.muted{fill:#666}
.grid{stroke:#eee}
.axis{stroke:#999}
.break{stroke:#bbb;fill:none;stroke-dasharray:3 3}
.lanebox{fill:#fafafa;stroke:#e3e3e3}
.area{fill:#cfe3f7}
.curve{fill:none;stroke:#2b6cb0;stroke-width:1.5}
.cap{stroke:#2b6cb0;stroke-dasharray:2 3;stroke-width:.8}
.renewal{stroke:#2f855a;stroke-dasharray:4 3;stroke-width:1.2}
.active{fill:#c6f0d0}
.cooldown{fill:#f8cccc}
.ok{fill:#2f9e44}
.part{fill:#f08c00}
.deny{stroke:#e03131;stroke-width:2.2}
.blocked{fill:#fff;stroke:#868e96;stroke-width:1.5}
.other{fill:#1c7ed6}
.qp{fill:#1b3f66}
.retry{stroke:#e03131;stroke-width:1;stroke-dasharray:4 2}
.reset{stroke:#adb5bd;stroke-width:1;stroke-dasharray:1 3}
.tick{fill:#e03131}
.agg rect{stroke:none}
.agg-deny{fill:#e03131}
.agg .blocked{fill:#adb5bd}
[data-line]:hover,.agg:hover{opacity:.7}
";

impl Timeline {
    /// The drawing as a standalone SVG document.
    pub fn svg(&self) -> String {
        let mut out = String::new();
        self.write_svg(&mut out);
        out
    }

    fn height(&self) -> f64 {
        TOP + self
            .lanes
            .iter()
            .map(|l| l.height() + LANE_GAP)
            .sum::<f64>()
            + 30.0
    }

    fn write_svg(&self, out: &mut String) {
        let width = self.axis.width;
        let height = self.height();
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0}" viewBox="0 0 {width} {height:.0}" data-axis="{}" data-us-per-px="{}" data-bin-px="{BIN_PX}"><style>{STYLE}</style>"#,
            self.axis.describe(),
            self.axis.us_per_px,
        );
        let _ = write!(
            out,
            r#"<text x="12" y="24" class="title">{}</text>"#,
            esc(&self.title)
        );
        let requests: u64 = self.lanes.iter().map(|l| l.totals.count).sum();
        let _ = write!(
            out,
            r#"<text x="12" y="44" class="muted">{} trace lines, {} decisions on {} buckets{} · hover a mark for its numbers</text>"#,
            self.lines,
            requests,
            self.lanes.len(),
            if self.undrawn > 0 {
                format!(
                    " (and {} decisions on buckets past the first {MAX_LANES}, not drawn)",
                    self.undrawn
                )
            } else {
                String::new()
            }
        );
        self.write_legend(out, 12.0, 66.0);
        self.write_axis(out, height);
        let mut y = TOP;
        for lane in &self.lanes {
            self.write_lane(out, lane, y);
            y += lane.height() + LANE_GAP;
        }
        out.push_str("</svg>");
    }

    fn write_legend(&self, out: &mut String, x: f64, y: f64) {
        let items: [(&str, &str); 8] = [
            ("ok", "allowed"),
            ("part", "partly granted"),
            ("deny", "denied by this limit"),
            ("blocked", "allowed here, batch refused elsewhere"),
            ("other", "refund / reset / release"),
            ("retry", "retry_after"),
            ("active", "tier active"),
            ("cooldown", "tier cooling down"),
        ];
        let mut cx = x;
        for (class, label) in items {
            match class {
                "deny" => {
                    let _ = write!(out, r#"<g class="deny">{}</g>"#, cross(cx + 5.0, y, 4.0));
                }
                "retry" => {
                    let _ = write!(
                        out,
                        r#"<line class="retry" x1="{cx}" x2="{}" y1="{y}" y2="{y}"/>"#,
                        cx + 12.0
                    );
                }
                "active" | "cooldown" => {
                    let _ = write!(
                        out,
                        r#"<rect class="{class}" x="{cx}" y="{}" width="12" height="10"/>"#,
                        y - 5.0
                    );
                }
                _ => {
                    let _ = write!(
                        out,
                        r#"<circle class="{class}" cx="{}" cy="{y}" r="4.5"/>"#,
                        cx + 5.0
                    );
                }
            }
            let _ = write!(
                out,
                r#"<text x="{}" y="{}">{label}</text>"#,
                cx + 16.0,
                y + 4.0
            );
            cx += 24.0 + 6.5 * label.len() as f64;
        }
    }

    fn write_axis(&self, out: &mut String, height: f64) {
        let top = TOP - 12.0;
        let _ = write!(
            out,
            r#"<line class="axis" x1="{LEFT}" x2="{}" y1="{top}" y2="{top}"/>"#,
            self.axis.width - RIGHT
        );
        // Ticks every 1, 2 or 5 x 10^k microseconds, at least 90 px apart; on a dated trace,
        // every whole minute, hour or day (in UTC) that far apart, at least 130 px.
        let min_us = self.axis.us_per_px * if self.dated { 130.0 } else { 90.0 };
        let mut step = 1u64;
        if self.dated {
            const MIN: u64 = 60_000_000;
            step = [
                1, 5, 15, 30, 60, 180, 360, 720, 1440, 2880, 10_080, 20_160, 43_200,
            ]
            .iter()
            .map(|m| m * MIN)
            .find(|&s| s as f64 >= min_us)
            .unwrap_or(86_400 * 365 * 1_000_000);
        } else {
            'find: for exp in 0..19u32 {
                for m in [1u64, 2, 5] {
                    let s = m.saturating_mul(10u64.saturating_pow(exp));
                    if s as f64 >= min_us {
                        step = s;
                        break 'find;
                    }
                }
            }
        }
        // Dated ticks fall on whole UTC instants, counted from 1970, not from the trace's start.
        let origin = if self.dated { EPOCH_US } else { 0 };
        // A label too close to the last one (across a cut) is left out.
        let mut last_label = f64::NEG_INFINITY;
        let gap = if self.dated { 110.0 } else { 60.0 };
        for (k, p) in self.axis.pieces.iter().enumerate() {
            let mut t = (origin + p.start)
                .div_ceil(step)
                .saturating_mul(step)
                .saturating_sub(origin);
            while t <= p.end {
                let x = self.axis.x(t);
                if x - last_label < gap {
                    t = match t.checked_add(step) {
                        Some(n) => n,
                        None => break,
                    };
                    continue;
                }
                last_label = x;
                let label = if self.dated {
                    date_label(EPOCH_US.saturating_add(t), step)
                } else {
                    seconds(t)
                };
                let _ = write!(
                    out,
                    r#"<line class="grid" x1="{x:.1}" x2="{x:.1}" y1="{top}" y2="{:.0}"/><text x="{x:.1}" y="{}" text-anchor="middle" class="muted" data-tick-us="{t}">{label}</text>"#,
                    height - 24.0,
                    top - 5.0,
                );
                t = match t.checked_add(step) {
                    Some(n) => n,
                    None => break,
                };
            }
            if let Some(next) = self.axis.pieces.get(k + 1) {
                let x = self.axis.piece_end_x(p) + BREAK_PX / 2.0;
                let idle = next.start - p.end;
                let _ = write!(
                    out,
                    r#"<g class="cut" data-from-us="{}" data-to-us="{}"><title>{} cut out: nothing happens and every bucket is fresh</title><path class="break" d="M{:.1} {top} V{:.0} M{:.1} {top} V{:.0}"/><text x="{x:.1}" y="{}" text-anchor="middle" class="muted">⋯ {} ⋯</text></g>"#,
                    p.end,
                    next.start,
                    seconds(idle),
                    x - 3.0,
                    height - 24.0,
                    x + 3.0,
                    height - 24.0,
                    height - 10.0,
                    seconds(idle),
                );
            }
        }
    }

    fn write_lane(&self, out: &mut String, lane: &Lane, y: f64) {
        let right = self.axis.width - RIGHT;
        let _ = write!(
            out,
            r#"<g class="lane" data-key="{}" data-kind="{}"><rect class="lanebox" x="4" y="{:.1}" width="{:.1}" height="{:.1}" rx="4"/><text x="12" y="{:.1}" font-weight="600">{}</text><text x="{LEFT}" y="{:.1}" class="muted">{}</text>"#,
            esc(&lane.label),
            match lane.quota {
                None => "unlimited",
                Some(Quota::Gcra(_)) => "gcra",
                Some(Quota::Tiered(_)) => "tiered",
                Some(Quota::Concurrency(_)) => "concurrency",
                Some(Quota::Calendar(_)) => "calendar",
                Some(_) => "other",
            },
            y,
            self.axis.width - 8.0,
            lane.height(),
            y + 15.0,
            esc(&lane.label),
            y + 15.0,
            esc(&lane.quota_text())
        );
        // A calendar quota's renewals, across the lane: the count is whole again from each.
        for piece in &self.axis.pieces {
            for t in lane.renewals(piece.start, piece.end) {
                let x = self.axis.x(t);
                let _ = write!(
                    out,
                    r#"<line class="renewal" data-renewal-us="{t}" x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}"><title>renews {}</title></line>"#,
                    y + HEAD_H,
                    y + lane.height() - 4.0,
                    calendar::instant_text(EPOCH_US.saturating_add(t))
                );
            }
        }
        let mut row_y = y + HEAD_H;
        for (i, series) in lane.series.iter().enumerate() {
            let base = row_y + ROW_H - 6.0;
            let scale = (ROW_H - 14.0) / series.max.max(1) as f64;
            // Tier activations behind the curve.
            for band in lane.bands.iter().filter(|b| b.tier == i) {
                let a = self.axis.x(band.entry);
                let b = self.axis.x(band.entry.saturating_add(band.active));
                let c = self
                    .axis
                    .x(band.entry.saturating_add(band.active + band.cooldown));
                let _ = write!(
                    out,
                    r#"<rect class="active" x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" data-tier="{}" data-entry-us="{}"><title>T{} active {} to {}</title></rect>"#,
                    row_y + 2.0,
                    (b - a).max(0.8),
                    ROW_H - 6.0,
                    i + 1,
                    band.entry,
                    i + 1,
                    seconds(band.entry),
                    seconds(band.entry + band.active)
                );
                if band.cooldown > 0 {
                    let _ = write!(
                        out,
                        r#"<rect class="cooldown" x="{b:.1}" y="{:.1}" width="{:.1}" height="{:.1}"><title>T{} cooling down until {}</title></rect>"#,
                        row_y + 2.0,
                        (c - b).max(0.8),
                        ROW_H - 6.0,
                        i + 1,
                        seconds(band.entry + band.active + band.cooldown)
                    );
                }
            }
            let _ = write!(
                out,
                r#"<g class="series" data-series="{i}" data-y0="{base:.3}" data-px-per-unit="{scale}" data-max="{}"><text x="{}" y="{:.1}" text-anchor="end" class="muted">{} (0..{})</text><line class="cap" x1="{LEFT}" x2="{right}" y1="{:.1}" y2="{:.1}"/>"#,
                series.max,
                LEFT - 8.0,
                row_y + ROW_H / 2.0 + 4.0,
                esc(&series.label),
                series.max,
                base - series.max as f64 * scale,
                base - series.max as f64 * scale,
            );
            let d = step_path(&series.columns, base, scale);
            if let (Some(first), Some(last)) = (series.columns.first(), series.columns.last()) {
                let (first_x, last_x) = (first.x, last.x);
                let _ = write!(
                    out,
                    r#"<path class="area" d="{d} H{:.1} V{base:.1} H{first_x:.1} Z"/><path class="curve" d="{d} H{:.1}"/>"#,
                    right.max(last_x),
                    right.max(last_x),
                );
            }
            // The exact value just after each request drawn on its own.
            for group in lane.all_groups() {
                for m in group.marks() {
                    if let Some(&v) = m.after.get(i) {
                        let _ = write!(
                            out,
                            r#"<circle class="qp" data-line="{}" data-series="{i}" data-value="{v}" cx="{:.2}" cy="{:.2}" r="1.8"><title>line {}: {} {v} after the request</title></circle>"#,
                            m.line,
                            self.axis.x(m.at),
                            base - v as f64 * scale,
                            m.line,
                            esc(&series.label)
                        );
                    }
                }
            }
            out.push_str("</g>");
            row_y += ROW_H;
        }
        let mid = row_y + MARKS_H / 2.0;
        let _ = write!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end" class="muted">requests</text>"#,
            LEFT - 8.0,
            mid + 4.0
        );
        for group in lane.all_groups() {
            match group {
                Group::Aggregate(counts) => self.write_aggregate(out, counts, mid),
                Group::Marks(marks) => {
                    for (k, m) in marks.iter().enumerate() {
                        let offset = (k as f64 - (marks.len() - 1) as f64 / 2.0) * 10.0;
                        self.write_mark(out, lane, m, mid + offset);
                    }
                }
            }
        }
        out.push_str("</g>");
    }

    fn write_mark(&self, out: &mut String, lane: &Lane, m: &Mark, mid: f64) {
        let x = self.axis.x(m.at);
        let mut attrs = format!(
            r#"data-line="{}" data-op="{}" data-limit="{}" data-id="{}" data-at-us="{}" data-class="{}""#,
            m.line,
            m.op,
            esc(lane.key.name().as_str()),
            esc(&lane.key.id().to_string()),
            m.at,
            m.class.css()
        );
        let mut title = format!(
            "line {} at {}: {} {}",
            m.line,
            seconds(m.at),
            m.op,
            lane.label
        );
        if m.class != Class::Other || m.op == "refund" {
            let _ = write!(
                attrs,
                r#" data-allowed="{}" data-batch-allowed="{}" data-cost="{}" data-granted="{}" data-remaining="{}" data-retry-after-us="{}" data-reset-after-us="{}""#,
                m.allowed, m.batch_allowed, m.cost, m.granted, m.remaining, m.retry_us, m.reset_us
            );
            let cost = if m.min_cost == m.cost {
                format!("cost {}", m.cost)
            } else {
                format!("cost {}..{}", m.min_cost, m.cost)
            };
            let _ = write!(
                title,
                "\n{cost}: {}\ngranted {}, remaining {}\nretry_after {}, reset_after {}",
                match m.class {
                    Class::Allowed => "allowed",
                    Class::Partial => "partly granted",
                    Class::Denied => "denied by this limit",
                    Class::Blocked => "allowed here, refused by the batch",
                    Class::Other => "done",
                },
                m.granted,
                m.remaining,
                seconds(m.retry_us),
                seconds(m.reset_us)
            );
        }
        if let Some(by) = &m.refused_by {
            let by = by.as_str();
            let _ = write!(attrs, r#" data-refused-by="{}""#, esc(by));
            let _ = write!(title, "\nthe batch was refused by {by}");
        }
        if let Some(t) = &m.tiers {
            let units: Vec<String> = t.units().iter().map(u64::to_string).collect();
            let _ = write!(
                attrs,
                r#" data-tiers="{}" data-tier="{}" data-burst="{}""#,
                units.join(","),
                t.tier,
                t.burst
            );
            let _ = write!(
                title,
                "\nper tier [{}], tier {}{}",
                units.join(", "),
                t.tier,
                if t.burst { ", burst" } else { "" }
            );
        }
        if m.skipped {
            attrs.push_str(r#" data-skipped="true""#);
            title.push_str("\nskipped (another rule already denied)");
        }
        if m.lease {
            attrs.push_str(r#" data-lease="true""#);
            title.push_str("\ntook a slot");
        }
        let _ = write!(out, r#"<g {attrs}><title>{}</title>"#, esc(&title));
        let r = 3.5 + (m.cost.max(1) as f64).log2().min(5.0);
        match (m.class, m.op) {
            (Class::Denied, _) => {
                // Where retry_after and reset_after point.
                if m.retry_us > 0 {
                    let rx = self.axis.x(m.at.saturating_add(m.retry_us));
                    let _ = write!(
                        out,
                        r#"<line class="retry" data-at-us="{}" x1="{x:.2}" x2="{rx:.2}" y1="{mid:.1}" y2="{mid:.1}"/><path class="tick" d="M{rx:.2} {:.1} l-3 -5 h6 z"/>"#,
                        m.at.saturating_add(m.retry_us),
                        mid - 2.0
                    );
                }
                if m.reset_us > 0 {
                    let sx = self.axis.x(m.at.saturating_add(m.reset_us));
                    let _ = write!(
                        out,
                        r#"<line class="reset" data-at-us="{}" x1="{x:.2}" x2="{sx:.2}" y1="{:.1}" y2="{:.1}"/>"#,
                        m.at.saturating_add(m.reset_us),
                        mid + 5.0,
                        mid + 5.0
                    );
                }
                let _ = write!(out, r#"<g class="deny">{}</g>"#, cross(x, mid, r));
            }
            (_, "check") => {
                let _ = write!(
                    out,
                    r#"<rect class="{}" x="{:.2}" y="{:.2}" width="{:.2}" height="{:.2}"/>"#,
                    m.class.css(),
                    x - r,
                    mid - r,
                    2.0 * r,
                    2.0 * r
                );
            }
            (Class::Other, _) => {
                let _ = write!(
                    out,
                    r#"<rect class="other" x="{:.2}" y="{:.1}" width="3" height="{:.1}"/>"#,
                    x - 1.5,
                    mid - 9.0,
                    18.0
                );
            }
            _ => {
                let _ = write!(
                    out,
                    r#"<circle class="{}" cx="{x:.2}" cy="{mid:.1}" r="{r:.2}"/>"#,
                    m.class.css()
                );
            }
        }
        out.push_str("</g>");
    }

    fn write_aggregate(&self, out: &mut String, c: &Counts, mid: f64) {
        let counts = [
            (Class::Allowed, c.allowed),
            (Class::Partial, c.partial),
            (Class::Denied, c.denied),
            (Class::Blocked, c.blocked),
            (Class::Other, c.other),
        ];
        let x = self.axis.x(c.from);
        let h = MARKS_H - 8.0;
        let _ = write!(
            out,
            r#"<g class="agg" data-count="{}" data-allowed="{}" data-partial="{}" data-denied="{}" data-blocked="{}" data-other="{}" data-from-us="{}" data-to-us="{}" data-first-line="{}" data-last-line="{}"><title>{} decisions, lines {} to {}, {} to {}&#10;allowed {}, partly granted {}, denied {}, refused by the batch {}, other {}&#10;units granted {}</title>"#,
            c.count,
            c.allowed,
            c.partial,
            c.denied,
            c.blocked,
            c.other,
            c.from,
            c.to,
            c.first_line,
            c.last_line,
            c.count,
            c.first_line,
            c.last_line,
            seconds(c.from),
            seconds(c.to),
            c.allowed,
            c.partial,
            c.denied,
            c.blocked,
            c.other,
            c.granted
        );
        let mut top = mid - h / 2.0;
        for (class, n) in counts {
            if n == 0 {
                continue;
            }
            let part = h * n as f64 / c.count as f64;
            let css = match class {
                Class::Denied => "agg-deny",
                c => c.css(),
            };
            let _ = write!(
                out,
                r#"<rect class="{css}" x="{:.2}" y="{top:.2}" width="{:.2}" height="{part:.2}"/>"#,
                x - 1.0,
                (BIN_PX - 1.0).max(2.0)
            );
            top += part;
        }
        out.push_str("</g>");
    }

    /// The drawing inside a self-contained HTML page: the SVG, a summary table per bucket, and
    /// a panel that shows a hovered mark's numbers. No network fetch, no external script or font.
    pub fn html(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width\"><title>{}</title><style>{PAGE_STYLE}</style></head><body><div class=\"scroll\">",
            esc(&self.title)
        );
        self.write_svg(&mut out);
        out.push_str(r#"</div><table class="summary"><thead><tr><th>bucket</th><th>limit</th><th>decisions</th><th>allowed</th><th>partly</th><th>denied</th><th>refused by the batch</th><th>units granted</th></tr></thead><tbody>"#);
        for lane in &self.lanes {
            let t = &lane.totals;
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&lane.label),
                esc(&lane.quota_text()),
                t.count,
                t.allowed,
                t.partial,
                t.denied,
                t.blocked,
                t.granted
            );
        }
        out.push_str("</tbody></table>");
        out.push_str(r#"<pre id="tip" hidden></pre><script>"#);
        out.push_str(PAGE_SCRIPT);
        out.push_str("</script></body></html>\n");
        out
    }
}

const PAGE_STYLE: &str = "
body{font:14px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px;color:#222}
table.summary{border-collapse:collapse;margin-top:12px}
table.summary td,table.summary th{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.summary td:first-child,table.summary td:nth-child(2),table.summary th{text-align:left}
.scroll{overflow-x:auto}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:6px 8px;border-radius:4px;font:12px ui-monospace,monospace;margin:0;max-width:480px;white-space:pre-wrap}
";

/// Shows the hovered mark's `<title>` in a panel that follows the pointer (the title is also
/// the browser's own tooltip, so the page works without it).
const PAGE_SCRIPT: &str = r#"
(function () {
  var tip = document.getElementById('tip');
  var svg = document.querySelector('svg');
  if (!tip || !svg) { return; }
  svg.addEventListener('mousemove', function (e) {
    var el = e.target.closest('[data-line], .agg, .cut, rect[data-entry-us]');
    var title = el && el.querySelector('title');
    if (!title) { tip.hidden = true; return; }
    tip.textContent = title.textContent;
    tip.hidden = false;
    var x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = Math.max(0, x) + 'px';
    tip.style.top = (e.clientY + 14) + 'px';
  });
  svg.addEventListener('mouseleave', function () { tip.hidden = true; });
})();
"#;

/// A step line through a series' columns: each value holds until the next column; a column
/// with several values draws its first, lowest, highest and last.
fn step_path(columns: &[Column], base: f64, scale: f64) -> String {
    let y = |v: u64| base - v as f64 * scale;
    let mut d = String::new();
    for c in columns {
        if d.is_empty() {
            let _ = write!(d, "M{:.1} {:.1}", c.x, y(c.first));
        } else {
            let _ = write!(d, " H{:.1} V{:.1}", c.x, y(c.first));
        }
        if (c.low, c.high, c.last) != (c.first, c.first, c.first) {
            let _ = write!(d, " V{:.1} V{:.1} V{:.1}", y(c.low), y(c.high), y(c.last));
        }
    }
    d
}

/// An x of half-size `r` at (`x`, `y`).
fn cross(x: f64, y: f64, r: f64) -> String {
    format!(
        r#"<path d="M{:.2} {:.2} L{:.2} {:.2} M{:.2} {:.2} L{:.2} {:.2}"/>"#,
        x - r,
        y - r,
        x + r,
        y + r,
        x - r,
        y + r,
        x + r,
        y - r
    )
}
