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
