//! Faults of the replies, not only of the server: a TCP proxy (`testkit::FaultProxy`) between
//! the lock and Redis delays replies, drops a reply after its command ran, or black-holes the
//! connection. The commands still run on the server; only the client's knowledge is hurt.
//!
//! * validity is counted from when a command was *sent*: with late replies the lease a holder
//!   believes in never outlasts the key in Redis;
//! * an acquisition whose reply is lost is ambiguous and cleaned up;
//! * a completion whose reply is lost is recognised when retried;
//! * an append whose reply is lost is recognised when retried (stored once), and an append
//!   dropped in flight is recognised only with the same part;
//! * a dropped acquisition future (the caller gave up) frees what it may have taken;
//! * the replica check (`WAIT`) runs on the connection that wrote.

use std::time::{Duration, Instant};

use distlock::once::RecordState;
use distlock::{Begin, LockClient, LockConfig, LockError};
use redis::AsyncCommands;
use testkit::{FaultProxy, RedisServer, ServerOptions};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

async fn client_via(proxy: &FaultProxy, prefix: &str, config: LockConfig) -> LockClient {
    let client = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .connect(&proxy.url())
        .unwrap();
    client
        .prepare()
        .await
        .expect("redis answers through the proxy");
    client
}

/// Polls `check` every 10 ms until it holds or `limit` passes.
async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(ms(10)).await;
    }
}

async fn exists(server: &RedisServer, key: &str) -> bool {
    let mut c = server.connection().await;
    c.exists(key).await.unwrap()
}

/// Whether `key` is gone within `limit`.
async fn gone_within(server: &RedisServer, key: &str, limit: Duration) -> bool {
    eventually(limit, || async { !exists(server, key).await }).await
}

/// The key's expiry in Redis, as an interval of this process's clock that contains it.
async fn key_expiry(server: &RedisServer, key: &str) -> Option<(Instant, Instant)> {
    let mut c = server.connection().await;
    let before = Instant::now();
    let pttl: i64 = c.pttl(key).await.unwrap();
    let after = Instant::now();
    (pttl >= 0).then(|| {
        let pttl = ms(pttl as u64);
        // Redis reports whole milliseconds, rounded down.
        (before + pttl, after + pttl + ms(1))
    })
}

/// Replies come 200 ms late (the commands run on time). The lease the holder believes in,
/// `valid_until`, must never end after the key does in Redis: validity is counted from when the
/// acquisition or renewal was sent. Counting from the reply would put `valid_until` about
/// 200 ms past the key's expiry after every confirmation, which this test samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_is_counted_from_when_the_command_was_sent() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("sent");
    let config = LockConfig::builder()
        .lease(ms(900))
        .op_timeout(ms(220))
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    let lock = client.lock("k").unwrap();
    proxy.delay_replies(ms(200));
    let guard = lock.try_acquire().await.unwrap();
    let key = lock.name().lock_key().to_owned();
    let mut samples = 0;
    let until = Instant::now() + ms(1_500);
    while Instant::now() < until {
        let believed = guard.lease().valid_until();
        if let Some((_, latest)) = key_expiry(&server, &key).await {
            assert!(
                believed <= latest,
                "the holder believes in its lease {:?} after the key expires in Redis",
                believed - latest
            );
            samples += 1;
        }
        tokio::time::sleep(ms(5)).await;
    }
    assert!(samples > 50, "sampled {samples} times");
    assert!(guard.is_held(), "renewals with late replies keep the lease");
    proxy.heal();
    assert!(guard.release().await.unwrap());
}

/// The acquisition ran but its reply was lost with the connection: the caller gets an ambiguous
/// `Unavailable`, and the lock the attempt took is deleted long before its 30 s lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acquisition_reply_is_ambiguous_and_cleaned_up() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("lost-acquire");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(ms(300))
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    proxy.drop_next_replies(1);
    match lock.try_acquire().await {
        Err(LockError::Unavailable { ambiguous, .. }) => assert!(ambiguous),
        other => panic!("expected an ambiguous Unavailable, got {other:?}"),
    }
    assert_eq!(proxy.dropped(), 1);
    assert!(
        gone_within(&server, &key, Duration::from_secs(2)).await,
        "the lock taken by the attempt whose reply was lost is deleted"
    );
}

