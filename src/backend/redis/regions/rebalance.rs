//! One rebalance of a region (`docs/regions.md`): its keys numbered in the region's store,
//! answered in the global store one slot at a time (a read, the protocol's answers, one
//! compare-and-set, a key another region wrote in between answered again), the grants applied,
//! the parts made smaller confirmed at once, and each marked limit's part and demand reported.

use std::sync::PoisonError;

use fred::prelude::Key;

use super::super::RedisBackend;
use super::super::keys::KeyBuf;
use super::super::script::ShareGrant;
use super::{GlobalCall, Numbered, Pass, Regional, Round};
use crate::algo::gcra::Limit;
use crate::algo::regions::{Request, Share};
use crate::backend::regions::global::{self, KeyRecord, RegistryRecord, Stored};
use crate::backend::regions::marked;
use crate::backend::{BackendError, BucketTx};
use crate::config::{Limits, RegionFloor};
use crate::key::BucketKey;
use crate::mode::Mode;
use crate::quota::Quota;

/// How many times a key another region wrote between this one's read and write is answered in
/// one pass: read and answered again at once (twice more at most), not a period later.
const ATTEMPTS: usize = 3;

/// A key a pass asks for: a key of a marked GCRA limit, its quota, limit and floor, and its
/// demand.
struct Asked<'a> {
    key: &'a BucketKey,
    quota: &'a Quota,
    limit: Limit,
    floor: RegionFloor,
    demand: u64,
}

/// What one slot's answers were, for its keys (by their place in the pass).
struct Answered {
    grant: Option<ShareGrant>,
    ask_again: bool,
}

impl RedisBackend {
    /// One rebalance of this region under `limits`: register (or keep the registration),
    /// then for `demands` (each key's demand above its floor over the last period, in requests
    /// per its limit's period; at most `max_keys`, the busiest first) number requests in the
    /// region's store, answer them in the global store (one read and one compare-and-set per
    /// global slot), and apply the grants. Keys that are not of a marked GCRA limit are
    /// skipped.
    pub(crate) async fn rebalance(
        &self,
        limits: &Limits,
        demands: &[(BucketKey, u64)],
    ) -> Result<Round, BackendError> {
        let Some(regional) = self.regional_mode() else {
            return Ok(Round::default());
        };
        let floor_bp = limits
            .across_regions_names()
            .into_iter()
            .filter_map(|n| limits.across_regions(n))
            .map(crate::config::RegionFloor::basis_points)
            .max()
            .unwrap_or(0);
        // On a global store that is not a cluster the registry is read with the keys, in the
        // same call (one command a period less, and the keys' answers see the registry as it
        // is when they are read); on a cluster, first, on its own slot.
        let with_keys = !regional.global.inner.clustered;
        if !with_keys {
            regional.register(floor_bp).await?;
        }
        self.answer_keys(
            regional,
            limits,
            demands,
            Pass::First(with_keys.then_some(floor_bp)),
        )
        .await
    }

    /// `demands` answered (`rebalance_keys`), and the parts that made smaller confirmed at
    /// once (a request naming the grant just applied): the global store frees them for the
    /// other regions this period, not the next.
    pub(super) async fn answer_keys(
        &self,
        regional: &Regional,
        limits: &Limits,
        demands: &[(BucketKey, u64)],
        pass: Pass,
    ) -> Result<Round, BackendError> {
        let (mut round, smaller) = self.rebalance_keys(regional, limits, demands, pass).await?;
        if !smaller.is_empty() {
            let (again, _) = self
                .rebalance_keys(regional, limits, &smaller, Pass::Later)
                .await?;
            let confirmed: std::collections::HashSet<&BucketKey> =
                smaller.iter().map(|(k, _)| k).collect();
            round.asked_next.retain(|k| !confirmed.contains(k));
            round.absorb(again);
        }
        Ok(round)
    }

