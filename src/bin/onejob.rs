//! `onejob`: the operator CLI. See `onejob --help`.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    onejob::cli::main(onejob::cli::Cli::parse()).await
}