/// A completion ran but its reply was lost: the retry (on a new connection) is recognised as
/// the same completion, `complete` succeeds, and the record is what later callers get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_completion_reply_is_recognised_on_retry() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("lost-complete");
    let config = LockConfig::builder()
        .lease(ms(3_000))
        .op_timeout(ms(300))
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    let once = client.once("evt").unwrap();
    let Begin::Acquired(guard) = once.begin("tag").await.unwrap() else {
        panic!("free")
    };
    proxy.drop_next_replies(1);
    guard
        .complete(b"record")
        .await
        .expect("the completion happened: a lost reply is not a failure");
    assert_eq!(proxy.dropped(), 1);
    match once.begin("tag").await.unwrap() {
        Begin::Done(record) => assert_eq!(record.whole().map(|w| &w[..]), Some(&b"record"[..])),
        other => panic!("{other:?}"),
    }
}

/// A streamed record whose completion reply was lost: the retried completion, recognised as
/// done, refreshes the retention of every key of the record, parts included (before: the
/// state's only, so for the retry's delay at the end of the retention the state said done while
/// its parts were gone, and a replay was reported unreadable instead of a fresh run).
#[tokio::test]
async fn a_retried_streamed_completion_keeps_the_parts_as_long_as_the_state() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("lost-complete-parts");
    let config = LockConfig::builder()
        .lease(ms(3_000))
        .op_timeout(ms(300))
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    let once = client
        .once("export")
        .unwrap()
        .retention(Duration::from_secs(60))
        .unwrap();
    let name = once.name().clone();
    let Begin::Acquired(guard) = once.begin("tag").await.unwrap() else {
        panic!("free")
    };
    guard.append(b"p0").await.unwrap();
    proxy.drop_next_replies(1);
    guard
        .complete(b"end")
        .await
        .expect("the completion happened: a lost reply is not a failure");
    assert_eq!(proxy.dropped(), 1, "the first completion's reply was lost");
    // Both expiries as absolute times (Unix ms): two PTTLs, even in one transaction, are read
    // at two instants on Redis 7.0, which reads its clock per command.
    let mut r = server.connection().await;
    let (state, parts): (i64, i64) = redis::pipe()
        .atomic()
        .cmd("PEXPIRETIME")
        .arg(name.state_key())
        .cmd("PEXPIRETIME")
        .arg(name.parts_key())
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(state > 0 && parts > 0, "state {state} ms, parts {parts} ms");
    assert!(
        parts >= state,
        "the parts expire {} ms before the state that says the record is done",
        state - parts
    );
}

/// A master with a replica in sync, a fault proxy in front of the master, and a client through
/// it that checks one replica (`WAIT`, 200 ms) after every write: a 30 s lease, a 600 ms
/// command timeout. `m` is a direct connection to the master.
struct Replicated {
    master: RedisServer,
    replica: RedisServer,
    proxy: FaultProxy,
    client: LockClient,
    m: redis::aio::MultiplexedConnection,
}

async fn replicated(test: &str) -> Replicated {
    let master = RedisServer::start_owned().await;
    let replica = RedisServer::start_with(
        ServerOptions::default()
            .arg("--replicaof")
            .arg("127.0.0.1")
            .arg(master.port().to_string()),
    )
    .await;
    let m = master.connection().await;
    let synced = eventually(Duration::from_secs(10), || {
        let mut m = m.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut m)
                .await
                .unwrap();
            info.contains("state=online")
        }
    })
    .await;
    assert!(synced, "the replica is in sync");
    let proxy = FaultProxy::start(&master).await;
    let prefix = testkit::unique_prefix(test);
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(ms(600))
        .build()
        .unwrap();
    let client = LockClient::builder()
        .config(config)
        .prefix(&prefix)
        .unwrap()
        .replicas(1, ms(200))
        .unwrap()
        .connect(&proxy.url())
        .unwrap();
    client.prepare().await.unwrap();
    Replicated {
        master,
        replica,
        proxy,
        client,
        m,
    }
}

