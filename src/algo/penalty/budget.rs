//! The attacker's budget of a ladder: the most units one key can have counted in a span (a
//! day), whatever it does, so a replay can say "at most N failed logins per account per day".
//!
//! The best a key can do is bursts: from a ban's end `e` (or the span's start) with its window
//! empty, `after - 1` units at `e`, `e + within`, ... (the most the sliding window lets through
//! without a ban), and then a ban at some time `x` (one unit more, while the last burst is in
//! the window): `(after - 1) * (floor((x - e) / within) + 1) + 1` units, the level at `x`
//! decayed from `e`. Banning one `within` later inside one step of decay never pays: a key can
//! always spend that `within` on one more safe burst first (the lemma
//! `V(t) >= after - 1 + V(t + within)`), so the only times worth trying are `e`, each step of
//! decay the span reaches and the first burst after it, and the span's last burst (whose ban
//! ends past the span). `tests.rs` holds this to an exhaustive search of every way to ask and
//! to the same recursion trying every time. Bans are taken without jitter (jitter only lengthens them).

use std::collections::HashMap;

use super::Ladder;

/// The most units a key can have counted in a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// The units (exactly the most, or a bound above it when `exact` is false).
    pub units: u64,
    /// Whether `units` is the most a key can get (a ladder whose bans are so short that a
    /// span holds more than [`MAX_BANS`] of them gets a bound above it instead).
    pub exact: bool,
}

/// The most bans a path of the search follows before the budget falls back to its bound.
pub const MAX_BANS: usize = 2_000;

/// The most states the search visits before it falls back to its bound.
const MAX_STATES: usize = 100_000;

impl Ladder {
    /// The most units one key can have counted within `span_us` (86,400,000,000 for a day),
    /// starting with no units and level 0 (the best start a key can have: any window of the
    /// span starts no better).
    pub fn budget(&self, span_us: u64) -> Budget {
        let mut search = Search {
            ladder: self,
            span: span_us,
            cap: level_cap(self, span_us),
            memo: HashMap::new(),
        };
        match search.best(0, 0, 0) {
            Some(units) => Budget { units, exact: true },
            None => Budget {
                units: self.bound(span_us),
                exact: false,
            },
        }
    }

    /// A bound above the budget: each stretch between two bans lets `after - 1` units
    /// through per `within` it lasts (and one more for its ban), and the span holds at most
    /// one ban per `base` it lasts.
    fn bound(&self, span_us: u64) -> u64 {
        let windows = span_us.div_ceil(self.within_us).saturating_add(1);
        let bans = (span_us / self.base_us).saturating_add(1);
        (self.after - 1)
            .saturating_mul(windows.saturating_add(bans))
            .saturating_add(bans)
    }
}

struct Search<'a> {
    ladder: &'a Ladder,
    span: u64,
    /// The level above which every level decides alike ([`level_cap`]).
    cap: u32,
    memo: HashMap<(u64, u32), u64>,
}

impl Search<'_> {
    /// The most units from a ban's end at `e` (the window empty) at `level` to the span's
    /// end; `None` when the search grew past its bounds.
    fn best(&mut self, e: u64, level: u32, depth: usize) -> Option<u64> {
        if e >= self.span {
            return Some(0);
        }
        if let Some(&units) = self.memo.get(&(e, level)) {
            return Some(units);
        }
        if depth > MAX_BANS || self.memo.len() > MAX_STATES {
            return None;
        }
        let l = self.ladder;
        let mut best = 0;
        for at in self.choices(e, level) {
            let now_level = level.saturating_sub(steps(at - e, l.forget_after_us)) + 1;
            let units = ((at - e) / l.within_us + 1) * (l.after - 1) + 1;
            let end = at.saturating_add(l.ban_us(now_level));
            let rest = self.best(end, now_level.min(self.cap), depth + 1)?;
            best = best.max(units + rest);
        }
        self.memo.insert((e, level), best);
        Some(best)
    }

    /// The times worth banning at from `e` at `level`: `e`; each step of decay the span
    /// reaches (`e + j * forget_after`) and the first burst after it; and the span's last
    /// burst (a later one inside a step whose ban ends past the span: the last one beats it).
    fn choices(&self, e: u64, level: u32) -> Vec<u64> {
        let (l, span) = (self.ladder, self.span);
        let w = l.within_us;
        let last = e + (span - 1 - e) / w * w;
        let mut out = vec![e, last];
        for step in 1..=u64::from(level) {
            let Some(at) = step
                .checked_mul(l.forget_after_us)
                .and_then(|wait| wait.checked_add(e))
                .filter(|&at| at < span)
            else {
                break;
            };
            let before = e + (at - e) / w * w;
            out.push(at);
            if let Some(after) = before.checked_add(w).filter(|&t| t < span && before < at) {
                out.push(after);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Levels above the one whose ban is `max` and that cannot fall below it within the span
/// decide alike.
fn level_cap(l: &Ladder, span: u64) -> u32 {
    let mut saturated = 1u32;
    while l.ban_us(saturated) < l.max_us && saturated < 64 {
        saturated += 1;
    }
    let fall = u32::try_from(span / l.forget_after_us).unwrap_or(u32::MAX);
    saturated.saturating_add(fall).saturating_add(1)
}

/// Whole `forget_after`s in `quiet`, as a level's steps down.
fn steps(quiet: u64, forget_after: u64) -> u32 {
    u32::try_from(quiet / forget_after).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
