//! A gate that slow handlers wait at, opened by the test: no sleeps, the test knows when
//! handlers are in flight and lets them finish when it chooses.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, watch};

/// Where slow handlers wait: each counts itself in `entered`, then waits for a permit.
#[derive(Clone)]
pub struct Gate {
    entered: Arc<watch::Sender<usize>>,
    open: Arc<Semaphore>,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    pub fn new() -> Self {
        Self {
            entered: Arc::new(watch::channel(0).0),
            open: Arc::new(Semaphore::new(0)),
        }
    }

    /// A handler's wait: counted in, then held until the test opens the gate for it.
    pub async fn pass(&self) {
        self.entered.send_modify(|n| *n += 1);
        if let Ok(permit) = self.open.acquire().await {
            permit.forget();
        }
    }

    /// Waits until `n` handlers have entered in all.
    pub async fn entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|&e| e >= n))
            .await
            .expect("handlers never entered")
            .unwrap();
    }

    /// Lets `n` waiting (or future) handlers through.
    pub fn open(&self, n: usize) {
        self.open.add_permits(n);
    }
}
