//! A stream's meter: each message one batch against the stream's keys, decided on the limiter's
//! road (layer-free: the same `Limiter::spend` a request's batch takes), with what happens at a
//! limit (push back or end) and the stream's own counts beside.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::key::{BucketKey, LimitName};
use crate::limiter::{BatchDecision, Limiter, LimiterError, Transaction, may_wait};
use crate::mode::Mode;

use super::grants::Grants;
use super::{StreamError, StreamLimited};
use crate::config::UnitPrice;
use crate::layer::AtLimit;

/// How one key of a meter is charged for a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// One unit a message, whatever its size.
    Message,
    /// The message's units (its bytes, tokens: what [`LimitedStream::units`] reads).
    ///
    /// [`LimitedStream::units`]: super::LimitedStream::units
    Unit,
    /// The price of the message's units (money): the stream's running total's price less what
    /// it was charged before ([`UnitPrice::between`]).
    Priced(UnitPrice),
}

impl Part {
    /// What a message of `units` units costs the key, the stream having been admitted
    /// `before` units.
    #[inline(always)]
    fn cost(self, units: u64, before: u64) -> u64 {
        match self {
            Part::Message => 1,
            Part::Unit => units,
            Part::Priced(price) => price.between(before, units),
        }
    }
}

/// What one decision asks of the stream's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ask {
    /// The message's units (its per-unit keys' cost).
    pub(crate) units: u64,
    pub(crate) how: How,
}

/// How a message takes its units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum How {
    /// All of them, or none; pushed back when `may_wait` and the meter pushes back.
    Whole { may_wait: bool },
    /// As many as the per-unit keys have, at least one (a metered body's cut chunk).
    UpTo,
    /// All of them, as debt where they do not fit (`Mode::Charge`: never refused; a metered
    /// body's crossing chunk).
    Charge,
}

/// How a decision ended: the units passed, the units passed with what the keys granted
/// ahead, or the refusal's decision.
enum Answer {
    Passed(u64),
    Granted(u64, BatchDecision),
    Refused(BatchDecision),
}

/// A message decided: its batch, to be reused by the next message, and the answer.
type Decided = (Vec<Transaction>, Result<Answer, LimiterError>);

/// A decision under way.
type Deciding = Pin<Box<dyn Future<Output = Decided> + Send>>;

/// Where a meter stands with the message it is deciding.
enum State {
    /// No decision under way: the batch waits for the next message.
    Idle(Vec<Transaction>),
    /// The limiter is deciding the message.
    Deciding(Deciding),
    /// Pushed back: the message waits for its units (`sleep`), then is decided again.
    Waiting(Vec<Transaction>),
    /// The batch is being moved between states (only within a poll); a meter left so (its
    /// decision's future panicked) refuses every message.
    Ended,
}

/// The limits every message of one stream counts against, and the stream's counts so far: one
/// batch per message (all its keys in one decision, as a request's rules are), decided on the
/// limiter's road, so that memory, Redis, the cluster and any backend decide a message as they
/// decide a request.
///
/// Built per stream, from the keys the stream's request was keyed by (per account, per
/// client, or per stream with an id of its own). A limit that holds slots (a concurrency or an
/// adaptive limit) is not counted per message: the stream holds its slot through the layer,
/// for the whole response ([`StreamError::HoldsSlots`]).
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimits::{AtLimit, Id, Limiter, Limits, ManualClock, MemoryBackend, StreamMeter};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limits = Limits::from_yaml_str(
///     "MessagesPerAccount: {kind: account, burst: 2, count: 10, period: 1s}\n\
///      BytesPerAccount: {kind: account, burst: 62500, count: 62500, period: 1s}\n",
///     None,
/// )?;
/// # let clock = ManualClock::new(1_700_000_000_000_000);
/// # let memory = MemoryBackend::builder().clock(clock).build();
/// let limiter = Limiter::new(limits, memory);
/// let mut meter = StreamMeter::builder(&limiter)
///     .per_message(limiter.key("MessagesPerAccount", Id::from(7u64))?)
///     .per_unit(limiter.key("BytesPerAccount", Id::from(7u64))?)
///     .at_limit(AtLimit::End)
///     .build()?;
/// meter.admit(1200).await?; // a message of 1,200 bytes
/// meter.admit(80).await?;
/// let refused = meter.admit(80).await.unwrap_err(); // the third message in the burst of 2
/// assert_eq!(refused.retry_after(), Some(Duration::from_millis(100)));
/// assert_eq!((meter.messages(), meter.units()), (2, 1280));
/// # Ok(()) }
/// ```
pub struct StreamMeter {
    limiter: Limiter,
    parts: smallvec::SmallVec<[Part; 4]>,
    at_limit: AtLimit,
    fail_open: bool,
    state: State,
    /// When the message being decided was first refused (push back's bound counts from it).
    refused_at: Option<tokio::time::Instant>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A message was refused: every next one is too ([`StreamLimited::Ended`]).
    ended: bool,
    /// Units taken ahead ([`StreamMeterBuilder::ahead`]).
    grants: Option<Grants>,
    messages: u64,
    units: u64,
}

impl std::fmt::Debug for StreamMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamMeter")
            .field("at_limit", &self.at_limit)
            .field("messages", &self.messages)
            .field("units", &self.units)
            .finish_non_exhaustive()
    }
}