/// A completion that ran but whose reply was lost, retried on a new connection with the
/// replica check on: the retry finds the record already stored, so its `WAIT` is all that
/// stands between a record on the master alone and a success. Valkey 9 answers a `WAIT` on a
/// connection that wrote nothing at once, counting a frozen replica (Redis 7.0 answers it
/// against the master's offset): the completion passed its check there with the record on the
/// master alone. The retry now refreshes the record's retention, a write the replica must
/// acknowledge, which it can only do after the record: the completion fails its check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_completion_is_checked_on_the_replicas() {
    let Replicated {
        master: _master,
        replica,
        proxy,
        client,
        mut m,
    } = replicated("wait-complete").await;
    let once = client.once("evt").unwrap();
    // Taken while the replica answers. On a loaded machine the check's 200 ms (or the 600 ms
    // command timeout) may not be enough: a failed attempt releases (or cleans up) what it
    // took, so try again, within a deadline.
    let deadline = Instant::now() + Duration::from_secs(10);
    let guard = loop {
        let attempt = once.begin_wait("tag", ms(500)).await;
        match attempt {
            Ok(Begin::Acquired(guard)) => break guard,
            Err(LockError::NotReplicated { .. }) | Ok(Begin::InFlight { .. })
                if Instant::now() < deadline =>
            {
                tokio::time::sleep(ms(50)).await;
            }
            Err(e) if e.is_unavailable() && Instant::now() < deadline => {
                tokio::time::sleep(ms(50)).await;
            }
            other => panic!("the lock, with the replica answering: {other:?}"),
        }
    };
    replica.pause().await;
    // The completion runs; its reply is lost with its connection.
    proxy.drop_next_replies(1);
    let outcome = guard.complete(b"record").await;
    let _: () = redis::cmd("PING").query_async(&mut m).await.unwrap();
    replica.resume().await;
    assert_eq!(proxy.dropped(), 1);
    assert!(
        matches!(outcome, Err(LockError::NotReplicated { .. })),
        "the frozen replica never acknowledged the record, yet the completion passed its replica check: {outcome:?}"
    );
}

/// A run-once lock taken through a fault proxy (3 s lease, no watchdog: no renewal competes
/// for the faults), ready to stream.
async fn streaming_through_a_proxy(
    test: &str,
    op_timeout: Duration,
) -> (RedisServer, FaultProxy, distlock::Once, distlock::OnceGuard) {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let config = LockConfig::builder()
        .lease(ms(3_000))
        .op_timeout(op_timeout)
        .watchdog(false)
        .build()
        .unwrap();
    let client = client_via(&proxy, &testkit::unique_prefix(test), config).await;
    let once = client.once("stream").unwrap();
    let Begin::Acquired(guard) = once.begin("tag").await.unwrap() else {
        panic!("free")
    };
    (server, proxy, once, guard)
}

/// Appends (and the completion of a streamed record) ran, but their replies were lost with the
/// connection: the retries within the lease are recognised (the script finds that very part at
/// its index; the completing token with the record), so every part is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_append_reply_does_not_duplicate_the_part() {
    let (server, proxy, once, guard) = streaming_through_a_proxy("lost-append", ms(300)).await;
    assert_eq!(guard.append(b"p0").await.unwrap(), 0);
    proxy.drop_next_replies(1);
    assert_eq!(
        guard
            .append(b"p1")
            .await
            .expect("the append happened: a lost reply is not a failure"),
        1
    );
    assert_eq!(proxy.dropped(), 1);
    assert_eq!(guard.append(b"p2").await.unwrap(), 2);
    proxy.drop_next_replies(1);
    guard
        .complete(b"p3")
        .await
        .expect("the completion happened: a lost reply is not a failure");
    assert_eq!(proxy.dropped(), 2);
    let read = once.parts(0, 10).await.unwrap();
    assert_eq!(read.parts(), [&b"p0"[..], b"p1", b"p2", b"p3"]);
    assert_eq!(read.state(), RecordState::Done { parts: 4 });
    let mut direct = server.connection().await;
    let stored: u64 = direct.llen(once.name().parts_key()).await.unwrap();
    assert_eq!(stored, 4, "no part stored twice");
}

