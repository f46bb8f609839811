//! The suggestion models (`docs/replay.md`, "Suggestions"): for each shape of the candidate's
//! limit, what each key asked of it in the log, and the limit sized so that no more than the
//! target share of keys would be refused. One home: the plan's tallies call [`Model::arrive`]
//! for the candidate's first decision of each request and [`Model::suggest`] once at the end.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use super::suggested::{
    Heavy, Suggested, SuggestedBudget, SuggestedCount, SuggestedMax, SuggestedTier, SuggestedTiers,
};
use crate::key::Id;
use crate::quota::SizedAs;

/// The grid of counts (and of a fair share's bursts) a suggestion is taken from: the
/// candidate's number times `2^(k/4)` for k in `GRID_LOW..=GRID_HIGH` (a quarter of it to 64
/// times it, steps of 19%).
const GRID_LOW: i32 = -8;
const GRID_HIGH: i32 = 24;
const GRID: usize = (GRID_HIGH - GRID_LOW + 1) as usize;

/// The most arrivals a key's model keeps in flight or inside one tier's window: past it, a
/// concurrency key's count stops growing (the suggestion says "at least") and a window's
/// oldest arrival is merged into the next (which can only raise what the key asked).
const MAX_KEPT: usize = 1 << 16;

/// How many keys the plan names as the heaviest, per limit.
const HEAVIEST: usize = 10;

/// One request's arrival in a model: its cost and how long the log says it was served.
#[derive(Clone, Copy)]
pub(crate) struct Arrival {
    pub(crate) cost: u64,
    pub(crate) duration_us: u64,
}

/// The candidate's limit a suggestion is sized for, with the state that belongs to the whole
/// limit (a fair share's budget is one stream, every id's requests together).
pub(crate) enum Model {
    Gcra(Box<Sizing>),
    Calendar(Arc<crate::algo::calendar::CalendarQuota>),
    /// A concurrency limit's or an adaptive limit's `max`; a request holds its slot for its
    /// logged duration (the layer renews its lease while it lives).
    Slots {
        max: u64,
        adaptive: bool,
    },
    Tiers(Arc<crate::algo::tiers::TieredLimit>),
    Budget(Box<Budget>),
}

/// A key's state in its limit's model: allocated at its first arrival under the candidate.
pub(crate) enum KeyModel {
    /// The burst it needed at the candidate's rate (in units), the grid points at which it was
    /// refused, and its buckets while one is not full again.
    Gcra {
        needed_burst: u64,
        refused: u64,
        live: Option<Box<Live>>,
    },
    /// The end of the period its last units fell in, the units asked in it, and the most
    /// asked in any period.
    Calendar([u64; 3]),
    /// The ends of its requests in flight, and the most in flight at once.
    InFlight {
        ends: BinaryHeap<Reverse<u64>>,
        most: u64,
    },
    /// Per tier: its arrivals inside the tier's window, their units, and the most units in
    /// any window.
    Windows(Vec<Window>),
    /// A fair share's id: the units it asked over the log.
    Units(u64),
}

/// A key's buckets in the GCRA model: at the candidate's count with no burst bound, and at
/// each grid count with the candidate's burst. Times are microseconds since the replay's start
/// times the bucket's count (so every step is a whole number).
pub(crate) struct Live {
    tat: u128,
    grid: [u128; GRID],
}

/// The candidate's GCRA numbers a suggestion is sized from.
#[derive(Clone, Copy)]
pub(crate) struct Sizing {
    burst: u64,
    count: u64,
    period_us: u64,
    grid: [u64; GRID],
}

/// One tier's window of a key.
#[derive(Default)]
pub(crate) struct Window {
    arrivals: VecDeque<(u64, u64)>,
    units: u64,
    most: u64,
}

/// A fair share's budget: every id's requests as one stream, through buckets at a grid of
/// counts (the candidate's burst) and a grid of bursts (the candidate's count), counting the
/// requests each would refuse.
pub(crate) struct Budget {
    sizing: Sizing,
    bursts: [u64; GRID],
    count_tats: [u128; GRID],
    burst_tats: [u128; GRID],
    refused_at_count: [u64; GRID],
    refused_at_burst: [u64; GRID],
    requests: u64,
}