/// Builds a [`StreamMeter`] ([`StreamMeter::builder`]).
#[derive(Debug)]
#[must_use]
pub struct StreamMeterBuilder {
    limiter: Limiter,
    parts: Vec<(BucketKey, Part)>,
    at_limit: AtLimit,
    fail_open: bool,
    ahead: u64,
    /// A key of this limit waits for its price (`StreamKeys::price_from_body`): no meter.
    unpriced: Option<LimitName>,
}

impl StreamMeter {
    /// A meter deciding on `limiter`, with no keys yet; at a limit it pushes back for up to 10
    /// seconds, then ends the stream ([`AtLimit`]).
    pub fn builder(limiter: &Limiter) -> StreamMeterBuilder {
        StreamMeterBuilder {
            limiter: limiter.clone(),
            parts: Vec::new(),
            at_limit: AtLimit::PushBack {
                up_to: Duration::from_secs(10),
            },
            fail_open: false,
            ahead: 0,
            unpriced: None,
        }
    }

    /// How many of its keys are charged by the message's units (their count or their price).
    pub(crate) fn unit_keys(&self) -> usize {
        self.parts.iter().filter(|p| **p != Part::Message).count()
    }

    /// The messages admitted so far.
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// The units admitted so far (bytes, tokens: the messages' [`per_unit`] cost).
    ///
    /// [`per_unit`]: StreamMeterBuilder::per_unit
    pub fn units(&self) -> u64 {
        self.units
    }

    /// Ends the stream: gives back what its grants still hold
    /// ([`ahead`](StreamMeterBuilder::ahead)) before it returns, where dropping the meter gives
    /// it back in a task. An error: the store did not take it back (the units come back with
    /// time, as spent units do).
    pub async fn close(mut self) -> Result<(), LimiterError> {
        let unused = self.grants.as_mut().map(Grants::unused).unwrap_or_default();
        if unused.is_empty() {
            return Ok(());
        }
        self.limiter.refund(&unused).await.map(drop)
    }

    /// Admits one message of `units` units (its bytes, tokens; 0 is a message with no units:
    /// it still counts against every [`per_message`](StreamMeterBuilder::per_message) key):
    /// `Ok` when it may pass, after waiting for its units when the meter pushes back; `Err`
    /// when the stream must end (and every message after it is refused alike).
    ///
    /// Cancelling the future keeps the decision under way: the next call resumes it, and must
    /// be for the same message.
    pub async fn admit(&mut self, units: u64) -> Result<(), StreamLimited> {
        std::future::poll_fn(|cx| self.poll_admit(cx, units)).await
    }

    /// [`admit`](Self::admit) as a poll: `Pending` while the message is decided or pushed
    /// back (the task is woken when it may be polled again). A stream wrapper calls it with
    /// the message it holds, until it is ready.
    pub fn poll_admit(
        &mut self,
        cx: &mut Context<'_>,
        units: u64,
    ) -> Poll<Result<(), StreamLimited>> {
        if self.ended {
            return Poll::Ready(Err(StreamLimited::Ended));
        }
        let how = How::Whole { may_wait: true };
        self.poll_ask(cx, Ask { units, how }).map_ok(|_| ())
    }

