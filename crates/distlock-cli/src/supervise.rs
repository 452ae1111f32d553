//! The supervisor between `distlock run` and CMD.
//!
//! `distlock run` starts CMD under `distlock __supervise --parent <pid> -- CMD...`, in a new
//! process group that the supervisor leads and CMD joins. The supervisor waits for CMD and exits
//! with its status (128+N when CMD was killed by signal N). Every 50 ms it checks that its
//! parent is still the `distlock run` that started it: when `distlock` dies (SIGKILL, the OOM
//! killer, a panic, a crash), the supervisor is re-parented, and it kills its whole process
//! group with SIGKILL, itself included: CMD and everything CMD started in its group end, within
//! about 50 ms, instead of running on without the lock once the lease expires.
//!
//! Why a supervisor and not `PR_SET_PDEATHSIG`: that signal reaches one process (the direct
//! child), not the children it started (`sh -c` and its `sleep`), and it exists only on Linux.
//! The parent check is POSIX (`getppid`), so it works the same on every Unix; `distlock` does
//! not build for other platforms. What it cannot catch: a process of CMD that left the group
//! (`setsid`, a daemon that double-forks into its own group) is not ended.
//!
//! SIGINT, SIGTERM and SIGHUP sent to the group (forwarded by `distlock run`) are meant for CMD:
//! the supervisor catches and ignores them, and exits when CMD does.

use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{Pid, Signal, getppid, kill_current_process_group};
use tokio::signal::unix::{SignalKind, signal};

use crate::args::SuperviseArgs;
use crate::exit;

/// How often the supervisor checks that `distlock run` is alive.
const CHECK: Duration = Duration::from_millis(50);

fn parent_is(expected: i32) -> bool {
    getppid().map(Pid::as_raw_pid) == Some(expected)
}

/// Ends the whole group, the supervisor included.
fn end_group() -> ! {
    let _ = kill_current_process_group(Signal::KILL);
    // Not reached: the signal killed us too.
    std::process::exit(exit::SOFTWARE);
}

/// Runs CMD and returns the supervisor's exit code.
pub(crate) fn supervise(args: &SuperviseArgs) -> i32 {
    if !parent_is(args.parent) {
        // distlock died before we even started.
        end_group();
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("distlock: cannot start the supervisor: {e}");
            return exit::SOFTWARE;
        }
    };
    runtime.block_on(run(args))
}

async fn run(args: &SuperviseArgs) -> i32 {
    // Installed before CMD starts, so a signal forwarded to the group never ends the
    // supervisor (CMD starts with the default dispositions: handlers do not survive exec).
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        eprintln!("distlock: cannot install signal handlers");
        return exit::SOFTWARE;
    };
    let mut child = match tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            };
            eprintln!("distlock: cannot run {:?}: {e}", args.command[0]);
            return code;
        }
    };
    let mut check = tokio::time::interval(CHECK);
    loop {
        tokio::select! {
            status = child.wait() => {
                return match status {
                    Ok(status) => code(status),
                    Err(e) => {
                        eprintln!("distlock: waiting for CMD: {e}");
                        exit::SOFTWARE
                    }
                };
            }
            _ = check.tick() => {
                if !parent_is(args.parent) {
                    end_group();
                }
            }
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = hup.recv() => {}
        }
    }
}

/// CMD's status as an exit code: its own code, or 128+N if signal N killed it.
pub(crate) fn code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => exit::SOFTWARE,
    }
}
