//! Limits: names, their id kinds, defaults and per-id overrides.
//!
//! [`Limits`] is an immutable snapshot. Names are interned ([`LimitName`]) when the snapshot is
//! built; resolving the limit of a bucket on the request path is one hash lookup in the
//! overrides (skipped when there are none) and one in the names, both on precomputed hashes.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::algo::gcra::LimitError;
use crate::algo::tiers::TierError;
use crate::key::{BucketKey, IdError, IdKind, LimitName};
use crate::quota::Quota;
use crate::time::DurationError;

mod stored;
#[cfg(feature = "yaml")]
mod yaml;

pub(crate) use stored::{StoredSet, check_override};

/// Where a configuration error was found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Location {
    /// The file (or a label such as `<defaults>` for text loaded from a string).
    pub source: Option<String>,
    /// The 1-based line, when known.
    pub line: Option<u64>,
}

/// What is wrong with a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The file could not be read.
    #[error("cannot read the file: {0}")]
    Io(#[from] std::io::Error),
    /// The file is larger than the loader accepts.
    #[error("the file is {bytes} bytes; at most {max} are accepted")]
    TooLarge {
        /// Its size.
        bytes: u64,
        /// The cap.
        max: u64,
    },
    /// The path is not a regular file (a directory, a FIFO, a device).
    #[error("not a regular file")]
    NotAFile,
    /// The file is not UTF-8 text.
    #[error("not valid UTF-8 (at byte {offset})")]
    NotUtf8 {
        /// The first byte that is not part of valid UTF-8.
        offset: usize,
    },
    /// The file holds no YAML document.
    #[error("the file is empty (write {{}} or [] for none)")]
    Empty,
    /// Not YAML, or YAML beyond the loader's budget (depth, size, aliases).
    #[error("invalid YAML: {0}")]
    Yaml(String),
    /// The document has the wrong shape.
    #[error("expected {expected}, found {found}")]
    WrongShape {
        /// What was expected.
        expected: &'static str,
        /// What was found.
        found: &'static str,
    },
    /// A field that does not exist, and the known field it most likely meant (a typo: a few
    /// letters off), when one is that close.
    #[error("unknown field {field:?}{}", suggestion_text(.did_you_mean))]
    UnknownField {
        /// The field as written (its first 80 characters, as for a name).
        field: String,
        /// The known field nearest to it, when one is a few letters away.
        did_you_mean: Option<&'static str>,
    },
    /// A required field is missing.
    #[error("missing field {0:?}")]
    MissingField(&'static str),
    /// A field given twice.
    #[error("field {0:?} given twice")]
    DuplicateField(String),
    /// A number that is not a positive integer that fits.
    #[error("{field} must be a whole number greater than zero, found {found}")]
    BadNumber {
        /// The field.
        field: &'static str,
        /// What was found.
        found: String,
    },
    /// A number that is not a whole number of at least 0 that fits (`max_debt`).
    #[error("{field} must be a whole number, 0 or more, found {found}")]
    BadCount {
        /// The field.
        field: &'static str,
        /// What was found.
        found: String,
    },
    /// A limit name that is not made of letters, digits, `_`, `-` and `.`, or longer than 64.
    #[error("invalid limit name {0:?}: use up to 64 letters, digits, '_', '-' or '.'")]
    InvalidName(String),
    /// A name defined twice.
    #[error("limit {0:?} is defined twice")]
    DuplicateName(String),
    /// An override for a name with no definition.
    #[error("override for unknown limit {0:?}")]
    UnknownName(String),
    /// `on_store_failure` other than `fail_closed` or `layer`.
    #[error(
        "on_store_failure must be `fail_closed` or `layer` (the layer's failure policy), found {0:?}"
    )]
    OnStoreFailure(String),
    /// The same bucket overridden twice.
    #[error("id {0:?} is overridden twice")]
    DuplicateId(String),
    /// An override entry without ids.
    #[error("an override needs at least one id")]
    NoIds,
    /// An id that does not fit the name's kind.
    #[error("invalid id: {0}")]
    InvalidId(#[from] IdError),
    /// A period that does not parse.
    #[error("invalid period: {0}")]
    InvalidPeriod(#[from] DurationError),
    /// A limit that does not validate.
    #[error("invalid limit: {0}")]
    InvalidLimit(#[from] LimitError),
    /// A concurrency limit that does not validate.
    #[error("invalid concurrency limit: {0}")]
    InvalidConcurrency(#[from] crate::algo::concurrency::ConcurrencyError),
    /// A calendar quota that does not validate (`docs/calendar.md`).
    #[error("invalid calendar quota: {0}")]
    InvalidCalendar(#[from] crate::algo::calendar::CalendarError),
    /// Tiers that do not validate (the error names the tier and the field).
    #[error("invalid tiers: {0}")]
    InvalidTiers(#[from] TierError),
    /// A tier field that is missing or does not parse.
    #[error("tier {tier}: {field} {reason}")]
    InvalidTier {
        /// The tier, from 1.
        tier: usize,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Fields that cannot be given together (`tiers` with `burst`/`count`/`period`, `concurrency`
    /// with either).
    #[error(
        "{0} and {1} cannot be given together: a limit is GCRA (burst, count, period), tiered (tiers), a concurrency limit (concurrency, lease, retry_after) or a calendar quota (calendar)"
    )]
    ConflictingFields(&'static str, &'static str),
    /// The configured cost of a request is larger than a burst (or, for tiers, the sum of the
    /// tiers' limits) it applies to.
    #[error("cost {cost} exceeds the burst of {burst}: no request could ever be allowed")]
    CostAboveBurst {
        /// The cost.
        cost: u64,
        /// The burst.
        burst: u64,
    },
}

/// A configuration error: what is wrong, and where (file, line, limit name).
///
/// ```
/// # #[cfg(feature = "yaml")] {
/// use tower_ratelimits::{ConfigErrorKind, Limits};
/// let err = Limits::from_yaml_str("Api:\n  burst: 0\n  count: 1\n  period: 1s\n", None).unwrap_err();
/// assert!(matches!(err.kind(), ConfigErrorKind::BadNumber { field: "burst", .. }));
/// assert_eq!(err.location().line, Some(2));
/// assert_eq!(err.limit(), Some("Api"));
/// assert_eq!(
///     err.to_string(),
///     "<defaults>:2: limit Api: burst must be a whole number greater than zero, found 0"
/// );
/// # }
/// ```
pub struct ConfigError {
    location: Location,
    limit: Option<String>,
    kind: ConfigErrorKind,
}

/// The `Display` sentence (what a `main` returning `Box<dyn Error>` prints), the structured
/// form under `{:#?}`.
impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !f.alternate() {
            return fmt::Display::fmt(self, f);
        }
        f.debug_struct("ConfigError")
            .field("location", &self.location)
            .field("limit", &self.limit)
            .field("kind", &self.kind)
            .finish()
    }
}

impl ConfigError {
    pub(crate) fn new(kind: impl Into<ConfigErrorKind>) -> Self {
        Self {
            location: Location::default(),
            limit: None,
            kind: kind.into(),
        }
    }

    #[cfg_attr(not(feature = "yaml"), allow(dead_code))]
    pub(crate) fn at_line(mut self, line: u64) -> Self {
        if line > 0 {
            self.location.line.get_or_insert(line);
        }
        self
    }

    #[cfg_attr(not(feature = "yaml"), allow(dead_code))]
    pub(crate) fn in_source(mut self, source: &str) -> Self {
        self.location
            .source
            .get_or_insert_with(|| source.to_owned());
        self
    }

    pub(crate) fn for_limit(mut self, name: &str) -> Self {
        // A name that is refused may be anything a file holds: its first 80 characters, as the
        // error's quoted part keeps them.
        self.limit
            .get_or_insert_with(|| name.chars().take(80).collect());
        self
    }

    /// What is wrong.
    pub fn kind(&self) -> &ConfigErrorKind {
        &self.kind
    }

    /// Where.
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// The limit name involved, when there is one.
    pub fn limit(&self) -> Option<&str> {
        self.limit.as_deref()
    }
}

#[cfg(feature = "yaml")]
impl ConfigErrorKind {
    /// An unknown field `field`, with the field of `known` it most likely meant: the nearest
    /// by edit distance (letters added, removed, changed or swapped), when it is at most a third
    /// of the field's length away (at least one).
    pub(crate) fn unknown_field(field: &str, known: &[&'static str]) -> Self {
        let most = (field.chars().count() / 3).max(1);
        let did_you_mean = known
            .iter()
            .map(|k| (edit_distance(field, k, most), *k))
            .filter(|(d, _)| *d <= most)
            .min_by_key(|(d, _)| *d)
            .map(|(_, k)| k);
        Self::UnknownField {
            field: field.chars().take(80).collect(),
            did_you_mean,
        }
    }
}

/// `; did you mean `x`?` after an unknown field's message, when there is a suggestion.
fn suggestion_text(suggestion: &Option<&'static str>) -> String {
    suggestion.map_or_else(String::new, |s| format!("; did you mean `{s}`?"))
}

/// The edit distance between `a` and `b` (optimal string alignment: insertions, deletions,
/// substitutions, and swaps of two neighbours), or `most + 1` when their lengths alone say it
/// is larger or either is longer than 64 characters (no known field is): a hostile field name
/// of any length costs one count of its characters per known field.
#[cfg(feature = "yaml")]
fn edit_distance(a: &str, b: &str, most: usize) -> usize {
    // Lengths first, by counting (a hostile name is never copied).
    let (a_len, b_len) = (a.chars().count(), b.chars().count());
    if a_len.abs_diff(b_len) > most || a_len > 64 || b_len > 64 {
        return most + 1;
    }
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // Three rows of the table: two back (for swaps), one back, and this one.
    let mut before: Vec<usize> = Vec::new();
    let mut last: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut row = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (last[j] + 1).min(row[j - 1] + 1).min(last[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(before[j - 2] + 1);
            }
        }
        before = std::mem::replace(&mut last, row);
    }
    last[b.len()]
}

impl From<crate::quota::ShapeError> for ConfigErrorKind {
    fn from(e: crate::quota::ShapeError) -> Self {
        match e {
            crate::quota::ShapeError::Limit(e) => e.into(),
            crate::quota::ShapeError::Tiers(e) => e.into(),
            crate::quota::ShapeError::Concurrency(e) => e.into(),
            crate::quota::ShapeError::Calendar(e) => e.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.location.source, self.location.line) {
            (Some(s), Some(l)) => write!(f, "{s}:{l}: ")?,
            (Some(s), None) => write!(f, "{s}: ")?,
            (None, Some(l)) => write!(f, "line {l}: ")?,
            (None, None) => {}
        }
        if let Some(name) = &self.limit {
            // Escaped: a refused name's control characters never reach a terminal.
            write!(f, "limit {}: ", name.escape_debug())?;
        }
        self.kind.fmt(f)
    }
}

impl std::error::Error for ConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.kind)
    }
}

