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

#[cfg(feature = "replay")]
pub(in crate::backend::redis) use read::*;

/// What a snapshot reads back of a fair share's hash ([`crate::backend::redis::keys::reading_of`]).
#[cfg(feature = "replay")]
mod read {
    use fred::prelude::Value;

    use crate::backend::kit;
    use crate::backend::redis::reply::LIMIT;

    /// The most fields a fair share's hash holds (`fair_share.lua` sweeps ended ids once it holds
    /// twice the ids a limit counts, one page a call; live ids above that are not ours).
    pub(in crate::backend::redis) const FAIR_SHARE_MOST_FIELDS: u64 =
        4 * crate::algo::fair_share::MAX_MEMBERS as u64 + 64;

    /// A fair share's hash (`fair_share.lua`), field and value by turns: the pool (the budget's TAT
    /// and its writer's bound as a bit length, the counts by period, the waiters) and each id's
    /// member; `None` for anything the script does not write.
    pub(in crate::backend::redis) fn read_fair_pool(items: &[Value]) -> Option<kit::Stored> {
        use crate::algo::fair_share::{MAX_WAITERS, Member, Pool, Waiter};
        let mut pool = Pool::default();
        let mut bits = 0u64;
        let mut members = std::collections::HashMap::new();
        for pair in items.chunks(2) {
            let [field, value] = pair else { return None };
            let field = std::str::from_utf8(field.as_bytes()?).ok()?;
            let value = std::str::from_utf8(value.as_bytes()?).ok()?;
            let n = || value.parse::<u64>().ok().filter(|&v| v <= LIMIT);
            match field {
                "t" => pool.tat = n()?,
                "k" => bits = n()?,
                "e" => pool.epoch = n()?,
                "w0" => pool.weights.0 = n()?,
                "w1" => pool.weights.1 = n()?,
                "m0" => pool.mins.0 = n()?,
                "m1" => pool.mins.1 = n()?,
                "n0" => pool.ids.0 = n()?,
                "n1" => pool.ids.1 = n()?,
                "h0" => pool.held[0] = n()?,
                "h1" => pool.held[1] = n()?,
                "h2" => pool.held[2] = n()?,
                "p" => pool.pressed = n()?,
                "f" => pool.fresh = n()?,
                "x" | "c" => {}
                "q" => {
                    for line in value.lines() {
                        let mut parts = line.split('\t');
                        let id = crate::key::Id::new(parts.next()?).ok()?;
                        let until_us = parts.next()?.parse().ok()?;
                        let cost = parts.next()?.parse().ok()?;
                        pool.waiting.push(Waiter { id, until_us, cost });
                    }
                }
                _ => {
                    let id = crate::key::Id::new(field.strip_prefix("m:")?).ok()?;
                    let mut parts = value.split(' ').map(|p| p.parse::<u64>().ok());
                    let mut next = || parts.next().flatten();
                    let mut member = Member {
                        tat: next()?,
                        epoch: next()?,
                        weight: next()?,
                        min: next()?,
                        ..Member::default()
                    };
                    // The units admitted below its share by period, and the latest's period
                    // (written since the rule for ids asking below their share).
                    if let Some(b0) = next() {
                        member.below = [b0, next()?, next()?];
                        member.below_at = next()?;
                    }
                    // The period it was first counted in (written since new ids have a part).
                    if let Some(since) = next() {
                        member.since = since;
                    }
                    members.insert(id, member);
                }
            }
        }
        if pool.waiting.len() > MAX_WAITERS || members.len() as u64 > FAIR_SHARE_MOST_FIELDS {
            return None;
        }
        let bound_us = if (1..=52).contains(&bits) {
            (1u64 << bits) - 1
        } else {
            0
        };
        pool.tat = kit::gcra_word_bound(pool.tat, bound_us).ok()?;
        Some(kit::Stored::FairShare(Box::new(kit::FairPool::new(
            pool, members,
        ))))
    }
}
