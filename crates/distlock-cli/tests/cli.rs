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

/// SIGTERM while distlock waits for the reply to its acquisition (a proxy holds replies back;
/// the command ran and took the lock): distlock exits with 128+15, and the lock its attempt
/// took is freed at once, not at the end of its 30 s lease.
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
    let child = c.spawn().unwrap();
    let mut admin = server.connection().await;
    let key = format!("{prefix}:{{job}}");
    // distlock waits: it subscribed to the lock's release announcements.
    assert!(
        server
            .subscribed(&format!("{key}:rel"), Duration::from_secs(5))
            .await,
        "distlock never waited for the lock"
    );
    // Every reply from here on arrives 0.8 s late. An attempt that sees the lock held takes
    // two round trips (`SET NX`, then `GET` and `PTTL`): 1.6 s, below distlock's 2 s operation
    // timeout (its lease is 30 s), so an attempt on its way now (the one that follows the
    // subscription comes right then) gets its late "held" answer without failing, and the
    // next attempt takes the lock. The test sees that at once in Redis and signals distlock
    // while that attempt's reply is still held back. (At 1.5 s, an attempt whose two round
    // trips were both held back timed out and distlock exited 69.)
    proxy.delay_replies(ms(800));
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
        tokio::time::sleep(ms(2)).await;
    }
    assert!(
        taken,
        "distlock's acquisition never ran within 10 s of the release"
    );
    let pid = rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut freed = false;
    for _ in 0..100 {
        if !admin.exists::<_, bool>(&key).await.unwrap() {
            freed = true;
            break;
        }
        tokio::time::sleep(ms(10)).await;
    }
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
