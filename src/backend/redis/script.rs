//! The script's protocol, in one place: what `ratelimit.lua` takes (`ARGV`) and what it
//! answers, encoded and decoded here only, field by named field. The script's header comment
//! documents the same layout; `tests/redis_keys.rs` and the tests below hold the two to each other.
//!
//! `ARGV`: the operation, now (`-1`: the server's `TIME`), the expiry mode, whether tiered keys
//! report their values before and after, then one record per key:
//!
//! | record | fields |
//! |---|---|
//! | lean (op `G`: a spend whose keys are all GCRA) | increment (emission interval * cost), burst offset, mode |
//! | lean with the defaults (`g`: no op and no head, exactly two arguments per key; server clock, expiry when fresh, check-and-spend) | increment, burst offset |
//! | GCRA | `0`, emission interval, burst offset, burst, cost, mode, debt offset (emission interval * `max_debt`) |
//! | GCRA range (a partial grant) | `2`, the GCRA fields, then the least units acceptable |
//! | GCRA charge (mode charge: a settle's overrun) | `4`, the GCRA fields |
//! | tiered | `1`, mode, min, max, tier count, then per tier: limit, window, active, cooldown |
//! | concurrency | `3`, mode, cost, max, lease (µs), retry hint (µs), lease id (decimal text; `0`: none; a renewal: every lease it renews, separated by spaces) |
//! | share bucket (a region's share of a limit across regions, `docs/regions.md`) | `6`, the floor's rate and burst, the period (µs), the GCRA kind (`0`, `2` or `4`), cost, mode, then a range's least units |
//! | penalty (a limit's penalty companion, `docs/penalties.md`; its answer adds whether the key is banned and the level of a ban it started, 0 for none) | `10`, mode, cost, reservation id (decimal text; `0`: the cost counts at admission), after, within, base, factor, max, forget_after (µs), jitter (‰), the key's canonical text |
//! | restore | the value the spend wrote, the value before (`''`: none), its TTL in ms (`-1`: none) |
//!
//! `C` (one calendar key alone, checked and spent: the script's own path for it): the head,
//! then the calendar record's count, start, end, next end and horizon, then min, and max only
//! when it is not min; `c` the same without the head when the call uses the defaults (as `g`).
//! Both answer as `spend` does for one key.
//!
//! `M` (coalesced `g` calls, see `coalesce.rs`): `M`, the number of requests, each one's key
//! count, then every request's `g` arguments in order; it answers as `g` for all the keys, and
//! each request takes its slice. `K` (coalesced `c` calls whose min is their max): `K`, the
//! number of requests, then each one's six `c` fields (count, start, end, next end, horizon,
//! cost), one key each; it answers now, then the units that counted and the period's end of
//! each request in order.
//!
//! The answer to `g` and `G`: now, then each key's stored TAT before the call (flat); the decisions are
//! computed here from them, with `gcra::check` and the batch rule, exactly as the script
//! decided. The other answers: one list per key, then now. A key holding something that is not
//! a state of ours (including a time further ahead than the crate writes:
//! `gcra::FOREIGN_SLACK_US`) is decided as a fresh bucket and replaced by the first write. The
//! lean path knows no debt offset: it carries only limits whose debt offset is their burst
//! offset (the default `max_debt`). The codes
//! (kinds, modes, ops) are one table here, which a test holds the script's constants to.

use fred::prelude::{Key, Value};

use crate::algo::calendar::{self, CalendarQuota};
use crate::algo::gcra;
use crate::algo::tiers::{MAX_TIERS, TierGrant};
use crate::backend::{BackendError, BucketTx, Mode, Outcome, Outcomes, batch_allowed, gcra_write};
use crate::quota::Quota;
pub(crate) use shares::{ShareAnswer, ShareCall, ShareGrant, decode_shares, encode_shares};

