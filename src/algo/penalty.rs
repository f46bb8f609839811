//! Penalty ladders: a key that gathers `after` counted units within a sliding `within` window is
//! banned, and each ban lasts longer than the one before: the n-th
//! `min(base * factor^(n-1), max)` microseconds, plus an optional jitter, while the ladder's
//! level falls one step for each quiet `forget_after` after a ban ends. The contract is
//! `docs/penalties.md`; this file is its whole rule, on integers, for every store (the script
//! will mirror it function for function).
//!
//! A limit's penalty counts at admission (`LimitsBuilder::penalty`, `backend/kit/penalty.rs`);
//! the reservations of outcome rules (`admit`, `settle`) are wired in the next step of issue 81.
#![cfg_attr(not(test), allow(dead_code))]

use std::collections::VecDeque;

pub(crate) mod budget;

/// The most units a ladder may count before a ban (`after`): the state keeps one entry per
/// counted event of the window, at most this many.
pub const MAX_AFTER: u64 = 1_000;

/// The longest ban (`max`), in microseconds: 100 days. Below it, a ban times a factor of at most
/// [`MAX_FACTOR`] stays below 2^53, so the script's doubles compute every step exactly.
pub const MAX_BAN_US: u64 = 100 * 86_400 * 1_000_000;

/// The largest factor between two bans in a row.
pub const MAX_FACTOR: u64 = 1_000;

/// The longest window and quiet time (`within`, `forget_after`): 100 days, as a ban.
pub const MAX_WINDOW_US: u64 = MAX_BAN_US;

/// Why a ladder was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PenaltyError {
    /// `after` is 0 or above 1,000.
    #[error("`after` must be 1 to {MAX_AFTER} counted units, not {0}")]
    After(u64),
    /// `within` or `forget_after` is 0 or above 100 days.
    #[error("`{0}` must be above 0 and at most 100 days")]
    Window(&'static str),
    /// `base` is 0, or `max` is below `base` or above 100 days.
    #[error("a ban lasts from `base` (above 0) to `max` (at least `base`, at most 100 days)")]
    Length,
    /// `factor` is 0 or above 1,000.
    #[error("`factor` must be 1 to {MAX_FACTOR}, not {0}")]
    Factor(u64),
    /// `jitter` is above 1,000 per mille.
    #[error("`jitter` must be 0 to 100% (0 to 1,000 per mille), not {0} per mille")]
    Jitter(u64),
}

/// A ladder: when a key is banned and for how long. All times in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ladder {
    after: u64,
    within_us: u64,
    base_us: u64,
    factor: u64,
    max_us: u64,
    forget_after_us: u64,
    jitter_permille: u64,
}

impl Ladder {
    /// A ladder banning a key that gathers `after` counted units within `within_us`, the first
    /// ban `base_us` long, each next one `factor` times the one before, never above `max_us`;
    /// no jitter, and a level that falls one step each `within_us` of quiet after a ban (set
    /// another with [`forget_after`](Self::forget_after)).
    pub fn new(
        after: u64,
        within_us: u64,
        base_us: u64,
        factor: u64,
        max_us: u64,
    ) -> Result<Self, PenaltyError> {
        if after == 0 || after > MAX_AFTER {
            return Err(PenaltyError::After(after));
        }
        check_window("within", within_us)?;
        if base_us == 0 || max_us < base_us || max_us > MAX_BAN_US {
            return Err(PenaltyError::Length);
        }
        if factor == 0 || factor > MAX_FACTOR {
            return Err(PenaltyError::Factor(factor));
        }
        Ok(Ladder {
            after,
            within_us,
            base_us,
            factor,
            max_us,
            forget_after_us: within_us,
            jitter_permille: 0,
        })
    }

    /// The quiet time after a ban's end that lowers the level one step (then each further one).
    pub fn forget_after(mut self, us: u64) -> Result<Self, PenaltyError> {
        check_window("forget_after", us)?;
        self.forget_after_us = us;
        Ok(self)
    }

    /// A jitter of up to `permille` thousandths of each ban added to it (never beyond `max`),
    /// the same on every store for the same key, level and start.
    pub fn jitter(mut self, permille: u64) -> Result<Self, PenaltyError> {
        if permille > 1_000 {
            return Err(PenaltyError::Jitter(permille));
        }
        self.jitter_permille = permille;
        Ok(self)
    }

