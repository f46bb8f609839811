//! Coalescing: while script calls are in flight, the lean spends of other requests queue up,
//! and the next call carries all of them (op `M` of `ratelimit.lua`; a calendar quota's spends
//! alone in their batch likewise, op `K`, in a queue of their own): each request is still its
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
//!
//! Queueing pays only while Redis is the bottleneck: then a call waits behind others anyway,
//! and one call for many requests shortens that wait. When the round trip is the network's
//! (a remote Redis), waiting for a call to end only adds to it. So by default the limit
//! adapts ([`Adapt`]): every call's round trip is timed; while the recent round trips (their
//! moving average) stay under [`CONGESTED`] times the shortest one seen lately, no request
//! queues; above, requests queue behind `in_flight` calls, until the average falls under
//! `RELIEVED` times the shortest. An explicit `in_flight` is a fixed limit.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use fred::prelude::{Key, Value};
use tokio::sync::oneshot;

use super::RedisBackend;
use super::script::{self, Coalesced};
use crate::backend::BackendError;

/// Requests the queue holds at most; beyond, a request makes its own call.
const QUEUE: usize = 4096;

/// A cluster's hash slots.
const HASH_SLOTS: usize = 16_384;

/// The settings: how many requests one call carries at most, how many calls may be in flight
/// before requests queue, and whether that holds always or only while the round trips say
/// Redis is busy.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) max_batch: usize,
    pub(super) in_flight: usize,
    pub(super) adaptive: bool,
}

impl Default for Settings {
    /// On: up to 64 requests a call, queueing behind 2 calls while Redis is busy.
    fn default() -> Self {
        Settings {
            max_batch: 64,
            in_flight: 2,
            adaptive: true,
        }
    }
}

/// Round trips this many times the shortest one seen lately (on average) mean Redis is busy:
/// calls wait behind others there (a remote Redis's round trip is mostly the network's, and
/// stays near its shortest: about 2.3 times it at 16 and 64 connections through a proxy that
/// holds every chunk 1 ms each way, `benches/redis_rounds.rs`; a local Redis at 16
/// connections, tens of times). Requests queue from an average above `CONGESTED` times the
/// shortest, and stop below `RELIEVED` times it (so a short stretch of slow calls on a
/// remote link does not turn queueing on and off).
pub(super) const CONGESTED: u64 = 5;
const RELIEVED: u64 = 3;

/// Calls timed before the adaptive limit decides (until then, no request queues: the first
/// calls' round trips carry the connection's start), and the length of the window over which
/// the shortest round trip is kept (it is the shortest of this window and the one before, so
/// it follows a network that changes).
const WARM_UP: u64 = 32;
const WINDOW: u64 = 4096;

/// The adaptive limit's reading of the round trips, all in microseconds (relaxed atomics: a
/// lost update moves an average a little, never a decision's correctness).
#[derive(Default)]
struct Adapt {
    timed: AtomicU64,
    shortest: AtomicU64,
    shortest_before: AtomicU64,
    average: AtomicU64,
    /// Whether requests queue now.
    busy: AtomicBool,
}

impl Adapt {
    fn new() -> Self {
        Adapt {
            shortest: AtomicU64::new(u64::MAX),
            shortest_before: AtomicU64::new(u64::MAX),
            ..Adapt::default()
        }
    }

    /// Takes one call's round trip into account, if the script `answered` it.
    fn observe(&self, rtt: Duration, answered: bool) {
        if !answered {
            return;
        }
        let us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX).max(1);
        let timed = self.timed.fetch_add(1, Ordering::Relaxed) + 1;
        if timed.is_multiple_of(WINDOW) {
            let last = self.shortest.swap(u64::MAX, Ordering::Relaxed);
            self.shortest_before.store(last, Ordering::Relaxed);
        }
        let shortest = self
            .shortest
            .fetch_min(us, Ordering::Relaxed)
            .min(us)
            .min(self.shortest_before.load(Ordering::Relaxed));
        // An average over about the last 64 calls (the last 4 during the warm-up, so that the
        // first calls, which carry the connection's start, leave it soon).
        let weight = if timed < WARM_UP { 4 } else { 64 };
        let average = self.average.load(Ordering::Relaxed);
        let average = if average == 0 {
            us
        } else {
            average - average / weight + us / weight
        };
        self.average.store(average, Ordering::Relaxed);
        if timed >= WARM_UP {
            let busy = self.busy.load(Ordering::Relaxed);
            let factor = if busy { RELIEVED } else { CONGESTED };
            let now_busy = average > shortest.saturating_mul(factor);
            if now_busy != busy {
                self.busy.store(now_busy, Ordering::Relaxed);
            }
        }
    }
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

