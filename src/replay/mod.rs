//! Replaying recorded traffic through the real layer (feature `replay`; `docs/replay.md`).
//!
//! Each request of a log is sent, at its logged time, through two layers built by the same
//! code a deployment runs: one on the current limits, one on a candidate's. Time is tokio's
//! paused clock, moved to each request's time in turn, and the layers' backends read their
//! clock from it: every timer (a response held for its logged duration, so a concurrency slot
//! is held as long as it was; a wait; a lease's renewal; the sweeper) fires on the logged
//! clock. What each layer decided is read from its journal (`layer/observe.rs`), the same
//! outcomes its metrics count.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use http::Request;
use tower_layer::Layer;
use tower_service::Service;

use crate::backend::MemoryBackend;
use crate::config::Limits;
use crate::layer::{LayerError, LoggedCost, RateLimitLayer, RateLimitService};
use crate::limiter::Limiter;
use crate::time::Clock;

mod inner;
mod log;
mod penalties;
mod plan;
mod snapshot;
mod streams;
mod suggest;
mod suggested;

use inner::{Inner, Logged, Opened, drain};
pub use log::{
    BadLine, LineError, LogFormat, LogReader, LoggedRequest, MAX_LINE_BYTES, MAX_SPREAD_MESSAGES,
    StreamLine, Totals,
};
pub use penalties::{PenaltyPlan, PerDay};
use plan::{Answer, Tally};
pub use plan::{
    Answered, BadLineExample, Counts, Flip, Headroom, KeyFlips, LimitPlan, PLAN_VERSION, Plan,
    Replayed,
};
pub use snapshot::{
    DEFAULT_SNAPSHOT_KEYS, RefusedId, SNAPSHOT_VERSION, Snapshot, SnapshotError, SnapshotKey, Warm,
};
pub use streams::{MessageCounts, StreamsEnded, StreamsPlan};
use streams::{MessageTally, Spread, Streams};
use suggest::Arrival;
pub use suggested::{
    Heavy, Suggested, SuggestedBudget, SuggestedCount, SuggestedMax, SuggestedTier, SuggestedTiers,
};

/// How many bad lines a plan shows.
const BAD_EXAMPLES: usize = 5;
/// How many flips of each direction a plan shows.
const FLIP_EXAMPLES: usize = 20;
/// Requests between two sweeps of the suggestion model's idle keys.
const SWEEP_EVERY: u64 = 1 << 16;
/// Log time between two sweeps of each policy's buckets (the memory backend's own period).
/// Swept by the replay as requests come, not by a timer: a periodic timer would wake once per
/// period across a long gap between two lines (years, in a hostile log).
const SWEEP_US: u64 = 10_000_000;

/// Why a replay stopped.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A policy's layer could not be built.
    #[error("the {policy} policy's layer: {error}")]
    Layer {
        /// `current` or `candidate`.
        policy: &'static str,
        /// Why.
        error: LayerError,
    },
    /// A line did not parse, in a strict replay ([`Replay::strict`]).
    #[error("{0}")]
    BadLine(BadLine),
    /// The replay's runtime could not start.
    #[error("starting the replay's runtime: {0}")]
    Runtime(std::io::Error),
    /// [`Replay::run`] was called on a thread inside a tokio runtime (a task, or tokio's
    /// `spawn_blocking`, whose threads are inside it too): a replay runs its own runtime, on a
    /// paused clock. Call it from a thread of its own (`std::thread::spawn`).
    #[error(
        "Replay::run was called inside a tokio runtime; it runs its own, on the log's clock: call it from a thread of its own (std::thread::spawn)"
    )]
    InsideRuntime,
}

readable_debug!(ReplayError { Layer { policy, error }, BadLine(line), Runtime(error), InsideRuntime });