    /// The counted units that make a ban.
    pub fn after(&self) -> u64 {
        self.after
    }

    /// The window the units are counted in, in microseconds.
    pub fn within_us(&self) -> u64 {
        self.within_us
    }

    /// The first ban's length, in microseconds.
    pub fn base_us(&self) -> u64 {
        self.base_us
    }

    /// How many times longer each ban is than the one before.
    pub fn factor(&self) -> u64 {
        self.factor
    }

    /// The longest ban, in microseconds.
    pub fn max_us(&self) -> u64 {
        self.max_us
    }

    /// The jitter's most, in thousandths of a ban.
    pub fn jitter_permille(&self) -> u64 {
        self.jitter_permille
    }

    /// The quiet time after a ban that lowers the level one step, in microseconds.
    pub fn forget_after_us(&self) -> u64 {
        self.forget_after_us
    }

    /// The length of the n-th ban (`level` n, from 1) without jitter:
    /// `min(base * factor^(n-1), max)`, exact (each step a whole multiple: nothing rounds).
    pub fn ban_us(&self, level: u32) -> u64 {
        let mut ban = self.base_us;
        for _ in 1..level {
            if ban >= self.max_us || self.factor == 1 {
                break;
            }
            ban = ban.saturating_mul(self.factor);
        }
        ban.min(self.max_us)
    }

    /// The level at `now` of a key whose level was `level` at `since` (the end of its last ban
    /// or its last step down): one step lower for each whole `forget_after` between, and the
    /// time the next step counts from.
    pub fn decayed(&self, level: u32, since: u64, now: u64) -> (u32, u64) {
        if level == 0 || now <= since {
            return (level, since);
        }
        let steps = (now - since) / self.forget_after_us;
        let down = u32::try_from(steps).unwrap_or(u32::MAX).min(level);
        (level - down, since + u64::from(down) * self.forget_after_us)
    }
}

fn check_window(field: &'static str, us: u64) -> Result<(), PenaltyError> {
    if us == 0 || us > MAX_WINDOW_US {
        return Err(PenaltyError::Window(field));
    }
    Ok(())
}

/// The jitter of a ban of `ban_us` at `level` starting at `start`, for the key whose canonical
/// bytes are `key`: up to `permille` thousandths of the ban, from a hash every store computes
/// alike (a polynomial over the bytes, then the level and the start, modulo 2^31 - 1: every
/// step below 2^53, so the script's doubles compute it exactly).
pub fn jitter(key: &[u8], level: u32, start: u64, ban_us: u64, permille: u64) -> u64 {
    let span = ban_us / 1_000 * permille + ban_us % 1_000 * permille / 1_000;
    if span == 0 {
        return 0;
    }
    const P: u64 = (1 << 31) - 1;
    let mix = |h: u64, byte: u64| (h * 131 + byte) % P;
    let mut h = key.iter().fold(7, |h, &b| mix(h, u64::from(b)));
    h = mix(h, u64::from(level) % P);
    // The start's decimal digits, as the script reads a number's text.
    let mut digits = itoa::Buffer::new();
    h = digits
        .format(start)
        .bytes()
        .fold(h, |h, b| mix(h, u64::from(b)));
    h % (span + 1)
}

/// A key's penalty state: its level (bans so far, less the steps it has fallen), the time its
/// next step down counts from, the end of its ban (0: none), the window's counted units by the
/// time their requests were admitted, and the reservations of its requests in flight (each
/// at most `after` entries: a ban clears both, and admission stops at `after` units).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PenaltyState {
    /// Bans so far, less the steps the level has fallen.
    pub level: u32,
    /// When the level's next step down counts from (the end of the last ban, or its last step).
    pub since: u64,
    /// The end of the ban in force (0: none).
    pub banned_until: u64,
    /// The window's counted units, `(time, units)`, oldest first.
    pub events: VecDeque<(u64, u64)>,
    /// The requests in flight, in the order they were admitted.
    pub reservations: Vec<Reservation>,
}

/// A request in flight: its reservation, until its outcome says what it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reservation {
    /// The request's id (its lease), which its outcome names.
    pub id: u64,
    /// When it was admitted: what it counts, it counts at this time.
    pub at: u64,
    /// Its largest weight (at most `after`).
    pub units: u64,
}

