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
