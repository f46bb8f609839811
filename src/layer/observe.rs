//! What the layer tells operators: a counter per limit and outcome (feature `metrics`), a
//! `tracing` event per decision, and rate-limited warnings for backend failures. The names,
//! labels and levels are listed in `docs/operating.md` ("Metrics and logs").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::key::LimitName;
use crate::limiter::{Decision, Entry};
use crate::quota::{Numbers, Own, Quota};

/// What happened to one rule of one request: the `outcome` label of
/// `tower_ratelimits_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RuleOutcome {
    /// Allowed (or the limit is disabled for the id).
    Allowed,
    /// Its own limit allowed, but another rule denied the request: nothing was spent.
    BatchDenied,
    /// Denied, and the request was refused.
    Denied,
    /// A shadowed rule that would have denied: the request was not refused because of it.
    ShadowDenied,
    /// Not evaluated: another rule's remembered denial decided the request (Redis deny cache).
    Skipped,
    /// A spend-only rule (not shadowed) whose own decision denied: nothing spent, the request
    /// was not refused because of it.
    NotSpent,
    /// The request was refused before deciding: missing key, bad key, or a cost above the
    /// burst.
    Rejected,
    /// The backend failed and the request went through (fail open).
    FailedOpen,
    /// The backend failed and the request was refused (fail closed, or a full memory table).
    FailedClosed,
    /// The backend failed and the in-memory fallback decided.
    Fallback,
}

impl RuleOutcome {
    const ALL: [RuleOutcome; 10] = [
        RuleOutcome::Allowed,
        RuleOutcome::BatchDenied,
        RuleOutcome::Denied,
        RuleOutcome::ShadowDenied,
        RuleOutcome::Skipped,
        RuleOutcome::NotSpent,
        RuleOutcome::Rejected,
        RuleOutcome::FailedOpen,
        RuleOutcome::FailedClosed,
        RuleOutcome::Fallback,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            RuleOutcome::Allowed => "allowed",
            RuleOutcome::BatchDenied => "batch_denied",
            RuleOutcome::Denied => "denied",
            RuleOutcome::ShadowDenied => "shadow_denied",
            RuleOutcome::Skipped => "skipped",
            RuleOutcome::NotSpent => "not_spent",
            RuleOutcome::Rejected => "rejected",
            RuleOutcome::FailedOpen => "failed_open",
            RuleOutcome::FailedClosed => "failed_closed",
            RuleOutcome::Fallback => "fallback",
        }
    }

    /// The outcome of a decided rule in a batch that was allowed or not (`batch_allowed`).
    pub(crate) fn of(d: &Seen<'_>, shadow: bool, batch_allowed: bool) -> Self {
        if d.skipped {
            RuleOutcome::Skipped
        } else if d.allowed && batch_allowed {
            RuleOutcome::Allowed
        } else if d.allowed {
            RuleOutcome::BatchDenied
        } else if shadow {
            RuleOutcome::ShadowDenied
        } else if d.counts {
            RuleOutcome::Denied
        } else {
            RuleOutcome::NotSpent
        }
    }
}

/// One decided transaction as the layer shows it (its counters, its trace event, its
/// `RateLimit` members): taken from a [`Decision`], or from the backend's outcome when no
/// decision was built. The layer's one view of a decision.
#[derive(Clone, Copy)]
pub(crate) struct Seen<'a> {
    pub(crate) name: LimitName,
    pub(crate) id: &'a crate::key::Id,
    /// `None`: the limit is disabled for this id.
    pub(crate) quota: Option<&'a Quota>,
    pub(crate) allowed: bool,
    pub(crate) skipped: bool,
    /// It takes part in choosing the batch decision ([`Decision::counts`]).
    pub(crate) counts: bool,
    pub(crate) remaining: u64,
    pub(crate) retry_after_us: u64,
    pub(crate) reset_after_us: u64,
    /// Denied because its key is banned by its limit's penalty ladder.
    pub(crate) banned: bool,
    /// Its numbers of its limit's own shape (a tiered limit's grant, a calendar quota's
    /// period, an adaptive limit's slots), read only by the shape's answers.
    pub(crate) own: Own<'a>,
}

