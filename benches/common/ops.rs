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

/// The ways a fenced acquisition (and its release) can be sent, measured against each other
/// with the plain client: the server-side cost of each, nothing of our client in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alternative {
    /// `acquire.lua` as it was: `SET NX PX`, `HINCRBY`, optional `PEXPIRE`, `PTTL` when held.
    Script,
    /// The smallest script that fences: `SET NX PX`, then `HINCRBY`; `0` when held.
    SmallScript,
    /// `MULTI`, `HINCRBY`, `SET NX PX`, `EXEC`: no Lua; a failed attempt burns a fence.
    Multi,
    /// `HINCRBY` and `SET NX PX` pipelined without `MULTI`: **not atomic, not safe** (a holder
    /// whose lease ran out between its two commands can draw a larger fence than the next
    /// holder); measured only to show what atomicity costs.
    Pipeline,
    /// The small script as a Redis 7 function (`FCALL`).
    Function,
    /// `SET NX PX`, then `HINCRBY`, pipelined without `MULTI`, the release a function: what the
    /// crate sends on one Redis since `acquire_plain`. Safe: the fence is drawn after the `SET`,
    /// so within the lease of an acquisition whose reply comes within the command timeout.
    SetThenFence,
}

/// How the release is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// `release.lua` as it was: compare-and-delete, then `PUBLISH` to the lock's channel.
    Publish,
    /// Compare-and-delete, and `PUBLISH` only when a waiter marked the lock (`EXISTS` of the
    /// marker key).
    PublishIfMarked,
    /// Compare-and-delete alone (what `rslock` does).
    Plain,
}

/// The smallest fenced acquire script.
pub const SMALL_ACQUIRE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return redis.call('HINCRBY', KEYS[2], 'n', 1) end return 0";

/// Compare-and-delete, announcing the release only when a waiter marked the lock.
pub const RELEASE_IF_MARKED: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) if redis.call('EXISTS', KEYS[2]) == 1 then redis.pcall('PUBLISH', KEYS[1] .. ':rel', ARGV[1]) end return 1 end return 0";

/// The Redis 7 function library of the `Function` alternative.
pub const LIBRARY: &str = "#!lua name=benchlock
redis.register_function('benchlock_acquire', function(keys, args)
  if redis.call('SET', keys[1], args[1], 'NX', 'PX', args[2]) then
    return redis.call('HINCRBY', keys[2], 'n', 1)
  end
  return 0
end)
redis.register_function('benchlock_release', function(keys, args)
  if redis.call('GET', keys[1]) == args[1] then
    redis.call('DEL', keys[1])
    redis.pcall('PUBLISH', keys[1] .. ':rel', args[1])
    return 1
  end
  return 0
end)";

/// The scripts the alternatives use, built once.
#[derive(Debug, Clone)]
pub struct AltScripts {
    pub acquire: redis::Script,
    pub small: redis::Script,
    pub release: redis::Script,
    pub release_if_marked: redis::Script,
    pub unlock: redis::Script,
}

impl AltScripts {
    /// Builds the scripts and loads the function library on `conn`.
    pub async fn load(conn: &mut MultiplexedConnection) -> Self {
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(LIBRARY)
            .query_async(conn)
            .await
            .unwrap();
        AltScripts {
            acquire: redis::Script::new(include_str!(
                "../../crates/distlock/src/backend/redis/scripts/acquire.lua"
            )),
            small: redis::Script::new(SMALL_ACQUIRE),
            release: redis::Script::new(include_str!(
                "../../crates/distlock/src/backend/redis/scripts/release.lua"
            )),
            release_if_marked: redis::Script::new(RELEASE_IF_MARKED),
            unlock: redis::Script::new(UNLOCK),
        }
    }
}

/// One fenced acquire + release of `{key}`, sent the way `acquire` and `release` say.
pub async fn alternative_pair(
    conn: &mut MultiplexedConnection,
    scripts: &AltScripts,
    acquire: Alternative,
    release: Release,
    key: &str,
) {
    let lock = format!("{{{key}}}");
    let state = format!("{{{key}}}:state");
    let fence: i64 = match acquire {
        Alternative::Script => scripts
            .acquire
            .key(&lock)
            .key(&state)
            .arg("token")
            .arg(10_000)
            .arg(0)
            .invoke_async(conn)
            .await
            .unwrap(),
        Alternative::SmallScript => scripts
            .small
            .key(&lock)
            .key(&state)
            .arg("token")
            .arg(10_000)
            .invoke_async(conn)
            .await
            .unwrap(),
        Alternative::SetThenFence => {
            let (set, fence): (Option<String>, i64) = redis::pipe()
                .cmd("SET")
                .arg(&lock)
                .arg("token")
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .cmd("HINCRBY")
                .arg(&state)
                .arg("n")
                .arg(1)
                .query_async(conn)
                .await
                .unwrap();
            assert!(set.is_some(), "uncontended");
            fence
        }
        Alternative::Multi | Alternative::Pipeline => {
            let mut pipe = redis::pipe();
            if acquire == Alternative::Multi {
                pipe.atomic();
            }
            pipe.cmd("HINCRBY")
                .arg(&state)
                .arg("n")
                .arg(1)
                .cmd("SET")
                .arg(&lock)
                .arg("token")
                .arg("NX")
                .arg("PX")
                .arg(10_000);
            let (fence, set): (i64, Option<String>) = pipe.query_async(conn).await.unwrap();
            assert!(set.is_some(), "uncontended");
            fence
        }
        Alternative::Function => redis::cmd("FCALL")
            .arg("benchlock_acquire")
            .arg(2)
            .arg(&lock)
            .arg(&state)
            .arg("token")
            .arg(10_000)
            .query_async(conn)
            .await
            .unwrap(),
    };
    assert!(fence >= 1, "uncontended");
    let released: i64 = match (acquire, release) {
        (Alternative::Function | Alternative::SetThenFence, Release::Publish) => {
            redis::cmd("FCALL")
                .arg("benchlock_release")
                .arg(1)
                .arg(&lock)
                .arg("token")
                .query_async(conn)
                .await
                .unwrap()
        }
        (_, Release::Publish) => scripts
            .release
            .key(&lock)
            .arg("token")
            .invoke_async(conn)
            .await
            .unwrap(),
        (_, Release::PublishIfMarked) => scripts
            .release_if_marked
            .key(&lock)
            .key(format!("{{{key}}}:w"))
            .arg("token")
            .invoke_async(conn)
            .await
            .unwrap(),
        (_, Release::Plain) => scripts
            .unlock
            .key(&lock)
            .arg("token")
            .invoke_async(conn)
            .await
            .unwrap(),
    };
    assert_eq!(released, 1);
}

/// Time process `pid` has run on a CPU so far, to the nanosecond: the sum over its threads
/// alive now of `/proc/<pid>/task/<tid>/schedstat` (a thread that ended counts nothing: for
/// servers whose threads live as long as they do).
pub fn process_run_time(pid: u32) -> Duration {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten();
    let ns = tasks
        .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// User + system CPU time of process `pid` (`"self"` for this one) so far, from /proc (in
/// clock ticks of 10 ms: a window must be long against that).
pub fn process_cpu(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (in parentheses, which may contain spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name and state.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}