fn grid_of(n: u64) -> [u64; GRID] {
    let mut grid = [0; GRID];
    for (i, k) in (GRID_LOW..=GRID_HIGH).enumerate() {
        grid[i] = ((n as f64) * 2f64.powf(f64::from(k) / 4.0)).ceil().max(1.0) as u64;
    }
    grid
}

impl Sizing {
    fn of(limit: &crate::algo::gcra::Limit) -> Sizing {
        Sizing {
            burst: limit.burst(),
            count: limit.count(),
            period_us: limit.period_us(),
            grid: grid_of(limit.count()),
        }
    }
}

/// What a limit's suggestion is: the plan's fields for it.
#[derive(Default)]
pub(crate) struct Suggestions {
    pub(crate) suggested: Option<Suggested>,
    pub(crate) suggested_count: Option<SuggestedCount>,
    pub(crate) suggested_max: Option<SuggestedMax>,
    pub(crate) suggested_tiers: Option<SuggestedTiers>,
    pub(crate) suggested_budget: Option<SuggestedBudget>,
    pub(crate) heaviest: Vec<Heavy>,
}

impl Model {
    /// The model of the candidate's default `quota`.
    pub(crate) fn of(quota: &crate::quota::Quota) -> Model {
        match quota.sized_as() {
            SizedAs::Rate(limit) => Model::Gcra(Box::new(Sizing::of(limit))),
            SizedAs::Period(quota) => Model::Calendar(Arc::new(quota.clone())),
            SizedAs::Slots { max, adaptive } => Model::Slots { max, adaptive },
            SizedAs::Tiers(tiers) => Model::Tiers(Arc::new(tiers.clone())),
            SizedAs::Budget(budget) => {
                let sizing = Sizing::of(budget);
                Model::Budget(Box::new(Budget {
                    sizing,
                    bursts: grid_of(sizing.burst),
                    count_tats: [0; GRID],
                    burst_tats: [0; GRID],
                    refused_at_count: [0; GRID],
                    refused_at_burst: [0; GRID],
                    requests: 0,
                }))
            }
        }
    }

    /// One arrival at `now_us` (Unix microseconds; the replay started at `base_us`) of a key
    /// whose model is `key`.
    pub(crate) fn arrive(
        &mut self,
        key: &mut Option<Box<KeyModel>>,
        now_us: u64,
        base_us: u64,
        a: Arrival,
    ) {
        match self {
            Model::Gcra(sizing) => {
                let key = key.get_or_insert_with(|| {
                    Box::new(KeyModel::Gcra {
                        needed_burst: 0,
                        refused: 0,
                        live: None,
                    })
                });
                if let KeyModel::Gcra {
                    needed_burst,
                    refused,
                    live,
                } = key.as_mut()
                {
                    let t = now_us.saturating_sub(base_us);
                    arrive_gcra(sizing, live, needed_burst, refused, t, a.cost);
                }
            }
            Model::Calendar(quota) => {
                let key = key.get_or_insert_with(|| Box::new(KeyModel::Calendar([0; 3])));
                if let KeyModel::Calendar([end, used, most]) = key.as_mut() {
                    // Uncapped: a refused request counts too, the suggestion asks what a key
                    // wanted.
                    if now_us >= *end {
                        *end = quota.period_at(now_us).1;
                        *used = 0;
                    }
                    *used = used.saturating_add(a.cost);
                    *most = (*most).max(*used);
                }
            }
            Model::Slots { .. } => {
                let key = key.get_or_insert_with(|| {
                    Box::new(KeyModel::InFlight {
                        ends: BinaryHeap::new(),
                        most: 0,
                    })
                });
                if let KeyModel::InFlight { ends, most } = key.as_mut() {
                    arrive_in_flight(ends, most, now_us, a.duration_us);
                }
            }
            Model::Tiers(tiers) => {
                let key = key.get_or_insert_with(|| {
                    Box::new(KeyModel::Windows(
                        tiers.tiers().iter().map(|_| Window::default()).collect(),
                    ))
                });
                if let KeyModel::Windows(windows) = key.as_mut() {
                    for (window, tier) in windows.iter_mut().zip(tiers.tiers()) {
                        window.arrive(now_us, tier.window_us(), a.cost);
                    }
                }
            }
            Model::Budget(budget) => {
                budget.arrive(now_us.saturating_sub(base_us), a.cost);
                let key = key.get_or_insert_with(|| Box::new(KeyModel::Units(0)));
                if let KeyModel::Units(units) = key.as_mut() {
                    *units = units.saturating_add(a.cost);
                }
            }
        }
    }