/// One queued request's spend: its keys and the arguments of its call alone (`g` or `c`).
struct Job {
    /// The cluster's hash slot of its keys (0 on a single server): a call carries one slot's.
    hash_slot: u16,
    keys: Vec<Key>,
    args: Vec<Value>,
    /// now, then this request's share of the answer (the TATs read, or the units that counted
    /// and the period's end).
    reply: oneshot::Sender<Result<Vec<Value>, BackendError>>,
}

/// The queues, one per kind of call (calls of one kind join into one).
const KINDS: [Coalesced; 2] = [Coalesced::Lean, Coalesced::Calendar];

/// The queues and the count of calls in flight, held by the backend: on a single server one
/// count, on a cluster one per hash slot (a script call carries the keys of one slot, so
/// requests queue only behind calls that could carry them: those of their own slot).
pub(super) struct Coalescer {
    settings: Settings,
    timeout: Duration,
    in_flight: Box<[AtomicU32]>,
    adapt: Option<Adapt>,
    queues: [Mutex<Vec<Job>>; KINDS.len()],
    /// Requests in the queues (a call that ends looks at them only when some are).
    queued: AtomicUsize,
    calls: AtomicU64,
    requests: AtomicU64,
    direct: AtomicU64,
}

impl Coalescer {
    pub(super) fn new(settings: Settings, timeout: Duration, clustered: bool) -> Self {
        let lanes = if clustered { HASH_SLOTS } else { 1 };
        Coalescer {
            settings,
            timeout,
            in_flight: (0..lanes).map(|_| AtomicU32::new(0)).collect(),
            adapt: settings.adaptive.then(Adapt::new),
            queues: [Mutex::new(Vec::new()), Mutex::new(Vec::new())],
            queued: AtomicUsize::new(0),
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

    /// The count of calls in flight for keys of `hash_slot`.
    fn lane(&self, hash_slot: u16) -> &AtomicU32 {
        &self.in_flight[usize::from(hash_slot) % self.in_flight.len()]
    }

    /// Takes a call slot for keys of `hash_slot` if one is free (always, while the adaptive
    /// limit reads Redis as not busy).
    fn enter(&self, hash_slot: u16) -> bool {
        let limit = match &self.adapt {
            Some(adapt) if !adapt.busy.load(Ordering::Relaxed) => u32::MAX,
            _ => u32::try_from(self.settings.in_flight).unwrap_or(u32::MAX),
        };
        let lane = self.lane(hash_slot);
        if lane.fetch_add(1, Ordering::SeqCst) < limit {
            return true;
        }
        lane.fetch_sub(1, Ordering::SeqCst);
        false
    }

    fn leave(&self, hash_slot: u16) {
        self.lane(hash_slot).fetch_sub(1, Ordering::SeqCst);
    }

    fn queue(&self, kind: Coalesced) -> std::sync::MutexGuard<'_, Vec<Job>> {
        // A panic while holding the lock leaves a valid Vec: keep using it.
        self.queues[kind as usize]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A call slot, given back when dropped (also when the call's future is cancelled); giving it
/// back sends what queued meanwhile. [`Slot::ended`] times the call's round trip.
pub(super) struct Slot<'a> {
    backend: &'a RedisBackend,
    hash_slot: u16,
    started: std::time::Instant,
}

impl<'a> Slot<'a> {
    fn new(backend: &'a RedisBackend, hash_slot: u16) -> Self {
        Slot {
            backend,
            hash_slot,
            started: std::time::Instant::now(),
        }
    }

    /// The call ended: its round trip counts for the adaptive limit when the script
    /// `answered` (a call refused by an open circuit, failed or timed out says nothing of
    /// Redis's load: its few microseconds, or its timeout, would skew the reading).
    pub(super) fn ended(self, answered: bool) {
        if let Some(Some(adapt)) = self.backend.inner.coalescer.as_ref().map(|c| &c.adapt) {
            adapt.observe(self.started.elapsed(), answered);
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(c) = &self.backend.inner.coalescer {
            c.leave(self.hash_slot);
            self.backend.flush(self.hash_slot);
        }
    }
}

/// How a request goes when coalescing is on.
pub(super) enum Route<'a> {
    /// A call slot is free (or the queue is full): make the call, holding the slot.
    Direct(Option<Slot<'a>>),
    /// Queued: the answer (now, then this request's share), when a call carried it.
    Queued(Result<Vec<Value>, BackendError>),
}

impl RedisBackend {
    /// Routes a spend with the defaults that can share a call as `kind`, its keys in
    /// `hash_slot` (`make` builds its keys and the arguments of its call alone, only when it
    /// queues).
    pub(super) async fn coalesce<M>(
        &self,
        coalescer: &Coalescer,
        (kind, hash_slot): (Coalesced, u16),
        make: M,
    ) -> Route<'_>
    where
        M: FnOnce() -> (Vec<Key>, Vec<Value>),
    {
        if coalescer.enter(hash_slot) {
            coalescer.direct.fetch_add(1, Ordering::Relaxed);
            return Route::Direct(Some(Slot::new(self, hash_slot)));
        }
        let (reply, answer) = oneshot::channel();
        // Built before the lock is taken, which then only guards a push.
        let (keys, args) = make();
        {
            let mut queue = coalescer.queue(kind);
            if queue.len() >= QUEUE {
                drop(queue);
                coalescer.direct.fetch_add(1, Ordering::Relaxed);
                return Route::Direct(None);
            }
            queue.push(Job {
                hash_slot,
                keys,
                args,
                reply,
            });
            coalescer.queued.fetch_add(1, Ordering::SeqCst);
        }
        // A call may have ended between the check and the push: send the queue if a slot is
        // free now.
        self.flush(hash_slot);
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

    /// Sends what is queued for keys of `hash_slot`, one call per free call slot, each from a
    /// spawned task.
    fn flush(&self, hash_slot: u16) {
        let Some(coalescer) = &self.inner.coalescer else {
            return;
        };
        if coalescer.queued.load(Ordering::SeqCst) == 0 {
            return;
        }
        for kind in KINDS {
            loop {
                let mine = |j: &Job| j.hash_slot == hash_slot;
                if !coalescer.queue(kind).iter().any(mine) || !coalescer.enter(hash_slot) {
                    break;
                }
                let jobs: Vec<Job> = {
                    let mut queue = coalescer.queue(kind);
                    let mut room = coalescer.settings.max_batch;
                    queue
                        .extract_if(.., |j| {
                            let take = room > 0 && mine(j);
                            room -= usize::from(take);
                            take
                        })
                        .collect()
                };
                coalescer.queued.fetch_sub(jobs.len(), Ordering::SeqCst);
                if jobs.is_empty() {
                    // Taken by another flush meanwhile: give the slot back and look again.
                    coalescer.leave(hash_slot);
                    continue;
                }
                coalescer.calls.fetch_add(1, Ordering::Relaxed);
                coalescer
                    .requests
                    .fetch_add(jobs.len() as u64, Ordering::Relaxed);
                let backend = self.clone();
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    // No runtime (being shut down): the queued requests' waits end with it.
                    coalescer.leave(hash_slot);
                    return;
                };
                runtime.spawn(async move {
                    let slot = Slot::new(&backend, hash_slot);
                    let answered = backend.run_jobs(kind, hash_slot, jobs).await;
                    slot.ended(answered);
                });
            }
        }
    }

    /// The call of one queued request alone (`g` or `c`).
    async fn alone(&self, job: &Job) -> Result<Value, BackendError> {
        self.eval(job.hash_slot, || (job.keys.clone(), job.args.clone()))
            .await
    }

    /// One call for `jobs` of `kind` (the call alone for one), its answer split among them;
    /// whether the script answered. One request's
    /// failure is its own: a write the script could not make answers that request's error
    /// (the script goes on with the next), and a call the server refused for one request's
    /// keys (`NOPERM`: a user whose ACL does not cover every key) is sent again one request a
    /// call, so that only the refused ones fail (nothing ran: the server checks the keys before
    /// the script starts).
    async fn run_jobs(&self, kind: Coalesced, hash_slot: u16, jobs: Vec<Job>) -> bool {
        let result = if let [job] = &jobs[..] {
            self.alone(job).await
        } else {
            self.eval(hash_slot, || {
                script::encode_coalesced(kind, jobs.iter().map(|j| (&j.keys[..], &j.args[..])))
            })
            .await
        };
        if jobs.len() > 1
            && let Err(BackendError::Unavailable(text)) = &result
            && text.contains("NOPERM")
        {
            let answers = futures_util::future::join_all(jobs.iter().map(|j| self.alone(j))).await;
            for (job, answer) in jobs.into_iter().zip(answers) {
                let answer = answer.and_then(|v| match v {
                    Value::Array(items) => Ok(items),
                    v => Err(BackendError::Unavailable(format!(
                        "unexpected script reply: {:?}",
                        v.kind()
                    ))),
                });
                let _ = job.reply.send(answer);
            }
            // The refused call's round trip was the server's: a check of the keys.
            return false;
        }
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
                return false;
            }
        };
        let now = items.first().cloned().unwrap_or(Value::Null);
        let mut read = items.into_iter().skip(1);
        for job in jobs {
            let len = kind.answer_len(job.keys.len());
            let mut answer = Vec::with_capacity(1 + len);
            answer.push(now.clone());
            answer.extend(read.by_ref().take(len));
            // A write the script could not make for this request: its text in place of its
            // answer. A short answer is caught by the decoder (a count that does not match).
            let failed = answer[1..].iter().find_map(|v| match v {
                Value::String(text) => Some(text.to_string()),
                _ => None,
            });
            let _ = job.reply.send(match failed {
                Some(text) => Err(super::calls::server_error(text)),
                None => Ok(answer),
            });
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{Adapt, CONGESTED, RELIEVED, WARM_UP};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    fn busy(a: &Adapt) -> bool {
        a.busy.load(Ordering::Relaxed)
    }

    impl Adapt {
        fn observe_answered(&self, rtt: Duration) {
            self.observe(rtt, true);
        }
    }

    /// Round trips near the shortest (a remote link: 2.3 times it, with a slow one now and
    /// then) never turn queueing on; an average above `CONGESTED` times the shortest does
    /// (not before `WARM_UP` calls), and it stays on until the average falls under
    /// `RELIEVED` times it.
    #[test]
    fn the_adaptive_limit_queues_only_while_round_trips_run_far_above_the_shortest() {
        let a = Adapt::new();
        let ms = Duration::from_micros;
        for i in 0..WARM_UP - 1 {
            a.observe_answered(ms(if i == 0 { 100 } else { 10_000 }));
        }
        assert!(!busy(&a), "not before the warm-up ends");
        // A remote link: 4,600 us, the shortest 2,000 us now and then, and one call of 20 ms
        // in 50 (what `redis_rounds --delay-ms 1` sees).
        let remote = |i: u64, typical: u64| match i % 50 {
            0 => 20_000,
            25 => 2_000,
            _ => typical,
        };
        let a = Adapt::new();
        for i in 0..10_000 {
            a.observe_answered(ms(remote(i, 4_600)));
            assert!(!busy(&a), "call {i}: a remote link's round trips");
        }
        // Redis busy: round trips climb to 20 times the shortest.
        let mut turned = None;
        for i in 0..400 {
            a.observe_answered(ms(40_000));
            if busy(&a) && turned.is_none() {
                turned = Some(i);
            }
        }
        let turned = turned.expect("queueing turned on");
        assert!(turned < 200, "on after {turned} calls");
        // Back between RELIEVED and CONGESTED times the shortest: still on; under: off.
        for i in 0..1_000 {
            a.observe_answered(ms(remote(i, 2_000 * (RELIEVED + CONGESTED) / 2)));
        }
        assert!(busy(&a));
        for i in 0..1_000 {
            a.observe_answered(ms(remote(i, 2_000 * RELIEVED - 2_000)));
        }
        assert!(!busy(&a));
    }

    /// Calls that were not answered (an open circuit answers in microseconds, a timeout after
    /// the command timeout) say nothing of Redis's load: after an outage of thousands of them,
    /// a remote link's round trips still do not queue.
    #[test]
    fn calls_that_were_not_answered_leave_the_adaptive_limit_as_it_was() {
        let a = Adapt::new();
        let ms = Duration::from_micros;
        for _ in 0..100 {
            a.observe_answered(ms(2_300));
        }
        for i in 0..10_000 {
            a.observe(ms(if i % 2 == 0 { 3 } else { 2_000_000 }), false);
        }
        for i in 0..1_000 {
            a.observe_answered(ms(4_600));
            assert!(!busy(&a), "call {i} after the outage");
        }
    }
}
