//! Every metric the crate emits, in one place (feature `metrics`; without it each function is
//! empty). Names follow Prometheus conventions; `docs/operating.md`'s "Metrics and logs"
//! lists them. Labels are bounded: operation names and limit names, never ids.
#![cfg_attr(not(feature = "metrics"), allow(unused_variables))]

/// The log targets, a promise to operators (`docs/operating.md`, "Metrics and logs", lists
/// them): every event the crate logs is on one of these, never on a module path that moves
/// with the code.
pub(crate) mod target {
    /// Each decision (`debug`) and each request refused for its key (`debug`).
    pub(crate) const DECISION: &str = "tower_ratelimits::decision";
    /// What a shadow rule would have denied (`info`).
    pub(crate) const SHADOW: &str = "tower_ratelimits::shadow";
    /// Reloads of the limits, from files or in code, and the fallback's copy of them.
    pub(crate) const RELOAD: &str = "tower_ratelimits::reload";
    /// The store: failures and recoveries, the failure policy applied, the circuit breaker,
    /// slots not renewed or released, settles not applied, the memory table.
    pub(crate) const BACKEND: &str = "tower_ratelimits::backend";
    /// Keys that could not be extracted because of the server's set-up (not the client's
    /// request), and responses that could not carry all they should (gRPC details).
    pub(crate) const LAYER: &str = "tower_ratelimits::layer";
}

/// `tower_ratelimits_backend_duration_seconds{op}`: how long a backend took to decide a batch
/// that it did not decide at once (Redis; memory decides synchronously and is not timed).
#[cfg(feature = "metrics")]
pub(crate) fn backend_duration(op: &'static str, seconds: f64) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("tower_ratelimits_backend_duration_seconds", "op" => op).record(seconds);
}

/// `tower_ratelimits_redis_round_trips_total`: scripts sent to Redis (one per slot of a
/// batch, and the compensations of a denied cross-slot batch).
#[cfg(feature = "redis")]
pub(crate) fn redis_round_trip() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_redis_round_trips_total").increment(1);
}

/// `tower_ratelimits_redis_deny_cache_hits_total`: batches the deny cache denied locally.
#[cfg(feature = "redis")]
pub(crate) fn deny_cache_hit() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_redis_deny_cache_hits_total").increment(1);
}

/// `tower_ratelimits_redis_compensations_total`: denied cross-slot batches whose allowed slots
/// were given back.
#[cfg(feature = "redis")]
pub(crate) fn compensation() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_redis_compensations_total").increment(1);
}

/// `tower_ratelimits_redis_circuit_opened_total`: times a circuit breaker opened.
#[cfg(feature = "redis")]
pub(crate) fn circuit_opened() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_redis_circuit_opened_total").increment(1);
}

/// `tower_ratelimits_redis_out_of_memory_total`: spends Redis refused for lack of memory
/// (`maxmemory` under `noeviction`), counted apart from other store failures.
#[cfg(feature = "redis")]
pub(crate) fn redis_out_of_memory() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_redis_out_of_memory_total").increment(1);
}

/// `tower_ratelimits_prefetch_refills_total{limit}`: refills of prefetched tokens the store
/// granted (a refill rides a request's own script call).
#[cfg(feature = "redis")]
pub(crate) fn prefetch_refill(limit: crate::key::LimitName) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_prefetch_refills_total", "limit" => limit.as_str())
        .increment(1);
}

/// `tower_ratelimits_prefetch_returned_units_total{limit}`: prefetched tokens given back to
/// the store unused (expired, dropped by a charge, or at shutdown).
#[cfg(feature = "redis")]
pub(crate) fn prefetch_returned(limit: crate::key::LimitName, units: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_prefetch_returned_units_total", "limit" => limit.as_str())
        .increment(units);
}

/// `tower_ratelimits_prefetch_local_decisions_total{limit, decision}`: requests of a
/// prefetching limit decided without a call, `allowed` (from prefetched tokens) or `denied`
/// (the store's last word leaves no room for a refill).
#[cfg(feature = "redis")]
pub(crate) fn prefetch_local_decision(limit: crate::key::LimitName, allowed: bool) {
    #[cfg(feature = "metrics")]
    {
        let decision = if allowed { "allowed" } else { "denied" };
        metrics::counter!("tower_ratelimits_prefetch_local_decisions_total", "limit" => limit.as_str(), "decision" => decision)
            .increment(1);
    }
}

