//! The Postgres store on a real PostgreSQL: exclusion and fencing, run-once records, streamed
//! records, and work whose writes commit with its record (or not at all), also when its
//! connection dies. (The streaming scenarios shared with the other stores are in
//! `both_stores.rs`, module `postgres`.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use distlock::once::{Purged, RecordState};
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
    // Records can be streamed.
    assert!(c.supports_streaming());
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

/// How many parts the parts table holds for `once`.
async fn parts_rows(admin: &tokio_postgres::Client, table: &str, once: &distlock::Once) -> i64 {
    admin
        .query_one(
            &format!("SELECT count(*) FROM {table}_parts WHERE name = $1"),
            &[&once.name().lock_key()],
        )
        .await
        .unwrap()
        .get(0)
}

/// A client on `table` whose one connection goes through a fault proxy.
async fn client_via_proxy(table: &str, config: LockConfig) -> (testkit::FaultProxy, LockClient) {
    let server = PostgresServer::shared().await;
    let direct: tokio_postgres::Config = server.url().parse().unwrap();
    let port = *direct.get_ports().first().expect("a port");
    let proxy = testkit::FaultProxy::to(format!("127.0.0.1:{port}"))
        .await
        .unwrap();
    let mut pg = tokio_postgres::Config::new();
    pg.host("127.0.0.1").port(proxy.port());
    if let Some(user) = direct.get_user() {
        pg.user(user);
    }
    if let Some(db) = direct.get_dbname() {
        pg.dbname(db);
    }
    if let Some(password) = direct.get_password() {
        pg.password(password);
    }
    let manager = deadpool_postgres::Manager::from_config(
        pg,
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    // One connection: the statements are prepared on it before a reply is dropped.
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .unwrap();
    let client = LockClient::builder()
        .config(config)
        .postgres(pool, table)
        .unwrap();
    client.prepare().await.unwrap();
    (proxy, client)
}

/// Appends (and the completion of a streamed record) ran, but their replies were lost with the
/// connection: the retries on a new connection are recognised (the part found at its index,
/// the completing token with the record), so every part is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_append_reply_does_not_duplicate_the_part() {
    let table = testkit::unique_table("lost_append");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(5))
        .op_timeout(Duration::from_millis(500))
        .watchdog(false)
        .build()
        .unwrap();
    let (proxy, c) = client_via_proxy(&table, config).await;
    let once = c.once("stream").unwrap();
    let Begin::Acquired(guard) = once.begin("tag").await.unwrap() else {
        panic!("free")
    };
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
    assert_eq!(
        parts_rows(&admin().await, &table, &once).await,
        4,
        "no part stored twice"
    );
}

/// A duplicate joins a record being streamed by another client (which announces nothing to
/// it: it polls), reads the parts as they come and the end, and gets the same bytes as a
/// reader after the end. `begin` shows the parts appended so far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_in_another_client_follows_the_record_live() {
    let table = testkit::unique_table("follow");
    let writer = client(&table, LockConfig::default()).await;
    let reader = client(&table, LockConfig::default()).await;
    let once = writer.once("live").unwrap();
    let theirs = reader.once("live").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    guard.append(b"head").await.unwrap();
    let (fence, parts) = match theirs.begin("fp").await.unwrap() {
        Begin::InFlight { fence, parts, .. } => (fence, parts),
        other => panic!("{other:?}"),
    };
    assert_eq!((fence, parts), (guard.fence(), 1));
    let mut follower = theirs.follow(0).expect_writer(fence);
    let soon = || Instant::now() + Duration::from_secs(5);
    let read = follower.next(8, soon()).await.unwrap();
    assert_eq!(read.parts(), [&b"head"[..]]);
    assert_eq!(read.state(), RecordState::Writing { parts: 1 });
    let waiting = tokio::spawn(async move {
        let read = follower.next(8, soon()).await.unwrap();
        (read.parts().to_vec(), follower)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let appended = Instant::now();
    guard.append(b"chunk").await.unwrap();
    let (got, mut follower) = waiting.await.unwrap();
    assert_eq!(got, [&b"chunk"[..]]);
    assert!(
        appended.elapsed() < Duration::from_secs(2),
        "the reader polled it within its backoff"
    );
    guard.complete(b"end").await.unwrap();
    let read = follower.next(8, soon()).await.unwrap();
    assert_eq!(read.parts(), [&b"end"[..]]);
    assert!(read.is_complete());
    assert_eq!(
        theirs.stored_parts(0, 8).await.unwrap(),
        [&b"head"[..], b"chunk", b"end"]
    );
    match theirs.begin("fp").await.unwrap() {
        Begin::Done(record) => {
            assert_eq!((&record.first()[..], record.parts()), (&b"head"[..], 3));
        }
        other => panic!("{other:?}"),
    }
}

/// In a bound transaction the appends and the completion go through the transaction's
/// connection (the row is locked by it: an append on another connection would wait on it), and
/// the parts commit with the record. Meanwhile a reader elsewhere sees the record being
/// written (its parts not yet committed), never abandoned, even once the lease it can see is
/// past (renewed in the transaction). Aborted instead, nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_bound_transaction_the_parts_commit_with_the_record() {
    let table = testkit::unique_table("tx_stream");
    let (admin, ledger) = ledger(&table).await;
    let config = LockConfig::builder()
        .lease(Duration::from_millis(1200))
        .op_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let c = client(&table, config).await;
    let reader = client(&table, LockConfig::default()).await;
    let insert = format!("INSERT INTO {ledger} (event, amount) VALUES ($1, $2)");
    let once = c.once("evt_stream").unwrap();
    let theirs = reader.once("evt_stream").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    let tx = guard.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_stream", &3i64]).await.unwrap();
    let started = Instant::now();
    assert_eq!(guard.append(b"p0").await.unwrap(), 0);
    assert_eq!(guard.append(b"p1").await.unwrap(), 1);
    assert!(started.elapsed() < Duration::from_secs(1), "appends waited");
    assert_eq!(parts_rows(&admin, &table, &once).await, 0, "not committed");
    // Past the lease as it was committed: renewed in the transaction only.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert!(guard.guard().is_held());
    let read = theirs.parts(0, 8).await.unwrap();
    assert_eq!(read.state(), RecordState::Writing { parts: 0 });
    assert!(read.parts().is_empty());
    assert!(matches!(
        theirs.begin("fp").await.unwrap(),
        Begin::InFlight { .. }
    ));
    guard.complete(b"end").await.unwrap();
    assert_eq!(rows(&admin, &ledger).await, 1);
    assert_eq!(parts_rows(&admin, &table, &once).await, 3);
    let read = theirs.parts(0, 8).await.unwrap();
    assert_eq!(read.parts(), [&b"p0"[..], b"p1", b"end"]);
    assert_eq!(read.state(), RecordState::Done { parts: 3 });

    // Aborted: the parts go with the transaction.
    let once = c.once("evt_abort").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    let tx = guard.transaction().await.unwrap();
    tx.execute(&insert, &[&"evt_abort", &4i64]).await.unwrap();
    guard.append(b"gone").await.unwrap();
    drop(tx);
    assert!(guard.abort().await.unwrap());
    assert_eq!(parts_rows(&admin, &table, &once).await, 0);
    assert_eq!(
        once.parts(0, 8).await.unwrap().state(),
        RecordState::Abandoned
    );
    assert_eq!(rows(&admin, &ledger).await, 1);
}

