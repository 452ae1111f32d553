//! `distlock run`: hold the lock while a command runs.

use std::process::ExitStatus;

use distlock::{LockClient, LockConfig, LockError, LockGuard};
use std::io::IsTerminal;
use std::process::Stdio;

use rustix::process::{Pid, Signal, getpid, kill_process, kill_process_group};
use tokio::signal::unix::{SignalKind, signal};

use crate::args::RunArgs;
use crate::exit;

/// The default Redis when neither `--redis` nor `REDIS_URL` is given.
const DEFAULT_URL: &str = "redis://127.0.0.1:6379/";

fn fail(code: i32, message: impl std::fmt::Display) -> i32 {
    eprintln!("distlock: {message}");
    code
}

/// The error with its sources, on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn code_for(error: &LockError) -> i32 {
    match error {
        LockError::Held { .. } | LockError::WaitTimeout { .. } => exit::TEMPFAIL,
        e if e.is_unavailable() => exit::UNAVAILABLE,
        LockError::Config(_) => exit::USAGE,
        _ => exit::SOFTWARE,
    }
}

/// Runs the command under the lock and returns the exit code.
pub(crate) async fn run(args: RunArgs) -> i32 {
    let urls = if args.redis.is_empty() {
        vec![std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())]
    } else {
        args.redis.clone()
    };
    let mut config = LockConfig::builder().lease(args.lease);
    if let Some(cap) = args.max_hold {
        config = config.max_hold(cap);
    }
    let config = match config.build() {
        Ok(config) => config,
        Err(e) => return fail(exit::USAGE, e),
    };
    let client = match connect(&urls, &args.prefix, config) {
        Ok(client) => client,
        Err(e) => return fail(exit::USAGE, e),
    };
    let lock = match client.lock(&args.key) {
        Ok(lock) => lock,
        Err(e) => return fail(exit::USAGE, e),
    };
    // What weakens the lock's promises (an evicting Redis) is said, and CMD still runs.
    let prepared = client.prepare_with_warnings().await.map(|warnings| {
        for warning in warnings {
            eprintln!("distlock: warning: {warning}");
        }
    });
    if let Err(e) = prepared {
        let shown: Vec<String> = urls.iter().map(|u| distlock::redact_url(u)).collect();
        // Reachable, but refusing what the lock needs (an ACL user without the commands, a
        // disabled command): a configuration to fix, not an outage.
        let (code, what) = match e {
            LockError::Config(_) => (exit::USAGE, "redis refuses what the lock needs"),
            _ => (exit::UNAVAILABLE, "redis unreachable"),
        };
        return fail(
            code,
            format!("{what} ({}): {}", shown.join(", "), chain(&e)),
        );
    }
    // A signal while the lock is being acquired ends the attempt: the acquisition future is
    // dropped (a command in flight may have taken the lock: the library sends its token-based
    // cleanup), and distlock waits for that cleanup before it exits with 128+N.
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        return fail(exit::SOFTWARE, "cannot install signal handlers");
    };
    let acquire = async {
        if args.wait.is_zero() {
            lock.try_acquire().await
        } else {
            lock.acquire(args.wait).await
        }
    };
    let interrupted = tokio::select! {
        acquired = acquire => Ok(acquired),
        _ = term.recv() => Err(Signal::TERM),
        _ = int.recv() => Err(Signal::INT),
        _ = hup.recv() => Err(Signal::HUP),
    };
    let acquired = match interrupted {
        Ok(acquired) => acquired,
        Err(sig) => {
            let cleaned = client.settle(lock.config().op_timeout() * 2).await;
            if !cleaned {
                eprintln!(
                    "distlock: interrupted; the cleanup of {:?} did not finish (it expires with its lease)",
                    args.key
                );
            }
            return 128 + sig.as_raw();
        }
    };
    let guard = match acquired {
        Ok(guard) => guard,
        Err(e) => {
            let code = code_for(&e);
            let message = match code {
                exit::TEMPFAIL => format!(
                    "lock {:?} is held by another owner; not acquired within --wait {:?}",
                    args.key, args.wait
                ),
                exit::UNAVAILABLE => format!("redis unreachable: {}", chain(&e)),
                _ => chain(&e),
            };
            return fail(code, message);
        }
    };
    if args.verbose {
        eprintln!(
            "distlock: acquired {:?} (fence {})",
            args.key,
            guard.fence()
        );
    }
    let code = supervise(&args, &guard, (term, int, hup)).await;
    match guard.release().await {
        Ok(true) => {
            if args.verbose {
                eprintln!("distlock: released {:?}", args.key);
            }
        }
        Ok(false) => eprintln!(
            "distlock: lock {:?} was no longer ours at release",
            args.key
        ),
        Err(e) => eprintln!(
            "distlock: release of {:?} failed ({}); it expires with its lease",
            args.key,
            chain(&e)
        ),
    }
    code
}

