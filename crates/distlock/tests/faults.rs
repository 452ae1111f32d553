//! The lock under faults of the one Redis it lives in: paused (SIGSTOP) past the lease, killed
//! and restarted with and without the delayed-restart rule and with AOF, connections killed,
//! the server slowed with DEBUG SLEEP, and a holder stalled past its lease whose late write a
//! fenced resource refuses.
//!
//! Every critical section is recorded as held from entry until it left or its lease could no
//! longer be proven (`valid_until`), whichever came first; the history checker then proves at
//! most one holder at a time and increasing fencing tokens, except where a single Redis cannot
//! promise it (a restart that forgot the lock), where the test shows the violation and the
//! loss signal instead.
//!
//! `SOAK=1` runs longer variants (more contenders and rounds).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use distlock::{Lock, LockClient, LockConfig, LockError, LossReason};
use testkit::{FencedResource, History, RedisServer, ServerOptions, instant_ns, now_ns};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn soak() -> bool {
    std::env::var("SOAK").is_ok_and(|v| v == "1")
}

async fn client(server: &RedisServer, prefix: &str, lease: u64) -> LockClient {
    let config = LockConfig::builder()
        .lease(ms(lease))
        .op_timeout(ms(lease / 4))
        .build()
        .unwrap();
    let c = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .connect(&server.url())
        .unwrap();
    c.prepare().await.unwrap();
    c
}

/// Takes the lock, retrying through the unavailability a fault causes.
async fn acquire(lock: &Lock) -> distlock::LockGuard {
    for _ in 0..2_000 {
        match lock.acquire(Duration::from_secs(30)).await {
            Ok(g) => return g,
            Err(e) if e.is_unavailable() => tokio::time::sleep(ms(10)).await,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("never acquired");
}

/// Records a section from entry until the holder leaves or its lease can no longer be proven.
fn leave(section: testkit::Open<'_>, guard: &distlock::LockGuard) {
    let proven = instant_ns(guard.lease().valid_until());
    section.leave_at(now_ns().min(proven));
}

/// Contenders on `clients` clients × `tasks` tasks hold the lock for `hold` each time until
/// `stop`; returns how many leases were lost while held.
async fn contend(
    clients: Vec<LockClient>,
    tasks: usize,
    hold: Duration,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) -> usize {
    let lost = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for (ci, client) in clients.into_iter().enumerate() {
        for t in 0..tasks {
            let lock = client.lock("shared").unwrap();
            let (history, stop, lost) = (history.clone(), stop.clone(), lost.clone());
            handles.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let guard = acquire(&lock).await;
                    let section = history.enter(format!("c{ci}t{t}"), guard.fence());
                    tokio::time::sleep(hold).await;
                    if !guard.is_held() {
                        lost.fetch_add(1, Ordering::SeqCst);
                    }
                    leave(section, &guard);
                    let _ = guard.release().await;
                }
            }));
        }
    }
    for h in handles {
        h.await.unwrap();
    }
    lost.load(Ordering::SeqCst)
}

/// Runs contenders while `faults` injects faults, then checks the history.
async fn under_faults<F, Fut>(
    server: &RedisServer,
    test: &str,
    lease: u64,
    hold: u64,
    faults: F,
) -> testkit::Report
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let prefix = testkit::unique_prefix(test);
    let mut clients = Vec::new();
    for _ in 0..if soak() { 4 } else { 2 } {
        clients.push(client(server, &prefix, lease).await);
    }
    let history = Arc::new(History::new());
    let stop = Arc::new(AtomicBool::new(false));
    let contenders = tokio::spawn(contend(clients, 2, ms(hold), history.clone(), stop.clone()));
    tokio::time::sleep(ms(200)).await;
    faults().await;
    tokio::time::sleep(ms(200)).await;
    stop.store(true, Ordering::SeqCst);
    let lost = contenders.await.unwrap();
    let report = testkit::check(&history.sections())
        .unwrap_or_else(|e| panic!("{test}: {e} ({lost} leases lost in sections)"));
    assert!(
        report.sections > 10,
        "{test}: the contenders made progress: {report:?}"
    );
    report
}

