//! Regional mode (`docs/regions.md`): the region's side of one limit across regions. A
//! region's share buckets are decided by the script with every request (`general_read.lua`);
//! here the rebalancer's two calls on them: number a request for each key's share, and apply
//! the grants the global store answered.

use fred::prelude::Key;

use super::RedisBackend;
use super::script::{self, Call, Op, ShareGrant};
use crate::backend::{BackendError, BucketTx};

/// A request for one key's share, numbered by the region's store (`RegionKey::request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Numbered {
    /// Larger than every earlier request of this region for the key.
    pub(crate) seq: u64,
    /// The number of the grant the region applies (0: none).
    pub(crate) applied: u64,
    /// When it left, on the clock of the store that holds the key: its lease starts here.
    pub(crate) sent_at: u64,
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
            };
            txs.len()
        ];
        for (group, (numbers, now)) in self.on_shares(Op::ShareRequest, txs, &[], 2).await? {
            for (&i, n) in group.iter().zip(numbers) {
                out[i] = Numbered {
                    seq: n[0],
                    applied: n[1],
                    sent_at: now,
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
        };
        let mut out = Vec::new();
        for (slot, group) in self.groups(&keys) {
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

type ShareAnswer = (Vec<smallvec::SmallVec<[u64; 2]>>, u64);
