//! The lock against a real redis-server: exclusion, fencing, lease loss, the reference articles'
//! failures, outages and recovery.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Begin, LockClient, LockConfig, LockError, LossReason, OwnerId};
use redis::AsyncCommands;
use testkit::{History, RedisServer};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// A client on `url`, connected and with its scripts loaded (so that short command timeouts
/// are not spent on the first connection).
async fn connect(url: &str, prefix: &str, config: LockConfig) -> LockClient {
    let client = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .connect(url)
        .unwrap();
    client.prepare().await.expect("redis answers");
    client
}

async fn client(server: &RedisServer, prefix: &str, config: LockConfig) -> LockClient {
    connect(&server.url(), prefix, config).await
}

fn short_lease(lease: u64) -> LockConfig {
    LockConfig::builder().lease(ms(lease)).build().unwrap()
}

#[tokio::test]
async fn acquire_release_and_fencing() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("basic");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let lock = c.lock("job").unwrap();
    let mut redis = server.connection().await;

    let a = lock.try_acquire().await.unwrap();
    let value: String = redis.get(lock.name().lock_key()).await.unwrap();
    assert_eq!(value, a.token().as_str(), "the value is the owner token");
    let pttl: i64 = redis.pttl(lock.name().lock_key()).await.unwrap();
    assert!(
        pttl > 0 && pttl <= 10_000,
        "the lease is the key's expiry: {pttl}"
    );

    match lock.try_acquire().await {
        Err(LockError::Held { retry_after, .. }) => assert!(retry_after.is_some()),
        other => panic!("{other:?}"),
    }
    let first = a.fence();
    assert!(a.release().await.unwrap());
    let exists: bool = redis.exists(lock.name().lock_key()).await.unwrap();
    assert!(!exists);

    let b = lock.try_acquire().await.unwrap();
    assert!(b.fence() > first);
    drop(b);
    // Drop releases in the background; the next acquisition waits for it.
    let c2 = lock.acquire(Duration::from_secs(5)).await.unwrap();
    assert!(c2.fence() > first + 1);
}

/// Many tasks on several clients (each with its own connections, like separate instances)
/// contend for one lock; the history proves one holder at a time and increasing fences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_across_clients_and_tasks() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("mutex");
    let history = Arc::new(History::new());
    let mut tasks = Vec::new();
    for c in 0..4 {
        let client = client(&server, &prefix, short_lease(2_000)).await;
        for t in 0..4 {
            let lock = client.lock("shared").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let guard = lock.acquire(Duration::from_secs(60)).await.unwrap();
                    let section = history.enter(format!("c{c}t{t}"), guard.fence());
                    tokio::time::sleep(ms(1)).await;
                    assert!(guard.is_held());
                    section.leave();
                    assert!(guard.release().await.unwrap());
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let report = testkit::check(&history.sections()).unwrap();
    assert_eq!(report.sections, 160);
    assert_eq!(report.holders, 16);
}

/// A holder that stops renewing (its runtime is stalled, as in a GC pause or SIGSTOP) loses the
/// lock when its lease ends; a waiter takes it with a greater fence; the old holder's loss signal
/// fires, and its late release deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_holder_loses_the_lock_and_cannot_delete_the_next() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("stall");
    let url = server.url();
    let (acquired_tx, acquired_rx) = std::sync::mpsc::channel();
    let holder_prefix = prefix.clone();
    let holder = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let c = connect(&url, &holder_prefix, short_lease(300)).await;
            let guard = c.lock("stall").unwrap().try_acquire().await.unwrap();
            acquired_tx.send(guard.fence()).unwrap();
            // Block the whole runtime: the watchdog cannot renew.
            std::thread::sleep(ms(1_500));
            let reason = tokio::time::timeout(Duration::from_secs(5), guard.lost())
                .await
                .expect("the loss signal fires");
            let held = guard.is_held();
            let released = guard.release().await.unwrap();
            (reason, held, released)
        })
    });
    let old_fence = acquired_rx.recv().unwrap();
    let c = client(&server, &prefix, short_lease(5_000)).await;
    let lock = c.lock("stall").unwrap();
    let new = lock.acquire(Duration::from_secs(10)).await.unwrap();
    assert!(new.fence() > old_fence);

    let (reason, held, released) = tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert!(
        matches!(reason, LossReason::Expired | LossReason::NotOwner),
        "{reason:?}"
    );
    assert!(!held);
    assert!(
        !released,
        "the old holder's release found the lock not its own"
    );
    let mut redis = server.connection().await;
    let value: String = redis.get(lock.name().lock_key()).await.unwrap();
    assert_eq!(
        value,
        new.token().as_str(),
        "the new holder's lock is intact"
    );
    assert!(new.release().await.unwrap());
}

/// Article 000: with the SETNX + GETSET timestamp recipe, a loser overwrites the winner's expiry,
/// and the winner can no longer unlock. Reproduced with the recipe, then shown impossible here.
#[tokio::test]
async fn article_000_a_loser_cannot_touch_the_holders_lock() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("a000");
    let mut r = server.connection().await;
    let key = format!("{prefix}:naive");
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };

    // The recipe. C3 holds an expired timestamp; C4 and C5 both find it expired.
    let _: () = r.set(&key, now() - 1_000).await.unwrap();
    let c4_sees: i64 = r.get(&key).await.unwrap();
    let c5_sees: i64 = r.get(&key).await.unwrap();
    assert!(c4_sees < now() && c5_sees < now());
    let t4 = now() + 10_000;
    let old4: i64 = redis::cmd("GETSET")
        .arg(&key)
        .arg(t4)
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(old4 < now(), "C4 wins");
    let t5 = t4 + 1;
    let old5: i64 = redis::cmd("GETSET")
        .arg(&key)
        .arg(t5)
        .query_async(&mut r)
        .await
        .unwrap();
    assert_eq!(
        old5, t4,
        "C5 loses, but has already overwritten C4's expiry"
    );
    let value: i64 = r.get(&key).await.unwrap();
    assert_ne!(
        value, t4,
        "C4's unlock (delete if the value is mine) now fails: the bug"
    );

    // This crate: a loser's attempt writes nothing.
    let c = client(&server, &prefix, LockConfig::default()).await;
    let lock = c.lock("res").unwrap();
    let holder = lock.try_acquire().await.unwrap();
    let pttl_before: i64 = r.pttl(lock.name().lock_key()).await.unwrap();
    for _ in 0..5 {
        assert!(matches!(
            lock.try_acquire().await,
            Err(LockError::Held { .. })
        ));
    }
    let value: String = r.get(lock.name().lock_key()).await.unwrap();
    assert_eq!(
        value,
        holder.token().as_str(),
        "the value is still the holder's"
    );
    let pttl_after: i64 = r.pttl(lock.name().lock_key()).await.unwrap();
    assert!(
        pttl_after <= pttl_before,
        "losers never extend or rewrite the lease"
    );
    assert!(holder.release().await.unwrap(), "the holder unlocks");
}