/// What a key's request meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Not banned.
    Free,
    /// Banned until this time.
    Banned {
        /// The ban's end.
        until: u64,
        /// The level of the ban.
        level: u32,
    },
}

/// What a request's admission met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: its units are reserved at its time until its outcome settles them.
    Admitted,
    /// The key is banned until `until`, at `level`: nothing reserved.
    Banned {
        /// The ban's end.
        until: u64,
        /// The ban's level.
        level: u32,
    },
    /// The window holds `after` units counted or reserved already: refused, nothing
    /// reserved; at `until` the oldest of them have left it and a request fits again (or
    /// sooner, when reservations in flight count less).
    Full {
        /// When the window's oldest units leave it.
        until: u64,
    },
}

/// What counting units did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tally {
    /// Counted; the window holds this many counted units now (below `after`).
    Counted(u64),
    /// These units made `after`: the key is banned from now until `until`, at `level`.
    Banned {
        /// The ban's end.
        until: u64,
        /// The ban's level.
        level: u32,
    },
    /// Nothing counted: the key was banned, or the request's reservation is no longer in the
    /// window (it left it, or a ban since cleared it).
    Ignored,
}

/// A key's standing under its limit's penalty ladder.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PenaltyStanding {
    /// The id, in its canonical text.
    pub id: String,
    /// Its level now (its bans so far, less the steps its quiet time took off): its next ban
    /// is the ladder's `level + 1`-th.
    pub level: u32,
    /// When it is banned: how long until the ban ends; `None` when it is not.
    pub banned_for: Option<std::time::Duration>,
}

impl PenaltyState {
    /// A key banned until `until` at level 1, its window empty: what an instance's fallback
    /// knows of a ban the store answered (the store's answer carries the ban's end, not its
    /// level, so the next ban the fallback decides is at least the ladder's second).
    pub(crate) fn banned_until(until: u64) -> Self {
        PenaltyState {
            level: 1,
            since: until,
            banned_until: until,
            ..PenaltyState::default()
        }
    }

    /// The key's standing at `now`, its level decayed first (a read: it may be written back).
    pub fn standing(&mut self, ladder: &Ladder, now: u64) -> Standing {
        if now < self.banned_until {
            return Standing::Banned {
                until: self.banned_until,
                level: self.level,
            };
        }
        (self.level, self.since) = ladder.decayed(self.level, self.since, now);
        Standing::Free
    }

    /// The standing of the key `id` whose state this is at `now` (a read: nothing is
    /// written back), its level decayed as a decision would; `None` for a key that neither is
    /// banned nor has a level (only counted units in its window).
    pub(crate) fn standing_of(
        &mut self,
        ladder: &Ladder,
        id: String,
        now: u64,
    ) -> Option<PenaltyStanding> {
        let banned_for = match self.standing(ladder, now) {
            Standing::Banned { until, .. } => Some(std::time::Duration::from_micros(until - now)),
            Standing::Free => None,
        };
        (banned_for.is_some() || self.level > 0).then_some(PenaltyStanding {
            id,
            level: self.level,
            banned_for,
        })
    }

    /// Admits the request `id` at `now` that could count up to `reserve` units (its largest
    /// weight; at most `after` is reserved): refused while banned or while the window holds
    /// `after` units counted or reserved. So requests in flight together never pass the
    /// ladder: a thousand at once on a key of `after` 10 admit 10 (of weight 1).
    pub fn admit(&mut self, ladder: &Ladder, (id, reserve): (u64, u64), now: u64) -> Admission {
        if let Standing::Banned { until, level } = self.standing(ladder, now) {
            return Admission::Banned { until, level };
        }
        self.drop_old(ladder, now);
        let held = self.units() + self.reservations.iter().map(|r| r.units).sum::<u64>();
        if held >= ladder.after {
            return Admission::Full {
                until: self.room_at(ladder, held),
            };
        }
        let units = reserve.min(ladder.after);
        if units > 0 {
            self.reservations.push(Reservation { id, at: now, units });
        }
        Admission::Admitted
    }

