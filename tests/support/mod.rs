//! Test support: real servers and clients.
#![allow(dead_code)]

pub mod http;
pub mod identity;
pub mod redis;
