//! The algorithms, as pure functions: no I/O, no clock, nothing from configuration. Every
//! backend decides with these (the Redis script mirrors them function for function), so they
//! carry the exhaustive tests: the specs' examples and property tests against naive models.

pub mod adaptive;
pub mod calendar;
pub mod concurrency;
pub mod fair_share;
pub mod gcra;
pub(crate) mod penalty;
pub(crate) mod regions;
pub mod tiers;

/// The random numbers of the property tests of every room (the algorithms' and the stores'):
/// xorshift, seeded by the test, so a failing case is the same on every run.
#[cfg(test)]
pub(crate) struct Rng(pub(crate) u64);

#[cfg(test)]
impl Rng {
    /// A number below `n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
