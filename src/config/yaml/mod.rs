//! Loading limits from YAML (feature `yaml`).
//!
//! The text is parsed by `serde-saphyr` under a budget (depth, nodes, aliases, size) into a
//! small tree that keeps each node's line, then checked by hand so every error names the
//! file, the line, the limit and the value. Nothing here panics on any input.

use std::path::Path;

mod node;
mod outcomes;
mod penalty;
#[cfg(feature = "stream")]
mod prices;
mod rule_price;
mod rules;
mod shapes;

pub(crate) use outcomes::RuleOutcome;
#[cfg(feature = "stream")]
pub(crate) use rule_price::{RuleModel, RulePrice, RulePriceOf};
pub use rules::RuleSet;
#[cfg(feature = "stream")]
pub(crate) use rules::{RuleAtLimit, RulePer};
pub(crate) use rules::{RuleCost, RuleKey, RuleMissing};

use node::{Fields, Node, Value, as_str, err_at, fields, parse, positive, wrong_shape};
use shapes::{override_of, quota_of};

use super::{ConfigError, ConfigErrorKind, Limits, LimitsBuilder, RegionFloor, check_name};
use crate::key::IdKind;

/// The largest configuration file accepted: 16 MiB.
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

fn id_text(node: &Node) -> Result<(String, u64), ConfigError> {
    match &node.value {
        Value::Str(s) => Ok((s.clone(), node.line)),
        Value::Int(i) => Ok((i.to_string(), node.line)),
        Value::Map(entries) => {
            let mut id = None;
            for (k, v) in entries {
                match as_str(k, "a field name")? {
                    "id" => {
                        if id.is_some() {
                            return Err(err_at(
                                ConfigErrorKind::DuplicateField("id".into()),
                                k.line,
                            ));
                        }
                        id = Some(id_text(v)?.0);
                    }
                    "comment" => {}
                    other => {
                        return Err(err_at(
                            ConfigErrorKind::unknown_field(other, &["id", "comment"]),
                            k.line,
                        ));
                    }
                }
            }
            id.map(|id| (id, node.line))
                .ok_or_else(|| err_at(ConfigErrorKind::MissingField("id"), node.line))
        }
        _ => Err(wrong_shape(
            "an id (a string, or {id: ..., comment: ...})",
            node,
        )),
    }
}

fn load_defaults(builder: &mut LimitsBuilder, root: &Node) -> Result<(), ConfigError> {
    let Value::Map(entries) = &root.value else {
        return Err(wrong_shape("a map of limit names to limits", root));
    };
    for (k, v) in entries {
        let name = as_str(k, "a limit name")?;
        let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
        let f = fields(
            v,
            &[
                "kind",
                "cost",
                "on_store_failure",
                "across_regions",
                "region_floor",
                "penalty",
                "comment",
            ],
        )
        .map_err(located)?;
        let limit = quota_of(&f).map_err(located)?;
        let kind = match f.kind {
            None => IdKind::Any,
            Some(n) => as_str(n, "an id kind")?
                .parse::<IdKind>()
                .map_err(|e| located(err_at(e.into(), n.line)))?,
        };
        // A configured cost of 0 would make the limit count nothing: refused like any zero.
        // (A request can still probe with cost 0: `Rule::cost(0)`, `Transaction::cost(0)`.)
        let cost = match f.cost {
            None => 1,
            Some(n) => positive("cost", n).map_err(located)?,
        };
        builder
            .try_define(name, kind, cost, Some(limit))
            .map_err(|e| {
                let line = match (e.kind(), f.cost) {
                    (ConfigErrorKind::CostAboveBurst { .. }, Some(c)) => c.line,
                    _ => k.line,
                };
                located(e.at_line(line))
            })?;
        // What a store failure does to this limit's requests: the layer's policy (`layer`, the
        // default) or a refusal whatever that policy is (`fail_closed`).
        if let Some(n) = f.on_store_failure {
            match as_str(n, "fail_closed or layer")? {
                "layer" => {}
                "fail_closed" => *builder = std::mem::take(builder).fail_closed(name),
                other => {
                    return Err(located(err_at(
                        ConfigErrorKind::OnStoreFailure(other.chars().take(80).collect()),
                        n.line,
                    )));
                }
            }
        }
        if let Some(floor) = across_regions_of(&f).map_err(located)? {
            let line = f.across_regions.map_or(k.line, |n| n.line);
            builder
                .try_across_regions(name, floor)
                .map_err(|e| located(e.at_line(line)))?;
        }
        if let Some(n) = f.penalty {
            let ladder = penalty::ladder_of(n).map_err(located)?;
            builder
                .try_penalty(name, ladder)
                .map_err(|e| located(e.at_line(n.line)))?;
        }
    }
    Ok(())
}

