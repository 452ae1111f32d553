//! The lock's scripts are sent as Redis functions (`FCALL`) where the server has them, and as
//! scripts (`EVALSHA`) where it does not or the user may not use them: on a real redis-server,
//! counted with `INFO commandstats`.

use std::time::Duration;

use distlock::{LockClient, LockConfig, LockError};
use testkit::{RedisServer, ServerOptions};

const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

fn client(url: &str) -> LockClient {
    LockClient::builder()
        .prefix("app")
        .unwrap()
        .connect(url)
        .unwrap()
}

/// Takes and frees a fenced lock, an unfenced one and a reentrant one, and begins and completes
/// a run-once record: every kind of script call.
async fn exercise(c: &LockClient) {
    let lock = c.lock("job").unwrap();
    let guard = within("acquire", lock.try_acquire()).await.unwrap();
    assert!(guard.fence() >= 1, "a fenced lock");
    assert!(within("release", guard.release()).await.unwrap());
    let owner = distlock::OwnerId::new("worker-1").unwrap();
    let reentrant = c.reentrant("shared", &owner).unwrap();
    let outer = within("reentrant", reentrant.try_acquire()).await.unwrap();
    let inner = within("re-entry", reentrant.try_acquire()).await.unwrap();
    assert!(within("release", inner.release()).await.unwrap());
    assert!(within("release", outer.release()).await.unwrap());
    let once = c.once(&testkit::unique_prefix("order")).unwrap();
    match within("begin", once.begin("tag")).await.unwrap() {
        distlock::Begin::Acquired(guard) => {
            within("complete", guard.complete(b"done")).await.unwrap()
        }
        other => panic!("a new record begins: {other:?}"),
    }
    match within("begin again", once.begin("tag")).await.unwrap() {
        distlock::Begin::Done(record) => assert_eq!(&record.first()[..], b"done"),
        other => panic!("the record is stored: {other:?}"),
    }
}

/// What `work` made the server run: (`FCALL`s, `EVALSHA`s).
async fn calls_during(
    server: &RedisServer,
    work: impl std::future::Future<Output = ()>,
) -> (u64, u64) {
    let (f, e) = (
        server.command_calls("fcall").await,
        server.command_calls("evalsha").await,
    );
    work.await;
    (
        server.command_calls("fcall").await - f,
        server.command_calls("evalsha").await - e,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_run_as_functions_and_a_flushed_library_is_loaded_again() {
    let server = RedisServer::start_owned().await;
    // Not prepared: the first call finds no function and loads the library.
    let c = client(&server.url());
    let (fcalls, evalshas) = calls_during(&server, exercise(&c)).await;
    assert!(fcalls >= 8, "every call a function: {fcalls} FCALLs");
    assert_eq!(evalshas, 0, "no script sent");

    // An operator flushes the functions (or the server restarted without persistence).
    let mut admin = server.connection().await;
    let () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    let (fcalls, evalshas) = calls_during(&server, exercise(&c)).await;
    assert!(fcalls >= 8, "functions again: {fcalls} FCALLs");
    assert_eq!(evalshas, 0, "no fall back to scripts for a missing library");
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(libraries.len(), 1, "the library is back, once");
}

/// Like Redis 6, or a managed service that renamed `FCALL` away: scripts, and nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_fcall_gets_scripts() {
    let server = RedisServer::start_with(
        ServerOptions::default()
            .arg("--rename-command")
            .arg("FCALL")
            .arg(""),
    )
    .await;
    let c = client(&server.url());
    within("prepare", c.prepare()).await.unwrap();
    let (fcalls, evalshas) = calls_during(&server, exercise(&c)).await;
    assert_eq!(fcalls, 0);
    assert!(evalshas >= 8, "every call a script: {evalshas} EVALSHAs");
}

/// A user whose rules predate functions (no `FCALL`), or that may call but not load them: the
/// lock works with scripts, prepared or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_functions_gets_scripts() {
    let server = RedisServer::start_owned().await;
    let all = distlock::acl_rules("app");
    for (user, refused, prepared) in [
        ("nofcall", "-fcall -function|load", true),
        ("nofcall2", "-fcall -function|load", false),
        ("noload", "-function|load", false),
        ("noload2", "-function|load", true),
    ] {
        // A library loaded earlier would let the user call it: none here.
        let mut admin = server.connection().await;
        let () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        let url = server.acl_user(user, &format!("{all} {refused}")).await;
        let c = client(&url);
        if prepared {
            within("prepare", c.prepare()).await.unwrap();
        }
        let (fcalls, evalshas) = calls_during(&server, exercise(&c)).await;
        assert!(
            evalshas >= 8,
            "{user}: every call a script: {evalshas} EVALSHAs"
        );
        assert!(fcalls <= 1, "{user}: one refused FCALL at most: {fcalls}");
    }
}

/// A full Redis (`maxmemory` reached, no eviction) refuses what takes memory, as with scripts,
/// and still lets a holder keep its lease and release: the functions that only renew or free
/// are flagged `allow-oom`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_still_renews_and_releases() {
    let server = RedisServer::start_owned().await;
    let config = LockConfig::builder()
        .lease(Duration::from_millis(900))
        .build()
        .unwrap();
    let c = LockClient::builder()
        .config(config)
        .prefix("app")
        .unwrap()
        .connect(&server.url())
        .unwrap();
    within("prepare", c.prepare()).await.unwrap();
    let held = within("acquire", c.lock("held").unwrap().try_acquire())
        .await
        .unwrap();
    let mut admin = server.connection().await;
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    let refused = within("acquire when full", c.lock("new").unwrap().try_acquire()).await;
    let oom = matches!(&refused, Err(LockError::Redis { source, .. }) if source.to_string().contains("OOM"));
    assert!(oom, "a new lock takes memory, refused: {refused:?}");
    // Three leases' worth of renewals, each refused if renewing were refused when full.
    tokio::time::sleep(Duration::from_millis(2_700)).await;
    assert!(held.is_held(), "the lease was renewed while Redis was full");
    assert!(
        within("release when full", held.release()).await.unwrap(),
        "released while Redis was full"
    );
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut admin)
        .await
        .unwrap();
}