mod adaptive;
mod fair_share;
mod fields;
mod records;
mod shares;
#[cfg(feature = "replay")]
pub(super) use adaptive::{ADAPTIVE_POOL_MOST_FIELDS, read_adaptive, read_adaptive_pool};
#[cfg(feature = "replay")]
pub(super) use fair_share::{FAIR_SHARE_MOST_FIELDS, read_fair_pool};
use fields::{Fields, bad};
pub(super) use records::read_penalty;
#[cfg(feature = "replay")]
pub(super) use records::{read_calendar, read_leases, read_tat, read_tiers};
/// The protocol's codes: the record kinds, the modes and the ops, each by the name the
/// script's constants carry (`local KIND_GCRA, ... = 0, ...`: a record kind at the top of its
/// shape's file, the rest in `ratelimit.lua` and `general.lua`; the test below holds the
/// script to this table, so a code changes in one place).
const KIND_GCRA: i64 = 0;
const KIND_TIERED: i64 = 1;
const KIND_RANGE: i64 = 2;
const KIND_CONCURRENCY: i64 = 3;
const KIND_CHARGE: i64 = 4;
const KIND_CALENDAR: i64 = 5;
const KIND_SHARE: i64 = 6;
const KIND_FAIR_SHARE: i64 = 7;
const KIND_ADAPTIVE: i64 = 8;
const KIND_ADAPTIVE_POOL: i64 = 9;
const KIND_PENALTY: i64 = 10;
const OP_LEAN: &str = "G";
const OP_COALESCED: &str = "M";
const OP_CALENDAR: &str = "C";
const OP_CALENDAR_DEFAULTS: &str = "c";
const OP_CALENDAR_COALESCED: &str = "K";
const OP_SPEND: &str = "spend";
const OP_REFUND: &str = "refund";
const OP_RESTORE: &str = "restore";
const OP_SHARE_REQUEST: &str = "share_request";
const OP_SHARE_GRANT: &str = "share_grant";

/// A mode's code.
const fn mode_number(mode: Mode) -> i64 {
    match mode {
        Mode::CheckAndSpend => 0,
        Mode::CheckOnly => 1,
        Mode::SpendOnly => 2,
        Mode::Observe => 3,
        Mode::Charge => 4,
        Mode::Renew => 5,
    }
}

/// Every code by its name in the script: numbers, and the ops' words.
#[cfg(test)]
const PROTOCOL: &[(&str, Code)] = &[
    ("OP_LEAN_DEFAULTS", Code::Word("g")),
    ("OP_LEAN", Code::Word(OP_LEAN)),
    ("OP_COALESCED", Code::Word(OP_COALESCED)),
    ("OP_CALENDAR", Code::Word(OP_CALENDAR)),
    ("OP_CALENDAR_DEFAULTS", Code::Word(OP_CALENDAR_DEFAULTS)),
    ("OP_CALENDAR_COALESCED", Code::Word(OP_CALENDAR_COALESCED)),
    ("OP_SPEND", Code::Word(OP_SPEND)),
    ("OP_REFUND", Code::Word(OP_REFUND)),
    ("OP_RESTORE", Code::Word(OP_RESTORE)),
    ("OP_SHARE_REQUEST", Code::Word(OP_SHARE_REQUEST)),
    ("OP_SHARE_GRANT", Code::Word(OP_SHARE_GRANT)),
    ("KIND_GCRA", Code::Number(KIND_GCRA)),
    ("KIND_TIERED", Code::Number(KIND_TIERED)),
    ("KIND_RANGE", Code::Number(KIND_RANGE)),
    ("KIND_CONCURRENCY", Code::Number(KIND_CONCURRENCY)),
    ("KIND_CHARGE", Code::Number(KIND_CHARGE)),
    ("KIND_CALENDAR", Code::Number(KIND_CALENDAR)),
    ("KIND_SHARE", Code::Number(KIND_SHARE)),
    ("KIND_FAIR_SHARE", Code::Number(KIND_FAIR_SHARE)),
    ("KIND_ADAPTIVE", Code::Number(KIND_ADAPTIVE)),
    ("KIND_ADAPTIVE_POOL", Code::Number(KIND_ADAPTIVE_POOL)),
    ("KIND_PENALTY", Code::Number(KIND_PENALTY)),
    (
        "MODE_CHECK_AND_SPEND",
        Code::Number(mode_number(Mode::CheckAndSpend)),
    ),
    (
        "MODE_CHECK_ONLY",
        Code::Number(mode_number(Mode::CheckOnly)),
    ),
    (
        "MODE_SPEND_ONLY",
        Code::Number(mode_number(Mode::SpendOnly)),
    ),
    ("MODE_OBSERVE", Code::Number(mode_number(Mode::Observe))),
    ("MODE_CHARGE", Code::Number(mode_number(Mode::Charge))),
    ("MODE_RENEW", Code::Number(mode_number(Mode::Renew))),
];

