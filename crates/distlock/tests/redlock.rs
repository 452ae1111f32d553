//! Redlock against real independent redis-server masters: quorum, rollback of partial
//! acquisitions, exclusion and fencing while nodes are stopped, paused and restarted, and the
//! restart rule shown both ways.

use std::sync::Arc;
use std::time::Duration;

use distlock::{LockClient, LockConfig, LockError, LossReason};
use redis::AsyncCommands;
use testkit::{History, RedisServer, ServerOptions};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

async fn nodes(n: usize, persistent: bool) -> Vec<RedisServer> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(RedisServer::start_with(ServerOptions::default().append_only(persistent)).await);
    }
    out
}

fn urls(nodes: &[RedisServer]) -> Vec<String> {
    nodes.iter().map(RedisServer::url).collect()
}

async fn redlock(nodes: &[RedisServer], prefix: &str, config: LockConfig) -> LockClient {
    redlock_with(nodes, prefix, config, ms(70)).await
}

async fn redlock_with(
    nodes: &[RedisServer],
    prefix: &str,
    config: LockConfig,
    node_timeout: Duration,
) -> LockClient {
    let client = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .node_timeout(node_timeout)
        .connect_redlock(&urls(nodes))
        .unwrap();
    // Scripts loaded on every live node (a quorum suffices).
    let _ = client.prepare().await;
    client
}

fn config(lease: u64) -> LockConfig {
    LockConfig::builder()
        .lease(ms(lease))
        .op_timeout(ms(lease / 4))
        .build()
        .unwrap()
}

/// One attempt, repeated while the store is unavailable: connections to a node that was
/// restarted fail once before they reconnect.
async fn try_acquire(lock: &distlock::Lock) -> Result<distlock::LockGuard, LockError> {
    let mut last = None;
    for _ in 0..40 {
        match lock.try_acquire().await {
            Err(e) if e.is_unavailable() => last = Some(e),
            other => return other,
        }
        tokio::time::sleep(ms(50)).await;
    }
    Err(last.expect("tried"))
}

/// Waits for the lock, retrying while the store is unavailable.
async fn acquire(lock: &distlock::Lock, wait: Duration) -> distlock::LockGuard {
    for _ in 0..40 {
        match lock.acquire(wait).await {
            Ok(g) => return g,
            Err(e) if e.is_unavailable() => tokio::time::sleep(ms(50)).await,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("no quorum after 40 attempts");
}

async fn lock_value(node: &RedisServer, key: &str) -> Option<String> {
    let mut c = node.connection().await;
    c.get(key).await.unwrap()
}

/// A foreign holder on two of three nodes: the third node's acquisition is rolled back. With
/// two nodes down, the attempt reports that no quorum can be had, and rolls back too.
#[tokio::test]
async fn partial_acquisitions_are_rolled_back() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-partial");
    let client = redlock(&n, &prefix, config(5_000)).await;
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    for node in &n[..2] {
        let mut c = node.connection().await;
        let _: () = c.set(&key, "someone-else").await.unwrap();
    }
    assert!(matches!(
        lock.try_acquire().await,
        Err(LockError::Held { .. })
    ));
    assert_eq!(
        lock_value(&n[2], &key).await,
        None,
        "rolled back on the node it got"
    );

    for node in &n[..2] {
        let mut c = node.connection().await;
        let _: () = c.del(&key).await.unwrap();
    }
    n[0].stop().await;
    n[1].stop().await;
    match lock.try_acquire().await {
        Err(e @ LockError::NoQuorum { .. }) => assert!(e.is_unavailable()),
        other => panic!("expected NoQuorum, got {other:?}"),
    }
    assert_eq!(
        lock_value(&n[2], &key).await,
        None,
        "rolled back without a quorum"
    );
}

/// A node too slow to answer within the node timeout may run the acquisition later: the
/// rollback is sent to it as well, and runs after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_node_is_rolled_back_too() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-late");
    let client = redlock(&n, &prefix, config(5_000)).await;
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    let mut c1 = n[1].connection().await;
    let _: () = c1.set(&key, "someone-else").await.unwrap();
    let mut slow = n[0].connection().await;
    let sleeper = tokio::spawn(async move {
        let _: () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(0.4)
            .query_async(&mut slow)
            .await
            .unwrap();
    });
    tokio::time::sleep(ms(50)).await;
    assert!(lock.try_acquire().await.is_err());
    sleeper.await.unwrap();
    for _ in 0..50 {
        if lock_value(&n[0], &key).await.is_none() && lock_value(&n[2], &key).await.is_none() {
            return;
        }
        tokio::time::sleep(ms(20)).await;
    }
    panic!("the late node kept a lock nobody holds");
}

/// One node down or frozen: acquisition, renewal and release still work with the majority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_majority_keeps_working_while_one_node_is_down_or_frozen() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-minority");
    let client = redlock(&n, &prefix, config(900)).await;
    let lock = client.lock("k").unwrap();
    n[0].stop().await;
    let guard = lock.try_acquire().await.unwrap();
    n[1].pause().await;
    // Nodes 0 and 1 are unavailable now: no quorum for renewals, so the lease is lost...
    let lost = tokio::time::timeout(Duration::from_secs(5), guard.lost()).await;
    n[1].resume().await;
    assert_eq!(
        lost.ok(),
        Some(LossReason::Expired),
        "two of three nodes gone: the lease cannot be renewed"
    );
    drop(guard);
    // ...while with one node down, renewals by the majority keep it.
    let guard = acquire(&lock, Duration::from_secs(10)).await;
    assert!(
        tokio::time::timeout(ms(2000), guard.lost()).await.is_err(),
        "renewed by the majority"
    );
    assert!(guard.release().await.unwrap());
}

