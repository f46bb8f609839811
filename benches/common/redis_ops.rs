//! The Redis decisions the Redis benches compare, in one place: `redis_backend.rs` times them,
//! `redis_calls.rs` (under `redis_instructions.sh`) counts their instructions.

use std::time::Duration;

use fred::prelude::{LuaInterface, Value};
use tower_ratelimits::{Id, Limiter, Limits, RedisBackend, Transaction};

/// Every request of the benches is allowed and writes (`Live` is for the memory measurements).
pub const LIMITS: &str = "\
A: {burst: 100000000, count: 1000000, period: 1s}
B: {kind: ip, burst: 100000000, count: 1000000, period: 1s}
C: {kind: account, burst: 100000000, count: 1000000, period: 1s}
Live: {kind: account, burst: 2, count: 1, period: 30s}
Hot: {burst: 100000000, count: 1000000, period: 1s, prefetch: 50}
Monthly: {kind: account, calendar: {count: 1000000000000, period: month}}
Shared: {kind: account, burst: 100000000, count: 1000000, period: 1s, fair_share: {}}
Slots: {kind: account, concurrency: 100000, lease: 60s}
Adaptive: {kind: account, concurrency: {adaptive: {min: 10, initial: 50, max: 100, completions: 100}}}
Pooled: {kind: account, concurrency: {adaptive: {min: 10, initial: 50, max: 100, completions: 100, capacity: 4096}}}
Banning: {kind: account, burst: 100000000, count: 1000000, period: 1s, penalty: {after: 1000, within: 1s, base: 1s, factor: 2, max: 1h}}
";

/// Keys cycled: `0..KEYS`.
pub const KEYS: u64 = 1000;

/// The variants, by name.
pub const VARIANTS: [&str; 19] = [
    "baseline_evalsha",
    "ours_1_rule",
    "ours_1_rule_uncoalesced",
    "ours_3_rules",
    "ours_3_rules_uncoalesced",
    "tower_rate_limit_fred",
    "ours_1_rule_coalesced",
    "ours_1_rule_hot_key",
    "ours_1_rule_hot_key_uncoalesced",
    "ours_1_rule_coalesced_hot_key",
    "tower_rate_limit_fred_hot_key",
    "ours_1_rule_hot_key_prefetch",
    "ours_calendar",
    "ours_calendar_uncoalesced",
    "ours_fair_share",
    "ours_concurrency_slot",
    "ours_adaptive_slot",
    "ours_adaptive_pool_slot",
    "ours_penalty",
];

/// Requests one coalesced call carries at most (`ours_1_rule_coalesced`).
pub const COALESCE: usize = 64;

/// A limiter over our Redis backend, and the baseline's trivial script.
pub struct RedisOps {
    pub limiter: Limiter,
    /// The same limits over a backend that coalesces (`RedisBackendBuilder::coalesce`).
    pub coalesced: Limiter,
    /// The same limits over a backend that never coalesces (`coalesce(0)`).
    pub uncoalesced: Limiter,
    pub backend: RedisBackend,
    pub trivial_sha: String,
}