/// What the configuration says of one name.
#[derive(Debug, Clone)]
pub(crate) struct NameEntry {
    name: LimitName,
    pub(crate) kind: IdKind,
    /// The cost of a request when its transaction sets none.
    pub(crate) cost: u64,
    pub(crate) default: Option<Quota>,
    /// A store failure refuses a request with a rule of this name, whatever the layer's
    /// failure policy (`on_store_failure: fail_closed`).
    pub(crate) fail_closed: bool,
}

/// A snapshot of every limit: names (interned), id kinds, default costs, defaults and overrides.
///
/// Build one with [`Limits::builder`] or load YAML with [`Limits::from_yaml_str`] /
/// [`Limits::from_yaml_files`].
///
/// ```
/// use tower_ratelimits::{BucketKey, Id, IdKind, Limit, Limits};
/// use std::time::Duration;
///
/// let limits = Limits::builder()
///     .limit_for("ApiPerIp", IdKind::Ip, Limit::new(20, 20, Duration::from_secs(1)).unwrap())
///     .override_for("ApiPerIp", "10.0.0.2", Limit::new(20, 40, Duration::from_secs(1)).unwrap())
///     .build()
///     .unwrap();
/// let name = limits.name("ApiPerIp").unwrap();
/// let key = BucketKey::new(name, Id::new("10.0.0.2").unwrap());
/// assert_eq!(limits.resolve(&key).unwrap().as_gcra().unwrap().count(), 40);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Limits {
    /// What the configuration says, shared by the snapshots that differ only in their stored
    /// overrides (a stored change copies two pointers, not the configuration).
    config: Arc<Config>,
    /// Overrides kept in the store (`Limiter::set_override`), applied to these limits; `None`
    /// when there are none (the request path checks one pointer).
    stored: Option<Arc<StoredSet>>,
}