    /// One pass of a rebalance over `demands`: its round, and the keys whose part it made
    /// smaller (with their demands), to confirm.
    async fn rebalance_keys(
        &self,
        regional: &Regional,
        limits: &Limits,
        demands: &[(BucketKey, u64)],
        pass: Pass,
    ) -> Result<(Round, Vec<(BucketKey, u64)>), BackendError> {
        let (report, registry) = match pass {
            Pass::First(registry) => (true, registry),
            Pass::Later => (false, None),
        };
        let asked = busiest(regional, limits, demands);
        let txs: Vec<BucketTx<'_>> = asked
            .iter()
            .filter_map(|a| {
                BucketTx::new(a.key, a.quota, 0..=0, Mode::Observe)
                    .ok()
                    .map(|tx| tx.across_regions(Some(a.floor)))
            })
            .collect();
        if txs.len() != asked.len() || txs.is_empty() {
            if let Some(floor_bp) = registry {
                regional.register(floor_bp).await?;
            }
            return Ok((Round::default(), Vec::new()));
        }
        let numbered = self.share_requests(&txs).await?;
        let mut round = Round {
            asked: txs.len(),
            ..Round::default()
        };
        let Some(grants) = regional
            .answer_all(&asked, &numbered, registry, &mut round)
            .await?
        else {
            return Ok((Round::default(), Vec::new()));
        };
        // The keys this pass gives a smaller part than the one in use, with their demands.
        let smaller: Vec<(BucketKey, u64)> = asked
            .iter()
            .zip(&numbered)
            .zip(&grants)
            .filter(|((_, n), g)| g.is_some_and(|g| !n.part.within(g.share)))
            .map(|((a, _), _)| (a.key.clone(), a.demand))
            .collect();
        round.asked_next = asked
            .iter()
            .zip(&grants)
            .filter(|(a, g)| g.is_some_and(|g| g.share != Share::ZERO || a.demand > 0))
            .map(|(a, _)| a.key.clone())
            .collect();
        if report {
            report_parts(regional, limits, &asked, &grants);
        }
        let (txs, grants): (Vec<BucketTx<'_>>, Vec<ShareGrant>) = txs
            .iter()
            .zip(grants)
            .filter_map(|(tx, g)| Some((*tx, g?)))
            .unzip();
        if !txs.is_empty() {
            round.applied = self
                .share_grants(&txs, &grants)
                .await?
                .into_iter()
                .filter(|a| *a)
                .count();
        }
        Ok((round, smaller))
    }
}

/// The keys of `demands` a pass asks for: at most `max_keys`, the busiest first, those of a
/// marked GCRA limit.
fn busiest<'a>(
    regional: &Regional,
    limits: &'a Limits,
    demands: &'a [(BucketKey, u64)],
) -> Vec<Asked<'a>> {
    let mut busiest: Vec<&(BucketKey, u64)> = demands.iter().collect();
    busiest.sort_by_key(|d| std::cmp::Reverse(d.1));
    busiest.truncate(regional.settings.max_keys);
    busiest
        .into_iter()
        .filter_map(|(key, demand)| {
            let (quota, limit, floor) = marked(limits, key)?;
            Some(Asked {
                key,
                quota,
                limit: *limit,
                floor,
                demand: *demand,
            })
        })
        .collect()
}

