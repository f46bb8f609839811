//! The `RateLimit` and `RateLimit-Policy` fields (and the `X-RateLimit-*` ones): one writer
//! of structured-field members, the numbers taken once when a request is decided, and what an
//! allowed response gets.

use bytes::Bytes;
use http::header::HeaderValue;
use http::{HeaderMap, HeaderName};

use super::*;

/// Numbers below this are header values without an allocation ([`number`]).
const SMALL: usize = 10_000;

/// The digits of every number below [`SMALL`], four to a number, zero-padded (`0000` ..
/// `9999`): a small number's value is a slice of them, shared, where `HeaderValue::from(u64)`
/// allocates. 40 KB in the binary.
static DIGITS: [u8; SMALL * 4] = digits();

const fn digits() -> [u8; SMALL * 4] {
    let mut out = [0u8; SMALL * 4];
    let mut n = 0;
    while n < SMALL {
        out[4 * n] = b'0' + (n / 1000) as u8;
        out[4 * n + 1] = b'0' + (n / 100 % 10) as u8;
        out[4 * n + 2] = b'0' + (n / 10 % 10) as u8;
        out[4 * n + 3] = b'0' + (n % 10) as u8;
        n += 1;
    }
    out
}

/// `n` as a header value (`Retry-After`, `grpc-status`, the `X-RateLimit-*` fields): a slice
/// of [`DIGITS`] below [`SMALL`], no allocation.
pub(super) fn number(n: u64) -> HeaderValue {
    if let Ok(i) = usize::try_from(n)
        && i < SMALL
    {
        let width = match i {
            0..=9 => 1,
            10..=99 => 2,
            100..=999 => 3,
            _ => 4,
        };
        let end = 4 * i + 4;
        if let Some(Ok(value)) = DIGITS
            .get(end - width..end)
            .map(|digits| HeaderValue::from_maybe_shared(Bytes::from_static(digits)))
        {
            return value;
        }
    }
    HeaderValue::from(n)
}

/// Appends the decimal digits of `n` to `buf`.
pub(super) fn push_u64(buf: &mut Buf, n: u64) {
    buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A header value being built (at its exact size where the layer writes it on every request).
pub(super) type Buf = Vec<u8>;

/// Appends `"<name>";<a>=<x>;<b>=<y>`, a structured-field list member, to `buf` (`, ` first
/// when the list has members). Names are `[A-Za-z0-9_.-]`, so the value is always valid.
pub(super) fn push_item(buf: &mut Buf, name: &str, a: u8, x: u64, b: u8, y: u64) {
    if !buf.is_empty() {
        buf.extend_from_slice(b", ");
    }
    buf.push(b'"');
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\";");
    buf.extend_from_slice(&[a, b'=']);
    push_u64(buf, x);
    buf.extend_from_slice(&[b';', b, b'=']);
    push_u64(buf, y);
}

/// Appends `"<name>";q=<max>;qu="concurrent-requests"`, the `RateLimit-Policy` member of a
/// concurrency limit (the draft's quota unit for requests in flight; no window).
pub(super) fn push_concurrency_policy(buf: &mut Buf, name: &str, max: u64) {
    if !buf.is_empty() {
        buf.extend_from_slice(b", ");
    }
    buf.push(b'"');
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\";q=");
    push_u64(buf, max);
    buf.extend_from_slice(b";qu=\"concurrent-requests\"");
}

/// One structured-field member as a header value.
pub(super) fn sf_item(name: &str, a: u8, x: u64, b: u8, y: u64) -> HeaderValue {
    let mut buf = Buf::with_capacity(item_len(name, x, y));
    push_item(&mut buf, name, a, x, b, y);
    owned_value(buf)
}

/// The `RateLimit-Policy` values of a layer whose rules all have a precomputed member
/// (`members`, in rule order; [`policy_value`]), one per rule reported strictest: its member
/// first, the others in order, as [`Fields::from_reported`] writes them. Empty for fewer than
/// two rules or when one has no precomputed member.
pub(crate) fn joined_policies(members: &[Option<&HeaderValue>]) -> Box<[HeaderValue]> {
    if members.len() < 2 {
        return Box::default();
    }
    let Some(members) = members.iter().copied().collect::<Option<Vec<_>>>() else {
        return Box::default();
    };
    let len = members.iter().map(|m| m.len()).sum::<usize>() + 2 * (members.len() - 1);
    (0..members.len())
        .map(|first| {
            let mut buf = Buf::with_capacity(len);
            let rest = members.iter().enumerate().filter(|&(i, _)| i != first);
            for member in std::iter::once(members[first]).chain(rest.map(|(_, m)| *m)) {
                if !buf.is_empty() {
                    buf.extend_from_slice(b", ");
                }
                buf.extend_from_slice(member.as_bytes());
            }
            owned_value(buf)
        })
        .collect()
}

/// The `RateLimit-Policy` value of a limit whose policy does not depend on the decision
/// (the seam's `fixed_policy`), computed once when a layer is built; `None` for another.
pub(crate) fn policy_value(name: &str, quota: &Quota) -> Option<HeaderValue> {
    let (q, w) = quota.fixed_policy()?;
    Some(sf_item(name, b'q', q, b'w', w))
}

