//! One behavioural suite, run against the in-memory store and against a real Redis: the two
//! must be interchangeable. With the `postgres` feature, the run-once and streaming part of it
//! also runs against a real PostgreSQL (`postgres::name`): the Postgres store offers no
//! reentrant locks and no announcements across processes (its readers poll), so the tests of
//! those are left out there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ::redis::AsyncCommands;
use bytes::Bytes;
use distlock::once::{Follower, Purged, RecordState};
use distlock::{Begin, LockClient, LockConfig, LockError, LossReason, OnceGuard, OwnerId};
use testkit::{History, RedisServer};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Builds clients on one store. Holds the Redis server (if any) for the test's duration.
struct Store {
    _server: Option<RedisServer>,
    url: Option<String>,
    memory: Option<LockClient>,
    /// (Postgres) The server's URL and the test's table.
    postgres: Option<(String, String)>,
    prefix: String,
}

impl Store {
    async fn memory() -> Self {
        Store {
            _server: None,
            url: None,
            memory: Some(LockClient::memory()),
            postgres: None,
            prefix: "m".into(),
        }
    }

    #[cfg(feature = "postgres")]
    async fn postgres(test: &str) -> Self {
        let server = testkit::PostgresServer::shared().await;
        Store {
            _server: None,
            url: None,
            memory: None,
            postgres: Some((server.url(), testkit::unique_table(test))),
            prefix: testkit::unique_prefix(test),
        }
    }

    async fn redis(test: &str) -> Self {
        let server = RedisServer::start().await;
        Store {
            url: Some(server.url()),
            _server: Some(server),
            memory: None,
            postgres: None,
            prefix: testkit::unique_prefix(test),
        }
    }

    /// A client with `config` on this store (memory clients of one store share their state).
    async fn client(&self, config: LockConfig) -> LockClient {
        self.client_under(&self.prefix, config).await
    }

    /// A client with `config` on this store, under `prefix` (memory: the store's own).
    async fn client_under(&self, prefix: &str, config: LockConfig) -> LockClient {
        match (&self.url, &self.memory, &self.postgres) {
            (Some(url), _, _) => {
                let c = LockClient::builder()
                    .config(config)
                    .prefix(prefix)
                    .unwrap()
                    .connect(url)
                    .unwrap();
                c.prepare().await.unwrap();
                c
            }
            (None, Some(shared), _) => shared.with_config(config).unwrap(),
            #[cfg(feature = "postgres")]
            (None, None, Some((url, table))) => {
                let c = LockClient::builder()
                    .config(config)
                    .prefix(prefix)
                    .unwrap()
                    .connect_postgres(url, table)
                    .unwrap();
                c.prepare().await.unwrap();
                c
            }
            _ => unreachable!(),
        }
    }

    /// How many parts the store holds for `once` (Redis: its list; Postgres: rows of the parts
    /// table), `None` in memory (nothing to look at from outside).
    async fn parts_stored(&self, once: &distlock::Once) -> Option<u64> {
        if let Some(server) = &self._server {
            let mut c = server.connection().await;
            return Some(c.llen(once.name().parts_key()).await.unwrap());
        }
        let (url, table) = self.postgres.as_ref()?;
        let (admin, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let n: i64 = admin
            .query_one(
                &format!("SELECT count(*) FROM {table}_parts WHERE name = $1"),
                &[&once.name().lock_key()],
            )
            .await
            .unwrap()
            .get(0);
        Some(n as u64)
    }

    /// Whether any of `keys` exists in Redis (memory: `None`, no keys to look at).
    async fn any_exists(&self, keys: &[&str]) -> Option<bool> {
        let server = self._server.as_ref()?;
        let mut c = server.connection().await;
        let n: u64 = c.exists(keys).await.unwrap();
        Some(n > 0)
    }
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Store::memory().await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Store::redis(stringify!($name)).await).await;
                }
            )*
        }
    };
}

both!(
    exclusion_and_fencing,
    held_and_released,
    expiry_without_renewal_signals_loss,
    reentrant_nesting,
    once_lifecycle,
    late_completion_is_refused,
    exclusion_without_fencing,
    reentrant_holds_never_shorten_each_others_lease,
    a_streamed_record_round_trips_byte_for_byte,
    readers_attached_before_during_and_after_the_stream,
    one_append_wakes_every_reader,
    a_lost_lease_mid_stream_is_abandoned_and_the_next_holder_starts_clean,
    abort_and_drop_after_appends_leave_no_parts,
    begin_wait_returns_on_the_first_part,
    a_reader_ahead_of_the_writer_waits_for_its_part,
    a_completion_reaches_every_waiting_duplicate,
    a_record_begun_again_after_it_expired_draws_a_larger_fence,
    an_operator_inspects_purges_and_scans,
    one_append_wakes_every_reader_of_the_writers_client,
    a_streamed_record_is_inspected_and_purged_with_its_parts,
    a_writer_whose_lease_ran_out_appends_nothing,
);