type Build = Rc<dyn Fn(Limiter) -> Result<RateLimitLayer, LayerError>>;
type Each = Box<dyn FnMut(&Replayed<'_>)>;

/// A replay of recorded requests through a current and a candidate policy: what the
/// candidate would change (see [`Plan`]).
///
/// The layer is built by `build`, the code a deployment runs (rules, extractors, trusted
/// proxies, exemptions, settings), on an in-memory limiter of each policy's limits whose
/// clock is the log's. Every request takes the real road; concurrency slots are held for the
/// logged duration; waits and leases run on the logged clock.
///
/// ```
/// use tower_ratelimits::{Limits, LogReader, Replay, RuleSet};
/// let rules = RuleSet::from_yaml_str("- {limit: PerIp, key: client_ip}\n")?;
/// let current = Limits::from_yaml_str("PerIp: {kind: ip, burst: 2, count: 1, period: 1s}\n", None)?;
/// let candidate = Limits::from_yaml_str("PerIp: {kind: ip, burst: 1, count: 1, period: 1s}\n", None)?;
/// let log = "{\"time\":\"2026-11-25T10:00:00Z\",\"ip\":\"192.0.2.1\"}\n".repeat(2);
/// let lines = LogReader::from_readers(vec![("log".into(), Box::new(std::io::Cursor::new(log)))], None, Default::default());
/// let plan = Replay::new(move |limiter| rules.layer(limiter), current, candidate).run(lines)?;
/// assert_eq!((plan.requests, plan.allow_to_deny), (2, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Replay {
    current: (Limits, Build),
    candidate: (Limits, Build),
    strict: bool,
    target: f64,
    top_keys: usize,
    each: Option<Each>,
    snapshot: Option<Snapshot>,
}

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("strict", &self.strict)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Replay {
    /// A replay of the layer `build` makes, under `current` and `candidate` limits.
    pub fn new(
        build: impl Fn(Limiter) -> Result<RateLimitLayer, LayerError> + 'static,
        current: Limits,
        candidate: Limits,
    ) -> Replay {
        let build: Build = Rc::new(build);
        Replay {
            current: (current, build.clone()),
            candidate: (candidate, build),
            strict: false,
            target: 0.01,
            top_keys: 20,
            each: None,
            snapshot: None,
        }
    }

    /// Calls `f` with every request, how the current and the candidate policy answered it
    /// and the buckets each decided it against, as the answers become known (a request
    /// waiting to be decided again is answered when it is: not always in the log's order).
    pub fn each(mut self, f: impl FnMut(&Replayed<'_>) + 'static) -> Replay {
        self.each = Some(Box::new(f));
        self
    }

    /// The candidate's layer made by other code (other rules: a limit the current policy
    /// lacks).
    pub fn candidate_layer(
        mut self,
        build: impl Fn(Limiter) -> Result<RateLimitLayer, LayerError> + 'static,
    ) -> Replay {
        self.candidate.1 = Rc::new(build);
        self
    }

    /// Starts both policies from `snapshot` instead of empty buckets: every key it holds is
    /// put into each policy's buckets that reads it (a limit the policy defines, an id its kind
    /// reads, a state of the shape of the limit that applies), the candidate's read under its
    /// own limit by the change rule, as a deployment of the candidate would read the store.
    /// The replay's clock starts at the snapshot's instant; lines before it are not replayed
    /// (counted in the plan's `warm.lines_before`).
    pub fn snapshot(mut self, snapshot: Snapshot) -> Replay {
        self.snapshot = Some(snapshot);
        self
    }

    /// Stops at the first bad line ([`ReplayError::BadLine`]) instead of counting it.
    pub fn strict(mut self, on: bool) -> Replay {
        self.strict = on;
        self
    }

    /// The share of keys a suggestion may leave refused (default 0.01: 1%), clamped to 0..1.
    pub fn target(mut self, share: f64) -> Replay {
        self.target = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.01
        };
        self
    }

    /// How many keys [`Plan::top_keys`] lists (default 20).
    pub fn top_keys(mut self, n: usize) -> Replay {
        self.top_keys = n;
        self
    }

    /// Replays `requests` (in time order; a request earlier than one before it is decided at
    /// the replay's clock, counted in [`Plan::late_lines`]) and says what changes. Runs its own
    /// runtime on a paused clock: call it outside any runtime (`std::thread::spawn` from async code).
    pub fn run<I>(self, requests: I) -> Result<Plan, ReplayError>
    where
        I: IntoIterator<Item = Result<LoggedRequest, BadLine>>,
    {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(ReplayError::InsideRuntime);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .map_err(ReplayError::Runtime)?;
        let local = tokio::task::LocalSet::new();
        let penalties = penalties::budgets(&self.current.0, &self.candidate.0);
        let mut plan = local.block_on(&runtime, self.replay(requests.into_iter()))?;
        plan.penalties = penalties;
        Ok(plan)
    }

    async fn replay(
        self,
        requests: impl Iterator<Item = Result<LoggedRequest, BadLine>>,
    ) -> Result<Plan, ReplayError> {
        let mut tally = Tally::new(0, self.target, self.top_keys, BAD_EXAMPLES, FLIP_EXAMPLES);
        // A snapshot's instant, before which lines are in the snapshot already.
        let from_us = self.snapshot.as_ref().map(Snapshot::instant_us);
        let mut warm = self.warm();
        let mut intake = Intake {
            requests,
            from_us,
            strict: self.strict,
            spread: Spread::default(),
            peeked: None,
        };
        // The first request sets the clock, unless a snapshot does.
        let Some(first) = intake.next(&mut warm, &mut |bad| tally.bad_line(bad))? else {
            let mut plan = tally.plan();
            plan.warm = warm;
            return Ok(plan);
        };
        let start_us = from_us.unwrap_or(first.time_us);
        let clock = LogClock::new(start_us);
        tally.base_us = first.time_us;
        let sides = self.sides(&clock, &mut warm)?;
        self.size(&mut tally);
        let state = Rc::new(RefCell::new(State {
            tally,
            pending: std::collections::HashMap::new(),
            each: self.each,
            messages: MessageTally::default(),
        }));
        let mut tasks = tokio::task::JoinSet::new();
        let mut streams = Streams::default();
        let mut next = Some(first);
        let mut index: u64 = 0;
        let mut swept_us = start_us;
        loop {
            let request = match next.take() {
                Some(r) => r,
                None => {
                    let mut bad = |b: &BadLine| state.borrow_mut().tally.bad_line(b);
                    match intake.next(&mut warm, &mut bad)? {
                        Some(r) => r,
                        None => break,
                    }
                }
            };
            if request.time_us < clock.now_us() {
                state.borrow_mut().tally.late_lines += 1;
            } else {
                clock.move_to(request.time_us).await;
            }
            let at_us = clock.now_us();
            if at_us.saturating_sub(swept_us) >= SWEEP_US {
                for side in &sides {
                    side.memory.sweep();
                }
                streams.sweep(at_us);
                swept_us = at_us;
            }
            if streamed(&request, &mut streams, &sides, &state, &clock, &mut tasks).await {
                continue;
            }
            index += 1;
            let answers =
                send_both(&sides, &request, &clock, at_us, index, &state, &mut tasks).await;
            state.borrow_mut().sent(request, answers, index, at_us);
            while tasks.try_join_next().is_some() {}
        }
        while tasks.join_next().await.is_some() {}
        drop(streams);
        let mut state = state.borrow_mut();
        let tally = std::mem::replace(&mut state.tally, Tally::new(0, 0.0, 0, 0, 0));
        let messages = std::mem::take(&mut state.messages);
        Ok(finished(tally, messages, warm, &sides))
    }

    /// What the plan says of the snapshot it starts from, before seeding.
    fn warm(&self) -> Option<Warm> {
        self.snapshot.as_ref().map(|s| Warm {
            instant: crate::time::instant_text(s.instant_us()),
            keys: s.keys().len() as u64,
            foreign: s.foreign(),
            ..Warm::default()
        })
    }

    /// Both policies on `clock`, each seeded from the snapshot when there is one.
    fn sides(&self, clock: &LogClock, warm: &mut Option<Warm>) -> Result<[Side; 2], ReplayError> {
        let sides = [
            Side::new("current", &self.current, clock)?,
            Side::new("candidate", &self.candidate, clock)?,
        ];
        if let (Some(snapshot), Some(w)) = (self.snapshot.as_ref(), warm.as_mut()) {
            w.current_seeded = snapshot.seed(&self.current.0, &sides[0].memory, 0, w);
            w.candidate_seeded = snapshot.seed(&self.candidate.0, &sides[1].memory, 1, w);
        }
        Ok(sides)
    }

    /// What the plan's per-limit tallies must know before the first request: the limits
    /// across regions (replayed as the one central limit each stands for: one log, one bucket
    /// per key) and each candidate limit's suggestion model.
    fn size(&self, tally: &mut Tally) {
        for limits in [&self.current.0, &self.candidate.0] {
            for name in limits.names() {
                if limits.across_regions(name).is_some() {
                    tally.across_regions(name);
                }
            }
        }
        for name in self.candidate.0.names() {
            if let Some(quota) = self.candidate.0.default_limit(name) {
                tally.size(name, quota);
            }
        }
    }
}