#[cfg(test)]
#[derive(Debug, PartialEq)]
enum Code {
    Number(i64),
    Word(&'static str),
}

/// The script, as run by `EVALSHA`: the head and the fast paths, the general path's head (what
/// every shape uses, and the table of shapes), each shape's own file (its records parsed, read,
/// decided and written, its handler registered under its kinds: a new shape adds its file
/// here), and the general path's run, which names no shape.
pub(super) const SCRIPT: &str = concat!(
    include_str!("ratelimit.lua"),
    include_str!("general.lua"),
    include_str!("gcra.lua"),
    include_str!("share.lua"),
    include_str!("calendar.lua"),
    include_str!("concurrency.lua"),
    include_str!("tiers.lua"),
    include_str!("fair_share.lua"),
    include_str!("adaptive.lua"),
    include_str!("penalty.lua"),
    include_str!("general_run.lua")
);

/// TATs and times sent to or read from Redis stay below 2^52 µs (year 2112), so that the
/// script's doubles are exact (the script refuses stored values at or above it).
pub(super) const MAX_TIME_US: u64 = 1 << 52;

/// What a call asks the script to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Spend,
    Refund,
    /// Puts back a tiered key's value from before a spend (undoing a denied cross-slot batch).
    Restore,
    /// The rebalancer's calls on share buckets (`docs/regions.md`): requests numbered, grants
    /// applied.
    ShareRequest,
    ShareGrant,
}

/// When keys expire.
#[derive(Debug, Clone, Copy)]
pub(super) enum Expiry {
    /// At the moment the state equals a fresh one, on the server's clock (`PXAT`).
    AtFresh,
    /// That long after now plus a margin in milliseconds (`PX`): caller time, which the
    /// server's clock cannot follow.
    AfterMargin(i64),
}

/// The head of every call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Call {
    pub(super) op: Op,
    /// `None`: the server's clock.
    pub(super) now: Option<u64>,
    /// This instance's clock (the caller's time when `now` is set): where it finds the calendar
    /// periods it sends.
    pub(super) local: u64,
    pub(super) expiry: Expiry,
    /// Tiered keys report their values before and after (to undo a spend with `Restore`).
    pub(super) want_raw: bool,
    /// What share buckets decide with (their floors, the store's start).
    pub(super) shares: ShareCall,
}

impl Call {
    /// The op word and the head; `path` names a spend's own path (`G` or `C`), if it takes
    /// one.
    fn push_head(&self, args: &mut Vec<Value>, path: Option<&'static str>) {
        args.push(word(match (self.op, path) {
            (Op::Spend, Some(path)) => path,
            (Op::Spend, None) => OP_SPEND,
            (Op::Refund, _) => OP_REFUND,
            (Op::Restore, _) => OP_RESTORE,
            (Op::ShareRequest, _) => OP_SHARE_REQUEST,
            (Op::ShareGrant, _) => OP_SHARE_GRANT,
        }));
        args.push(self.now.map_or(Value::Integer(-1), int));
        args.push(Value::Integer(match self.expiry {
            Expiry::AtFresh => -1,
            Expiry::AfterMargin(ms) => ms,
        }));
        args.push(Value::Integer(i64::from(self.want_raw)));
    }
}

/// A word of the protocol, sent without copying it.
fn word(w: &'static str) -> Value {
    Value::String(fred::bytes_utils::Str::from_static(w))
}

fn int(v: u64) -> Value {
    // Every value sent is below 2^53 (see `MAX_BURST_OFFSET_US` and `MAX_TIME_US`).
    Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

fn mode_code(mode: Mode) -> Value {
    Value::Integer(mode_number(mode))
}

/// Whether a call takes the script's lean path: a spend whose keys are all GCRA, each of one
/// cost (a partial grant and a charge take the general path).
pub(super) fn is_lean<'a>(call: Call, mut txs: impl Iterator<Item = &'a BucketTx<'a>>) -> bool {
    call.op == Op::Spend
        && txs.all(|tx| {
            // The lean path bounds stored TATs by twice the burst offset (the default debt);
            // a region's share bucket takes the general path.
            tx.plain_gcra()
                .is_some_and(|l| l.debt_offset_us() == l.burst_offset_us())
                && tx.min_cost == tx.cost
                && tx.mode != Mode::Charge
        })
}

/// Whether the script answers a transaction's units granted: a GCRA range or charge, and a
/// renewal (the leases it renewed).
fn reports_granted(call: Call, tx: &BucketTx<'_>) -> bool {
    call.op == Op::Spend
        && tx.penalty.is_none()
        && ((tx.quota.as_gcra().is_some() || tx.quota.as_fair_share().is_some())
            && (tx.min_cost < tx.cost || tx.mode == Mode::Charge)
            || tx.mode == Mode::Renew
            || tx.quota.as_calendar().is_some())
}