/// Article 002: with a constant value, a holder whose lease expired deletes the next holder's
/// lock. Reproduced, then shown impossible with unique tokens and compare-and-delete.
#[tokio::test]
async fn article_002_an_expired_holder_cannot_release_the_next_holders_lock() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("a002");
    let mut r = server.connection().await;
    let key = format!("{prefix}:naive");
    let unlock = redis::Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    );

    // The recipe: every caller uses the value 1.
    let a: bool = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(100)
        .query_async::<Option<String>>(&mut r)
        .await
        .unwrap()
        .is_some();
    assert!(a);
    tokio::time::sleep(ms(200)).await; // A is slow; its lock expires.
    let b = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async::<Option<String>>(&mut r)
        .await
        .unwrap()
        .is_some();
    assert!(b, "B takes the lock");
    let deleted: i64 = unlock.key(&key).arg(1).invoke_async(&mut r).await.unwrap();
    assert_eq!(deleted, 1, "A's 'safe' unlock deletes B's lock");
    let c = redis::cmd("SET")
        .arg(&key)
        .arg(1)
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async::<Option<String>>(&mut r)
        .await
        .unwrap()
        .is_some();
    assert!(
        c,
        "C takes the lock while B still works: two holders, the bug"
    );

    // This crate.
    let config = LockConfig::builder()
        .lease(ms(100))
        .watchdog(false)
        .build()
        .unwrap();
    let client_a = client(&server, &prefix, config).await;
    let client_b = client(&server, &prefix, LockConfig::default()).await;
    let guard_a = client_a.lock("res").unwrap().try_acquire().await.unwrap();
    tokio::time::sleep(ms(200)).await;
    let lock_b = client_b.lock("res").unwrap();
    let guard_b = lock_b.try_acquire().await.unwrap();
    assert!(
        !guard_a.release().await.unwrap(),
        "A's release finds the lock is not A's"
    );
    assert!(
        matches!(lock_b.try_acquire().await, Err(LockError::Held { .. })),
        "B's lock is intact: C cannot take it"
    );
    assert!(guard_b.release().await.unwrap());
}

/// Redis goes away while a task waits: the wait ends with `Unavailable` (not at its 60 s
/// deadline), and once Redis is back the same client works again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_wait_then_the_client_recovers() {
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("outage");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let lock = c.lock("job").unwrap();
    let holder = lock.try_acquire().await.unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.acquire(Duration::from_secs(60)).await }
    });
    tokio::time::sleep(ms(300)).await;
    assert!(!waiter.is_finished(), "the waiter is waiting");
    server.stop().await;
    match waiter.await.unwrap() {
        Err(e @ LockError::Unavailable { .. }) => assert!(e.is_unavailable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    drop(holder);

    server.restart().await;
    let mut recovered = None;
    for _ in 0..100 {
        match lock.try_acquire().await {
            Ok(guard) => {
                recovered = Some(guard);
                break;
            }
            Err(LockError::Unavailable { .. }) => tokio::time::sleep(ms(50)).await,
            Err(other) => panic!("{other:?}"),
        }
    }
    let guard = recovered.expect("the client reconnects by itself");
    assert!(guard.release().await.unwrap());
}

/// The watchdog renews a lease much shorter than the hold.
#[tokio::test]
async fn the_watchdog_keeps_a_long_hold() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("watchdog");
    let c = client(&server, &prefix, short_lease(300)).await;
    let lock = c.lock("long").unwrap();
    let guard = lock.try_acquire().await.unwrap();
    let still = tokio::time::timeout(ms(1_200), guard.lost()).await;
    assert!(still.is_err(), "no loss during four leases");
    assert!(guard.is_held());
    let mut r = server.connection().await;
    let value: String = r.get(lock.name().lock_key()).await.unwrap();
    assert_eq!(value, guard.token().as_str());
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held { .. })
    ));
    assert!(guard.release().await.unwrap());
}

/// A renewal that finds the lock gone fires the loss signal with `NotOwner`.
#[tokio::test]
async fn the_loss_signal_fires_when_the_lock_is_taken_away() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("taken");
    let c = client(&server, &prefix, short_lease(600)).await;
    let lock = c.lock("k").unwrap();
    let guard = lock.try_acquire().await.unwrap();
    let lease = guard.lease();
    let mut r = server.connection().await;
    let _: () = r.del(lock.name().lock_key()).await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("loss signalled");
    assert_eq!(reason, LossReason::NotOwner);
    assert!(matches!(lease.check(), Err(LockError::LeaseLost { .. })));
    assert!(!guard.release().await.unwrap());
}

/// The hold cap stops renewal: the loss signal says so and the lock frees itself.
#[tokio::test]
async fn the_hold_cap_ends_the_lease() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("cap");
    let config = LockConfig::builder()
        .lease(ms(200))
        .max_hold(ms(500))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let lock = c.lock("k").unwrap();
    let guard = lock.try_acquire().await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the cap is reached");
    assert_eq!(reason, LossReason::HoldLimit);
    let other = lock.acquire(Duration::from_secs(5)).await.unwrap();
    assert!(other.fence() > guard.fence());
}

