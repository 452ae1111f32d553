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

/// What `work` made the server run: `FCALL`s (run, refused before running) and `EVALSHA`s run.
async fn calls_during(
    server: &RedisServer,
    work: impl std::future::Future<Output = ()>,
) -> (u64, u64, u64) {
    let count = || async {
        (
            server.command_calls("fcall").await,
            server.command_rejections("fcall").await,
            server.command_calls("evalsha").await,
        )
    };
    let (f, r, e) = count().await;
    work.await;
    let (f2, r2, e2) = count().await;
    (f2 - f, r2 - r, e2 - e)
}

async fn flush_functions(server: &RedisServer) {
    let () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
}

/// Loads the lock's library as an administrator would.
async fn load_library(server: &RedisServer) {
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(distlock::function_library())
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_run_as_functions_and_a_flushed_library_is_loaded_again() {
    let server = RedisServer::start_owned().await;
    // Not prepared: the first call finds no function and loads the library.
    let c = client(&server.url());
    let (fcalls, _, evalshas) = calls_during(&server, exercise(&c)).await;
    assert!(fcalls >= 8, "every call a function: {fcalls} FCALLs");
    assert_eq!(evalshas, 0, "no script sent");

    // An operator flushes the functions (or the server restarted without persistence).
    flush_functions(&server).await;
    let (fcalls, _, evalshas) = calls_during(&server, exercise(&c)).await;
    assert!(fcalls >= 8, "functions again: {fcalls} FCALLs");
    assert_eq!(evalshas, 0, "no fall back to scripts for a missing library");
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
    assert_eq!(libraries.len(), 1, "the library is back, once");
    // Another client finds it loaded: `FUNCTION LOAD` answers that it exists, which is no error.
    let other = client(&server.url());
    within("prepare", other.prepare()).await.unwrap();
    let (fcalls, _, evalshas) = calls_during(&server, exercise(&other)).await;
    assert!(
        fcalls >= 8 && evalshas == 0,
        "{fcalls} FCALLs, {evalshas} EVALSHAs"
    );
}

/// Like Redis 6, or a managed service that renamed `FCALL` away: scripts, and nothing fails,
/// prepared or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_fcall_gets_scripts() {
    let server = RedisServer::start_with(
        ServerOptions::default()
            .arg("--rename-command")
            .arg("FCALL")
            .arg(""),
    )
    .await;
    for prepared in [false, true] {
        let c = client(&server.url());
        if prepared {
            within("prepare", c.prepare()).await.unwrap();
        }
        let (_, _, evalshas) = calls_during(&server, exercise(&c)).await;
        assert!(
            evalshas >= 8,
            "prepared {prepared}: every call a script: {evalshas} EVALSHAs"
        );
    }
}

/// A user refused `FCALL` runs scripts after one refusal; a user that may call but not load
/// functions (the documented rules) runs scripts until an administrator loads the library,
/// then functions: prepared or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_refused_functions_get_scripts() {
    let server = RedisServer::start_owned().await;
    let all = distlock::acl_rules("app");
    // `prepare` (when called) and the work, counted together.
    let run = |url: String, prepared: bool| async move {
        let c = client(&url);
        if prepared {
            within("prepare", c.prepare()).await.unwrap();
        }
        exercise(&c).await;
    };
    for prepared in [false, true] {
        flush_functions(&server).await;
        let url = server.acl_user("nofcall", &format!("{all} -fcall")).await;
        let (fcalls, refused, evalshas) = calls_during(&server, run(url, prepared)).await;
        assert!(evalshas >= 8, "every call a script: {evalshas} EVALSHAs");
        assert_eq!((fcalls, refused), (0, 1), "one refused FCALL, then scripts");

        // The documented rules: FCALL, not FUNCTION LOAD. The library is not there: scripts.
        let url = server.acl_user("locks", &all).await;
        let (fcalls, _, evalshas) = calls_during(&server, run(url.clone(), prepared)).await;
        assert!(evalshas >= 8, "every call a script: {evalshas} EVALSHAs");
        assert!(fcalls <= 1, "one FCALL found no function: {fcalls}");

        // An administrator loads the library: a new client of the same user calls it.
        load_library(&server).await;
        let (fcalls, refused, evalshas) = calls_during(&server, run(url, prepared)).await;
        assert!(fcalls >= 8, "every call a function: {fcalls} FCALLs");
        assert_eq!((refused, evalshas), (0, 0));
    }
}