/// A concurrency record's lease ids: its lease, or a renewal's leases separated by spaces.
fn lease_ids(tx: &BucketTx<'_>) -> Value {
    if tx.mode != Mode::Renew {
        return Value::String(itoa::Buffer::new().format(tx.lease).into());
    }
    let mut text = String::with_capacity(tx.renewed().len() * 21);
    for (i, id) in tx.renewed().iter().enumerate() {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(itoa::Buffer::new().format(*id));
    }
    Value::String(text.into())
}

/// Which of the script's paths a call takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// A spend whose keys are all GCRA ([`is_lean`]): `g`, `G`.
    Lean,
    /// One calendar key alone, checked and spent: `c`, `C`.
    Calendar,
    /// Everything else.
    General,
}

/// The path a call of `txs` takes.
pub(super) fn path<'a>(call: Call, txs: impl Iterator<Item = &'a BucketTx<'a>> + Clone) -> Path {
    if is_lean(call, txs.clone()) {
        return Path::Lean;
    }
    let mut txs = txs;
    match (txs.next(), txs.next()) {
        (Some(tx), None)
            if call.op == Op::Spend
                && tx.mode == Mode::CheckAndSpend
                && tx.quota.as_calendar().is_some() =>
        {
            Path::Calendar
        }
        _ => Path::General,
    }
}

/// The arguments of a spend or refund of `txs` (one slot's keys, in order), on `path` as
/// [`path`] says.
pub(super) fn encode<'a>(
    call: Call,
    path: Path,
    txs: impl Iterator<Item = &'a BucketTx<'a>> + Clone,
) -> Vec<Value> {
    let mut txs = txs.into_iter();
    let (size, _) = txs.size_hint();
    match path {
        Path::Lean => return encode_lean(call, txs, size),
        Path::Calendar => {
            if let Some(tx) = txs.next()
                && let Quota::Calendar(quota) = tx.quota
            {
                return encode_calendar(call, tx, quota);
            }
        }
        Path::General => {}
    }
    let mut args = Vec::with_capacity(4 + 6 * size);
    call.push_head(&mut args, None);
    for tx in txs {
        if let Some(penalty) = tx.penalty {
            records::push_penalty(&mut args, tx, &penalty.ladder);
            continue;
        }
        match tx.quota {
            Quota::Gcra(limit) => records::push_gcra(&mut args, tx, limit, call.shares),
            Quota::Concurrency(limit) => records::push_concurrency(&mut args, tx, limit),
            Quota::FairShare(share) => fair_share::push_fair_share(&mut args, tx, share),
            Quota::Adaptive(limit) => adaptive::push_adaptive(&mut args, tx, limit, lease_ids(tx)),
            Quota::Calendar(quota) => records::push_calendar(&mut args, tx, quota, call),
            Quota::Tiered(limit) => records::push_tiered(&mut args, tx, limit),
        }
    }
    args
}

/// A calendar transaction's least and most units, as the script takes them (every count is far
/// below what its numbers hold).
fn calendar_costs(tx: &BucketTx<'_>) -> (Value, Value) {
    (
        int(tx.min_cost.min(MAX_TIME_US)),
        int(tx.cost.min(MAX_TIME_US)),
    )
}

/// A calendar record's fields after its costs: count, the period in force on this instance's
/// clock (or the caller's time: its start and end), the next end, and the horizon. The store's
/// clock decides: the script takes the period before it, it or the next one, the one that
/// holds its now (an instance whose clock runs ahead of the store's or behind it spends in the
/// store's period). The horizon bounds a stored end the script keeps.
fn calendar_fields(call: Call, quota: &CalendarQuota) -> [Value; 5] {
    let (start, end) = quota.period_at(call.local);
    [
        int(quota.count()),
        int(start),
        int(end),
        int(quota.period_at(end).1),
        int(quota.horizon_us()),
    ]
}