/// A read whose reply is lost with its connection (a network blip, a failover) is tried again
/// once the store answers: reads change nothing, so a reader in the middle of a long record
/// (a replay, a follower of a live stream) goes on (before: the first failed read ended it
/// with `Unavailable`, though the store was back a moment later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_reply_is_lost_is_tried_again() {
    let (_server, proxy, once, guard) = streaming_through_a_proxy("lost-read", ms(900)).await;
    assert_eq!(guard.append(b"p0").await.unwrap(), 0);
    let mut follower = once.follow(0);
    let soon = || Instant::now() + ms(500);
    assert_eq!(
        follower.next(8, soon()).await.unwrap().parts(),
        [&b"p0"[..]]
    );
    // A follower's read of the record being written.
    assert_eq!(guard.append(b"p1").await.unwrap(), 1);
    proxy.drop_next_replies(1);
    let read = follower
        .next(8, soon())
        .await
        .expect("a lost read reply is tried again");
    assert_eq!(read.parts(), [&b"p1"[..]]);
    assert_eq!(proxy.dropped(), 1);
    guard.complete(b"p2").await.unwrap();
    // The atomic read of a completed record, and the plain list read.
    proxy.drop_next_replies(1);
    let read = once
        .parts(0, 10)
        .await
        .expect("a lost read reply is tried again");
    assert_eq!(read.parts(), [&b"p0"[..], b"p1", b"p2"]);
    assert_eq!(read.state(), RecordState::Done { parts: 3 });
    proxy.drop_next_replies(1);
    let parts = once
        .stored_parts(1, 10)
        .await
        .expect("a lost read reply is tried again");
    assert_eq!(parts, [&b"p1"[..], b"p2"]);
    assert_eq!(proxy.dropped(), 3);
}

/// A read whose connection drops while nobody polls it (a replay's read-ahead behind a client
/// that reads slowly) still gets its tries when it is polled again, past the command timeout:
/// the time for trying again counts from when the failure is seen (before, from the first
/// poll: the read answered `Unavailable` at once, and the replay broke off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_failed_while_nobody_polled_it_is_still_tried_again() {
    let (_server, proxy, once, guard) = streaming_through_a_proxy("unpolled-read", ms(900)).await;
    assert_eq!(guard.append(b"p0").await.unwrap(), 0);
    guard.complete(b"p1").await.unwrap();
    proxy.drop_next_replies(1);
    let mut read = Box::pin(once.stored_parts(0, 10));
    // One poll: the command leaves; its reply is lost with the connection.
    std::future::poll_fn(|cx| {
        let _ = read.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
    assert!(
        eventually(ms(2_000), || async { proxy.dropped() == 1 }).await,
        "the reply was not dropped"
    );
    // Nobody polls it for longer than the command timeout.
    tokio::time::sleep(ms(1_100)).await;
    let parts = tokio::time::timeout(ms(5_000), read)
        .await
        .expect("an answer within 5 s")
        .expect("tried again once polled");
    assert_eq!(parts, [&b"p0"[..], b"p1"]);
}

/// The caller gives up on an append after it was sent (its reply is late): the part may be
/// stored. Appending the same part again is recognised (index 0 once); another part at that
/// index is refused as a broken record, never stored next to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_append_is_recognised_only_with_the_same_part() {
    let (_server, proxy, once, guard) = streaming_through_a_proxy("dropped-append", ms(900)).await;
    proxy.delay_replies(ms(400));
    assert!(
        tokio::time::timeout(ms(100), guard.append(b"A"))
            .await
            .is_err(),
        "the caller gave up before the reply"
    );
    tokio::time::sleep(ms(500)).await;
    proxy.heal();
    assert_eq!(guard.appended(), 0, "not known to be stored");
    assert!(matches!(
        guard.append(b"B").await,
        Err(LockError::BrokenRecord { .. })
    ));
    assert_eq!(guard.append(b"A").await.unwrap(), 0, "recognised");
    assert_eq!(guard.append(b"B").await.unwrap(), 1);
    let read = once.parts(0, 10).await.unwrap();
    assert_eq!(read.parts(), [&b"A"[..], b"B"]);
    drop(guard);
}

