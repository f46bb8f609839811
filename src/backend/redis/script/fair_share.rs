//! A fair share's record in the script's protocol (`docs/fair-share.md`, `fair_share.lua`).

use fred::prelude::Value;

use super::{KIND_FAIR_SHARE, MAX_TIME_US, int, mode_code};
use crate::algo::fair_share::FairShare;
use crate::backend::BucketTx;

/// A fair-share record: its mode and costs, the budget (interval, burst offset, debt offset,
/// burst), the id's weight and minimum, the budget's count, the refresh period, the id's
/// text (its canonical form: the id a waiter and a member are known by), and the units new
/// ids may take together in a refresh period while an id seen before is refused.
pub(super) fn push_fair_share(args: &mut Vec<Value>, tx: &BucketTx<'_>, share: &FairShare) {
    let budget = share.budget();
    args.extend([
        Value::Integer(KIND_FAIR_SHARE),
        mode_code(tx.mode),
        int(tx.min_cost.min(MAX_TIME_US)),
        int(tx.cost.min(MAX_TIME_US)),
        int(budget.emission_interval_us()),
        int(budget.burst_offset_us()),
        int(budget.debt_offset_us()),
        int(budget.burst()),
        int(share.weight()),
        int(share.min()),
        int(budget.count()),
        int(share.refresh_us()),
        Value::String(tx.key.id().to_string().into()),
        int(share.new_ids_cap().min(MAX_TIME_US)),
    ]);
}
