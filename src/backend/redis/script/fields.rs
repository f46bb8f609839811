//! Reading one key's answer of the script, field by field, by name.

use fred::prelude::Value;

use crate::backend::BackendError;

pub(super) fn bad(what: String) -> BackendError {
    BackendError::Unavailable(format!("unexpected script reply: {what}"))
}

/// Reads one key's list field by field, by name.
pub(super) struct Fields {
    pub(super) key: usize,
    pub(super) values: std::vec::IntoIter<Value>,
}

impl Fields {
    pub(super) fn next(&mut self, name: &str) -> Result<Value, BackendError> {
        self.values
            .next()
            .ok_or_else(|| bad(format!("key {}: no {name}", self.key + 1)))
    }

    pub(super) fn u64(&mut self, name: &str) -> Result<u64, BackendError> {
        let v = self.next(name)?;
        v.as_i64()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(format!("key {}: {name} is {v:?}", self.key + 1)))
    }

    pub(super) fn flag(&mut self, name: &str) -> Result<bool, BackendError> {
        match self.u64(name)? {
            0 => Ok(false),
            1 => Ok(true),
            n => Err(bad(format!("key {}: {name} is {n}", self.key + 1))),
        }
    }

    pub(super) fn end(mut self) -> Result<(), BackendError> {
        match self.values.next() {
            None => Ok(()),
            Some(v) => Err(bad(format!("key {}: an extra value {v:?}", self.key + 1))),
        }
    }
}