/// The caller gives up (drops the future) after the acquisition was sent but before its reply
/// came: the lock the command took is freed within a second, not at the end of its 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_acquisition_future_frees_the_lock() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("dropped-acquire");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    for kind in ["lock", "once"] {
        let name = format!("k-{kind}");
        let lock_name = client.lock(&name).unwrap().name().clone();
        let (key, state) = (lock_name.lock_key(), lock_name.state_key());
        proxy.delay_replies(ms(1_500));
        let attempt = async {
            match kind {
                "lock" => client
                    .lock(&name)
                    .unwrap()
                    .acquire(Duration::from_secs(10))
                    .await
                    .map(drop),
                _ => client.once(&name).unwrap().begin("t").await.map(drop),
            }
        };
        assert!(
            tokio::time::timeout(ms(300), attempt).await.is_err(),
            "the caller gave up before the reply"
        );
        // The acquisition ran (it drew a fence), whether or not its lock is still there.
        assert!(exists(&server, state).await, "{kind}: the command ran");
        let given_up = Instant::now();
        assert!(
            gone_within(&server, key, Duration::from_secs(1)).await,
            "{kind}: the lock is still held {:?} after the caller gave up",
            given_up.elapsed()
        );
        proxy.heal();
    }
}

/// Redlock: the same, for a fan-out that was dropped while every node's reply was late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_redlock_acquisition_frees_every_node() {
    let servers = RedisServer::start_many(3).await;
    let mut proxies = Vec::new();
    for s in &servers {
        proxies.push(FaultProxy::start(s).await);
    }
    let prefix = testkit::unique_prefix("dropped-redlock");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(Duration::from_secs(6))
        .build()
        .unwrap();
    let urls: Vec<String> = proxies.iter().map(FaultProxy::url).collect();
    let client = LockClient::builder()
        .config(config)
        .prefix(&prefix)
        .unwrap()
        .node_timeout(Duration::from_secs(2))
        .connect_redlock(&urls)
        .unwrap();
    client.prepare().await.unwrap();
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    let state = lock.name().state_key().to_owned();
    for p in &proxies {
        p.delay_replies(ms(1_500));
    }
    assert!(
        tokio::time::timeout(ms(300), lock.acquire(Duration::from_secs(10)))
            .await
            .is_err()
    );
    let mut held = 0;
    for s in &servers {
        held += usize::from(exists(s, &state).await);
    }
    assert_eq!(
        held, 3,
        "the acquisition ran on every node (each drew a fence)"
    );
    for s in &servers {
        assert!(
            gone_within(s, &key, Duration::from_secs(1)).await,
            "a node still holds the lock of a dropped acquisition"
        );
    }
}

/// The replica check must wait for the write it checks. A replica that cannot acknowledge
/// (frozen) and a connection cut right after the acquisition's reply: `WAIT` sent afterwards
/// on a new connection has nothing of its own to wait for and would count the replica at once.
/// The acquisition must not succeed, and the lock it took must not stay behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_check_waits_on_the_connection_that_wrote() {
    let Replicated {
        master,
        replica,
        proxy,
        client,
        mut m,
    } = replicated("wait-fresh").await;
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    replica.pause().await;
    // The acquisition script's reply arrives, and its connection is cut right after it.
    proxy.cut_after_next_replies(1);
    let outcome = lock.try_acquire().await;
    let _: () = redis::cmd("PING").query_async(&mut m).await.unwrap();
    replica.resume().await;
    assert_eq!(
        proxy.cut_after_replies(),
        1,
        "the connection was cut after the script's reply"
    );
    assert!(
        outcome.is_err(),
        "the replica never acknowledged the lock, yet the acquisition succeeded"
    );
    assert!(
        gone_within(&master, &key, Duration::from_secs(1)).await,
        "the lock of a failed replica check stays behind: {outcome:?}"
    );
}

