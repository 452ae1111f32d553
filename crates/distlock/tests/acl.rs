//! The lock as a least-privilege ACL user: the documented rules (`distlock::acl_rules`) are
//! enough for every kind of lock and for notifications; without channel rights waiters poll
//! after one warning; a user refused a command the lock needs, or the keys under its prefix,
//! gets a configuration error naming it at `prepare()`, and so does a server that renamed a
//! command away. (The whole behavioural suite also runs as such a user: `TESTKIT_ACL` in
//! `scripts/test.sh`.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::{Begin, ConfigError, LockClient, LockConfig, LockError, OwnerId};
use testkit::{RedisServer, ServerOptions};

const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

fn client(url: &str, prefix: &str, config: LockConfig) -> LockClient {
    LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .connect(url)
        .unwrap()
}

fn refusal(result: Result<(), LockError>) -> (&'static str, String) {
    match result {
        Err(LockError::Config(ConfigError::Invalid { field, reason })) => (field, reason),
        other => panic!("expected a configuration error naming the refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_rules_are_enough_for_every_lock_and_for_notifications() {
    let server = RedisServer::start_owned().await;
    let url = server.acl_user("locks", &distlock::acl_rules("app")).await;
    // No polling: a waiter that gets the lock was woken by the announcement.
    let config = LockConfig::builder().polling(false).build().unwrap();
    let c = client(&url, "app", config);
    within("prepare", c.prepare())
        .await
        .expect("prepare as the ACL user");

    let lock = c.lock("job").unwrap();
    let held = within("acquire", lock.try_acquire()).await.unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.acquire(Duration::from_secs(15)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(within("release", held.release()).await.unwrap());
    let next = within("the waiter is woken", waiter)
        .await
        .unwrap()
        .unwrap();
    within("release", next.release()).await.unwrap();

    // Renewals (the watchdog's PEXPIRE in a script): held across three leases.
    let short = LockConfig::builder()
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let renewed = client(&url, "app", short);
    let guard = within("acquire", renewed.lock("long").unwrap().try_acquire())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(
        guard.is_held(),
        "the watchdog renewed the lease as the ACL user"
    );
    assert!(within("release", guard.release()).await.unwrap());

    let me = OwnerId::random();
    let outer = within(
        "reentrant",
        c.reentrant("ledger", &me).unwrap().try_acquire(),
    )
    .await
    .unwrap();
    let inner = within(
        "reentrant",
        c.reentrant("ledger", &me).unwrap().try_acquire(),
    )
    .await
    .unwrap();
    within("release", inner.release()).await.unwrap();
    within("release", outer.release()).await.unwrap();

    let once = c.once("evt").unwrap();
    let Begin::Acquired(guard) = within("begin", once.begin("t")).await.unwrap() else {
        panic!("a fresh run-once lock is free")
    };
    within("complete", guard.complete(b"done")).await.unwrap();
    assert!(
        matches!(within("replay", once.begin("t")).await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"done"))
    );

    // And nothing outside the prefix: the same user cannot touch another prefix's locks.
    let other = client(&url, "other", LockConfig::default());
    let (field, reason) = refusal(within("prepare", other.prepare()).await);
    assert_eq!(field, "acl", "{reason}");
    assert!(reason.contains("keys"), "{reason}");
}

/// Captures what the lock logs.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

// One thread: the subscriber set for this test sees the notification task's warning.
#[tokio::test(flavor = "current_thread")]
async fn without_channel_rights_waiters_poll_after_one_warning() {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let server = RedisServer::start_owned().await;
    let rules = distlock::acl_rules("app").replace("&app:*", "");
    assert!(!rules.contains('&'), "no channel pattern left: {rules}");
    let url = server.acl_user("nochannels", &rules).await;
    let c = client(&url, "app", LockConfig::default());
    within("prepare", c.prepare()).await.expect("prepare");
    let lock = c.lock("job").unwrap();
    for round in 0..3 {
        let held = within("acquire", lock.try_acquire()).await.unwrap();
        let waiter = tokio::spawn({
            let lock = lock.clone();
            async move { lock.acquire(Duration::from_secs(15)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            within("release", held.release()).await.unwrap(),
            "round {round}: the release happened although its announcement was refused"
        );
        let next = within("the waiter polls", waiter).await.unwrap().unwrap();
        within("release", next.release()).await.unwrap();
    }
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let warnings = text.matches("notifications refused").count();
    assert_eq!(warnings, 1, "one warning, not one per wait:\n{text}");
    // A purge deletes the record although its announcement (for replay caches) is refused.
    let once = c.once("evt").unwrap();
    let Begin::Acquired(guard) = within("begin", once.begin("t")).await.unwrap() else {
        panic!("a new name is taken");
    };
    within("complete", guard.complete(b"done")).await.unwrap();
    assert_eq!(
        within("purge", once.purge()).await.unwrap(),
        distlock::once::Purged::Deleted
    );
    assert!(matches!(
        within("begin", once.begin("t")).await.unwrap(),
        Begin::Acquired(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_command_is_named_when_the_client_is_prepared() {
    let server = RedisServer::start_owned().await;
    let all = distlock::acl_rules("app");
    // Refused functions alone are no refusal: the lock sends scripts (tests/functions.rs).
    for (refused, name) in [
        ("-fcall -evalsha", "EVALSHA"),
        ("-script|load", "SCRIPT LOAD"),
    ] {
        let user = format!("no{}", name.replace(' ', "").to_lowercase());
        let url = server.acl_user(&user, &format!("{all} {refused}")).await;
        let c = client(&url, "app", LockConfig::default());
        let started = std::time::Instant::now();
        let (field, reason) = refusal(within("prepare", c.prepare()).await);
        assert_eq!(field, "acl", "{reason}");
        assert!(reason.contains(name), "{refused} named: {reason}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a refusal is an answer, not a timeout"
        );
    }
}

/// A user refused one of the commands the lock sends on its keys (the fencing draw `HINCRBY`,
/// the lease's `PEXPIRE`, the run-once record's `HSET`, `HMGET` and `RPUSH`) is told at
/// `prepare()`, which names the command, on one Redis and on Redlock (before: `prepare()`
/// passed, the release script it ran needing none of them, and the first acquisition failed).
/// Nothing is run to find out (`redis.acl_check_cmd`): the ACL log stays empty (with the
/// function library loaded by an administrator, as the documented rules leave `FUNCTION LOAD`
/// out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_command_of_the_lock_is_named_when_the_client_is_prepared() {
    let server = RedisServer::start_owned().await;
    let all = distlock::acl_rules("app");
    let mut admin = server.connection().await;
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(distlock::function_library())
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut failures = Vec::new();
    for command in ["HINCRBY", "PEXPIRE", "HSET", "HMGET", "RPUSH"] {
        let user = format!("no{}", command.to_lowercase());
        let rules = format!("{all} -{}", command.to_lowercase());
        let url = server.acl_user(&user, &rules).await;
        for redlock in [false, true] {
            let builder = LockClient::builder().prefix("app").unwrap();
            let c = if redlock {
                builder.connect_redlock(&[url.as_str()]).unwrap()
            } else {
                builder.connect(&url).unwrap()
            };
            let case = format!("without {command}, redlock {redlock}");
            match within("prepare", c.prepare()).await {
                Err(LockError::Config(ConfigError::Invalid { field, reason }))
                    if field == "acl" && reason.contains(command) => {}
                other => failures.push(format!("{case}: {other:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(log.is_empty(), "prepare ran a refused command: {log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_the_script_commands_is_named_when_the_client_is_prepared() {
    // As managed services that disable scripting do: the commands are gone (renamed away).
    let server = RedisServer::start_with(
        ServerOptions::default()
            .arg("--rename-command")
            .arg("FCALL")
            .arg("")
            .arg("--rename-command")
            .arg("EVALSHA")
            .arg(""),
    )
    .await;
    let c = client(&server.url(), "app", LockConfig::default());
    let (field, reason) = refusal(within("prepare", c.prepare()).await);
    assert_eq!(field, "commands", "{reason}");
    assert!(reason.contains("EVALSHA"), "{reason}");
}

/// A server that renamed away a command the lock's scripts call (here `HINCRBY`, the fencing
/// draw) is named when the client is prepared (before: `prepare()` passed, and every fenced
/// acquisition failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_a_command_the_scripts_call_is_named_when_the_client_is_prepared() {
    let server = RedisServer::start_with(
        ServerOptions::default()
            .arg("--rename-command")
            .arg("HINCRBY")
            .arg(""),
    )
    .await;
    let c = client(&server.url(), "app", LockConfig::default());
    let (field, reason) = refusal(within("prepare", c.prepare()).await);
    assert_eq!(field, "commands", "{reason}");
    assert!(reason.contains("HINCRBY"), "{reason}");
}

/// The documented rules are all the lock's connections use: nothing they send is refused, so
/// the server's ACL log (what a security audit reads) stays empty, once an administrator loaded
/// the function library (the rules leave `FUNCTION LOAD` out; without the library each
/// connection is refused it once, then sends scripts: tests/functions.rs). (redis-rs sends
/// `CLIENT SETINFO` on every new connection; Valkey and Redis 7.2+ would log its refusal, and
/// Redis 7.0 cannot even name it in a rule.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_user_leaves_nothing_in_the_acl_log() {
    let server = RedisServer::start_owned().await;
    let url = server.acl_user("quiet", &distlock::acl_rules("app")).await;
    let mut admin = server.connection().await;
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(distlock::function_library())
        .query_async(&mut admin)
        .await
        .unwrap();
    let () = redis::cmd("ACL")
        .arg("LOG")
        .arg("RESET")
        .query_async(&mut admin)
        .await
        .unwrap();
    for redlock in [false, true] {
        let builder = LockClient::builder().prefix("app").unwrap();
        let c = if redlock {
            builder.connect_redlock(&[url.as_str()]).unwrap()
        } else {
            builder.connect(&url).unwrap()
        };
        within("prepare", c.prepare()).await.unwrap();
        let lock = c.lock("job").unwrap();
        let held = within("acquire", lock.try_acquire()).await.unwrap();
        let waiter = tokio::spawn({
            let lock = lock.clone();
            async move { lock.acquire(Duration::from_secs(15)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        within("release", held.release()).await.unwrap();
        let next = within("the waiter", waiter).await.unwrap().unwrap();
        within("release", next.release()).await.unwrap();
    }
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(log.is_empty(), "refusals in the ACL log: {log:?}");
}

/// Every `ACL SETUSER` line the documentation shows is exactly what `acl_rules` gives (and so
/// what these tests run under).
#[test]
fn the_documented_acl_lines_are_the_tested_rules() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = [
        here.join("README.md"),
        here.join("src/lib.rs"),
        here.join("../../README.md"),
        here.join("../../src/lib.rs"),
    ];
    let mut seen = 0;
    for file in &files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for line in text.lines().filter(|l| l.contains("ACL SETUSER")) {
            let Some((_, rules)) = line.split_once(">PASSWORD ") else {
                continue;
            };
            let rules = rules.trim_end_matches('.');
            if rules.ends_with("...") {
                continue;
            }
            let prefix = rules
                .split_whitespace()
                .find_map(|r| r.strip_prefix('~')?.strip_suffix(":*"))
                .unwrap_or_else(|| panic!("no key pattern in {}: {line}", file.display()));
            assert_eq!(
                rules,
                distlock::acl_rules(prefix),
                "{} documents other rules",
                file.display()
            );
            seen += 1;
        }
    }
    assert!(seen >= 4, "the ACL line is documented in each file: {seen}");
}

/// Through Sentinel, the master is reached as the ACL user (its credentials are separate from
/// the sentinels'), with the documented rules: `ROLE` lets the client check the master it is
/// given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_master_as_the_acl_user() {
    use distlock::sentinel::SentinelConnection;
    let group = testkit::RedisSentinel::start(1).await;
    let rules = distlock::acl_rules("app");
    // ACL users belong to each server: every server a failover may promote has the user.
    let mut url = String::new();
    for server in group.servers() {
        url = server.acl_user("locks", &rules).await;
    }
    let info = redis::IntoConnectionInfo::into_connection_info(url.as_str()).unwrap();
    let password = info.redis_settings().password().unwrap().to_owned();
    let client = LockClient::builder()
        .prefix("app")
        .unwrap()
        .sentinel_with(
            SentinelConnection::builder(&group.sentinel_urls(), testkit::SENTINEL_SERVICE)
                .master_auth(Some("locks"), &password),
        )
        .unwrap();
    within("prepare through the sentinels", client.prepare())
        .await
        .expect("the master answers the ACL user");
    let lock = client.lock("job").unwrap();
    let guard = within("acquire", lock.try_acquire()).await.unwrap();
    let mut master = group.servers()[0].connection().await;
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut master)
        .await
        .unwrap();
    assert!(
        clients.lines().any(|l| l.contains(" user=locks ")),
        "the lock's connection is the ACL user's: {clients}"
    );
    assert!(within("release", guard.release()).await.unwrap());

    // With a wrong password the master refuses, and prepare says so.
    let wrong = LockClient::builder()
        .prefix("app")
        .unwrap()
        .sentinel_with(
            SentinelConnection::builder(&group.sentinel_urls(), testkit::SENTINEL_SERVICE)
                .master_auth(Some("locks"), "wrong"),
        )
        .unwrap();
    assert!(
        within("prepare with a wrong password", wrong.prepare())
            .await
            .is_err()
    );
}
