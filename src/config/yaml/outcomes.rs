//! A rule's `count_when:` in a rules file: the outcome cases that count a request, each with its
//! weight (`Rule::count_when` in code). Read as data here; the layer builds its `CountWhen`
//! from them (`layer/rules_file.rs`).

use super::node::{Node, Value, as_str, duplicate, err_at, invalid, wrong_shape};
use crate::config::{ConfigError, ConfigErrorKind};

/// The heaviest weight a case may have: 2^40, as a settled cost.
const MOST_WEIGHT: u64 = 1 << 40;

/// The most cases a rule's `count_when` may list, as `CountWhen` takes.
const MOST_CASES: usize = 64;

/// The highest gRPC status code (`UNAUTHENTICATED`), as `CountWhen::grpc_status` takes.
const MOST_GRPC_CODE: u32 = 16;

/// What a case of a rule's `count_when` matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RuleOutcome {
    /// `status: 401` or `status: 500-599`: a status in this range, both ends included.
    Status(u16, u16),
    /// `header: <name>`: the header present; with `equals: <value>`, that one value exactly.
    Header(http::HeaderName, Option<http::HeaderValue>),
    /// `grpc_status: 16`: a gRPC call ending with this status (0 to 16).
    GrpcStatus(u32),
    /// `latency_above: 2s`: a response head that came later than this after the request was
    /// let through.
    LatencyAbove(std::time::Duration),
}

const CASE_FIELDS: &[&str] = &[
    "status",
    "header",
    "equals",
    "grpc_status",
    "latency_above",
    "weight",
];

/// `count_when: [{status: 401}, {header: x-login-failure, equals: mfa, weight: 3}, ...]`: at
/// least one case, in order, each with its weight (1 when none is given).
pub(super) fn count_when_of(node: &Node) -> Result<Vec<(RuleOutcome, u64)>, ConfigError> {
    let Value::Seq(items) = &node.value else {
        return Err(wrong_shape(
            "a list of outcome cases ([{status: 401}, {header: x-failed, weight: 3}])",
            node,
        ));
    };
    if items.len() > MOST_CASES {
        return Err(invalid(
            format!(
                "count_when lists {} cases: at most {MOST_CASES}",
                items.len()
            ),
            node,
        ));
    }
    let cases = items.iter().map(case_of).collect::<Result<Vec<_>, _>>()?;
    if !cases.iter().any(|&(_, weight)| weight > 0) {
        return Err(invalid(
            "count_when counts nothing: give a case a weight above 0".into(),
            node,
        ));
    }
    Ok(cases)
}

fn case_of(node: &Node) -> Result<(RuleOutcome, u64), ConfigError> {
    let Value::Map(fields) = &node.value else {
        return Err(wrong_shape(
            "an outcome case ({status: 401, weight: 1})",
            node,
        ));
    };
    let [
        mut status,
        mut header,
        mut equals,
        mut grpc,
        mut latency,
        mut weight,
    ] = [None; 6];
    for (k, v) in fields {
        let field = as_str(k, "a field name")?;
        let slot = match field {
            "status" => &mut status,
            "header" => &mut header,
            "equals" => &mut equals,
            "grpc_status" => &mut grpc,
            "latency_above" => &mut latency,
            "weight" => &mut weight,
            other => {
                return Err(err_at(
                    ConfigErrorKind::unknown_field(other, CASE_FIELDS),
                    k.line,
                ));
            }
        };
        if slot.replace(v).is_some() {
            return Err(duplicate(field, k));
        }
    }
    let outcome = match (status, header, equals, grpc, latency) {
        (Some(status), None, None, None, None) => status_of(status)?,
        (None, Some(name), equals, None, None) => header_of(name, equals)?,
        (None, None, None, Some(code), None) => grpc_status_of(code)?,
        (None, None, None, None, Some(bound)) => latency_of(bound)?,
        _ => {
            return Err(invalid(
                "a case is one of `status`, `header` (with `equals` for one value), \
                 `grpc_status` or `latency_above`"
                    .into(),
                node,
            ));
        }
    };
    let weight = match weight {
        None => 1,
        Some(n) => match n.value {
            Value::Int(w) if (0..=i128::from(MOST_WEIGHT)).contains(&w) => w as u64,
            _ => return Err(invalid("weight: a whole number from 0 to 2^40".into(), n)),
        },
    };
    Ok((outcome, weight))
}

/// `status: 401` or `status: 500-599`.
fn status_of(node: &Node) -> Result<RuleOutcome, ConfigError> {
    let code = |text: &str| {
        text.trim()
            .parse::<u16>()
            .ok()
            .filter(|c| (100..=599).contains(c))
    };
    let range = match &node.value {
        Value::Int(c) => u16::try_from(*c)
            .ok()
            .and_then(|c| code(&c.to_string()))
            .map(|c| (c, c)),
        Value::Str(s) => match s.split_once('-') {
            Some((a, b)) => code(a).zip(code(b)).filter(|(a, b)| a <= b),
            None => code(s).map(|c| (c, c)),
        },
        _ => None,
    };
    let (low, high) = range.ok_or_else(|| {
        invalid(
            "status: a code from 100 to 599, or a range of them (500-599)".into(),
            node,
        )
    })?;
    Ok(RuleOutcome::Status(low, high))
}

/// `grpc_status: 16`: a code from 0 to 16.
fn grpc_status_of(node: &Node) -> Result<RuleOutcome, ConfigError> {
    match node.value {
        Value::Int(c) if (0..=i128::from(MOST_GRPC_CODE)).contains(&c) => {
            Ok(RuleOutcome::GrpcStatus(c as u32))
        }
        _ => Err(invalid(
            format!("grpc_status: a gRPC status code from 0 to {MOST_GRPC_CODE}"),
            node,
        )),
    }
}

/// `latency_above: 2s`: a duration above 0.
fn latency_of(node: &Node) -> Result<RuleOutcome, ConfigError> {
    let text = as_str(node, "a duration (2s, 500ms)")?;
    match crate::time::parse_duration_us(text) {
        Ok(us) if us > 0 => Ok(RuleOutcome::LatencyAbove(std::time::Duration::from_micros(
            us,
        ))),
        Ok(_) => Err(invalid(
            "latency_above: 0 counts every response: give a bound above 0".into(),
            node,
        )),
        Err(e) => Err(invalid(format!("latency_above: {e}"), node)),
    }
}

/// `header: <name>`, with `equals: <value>` or without.
fn header_of(name: &Node, equals: Option<&Node>) -> Result<RuleOutcome, ConfigError> {
    let text = as_str(name, "a header name")?;
    let header = http::HeaderName::from_bytes(text.as_bytes())
        .map_err(|_| invalid(format!("{text:?} is not a header name"), name))?;
    let value = match equals {
        None => None,
        Some(node) => {
            let text = as_str(node, "a header value")?;
            Some(
                http::HeaderValue::from_str(text)
                    .map_err(|_| invalid(format!("{text:?} is not a header value"), node))?,
            )
        }
    };
    Ok(RuleOutcome::Header(header, value))
}