/// Reentrant locks on Redis: holds nest per owner; another owner waits for the last release.
#[tokio::test]
async fn reentrant_holds_nest_per_owner() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("reentrant");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let me = OwnerId::new("worker-1").unwrap();
    let other = OwnerId::new("worker-2").unwrap();
    let outer = c
        .reentrant("ledger", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let inner = c
        .reentrant("ledger", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert_eq!(inner.fence(), outer.fence());
    let theirs = c.reentrant("ledger", &other).unwrap();
    assert!(matches!(
        theirs.try_acquire().await,
        Err(LockError::Held { .. })
    ));
    // An exclusive lock on the same name is excluded too.
    assert!(matches!(
        c.lock("ledger").unwrap().try_acquire().await,
        Err(LockError::Held { .. })
    ));
    assert!(inner.release().await.unwrap());
    assert!(matches!(
        theirs.try_acquire().await,
        Err(LockError::Held { .. })
    ));
    let waiting = tokio::spawn({
        let theirs = theirs.clone();
        async move { theirs.acquire(Duration::from_secs(10)).await }
    });
    let outer_fence = outer.fence();
    assert!(outer.release().await.unwrap());
    let got = waiting.await.unwrap().unwrap();
    assert!(got.fence() > outer_fence);
}

/// A command that times out may still run on the server: the attempt reports an ambiguous
/// failure and deletes the lock it may have taken, long before that lock's lease would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_acquisition_is_cleaned_up() {
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("ambiguous");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(60))
        .op_timeout(ms(100))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let lock = c.lock("k").unwrap();
    // Warm up the connection and load the scripts.
    lock.try_acquire().await.unwrap().release().await.unwrap();

    let mut slow = server.connection().await;
    let sleeper = tokio::spawn(async move {
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(0.3)
            .query_async(&mut slow)
            .await
            .unwrap();
    });
    tokio::time::sleep(ms(50)).await;
    match lock.try_acquire().await {
        Err(LockError::Unavailable { ambiguous, .. }) => assert!(ambiguous),
        other => panic!("expected an ambiguous Unavailable, got {other:?}"),
    }
    sleeper.await.unwrap();
    // Redis ran the acquisition after its sleep; the cleanup deletes it.
    let mut r = server.connection().await;
    let mut gone = false;
    for _ in 0..100 {
        let exists: bool = r.exists(lock.name().lock_key()).await.unwrap();
        if !exists {
            gone = true;
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    assert!(
        gone,
        "the lock taken by the timed-out attempt was deleted (its lease is 60 s)"
    );
    assert!(lock.try_acquire().await.unwrap().release().await.unwrap());
}

/// The process stalls past the lease between the acquisition's reply and its handling (the
/// command timeout cannot fire: the reply is ready when the timer is looked at). The lease can
/// no longer be proven, so no guard is handed out: the attempt fails as one that timed out (and
/// is cleaned up as one; here the lock has expired by then anyway). Before, the caller got a
/// guard already lost, whose fence was
/// usable at a resource; and on one Redis the fence is drawn behind the `SET`, so a stall
/// between the two could have drawn it after the next holder's.
#[tokio::test]
async fn a_reply_handled_after_the_lease_ended_is_never_a_guard() {
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("stalled-reply");
    let conn = testkit::HookedConnection::new(server.connection().await);
    let c = LockClient::builder()
        .config(short_lease(300))
        .prefix(&prefix)
        .unwrap()
        .redis(conn.clone())
        .unwrap();
    let lock = c.lock("k").unwrap();
    // Warm up the connection and load the scripts.
    lock.try_acquire().await.unwrap().release().await.unwrap();
    // The process stalls (its thread blocked) with the next reply in hand.
    conn.after_next_reply(|| async { std::thread::sleep(ms(450)) });
    match lock.try_acquire().await {
        Err(LockError::Unavailable { ambiguous, .. }) => assert!(ambiguous),
        Ok(guard) => panic!(
            "a guard handed out after its lease (held: {}, fence {})",
            guard.is_held(),
            guard.fence()
        ),
        Err(other) => panic!("expected an ambiguous Unavailable, got {other:?}"),
    }
}

/// An explicit release whose future is dropped after its first poll (the caller's request
/// cancelled, a `select!` that took another branch) still releases: as a dropped guard does, in
/// a task. On a current-thread runtime the first poll only queues the command, and redis-rs
/// discards a queued request whose caller went away; so does an abort of a run-once lock.
#[tokio::test]
async fn a_release_dropped_after_its_first_poll_still_releases() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("dropped-release");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let lock = c.lock("k").unwrap();
    let guard = lock.try_acquire().await.unwrap();
    let mut release = Box::pin(guard.release());
    assert!(futures_util::poll!(&mut release).is_pending());
    drop(release);
    assert!(
        c.settle(Duration::from_secs(5)).await,
        "the background release ends"
    );
    let again = lock.try_acquire().await;
    assert!(
        again.is_ok(),
        "a cancelled release left the lock held for its 30 s lease: {again:?}"
    );

    let once = c.once("job").unwrap();
    let Begin::Acquired(guard) = once.begin("").await.unwrap() else {
        panic!("free")
    };
    let mut abort = Box::pin(guard.abort());
    assert!(futures_util::poll!(&mut abort).is_pending());
    drop(abort);
    assert!(
        c.settle(Duration::from_secs(5)).await,
        "the background release ends"
    );
    assert!(
        matches!(once.begin("").await, Ok(Begin::Acquired(_))),
        "a cancelled abort left the run-once lock held"
    );
}

/// A holder that dies without releasing: its lock expires at the end of the lease and a waiter
/// takes it then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_lock_is_taken_when_its_lease_ends() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("crash");
    let url = server.url();
    let p = prefix.clone();
    let fence = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let fence = rt.block_on(async {
            let c = connect(&url, &p, short_lease(400)).await;
            let guard = c.lock("k").unwrap().try_acquire().await.unwrap();
            let fence = guard.fence();
            std::mem::forget(guard);
            fence
        });
        // The runtime goes away with its watchdog: no renewal, no release. A crash.
        drop(rt);
        fence
    })
    .join()
    .unwrap();
    let c = client(&server, &prefix, LockConfig::default()).await;
    let lock = c.lock("k").unwrap();
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held { .. })
    ));
    let guard = lock.acquire(Duration::from_secs(10)).await.unwrap();
    assert!(guard.fence() > fence);
}

/// Run-once on Redis: begin, in-flight with the holder's tag, complete, replay; an aborted
/// attempt leaves no record.
#[tokio::test]
async fn once_records_on_redis() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("once");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let once = c
        .once("evt_1")
        .unwrap()
        .retention(Duration::from_secs(60))
        .unwrap();
    let Begin::Acquired(first) = once.begin("fp-a").await.unwrap() else {
        panic!("free")
    };
    match once.begin("fp-b").await.unwrap() {
        Begin::InFlight {
            tag, retry_after, ..
        } => {
            assert_eq!(&tag[..], b"fp-a");
            assert!(retry_after.is_some());
        }
        other => panic!("{other:?}"),
    }
    assert!(first.abort().await.unwrap());
    let Begin::Acquired(second) = once.begin("fp-a").await.unwrap() else {
        panic!("an aborted attempt leaves no record")
    };
    let fence = second.fence();
    let waiter = tokio::spawn({
        let once = once.clone();
        async move { once.begin_wait("fp-a", Duration::from_secs(10)).await }
    });
    second.complete(b"201 {\"id\":7}").await.unwrap();
    match waiter.await.unwrap().unwrap() {
        Begin::Done(record) => {
            assert_eq!(record.whole().map(|w| &w[..]), Some(&b"201 {\"id\":7}"[..]))
        }
        other => panic!("{other:?}"),
    }
    assert!(fence >= 2);
    let mut r = server.connection().await;
    let ttl: i64 = r.pttl(once.name().state_key()).await.unwrap();
    assert!(
        ttl > 0 && ttl <= 60_000,
        "the record is kept for the retention: {ttl}"
    );
}