/// The arguments of `C`, when the call is one calendar key alone, checked and spent (the
/// script's own path for it): the head, the calendar record's fields after its costs, then min,
/// and max only when it is not min (one argument less for a request's usual cost); of `c` (no
/// head) when the call uses the defaults, as `g` does.
fn encode_calendar(call: Call, tx: &BucketTx<'_>, quota: &CalendarQuota) -> Vec<Value> {
    let mut args = Vec::with_capacity(11);
    if uses_defaults(call, std::iter::once(tx)) {
        args.push(word(OP_CALENDAR_DEFAULTS));
    } else {
        call.push_head(&mut args, Some(OP_CALENDAR));
    }
    args.extend(calendar_fields(call, quota));
    let (min, max) = calendar_costs(tx);
    if max != min {
        args.extend([min, max]);
    } else {
        args.push(min);
    }
    args
}

/// Whether a lean call uses the defaults (the server's clock, keys expiring when fresh, every
/// key check-and-spend): then it is sent as two arguments per key and nothing else (`g`), and
/// can be coalesced with others (`M`).
pub(super) fn uses_defaults<'a>(
    call: Call,
    mut txs: impl Iterator<Item = &'a BucketTx<'a>>,
) -> bool {
    call.now.is_none()
        && matches!(call.expiry, Expiry::AtFresh)
        && txs.all(|tx| tx.mode == Mode::CheckAndSpend)
}

/// The calls the coalescer can join: `g` calls into an `M` call, `c` calls into a `K` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Coalesced {
    /// A lean spend with the defaults (`g`).
    Lean,
    /// One calendar key alone with the defaults, its min its max (`c`).
    Calendar,
}

impl Coalesced {
    /// The values a request's share of the joined answer holds: a TAT per key, or the units
    /// that counted and the period's end.
    pub(super) fn answer_len(self, keys: usize) -> usize {
        match self {
            Coalesced::Lean => keys,
            Coalesced::Calendar => 2,
        }
    }
}

/// Whether a spend of `txs` on `path` can share a call with others' (coalescing), and as
/// which: on the defaults (the server's clock, keys expiring when fresh, check-and-spend), a
/// lean spend, or one calendar key whose least units are its cost.
pub(super) fn coalescible<'a>(
    call: Call,
    path: Path,
    mut txs: impl Iterator<Item = &'a BucketTx<'a>> + Clone,
) -> Option<Coalesced> {
    if !uses_defaults(call, txs.clone()) {
        return None;
    }
    match path {
        Path::Lean => Some(Coalesced::Lean),
        Path::Calendar if txs.all(|tx| tx.min_cost == tx.cost) => Some(Coalesced::Calendar),
        _ => None,
    }
}

/// The keys and arguments of an `M` call (coalesced `g` calls: the number of requests, each
/// one's key count, then every request's two arguments per key) or a `K` call (coalesced `c`
/// calls: the number of requests, then each one's fields after `c`), in queue order.
/// `requests` gives each request's keys and the arguments of its call alone.
pub(super) fn encode_coalesced<'r>(
    kind: Coalesced,
    requests: impl Iterator<Item = (&'r [Key], &'r [Value])> + Clone,
) -> (Vec<Key>, Vec<Value>) {
    let (count, n, fields) = requests.clone().fold((0, 0, 0), |(c, n, f), (keys, args)| {
        (c + 1, n + keys.len(), f + args.len())
    });
    let mut keys = Vec::with_capacity(n);
    let mut args = Vec::with_capacity(2 + count + fields);
    match kind {
        Coalesced::Lean => {
            args.extend([word(OP_COALESCED), int(count as u64)]);
            args.extend(requests.clone().map(|(k, _)| int(k.len() as u64)));
        }
        Coalesced::Calendar => args.extend([word(OP_CALENDAR_COALESCED), int(count as u64)]),
    }
    for (k, a) in requests {
        keys.extend_from_slice(k);
        // A `c` call's fields follow its op.
        let a = match kind {
            Coalesced::Lean => a,
            Coalesced::Calendar => a.get(1..).unwrap_or_default(),
        };
        args.extend_from_slice(a);
    }
    (keys, args)
}

/// The arguments of the lean path: two fields per key and nothing else when the call uses the
/// defaults (the server's clock, keys expiring when fresh, every key check-and-spend: a
/// request's usual batch; the script knows it by the count), else `G`, the head and three
/// fields per key. Each argument costs the server about 2,000 instructions
/// (`benches/redis_instructions.sh`).
fn encode_lean<'a>(
    call: Call,
    txs: impl Iterator<Item = &'a BucketTx<'a>> + Clone,
    size: usize,
) -> Vec<Value> {
    let defaults = uses_defaults(call, txs.clone());
    let mut args = Vec::with_capacity(if defaults { 2 * size } else { 4 + 3 * size });
    if !defaults {
        call.push_head(&mut args, Some(OP_LEAN));
    }
    for tx in txs {
        if let Quota::Gcra(limit) = tx.quota {
            // Below 2^53: the cost was checked against the burst, so this is at most the
            // burst offset.
            args.push(int(limit.emission_interval_us().saturating_mul(tx.cost)));
            args.push(int(limit.burst_offset_us()));
            if !defaults {
                args.push(mode_code(tx.mode));
            }
        }
    }
    args
}

