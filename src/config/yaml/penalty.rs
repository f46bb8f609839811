//! A limit's `penalty:` in YAML (`docs/penalties.md`): the ladder's fields, each checked on
//! its own line, and the ladder's bounds (`PenaltyError`) on the penalty's.
//!
//! ```yaml
//! LoginPerAccount:
//!   burst: 10
//!   count: 10
//!   period: 10m
//!   penalty: {after: 5, within: 10m, base: 1m, factor: 5, max: 1d, forget_after: 1d, jitter: 10%}
//! ```

use super::node::{Node, Value, err_at, wrong_shape};
use super::{ConfigError, ConfigErrorKind};
use crate::algo::penalty::Ladder;
use crate::quota::entry::{duration_of, fields_of, positive};

/// The fields of a penalty, in the order of [`Ladder`]'s.
const FIELDS: [&str; 7] = [
    "after",
    "within",
    "base",
    "factor",
    "max",
    "forget_after",
    "jitter",
];

/// The ladder a `penalty:` map describes: `after`, `within`, `base`, `factor` and `max` given,
/// `forget_after` (default: `within`) and `jitter` (a percentage with at most one decimal,
/// default 0%) if wanted.
pub(super) fn ladder_of(node: &Node) -> Result<Ladder, ConfigError> {
    let Value::Map(entries) = &node.value else {
        return Err(wrong_shape(
            "a map of penalty fields (after, within, base, factor, max)",
            node,
        ));
    };
    let [after, within, base, factor, max, forget, jitter] =
        fields_of(entries, &FIELDS, "a penalty field")?;
    let need = |field, name| need(field, name, node.line);
    let ladder = Ladder::new(
        positive("after", need(after, "after")?)?,
        duration_of("within", need(within, "within")?)?,
        duration_of("base", need(base, "base")?)?,
        positive("factor", need(factor, "factor")?)?,
        duration_of("max", need(max, "max")?)?,
    );
    let located = |e| err_at(ConfigErrorKind::Ladder(e), node.line);
    let mut ladder = ladder.map_err(located)?;
    if let Some(n) = forget {
        let us = duration_of("forget_after", n)?;
        ladder = ladder.forget_after(us).map_err(located)?;
    }
    if let Some(n) = jitter {
        ladder = ladder.jitter(permille(n)?).map_err(located)?;
    }
    Ok(ladder)
}

/// A field that must be given: missing, an error on the penalty's `line`.
fn need<'n>(
    field: Option<&'n Node>,
    name: &'static str,
    line: u64,
) -> Result<&'n Node, ConfigError> {
    field.ok_or_else(|| err_at(ConfigErrorKind::MissingField(name), line))
}

/// A percentage with at most one decimal (`10%`, `2.5%`), in thousandths.
fn permille(node: &Node) -> Result<u64, ConfigError> {
    let bad = || {
        let found = match &node.value {
            Value::Str(s) => format!("{:?}", s.chars().take(40).collect::<String>()),
            other => other.describe().to_owned(),
        };
        err_at(ConfigErrorKind::Jitter(found), node.line)
    };
    let Value::Str(text) = &node.value else {
        return Err(bad());
    };
    let number = text.trim().strip_suffix('%').ok_or_else(bad)?.trim_end();
    let (whole, tenths) = number.split_once('.').unwrap_or((number, "0"));
    let digits = |s: &str, most: usize| {
        !s.is_empty() && s.len() <= most && s.bytes().all(|b| b.is_ascii_digit())
    };
    if !digits(whole, 3) || !digits(tenths, 1) {
        return Err(bad());
    }
    let whole: u64 = whole.parse().map_err(|_| bad())?;
    let tenths: u64 = tenths.parse().map_err(|_| bad())?;
    Ok(whole * 10 + tenths)
}