    /// Decides `ask` (the same until it is ready): the units passed, or why the stream ends.
    /// A refusal keeps the batch, so that a metered body may ask for the same chunk again (a
    /// part of it, or as debt); the public [`poll_admit`](Self::poll_admit) refuses every
    /// message after it.
    pub(crate) fn poll_ask(
        &mut self,
        cx: &mut Context<'_>,
        ask: Ask,
    ) -> Poll<Result<u64, StreamLimited>> {
        loop {
            match std::mem::replace(&mut self.state, State::Ended) {
                State::Idle(batch) => match self.decide(batch, ask) {
                    Ok((batch, decided)) => match self.decided(batch, ask, decided) {
                        Some(answer) => return Poll::Ready(answer),
                        None => continue,
                    },
                    Err(deciding) => self.state = State::Deciding(deciding),
                },
                State::Deciding(mut fut) => match fut.as_mut().poll(cx) {
                    Poll::Pending => {
                        self.state = State::Deciding(fut);
                        return Poll::Pending;
                    }
                    Poll::Ready((batch, decided)) => match self.decided(batch, ask, decided) {
                        Some(answer) => return Poll::Ready(answer),
                        None => continue,
                    },
                },
                State::Waiting(batch) => {
                    if let Some(sleep) = &mut self.sleep
                        && sleep.as_mut().poll(cx).is_pending()
                    {
                        self.state = State::Waiting(batch);
                        return Poll::Pending;
                    }
                    self.state = State::Idle(batch);
                }
                State::Ended => return Poll::Ready(Err(StreamLimited::Ended)),
            }
        }
    }

    /// The message's batch sent down the road, each part's cost and mode set for `ask`: a
    /// whole message or a charge decided at once where the backend can (read in place,
    /// nothing allocated), else a decision under way (a partial grant's always: its grant is
    /// read from the decision).
    fn decide(&mut self, mut batch: Vec<Transaction>, ask: Ask) -> Result<Decided, Deciding> {
        let (units, before) = (ask.units, self.units);
        let parts = &self.parts;
        let need = |i: usize| parts[i].cost(units, before);
        if let (Some(grants), How::Whole { .. }) = (&mut self.grants, ask.how) {
            if grants.take(need) {
                return Ok((batch, Ok(Answer::Passed(units))));
            }
            for (i, tx) in batch.iter_mut().enumerate() {
                grants.ask(i, need(i), tx);
            }
            return Err(self.deciding(batch, ask, true));
        }
        for (tx, part) in batch.iter_mut().zip(parts) {
            let cost = part.cost(units, before);
            match (part, ask.how) {
                // A crossing chunk's excess: its message was counted with its room.
                (Part::Message, How::Charge) => tx.set(0, 0, Mode::Charge),
                (Part::Unit, How::UpTo) => tx.set(units.min(1), units, Mode::CheckAndSpend),
                (_, How::Charge) => tx.set(cost, cost, Mode::Charge),
                (_, _) => tx.set(cost, cost, Mode::CheckAndSpend),
            }
        }
        if ask.how != How::UpTo
            && let Some(decided) = self.limiter.spend_message_now(&batch)
        {
            let answer = decided.map(|refused| match refused {
                None => Answer::Passed(units),
                Some(d) => Answer::Refused(d),
            });
            return Ok((batch, answer));
        }
        Err(self.deciding(batch, ask, false))
    }

    /// The batch's decision under way (a backend that must be awaited; a partial grant, whose
    /// grant is read from the decision): `granting`, the decision is kept for the grants.
    fn deciding(&self, batch: Vec<Transaction>, ask: Ask, granting: bool) -> Deciding {
        let limiter = self.limiter.clone();
        let parts = self.parts.clone();
        Box::pin(async move {
            let decided = limiter.spend(&batch).await.map(|d| {
                if !d.allowed() {
                    return Answer::Refused(d);
                }
                if granting {
                    return Answer::Granted(ask.units, d);
                }
                // The least any per-unit key granted (one key: its grant).
                let granted = d
                    .decisions()
                    .iter()
                    .zip(&parts)
                    .filter(|(_, p)| **p == Part::Unit)
                    .map(|(d, _)| d.granted())
                    .min();
                Answer::Passed(granted.unwrap_or(ask.units))
            });
            (batch, decided)
        })
    }

