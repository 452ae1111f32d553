//! Crash test through real processes: two instances of the webhook example share a store and a
//! Postgres ledger; a sender delivers events as Stripe does (each attempt signed and serialised
//! afresh, retried until answered 2xx); meanwhile instances are killed with SIGKILL at random
//! moments and restarted. On the Postgres store in same-transaction mode every event is applied
//! exactly once, and every delivery's final answer names the one execution that booked it. The
//! same run on Redis (ledger entries commit on their own) reports how many events it applied
//! twice: the figure this store's guarantee removes.
//!
//! The instances are this test binary run again as a child process (`serve_an_instance`), so
//! that nothing else needs building.

mod support;

#[path = "../examples/shared/webhook.rs"]
#[allow(dead_code)]
mod webhook_app;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use distlock::{LockClient, LockConfig};
use tokio::process::{Child, Command};
use tower_idempotency::Store;

const WEBHOOK_SECRET: &[u8] = b"whsec_crash";
const EVENTS: usize = 60;

/// Events delivered at once.
const AT_ONCE: usize = 6;

/// What an instance runs on, passed to the child in its environment.
#[derive(Clone)]
struct Spec {
    database: String,
    ledger: String,
    /// `postgres:<table>` or `redis:<url>:<prefix>`.
    store: String,
}

/// The child: serves one instance until killed (run only by the crash tests, with
/// `CRASH_INSTANCE` set).
#[test]
#[ignore = "a child process of the crash tests below, which run it with --ignored"]
fn serve_an_instance() {
    let (Ok(bind), Ok(database), Ok(ledger), Ok(store)) = (
        std::env::var("CRASH_INSTANCE"),
        std::env::var("CRASH_DATABASE"),
        std::env::var("CRASH_LEDGER"),
        std::env::var("CRASH_STORE"),
    ) else {
        panic!("run by the crash tests, which set CRASH_INSTANCE and the rest");
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        // A short lease: a killed instance's events are taken over within a second.
        let config = LockConfig::builder()
            .lease(Duration::from_millis(1000))
            .build()
            .unwrap();
        let store = match store.split_once(':') {
            Some(("postgres", table)) => Store::from_client(
                LockClient::builder()
                    .config(config)
                    .connect_postgres(&database, table)
                    .unwrap(),
            ),
            Some(("redis", rest)) => {
                let (url, prefix) = rest.rsplit_once('|').unwrap();
                Store::from_client(
                    LockClient::builder()
                        .config(config)
                        .prefix(prefix)
                        .unwrap()
                        .connect(url)
                        .unwrap(),
                )
            }
            _ => panic!("CRASH_STORE={store}"),
        };
        store.prepare().await.unwrap();
        let ledger = webhook_app::Ledger::postgres(&database, &ledger, Duration::from_millis(200))
            .await
            .unwrap();
        let app = webhook_app::app(store, support::SECRET, WEBHOOK_SECRET, ledger).unwrap();
        let listener = tokio::net::TcpListener::bind(&bind).await.unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}

/// Starts an instance on `addr`, waiting (with a deadline) until it accepts connections.
async fn start(spec: &Spec, addr: SocketAddr) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "serve_an_instance", "--nocapture"])
        .env("CRASH_INSTANCE", addr.to_string())
        .env("CRASH_DATABASE", &spec.database)
        .env("CRASH_LEDGER", &spec.ledger)
        .env("CRASH_STORE", &spec.store)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the instance on {addr} exited at start"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the instance on {addr} never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// One delivery attempt of event `i`, serialised and signed afresh.
fn delivery(i: usize, attempt: usize) -> Request<Body> {
    let body = format!(
        r#"{{"id":"evt_{i}","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_{i}","amount":{}}}}},"pending_webhooks":{attempt}}}"#,
        100 + i
    );
    Request::post("/webhooks/stripe")
        .header("content-type", "application/json")
        .header(
            "stripe-signature",
            webhook_app::sign(WEBHOOK_SECRET, unix_now(), body.as_bytes()),
        )
        .body(Body::from(body))
        .unwrap()
}

/// What a run found.
struct Report {
    /// Ledger entries per event.
    applied: HashMap<String, Vec<Option<u64>>>,
    /// The fence each event's final 2xx answer names.
    answered: HashMap<String, Option<u64>>,
    kills: usize,
    attempts: usize,
}

