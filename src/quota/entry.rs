//! A limit's entry as a tree of fields, each node with the line it was written on (feature
//! `yaml`): the one schema every shape reads its own fields from (`read_entry` in its file,
//! driven by `Quota::of_entry`), the checks every field shares, and what a field can get
//! wrong ([`FieldError`], which the configuration turns into a located `ConfigError`).

#[cfg(any(test, feature = "admin"))]
use super::Quota;
use super::ShapeError;
use crate::time::{DurationError, parse_duration_us};

/// A value with the line it was written on (0: none known).
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) line: u64,
    /// Where the node's text is in the source (byte offset and length), when known (a YAML
    /// file's numbers are read from it again).
    #[cfg_attr(not(feature = "yaml"), expect(dead_code))]
    pub(crate) span: Option<(usize, usize)>,
    pub(crate) value: Value,
}

#[derive(Debug)]
pub(crate) enum Value {
    Null,
    Bool(#[cfg_attr(not(feature = "yaml"), expect(dead_code))] bool),
    Int(i128),
    Float,
    /// A number YAML reads but that is not written in plain decimal (`1_000`, `0x10`, `+5`,
    /// `017`): refused, since what it means depends on the YAML version.
    #[cfg_attr(not(feature = "yaml"), expect(dead_code))]
    Unplain(String),
    /// A whole number too large for 64 bits (YAML's; JSON's is a decimal number).
    #[cfg_attr(not(feature = "yaml"), expect(dead_code))]
    Big(String),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Value {
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            Value::Null => "nothing",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "a number",
            Value::Float => "a decimal number",
            Value::Unplain(_) => "a number not in plain decimal",
            Value::Big(_) => "a number too large",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a map",
        }
    }
}

/// What a field got wrong, on the line of the node that has it.
#[derive(Debug)]
pub(crate) struct FieldError {
    pub(crate) problem: Problem,
    pub(crate) line: u64,
}

/// What a field can get wrong: each is the configuration error of the same name
/// (`ConfigErrorKind`), which says it.
#[derive(Debug)]
pub(crate) enum Problem {
    WrongShape {
        expected: &'static str,
        found: &'static str,
    },
    UnknownField {
        field: String,
        known: &'static [&'static str],
    },
    MissingField(&'static str),
    DuplicateField(String),
    BadNumber {
        field: &'static str,
        found: String,
    },
    BadCount {
        field: &'static str,
        found: String,
    },
    ConflictingFields(&'static str, &'static str),
    InvalidTier {
        tier: usize,
        field: &'static str,
        reason: String,
    },
    OtherAlgorithm {
        field: &'static str,
        algorithm: &'static str,
    },
    /// A duration that does not parse, and its field (`period`, `lease`, ...).
    InvalidPeriod(
        #[cfg_attr(not(feature = "admin"), expect(dead_code))] &'static str,
        DurationError,
    ),
    Shape(ShapeError),
}

#[cfg(feature = "admin")]
impl FieldError {
    /// The field a duration's error is about, which its text does not say (a file's line
    /// does; a JSON body has none, and says the field before the text).
    pub(crate) fn unnamed_field(&self) -> Option<&'static str> {
        match self.problem {
            Problem::InvalidPeriod(field, _) => Some(field),
            _ => None,
        }
    }
}

/// `problem` on `line`.
pub(crate) fn at(problem: Problem, line: u64) -> FieldError {
    FieldError { problem, line }
}

/// A shape's own error (its constructor's), on `line`.
pub(crate) fn shape_at(e: impl Into<ShapeError>, line: u64) -> FieldError {
    at(Problem::Shape(e.into()), line)
}

pub(crate) fn wrong_shape(expected: &'static str, node: &Node) -> FieldError {
    at(
        Problem::WrongShape {
            expected,
            found: node.value.describe(),
        },
        node.line,
    )
}

pub(crate) fn as_str<'a>(node: &'a Node, expected: &'static str) -> Result<&'a str, FieldError> {
    match &node.value {
        Value::Str(s) => Ok(s),
        _ => Err(wrong_shape(expected, node)),
    }
}

