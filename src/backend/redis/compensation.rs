//! Compensation: a cluster batch spans slots, one script per slot; when one slot denies (or
//! fails), what the others spent is given back, so the batch stays all or nothing as the client sees it.

use fred::prelude::Key;

use super::RedisBackend;
use super::script::{self, RawChange};
use crate::backend::{BucketTx, Outcome};

impl RedisBackend {
    /// Gives back what allowed groups of a denied cluster batch spent: GCRA buckets by a
    /// refund, concurrency keys by releasing the lease taken, tiered keys by putting back their
    /// value from before (when nobody wrote them since), which also undoes the tiers the spend
    /// entered.
    pub(super) async fn compensate(
        &self,
        batch: &[BucketTx<'_>],
        keys: &[Key],
        spent: &[usize],
        outcomes: &[Outcome],
        raws: &[Option<RawChange>],
    ) {
        crate::telemetry::compensation();
        // A GCRA bucket gets back what it was granted: its cost, or a partial grant's units;
        // a concurrency key its lease (a refund there is a release).
        let txs: Vec<BucketTx<'_>> = spent
            .iter()
            .filter(|&&i| !batch[i].undone_by_value())
            .map(|&i| BucketTx {
                cost: outcomes[i].granted.unwrap_or(batch[i].cost),
                ..batch[i]
            })
            .collect();
        if let Err(e) = self.refund_batch(&txs).await {
            tracing::error!(target: crate::telemetry::target::BACKEND,
                error = %e,
                "could not give back what the allowed part of a cross-slot batch spent (another \
                 part was denied or failed); it drains at the limits' rate"
            );
        }
        for &i in spent {
            let Some(raw) = &raws[i] else { continue };
            if raw.before == raw.after {
                continue;
            }
            let slot = fred::util::redis_keyslot(keys[i].as_bytes());
            let result = self
                .eval(slot, || {
                    (vec![keys[i].clone()], script::encode_restore(raw))
                })
                .await;
            if let Err(e) = result {
                tracing::error!(target: crate::telemetry::target::BACKEND,
                    error = %e,
                    "could not undo the tiered part of a cross-slot batch another part of which was \
                     denied or failed"
                );
            }
        }
    }
}