/// Sets the metrics of each marked limit's part (what this pass granted its keys) and demand.
fn report_parts(
    regional: &Regional,
    limits: &Limits,
    asked: &[Asked<'_>],
    grants: &[Option<ShareGrant>],
) {
    for name in limits.across_regions_names() {
        let (mut part, mut demand) = (Share::ZERO, 0u64);
        for (a, grant) in asked.iter().zip(grants) {
            if a.key.name() == name {
                demand = demand.saturating_add(a.demand);
                if let Some(g) = grant {
                    part = part.plus(g.share);
                }
            }
        }
        crate::telemetry::region_share(&regional.region, name, part.rate, part.burst, demand);
    }
}

impl Regional {
    /// The global store's grants for `asked` (numbered as `numbered`), one slot at a time, the
    /// registry read with the first slot's keys when `registry` holds this region's floor;
    /// `None` when this region is not in the registry as the store holds it (never answered
    /// without its floors and quiet period).
    async fn answer_all(
        &self,
        asked: &[Asked<'_>],
        numbered: &[Numbered],
        mut registry: Option<u16>,
        round: &mut Round,
    ) -> Result<Option<Vec<Option<ShareGrant>>>, BackendError> {
        let global_keys: Vec<Key> = asked
            .iter()
            .map(|a| KeyBuf::new(self.global.prefix(), a.key, ":g").key())
            .collect();
        let mut grants: Vec<Option<ShareGrant>> = vec![None; asked.len()];
        for (slot, mut group) in self.global.groups(&global_keys) {
            for attempt in 0..ATTEMPTS {
                if group.is_empty() {
                    break;
                }
                let keys: Vec<Key> = group.iter().map(|&i| global_keys[i].clone()).collect();
                let (now, read) = self.read_global(slot, &keys, registry.take()).await?;
                let registry = self
                    .registry
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if registry.registered_at(&self.region).is_none() {
                    return Ok(None);
                }
                let (writes, answered) =
                    self.answer_group(&group, read, (asked, numbered), &registry, now);
                let (_, written) = self
                    .global_call(slot, &keys, GlobalCall::Cas(&writes))
                    .await?;
                let mut again = Vec::new();
                for ((&i, answer), ok) in group.iter().zip(answered).zip(written) {
                    if ok != "1" {
                        if attempt == ATTEMPTS - 1 {
                            round.conflicts += 1;
                        } else {
                            again.push(i);
                        }
                    } else if answer.grant.is_some() {
                        round.answered += 1;
                        grants[i] = answer.grant;
                        if answer.ask_again {
                            round
                                .ask_again
                                .push((asked[i].key.clone(), asked[i].demand));
                        }
                    }
                }
                group = again;
            }
        }
        Ok(Some(grants))
    }

    /// The records of `keys` (one slot of the global store) and the store's now; with the
    /// registry first when `registry` holds this region's floor (then registered in the same
    /// instant).
    async fn read_global(
        &self,
        slot: u16,
        keys: &[Key],
        registry: Option<u16>,
    ) -> Result<(u64, Vec<String>), BackendError> {
        let (now, mut read) = match registry {
            Some(floor_bp) => {
                let mut both = vec![self.registry_key()];
                both.extend(keys.iter().cloned());
                let (now, mut read) = self.global_call(slot, &both, GlobalCall::Read).await?;
                let text = if read.is_empty() {
                    String::new()
                } else {
                    read.remove(0)
                };
                self.registered(text, now, floor_bp).await?;
                (now, read)
            }
            None => self.global_call(slot, keys, GlobalCall::Read).await?,
        };
        read.truncate(keys.len());
        Ok((now, read))
    }

    /// The protocol's answer for each key of `group` from its record as `read`: what to
    /// write (the record read, the new one, its time to live) and the grant.
    fn answer_group(
        &self,
        group: &[usize],
        read: Vec<String>,
        (asked, numbered): (&[Asked<'_>], &[Numbered]),
        registry: &RegistryRecord,
        now: u64,
    ) -> (Vec<(String, String, u64)>, Vec<Answered>) {
        let mut writes = Vec::with_capacity(group.len());
        let mut answered = Vec::with_capacity(group.len());
        for (&i, text) in group.iter().zip(read) {
            let a = &asked[i];
            let n = numbered[i];
            let answer = global::answer(
                Stored::read(&text, KeyRecord::parse),
                registry,
                &self.region,
                Request {
                    region: 0,
                    seq: n.seq,
                    applied: n.applied,
                    demand: a.demand,
                    sent_at: n.sent_at,
                },
                global::Asked::of(&a.limit, a.floor),
                &self.settings.protocol(&a.limit),
                now,
            );
            let new = answer
                .record
                .as_ref()
                .map(KeyRecord::text)
                .unwrap_or_default();
            writes.push((text, new, answer.ttl_ms));
            answered.push(Answered {
                grant: answer.grant.map(|g| ShareGrant {
                    seq: g.seq,
                    share: g.share,
                    lease_end: n.sent_at.saturating_add(self.settings.lease_us),
                }),
                ask_again: answer.ask_again,
            });
        }
        (writes, answered)
    }
}