/// A completion whose lease was lost stores nothing.
#[tokio::test]
async fn a_completion_after_the_lease_was_lost_is_refused() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("once-lost");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let once = c.once("evt").unwrap();
    let Begin::Acquired(guard) = once.begin("").await.unwrap() else {
        panic!()
    };
    let mut r = server.connection().await;
    let _: () = r.del(once.name().lock_key()).await.unwrap();
    let Begin::Acquired(second) = once.begin("").await.unwrap() else {
        panic!("the lock was taken away")
    };
    match guard.complete(b"late").await {
        Err(LockError::LeaseLost { reason, .. }) => assert_eq!(reason, LossReason::NotOwner),
        other => panic!("{other:?}"),
    }
    second.complete(b"right").await.unwrap();
    assert!(
        matches!(once.begin("").await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"right"))
    );
}

/// Announcements, proven without the polling fallback: a waiter in another client (so not
/// woken locally) with polling off is woken only if the scripts announce releases on the
/// channel it listens to. Exclusive release, reentrant last release and completion each wake
/// it well within its wait (the holder's lease, 10 s, would be the only other wake-up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_wake_a_waiter_in_another_client_without_polling() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("announce");
    let config = LockConfig::builder().polling(false).build().unwrap();
    let holder = client(&server, &prefix, config.clone()).await;
    let waiter = client(&server, &prefix, config).await;
    let wait = Duration::from_secs(5);

    // Exclusive lock.
    let held = holder.lock("x").unwrap().try_acquire().await.unwrap();
    let lock = waiter.lock("x").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire(wait).await });
    tokio::time::sleep(ms(200)).await;
    assert!(held.release().await.unwrap());
    let got = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the announcement woke the waiter")
        .unwrap()
        .unwrap();
    assert!(got.release().await.unwrap());

    // Reentrant: the last hold's release is announced.
    let me = OwnerId::random();
    let a = holder
        .reentrant("r", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let b = holder
        .reentrant("r", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let lock = waiter.reentrant("r", &OwnerId::random()).unwrap();
    let waiting = tokio::spawn(async move { lock.acquire(wait).await });
    tokio::time::sleep(ms(200)).await;
    assert!(a.release().await.unwrap());
    assert!(b.release().await.unwrap());
    let got = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the last release woke the waiter")
        .unwrap()
        .unwrap();
    assert!(got.release().await.unwrap());

    // Completion.
    let Begin::Acquired(g) = holder.once("o").unwrap().begin("t").await.unwrap() else {
        panic!("free")
    };
    let once = waiter.once("o").unwrap();
    let waiting = tokio::spawn(async move { once.begin_wait("t", wait).await });
    tokio::time::sleep(ms(200)).await;
    g.complete(b"done").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the completion woke the waiter")
        .unwrap()
        .unwrap();
    assert!(matches!(got, Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"done")));
}

/// An ACL user without pub/sub channel rights (Redis 7's `resetchannels`): releases and
/// completions happened and say so (the announcement is refused, not the write), and the
/// notification task does not reconnect in a loop: waiters poll instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_channel_rights_writes_succeed_and_waiters_poll() {
    let server = RedisServer::start_owned().await;
    let mut admin = server.connection().await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "nochan",
            "on",
            ">pw",
            "~*",
            "resetchannels",
            "+@all",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://nochan:pw@127.0.0.1:{}/", server.port());
    let prefix = testkit::unique_prefix("nochan");
    let c = connect(&url, &prefix, LockConfig::default()).await;
    let lock = c.lock("k").unwrap();
    let held = lock.try_acquire().await.unwrap();
    let connections = |info: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("total_connections_received:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    let waiting = tokio::spawn({
        let lock = lock.clone();
        async move { lock.acquire(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(ms(200)).await;
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut admin)
        .await
        .unwrap();
    let before = connections(&info);
    tokio::time::sleep(ms(1_000)).await;
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut admin)
        .await
        .unwrap();
    let opened = connections(&info) - before;
    assert!(
        opened <= 2,
        "{opened} connections in a second: a reconnect loop"
    );
    assert!(
        held.release().await.expect("the release happened"),
        "and it was ours"
    );
    let got = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiter polls")
        .unwrap()
        .unwrap();
    drop(got);
    let once = c.once("o").unwrap();
    let Begin::Acquired(g) = once.begin("t").await.unwrap() else {
        panic!("free")
    };
    g.complete(b"r").await.expect("the completion happened");
    assert!(
        matches!(once.begin("t").await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"r"))
    );
}

