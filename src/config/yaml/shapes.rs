//! An entry's limit: its shape's own reader (`Quota::of_entry`,
//! each shape reading its fields in its own file), or, in an override, `unlimited: true`.

use super::node::{Fields, Value, err_at, wrong_shape};
use crate::config::{ConfigError, ConfigErrorKind};
use crate::quota::Quota;

/// What an override entry gives its ids: a limit, or `unlimited: true` (no limit at all, and
/// no limit field beside it).
pub(super) fn override_of(f: &Fields<'_>) -> Result<Option<Quota>, ConfigError> {
    let Some(node) = f.unlimited else {
        return quota_of(f).map(Some);
    };
    match node.value {
        Value::Bool(true) => {}
        Value::Bool(false) => {
            return Err(err_at(
                ConfigErrorKind::WrongShape {
                    expected: "true (to give the limit, write it instead)",
                    found: "false",
                },
                node.line,
            ));
        }
        _ => return Err(wrong_shape("true", node)),
    }
    if let Some((name, n)) = f.limit.given().next() {
        return Err(err_at(
            ConfigErrorKind::ConflictingFields("unlimited", name),
            n.line,
        ));
    }
    Ok(None)
}

/// The limit an entry's fields make.
pub(super) fn quota_of(f: &Fields<'_>) -> Result<Quota, ConfigError> {
    Ok(Quota::of_entry(&f.limit)?)
}