/// The configuration's part of a [`Limits`]: names, defaults, file overrides.
#[derive(Debug, Clone, Default)]
struct Config {
    /// In definition order (for listing only: nothing is keyed by a position).
    names: Vec<NameEntry>,
    by_name: HashMap<LimitName, usize, nohash_hasher::BuildNoHashHasher<LimitName>>,
    by_text: HashMap<&'static str, usize, foldhash::fast::RandomState>,
    overrides: HashMap<BucketKey, Quota, foldhash::fast::RandomState>,
    /// Ids an override makes unlimited (`unlimited: true`): no limit, whatever the default.
    unlimited: HashSet<BucketKey, foldhash::fast::RandomState>,
}

impl Limits {
    /// A builder.
    pub fn builder() -> LimitsBuilder {
        LimitsBuilder::default()
    }

    /// A name's entry: one lookup, for everything the request path needs of the name.
    pub(crate) fn entry(&self, name: LimitName) -> Option<&NameEntry> {
        self.config
            .by_name
            .get(&name)
            .map(|&i| &self.config.names[i])
    }

    /// The name `text`, when this configuration defines it.
    pub fn name(&self, text: &str) -> Option<LimitName> {
        self.config
            .by_text
            .get(text)
            .map(|&i| self.config.names[i].name)
    }

