//! A bucket's lane: what it draws (its series of quantities, their columns, the tiers'
//! bands, the requests' marks, drawn one by one or counted) and how its quantities are read
//! from the backend's state at any instant.

use super::*;

/// What a mark stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
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
    pub(super) fn css(self) -> &'static str {
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
pub(super) struct Mark {
    pub(super) line: usize,
    pub(super) at: u64,
    pub(super) op: &'static str,
    pub(super) class: Class,
    pub(super) allowed: bool,
    pub(super) batch_allowed: bool,
    pub(super) cost: u64,
    pub(super) min_cost: u64,
    pub(super) granted: u64,
    pub(super) remaining: u64,
    pub(super) retry_us: u64,
    pub(super) reset_us: u64,
    pub(super) refused_by: Option<LimitName>,
    pub(super) tiers: Option<TierGrant>,
    pub(super) skipped: bool,
    pub(super) lease: bool,
    /// Each quantity of the lane just after the line (the first `series.len()`).
    pub(super) after: [u64; MAX_SERIES],
}

/// The marks that share a place on the axis (within [`BIN_PX`] of the first).
#[derive(Debug, Clone)]
pub(super) enum Group {
    /// Up to [`STACK`] marks, drawn each on its own.
    Marks(Vec<Mark>),
    /// More: drawn as one mark with their counts.
    Aggregate(Counts),
}

/// Counts of marks, for an aggregate mark and a lane's summary.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Counts {
    pub(super) count: u64,
    pub(super) allowed: u64,
    pub(super) partial: u64,
    pub(super) denied: u64,
    pub(super) blocked: u64,
    pub(super) other: u64,
    pub(super) granted: u64,
    pub(super) from: u64,
    pub(super) to: u64,
    pub(super) first_line: usize,
    pub(super) last_line: usize,
}