/// What `line` does to the replay's streams: the streams each policy let through since the
/// last line opened; a stream it opens declared (until its logged end); a message admitted
/// under each policy at the clock's time (true: the line was a message, not a request).
async fn streamed(
    line: &LoggedRequest,
    streams: &mut Streams,
    sides: &[Side; 2],
    state: &Rc<RefCell<State>>,
    clock: &LogClock,
    tasks: &mut tokio::task::JoinSet<()>,
) -> bool {
    for (side, s) in sides.iter().enumerate() {
        let opened = s.opened.lock().map(|mut o| std::mem::take(&mut *o));
        streams.let_through(side, opened.unwrap_or_default());
    }
    match &line.stream {
        Some(StreamLine::Message { id, units }) => {
            let at_us = clock.now_us();
            streams
                .message(id, *units, at_us, state, clock, tasks)
                .await;
            true
        }
        Some(StreamLine::Opens { id, totals }) => {
            let end_us = match line.duration_us {
                0 => u64::MAX,
                d => line.time_us.saturating_add(d),
            };
            if streams.opens(id.clone(), end_us) {
                state.borrow_mut().messages.opened(totals.is_some());
            }
            false
        }
        None => false,
    }
}

/// Sends request `index` through both policies at `at_us`: each answer known now, and a task
/// for each response still running (held, or waiting to be decided again) that answers later.
async fn send_both(
    sides: &[Side; 2],
    request: &LoggedRequest,
    clock: &LogClock,
    at_us: u64,
    index: u64,
    state: &Rc<RefCell<State>>,
    tasks: &mut tokio::task::JoinSet<()>,
) -> [Option<Answer>; 2] {
    let cost = request.cost.unwrap_or(1);
    let mut answers: [Option<Answer>; 2] = [None, None];
    for (side, s) in sides.iter().enumerate() {
        let (answer, running) = s.send(request, clock, side, cost, at_us, state).await;
        answers[side] = answer;
        if let Some(running) = running {
            let state = state.clone();
            let (served, layer, clock) = (s.served.clone(), s.layer.clone(), clock.clone());
            tasks.spawn_local(async move {
                finish(running, side, index, served, layer, state, clock).await;
            });
        }
    }
    answers
}