    /// Whether this configuration defines `name`.
    pub fn contains(&self, name: LimitName) -> bool {
        self.config.by_name.contains_key(&name)
    }

    /// The id kind a name is keyed by.
    pub fn id_kind(&self, name: LimitName) -> Option<IdKind> {
        self.entry(name).map(|e| e.kind)
    }

    /// The cost of one request against a name when the transaction sets none (1 by default).
    pub fn default_cost(&self, name: LimitName) -> u64 {
        self.entry(name).map_or(1, |e| e.cost)
    }

    /// Whether a store failure refuses the requests of `name` whatever the layer's failure
    /// policy ([`LimitsBuilder::fail_closed`]).
    pub fn fails_closed(&self, name: LimitName) -> bool {
        self.entry(name).is_some_and(|e| e.fail_closed)
    }

    /// The default limit of a name (`None`: disabled unless overridden).
    pub fn default_limit(&self, name: LimitName) -> Option<&Quota> {
        self.entry(name).and_then(|e| e.default.as_ref())
    }

    /// Every name, in the order they were defined.
    pub fn names(&self) -> impl Iterator<Item = LimitName> + '_ {
        self.config.names.iter().map(|e| e.name)
    }

    /// The names whose default or a file override prefetches tokens
    /// ([`Limit::with_prefetch`](crate::Limit::with_prefetch)), in definition order.
    pub(crate) fn prefetching_names(&self) -> Vec<LimitName> {
        let prefetches = Quota::prefetches;
        // One pass over the overrides (a file may hold millions), then one over the names.
        let mut by_override: Vec<LimitName> = Vec::new();
        for (key, quota) in &self.config.overrides {
            if prefetches(quota) && !by_override.contains(&key.name()) {
                by_override.push(key.name());
            }
        }
        self.config
            .names
            .iter()
            .filter(|e| e.default.as_ref().is_some_and(prefetches) || by_override.contains(&e.name))
            .map(|e| e.name)
            .collect()
    }

    /// The number of overrides (unlimited ids included), not counting stored ones.
    pub fn override_count(&self) -> usize {
        self.config.overrides.len() + self.config.unlimited.len()
    }

    /// The number of stored overrides ([`Limiter::set_override`](crate::Limiter::set_override))
    /// that apply to these limits.
    pub fn stored_override_count(&self) -> usize {
        self.stored.as_ref().map_or(0, |s| s.len())
    }

    /// These limits with `stored` applied in place of the stored overrides they had (the
    /// configuration is shared, not copied).
    pub(crate) fn with_stored(&self, stored: Option<Arc<StoredSet>>) -> Self {
        Self {
            config: self.config.clone(),
            stored,
        }
    }

    /// The stored overrides applied to these limits.
    pub(crate) fn stored(&self) -> Option<&Arc<StoredSet>> {
        self.stored.as_ref()
    }

    /// The limit that applies to a bucket: its override, else the name's default, else `None`
    /// (disabled, or a name this configuration does not define).
    pub fn resolve(&self, key: &BucketKey) -> Option<&Quota> {
        self.resolve_in(self.entry(key.name())?, key).quota
    }

    /// The limit that applies to a bucket and where it comes from: the one home of the
    /// precedence (a stored override, then a file override, then the name's default).
    #[inline(always)]
    pub(crate) fn resolve_in<'a>(
        &'a self,
        entry: &'a NameEntry,
        key: &BucketKey,
    ) -> Resolution<'a> {
        if let Some(stored) = &self.stored
            && let Some(r) = Self::resolve_stored(stored, entry, key)
        {
            return r;
        }
        if !self.config.overrides.is_empty()
            && let Some(l) = self.config.overrides.get(key)
        {
            return Resolution::of(Some(l), LimitSource::Override);
        }
        if !self.config.unlimited.is_empty() && self.config.unlimited.contains(key) {
            return Resolution::of(None, LimitSource::Override);
        }
        Resolution::of(entry.default.as_ref(), LimitSource::Default)
    }
}