impl Counts {
    pub(super) fn add(&mut self, m: &Mark) {
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
    pub(super) fn add(&mut self, m: Mark) {
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

    pub(super) fn marks(&self) -> &[Mark] {
        match self {
            Group::Marks(m) => m,
            Group::Aggregate(_) => &[],
        }
    }
}

/// One drawn quantity of a lane.
#[derive(Debug, Clone)]
pub(super) struct Series {
    pub(super) label: String,
    pub(super) max: u64,
    /// Per pixel column touched, in time order: the value at the column's first point, the
    /// lowest and highest, and the last (which holds until the next column's first).
    pub(super) columns: Vec<Column>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Column {
    pub(super) x: f64,
    pub(super) first: u64,
    pub(super) low: u64,
    pub(super) high: u64,
    pub(super) last: u64,
}

impl Series {
    pub(super) fn new(label: String, max: u64) -> Series {
        Series {
            label,
            max,
            columns: Vec::new(),
        }
    }

    pub(super) fn push(&mut self, x: f64, v: u64) {
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

    pub(super) fn last(&self) -> u64 {
        self.columns.last().map_or(0, |c| c.last)
    }
}

/// A tier's activation: entered at `entry`, active for `active`, then cooling for `cooldown`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Band {
    pub(super) tier: usize,
    pub(super) entry: u64,
    pub(super) active: u64,
    pub(super) cooldown: u64,
}

/// A ban of a key by its limit's penalty ladder: from the request that started it to its end
/// (trace time), at its level.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ban {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) level: u32,
}

/// One bucket.
pub(super) struct Lane {
    pub(super) key: BucketKey,
    /// Its region (0 in a run in no region).
    pub(super) region: usize,
    /// A region's share bucket of a limit across regions: drawn with its share of the rate.
    pub(super) share: bool,
    pub(super) label: String,
    pub(super) quota: Option<Quota>,
    pub(super) series: Vec<Series>,
    /// Closed groups of marks, in time order, and the open one with its first mark's x.
    pub(super) groups: Vec<Group>,
    pub(super) open: Option<(f64, Group)>,
    pub(super) totals: Counts,
    pub(super) bands: Vec<Band>,
    /// Per tier, the last entry seen (so each activation is one band).
    pub(super) entries: Vec<Option<u64>>,
    /// A limit with a penalty ladder: the limits, to read the key's standing under it.
    pub(super) penalty: Option<std::sync::Arc<Limits>>,
    /// The key's bans, in time order.
    pub(super) bans: Vec<Ban>,
}

impl Lane {
    /// Each quantity of this bucket at trace time `t` (the first `series.len()`), as the
    /// backend's state says (`None`: a fresh bucket's).
    pub(super) fn values(&self, backend: Option<&MemoryBackend>, t: u64) -> [u64; MAX_SERIES] {
        let now = EPOCH_US.saturating_add(t);
        let mut out = [0; MAX_SERIES];
        // A penalty ladder's level: the lane's last quantity.
        if let (Some(limits), Some(b), Some(i)) =
            (&self.penalty, backend, self.series.len().checked_sub(1))
        {
            let standing = b.penalty_standing(limits, &self.key, now);
            out[i] = standing.map_or(0, |s| u64::from(s.level));
        }
        match self.quota.as_ref().map(Quota::shape_ref) {
            None => {}
            Some(ShapeRef::Gcra(_)) if self.share => {
                if let Some(share) = backend.and_then(|b| b.share_now(&self.key)) {
                    out[0] = share.tokens;
                    out[1] = share.floor.0.saturating_add(share.part.0);
                }
            }
            Some(ShapeRef::Gcra(l)) => {
                let tat = backend.and_then(|b| b.tat(&self.key));
                out[0] = gcra::check(l, tat, now, 0).map_or(0, |o| o.remaining);
            }
            Some(ShapeRef::Tiered(limit)) => {
                let state = backend
                    .and_then(|b| b.tier_state(&self.key))
                    .unwrap_or_default();
                for (i, v) in out.iter_mut().enumerate().take(limit.tiers().len()) {
                    *v = tiers::tier_at(limit, &state, i, now).1;
                }
            }
            Some(ShapeRef::Concurrency(_)) => {
                out[0] = backend.map_or(0, |b| b.leases(&self.key) as u64);
            }
            Some(ShapeRef::Adaptive(a)) => {
                out[0] = backend.map_or(0, |b| b.leases(&self.key) as u64);
                let state = backend
                    .and_then(|b| b.adaptive_state(&self.key))
                    .unwrap_or_default();
                out[1] = a.slots_at(&state, now).max();
            }
            Some(ShapeRef::Calendar(c)) => {
                // The units used in the period in force (an overrun drawn at the count).
                let state = backend.and_then(|b| b.calendar_state(&self.key));
                let (_, end) = c.period_at(now);
                out[0] = calendar::used(state, end, now).min(c.count());
            }
            Some(ShapeRef::FairShare(s)) => {
                let pool = backend.and_then(|b| b.fair_share_state(self.key.name()));
                let tat = pool.as_ref().map(|p| p.budget_tat()).filter(|&t| t != 0);
                out[0] = gcra::check(s.budget(), tat, now, 0).map_or(0, |o| o.remaining);
            }
        }
        out
    }

    /// The renewals of a calendar quota inside `[from, to]` (trace time), at most `MAX`.
    pub(super) fn renewals(&self, from: u64, to: u64) -> Vec<u64> {
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

    pub(super) fn sample(&mut self, axis: &Axis, backend: &MemoryBackend, t: u64) {
        let values = self.values(Some(backend), t);
        let x = axis.x(t);
        for (s, v) in self.series.iter_mut().zip(values) {
            s.push(x, v);
        }
    }

    /// Records the tier activations a request made (a tier is entered only by a request).
    pub(super) fn note_activations(&mut self, backend: &MemoryBackend) {
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

    /// Records a ban a request at trace time `t` started (a key is banned only by a request).
    pub(super) fn note_bans(&mut self, backend: &MemoryBackend, t: u64) {
        const MAX: usize = 10_000;
        let Some(limits) = &self.penalty else {
            return;
        };
        let standing = backend.penalty_standing(limits, &self.key, EPOCH_US.saturating_add(t));
        let Some((left, level)) = standing.and_then(|s| Some((s.banned_for?, s.level))) else {
            return;
        };
        let end = t.saturating_add(u64::try_from(left.as_micros()).unwrap_or(u64::MAX));
        if self.bans.len() < MAX && self.bans.last().is_none_or(|b| b.end != end) {
            self.bans.push(Ban {
                start: t,
                end,
                level,
            });
        }
    }

    /// The groups of marks, the open one last.
    pub(super) fn all_groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter().chain(self.open.as_ref().map(|(_, g)| g))
    }

    pub(super) fn height(&self) -> f64 {
        HEAD_H + ROW_H * self.series.len() as f64 + MARKS_H
    }

    pub(super) fn quota_text(&self) -> String {
        let shape = self.shape_text();
        let ladder = self
            .penalty
            .as_ref()
            .and_then(|l| l.penalty(self.key.name()));
        match ladder {
            Some(l) => format!(
                "{shape} · penalty: {} within {}, bans of {} x{} up to {}",
                l.after(),
                seconds(l.within_us()),
                seconds(l.base_us()),
                l.factor(),
                seconds(l.max_us())
            ),
            None => shape,
        }
    }

    fn shape_text(&self) -> String {
        match self.quota.as_ref().map(Quota::shape_ref) {
            None => "unlimited".into(),
            Some(ShapeRef::Gcra(l)) => format!(
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
            Some(ShapeRef::Tiered(t)) => {
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
            Some(ShapeRef::Concurrency(c)) => format!(
                "concurrency: {} in flight, lease {}",
                c.max(),
                seconds(c.lease_us())
            ),
            Some(ShapeRef::Calendar(c)) => format!(
                "calendar: {} per {}{}, at {} {}",
                c.count(),
                c.period().as_str(),
                c.anchor()
                    .map_or(String::new(), |a| format!(", renewing on day {a}")),
                c.renews_at(),
                c.zone_name()
            ),
            Some(ShapeRef::FairShare(s)) => format!(
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
            Some(ShapeRef::Adaptive(a)) => format!(
                "adaptive concurrency: {}, lease {}",
                a.adaptive(),
                seconds(a.slots().lease_us())
            ),
        }
    }
}
