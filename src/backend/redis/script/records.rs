//! The records of a GCRA bucket, a concurrency key, a calendar key and a tiered key: each
//! shape's arguments on the general path, one function each (`encode` calls one per
//! transaction, as it does the fair share's and the adaptive limit's in their own files).

use fred::prelude::Value;

use super::{
    Call, KIND_CALENDAR, KIND_CHARGE, KIND_CONCURRENCY, KIND_GCRA, KIND_PENALTY, KIND_RANGE,
    KIND_TIERED, MAX_TIME_US, calendar_costs, calendar_fields, int, lease_ids, mode_code, shares,
};
use crate::algo::calendar::CalendarQuota;
use crate::algo::concurrency::ConcurrencyLimit;
use crate::algo::gcra::Limit;
use crate::algo::penalty::Ladder;
use crate::algo::tiers::TieredLimit;
use crate::backend::{BucketTx, Mode};
use crate::key::KeyText;

/// A GCRA transaction: a spend or check, a range (its lower end added) or a charge; a share
/// bucket's record when it carries a floor.
pub(super) fn push_gcra(
    args: &mut Vec<Value>,
    tx: &BucketTx<'_>,
    limit: &Limit,
    share_call: shares::ShareCall,
) {
    let charge = tx.mode == Mode::Charge;
    let range = tx.min_cost < tx.cost && !charge;
    let kind = match (charge, range) {
        (true, _) => KIND_CHARGE,
        (_, true) => KIND_RANGE,
        _ => KIND_GCRA,
    };
    if let Some(floor) = tx.floor {
        shares::push_share(args, tx, limit, floor, kind, share_call);
    } else {
        args.extend([
            Value::Integer(kind),
            int(limit.emission_interval_us()),
            int(limit.burst_offset_us()),
            int(limit.burst()),
            // A charge may exceed what the script's doubles hold exactly: it takes at most
            // the units that fit within the debt bound, below 2^53.
            int(tx.cost.min(MAX_TIME_US)),
            mode_code(tx.mode),
            int(limit.debt_offset_us()),
        ]);
    }
    if range {
        args.push(int(tx.min_cost));
    }
}

/// A penalty's companion: its mode and cost, its reservation id as text (any u64; `0`: the
/// cost counts at admission), the ladder, and the key's canonical text (its jitter's hash).
pub(super) fn push_penalty(args: &mut Vec<Value>, tx: &BucketTx<'_>, ladder: &Ladder) {
    let text = KeyText::canonical(tx.key);
    args.extend([
        Value::Integer(KIND_PENALTY),
        mode_code(tx.mode),
        int(tx.cost.min(ladder.after())),
        Value::String(itoa::Buffer::new().format(tx.lease).into()),
        int(ladder.after()),
        int(ladder.within_us()),
        int(ladder.base_us()),
        int(ladder.factor()),
        int(ladder.max_us()),
        int(ladder.forget_after_us()),
        int(ladder.jitter_permille()),
        Value::Bytes(text.bytes().to_vec().into()),
    ]);
}

/// A concurrency transaction: its slot, the limit, and its lease ids as text (an id is any
/// u64, beyond what the script's doubles hold exactly; a renewal names every lease it renews,
/// separated by spaces).
pub(super) fn push_concurrency(args: &mut Vec<Value>, tx: &BucketTx<'_>, limit: &ConcurrencyLimit) {
    args.extend([
        Value::Integer(KIND_CONCURRENCY),
        mode_code(tx.mode),
        int(tx.cost),
        int(limit.max()),
        int(limit.lease_us()),
        int(limit.retry_after_us()),
        lease_ids(tx),
    ]);
}

/// A calendar transaction: its least and most units, and the quota's fields.
pub(super) fn push_calendar(
    args: &mut Vec<Value>,
    tx: &BucketTx<'_>,
    quota: &CalendarQuota,
    call: Call,
) {
    let (min, max) = calendar_costs(tx);
    args.extend([Value::Integer(KIND_CALENDAR), mode_code(tx.mode), min, max]);
    args.extend(calendar_fields(call, quota));
}

/// A tiered transaction: its range and every tier (debt is not defined for tiers: a charge is
/// a spend-only there).
pub(super) fn push_tiered(args: &mut Vec<Value>, tx: &BucketTx<'_>, limit: &TieredLimit) {
    let mode = match tx.mode {
        Mode::Charge => Mode::SpendOnly,
        mode => mode,
    };
    args.extend([
        Value::Integer(KIND_TIERED),
        mode_code(mode),
        int(tx.min_cost),
        int(tx.cost),
        int(limit.tiers().len() as u64),
    ]);
    for t in limit.tiers() {
        args.extend([
            int(t.limit()),
            int(t.window_us()),
            int(t.active_us()),
            int(t.cooldown_us()),
        ]);
    }
}

