//! An adaptive concurrency record in the script's protocol (`docs/adaptive-concurrency.md`,
//! `adaptive.lua`).

use fred::prelude::Value;

use super::{KIND_ADAPTIVE, KIND_ADAPTIVE_POOL, int, mode_code};
use crate::algo::adaptive::{AdaptiveConcurrency, Algorithm};
use crate::backend::BucketTx;

/// An adaptive record: a concurrency record's mode, cost, lease time, hint and lease ids, then
/// the least, first and most slots, the algorithm (0 gradient: smoothing and tolerance; 1 AIMD:
/// backoff and increase), the window, the completions that end one, the idle time, and a
/// release's completion (its latency, -1 for none, and whether it failed).
pub(super) fn push_adaptive(
    args: &mut Vec<Value>,
    tx: &BucketTx<'_>,
    limit: &AdaptiveConcurrency,
    ids: Value,
) {
    let a = limit.adaptive();
    let (algo, p1, p2) = match a.algorithm() {
        Algorithm::Gradient {
            smoothing_pm,
            tolerance_pm,
        } => (0, smoothing_pm, tolerance_pm),
        Algorithm::Aimd {
            backoff_pm,
            increase,
        } => (1, backoff_pm, increase),
    };
    let (latency, failed) = match tx.completion {
        Some(c) => (
            Value::Integer(i64::try_from(c.latency_us.min(super::MAX_TIME_US)).unwrap_or(0)),
            c.failed,
        ),
        None => (Value::Integer(-1), false),
    };
    let capacity = limit.shared();
    args.extend([
        Value::Integer(if capacity.is_some() {
            KIND_ADAPTIVE_POOL
        } else {
            KIND_ADAPTIVE
        }),
        mode_code(tx.mode),
        int(tx.cost),
        int(limit.slots().lease_us()),
        int(limit.slots().retry_after_us()),
        ids,
        int(a.min()),
        int(a.initial()),
        int(a.max()),
        Value::Integer(algo),
        int(p1),
        int(p2),
        int(limit.window_us()),
        int(limit.window_completions_count()),
        int(limit.idle_reset_us()),
        latency,
        Value::Integer(i64::from(failed)),
    ]);
    // A pool's record: the capacity its keys share, the key's id (its canonical text, as the
    // pool knows its keys) and the capacity's headroom.
    if let Some(c) = capacity {
        args.extend([
            int(c.slots),
            Value::String(tx.key.id().to_string().into()),
            int(c.headroom),
        ]);
    }
}

/// The number of slots the script answered, as an outcome carries it.
pub(super) fn slots(n: u64) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

#[cfg(feature = "replay")]
pub(in crate::backend::redis) use read::*;

/// What a snapshot reads back of an adaptive key's sorted set and a pooled limit's hash ([`crate::backend::redis::keys::reading_of`]).
#[cfg(feature = "replay")]
mod read {
    use fred::prelude::Value;

    use crate::backend::kit;
    use crate::backend::redis::reply::{LIMIT, digits, scored, whole};

    /// The most fields an adaptive pool's hash holds (`adaptive.lua` sweeps the states of keys
    /// holding no slot past [`kit::MAX_POOL_KEYS`], a page a call).
    pub(in crate::backend::redis) const ADAPTIVE_POOL_MOST_FIELDS: u64 =
        2 * kit::MAX_POOL_KEYS as u64 + 64;

    /// An adaptive pool's hash (`adaptive.lua`), field and value by turns: every lease by its key,
    /// the waiters, and each key's state; `None` for anything the script does not write.
    pub(in crate::backend::redis) fn read_adaptive_pool(items: &[Value]) -> Option<kit::Stored> {
        use crate::algo::adaptive::AdaptiveState;
        use crate::key::Id;
        let mut keys: std::collections::HashMap<Id, AdaptiveState> = Default::default();
        let mut waiters = Vec::new();
        let mut leases = Vec::new();
        for pair in items.chunks(2) {
            let [field, value] = pair else { return None };
            let field = std::str::from_utf8(field.as_bytes()?).ok()?;
            let value = std::str::from_utf8(value.as_bytes()?).ok()?;
            match field {
                "x" | "c" => {}
                "L" => {
                    for line in value.lines() {
                        let mut parts = line.split('\t');
                        let id = Id::new(parts.next()?).ok()?;
                        let lease = parts.next()?.parse().ok()?;
                        let deadline: u64 = parts.next()?.parse().ok()?;
                        leases.push((id, (lease, deadline)));
                    }
                }
                "q" => {
                    for line in value.lines() {
                        let (id, until) = line.split_once('\t')?;
                        waiters.push((Id::new(id).ok()?, until.parse().ok()?));
                    }
                }
                _ => {
                    let id = Id::new(field.strip_prefix("k:")?).ok()?;
                    let v: Vec<u64> = value
                        .split(' ')
                        .map(|p| p.parse().ok().filter(|&v| v < LIMIT))
                        .collect::<Option<_>>()?;
                    let [c, g, n, f, s, m, w, t] = v[..] else {
                        return None;
                    };
                    let state = keys.entry(id).or_default();
                    state.controller.limit_milli = c;
                    state.controller.long_us = g;
                    state.window.completions = n;
                    state.window.failures = f;
                    state.window.latency_sum_us = s;
                    state.window.max_in_flight = m;
                    state.window_start_us = w;
                    state.last_us = t;
                }
            }
        }
        for (id, lease) in leases {
            keys.entry(id).or_default().leases.push(lease);
        }
        if waiters.len() > kit::MAX_POOL_WAITERS || keys.len() > kit::MAX_POOL_KEYS * 2 {
            return None;
        }
        Some(kit::Stored::AdaptivePool(Box::new(kit::AdaptivePool::new(
            keys, waiters,
        ))))
    }

    /// An adaptive key's sorted set (`adaptive.lua`): its leases (ids scored by deadlines), and
    /// its state (`~f` scored `-(value + 1)`); a member of neither form is not ours.
    pub(in crate::backend::redis) fn read_adaptive(reply: Value) -> Option<kit::Stored> {
        use crate::algo::adaptive::AdaptiveState;
        let mut state = AdaptiveState::default();
        for (member, score) in scored(reply)? {
            if score > 0.0 {
                state.leases.push((digits(&member)?, whole(score)?));
                continue;
            }
            let v = whole(-score - 1.0)?;
            let field = match member.as_slice() {
                b"~c" => &mut state.controller.limit_milli,
                b"~g" => &mut state.controller.long_us,
                b"~n" => &mut state.window.completions,
                b"~f" => &mut state.window.failures,
                b"~s" => &mut state.window.latency_sum_us,
                b"~m" => &mut state.window.max_in_flight,
                b"~w" => &mut state.window_start_us,
                b"~t" => &mut state.last_us,
                _ => return None,
            };
            *field = v;
        }
        Some(kit::Stored::Adaptive(Box::new(state)))
    }
}