async fn run(spec: Spec) -> Report {
    let addrs: Vec<SocketAddr> = (0..2)
        .map(|_| SocketAddr::from(([127, 0, 0, 1], testkit::free_port().unwrap())))
        .collect();
    let mut children = Vec::new();
    for addr in &addrs {
        children.push(start(&spec, *addr).await);
    }
    let children = Arc::new(tokio::sync::Mutex::new(children));
    let done = Arc::new(AtomicBool::new(false));
    // Chaos: kill a random instance with SIGKILL every 150 to 400 ms, restart it at once.
    let chaos = tokio::spawn({
        let (children, done, spec, addrs) =
            (children.clone(), done.clone(), spec.clone(), addrs.clone());
        async move {
            let mut kills = 0;
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(150..400))).await;
                let i = fastrand::usize(0..addrs.len());
                let mut children = children.lock().await;
                let _ = children[i].start_kill();
                let _ = children[i].wait().await;
                kills += 1;
                children[i] = start(&spec, addrs[i]).await;
            }
            kills
        }
    });
    // The sender: every event until answered 2xx, each attempt to a random instance, with a
    // short timeout (as a provider's, shorter than the work at times).
    let client = support::client();
    let attempts = Arc::new(AtomicUsize::new(0));
    let at_once = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let mut senders = Vec::new();
    for i in 0..EVENTS {
        let (client, addrs, attempts) = (client.clone(), addrs.clone(), attempts.clone());
        let at_once = at_once.clone();
        senders.push(tokio::spawn(async move {
            let _turn = at_once.acquire().await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            for attempt in 0.. {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "evt_{i} never answered 2xx"
                );
                attempts.fetch_add(1, Ordering::SeqCst);
                let addr = addrs[fastrand::usize(0..addrs.len())];
                let mut request = delivery(i, attempt);
                *request.uri_mut() = format!("http://{addr}/webhooks/stripe").parse().unwrap();
                let sent =
                    tokio::time::timeout(Duration::from_millis(700), client.request(request));
                if let Ok(Ok(response)) = sent.await
                    && response.status() == StatusCode::OK
                    && let Ok(body) = http_body_util::BodyExt::collect(response.into_body()).await
                {
                    let answer: serde_json::Value =
                        serde_json::from_slice(&body.to_bytes()).unwrap();
                    return (format!("evt_{i}"), answer["fence"].as_u64());
                }
                tokio::time::sleep(Duration::from_millis(fastrand::u64(20..120))).await;
            }
            unreachable!()
        }));
    }
    let mut answered = HashMap::new();
    for s in senders {
        let (event, fence) = s.await.unwrap();
        answered.insert(event, fence);
    }
    done.store(true, Ordering::SeqCst);
    let kills = chaos.await.unwrap();
    // The instances are gone; what they left is in the ledger.
    for child in children.lock().await.iter_mut() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    let ledger = webhook_app::Ledger::postgres(&spec.database, &spec.ledger, Duration::ZERO)
        .await
        .unwrap();
    let mut applied: HashMap<String, Vec<Option<u64>>> = HashMap::new();
    for entry in ledger.entries().await {
        applied.entry(entry.event).or_default().push(entry.fence);
    }
    Report {
        applied,
        answered,
        kills,
        attempts: attempts.load(Ordering::SeqCst),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_every_event_is_applied_once_through_sigkills() {
    let server = testkit::PostgresServer::shared().await;
    let table = testkit::unique_table("crash_pg");
    let report = run(Spec {
        database: server.url(),
        ledger: format!("{table}_ledger"),
        store: format!("postgres:{table}"),
    })
    .await;
    assert!(
        report.kills >= 3,
        "instances were killed during the run: {}",
        report.kills
    );
    for i in 0..EVENTS {
        let event = format!("evt_{i}");
        let entries = &report.applied[&event];
        assert_eq!(
            entries.len(),
            1,
            "{event} applied {} times: {entries:?}",
            entries.len()
        );
        assert_eq!(
            report.answered[&event], entries[0],
            "{event}: the final answer names the execution that booked it"
        );
    }
    eprintln!(
        "postgres: {EVENTS} events, {} attempts, {} instances killed, 0 applied twice",
        report.attempts, report.kills
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_same_run_reports_events_applied_twice() {
    let server = testkit::PostgresServer::shared().await;
    let redis = testkit::RedisServer::start().await;
    let table = testkit::unique_table("crash_redis");
    let report = run(Spec {
        database: server.url(),
        ledger: format!("{table}_ledger"),
        store: format!("redis:{}|{}", redis.url(), testkit::unique_prefix("crash")),
    })
    .await;
    assert!(
        report.kills >= 3,
        "instances were killed during the run: {}",
        report.kills
    );
    let twice = (0..EVENTS)
        .filter(|i| report.applied[&format!("evt_{i}")].len() > 1)
        .count();
    assert!(
        (0..EVENTS).all(|i| !report.applied[&format!("evt_{i}")].is_empty()),
        "every event applied at least once"
    );
    // A figure, not a failure: what the Postgres store's guarantee removes.
    eprintln!(
        "redis: {EVENTS} events, {} attempts, {} instances killed, {twice} applied twice",
        report.attempts, report.kills
    );
}