impl Limits {
    /// A stored override of `key`, out of line: the request path of limits without stored
    /// overrides stays as small as before they existed (one pointer checked).
    #[inline(never)]
    fn resolve_stored<'a>(
        stored: &'a StoredSet,
        entry: &'a NameEntry,
        key: &BucketKey,
    ) -> Option<Resolution<'a>> {
        stored
            .resolve(key, entry.default.as_ref())
            .map(|r| Resolution {
                quota: r.quota,
                source: LimitSource::Store,
                block_s: r.block_s,
            })
    }
}

/// The limit that applies to a bucket ([`Limits::resolve_in`]).
pub(crate) struct Resolution<'a> {
    /// `None`: no limit (disabled for this id, or unlimited).
    pub(crate) quota: Option<&'a Quota>,
    pub(crate) source: LimitSource,
    /// A stored block: seconds until it ends, rounded up (0: not blocked; `Retry-After` is in
    /// whole seconds too). A blocked transaction is denied without asking the backend.
    pub(crate) block_s: u32,
}

impl<'a> Resolution<'a> {
    #[inline]
    fn of(quota: Option<&'a Quota>, source: LimitSource) -> Self {
        Self {
            quota,
            source,
            block_s: 0,
        }
    }
}

impl Limits {
    /// What replacing `self` with `new` changes, by name.
    pub(crate) fn change_to(&self, new: &Limits) -> LimitsChange {
        let mut change = LimitsChange::default();
        fn overrides_of(limits: &Limits, name: LimitName) -> Vec<(String, Option<&Quota>)> {
            let mut o: Vec<(String, Option<&Quota>)> = limits
                .config
                .overrides
                .iter()
                .filter(|(k, _)| k.name() == name)
                .map(|(k, q)| (k.id().to_string(), Some(q)))
                .chain(
                    limits
                        .config
                        .unlimited
                        .iter()
                        .filter(|k| k.name() == name)
                        .map(|k| (k.id().to_string(), None)),
                )
                .collect();
            o.sort_by(|a, b| a.0.cmp(&b.0));
            o
        }
        for e in &new.config.names {
            match self.entry(e.name) {
                None => change.added.push(e.name.to_string()),
                Some(old) => {
                    if old.kind != e.kind
                        || old.cost != e.cost
                        || old.default != e.default
                        || overrides_of(self, e.name) != overrides_of(new, e.name)
                    {
                        change.changed.push(e.name.to_string());
                    }
                }
            }
        }
        for e in &self.config.names {
            if !new.contains(e.name) {
                change.removed.push(e.name.to_string());
            }
        }
        change
    }

