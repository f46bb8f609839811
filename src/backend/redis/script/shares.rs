//! The share buckets' part of the script's protocol (`docs/regions.md`): a share bucket's
//! record, and the rebalancer's two calls on them (a request numbered, a grant applied).

use fred::prelude::Value;

use super::{Call, Fields, KIND_GCRA, KIND_SHARE, MAX_TIME_US, bad, int, mode_code};
use crate::backend::{BackendError, BucketTx};
use crate::quota::Quota;

/// What a call's share buckets decide with, from the region's state.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ShareCall {
    /// Whether the floors are in use (the region's registration confirmed, and the rest of
    /// `RedisBackend::floors`); without them the floor is 0.
    pub(crate) floors: bool,
    /// When the region's store started, on the script's clock (0: unknown): a bucket it holds
    /// no record of is empty at that time (`regions/store_start.rs`).
    pub(crate) store_start: u64,
}

/// A region's share bucket's record: the script finds its limit (the floor, and the part
/// while its lease runs); `kind` is the GCRA record's kind (a single cost, a range, a charge).
pub(super) fn push_share(
    args: &mut Vec<Value>,
    tx: &BucketTx<'_>,
    limit: &crate::algo::gcra::Limit,
    floor: crate::config::RegionFloor,
    kind: i64,
    shares: ShareCall,
) {
    let floor = |amount| if shares.floors { floor.of(amount) } else { 0 };
    args.extend([
        Value::Integer(KIND_SHARE),
        int(floor(limit.count())),
        int(floor(limit.burst())),
        int(limit.period_us()),
        Value::Integer(kind),
        int(tx.cost.min(MAX_TIME_US)),
        mode_code(tx.mode),
        int(shares.store_start.min(MAX_TIME_US)),
    ]);
}

/// A grant for one share bucket, as the region applies it (`RegionKey::on_grant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShareGrant {
    /// The number of the request it answers.
    pub(crate) seq: u64,
    /// The part granted.
    pub(crate) share: crate::algo::regions::Share,
    /// When its lease ends (region clock): its request's sending time plus the lease.
    pub(crate) lease_end: u64,
}

/// The arguments of the rebalancer's call on share buckets ([`Op::ShareRequest`],
/// [`Op::ShareGrant`]): the head, then per key its share record (cost 0, observed) and, for a
/// grant, the request's number, the part's rate and burst, and the lease's end. Every key's
/// transaction carries its floor.
pub(crate) fn encode_shares<'a>(
    call: Call,
    txs: impl Iterator<Item = &'a BucketTx<'a>>,
    grants: &[ShareGrant],
) -> Vec<Value> {
    let mut args = Vec::new();
    call.push_head(&mut args, None);
    for (i, tx) in txs.enumerate() {
        if let (Quota::Gcra(limit), Some(floor)) = (tx.quota, tx.floor) {
            push_share(&mut args, tx, limit, floor, KIND_GCRA, call.shares);
        }
        if let Some(g) = grants.get(i) {
            args.extend([
                int(g.seq),
                int(g.share.rate.min(MAX_TIME_US)),
                int(g.share.burst.min(MAX_TIME_US)),
                int(g.lease_end),
            ]);
        }
    }
    args
}

/// The answer to a call on share buckets: per key its numbers (a request: its number, the
/// grant applied and the part in use, rate and burst; a grant: 1 when applied), and the
/// store's now.
pub(crate) type ShareAnswer = (Vec<smallvec::SmallVec<[u64; 4]>>, u64);

/// Decodes the answer to a call on share buckets ([`ShareAnswer`]).
pub(crate) fn decode_shares(
    value: Value,
    keys: usize,
    fields: usize,
) -> Result<ShareAnswer, BackendError> {
    let Value::Array(items) = value else {
        return Err(bad(format!("{:?}", value.kind())));
    };
    if items.len() != keys + 1 {
        return Err(bad(format!(
            "{} values for {keys} share buckets",
            items.len()
        )));
    }
    let mut items = items.into_iter();
    let mut out = Vec::with_capacity(keys);
    for key in 0..keys {
        let Some(Value::Array(values)) = items.next() else {
            return Err(bad(format!("share bucket {}: not a list", key + 1)));
        };
        let mut f = Fields {
            key,
            values: values.into_iter(),
        };
        let mut numbers = smallvec::SmallVec::new();
        for _ in 0..fields {
            numbers.push(f.u64("a share bucket's number")?);
        }
        f.end()?;
        out.push(numbers);
    }
    let now = items
        .next()
        .and_then(|v| v.as_i64())
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad("no now".into()))?;
    Ok((out, now))
}
