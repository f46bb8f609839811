//! Coalescing: while script calls are in flight, the lean spends of other requests queue up,
//! and the next call carries all of them (op `M` of `ratelimit.lua`): each request is still its
//! own batch, all or nothing alone, decided in queue order as if it had been sent alone. The
//! server runs one `EVALSHA` (one command parsed, one `TIME`, one reply) for many decisions.
//!
//! Nothing waits on purpose, and nothing hops when there is no crowd: a request that finds
//! fewer than `in_flight` calls outstanding makes its own call, exactly as without coalescing.
//! Only a request that finds them all busy queues; whichever call ends next (or the request
//! itself, if one ended meanwhile) sends the queue as one call, from a spawned task. A queued
//! request waits at most for one call to end, and never longer than the command timeout (then
//! [`BackendError::Timeout`]). The queue is bounded: when it is full, a request makes its own
//! call.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use fred::prelude::{Key, Value};
use tokio::sync::oneshot;

use super::{RedisBackend, script};
use crate::backend::BackendError;

/// Requests the queue holds at most; beyond, a request makes its own call.
const QUEUE: usize = 4096;

/// The settings: how many requests one call carries at most, and how many calls may be in
/// flight before requests queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) max_batch: usize,
    pub(super) in_flight: usize,
}

/// What coalescing did since the backend connected ([`RedisBackend::coalesce_stats`]):
/// `calls` made for `requests` queued requests (`requests / calls` of them per call), and the
/// `direct` requests that found a call free and made their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CoalesceStats {
    /// Calls that carried queued requests.
    pub calls: u64,
    /// Queued requests those calls decided.
    pub requests: u64,
    /// Requests that made their own call (a call was free, or the queue was full).
    pub direct: u64,
}

/// One queued request's lean spend: its keys and its two arguments per key (the `g` call's).
struct Job {
    keys: Vec<Key>,
    args: Vec<Value>,
    /// now, then the TATs read for this request's keys.
    reply: oneshot::Sender<Result<Vec<Value>, BackendError>>,
}

/// The queue and the count of calls in flight, held by the backend.
pub(super) struct Coalescer {
    settings: Settings,
    timeout: Duration,
    in_flight: AtomicUsize,
    queue: Mutex<Vec<Job>>,
    calls: AtomicU64,
    requests: AtomicU64,
    direct: AtomicU64,
}

impl Coalescer {
    pub(super) fn new(settings: Settings, timeout: Duration) -> Self {
        Coalescer {
            settings,
            timeout,
            in_flight: AtomicUsize::new(0),
            queue: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            direct: AtomicU64::new(0),
        }
    }

    pub(super) fn stats(&self) -> CoalesceStats {
        CoalesceStats {
            calls: self.calls.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            direct: self.direct.load(Ordering::Relaxed),
        }
    }

    /// Takes a call slot if one is free.
    fn enter(&self) -> bool {
        if self.in_flight.fetch_add(1, Ordering::SeqCst) < self.settings.in_flight {
            return true;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        false
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<Job>> {
        // A panic while holding the lock leaves a valid Vec: keep using it.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A call slot, given back when dropped (also when the call's future is cancelled); giving it
/// back sends what queued meanwhile.
pub(super) struct Slot<'a>(&'a RedisBackend);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(c) = &self.0.inner.coalescer {
            c.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.0.flush();
        }
    }
}

/// How a request goes when coalescing is on.
pub(super) enum Route<'a> {
    /// A call slot is free (or the queue is full): make the call, holding the slot.
    Direct(Option<Slot<'a>>),
    /// Queued: the answer (now, then the TATs read), when a call carried it.
    Queued(Result<Vec<Value>, BackendError>),
}

impl RedisBackend {
    /// Routes a lean spend with the defaults (`make` builds its keys and arguments, only when
    /// it queues).
    pub(super) async fn coalesce<M>(&self, coalescer: &Coalescer, make: M) -> Route<'_>
    where
        M: FnOnce() -> (Vec<Key>, Vec<Value>),
    {
        if coalescer.enter() {
            coalescer.direct.fetch_add(1, Ordering::Relaxed);
            return Route::Direct(Some(Slot(self)));
        }
        let (reply, answer) = oneshot::channel();
        // Built before the lock is taken, which then only guards a push.
        let (keys, args) = make();
        {
            let mut queue = coalescer.queue();
            if queue.len() >= QUEUE {
                drop(queue);
                coalescer.direct.fetch_add(1, Ordering::Relaxed);
                return Route::Direct(None);
            }
            queue.push(Job { keys, args, reply });
        }
        // A call may have ended between the check and the push: send the queue if a slot is
        // free now.
        self.flush();
        Route::Queued(
            match tokio::time::timeout(coalescer.timeout, answer).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(_)) => Err(BackendError::Unavailable(
                    "a coalesced call ended without answering".into(),
                )),
                Err(_) => Err(BackendError::Timeout(coalescer.timeout)),
            },
        )
    }

    /// Sends what is queued, one call per free slot, each from a spawned task.
    fn flush(&self) {
        let Some(coalescer) = &self.inner.coalescer else {
            return;
        };
        loop {
            if coalescer.queue().is_empty() || !coalescer.enter() {
                return;
            }
            let jobs: Vec<Job> = {
                let mut queue = coalescer.queue();
                let n = queue.len().min(coalescer.settings.max_batch);
                queue.drain(..n).collect()
            };
            if jobs.is_empty() {
                // Taken by another flush meanwhile: give the slot back and look again.
                coalescer.in_flight.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            coalescer.calls.fetch_add(1, Ordering::Relaxed);
            coalescer
                .requests
                .fetch_add(jobs.len() as u64, Ordering::Relaxed);
            let backend = self.clone();
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                // No runtime (being shut down): the queued requests' waits end with it.
                coalescer.in_flight.fetch_sub(1, Ordering::SeqCst);
                return;
            };
            runtime.spawn(async move {
                let _slot = Slot(&backend);
                backend.run_jobs(jobs).await;
            });
        }
    }

    /// One call for `jobs` (the `g` call for one), its answer split among them.
    async fn run_jobs(&self, jobs: Vec<Job>) {
        let result = if let [job] = &jobs[..] {
            self.eval(0, || (job.keys.clone(), job.args.clone())).await
        } else {
            self.eval(0, || {
                script::encode_coalesced(jobs.iter().map(|j| (&j.keys[..], &j.args[..])))
            })
            .await
        };
        let items = match result {
            Ok(Value::Array(items)) => items,
            other => {
                let e = match other {
                    Err(e) => e,
                    Ok(v) => BackendError::Unavailable(format!(
                        "unexpected script reply: {:?}",
                        v.kind()
                    )),
                };
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
