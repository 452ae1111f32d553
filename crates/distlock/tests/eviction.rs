//! Eviction: a Redis whose `maxmemory-policy` is not `noeviction` may evict a held lock or a
//! stored record when it reaches `maxmemory` (and, under `allkeys-*`, a fencing counter, whose
//! fences then start again). `prepare()` reads the policy where the user may (`CONFIG GET`) and
//! warns; where it may not (an ACL user, a managed service), it says nothing and passes, and
//! sends nothing the user is refused.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::{LockClient, LockConfig};
use testkit::{RedisServer, ServerOptions};

const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

/// Captures what the lock logs.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

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

/// Warnings (and worse) the lock logs, captured for the current thread.
fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

async fn server(policy: &str) -> RedisServer {
    RedisServer::start_with(
        ServerOptions::default()
            .arg("--maxmemory-policy")
            .arg(policy),
    )
    .await
}

fn client(url: &str) -> LockClient {
    LockClient::builder()
        .config(LockConfig::default())
        .prefix("app")
        .unwrap()
        .connect(url)
        .unwrap()
}

// One thread: the subscriber set for this test sees what `prepare` logs.
#[tokio::test(flavor = "current_thread")]
async fn an_evicting_policy_is_warned_about_when_the_client_is_prepared() {
    let (logs, _default) = capture();
    for policy in ["allkeys-lru", "volatile-ttl"] {
        let server = server(policy).await;
        within("prepare", client(&server.url()).prepare())
            .await
            .expect("a warning, not a refusal");
        let text = logs.text();
        let warnings: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("maxmemory-policy"))
            .collect();
        assert_eq!(warnings.len(), 1, "one warning for {policy}:\n{text}");
        assert!(warnings[0].contains("WARN"), "{text}");
        assert!(warnings[0].contains(policy), "{text}");
        logs.clear();
    }
    let server = server("noeviction").await;
    within("prepare", client(&server.url()).prepare())
        .await
        .unwrap();
    assert_eq!(logs.text(), "", "nothing to say about noeviction");
}

/// An ACL user without `CONFIG` (the documented rules) is not sent it: `prepare()` passes, says
/// nothing about eviction, and the ACL log stays empty.
#[tokio::test(flavor = "current_thread")]
async fn a_user_without_config_is_not_asked_and_prepare_passes() {
    let (logs, _default) = capture();
    let server = server("allkeys-lru").await;
    let mut admin = server.connection().await;
    // As an administrator would for this user (the rules leave `FUNCTION LOAD` out).
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(distlock::function_library())
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = server.acl_user("locks", &distlock::acl_rules("app")).await;
    within("prepare", client(&url).prepare())
        .await
        .expect("prepared without CONFIG");
    assert_eq!(logs.text(), "", "nothing said without CONFIG");
    let log: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        log.is_empty(),
        "prepare sent a command the user may not run: {log:?}"
    );
}

/// `prepare_with_warnings` returns what `prepare` logs: the policy and `maxmemory` of every
/// evicting server, on one Redis and on each Redlock master ready with the quorum; nothing for
/// a user who may not read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warnings_name_the_server_its_policy_and_its_limit() {
    let evicting = RedisServer::start_with(
        ServerOptions::default()
            .arg("--maxmemory-policy")
            .arg("volatile-lru")
            .arg("--maxmemory")
            .arg("100mb"),
    )
    .await;
    let c = client(&evicting.url());
    match &within("prepare", c.prepare_with_warnings()).await.unwrap()[..] {
        [
            distlock::StoreWarning::Eviction {
                store,
                policy,
                maxmemory,
            },
        ] => {
            assert_eq!(store, &c.store());
            assert_eq!(policy, "volatile-lru");
            assert_eq!(*maxmemory, 100 << 20);
        }
        other => panic!("{other:?}"),
    }
    let url = evicting
        .acl_user("locks", &distlock::acl_rules("app"))
        .await;
    let warnings = within("prepare", client(&url).prepare_with_warnings())
        .await
        .unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");

    let masters = [
        server("allkeys-lru").await,
        server("allkeys-lru").await,
        server("allkeys-lru").await,
    ];
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let redlock = LockClient::builder()
        .prefix("app")
        .unwrap()
        .connect_redlock(&urls)
        .unwrap();
    let warnings = within("prepare", redlock.prepare_with_warnings())
        .await
        .unwrap();
    let mut named: Vec<&str> = warnings
        .iter()
        .map(|w| match w {
            distlock::StoreWarning::Eviction { store, policy, .. } => {
                assert_eq!(policy, "allkeys-lru");
                store.as_str()
            }
            other => panic!("{other:?}"),
        })
        .collect();
    named.sort_unstable();
    named.dedup();
    assert!(
        named.len() >= 2 && named.len() == warnings.len(),
        "a warning for each master of the quorum at least, once: {warnings:?}"
    );
    for store in named {
        assert!(
            masters
                .iter()
                .any(|m| store == format!("127.0.0.1:{}", m.port())),
            "{store} names a master"
        );
    }
}
