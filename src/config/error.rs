//! What a configuration error says: the kind (`ConfigErrorKind`, with a did-you-mean for an
//! unknown field), and where it was found (`Location`: file, line, limit).

use std::fmt;

use crate::key::IdError;
use crate::quota::ShapeError;
#[cfg(any(feature = "yaml", feature = "admin"))]
use crate::quota::entry::{FieldError, Problem};
use crate::time::DurationError;

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
    /// A rule of a rules file ([`RuleSet`](crate::RuleSet)) that cannot be built: an unknown
    /// key, a header or method that does not parse, a limit with two rules.
    #[error("invalid rule: {0}")]
    InvalidRule(String),
    /// A price table ([`PriceTable`](crate::PriceTable), feature `stream`) that cannot be
    /// read: a price that is not a whole number of micro-units, a model without its input or
    /// output price, a model named twice.
    #[error("invalid price table: {0}")]
    InvalidPrice(String),
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
    /// A limit's fields that do not make a limit of its shape: the shape's own error, one
    /// variant per shape (its text names the shape: `invalid limit: ...`, `invalid calendar
    /// quota: ...`).
    #[error("{0}")]
    Shape(ShapeError),
    /// An override that changes what its limit's ids share (a fair share's budget).
    #[error("an override must keep {0}")]
    OverrideMustKeep(&'static str),
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
        "{0} and {1} cannot be given together: a limit is GCRA (burst, count, period), tiered (tiers), a concurrency limit (concurrency, lease, retry_after; concurrency: {{adaptive: ...}} for one that finds its number), a calendar quota (calendar) or a fair share (a GCRA budget with fair_share)"
    )]
    ConflictingFields(&'static str, &'static str),
    /// A field of the other adaptive algorithm (`smoothing` under `algorithm: aimd`).
    #[error("{}", other_algorithm(field, algorithm))]
    OtherAlgorithm {
        /// The field.
        field: &'static str,
        /// The algorithm the limit names (`gradient` or `aimd`).
        algorithm: &'static str,
    },
    /// A limit marked `across_regions` (or an override of one) that cannot be one limit
    /// across regions: only a GCRA limit without prefetched tokens can (`docs/regions.md`).
    #[error(
        "across_regions needs a GCRA limit (burst, count, period) without prefetch; this one has {0}"
    )]
    AcrossRegions(&'static str),
    /// A penalty ladder where none can be: on a limit marked `across_regions` (how a ban
    /// crosses regions is not specified yet), or one that does not count units.
    #[error("a penalty {0}")]
    Penalty(&'static str),
    /// A penalty ladder's fields that do not make a ladder (`after` of 0, `max` below
    /// `base`, a factor above 1,000, ...).
    #[error("invalid penalty: {0}")]
    Ladder(crate::algo::penalty::PenaltyError),
    /// A penalty's `jitter` that is not a percentage with at most one decimal.
    #[error(
        "jitter must be a percentage from 0% to 100% with at most one decimal (e.g. 10% or 2.5%), found {0}"
    )]
    Jitter(String),
    /// A `region_floor` that is not a percentage from 0% to 100% with at most two decimals, or
    /// one given to a limit not marked `across_regions`.
    #[error(
        "region_floor must be a percentage from 0% to 100% (at most two decimals, e.g. 10% or 2.5%) on a limit with across_regions: true, found {0}"
    )]
    RegionFloor(String),
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
    /// Boxed: with a shape's error in the kind, the error stays under 128 bytes.
    limit: Option<Box<str>>,
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
            .get_or_insert_with(|| name.chars().take(80).collect::<String>().into());
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

#[cfg(any(feature = "yaml", feature = "admin"))]
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

/// The message of [`ConfigErrorKind::OtherAlgorithm`]: whose field it is, and what the named
/// algorithm takes.
fn other_algorithm(field: &str, algorithm: &str) -> String {
    let (other, takes) = if algorithm == "aimd" {
        ("gradient", "backoff and increase")
    } else {
        ("aimd", "smoothing and tolerance")
    };
    format!(
        "{field} is a field of algorithm: {other}; algorithm: {algorithm} takes {takes} (or write \
         algorithm: {other})"
    )
}

/// `; did you mean `x`?` after an unknown field's message, when there is a suggestion.
fn suggestion_text(suggestion: &Option<&'static str>) -> String {
    suggestion.map_or_else(String::new, |s| format!("; did you mean `{s}`?"))
}

/// The edit distance between `a` and `b` (optimal string alignment: insertions, deletions,
/// substitutions, and swaps of two neighbours), or `most + 1` when their lengths alone say it
/// is larger or either is longer than 64 characters (no known field is): a hostile field name
/// of any length costs one count of its characters per known field.
pub(crate) fn edit_distance(a: &str, b: &str, most: usize) -> usize {
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

/// A shape's own error (and [`ShapeError`] itself) is a configuration error of the one kind,
/// so that a new shape's error needs nothing here.
impl<E> From<E> for ConfigErrorKind
where
    ShapeError: From<E>,
{
    fn from(e: E) -> Self {
        ConfigErrorKind::Shape(ShapeError::from(e))
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

/// A field's error, located (a JSON body's has no line): the configuration error of the same
/// name.
#[cfg(any(feature = "yaml", feature = "admin"))]
impl From<FieldError> for ConfigError {
    fn from(e: FieldError) -> Self {
        let kind = match e.problem {
            Problem::WrongShape { expected, found } => {
                ConfigErrorKind::WrongShape { expected, found }
            }
            Problem::UnknownField { field, known } => ConfigErrorKind::unknown_field(&field, known),
            Problem::MissingField(field) => ConfigErrorKind::MissingField(field),
            Problem::DuplicateField(field) => ConfigErrorKind::DuplicateField(field),
            Problem::BadNumber { field, found } => ConfigErrorKind::BadNumber { field, found },
            Problem::BadCount { field, found } => ConfigErrorKind::BadCount { field, found },
            Problem::ConflictingFields(a, b) => ConfigErrorKind::ConflictingFields(a, b),
            Problem::InvalidTier {
                tier,
                field,
                reason,
            } => ConfigErrorKind::InvalidTier {
                tier,
                field,
                reason,
            },
            Problem::OtherAlgorithm { field, algorithm } => {
                ConfigErrorKind::OtherAlgorithm { field, algorithm }
            }
            Problem::InvalidPeriod(_, e) => ConfigErrorKind::InvalidPeriod(e),
            Problem::Shape(e) => ConfigErrorKind::Shape(e),
        };
        ConfigError::new(kind).at_line(e.line)
    }
}
