//! One behavioural suite, run against the in-memory store and against a real Redis: the two
//! must be interchangeable.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Begin, LockClient, LockConfig, LockError, LossReason, OwnerId};
use testkit::{History, RedisServer};

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Builds clients on one store. Holds the Redis server (if any) for the test's duration.
struct Store {
    _server: Option<RedisServer>,
    url: Option<String>,
    memory: Option<LockClient>,
    prefix: String,
}

impl Store {
    async fn memory() -> Self {
        Store {
            _server: None,
            url: None,
            memory: Some(LockClient::memory()),
            prefix: "m".into(),
        }
    }

    async fn redis(test: &str) -> Self {
        let server = RedisServer::start().await;
        Store {
            url: Some(server.url()),
            _server: Some(server),
            memory: None,
            prefix: testkit::unique_prefix(test),
        }
    }

    /// A client with `config` on this store (memory clients of one store share their state).
    async fn client(&self, config: LockConfig) -> LockClient {
        match (&self.url, &self.memory) {
            (Some(url), _) => {
                let c = LockClient::builder()
                    .config(config)
                    .prefix(&self.prefix)
                    .unwrap()
                    .connect(url)
                    .unwrap();
                c.prepare().await.unwrap();
                c
            }
            (None, Some(shared)) => shared.with_config(config).unwrap(),
            _ => unreachable!(),
        }
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
    assert!(matches!(once.begin("t4").await.unwrap(), Begin::Done(r) if &r[..] == b"rec"));
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
    assert!(matches!(once.begin("").await.unwrap(), Begin::Done(r) if &r[..] == b"fast"));
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
