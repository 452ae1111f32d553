//! `distlock run --redis URL --key NAME --lease 10s --wait 30s -- CMD ARGS...`
//!
//! Runs CMD while holding a distributed lock in Redis, renewing it as long as CMD runs, like
//! `flock(1)` or `etcdctl lock` for shell scripts and cron jobs on several machines. See
//! `distlock run --help` for the options and exit codes.

mod args;
mod exit;
mod run;
mod supervise;

use clap::Parser;
use clap::error::ErrorKind;

fn main() {
    let cli = match args::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => exit::USAGE,
                _ => exit::USAGE,
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    if let args::Command::Supervise(args) = &cli.command {
        std::process::exit(supervise::supervise(args));
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("distlock: cannot start the runtime: {e}");
            std::process::exit(exit::SOFTWARE);
        }
    };
    let code = match cli.command {
        args::Command::Run(args) => runtime.block_on(run::run(args)),
        args::Command::Supervise(_) => exit::SOFTWARE,
    };
    drop(runtime);
    std::process::exit(code);
}
