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
                .redis(conn);
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
    assert!(matches!(waiting.await.unwrap(), Begin::Done(r) if &r[..] == b"done"));
}
