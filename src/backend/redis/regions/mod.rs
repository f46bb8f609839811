//! Regional mode (`docs/regions.md`): the region's side of one limit across regions. A
//! region's share buckets are decided by the script with every request (`share.lua`);
//! here what moves the shares: the region's registration in the global store, and the
//! rebalance (number a request for each busy key's share in the region's store, answer them in
//! the global store with the protocol's functions, apply the grants in the region's store).

mod overrides;
mod rebalance;
mod store_start;
mod task;

pub(in crate::backend::redis) use overrides::RegionalOverrides;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use fred::prelude::{Key, Value};

use super::RedisBackend;
use super::keys::KeyBuf;
use super::script::{self, Call, Op, ShareAnswer, ShareGrant};
use crate::algo::regions::Share;
pub(crate) use crate::backend::regions::RegionalSettings;
use crate::backend::regions::global::{self, RegistryRecord, Stored};
use crate::backend::{BackendError, BucketTx};
use crate::key::BucketKey;

/// The global store's script (`global.lua`).
const GLOBAL_SCRIPT: &str = include_str!("global.lua");

/// Why regional mode cannot be set up as asked ([`RedisSetupError::InvalidRegional`](super::RedisSetupError::InvalidRegional)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionalError {
    /// A region name that is not 1 to 32 ASCII letters, digits, `-` or `_` (the name).
    #[error("region {0:?}: a region is named by 1 to 32 ASCII letters, digits, '-' or '_'")]
    RegionName(String),
    /// The global store under the region's own prefix (the prefix).
    #[error("the global store's prefix {0:?} is the region's own: give it one of its own")]
    SamePrefix(String),
    /// A rebalance period or a lease margin of zero.
    #[error("the rebalance period and the lease margin must be longer than zero")]
    ZeroTiming,
}

/// Whether regional mode can be set up as asked: `region`'s name, the global store's prefix
/// beside the region's own, the settings.
pub(crate) fn check(
    region: &str,
    global_prefix: &str,
    settings: &RegionalSettings,
    prefix: &str,
) -> Result<(), RegionalError> {
    if !global::is_region_name(region) {
        return Err(RegionalError::RegionName(region.to_owned()));
    }
    if global_prefix == prefix {
        return Err(RegionalError::SamePrefix(prefix.to_owned()));
    }
    if settings.period_us == 0 || settings.margin_us == 0 {
        return Err(RegionalError::ZeroTiming);
    }
    Ok(())
}

/// What regional mode keeps beside the region's store.
pub(crate) struct Regional {
    /// This region's name.
    pub(crate) region: String,
    /// The global store (its own prefix).
    pub(crate) global: RedisBackend,
    pub(crate) settings: RegionalSettings,
    /// Whether this region's registration is confirmed: until then its floors are 0.
    confirmed: AtomicBool,
    /// When the region's store started, on the script's clock (`store_start::UNKNOWN` until
    /// read): a share bucket it holds no record of is empty at that time.
    store_start: AtomicU64,
    /// The registry as last read or written: its registrations (with their times: a lost
    /// registry is made again with them) and its quiet period.
    registry: Mutex<RegistryRecord>,
    /// The global script's SHA-1.
    sha: fred::bytes_utils::Str,
    /// The units this instance's requests asked of each marked key in this period.
    demand: Mutex<std::collections::HashMap<BucketKey, u64>>,
    /// When the demand was last taken (instance clock): what the demand so far counts over.
    demand_since: AtomicU64,
    /// The limits in force on the limiter served (which limits are marked: where their
    /// overrides are kept).
    followed: Mutex<Option<crate::backend::FollowedLimits>>,
}