    /// The same limits at `percent` of their size (1 to 100), for an in-memory fallback
    /// limiter per instance (each shape scales as `Quota::scaled` says; nothing below the
    /// configured cost of a request). Errors name the limit that cannot be scaled.
    pub(crate) fn scaled(&self, percent: u8) -> Result<Limits, ConfigError> {
        let quota = |q: &Quota, cost: u64| q.scaled(percent, cost).map_err(ConfigErrorKind::from);
        let mut scaled = self.clone();
        for e in &mut Arc::make_mut(&mut scaled.config).names {
            if let Some(q) = &e.default {
                e.default = Some(
                    quota(q, e.cost).map_err(|k| ConfigError::new(k).for_limit(e.name.as_str()))?,
                );
            }
        }
        for (key, q) in &mut Arc::make_mut(&mut scaled.config).overrides {
            let cost = self.entry(key.name()).map_or(1, |e| e.cost);
            *q = quota(q, cost).map_err(|k| ConfigError::new(k).for_limit(key.name().as_str()))?;
        }
        // Stored overrides' limits scale too (a block or unlimited stays what it is).
        if let Some(stored) = &self.stored {
            let mut stored = (**stored).clone();
            stored.try_map_quotas(|key, q| {
                let cost = self.entry(key.name()).map_or(1, |e| e.cost);
                quota(q, cost).map_err(|k| ConfigError::new(k).for_limit(key.name().as_str()))
            })?;
            scaled.stored = Some(Arc::new(stored));
        }
        Ok(scaled)
    }
}

/// Builds [`Limits`]; errors are reported by [`LimitsBuilder::build`], the first one found.
#[derive(Debug, Default)]
pub struct LimitsBuilder {
    limits: Limits,
    error: Option<ConfigError>,
}

/// Limit names: 1 to 64 ASCII letters, digits, `_`, `-`, `.`.
pub(crate) fn check_name(name: &str) -> Result<(), ConfigErrorKind> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ConfigErrorKind::InvalidName(
            name.chars().take(80).collect(),
        ))
    }
}

impl LimitsBuilder {
    fn fail(&mut self, e: ConfigError) {
        self.error.get_or_insert(e);
    }

    /// Defines `name` with ids of any kind and a default limit (a [`Limit`](crate::Limit) or a
    /// [`TieredLimit`](crate::algo::tiers::TieredLimit)).
    pub fn limit(self, name: &str, limit: impl Into<Quota>) -> Self {
        self.define(name, IdKind::Any, 1, Some(limit.into()))
    }

    /// Defines `name` with ids of `kind` and a default limit.
    pub fn limit_for(self, name: &str, kind: IdKind, limit: impl Into<Quota>) -> Self {
        self.define(name, kind, 1, Some(limit.into()))
    }

    /// Defines `name` in full: id kind, the cost of a request when a transaction sets none, and
    /// the default limit (`None`: the limit applies only to overridden ids).
    pub fn define(mut self, name: &str, kind: IdKind, cost: u64, default: Option<Quota>) -> Self {
        if let Err(e) = self.try_define(name, kind, cost, default) {
            self.fail(e.for_limit(name));
        }
        self
    }

    pub(crate) fn try_define(
        &mut self,
        name: &str,
        kind: IdKind,
        cost: u64,
        default: Option<Quota>,
    ) -> Result<(), ConfigError> {
        check_name(name).map_err(ConfigError::new)?;
        if self.limits.config.by_text.contains_key(name) {
            return Err(ConfigError::new(ConfigErrorKind::DuplicateName(
                name.to_owned(),
            )));
        }
        if let Some(l) = &default
            && cost > l.max_cost()
        {
            return Err(ConfigError::new(ConfigErrorKind::CostAboveBurst {
                cost,
                burst: l.max_cost(),
            }));
        }
        let name = LimitName::intern(name);
        let index = self.limits.config.names.len();
        let config = Arc::make_mut(&mut self.limits.config);
        config.by_name.insert(name, index);
        config.by_text.insert(name.as_str(), index);
        config.names.push(NameEntry {
            name,
            kind,
            cost,
            default,
            fail_closed: false,
        });
        Ok(())
    }