/// The arguments that put back one tiered key's value from before a spend.
pub(super) fn encode_restore(change: &RawChange) -> Vec<Value> {
    let mut args = Vec::with_capacity(7);
    Call {
        op: Op::Restore,
        now: None,
        local: 0,
        expiry: Expiry::AtFresh,
        want_raw: false,
        shares: ShareCall::default(),
    }
    .push_head(&mut args, None);
    args.extend([
        change.after.clone(),
        change.before.clone(),
        Value::Integer(change.ttl_ms),
    ]);
    args
}

/// A tiered key's value before and after a spend, to undo it.
#[derive(Clone, Debug)]
pub(super) struct RawChange {
    pub(super) before: Value,
    pub(super) after: Value,
    pub(super) ttl_ms: i64,
}

/// What one script run answered, per key in the order sent.
pub(super) struct ScriptReply {
    pub(super) outcomes: Outcomes,
    /// The TAT stored after the script, per key (0: none; always 0 for a tiered key).
    pub(super) tats: Vec<u64>,
    /// Per tiered key, when asked for: its value before and after (empty from the lean path,
    /// which has no tiered key).
    pub(super) raws: Vec<Option<RawChange>>,
    /// The script's now.
    pub(super) now: u64,
}

/// Decodes the lean path's answer (now, then the TATs read) into the decisions the script
/// made: the same rule (`gcra::check`), the same batch rule.
pub(super) fn decode_lean<'a>(
    items: Vec<Value>,
    txs: impl ExactSizeIterator<Item = &'a BucketTx<'a>> + Clone,
) -> Result<ScriptReply, BackendError> {
    let n = txs.len();
    if items.len() != n + 1 {
        return Err(bad(format!("{} values for {n} keys", items.len())));
    }
    let mut items = items.into_iter();
    let mut number = |what: &str| -> Result<u64, BackendError> {
        let v = items.next().ok_or_else(|| bad(format!("no {what}")))?;
        v.as_i64()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(format!("{what} is {v:?}")))
    };
    let now = number("now")?;
    let mut decided: smallvec::SmallVec<[(u64, gcra::GcraOutcome); 4]> =
        smallvec::SmallVec::with_capacity(n);
    for tx in txs.clone() {
        let stored = number("stored TAT")?;
        let Quota::Gcra(limit) = tx.quota else {
            return Err(bad("a tiered key on the lean path".into()));
        };
        // The script judged the value (a foreign one comes back as the drained bucket that
        // replaced it): what it answers is the crate's.
        let stored_tat = (stored > 0).then_some(stored);
        let wide = crate::backend::kit::trusted(limit, stored_tat, now);
        let outcome = gcra::check(wide.as_ref().unwrap_or(limit), stored_tat, now, tx.cost)?;
        decided.push((stored, outcome));
    }
    let outcomes: Outcomes = decided.iter().map(|(_, o)| Outcome::from(*o)).collect();
    let allowed = batch_allowed(txs.clone().zip(outcomes.iter()));
    let tats = txs
        .zip(&decided)
        .map(|(tx, (stored, o))| {
            let written = allowed.then(|| gcra_write(tx.mode, o, *stored, now));
            let after = written.flatten().unwrap_or(*stored);
            if after <= now { 0 } else { after }
        })
        .collect();
    Ok(ScriptReply {
        outcomes,
        tats,
        raws: Vec::new(),
        now,
    })
}