impl std::fmt::Debug for Regional {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Regional")
            .field("region", &self.region)
            .field("settings", &self.settings)
            .field("confirmed", &self.confirmed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Regional {
    pub(crate) fn new(region: String, global: RedisBackend, settings: RegionalSettings) -> Self {
        Self {
            region,
            global,
            settings,
            confirmed: AtomicBool::new(false),
            store_start: AtomicU64::new(store_start::UNKNOWN),
            registry: Mutex::default(),
            sha: fred::util::sha1_hash(GLOBAL_SCRIPT).into(),
            demand: Mutex::default(),
            demand_since: AtomicU64::new(0),
            followed: Mutex::default(),
        }
    }

    /// Follows the limits in force on the limiter served.
    pub(crate) fn follow(&self, limits: crate::backend::FollowedLimits) {
        *self.followed.lock().unwrap_or_else(PoisonError::into_inner) = Some(limits);
    }

    /// Whether this region's registration is confirmed (its floors may be used).
    pub(crate) fn confirmed(&self) -> bool {
        self.confirmed.load(Ordering::Acquire)
    }

    /// Whether this region's registration is confirmed, as the global store answered (the
    /// instance that rebalances) or as that instance wrote it in the region's store (the
    /// others). Only an answer changes it: an instance that can read neither (the global
    /// store unreachable or hung, the region's record of it gone) keeps what it knew, as the
    /// instance that rebalances does, so the instances of a region never decide its buckets
    /// on different floors for want of an answer (`docs/regions.md`, "Several instances in a
    /// region").
    fn set_confirmed(&self, confirmed: bool) {
        self.confirmed.store(confirmed, Ordering::Release);
        crate::telemetry::region_confirmed(&self.region, confirmed);
    }

    /// Confirmed without waiting one lease and the margin after a registration, on a store
    /// taken as started long ago (its keys full): for the tests of a region's share buckets
    /// alone.
    #[cfg(test)]
    pub(crate) fn confirm_for_tests(&self) {
        self.confirmed.store(true, Ordering::Release);
        self.store_start.store(0, Ordering::Release);
    }
}

/// What one rebalance did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// Keys asked for.
    pub(crate) asked: usize,
    /// Grants the global store answered.
    pub(crate) answered: usize,
    /// Grants applied in the region's store.
    pub(crate) applied: usize,
    /// Keys another instance wrote between this one's read and write three times running (asked
    /// again next time).
    pub(crate) conflicts: usize,
    /// The keys whose part or reported demand is not zero after the round: asked again at the
    /// next rebalance (demand 0 when they have none), so a part is given back and a demand
    /// that stopped stops counting, not a lease later.
    pub(crate) asked_next: Vec<BucketKey>,
    /// The keys whose answer may change once the other regions have reported and confirmed
    /// in this period (`global::Answered::ask_again`), with their demands: the task asks again
    /// later in the period.
    pub(crate) ask_again: Vec<(BucketKey, u64)>,
}

impl Round {
    /// Adds a later pass's counts, and its keys asked at the next rebalance.
    fn absorb(&mut self, later: Round) {
        self.asked += later.asked;
        self.answered += later.answered;
        self.applied += later.applied;
        self.conflicts += later.conflicts;
        let mut seen: std::collections::HashSet<BucketKey> =
            self.asked_next.iter().cloned().collect();
        for key in later.asked_next {
            if seen.insert(key.clone()) {
                self.asked_next.push(key);
            }
        }
    }
}

/// The most share buckets one call of the region's script numbers or applies grants to.
const SHARE_CALL_KEYS: usize = 256;

/// Which pass of a period a rebalance's call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The period's rebalance: it sets the metrics of each marked limit's part and demand.
    /// With the largest floor of the marked limits when the registry is read with the keys (a
    /// global store that is not a cluster): this region is registered in it before any key is
    /// answered, with the keys' records as read in the same instant.
    First(Option<u16>),
    /// A pass that confirms parts made smaller, or asks again later in the period.
    Later,
}

/// A request for one key's share, numbered by the region's store (`RegionKey::request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Numbered {
    /// Larger than every earlier request of this region for the key.
    pub(crate) seq: u64,
    /// The number of the grant the region applies (0: none).
    pub(crate) applied: u64,
    /// When it left, on the clock of the store that holds the key: its lease starts here.
    pub(crate) sent_at: u64,
    /// The part the region uses now (zero once its lease ended).
    pub(crate) part: Share,
}