/// A refused connection never sent the command: the error is not ambiguous, so no cleanup is
/// spawned for it (callers retrying through an outage would pile them up).
#[tokio::test]
async fn a_refused_connection_is_not_an_ambiguous_acquisition() {
    let port = testkit::free_port().unwrap();
    let c = LockClient::builder()
        .connect(&format!("redis://127.0.0.1:{port}/"))
        .unwrap();
    match c.lock("k").unwrap().try_acquire().await {
        Err(LockError::Unavailable { ambiguous, .. }) => assert!(!ambiguous),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// A streamed record whose parts vanished (evicted) before its completion: the completion is
/// refused (`BrokenRecord`) and, with `try_complete`, the guard still holds the lock, so the
/// writer can store a one-part record in place of the parts (`complete_whole`): done, whole,
/// its parts deleted; the work is not run again.
#[tokio::test]
async fn a_broken_streamed_record_can_be_completed_whole() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("complete-whole");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let once = c.once("export").unwrap();
    let name = once.name().clone();
    let mut r = server.connection().await;
    let Begin::Acquired(mut g) = once.begin("t").await.unwrap() else {
        panic!("free")
    };
    g.append(b"p0").await.unwrap();
    let _: () = r.del(name.parts_key()).await.unwrap();
    match g.try_complete(b"end").await {
        Err(LockError::BrokenRecord { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(once.begin("t").await.unwrap(), Begin::InFlight { .. }),
        "the guard still holds the lock"
    );
    // A part appended again makes the list non-empty: it goes too.
    let _: () = r.rpush(name.parts_key(), "stale").await.unwrap();
    g.complete_whole(b"summary").await.unwrap();
    match once.begin("t").await.unwrap() {
        Begin::Done(record) => {
            assert_eq!(record.parts(), 1);
            assert_eq!(record.whole().map(|w| &w[..]), Some(&b"summary"[..]));
        }
        other => panic!("{other:?}"),
    }
    let exists: bool = r.exists(name.parts_key()).await.unwrap();
    assert!(!exists, "the parts are deleted");
}

/// Every key of a streamed record lives for the record's retention: the state and the parts
/// from the first append on, refreshed by every append and every renewal of the lease (a
/// writer that appends rarely does not lose its first parts), and both after completion; the
/// lock key has the lease and goes with the completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_streamed_record_has_the_retention() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("stream-ttl");
    let config = LockConfig::builder()
        .lease(ms(900))
        .op_timeout(ms(200))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let once = c
        .once("export")
        .unwrap()
        .retention(Duration::from_secs(3))
        .unwrap();
    let name = once.name().clone();
    let mut r = server.connection().await;
    let Begin::Acquired(g) = once.begin("t").await.unwrap() else {
        panic!("free")
    };
    g.append(b"p0").await.unwrap();
    let pttl = |key: String| {
        let mut r = r.clone();
        async move { r.pttl::<_, i64>(key).await.unwrap() }
    };
    let (state, parts) = (name.state_key().to_owned(), name.parts_key().to_owned());
    assert!(
        pttl(parts.clone()).await > 2_800,
        "the parts have the retention"
    );
    assert!(pttl(state.clone()).await > 2_800);
    assert!(
        pttl(name.lock_key().to_owned()).await <= 900,
        "the lock has the lease"
    );
    // No append for 1.5 s: the renewals keep every key's retention.
    tokio::time::sleep(ms(1_500)).await;
    assert!(
        pttl(parts.clone()).await > 2_000,
        "renewals refresh the parts too"
    );
    assert!(pttl(state.clone()).await > 2_000);
    g.append(b"p1").await.unwrap();
    assert!(
        pttl(parts.clone()).await > 2_800,
        "an append refreshes them"
    );
    g.complete(b"p2").await.unwrap();
    for key in [&state, &parts] {
        let ttl = pttl(key.clone()).await;
        assert!((2_800..=3_000).contains(&ttl), "{key}: {ttl}");
    }
    let exists: bool = r.exists(name.lock_key()).await.unwrap();
    assert!(!exists);
}

/// The absolute expiry (Unix ms, `PEXPIRETIME`) of the state and of the parts of `name`'s
/// record, read in one transaction.
async fn expiry_times(
    r: &mut redis::aio::MultiplexedConnection,
    name: &distlock::LockName,
) -> (i64, i64) {
    redis::pipe()
        .atomic()
        .cmd("PEXPIRETIME")
        .arg(name.state_key())
        .cmd("PEXPIRETIME")
        .arg(name.parts_key())
        .query_async(r)
        .await
        .unwrap()
}

/// A streamed record's parts never expire before the state that says it is done. Redis (7.0)
/// reads its clock per command inside a script: the completion set the parts' retention first
/// and the state's a moment later, so when a millisecond passed between them the state outlived
/// its parts by 1 ms, in which a replay found "done" and no parts (unreadable instead of a
/// fresh run). Many completions, each checked on the absolute expiry times.
#[tokio::test]
async fn a_streamed_records_parts_never_expire_before_its_state() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("stream-expiry-order");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let mut r = server.connection().await;
    let mut inverted = Vec::new();
    for i in 0..2_000 {
        let once = c
            .once(&format!("export-{i}"))
            .unwrap()
            .retention(Duration::from_secs(60))
            .unwrap();
        let Begin::Acquired(g) = once.begin("t").await.unwrap() else {
            panic!("free")
        };
        g.append(b"p0").await.unwrap();
        g.complete(b"end").await.unwrap();
        let (state, parts) = expiry_times(&mut r, once.name()).await;
        assert!(state > 0 && parts > 0, "state {state}, parts {parts}");
        if parts < state {
            inverted.push((i, state - parts));
        }
    }
    assert!(
        inverted.is_empty(),
        "records whose parts expire before their state (record, ms): {inverted:?}"
    );
}

/// A release hands the lock to the next waiter of its own client in the release's round trip,
/// ahead of other clients' waiters (woken by the store's announcement, a round trip later); not
/// every time (one release in nine, drawn at random, wakes it only once answered), so a waiter
/// in another client (another instance of the service) still gets the lock while two local
/// tasks keep taking turns, rather than only once they stop. Between turns no local waiter is
/// left, so nothing about the local queue lasts from one release to the next.
///
/// A liveness check: on loopback in one process the local waiter's wake-up is slow enough that
/// the other client's waiter gets in within a few turns even when every release hands over
/// early, so this does not tell the 1-in-9 rule from none; it catches starvation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clients_waiter_gets_its_turn_between_two_local_tasks() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("turns");
    let config = LockConfig::builder().lease(ms(5_000)).build().unwrap();
    let here = client(&server, &prefix, config.clone()).await;
    let there = client(&server, &prefix, config).await;
    let turns = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let lock = here.lock("turns").unwrap();
        let (turns, stop) = (turns.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let guard = lock.acquire(Duration::from_secs(60)).await.unwrap();
                tokio::time::sleep(ms(2)).await;
                guard.release().await.unwrap();
                turns.fetch_add(1, Ordering::SeqCst);
                // Away for a moment: the other task takes the lock, and no local waiter is
                // left until this one comes back.
                tokio::time::sleep(ms(1)).await;
            }
        }));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while turns.load(Ordering::SeqCst) < 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "the local tasks made no progress"
        );
        tokio::time::sleep(ms(1)).await;
    }
    let started = turns.load(Ordering::SeqCst);
    let waiting = tokio::spawn(async move {
        let guard = there
            .lock("turns")
            .unwrap()
            .acquire(Duration::from_secs(120))
            .await
            .unwrap();
        guard.release().await.unwrap();
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !waiting.is_finished() && turns.load(Ordering::SeqCst) < started + 300 {
        assert!(
            std::time::Instant::now() < deadline,
            "neither the other client's waiter nor the local tasks got on"
        );
        tokio::time::sleep(ms(1)).await;
    }
    let waited = turns.load(Ordering::SeqCst) - started;
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the local tasks stop")
            .unwrap();
    }
    assert!(
        waiting.is_finished(),
        "the other client's waiter did not get the lock in {waited} local turns"
    );
    waiting.await.unwrap();
}

/// A release found its script gone (`FUNCTION FLUSH` and `SCRIPT FLUSH`, a restarted or
/// failed-over server): it is answered that the function is not found (or `NOSCRIPT`), loads
/// the library (or the script) and is sent again. The next local waiter, woken as soon
/// as the release was first sent, tried in between (its unfenced `SET NX` needs no script),
/// found the lock still held, and the release's announcement, already counted as heard, woke
/// no one. Without polling, and with the old holder's lease 30 s away, the waiter must still
/// take the lock at once, not when that lease would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_hand_over_came_too_early_looks_again() {
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("noscript");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .fencing(false)
        .polling(false)
        .build()
        .unwrap();
    let here = client(&server, &prefix, config).await;
    let mut admin = server.connection().await;
    for round in 0..3 {
        let lock = here.lock("job").unwrap();
        let channel = lock.name().channel().to_owned();
        let held = lock.try_acquire().await.unwrap();
        let waiter = tokio::spawn({
            let lock = lock.clone();
            async move { lock.acquire(Duration::from_secs(25)).await }
        });
        assert!(
            server.subscribed(&channel, Duration::from_secs(10)).await,
            "the waiter never subscribed"
        );
        // Its look after subscribing done: it sleeps until woken (or the lease's end).
        tokio::time::sleep(ms(200)).await;
        for flushed in ["FUNCTION", "SCRIPT"] {
            let _: () = redis::cmd(flushed)
                .arg("FLUSH")
                .query_async(&mut admin)
                .await
                .unwrap();
        }
        assert!(held.release().await.unwrap());
        let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap_or_else(|_| {
                panic!("round {round}: the waiter still waits 5 s after the lock was freed")
            })
            .unwrap()
            .unwrap();
        assert!(guard.release().await.unwrap());
    }
}

