//! Calls to the store: a slot's client under its circuit breaker (a probe in the background
//! when the cool-off is over), the script by its SHA (loaded again after a flush), and a batch's
//! keys grouped by slot, one script call per group.

use super::*;

/// A server's circuit breaker, borrowed or shared.
pub(super) enum BreakerRef<'a> {
    Borrowed(&'a breaker::Breaker),
    Shared(Arc<breaker::Breaker>),
}

impl std::ops::Deref for BreakerRef<'_> {
    type Target = breaker::Breaker;
    fn deref(&self) -> &breaker::Breaker {
        match self {
            BreakerRef::Borrowed(b) => b,
            BreakerRef::Shared(b) => b,
        }
    }
}

/// Whether a call reached the server (an error the server answered counts: it is up).
pub(super) fn reached<T>(result: &Result<T, BackendError>) -> bool {
    !matches!(
        result,
        Err(BackendError::Timeout(_) | BackendError::Unavailable(_))
    )
}

pub(super) fn unavailable(e: FredError) -> BackendError {
    server_error(e.to_string())
}

/// The error a server's answer `text` is: out of memory, or unavailable.
pub(super) fn server_error(text: String) -> BackendError {
    // Redis's answer to a write at `maxmemory` under `noeviction`, also inside a script.
    if text.contains("OOM command not allowed") {
        crate::telemetry::redis_out_of_memory();
        return BackendError::OutOfMemory(text);
    }
    BackendError::Unavailable(text)
}

