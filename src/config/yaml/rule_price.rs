//! A rule's `price` in a rules file (`docs/streams.md`, "Money"): the model named by a request
//! header, and which of its prices the rule charges, from the file's `prices` table.

use super::node::{Node, Value, as_str, invalid, wrong_shape};
use crate::config::ConfigError;

/// Which of a model's prices a rule charges (`of:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RulePriceOf {
    /// `input`: the prompt's tokens.
    Input,
    /// `cached_input`: the prompt's cached tokens.
    CachedInput,
    /// `output`: the answer's tokens.
    Output,
}

/// `price: {model: 'header:<Name>', of: input | cached_input | output}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RulePrice {
    /// The header that names the request's model.
    pub(crate) model: http::HeaderName,
    pub(crate) of: RulePriceOf,
}

const WHAT: &str = "price: {model: 'header:<Name>', of: input | cached_input | output}";

/// A rule's `price` node.
pub(super) fn price_of(node: &Node) -> Result<RulePrice, ConfigError> {
    let Value::Map(fields) = &node.value else {
        return Err(wrong_shape(WHAT, node));
    };
    let (mut model, mut of) = (None, None);
    for (k, v) in fields {
        match as_str(k, "a field name")? {
            "model" => {
                let text = as_str(v, "the model's header (header:<Name>)")?;
                let name = text
                    .strip_prefix("header:")
                    .map(str::trim)
                    .and_then(|n| http::HeaderName::from_bytes(n.as_bytes()).ok())
                    .ok_or_else(|| {
                        invalid(
                            format!(
                                "model {text:?}: a request header names the model (header:<Name>)"
                            ),
                            v,
                        )
                    })?;
                model = Some(name);
            }
            "of" => {
                of = Some(match as_str(v, "input, cached_input or output")? {
                    "input" => RulePriceOf::Input,
                    "cached_input" => RulePriceOf::CachedInput,
                    "output" => RulePriceOf::Output,
                    other => {
                        return Err(invalid(
                            format!("of {other:?}: use input, cached_input or output"),
                            v,
                        ));
                    }
                });
            }
            _ => return Err(invalid(WHAT.into(), k)),
        }
    }
    match (model, of) {
        (Some(model), Some(of)) => Ok(RulePrice { model, of }),
        _ => Err(invalid(WHAT.into(), node)),
    }
}