/// A Redis at `maxclients` answers a reconnecting client's first command with "max number of
/// clients reached": the store is out of reach for now, and a completion meeting it is retried
/// within the lease like any unreachable store, not taken for a record the store refused
/// (before: `LockError::Redis`, which the layer stored as an outcome without its body; found by
/// `tests/disconnect.rs::the_client_leaves_while_the_completion_is_retried` on CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_meeting_maxclients_is_retried_until_redis_takes_connections() {
    let server = RedisServer::start_owned().await;
    let mut admin = server.connection().await;
    let c = LockClient::builder()
        .config(LockConfig::builder().lease(ms(30_000)).build().unwrap())
        .prefix(&testkit::unique_prefix("maxclients"))
        .unwrap()
        .connect(&server.url())
        .unwrap();
    c.prepare().await.unwrap();
    let once = c.once("o").unwrap();
    let Begin::Acquired(mut guard) = once.begin("t").await.unwrap() else {
        panic!("free")
    };
    let maxclients = |n: u32| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxclients").arg(n);
        cmd
    };
    maxclients(1).query_async::<()>(&mut admin).await.unwrap();
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async::<i64>(&mut admin)
        .await
        .unwrap();
    let completing = tokio::spawn(async move { guard.try_complete(b"record").await });
    // Long enough for the reconnecting client to be answered "max number of clients reached"
    // (not only broken pipes): up to about 8 s here. The 30 s lease outlasts it.
    let refusing = tokio::time::Instant::now() + Duration::from_secs(10);
    while !completing.is_finished() && tokio::time::Instant::now() < refusing {
        tokio::time::sleep(ms(50)).await;
    }
    maxclients(10_000)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    let completed = tokio::time::timeout(Duration::from_secs(20), completing)
        .await
        .expect("the completion ends once Redis takes connections")
        .unwrap();
    assert!(completed.is_ok(), "retried until stored: {completed:?}");
    let Begin::Done(record) = once.begin("t").await.unwrap() else {
        panic!("the record is stored")
    };
    assert_eq!(record.whole().map(|r| &r[..]), Some(&b"record"[..]));
}

tokio::task_local! {
    /// Which waiter a task is, for a hook that runs inside it.
    static WAITER: usize;
}

/// A release wakes one waiter of this client. That waiter's request is then dropped (a client
/// that left: the normal case in a server) while its look at the lock is on its way, or once
/// Redis answered it. Its wake must go to the next waiter: the lock is free (or freed by the
/// dropped look's cleanup), and no other release is coming. Before, the other waiter slept on
/// until its own timer (polling off: the end of the old holder's lease, 30 s away). On a
/// client without pub/sub (a connection handed to the builder) the cleanup's release wakes no
/// one either.
#[tokio::test]
async fn a_woken_waiter_dropped_before_its_look_is_sent_passes_its_wake_on() {
    dropped_woken_waiter(true).await;
}

#[tokio::test]
async fn a_woken_waiter_dropped_after_its_look_took_the_lock_passes_its_wake_on() {
    dropped_woken_waiter(false).await;
}

async fn dropped_woken_waiter(before_sending: bool) {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("dropped-waiter");
    let conn = testkit::HookedConnection::new(server.connection().await);
    let mut admin = server.connection().await;
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .retry(ms(10), ms(50))
        .polling(false)
        .build()
        .unwrap();
    let c = LockClient::builder()
        .config(config)
        .prefix(&prefix)
        .unwrap()
        .redis(conn.clone())
        .unwrap();
    let lock = c.lock("k").unwrap();
    let held = lock.try_acquire().await.unwrap();
    let looks_before = script_calls(&mut admin).await;
    let mut waiters: Vec<_> = (0..2)
        .map(|i| {
            let lock = lock.clone();
            tokio::spawn(WAITER.scope(
                i,
                async move { lock.acquire(Duration::from_secs(25)).await },
            ))
        })
        .collect();
    // Both looked (three or four looks between them), found the lock held, and sleep until
    // woken (or the old lease's end): no look for 200 ms.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut seen = (looks_before, std::time::Instant::now());
    loop {
        tokio::time::sleep(ms(20)).await;
        let looks = script_calls(&mut admin).await;
        if looks != seen.0 {
            seen = (looks, std::time::Instant::now());
        } else if looks >= looks_before + 3 && seen.1.elapsed() >= ms(200) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the waiters kept looking: {} looks",
            looks - looks_before
        );
    }
    let (tell, woken) = tokio::sync::oneshot::channel();
    let hook = move || async move {
        let _ = tell.send(WAITER.try_with(|w| *w).ok());
        std::future::pending::<()>().await;
    };
    // The acquire function's call (Redis 7 functions; not the release, sent first).
    if before_sending {
        conn.before_sending(b"_acquire", hook);
    } else {
        conn.after_reply_to(b"_acquire", hook);
    }
    assert!(held.release().await.unwrap());
    let woken = tokio::time::timeout(Duration::from_secs(5), woken)
        .await
        .expect("no waiter called the acquire function within 5 s of the release")
        .unwrap()
        .expect("the look ran outside the waiters' tasks");
    waiters[woken].abort();
    let other = &mut waiters[1 - woken];
    let guard = tokio::time::timeout(Duration::from_secs(5), other)
        .await
        .expect("the other waiter still waits 5 s after the lock was freed")
        .unwrap()
        .unwrap();
    assert!(guard.release().await.unwrap());
}

/// The function and script calls Redis has run so far (`INFO commandstats`).
async fn script_calls(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A follower of a live record whose parts Redis lost (evicted under `maxmemory`, deleted)
/// while the writer lives is told at once, not left waiting: a writer's list never shrinks, so
/// fewer parts than the follower has read means parts lost. Before, it was told "writing, no
/// parts" and waited for the writer (whose next append is refused, and who then appends no
/// more) until the writer's run ended: a live stream's joiner sat silent for as long.
#[tokio::test]
async fn a_follower_whose_parts_were_lost_is_told_at_once() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("parts-lost-follow");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let once = c.once("s").unwrap();
    let Begin::Acquired(writer) = once.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    writer.append(b"a").await.unwrap();
    writer.append(b"b").await.unwrap();
    let mut follower = once.follow(0);
    let soon = || std::time::Instant::now() + Duration::from_secs(1);
    assert_eq!(follower.next(8, soon()).await.unwrap().parts().len(), 2);
    let mut admin = server.connection().await;
    let _: () = admin.del(once.name().parts_key()).await.unwrap();
    let read = tokio::time::timeout(
        Duration::from_secs(5),
        follower.next(8, std::time::Instant::now() + Duration::from_secs(20)),
    )
    .await
    .expect("the follower still waits 5 s after the parts it read were lost");
    match read {
        Err(LockError::BrokenRecord { .. }) => {}
        other => panic!("expected BrokenRecord, got {other:?}"),
    }
    drop(writer);
}