/// Many contenders on 3 and on 5 masters while nodes are stopped and restarted (with AOF
/// `appendfsync always`) and frozen with SIGSTOP: one holder at a time, fences increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_with_three_masters_under_faults() {
    exclusion_under_faults(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_with_five_masters_under_faults() {
    exclusion_under_faults(5).await;
}

async fn exclusion_under_faults(count: usize) {
    let n = Arc::new(nodes(count, true).await);
    let prefix = testkit::unique_prefix(&format!("rl-faults-{count}"));
    let history = Arc::new(History::new());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..3 {
        let client = redlock(&n, &prefix, config(2_000)).await;
        for t in 0..3 {
            let lock = client.lock("shared").unwrap();
            let history = history.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..12 {
                    let guard = loop {
                        match lock.acquire(Duration::from_secs(30)).await {
                            Ok(g) => break g,
                            // A fault can leave no quorum for a moment: try again.
                            Err(e) if e.is_unavailable() => tokio::time::sleep(ms(20)).await,
                            Err(e) => panic!("{e}"),
                        }
                    };
                    let section = history.enter(format!("c{c}t{t}"), guard.fence());
                    tokio::time::sleep(ms(2)).await;
                    section.leave();
                    let _ = guard.release().await;
                }
            }));
        }
    }
    let faults = tokio::spawn({
        let n = n.clone();
        let stop = stop.clone();
        async move {
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let victim = &n[round % n.len()];
                if round % 2 == 0 {
                    victim.stop().await;
                    tokio::time::sleep(ms(150)).await;
                    victim.restart().await;
                } else {
                    victim.pause().await;
                    tokio::time::sleep(ms(150)).await;
                    victim.resume().await;
                }
                tokio::time::sleep(ms(100)).await;
                round += 1;
            }
            round
        }
    });
    for t in tasks {
        t.await.unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rounds = faults.await.unwrap();
    assert!(rounds >= 1, "faults were injected while the contenders ran");
    let report = testkit::check(&history.sections()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.sections, 108);
}

/// Fencing tokens stay strictly increasing while random subsets of up to two of five masters
/// are stopped (and restarted with their data) or frozen between acquisitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_increase_with_random_node_subsets_failing() {
    let n = nodes(5, true).await;
    let prefix = testkit::unique_prefix("rl-fence");
    let client = redlock(&n, &prefix, config(2_000)).await;
    let lock = client.lock("f").unwrap();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut last = 0;
    for _ in 0..12 {
        let mut down: Vec<usize> = (0..5).collect();
        rng.shuffle(&mut down);
        down.truncate(rng.usize(0..=2));
        let freeze = rng.bool();
        for &i in &down {
            if freeze {
                n[i].pause().await;
            } else {
                n[i].stop().await;
            }
        }
        let guard = acquire(&lock, Duration::from_secs(10)).await;
        assert!(
            guard.fence() > last,
            "fence {} after {last} (down: {down:?})",
            guard.fence()
        );
        last = guard.fence();
        let _ = guard.release().await;
        for &i in &down {
            if freeze {
                n[i].resume().await;
            } else {
                n[i].restart().await;
            }
        }
    }
}

/// The restart rule. A holds the lock on nodes 0 and 1 (node 2 is down). Node 1 crashes.
/// * Restarted at once without persistence, it has forgotten A's lock: B gets a quorum of
///   nodes 1 and 2 while A still holds the lock. Two holders: the failure.
/// * Restarted with AOF `appendfsync always`, it still has A's lock: B cannot get a quorum.
/// * Restarted only after the longest lease has passed (the delayed restart): A could not renew
///   without a quorum, its loss signal fired, its lease ended, and only then does B take the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_rule_both_ways() {
    async fn setup(
        persistent: bool,
    ) -> (
        Vec<RedisServer>,
        LockClient,
        LockClient,
        distlock::LockGuard,
    ) {
        let n = nodes(3, persistent).await;
        let prefix = testkit::unique_prefix("rl-restart");
        let a = redlock(&n, &prefix, config(1_500)).await;
        let b = redlock(&n, &prefix, config(1_500)).await;
        n[2].stop().await;
        let guard = a.lock("r").unwrap().try_acquire().await.unwrap();
        n[1].stop().await;
        (n, a, b, guard)
    }

    // Without persistence and restarted at once: two holders.
    let (n, _a, b, guard_a) = setup(false).await;
    n[1].restart().await;
    n[2].restart().await;
    let guard_b = try_acquire(&b.lock("r").unwrap())
        .await
        .expect("B gets a quorum of forgetful nodes");
    assert!(
        guard_a.is_held(),
        "A's lease has not ended: two holders at once"
    );
    drop((guard_a, guard_b));

    // With AOF fsync always: the restarted node remembers A's lock.
    let (n, _a, b, guard_a) = setup(true).await;
    n[1].restart().await;
    n[2].restart().await;
    assert!(matches!(
        try_acquire(&b.lock("r").unwrap()).await,
        Err(LockError::Held { .. })
    ));
    assert!(guard_a.is_held());
    drop(guard_a);

    // Delayed restart (no persistence): node 1 stays down longer than the lease.
    let (n, _a, b, guard_a) = setup(false).await;
    let reason = tokio::time::timeout(Duration::from_secs(10), guard_a.lost())
        .await
        .expect("A cannot renew without a quorum");
    assert_eq!(reason, LossReason::Expired);
    tokio::time::sleep(ms(1_600)).await; // past the longest lease
    n[1].restart().await;
    n[2].restart().await;
    let guard_b = acquire(&b.lock("r").unwrap(), Duration::from_secs(10)).await;
    assert!(
        !guard_a.is_held(),
        "A knew it had lost the lock before B took it"
    );
    assert!(guard_b.is_held());
}