    /// Drops what a key's model no longer needs at `now_us`: GCRA buckets full again (the
    /// same as fresh ones), requests no longer in flight, arrivals out of every window. Memory
    /// follows live keys.
    pub(crate) fn sweep(&self, key: &mut KeyModel, now_us: u64, base_us: u64) {
        match (self, key) {
            (Model::Gcra(sizing), KeyModel::Gcra { live, .. }) => {
                let t = u128::from(now_us.saturating_sub(base_us));
                let idle = live.as_ref().is_some_and(|live| {
                    live.tat <= t * u128::from(sizing.count)
                        && live
                            .grid
                            .iter()
                            .zip(sizing.grid)
                            .all(|(&tat, count)| tat <= t * u128::from(count))
                });
                if idle {
                    *live = None;
                }
            }
            (Model::Slots { .. }, KeyModel::InFlight { ends, .. }) => {
                while ends.peek().is_some_and(|end| end.0 <= now_us) {
                    ends.pop();
                }
                ends.shrink_to_fit();
            }
            (Model::Tiers(tiers), KeyModel::Windows(windows)) => {
                for (window, tier) in windows.iter_mut().zip(tiers.tiers()) {
                    window.forget(now_us, tier.window_us());
                    window.arrivals.shrink_to_fit();
                }
            }
            _ => {}
        }
    }

    /// The suggestion over `keys` (each key's model, when it arrived under the candidate):
    /// no more than `target` of them refused.
    pub(crate) fn suggest<'a>(
        &self,
        keys: impl Iterator<Item = (&'a Id, Option<&'a KeyModel>)>,
        target: f64,
    ) -> Suggestions {
        let (needs, tier_most) = needs(keys);
        let mut out = Suggestions::default();
        if needs.is_empty() {
            return out;
        }
        let n = needs.len();
        // The most keys that may see a refusal, and the need of the heaviest key left.
        let may = ((target * n as f64).floor() as usize).min(n - 1);
        let mut sorted: Vec<u64> = needs.iter().map(|k| k.1).collect();
        sorted.sort_unstable();
        let at = sorted[n - 1 - may];
        let keys = n as u64;
        match self {
            Model::Gcra(sizing) => {
                out.suggested = Some(suggest_gcra(sizing, &needs, at, may, target));
            }
            Model::Calendar(quota) => {
                out.suggested_count = Some(SuggestedCount {
                    target,
                    keys,
                    count: at,
                    period: quota.period().as_str().to_owned(),
                    candidate_count: quota.count(),
                });
            }
            Model::Slots { max, adaptive } => {
                out.suggested_max = Some(SuggestedMax {
                    target,
                    keys,
                    max: at,
                    candidate_max: *max,
                    adaptive: *adaptive,
                    at_least: at >= MAX_KEPT as u64,
                });
            }
            Model::Tiers(tiers) => {
                out.suggested_tiers = Some(suggest_tiers(tiers, &tier_most, may, target));
            }
            Model::Budget(budget) => out.suggested_budget = Some(budget.suggest(target)),
        }
        // The heaviest: the keys above what is suggested (a fair share's: the ids that asked
        // the most, which it exists to share out among), most first.
        let above = if matches!(self, Model::Budget(_)) {
            0
        } else {
            at
        };
        out.heaviest = heaviest(needs, above);
        out
    }
}