/// A completion wakes whoever waits for it, however they wait, with polling off: a duplicate
/// that found the lock held, a reader that follows the parts from before the first one (the
/// writer then completing in one part, without appending), and a reader of appended parts. Each
/// gets the record at once, long before the holder's lease (60 s) would have ended. (A version
/// that announced only when a waiter had marked the state left the second one waiting.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_wakes_every_kind_of_waiter() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("announce");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(60))
        .polling(false)
        .build()
        .unwrap();
    let c = client(&server, &prefix, config.clone()).await;
    let other = client(&server, &prefix, config).await;
    let later = || std::time::Instant::now() + Duration::from_secs(50);
    // A duplicate waits.
    let once = c.once("waited").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    let waiter = tokio::spawn({
        let once = other.once("waited").unwrap();
        async move { once.begin_wait("fp", Duration::from_secs(50)).await }
    });
    tokio::time::sleep(ms(100)).await;
    guard.complete(b"done").await.unwrap();
    let woken = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiting duplicate was not woken within 10 s (its lease had 50 s left)")
        .unwrap()
        .unwrap();
    assert!(matches!(woken, Begin::Done(r) if &r.first()[..] == b"done"));
    // A reader follows from before the first part; the writer completes in one part.
    let once = c.once("whole").unwrap();
    let Begin::Acquired(writer) = once.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    let mut follower = other.once("whole").unwrap().follow(0);
    let reading = tokio::spawn(async move { follower.next(8, later()).await });
    tokio::time::sleep(ms(100)).await;
    writer.complete(b"whole").await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(10), reading)
        .await
        .expect("the reader that followed from before the first part was not woken within 10 s of the completion")
        .unwrap()
        .unwrap();
    assert_eq!(read.parts(), &[bytes::Bytes::from_static(b"whole")]);
    // A reader of appended parts hears the end (after each part's progress).
    let once = c.once("streamed").unwrap();
    let Begin::Acquired(writer) = once.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    writer.append(b"a").await.unwrap();
    let mut follower = other.once("streamed").unwrap().follow(0);
    assert_eq!(follower.next(8, later()).await.unwrap().parts().len(), 1);
    let reading = tokio::spawn(async move { follower.next(8, later()).await });
    tokio::time::sleep(ms(50)).await;
    writer.complete(b"b").await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(10), reading)
        .await
        .expect("the reader was not woken within 10 s of the completion")
        .unwrap()
        .unwrap();
    assert_eq!(read.parts(), &[bytes::Bytes::from_static(b"b")]);
}

/// A writer that died mid-stream leaves parts; the next writer starts from none, whatever the
/// state says about them. Here the state keeps no mark of the parts (as one left by another
/// version of the scripts, or evicted and made again, leaves it): the next writer's first part
/// is still its first, and a reader of its record reads its parts, never the dead writer's.
#[tokio::test]
async fn a_dead_writers_parts_are_never_the_next_writers() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("inherit");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(60))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let mut admin = server.connection().await;
    let once = c.once("stream").unwrap();
    let Begin::Acquired(dead) = once.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    dead.append(b"old").await.unwrap();
    // The writer dies (its lease ends), and its state keeps only the counter and the tag.
    let state = once.name().state_key();
    let fields: Vec<String> = admin.hkeys(state).await.unwrap();
    for field in fields
        .iter()
        .filter(|f| !["n", "m", "t"].contains(&f.as_str()))
    {
        let _: i64 = admin.hdel(state, field).await.unwrap();
    }
    let _: i64 = admin.del(once.name().lock_key()).await.unwrap();
    std::mem::forget(dead);
    let Begin::Acquired(next) = once.begin("fp").await.unwrap() else {
        panic!("the next writer takes the lock")
    };
    next.append(b"new")
        .await
        .expect("the next writer's first part is its first");
    next.complete(b"end").await.unwrap();
    let mut follower = c.once("stream").unwrap().follow(0);
    let read = follower
        .next(8, std::time::Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(
        read.parts(),
        &[
            bytes::Bytes::from_static(b"new"),
            bytes::Bytes::from_static(b"end")
        ],
        "the dead writer's part served as the next writer's"
    );
}

/// The holder's tag names a holder: a completed record keeps none, in one part or streamed.
/// `complete.lua` overwrites it with the completing token in the write that stores the record
/// (deleting it would cost a command, an empty field some 40 bytes per record), so a record
/// holds no field it did not hold before, and the record replays as stored.
#[tokio::test]
async fn a_completed_record_keeps_no_holders_tag() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("tagless");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let mut admin = server.connection().await;
    for (name, streamed) in [("whole", false), ("streamed", true)] {
        let once = c.once(name).unwrap();
        let Begin::Acquired(run) = once.begin("in-flight tag").await.unwrap() else {
            panic!("{name}: the lock is free")
        };
        let state = once.name().state_key().to_owned();
        let tag: Option<String> = admin.hget(&state, "m").await.unwrap();
        assert_eq!(
            tag.as_deref(),
            Some("in-flight tag"),
            "{name}: shown while held"
        );
        if streamed {
            run.append(b"first").await.unwrap();
        }
        let token = run.guard().token().as_str().to_owned();
        run.complete(b"record").await.unwrap();
        let tag: Option<String> = admin.hget(&state, "m").await.unwrap();
        assert_eq!(
            tag.as_deref(),
            Some(token.as_str()),
            "{name}: the completing token in place of the tag"
        );
        // What an operator's inspection reads of it: no tag beside a record.
        let inspected: Vec<redis::Value> = redis::cmd("EVAL")
            .arg(include_str!("../src/backend/redis/scripts/inspect.lua"))
            .arg(3)
            .arg(once.name().lock_key())
            .arg(&state)
            .arg(once.name().parts_key())
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(inspected[2], redis::Value::Nil, "{name}: {inspected:?}");
        let mut fields: Vec<String> = admin.hkeys(&state).await.unwrap();
        fields.sort();
        let record_field = if streamed { "p" } else { "d" };
        let mut expected = vec!["m", "n", "t", record_field];
        expected.sort();
        assert_eq!(fields, expected, "{name}: the fields of a stored record");
        let inspection = once.inspect().await.unwrap();
        assert!(inspection.holder.is_none(), "{name}: {inspection:?}");
        match once.begin("another").await.unwrap() {
            Begin::Done(_) => {}
            _ => panic!("{name}: the record replays"),
        }
    }
}