impl RedisBackend {
    /// Splits a batch into groups of one slot (one group, "slot" 0, when not clustered).
    pub(super) fn groups(&self, keys: &[Key]) -> Vec<(u16, Vec<usize>)> {
        if !self.inner.clustered {
            return vec![(0, (0..keys.len()).collect())];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = fred::util::redis_keyslot(key.as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups
    }

    /// Runs `f` on the client of `slot`; on a cluster, a `MOVED`/`ASK` answer refreshes the
    /// slot map and retries once (the command did not run), and a failure to reach the node
    /// schedules a refresh (a failover may have moved the slot).
    pub(super) async fn with_client<T, F, Fut>(&self, slot: u16, f: F) -> Result<T, BackendError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, FredError>>,
    {
        let breaker = self.breaker(slot);
        match breaker.admit(|| self.inner.local.now_us()) {
            breaker::Admission::Go => {}
            breaker::Admission::Probe => {
                // The cool-off is over: probe in the background, so that no request waits
                // the command timeout for a server that may still be down. The circuit stays
                // open until the probe answers.
                let backend = self.clone();
                tokio::spawn(async move { backend.probe(slot).await });
                return Err(BackendError::CircuitOpen {
                    retry_in: Duration::ZERO,
                });
            }
            breaker::Admission::Refuse(us) => {
                return Err(BackendError::CircuitOpen {
                    retry_in: Duration::from_micros(us),
                });
            }
        }
        let result = self.call(slot, f).await;
        breaker.record(reached(&result), false, || self.inner.local.now_us());
        result
    }

    /// Pings `slot`'s server within the command timeout and records what it found on its
    /// circuit: an answer closes it, a failure opens it for another cool-off.
    pub(super) async fn probe(&self, slot: u16) {
        /// A probe dropped before it answered (its runtime shut down) counts as failed, so the
        /// circuit is not left waiting for it forever: another cool-off, then another probe.
        struct Unanswered<'a>(Option<(&'a RedisBackend, u16)>);
        impl Drop for Unanswered<'_> {
            fn drop(&mut self) {
                if let Some((backend, slot)) = self.0 {
                    backend
                        .breaker(slot)
                        .record(false, true, || backend.inner.local.now_us());
                }
            }
        }
        let mut unanswered = Unanswered(Some((self, slot)));
        let result = self
            .call(slot, |client| async move { client.ping::<()>(None).await })
            .await;
        unanswered.0 = None;
        self.breaker(slot)
            .record(reached(&result), true, || self.inner.local.now_us());
    }

    /// The circuit breaker of `slot`'s server: borrowed for a single server (no reference
    /// count touched per command), shared from the topology on a cluster.
    pub(super) fn breaker(&self, slot: u16) -> BreakerRef<'_> {
        match &self.inner.conn {
            Connection::Cluster(router) => match router.breaker_for_slot(slot) {
                Some(b) => BreakerRef::Shared(b),
                None => BreakerRef::Borrowed(&self.inner.breaker),
            },
            _ => BreakerRef::Borrowed(&self.inner.breaker),
        }
    }

    /// Every circuit breaker of this backend (one per cluster master).
    pub(super) fn breakers(&self) -> Vec<Arc<breaker::Breaker>> {
        match &self.inner.conn {
            Connection::Cluster(router) => router.breakers(),
            _ => vec![self.inner.breaker.clone()],
        }
    }

    /// One command on `slot`'s node, within the command timeout; on a cluster, a
    /// `MOVED`/`ASK` answer refreshes the slot map and retries once.
    pub(super) async fn call<T, F, Fut>(&self, slot: u16, f: F) -> Result<T, BackendError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, FredError>>,
    {
        let (timeout, fred_timeout) = (self.inner.timeout, self.inner.fred_timeout);
        let f = &f;
        let attempt = |client: Client| async move {
            if fred_timeout {
                // fred's own timeout is ours: a second one would only register another timer.
                return f(client).await.map_err(Some);
            }
            match tokio::time::timeout(timeout, f(client)).await {
                Ok(r) => r.map_err(Some),
                Err(_) => Err(None),
            }
        };
        let client = self.inner.conn.client(slot)?;
        let result = attempt(client).await;
        let Connection::Cluster(router) = &self.inner.conn else {
            return result.map_err(|e| self.error(e));
        };
        match result {
            Ok(v) => Ok(v),
            Err(Some(e)) if cluster::is_redirect(&e) => {
                router.refresh_now().await;
                let client = self.inner.conn.client(slot)?;
                attempt(client).await.map_err(|e| self.error(e))
            }
            Err(e) => {
                router.refresh_soon();
                Err(self.error(e))
            }
        }
    }

    pub(super) fn error(&self, e: Option<FredError>) -> BackendError {
        match e {
            None => BackendError::Timeout(self.inner.timeout),
            Some(e) if *e.kind() == ErrorKind::Timeout => BackendError::Timeout(self.inner.timeout),
            Some(e) => unavailable(e),
        }
    }

    /// Runs the script on `slot`'s node: `EVALSHA`, and `EVAL` once when the server lost
    /// the script (`SCRIPT FLUSH`, a failover). `make` builds the keys and arguments of a
    /// command: once per command sent, so that nothing is copied for a resend that almost
    /// never happens.
    pub(super) async fn eval<M>(&self, slot: u16, make: M) -> Result<Value, BackendError>
    where
        M: Fn() -> (Vec<Key>, Vec<Value>),
    {
        self.eval_script(slot, &self.inner.sha, SCRIPT, make).await
    }

    /// [`eval`](Self::eval) of another script of the crate's (`sha` its SHA-1, `text` itself):
    /// by its SHA, sent whole when the server does not know it.
    pub(super) async fn eval_script<M>(
        &self,
        slot: u16,
        sha: &fred::bytes_utils::Str,
        text: &'static str,
        make: M,
    ) -> Result<Value, BackendError>
    where
        M: Fn() -> (Vec<Key>, Vec<Value>),
    {
        crate::telemetry::redis_round_trip();
        self.with_client(slot, |client| {
            let make = &make;
            async move {
                let (keys, args) = make();
                match client
                    .evalsha::<Value, _, _, _>(sha.clone(), keys, args)
                    .await
                {
                    Err(e) if e.details().contains("NOSCRIPT") => {
                        tracing::debug!(target: crate::telemetry::target::BACKEND, "Redis lost the rate-limit script; sending it again");
                        let (keys, args) = make();
                        client.eval::<Value, _, _, _>(text, keys, args).await
                    }
                    other => other,
                }
            }
        })
        .await
    }

    /// Runs the script on one slot's transactions `txs` (taking `path`), whose Redis keys
    /// `keys` builds.
    pub(super) async fn run_script<'a, T, K>(
        &self,
        (call, path): (Call, script::Path),
        slot: u16,
        txs: T,
        keys: K,
    ) -> Result<ScriptReply, BackendError>
    where
        T: ExactSizeIterator<Item = &'a BucketTx<'a>> + Clone,
        K: Fn() -> Vec<Key>,
    {
        let value = self
            .eval(slot, || (keys(), script::encode(call, path, txs.clone())))
            .await?;
        script::decode(value, path, txs.clone(), call)
    }

    /// Runs the script on one group of `batch` (one slot's keys).
    pub(super) async fn run_group(
        &self,
        call: Call,
        batch: &[BucketTx<'_>],
        keys: &[Key],
        (slot, group): &(u16, Vec<usize>),
    ) -> Result<ScriptReply, BackendError> {
        let txs = group.iter().map(|&i| &batch[i]);
        let script_keys = || group.iter().map(|&i| keys[i].clone()).collect();
        let path = script::path(call, txs.clone());
        self.run_script((call, path), *slot, txs, script_keys).await
    }

    /// Runs `op` on every group (concurrently), returning replies in batch order.
    pub(super) async fn run_groups(
        &self,
        op: Op,
        (now, local): (Option<u64>, u64),
        batch: &[BucketTx<'_>],
        keys: &[Key],
        groups: &[(u16, Vec<usize>)],
    ) -> Vec<Result<ScriptReply, BackendError>> {
        let mut call = Call {
            op,
            now,
            local,
            expiry: self.expiry(),
            want_raw: false,
            shares: self.share_call(),
        };
        if let [group] = groups {
            return vec![self.run_group(call, batch, keys, group).await];
        }
        // Several slots: a spend may have to be undone, so tiered keys report their values.
        call.want_raw = op == Op::Spend && batch.iter().any(|tx| tx.undone_by_value());
        futures_util::future::join_all(groups.iter().map(|g| self.run_group(call, batch, keys, g)))
            .await
    }
}
