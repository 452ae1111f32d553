//! An acquisition writes all it must or nothing: one whose fencing draw, hold or record state
//! cannot be written (the state key holds a value of another type, the ACL user may not run one
//! of the commands) fails with Redis's refusal as the error's source, and leaves no lock behind
//! to be held by nobody for a whole lease (or, for a reentrant lock without its expiry, for
//! ever). Every way an acquisition is sent: the pipelined `SET NX PX` + `HINCRBY` on one Redis,
//! the acquisition scripts (as on a Cluster or a Sentinel-managed master), and a Redlock master.

use std::time::Duration;

use distlock::{Begin, LockClient, LockError, OwnerId};
use redis::AsyncCommands;
use testkit::{HookedConnection, RedisServer};

const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

/// How the client reaches the server, which decides how an acquisition is sent.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// `connect`: an exclusive acquisition is `SET NX PX` with the `HINCRBY` pipelined behind.
    Pipelined,
    /// `redis` with a connection not known to reach one server (as a Cluster's or Sentinel's):
    /// every acquisition is one script.
    Scripted,
    /// A Redlock of one master: the scripts, on a master.
    Redlock,
}

const SHAPES: [Shape; 3] = [Shape::Pipelined, Shape::Scripted, Shape::Redlock];

async fn client(shape: Shape, url: &str, prefix: &str) -> LockClient {
    let builder = LockClient::builder().prefix(prefix).unwrap();
    match shape {
        Shape::Pipelined => builder.connect(url).unwrap(),
        Shape::Scripted => {
            let conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            builder.redis(HookedConnection::new(conn)).unwrap()
        }
        Shape::Redlock => builder.connect_redlock(&[url]).unwrap(),
    }
}

/// The kinds of lock, each acquired once.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Exclusive,
    Reentrant,
    Once,
}

const KINDS: [Kind; 3] = [Kind::Exclusive, Kind::Reentrant, Kind::Once];

/// One acquisition of `kind` on `name`: `Ok` if it took the lock (or found a record).
async fn acquire(client: &LockClient, kind: Kind, name: &str) -> Result<(), LockError> {
    match kind {
        Kind::Exclusive => {
            let guard = client.lock(name)?.try_acquire().await?;
            drop(guard);
        }
        Kind::Reentrant => {
            let guard = client
                .reentrant(name, &OwnerId::random())?
                .try_acquire()
                .await?;
            drop(guard);
        }
        Kind::Once => match client.once(name)?.begin("tag").await? {
            Begin::Acquired(guard) => drop(guard),
            other => panic!("a fresh name is free: {other:?}"),
        },
    }
    Ok(())
}

/// The Redis error an acquisition failed with (a master's, on Redlock).
fn refusal(error: &LockError) -> &redis::RedisError {
    match error {
        LockError::Redis { source, .. } => source,
        LockError::NoQuorum {
            source: Some(source),
            ..
        } => source,
        other => panic!("expected Redis's refusal as the source, got {other:?}"),
    }
}

/// Whether Redis refused a command to the ACL user: `NOPERM`, or inside a script on Redis 7.0
/// "The user executing the script can't run this command or subcommand".
fn acl_refusal(error: &redis::RedisError) -> bool {
    error.code() == Some("NOPERM") || error.to_string().contains("can't run this command")
}

/// The state key (fencing counter, run-once record) holds a string: every acquisition fails
/// with Redis's `WRONGTYPE` and leaves the lock key unset (before: the acquisition script set
/// the lock, then failed at `HINCRBY`, and the lock was held by nobody for the whole lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_key_of_another_type_fails_the_acquisition_and_leaves_no_lock() {
    let server = RedisServer::start_owned().await;
    let mut admin = server.connection().await;
    let mut failures = Vec::new();
    for shape in SHAPES {
        let prefix = testkit::unique_prefix("wrong-state");
        let c = client(shape, &server.url(), &prefix).await;
        for kind in KINDS {
            let name = format!("{kind:?}");
            let probe = c.lock(&name).unwrap();
            let (lock_key, state_key) = (probe.name().lock_key(), probe.name().state_key());
            let _: () = admin.set(state_key, "not a hash").await.unwrap();
            match within("acquire", acquire(&c, kind, &name)).await {
                Err(error) if refusal(&error).code() == Some("WRONGTYPE") => {}
                other => failures.push(format!("{shape:?} {kind:?}: {other:?}")),
            }
            let left: bool = admin.exists(lock_key).await.unwrap();
            if left {
                failures.push(format!("{shape:?} {kind:?}: the lock key was left set"));
            }
            let state: String = admin.get(state_key).await.unwrap();
            assert_eq!(
                state, "not a hash",
                "{shape:?} {kind:?}: the state untouched"
            );
        }
        assert!(c.settle(Duration::from_secs(5)).await);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An ACL user refused one command of an acquisition (`HINCRBY`, the fencing draw; `PEXPIRE`,
/// the reentrant lock's lease; `HSET`, the run-once record's state): the acquisition fails with
/// Redis's refusal and leaves no lock (before: the scripts set the lock first, and a reentrant
/// lock was left without an expiry: held by nobody for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_the_user_may_not_run_fails_the_acquisition_and_leaves_no_lock() {
    let server = RedisServer::start_owned().await;
    let mut admin = server.connection().await;
    let mut failures = Vec::new();
    for (refused, kind) in [
        ("hincrby", Kind::Exclusive),
        ("pexpire", Kind::Reentrant),
        ("hset", Kind::Once),
    ] {
        for shape in SHAPES {
            let prefix = testkit::unique_prefix("refused");
            let rules = format!("{} -{refused}", distlock::acl_rules(&prefix));
            let url = server.acl_user(&format!("no{refused}"), &rules).await;
            let c = client(shape, &url, &prefix).await;
            let name = format!("{kind:?}");
            let case = format!("{shape:?} {kind:?} without {refused}");
            match within("acquire", acquire(&c, kind, &name)).await {
                Err(error) if acl_refusal(refusal(&error)) => {}
                other => failures.push(format!("{case}: {other:?}")),
            }
            let lock_key = c.lock(&name).unwrap().name().lock_key().to_owned();
            let left: bool = admin.exists(&lock_key).await.unwrap();
            if left {
                failures.push(format!("{case}: the lock key was left set"));
            }
            assert!(c.settle(Duration::from_secs(5)).await);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