impl<'a> Seen<'a> {
    /// Its numbers as its limit's shape reads them.
    #[inline]
    pub(crate) fn numbers(&self) -> Numbers<'a> {
        Numbers {
            allowed: self.allowed,
            remaining: self.remaining,
            retry_after_us: self.retry_after_us,
            reset_after_us: self.reset_after_us,
            own: self.own,
        }
    }

    /// Whether it left at most `100 - percent` % of its limit's size (`Quota::size`). A
    /// disabled limit never is.
    #[cfg(feature = "metrics")]
    fn near_limit(&self, percent: u8) -> bool {
        let Some(quota) = self.quota else {
            return false;
        };
        let size = quota.size(&self.numbers());
        u128::from(self.remaining) * 100 <= u128::from(size) * u128::from(100 - percent.min(100))
    }
}

impl<'a> From<&'a Decision> for Seen<'a> {
    fn from(d: &'a Decision) -> Self {
        let micros = crate::time::duration_us;
        Self {
            name: d.name,
            id: d.key.id(),
            quota: d.limit.as_ref(),
            allowed: d.allowed,
            skipped: d.skipped,
            counts: d.counts(),
            remaining: d.remaining,
            retry_after_us: micros(d.retry_after),
            reset_after_us: micros(d.reset_after),
            banned: d.banned,
            own: d.own(),
        }
    }
}

impl<'a> From<Entry<'a>> for Seen<'a> {
    fn from(e: Entry<'a>) -> Self {
        Self {
            name: e.tx.key().name(),
            id: e.tx.key().id(),
            quota: e.quota,
            allowed: e.outcome.allowed,
            skipped: e.outcome.skipped,
            counts: e.counts(),
            remaining: e.outcome.remaining,
            retry_after_us: e.outcome.retry_after_us,
            reset_after_us: e.outcome.reset_after_us,
            banned: e.outcome.banned,
            own: e.own(),
        }
    }
}

/// A rule's counters, registered once when the layer is built (so install the metrics
/// recorder before building layers), one per outcome; labels are the limit name and the
/// outcome, never an id.
pub(crate) struct RuleMetrics {
    #[cfg(feature = "metrics")]
    counters: [metrics::Counter; RuleOutcome::ALL.len()],
    /// `tower_ratelimits_near_limit_total{limit}`.
    #[cfg(feature = "metrics")]
    near_limit: metrics::Counter,
    /// The layer's journal and the rule's name, for a replay.
    #[cfg(feature = "replay")]
    journal: (LimitName, std::sync::Arc<Journal>),
}

impl RuleMetrics {
    pub(crate) fn new(
        name: LimitName,
        #[cfg(feature = "replay")] journal: &std::sync::Arc<Journal>,
    ) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self {
                #[cfg(feature = "replay")]
                journal: (name, journal.clone()),
                counters: RuleOutcome::ALL.map(|o| {
                    metrics::counter!(
                        "tower_ratelimits_decisions_total",
                        "limit" => name.as_str(),
                        "outcome" => o.label()
                    )
                }),
                near_limit: metrics::counter!(
                    "tower_ratelimits_near_limit_total",
                    "limit" => name.as_str()
                ),
            }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (name, RuleOutcome::ALL);
            Self {
                #[cfg(feature = "replay")]
                journal: (name, journal.clone()),
            }
        }
    }

    pub(crate) fn count(&self, outcome: RuleOutcome) {
        #[cfg(feature = "metrics")]
        self.counters[outcome as usize].increment(1);
        #[cfg(feature = "replay")]
        self.journal.1.note(self.journal.0, None, outcome);
        #[cfg(not(any(feature = "metrics", feature = "replay")))]
        let _ = outcome;
    }

    /// Counts a decided transaction (`count`, with what a replay reads of it).
    #[inline]
    pub(crate) fn count_seen(&self, d: &Seen<'_>, outcome: RuleOutcome) {
        #[cfg(feature = "metrics")]
        self.counters[outcome as usize].increment(1);
        #[cfg(feature = "replay")]
        self.journal.1.note(self.journal.0, Some(d), outcome);
        #[cfg(not(feature = "replay"))]
        let _ = d;
        #[cfg(not(any(feature = "metrics", feature = "replay")))]
        let _ = outcome;
    }

    /// Counts `d` in `tower_ratelimits_near_limit_total` when it was allowed and left at most
    /// `100 - percent` % of its limit (Envoy's rate-limit service: 80).
    #[inline]
    pub(crate) fn count_near_limit(&self, d: &Seen<'_>, outcome: RuleOutcome, percent: u8) {
        #[cfg(feature = "metrics")]
        if outcome == RuleOutcome::Allowed && d.near_limit(percent) {
            self.near_limit.increment(1);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (d, outcome, percent);
    }
}