/// One reported decision's numbers: its `RateLimit-Policy` member (precomputed, or `q` and
/// `w`) and its `RateLimit` member's `r` and `t` (draft-11; see `docs/keys-and-http.md`).
pub(super) struct Member<'c> {
    name: LimitName,
    concurrency: bool,
    q: u64,
    w: u64,
    r: u64,
    t: u64,
    /// The legacy `X-RateLimit-Reset`: seconds until the bucket is full, rounded up.
    reset_secs: u64,
    cached: Option<&'c HeaderValue>,
}

impl Member<'_> {
    /// The length of its `RateLimit-Policy` member.
    fn policy_len(&self) -> usize {
        match self.cached {
            Some(v) => v.len(),
            None if self.concurrency => self.name.as_str().len() + 30 + decimal_len(self.q),
            None => item_len(self.name.as_str(), self.q, self.w),
        }
    }

    fn push_policy(&self, buf: &mut Buf) {
        let name = self.name.as_str();
        match self.cached {
            Some(v) => {
                if !buf.is_empty() {
                    buf.extend_from_slice(b", ");
                }
                buf.extend_from_slice(v.as_bytes());
            }
            None if self.concurrency => push_concurrency_policy(buf, name, self.q),
            None => push_item(buf, name, b'q', self.q, b'w', self.w),
        }
    }
}