/// `Once` on Redlock decides "done" by quorum. Holder X's lease runs out on two of three nodes
/// (their lock keys vanish): its completion stores a record on the third only and is told
/// `LeaseLost`. Y then takes the two free nodes and completes. Every reader, whichever node
/// answers first, gets Y's record: X's minority record is never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_completion_record_is_never_replayed() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-once");
    let client = redlock(&n, &prefix, config(5_000)).await;
    let once = client.once("evt").unwrap();
    let distlock::Begin::Acquired(x) = once.begin("x").await.unwrap() else {
        panic!("free")
    };
    for node in &n[1..] {
        let mut c = node.connection().await;
        let _: () = c.del(once.name().lock_key()).await.unwrap();
    }
    assert!(matches!(
        x.complete(b"X").await,
        Err(LockError::LeaseLost { .. })
    ));
    let mut c0 = n[0].connection().await;
    let stored: Option<String> = c0.hget(once.name().state_key(), "d").await.unwrap();
    assert_eq!(stored.as_deref(), Some("X"), "X's record is on node 0 only");
    match once.begin("y").await.unwrap() {
        distlock::Begin::Acquired(y) => y.complete(b"Y").await.unwrap(),
        distlock::Begin::Done(r) => panic!("a minority record was replayed: {r:?}"),
        other => panic!("{other:?}"),
    }
    for _ in 0..5 {
        let reader = redlock(&n, &prefix, config(5_000)).await;
        match reader.once("evt").unwrap().begin("z").await.unwrap() {
            distlock::Begin::Done(r) => assert_eq!(r.whole().map(|w| &w[..]), Some(&b"Y"[..])),
            other => panic!("{other:?}"),
        }
    }
}

/// Streamed records are not offered on Redlock (every part would need a quorum read): the
/// client says so, `append`, `parts` and `wait_parts` are refused with `Unsupported` and send
/// nothing, and the same guard still completes a whole record, decided by quorum.
#[tokio::test]
async fn streaming_is_refused_on_redlock() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-stream");
    let client = redlock(&n, &prefix, config(5_000)).await;
    assert!(!client.supports_streaming());
    let once = client.once("evt").unwrap();
    let distlock::Begin::Acquired(g) = once.begin("x").await.unwrap() else {
        panic!("free")
    };
    match g.append(b"part").await {
        Err(LockError::Unsupported { operation, .. }) => assert_eq!(operation, "append"),
        other => panic!("{other:?}"),
    }
    assert_eq!(g.appended(), 0);
    assert!(matches!(
        once.parts(0, 8).await,
        Err(LockError::Unsupported { .. })
    ));
    let soon = std::time::Instant::now() + Duration::from_secs(1);
    assert!(matches!(
        once.wait_parts(0, 8, soon).await,
        Err(LockError::Unsupported { .. })
    ));
    g.complete(b"whole").await.unwrap();
    match once.begin("x").await.unwrap() {
        distlock::Begin::Done(r) => {
            assert_eq!(r.parts(), 1);
            assert_eq!(r.whole().map(|w| &w[..]), Some(&b"whole"[..]));
        }
        other => panic!("{other:?}"),
    }
    for node in &n {
        let mut c = node.connection().await;
        let exists: bool = c.exists(once.name().parts_key()).await.unwrap();
        assert!(!exists, "nothing streamed");
    }
}

/// Run-once and reentrant locks always fence, on Redlock too, even with `fencing(false)`.
#[tokio::test]
async fn once_and_reentrant_locks_fence_on_redlock_without_fencing() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-fence-off");
    let unfenced = config(5_000).to_builder().fencing(false).build().unwrap();
    let client = redlock(&n, &prefix, unfenced).await;
    let distlock::Begin::Acquired(g) = client.once("o").unwrap().begin("").await.unwrap() else {
        panic!("free")
    };
    assert!(g.fence() >= 1, "a run-once lock fences");
    let me = distlock::OwnerId::random();
    let r = client
        .reentrant("r", &me)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(r.fence() >= 1, "a reentrant lock fences");
    let x = client.lock("x").unwrap().try_acquire().await.unwrap();
    assert_eq!(x.fence(), 0, "an exclusive lock does not");
}

/// One of three masters is frozen (SIGSTOP: it accepts connections and never answers). A fresh
/// client connects to the nodes concurrently and goes on with the quorum that answers: ready
/// and holding the lock in well under a second, not after the frozen node's connection
/// timeouts (5 s before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_does_not_stall_a_fresh_client() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-frozen-start");
    n[0].pause().await;
    let started = std::time::Instant::now();
    let client = LockClient::builder()
        .prefix(&prefix)
        .unwrap()
        .connect_redlock(&urls(&n))
        .unwrap();
    let prepared = client.prepare().await;
    let guard = client.lock("k").unwrap().try_acquire().await;
    let took = started.elapsed();
    n[0].resume().await;
    prepared.expect("a quorum is ready");
    let guard = guard.expect("a quorum takes the lock");
    assert!(
        took < Duration::from_millis(1_500),
        "a fresh client waited {took:?} for a frozen master"
    );
    assert!(guard.release().await.unwrap());
}

