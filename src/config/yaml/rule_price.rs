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

/// Where a rule reads the request's model (`model:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RuleModel {
    /// `header:<Name>`.
    Header(http::HeaderName),
    /// `body:<field>`: a top-level field of the request's JSON body.
    Body(String),
}

/// `price: {model: 'header:<Name>' | 'body:<field>', of: input | cached_input | output}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RulePrice {
    pub(crate) model: RuleModel,
    pub(crate) of: RulePriceOf,
}

const WHAT: &str =
    "price: {model: 'header:<Name>' or 'body:<field>', of: input | cached_input | output}";

/// A rule's `price` node.
pub(super) fn price_of(node: &Node) -> Result<RulePrice, ConfigError> {
    let Value::Map(fields) = &node.value else {
        return Err(wrong_shape(WHAT, node));
    };
    let (mut model, mut of) = (None, None);
    for (k, v) in fields {
        match as_str(k, "a field name")? {
            "model" => model = Some(model_of(v)?),
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

/// `model: 'header:<Name>' | 'body:<field>'`.
fn model_of(node: &Node) -> Result<RuleModel, ConfigError> {
    let text = as_str(node, "where the model is (header:<Name>, body:<field>)")?;
    if let Some(header) = text.strip_prefix("header:")
        && let Ok(name) = http::HeaderName::from_bytes(header.trim().as_bytes())
    {
        return Ok(RuleModel::Header(name));
    }
    match text.strip_prefix("body:").map(str::trim) {
        Some(field) if !field.is_empty() => Ok(RuleModel::Body(field.to_owned())),
        _ => Err(invalid(
            format!(
                "model {text:?}: a request header (header:<Name>) or a field of its JSON body (body:<field>) names the model"
            ),
            node,
        )),
    }
}