pub(crate) fn positive(field: &'static str, node: &Node) -> Result<u64, FieldError> {
    whole(field, node, 1)
}

/// A whole number of at least `least` (0 or 1), in plain decimal digits, that fits 64 bits.
pub(crate) fn whole(field: &'static str, node: &Node, least: i128) -> Result<u64, FieldError> {
    let bad = |found: String| {
        let problem = if least == 0 {
            Problem::BadCount { field, found }
        } else {
            Problem::BadNumber { field, found }
        };
        at(problem, node.line)
    };
    let too_large =
        |v: &dyn std::fmt::Display| bad(format!("{v}, which is larger than {}", u64::MAX));
    match &node.value {
        Value::Int(v) if *v >= least => u64::try_from(*v).map_err(|_| too_large(v)),
        Value::Int(v) => Err(bad(v.to_string())),
        Value::Big(s) => Err(too_large(s)),
        Value::Unplain(s) => Err(bad(format!("{s:?} (write plain decimal digits)"))),
        Value::Str(s) => Err(bad(format!("{s:?}"))),
        other => Err(bad(other.describe().to_owned())),
    }
}

/// A duration field (`period`, `lease`, `retry_after`, ...), in microseconds.
pub(crate) fn duration_of(field: &'static str, node: &Node) -> Result<u64, FieldError> {
    let Value::Str(text) = &node.value else {
        return Err(at(
            Problem::BadNumber {
                field,
                found: format!(
                    "{} (write a duration such as 1s or 180m)",
                    node.value.describe()
                ),
            },
            node.line,
        ));
    };
    parse_duration_us(text).map_err(|e| at(Problem::InvalidPeriod(field, e), node.line))
}

/// The fields of a map, each once, in the order of `known` (an unknown field, or one given
/// twice, refused on its line; `key` names what a field's name must be, for the error).
pub(crate) fn fields_of<'a, const N: usize>(
    entries: impl IntoIterator<Item = &'a (Node, Node)>,
    known: &'static [&'static str; N],
    key: &'static str,
) -> Result<[Option<&'a Node>; N], FieldError> {
    let mut found: [Option<&Node>; N] = [None; N];
    for (k, v) in entries {
        let name = as_str(k, key)?;
        let Some(i) = known.iter().position(|n| *n == name) else {
            return Err(at(
                Problem::UnknownField {
                    field: name.to_owned(),
                    known,
                },
                k.line,
            ));
        };
        if found[i].replace(v).is_some() {
            return Err(at(Problem::DuplicateField(name.to_owned()), k.line));
        }
    }
    Ok(found)
}

/// Every limit's fields, in a default and in an override alike: each shape's own, and the GCRA
/// limit's options (the one table: a new shape's fields join it here, and its slot in
/// [`Entry`]).
pub(crate) const LIMIT_FIELDS: [&str; 12] = [
    "burst",
    "count",
    "period",
    "max_debt",
    "prefetch",
    "prefetch_ttl",
    "tiers",
    "concurrency",
    "calendar",
    "lease",
    "retry_after",
    "fair_share",
];

/// The limit's fields of one entry (a default or an override), each with its line.
#[derive(Default)]
pub(crate) struct Entry<'a> {
    /// The entry's own line (a missing field's).
    pub(crate) line: u64,
    pub(crate) burst: Option<&'a Node>,
    pub(crate) count: Option<&'a Node>,
    pub(crate) period: Option<&'a Node>,
    pub(crate) max_debt: Option<&'a Node>,
    pub(crate) prefetch: Option<&'a Node>,
    pub(crate) prefetch_ttl: Option<&'a Node>,
    pub(crate) tiers: Option<&'a Node>,
    pub(crate) concurrency: Option<&'a Node>,
    pub(crate) calendar: Option<&'a Node>,
    pub(crate) lease: Option<&'a Node>,
    pub(crate) retry_after: Option<&'a Node>,
    pub(crate) fair_share: Option<&'a Node>,
}