/// Decodes the calendar path's answer (now, the units that counted, the end of the period the
/// script chose) into the decision it made: the same rule (`calendar::decide_used`).
fn decode_calendar<'a>(
    items: Vec<Value>,
    mut txs: impl Iterator<Item = &'a BucketTx<'a>>,
) -> Result<ScriptReply, BackendError> {
    let (Some(tx), None) = (txs.next(), txs.next()) else {
        return Err(bad("the calendar path for more than one key".into()));
    };
    let Quota::Calendar(quota) = tx.quota else {
        return Err(bad("another shape on the calendar path".into()));
    };
    let [now, used, end] = <[Value; 3]>::try_from(items)
        .map_err(|items| bad(format!("{} values from the calendar path", items.len())))?
        .map(|v| v.as_i64().and_then(|n| u64::try_from(n).ok()));
    let (Some(now), Some(used), Some(end)) = (now, used, end) else {
        return Err(bad("a value of the calendar path is not a count".into()));
    };
    let out = calendar::decide_used(quota, used, end, now, tx.min_cost, tx.cost, tx.mode);
    let length = quota.length_of_period_ending(end);
    Ok(ScriptReply {
        outcomes: Outcomes::one(crate::backend::kit::calendar_outcome(&out, length)),
        tats: vec![end],
        raws: Vec::new(),
        now,
    })
}

/// Decodes a spend's or refund's answer for `txs` (the keys sent, in order), on `path` as
/// sent.
pub(super) fn decode<'a>(
    value: Value,
    path: Path,
    txs: impl ExactSizeIterator<Item = &'a BucketTx<'a>> + Clone,
    call: Call,
) -> Result<ScriptReply, BackendError> {
    let Value::Array(items) = value else {
        return Err(bad(format!("{:?}", value.kind())));
    };
    match path {
        Path::Lean => return decode_lean(items, txs),
        Path::Calendar => return decode_calendar(items, txs),
        Path::General => {}
    }
    let n = txs.len();
    if items.len() != n + 1 {
        return Err(bad(format!("{} values for {n} keys", items.len())));
    }
    let mut items = items.into_iter();
    let mut reply = ScriptReply {
        outcomes: Outcomes::with_capacity(n),
        tats: Vec::with_capacity(n),
        raws: Vec::with_capacity(n),
        now: 0,
    };
    for (key, (tx, item)) in txs.zip(items.by_ref()).enumerate() {
        let Value::Array(values) = item else {
            return Err(bad(format!("key {}: {:?}", key + 1, item.kind())));
        };
        let mut f = Fields {
            key,
            values: values.into_iter(),
        };
        let (tat, outcome) = decode_outcome(&mut f, tx, call)?;
        let (tiers, raw) = match (tx.penalty, tx.quota) {
            (Some(_), _) => (None, decode_raw(&mut f, call)?),
            (None, Quota::Tiered(limit)) => decode_tiers(&mut f, limit, call.want_raw)?,
            _ => (None, None),
        };
        f.end()?;
        reply.tats.push(tat);
        reply.outcomes.push_tiered(outcome, tiers);
        reply.raws.push(raw);
    }
    let now = items.next().ok_or_else(|| bad("no now".into()))?;
    reply.now = now
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| bad(format!("now is {now:?}")))?;
    Ok(reply)
}

/// A key's outcome on the general path, and its stored TAT (a calendar key's period end, by
/// the store's clock): the numbers every shape answers, a range's grant, and a shape's own
/// number (a calendar quota's period, a learning shape's slots).
fn decode_outcome(
    f: &mut Fields,
    tx: &BucketTx<'_>,
    call: Call,
) -> Result<(u64, Outcome), BackendError> {
    let mut outcome = Outcome::new(
        f.flag("allowed")?,
        f.u64("remaining")?,
        f.u64("retry_after")?,
        f.u64("reset_after")?,
    );
    let tat = f.u64("stored TAT")?;
    if tx.penalty.is_some() {
        // A penalty's companion answers the numbers every shape answers, and whether its key
        // is banned.
        outcome.banned = f.flag("banned")?;
        let level = f.u64("ban level")?;
        outcome.shape_number = u32::try_from(level).unwrap_or(u32::MAX);
        return Ok((tat, outcome));
    }
    if reports_granted(call, tx) {
        outcome.granted = Some(f.u64("granted")?);
    }
    if let Quota::Calendar(quota) = tx.quota {
        outcome.shape_number =
            crate::algo::calendar::period_seconds(quota.length_of_period_ending(tat));
        // A charge is taken whole: its cost, which the script saw cut to what its numbers
        // hold (every count is far below).
        if tx.mode == Mode::Charge && outcome.allowed && call.op == Op::Spend {
            outcome.granted = Some(tx.cost);
        }
    }
    if tx.quota.learns().is_some() {
        outcome.shape_number = u32::from(adaptive::slots(f.u64("slots")?));
    }
    Ok((tat, outcome))
}