/// `tower_ratelimits_memory_full_total`: requests refused because the memory table was full.
pub(crate) fn memory_full() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_memory_full_total").increment(1);
}

/// After a sweep: `tower_ratelimits_memory_sweeps_total`,
/// `tower_ratelimits_memory_swept_keys_total` (buckets dropped) and the gauge
/// `tower_ratelimits_memory_keys` (buckets held).
pub(crate) fn memory_swept(dropped: usize, live: usize) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("tower_ratelimits_memory_sweeps_total").increment(1);
        metrics::counter!("tower_ratelimits_memory_swept_keys_total").increment(dropped as u64);
        metrics::gauge!("tower_ratelimits_memory_keys").set(live as f64);
    }
}

/// A settled reservation ([`Settle`](crate::Settle)):
/// `tower_ratelimits_settlements_total{limit, outcome}` with `outcome` one of `exact`,
/// `refunded`, `charged` (extra units taken, into debt as far as the limit allows),
/// `forgiven` (extra units of which none could be taken), `kept` (no true cost found: the
/// estimate stands), `failed` (the store did not settle: the estimate stands) and `absurd` (a
/// report above 2^40 units: what the bucket takes of it is charged, its units are counted in
/// no units counter, which they would wrap); and
/// `tower_ratelimits_settled_units_total{limit, outcome}` for the units refunded, charged or
/// forgiven (the units beyond the debt bound of a charge that took some count as forgiven).
pub(crate) fn settled(limit: crate::key::LimitName, outcome: &'static str, units: u64) {
    #[cfg(feature = "metrics")]
    {
        let limit = limit.as_str();
        metrics::counter!("tower_ratelimits_settlements_total", "limit" => limit, "outcome" => outcome)
            .increment(1);
    }
    settled_units(limit, outcome, units);
}

/// A key banned by `limit`'s penalty ladder, its `level`-th ban (`docs/penalties.md`):
/// `tower_ratelimits_bans_total{limit, level}`, the level as its number up to 9 and `10+`
/// above (a bounded label).
pub(crate) fn banned(limit: crate::key::LimitName, level: u32) {
    #[cfg(feature = "metrics")]
    {
        const LEVELS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
        let level = LEVELS.get(level as usize).copied().unwrap_or("10+");
        metrics::counter!("tower_ratelimits_bans_total", "limit" => limit.as_str(), "level" => level)
            .increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (limit, level);
}

/// Units of a settlement counted under `outcome` without counting a settlement (the forgiven
/// part of a charge that took some of its units).
pub(crate) fn settled_units(limit: crate::key::LimitName, outcome: &'static str, units: u64) {
    #[cfg(feature = "metrics")]
    if units > 0 {
        metrics::counter!("tower_ratelimits_settled_units_total", "limit" => limit.as_str(), "outcome" => outcome)
            .increment(units);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (limit, outcome, units);
}

/// A request that would have been denied waits instead ([`Wait`](crate::Wait)):
/// `tower_ratelimits_waits_total{limit, outcome="waited"}` (a wait began; a request that loses
/// the race when it wakes and waits again counts again).
pub(crate) fn waited(limit: crate::key::LimitName) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_waits_total", "limit" => limit.as_str(), "outcome" => "waited")
        .increment(1);
}

/// A request of a waiting rule refused anyway: `tower_ratelimits_waits_total{limit, outcome}`
/// with `outcome` `too_long` (its wait, or its turn in its key's line, is beyond the rule's
/// bound), `full` (the rule already has its most waiting requests) or `key_full` (its key
/// does).
pub(crate) fn wait_refused(limit: crate::key::LimitName, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_waits_total", "limit" => limit.as_str(), "outcome" => outcome)
        .increment(1);
}

/// `tower_ratelimits_waiting{limit}`: requests of a rule waiting now.
pub(crate) fn waiting(limit: crate::key::LimitName, now: usize) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tower_ratelimits_waiting", "limit" => limit.as_str()).set(now as f64);
}

/// A spend of a cost range (a partial grant): `tower_ratelimits_partial_grants_total{limit,
/// outcome}` with `outcome` `whole` (the range's upper end granted), `partial` (less, at least
/// its lower end) or `denied`; and `tower_ratelimits_partial_granted_units_total{limit}`.
pub(crate) fn partial_grant(limit: crate::key::LimitName, outcome: &'static str, units: u64) {
    #[cfg(feature = "metrics")]
    {
        let limit = limit.as_str();
        metrics::counter!("tower_ratelimits_partial_grants_total", "limit" => limit, "outcome" => outcome)
            .increment(1);
        metrics::counter!("tower_ratelimits_partial_granted_units_total", "limit" => limit)
            .increment(units);
    }
}