impl RedisOps {
    /// Connects to `url` (keys under `rl:bench:`, no deny cache: every decision is a call).
    pub async fn connect(url: &str) -> Self {
        let backend = RedisBackend::from_url(url)
            .prefix("rl:bench:")
            .deny_cache(false)
            .connect()
            .await
            .expect("connect to Redis");
        let trivial_sha: String = backend.client().script_load("return 1").await.unwrap();
        let limiter = Limiter::new(
            Limits::from_yaml_str(LIMITS, None).unwrap(),
            backend.clone(),
        );
        let coalescing = RedisBackend::from_url(url)
            .prefix("rl:bench:")
            .deny_cache(false)
            .coalesce(COALESCE)
            .coalesce_in_flight(2)
            .connect()
            .await
            .expect("connect to Redis");
        let coalesced = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), coalescing);
        let direct = RedisBackend::from_url(url)
            .prefix("rl:bench:")
            .deny_cache(false)
            .coalesce(0)
            .connect()
            .await
            .expect("connect to Redis");
        let uncoalesced = Limiter::new(Limits::from_yaml_str(LIMITS, None).unwrap(), direct);
        Self {
            limiter,
            coalesced,
            uncoalesced,
            backend,
            trivial_sha,
        }
    }

    /// Decision `i` of `variant`: `baseline_evalsha` (`EVALSHA` of `return 1`), `ours_1_rule`,
    /// `ours_3_rules` (one script), `tower_rate_limit_fred` (the peer's GCRA script over the
    /// same fred client; its largest burst at 1,000/s per key, never denied here).
    pub async fn one(&self, variant: &str, i: u64) {
        let id = i % KEYS;
        match variant {
            "baseline_evalsha" => {
                let key = format!("rl:bench:{{0:{id}}}");
                let _: Value = self
                    .backend
                    .client()
                    .evalsha(self.trivial_sha.as_str(), vec![key], Vec::<Value>::new())
                    .await
                    .unwrap();
            }
            "ours_1_rule" => spends(&self.limiter, "A", id).await,
            // One key for every decision: a hot key (a tenant behind many instances).
            "ours_1_rule_hot_key" => spends(&self.limiter, "A", 0).await,
            "ours_1_rule_hot_key_uncoalesced" => spends(&self.uncoalesced, "A", 0).await,
            // The hot key through the coalescing backend.
            "ours_1_rule_coalesced_hot_key" => spends(&self.coalesced, "A", 0).await,
            // The same hot key under a limit with `prefetch: 50`.
            "ours_1_rule_hot_key_prefetch" => spends(&self.limiter, "Hot", 0).await,
            // One calendar quota (a month; never used up here): the script's calendar path,
            // coalesced while Redis is busy (`K` calls).
            "ours_calendar" => spends(&self.limiter, "Monthly", id).await,
            // A limit with a ladder no run reaches: the limit's word and its companion's
            // state decided in one call.
            "ours_penalty" => spends(&self.limiter, "Banning", id).await,
            "ours_calendar_uncoalesced" => spends(&self.uncoalesced, "Monthly", id).await,
            // One fair share, every key an id of it (1,000 ids counted; never used up here):
            // the limit's one hash, the script's general path.
            "ours_fair_share" => spends(&self.limiter, "Shared", id).await,
            // A slot taken and given back (two calls: the decision, the release).
            "ours_concurrency_slot" => slot(&self.limiter, "Slots", id, None).await,
            // The same on an adaptive limit, the release with its completion (a window of 100).
            "ours_adaptive_slot" => {
                let done = tower_ratelimits::Completion::new(Duration::from_millis(5), false);
                slot(&self.limiter, "Adaptive", id, Some(done)).await
            }
            // The same with the limit's keys sharing 4,096 slots: every key in the limit's one
            // hash (one slot of a cluster).
            "ours_adaptive_pool_slot" => {
                let done = tower_ratelimits::Completion::new(Duration::from_millis(5), false);
                slot(&self.limiter, "Pooled", id, Some(done)).await
            }
            "ours_1_rule_coalesced" => spends(&self.coalesced, "A", id).await,
            // Coalescing turned off.
            "ours_1_rule_uncoalesced" => spends(&self.uncoalesced, "A", id).await,
            "ours_3_rules" => three_rules(&self.limiter, id).await,
            "ours_3_rules_uncoalesced" => three_rules(&self.uncoalesced, id).await,
            "tower_rate_limit_fred" => self.peer(format!("trlf:bench:{id}")).await,
            // The peer on one hot key (its burst, 65,535, outlasts a run).
            "tower_rate_limit_fred_hot_key" => self.peer("trlf:bench:hot".to_string()).await,
            other => panic!("unknown variant {other}"),
        }
    }

    /// One decision of the peer (tower-rate-limit-fred's GCRA script over the same fred
    /// client) on `key`: its largest burst at 1,000/s, never denied here.
    async fn peer(&self, key: String) {
        let retry = tower_rate_limit_fred::rate_limit(
            &self.backend.client(),
            key,
            u16::MAX,
            Duration::from_millis(1),
        )
        .await
        .unwrap();
        assert_eq!(retry, None);
    }
}

/// One allowed spend of `limiter`'s limit `name` for the id `id`.
async fn slot(
    limiter: &Limiter,
    name: &str,
    id: u64,
    completion: Option<tower_ratelimits::Completion>,
) {
    let key = limiter.key(name, Id::from(id)).unwrap();
    let d = limiter.spend(&[Transaction::new(key)]).await.unwrap();
    assert!(d.allowed());
    let leases: Vec<_> = d.decisions().iter().filter_map(|d| d.lease()).collect();
    let given = match completion {
        Some(c) => limiter.complete(&leases, c).await,
        None => limiter.release(&leases).await,
    };
    assert_eq!(given.unwrap(), 1);
}

async fn spends(limiter: &Limiter, name: &str, id: u64) {
    let key = limiter.key(name, Id::from(id)).unwrap();
    let d = limiter.spend(&[Transaction::new(key)]).await.unwrap();
    assert!(d.allowed());
}

/// One request under three rules (two keyed by the id, one by an address made of it): one
/// batch of three transactions.
async fn three_rules(limiter: &Limiter, id: u64) {
    let ip = std::net::IpAddr::from([10, 0, (id >> 8) as u8, id as u8]);
    let batch = [
        Transaction::new(limiter.key("A", Id::from(id)).unwrap()),
        Transaction::new(limiter.key("B", Id::from(ip)).unwrap()),
        Transaction::new(limiter.key("C", Id::from(id)).unwrap()),
    ];
    assert!(limiter.spend(&batch).await.unwrap().allowed());
}
