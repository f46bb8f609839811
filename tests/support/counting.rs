//! The in-memory backend, counting its batches (its one `spend`), for the "one backend call per
//! request" tests of the middleware's own logic.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tower_ratelimits::async_trait;
use tower_ratelimits::{
    Backend, BackendError, BucketKey, BucketTx, MemoryBackend, Outcomes, Spend,
};

pub struct Counting {
    pub calls: Arc<AtomicUsize>,
    pub inner: MemoryBackend,
}

#[async_trait]
impl Backend for Counting {
    fn spend(&self, batch: &[BucketTx<'_>]) -> Spend {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.spend(batch)
    }
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Outcomes, BackendError> {
        self.inner.refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        self.inner.reset(keys).await
    }
}
