//! The YAML tree a configuration is read into (each node with its line), parsed under a
//! budget, and the checks every field shares: shapes, numbers, the fields of one entry.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use super::MAX_FILE_BYTES;
use crate::config::{ConfigError, ConfigErrorKind};

#[derive(Debug)]
pub(super) struct Node {
    pub(super) line: u64,
    /// Where the node's text is in the source (byte offset and length), when known.
    pub(super) span: Option<(usize, usize)>,
    pub(super) value: Value,
}

#[derive(Debug)]
pub(super) enum Value {
    Null,
    Bool(bool),
    Int(i128),
    Float,
    /// A number YAML reads but that is not written in plain decimal (`1_000`, `0x10`, `+5`,
    /// `017`): refused, since what it means depends on the YAML version.
    Unplain(String),
    /// A whole number too large for 64 bits.
    Big(String),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Value {
    pub(super) fn describe(&self) -> &'static str {
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

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let spanned: Spanned<Value> = Spanned::deserialize(d)?;
        let span = spanned.referenced.span();
        Ok(Node {
            line: spanned.referenced.line(),
            span: span
                .byte_offset()
                .zip(span.byte_len())
                .and_then(|(o, l)| Some((usize::try_from(o).ok()?, usize::try_from(l).ok()?))),
            value: spanned.value,
        })
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

pub(super) struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a YAML value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(v.into()))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Value, E> {
        Ok(Value::Int(i128::try_from(v).unwrap_or(i128::MAX)))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Value, E> {
        Ok(Value::Float)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(n) = seq.next_element::<Node>()? {
            items.push(n);
        }
        Ok(Value::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some((k, v)) = map.next_entry::<Node, Node>()? {
            items.push((k, v));
        }
        Ok(Value::Map(items))
    }
}

pub(super) fn err_at(kind: ConfigErrorKind, line: u64) -> ConfigError {
    ConfigError::new(kind).at_line(line)
}

/// The most anchors (`&name`) a limits file may define.
pub(crate) const MAX_ANCHORS: usize = 256;
/// The most aliases (`*name`) a limits file may use.
pub(crate) const MAX_ALIASES: usize = 1_024;

pub(super) fn parse(text: &str) -> Result<Option<Node>, ConfigError> {
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::new(ConfigErrorKind::TooLarge {
            bytes: text.len() as u64,
            max: MAX_FILE_BYTES,
        }));
    }
    let meaningful = text.lines().any(|l| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#') && t != "---" && t != "..."
    });
    if !meaningful {
        return Ok(None);
    }
    let mut options = serde_saphyr::Options::default();
    if let Some(budget) = options.budget.as_mut() {
        budget.max_depth = 16;
        budget.max_nodes = 1_000_000;
        // Anchors and aliases share settings between limits (`B: *a`, `<<: *a`): a bounded
        // number, and what they may copy is bounded too (a "billion laughs" stops here).
        budget.max_aliases = MAX_ALIASES;
        budget.max_anchors = MAX_ANCHORS;
        budget.max_recorded_anchor_events = 100_000;
        budget.max_recorded_anchor_bytes = 1 << 20;
        budget.max_documents = 1;
    }
    options.with_snippet = false;
    // `!tags` the loader does not know are errors, not silently dropped.
    options.reject_unsupported_tags = true;
    match serde_saphyr::from_str_with_options::<Node>(text, options) {
        Ok(mut n) => {
            plain_numbers(&mut n, text);
            Ok(Some(n))
        }
        Err(e) => {
            let line = e.location().map_or(0, |l| l.line());
            let message = e.to_string();
            let mut first = message.lines().next().unwrap_or("").to_owned();
            if first.contains("budget breached") {
                first.push_str(&format!(
                    " (a limits file holds at most {MAX_ANCHORS} anchors, {MAX_ALIASES} aliases, \
                     1,000,000 values and 16 levels)"
                ));
            }
            Err(err_at(ConfigErrorKind::Yaml(first), line))
        }
    }
}

/// Reads numbers from their source text: YAML also reads `1_000`, `0x10`, `0o17`, `+5` (and,
/// in YAML 1.1, `017` as octal) as numbers, and a whole number beyond 64 bits as a decimal
/// one. Only plain decimal digits are numbers here; the others get a precise error.
pub(super) fn plain_numbers(node: &mut Node, text: &str) {
    match &mut node.value {
        Value::Int(_) | Value::Float => {
            let Some(raw) = node.span.and_then(|(o, l)| text.get(o..o.checked_add(l)?)) else {
                return;
            };
            let raw = raw.trim();
            // A copy an alias made (its span is the alias, `*name`): the anchored original
            // was read from its own text where it stands.
            if raw.starts_with('*') {
                return;
            }
            let digits = raw.strip_prefix('-').unwrap_or(raw);
            let all_digits = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
            let plain = all_digits && (digits == "0" || !digits.starts_with('0'));
            match (&node.value, plain, all_digits) {
                (Value::Float, true, _) => node.value = Value::Big(raw.to_owned()),
                (Value::Int(_), false, _) | (Value::Float, false, true) => {
                    node.value = Value::Unplain(raw.to_owned());
                }
                _ => {}
            }
        }
        Value::Seq(items) => items.iter_mut().for_each(|n| plain_numbers(n, text)),
        Value::Map(items) => items.iter_mut().for_each(|(k, v)| {
            plain_numbers(k, text);
            plain_numbers(v, text);
        }),
        _ => {}
    }
}

