//! The YAML tree a configuration is read into (each node with its line), parsed under a
//! budget, and the checks every field shares: shapes, numbers, the fields of one entry.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use super::MAX_FILE_BYTES;
use crate::config::{ConfigError, ConfigErrorKind};
use crate::quota::entry::{self, Entry, LIMIT_FIELDS};
pub(super) use crate::quota::entry::{Node, Value};

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

/// A field given twice in a rules file's map.
pub(super) fn duplicate(field: &str, at: &Node) -> ConfigError {
    err_at(ConfigErrorKind::DuplicateField(field.to_owned()), at.line)
}

/// A rules file's value that is not what its field takes.
pub(super) fn invalid(message: String, at: &Node) -> ConfigError {
    err_at(ConfigErrorKind::InvalidRule(message), at.line)
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

/// The checks every field shares (`quota::entry`'s), for the configuration's own fields.
pub(super) fn wrong_shape(expected: &'static str, node: &Node) -> ConfigError {
    entry::wrong_shape(expected, node).into()
}

pub(super) fn as_str<'a>(node: &'a Node, expected: &'static str) -> Result<&'a str, ConfigError> {
    Ok(entry::as_str(node, expected)?)
}

pub(super) fn positive(field: &'static str, node: &Node) -> Result<u64, ConfigError> {
    Ok(entry::positive(field, node)?)
}

/// The fields of one entry (a default or an override), each with its line: the limit's
/// ([`Entry`], each shape's own) and the entry's own.
#[derive(Default)]
pub(super) struct Fields<'a> {
    pub(super) line: u64,
    pub(super) limit: Entry<'a>,
    pub(super) kind: Option<&'a Node>,
    pub(super) cost: Option<&'a Node>,
    pub(super) on_store_failure: Option<&'a Node>,
    pub(super) across_regions: Option<&'a Node>,
    pub(super) region_floor: Option<&'a Node>,
    pub(super) penalty: Option<&'a Node>,
    pub(super) ids: Option<&'a Node>,
    pub(super) unlimited: Option<&'a Node>,
    pub(super) comment: Option<&'a Node>,
}

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
        limit: Entry {
            line: node.line,
            ..Entry::default()
        },
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
            "kind" => &mut f.kind,
            "cost" => &mut f.cost,
            "on_store_failure" => &mut f.on_store_failure,
            "across_regions" => &mut f.across_regions,
            "region_floor" => &mut f.region_floor,
            "penalty" => &mut f.penalty,
            "ids" => &mut f.ids,
            "unlimited" => &mut f.unlimited,
            "comment" => &mut f.comment,
            limit_field => match f.limit.slot(limit_field) {
                Some(slot) => slot,
                None => &mut f.comment,
            },
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
