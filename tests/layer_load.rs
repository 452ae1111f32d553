//! The layer under load with Redis faults injected mid-run: two instances of the webhook
//! example share one Redis (and one ledger, as they would share a database); client tasks
//! deliver every payment event several times, partly in concurrent bursts, partly later, and
//! one delivery of every burst hangs up at a random moment (often while the handler runs,
//! after it booked the payment); Redis connections are killed, Redis is slowed and frozen
//! (shorter than the lease, so it keeps its data). Every response must be a success, a replay
//! or a documented rejection, and in the end every event must be in the ledger exactly once.
//!
//! `SOAK=1` delivers ten times as many events.

mod support;

#[path = "../examples/shared/webhook.rs"]
#[allow(dead_code)]
mod webhook_app;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use distlock::{LockClient, LockConfig};
use support::{Client, client, http, serve};
use testkit::RedisServer;
use tower_idempotency::Store;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

const WEBHOOK_SECRET: &[u8] = b"whsec_load";

/// A signed Stripe delivery of event `event`; `attempt` changes what the sender serialises
/// afresh for each attempt.
fn delivery(event: usize, attempt: usize) -> Request<Body> {
    let body = format!(
        r#"{{"id":"evt_{event}","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_{event}","amount":{}}}}},"pending_webhooks":{attempt}}}"#,
        100 + event
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    Request::post("/webhooks/stripe")
        .header("content-type", "application/json")
        .header(
            "stripe-signature",
            webhook_app::sign(WEBHOOK_SECRET, now, body.as_bytes()),
        )
        .body(Body::from(body))
        .unwrap()
}

async fn store(server: &RedisServer, prefix: &str) -> Store {
    let config = LockConfig::builder()
        .lease(Duration::from_secs(2))
        .build()
        .unwrap();
    let c = LockClient::builder()
        .config(config)
        .prefix(prefix)
        .unwrap()
        .connect(&server.url())
        .unwrap();
    c.prepare().await.unwrap();
    Store::from_client(c)
}

/// Writes a delivery on a raw connection and hangs up after `after` (a provider that timed out).
async fn hang_up(addr: std::net::SocketAddr, event: usize, attempt: usize, after: Duration) {
    use tokio::io::AsyncWriteExt;
    let (parts, body) = delivery(event, attempt).into_parts();
    let body = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .to_bytes();
    let mut head = format!(
        "POST /webhooks/stripe HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in &parts.headers {
        head.push_str(&format!("{name}: {}\r\n", value.to_str().unwrap()));
    }
    head.push_str("\r\n");
    let Ok(mut socket) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let _ = socket.write_all(head.as_bytes()).await;
    let _ = socket.write_all(&body).await;
    tokio::time::sleep(after).await;
}

/// Delivers once; panics on an answer that is neither a success, a replay nor a documented
/// rejection. Returns the status.
async fn deliver(
    client: &Client,
    addr: std::net::SocketAddr,
    event: usize,
    attempt: usize,
) -> StatusCode {
    let reply = http(client, addr, delivery(event, attempt)).await;
    match reply.status {
        StatusCode::OK => {}
        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
            // Only the layer's documented rejections: the handler's own 409 ("stale fencing
            // token") would mean a second execution.
            assert_eq!(
                reply.headers["content-type"], "application/problem+json",
                "{reply:?}"
            );
        }
        other => panic!("undocumented answer {other}: {reply:?}"),
    }
    reply.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_under_faults_are_applied_exactly_once() {
    let soak = std::env::var("SOAK").is_ok_and(|v| v == "1");
    let events = if soak { 1500 } else { 150 };
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("load");
    let ledger = webhook_app::Ledger::with_work(ms(3));
    let (addr_a, _a) = serve(
        webhook_app::app(
            store(&server, &prefix).await,
            support::SECRET,
            WEBHOOK_SECRET,
            ledger.clone(),
        )
        .unwrap(),
    )
    .await;
    let (addr_b, _b) = serve(
        webhook_app::app(
            store(&server, &prefix).await,
            support::SECRET,
            WEBHOOK_SECRET,
            ledger.clone(),
        )
        .unwrap(),
    )
    .await;
    let addrs = [addr_a, addr_b];

    let stop = Arc::new(AtomicBool::new(false));
    let faults = tokio::spawn({
        let stop = stop.clone();
        let url = server.url();
        let pid = server.pid().unwrap();
        async move {
            let admin = redis::Client::open(url).unwrap();
            let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
            let mut admin = admin
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .unwrap();
            let mut injected = 0;
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(ms(150)).await;
                match injected % 3 {
                    0 => {
                        for kind in ["normal", "pubsub"] {
                            let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                                .arg("KILL")
                                .arg("TYPE")
                                .arg(kind)
                                .arg("SKIPME")
                                .arg("yes")
                                .query_async(&mut admin)
                                .await;
                        }
                    }
                    1 => {
                        let _: redis::RedisResult<()> = redis::cmd("DEBUG")
                            .arg("SLEEP")
                            .arg(0.3)
                            .query_async(&mut admin)
                            .await;
                    }
                    _ => {
                        let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
                        rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
                        tokio::time::sleep(ms(500)).await;
                        rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
                    }
                }
                injected += 1;
            }
            injected
        }
    });

    // Eight client tasks; each event is delivered 8 times: a burst of 4 at once to both
    // instances, then 4 more one by one, each attempt serialised afresh (as Stripe does) and
    // deduplicated by the event id.
    let http_client = client();
    let mut tasks = Vec::new();
    for worker in 0..8 {
        let http_client = http_client.clone();
        tasks.push(tokio::spawn(async move {
            let mut statuses: HashMap<StatusCode, usize> = HashMap::new();
            for event in (worker..events).step_by(8) {
                let burst: Vec<_> = (0..3)
                    .map(|i| {
                        let c = http_client.clone();
                        tokio::spawn(async move { deliver(&c, addrs[i % 2], event, i).await })
                    })
                    .collect();
                // The fourth of the burst gives up after 0 to 6 ms (the handler takes 3).
                hang_up(addrs[event % 2], event, 3, ms(fastrand::u64(0..6))).await;
                for b in burst {
                    *statuses.entry(b.await.unwrap()).or_default() += 1;
                }
                for i in 0..4 {
                    *statuses
                        .entry(deliver(&http_client, addrs[i % 2], event, 4 + i).await)
                        .or_default() += 1;
                }
            }
            statuses
        }));
    }
    let mut statuses: HashMap<StatusCode, usize> = HashMap::new();
    for t in tasks {
        for (k, v) in t.await.unwrap() {
            *statuses.entry(k).or_default() += v;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let injected = faults.await.unwrap();
    assert!(
        injected >= 3,
        "faults were injected during the run: {injected}"
    );
    assert_eq!(statuses.values().sum::<usize>(), events * 7);
    assert!(
        statuses.get(&StatusCode::OK).copied().unwrap_or(0) > events,
        "{statuses:?}"
    );

    // No event was applied twice while Redis kept its data.
    let mut applied: HashMap<String, usize> = HashMap::new();
    for entry in ledger.entries().await {
        *applied.entry(entry.event).or_default() += 1;
    }
    let doubled: Vec<_> = applied.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        doubled.is_empty(),
        "events applied more than once: {doubled:?}"
    );

    // Nothing is lost: with the faults over, one more delivery of each event succeeds (the
    // first time, or as a replay), and then every event is in the ledger once.
    for event in 0..events {
        let mut ok = false;
        for _ in 0..200 {
            if deliver(&http_client, addrs[event % 2], event, 9).await == StatusCode::OK {
                ok = true;
                break;
            }
            tokio::time::sleep(ms(50)).await;
        }
        assert!(ok, "evt_{event} never went through");
    }
    let entries = ledger.entries().await;
    assert_eq!(entries.len(), events, "every event applied exactly once");
    let expected: u64 = (0..events).map(|e| 100 + e as u64).sum();
    let paid: u64 = entries.iter().map(|e| e.amount).sum();
    assert_eq!(paid, expected, "nothing lost, nothing doubled");
    eprintln!("statuses: {statuses:?}, faults injected: {injected}");
}
