//! Test support: real servers and clients.
#![allow(dead_code)]

pub mod examples;
pub mod gate;
pub mod http;
pub mod identity;
pub mod redis;
pub mod scrape;