/// A completion whose lock is gone is recognised as done only beside a record its token
/// stored: the field that names the completing token holds a holder's tag until then, and a
/// tag is whatever bytes its caller passed (here the first holder's token, which its
/// announcements publish). Before, a holder that lost its lock to one whose tag was its token
/// was told its record was stored.
#[tokio::test]
async fn a_tag_equal_to_a_lost_holders_token_is_no_completion() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("tag-token");
    let c = client(&server, &prefix, LockConfig::default()).await;
    let mut admin = server.connection().await;
    let once = c.once("name").unwrap();
    let Begin::Acquired(first) = once.begin("first").await.unwrap() else {
        panic!("the lock is free")
    };
    let token = first.guard().token().as_str().to_owned();
    // The first holder's lock is lost (a failover, an expiry the holder did not see).
    let _: i64 = admin.del(once.name().lock_key()).await.unwrap();
    let Begin::Acquired(second) = once.begin(token.clone()).await.unwrap() else {
        panic!("the next writer takes the free lock")
    };
    match first.complete(b"never stored").await {
        Err(LockError::LeaseLost { .. }) => {}
        other => panic!("a completion that stored nothing answered {other:?}"),
    }
    second.complete(b"stored").await.unwrap();
    match once.begin("third").await.unwrap() {
        Begin::Done(record) => assert_eq!(&record.first()[..], b"stored"),
        _ => panic!("the second writer's record replays"),
    }
}

/// What a call to Redis runs, command by command (`INFO commandstats`, which counts the
/// commands a script runs too), read on `admin` before and after it: the counts after less
/// those before, less the `INFO` that read them before.
async fn commands_run<F: std::future::Future>(
    admin: &mut redis::aio::MultiplexedConnection,
    call: F,
) -> (F::Output, std::collections::BTreeMap<String, u64>) {
    let before = RedisServer::command_counts(admin).await;
    let output = call.await;
    let mut after = RedisServer::command_counts(admin).await;
    for (name, calls) in &mut after {
        *calls -= before.get(name).copied().unwrap_or(0);
    }
    if let Some(info) = after.get_mut("info") {
        *info -= 1;
    }
    // What the client's pub/sub connection may send meanwhile, (re)connecting: its handshake
    // and subscriptions, never a request's.
    after.retain(|name, calls| {
        *calls > 0
            && ![
                "client|",
                "hello",
                "auth",
                "select",
                "subscribe",
                "psubscribe",
                "ssubscribe",
            ]
            .iter()
            .any(|own| name.starts_with(own))
    });
    // One name for a script call, sent either way (`FCALL`, or `EVALSHA` on Redis 6).
    for sent in ["fcall", "evalsha"] {
        if let Some(calls) = after.remove(sent) {
            *after.entry("script call".to_owned()).or_default() += calls;
        }
    }
    (output, after)
}

/// The commands an uncontended execution costs Redis: `begin` five (read the state, take the
/// lock, write the holder and the retention, clear a dead writer's parts), `complete` five
/// (check the lock, store the record over the holder's tag, its retention, free the lock,
/// announce it). One more in either is a cost every request pays.
#[tokio::test]
async fn an_execution_runs_ten_commands_in_redis() {
    // Its own server: the counts are the server's, and no other test may add to them. No
    // watchdog: a renewal inside a window is not the call's.
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("budget");
    let config = LockConfig::builder().watchdog(false).build().unwrap();
    let c = client(&server, &prefix, config).await;
    let mut admin = server.connection().await;
    // The first call loads the library: not what a request costs.
    let once = c.once("warm").unwrap();
    let Begin::Acquired(run) = once.begin("tag").await.unwrap() else {
        panic!("the lock is free")
    };
    run.complete(b"record").await.unwrap();
    let once = c.once("counted").unwrap();
    let (began, begin) = commands_run(&mut admin, once.begin("tag")).await;
    let Begin::Acquired(run) = began.unwrap() else {
        panic!("the lock is free")
    };
    let count = |pairs: &[(&str, u64)]| -> std::collections::BTreeMap<String, u64> {
        pairs.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
    };
    assert_eq!(
        begin,
        count(&[
            ("script call", 1),
            ("hmget", 1),
            ("set", 1),
            ("hset", 1),
            ("pexpire", 1),
            ("del", 1)
        ]),
        "begin"
    );
    let (completed, complete) = commands_run(&mut admin, run.complete(b"record")).await;
    completed.unwrap();
    assert_eq!(
        complete,
        count(&[
            ("script call", 1),
            ("get", 1),
            ("hset", 1),
            ("pexpire", 1),
            ("del", 1),
            ("publish", 1)
        ]),
        "complete"
    );
}

/// Waits, at most 10 s, until `key` is gone from Redis.
async fn until_gone(redis: &mut redis::aio::MultiplexedConnection, key: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let exists: bool = redis.exists(key).await.unwrap();
        if !exists {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key} still in Redis after 10 s"
        );
        tokio::time::sleep(ms(20)).await;
    }
}

/// With `fence_ttl`, a lock's fencing counter expires after that long unused (locks on
/// ever-new names leave nothing behind), and a counter made again starts from the caller's
/// clock, so that the fences of the name keep increasing across the expiry (before: made again
/// from 0, the next holder drew fence 1 again, and a store that had seen the earlier holder's
/// fence refused the later one). Exclusive (one pipeline) and reentrant (a script) locks.
#[tokio::test]
async fn a_fence_counter_that_expired_starts_again_above_the_fences_it_gave() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("fence-ttl");
    let config = LockConfig::builder()
        .lease(ms(200))
        .fence_ttl(ms(300))
        .build()
        .unwrap();
    let c = client(&server, &prefix, config).await;
    let mut redis = server.connection().await;
    let me = OwnerId::new("worker-1").unwrap();
    for reentrant in [false, true] {
        let name = if reentrant { "reentrant" } else { "exclusive" };
        let lock = if reentrant {
            c.reentrant(name, &me).unwrap()
        } else {
            c.lock(name).unwrap()
        };
        let state = lock.name().state_key().to_owned();
        let guard = lock.try_acquire().await.unwrap();
        let first = guard.fence();
        assert!(guard.release().await.unwrap());
        let pttl: i64 = redis.pttl(&state).await.unwrap();
        assert!(
            pttl > 0 && pttl <= 300,
            "{name}: the counter expires with fence_ttl: {pttl}"
        );
        until_gone(&mut redis, &state).await;
        let guard = lock.try_acquire().await.unwrap();
        assert!(
            guard.fence() > first,
            "{name}: the fence after the counter expired ({}) is above the one before ({first})",
            guard.fence()
        );
        assert!(guard.release().await.unwrap());
    }
}