/// The run-once and streaming scenarios on a real PostgreSQL.
#[cfg(feature = "postgres")]
macro_rules! on_postgres {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Store::postgres(stringify!($name)).await).await;
                }
            )*
        }
    };
}

#[cfg(feature = "postgres")]
on_postgres!(
    exclusion_and_fencing,
    held_and_released,
    expiry_without_renewal_signals_loss,
    once_lifecycle,
    late_completion_is_refused,
    a_streamed_record_round_trips_byte_for_byte,
    readers_attached_before_during_and_after_the_stream,
    a_lost_lease_mid_stream_is_abandoned_and_the_next_holder_starts_clean,
    abort_and_drop_after_appends_leave_no_parts,
    a_reader_ahead_of_the_writer_waits_for_its_part,
    a_record_begun_again_after_it_expired_draws_a_larger_fence,
    an_operator_inspects_purges_and_scans,
    one_append_wakes_every_reader_of_the_writers_client,
    a_streamed_record_is_inspected_and_purged_with_its_parts,
    a_writer_whose_lease_ran_out_appends_nothing,
);

async fn exclusion_and_fencing(store: Store) {
    let history = Arc::new(History::new());
    let mut tasks = Vec::new();
    for c in 0..3 {
        let client = store.client(LockConfig::default()).await;
        for t in 0..4 {
            let lock = client.lock("x").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..8 {
                    let g = lock.acquire(Duration::from_secs(60)).await.unwrap();
                    let s = history.enter(format!("{c}/{t}"), g.fence());
                    tokio::task::yield_now().await;
                    s.leave();
                    assert!(g.release().await.unwrap());
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let report = testkit::check(&history.sections()).unwrap();
    assert_eq!(report.sections, 96);
}

async fn held_and_released(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let lock = client.lock("h").unwrap();
    let g = lock.try_acquire().await.unwrap();
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held {
            retry_after: Some(_),
            ..
        })
    ));
    assert!(matches!(
        lock.acquire(ms(100)).await,
        Err(LockError::WaitTimeout { .. })
    ));
    let lease = g.lease();
    assert!(g.release().await.unwrap());
    assert_eq!(lease.loss(), Some(LossReason::Released));
    assert!(!lease.is_held());
    drop(lock.try_acquire().await.unwrap());
    // Dropped guards release in the background; waiting finds the lock free.
    let again = lock.acquire(Duration::from_secs(5)).await.unwrap();
    assert!(again.release().await.unwrap());
}

async fn expiry_without_renewal_signals_loss(store: Store) {
    let config = LockConfig::builder()
        .lease(ms(150))
        .watchdog(false)
        .build()
        .unwrap();
    let client = store.client(config).await;
    let lock = client.lock("e").unwrap();
    let g = lock.try_acquire().await.unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), g.lost())
        .await
        .unwrap();
    assert_eq!(reason, LossReason::Expired);
    assert!(!g.is_held());
    // The store expires it too: someone else takes it, and the old release deletes nothing.
    let other = lock.acquire(Duration::from_secs(5)).await.unwrap();
    assert!(other.fence() > g.fence());
    assert!(!g.release().await.unwrap());
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held { .. })
    ));
}

async fn reentrant_nesting(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let me = OwnerId::random();
    let a = client
        .reentrant("r", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let b = client
        .reentrant("r", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert_eq!(a.fence(), b.fence());
    let them = client.reentrant("r", &OwnerId::random()).unwrap();
    assert!(them.try_acquire().await.is_err());
    assert!(
        client.lock("r").unwrap().try_acquire().await.is_err(),
        "exclusive excluded too"
    );
    let first = a.fence();
    assert!(a.release().await.unwrap());
    assert!(them.try_acquire().await.is_err(), "one hold remains");
    assert!(b.release().await.unwrap());
    let t = them.try_acquire().await.unwrap();
    assert!(t.fence() > first);
}

async fn once_lifecycle(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("o").unwrap();
    let Begin::Acquired(g) = once.begin("t1").await.unwrap() else {
        panic!()
    };
    assert!(
        matches!(once.begin("t2").await.unwrap(), Begin::InFlight { tag, .. } if &tag[..] == b"t1")
    );
    drop(g);
    // An abandoned attempt (dropped guard) leaves no record: the next begin may take it.
    let Begin::Acquired(g) = once.begin_wait("t3", Duration::from_secs(5)).await.unwrap() else {
        panic!("the dropped guard was released")
    };
    g.complete(b"rec").await.unwrap();
    assert!(
        matches!(once.begin("t4").await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"rec"))
    );
}

async fn late_completion_is_refused(store: Store) {
    let config = LockConfig::builder()
        .lease(ms(150))
        .watchdog(false)
        .build()
        .unwrap();
    let client = store.client(config).await;
    let once = client.once("late").unwrap();
    let Begin::Acquired(slow) = once.begin("").await.unwrap() else {
        panic!()
    };
    let Begin::Acquired(fast) = once.begin_wait("", Duration::from_secs(5)).await.unwrap() else {
        panic!("the slow holder's lease expired")
    };
    assert!(matches!(
        slow.complete(b"slow").await,
        Err(LockError::LeaseLost {
            reason: LossReason::NotOwner,
            ..
        })
    ));
    fast.complete(b"fast").await.unwrap();
    assert!(
        matches!(once.begin("").await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"fast"))
    );
}