/// A tiered key's grant per tier, and, when a cross-slot spend may be undone, its value before
/// and after.
fn decode_tiers(
    f: &mut Fields,
    limit: &crate::algo::tiers::TieredLimit,
    want_raw: bool,
) -> Result<(Option<TierGrant>, Option<RawChange>), BackendError> {
    let tier_count = limit.tiers().len().min(MAX_TIERS);
    let mut grant = TierGrant {
        granted: f.u64("granted")?,
        tier_count: tier_count as u8,
        tier: u8::try_from(f.u64("tier")?).map_err(|_| bad("tier".into()))?,
        burst: f.flag("burst")?,
        ..TierGrant::default()
    };
    for units in grant.units.iter_mut().take(tier_count) {
        *units = f.u64("units of a tier")?;
    }
    let raw = if want_raw { raw_change(f)? } else { None };
    Ok((Some(grant), raw))
}

/// A value kept whole (a tiered key's, a penalty's): its value before and after a spend and
/// the milliseconds the one before had to live, which undo it ([`RawChange`]).
fn raw_change(f: &mut Fields) -> Result<Option<RawChange>, BackendError> {
    Ok(Some(RawChange {
        before: f.next("value before")?,
        after: f.next("value after")?,
        ttl_ms: f.next("ttl")?.as_i64().unwrap_or(-1),
    }))
}

/// A penalty's value before and after a spend, when a cross-slot spend may be undone.
fn decode_raw(f: &mut Fields, call: Call) -> Result<Option<RawChange>, BackendError> {
    if call.want_raw && call.op == Op::Spend {
        raw_change(f)
    } else {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::{Code, PROTOCOL, SCRIPT};

    /// The script's `local A, B = x, y` lines: every name with its value.
    fn script_constants() -> Vec<(String, Code)> {
        let mut out = Vec::new();
        for line in SCRIPT.lines() {
            let Some(rest) = line.strip_prefix("local ") else {
                continue;
            };
            let Some((names, values)) = rest.split_once(" = ") else {
                continue;
            };
            let names: Vec<&str> = names.split(", ").collect();
            let values: Vec<&str> = values.split(", ").collect();
            if names.len() != values.len()
                || !names.iter().all(|n| {
                    n.starts_with("OP_") || n.starts_with("KIND_") || n.starts_with("MODE_")
                })
            {
                continue;
            }
            for (name, value) in names.iter().zip(values) {
                let code = match value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
                    Some(word) => Code::Word(Box::leak(word.to_owned().into_boxed_str())),
                    None => Code::Number(value.parse().expect("a number")),
                };
                out.push((name.to_string(), code));
            }
        }
        out
    }

    #[test]
    fn the_scripts_codes_are_the_protocol_table() {
        let script = script_constants();
        for (name, code) in PROTOCOL {
            let found: Vec<_> = script.iter().filter(|(n, _)| n == name).collect();
            assert_eq!(found.len(), 1, "{name} is defined once in the script");
            assert_eq!(&found[0].1, code, "{name} in the script");
        }
        assert_eq!(script.len(), PROTOCOL.len(), "no code the table lacks");
    }

    /// The general path's two files name no record kind: each shape's file registers its
    /// handler under its own kinds, so a new shape edits no loop of the general path.
    #[test]
    fn the_general_path_names_no_shape() {
        for (file, text) in [
            ("general.lua", include_str!("general.lua")),
            ("general_run.lua", include_str!("general_run.lua")),
        ] {
            for (i, line) in text.lines().enumerate() {
                let code = line.split("--").next().unwrap_or("");
                assert!(!code.contains("KIND_"), "{file}:{}: {}", i + 1, line.trim());
            }
        }
    }

    /// The script compares kinds, modes and ops with the named codes only, so the table is
    /// the whole protocol.
    #[test]
    fn the_script_compares_no_code_with_a_bare_literal() {
        for (i, line) in SCRIPT.lines().enumerate() {
            let code = line.split("--").next().unwrap_or("");
            for what in ["kind", "mode", "op"] {
                for cmp in ["==", "~="] {
                    let needle = format!("{what} {cmp} ");
                    if let Some(at) = code.find(&needle) {
                        let next = code[at + needle.len()..].chars().next();
                        assert!(
                            !matches!(next, Some('0'..='9' | '\'' | '"')),
                            "the script's line {}: {}",
                            i + 1,
                            line.trim()
                        );
                    }
                }
            }
        }
    }
}