/// The log's lines as the requests to replay: lines before a snapshot's instant counted in
/// `warm`, bad lines handed to a tally (or, strict, the replay's error), and the messages of
/// streams logged by their totals spread among them in time order.
struct Intake<I> {
    requests: I,
    from_us: Option<u64>,
    strict: bool,
    spread: Spread,
    /// The log's next line, read while spread messages before it are handed out.
    peeked: Option<LoggedRequest>,
}

impl<I: Iterator<Item = Result<LoggedRequest, BadLine>>> Intake<I> {
    fn next(
        &mut self,
        warm: &mut Option<Warm>,
        bad: &mut dyn FnMut(&BadLine),
    ) -> Result<Option<LoggedRequest>, ReplayError> {
        if self.peeked.is_none() {
            self.peeked = self.read(warm, bad)?;
        }
        let spread_first = match (self.spread.next_us(), &self.peeked) {
            (Some(spread), Some(line)) => spread < line.time_us,
            (spread, _) => spread.is_some(),
        };
        if spread_first {
            return Ok(self.spread.pop());
        }
        let line = self.peeked.take();
        if let Some(l) = &line
            && let Some(StreamLine::Opens {
                id,
                totals: Some(totals),
            }) = &l.stream
        {
            self.spread
                .add(id.clone(), l.time_us, l.duration_us, *totals);
        }
        Ok(line)
    }