/// Redlock while leases run out: a seeded random schedule of faults (a master stopped and
/// restarted with its AOF, or frozen), holders that keep the lock past their lease (no
/// watchdog) or lose it while a second master fails mid-hold, and a contender waiting each
/// time. Every section (ended where its lease could no longer be proven) must be exclusive and
/// every fence greater than the one before. The schedule must reach the case the fence
/// write-back exists for: a quorum member whose own counter was behind (it missed an
/// acquisition while down) and was raised to the fence drawn elsewhere. `SEED=n` replays a
/// schedule; the seed is printed on failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_outlived_while_masters_fail_with_a_seeded_schedule() {
    let seed = std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| testkit::now_ns() % 1_000_000);
    let failed = |what: String| -> ! { panic!("seed {seed} (replay with SEED={seed}): {what}") };
    let mut rng = fastrand::Rng::with_seed(seed);
    let steps = if std::env::var("SOAK").is_ok_and(|v| v == "1") {
        40
    } else {
        8
    };
    let n = nodes(3, true).await;
    let prefix = testkit::unique_prefix("rl-schedule");
    let lease = 300;
    let node = ms(25);
    let renewing = redlock_with(&n, &prefix, config(lease), node).await;
    let lazy = config(lease).to_builder().watchdog(false).build().unwrap();
    let lazy = redlock_with(&n, &prefix, lazy, node).await;
    let contender = redlock_with(&n, &prefix, config(lease), node).await;
    let state_key = renewing.lock("s").unwrap().name().state_key().to_owned();
    let history = History::new();
    let (mut write_backs, mut losses) = (0, 0);
    let mut down: Option<(usize, bool)> = None;
    let mut step = 0;
    // The planned steps, extended (boundedly) until both cases of interest were reached.
    while step < steps || ((losses == 0 || write_backs == 0) && step < 3 * steps) {
        step += 1;
        // Restore the node taken down last step, then maybe take another one down.
        if let Some((i, frozen)) = down.take() {
            if frozen {
                n[i].resume().await
            } else {
                n[i].restart().await
            }
        }
        if rng.f32() < 0.8 {
            let (i, frozen) = (rng.usize(0..3), rng.bool());
            if frozen {
                n[i].pause().await
            } else {
                n[i].stop().await
            }
            down = Some((i, frozen));
        }
        // Counters before, on the nodes that answer.
        let mut before = [None; 3];
        for (i, node) in n.iter().enumerate() {
            if down.is_some_and(|(d, _)| d == i) {
                continue;
            }
            let mut c = node.connection().await;
            let v: Option<u64> = c.hget(&state_key, "n").await.unwrap_or(None);
            before[i] = Some(v.unwrap_or(0));
        }
        let long = rng.bool();
        let holder = if long && rng.bool() { &lazy } else { &renewing };
        let guard = acquire(&holder.lock("s").unwrap(), Duration::from_secs(10)).await;
        let fence = guard.fence();
        for (i, node) in n.iter().enumerate() {
            let Some(was) = before[i] else { continue };
            let mut c = node.connection().await;
            let now: Option<u64> = c.hget(&state_key, "n").await.unwrap_or(None);
            if now == Some(fence) && was + 1 < fence {
                write_backs += 1;
            }
        }
        let section = history.enter(format!("h{step}"), fence);
        let waiting = tokio::spawn({
            let lock = contender.lock("s").unwrap();
            async move { acquire(&lock, Duration::from_secs(10)).await }
        });
        let mut second = None;
        if long {
            if let (true, Some((d, _))) = (std::ptr::eq(holder, &renewing), down) {
                // A second master fails mid-hold: no quorum renews the lease, it runs out.
                let j = (d + 1 + rng.usize(0..2)) % 3;
                n[j].pause().await;
                second = Some(j);
            }
            tokio::time::sleep(ms(lease + 150)).await;
        } else {
            tokio::time::sleep(ms(20)).await;
        }
        if !guard.is_held() {
            losses += 1;
        }
        let proven = testkit::instant_ns(guard.lease().valid_until());
        section.leave_at(testkit::now_ns().min(proven));
        let _ = guard.release().await;
        if let Some(j) = second {
            n[j].resume().await;
        }
        let next = tokio::time::timeout(Duration::from_secs(15), waiting)
            .await
            .unwrap_or_else(|_| failed(format!("step {step}: the contender never got the lock")))
            .unwrap();
        let s = history.enter(format!("c{step}"), next.fence());
        tokio::time::sleep(ms(5)).await;
        s.leave();
        let _ = next.release().await;
    }
    if let Some((i, frozen)) = down {
        if frozen {
            n[i].resume().await
        } else {
            n[i].restart().await
        }
    }
    if let Err(e) = testkit::check(&history.sections()) {
        failed(e);
    }
    eprintln!(
        "seed {seed}: {write_backs} write-backs raised a lagging quorum member; {losses} leases outlived"
    );
    if losses == 0 {
        failed("no hold outlived its lease".into());
    }
    if write_backs == 0 {
        failed("the schedule never reached the fence write-back case".into());
    }
}

// ---------------------------------------------------------------------------------------------
// The fence write-back, and when it can be skipped. A holder's fence must be recorded (the
// node's counter at the fence or above) on a quorum of nodes while it holds the lock there, so
// that every later quorum meets one such node and draws a larger fence. Nodes that drew the
// largest counter record it by their own acquisition; only when fewer than a quorum did must
// the fence be written back before the lock is used.

/// A client whose node timeout (400 ms) leaves a loaded machine's local servers ample time, so
/// that the exact fences these tests expect are not shifted by a retried attempt.
async fn patient(n: &[RedisServer], prefix: &str) -> LockClient {
    redlock_with(n, prefix, config(5_000), ms(400)).await
}

/// The fencing counter of `state_key` on each node (`None`: unreachable; 0: no counter).
async fn counters(n: &[RedisServer], state_key: &str) -> Vec<Option<u64>> {
    let mut out = Vec::new();
    for node in n {
        let read = async {
            let mut c = node
                .client()
                .get_multiplexed_async_connection()
                .await
                .ok()?;
            let v: Option<u64> = c.hget(state_key, "n").await.ok()?;
            Some(v.unwrap_or(0))
        };
        out.push(tokio::time::timeout(ms(300), read).await.ok().flatten());
    }
    out
}

async fn set_counter(node: &RedisServer, state_key: &str, value: u64) {
    let mut c = node.connection().await;
    let _: () = c.hset(state_key, "n", value).await.unwrap();
}

/// How many nodes hold a counter at `fence` or above.
fn recorded(counters: &[Option<u64>], fence: u64) -> usize {
    counters
        .iter()
        .filter(|c| c.is_some_and(|c| c >= fence))
        .count()
}

/// What MONITOR shows of a call of `script`: `FCALL` of the function `distlock_<hash>_<script>`
/// (the test servers have functions). (`_acquire` also names `_reentrant_acquire`: the tests
/// watching for it take no reentrant lock.)
fn call_of(script: &str) -> String {
    format!("_{script}")
}

/// Counts, with MONITOR, the commands naming `needle` that a node receives (commands run inside
/// scripts excluded) until [`Watch::count`].
struct Watch {
    seen: Arc<std::sync::atomic::AtomicUsize>,
    ended: Arc<std::sync::atomic::AtomicBool>,
    end: String,
    task: tokio::task::JoinHandle<()>,
}