/// The table and function of the previous version (no parts table, no part counts), as a
/// deployment made them.
const PREVIOUS_SCHEMA: &str = r#"
CREATE TABLE {table} (
    name text PRIMARY KEY,
    token text,
    lease_until timestamptz,
    fence bigint,
    tag bytea,
    since timestamptz,
    record bytea,
    completed_by text,
    expires_at timestamptz
);
CREATE INDEX {table}_expires_at ON {table} (expires_at);
CREATE OR REPLACE FUNCTION {table}_acquire(
    p_name text, p_token text, p_lease_ms bigint, p_state_ms bigint, p_once boolean,
    p_tag bytea, p_start bigint)
RETURNS TABLE(kind int, fence bigint, ttl_ms bigint, holder_tag bytea, rec bytea)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT 0, 0::bigint, 0::bigint, NULL::bytea, NULL::bytea;
END
$$;
"#;

/// A table made by the previous version keeps its records and gains what streaming needs
/// when an instance of this version prepares it (twice: a second instance finds it done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_the_previous_version_is_brought_up_to_date() {
    let table = testkit::unique_table("previous");
    let admin = admin().await;
    admin
        .batch_execute(&PREVIOUS_SCHEMA.replace("{table}", &table))
        .await
        .unwrap();
    let server = PostgresServer::shared().await;
    let c = LockClient::builder()
        .connect_postgres(&server.url(), &table)
        .unwrap();
    let kept = c.once("kept").unwrap();
    admin
        .execute(
            &format!(
                "INSERT INTO {table} (name, fence, record, completed_by, expires_at) \
                 VALUES ($1, 7, 'old record', 'someone', now() + interval '1 hour')"
            ),
            &[&kept.name().lock_key()],
        )
        .await
        .unwrap();
    c.prepare().await.unwrap();
    c.prepare().await.unwrap();
    match kept.begin("fp").await.unwrap() {
        Begin::Done(record) => assert_eq!(record.whole().map(|r| &r[..]), Some(&b"old record"[..])),
        other => panic!("{other:?}"),
    }
    let once = c.once("new").unwrap();
    let Begin::Acquired(guard) = once.begin("fp").await.unwrap() else {
        panic!()
    };
    guard.append(b"a").await.unwrap();
    guard.complete(b"b").await.unwrap();
    assert_eq!(once.parts(0, 8).await.unwrap().parts(), [&b"a"[..], b"b"]);
}

/// Many duplicates at once on a completed record (whole and streamed): every one gets the
/// record. Before, one whose acquisition found the row taken for a moment by another's (which
/// was reading the record) reported it held, by nobody and with no tag: a layer answered
/// "key reused" to a plain retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_of_a_completed_record_all_get_it() {
    let table = testkit::unique_table("dup_done");
    let writer = client(&table, LockConfig::default()).await;
    let whole = writer.once("whole").unwrap();
    let Begin::Acquired(g) = whole.begin("fp").await.unwrap() else {
        panic!()
    };
    g.complete(b"record").await.unwrap();
    let streamed = writer.once("streamed").unwrap();
    let Begin::Acquired(g) = streamed.begin("fp").await.unwrap() else {
        panic!()
    };
    g.append(b"head").await.unwrap();
    g.complete(b"end").await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let c = client(&table, LockConfig::default()).await;
        for name in ["whole", "streamed"] {
            for _ in 0..4 {
                let once = c.once(name).unwrap();
                tasks.push(tokio::spawn(async move {
                    for _ in 0..25 {
                        match once.begin("fp").await.unwrap() {
                            Begin::Done(_) => {}
                            other => panic!("{other:?}"),
                        }
                    }
                }));
            }
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
}