impl RedisBackend {
    /// Numbers a request for the share of each of `txs` (share buckets: each carries its
    /// floor), one call per slot; in `txs`' order.
    pub(crate) async fn share_requests(
        &self,
        txs: &[BucketTx<'_>],
    ) -> Result<Vec<Numbered>, BackendError> {
        let mut out = vec![
            Numbered {
                seq: 0,
                applied: 0,
                sent_at: 0,
                part: Share::ZERO,
            };
            txs.len()
        ];
        for (group, (numbers, now)) in self.on_shares(Op::ShareRequest, txs, &[], 4).await? {
            for (&i, n) in group.iter().zip(numbers) {
                out[i] = Numbered {
                    seq: n[0],
                    applied: n[1],
                    sent_at: now,
                    part: Share {
                        rate: n[2],
                        burst: n[3],
                    },
                };
            }
        }
        Ok(out)
    }

    /// Applies `grants` (one per transaction of `txs`, in order) to the share buckets, one call
    /// per slot: whether each was applied (a late or repeated grant is not).
    pub(crate) async fn share_grants(
        &self,
        txs: &[BucketTx<'_>],
        grants: &[ShareGrant],
    ) -> Result<Vec<bool>, BackendError> {
        let mut out = vec![false; txs.len()];
        for (group, (applied, _)) in self.on_shares(Op::ShareGrant, txs, grants, 1).await? {
            for (&i, a) in group.iter().zip(applied) {
                out[i] = a[0] == 1;
            }
        }
        Ok(out)
    }

    /// One call of `op` per slot of `txs`' share buckets: each group's positions and its
    /// answer (`fields` numbers per key, and the store's now).
    async fn on_shares(
        &self,
        op: Op,
        txs: &[BucketTx<'_>],
        grants: &[ShareGrant],
        fields: usize,
    ) -> Result<Vec<(Vec<usize>, ShareAnswer)>, BackendError> {
        let keys = self.keys(txs);
        let (now, local) = self.now_arg()?;
        let call = Call {
            op,
            now,
            local,
            expiry: self.expiry(),
            want_raw: false,
            shares: self.share_call(),
        };
        let mut out = Vec::new();
        // At most `SHARE_CALL_KEYS` keys a call: one call over a rebalance's 10,000 keys held
        // the region's store for a quarter of a second, and every request decided behind it
        // waited as long.
        let chunks = self.groups(&keys).into_iter().flat_map(|(slot, group)| {
            (group.chunks(SHARE_CALL_KEYS).map(|c| (slot, c.to_vec()))).collect::<Vec<_>>()
        });
        for (slot, group) in chunks {
            let group_keys = || -> Vec<Key> { group.iter().map(|&i| keys[i].clone()).collect() };
            let group_grants: Vec<ShareGrant> = group
                .iter()
                .filter_map(|&i| grants.get(i).copied())
                .collect();
            let value = self
                .eval(slot, || {
                    (
                        group_keys(),
                        script::encode_shares(call, group.iter().map(|&i| &txs[i]), &group_grants),
                    )
                })
                .await?;
            let answer = script::decode_shares(value, group.len(), fields)?;
            out.push((group, answer));
        }
        Ok(out)
    }
}

/// A call of the global script: a read (each key's value, `''` for none) or a compare-and-set.
enum GlobalCall<'a> {
    Read,
    /// Per key: the value read, the value to write (`''` deletes), its time to live (ms).
    Cas(&'a [(String, String, u64)]),
}

impl Regional {
    /// One call of the global script on `keys` (one slot of the global store): the store's now
    /// and per key its value (a read) or whether it was written (`"1"`).
    async fn global_call(
        &self,
        slot: u16,
        keys: &[Key],
        call: GlobalCall<'_>,
    ) -> Result<(u64, Vec<String>), BackendError> {
        let args = || -> Vec<Value> {
            match call {
                GlobalCall::Read => vec![Value::from("read")],
                GlobalCall::Cas(writes) => std::iter::once(Value::from("cas"))
                    .chain(writes.iter().flat_map(|(seen, new, ttl)| {
                        [
                            Value::from(seen.as_str()),
                            Value::from(new.as_str()),
                            Value::Integer(i64::try_from(*ttl).unwrap_or(i64::MAX)),
                        ]
                    }))
                    .collect(),
            }
        };
        crate::telemetry::region_global_call(&self.region);
        let value = self
            .global
            .eval_script(slot, &self.sha, GLOBAL_SCRIPT, || (keys.to_vec(), args()))
            .await?;
        let bad = |what: &str| {
            BackendError::Unavailable(format!("unexpected reply of the global store: {what}"))
        };
        let Value::Array(items) = value else {
            return Err(bad("not a list"));
        };
        if items.len() != keys.len() + 1 {
            return Err(bad("not one value per key"));
        }
        let mut items = items.into_iter();
        let now = items
            .next()
            .and_then(|v| v.as_i64())
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad("no time"))?;
        Ok((
            now,
            items.map(|v| v.into_string().unwrap_or_default()).collect(),
        ))
    }

    /// The registry's key in the global store.
    fn registry_key(&self) -> Key {
        Key::from(format!("{}{{regions}}", self.global.prefix()))
    }

    /// `kept` (the registry as the region's store keeps it) merged into the registrations
    /// this instance has seen.
    pub(crate) fn merge_seen(&self, kept: &RegistryRecord) {
        (self.registry.lock().unwrap_or_else(PoisonError::into_inner)).merge_seen(kept);
    }

    /// The registry as this instance last read it (with what it merged).
    pub(crate) fn seen(&self) -> RegistryRecord {
        (self.registry.lock().unwrap_or_else(PoisonError::into_inner)).clone()
    }

    /// Registers this region in the global store (keeps its registration; makes a lost
    /// registry again, quiet, with the registrations seen) and learns whether it is
    /// confirmed. `floor_bp`: the largest floor of the marked limits.
    pub(crate) async fn register(&self, floor_bp: u16) -> Result<(), BackendError> {
        let keys = [self.registry_key()];
        let (now, read) = self
            .global_call(self.registry_slot(), &keys, GlobalCall::Read)
            .await?;
        let text = read.into_iter().next().unwrap_or_default();
        self.registered(text, now, floor_bp).await
    }

    /// The registry's slot (any on a global store that is not a cluster: it is read with the
    /// keys of a rebalance, in the same call).
    fn registry_slot(&self) -> u16 {
        fred::util::redis_keyslot(self.registry_key().as_bytes())
    }

    /// Registers this region in the registry `text` read at `now` (the global store's clock):
    /// written when it changes (`global::register`), then whether this region is confirmed.
    async fn registered(&self, text: String, now: u64, floor_bp: u16) -> Result<(), BackendError> {
        let slot = self.registry_slot();
        let keys = [self.registry_key()];
        let stored = Stored::read(&text, RegistryRecord::parse);
        let current = match &stored {
            Stored::Ours(r) => Some(r),
            _ => None,
        };
        let seen = self
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .regions
            .clone();
        let hold = self
            .settings
            .lease_us
            .saturating_add(self.settings.margin_us);
        let changed = global::register(
            current,
            &seen,
            &self.region,
            now,
            hold,
            floor_bp,
            crate::time::random_u64(),
        )
        .map_err(|e| BackendError::Unavailable(e.to_string()))?;
        let record = match changed {
            Some(new) => {
                let writes = [(text, new.text(), 0)];
                let (_, written) = self
                    .global_call(slot, &keys, GlobalCall::Cas(&writes))
                    .await?;
                if written.first().map(String::as_str) != Some("1") {
                    // Another instance changed it first: this period decides nothing (a grant
                    // needs the registry as the store holds it: its floors, its quiet period).
                    return Err(BackendError::Unavailable(
                        "the registry of regions changed while this region registered; \
                         rebalanced at the next period"
                            .into(),
                    ));
                }
                new
            }
            None => current.cloned().unwrap_or_default(),
        };
        let confirmed = record
            .registered_at(&self.region)
            .is_some_and(|at| now.saturating_sub(at) >= hold);
        self.set_confirmed(confirmed);
        *self.registry.lock().unwrap_or_else(PoisonError::into_inner) = record;
        Ok(())
    }
}

impl RedisBackend {
    /// Regional mode, when on.
    pub(crate) fn regional_mode(&self) -> Option<&Arc<Regional>> {
        self.inner.regional.as_ref()
    }

    /// Whether share buckets decide with their floors now: not in regional mode, or this
    /// region's registration is confirmed, this instance has read the global store's
    /// overrides (the marked limits' own) whole once, and it knows when the region's store
    /// started.
    pub(crate) fn floors(&self) -> bool {
        self.inner.regional.as_ref().is_none_or(|r| {
            r.confirmed()
                && r.store_start().is_some()
                && r.global
                    .inner
                    .overrides_ready
                    .load(std::sync::atomic::Ordering::Acquire)
        })
    }

    /// What the script's share buckets decide with: the floors (above), and when the region's
    /// store started (0: unknown, or not regional).
    pub(crate) fn share_call(&self) -> script::ShareCall {
        script::ShareCall {
            floors: self.floors(),
            store_start: self
                .inner
                .regional
                .as_ref()
                .and_then(|r| r.store_start())
                .unwrap_or(0),
        }
    }
}

impl RedisBackend {
    /// This region's share of `key` (a limit marked `across_regions`, `limit` its quota, with
    /// `floor`), as its share bucket's record holds it; the lease by this instance's clock.
    pub(crate) async fn share_of(
        &self,
        key: &BucketKey,
        limit: &crate::algo::gcra::Limit,
        floor: crate::config::RegionFloor,
    ) -> Result<Option<crate::backend::regions::RegionShare>, BackendError> {
        use fred::prelude::KeysInterface;
        let Some(regional) = self.regional_mode() else {
            return Ok(None);
        };
        let record = KeyBuf::new(self.prefix(), key, super::keys::SHARE_SUFFIX).key();
        let slot = fred::util::redis_keyslot(record.as_bytes());
        let text: Option<String> = self
            .with_client(slot, |client| {
                let record = record.clone();
                async move { client.get::<Option<String>, _>(record).await }
            })
            .await?;
        // `1 <TAT> <interval> <burst> <written at> <rate> <burst> <applied> <lease end> <last>`.
        let fields: Vec<u64> = text
            .as_deref()
            .unwrap_or("")
            .split(' ')
            .filter_map(|f| f.parse().ok())
            .collect();
        let now = self.inner.local.now_us();
        let (part, lease_left) = match fields.as_slice() {
            [1, _, _, _, _, rate, burst, _, lease_end, _] if *lease_end > now => {
                ((*rate, *burst), lease_end - now)
            }
            _ => ((0, 0), 0),
        };
        let confirmed = regional.confirmed();
        let floor = if confirmed {
            (floor.of(limit.count()), floor.of(limit.burst()))
        } else {
            (0, 0)
        };
        Ok(Some(crate::backend::regions::RegionShare {
            region: regional.region.clone(),
            confirmed,
            floor,
            part,
            lease_left: std::time::Duration::from_micros(lease_left),
        }))
    }
}

#[cfg(test)]
mod check_tests {
    use super::*;

    /// Regional mode set up wrong is refused with what is wrong: a name, the global store's
    /// prefix, a timing of zero.
    #[test]
    fn regional_mode_set_up_wrong_is_refused_by_kind() {
        let settings = RegionalSettings::default();
        assert_eq!(check("eu-1", "g:", &settings, "r:"), Ok(()));
        assert_eq!(
            check("eu 1", "g:", &settings, "r:"),
            Err(RegionalError::RegionName("eu 1".into()))
        );
        assert_eq!(
            check("eu", "r:", &settings, "r:"),
            Err(RegionalError::SamePrefix("r:".into()))
        );
        let zero = RegionalSettings {
            period_us: 0,
            ..RegionalSettings::default()
        };
        let err = check("eu", "g:", &zero, "r:").unwrap_err();
        assert_eq!(err, RegionalError::ZeroTiming);
        assert_eq!(
            err.to_string(),
            "the rebalance period and the lease margin must be longer than zero"
        );
    }
}
