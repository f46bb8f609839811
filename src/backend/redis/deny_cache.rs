//! The local deny cache: remembers the TATs of buckets Redis denied, so that a flood of
//! requests on an exhausted bucket is denied without a round trip (see the module docs of
//! the Redis backend for what it may and may not answer).

use std::sync::atomic::{AtomicU64, Ordering};

use quick_cache::sync::Cache;

use crate::backend::{BackendError, BucketTx, Outcome, Outcomes, batch_allowed, gcra_decide, kit};
use crate::key::BucketKey;

/// Remembers the TATs of recently denied buckets, on the local clock.
///
/// A bounded cache with O(1) insertion and eviction (quick_cache, S3-FIFO): a flood of new
/// denied keys evicts old entries as it goes, and never makes one request scan the cache.
pub(super) struct DenyCache {
    /// Bucket -> TAT lower bound in local microseconds (0: the bucket was fresh).
    map: Cache<BucketKey, u64>,
    pub(super) hits: AtomicU64,
}

impl DenyCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            map: Cache::new(capacity.max(1)),
            hits: AtomicU64::new(0),
        }
    }

    /// Buckets remembered (at most the capacity).
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Answers a batch locally when the remembered TAT of one of its counting transactions
    /// denies it: a batch is all or nothing, so that denial decides it. Remembered buckets
    /// report what their TATs say; the others are [skipped](Outcome::skip). Never answers
    /// "allowed" (the remembered TATs are lower bounds: only their denials are certain).
    pub(super) fn answer(
        &self,
        batch: &[BucketTx<'_>],
        now: u64,
    ) -> Option<Result<Outcomes, BackendError>> {
        if self.map.is_empty() {
            return None;
        }
        let mut outcomes = Outcomes::with_capacity(batch.len());
        for tx in batch {
            // Only GCRA buckets are remembered: a tiered one or a region's share bucket is
            // skipped, never guessed.
            let remembered = tx
                .plain_gcra()
                .and_then(|limit| Some((limit, self.map.get(tx.key)?)));
            let outcome = match remembered {
                Some((limit, tat)) => {
                    let tat = (tat != 0).then_some(tat);
                    // The store's TAT: a bucket drained under a larger limit is still drained.
                    let wide = kit::trusted(limit, tat, now);
                    match gcra_decide(tx, wide.as_ref().unwrap_or(limit), tat, now) {
                        Ok(d) => d.outcome(),
                        Err(_) => return None,
                    }
                }
                None => Outcome::skip(),
            };
            outcomes.push(outcome);
        }
        // The batch rule over the evaluated transactions: one counting denial decides.
        let evaluated = batch.iter().zip(&outcomes).filter(|(_, o)| !o.skipped);
        if batch_allowed(evaluated) {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        crate::telemetry::deny_cache_hit();
        Some(Ok(outcomes))
    }

    /// Remembers a bucket of a denied batch (evicting another when full).
    pub(super) fn remember(&self, key: &BucketKey, tat: u64) {
        self.map.insert(key.clone(), tat);
    }

    /// Updates a bucket if it is remembered.
    pub(super) fn refresh(&self, key: &BucketKey, tat: u64) {
        if !self.map.is_empty() && self.map.contains_key(key) {
            let _ = self.map.replace(key.clone(), tat, true);
        }
    }

    pub(super) fn forget(&self, key: &BucketKey) {
        self.map.remove(key);
    }

    /// Forgets every bucket.
    pub(super) fn clear(&self) {
        self.map.clear();
    }
}