/// A need of a key: its id, what it needed in the shape's own unit, and (GCRA) the grid
/// points at which it was refused.
type Need<'a> = (&'a Id, u64, u64);

/// Each key's need, and for burst tiers each key's most units per tier.
fn needs<'a>(
    keys: impl Iterator<Item = (&'a Id, Option<&'a KeyModel>)>,
) -> (Vec<Need<'a>>, Vec<Vec<u64>>) {
    let mut needs: Vec<Need<'a>> = Vec::new();
    let mut tier_most: Vec<Vec<u64>> = Vec::new();
    for (id, model) in keys {
        match model {
            Some(KeyModel::Gcra {
                needed_burst,
                refused,
                ..
            }) if *needed_burst > 0 => needs.push((id, *needed_burst, *refused)),
            Some(KeyModel::Calendar([_, _, most]) | KeyModel::InFlight { most, .. }) => {
                needs.push((id, *most, 0))
            }
            Some(KeyModel::Units(units)) => needs.push((id, *units, 0)),
            Some(KeyModel::Windows(windows)) => {
                needs.push((id, windows.first().map_or(0, |w| w.most), 0));
                tier_most.push(windows.iter().map(|w| w.most).collect());
            }
            _ => {}
        }
    }
    (needs, tier_most)
}

/// The keys that needed more than `above`, most first, at most [`HEAVIEST`].
fn heaviest(mut needs: Vec<Need<'_>>, above: u64) -> Vec<Heavy> {
    needs.retain(|k| k.1 > above);
    needs.sort_by_cached_key(|k| (Reverse(k.1), k.0.to_string()));
    needs
        .iter()
        .take(HEAVIEST)
        .map(|k| Heavy {
            id: k.0.to_string(),
            needed: k.1,
        })
        .collect()
}

/// One arrival of `cost` units at `t` (microseconds since the start) in a key's GCRA model.
fn arrive_gcra(
    sizing: &Sizing,
    live: &mut Option<Box<Live>>,
    needed_burst: &mut u64,
    refused: &mut u64,
    t: u64,
    cost: u64,
) {
    let live = live.get_or_insert_with(|| {
        Box::new(Live {
            tat: 0,
            grid: [0; GRID],
        })
    });
    let (t, cost, period, burst) = (
        u128::from(t),
        u128::from(cost),
        u128::from(sizing.period_us),
        u128::from(sizing.burst),
    );
    let now = t * u128::from(sizing.count);
    live.tat = live.tat.max(now) + cost * period;
    let needed = (live.tat - now).div_ceil(period);
    *needed_burst = (*needed_burst).max(u64::try_from(needed).unwrap_or(u64::MAX));
    for (i, (tat, count)) in live.grid.iter_mut().zip(sizing.grid).enumerate() {
        let now = t * u128::from(count);
        let after = (*tat).max(now) + cost * period;
        if after - now > burst * period {
            *refused |= 1 << i;
        } else {
            *tat = after;
        }
    }
}

/// One request in flight from `now_us` for `hold_us`: a request ended at or before `now_us`
/// gave its slot back; one served at once held it for its instant.
fn arrive_in_flight(
    ends: &mut BinaryHeap<Reverse<u64>>,
    most: &mut u64,
    now_us: u64,
    hold_us: u64,
) {
    while ends.peek().is_some_and(|end| end.0 <= now_us) {
        ends.pop();
    }
    let mut live = ends.len() as u64 + 1;
    if hold_us > 0 {
        if ends.len() < MAX_KEPT {
            ends.push(Reverse(now_us.saturating_add(hold_us)));
        } else {
            live = MAX_KEPT as u64;
        }
    }
    *most = (*most).max(live);
}

