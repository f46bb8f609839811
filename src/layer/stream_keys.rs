//! What a layer's per-message rules ([`Rule::per`](crate::Rule::per), feature `stream`) find
//! for a request that opens a stream: what a rule counts ([`Per`]), what the stream does at its
//! limit ([`AtLimit`]), and the keys its messages count against, handed to the handler
//! ([`StreamKeys`]), whose meter (`stream/keys.rs`) counts each message.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{PriceOf, PriceTable, UnitPrice};
use crate::key::BucketKey;
use crate::limiter::Limiter;

/// What a stream does when a message finds no room ([`StreamMeterBuilder::at_limit`](crate::StreamMeterBuilder::at_limit)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AtLimit {
    /// Flow control, no error: the message is held until its units come (an inbound stream is
    /// not polled meanwhile, so its sender stalls on the transport's own flow control; an
    /// outbound message waits before it is sent), for a wait of at most `up_to` counted from
    /// the message's first refusal. A wait beyond it ends the stream, as [`End`](Self::End)
    /// does.
    PushBack {
        /// The longest a message waits.
        up_to: Duration,
    },
    /// The stream ends at the first message that finds no room ([`StreamLimited`](crate::StreamLimited): gRPC
    /// `RESOURCE_EXHAUSTED` with `RetryInfo` in the trailers, WebSocket close 1013, an SSE
    /// `rate-limited` event: `docs/streams.md`).
    End,
}

/// What a rule counts ([`Rule::per`](crate::Rule::per); `per:` in a rules file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Per {
    /// Each request (the default): decided by the layer before the service runs.
    #[default]
    Request,
    /// Each message of the stream the request opens, one unit a message: the layer finds the
    /// rule's key and hands it to the handler ([`StreamKeys`]), whose meter counts it.
    Message,
    /// Each message's units (its bytes, its tokens: what
    /// [`LimitedStream::units`](crate::LimitedStream::units) reads), as [`Per::Message`]
    /// hands the key over.
    Unit,
}

/// The keys a layer's per-message rules ([`Rule::per`](crate::Rule::per)) found for a request,
/// in the request's extensions for its handler: each rule that applied, keyed as its
/// request-level rules are (the same extractors, scopes and missing-key policy), none decided
/// yet. The handler builds the stream's meter with them ([`StreamKeys::meter`]); a request
/// none of whose per-message rules applied has none (no extension).
///
/// ```
/// use tower_ratelimits::{Header, Limiter, Limits, MemoryBackend, Per, RateLimitLayer, Rule};
/// let limits = Limits::from_yaml_str(
///     "MessagesPerAccount: {kind: account, burst: 20, count: 10, period: 1s}\n",
///     None,
/// )?;
/// let limiter = Limiter::new(limits, MemoryBackend::new());
/// let layer = RateLimitLayer::builder(limiter)
///     .rule(Rule::new("MessagesPerAccount", Header::new("x-account")).per(Per::Message))
///     .build()?;
/// // In the handler: `request.extensions().get::<StreamKeys>()`, then
/// // `keys.meter().build()?` wraps the stream (axum: `Option<Extension<StreamKeys>>`).
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct StreamKeys {
    pub(crate) limiter: Limiter,
    /// Each key, what it counts, and the price it charges its units at (a priced rule's).
    pub(crate) keys: smallvec::SmallVec<[(BucketKey, Per, KeyPrice); 2]>,
    pub(crate) at_limit: Option<AtLimit>,
}

/// The price a key of [`StreamKeys`] charges its units at.
#[derive(Debug, Clone)]
pub(crate) enum KeyPrice {
    /// None: it counts units (or messages).
    Unpriced,
    /// This price (the model its rule's header named).
    At(UnitPrice),
    /// The model the request's body names: priced by the handler, which reads the body
    /// (`StreamKeys::price_from_body`, `stream/keys.rs`).
    FromBody(Arc<Priced>),
}

/// Where a priced rule reads the request's model ([`Rule::priced`](crate::Rule::priced); a
/// rules file's `price: {model: ...}`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ModelFrom {
    /// A request header (`header:<Name>`): read by the layer, before the handler runs.
    Header(http::HeaderName),
    /// A top-level string field of the request's JSON body (`body:<field>`): a layer decides
    /// before the body is read, so the handler reads it
    /// ([`StreamKeys::price_from_body`](crate::StreamKeys::price_from_body)).
    BodyField(String),
}

/// A priced rule's price ([`Rule::priced`](crate::Rule::priced)): where the request names its
/// model, and which of its prices in `table` the rule charges.
#[derive(Debug)]
pub(crate) struct Priced {
    pub(crate) table: Arc<PriceTable>,
    pub(crate) model: ModelFrom,
    pub(crate) of: PriceOf,
}

impl Priced {
    /// `model`'s price, or why it has none.
    pub(crate) fn of_model(&self, name: &str) -> Result<UnitPrice, String> {
        match self.table.model(name) {
            Some(model) => Ok(model.of(self.of)),
            None => Err(format!("model {name:?} has no price")),
        }
    }

    /// The price of a request's model: `Ok(None)` when the request names none (the rule's
    /// missing-key policy decides), `Err` with why when it names one ambiguously (the header
    /// sent twice) or one the table does not price; a model in the body is the handler's.
    pub(crate) fn price(
        self: &Arc<Self>,
        parts: &http::request::Parts,
    ) -> Result<Option<KeyPrice>, String> {
        let header = match &self.model {
            ModelFrom::Header(header) => header,
            ModelFrom::BodyField(_) => return Ok(Some(KeyPrice::FromBody(self.clone()))),
        };
        let mut values = parts.headers.get_all(header).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(format!("{header} is sent twice: which model is meant?"));
        }
        let name = value.to_str().unwrap_or_default();
        self.of_model(name).map(|price| Some(KeyPrice::At(price)))
    }
}

impl std::fmt::Debug for StreamKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamKeys")
            .field("keys", &self.keys)
            .field("at_limit", &self.at_limit)
            .finish_non_exhaustive()
    }
}

impl StreamKeys {
    /// No keys yet, on `limiter`.
    pub(crate) fn new(limiter: &Limiter) -> Self {
        Self {
            limiter: limiter.clone(),
            keys: smallvec::SmallVec::new(),
            at_limit: None,
        }
    }

    /// Adds a rule's key, with what it counts and what it does at its limit; the stricter
    /// choice wins ([`StreamKeys::at_limit`]).
    pub(crate) fn push(
        &mut self,
        key: BucketKey,
        per: Per,
        price: KeyPrice,
        at_limit: Option<AtLimit>,
    ) {
        self.keys.push((key, per, price));
        self.at_limit = match (self.at_limit, at_limit) {
            (Some(AtLimit::End), _) | (_, Some(AtLimit::End)) => Some(AtLimit::End),
            (Some(AtLimit::PushBack { up_to: a }), Some(AtLimit::PushBack { up_to: b })) => {
                Some(AtLimit::PushBack { up_to: a.min(b) })
            }
            (mine, theirs) => mine.or(theirs),
        };
    }

    /// Whether no rule applied.
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The keys, each with what it counts ([`Per::Message`] or [`Per::Unit`]), in the layer's
    /// rule order.
    pub fn keys(&self) -> impl Iterator<Item = (&BucketKey, Per)> {
        self.keys.iter().map(|(k, p, _)| (k, *p))
    }

    /// What the rules do at a limit: [`AtLimit::End`] when any of them ends, else the shortest
    /// push back any of them sets; `None`: none says (the meter's default).
    pub fn at_limit(&self) -> Option<AtLimit> {
        self.at_limit
    }
}
