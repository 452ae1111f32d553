//! The Postgres store on a real PostgreSQL: exclusion and fencing, run-once records, and work
//! whose writes commit with its record (or not at all), also when its connection dies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use distlock::once::Purged;
use distlock::{Begin, LockClient, LockConfig, LockError};
use testkit::{History, PostgresServer};

async fn client(table: &str, config: LockConfig) -> LockClient {
    let server = PostgresServer::shared().await;
    let client = LockClient::builder()
        .config(config)
        .connect_postgres(&server.url(), table)
        .unwrap();
    client.prepare().await.expect("the table is made");
    client
}

async fn admin() -> tokio_postgres::Client {
    let server = PostgresServer::shared().await;
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_and_fencing_across_clients() {
    let table = testkit::unique_table("exclusion");
    let history = Arc::new(History::new());
    let mut tasks = Vec::new();
    for c in 0..3 {
        let client = client(&table, LockConfig::default()).await;
        for t in 0..3 {
            let lock = client.lock("shared").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..8 {
                    let g = lock.acquire(Duration::from_secs(60)).await.unwrap();
                    let s = history.enter(format!("{c}/{t}"), g.fence());
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    s.leave();
                    assert!(g.release().await.unwrap());
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(testkit::check(&history.sections()).unwrap().sections, 72);
}

#[tokio::test]
async fn a_held_lock_is_reported_and_a_crashed_holders_expires() {
    let table = testkit::unique_table("held");
    let config = LockConfig::builder()
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let b = client(&table, config.clone()).await;
    // A holder in a runtime that goes away with its watchdog: no renewal, no release. A crash.
    let fence = std::thread::spawn({
        let table = table.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let fence = rt.block_on(async {
                let a = client(&table, config).await;
                let held = a.lock("job").unwrap().try_acquire().await.unwrap();
                let fence = held.fence();
                std::mem::forget(held);
                fence
            });
            drop(rt);
            fence
        }
    })
    .join()
    .unwrap();
    match b.lock("job").unwrap().try_acquire().await {
        Err(LockError::Held { retry_after, .. }) => assert!(retry_after.is_some()),
        other => panic!("{other:?}"),
    }
    let taken = b
        .lock("job")
        .unwrap()
        .acquire(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(taken.fence() > fence);
}

#[tokio::test]
async fn run_once_records_and_operators() {
    let table = testkit::unique_table("once");
    let c = client(&table, LockConfig::default()).await;
    let once = c.once("evt_1").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    match once.begin("fp2").await.unwrap() {
        Begin::InFlight { tag, fence, .. } => {
            assert_eq!(tag, Bytes::from_static(b"fp"));
            assert_eq!(fence, guard.fence());
        }
        other => panic!("{other:?}"),
    }
    let inspected = once.inspect().await.unwrap();
    assert_eq!(inspected.holder.map(|h| h.fence), Some(guard.fence()));
    assert!(matches!(
        once.purge().await.unwrap(),
        Purged::InFlight { .. }
    ));
    guard.complete(b"receipt").await.unwrap();
    match once.begin("fp").await.unwrap() {
        Begin::Done(record) => assert_eq!(record.whole().map(|r| &r[..]), Some(&b"receipt"[..])),
        other => panic!("{other:?}"),
    }
    let done = once.inspect().await.unwrap();
    assert!(done.holder.is_none());
    assert!(
        done.expires_in
            .is_some_and(|e| e > Duration::from_secs(3600))
    );
    assert_eq!(c.scan("evt_*").await.unwrap(), ["evt_1"]);
    assert_eq!(once.purge().await.unwrap(), Purged::Deleted);
    assert!(once.inspect().await.unwrap().is_absent());
    assert!(matches!(
        once.begin("fp").await.unwrap(),
        Begin::Acquired(_)
    ));
    // Streaming is not offered: refused before anything is sent.
    assert!(!c.supports_streaming());
}

/// A record kept for its retention, then gone: the next begin runs the work again, with a
/// greater fence.
#[tokio::test]
async fn a_record_expires_with_its_retention() {
    let table = testkit::unique_table("retention");
    let config = LockConfig::builder()
        .lease(Duration::from_millis(200))
        .build()
        .unwrap();
    let c = client(&table, config).await;
    let once = c
        .once("short")
        .unwrap()
        .retention(Duration::from_millis(300))
        .unwrap();
    let Begin::Acquired(guard) = once.begin("").await.unwrap() else {
        panic!()
    };
    let fence = guard.fence();
    guard.complete(b"x").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match once.begin("").await.unwrap() {
            Begin::Acquired(g) => {
                assert!(g.fence() > fence);
                break;
            }
            Begin::Done(_) => {
                assert!(Instant::now() < deadline, "never expired");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other:?}"),
        }
    }
}

async fn ledger(table: &str) -> (tokio_postgres::Client, String) {
    let admin = admin().await;
    let ledger = format!("{table}_ledger");
    admin
        .batch_execute(&format!(
            "CREATE TABLE {ledger} (event text PRIMARY KEY, amount bigint)"
        ))
        .await
        .unwrap();
    (admin, ledger)
}

async fn rows(admin: &tokio_postgres::Client, ledger: &str) -> i64 {
    admin
        .query_one(&format!("SELECT count(*) FROM {ledger}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// The work's writes and the record commit together; released (or dropped) instead, neither.
/// A duplicate meanwhile is told the work is in flight at once: it never waits on the locked
/// row, nor holds a connection while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_commit_with_the_record_or_not_at_all() {
    let table = testkit::unique_table("tx");
    let (admin, ledger) = ledger(&table).await;
    let c = client(&table, LockConfig::default()).await;
    let insert = format!("INSERT INTO {ledger} (event, amount) VALUES ($1, $2)");

    let once = c.once("evt_commit").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    let tx = guard.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_commit", &5i64]).await.unwrap();
    // Not visible until the commit; a duplicate is told it is in flight, at once.
    assert_eq!(rows(&admin, &ledger).await, 0);
    let started = Instant::now();
    assert!(matches!(
        once.begin("fp").await.unwrap(),
        Begin::InFlight { .. }
    ));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a duplicate waited on the row"
    );
    guard.complete(b"paid").await.unwrap();
    assert_eq!(rows(&admin, &ledger).await, 1);
    assert!(matches!(once.begin("fp").await.unwrap(), Begin::Done(_)));

    // Aborted: the write goes with it, and the next attempt runs clean.
    let once = c.once("evt_abort").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    let tx = guard.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_abort", &7i64]).await.unwrap();
    drop(tx);
    assert!(guard.abort().await.unwrap());
    assert_eq!(rows(&admin, &ledger).await, 1);
    let Begin::Acquired(again) = once.begin("fp").await.unwrap() else {
        panic!("the aborted attempt left no record")
    };
    // Dropped without a word: rolled back as well.
    let tx = again.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_abort", &7i64]).await.unwrap();
    drop(tx);
    drop(again);
    let deadline = Instant::now() + Duration::from_secs(10);
    let third = loop {
        match once.begin("fp").await.unwrap() {
            Begin::Acquired(g) => break g,
            Begin::InFlight { .. } => {
                assert!(
                    Instant::now() < deadline,
                    "the dropped guard's lock never went"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        rows(&admin, &ledger).await,
        1,
        "the dropped attempt's write is gone"
    );
    let tx = third.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_abort", &7i64]).await.unwrap();
    third.complete(b"paid").await.unwrap();
    assert_eq!(rows(&admin, &ledger).await, 2);
}

/// The holder's connection dies mid-work (its process crashed, the network went): the database
/// rolls its writes back and lets the row go; once the lease is over the next attempt runs
/// clean, with a greater fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_connection_dies_leaves_nothing() {
    let table = testkit::unique_table("crash");
    let (admin, ledger) = ledger(&table).await;
    let config = LockConfig::builder()
        .lease(Duration::from_millis(500))
        .build()
        .unwrap();
    let crashed = client(&table, config.clone()).await;
    let next = client(&table, config).await;
    let insert = format!("INSERT INTO {ledger} (event, amount) VALUES ($1, $2)");
    let once = crashed.once("evt_crash").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    let fence = guard.fence();
    let tx = guard.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_crash", &9i64]).await.unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    // The process dies: no renewal, no release, its connection cut.
    std::mem::forget(guard);
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    std::mem::forget(tx);
    let once = next.once("evt_crash").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let successor = loop {
        match once.begin("fp").await.unwrap() {
            Begin::Acquired(g) => break g,
            Begin::InFlight { .. } => {
                assert!(
                    Instant::now() < deadline,
                    "the crashed holder's lease never ended"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other:?}"),
        }
    };
    assert!(successor.fence() > fence);
    assert_eq!(
        rows(&admin, &ledger).await,
        0,
        "the crashed attempt's write is gone"
    );
}

#[tokio::test]
async fn a_bad_table_name_is_refused_and_reentrant_locks_are_not_offered() {
    let server = PostgresServer::shared().await;
    for bad in ["", "1abc", "a;drop", "a.b.c", "x y"] {
        assert!(
            LockClient::builder()
                .connect_postgres(&server.url(), bad)
                .is_err(),
            "{bad:?}"
        );
    }
    assert!(
        LockClient::builder()
            .connect_postgres("not a url", "t")
            .is_err()
    );
    let c = client(&testkit::unique_table("reentrant"), LockConfig::default()).await;
    let owner = distlock::OwnerId::random();
    assert!(matches!(
        c.reentrant("r", &owner).unwrap().try_acquire().await,
        Err(LockError::Unsupported { .. })
    ));
}

/// A look at a row that a short statement has locked (a completion or a release being
/// committed, another caller taking it) reports what the row holds once that statement ends,
/// never "held" by nobody: it reported a free or completed name as held, with an empty tag,
/// which a caller comparing tags takes for another request's (the layer answered a retry with
/// `key-reused` while the first call's completion committed). A row locked by a bound
/// transaction whose holder is live is still reported held at once (see
/// `writes_commit_with_the_record_or_not_at_all`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_during_a_completion_sees_its_end() {
    let table = testkit::unique_table("look-during");
    let c = client(&table, LockConfig::default()).await;
    let admin = admin().await;
    // Completed: a look while the row is locked is the record.
    let done = c.once("done").unwrap();
    let Begin::Acquired(guard) = done.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    guard.complete(b"rec").await.unwrap();
    admin.batch_execute("BEGIN").await.unwrap();
    admin
        .execute(
            &format!("SELECT 1 FROM {table} WHERE name = $1 FOR UPDATE"),
            &[&done.name().lock_key()],
        )
        .await
        .unwrap();
    let look = tokio::spawn({
        let done = done.clone();
        async move { done.begin("fp").await }
    });
    // Released without a record: the look takes it once the row is free.
    let freed = c.once("freed").unwrap();
    let Begin::Acquired(guard) = freed.begin("fp").await.unwrap() else {
        panic!("the lock")
    };
    assert!(guard.abort().await.unwrap());
    admin
        .execute(
            &format!("SELECT 1 FROM {table} WHERE name = $1 FOR UPDATE"),
            &[&freed.name().lock_key()],
        )
        .await
        .unwrap();
    let take = tokio::spawn({
        let freed = freed.clone();
        async move { freed.begin("fp").await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    admin.batch_execute("COMMIT").await.unwrap();
    let look = tokio::time::timeout(Duration::from_secs(10), look)
        .await
        .expect("the look did not end within 10 s of the row's unlock")
        .unwrap()
        .unwrap();
    assert!(
        matches!(&look, Begin::Done(r) if &r.first()[..] == b"rec"),
        "{look:?}"
    );
    let take = tokio::time::timeout(Duration::from_secs(10), take)
        .await
        .expect("the take did not end within 10 s of the row's unlock")
        .unwrap()
        .unwrap();
    assert!(matches!(take, Begin::Acquired(_)), "{take:?}");
}
