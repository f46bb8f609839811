//! Where a bucket lives: `<prefix>{<limit name>:<escaped id>}`, and `:t` after the hash tag
//! for a tiered state.

use std::fmt;

use crate::key::BucketKey;

/// The suffix of a tiered key's Redis key (after the hash tag, so it stays in the same slot):
/// a name switched between GCRA and tiers never reads the other algorithm's state.
pub(super) const TIERS_SUFFIX: &str = ":t";

/// Writes `id` into `out`, escaping what could break the key format (see the module docs).
fn push_escaped(out: &mut String, id: &str) {
    for b in id.bytes() {
        if (0x21..=0x7e).contains(&b) && !matches!(b, b'{' | b'}' | b'%') {
            out.push(b as char);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
    }
}

/// The Redis key of `key` under `prefix` (see [`RedisBackend::redis_key`]).
pub(crate) fn redis_key(prefix: &str, key: &BucketKey) -> String {
    use std::fmt::Write as _;
    /// Escapes what the id's `Display` writes, straight into the key.
    struct Escaping<'a>(&'a mut String);
    impl fmt::Write for Escaping<'_> {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            push_escaped(self.0, s);
            Ok(())
        }
    }
    let mut out = String::with_capacity(prefix.len() + 64);
    out.push_str(prefix);
    out.push('{');
    push_escaped(&mut out, key.name().as_str());
    out.push(':');
    let _ = write!(Escaping(&mut out), "{}", key.id());
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Id, Limit, Limits};

    #[test]
    fn keys_name_the_limit_and_escape_the_id() {
        let limits = Limits::builder()
            .limit("Api", Limit::from_micros(1, 1, 1_000_000).unwrap())
            .build()
            .unwrap();
        let key = BucketKey::new(limits.name("Api").unwrap(), Id::new("a{b}%c é").unwrap());
        assert_eq!(redis_key("rl:", &key), "rl:{Api:a%7Bb%7D%25c%20%C3%A9}");
    }
}
