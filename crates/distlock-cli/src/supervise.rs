//! The supervisor between `distlock run` and CMD.
//!
//! `distlock run` starts CMD under `distlock __supervise --parent <pid> --kill-after <d> --
//! CMD...`, in a new process group that the supervisor leads and CMD joins. The supervisor
//! exits only once nothing of that group runs any more, with CMD's status (128+N when CMD was
//! killed by signal N), and `distlock run` releases the lock only after that:
//!
//! * when CMD exits, what it left running in its group (a background job, a daemon that did
//!   not leave the group) gets SIGTERM (and SIGCONT, should it be stopped), and SIGKILL after
//!   `--kill-after`;
//! * a signal sent to the group by `distlock run` (SIGTERM on a lost lease, or SIGINT, SIGTERM
//!   or SIGHUP forwarded) reaches the supervisor too: what is left of the group gets SIGKILL
//!   `--kill-after` later;
//! * then the supervisor waits until the group is empty.
//!
//! To see the group empty and to signal all of it, the supervisor leaves it when this ending
//! starts, for the group of `distlock run`: the group keeps the supervisor's pid as its id, and
//! no other process can take that number while the supervisor lives. On Linux the supervisor is
//! a child subreaper, so that what CMD left behind is re-parented to it and reaped when it
//! ends: a zombie counts as a member of its group, and an init that does not reap (as in some
//! containers) would keep the group from ever being empty.
//!
//! Every 50 ms the supervisor checks that its parent is still the `distlock run` that started
//! it: when `distlock` dies (SIGKILL, the OOM killer, a panic, a crash), the supervisor is
//! re-parented, and it kills the whole group with SIGKILL: CMD and everything CMD started in
//! its group end, within about 50 ms, instead of running on without the lock once the lease
//! expires.
//!
//! Why a supervisor and not `PR_SET_PDEATHSIG`: that signal reaches one process (the direct
//! child), not the children it started (`sh -c` and its `sleep`), and it exists only on Linux.
//! The parent check is POSIX (`getppid`), so it works the same on every Unix; `distlock` does
//! not build for other platforms. What it cannot catch: a process of CMD that left the group
//! (`setsid`, a daemon that double-forks into its own group) is not ended.

use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{
    Pid, Signal, WaitOptions, getpgid, getpid, getppid, kill_current_process_group,
    kill_process_group, setpgid, test_kill_process_group, wait,
};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use crate::args::SuperviseArgs;
use crate::exit;

/// How often the supervisor checks that `distlock run` is alive.
const CHECK: Duration = Duration::from_millis(50);

/// How often the supervisor looks whether the group is empty while it ends it (it also looks
/// whenever a child of its own ends).
const EMPTY_CHECK: Duration = Duration::from_millis(10);

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

/// CMD's process group, as the supervisor ends it.
struct Group {
    /// The group's id: the supervisor's pid.
    id: Pid,
    /// The group of `distlock run`, which the supervisor joins to end CMD's.
    home: Option<Pid>,
    /// Whether the supervisor left the group.
    left: bool,
    /// When what is left of the group gets SIGKILL, once the ending started.
    kill_at: Option<Instant>,
    killed: bool,
}

impl Group {
    fn signal(&self, sig: Signal) {
        let _ = kill_process_group(self.id, sig);
    }

    /// Whether no process is left in the group (the supervisor must have left it).
    fn is_empty(&self) -> bool {
        matches!(
            test_kill_process_group(self.id),
            Err(rustix::io::Errno::SRCH)
        )
    }

    /// Starts the ending: the supervisor leaves the group, and SIGKILL follows in `kill_after`.
    fn end(&mut self, kill_after: Duration) {
        if self.kill_at.is_some() {
            return;
        }
        self.kill_at = Some(Instant::now() + kill_after);
        self.left = self
            .home
            .is_some_and(|home| setpgid(None, Some(home)).is_ok());
        if !self.left {
            // Still in the group: it can be neither seen empty nor killed without us. End it
            // now, ourselves included (distlock then sees the supervisor killed, and kills the
            // group again).
            end_group();
        }
    }

    fn kill(&mut self) {
        self.killed = true;
        self.signal(Signal::KILL);
    }
}

async fn run(args: &SuperviseArgs) -> i32 {
    // Installed before CMD starts, so a signal sent to the group never ends the supervisor
    // (CMD starts with the default dispositions: handlers do not survive exec).
    let (Ok(mut term), Ok(mut int), Ok(mut hup), Ok(mut child_ended)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
        signal(SignalKind::child()),
    ) else {
        eprintln!("distlock: cannot install signal handlers");
        return exit::SOFTWARE;
    };
    let mut group = Group {
        id: getpid(),
        home: Pid::from_raw(args.parent).and_then(|parent| getpgid(Some(parent)).ok()),
        left: false,
        kill_at: None,
        killed: false,
    };
    // What CMD leaves behind is re-parented to us, not to init: we reap it.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let _ = rustix::process::set_child_subreaper(Some(group.id));
    // Not a tokio child: the supervisor reaps every child itself (`wait` below), and Tokio's
    // own reaping of its children would race it.
    let cmd = match std::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .spawn()
    {
        Ok(child) => child.id(),
        Err(e) => {
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => exit::NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            };
            eprintln!("distlock: cannot run {:?}: {e}", args.command[0]);
            return code;
        }
    };
    let mut status = None;
    let mut check = tokio::time::interval(CHECK);
    let mut empty_check = tokio::time::interval(EMPTY_CHECK);
    loop {
        while let Ok(Some((pid, ended))) = wait(WaitOptions::NOHANG) {
            if pid.as_raw_pid().unsigned_abs() == cmd {
                status = Some(wait_code(ended));
                // CMD is done: what it left in its group is asked to end too.
                group.end(args.kill_after);
                group.signal(Signal::TERM);
                group.signal(Signal::CONT);
            }
        }
        if let Some(code) = status
            && group.left
            && group.is_empty()
        {
            return code;
        }
        let kill_at = group.kill_at.filter(|_| !group.killed);
        tokio::select! {
            _ = child_ended.recv() => {}
            _ = empty_check.tick(), if group.left => {}
            () = tokio::time::sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() => {
                group.kill();
            }
            _ = check.tick() => {
                if !parent_is(args.parent) {
                    if !group.left {
                        end_group();
                    }
                    group.kill();
                }
            }
            // Sent to the group by distlock (a lost lease, a forwarded signal): CMD's to
            // handle, and the start of the ending for the supervisor.
            _ = term.recv() => group.end(args.kill_after),
            _ = int.recv() => group.end(args.kill_after),
            _ = hup.recv() => group.end(args.kill_after),
        }
    }
}

/// A status from `wait` as an exit code: the code, or 128+N if signal N killed the process.
fn wait_code(status: rustix::process::WaitStatus) -> i32 {
    match (status.exit_status(), status.terminating_signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => exit::SOFTWARE,
    }
}

/// The supervisor's status as an exit code: its own code, or 128+N if signal N killed it.
pub(crate) fn code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => exit::SOFTWARE,
    }
}
