//! One acquire + release, done each way the lock benchmarks compare.

use std::time::Duration;

use redis::aio::MultiplexedConnection;

/// The compare-and-delete every Redis lock releases with: the limit's second command.
pub const UNLOCK: &str = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

/// The limit: `SET NX PX`, then `EVALSHA` compare-and-delete, with the plain redis client.
pub async fn raw_pair(
    conn: &mut MultiplexedConnection,
    script: &redis::Script,
    key: &str,
    token: &str,
) {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(token)
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async(conn)
        .await
        .unwrap();
    assert!(set.is_some(), "uncontended");
    let released: i64 = script.key(key).arg(token).invoke_async(conn).await.unwrap();
    assert_eq!(released, 1);
}

/// Our two scripts sent with the plain client: the server-side cost of fencing and
/// notifications, without any of the client-side machinery.
pub async fn scripts_pair(
    conn: &mut MultiplexedConnection,
    acquire: &redis::Script,
    release: &redis::Script,
    key: &str,
) {
    let fence: i64 = acquire
        .key(format!("{{{key}}}"))
        .key(format!("{{{key}}}:state"))
        .arg("token")
        .arg(10_000)
        .arg(0)
        .invoke_async(conn)
        .await
        .unwrap();
    assert!(fence >= 1);
    let released: i64 = release
        .key(format!("{{{key}}}"))
        .arg("token")
        .invoke_async(conn)
        .await
        .unwrap();
    assert_eq!(released, 1);
}

/// Ours: `try_acquire`, then `release`.
pub async fn ours_pair(lock: &distlock::Lock) {
    let guard = lock.try_acquire().await.unwrap();
    assert!(guard.release().await.unwrap());
}

/// The `rslock` crate: `lock`, then `unlock`.
pub async fn rslock_pair(manager: &rslock::LockManager, key: &str) {
    let lock = manager
        .lock(key.as_bytes(), Duration::from_secs(10))
        .await
        .unwrap();
    manager.unlock(&lock).await;
}
