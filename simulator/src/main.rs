//! `tower-ratelimits-simulate`: see the crate's documentation for the command line.

fn main() -> std::process::ExitCode {
    tower_ratelimits_simulator::cli()
}
