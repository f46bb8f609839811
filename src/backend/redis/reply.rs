//! Numbers read back from the store's replies (a snapshot's values): decimal digits, whole
//! microseconds, a sorted set's members and scores.

use fred::prelude::Value;

#[cfg(feature = "replay")]
/// The largest stored number the script writes (2^52).
pub(in crate::backend::redis) const LIMIT: u64 = 1 << 52;

/// A whole number from a reply (an integer, or its digits).
pub(in crate::backend::redis) fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => u64::try_from(*i).ok(),
        other => digits(other.as_bytes()?),
    }
}

/// The number `bytes` spell in decimal digits (no sign, no leading `+`).
pub(in crate::backend::redis) fn digits(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || bytes.len() > 20 || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

#[cfg(feature = "replay")]
/// A sorted set's members and scores, from `ZRANGE ... WITHSCORES` (flat, or in pairs).
pub(in crate::backend::redis) fn scored(reply: Value) -> Option<Vec<(Vec<u8>, f64)>> {
    let Value::Array(items) = reply else {
        return None;
    };
    let mut flat = Vec::with_capacity(items.len());
    for item in items {
        match item {
            Value::Array(pair) => flat.extend(pair),
            other => flat.push(other),
        }
    }
    if flat.len() % 2 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(flat.len() / 2);
    for pair in flat.chunks(2) {
        let member = pair[0].as_bytes()?.to_vec();
        let score = match &pair[1] {
            Value::Double(d) => *d,
            Value::Integer(i) => *i as f64,
            other => std::str::from_utf8(other.as_bytes()?).ok()?.parse().ok()?,
        };
        out.push((member, score));
    }
    Some(out)
}

#[cfg(feature = "replay")]
/// A score that is a whole number of microseconds.
pub(in crate::backend::redis) fn whole(d: f64) -> Option<u64> {
    (d.is_finite() && d >= 0.0 && d.fract() == 0.0 && d < LIMIT as f64).then_some(d as u64)
}
