//! Coalescing: while script calls are in flight, the lean spends of other requests queue up,
//! and the next call carries all of them (op `M` of `ratelimit.lua`): each request is still its
//! own batch, all or nothing alone, decided in queue order as if it had been sent alone. The
//! server runs one `EVALSHA` (one command parsed, one `TIME`, one reply) for many decisions.
//!
//! Nothing waits on purpose: a request that finds fewer than `in_flight` calls outstanding is
//! sent at once, so at low concurrency every call carries one request (the `g` call, as
//! without coalescing) and the only cost is the hop through the coalescing task. A request
//! waits only for a free call, i.e. at most one call's round trip, and never longer than the
//! command timeout (then [`BackendError::Timeout`]). The queue is bounded: when it is full, a
//! request is sent on its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use fred::prelude::{Key, Value};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{Inner, RedisBackend};
use crate::backend::BackendError;

/// Requests a queue holds at most; beyond, a request is sent on its own.
const QUEUE: usize = 4096;

/// The settings: how many requests one call carries at most, and how many calls may be in
/// flight before requests queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) max_batch: usize,
    pub(super) in_flight: usize,
}

/// One request's lean spend: its keys and its two arguments per key (the `g` call's).
pub(super) struct Job {
    pub(super) keys: Vec<Key>,
    pub(super) args: Vec<Value>,
    /// now, then the TATs read for this request's keys.
    reply: oneshot::Sender<Result<Vec<Value>, BackendError>>,
}

/// What coalescing did since the backend connected ([`RedisBackend::coalesce_stats`]): the
/// requests it carried and the script calls it made for them. `requests / calls` is the mean
/// number of decisions per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoalesceStats {
    /// Script calls made by the coalescing task.
    pub calls: u64,
    /// Requests (batches) those calls decided.
    pub requests: u64,
}

/// The queue's sending end, held by the backend; the coalescing task ends when it is dropped.
pub(super) struct Coalescer {
    tx: mpsc::Sender<Job>,
    timeout: Duration,
    calls: AtomicU64,
    requests: AtomicU64,
}

impl Coalescer {
    /// Starts the coalescing task on the current tokio runtime (`None` outside one: the
    /// backend then calls directly).
    pub(super) fn start(
        settings: Settings,
        timeout: Duration,
        backend: Weak<Inner>,
    ) -> Option<Coalescer> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (tx, rx) = mpsc::channel(QUEUE);
        runtime.spawn(run(settings, rx, backend));
        Some(Coalescer {
            tx,
            timeout,
            calls: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        })
    }

    pub(super) fn stats(&self) -> CoalesceStats {
        CoalesceStats {
            calls: self.calls.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }

    /// Queues `keys` and `args` and waits for the answer (now, then the TATs read); `Err(())`
    /// when the queue is full or the task is gone: the caller sends the call itself.
    pub(super) async fn spend(
        &self,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Result<Vec<Value>, BackendError>, ()> {
        let (reply, answer) = oneshot::channel();
        if self.tx.try_send(Job { keys, args, reply }).is_err() {
            return Err(());
        }
        Ok(match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(BackendError::Unavailable(
                "the coalescing task stopped before answering".into(),
            )),
            Err(_) => Err(BackendError::Timeout(self.timeout)),
        })
    }
}

/// The task: waits for a free call, then takes the queued jobs (at most `max_batch`) into it.
async fn run(settings: Settings, mut rx: mpsc::Receiver<Job>, backend: Weak<Inner>) {
    let calls = Arc::new(Semaphore::new(settings.in_flight.max(1)));
    loop {
        let Ok(permit) = calls.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut jobs = vec![first];
        while jobs.len() < settings.max_batch {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        let Some(inner) = backend.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            RedisBackend { inner }.run_jobs(jobs).await;
            drop(permit);
        });
    }
}

impl RedisBackend {
    /// One call for `jobs` (the `g` call for one), its answer split among them.
    async fn run_jobs(&self, jobs: Vec<Job>) {
        if let Some(c) = &self.inner.coalescer {
            c.calls.fetch_add(1, Ordering::Relaxed);
            c.requests.fetch_add(jobs.len() as u64, Ordering::Relaxed);
        }
        let result = if let [job] = &jobs[..] {
            self.eval(0, || (job.keys.clone(), job.args.clone())).await
        } else {
            self.eval(0, || coalesced_call(&jobs)).await
        };
        let items = match result {
            Ok(Value::Array(items)) => items,
            Ok(other) => {
                let e = BackendError::Unavailable(format!(
                    "unexpected script reply: {:?}",
                    other.kind()
                ));
                for job in jobs {
                    let _ = job.reply.send(Err(e.clone()));
                }
                return;
            }
            Err(e) => {
                for job in jobs {
                    let _ = job.reply.send(Err(e.clone()));
                }
                return;
            }
        };
        let now = items.first().cloned().unwrap_or(Value::Null);
        let mut read = items.into_iter().skip(1);
        for job in jobs {
            let mut answer = Vec::with_capacity(1 + job.keys.len());
            answer.push(now.clone());
            answer.extend(read.by_ref().take(job.keys.len()));
            // A short answer is caught by the decoder (a count that does not match).
            let _ = job.reply.send(Ok(answer));
        }
    }
}

/// The keys and arguments of an `M` call: the number of requests, each one's key count, then
/// every request's two arguments per key, in queue order.
fn coalesced_call(jobs: &[Job]) -> (Vec<Key>, Vec<Value>) {
    let n: usize = jobs.iter().map(|j| j.keys.len()).sum();
    let mut keys = Vec::with_capacity(n);
    let mut args = Vec::with_capacity(2 + jobs.len() + 2 * n);
    args.push(Value::String(fred::bytes_utils::Str::from_static("M")));
    args.push(Value::Integer(jobs.len() as i64));
    for job in jobs {
        args.push(Value::Integer(job.keys.len() as i64));
    }
    for job in jobs {
        keys.extend(job.keys.iter().cloned());
        args.extend(job.args.iter().cloned());
    }
    (keys, args)
}
