//! The lock, unchanged, on a real Redis Cluster (3 masters, each with a replica): every script
//! touches one hash slot, MOVED/ASK are the client's business, release announcements reach a
//! subscriber on any node.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Begin, LockClient, LockConfig, OwnerId};
use testkit::{History, RedisCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_run_unchanged_on_a_cluster() {
    let cluster = RedisCluster::start(3, 1).await;
    let prefix = testkit::unique_prefix("cluster");
    let client = |config: LockConfig| {
        let prefix = prefix.clone();
        let cluster = &cluster;
        async move {
            let conn = cluster.connection().await;
            let c = LockClient::builder()
                .config(config)
                .prefix(&prefix)
                .unwrap()
                .notifications(redis::Client::open(cluster.urls()[0].as_str()).unwrap())
                .redis(conn)
                .unwrap();
            c.prepare().await.expect("scripts load on every master");
            c
        }
    };

    // The keys of one lock share a slot; names spread over the masters.
    let mut conn = cluster.connection().await;
    let c = client(LockConfig::default()).await;
    for name in ["a", "b", "c", "d", "e", "f"] {
        let lock = c.lock(name).unwrap();
        let slot = |key: &str| {
            let key = key.to_owned();
            let mut conn = conn.clone();
            async move {
                redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(key)
                    .query_async::<i64>(&mut conn)
                    .await
                    .unwrap()
            }
        };
        assert_eq!(
            slot(lock.name().lock_key()).await,
            slot(lock.name().state_key()).await
        );
        let g = lock.try_acquire().await.unwrap();
        assert!(lock.try_acquire().await.is_err());
        assert!(g.release().await.unwrap());
    }
    let _: () = redis::cmd("PING").query_async(&mut conn).await.unwrap();

    // Exclusion and fencing across clients and tasks.
    let history = Arc::new(History::new());
    let mut tasks = Vec::new();
    for ci in 0..3 {
        let c = client(LockConfig::default()).await;
        for t in 0..3 {
            let lock = c.lock("shared").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..10 {
                    let g = lock.acquire(Duration::from_secs(60)).await.unwrap();
                    let s = history.enter(format!("{ci}/{t}"), g.fence());
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
    assert_eq!(testkit::check(&history.sections()).unwrap().sections, 90);

    // Reentrant locks and run-once records.
    let me = OwnerId::random();
    let outer = c.reentrant("r", &me).unwrap().try_acquire().await.unwrap();
    let inner = c.reentrant("r", &me).unwrap().try_acquire().await.unwrap();
    assert!(
        c.reentrant("r", &OwnerId::random())
            .unwrap()
            .try_acquire()
            .await
            .is_err()
    );
    assert!(inner.release().await.unwrap() && outer.release().await.unwrap());
    let once = c.once("evt").unwrap();
    let Begin::Acquired(g) = once.begin("t").await.unwrap() else {
        panic!()
    };
    let waiting = tokio::spawn({
        let once = once.clone();
        async move { once.begin_wait("t", Duration::from_secs(10)).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    g.complete(b"done").await.unwrap();
    assert!(
        matches!(waiting.await.unwrap(), Begin::Done(r) if r.whole().is_some_and(|w| &w[..] == b"done"))
    );
    // A streamed record: every key of it in the record's slot (no CROSSSLOT), read back whole.
    assert!(c.supports_streaming());
    let stream = c.once("stream").unwrap();
    let Begin::Acquired(g) = stream.begin("t").await.unwrap() else {
        panic!()
    };
    g.append(b"a").await.unwrap();
    g.append(b"b").await.unwrap();
    g.complete(b"c").await.unwrap();
    let read = stream.parts(0, 8).await.unwrap();
    assert_eq!(read.parts(), [&b"a"[..], b"b", b"c"]);
    assert_eq!(read.state(), distlock::once::RecordState::Done { parts: 3 });

    // An operator's scan reaches every master: records spread over the slots are all found
    // (a SCAN of one node finds a third of them), and inspected where they are.
    let mut names: Vec<String> = (0..30).map(|i| format!("scan.{i:02}")).collect();
    for name in &names {
        let Begin::Acquired(g) = c.once(name).unwrap().begin("t").await.unwrap() else {
            panic!()
        };
        g.complete(b"x").await.unwrap();
    }
    names.sort();
    assert_eq!(c.scan("scan.*").await.unwrap(), names);
    let inspected = c.once("scan.07").unwrap().inspect().await.unwrap();
    assert_eq!(
        inspected.record.map(|r| r.into_first()),
        Some(bytes::Bytes::from_static(b"x"))
    );
    assert_eq!(
        c.once("scan.07").unwrap().purge().await.unwrap(),
        distlock::once::Purged::Deleted
    );
}

/// A release announcement published on the master that owns the lock reaches a waiter whose
/// client listens on another master, with polling off (so nothing else could wake it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_reaches_a_waiter_listening_on_another_node() {
    let cluster = RedisCluster::start(3, 0).await;
    let prefix = testkit::unique_prefix("cluster-announce");
    let config = LockConfig::builder().polling(false).build().unwrap();
    let mut conn = cluster.connection().await;
    let lock_name = distlock::LockName::new(&prefix, "far").unwrap();
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(lock_name.lock_key())
        .query_async(&mut conn)
        .await
        .unwrap();
    // The node that does not serve the lock's slot.
    let mut listen_on = None;
    for url in cluster.urls() {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut c)
            .await
            .unwrap();
        let me = nodes.lines().find(|l| l.contains("myself")).unwrap();
        let serves = me.split(' ').skip(8).any(|range| {
            let mut ends = range.split('-').map(|v| v.parse::<i64>().unwrap_or(-1));
            let lo = ends.next().unwrap_or(-1);
            let hi = ends.next().unwrap_or(lo);
            (lo..=hi).contains(&slot)
        });
        if !serves {
            listen_on = Some(url);
            break;
        }
    }
    let listen_on = listen_on.expect("three masters: two do not serve the slot");
    let make = |notify: &str| {
        let notify = redis::Client::open(notify).unwrap();
        let config = config.clone();
        let prefix = prefix.clone();
        let cluster = &cluster;
        async move {
            let c = LockClient::builder()
                .config(config)
                .prefix(&prefix)
                .unwrap()
                .notifications(notify)
                .redis(cluster.connection().await)
                .unwrap();
            c.prepare().await.unwrap();
            c
        }
    };
    let holder = make(&cluster.urls()[0]).await;
    let waiter = make(&listen_on).await;
    let held = holder.lock("far").unwrap().try_acquire().await.unwrap();
    let lock = waiter.lock("far").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire(Duration::from_secs(5)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(held.release().await.unwrap());
    let got = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the announcement crossed the cluster and woke the waiter")
        .unwrap()
        .unwrap();
    assert!(got.release().await.unwrap());
}