async fn watch_for(node: &RedisServer, needle: String) -> Watch {
    use futures_util::StreamExt;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let monitor = node.client().get_async_monitor().await.unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicBool::new(false));
    let end = format!("end-of-watch-{}", testkit::unique_prefix("w"));
    let task = tokio::spawn({
        let (seen, ended, needle, end) = (seen.clone(), ended.clone(), needle.clone(), end.clone());
        async move {
            let mut stream = monitor.into_on_message::<String>();
            while let Some(line) = stream.next().await {
                if line.contains(&end) {
                    ended.store(true, Ordering::Release);
                } else if line.contains(&needle) && !line.contains(" lua]") {
                    seen.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    // MONITOR is on once a command shows up in it.
    let mut c = node.connection().await;
    let _: () = redis::cmd("ECHO")
        .arg(&needle)
        .query_async(&mut c)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while seen.load(Ordering::Relaxed) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "MONITOR never showed the first command"
        );
        tokio::time::sleep(ms(10)).await;
    }
    Watch {
        seen,
        ended,
        end,
        task,
    }
}

impl Watch {
    /// The commands seen so far on `node` (the one watched): MONITOR shows commands in the order
    /// the server ran them, so once a marker sent now shows up, every earlier one has.
    async fn count(self, node: &RedisServer) -> usize {
        use std::sync::atomic::Ordering;
        let mut c = node.connection().await;
        let _: () = redis::cmd("ECHO")
            .arg(&self.end)
            .query_async(&mut c)
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !self.ended.load(Ordering::Acquire) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "MONITOR never showed the end marker"
            );
            tokio::time::sleep(ms(10)).await;
        }
        self.task.abort();
        // Less the ECHO that showed MONITOR was on.
        self.seen.load(Ordering::Relaxed) - 1
    }
}

/// Nodes whose counters agree (the normal case: every acquisition reaches every node) need no
/// write-back: the acquisition is one round, and no `fence_sync` is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agreeing_quorum_takes_the_lock_in_one_round() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-agree");
    let client = patient(&n, &prefix).await;
    let lock = client.lock("k").unwrap();
    let mut watches = Vec::new();
    for node in &n {
        // The acquisitions are watched too: they show the watch sees the calls it counts.
        watches.push((
            watch_for(node, call_of("fence_sync")).await,
            watch_for(node, call_of("acquire")).await,
        ));
    }
    let mut last = 0;
    for _ in 0..5 {
        let guard = try_acquire(&lock).await.unwrap();
        assert!(guard.fence() > last, "{} after {last}", guard.fence());
        last = guard.fence();
        let counters = counters(&n, lock.name().state_key()).await;
        assert_eq!(counters, vec![Some(last); 3], "every node drew the fence");
        assert!(guard.release().await.unwrap());
    }
    let (mut sent, mut acquisitions) = (Vec::new(), Vec::new());
    for ((fence_sync, acquire), node) in watches.into_iter().zip(&n) {
        sent.push(fence_sync.count(node).await);
        acquisitions.push(acquire.count(node).await);
    }
    assert_eq!(acquisitions, vec![5; 3], "the watch sees every acquisition");
    assert_eq!(
        sent,
        vec![0; 3],
        "fence_sync sent although every node drew the same fence"
    );
}

/// A quorum that agrees while a third node lags (it missed acquisitions): the fence is the
/// quorum's, with no write-back round; the lagging node is raised to it in the background
/// while the lock is held, so that it does not stay behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_node_is_raised_in_the_background() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-lagging");
    let client = patient(&n, &prefix).await;
    let lock = client.lock("k").unwrap();
    let state = lock.name().state_key().to_owned();
    set_counter(&n[0], &state, 50).await;
    set_counter(&n[1], &state, 50).await;
    set_counter(&n[2], &state, 10).await;
    let guard = try_acquire(&lock).await.unwrap();
    assert_eq!(guard.fence(), 51, "the largest counter of the quorum, + 1");
    let mut raised = false;
    for _ in 0..100 {
        if counters(&n, &state).await == vec![Some(51); 3] {
            raised = true;
            break;
        }
        tokio::time::sleep(ms(20)).await;
    }
    assert!(
        raised,
        "the lagging node was not raised to the fence while the lock was held: {:?}",
        counters(&n, &state).await
    );
    assert!(guard.release().await.unwrap());
    // With the two nodes that drew 51 down in turn, the fence still grows.
    let mut last = 51;
    for down in &n[..2] {
        down.stop().await;
        let guard = acquire(&lock, Duration::from_secs(10)).await;
        assert!(guard.fence() > last, "{} after {last}", guard.fence());
        last = guard.fence();
        let _ = guard.release().await;
        down.restart().await;
    }
}

/// The quorum disagrees and fewer than a quorum drew the fence: it is written back to the
/// others before the lock is used, so that a later quorum without the node that drew it still
/// draws a larger one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disagreeing_quorum_writes_the_fence_back_before_the_lock_is_used() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-disagree");
    let client = patient(&n, &prefix).await;
    let lock = client.lock("k").unwrap();
    let state = lock.name().state_key().to_owned();
    set_counter(&n[0], &state, 5).await;
    set_counter(&n[1], &state, 100).await;
    set_counter(&n[2], &state, 5).await;
    let guard = try_acquire(&lock).await.unwrap();
    assert_eq!(guard.fence(), 101);
    // Read at once, before anything in the background could have run: the write-back is part
    // of the acquisition.
    let now = counters(&n, &state).await;
    assert!(
        recorded(&now, 101) >= 2,
        "the fence is recorded on fewer than a quorum while the lock is held: {now:?}"
    );
    assert!(guard.release().await.unwrap());
    n[1].stop().await;
    let guard = acquire(&lock, Duration::from_secs(10)).await;
    assert!(
        guard.fence() > 101,
        "without the node that drew 101, the next fence is {}",
        guard.fence()
    );
    assert!(guard.release().await.unwrap());
}