    /// What a decision means for the message: `Some` answer, or `None` to decide it again
    /// (pushed back until its units come: the sleep is set).
    fn decided(
        &mut self,
        batch: Vec<Transaction>,
        ask: Ask,
        decided: Result<Answer, LimiterError>,
    ) -> Option<Result<u64, StreamLimited>> {
        let decision = match decided {
            Ok(Answer::Refused(refused)) => refused,
            Ok(Answer::Passed(units)) => return Some(self.passed(batch, ask.how, units)),
            Ok(Answer::Granted(units, decision)) => {
                if let Some(grants) = &mut self.grants {
                    let (parts, before) = (&self.parts, self.units);
                    grants.granted(&decision, |i| parts[i].cost(units, before));
                }
                return Some(self.passed(batch, ask.how, units));
            }
            Err(e) => return self.failed(batch, ask, e),
        };
        self.state = State::Idle(batch);
        let refused = StreamLimited::of(&decision);
        let wait = refused.retry_after().unwrap_or(Duration::ZERO);
        if let (AtLimit::PushBack { up_to }, How::Whole { may_wait: true }) =
            (self.at_limit, ask.how)
        {
            let first = *self
                .refused_at
                .get_or_insert_with(tokio::time::Instant::now);
            if may_wait(first.elapsed(), wait, up_to) {
                let deadline = tokio::time::Instant::now() + wait;
                match &mut self.sleep {
                    Some(sleep) => sleep.as_mut().reset(deadline),
                    None => self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
                }
                if let State::Idle(batch) = std::mem::replace(&mut self.state, State::Ended) {
                    self.state = State::Waiting(batch);
                }
                return None;
            }
        }
        self.ended = true;
        Some(Err(refused))
    }

    /// A message admitted (`units` of it): counted (a charge's units only: its message was
    /// counted with its room), and the batch kept for the next.
    fn passed(
        &mut self,
        batch: Vec<Transaction>,
        how: How,
        units: u64,
    ) -> Result<u64, StreamLimited> {
        if how != How::Charge {
            self.messages += 1;
        }
        self.units = self.units.saturating_add(units);
        self.refused_at = None;
        self.ended = false;
        self.state = State::Idle(batch);
        Ok(units)
    }

    /// A decision the limiter could not take: a message larger than a limit's burst ends the
    /// stream whatever the failure policy (it could never pass); a store's failure passes the
    /// message when the meter fails open, and ends the stream otherwise.
    fn failed(
        &mut self,
        batch: Vec<Transaction>,
        ask: Ask,
        e: LimiterError,
    ) -> Option<Result<u64, StreamLimited>> {
        if let LimiterError::Backend(_) = e
            && self.fail_open
        {
            return Some(self.passed(batch, ask.how, ask.units));
        }
        self.state = State::Idle(batch);
        self.ended = true;
        Some(Err(match e {
            LimiterError::CostAboveBurst { name, cost, burst } => StreamLimited::TooLarge {
                limit: name,
                units: cost,
                max: burst,
            },
            e => StreamLimited::Failed(e),
        }))
    }
}

impl StreamMeterBuilder {
    /// A key of `limit` whose price is not known yet: the build fails.
    pub(crate) fn unpriced(mut self, limit: LimitName) -> Self {
        self.unpriced.get_or_insert(limit);
        self
    }

    /// Every message costs one unit of `key`'s limit (messages per second, per account, per
    /// stream).
    pub fn per_message(mut self, key: BucketKey) -> Self {
        self.parts.push((key, Part::Message));
        self
    }

    /// Every message costs its units of `key`'s limit: its bytes, its tokens (what the
    /// stream's [`units`](super::LimitedStream::units) reads, or what
    /// [`StreamMeter::admit`] is given).
    pub fn per_unit(mut self, key: BucketKey) -> Self {
        self.parts.push((key, Part::Unit));
        self
    }

