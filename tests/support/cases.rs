//! How many cases a property test runs: its default here, or `PROPTEST_CASES` for a long run
//! (`PROPTEST_CASES=100000 cargo test --all-features --test tiers`, see the README).

/// `PROPTEST_CASES` when set to a number, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