    /// The log's next line to replay.
    fn read(
        &mut self,
        warm: &mut Option<Warm>,
        bad: &mut dyn FnMut(&BadLine),
    ) -> Result<Option<LoggedRequest>, ReplayError> {
        loop {
            match self.requests.next() {
                None => return Ok(None),
                Some(Ok(r)) if self.from_us.is_some_and(|from| r.time_us < from) => {
                    if let Some(w) = warm.as_mut() {
                        w.lines_before += 1;
                    }
                }
                Some(Ok(r)) => return Ok(Some(r)),
                Some(Err(line)) if self.strict => return Err(ReplayError::BadLine(line)),
                Some(Err(line)) => bad(&line),
            }
        }
    }
}

fn seen(request: &LoggedRequest) -> plan::Seen<'_> {
    plan::Seen {
        time_us: request.time_us,
        ip: request.ip,
        method: request.method.as_str(),
        path: &request.path,
    }
}

/// The log's clock. Timers run on tokio's paused clock, which ticks in whole milliseconds (a
/// deadline rounded up to its tick); a decision reads the logged time to the microsecond: the
/// later of the last request's time and tokio's.
#[derive(Clone)]
struct LogClock {
    start: tokio::time::Instant,
    start_us: u64,
    request_us: Arc<AtomicU64>,
}

impl LogClock {
    fn new(start_us: u64) -> LogClock {
        LogClock {
            start: tokio::time::Instant::now(),
            start_us,
            request_us: Arc::new(AtomicU64::new(start_us)),
        }
    }

    fn instant(&self, us: u64) -> tokio::time::Instant {
        self.start + Duration::from_micros(us.saturating_sub(self.start_us))
    }

    /// Moves to a request at `us`: tokio's clock sleeps to the last tick before it (every timer
    /// due by then fires; tokio moves only at ticks, never past the next timer), and the
    /// decisions read `us` itself. A timer due within that last millisecond fires after the
    /// request is decided: the one inexactness, tokio's resolution.
    async fn move_to(&self, us: u64) {
        let early = self.instant(us).checked_sub(Duration::from_millis(1));
        if let Some(early) = early.filter(|e| *e > tokio::time::Instant::now()) {
            tokio::time::sleep_until(early).await;
            // Timers of the tick it woke at (due before `us` too) end first: their tasks were
            // woken with it. A yield never moves a paused clock while a timer is pending.
            tokio::task::yield_now().await;
        }
        self.request_us.fetch_max(us, Ordering::Relaxed);
    }
}

impl Clock for LogClock {
    fn now_us(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.start);
        let timers = self
            .start_us
            .saturating_add(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX));
        timers.max(self.request_us.load(Ordering::Relaxed))
    }
}

/// The tallies, and the requests whose answers are not both known yet.
struct State {
    tally: Tally,
    pending: std::collections::HashMap<u64, Pending>,
    each: Option<Each>,
    messages: MessageTally,
}

struct Pending {
    request: Box<LoggedRequest>,
    answers: [Option<Answer>; 2],
}