/// A node that is frozen during the acquisition misses the write-back; the quorum's other node
/// got it, so a later quorum of the lagging node and that one draws a larger fence, and the
/// lagging node is brought up to it then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_missed_the_write_back_is_covered_by_the_quorum() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-missed");
    let client = patient(&n, &prefix).await;
    let lock = client.lock("k").unwrap();
    let state = lock.name().state_key().to_owned();
    set_counter(&n[0], &state, 100).await;
    set_counter(&n[1], &state, 5).await;
    set_counter(&n[2], &state, 5).await;
    n[2].pause().await;
    let first = try_acquire(&lock).await.unwrap();
    assert_eq!(first.fence(), 101);
    let now = counters(&n[..2], &state).await;
    assert_eq!(
        now,
        vec![Some(101), Some(101)],
        "the fence was not written back to the other quorum member"
    );
    assert!(first.release().await.unwrap());
    n[2].resume().await;
    n[0].stop().await;
    let second = acquire(&lock, Duration::from_secs(10)).await;
    assert!(
        second.fence() > 101,
        "a quorum of the node that missed the write-back and one that got it drew {}",
        second.fence()
    );
    let now = counters(&n[1..], &state).await;
    assert!(
        recorded(&now, second.fence()) == 2,
        "the lagging node was not brought up to the fence: {now:?}"
    );
    assert!(second.release().await.unwrap());
}

/// A node restarted empty (its counter gone) lags behind by the whole count. With one node
/// restarted empty at a time, while the others keep theirs, every majority includes a node that
/// recorded the last fence, and the restarted one is brought up to it (written back when the
/// quorum is that node and one other): fences never go back. (Two nodes losing their data in
/// turn before the lagging one is raised can: the crate docs say so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_restarted_empty_at_a_time_never_takes_a_fence_back() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-empty");
    let client = patient(&n, &prefix).await;
    let lock = client.lock("k").unwrap();
    let mut last = 0;
    for _ in 0..5 {
        let guard = try_acquire(&lock).await.unwrap();
        last = guard.fence();
        assert!(guard.release().await.unwrap());
    }
    n[0].restart().await;
    // Every majority in turn: {0, 1, 2}, then {0, 2}, {0, 1}, {1, 2}.
    for down in [None, Some(1), Some(2), Some(0)] {
        if let Some(d) = down {
            n[d].stop().await;
        }
        let guard = acquire(&lock, Duration::from_secs(10)).await;
        assert!(
            guard.fence() > last,
            "fence {} after {last} (node 0 restarted empty; down: {down:?})",
            guard.fence()
        );
        last = guard.fence();
        assert!(guard.release().await.unwrap());
        if let Some(d) = down {
            // Restarted empty as well (no lock is held on it).
            n[d].restart().await;
        }
    }
}

/// A background raise is sent after the acquisition returned, so it can land late: after the
/// lock was released and taken again, by someone else or by the same reentrant owner with a
/// newer fence. It must then change nothing that matters: it raises no counter for a lock that
/// is not ours, and it never lowers the fence a reentrant hold records (re-entries return it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_background_raise_never_lowers_a_fence() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-late-raise");
    let client = patient(&n, &prefix).await;
    let fence_sync =
        redis::Script::new(include_str!("../src/backend/redis/scripts/fence_sync.lua"));

    // Reentrant: the owner's first hold has fence 51 (node 2 lagging), its next one 52.
    let me = distlock::OwnerId::new("rl-late-raise-owner").unwrap();
    let lock = client.reentrant("r", &me).unwrap();
    let (key, state) = (
        lock.name().lock_key().to_owned(),
        lock.name().state_key().to_owned(),
    );
    set_counter(&n[0], &state, 50).await;
    set_counter(&n[1], &state, 50).await;
    set_counter(&n[2], &state, 10).await;
    let first = try_acquire(&lock).await.unwrap();
    assert_eq!(first.fence(), 51);
    assert!(first.release().await.unwrap());
    let second = try_acquire(&lock).await.unwrap();
    assert!(second.fence() > 51, "{}", second.fence());
    // Node 2 lagged for both holds: wait until the second hold's own raise reached it.
    let mut c = n[2].connection().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let f: Option<u64> = c.hget(&key, "f").await.unwrap();
        if f == Some(second.fence()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node 2 never recorded the second hold's fence: {f:?}"
        );
        tokio::time::sleep(ms(10)).await;
    }
    let recorded = second.fence();
    // The first hold's raise, landing now: the lock there is the same owner's.
    let mine: i64 = fence_sync
        .key(&key)
        .key(&state)
        .arg(me.as_str())
        .arg(51)
        .arg("r")
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(mine, 1);
    let after: u64 = c.hget(&key, "f").await.unwrap();
    assert_eq!(after, recorded, "a late raise lowered the hold's fence");
    let again = try_acquire(&lock).await.unwrap();
    assert_eq!(
        again.fence(),
        second.fence(),
        "a re-entry returns the hold's fence"
    );
    assert!(again.release().await.unwrap());
    assert!(second.release().await.unwrap());

    // Exclusive: the lock is someone else's by the time the raise lands: nothing changes.
    let lock = client.lock("x").unwrap();
    let (key, state) = (
        lock.name().lock_key().to_owned(),
        lock.name().state_key().to_owned(),
    );
    let guard = try_acquire(&lock).await.unwrap();
    let before: u64 = c.hget(&state, "n").await.unwrap();
    let theirs: i64 = fence_sync
        .key(&key)
        .key(&state)
        .arg("a token of a released hold")
        .arg(before + 100)
        .arg("x")
        .invoke_async(&mut c)
        .await
        .unwrap();
    assert_eq!(theirs, 0, "the lock there is not the raise's");
    let now: u64 = c.hget(&state, "n").await.unwrap();
    assert_eq!(
        now, before,
        "a raise for a lock that is not ours changed the counter"
    );
    assert!(guard.release().await.unwrap());
}

/// `key` held on `nodes` by another owner for `px_ms`.
async fn held_elsewhere(nodes: &[RedisServer], key: &str, px_ms: u64) {
    for node in nodes {
        let mut c = node.connection().await;
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("someone-else")
            .arg("PX")
            .arg(px_ms)
            .query_async(&mut c)
            .await
            .unwrap();
    }
}

