//! The `distlock` binary against a real redis-server: exit codes, environment, release, signals,
//! lease loss, and mutual exclusion between processes.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use distlock::LockClient;
use redis::AsyncCommands;
use testkit::RedisServer;
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_distlock");

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn distlock(
    server: &RedisServer,
    prefix: &str,
    key: &str,
    extra: &[&str],
    cmd: &[&str],
) -> Command {
    let mut c = Command::new(BIN);
    c.args([
        "run",
        "--redis",
        &server.url(),
        "--prefix",
        prefix,
        "--key",
        key,
    ])
    .args(extra)
    .arg("--")
    .args(cmd)
    .env_remove("REDIS_URL")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    c
}

struct Outcome {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn finish(child: Child) -> Outcome {
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("distlock exits")
        .unwrap();
    Outcome {
        code: out.status.code().expect("exited normally"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn run(mut c: Command) -> Outcome {
    finish(c.spawn().unwrap()).await
}

async fn lib_client(server: &RedisServer, prefix: &str) -> LockClient {
    let c = LockClient::builder()
        .prefix(prefix)
        .unwrap()
        .connect(&server.url())
        .unwrap();
    c.prepare().await.unwrap();
    c
}

/// Waits (bounded) until `path` exists.
async fn wait_for_file(path: &Path) {
    for _ in 0..400 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(ms(25)).await;
    }
    panic!("{} never appeared", path.display());
}

#[tokio::test]
async fn passes_key_and_fence_and_the_exit_code_and_releases() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-env");
    let print = ["sh", "-c", "echo \"$DISTLOCK_KEY $DISTLOCK_FENCE\"; exit 3"];
    let first = run(distlock(&server, &prefix, "nightly", &[], &print)).await;
    assert_eq!(first.code, 3, "CMD's exit code: {}", first.stderr);
    let (key, fence) = first.stdout.trim().split_once(' ').unwrap();
    assert_eq!(key, "nightly");
    let fence: u64 = fence.parse().unwrap();
    let second = run(distlock(&server, &prefix, "nightly", &[], &print)).await;
    let fence2: u64 = second
        .stdout
        .trim()
        .split_once(' ')
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert!(fence2 > fence, "fencing tokens grow across runs");
    // Released on exit: the key is gone and the library can take the lock at once.
    let client = lib_client(&server, &prefix).await;
    let guard = client.lock("nightly").unwrap().try_acquire().await.unwrap();
    assert!(guard.fence() > fence2);
}

/// A Redis that may evict keys (`maxmemory-policy` other than `noeviction`) is said on standard
/// error, and the command still runs under the lock (before: nothing was said).
#[tokio::test]
async fn an_evicting_redis_is_warned_about_on_stderr() {
    let server = RedisServer::start_with(
        testkit::ServerOptions::default()
            .arg("--maxmemory-policy")
            .arg("allkeys-lru"),
    )
    .await;
    let prefix = testkit::unique_prefix("cli-evict");
    let out = run(distlock(&server, &prefix, "job", &[], &["true"])).await;
    assert_eq!(out.code, 0, "CMD ran: {}", out.stderr);
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("maxmemory-policy allkeys-lru"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning:\n{}", out.stderr);
    assert!(
        warnings[0].starts_with("distlock: warning: "),
        "{}",
        out.stderr
    );
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
    let out = run(distlock(&server, &prefix, "job", &[], &["true"])).await;
    assert_eq!((out.code, out.stderr.as_str()), (0, ""), "nothing to say");
}

#[tokio::test]
async fn exit_codes_for_usage_unavailable_held_and_missing_commands() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-codes");

    // Bad arguments: 64 with usage.
    let out = run({
        let mut c = Command::new(BIN);
        c.args(["run", "--", "true"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    })
    .await;
    assert_eq!(out.code, 64);
    assert!(out.stderr.contains("Usage"), "{}", out.stderr);
    for extra in [
        &["--lease", "5ms"][..],
        &["--lease", "ten"],
        &["--wait", "-1s"],
    ] {
        let out = run(distlock(&server, &prefix, "k", extra, &["true"])).await;
        assert_eq!(out.code, 64, "{extra:?}: {}", out.stderr);
    }
    let out = run(distlock(&server, &prefix, "bad{name}", &[], &["true"])).await;
    assert_eq!(out.code, 64, "{}", out.stderr);
    assert!(out.stderr.contains("brace"), "{}", out.stderr);

    // Redis unreachable: 69 with the error.
    let port = testkit::free_port().unwrap();
    let out = run({
        let mut c = Command::new(BIN);
        c.args([
            "run",
            "--redis",
            &format!("redis://127.0.0.1:{port}/"),
            "--key",
            "k",
            "--",
            "true",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c
    })
    .await;
    assert_eq!(out.code, 69, "{}", out.stderr);
    assert!(out.stderr.contains("unreachable"), "{}", out.stderr);

    // Reachable, but refusing what the lock needs (an ACL user without the script commands):
    // a configuration to fix, 64 with the reason, not "unreachable" (before: 69).
    let own = RedisServer::start_owned().await;
    let mut admin = own.connection().await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all"][..])
        .arg(&["-eval", "-evalsha", "-fcall", "-function", "-script"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let out = run({
        let mut c = Command::new(BIN);
        c.args([
            "run",
            "--redis",
            &format!("redis://noscripts:pw@127.0.0.1:{}/", own.port()),
            "--key",
            "k",
            "--",
            "true",
        ])
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c
    })
    .await;
    assert_eq!(out.code, 64, "{}", out.stderr);
    assert!(!out.stderr.contains("unreachable"), "{}", out.stderr);
    assert!(out.stderr.contains("EVALSHA"), "the reason: {}", out.stderr);
    assert!(
        !out.stderr.contains(":pw@"),
        "the password is masked: {}",
        out.stderr
    );
    // Nor in a URL refused before anything is sent, in the userinfo or a query parameter.
    for url in [
        "redis://u:secret@127.0.0.1:1/notanumber",
        "redis+unix:///nowhere/redis.sock?db=x&pass=secret",
    ] {
        let out = run({
            let mut c = Command::new(BIN);
            c.args(["run", "--redis", url, "--key", "k", "--", "true"])
                .env_remove("REDIS_URL")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        })
        .await;
        assert_ne!(out.code, 0, "{url}: {}", out.stderr);
        assert!(!out.stderr.contains("secret"), "{url}: {}", out.stderr);
    }

    // Held by someone else past --wait: 75 with a message; CMD never runs.
    let client = lib_client(&server, &prefix).await;
    let _held = client.lock("busy").unwrap().try_acquire().await.unwrap();
    let out = run(distlock(
        &server,
        &prefix,
        "busy",
        &["--wait", "300ms"],
        &["echo", "ran"],
    ))
    .await;
    assert_eq!(out.code, 75, "{}", out.stderr);
    assert!(
        out.stderr.contains("held by another owner"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty());

    // CMD not found: 127, and the lock is released.
    let out = run(distlock(&server, &prefix, "k", &[], &["/nonexistent/cmd"])).await;
    assert_eq!(out.code, 127, "{}", out.stderr);
    let guard = client.lock("k").unwrap().try_acquire().await.unwrap();
    assert!(
        guard.release().await.unwrap(),
        "the CLI released before exiting"
    );
}

/// `--help` documents the exit codes.
#[tokio::test]
async fn help_lists_the_exit_codes() {
    let out = run({
        let mut c = Command::new(BIN);
        c.args(["run", "--help"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    })
    .await;
    assert_eq!(out.code, 0);
    for needle in ["64", "69", "75", "76", "DISTLOCK_FENCE"] {
        assert!(out.stdout.contains(needle), "{needle} missing from help");
    }
}

/// A command that reports SIGTERM and otherwise runs for at most 30 s (so that a failed test
/// never leaves it behind for long).
const TRAP: &str = "trap 'echo term > \"$D/term\"; exit 0' TERM; touch \"$D/started\"; i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done";

/// The lease is lost while CMD runs (the lock is deleted behind its back): CMD gets SIGTERM and
/// distlock exits 76.
#[tokio::test]
async fn lease_loss_terminates_the_command() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-loss");
    let dir = tempfile::tempdir().unwrap();
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--lease", "600ms"],
        &["sh", "-c", TRAP],
    );
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_file(&dir.path().join("started")).await;
    let mut r = server.connection().await;
    let _: () = r.del(format!("{prefix}:{{job}}")).await.unwrap();
    let out = finish(child).await;
    assert_eq!(out.code, 76, "{}", out.stderr);
    assert!(out.stderr.contains("lost"), "{}", out.stderr);
    assert!(dir.path().join("term").exists(), "CMD received SIGTERM");
}

/// Redis freezes (SIGSTOP) while CMD runs: no renewal is confirmed, the loss signal fires at
/// the end of the lease, CMD is terminated and distlock exits 76.
#[tokio::test]
async fn a_frozen_redis_means_the_lease_is_lost() {
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("cli-frozen");
    let dir = tempfile::tempdir().unwrap();
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--lease", "600ms"],
        &["sh", "-c", TRAP],
    );
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_file(&dir.path().join("started")).await;
    server.pause().await;
    let term = dir.path().join("term");
    for _ in 0..400 {
        if term.exists() {
            break;
        }
        tokio::time::sleep(ms(25)).await;
    }
    server.resume().await;
    let out = finish(child).await;
    assert_eq!(out.code, 76, "{}", out.stderr);
    assert!(term.exists(), "CMD received SIGTERM");
}

/// SIGTERM to distlock is forwarded to CMD; distlock releases after CMD exits.
#[tokio::test]
async fn signals_are_forwarded_and_the_lock_released() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-signal");
    let dir = tempfile::tempdir().unwrap();
    let mut c = distlock(&server, &prefix, "job", &[], &["sh", "-c", TRAP]);
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_file(&dir.path().join("started")).await;
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let out = finish(child).await;
    assert_eq!(
        out.code, 0,
        "CMD's own exit code after its trap: {}",
        out.stderr
    );
    assert!(dir.path().join("term").exists());
    let client = lib_client(&server, &prefix).await;
    let guard = client.lock("job").unwrap().try_acquire().await.unwrap();
    assert!(
        guard.release().await.unwrap(),
        "the CLI released after CMD exited"
    );
}

/// A background loop in CMD's process group that ignores SIGTERM and appends a line to
/// `$D/loop` every 0.1 s, for at most 30 s (so that a failed test never leaves it behind for
/// long). Its output is not distlock's (the test reads that to its end). CMD goes on after it:
/// `wait`, or `exit 0`.
const LOOP: &str = "(trap '' TERM; i=0; while [ $i -lt 300 ]; do echo x >> \"$D/loop\"; sleep 0.1; i=$((i+1)); done) >/dev/null 2>&1 &";

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Waits (bounded) until the loop has written.
async fn wait_for_loop(dir: &Path) {
    let path = dir.join("loop");
    for _ in 0..400 {
        if size(&path) > 0 {
            return;
        }
        tokio::time::sleep(ms(25)).await;
    }
    panic!("the background loop never wrote to {}", path.display());
}

/// Asserts that the loop writes no more: nothing for five of its periods from now.
async fn assert_loop_ended(dir: &Path, when: &str) {
    let path = dir.join("loop");
    let before = size(&path);
    tokio::time::sleep(ms(500)).await;
    let after = size(&path);
    assert_eq!(
        before, after,
        "CMD's background loop still ran {when} ({before} -> {after} bytes)"
    );
}

/// CMD exits and leaves a child in its process group that ignores SIGTERM: distlock ends it
/// (SIGTERM, SIGKILL after --kill-after) before it releases the lock. Before, distlock released
/// at once and exited 0, and the loop wrote on while the next holder held the lock.
#[tokio::test]
async fn what_cmd_left_running_ends_before_the_release() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-leftover");
    let dir = tempfile::tempdir().unwrap();
    // (Once the loop has written: it ignores SIGTERM from then on.)
    let cmd = format!(
        "{LOOP} i=0; while [ ! -s \"$D/loop\" ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done; exit 0"
    );
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--kill-after", "500ms"],
        &["sh", "-c", &cmd],
    );
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_loop(dir.path()).await;
    let client = lib_client(&server, &prefix).await;
    let next = client
        .lock("job")
        .unwrap()
        .acquire(Duration::from_secs(20))
        .await
        .expect("distlock released the lock");
    assert_loop_ended(dir.path(), "after distlock released the lock").await;
    drop(next);
    let out = finish(child).await;
    assert_eq!(out.code, 0, "CMD's own exit code: {}", out.stderr);
}

/// SIGTERM to distlock is forwarded to CMD's group; CMD exits, its background child ignores
/// SIGTERM and is killed after --kill-after, all before the lock is released.
#[tokio::test]
async fn a_forwarded_signal_ends_the_whole_group_before_the_release() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-signal-group");
    let dir = tempfile::tempdir().unwrap();
    let cmd = format!("{LOOP} wait");
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--kill-after", "500ms"],
        &["sh", "-c", &cmd],
    );
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_loop(dir.path()).await;
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let client = lib_client(&server, &prefix).await;
    let next = client
        .lock("job")
        .unwrap()
        .acquire(Duration::from_secs(20))
        .await
        .expect("distlock released the lock");
    assert_loop_ended(dir.path(), "after distlock released the lock").await;
    drop(next);
    let out = finish(child).await;
    assert_eq!(out.code, 128 + 15, "sh ended by SIGTERM: {}", out.stderr);
}

/// The lease is lost (another host took the lock): distlock ends CMD's whole group (SIGTERM,
/// SIGKILL after --kill-after for the child that ignores SIGTERM) before it exits 76. Before,
/// it exited 76 as soon as `sh` died and the loop wrote on under the other host's lock. (The
/// lock is already someone else's when the loss is seen: --kill-after bounds the overlap.)
#[tokio::test]
async fn a_lost_lease_ends_the_whole_group_before_distlock_exits() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-loss-group");
    let dir = tempfile::tempdir().unwrap();
    let cmd = format!("{LOOP} wait");
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--lease", "600ms", "--kill-after", "500ms"],
        &["sh", "-c", &cmd],
    );
    c.env("D", dir.path());
    let child = c.spawn().unwrap();
    wait_for_loop(dir.path()).await;
    let mut r = server.connection().await;
    let _: () = r.del(format!("{prefix}:{{job}}")).await.unwrap();
    let client = lib_client(&server, &prefix).await;
    let other = client.lock("job").unwrap().try_acquire().await.unwrap();
    let out = finish(child).await;
    assert_eq!(out.code, 76, "{}", out.stderr);
    assert_loop_ended(dir.path(), "after distlock exited 76").await;
    assert!(other.release().await.unwrap());
}

/// Whether the process `pid` is gone (or a zombie nobody reaped: it runs no more code).
#[cfg(target_os = "linux")]
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// A distlock process killed with SIGKILL cannot release: its lock lives until the lease ends,
/// then a waiter takes it. CMD's whole process group ends with it (here `sh` and the `sleep`
/// it started in the background), instead of running on without the lock.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_killed_holder_process_loses_the_lock_and_its_command_group() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-kill");
    let dir = tempfile::tempdir().unwrap();
    let cmd = "sleep 30 & echo $! > \"$D/bg\"; echo $$ > \"$D/sh\"; touch \"$D/started\"; sleep 30";
    let mut c = distlock(
        &server,
        &prefix,
        "job",
        &["--lease", "500ms"],
        &["sh", "-c", cmd],
    );
    c.env("D", dir.path());
    let mut child = c.spawn().unwrap();
    wait_for_file(&dir.path().join("started")).await;
    let pid = |name: &str| -> u32 {
        std::fs::read_to_string(dir.path().join(name))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let (sh, background) = (pid("sh"), pid("bg"));
    assert!(!dead(sh) && !dead(background), "CMD runs");
    let client = lib_client(&server, &prefix).await;
    let lock = client.lock("job").unwrap();
    assert!(lock.try_acquire().await.is_err(), "held by the CLI");
    child.kill().await.unwrap();
    let mut ended = false;
    for _ in 0..100 {
        if dead(sh) && dead(background) {
            ended = true;
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    assert!(
        ended,
        "CMD's process group outlived the killed distlock (sh dead: {}, its background sleep dead: {})",
        dead(sh),
        dead(background)
    );
    let guard = lock.acquire(Duration::from_secs(10)).await.unwrap();
    assert!(guard.fence() >= 2);
}

/// SIGTERM while distlock waits for the reply to its acquisition (a proxy holds the reply back;
/// the command ran and took the lock): distlock exits with 128+15, and the lock its attempt
/// took is freed at once, not at the end of its 30 s lease.
///
/// distlock waits for the lock first (it is held here, then released). The proxy holds back
/// only the reply of the `SET` that takes the lock (`+OK`) and what follows it on that
/// connection; the attempts that find the lock held (a `SET` answered nil, then a `GET` and
/// `PTTL`) are answered at once, whenever they were sent. (This test used to delay every reply
/// by 1.5 s from the moment distlock was seen subscribed: an attempt in flight then, which
/// found the lock held, waited 1.5 s for each of its two round trips, past the 2 s command
/// timeout, and distlock gave up with 69.)
#[tokio::test]
async fn an_interrupted_acquisition_frees_the_lock() {
    let server = RedisServer::start_owned().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("cli-interrupt");
    let client = lib_client(&server, &prefix).await;
    let held = client.lock("job").unwrap().try_acquire().await.unwrap();
    let mut c = Command::new(BIN);
    c.args([
        "run",
        "--redis",
        &proxy.url(),
        "--prefix",
        &prefix,
        "--key",
        "job",
    ])
    .args(["--lease", "30s", "--wait", "20s", "--", "true"])
    .env_remove("REDIS_URL")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let mut child = c.spawn().unwrap();
    let mut admin = server.connection().await;
    let key = format!("{prefix}:{{job}}");
    // distlock waits: it subscribed to the lock's release announcements.
    assert!(
        server
            .subscribed(&format!("{key}:rel"), Duration::from_secs(5))
            .await,
        "distlock never waited for the lock"
    );
    proxy.hold_replies_from(b"+OK");
    let ours = held.token().as_str().to_owned();
    assert!(held.release().await.unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut taken = false;
    while tokio::time::Instant::now() < deadline {
        let value: Option<String> = admin.get(&key).await.unwrap();
        if value.is_some_and(|v| v != ours) {
            taken = true;
            break;
        }
        if child.try_wait().unwrap().is_some() {
            proxy.heal();
            let out = finish(child).await;
            panic!(
                "distlock exited ({}) before its acquisition took the lock: {}",
                out.code, out.stderr
            );
        }
        tokio::time::sleep(ms(2)).await;
    }
    assert!(
        taken,
        "distlock's acquisition never took the lock within 10 s of the release"
    );
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    // The cleanup's release reaches Redis at once (its reply is held too).
    let mut freed = false;
    for _ in 0..500 {
        if !admin.exists::<_, bool>(&key).await.unwrap() {
            freed = true;
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
    proxy.heal();
    assert!(freed, "the interrupted acquisition's lock is still held");
    let out = finish(child).await;
    assert_eq!(out.code, 128 + 15, "{}", out.stderr);
}

/// Several OS processes (the CLI) and in-process tasks contend for one lock. Inside the critical
/// section each creates a marker directory (`mkdir` fails if another holder is inside) and
/// appends its fence to a log: no overlap may ever be seen, and the log must be increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_and_tasks_exclude_each_other() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-mutex");
    let dir = tempfile::tempdir().unwrap();
    let section = "mkdir \"$D/in\" 2>/dev/null || echo \"overlap $DISTLOCK_FENCE\" >> \"$D/violations\"; \
                   echo \"$DISTLOCK_FENCE\" >> \"$D/fences\"; sleep 0.01; rmdir \"$D/in\"";
    let mut processes = Vec::new();
    for _ in 0..3 {
        let server_url = server.url();
        let prefix = prefix.clone();
        let d = dir.path().to_path_buf();
        processes.push(tokio::spawn(async move {
            for _ in 0..6 {
                let out = Command::new(BIN)
                    .args([
                        "run",
                        "--redis",
                        &server_url,
                        "--prefix",
                        &prefix,
                        "--key",
                        "shared",
                    ])
                    .args(["--wait", "60s", "--", "sh", "-c", section])
                    .env("D", &d)
                    .output()
                    .await
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }));
    }
    let client = lib_client(&server, &prefix).await;
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let lock = client.lock("shared").unwrap();
        let d = dir.path().to_path_buf();
        tasks.push(tokio::spawn(async move {
            for _ in 0..6 {
                let guard = lock.acquire(Duration::from_secs(60)).await.unwrap();
                if std::fs::create_dir(d.join("in")).is_err() {
                    let line = format!("overlap {}\n", guard.fence());
                    append(&d.join("violations"), &line);
                }
                append(&d.join("fences"), &format!("{}\n", guard.fence()));
                tokio::time::sleep(ms(10)).await;
                std::fs::remove_dir(d.join("in")).unwrap();
                assert!(guard.release().await.unwrap());
            }
        }));
    }
    for t in processes.into_iter().chain(tasks) {
        t.await.unwrap();
    }
    assert!(
        !dir.path().join("violations").exists(),
        "two holders were inside at once"
    );
    let fences: Vec<u64> = std::fs::read_to_string(dir.path().join("fences"))
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(fences.len(), 36);
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences in holder order: {fences:?}"
    );
}

fn append(path: &Path, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    f.write_all(line.as_bytes()).unwrap();
}

/// Several `--redis`: Redlock across independent masters. It works with a majority up, and
/// exits 69 when no quorum can be reached.
#[tokio::test]
async fn several_redis_urls_use_redlock() {
    let nodes = RedisServer::start_many(3).await;
    let prefix = testkit::unique_prefix("cli-redlock");
    let redlock = |extra: &[&str], cmd: &[&str]| {
        let mut c = Command::new(BIN);
        c.arg("run");
        for n in &nodes {
            c.args(["--redis", &n.url()]);
        }
        c.args(["--prefix", &prefix, "--key", "job"])
            .args(extra)
            .arg("--")
            .args(cmd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let out = run(redlock(&[], &["sh", "-c", "echo $DISTLOCK_FENCE"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let first: u64 = out.stdout.trim().parse().unwrap();
    // The lock exists on every master while CMD runs, and is released on all of them after.
    let dir = tempfile::tempdir().unwrap();
    let probe = format!("touch {}/ran", dir.path().display());
    let mut check = nodes[0].connection().await;
    let out = run(redlock(&[], &["sh", "-c", &probe])).await;
    assert_eq!(out.code, 0);
    assert!(dir.path().join("ran").exists());
    let left: Vec<String> = check.keys(format!("{prefix}:{{job}}")).await.unwrap();
    assert!(left.is_empty(), "released on every master: {left:?}");

    nodes[0].stop().await;
    let out = run(redlock(&[], &["sh", "-c", "echo $DISTLOCK_FENCE"])).await;
    assert_eq!(out.code, 0, "a majority is enough: {}", out.stderr);
    let later: u64 = out.stdout.trim().parse().unwrap();
    assert!(later > first, "fences keep growing with a master down");

    nodes[1].stop().await;
    let out = run(redlock(&[], &["true"])).await;
    assert_eq!(out.code, 69, "no quorum: {}", out.stderr);
}

/// Kleppmann's scenario across processes: a `distlock run` holder is frozen (SIGSTOP) past its
/// lease; another process takes the lock and writes to a fenced resource (a Redis hash guarded
/// by a script); when the first one's command finally writes, its stale fence is refused, and
/// the first distlock, resumed, reports the lost lease (76).
#[tokio::test]
async fn a_frozen_holders_late_write_is_fenced_off() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-kleppmann");
    let dir = tempfile::tempdir().unwrap();
    let resource = format!("{prefix}:resource");
    let write = |who: &str| {
        format!(
            "redis-cli -p {port} EVAL \"$LUA\" 1 {resource} \"$DISTLOCK_FENCE\" {who}",
            port = server.port()
        )
    };
    let slow = format!(
        "trap '' TERM; touch \"$D/started\"; i=0; while [ ! -e \"$D/go\" ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done; {} > \"$D/a\"",
        write("A")
    );
    let mut a = distlock(
        &server,
        &prefix,
        "res",
        &["--lease", "600ms"],
        &["sh", "-c", &slow],
    );
    a.env("D", dir.path()).env("LUA", testkit::FENCED_WRITE_LUA);
    let a = a.spawn().unwrap();
    wait_for_file(&dir.path().join("started")).await;
    let pid = rustix::process::Pid::from_raw(a.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();

    // Meanwhile another process takes the expired lock and writes.
    let mut b = distlock(
        &server,
        &prefix,
        "res",
        &["--wait", "10s"],
        &["sh", "-c", &write("B")],
    );
    b.env("LUA", testkit::FENCED_WRITE_LUA);
    let b = run(b).await;
    assert_eq!(b.code, 0, "{}", b.stderr);
    assert_eq!(b.stdout.trim(), "1", "B's write is accepted");

    // A resumes and makes its late write.
    std::fs::write(dir.path().join("go"), "").unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    let a = finish(a).await;
    assert_eq!(a.code, 76, "A reports the lost lease: {}", a.stderr);
    let a_result = std::fs::read_to_string(dir.path().join("a")).unwrap();
    assert_eq!(a_result.trim(), "0", "A's stale write is refused");
    let mut r = server.connection().await;
    let value: String = r.hget(&resource, "v").await.unwrap();
    assert_eq!(value, "B");
}

/// One of three Redlock masters is frozen: a fresh `distlock run` starts CMD as soon as a
/// quorum answers, not after the frozen master's connection timeouts (5.2 s before).
#[tokio::test]
async fn a_frozen_redlock_master_does_not_stall_the_start() {
    let nodes = RedisServer::start_many(3).await;
    let prefix = testkit::unique_prefix("cli-frozen-master");
    let dir = tempfile::tempdir().unwrap();
    nodes[2].pause().await;
    let mut c = Command::new(BIN);
    c.arg("run");
    for n in &nodes {
        c.args(["--redis", &n.url()]);
    }
    c.args(["--prefix", &prefix, "--key", "job", "--", "sh", "-c"])
        .arg(format!("touch {}/ran", dir.path().display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = std::time::Instant::now();
    let child = c.spawn().unwrap();
    wait_for_file(&dir.path().join("ran")).await;
    let took = started.elapsed();
    let out = finish(child).await;
    nodes[2].resume().await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        took < Duration::from_millis(2_000),
        "CMD started {took:?} after distlock, stalled by the frozen master"
    );
}

/// The state letter of process `pid` in /proc (`T` stopped, `Z` zombie...), if it exists.
#[cfg(target_os = "linux")]
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Waits (bounded) until `done` holds, else panics with `what`.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        tokio::time::sleep(ms(25)).await;
    }
    panic!("{what} (waited 10 s)");
}

/// An interactive bash (job control on) in a pseudo-terminal made by util-linux `script`, with
/// what the test types as its keyboard. `$D` is the test's directory; `sh "$D/run.sh"` runs
/// distlock as a job of its own, as a user at a terminal would, its pid in `$D/distlock`.
#[cfg(target_os = "linux")]
struct Terminal {
    script: Child,
    keys: tokio::process::ChildStdin,
    dir: std::path::PathBuf,
    /// Killed (SIGKILL) if the test fails while it runs: a command stopped for good (the
    /// defects these tests catch) would otherwise keep it waiting after the test.
    distlock: Option<u32>,
}

#[cfg(target_os = "linux")]
impl Terminal {
    /// Starts the terminal and a `distlock run` job in it: `--redis`, `--prefix`, `--key job`,
    /// then `extra`, then `sh $D/cmd.sh` (written here from `cmd`).
    async fn run(
        server: &RedisServer,
        prefix: &str,
        dir: &Path,
        extra: &[&str],
        cmd: &str,
    ) -> Self {
        std::fs::write(dir.join("cmd.sh"), cmd).unwrap();
        let run = format!(
            "echo $$ > \"$D/distlock\"\nexec {BIN} run --redis {} --prefix {prefix} --key job {} -- sh \"$D/cmd.sh\"\n",
            server.url(),
            extra.join(" ")
        );
        std::fs::write(dir.join("run.sh"), run).unwrap();
        let mut c = Command::new("script");
        c.args(["-qec", "bash --norc --noprofile -i", "/dev/null"])
            .env("D", dir)
            .env("SHELL", "/bin/bash")
            .env_remove("REDIS_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut script = c.spawn().expect("util-linux script runs");
        let keys = script.stdin.take().unwrap();
        let mut terminal = Terminal {
            script,
            keys,
            dir: dir.to_path_buf(),
            distlock: None,
        };
        // Typed again until bash runs it: input typed before bash set the terminal up may be
        // dropped.
        let ready = dir.join("ready");
        for _ in 0..100 {
            terminal.type_keys("touch \"$D/ready\"\n").await;
            tokio::time::sleep(ms(100)).await;
            if ready.exists() {
                break;
            }
        }
        assert!(ready.exists(), "bash never ran a command in the terminal");
        terminal.type_keys("sh \"$D/run.sh\"\n").await;
        let pid = dir.join("distlock");
        wait_until("distlock never started in the terminal", || {
            std::fs::read_to_string(&pid).is_ok_and(|p| p.ends_with('\n'))
        })
        .await;
        terminal.distlock = Some(
            std::fs::read_to_string(&pid)
                .unwrap()
                .trim()
                .parse()
                .unwrap(),
        );
        terminal
    }

    fn distlock(&self) -> u32 {
        self.distlock.unwrap()
    }

    async fn type_keys(&mut self, text: &str) {
        use tokio::io::AsyncWriteExt;
        self.keys.write_all(text.as_bytes()).await.unwrap();
        self.keys.flush().await.unwrap();
    }

    /// Waits (bounded) for the distlock job to end and returns its exit status, as bash saw
    /// it.
    async fn status(&mut self) -> i32 {
        let pid = self.distlock();
        wait_until("distlock never exited", || dead(pid)).await;
        self.type_keys("echo $? > \"$D/status\"\n").await;
        let path = self.dir.join("status");
        wait_until("bash never said distlock's exit status", || {
            std::fs::read_to_string(&path).is_ok_and(|s| s.ends_with('\n'))
        })
        .await;
        self.distlock = None;
        std::fs::read_to_string(&path)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    async fn exit(mut self) {
        self.type_keys("exit\n").await;
        tokio::time::timeout(Duration::from_secs(30), self.script.wait())
            .await
            .expect("the terminal's bash exits")
            .unwrap();
    }
}

#[cfg(target_os = "linux")]
impl Drop for Terminal {
    fn drop(&mut self) {
        if let Some(pid) = self.distlock
            && std::thread::panicking()
            && std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.contains("distlock"))
        {
            let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// A loop in CMD's group that appends a line to `$D/loop` every 0.1 s (for at most 30 s), and
/// CMD waiting for it.
const WRITING: &str = "(i=0; while [ $i -lt 300 ]; do echo x >> \"$D/loop\"; sleep 0.1; i=$((i+1)); done) >/dev/null 2>&1 &\nwait\n";

/// distlock run at a terminal, CMD reading its input: CMD reads end-of-file and finishes.
/// Before, CMD (in a process group that is not the terminal's foreground group) was stopped by
/// SIGTTIN as it read, and distlock renewed the lease for ever.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_command_at_a_terminal_reads_no_input_instead_of_stopping() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-tty-read");
    let dir = tempfile::tempdir().unwrap();
    let cmd = "read x; echo \"[$x] $?\" > \"$D/read\"\n";
    let mut terminal = Terminal::run(&server, &prefix, dir.path(), &[], cmd).await;
    let read = dir.path().join("read");
    wait_until(
        "CMD never finished reading (stopped by SIGTTIN, reading the terminal from outside its foreground group?)",
        || std::fs::read_to_string(&read).is_ok_and(|s| s.ends_with('\n')),
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(&read).unwrap(),
        "[] 1\n",
        "end-of-file"
    );
    assert_eq!(terminal.status().await, 0);
    terminal.exit().await;
}

/// Ctrl-Z at the terminal stops CMD's process group with distlock, and `fg` continues both,
/// the lease still held. Before, Ctrl-Z stopped distlock (and its renewals) but not CMD, in
/// another process group: after one lease another host could take the lock while CMD worked on.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn ctrl_z_stops_the_command_with_distlock_and_fg_continues_both() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-ctrl-z");
    let dir = tempfile::tempdir().unwrap();
    let mut terminal = Terminal::run(&server, &prefix, dir.path(), &[], WRITING).await;
    wait_for_loop(dir.path()).await;
    terminal.type_keys("\x1a").await;
    let pid = terminal.distlock();
    wait_until("Ctrl-Z never stopped distlock", || state(pid) == Some('T')).await;
    assert_loop_ended(dir.path(), "while distlock was stopped").await;
    let client = lib_client(&server, &prefix).await;
    let lock = client.lock("job").unwrap();
    assert!(
        lock.try_acquire().await.is_err(),
        "the lease is still held (10 s)"
    );
    terminal.type_keys("fg\n").await;
    let path = dir.path().join("loop");
    let stopped_at = size(&path);
    wait_until("fg never continued CMD", || size(&path) > stopped_at).await;
    assert!(lock.try_acquire().await.is_err(), "distlock holds the lock");
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert_eq!(terminal.status().await, 128 + 15);
    terminal.exit().await;
}

/// Stopped by Ctrl-Z past the end of its lease (another owner takes the lock meanwhile), then
/// continued: CMD's group is ended before it runs anything else (its SIGTERM is pending when
/// it continues), and distlock exits 76.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn continued_after_the_lease_ran_out_the_command_ends_before_it_runs() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cli-ctrl-z-lapse");
    let dir = tempfile::tempdir().unwrap();
    let mut terminal =
        Terminal::run(&server, &prefix, dir.path(), &["--lease", "600ms"], WRITING).await;
    wait_for_loop(dir.path()).await;
    terminal.type_keys("\x1a").await;
    let pid = terminal.distlock();
    wait_until("Ctrl-Z never stopped distlock", || state(pid) == Some('T')).await;
    let client = lib_client(&server, &prefix).await;
    let other = client
        .lock("job")
        .unwrap()
        .acquire(Duration::from_secs(10))
        .await
        .expect("the stopped holder's lease runs out");
    assert_loop_ended(
        dir.path(),
        "while distlock was stopped and another owner held the lock",
    )
    .await;
    let path = dir.path().join("loop");
    let taken_at = size(&path);
    terminal.type_keys("fg\n").await;
    assert_eq!(terminal.status().await, 76);
    assert_loop_ended(dir.path(), "after distlock exited").await;
    assert_eq!(
        size(&path),
        taken_at,
        "CMD ran after it was continued, while another owner held the lock"
    );
    assert!(other.release().await.unwrap());
    terminal.exit().await;
}