    /// Every message costs the price of its units on `key`, whose limit counts money (integer
    /// micro-units: [`UnitPrice`], a model's from a [`PriceTable`](crate::PriceTable)): a
    /// stream is charged its running total's price rounded up, so its messages together cost
    /// exactly the price of all their units. With a key per unit beside it (tokens and money
    /// in one batch), a message passes only if both have room. A metered body with a priced
    /// key never splits a chunk.
    pub fn per_unit_at(mut self, key: BucketKey, price: UnitPrice) -> Self {
        self.parts.push((key, Part::Priced(price)));
        self
    }

    /// What the stream does at a limit (by default: push back for up to 10 seconds).
    pub fn at_limit(mut self, at_limit: AtLimit) -> Self {
        self.at_limit = at_limit;
        self
    }

    /// Takes units ahead: a message that finds its grant used up asks the store for what it
    /// needs and up to `messages` messages' worth more (of its size), on each key whose limit
    /// is a GCRA limit (a partial grant: what fits; the other shapes are decided per
    /// message); the next messages pass on what is held, without a round trip, and what the
    /// stream did not use goes back to the store when the meter is dropped. The store spends
    /// every unit it grants, so never more is admitted than the limit; a key's other streams
    /// may wait for the units one stream holds (at most `messages` messages' worth each). 0,
    /// the default, takes none: every message is a decision.
    pub fn ahead(mut self, messages: u64) -> Self {
        self.ahead = messages;
        self
    }

    /// Whether a message passes when its limits cannot be decided (the store is down): by
    /// default no, the stream ends ([`StreamLimited::Failed`]).
    pub fn fail_open(mut self, open: bool) -> Self {
        self.fail_open = open;
        self
    }

    /// The meter, its keys checked against the limits in force: each names a limit
    /// ([`StreamError::Limiter`]), none twice ([`StreamError::Limiter`]), and none holds slots
    /// ([`StreamError::HoldsSlots`]); at least one key ([`StreamError::NoKeys`]).
    pub fn build(self) -> Result<StreamMeter, StreamError> {
        if let Some(limit) = self.unpriced {
            let why = "its model is read from the request's body: call StreamKeys::price_from_body before meter";
            return Err(StreamError::Unpriced(limit, why.into()));
        }
        if self.parts.is_empty() {
            return Err(StreamError::NoKeys);
        }
        let limits = self.limiter.limits();
        for (key, _) in &self.parts {
            if limits.resolve(key).is_some_and(|q| q.holds_leases()) {
                return Err(StreamError::HoldsSlots(key.name()));
            }
        }
        let batch: Vec<Transaction> = self
            .parts
            .iter()
            .map(|(k, _)| Transaction::new(k.clone()))
            .collect();
        if let Some(key) = crate::limiter::first_duplicate(&batch) {
            return Err(StreamError::Limiter(LimiterError::DuplicateKey(
                key.to_string(),
            )));
        }
        let grants = (self.ahead > 0).then(|| {
            let keys = self.parts.iter().map(|(k, _)| k.clone()).collect();
            Grants::new(&self.limiter, keys, self.ahead)
        });
        Ok(StreamMeter {
            limiter: self.limiter,
            parts: self.parts.iter().map(|(_, p)| *p).collect(),
            at_limit: self.at_limit,
            fail_open: self.fail_open,
            state: State::Idle(batch),
            refused_at: None,
            sleep: None,
            ended: false,
            grants,
            messages: 0,
            units: 0,
        })
    }
}

impl Drop for StreamMeter {
    /// Gives back what the stream's grants still hold, in a task of the runtime the meter is
    /// dropped on (none: the units come back with time, as spent units do).
    fn drop(&mut self) {
        let Some(grants) = &mut self.grants else {
            return;
        };
        let unused = grants.unused();
        if unused.is_empty() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let limiter = self.limiter.clone();
            runtime.spawn(async move {
                if let Err(e) = limiter.refund(&unused).await {
                    tracing::debug!(target: crate::telemetry::target::BACKEND, error = %e, "a stream's unused grant was not given back");
                }
            });
        }
    }
}