fn connect(
    urls: &[String],
    prefix: &str,
    config: LockConfig,
) -> Result<LockClient, distlock::ConfigError> {
    let builder = LockClient::builder().config(config).prefix(prefix)?;
    match urls {
        [url] => builder.connect(url),
        _ => builder.connect_redlock(urls),
    }
}

type Signals = (
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
);

/// Spawns CMD under the supervisor (see `supervise.rs`: it leads CMD's process group, ends
/// what CMD leaves in it, and ends it all if distlock dies) and waits for it, until nothing of
/// the group runs; terminates the group if the lease is lost, and forwards signals.
async fn supervise(args: &RunArgs, guard: &LockGuard, signals: Signals) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            return fail(
                exit::SOFTWARE,
                format!("cannot find the distlock binary: {e}"),
            );
        }
    };
    let mut command = tokio::process::Command::new(exe);
    command
        .arg("__supervise")
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--kill-after")
        .arg(format!("{}ms", args.kill_after.as_millis()))
        .arg("--")
        .args(&args.command)
        .env("DISTLOCK_KEY", &args.key)
        .env("DISTLOCK_FENCE", guard.fence().to_string())
        .process_group(0);
    if std::io::stdin().is_terminal() {
        // CMD's group is not the terminal's foreground group: reading the terminal would stop
        // it (SIGTTIN) while distlock renews the lease for ever. Handing it the terminal
        // instead would put Ctrl-Z and Ctrl-C out of distlock's reach. So no terminal input:
        // it reads end-of-file. (Pipes and files on stdin are passed on.)
        command.stdin(Stdio::null());
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => return fail(exit::SOFTWARE, format!("cannot start the supervisor: {e}")),
    };
    let group = child
        .id()
        .and_then(|id| Pid::from_raw(id as i32))
        .expect("a spawned child has a pid");
    let send = |sig: Signal| {
        let _ = kill_process_group(group, sig);
    };
    let (mut term, mut int, mut hup) = signals;
    // Job control: Ctrl-Z stops CMD's group with distlock, `fg` or `bg` continues both.
    let (Ok(mut tstp), Ok(mut cont)) = (
        signal(SignalKind::from_raw(Signal::TSTP.as_raw())),
        signal(SignalKind::from_raw(Signal::CONT.as_raw())),
    ) else {
        send(Signal::KILL);
        let _ = child.wait().await;
        return fail(exit::SOFTWARE, "cannot install signal handlers");
    };
    let mut lost = false;
    // Continued (after Ctrl-Z, or a SIGSTOP from anyone): CMD's group goes on with distlock if
    // the lease is still proven held; if not, it was not renewed while distlock was stopped and
    // another owner may hold the lock: the group is ended before it runs anything else (the
    // SIGTERM is pending when it continues).
    let resume = |lost: &mut bool| {
        if !*lost && !guard.is_held() {
            *lost = true;
            eprintln!(
                "distlock: continued after the lease on {:?} ran out; ending CMD's process group {} (SIGTERM, SIGKILL after {:?})",
                args.key,
                group.as_raw_pid(),
                args.kill_after
            );
            send(Signal::TERM);
        }
        send(Signal::CONT);
    };
    // The supervisor exits once nothing of the group runs (see `supervise.rs`).
    let status: std::io::Result<ExitStatus> = loop {
        tokio::select! {
            status = child.wait() => break status,
            reason = guard.lost(), if !lost => {
                lost = true;
                eprintln!(
                    "distlock: lease on {:?} lost ({reason}); ending CMD's process group {} (SIGTERM, SIGKILL after {:?})",
                    args.key,
                    group.as_raw_pid(),
                    args.kill_after
                );
                send(Signal::TERM);
                send(Signal::CONT);
            }
            _ = tstp.recv() => {
                // Stopped for sure (SIGSTOP: CMD may ignore SIGTSTP), then ourselves.
                send(Signal::STOP);
                let _ = kill_process(getpid(), Signal::STOP);
                resume(&mut lost);
            }
            _ = cont.recv() => resume(&mut lost),
            _ = term.recv() => send(Signal::TERM),
            _ = int.recv() => send(Signal::INT),
            _ = hup.recv() => send(Signal::HUP),
        }
    };
    if status.as_ref().map_or(true, |s| s.code().is_none()) {
        // The supervisor itself was killed: whatever is left of the group must not run on.
        send(Signal::KILL);
    }
    if lost {
        return exit::LEASE_LOST;
    }
    match status {
        Ok(status) => crate::supervise::code(status),
        Err(e) => fail(exit::SOFTWARE, format!("waiting for CMD: {e}")),
    }
}