/// `across_regions: true` and its `region_floor` (a percentage, 10% by default): the floor when
/// the limit is marked.
fn across_regions_of(f: &Fields<'_>) -> Result<Option<RegionFloor>, ConfigError> {
    let marked = match f.across_regions {
        None => false,
        Some(n) => match n.value {
            Value::Bool(b) => b,
            _ => return Err(wrong_shape("true or false", n)),
        },
    };
    match (marked, f.region_floor) {
        (false, None) => Ok(None),
        (true, None) => Ok(Some(RegionFloor::default())),
        (false, Some(n)) => Err(err_at(
            ConfigErrorKind::RegionFloor("a floor on a limit without across_regions: true".into()),
            n.line,
        )),
        (true, Some(n)) => {
            let text = match &n.value {
                Value::Str(s) => s.as_str(),
                _ => {
                    return Err(err_at(
                        ConfigErrorKind::RegionFloor(n.value.describe().into()),
                        n.line,
                    ));
                }
            };
            text.parse::<RegionFloor>()
                .map(Some)
                .map_err(|e| err_at(e, n.line))
        }
    }
}

fn load_overrides(builder: &mut LimitsBuilder, root: &Node) -> Result<(), ConfigError> {
    match &root.value {
        // The list format: `- Name: {burst, count, period, ids: [...]}`.
        Value::Seq(items) => {
            for item in items {
                let Value::Map(entries) = &item.value else {
                    return Err(wrong_shape("a map with one limit name", item));
                };
                let [(k, v)] = entries.as_slice() else {
                    return Err(wrong_shape("a map with exactly one limit name", item));
                };
                let name = as_str(k, "a limit name")?;
                let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
                let f = fields(v, &["ids", "unlimited", "comment"]).map_err(located)?;
                let limit = override_of(&f).map_err(located)?;
                let ids_node = f
                    .ids
                    .ok_or_else(|| located(err_at(ConfigErrorKind::MissingField("ids"), f.line)))?;
                let Value::Seq(ids) = &ids_node.value else {
                    return Err(located(wrong_shape("a list of ids", ids_node)));
                };
                if ids.is_empty() {
                    return Err(located(err_at(ConfigErrorKind::NoIds, ids_node.line)));
                }
                check_name(name).map_err(|e| located(ConfigError::new(e)))?;
                if builder.limits.name(name).is_none() {
                    return Err(located(ConfigError::new(ConfigErrorKind::UnknownName(
                        name.to_owned(),
                    ))));
                }
                for id in ids {
                    let (text, line) = id_text(id).map_err(located)?;
                    builder
                        .try_override(name, &text, limit.clone())
                        .map_err(|e| e.for_limit(name).at_line(line))?;
                }
            }
            Ok(())
        }
        // The older format: `Name:id: {burst, count, period}`.
        Value::Map(entries) => {
            for (k, v) in entries {
                let key = as_str(k, "a Name:id key")?;
                let Some((name, id)) = key.split_once(':') else {
                    return Err(err_at(
                        ConfigErrorKind::WrongShape {
                            expected: "a key of the form Name:id",
                            found: "a key without ':'",
                        },
                        k.line,
                    ));
                };
                let located = |e: ConfigError| e.for_limit(name).at_line(k.line);
                let f = fields(v, &["unlimited", "comment"]).map_err(located)?;
                let limit = override_of(&f).map_err(located)?;
                builder.try_override(name, id, limit).map_err(located)?;
            }
            Ok(())
        }
        _ => Err(wrong_shape(
            "a list of overrides (or a map of Name:id keys)",
            root,
        )),
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "yaml")))]
impl Limits {
    /// Loads defaults, and optionally overrides, from YAML text.
    ///
    /// ```
    /// use tower_ratelimits::Limits;
    /// let limits = Limits::from_yaml_str(
    ///     "NewOrdersPerAccount:\n  burst: 300\n  count: 300\n  period: 180m\n  kind: account\n",
    ///     Some("- NewOrdersPerAccount:\n    burst: 300\n    count: 600\n    period: 180m\n    ids: [12345678]\n"),
    /// ).unwrap();
    /// assert_eq!(limits.override_count(), 1);
    /// ```
    pub fn from_yaml_str(defaults: &str, overrides: Option<&str>) -> Result<Limits, ConfigError> {
        Self::from_named_yaml(
            ("<defaults>", defaults),
            overrides.map(|o| ("<overrides>", o)),
        )
    }