impl Window {
    /// Forgets the arrivals out of the window at `now_us` (a window is closed: an arrival at
    /// `t` still counts at `t + window`).
    fn forget(&mut self, now_us: u64, window_us: u64) {
        while let Some(&(t, units)) = self.arrivals.front() {
            if t.saturating_add(window_us) >= now_us {
                break;
            }
            self.arrivals.pop_front();
            self.units = self.units.saturating_sub(units);
        }
    }

    fn arrive(&mut self, now_us: u64, window_us: u64, cost: u64) {
        self.forget(now_us, window_us);
        if self.arrivals.len() >= MAX_KEPT
            && let Some((_, oldest)) = self.arrivals.pop_front()
            && let Some(next) = self.arrivals.front_mut()
        {
            // Counted as long as the next one is: never less than the key asked.
            next.1 = next.1.saturating_add(oldest);
        }
        self.arrivals.push_back((now_us, cost));
        self.units = self.units.saturating_add(cost);
        self.most = self.most.max(self.units);
    }
}

impl Budget {
    fn arrive(&mut self, t: u64, cost: u64) {
        self.requests += 1;
        let s = &self.sizing;
        let (t, cost, period) = (u128::from(t), u128::from(cost), u128::from(s.period_us));
        for i in 0..GRID {
            let now = t * u128::from(s.grid[i]);
            let after = self.count_tats[i].max(now) + cost * period;
            if after - now > u128::from(s.burst) * period {
                self.refused_at_count[i] += 1;
            } else {
                self.count_tats[i] = after;
            }
            let now = t * u128::from(s.count);
            let after = self.burst_tats[i].max(now) + cost * period;
            if after - now > u128::from(self.bursts[i]) * period {
                self.refused_at_burst[i] += 1;
            } else {
                self.burst_tats[i] = after;
            }
        }
    }

    fn suggest(&self, target: f64) -> SuggestedBudget {
        let may = (target * self.requests as f64).floor() as u64;
        let first = |refused: &[u64; GRID], grid: &[u64; GRID]| {
            (0..GRID).find(|&i| refused[i] <= may).map(|i| grid[i])
        };
        SuggestedBudget {
            target,
            requests: self.requests,
            count: first(&self.refused_at_count, &self.sizing.grid),
            burst: first(&self.refused_at_burst, &self.bursts),
            period: crate::time::format_duration_us(self.sizing.period_us),
            candidate_burst: self.sizing.burst,
            candidate_count: self.sizing.count,
        }
    }
}

fn suggest_gcra(
    sizing: &Sizing,
    needs: &[Need<'_>],
    burst: u64,
    may: usize,
    target: f64,
) -> Suggested {
    let n = needs.len();
    // The smallest grid point a key was never refused at (GRID: refused at every one).
    let mut points: Vec<usize> = needs
        .iter()
        .map(|k| {
            (0..GRID)
                .rev()
                .take_while(|&i| k.2 & (1 << i) == 0)
                .last()
                .unwrap_or(GRID)
        })
        .collect();
    points.sort_unstable();
    Suggested {
        target,
        keys: n as u64,
        burst,
        count: sizing.grid.get(points[n - 1 - may]).copied(),
        period: crate::time::format_duration_us(sizing.period_us),
        candidate_burst: sizing.burst,
        candidate_count: sizing.count,
    }
}

fn suggest_tiers(
    tiers: &crate::algo::tiers::TieredLimit,
    most: &[Vec<u64>],
    may: usize,
    target: f64,
) -> SuggestedTiers {
    let n = most.len();
    let tiers = tiers
        .tiers()
        .iter()
        .enumerate()
        .map(|(i, tier)| {
            let mut sorted: Vec<u64> = most.iter().map(|m| m[i]).collect();
            sorted.sort_unstable();
            SuggestedTier {
                window: crate::time::format_duration_us(tier.window_us()),
                limit: sorted[n - 1 - may],
                candidate_limit: tier.limit(),
            }
        })
        .collect();
    SuggestedTiers {
        target,
        keys: n as u64,
        tiers,
    }
}

#[cfg(test)]
mod tests;