fn rounds() -> usize {
    if soak() { 10 } else { 2 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_longer_than_the_lease() {
    let server = RedisServer::start_owned().await;
    under_faults(&server, "pause", 400, 20, || async {
        for _ in 0..rounds() {
            server.pause().await;
            tokio::time::sleep(ms(1_000)).await;
            server.resume().await;
            tokio::time::sleep(ms(300)).await;
        }
    })
    .await;

    // One holder inside the section across the pause: its loss signal fires during the pause,
    // and the next holder enters only after the resume.
    let prefix = testkit::unique_prefix("pause-one");
    let a = client(&server, &prefix, 400).await;
    let b = client(&server, &prefix, 400).await;
    let history = History::new();
    let guard = a.lock("k").unwrap().try_acquire().await.unwrap();
    // A stays inside its section (as far as it knows) until B is in: the history ends A's
    // section when its lease could no longer be proven, and B must enter after that.
    let section_a = history.enter("a", guard.fence());
    server.pause().await;
    let reason = tokio::time::timeout(Duration::from_secs(5), guard.lost()).await;
    server.resume().await;
    assert_eq!(
        reason.ok(),
        Some(LossReason::Expired),
        "the loss signal fired while Redis was frozen"
    );
    let next = acquire(&b.lock("k").unwrap()).await;
    let section_b = history.enter("b", next.fence());
    leave(section_a, &guard);
    section_b.leave();
    testkit::check(&history.sections())
        .expect("B entered after A's lease ended, with a greater fence");
    assert!(
        !guard.release().await.unwrap(),
        "the old holder deletes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slowed_with_debug_sleep() {
    let server = RedisServer::start_owned().await;
    under_faults(&server, "slow-short", 600, 10, || async {
        let mut c = server.connection().await;
        for _ in 0..rounds() * 3 {
            let _: () = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg(0.15)
                .query_async(&mut c)
                .await
                .unwrap();
            tokio::time::sleep(ms(100)).await;
        }
    })
    .await;
    under_faults(&server, "slow-long", 400, 10, || async {
        let mut c = server.connection().await;
        for _ in 0..rounds() {
            let _: () = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg(0.8)
                .query_async(&mut c)
                .await
                .unwrap();
            tokio::time::sleep(ms(300)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_killed_under_contention() {
    let server = RedisServer::start_owned().await;
    under_faults(&server, "client-kill", 600, 5, || async {
        let mut admin = server.connection().await;
        for _ in 0..rounds() * 5 {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("normal")
                .arg("SKIPME")
                .arg("yes")
                .query_async(&mut admin)
                .await
                .unwrap();
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg("pubsub")
                .query_async(&mut admin)
                .await
                .unwrap();
            tokio::time::sleep(ms(80)).await;
        }
    })
    .await;

    // A holder whose connection is killed keeps its lease: the renewal reconnects in time.
    let prefix = testkit::unique_prefix("kill-one");
    let a = client(&server, &prefix, 900).await;
    let guard = a.lock("k").unwrap().try_acquire().await.unwrap();
    let mut admin = server.connection().await;
    for _ in 0..3 {
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query_async(&mut admin)
            .await
            .unwrap();
        tokio::time::sleep(ms(300)).await;
    }
    assert!(guard.is_held(), "renewals survive dropped connections");
    assert!(guard.release().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted() {
    // Without persistence, restarted at once: Redis forgot the lock. A single Redis cannot
    // promise exclusion here; the history shows two holders, and the old holder's loss signal
    // fires at its next renewal.
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("restart-forget");
    let a = client(&server, &prefix, 2_000).await;
    let b = client(&server, &prefix, 2_000).await;
    let history = History::new();
    let guard_a = a.lock("k").unwrap().try_acquire().await.unwrap();
    let section_a = history.enter("a", guard_a.fence());
    server.stop().await;
    server.restart().await;
    let guard_b = acquire(&b.lock("k").unwrap()).await;
    let section_b = history.enter("b", guard_b.fence());
    let reason = tokio::time::timeout(Duration::from_secs(5), guard_a.lost()).await;
    leave(section_a, &guard_a);
    section_b.leave();
    assert_eq!(
        reason.ok(),
        Some(LossReason::NotOwner),
        "A learns at its next renewal"
    );
    let violation = testkit::check(&history.sections()).unwrap_err();
    assert!(
        violation.contains("two holders") || violation.contains("fencing"),
        "{violation}"
    );

    // Delayed restart: Redis stays down longer than the lease. A cannot renew, its loss signal
    // fires at the end of its lease, and B only gets the lock after that.
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("restart-delayed");
    let a = client(&server, &prefix, 800).await;
    let b = client(&server, &prefix, 800).await;
    let history = History::new();
    let guard_a = a.lock("k").unwrap().try_acquire().await.unwrap();
    // Numbered sections: the fences cannot be compared here (see below).
    let section_a = history.enter("a", 1);
    server.stop().await;
    let reason = tokio::time::timeout(Duration::from_secs(5), guard_a.lost()).await;
    assert_eq!(reason.ok(), Some(LossReason::Expired));
    tokio::time::sleep(ms(900)).await;
    server.restart().await;
    let guard_b = acquire(&b.lock("k").unwrap()).await;
    // A is still inside as far as it knows; its section ends where its lease could no longer
    // be proven, and B must have entered after that.
    let section_b = history.enter("b", 2);
    leave(section_a, &guard_a);
    section_b.leave();
    testkit::check(&history.sections()).expect("no overlap with the delayed restart");
    // The limit (SAFETY.md, L6): the restarted Redis forgot the fencing counter with the lock,
    // so B's token does not exceed A's. Only the lease kept them apart; a resource that checks
    // tokens needs a Redis that persists (AOF), as below.
    assert!(
        guard_b.fence() <= guard_a.fence(),
        "a Redis restarted empty starts its counter again: {} after {}",
        guard_b.fence(),
        guard_a.fence()
    );

    // AOF with fsync always, restarted at once: the lock survives; B cannot take it, and A's
    // renewals reach the restarted Redis.
    let server = RedisServer::start_with(ServerOptions::default().append_only(true)).await;
    let prefix = testkit::unique_prefix("restart-aof");
    let a = client(&server, &prefix, 2_000).await;
    let b = client(&server, &prefix, 2_000).await;
    let guard_a = a.lock("k").unwrap().try_acquire().await.unwrap();
    server.stop().await;
    server.restart().await;
    let lock_b = b.lock("k").unwrap();
    let mut held = false;
    for _ in 0..40 {
        match lock_b.try_acquire().await {
            Err(LockError::Held { .. }) => {
                held = true;
                break;
            }
            Err(e) if e.is_unavailable() => tokio::time::sleep(ms(25)).await,
            other => panic!("B must not get A's persisted lock: {other:?}"),
        }
    }
    assert!(held);
    tokio::time::sleep(ms(1_500)).await;
    assert!(guard_a.is_held(), "A kept renewing across the restart");
    assert!(guard_a.release().await.unwrap());
}

/// Kleppmann's scenario: a holder stalls past its lease (its runtime blocked, as in a GC
/// pause), the next holder writes with a greater fence, and the stalled holder's late write is
/// refused by the fenced resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_holders_late_write_is_fenced_off() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("kleppmann");
    let resource = Arc::new(FencedResource::new());
    let url = server.url();
    let (tx, rx) = std::sync::mpsc::channel();
    let stalled = std::thread::spawn({
        let resource = resource.clone();
        let prefix = prefix.clone();
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let config = LockConfig::builder().lease(ms(300)).build().unwrap();
                let c = LockClient::builder()
                    .config(config)
                    .prefix(&prefix)
                    .unwrap()
                    .connect(&url)
                    .unwrap();
                c.prepare().await.unwrap();
                let guard = c.lock("file").unwrap().try_acquire().await.unwrap();
                tx.send(()).unwrap();
                std::thread::sleep(ms(1_200)); // the pause: no renewal, no loss noticed yet
                // The write it was about to make, with its (now stale) fence:
                resource.write(guard.fence(), "stale holder's data")
            })
        }
    });
    rx.recv().unwrap();
    let c = client(&server, &prefix, 2_000).await;
    let guard = acquire(&c.lock("file").unwrap()).await;
    assert!(resource.write(guard.fence(), "current holder's data"));
    let stale_accepted = tokio::task::spawn_blocking(move || stalled.join().unwrap())
        .await
        .unwrap();
    assert!(!stale_accepted, "the late write was refused");
    assert_eq!(resource.value().as_deref(), Some("current holder's data"));
    assert_eq!(resource.rejected().len(), 1);
}

/// A Sentinel master that hangs (as the client sees it: its connection answers nothing, the
/// socket stays open) without any failover, so no `+switch-master` ever comes: the client
/// abandons the silent connection, asks the sentinels again, and works on a new connection
/// within a few seconds. Before, every command kept timing out on the hung connection forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_sentinel_master_is_abandoned_without_a_switch() {
    let group = testkit::RedisSentinel::start_behind_proxy(0).await;
    let proxy = group.proxy().expect("behind a proxy");
    let config = LockConfig::builder()
        .lease(ms(900))
        .op_timeout(ms(150))
        .build()
        .unwrap();
    let client = LockClient::builder()
        .config(config)
        .prefix(&testkit::unique_prefix("sentinel-hung"))
        .unwrap()
        .sentinel(&group.sentinel_urls(), testkit::SENTINEL_SERVICE)
        .unwrap();
    let lock = client.lock("k").unwrap();
    let mut ready = false;
    for _ in 0..100 {
        if let Ok(g) = lock.try_acquire().await {
            assert!(g.release().await.unwrap());
            ready = true;
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    assert!(ready, "the lock works through the sentinels");
    proxy.hang_open_connections();
    let hung = std::time::Instant::now();
    let mut recovered = None;
    while hung.elapsed() < Duration::from_secs(8) {
        match lock.try_acquire().await {
            Ok(g) => {
                recovered = Some(g);
                break;
            }
            Err(e) if e.is_unavailable() => tokio::time::sleep(ms(100)).await,
            Err(e) => panic!("{e}"),
        }
    }
    let guard = recovered.unwrap_or_else(|| {
        panic!(
            "still no answer {:?} after the master's connection hung",
            hung.elapsed()
        )
    });
    assert!(guard.release().await.unwrap());
}