/// A split vote is rolled back on the nodes it won, and the rollback announces the attempt's
/// token as released. The attempt that later wins must hold the lock under a token of its own:
/// under the same one, its release would look like that old announcement heard again and wake
/// none of this client's waiters (which, without polling, would sleep until the lease's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_split_vote_still_wakes_the_next_waiter() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-split-wake");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .polling(false)
        .build()
        .unwrap();
    let client = redlock_with(&n, &prefix, config, ms(500)).await;
    let lock = client.lock("k").unwrap();
    let key = lock.name().lock_key().to_owned();
    // Two nodes held briefly by someone else: the first attempt wins one node of three.
    held_elsewhere(&n[..2], &key, 400).await;
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        lock.acquire(Duration::from_secs(5)),
    )
    .await
    .expect("the lock is taken once the other holder's keys expire")
    .unwrap();
    let waiter = tokio::spawn({
        let lock = lock.clone();
        async move { lock.acquire(Duration::from_secs(25)).await }
    });
    // The waiter tried, found the lock held for 30 s, and sleeps until woken.
    tokio::time::sleep(ms(300)).await;
    assert!(!waiter.is_finished());
    assert!(first.release().await.unwrap());
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter still waits 5 s after the release")
        .unwrap()
        .unwrap();
    assert!(next.release().await.unwrap());
}

/// A waiter whose attempts win a minority (the holder has two nodes of three, the third is
/// free) rolls each attempt back, and the rollback announces the attempt's token on that node:
/// the waiter must not take its own announcement for a release (before: it did, and attempted
/// again at once, hundreds of attempts and rollbacks a second for the whole hold, polling off);
/// nor may waiters of other clients, woken by each other's rollbacks, run faster than a backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_do_not_make_waiters_spin() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-no-spin");
    let config = LockConfig::builder()
        .lease(Duration::from_secs(30))
        .polling(false)
        .build()
        .unwrap();
    let a = redlock_with(&n, &prefix, config.clone(), ms(500)).await;
    let b = redlock_with(&n, &prefix, config, ms(500)).await;
    let key = a.lock("k").unwrap().name().lock_key().to_owned();
    // Held by someone else on two nodes for 3 s; the third is free.
    held_elsewhere(&n[..2], &key, 3_000).await;
    let before = n[2].script_calls().await;
    let waiters: Vec<_> = [a, b]
        .into_iter()
        .map(|client| {
            tokio::spawn(async move {
                let guard = client
                    .lock("k")
                    .unwrap()
                    .acquire(Duration::from_secs(20))
                    .await;
                if let Ok(guard) = guard {
                    let _ = guard.release().await;
                }
            })
        })
        .collect();
    tokio::time::sleep(ms(2_000)).await;
    let calls = n[2].script_calls().await - before;
    // Each attempt is one script call on the free node (and its rollback another): with a
    // growing backoff between the attempts a rollback woke, a few dozen calls in all (60 to 70
    // measured; 11,041 before).
    assert!(calls <= 300, "{calls} script calls on the free node in 2 s");
    for w in waiters {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("both take the lock in turn once the holder's keys expire")
            .unwrap();
    }
}

/// Every call of the large-record tests has this deadline.
const LARGE_DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LARGE_DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("waited {LARGE_DEADLINE:?} for: {what}"))
}

/// The masters, each behind a proxy that carries `rate` bytes a second each way.
async fn slow_links(n: &[RedisServer], rate: u64) -> Vec<testkit::FaultProxy> {
    let mut proxies = Vec::new();
    for node in n {
        let proxy = testkit::FaultProxy::start(node).await;
        proxy.limit_bandwidth(rate);
        proxies.push(proxy);
    }
    proxies
}

async fn through(proxies: &[testkit::FaultProxy], prefix: &str) -> LockClient {
    let urls: Vec<String> = proxies.iter().map(testkit::FaultProxy::url).collect();
    let config = LockConfig::builder()
        .lease(ms(4_000))
        .op_timeout(ms(1_000))
        .build()
        .unwrap();
    let client = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .node_timeout(ms(70))
        .connect_redlock(&urls)
        .unwrap();
    within("prepare", client.prepare())
        .await
        .expect("every master answers through its proxy");
    client
}

fn large_record(len: u32) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// A record larger than the node timeout can carry is completed and read back whole. Each
/// master's link carries 32 MiB/s: the 4 MiB record takes about 125 ms to reach a master or
/// come back from one, well past the node timeout of 70 ms (before: the completion stored it
/// on every master and still returned `NoQuorum`, each master's answer coming after the node
/// timeout, retried until the lease was lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_record_is_completed_and_read_back_on_slow_links() {
    let n = nodes(3, false).await;
    let proxies = slow_links(&n, 32 << 20).await;
    let prefix = testkit::unique_prefix("rl-large");
    let client = through(&proxies, &prefix).await;
    let once = client.once("big").unwrap();
    let record = large_record(4 << 20);
    let distlock::Begin::Acquired(writer) = within("begin", once.begin("t")).await.unwrap() else {
        panic!("a fresh name is free")
    };
    within("complete", writer.complete(&record))
        .await
        .expect("a quorum stored the record");
    for node in &n {
        let mut c = node.connection().await;
        let (stored, len): (Vec<u8>, usize) = redis::cmd("HMGET")
            .arg(once.name().state_key())
            .arg("d")
            .arg("l")
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(stored == record, "the record on every master");
        assert_eq!(
            len,
            record.len(),
            "stored with its size, for begin to name it"
        );
    }
    let reader = through(&proxies, &prefix).await;
    match within("replay", reader.once("big").unwrap().begin("t"))
        .await
        .unwrap()
    {
        distlock::Begin::Done(r) => {
            let whole = r.whole().expect("a record written whole");
            assert!(whole[..] == record[..], "read back byte for byte");
        }
        other => panic!("{other:?}"),
    }
}