    /// Settles at `now` the request `id`: its outcome counts `counted` units (at most its
    /// reservation; 0 for an outcome that does not count) at its admission's time, and when
    /// the window's counted units reach `after`, the key is banned from `now`. A request no
    /// longer in flight (its reservation left the window, or a ban cleared it) counts nothing.
    pub fn settle(
        &mut self,
        ladder: &Ladder,
        key: &[u8],
        id: u64,
        counted: u64,
        now: u64,
    ) -> Tally {
        let banned = matches!(self.standing(ladder, now), Standing::Banned { .. });
        self.drop_old(ladder, now);
        let Some(i) = self.reservations.iter().position(|r| r.id == id) else {
            return Tally::Ignored;
        };
        let r = self.reservations.remove(i);
        let counted = counted.min(r.units);
        if banned {
            return Tally::Ignored;
        }
        if counted == 0 {
            return Tally::Counted(self.units());
        }
        self.add(r.at, counted);
        self.tally(ladder, key, now)
    }

    /// Counts `units` (a counted outcome's weight, with no reservation before it; 0 counts
    /// nothing) at `now` for the key whose canonical bytes are `key`: the window's units
    /// older than `within` dropped, these added, and when they reach `after`, a ban (the
    /// level one up, the window cleared).
    pub fn count(&mut self, ladder: &Ladder, key: &[u8], units: u64, now: u64) -> Tally {
        if let Standing::Banned { .. } = self.standing(ladder, now) {
            return Tally::Ignored;
        }
        self.drop_old(ladder, now);
        let units = units.min(ladder.after);
        if units == 0 {
            return Tally::Counted(self.units());
        }
        self.add(now, units);
        self.tally(ladder, key, now)
    }

    /// The window's counted units (reservations in flight left out).
    pub fn units(&self) -> u64 {
        self.events.iter().map(|&(_, u)| u).sum()
    }

    /// The counted units still in the window `(now - within, now]` at `now`, for a read that
    /// writes nothing back (those older have left it, though the state still holds them).
    pub fn units_at(&self, ladder: &Ladder, now: u64) -> u64 {
        let start = now.checked_sub(ladder.within_us);
        let live = |t: u64| start.is_none_or(|start| t > start);
        self.events
            .iter()
            .filter(|&&(t, _)| live(t))
            .map(|&(_, u)| u)
            .sum()
    }

    /// Bans the key at `now` when the window's counted units reach `after`.
    fn tally(&mut self, ladder: &Ladder, key: &[u8], now: u64) -> Tally {
        let total = self.units();
        if total < ladder.after {
            return Tally::Counted(total);
        }
        self.level = self.level.saturating_add(1);
        let ban = ladder.ban_us(self.level);
        let ban =
            (ban + jitter(key, self.level, now, ban, ladder.jitter_permille)).min(ladder.max_us);
        self.banned_until = now.saturating_add(ban);
        self.since = self.banned_until;
        self.events.clear();
        self.reservations.clear();
        Tally::Banned {
            until: self.banned_until,
            level: self.level,
        }
    }

    /// Drops what left the window `(now - within, now]`: counted units and reservations.
    fn drop_old(&mut self, ladder: &Ladder, now: u64) {
        if let Some(start) = now.checked_sub(ladder.within_us) {
            while self.events.front().is_some_and(|&(t, _)| t <= start) {
                self.events.pop_front();
            }
            self.reservations.retain(|r| r.at > start);
        }
    }

    /// Adds `units` counted at `at` to the window, in time order (merged with units of the
    /// same time).
    fn add(&mut self, at: u64, units: u64) {
        let i = self.events.partition_point(|&(t, _)| t < at);
        match self.events.get_mut(i) {
            Some((t, u)) if *t == at => *u += units,
            _ => self.events.insert(i, (at, units)),
        }
    }

    /// When the window holding `held` units has room for a request again: when enough of
    /// its oldest units, counted or reserved, have left it.
    fn room_at(&self, ladder: &Ladder, mut held: u64) -> u64 {
        let mut all: Vec<(u64, u64)> = self.events.iter().copied().collect();
        all.extend(self.reservations.iter().map(|r| (r.at, r.units)));
        all.sort_unstable();
        for (at, units) in all {
            held -= units;
            if held < ladder.after {
                return at.saturating_add(ladder.within_us);
            }
        }
        0
    }
}

#[cfg(test)]
mod tests;