    /// Makes a store failure refuse every request with a rule of `name` (`503`, gRPC
    /// `UNAVAILABLE`), whatever the layer's failure policy: a quota that must hold through an
    /// outage (a monthly plan) neither opens nor falls back to memory. YAML:
    /// `on_store_failure: fail_closed` on the limit.
    ///
    /// ```
    /// use tower_ratelimits::{CalendarQuota, Limits, Period};
    /// let limits = Limits::builder()
    ///     .limit("ApiCallsPerMonth", CalendarQuota::new(100_000, Period::Month).unwrap())
    ///     .fail_closed("ApiCallsPerMonth")
    ///     .build()
    ///     .unwrap();
    /// assert!(limits.fails_closed(limits.name("ApiCallsPerMonth").unwrap()));
    /// ```
    pub fn fail_closed(mut self, name: &str) -> Self {
        match self.limits.config.by_text.get(name).copied() {
            Some(i) => Arc::make_mut(&mut self.limits.config).names[i].fail_closed = true,
            None => self.fail(ConfigError::new(ConfigErrorKind::UnknownName(
                name.chars().take(80).collect(),
            ))),
        }
        self
    }

    /// Overrides `name`'s limit for one id, given as text and checked against the name's kind.
    pub fn override_for(mut self, name: &str, id: &str, limit: impl Into<Quota>) -> Self {
        if let Err(e) = self.try_override(name, id, Some(limit.into())) {
            self.fail(e.for_limit(name));
        }
        self
    }

    /// Makes `name` unlimited for one id (YAML: `unlimited: true` in an override entry): its
    /// requests are allowed without touching the store, like a limit with no default.
    pub fn unlimited_for(mut self, name: &str, id: &str) -> Self {
        if let Err(e) = self.try_override(name, id, None) {
            self.fail(e.for_limit(name));
        }
        self
    }

    /// An override: a limit, or `None` for unlimited.
    pub(crate) fn try_override(
        &mut self,
        name: &str,
        id: &str,
        limit: Option<Quota>,
    ) -> Result<(), ConfigError> {
        let index = *self
            .limits
            .config
            .by_text
            .get(name)
            .ok_or_else(|| ConfigError::new(ConfigErrorKind::UnknownName(name.to_owned())))?;
        let entry = &self.limits.config.names[index];
        if let Some(limit) = &limit
            && entry.cost > limit.max_cost()
        {
            return Err(ConfigError::new(ConfigErrorKind::CostAboveBurst {
                cost: entry.cost,
                burst: limit.max_cost(),
            }));
        }
        let parsed = entry.kind.parse(id).map_err(ConfigError::new)?;
        let key = BucketKey::new(entry.name, parsed);
        if self.limits.config.overrides.contains_key(&key)
            || self.limits.config.unlimited.contains(&key)
        {
            return Err(ConfigError::new(ConfigErrorKind::DuplicateId(
                id.to_owned(),
            )));
        }
        match limit {
            Some(limit) => {
                Arc::make_mut(&mut self.limits.config)
                    .overrides
                    .insert(key, limit);
            }
            None => {
                Arc::make_mut(&mut self.limits.config).unlimited.insert(key);
            }
        }
        Ok(())
    }

    /// The snapshot, or the first error met.
    pub fn build(self) -> Result<Limits, ConfigError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.limits),
        }
    }
}

/// What a reload changed, by limit name (in the new configuration's order; removed names in
/// the old one's). Its `Display` is one line for a log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimitsChange {
    /// Names the new configuration adds.
    pub added: Vec<String>,
    /// Names it removes.
    pub removed: Vec<String>,
    /// Names whose id kind, cost, default or overrides changed.
    pub changed: Vec<String>,
}

impl LimitsChange {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

impl std::fmt::Display for LimitsChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_empty() {
            return f.write_str("no limit changed");
        }
        let mut first = true;
        for (what, names) in [
            ("added", &self.added),
            ("removed", &self.removed),
            ("changed", &self.changed),
        ] {
            if names.is_empty() {
                continue;
            }
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            write!(f, "{what}: {}", names.join(", "))?;
        }
        Ok(())
    }
}

