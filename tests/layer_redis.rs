//! The layer on a real Redis: several service instances over HTTP, Redis outages (fail closed
//! and fail open), what lands in Redis, corrupt records, and a lease taken away mid-handler.

mod support;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use redis::AsyncCommands;
use support::{app, app_with, client, http, post_key, redis_store, send, serve};
use testkit::RedisServer;
use tower_idempotency::{Store, key};

/// Hundreds of concurrent duplicates, spread over two service instances that share one Redis,
/// run the handler exactly once; then many keys with bursts of duplicates each run once per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_redis() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("two-instances");
    let store_a = redis_store(&server.url(), &prefix).await;
    let store_b = redis_store(&server.url(), &prefix).await;
    let (router_a, probe) = app(&store_a, |b| b);
    let router_b = app_with(&store_b, &probe, |b| b);
    let (addr_a, _a) = serve(router_a).await;
    let (addr_b, _b) = serve(router_b).await;
    let client = client();

    probe.close();
    let tasks: Vec<_> = (0..300)
        .map(|i| {
            let client = client.clone();
            let addr = if i % 2 == 0 { addr_a } else { addr_b };
            tokio::spawn(
                async move { http(&client, addr, post_key("/things", "burst", "{}")).await },
            )
        })
        .collect();
    let mut pending = tasks;
    let mut conflicts = 0;
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    while pending.len() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of 300 duplicates still unanswered while the first is held",
            pending.len()
        );
        let mut still = Vec::new();
        for t in pending {
            if t.is_finished() {
                assert_eq!(t.await.unwrap().status, StatusCode::CONFLICT);
                conflicts += 1;
            } else {
                still.push(t);
            }
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    probe.open();
    let winner = pending.pop().unwrap().await.unwrap();
    assert_eq!(winner.status, StatusCode::CREATED);
    assert_eq!(conflicts, 299);
    assert_eq!(
        probe.runs_of("burst"),
        1,
        "one execution across both instances"
    );
    for addr in [addr_a, addr_b] {
        let replay = http(&client, addr, post_key("/things", "burst", "{}")).await;
        assert!(replay.replayed());
        assert_eq!(
            replay.body, winner.body,
            "byte-identical on either instance"
        );
    }

    // Many keys, a burst of duplicates each, no gate: every key's handler runs once.
    let tasks: Vec<_> = (0..40)
        .flat_map(|k| (0..8).map(move |i| (k, i)))
        .map(|(k, i)| {
            let client = client.clone();
            let addr = if (k + i) % 2 == 0 { addr_a } else { addr_b };
            tokio::spawn(async move {
                let r = http(
                    &client,
                    addr,
                    post_key("/things", &format!("key-{k}"), "{}"),
                )
                .await;
                assert!(
                    r.status == StatusCode::CREATED || r.status == StatusCode::CONFLICT,
                    "{r:?}"
                );
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    for k in 0..40 {
        assert_eq!(probe.runs_of(&format!("key-{k}")), 1, "key-{k}");
    }
}

/// With Redis unreachable the layer fails closed: 503 with Retry-After, the handler never runs.
/// In fail-open mode the handler runs unprotected and the response is not stored.
#[tokio::test]
async fn an_unreachable_redis_fails_closed_or_open() {
    let port = testkit::free_port().unwrap();
    let store = Store::redis(&format!("redis://127.0.0.1:{port}/")).unwrap();
    let (closed, probe) = app(&store, |b| b);
    let r = send(&closed, post_key("/things", "k", "{}")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.problem(), "store-unavailable");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(probe.runs(), 0);

    let (open, probe) = app(&store, |b| b.fail_open(true));
    for _ in 0..2 {
        let r = send(&open, post_key("/things", "k", "{}")).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert!(!r.replayed());
        assert!(
            r.json()["fence"].is_null(),
            "the handler saw it was unprotected"
        );
    }
    assert_eq!(probe.runs(), 2);
}

/// Redis goes away and comes back: requests get 503 meanwhile, and the layer recovers by itself.
#[tokio::test]
async fn the_layer_recovers_after_a_redis_restart() {
    let server = RedisServer::start_owned().await;
    let store = redis_store(&server.url(), &testkit::unique_prefix("restart")).await;
    let (app, probe) = app(&store, |b| b);
    assert_eq!(
        send(&app, post_key("/things", "a", "{}")).await.status,
        StatusCode::CREATED
    );
    server.stop().await;
    let down = send(&app, post_key("/things", "b", "{}")).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    server.restart().await;
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..100 {
        status = send(&app, post_key("/things", "b", "{}")).await.status;
        if status != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(probe.runs(), 2);
}

/// Only hashes reach Redis: no phone number in any key, and the in-flight tag is a digest.
#[tokio::test]
async fn no_raw_input_lands_in_redis() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("raw");
    let store = redis_store(&server.url(), &prefix).await;
    let (app, _) = app(&store, |b| b.key(key::json("/phone").unwrap()));
    let signup = Request::post("/quiet")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"phone":"+15550100777","name":"Ada"}"#))
        .unwrap();
    assert_eq!(send(&app, signup).await.status, StatusCode::CREATED);
    let mut r = server.connection().await;
    let keys: Vec<String> = r.keys(format!("{prefix}:*")).await.unwrap();
    assert_eq!(keys.len(), 1, "one state key per request: {keys:?}");
    for k in &keys {
        assert!(!k.contains("15550100777"), "{k}");
        let fields: Vec<(String, Vec<u8>)> = r.hgetall(k).await.unwrap();
        for (field, value) in fields {
            assert!(
                !String::from_utf8_lossy(&value).contains("15550100777"),
                "{k} {field}"
            );
        }
    }
    let ttl: i64 = r.pttl(&keys[0]).await.unwrap();
    assert!(ttl > 23 * 3600 * 1000, "kept for the 24 h retention: {ttl}");
}

/// A stored record that cannot be decoded is reported (500), and the handler does not run again.
#[tokio::test]
async fn a_corrupt_record_is_reported_never_rerun() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("corrupt");
    let store = redis_store(&server.url(), &prefix).await;
    let (app, probe) = app(&store, |b| b);
    assert_eq!(
        send(&app, post_key("/quiet", "c", "")).await.status,
        StatusCode::CREATED
    );
    let mut r = server.connection().await;
    let keys: Vec<String> = r.keys(format!("{prefix}:*:state")).await.unwrap();
    for garbage in [&b"garbage"[..], b"TIR\x02future-format", b""] {
        let _: () = r.hset(&keys[0], "d", garbage).await.unwrap();
        let reply = send(&app, post_key("/quiet", "c", "")).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(reply.problem(), "record-unreadable");
    }
    assert_eq!(probe.runs(), 1);
}

/// The lease is taken away while the handler runs: its completion is refused, so a retry runs
/// the handler again instead of replaying an outcome stored without a lease.
#[tokio::test]
async fn a_lease_taken_away_mid_handler_is_not_completed() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("taken");
    let store = redis_store(&server.url(), &prefix).await;
    let lock = distlock::LockConfig::builder()
        .lease(Duration::from_millis(600))
        .build()
        .unwrap();
    let (app, probe) = app(&store, |b| b.lock_config(lock));
    probe.close();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "t", "{}")).await }
    });
    probe.started(1).await;
    let mut r = server.connection().await;
    let locks: Vec<String> = r.keys(format!("{prefix}:{{*}}")).await.unwrap();
    assert_eq!(locks.len(), 1, "{locks:?}");
    let _: () = r.del(&locks[0]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await; // a renewal finds it gone
    probe.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["held_at_end"], false);
    let retry = send(&app, post_key("/things", "t", "{}")).await;
    assert!(
        !retry.replayed(),
        "nothing was stored by the lease that was lost"
    );
    assert_eq!(probe.runs(), 2);
}
