//! `onejob`: the operator CLI. See `onejob --help`.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    onejob::operator::cli::main(onejob::operator::cli::Cli::parse()).await
}
