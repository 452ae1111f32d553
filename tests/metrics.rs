//! Every outcome is counted (feature `metrics`), including a completion refused because the
//! lease was lost, and store latency is recorded.
#![cfg(feature = "metrics")]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use axum::http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::{app, post_key, send};
use tower_idempotency::{OnConflict, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder in this test binary");

    let store = Store::memory();
    let (plain, probe) = app(&store, |b| b);
    assert_eq!(
        send(&plain, post_key("/things", "a", "{}")).await.status,
        StatusCode::CREATED
    ); // executed
    assert!(
        send(&plain, post_key("/things", "a", "{}"))
            .await
            .replayed()
    ); // replayed
    assert_eq!(
        send(&plain, post_key("/things", "a", "{\"x\":1}"))
            .await
            .status,
        StatusCode::UNPROCESSABLE_ENTITY
    ); // mismatch
    assert_eq!(
        send(&plain, post_key("/things", "", "{}")).await.status,
        StatusCode::BAD_REQUEST
    ); // rejected
    probe.close();
    let held = tokio::spawn({
        let plain = plain.clone();
        async move { send(&plain, post_key("/things", "b", "{}")).await }
    });
    probe.started(2).await;
    assert_eq!(
        send(&plain, post_key("/things", "b", "{}")).await.status,
        StatusCode::CONFLICT
    ); // conflict
    probe.open();
    held.await.unwrap();

    // A lease that runs out under a slow handler: the completion is refused and counted.
    let lock = distlock::LockConfig::builder()
        .lease(Duration::from_millis(100))
        .watchdog(false)
        .build()
        .unwrap();
    let (short, probe) = app(&store, |b| {
        b.lock_config(lock).on_conflict(OnConflict::Reject)
    });
    probe.close();
    let slow = tokio::spawn({
        let short = short.clone();
        async move { send(&short, post_key("/things", "slow", "{}")).await }
    });
    probe.started(1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Another attempt takes the expired lease, so the slow one's completion is refused.
    let second = tokio::spawn({
        let short = short.clone();
        async move { send(&short, post_key("/things", "slow", "{}")).await }
    });
    probe.started(2).await;
    probe.open();
    slow.await.unwrap();
    second.await.unwrap();

    // An unreachable store: store_error (fail closed) and fail_open.
    let port = testkit::free_port().unwrap();
    let down = Store::redis(&format!("redis://127.0.0.1:{port}/")).unwrap();
    let (closed, _) = app(&down, |b| b);
    assert_eq!(
        send(&closed, post_key("/things", "c", "{}")).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (open, _) = app(&down, |b| b.fail_open(true));
    assert_eq!(
        send(&open, post_key("/things", "c", "{}")).await.status,
        StatusCode::CREATED
    );

    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut latencies = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        match (key.name(), value) {
            ("idempotency_outcomes_total", DebugValue::Counter(n)) => {
                let outcome = key
                    .labels()
                    .find(|l| l.key() == "outcome")
                    .unwrap()
                    .value()
                    .to_owned();
                *counts.entry(outcome).or_default() += n;
            }
            ("idempotency_store_seconds", DebugValue::Histogram(values)) => {
                latencies += values.len()
            }
            _ => {}
        }
    }
    for outcome in [
        "executed",
        "replayed",
        "conflict",
        "mismatch",
        "rejected",
        "lease_lost",
        "store_error",
        "fail_open",
    ] {
        assert!(
            counts.get(outcome).copied().unwrap_or(0) >= 1,
            "{outcome} not counted: {counts:?}"
        );
    }
    assert_eq!(counts["lease_lost"], 1, "{counts:?}");
    assert!(latencies >= 8, "store latency recorded: {latencies}");
}