impl<'a> Entry<'a> {
    /// The slot of limit field `name` (one of [`LIMIT_FIELDS`]), or `None` for another field.
    pub(crate) fn slot(&mut self, name: &str) -> Option<&mut Option<&'a Node>> {
        Some(match name {
            "burst" => &mut self.burst,
            "count" => &mut self.count,
            "period" => &mut self.period,
            "max_debt" => &mut self.max_debt,
            "prefetch" => &mut self.prefetch,
            "prefetch_ttl" => &mut self.prefetch_ttl,
            "tiers" => &mut self.tiers,
            "concurrency" => &mut self.concurrency,
            "calendar" => &mut self.calendar,
            "lease" => &mut self.lease,
            "retry_after" => &mut self.retry_after,
            "fair_share" => &mut self.fair_share,
            _ => return None,
        })
    }

    /// The limit fields given, by name, in [`LIMIT_FIELDS`]' order.
    #[cfg(feature = "yaml")]
    pub(crate) fn given(&self) -> impl Iterator<Item = (&'static str, &'a Node)> + '_ {
        let slots = [
            self.burst,
            self.count,
            self.period,
            self.max_debt,
            self.prefetch,
            self.prefetch_ttl,
            self.tiers,
            self.concurrency,
            self.calendar,
            self.lease,
            self.retry_after,
            self.fair_share,
        ];
        LIMIT_FIELDS
            .into_iter()
            .zip(slots)
            .filter_map(|(name, node)| Some((name, node?)))
    }

    /// Field `field`'s node (`n`), or its absence refused on the entry's line.
    pub(crate) fn need(
        &self,
        field: &'static str,
        n: Option<&'a Node>,
    ) -> Result<&'a Node, FieldError> {
        n.ok_or_else(|| at(Problem::MissingField(field), self.line))
    }

    /// The first field of a rate limit (GCRA or tiers) the entry gives, if any.
    pub(crate) fn rate_field(&self) -> Option<(&'static str, &'a Node)> {
        [
            ("burst", self.burst),
            ("count", self.count),
            ("period", self.period),
            ("tiers", self.tiers),
        ]
        .into_iter()
        .find_map(|(name, node)| Some((name, node?)))
    }
}

/// A JSON value as an entry's tree: the admin API's body, whose fields are the file's (no
/// line: every node's is 0).
#[cfg(any(test, feature = "admin"))]
pub(crate) fn node_of_json(v: &serde_json::Value) -> Node {
    use serde_json::Value as Json;
    let value = match v {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Value::Int(u.into()),
            (None, Some(i)) => Value::Int(i.into()),
            (None, None) => Value::Float,
        },
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(items) => Value::Seq(items.iter().map(node_of_json).collect()),
        Json::Object(map) => Value::Map(
            map.iter()
                .map(|(k, v)| (node_of_json(&Json::String(k.clone())), node_of_json(v)))
                .collect(),
        ),
    };
    Node {
        line: 0,
        span: None,
        value,
    }
}

/// A limit written as the file writes it, in a JSON body (`fields`: the body's limit fields,
/// each shape's own): read by the same readers as the file's entries, with the same errors.
#[cfg(any(test, feature = "admin"))]
pub(crate) fn read_api(fields: &serde_json::Value) -> Result<Quota, FieldError> {
    let node = node_of_json(fields);
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape("a map of limit fields", &node));
    };
    let mut entry = Entry::default();
    for (k, v) in entries {
        let name = as_str(k, "a field name")?;
        // A GCRA limit's debt and prefetched tokens are the file's options: a stored override
        // keeps a limit's rate and burst only (taking them would lose them at the next read).
        let not_kept = ["max_debt", "prefetch", "prefetch_ttl"].contains(&name);
        let Some(slot) = entry.slot(name).filter(|_| !not_kept) else {
            return Err(at(
                Problem::UnknownField {
                    field: name.to_owned(),
                    known: if not_kept { &[] } else { &LIMIT_FIELDS },
                },
                0,
            ));
        };
        *slot = Some(v);
    }
    Quota::of_entry(&entry)
}