    /// [`Limits::from_yaml_str`] with each text's name, which its errors give as a file's:
    /// for YAML read from elsewhere than a file (a configuration service, an environment
    /// variable, a file embedded in the binary).
    ///
    /// ```
    /// use tower_ratelimits::Limits;
    /// let defaults = "PerIp:\n  kind: ip\n  burst: 10\n  count: 10\n  period: 1s\n";
    /// let overrides = "- PerIp:\n    burst: 20\n    count: 20\n    periood: 1s\n    ids: [192.0.2.1]\n";
    /// let e = Limits::from_named_yaml(("limits.yaml", defaults), Some(("vault:ratelimits/overrides", overrides)))
    ///     .unwrap_err();
    /// assert!(e.to_string().starts_with("vault:ratelimits/overrides:4: "), "{e}");
    /// ```
    pub fn from_named_yaml(
        (defaults_name, defaults): (&str, &str),
        overrides: Option<(&str, &str)>,
    ) -> Result<Limits, ConfigError> {
        load(
            (defaults, defaults_name),
            overrides.map(|(name, text)| (text, name)),
        )
    }

    /// Loads defaults from a YAML file (no overrides). Errors name the file.
    pub fn from_yaml_file(defaults: impl AsRef<Path>) -> Result<Limits, ConfigError> {
        Self::from_yaml_files(defaults, None::<&Path>)
    }

    /// Loads defaults, and optionally overrides, from YAML files. Errors name the file. Paths
    /// are anything path-like: `&str`, `String`, `&Path`, `PathBuf`.
    ///
    /// ```no_run
    /// # use tower_ratelimits::Limits;
    /// let limits = Limits::from_yaml_files("ratelimits.yaml", Some("overrides.yaml"))?;
    /// let from_env = Limits::from_yaml_files("ratelimits.yaml", std::env::var("OVERRIDES").ok())?;
    /// let defaults_only = Limits::from_yaml_file("ratelimits.yaml")?;
    /// # Ok::<(), tower_ratelimits::ConfigError>(())
    /// ```
    pub fn from_yaml_files(
        defaults: impl AsRef<Path>,
        overrides: Option<impl AsRef<Path>>,
    ) -> Result<Limits, ConfigError> {
        let defaults = defaults.as_ref();
        let d_name = defaults.display().to_string();
        let d_text = read(defaults).map_err(|e| e.in_source(&d_name))?;
        match overrides.as_ref().map(AsRef::as_ref) {
            None => load((&d_text, &d_name), None),
            Some(o) => {
                let o_name = o.display().to_string();
                let o_text = read(o).map_err(|e| e.in_source(&o_name))?;
                load((&d_text, &d_name), Some((&o_text, &o_name)))
            }
        }
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    // Only a regular file: opening a FIFO (or reading a device) could block forever.
    let metadata = std::fs::metadata(path).map_err(ConfigError::new)?;
    if !metadata.is_file() {
        return Err(ConfigError::new(ConfigErrorKind::NotAFile));
    }
    let file = std::fs::File::open(path).map_err(ConfigError::new)?;
    let mut bytes = Vec::new();
    let read = file
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(ConfigError::new)?;
    // The size first: a cut through a multi-byte character is not the file's fault.
    if read as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::new(ConfigErrorKind::TooLarge {
            bytes: metadata.len().max(read as u64),
            max: MAX_FILE_BYTES,
        }));
    }
    String::from_utf8(bytes).map_err(|e| {
        ConfigError::new(ConfigErrorKind::NotUtf8 {
            offset: e.utf8_error().valid_up_to(),
        })
    })
}

fn load(defaults: (&str, &str), overrides: Option<(&str, &str)>) -> Result<Limits, ConfigError> {
    let mut builder = Limits::builder();
    let (text, source) = defaults;
    let root = parse(text)
        .and_then(|r| r.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty)))
        .map_err(|e| e.in_source(source))?;
    load_defaults(&mut builder, &root).map_err(|e| e.in_source(source))?;
    if let Some((text, source)) = overrides {
        let root = parse(text)
            .and_then(|r| r.ok_or_else(|| ConfigError::new(ConfigErrorKind::Empty)))
            .map_err(|e| e.in_source(source))?;
        load_overrides(&mut builder, &root).map_err(|e| e.in_source(source))?;
    }
    builder.build()
}
