//! What a layer's per-message rules found for a request that opens a stream: the keys its
//! messages count against, handed to the handler ([`StreamKeys`]), which meters the stream
//! with them.

use crate::key::BucketKey;
use crate::limiter::Limiter;

use super::AtLimit;
use super::meter::StreamMeterBuilder;

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
    /// [`LimitedStream::units`](super::LimitedStream::units) reads), as [`Per::Message`]
    /// hands the key over.
    Unit,
}

impl Per {
    /// What a message of `units` units costs a key counted so.
    #[inline(always)]
    pub(crate) fn cost(self, units: u64) -> u64 {
        match self {
            Per::Unit => units,
            Per::Message | Per::Request => 1,
        }
    }
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
    limiter: Limiter,
    keys: smallvec::SmallVec<[(BucketKey, Per); 2]>,
    at_limit: Option<AtLimit>,
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
    pub(crate) fn push(&mut self, key: BucketKey, per: Per, at_limit: Option<AtLimit>) {
        self.keys.push((key, per));
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
        self.keys.iter().map(|(k, p)| (k, *p))
    }

    /// What the rules do at a limit: [`AtLimit::End`] when any of them ends, else the shortest
    /// push back any of them sets; `None`: none says (the meter's default).
    pub fn at_limit(&self) -> Option<AtLimit> {
        self.at_limit
    }

    /// A meter builder holding these keys and the rules' [`at_limit`](Self::at_limit): add
    /// keys of the handler's own (a per-stream key), grants ahead, and build.
    pub fn meter(&self) -> StreamMeterBuilder {
        let mut builder = super::StreamMeter::builder(&self.limiter);
        for (key, per) in &self.keys {
            builder = match per {
                Per::Unit => builder.per_unit(key.clone()),
                _ => builder.per_message(key.clone()),
            };
        }
        match self.at_limit {
            Some(at_limit) => builder.at_limit(at_limit),
            None => builder,
        }
    }
}