/// Where the limit in force for a bucket comes from ([`Limiter::inspect`](crate::Limiter::inspect)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LimitSource {
    /// The name's default limit (or none: the name is disabled for ids without an override).
    Default,
    /// An override for this id in the [`Limits`]: its overrides file, or
    /// [`LimitsBuilder::override_for`] in code. An `unlimited` override is one too.
    Override,
    /// An override kept in the store ([`Limiter::set_override`](crate::Limiter::set_override)),
    /// which wins over the other two.
    Store,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::gcra::Limit;
    use crate::algo::tiers::{Tier, TieredLimit};

    /// Without the feature `acme`, a file naming one of its kinds is refused at the kind's
    /// line, saying which feature brings it (not "unknown kind"). Run by `.ci/run`'s unit tests
    /// with the default features.
    #[cfg(all(feature = "yaml", not(feature = "acme")))]
    #[test]
    fn an_acme_kind_without_the_feature_names_it_at_its_line() {
        let e = Limits::from_yaml_str(
            "Certs:\n  kind: account_domain\n  burst: 1\n  count: 1\n  period: 1s\n",
            None,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "<defaults>:2: limit Certs: invalid id: id kind \"account_domain\" needs the `acme` \
             feature of tower-ratelimits"
        );
    }

    #[test]
    fn scaled_limits_keep_names_costs_and_shares() {
        let s = |secs| std::time::Duration::from_secs(secs);
        let limits = Limits::builder()
            .limit("Gcra", Limit::new(20, 20, s(1)).unwrap())
            .define(
                "Costly",
                IdKind::Any,
                5,
                Some(Limit::new(6, 6, s(1)).unwrap().into()),
            )
            .limit(
                "Tiered",
                TieredLimit::new([
                    Tier::new(5, s(1), s(1), s(0)),
                    Tier::new(50, s(5), s(5), s(15)),
                ])
                .unwrap(),
            )
            .override_for("Gcra", "vip", Limit::new(100, 100, s(1)).unwrap())
            .build()
            .unwrap();
        let half = limits.scaled(50).unwrap();
        let gcra = |l: &Limits, name: &str| {
            *l.default_limit(l.name(name).unwrap())
                .unwrap()
                .as_gcra()
                .unwrap()
        };
        // GCRA: half the burst, the same count over twice the period: half the rate, exactly.
        let g = gcra(&half, "Gcra");
        assert_eq!((g.burst(), g.count(), g.period_us()), (10, 20, 2_000_000));
        assert_eq!(g.emission_interval_us(), 100_000);
        // Never below a request's configured cost.
        assert_eq!(gcra(&half, "Costly").burst(), 5);
        // Tiers scale their limits.
        let t = half
            .default_limit(half.name("Tiered").unwrap())
            .unwrap()
            .as_tiered()
            .unwrap()
            .clone();
        assert_eq!(
            t.tiers().iter().map(Tier::limit).collect::<Vec<_>>(),
            [2, 25]
        );
        // Overrides scale too.
        let vip = BucketKey::new(half.name("Gcra").unwrap(), crate::Id::new("vip").unwrap());
        assert_eq!(half.resolve(&vip).unwrap().as_gcra().unwrap().burst(), 50);
        // So do stored overrides (the fallback follows them).
        let vip_store = crate::overrides::StoredOverride {
            limit: "Gcra".into(),
            id: "store-vip".into(),
            kind: crate::overrides::OverrideKind::Limit(Limit::new(80, 80, s(1)).unwrap()),
            expires_at_ms: None,
        };
        let with_stored = limits.with_stored(StoredSet::build(
            &limits,
            &[vip_store],
            Arc::new(crate::SystemClock),
        ));
        let half = with_stored.scaled(50).unwrap();
        let key = BucketKey::new(
            half.name("Gcra").unwrap(),
            crate::Id::new("store-vip").unwrap(),
        );
        assert_eq!(half.resolve(&key).unwrap().as_gcra().unwrap().burst(), 40);
        assert_eq!(half.stored_override_count(), 1);
        // 100% is the same limits.
        assert_eq!(
            gcra(&limits.scaled(100).unwrap(), "Gcra"),
            gcra(&limits, "Gcra")
        );
    }
}