/// The request-level counter `tower_ratelimits_requests_total{outcome}`.
pub(crate) fn count_request(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_ratelimits_requests_total", "outcome" => outcome).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// One `tracing` event per decided rule: `debug` on the target `tower_ratelimits::decision`;
/// a shadowed rule that would deny at `info` on `tower_ratelimits::shadow`. The id is a field
/// only when `log_ids` is on (ids can be personal data).
#[inline]
pub(crate) fn trace_decision(
    d: &Seen<'_>,
    outcome: RuleOutcome,
    log_ids: bool,
    shadow_gate: &WarnGate,
) {
    // Every request comes here: nothing is prepared unless a subscriber may want the event.
    if !tracing::level_enabled!(tracing::Level::INFO)
        || (outcome != RuleOutcome::ShadowDenied && !tracing::level_enabled!(tracing::Level::DEBUG))
    {
        return;
    }
    trace_enabled(d, outcome, log_ids, shadow_gate);
}

/// [`trace_decision`] once a subscriber may want the event (out of line: the check above is
/// what every request pays).
#[inline(never)]
fn trace_enabled(d: &Seen<'_>, outcome: RuleOutcome, log_ids: bool, shadow_gate: &WarnGate) {
    let retry_after_ms = d.retry_after_us / 1000;
    let (limit, id, remaining) = (d.name.as_str(), d.id, d.remaining);
    if outcome == RuleOutcome::ShadowDenied {
        // At most one line per interval (every "would deny" is counted in the metrics): a
        // shadowed limit that denies much would otherwise log once per request.
        let Some(held_back) = shadow_gate.admit() else {
            return;
        };
        if log_ids {
            tracing::info!(target: crate::telemetry::target::SHADOW, limit, id = %id, retry_after_ms, held_back, "shadow rule would deny");
        } else {
            tracing::info!(target: crate::telemetry::target::SHADOW, limit, retry_after_ms, held_back, "shadow rule would deny");
        }
        return;
    }
    let outcome = outcome.label();
    if log_ids {
        tracing::debug!(target: crate::telemetry::target::DECISION, limit, outcome, id = %id, retry_after_ms, remaining, "rate limit decision");
    } else {
        tracing::debug!(target: crate::telemetry::target::DECISION, limit, outcome, retry_after_ms, remaining, "rate limit decision");
    }
}

/// Lets one warning through per interval and counts the ones it held back, so that an outage
/// writes a line every 10 s instead of one per request.
pub(crate) struct WarnGate {
    start: Instant,
    /// Microseconds since `start` of the next warning allowed (0: now).
    next_us: AtomicU64,
    suppressed: AtomicU64,
    interval: Duration,
}

impl WarnGate {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            start: Instant::now(),
            next_us: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            interval,
        }
    }

    /// `Some(held back since the last one)` when a warning may be written now.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(crate::time::duration_us(self.start.elapsed()))
    }

    /// [`admit`](Self::admit) at `now` microseconds since the gate was made.
    fn admit_at(&self, now: u64) -> Option<u64> {
        let next = self.next_us.load(Ordering::Relaxed);
        let interval = crate::time::duration_us(self.interval);
        if now >= next
            && self
                .next_us
                .compare_exchange(
                    next,
                    now.saturating_add(interval),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warn_gate_lets_one_warning_through_per_interval_and_counts_the_rest() {
        let gate = WarnGate::new(Duration::from_secs(10));
        assert_eq!(gate.admit_at(5), Some(0));
        for t in [6, 1_000, 9_999_999] {
            assert_eq!(gate.admit_at(t), None, "at {t} us");
        }
        assert_eq!(gate.admit_at(10_000_005), Some(3), "three held back");
        assert_eq!(gate.admit_at(10_000_006), None);
        assert_eq!(gate.admit_at(30_000_000), Some(1));
    }

    /// A request's decisions are looked at again only when something reads them: the metrics
    /// (feature `metrics`), a `tracing` subscriber at `info` or finer (the shadow "would deny"
    /// line), or a replay's journal. Before, every request built each decision's view and
    /// walked the rules for it whatever read it.
    #[test]
    fn decisions_are_observed_only_when_something_reads_them() {
        let limits =
            crate::Limits::from_yaml_str("Api: {burst: 5, count: 5, period: 1s}", None).unwrap();
        let limiter = crate::Limiter::new(limits, crate::MemoryBackend::new());
        let rule = crate::Rule::new("Api", crate::ClientIp::new()).shadow(true);
        let layer = crate::RateLimitLayer::new(limiter, [rule]).unwrap();
        let rules = &layer.shared.rules;
        // No subscriber yet in this test binary, no journal: only the metrics read them.
        assert_eq!(rules.observed(), cfg!(feature = "metrics"));
        let at = |level| {
            tracing_subscriber::fmt()
                .with_max_level(level)
                .with_writer(std::io::sink)
                .finish()
        };
        tracing::subscriber::with_default(at(tracing::Level::INFO), || {
            assert!(
                rules.observed(),
                "a subscriber at info reads the shadow line"
            );
        });
        #[cfg(feature = "replay")]
        {
            rules.journal.start();
            assert!(rules.observed(), "a replay reads every decision");
        }
    }
}

/// What each rule of a layer decided, in order, for a replay (feature `replay`): nothing is
/// kept until a replay turns it on ([`Journal::start`]), so a layer in a server pays one load
/// per decided rule.
#[cfg(feature = "replay")]
#[derive(Default)]
pub(crate) struct Journal {
    on: std::sync::atomic::AtomicBool,
    notes: std::sync::Mutex<Vec<Note>>,
    /// Requests an exemption let through.
    pub(crate) exempt: AtomicU64,
}

/// One rule's outcome for one request, as a replay reads it.
#[cfg(feature = "replay")]
#[derive(Debug, Clone)]
pub(crate) struct Note {
    pub(crate) name: LimitName,
    pub(crate) outcome: RuleOutcome,
    /// The bucket's id, when the rule was decided.
    pub(crate) id: Option<crate::key::Id>,
    /// Units of the limit's size in use after the decision, and the size.
    pub(crate) used: u64,
    pub(crate) size: u64,
}

#[cfg(feature = "replay")]
impl Journal {
    /// Whether notes are kept.
    #[inline(always)]
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Keeps notes from now on.
    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    fn note(&self, name: LimitName, d: Option<&Seen<'_>>, outcome: RuleOutcome) {
        if !self.on() {
            return;
        }
        let (id, used, size) = match d {
            Some(d) => {
                let size = d.quota.map_or(0, |q| q.size(&d.numbers()));
                (Some(d.id.clone()), size.saturating_sub(d.remaining), size)
            }
            None => (None, 0, 0),
        };
        let note = Note {
            name,
            outcome,
            id,
            used,
            size,
        };
        if let Ok(mut notes) = self.notes.lock() {
            notes.push(note);
        }
    }

    /// The notes kept since the last take.
    pub(crate) fn take(&self, into: &mut Vec<Note>) {
        if let Ok(mut notes) = self.notes.lock() {
            into.append(&mut notes);
        }
    }
}