async fn exclusion_without_fencing(store: Store) {
    let config = LockConfig::builder().fencing(false).build().unwrap();
    let history = Arc::new(History::new());
    let mut tasks = Vec::new();
    for c in 0..2 {
        let client = store.client(config.clone()).await;
        for t in 0..4 {
            let lock = client.lock("unfenced").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..8u64 {
                    let g = lock.acquire(Duration::from_secs(60)).await.unwrap();
                    assert_eq!(g.fence(), 0, "no fencing token");
                    // The checker wants increasing tokens: number the sections instead.
                    let s = history.enter(format!("{c}/{t}/{i}"), 0);
                    tokio::task::yield_now().await;
                    s.leave();
                    assert!(g.release().await.unwrap());
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut sections = history.sections();
    sections.sort_by_key(|s| s.enter);
    for (i, s) in sections.iter_mut().enumerate() {
        s.fence = i as u64 + 1;
    }
    assert_eq!(testkit::check(&sections).unwrap().sections, 64);
    let client = store.client(config).await;
    let lock = client.lock("unfenced-held").unwrap();
    let _g = lock.try_acquire().await.unwrap();
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held {
            retry_after: Some(_),
            ..
        })
    ));
    // A name a reentrant lock holds (a hash in Redis, not a string) is held for an unfenced
    // acquisition too: `Held`, not a type error from checking whose it is.
    let owner = OwnerId::random();
    let _hold = client
        .reentrant("mixed", &owner)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let taken = client.lock("mixed").unwrap().try_acquire().await;
    assert!(matches!(taken, Err(LockError::Held { .. })), "{taken:?}");
}

/// Owner O holds a reentrant lock with a 10 s lease and takes a second hold with a 300 ms lease
/// (renewed by the watchdog), keeps it for 500 ms and releases it. The key's expiry must still
/// cover the first hold's promise: another owner must not get the lock while O's outer guard
/// holds it. (Before, each renewal of the short hold set the key's expiry to 300 ms.)
async fn reentrant_holds_never_shorten_each_others_lease(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let me = OwnerId::random();
    let outer = client
        .reentrant("nest", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    let short = LockConfig::builder().lease(ms(300)).build().unwrap();
    let inner = client
        .reentrant("nest", &me)
        .unwrap()
        .with_config(short)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    tokio::time::sleep(ms(500)).await;
    assert!(inner.release().await.unwrap());
    let them = client.reentrant("nest", &OwnerId::random()).unwrap();
    for _ in 0..10 {
        tokio::time::sleep(ms(60)).await;
        assert!(outer.is_held());
        assert!(
            matches!(them.try_acquire().await, Err(LockError::Held { .. })),
            "another owner took the lock while the outer hold was promised 10 s"
        );
    }
    assert!(outer.release().await.unwrap());
}

fn b(v: &[u8]) -> Bytes {
    Bytes::copy_from_slice(v)
}

/// Begins `name` and expects the lock.
async fn holder(once: &distlock::Once) -> OnceGuard {
    match once.begin("fp").await.unwrap() {
        Begin::Acquired(g) => g,
        other => panic!("expected the lock: {other:?}"),
    }
}

/// Follows a record to its end (or its writer's end); returns the bytes read in order, or the
/// state it stopped at.
async fn read_all(mut follower: Follower) -> Result<Vec<Bytes>, RecordState> {
    let mut parts = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let read = follower.next(2, deadline).await.unwrap();
        assert!(Instant::now() < deadline, "the stream did not end in time");
        parts.extend(read.parts().iter().cloned());
        if read.is_complete() {
            return Ok(parts);
        }
        if !matches!(
            read.state(),
            RecordState::Writing { .. } | RecordState::Done { .. }
        ) {
            return Err(read.state());
        }
    }
}