async fn config_set(server: &RedisServer, name: &str, value: &str) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
}

/// A full Redis (`maxmemory` reached, no eviction) refuses what takes memory, as with scripts,
/// and still lets a holder keep its lease and release (the functions that only renew or free
/// are flagged `allow-oom`), answers a replay (`begin` finding the record: a function without
/// flags is refused whole when full, so that call goes as a script), and does all of it with
/// the library gone too (`FUNCTION LOAD` is refused when full: those calls go as scripts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_still_renews_releases_and_replays() {
    let server = RedisServer::start_owned().await;
    let config = LockConfig::builder()
        .lease(Duration::from_millis(900))
        .build()
        .unwrap();
    for library in [true, false] {
        let c = LockClient::builder()
            .config(config.clone())
            .prefix("app")
            .unwrap()
            .connect(&server.url())
            .unwrap();
        within("prepare", c.prepare()).await.unwrap();
        let held = within("acquire", c.lock("held").unwrap().try_acquire())
            .await
            .unwrap();
        let once = c.once(&testkit::unique_prefix("order")).unwrap();
        match within("begin", once.begin("tag")).await.unwrap() {
            distlock::Begin::Acquired(guard) => {
                within("complete", guard.complete(b"done")).await.unwrap()
            }
            other => panic!("a new record begins: {other:?}"),
        }
        if !library {
            flush_functions(&server).await;
        }
        config_set(&server, "maxmemory-policy", "noeviction").await;
        config_set(&server, "maxmemory", "1").await;
        let refused = within("acquire when full", c.lock("new").unwrap().try_acquire()).await;
        let oom = matches!(&refused, Err(LockError::Redis { source, .. }) if source.to_string().contains("OOM"));
        assert!(
            oom,
            "library {library}: a new lock takes memory, refused: {refused:?}"
        );
        match within("replay when full", once.begin("tag")).await {
            Ok(distlock::Begin::Done(record)) => assert_eq!(&record.first()[..], b"done"),
            other => panic!("library {library}: the stored record is replayed: {other:?}"),
        }
        // Three leases' worth of renewals, each refused if renewing were refused when full.
        tokio::time::sleep(Duration::from_millis(2_700)).await;
        assert!(
            held.is_held(),
            "library {library}: the lease was renewed while Redis was full"
        );
        assert!(
            within("release when full", held.release()).await.unwrap(),
            "library {library}: released while Redis was full"
        );
        config_set(&server, "maxmemory", "0").await;
    }
}

/// An acquisition sent twice (redis-rs's cluster client resends a command whose connection
/// broke before the reply came) is recognised by its own token: taken, with the fence the
/// first run drew; the same for a run-once begin (before: the second run answered "held",
/// so the lock stayed held for a whole lease under a token nobody held, and a run-once request
/// was answered as its own duplicate).
#[tokio::test]
async fn an_acquisition_sent_twice_is_recognised_as_taken() {
    let server = RedisServer::start_owned().await;
    let mut r = server.connection().await;
    let library = distlock::function_library();
    let name = library
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("#!lua name="))
        .expect("the library names itself");
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(library)
        .query_async(&mut r)
        .await
        .unwrap();
    let fcall = |function: &str, keys: &[&str], args: &[&str]| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(format!("{name}_{function}"))
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        cmd
    };
    let acquire = fcall(
        "acquire",
        &["app:{k}", "app:{k}:state"],
        &["tok-1", "30000", "0"],
    );
    let first: i64 = acquire.query_async(&mut r).await.unwrap();
    let again: i64 = acquire.query_async(&mut r).await.unwrap();
    assert!(first >= 1, "taken: {first}");
    assert_eq!(again, first, "the same attempt again: taken, same fence");
    let other: i64 = fcall(
        "acquire",
        &["app:{k}", "app:{k}:state"],
        &["tok-2", "30000", "0"],
    )
    .query_async(&mut r)
    .await
    .unwrap();
    assert!(other < 0, "another token: held ({other})");

    let keys = ["app:{o}", "app:{o}:state", "app:{o}:parts"];
    let begin = fcall("begin", &keys, &["tok-3", "30000", "60000", "tag", "1000"]);
    // Taken: the fence, bare.
    let first: i64 = begin.query_async(&mut r).await.unwrap();
    let again: i64 = begin.query_async(&mut r).await.unwrap();
    assert!(
        first > 1000,
        "taken, the counter from the caller's clock: {first}"
    );
    assert_eq!(again, first, "the same attempt again: taken, same fence");
}