/// A response's rate-limit fields, written when its decisions are made (the decisions
/// themselves need not be kept): the `RateLimit-Policy` and `RateLimit` values, one member per
/// reported decision, the strictest first, and the legacy fields' numbers (of the strictest).
/// Two values whatever the number of rules, each written once at its exact size.
pub(crate) struct Fields {
    policy: HeaderValue,
    state: HeaderValue,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset`.
    legacy: [u64; 3],
}

/// The `t` of `r`, whose shape shows `t_us`: a banned key's wait is its ban's, whatever its
/// limit's numbers say.
#[inline]
fn wait_us(r: &Seen<'_>, t_us: u64) -> u64 {
    if r.banned {
        t_us.max(r.retry_after_us)
    } else {
        t_us
    }
}

impl Fields {
    /// The fields of `batch`; `cached` gives a limit's precomputed `RateLimit-Policy` member,
    /// if any. `None` when no decision is reported.
    pub(crate) fn of<'c>(
        batch: &BatchDecision,
        cached: impl Fn(LimitName, &Quota) -> Option<&'c HeaderValue>,
        joined: &[HeaderValue],
    ) -> Option<Self> {
        let items = batch.decisions().iter().map(|d| {
            let seen = Seen::from(d);
            let policy = seen.quota.and_then(|q| cached(seen.name, q));
            (seen, policy)
        });
        Self::from_reported(items, joined)
    }

    /// The fields of the transactions `items`, each with its precomputed `RateLimit-Policy`
    /// member if any, reporting the strictest first (as [`BatchDecision::strictest`] chooses
    /// it), then every other one that counts, in order. Every item is taken (a caller may count
    /// and trace them on the way). `joined`: the layer's [`joined_policies`] (empty when it has
    /// none), the `RateLimit-Policy` value when every rule reports its precomputed member. The
    /// one home of the fields' numbers.
    pub(crate) fn from_reported<'a, 'c>(
        items: impl Iterator<Item = (Seen<'a>, Option<&'c HeaderValue>)>,
        joined: &[HeaderValue],
    ) -> Option<Self> {
        // One pass: each member as it comes (on the stack for a request's few rules), the
        // strictest chosen on the way and moved to the front at the end.
        let mut members: SmallVec<[Member<'c>; 8]> = SmallVec::new();
        let mut strictest = Strictest::default();
        let mut first = None;
        for (i, (r, cached)) in items.enumerate() {
            let Some(quota) = r.quota.filter(|_| r.counts) else {
                continue;
            };
            strictest.offer(i, r.allowed, r.retry_after_us, r.remaining);
            // A cached member needs no window.
            let shown = quota.shown(&r.numbers(), cached.is_none());
            if strictest.index() == Some(i) {
                first = shown.map(|_| members.len());
            }
            let Some(shown) = shown else { continue };
            members.push(Member {
                name: r.name,
                concurrency: shown.concurrency,
                q: shown.q,
                w: shown.w,
                r: r.remaining,
                t: ceil_secs_us(wait_us(&r, shown.t_us)),
                reset_secs: ceil_secs_us(r.reset_after_us),
                cached,
            });
        }
        // Every rule reported with its precomputed member: the value joined when the layer
        // was built, with the strictest first (4 rules: -558 instructions a request).
        let every_rule =
            members.len() == joined.len() && members.iter().all(|m| m.cached.is_some());
        let joined = every_rule.then(|| joined.get(first.unwrap_or(0))).flatten();
        if let Some(at @ 1..) = first {
            members[..=at].rotate_right(1);
        }
        let members: &[Member<'c>] = &members;
        let first = members.first()?;
        let separators = 2 * (members.len() - 1);
        let policy = match (members, first.cached, joined) {
            (_, _, Some(v)) | ([_], Some(v), _) => v.clone(),
            _ => {
                let len = members.iter().map(Member::policy_len).sum::<usize>() + separators;
                let mut policy = Buf::with_capacity(len);
                for m in members {
                    m.push_policy(&mut policy);
                }
                debug_assert_eq!(
                    policy.len(),
                    len,
                    "the policy field's length was computed wrong"
                );
                owned_value(policy)
            }
        };
        let len = members
            .iter()
            .map(|m| item_len(m.name.as_str(), m.r, m.t))
            .sum::<usize>()
            + separators;
        let mut state = Buf::with_capacity(len);
        for m in members {
            push_item(&mut state, m.name.as_str(), b'r', m.r, b't', m.t);
        }
        debug_assert_eq!(
            state.len(),
            len,
            "the state field's length was computed wrong"
        );
        Some(Self {
            policy,
            state: owned_value(state),
            legacy: [first.q, first.r, first.reset_secs],
        })
    }

    /// Adds `RateLimit-Policy` and `RateLimit`, appended to members another layer already
    /// wrote, and the legacy `X-RateLimit-*` fields of the strictest when asked (unless
    /// another layer wrote them). A lone member's precomputed policy is shared, not copied.
    pub(super) fn write(self, headers: &mut HeaderMap, legacy: bool) {
        put(headers, &RATELIMIT_POLICY, self.policy);
        put(headers, &RATELIMIT, self.state);
        if legacy && !headers.contains_key(&X_RATELIMIT_LIMIT) {
            let [limit, remaining, reset] = self.legacy;
            headers.insert(X_RATELIMIT_LIMIT.clone(), number(limit));
            headers.insert(X_RATELIMIT_REMAINING.clone(), number(remaining));
            headers.insert(X_RATELIMIT_RESET.clone(), number(reset));
        }
    }
}

/// The length of the member [`push_item`] writes.
pub(super) fn item_len(name: &str, x: u64, y: u64) -> usize {
    name.len() + 8 + decimal_len(x) + decimal_len(y)
}

/// The number of decimal digits of `n`, in a few instructions whatever `n` (`ilog10` costs
/// 26): the bit length gives the digits within one, a power of ten settles it.
pub(super) fn decimal_len(n: u64) -> usize {
    const POW10: [u64; 20] = {
        let mut p = [1u64; 20];
        let mut i = 1;
        while i < 20 {
            p[i] = p[i - 1] * 10;
            i += 1;
        }
        p
    };
    let bits = 64 - (n | 1).leading_zeros() as usize;
    // bits * log10(2), rounded down: floor(log10(n)) or one more (at most 19).
    let guess = (bits * 1233) >> 12;
    let at_least = POW10.get(guess).is_some_and(|&p| n >= p);
    (guess + usize::from(at_least)).max(1)
}

/// A header value that owns `buf`, written at its exact size (so nothing is copied).
pub(super) fn owned_value(buf: Buf) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::from(buf))
        .unwrap_or_else(|_| HeaderValue::from_static("\"invalid\""))
}

/// Adds `ours` to the field `name`: appended to the members another layer already wrote
/// (stacked layers), else as the field.
pub(super) fn put(headers: &mut HeaderMap, name: &'static HeaderName, ours: HeaderValue) {
    // One lookup when the field is new (the common case); a field another layer wrote is
    // read back and joined.
    let Some(theirs) = headers.insert(name, ours) else {
        return;
    };
    if let Some(slot) = headers.get_mut(name) {
        let mut both = Buf::with_capacity(theirs.len() + 2 + slot.len());
        both.extend_from_slice(theirs.as_bytes());
        both.extend_from_slice(b", ");
        both.extend_from_slice(slot.as_bytes());
        if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(both)) {
            *slot = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joined_policies_put_each_member_first_once_and_the_rest_in_order() {
        let [a, b, c] =
            ["\"a\";q=1;w=1", "\"b\";q=2;w=2", "\"c\";q=3;w=3"].map(HeaderValue::from_static);
        let joined = joined_policies(&[Some(&a), Some(&b), Some(&c)]);
        let shown: Vec<&str> = joined.iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(
            shown,
            [
                "\"a\";q=1;w=1, \"b\";q=2;w=2, \"c\";q=3;w=3",
                "\"b\";q=2;w=2, \"a\";q=1;w=1, \"c\";q=3;w=3",
                "\"c\";q=3;w=3, \"a\";q=1;w=1, \"b\";q=2;w=2",
            ]
        );
        // One rule (its member is shared as it is), or one without a precomputed member.
        assert!(joined_policies(&[Some(&a)]).is_empty());
        assert!(joined_policies(&[Some(&a), None]).is_empty());
    }

    #[test]
    fn a_number_is_its_digits_with_or_without_the_table() {
        for n in (0..=SMALL as u64 + 10).chain([99_999, 1 << 40, u64::MAX]) {
            assert_eq!(number(n), HeaderValue::from(n), "{n}");
        }
    }
}