/// Parts of every size class (empty, binary with zero bytes, 64 KiB) come back byte for byte;
/// the record is done with its part count, `begin` shows the first part and the count, reads
/// start anywhere, and absurd positions return nothing rather than panic.
async fn a_streamed_record_round_trips_byte_for_byte(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("stream-rt").unwrap();
    let g = holder(&once).await;
    let big: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    let parts = [b(b"HTTP/1.1 200"), b(b""), b(&[0, 1, 0, 255]), b(&big)];
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(g.append(part).await.unwrap(), i as u64);
    }
    assert_eq!(g.appended(), 4);
    let fence = g.fence();
    g.complete(b"end").await.unwrap();
    let mut all = parts.to_vec();
    all.push(b(b"end"));

    let read = once.parts(0, 100).await.unwrap();
    assert_eq!(read.parts(), &all[..]);
    assert_eq!(read.state(), RecordState::Done { parts: 5 });
    assert_eq!(read.fence(), fence);
    assert!(read.is_complete());
    assert_eq!(once.parts(2, 2).await.unwrap().parts(), &all[2..4]);
    // The plain read of a completed record gives the same parts.
    assert_eq!(once.stored_parts(0, 100).await.unwrap(), all);
    assert_eq!(once.stored_parts(2, 2).await.unwrap(), &all[2..4]);
    assert!(once.stored_parts(1, 0).await.unwrap().is_empty());
    let state_only = once.parts(0, 0).await.unwrap();
    assert!(state_only.parts().is_empty());
    assert_eq!(state_only.state(), RecordState::Done { parts: 5 });
    for (from, max) in [(5, 10), (u64::MAX, usize::MAX), (i64::MAX as u64, 3)] {
        let read = once.parts(from, max).await.unwrap();
        assert!(read.parts().is_empty(), "{from} {max}");
        assert!(once.stored_parts(from, max).await.unwrap().is_empty());
        assert_eq!(read.state(), RecordState::Done { parts: 5 });
    }
    match once.begin("fp").await.unwrap() {
        Begin::Done(record) => {
            assert_eq!(record.first(), &all[0]);
            assert_eq!(record.parts(), 5);
            assert!(record.whole().is_none());
        }
        other => panic!("{other:?}"),
    }

    // A record written whole is the one-part case of the same reads.
    let whole = client.once("stream-whole").unwrap();
    holder(&whole).await.complete(b"whole").await.unwrap();
    let read = whole.parts(0, 8).await.unwrap();
    assert_eq!(read.parts(), [b(b"whole")]);
    assert_eq!(whole.stored_parts(0, 8).await.unwrap(), [b(b"whole")]);
    assert_eq!(read.state(), RecordState::Done { parts: 1 });
    assert!(whole.parts(1, 8).await.unwrap().parts().is_empty());
    assert_ne!(
        store.any_exists(&[whole.name().parts_key()]).await,
        Some(true),
        "a one-part record has no parts key"
    );
}