/// A slot on a concurrency limit: `tower_ratelimits_leases_total{limit, outcome}` with
/// `outcome` `acquired` (a request took a slot), `denied` (every slot was in use),
/// `renewed` (a live request's lease got a new deadline) or `released` (given back by this
/// instance while still held, not past its lease time).
pub(crate) fn lease(limit: crate::key::LimitName, outcome: &'static str) {
    leases(limit, outcome, 1);
}

/// [`lease`], `n` at once (a renewal of a key's leases).
pub(crate) fn leases(limit: crate::key::LimitName, outcome: &'static str, n: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_leases_total", "limit" => limit.as_str(), "outcome" => outcome)
        .increment(n);
    #[cfg(not(feature = "metrics"))]
    let _ = (limit, outcome, n);
}

/// `tower_ratelimits_adaptive_slots{limit}`: on an adaptive concurrency limit, the key's number
/// of slots after each completion this instance reported (how the numbers its keys run at are
/// spread, and how they move).
pub(crate) fn adaptive_slots(limit: crate::key::LimitName, slots: u64) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("tower_ratelimits_adaptive_slots", "limit" => limit.as_str())
        .record(slots as f64);
    #[cfg(not(feature = "metrics"))]
    let _ = (limit, slots);
}

/// `tower_ratelimits_stored_overrides`: the stored overrides in force on this limiter (set at
/// run time, applied to its limits; expired ones drop out when the store is next read).
pub(crate) fn stored_overrides(now: usize) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tower_ratelimits_stored_overrides").set(now as f64);
    #[cfg(not(feature = "metrics"))]
    let _ = now;
}

/// `tower_ratelimits_region_rebalances_total{region, outcome}`: rebalances of the limits
/// across regions this instance ran (it held its region's lock), `ok` or `failed`.
#[cfg(feature = "redis")]
pub(crate) fn region_rebalance(region: &str, ok: bool) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_region_rebalances_total",
        "region" => region.to_owned(), "outcome" => if ok { "ok" } else { "failed" })
    .increment(1);
}

/// `tower_ratelimits_region_global_calls_total{region}`: calls this instance sent to the
/// global store (each one command: a read, or a compare-and-set).
#[cfg(feature = "redis")]
pub(crate) fn region_global_call(region: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_region_global_calls_total", "region" => region.to_owned())
        .increment(1);
}

/// `tower_ratelimits_region_confirmed{region}`: 1 once the region's registration in the global
/// store is confirmed (its floors in use), 0 before (marked limits decide on granted parts alone).
#[cfg(feature = "redis")]
pub(crate) fn region_confirmed(region: &str, confirmed: bool) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("tower_ratelimits_region_confirmed", "region" => region.to_owned())
        .set(if confirmed { 1.0 } else { 0.0 });
}

/// `tower_ratelimits_region_keys{region, state}` at the last rebalance: keys `asked` for (the
/// busiest, and those giving a part back), keys `with_part` (a part above zero after it), and
/// `conflicts` (written by another instance between its read and write: asked again next time).
#[cfg(feature = "redis")]
pub(crate) fn region_keys(region: &str, asked: usize, with_part: usize, conflicts: usize) {
    #[cfg(feature = "metrics")]
    for (state, n) in [
        ("asked", asked),
        ("with_part", with_part),
        ("conflicts", conflicts),
    ] {
        metrics::gauge!("tower_ratelimits_region_keys", "region" => region.to_owned(), "state" => state)
            .set(n as f64);
    }
}

/// `tower_ratelimits_region_share{region, limit, of}` at the last rebalance, summed over a
/// marked limit's keys asked for: the parts granted to this region (`of` = `rate`, in requests
/// per the limit's period, or `burst`), and the demand above the floors (`of` = `demand`).
#[cfg(feature = "redis")]
pub(crate) fn region_share(
    region: &str,
    limit: crate::key::LimitName,
    rate: u64,
    burst: u64,
    demand: u64,
) {
    #[cfg(feature = "metrics")]
    for (of, n) in [("rate", rate), ("burst", burst), ("demand", demand)] {
        metrics::gauge!("tower_ratelimits_region_share",
            "region" => region.to_owned(), "limit" => limit.as_str(), "of" => of)
        .set(n as f64);
    }
}