pub(super) fn wrong_shape(expected: &'static str, node: &Node) -> ConfigError {
    err_at(
        ConfigErrorKind::WrongShape {
            expected,
            found: node.value.describe(),
        },
        node.line,
    )
}

pub(super) fn as_str<'a>(node: &'a Node, expected: &'static str) -> Result<&'a str, ConfigError> {
    match &node.value {
        Value::Str(s) => Ok(s),
        _ => Err(wrong_shape(expected, node)),
    }
}

pub(super) fn positive(field: &'static str, node: &Node) -> Result<u64, ConfigError> {
    whole(field, node, 1)
}

/// A whole number of at least `least` (0 or 1), in plain decimal digits, that fits 64 bits.
pub(super) fn whole(field: &'static str, node: &Node, least: i128) -> Result<u64, ConfigError> {
    let bad = |found: String| {
        let kind = if least == 0 {
            ConfigErrorKind::BadCount { field, found }
        } else {
            ConfigErrorKind::BadNumber { field, found }
        };
        err_at(kind, node.line)
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

/// The fields of one limit entry (defaults or overrides), each with its line.
#[derive(Default)]
pub(super) struct Fields<'a> {
    pub(super) line: u64,
    pub(super) burst: Option<&'a Node>,
    pub(super) count: Option<&'a Node>,
    pub(super) period: Option<&'a Node>,
    pub(super) max_debt: Option<&'a Node>,
    pub(super) prefetch: Option<&'a Node>,
    pub(super) prefetch_ttl: Option<&'a Node>,
    pub(super) tiers: Option<&'a Node>,
    pub(super) concurrency: Option<&'a Node>,
    pub(super) calendar: Option<&'a Node>,
    pub(super) lease: Option<&'a Node>,
    pub(super) retry_after: Option<&'a Node>,
    pub(super) fair_share: Option<&'a Node>,
    pub(super) kind: Option<&'a Node>,
    pub(super) cost: Option<&'a Node>,
    pub(super) on_store_failure: Option<&'a Node>,
    pub(super) across_regions: Option<&'a Node>,
    pub(super) region_floor: Option<&'a Node>,
    pub(super) ids: Option<&'a Node>,
    pub(super) unlimited: Option<&'a Node>,
    pub(super) comment: Option<&'a Node>,
}

/// Every limit's fields, in a default and in an override alike: each shape's own, and the GCRA
/// limit's options (the one table: a new shape's fields join it here).
const LIMIT_FIELDS: [&str; 12] = [
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

/// The fields of one entry: a limit's ([`LIMIT_FIELDS`]) and the entry's own (`entry`: a
/// default's `kind` and `cost`, an override's `ids` or `unlimited`, ...).
pub(super) fn fields<'a>(
    node: &'a Node,
    entry: &[&'static str],
) -> Result<Fields<'a>, ConfigError> {
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape("a map of limit fields", node));
    };
    let mut f = Fields {
        line: node.line,
        ..Fields::default()
    };
    for (k, v) in entries {
        let key = as_str(k, "a field name")?;
        if !LIMIT_FIELDS.contains(&key) && !entry.contains(&key) {
            let allowed = [&LIMIT_FIELDS[..], entry].concat();
            return Err(err_at(
                ConfigErrorKind::unknown_field(key, &allowed),
                k.line,
            ));
        }
        let slot = match key {
            "burst" => &mut f.burst,
            "count" => &mut f.count,
            "period" => &mut f.period,
            "max_debt" => &mut f.max_debt,
            "prefetch" => &mut f.prefetch,
            "prefetch_ttl" => &mut f.prefetch_ttl,
            "tiers" => &mut f.tiers,
            "concurrency" => &mut f.concurrency,
            "calendar" => &mut f.calendar,
            "lease" => &mut f.lease,
            "retry_after" => &mut f.retry_after,
            "fair_share" => &mut f.fair_share,
            "kind" => &mut f.kind,
            "cost" => &mut f.cost,
            "on_store_failure" => &mut f.on_store_failure,
            "across_regions" => &mut f.across_regions,
            "region_floor" => &mut f.region_floor,
            "ids" => &mut f.ids,
            "unlimited" => &mut f.unlimited,
            _ => &mut f.comment,
        };
        if slot.replace(v).is_some() {
            return Err(err_at(
                ConfigErrorKind::DuplicateField(key.to_owned()),
                k.line,
            ));
        }
    }
    Ok(f)
}

pub(super) fn need<'a>(
    f: &Fields<'a>,
    field: &'static str,
    n: Option<&'a Node>,
) -> Result<&'a Node, ConfigError> {
    n.ok_or_else(|| err_at(ConfigErrorKind::MissingField(field), f.line))
}