impl State {
    /// Request `index` sent through both policies at `at_us`: decided when both answered at
    /// once, else pending until the tasks that run it answer; the tallies swept now and then.
    fn sent(
        &mut self,
        request: LoggedRequest,
        answers: [Option<Answer>; 2],
        index: u64,
        at_us: u64,
    ) {
        match answers {
            [Some(a), Some(b)] => self.decided(&request, [&a, &b]),
            [a, b] => {
                // Tasks run only when the replay's loop yields: none has answered yet.
                let entry = Pending {
                    request: Box::new(request),
                    answers: [a, b],
                };
                self.pending.insert(index, entry);
            }
        }
        if index.is_multiple_of(SWEEP_EVERY) {
            self.tally.sweep(at_us);
        }
    }

    /// A policy's answer to request `index`, given by a task.
    fn answered(&mut self, index: u64, side: usize, answer: Answer) {
        let Some(entry) = self.pending.get_mut(&index) else {
            return;
        };
        entry.answers[side] = Some(answer);
        if let [Some(_), Some(_)] = &entry.answers
            && let Some(Pending {
                request,
                answers: [Some(a), Some(b)],
            }) = self.pending.remove(&index)
        {
            self.decided(&request, [&a, &b]);
        }
    }

    /// Both policies' answers to `request`.
    fn decided(&mut self, request: &LoggedRequest, answers: [&Answer; 2]) {
        self.tally.decided(&seen(request), answers);
        if let Some(each) = self.each.as_mut() {
            each(&Replayed {
                request,
                current: answers[0].class,
                candidate: answers[1].class,
                current_buckets: &answers[0].buckets,
                candidate_buckets: &answers[1].buckets,
            });
        }
    }
}

type Running = Pin<Box<<RateLimitService<Inner> as Service<Request<()>>>::Future>>;

/// Why a plan leaves a limit counted per message out ([`Plan::not_replayed`]).
const NOT_REPLAYED: &str = "counted per message of a stream (a rule `per: message` or `per: unit`): the log has no stream lines (stream, message_of), so it holds no messages";

/// The plan of a replay's tally and its streams', from a snapshot (`warm`) or cold; when the
/// log had no streams, naming the limits either policy's rules count per message, each with
/// why the replay left it out.
fn finished(
    tally: Tally,
    messages: MessageTally,
    warm: Option<snapshot::Warm>,
    sides: &[Side; 2],
) -> Plan {
    let mut plan = tally.plan();
    plan.warm = warm;
    plan.streams = messages.plan();
    if plan.streams.is_none() {
        plan.not_replayed = sides
            .iter()
            .flat_map(|side| side.layer.per_message_limits())
            .map(|name| (name.to_string(), NOT_REPLAYED.to_owned()))
            .collect();
    }
    plan
}

/// One policy: its layer around the inner service.
struct Side {
    memory: MemoryBackend,
    layer: RateLimitLayer,
    service: RateLimitService<Inner>,
    served: Arc<AtomicU64>,
    /// The streams its layer let through, for `streams.rs` to meter.
    opened: Arc<std::sync::Mutex<Vec<Opened>>>,
}

impl Side {
    fn new(
        policy: &'static str,
        (limits, build): &(Limits, Build),
        clock: &LogClock,
    ) -> Result<Side, ReplayError> {
        let memory = MemoryBackend::builder()
            .clock(clock.clone())
            .no_background_sweep()
            .build();
        let layer = build(Limiter::new(limits.clone(), memory.clone()))
            .map_err(|error| ReplayError::Layer { policy, error })?;
        layer.journal().start();
        layer.settle_inline();
        layer.answer_quietly();
        let served = Arc::new(AtomicU64::new(0));
        let opened = Arc::default();
        let service = layer.layer(Inner {
            served: served.clone(),
            settles: layer.settle_sources().into(),
            opened: Arc::clone(&opened),
        });
        Ok(Side {
            memory,
            layer,
            service,
            served,
            opened,
        })
    }

