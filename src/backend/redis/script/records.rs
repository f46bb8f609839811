//! The records of a GCRA bucket, a concurrency key, a calendar key and a tiered key: each
//! shape's arguments on the general path, one function each (`encode` calls one per
//! transaction, as it does the fair share's and the adaptive limit's in their own files).

use fred::prelude::Value;

use super::{
    Call, KIND_CALENDAR, KIND_CHARGE, KIND_CONCURRENCY, KIND_GCRA, KIND_RANGE, KIND_TIERED,
    MAX_TIME_US, calendar_costs, calendar_fields, int, lease_ids, mode_code, shares,
};
use crate::algo::calendar::CalendarQuota;
use crate::algo::concurrency::ConcurrencyLimit;
use crate::algo::gcra::Limit;
use crate::algo::tiers::TieredLimit;
use crate::backend::{BucketTx, Mode};

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
