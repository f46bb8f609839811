//! Bucket identity across configurations: app instances whose files list the same limits in
//! different orders, or with an extra limit first, share exactly the right buckets.

use tower_ratelimits::{BucketKey, Id, Limiter, Limits, Transaction};

const PER_IP: &str = "RequestsPerIPAddress: {kind: ip, burst: 3, count: 3, period: 1h}\n";
const PER_RANGE: &str =
    "RequestsPerIPv6Range: {kind: ipv6_range, burst: 5, count: 5, period: 1h}\n";
const UNUSED: &str = "Unused: {kind: ip, burst: 1, count: 1, period: 1h}\n";

/// The stock order, the same limits swapped, and an unused limit inserted first.
pub fn three_configurations() -> [Limits; 3] {
    let load = |yaml: String| Limits::from_yaml_str(&yaml, None).unwrap();
    [
        load(format!("{PER_IP}{PER_RANGE}")),
        load(format!("{PER_RANGE}{PER_IP}")),
        load(format!("{UNUSED}{PER_IP}{PER_RANGE}")),
    ]
}

fn key(limiter: &Limiter, name: &str) -> BucketKey {
    // An IPv4 client: the range limit keys it by its address too, so both limits see the
    // same id and only the limit's name tells their buckets apart.
    limiter.key(name, Id::new("10.0.0.1").unwrap()).unwrap()
}

async fn spend(limiter: &Limiter, name: &str) -> (bool, u64) {
    let d = limiter
        .spend(&[Transaction::new(key(limiter, name))])
        .await
        .unwrap();
    let d = &d.decisions()[0];
    (d.allowed(), d.remaining())
}

/// `a`, `b` and `c` run `three_configurations()` in that order over one store.
pub async fn instances_share_exactly_the_right_buckets(a: &Limiter, b: &Limiter, c: &Limiter) {
    // A drains its per-IP bucket.
    for left in [2, 1, 0] {
        assert_eq!(spend(a, "RequestsPerIPAddress").await, (true, left));
    }
    assert!(!spend(a, "RequestsPerIPAddress").await.0);
    // B (the file's order swapped) sees the same per-IP bucket drained, and its own range
    // bucket untouched: with keys built from positions it answered from A's per-IP bucket.
    assert!(!spend(b, "RequestsPerIPAddress").await.0);
    assert_eq!(spend(b, "RequestsPerIPv6Range").await, (true, 4));
    // C (an unused limit inserted first) sees both as A and B left them.
    assert!(!spend(c, "RequestsPerIPAddress").await.0);
    assert_eq!(spend(c, "RequestsPerIPv6Range").await, (true, 3));
    // The unused limit has a bucket of its own, fresh: it was never one of the others'.
    assert_eq!(spend(c, "Unused").await, (true, 0));
    // Keys name the limit, whichever instance built them.
    assert_eq!(
        key(a, "RequestsPerIPv6Range"),
        key(b, "RequestsPerIPv6Range")
    );
    assert_eq!(
        key(c, "RequestsPerIPAddress").to_string(),
        "RequestsPerIPAddress:10.0.0.1"
    );
}
