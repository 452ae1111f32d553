//! Command-line arguments.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Run a command while holding a distributed lock in Redis (like flock(1), across machines).
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_help = crate::exit::TABLE)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Acquire the lock, run CMD while renewing it, release it when CMD ends.
    ///
    /// CMD gets DISTLOCK_KEY (the lock name) and DISTLOCK_FENCE (the fencing token: strictly
    /// greater than that of every earlier holder; pass it with your writes) in its environment.
    /// CMD runs in its own process group, led by a small supervisor (distlock itself). SIGINT,
    /// SIGTERM and SIGHUP sent to distlock are forwarded to the group. The lock is released only
    /// once nothing of the group runs: when CMD exits, what it left running in its group (a
    /// background job) gets SIGTERM, then SIGKILL after --kill-after; after a forwarded signal
    /// or a lost lease (SIGTERM), what is left of the group gets SIGKILL after --kill-after.
    /// Processes that left the group (setsid, daemons) are not followed. If distlock dies
    /// (SIGKILL, OOM, a crash), the supervisor kills the whole group: nothing of CMD runs on
    /// without the lock.
    ///
    /// Ctrl-Z (SIGTSTP) stops CMD's group with distlock; fg or bg (SIGCONT) continues both.
    /// The lease is not renewed while distlock is stopped: continued after it ran out (another
    /// owner may hold the lock), CMD's group gets SIGTERM before it runs anything else, SIGKILL
    /// after --kill-after, and distlock exits 76. At a terminal CMD gets no input (stdin is
    /// /dev/null): its group is not the terminal's foreground group, and reading the terminal
    /// would stop it. Pipes and files on stdin are passed on.
    #[command(after_help = crate::exit::TABLE)]
    Run(RunArgs),
    /// (Internal) The supervisor `run` starts CMD under: it leads CMD's process group and ends
    /// the whole group if `distlock` dies.
    #[command(hide = true, name = "__supervise")]
    Supervise(SuperviseArgs),
}

#[derive(Debug, Args)]
pub(crate) struct SuperviseArgs {
    /// The pid of the `distlock run` process to watch.
    #[arg(long)]
    pub(crate) parent: i32,

    /// How long what is left of CMD's group has after SIGTERM, before SIGKILL.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) kill_after: Duration,

    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub(crate) command: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// Redis URL. Give it once for a single Redis; more than once for Redlock across
    /// independent masters. Default: $REDIS_URL, else redis://127.0.0.1:6379/
    #[arg(long = "redis", value_name = "URL")]
    pub(crate) redis: Vec<String>,

    /// Lock name (no braces or control characters).
    #[arg(long, value_name = "NAME")]
    pub(crate) key: String,

    /// Lease: how long the lock survives without renewal (renewed every lease/3 while CMD runs).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) lease: Duration,

    /// How long to wait for the lock; 0 tries once.
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration)]
    pub(crate) wait: Duration,

    /// Cap on the total hold time: after it the lease is not renewed and CMD is terminated.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) max_hold: Option<Duration>,

    /// How long CMD's process group has to end after SIGTERM (the lease lost, a signal
    /// forwarded, or CMD exited and left processes in its group), before SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) kill_after: Duration,

    /// Key prefix in Redis.
    #[arg(long, value_name = "PREFIX", default_value = distlock::DEFAULT_PREFIX)]
    pub(crate) prefix: String,

    /// Say on stderr when the lock is acquired and released.
    #[arg(long, short)]
    pub(crate) verbose: bool,

    /// The command and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub(crate) command: Vec<String>,
}

/// Parses `10s`, `500ms`, `2m`, `1h`, `1.5s`, or a plain number of seconds.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (examples: 500ms, 10s, 2m, 1h)"))?;
    let scale = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use ms, s, m or h)"
            ));
        }
    };
    let duration =
        Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))?;
    // Deadlines are computed from these (`--kill-after` after a lost lease): far beyond any
    // use, and far below what `Instant` can hold.
    if duration > LONGEST {
        return Err(format!("{text:?} is longer than 100 years"));
    }
    Ok(duration)
}

/// The longest duration accepted on the command line: about 100 years.
const LONGEST: Duration = Duration::from_secs(100 * 365 * 86_400);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("10").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        for bad in ["", "s", "10x", "-1s", "1e9999s", "ten"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    /// `--kill-after 10000000000000000000` parsed, and the supervisor panicked adding it to
    /// the clock when the lease was lost (exit 101, CMD killed at once instead of after it).
    #[test]
    fn durations_beyond_a_century_are_refused() {
        assert!(parse_duration("876000h").is_ok(), "100 years fit");
        for huge in ["10000000000000000000", "876001h", "5000000000m"] {
            let refused = parse_duration(huge).unwrap_err();
            assert!(
                refused.contains("longer than 100 years"),
                "{huge}: {refused}"
            );
        }
    }

    #[test]
    fn the_command_comes_after_two_dashes() {
        let cli =
            Cli::try_parse_from(["distlock", "run", "--key", "k", "--", "echo", "--key"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run")
        };
        assert_eq!(args.command, ["echo", "--key"]);
        assert!(Cli::try_parse_from(["distlock", "run", "--key", "k"]).is_err());
    }
}