    /// Sends `logged` through the layer and polls it once: its answer when known now, and
    /// the response still running (held, or waiting to be decided again) for a task to end.
    async fn send(
        &self,
        logged: &LoggedRequest,
        clock: &LogClock,
        side: usize,
        cost: u64,
        now_us: u64,
        state: &Rc<RefCell<State>>,
    ) -> (Option<Answer>, Option<Running>) {
        let request = request_of(logged, clock);
        let journal = self.layer.journal();
        let (served, exempt) = (
            self.served.load(Ordering::Relaxed),
            journal.exempt.load(Ordering::Relaxed),
        );
        let mut service = self.service.clone();
        let mut running: Running = Box::pin(service.call(request));
        let polled = std::future::poll_fn(|cx| Poll::Ready(running.as_mut().poll(cx))).await;
        let done = match polled {
            Poll::Ready(Ok(response)) => {
                drain(response).await;
                true
            }
            Poll::Ready(Err(never)) => match never {},
            Poll::Pending => false,
        };
        let mut notes = Vec::new();
        journal.take(&mut notes);
        let keep = state.borrow().each.is_some();
        let arrival = Arrival {
            cost,
            duration_us: logged.duration_us,
        };
        state
            .borrow_mut()
            .tally
            .noted(side, &notes, now_us, Some(arrival));
        let served = self.served.load(Ordering::Relaxed) > served;
        let exempt = journal.exempt.load(Ordering::Relaxed) > exempt;
        match (done, served) {
            (true, _) => (Some(Answer::of(served, exempt, &notes, keep)), None),
            (false, true) => (Some(Answer::of(true, exempt, &notes, keep)), Some(running)),
            // Waiting to be decided again: the task answers.
            (false, false) => (None, Some(running)),
        }
    }
}

/// Drives a running response to its end; answers for it when it had no answer yet (a
/// request waiting to be decided again), from what its layer notes on the way.
async fn finish(
    mut running: Running,
    side: usize,
    index: u64,
    served: Arc<AtomicU64>,
    layer: RateLimitLayer,
    state: Rc<RefCell<State>>,
    clock: LogClock,
) {
    let keep = state.borrow().each.is_some();
    let answered = state
        .borrow()
        .pending
        .get(&index)
        .is_none_or(|p| p.answers[side].is_some());
    let mut all = Vec::new();
    let mut through = false;
    let mut notes = Vec::new();
    let mut output = None;
    std::future::poll_fn(|cx| {
        let before = served.load(Ordering::Relaxed);
        let poll = running.as_mut().poll(cx);
        through |= served.load(Ordering::Relaxed) > before;
        notes.clear();
        layer.journal().take(&mut notes);
        if !notes.is_empty() {
            // Decided again after a wait: the shares it used, not a new arrival.
            state
                .borrow_mut()
                .tally
                .noted(side, &notes, clock.now_us(), None);
            all.extend(notes.iter().cloned());
        }
        if let Poll::Ready(out) = poll {
            output = Some(out);
            return Poll::Ready(());
        }
        if !answered && through {
            return Poll::Ready(());
        }
        Poll::Pending
    })
    .await;
    if !answered {
        state
            .borrow_mut()
            .answered(index, side, Answer::of(through, false, &all, keep));
    }
    // Let through: the response runs to its end, and its body is read (a settle from the body
    // settles there; its slots are given back).
    let response = match output {
        Some(out) => out,
        None => running.await,
    };
    let Ok(response) = response;
    drain(response).await;
}

/// The request a log line stands for.
fn request_of(logged: &LoggedRequest, clock: &LogClock) -> Request<()> {
    let mut request = Request::new(());
    *request.method_mut() = logged.method.clone();
    if let Ok(uri) = http::Uri::try_from(logged.path.as_str()) {
        *request.uri_mut() = uri;
    }
    *request.headers_mut() = logged.headers.clone();
    let extensions = request.extensions_mut();
    extensions.insert(std::net::SocketAddr::new(logged.ip, 0));
    if let Some(cost) = logged.cost {
        extensions.insert(LoggedCost(cost));
    }
    extensions.insert(Logged {
        until: (logged.duration_us > 0)
            .then(|| clock.instant(logged.time_us.saturating_add(logged.duration_us))),
        status: logged.status,
        cost: logged.cost,
        stream: match &logged.stream {
            Some(StreamLine::Opens { id, .. }) => Some(id.clone()),
            _ => None,
        },
    });
    request
}
