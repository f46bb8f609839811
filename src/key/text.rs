//! A key's text: `<limit name>:<escaped id>`, the one writer of it. A Redis key wraps it in
//! its prefix, hash tag and suffix (`backend/redis/keys.rs`); a penalty's jitter hashes it as
//! it is (`docs/penalties.md`, "How a store keeps it"), so every store gets the same ban.

use std::fmt;

use super::BucketKey;

/// A key's text being built: on the stack up to 256 bytes, so that the one allocation (if
/// any) is the text's own, made at its exact size.
pub(crate) struct KeyText(pub(crate) smallvec::SmallVec<[u8; 256]>);

impl KeyText {
    /// `<prefix>{<limit name>:<escaped id>}` then `suffix`.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn new(prefix: &str, key: &BucketKey, suffix: &str) -> Self {
        let mut out = KeyText::opened(prefix, key.name().as_str());
        out.push_id(key);
        out.push("}");
        out.push(suffix);
        out
    }

    /// `<limit name>:<escaped id>`: the key's canonical text, with no prefix or hash tag.
    pub(crate) fn canonical(key: &BucketKey) -> Self {
        let mut out = KeyText(smallvec::SmallVec::new());
        out.push_escaped(key.name().as_str());
        out.push(":");
        out.push_id(key);
        out
    }

    /// The escaped id of `key`.
    fn push_id(&mut self, key: &BucketKey) {
        use std::fmt::Write as _;
        /// Escapes what the id's `Display` writes, straight into the text.
        struct Escaping<'a>(&'a mut KeyText);
        impl fmt::Write for Escaping<'_> {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                self.0.push_escaped(s);
                Ok(())
            }
        }
        // The id's `Display` text: digits and dots need no escaping, a text id is escaped as
        // it is, and the rest (IPv6 addresses and ranges) go through the formatter.
        let id = key.id();
        if let Some(digits) = id.digits() {
            self.0.extend_from_slice(digits.as_bytes());
        } else if let Some(text) = id.as_text() {
            self.push_escaped(text);
        } else {
            let _ = write!(Escaping(self), "{id}");
        }
    }

    /// `<prefix>{<escaped limit name>:`: what every key of the limit starts with.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    #[inline]
    pub(crate) fn opened(prefix: &str, name: &str) -> Self {
        let mut out = KeyText(smallvec::SmallVec::new());
        out.push(prefix);
        out.push("{");
        out.push_escaped(name);
        out.push(":");
        out
    }

    fn push(&mut self, s: &str) {
        self.0.extend_from_slice(s.as_bytes());
    }

    /// Writes `id`, escaping what could break the key format: every byte but printable ASCII
    /// (the braces and `%` too) as `%XX`.
    fn push_escaped(&mut self, id: &str) {
        // Most names and ids need no escaping: copied at once.
        if id.bytes().all(Self::plain) {
            self.0.extend_from_slice(id.as_bytes());
            return;
        }
        for b in id.bytes() {
            if Self::plain(b) {
                self.0.push(b);
            } else {
                const HEX: &[u8; 16] = b"0123456789ABCDEF";
                self.0.extend_from_slice(&[
                    b'%',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0xf)],
                ]);
            }
        }
    }

    /// Whether a byte is written as it is (printable ASCII but the braces and `%`).
    #[inline]
    pub(crate) fn plain(b: u8) -> bool {
        (0x21..=0x7e).contains(&b) && !matches!(b, b'{' | b'}' | b'%')
    }

    /// The text's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}
