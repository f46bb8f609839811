//! Where `cargo test` put this package's example binaries.
#![allow(dead_code)]

use std::path::PathBuf;

/// `target/<profile>/examples/<name>`: the test binary is `target/<profile>/deps/<test>-<hash>`.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}
