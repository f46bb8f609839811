//! `cargo run --example simulate -- ARGS` from the repository root: the simulator's command
//! line (`tower-ratelimits-simulate`), as documented in the crate.

fn main() -> std::process::ExitCode {
    tower_ratelimits_simulator::cli()
}