/// A large record stored on every master as an earlier version's completion left it (without
/// its size and digest) is replayed through links of 16 MiB/s, where the 2 MiB record takes
/// about 125 ms to come back from a master (before: every `begin` timed out on every master,
/// its answer carrying the record, for the whole retention).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_stored_record_is_replayed_on_slow_links() {
    let n = nodes(3, false).await;
    let proxies = slow_links(&n, 16 << 20).await;
    let prefix = testkit::unique_prefix("rl-large-stored");
    let client = through(&proxies, &prefix).await;
    let once = client.once("big").unwrap();
    let record = large_record(2 << 20);
    for node in &n {
        let mut c = node.connection().await;
        let () = redis::cmd("HSET")
            .arg(once.name().state_key())
            .arg("n")
            .arg(7)
            .arg("d")
            .arg(&record)
            .arg("c")
            .arg("the-writers-token")
            .query_async(&mut c)
            .await
            .unwrap();
    }
    for _ in 0..3 {
        match within("replay", once.begin("t")).await.unwrap() {
            distlock::Begin::Done(r) => {
                let whole = r.whole().expect("a record written whole");
                assert!(whole[..] == record[..], "read back byte for byte");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// On Redlock a record must reach every master within the timeouts: larger than
/// `max_record_len` (what the assumed slowest link, 10 MiB/s, carries in the command timeout
/// less two node timeouts) it is refused before anything is sent, and the guard, still holding
/// the lock, can store a smaller record in its place. Other stores take up to `MAX_PART_LEN`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_what_redlock_carries_is_refused_before_it_is_sent() {
    let n = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-too-large");
    let config = LockConfig::builder()
        .lease(ms(4_000))
        .op_timeout(ms(1_000))
        .build()
        .unwrap();
    let client = redlock_with(&n, &prefix, config, ms(70)).await;
    let max = client.max_record_len();
    assert_eq!(
        max,
        (0.86 * f64::from(10u32 << 20)) as usize,
        "860 ms at 10 MiB/s"
    );
    assert_eq!(
        LockClient::memory().max_record_len(),
        distlock::once::MAX_PART_LEN
    );
    let once = client.once("big").unwrap();
    let distlock::Begin::Acquired(mut writer) = within("begin", once.begin("t")).await.unwrap()
    else {
        panic!("a fresh name is free")
    };
    let before: Vec<u64> = {
        let mut calls = Vec::new();
        for node in &n {
            calls.push(node.script_calls().await);
        }
        calls
    };
    let record = vec![1u8; max + 1];
    match within("complete", writer.try_complete(&record)).await {
        Err(LockError::TooLarge {
            len, max: limit, ..
        }) => assert_eq!((len, limit), (max + 1, max)),
        other => panic!("{other:?}"),
    }
    for (node, before) in n.iter().zip(before) {
        assert_eq!(node.script_calls().await, before, "nothing sent");
    }
    assert!(writer.guard().is_held(), "the guard still holds the lock");
    within("complete", writer.complete_whole(b"too large to keep"))
        .await
        .unwrap();
    match within("replay", once.begin("t")).await.unwrap() {
        distlock::Begin::Done(r) => {
            assert_eq!(r.whole().map(|w| &w[..]), Some(&b"too large to keep"[..]))
        }
        other => panic!("{other:?}"),
    }
}

/// With `fence_ttl`, every master's fence counter expires, and the counters made again start
/// from the caller's clock (one start for every master, so they agree): the fence after the
/// expiry is above the fences given before (before: made again from 0, fence 1 again).
#[tokio::test]
async fn fences_keep_increasing_across_an_expired_counter() {
    let nodes = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-fence-ttl");
    let config = LockConfig::builder()
        .lease(ms(1_000))
        .op_timeout(ms(250))
        .fence_ttl(ms(1_200))
        .build()
        .unwrap();
    let client = redlock(&nodes, &prefix, config).await;
    let lock = client.lock("job").unwrap();
    let state = lock.name().state_key().to_owned();
    let guard = try_acquire(&lock).await.unwrap();
    let first = guard.fence();
    assert!(guard.release().await.unwrap());
    let mut conns = Vec::new();
    for node in &nodes {
        let mut conn = node.connection().await;
        let pttl: i64 = redis::AsyncCommands::pttl(&mut conn, &state).await.unwrap();
        assert!(
            pttl > 0 && pttl <= 1_200,
            "every master's counter expires with fence_ttl: {pttl}"
        );
        conns.push(conn);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for conn in &mut conns {
        loop {
            let exists: bool = redis::AsyncCommands::exists(conn, &state).await.unwrap();
            if !exists {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{state} still on a master after 10 s"
            );
            tokio::time::sleep(ms(20)).await;
        }
    }
    let guard = try_acquire(&lock).await.unwrap();
    assert!(
        guard.fence() > first,
        "the fence after the counters expired ({}) is above the one before ({first})",
        guard.fence()
    );
    assert!(guard.release().await.unwrap());
}

/// Every master of one attempt gets the same counter start: the fences of a new record (and
/// of a counter made again after it expired) agree on every master, and the lock is used
/// without a second round (before: each master's start was read from the clock when its call
/// was made, microseconds apart; the fences differed, and the largest was written back to the
/// others before use: a `fence_sync` call on two masters for every new record).
#[tokio::test]
async fn a_new_counter_agrees_on_every_master_without_a_second_round() {
    let nodes = nodes(3, false).await;
    let prefix = testkit::unique_prefix("rl-start");
    let client = redlock(&nodes, &prefix, config(1_000)).await;
    for round in 0..5 {
        let mut before = Vec::new();
        for node in &nodes {
            before.push(node.script_calls().await);
        }
        let once = client.once(&format!("fresh-{round}")).unwrap();
        let distlock::Begin::Acquired(guard) = once.begin("t").await.unwrap() else {
            panic!("a new name is taken");
        };
        for (node, before) in nodes.iter().zip(&before) {
            assert_eq!(
                node.script_calls().await - before,
                1,
                "round {round}: one call per master (the begin), no fence written back"
            );
        }
        guard.complete(b"done").await.unwrap();
    }
}