/// Three readers: one attached before the first part, one mid-stream, one after the end. Each
/// reads the same parts in the same order as written.
async fn readers_attached_before_during_and_after_the_stream(store: Store) {
    let writer = store.client(LockConfig::default()).await;
    let reader = store.client(LockConfig::default()).await;
    let once = writer.once("stream-readers").unwrap();
    let theirs = reader.once("stream-readers").unwrap();
    let g = holder(&once).await;
    let before = tokio::spawn(read_all(theirs.follow(0)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let written: Vec<Bytes> = (0..7).map(|i| b(format!("part {i}").as_bytes())).collect();
    for part in &written[..3] {
        g.append(part).await.unwrap();
    }
    let during = tokio::spawn(read_all(theirs.follow(0)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    for part in &written[3..6] {
        g.append(part).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    g.complete(&written[6]).await.unwrap();
    let after = read_all(theirs.follow(0)).await;
    for (when, got) in [
        ("before", before.await.unwrap()),
        ("during", during.await.unwrap()),
        ("after", after),
    ] {
        assert_eq!(got.as_deref(), Ok(&written[..]), "reader attached {when}");
    }
    // A reader can start anywhere.
    assert_eq!(
        read_all(theirs.follow(5)).await.as_deref(),
        Ok(&written[5..])
    );
}

/// With polling off, only announcements can wake a reader: eight readers in another client
/// wait for part 0, and one append wakes every one of them (long before the holder's lease or
/// their deadline).
async fn one_append_wakes_every_reader(store: Store) {
    let quiet = LockConfig::builder().polling(false).build().unwrap();
    let writer = store.client(quiet.clone()).await;
    let reader = store.client(quiet).await;
    let once = writer.once("stream-wake").unwrap();
    let g = holder(&once).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let once = reader.once("stream-wake").unwrap();
            tokio::spawn(async move { once.wait_parts(0, 4, deadline).await.unwrap() })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let appended = Instant::now();
    g.append(b"tick").await.unwrap();
    for r in readers {
        let read = tokio::time::timeout(Duration::from_secs(2), r)
            .await
            .expect("woken by the announcement")
            .unwrap();
        assert_eq!(read.parts(), [b(b"tick")]);
        assert_eq!(read.state(), RecordState::Writing { parts: 1 });
    }
    assert!(appended.elapsed() < Duration::from_secs(2));
    g.complete(b"end").await.unwrap();
}

/// The writer's lease runs out mid-stream (no watchdog): its reader sees `Abandoned`, its later
/// appends and completion store nothing (`LeaseLost`), and the next holder starts from no parts
/// with a greater fence. The first reader never gets the new writer's parts, and a plain read
/// tells the writers apart by their fence.
async fn a_lost_lease_mid_stream_is_abandoned_and_the_next_holder_starts_clean(store: Store) {
    // Polling off: the reader learns the writer is gone from the end of its lease alone.
    let short = LockConfig::builder()
        .lease(Duration::from_millis(200))
        .watchdog(false)
        .polling(false)
        .build()
        .unwrap();
    let client = store.client(short).await;
    let once = client.once("stream-lost").unwrap();
    let old = holder(&once).await;
    old.append(b"old-0").await.unwrap();
    old.append(b"old-1").await.unwrap();
    let mut follower = once.follow(0);
    let soon = Instant::now() + Duration::from_secs(5);
    let read = follower.next(8, soon).await.unwrap();
    assert_eq!(read.parts(), [b(b"old-0"), b(b"old-1")]);
    assert_eq!(follower.writer(), Some(old.fence()));
    // No part comes, and the lease ends: the reader is told at the end of the lease.
    let read = follower.next(8, soon).await.unwrap();
    assert_eq!(read.state(), RecordState::Abandoned);
    assert!(read.parts().is_empty());
    assert!(
        Instant::now() < soon,
        "told when the lease ended, not at the deadline"
    );
    assert!(matches!(
        old.append(b"late").await,
        Err(LockError::LeaseLost { .. })
    ));

    let new = holder(&once).await;
    assert!(new.fence() > old.fence());
    let fresh = once.parts(0, 8).await.unwrap();
    assert_eq!(fresh.state(), RecordState::Writing { parts: 0 });
    assert!(
        fresh.parts().is_empty(),
        "the new writer starts from no parts"
    );
    assert_eq!(fresh.fence(), new.fence());
    assert_eq!(new.append(b"new-0").await.unwrap(), 0);
    assert!(matches!(
        old.append(b"late").await,
        Err(LockError::LeaseLost { .. })
    ));
    // The old writer's reader does not get the new writer's parts.
    let read = follower.next(8, soon).await.unwrap();
    assert_eq!(read.state(), RecordState::Abandoned);
    assert!(read.parts().is_empty());
    // A reader pinned to the old writer from the start sees the same.
    let pinned = once.follow(2).expect_writer(old.fence());
    assert_eq!(read_all(pinned).await, Err(RecordState::Abandoned));
    assert!(matches!(
        old.complete(b"late").await,
        Err(LockError::LeaseLost { .. })
    ));
    let new_fence = new.fence();
    new.complete(b"new-1").await.unwrap();
    let read = once.parts(0, 8).await.unwrap();
    assert_eq!(read.parts(), [b(b"new-0"), b(b"new-1")]);
    assert_eq!(read.fence(), new_fence);
    assert_eq!(read.state(), RecordState::Done { parts: 2 });
}

/// Aborting after appends, or dropping the guard, deletes the parts: no record, no parts key,
/// readers see `Abandoned`, and the next holder does the work again from nothing.
async fn abort_and_drop_after_appends_leave_no_parts(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("stream-abort").unwrap();
    let parts_key = once.name().parts_key().to_owned();
    let g = holder(&once).await;
    g.append(b"a").await.unwrap();
    g.append(b"b").await.unwrap();
    assert_ne!(store.any_exists(&[&parts_key]).await, Some(false));
    let reader = tokio::spawn({
        let once = once.clone();
        async move { read_all(once.follow(0)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(g.abort().await.unwrap());
    assert_eq!(reader.await.unwrap(), Err(RecordState::Abandoned));
    let read = once.parts(0, 8).await.unwrap();
    assert_eq!(read.state(), RecordState::Abandoned);
    assert!(read.parts().is_empty());
    assert_ne!(store.any_exists(&[&parts_key]).await, Some(true));

    let g = holder(&once).await;
    assert_eq!(
        once.parts(0, 8).await.unwrap().state(),
        RecordState::Writing { parts: 0 }
    );
    g.append(b"c").await.unwrap();
    drop(g);
    assert!(client.settle(Duration::from_secs(5)).await);
    assert_eq!(
        once.parts(0, 8).await.unwrap().state(),
        RecordState::Abandoned
    );
    assert_ne!(store.any_exists(&[&parts_key]).await, Some(true));
    assert!(matches!(
        once.begin("fp").await.unwrap(),
        Begin::Acquired(_)
    ));
}

/// A duplicate waiting with `begin_wait` (polling off: only the announcement can wake it) is
/// told as soon as the holder appends its first part, with the holder's fence, so that it can
/// follow the live stream instead of waiting for its end.
async fn begin_wait_returns_on_the_first_part(store: Store) {
    let quiet = LockConfig::builder().polling(false).build().unwrap();
    let writer = store.client(quiet.clone()).await;
    let reader = store.client(quiet).await;
    let once = writer.once("stream-join").unwrap();
    let g = holder(&once).await;
    let waiting = tokio::spawn({
        let once = reader.once("stream-join").unwrap();
        async move { once.begin_wait("fp", Duration::from_secs(20)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "nothing to join yet");
    g.append(b"first").await.unwrap();
    let joined = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("returned on the first part")
        .unwrap()
        .unwrap();
    match joined {
        Begin::InFlight {
            fence, parts, tag, ..
        } => {
            assert_eq!((fence, parts), (g.fence(), 1));
            assert_eq!(&tag[..], b"fp");
            let follower = reader
                .once("stream-join")
                .unwrap()
                .follow(0)
                .expect_writer(fence);
            let rest = tokio::spawn(read_all(follower));
            g.complete(b"last").await.unwrap();
            assert_eq!(rest.await.unwrap(), Ok(vec![b(b"first"), b(b"last")]));
        }
        other => panic!("{other:?}"),
    }
}

/// Every duplicate waiting for a run-once record gets it as soon as it is completed, not only
/// the one the completion's announcement woke (a release wakes one waiter of a client: the next
/// in line for the lock). Polling off, so that only announcements, and waiters passing them on,
/// can wake them. Before, the woken one found the record and returned, and the others slept
/// until their deadline and were told "in flight" about a record completed 20 s earlier.
async fn a_completion_reaches_every_waiting_duplicate(store: Store) {
    let quiet = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .retry(ms(10), ms(50))
        .polling(false)
        .build()
        .unwrap();
    let writer = store.client(quiet.clone()).await;
    let reader = store.client(quiet).await;
    let once = writer.once("all-done").unwrap();
    let g = holder(&once).await;
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            let once = reader.once("all-done").unwrap();
            tokio::spawn(async move { once.begin_wait_done("fp", Duration::from_secs(20)).await })
        })
        .collect();
    // Each looked, found it in flight, and sleeps until woken (or its deadline: the lease,
    // 30 s away, is longer).
    tokio::time::sleep(ms(300)).await;
    assert!(waiting.iter().all(|w| !w.is_finished()), "nothing done yet");
    g.complete(b"the record").await.unwrap();
    for (i, w) in waiting.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .unwrap_or_else(|_| panic!("waiter {i} still waits 5 s after the completion"))
            .unwrap()
            .unwrap();
        match got {
            Begin::Done(record) => assert_eq!(&record.first()[..], b"the record"),
            other => panic!("waiter {i}: {other:?}"),
        }
    }
}

/// A reader can start ahead of the writer (`follow(n)`, `wait_parts(n, ..)` before part n is
/// there) and waits there: fewer parts than its position is not parts lost (a count that goes
/// down under it is; see `redis_lock::a_follower_whose_parts_were_lost_is_told_at_once`).
async fn a_reader_ahead_of_the_writer_waits_for_its_part(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("ahead").unwrap();
    let g = holder(&once).await;
    g.append(b"0").await.unwrap();
    g.append(b"1").await.unwrap();
    let mut ahead = once.follow(3);
    let read = ahead.next(8, Instant::now() + ms(50)).await.unwrap();
    assert_eq!(read.state(), RecordState::Writing { parts: 2 });
    assert!(read.parts().is_empty());
    let waiting = tokio::spawn({
        let once = once.clone();
        async move {
            once.wait_parts(3, 8, Instant::now() + Duration::from_secs(10))
                .await
        }
    });
    g.append(b"2").await.unwrap();
    g.append(b"3").await.unwrap();
    let read = ahead
        .next(8, Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(read.parts(), [&b"3"[..]]);
    let waited = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting reader returned")
        .unwrap()
        .unwrap();
    assert_eq!(waited.parts(), [&b"3"[..]]);
}

/// A record's fencing counter lives in its state, which expires with the record. Begun again
/// after that, the next run must not draw a fence an earlier run had: a streamed record's parts
/// are bound to their writer's fence, and two runs with one fence would write interchangeable
/// parts (a replay still reading the first could be handed the second's).
async fn a_record_begun_again_after_it_expired_draws_a_larger_fence(store: Store) {
    let config = LockConfig::builder()
        .lease(Duration::from_millis(200))
        .build()
        .unwrap();
    let client = store.client(config).await;
    let once = client
        .once("again")
        .unwrap()
        .retention(Duration::from_millis(300))
        .unwrap();
    let first = holder(&once).await;
    let fence = first.fence();
    first.append(b"head").await.unwrap();
    first.complete(b"end").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match once.begin("fp").await.unwrap() {
            Begin::Acquired(g) => break g,
            Begin::Done(_) => {
                assert!(
                    Instant::now() < deadline,
                    "the record was still there 10 s after its 300 ms retention"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other:?}"),
        }
    };
    assert!(
        again.fence() > fence,
        "the run after the record expired drew fence {} after {fence}",
        again.fence()
    );
}

/// What an operator sees of a name: absent; in flight (the lease left, the fence, the tag,
/// since when); completed (the record, how long it is kept). A purge is refused while a lease
/// holds the name (the holder goes on and stores its record), and once it ended deletes the
/// record: the next `begin` runs the work again, with a greater fence. A scan finds the names
/// by pattern under the client's prefix, never another prefix's.
async fn an_operator_inspects_purges_and_scans(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("order.7").unwrap();
    let absent = once.inspect().await.unwrap();
    assert!(absent.is_absent(), "{absent:?}");
    assert_eq!(once.purge().await.unwrap(), Purged::Absent);

    let before = std::time::SystemTime::now();
    let guard = holder(&once).await;
    let held = once.inspect().await.unwrap();
    let h = held.holder.as_ref().expect("in flight");
    assert_eq!(h.fence, guard.fence());
    assert_eq!(h.tag, Bytes::from_static(b"fp"));
    assert!(
        h.lease_left
            .is_some_and(|l| l > Duration::ZERO && l <= Duration::from_secs(10))
    );
    let since = h.since.expect("since when");
    assert!(
        since + Duration::from_secs(5) >= before && since <= std::time::SystemTime::now(),
        "{since:?} against {before:?}"
    );
    assert!(held.record.is_none());
    // A purge never lets a second execution start beside this one.
    assert!(matches!(
        once.purge().await.unwrap(),
        Purged::InFlight {
            lease_left: Some(_)
        }
    ));
    assert!(matches!(
        once.begin("fp").await.unwrap(),
        Begin::InFlight { .. }
    ));
    let fence = guard.fence();
    guard.complete(b"receipt").await.unwrap();
    let done = once.inspect().await.unwrap();
    assert!(done.holder.is_none());
    assert_eq!(
        done.record.map(|r| r.into_first()),
        Some(Bytes::from_static(b"receipt"))
    );
    assert_eq!(done.fence, Some(fence));
    assert!(
        done.expires_in
            .is_some_and(|e| e > Duration::from_secs(3600))
    );

    // Names by pattern, under this prefix only; on Redis as a user with the operators' rules
    // (the service's and SCAN).
    let scanner = match &store._server {
        Some(server) => {
            let user = server
                .acl_user(
                    "operator",
                    &distlock::operator_acl_rules(testkit::TEST_PREFIX),
                )
                .await;
            let c = LockClient::builder()
                .prefix(&store.prefix)
                .unwrap()
                .connect(&user)
                .unwrap();
            c.prepare().await.unwrap();
            c
        }
        None => client.clone(),
    };
    for name in ["order.8", "invoice.1"] {
        let g = holder(&client.once(name).unwrap()).await;
        g.complete(b"x").await.unwrap();
    }
    if store.memory.is_none() {
        let other = store
            .client_under(
                &format!("{}-elsewhere", store.prefix),
                LockConfig::default(),
            )
            .await;
        let g = holder(&other.once("order.9").unwrap()).await;
        g.complete(b"x").await.unwrap();
    }
    assert_eq!(
        scanner.scan("order.*").await.unwrap(),
        ["order.7", "order.8"]
    );
    assert_eq!(scanner.scan("*").await.unwrap().len(), 3);
    assert_eq!(
        scanner.scan("nothing*").await.unwrap(),
        Vec::<String>::new()
    );

    assert_eq!(once.purge().await.unwrap(), Purged::Deleted);
    assert!(once.inspect().await.unwrap().is_absent());
    assert_eq!(scanner.scan("order.*").await.unwrap(), ["order.8"]);
    let again = holder(&once).await;
    assert!(again.fence() > fence, "{} after {fence}", again.fence());
}

/// Polling off, one client: the append's local wake-up alone reaches every reader waiting in
/// the writer's client (on every store, Postgres included, which announces nothing across
/// processes), and the completion wakes a reader waiting for the next part.
async fn one_append_wakes_every_reader_of_the_writers_client(store: Store) {
    let quiet = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .polling(false)
        .build()
        .unwrap();
    let client = store.client(quiet).await;
    let once = client.once("local-wake").unwrap();
    let g = holder(&once).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let once = once.clone();
            tokio::spawn(async move { once.wait_parts(0, 4, deadline).await.unwrap() })
        })
        .collect();
    tokio::time::sleep(ms(300)).await;
    assert!(readers.iter().all(|r| !r.is_finished()), "nothing yet");
    g.append(b"tick").await.unwrap();
    for r in readers {
        let read = tokio::time::timeout(Duration::from_secs(2), r)
            .await
            .expect("woken by the append")
            .unwrap();
        assert_eq!(read.parts(), [b(b"tick")]);
        assert_eq!(read.state(), RecordState::Writing { parts: 1 });
    }
    let next = tokio::spawn({
        let once = once.clone();
        async move { once.wait_parts(1, 4, deadline).await.unwrap() }
    });
    tokio::time::sleep(ms(300)).await;
    assert!(!next.is_finished(), "part 1 is not there yet");
    g.complete(b"end").await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(2), next)
        .await
        .expect("woken by the completion")
        .unwrap();
    assert_eq!(read.parts(), [b(b"end")]);
    assert_eq!(read.state(), RecordState::Done { parts: 2 });
}

/// An operator's view of a streamed record: in flight with no record while it is written; done,
/// a record of its parts (the first and the count). A purge deletes the parts with the record,
/// and the next writer starts from none of them.
async fn a_streamed_record_is_inspected_and_purged_with_its_parts(store: Store) {
    let client = store.client(LockConfig::default()).await;
    let once = client.once("inspect-stream").unwrap();
    let g = holder(&once).await;
    g.append(b"head").await.unwrap();
    g.append(b"body").await.unwrap();
    let writing = once.inspect().await.unwrap();
    assert_eq!(writing.holder.map(|h| h.fence), Some(g.fence()));
    assert!(writing.record.is_none(), "{:?}", writing.record);
    let fence = g.fence();
    g.complete(b"end").await.unwrap();
    let done = once.inspect().await.unwrap();
    assert!(done.holder.is_none());
    let record = done.record.expect("a record of its parts");
    assert_eq!(record.parts(), 3);
    assert_eq!(record.first(), &b(b"head"));
    assert_eq!(done.fence, Some(fence));
    assert_ne!(store.parts_stored(&once).await, Some(0));

    assert_eq!(once.purge().await.unwrap(), Purged::Deleted);
    assert!(once.inspect().await.unwrap().is_absent());
    let read = once.parts(0, 8).await.unwrap();
    assert_eq!(read.state(), RecordState::Abandoned);
    assert!(read.parts().is_empty());
    assert!(matches!(store.parts_stored(&once).await, None | Some(0)));
    let again = holder(&once).await;
    assert!(again.fence() > fence);
    let fresh = once.parts(0, 8).await.unwrap();
    assert_eq!(fresh.state(), RecordState::Writing { parts: 0 });
    assert!(fresh.parts().is_empty());
    assert_eq!(again.append(b"new").await.unwrap(), 0);
    again.complete(b"end").await.unwrap();
    assert_eq!(
        once.parts(0, 8).await.unwrap().parts(),
        [b(b"new"), b(b"end")]
    );
}

/// A writer whose lease ran out appends nothing, whether or not anyone took the name since
/// (its token may still be in the store: the lease decides), and concurrent appends of it
/// beside the new holder's never mix into the new record.
async fn a_writer_whose_lease_ran_out_appends_nothing(store: Store) {
    let short = LockConfig::builder()
        .lease(ms(200))
        .watchdog(false)
        .build()
        .unwrap();
    let client = store.client(short).await;
    let once = client.once("stale-writer").unwrap();
    let old = Arc::new(holder(&once).await);
    old.append(b"old-0").await.unwrap();
    tokio::time::sleep(ms(400)).await;
    assert!(matches!(
        old.append(b"old-1").await,
        Err(LockError::LeaseLost { .. })
    ));
    let new = holder(&once).await;
    assert!(new.fence() > old.fence());
    let stale: Vec<_> = (0..4)
        .map(|i| {
            let old = old.clone();
            tokio::spawn(async move { old.append(format!("old-{i}").as_bytes()).await })
        })
        .collect();
    for i in 0..4 {
        assert_eq!(new.append(format!("new-{i}").as_bytes()).await.unwrap(), i);
    }
    for s in stale {
        assert!(matches!(s.await.unwrap(), Err(LockError::LeaseLost { .. })));
    }
    new.complete(b"new-end").await.unwrap();
    let read = once.parts(0, 16).await.unwrap();
    let want: Vec<Bytes> = ["new-0", "new-1", "new-2", "new-3", "new-end"]
        .iter()
        .map(|p| b(p.as_bytes()))
        .collect();
    assert_eq!(read.parts(), &want[..]);
    assert_eq!(read.state(), RecordState::Done { parts: 5 });
    if let Some(stored) = store.parts_stored(&once).await {
        assert_eq!(stored, 5, "no stale part stored");
    }
}