/// A key's penalty state: `penalty.lua`'s MessagePack array, `[1, level, since, until, n,
/// (time, units) x n, m, (id as text, time, units) x m]`, every number whole and below
/// 2^53, at most 1,000 entries a list (`docs/penalties.md`, "How a store keeps it").
pub(in crate::backend::redis) fn read_penalty(raw: &[u8]) -> Option<crate::backend::kit::Stored> {
    use crate::algo::penalty::{MAX_AFTER, PenaltyState, Reservation};
    /// The array's values, one at a time, no more than its length.
    struct Values<'a> {
        input: &'a [u8],
        left: u32,
    }
    impl Values<'_> {
        /// The next whole number below 2^53.
        fn number(&mut self) -> Option<u64> {
            self.left = self.left.checked_sub(1)?;
            let v: u64 = rmp::decode::read_int(&mut self.input).ok()?;
            (v < 1 << 53).then_some(v)
        }
        /// The next list's length, at most `MAX_AFTER`.
        fn count(&mut self) -> Option<u64> {
            self.number().filter(|&n| n <= MAX_AFTER)
        }
        /// The next lease id, written as decimal text.
        fn id(&mut self) -> Option<u64> {
            self.left = self.left.checked_sub(1)?;
            let mut text = [0u8; 20];
            rmp::decode::read_str(&mut self.input, &mut text)
                .ok()?
                .parse()
                .ok()
        }
    }
    let mut input = raw;
    let left = rmp::decode::read_array_len(&mut input).ok()?;
    let mut v = Values { input, left };
    if v.number()? != 1 {
        return None;
    }
    let mut state = PenaltyState {
        level: u32::try_from(v.number()?).ok()?,
        since: v.number()?,
        banned_until: v.number()?,
        ..PenaltyState::default()
    };
    for _ in 0..v.count()? {
        let at = v.number()?;
        state.events.push_back((at, v.number()?));
    }
    for _ in 0..v.count()? {
        let (id, at, units) = (v.id()?, v.number()?, v.number()?);
        state.reservations.push(Reservation { id, at, units });
    }
    (v.left == 0 && v.input.is_empty())
        .then(|| crate::backend::kit::Stored::Penalty(Box::new(state)))
}

#[cfg(feature = "replay")]
pub(in crate::backend::redis) use read::*;

/// What a snapshot reads back of a GCRA, calendar, concurrency or tiered key ([`crate::backend::redis::keys::reading_of`]).
#[cfg(feature = "replay")]
mod read {
    use fred::prelude::Value;

    use crate::algo::calendar::CalendarState;
    use crate::algo::tiers::{TierLog, TierState};
    use crate::backend::kit;
    use crate::backend::redis::reply::{LIMIT, digits, scored, whole};

    /// A GCRA key: its TAT and its writer's bound, from when the key expires (`PXAT` of the TAT's
    /// millisecond, rounded up, plus the bound's bit length `k`; a key written with caller time
    /// expires relative to its write and records no bound: read as written by the limit in force).
    pub(in crate::backend::redis) fn read_tat(raw: &[u8], expires_ms: i64) -> Option<kit::Stored> {
        let tat = digits(raw).filter(|&t| t < LIMIT)?;
        let k = expires_ms - i64::try_from(tat.div_ceil(1_000)).ok()?;
        let bound_us = if (1..=52).contains(&k) {
            (1u64 << k) - 1
        } else {
            0
        };
        kit::gcra_word_bound(tat, bound_us)
            .ok()
            .map(kit::Stored::Tat)
    }

    /// A calendar key: `"<end> <used>"` (units used above 2^52 read as 2^52, as the script reads
    /// them).
    pub(in crate::backend::redis) fn read_calendar(raw: &[u8]) -> Option<kit::Stored> {
        let space = raw.iter().position(|&b| b == b' ')?;
        let end_us = digits(&raw[..space]).filter(|&e| e < LIMIT)?;
        let used = &raw[space + 1..];
        let used = match digits(used) {
            Some(u) => u.min(LIMIT),
            // More digits than a u64 holds: a number past 2^52 all the same.
            None if !used.is_empty() && used.iter().all(u8::is_ascii_digit) => LIMIT,
            None => return None,
        };
        Some(kit::Stored::Calendar(CalendarState { end_us, used }))
    }

    /// A concurrency key's leases from `ZRANGE .. WITHSCORES` (flat pairs, or pairs in arrays).
    pub(in crate::backend::redis) fn read_leases(reply: Value) -> Option<kit::Stored> {
        let mut out = Vec::new();
        for (member, score) in scored(reply)? {
            out.push((digits(&member)?, whole(score)?));
        }
        Some(kit::Stored::Leases(out))
    }

    /// A tiered key's MessagePack array of whole numbers.
    pub(in crate::backend::redis) fn read_tiers(raw: &[u8]) -> Option<kit::Stored> {
        /// The array's numbers, one at a time, no more than its length.
        struct Numbers<'a> {
            input: &'a [u8],
            left: u32,
        }
        impl Numbers<'_> {
            /// The next number, at least `lo` and below 2^52.
            fn next(&mut self, lo: i64) -> Option<i64> {
                self.left = self.left.checked_sub(1)?;
                let v: i64 = rmp::decode::read_int(&mut self.input).ok()?;
                (v >= lo && v < LIMIT as i64).then_some(v)
            }
            /// The next number, at least `lo` (0 or more) and below 2^52.
            fn whole(&mut self, lo: i64) -> Option<u64> {
                self.next(lo).map(i64::unsigned_abs)
            }
        }
        let mut input = raw;
        let left = rmp::decode::read_array_len(&mut input).ok()?;
        let mut n = Numbers { input, left };
        if n.whole(1)? != 1 {
            return None;
        }
        let base = n.whole(0)?;
        let count = n.whole(0)?;
        if count > 64 {
            return None;
        }
        let mut logs = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let entry = match n.next(-1)? {
                -1 => None,
                e => Some(base.checked_add(e.unsigned_abs())?),
            };
            let grants = n.whole(0)?;
            if grants > u64::from(n.left) {
                return None;
            }
            let mut log = Vec::with_capacity(grants as usize);
            for _ in 0..grants {
                let t = base.checked_add(n.whole(0)?).filter(|&t| t < LIMIT)?;
                log.push((t, n.whole(1)?));
            }
            logs.push(TierLog::new(entry, log));
        }
        (n.left == 0 && n.input.is_empty()).then(|| kit::Stored::Tiers(TierState::from_tiers(logs)))
    }
}