/// A `WAIT` that fails after the lock was set must release it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_replica_check_releases_the_lock() {
    let server = RedisServer::start_owned().await;
    let mut admin = server.connection().await;
    // A user that may do everything except WAIT: the check fails after the lock was set.
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "nowait", "on", ">pw", "~*", "&*", "+@all", "-wait",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let prefix = testkit::unique_prefix("wait-error");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(ms(500))
        .build()
        .unwrap();
    let client = LockClient::builder()
        .config(config)
        .prefix(&prefix)
        .unwrap()
        .replicas(1, ms(100))
        .unwrap()
        .connect(&format!("redis://nowait:pw@127.0.0.1:{}/", server.port()))
        .unwrap();
    client.prepare().await.unwrap();
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    assert!(lock.try_acquire().await.is_err());
    assert!(
        gone_within(&server, &key, Duration::from_secs(1)).await,
        "the lock stays behind after the replica check failed"
    );
}

/// A release wakes the next waiter of its own client as soon as the release is on the
/// connection, not when its reply comes back: the waiter's acquisition follows the release on
/// the same connection, so Redis runs it right after the compare-and-delete and the lock changes
/// hands in one round trip instead of two. Replies are held back 3 s here: the waiter's token is
/// in Redis while the release's reply is still on its way. (One release in nine, drawn at
/// random, wakes the waiter only once answered, so that other clients' waiters get their
/// chance: the test tries up to ten releases and needs one hand-over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_local_waiter_takes_the_lock_in_the_releases_round_trip() {
    let server = RedisServer::start_owned().await;
    let proxy = FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("hand-over");
    // No polling: the waiter sends nothing until it is woken (an attempt of its own in flight
    // when replies start lagging would keep it busy for the delay).
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .op_timeout(Duration::from_secs(5))
        .polling(false)
        .build()
        .unwrap();
    let client = client_via(&proxy, &prefix, config).await;
    let mut handed_over = false;
    for _ in 0..10 {
        if hand_over(&server, &proxy, &client).await {
            handed_over = true;
            break;
        }
    }
    assert!(
        handed_over,
        "in ten releases, the waiter's acquisition never reached Redis before the release's \
         reply came back"
    );
}

/// One release with a waiter parked behind it, replies held back: whether the waiter took the
/// lock while the release's reply was still on its way.
async fn hand_over(server: &RedisServer, proxy: &FaultProxy, client: &LockClient) -> bool {
    let lock = client.lock("job").unwrap();
    let (key, channel) = (
        lock.name().lock_key().to_owned(),
        lock.name().channel().to_owned(),
    );
    let held = lock.try_acquire().await.unwrap();
    let ours = held.token().as_str().to_owned();
    let mut admin = server.connection().await;
    // An exclusive acquisition is a `SET NX PX` (with the fence drawn behind it), no script.
    let before = server.command_calls("set").await;
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.acquire(Duration::from_secs(30)).await }
    });
    // The waiter tried, subscribed, and looked again: two attempts, then it sleeps.
    assert!(
        eventually(Duration::from_secs(10), || async {
            server.subscribers(&channel).await > 0
                && server.command_calls("set").await >= before + 2
        })
        .await,
        "the waiter never settled to wait"
    );
    // Its second attempt's reply on its way back, not held back by the delay below.
    tokio::time::sleep(ms(300)).await;
    proxy.delay_replies(Duration::from_secs(3));
    let release = tokio::spawn(held.release());
    let mut handed_over = false;
    let deadline = Instant::now() + ms(2_000);
    while Instant::now() < deadline {
        let value: Option<String> = admin.get(&key).await.unwrap();
        if value.is_some_and(|v| v != ours) {
            handed_over = true;
            break;
        }
        tokio::time::sleep(ms(5)).await;
    }
    if handed_over {
        assert!(
            !release.is_finished(),
            "the release's reply is still held back by the proxy"
        );
    }
    assert!(release.await.unwrap().unwrap(), "the release was ours");
    let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter got the lock")
        .unwrap()
        .unwrap();
    let value: Option<String> = admin.get(&key).await.unwrap();
    assert_eq!(value.as_deref(), Some(guard.token().as_str()));
    proxy.heal();
    assert!(guard.release().await.unwrap());
    handed_over
}
