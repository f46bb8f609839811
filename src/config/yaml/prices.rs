//! A price table's YAML ([`PriceTable`], `docs/streams.md`, "Money"): micro-units of money per
//! `per_tokens` tokens, per model.

use std::path::Path;

use super::node::{Node, Value, as_str, err_at, parse, wrong_shape};
use super::read;
use crate::config::price::{ModelPrice, PriceTable, UnitPrice};
use crate::config::{ConfigError, ConfigErrorKind};

const FILE_FIELDS: &[&str] = &["per_tokens", "models"];
const MODEL_FIELDS: &[&str] = &["input", "cached_input", "output"];

fn refused(message: String, at: &Node) -> ConfigError {
    err_at(ConfigErrorKind::InvalidPrice(message), at.line)
}

impl PriceTable {
    /// Reads a price table's text. Errors name the line.
    pub fn from_yaml_str(text: &str) -> Result<PriceTable, ConfigError> {
        let root = parse(text)?.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty))?;
        table_of(&root)
    }

    /// Reads a price table file. Errors name the file and the line.
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<PriceTable, ConfigError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = read(path).map_err(|e| e.in_source(&name))?;
        Self::from_yaml_str(&text).map_err(|e| e.in_source(&name))
    }
}

/// A price table's node (a file's root, or a rules file's `prices:`).
pub(super) fn table_of(root: &Node) -> Result<PriceTable, ConfigError> {
    let Value::Map(fields) = &root.value else {
        return Err(wrong_shape("a map with `models:`", root));
    };
    let (mut per_tokens, mut models) = (1_000_000, None);
    for (k, v) in fields {
        match as_str(k, "a field name")? {
            "per_tokens" => per_tokens = tokens(v)?,
            "models" => models = Some(v),
            other => {
                return Err(err_at(
                    ConfigErrorKind::unknown_field(other, FILE_FIELDS),
                    k.line,
                ));
            }
        }
    }
    let models =
        models.ok_or_else(|| err_at(ConfigErrorKind::MissingField("models"), root.line))?;
    let Value::Map(entries) = &models.value else {
        return Err(wrong_shape("a map of models to their prices", models));
    };
    let mut table = PriceTable::default();
    for (name, prices) in entries {
        let name_text = as_str(name, "a model's name")?;
        let price = model(prices, per_tokens)?;
        if table.models.insert(name_text.to_owned(), price).is_some() {
            return Err(refused(
                format!("model {name_text:?} is priced twice"),
                name,
            ));
        }
    }
    Ok(table)
}

/// A whole number of micro-units (0 or more).
fn whole(field: &str, node: &Node) -> Result<u64, ConfigError> {
    match node.value {
        Value::Int(n) if let Ok(n) = u64::try_from(n) => Ok(n),
        _ => Err(refused(
            format!("{field}: a whole number of micro-units (0 or more)"),
            node,
        )),
    }
}

/// `per_tokens`: how many tokens a price is for (1 or more: a price per 0 tokens means nothing).
fn tokens(node: &Node) -> Result<u64, ConfigError> {
    match node.value {
        Value::Int(n) if let Ok(n @ 1..) = u64::try_from(n) => Ok(n),
        _ => Err(refused(
            "per_tokens: a whole number of tokens (1 or more)".into(),
            node,
        )),
    }
}

/// `{input: <micro>, output: <micro>, cached_input: <micro>}`: input and output required.
fn model(node: &Node, per_tokens: u64) -> Result<ModelPrice, ConfigError> {
    let Value::Map(fields) = &node.value else {
        return Err(wrong_shape(
            "a model's prices ({input: .., output: ..})",
            node,
        ));
    };
    let (mut input, mut cached, mut output) = (None, None, None);
    for (k, v) in fields {
        let field = as_str(k, "a field name")?;
        let slot = match field {
            "input" => &mut input,
            "cached_input" => &mut cached,
            "output" => &mut output,
            other => {
                return Err(err_at(
                    ConfigErrorKind::unknown_field(other, MODEL_FIELDS),
                    k.line,
                ));
            }
        };
        *slot = Some(whole(field, v)?);
    }
    let price = |micro: u64| UnitPrice::new(micro, per_tokens);
    let (Some(input), Some(output)) = (input, output) else {
        return Err(refused(
            "a model needs its `input` and `output` prices".into(),
            node,
        ));
    };
    Ok(ModelPrice {
        input: price(input),
        cached_input: price(cached.unwrap_or(input)),
        output: price(output),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_reads_its_models_and_refuses_what_it_cannot_price() {
        let table = PriceTable::from_yaml_str(
            "per_tokens: 1000\nmodels:\n  a: {input: 3, output: 9}\n  b: {input: 0, output: 1, cached_input: 0}\n",
        )
        .unwrap();
        assert_eq!(table.models().collect::<Vec<_>>(), ["a", "b"]);
        let a = table.model("a").unwrap();
        assert_eq!(a.cached_input(), a.input());
        assert_eq!(a.output().cost(1000), 9);
        let error = |text: &str| PriceTable::from_yaml_str(text).unwrap_err().to_string();
        assert!(error("models:\n  a: {input: 1}\n").contains("needs its `input` and `output`"));
        assert!(error("models:\n  a: {input: 1.5, output: 2}\n").contains("whole number"));
        assert!(error("models:\n  a: {input: -1, output: 2}\n").contains("whole number"));
        assert!(error("models:\n  a: {input: 1, output: 2, extra: 3}\n").contains("extra"));
        assert!(error("per_tokens: 10\n").contains("models"));
        assert!(error("models: [a]\n").contains("a map of models"));
        assert!(error("currency: usd\nmodels: {}\n").contains("currency"));
        assert!(error("per_tokens: 0\nmodels: {}\n").contains("1 or more"));
        assert!(error("per_tokens: x\nmodels: {}\n").contains("1 or more"));
        let twice = error("models: {}\nper_tokens: 5\nmodels: {}\n");
        assert!(
            twice.contains("duplicate") && twice.contains("line 3"),
            "{twice}"
        );
        let twice = error("models:\n  a: {input: 1, input: 2, output: 2}\n");
        assert!(twice.contains("duplicate"), "{twice}");
        let line = error("models:\n  a: {input: 1, output: 2}\n  b: {input: x, output: 2}\n");
        assert!(line.contains("line 3"), "{line}");
    }
}
