//! The in-memory backend, counting its batches (both paths: `spend` and `spend_now`), for the
//! "one backend call per request" tests of the middleware's own logic.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use tower_ratelimits::{Backend, BackendError, BucketKey, BucketTx, MemoryBackend, Outcome};

pub struct Counting {
    pub calls: Arc<AtomicUsize>,
    pub inner: MemoryBackend,
}

#[async_trait]
impl Backend for Counting {
    async fn spend(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.spend(batch).await
    }
    fn spend_now(&self, batch: &[BucketTx<'_>]) -> Option<Result<Vec<Outcome>, BackendError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.spend_now(batch)
    }
    async fn refund(&self, batch: &[BucketTx<'_>]) -> Result<Vec<Outcome>, BackendError> {
        self.inner.refund(batch).await
    }
    async fn reset(&self, keys: &[&BucketKey]) -> Result<(), BackendError> {
        self.inner.reset(keys).await
    }
}
