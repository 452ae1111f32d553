//! The layer on a real Redis: several service instances over HTTP, Redis outages (fail closed
//! and fail open), what lands in Redis, corrupt records, and a lease taken away mid-handler.

mod support;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use redis::AsyncCommands;
use support::{app, app_with, client, http, post_key, redis_store, send, serve};
use testkit::RedisServer;
use tower::ServiceExt;
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

/// Fail-open is for a store that cannot be reached, not for one that just said the key is in
/// flight: a duplicate waiting for the first request (`OnConflict::Wait`) whose store stops
/// answering gets 503 and never runs the handler beside the first (before: it ran unprotected
/// while the first still held its lease, two executions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_never_runs_beside_a_request_seen_in_flight() {
    use support::within;
    let server = RedisServer::start_owned().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("open-in-flight");
    let (a, probe) = app(&redis_store(&server.url(), &prefix).await, |b| b);
    let b = app_with(&redis_store(&proxy.url(), &prefix).await, &probe, |b| {
        b.fail_open(true)
            .on_conflict(tower_idempotency::OnConflict::Wait(Duration::from_secs(3)))
    });
    probe.close();
    let first = tokio::spawn(async move { send(&a, post_key("/things", "k", "{}")).await });
    probe.started(1).await;
    // The duplicate found the key in flight and waits for it: it listens for the release.
    let r = server.connection().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let second = tokio::spawn(async move { send(&b, post_key("/things", "k", "{}")).await });
    loop {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query_async(&mut r.clone())
            .await
            .unwrap();
        if !channels.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicate never waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Now its store stops answering.
    proxy.blackhole(true);
    support::wait_until("the duplicate answered or ran", || {
        second.is_finished() || probe.runs() > 1
    })
    .await;
    assert_eq!(
        probe.runs(),
        1,
        "the duplicate ran beside the first, unprotected"
    );
    let second = within("the duplicate's answer", second).await.unwrap();
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE, "{second:?}");
    proxy.blackhole(false);
    probe.open();
    let first = within("the first request", first).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(probe.runs(), 1);
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

/// Every key and value in the Redis database, dumped whatever its type.
async fn dump(server: &RedisServer) -> Vec<(String, Vec<u8>)> {
    let mut r = server.connection().await;
    let mut out = Vec::new();
    let keys: Vec<String> = r.keys("*").await.unwrap();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut r)
            .await
            .unwrap();
        let values: Vec<Vec<u8>> = match kind.as_str() {
            "string" => vec![r.get(&key).await.unwrap()],
            "hash" => {
                let fields: Vec<(Vec<u8>, Vec<u8>)> = r.hgetall(&key).await.unwrap();
                fields.into_iter().flat_map(|(f, v)| [f, v]).collect()
            }
            "list" => r.lrange(&key, 0, -1).await.unwrap(),
            "set" => r.smembers(&key).await.unwrap(),
            "stream" => {
                let reply: redis::Value = redis::cmd("XRANGE")
                    .arg(&key)
                    .arg("-")
                    .arg("+")
                    .query_async(&mut r)
                    .await
                    .unwrap();
                vec![format!("{reply:?}").into_bytes()]
            }
            other => panic!("unexpected type {other} at {key}"),
        };
        for v in values {
            out.push((key.clone(), v));
        }
    }
    out
}

/// Nothing readable lands in Redis: after signups (phone number and name in the body, echoed
/// by the handler), header keys, streamed and failing responses, retryable and in-flight
/// requests, no byte sequence of any request or response appears in any key or value: Redis
/// holds keyed hashes, sealed records, lease tokens and fence counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_readable_lands_in_redis() {
    let server = RedisServer::start_owned().await;
    let prefix = "idem";
    let store = redis_store(&server.url(), prefix).await;
    let (signups, _) = app(&store, |b| b.key(key::json("/phone").unwrap()));
    let (things, probe) = app(&store, |b| b);
    let secrets = [
        "+15550100777",
        "Ada Lovelace",
        "order-key-8812",
        "zebra-quartz",
        "tenant-acme",
    ];
    let signup = Request::post("/things")
        .header("content-type", "application/json")
        .body(Body::from(
            r#"{"phone":"+15550100777","name":"Ada Lovelace"}"#,
        ))
        .unwrap();
    assert_eq!(send(&signups, signup).await.status, StatusCode::CREATED);
    let mut keyed = post_key("/things", "order-key-8812", r#"{"note":"zebra-quartz"}"#);
    keyed
        .headers_mut()
        .insert("authorization", "tenant-acme".parse().unwrap());
    let first = send(&things, keyed).await;
    assert!(
        String::from_utf8_lossy(&first.body).contains("zebra-quartz"),
        "the handler echoes the input, so the record holds it"
    );
    send(&things, post_key("/stream", "order-key-8812-stream", "")).await;
    let _ = things
        .clone()
        .oneshot(post_key("/stream?fail=true", "order-key-8812-fail", ""))
        .await;
    send(
        &things,
        post_key("/decide?status=503", "order-key-8812-503", ""),
    )
    .await;
    // One request still in flight while Redis is dumped.
    probe.close();
    let in_flight = tokio::spawn({
        let things = things.clone();
        async move {
            send(
                &things,
                post_key(
                    "/things",
                    "order-key-8812-flight",
                    r#"{"x":"zebra-quartz"}"#,
                ),
            )
            .await
        }
    });
    probe.started(5).await;
    let dumped = dump(&server).await;
    probe.open();
    in_flight.await.unwrap();
    let dumped_after = dump(&server).await;
    assert!(
        dumped.len() > 5,
        "the scenarios left their records: {}",
        dumped.len()
    );
    let mut more_fragments: Vec<String> = vec![
        "15550100777".into(),
        "Lovelace".into(),
        "part 0".into(),
        "/things".into(),
        "application/json".into(),
    ];
    more_fragments.extend(secrets.iter().map(|s| s.to_string()));
    for (key, value) in dumped.iter().chain(&dumped_after) {
        assert!(key.starts_with("idem:{"), "only the layer's keys: {key}");
        for fragment in &more_fragments {
            let needle = fragment.as_bytes();
            assert!(
                !key.as_bytes().windows(needle.len()).any(|w| w == needle),
                "{fragment:?} in the key {key}"
            );
            assert!(
                !value.windows(needle.len()).any(|w| w == needle),
                "{fragment:?} in the value of {key}"
            );
        }
    }
    // Every stored record is kept for the retention (the state keys without a record are the
    // fence counters of the things keys name: see the next test).
    let mut r = server.connection().await;
    let states: Vec<String> = r.keys("idem:*:state").await.unwrap();
    let mut records = 0;
    for state in &states {
        let fields: Vec<String> = r.hkeys(state).await.unwrap();
        if !fields.iter().any(|f| f == "d" || f == "p") {
            continue;
        }
        records += 1;
        let ttl: i64 = r.pttl(state).await.unwrap();
        assert!(
            ttl > 23 * 3600 * 1000,
            "{state} kept for the 24 h retention: {ttl}"
        );
    }
    assert!(records > 0, "no record among the state keys: {states:?}");
}

/// The fence counter of a thing a key names (a phone number) lives as long as a record about
/// it, not for good: Redis memory does not grow with every phone number ever seen (before:
/// kept with no expiry). And the thing's fence still grows across that expiry: an execution
/// about the thing after its counter went is fenced above every earlier one.
#[tokio::test]
async fn a_things_fence_counter_expires_with_the_retention_and_its_fence_still_grows() {
    let server = RedisServer::start_owned().await;
    let store = redis_store(&server.url(), "idem").await;
    let (signups, _) = app(&store, |b| {
        b.key(key::json("/phone").unwrap())
            .lease(Duration::from_millis(300))
            .unwrap()
            .retention(Duration::from_millis(800))
    });
    let signup = |name: &str| {
        Request::post("/things")
            .header("content-type", "application/json")
            .body(Body::from(format!(
                r#"{{"phone":"+15550100777","name":"{name}"}}"#
            )))
            .unwrap()
    };
    let first = send(&signups, signup("Ada")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let fence = |reply: &support::Reply| reply.json()["fence"].as_u64().expect("a fence");
    let mut r = server.connection().await;
    let states: Vec<String> = r.keys("idem:*:state").await.unwrap();
    let mut counters = Vec::new();
    for state in &states {
        let fields: Vec<String> = r.hkeys(state).await.unwrap();
        if fields.iter().any(|f| f == "d" || f == "p") {
            continue;
        }
        let ttl: i64 = r.pttl(state).await.unwrap();
        assert!(
            ttl > 0 && ttl <= 800,
            "{state} ({fields:?}), the thing's fence counter, expires with the retention: {ttl}"
        );
        counters.push(state.clone());
    }
    assert_eq!(counters.len(), 1, "one thing's counter among {states:?}");
    // Once every key about the thing is gone, another signup with the phone number runs, under
    // a greater fence.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<String> = r.keys("idem:*").await.unwrap();
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still in Redis after 10 s: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let later = send(&signups, signup("Grace")).await;
    assert_eq!(later.status, StatusCode::CREATED);
    assert!(
        fence(&later) > fence(&first),
        "the fence after the counter expired ({}) is above the first ({})",
        fence(&later),
        fence(&first)
    );
}

/// A stored record that does not open is reported (500 `record-unreadable`) and never replayed
/// nor re-run: garbage, an old format version, a byte altered, a record copied from another
/// key, a record written by hand in the current format, another server secret.
#[tokio::test]
async fn forged_swapped_and_old_records_are_refused() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("forged");
    let store = redis_store(&server.url(), &prefix).await;
    let (app, probe) = app(&store, |b| b);
    for key in ["a", "b"] {
        assert_eq!(
            send(&app, post_key("/quiet", key, "")).await.status,
            StatusCode::CREATED
        );
    }
    let mut r = server.connection().await;
    let states: Vec<String> = r.keys(format!("{prefix}:*:state")).await.unwrap();
    assert_eq!(states.len(), 2);
    let record_of =
        |fields: &Vec<(String, Vec<u8>)>| fields.iter().find(|(f, _)| f == "d").unwrap().1.clone();
    let a_fields: Vec<(String, Vec<u8>)> = r.hgetall(&states[0]).await.unwrap();
    let b_fields: Vec<(String, Vec<u8>)> = r.hgetall(&states[1]).await.unwrap();
    let (a, b) = (record_of(&a_fields), record_of(&b_fields));
    let mut altered = a.clone();
    let last = altered.len() - 1;
    altered[last] ^= 1;
    let mut body_altered = a.clone();
    body_altered[20] ^= 0x80;
    let mut hand_written = b"TIR\x03".to_vec();
    hand_written.extend_from_slice(&[0u8; 60]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"garbage".to_vec()),
        ("empty", Vec::new()),
        ("format version 1", b"TIR\x01\x00\x00".to_vec()),
        ("a tag byte altered", altered),
        ("a ciphertext byte altered", body_altered),
        ("the other key's record", b),
        ("written by hand", hand_written),
    ];
    // Whichever of the two state keys belongs to "a" and "b", each gets every forgery.
    for state in &states {
        for (what, forged) in &cases {
            let _: () = r.hset(state, "d", forged).await.unwrap();
            for key in ["a", "b"] {
                let reply = send(&app, post_key("/quiet", key, "")).await;
                if reply.status == StatusCode::CREATED {
                    assert!(reply.replayed(), "{what}: never re-run");
                    continue; // this key's record is the untouched one
                }
                assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{what}");
                assert_eq!(reply.problem(), "record-unreadable", "{what}");
            }
        }
        let _: () = r.hset(state, "d", &a).await.unwrap();
    }
    assert_eq!(probe.runs(), 2, "no forgery made the handler run again");
    // Another server secret cannot open the records, nor forge one the first can open.
    let other = tower_idempotency::IdempotencyLayer::builder(store.clone())
        .secret("another server secret, 32 bytes")
        .unwrap()
        .principal(|_: &http::request::Parts| Some("anonymous".into()))
        .build()
        .unwrap();
    let (other_app, other_probe) = support::app_with_layer(other);
    let reply = send(&other_app, post_key("/quiet", "a", "")).await;
    assert!(!reply.replayed(), "another secret names another key");
    assert_eq!(other_probe.runs(), 1);
}

/// A streamed record whose parts are gone while its state says it is done (Redis evicted one
/// of its keys, or they expired a moment apart) is reported, never a reason to run the handler
/// again: not even with `fail_open`, which is for a store that does not answer (before, the
/// broken record counted as an unreachable store: 503, and with `fail_open` a second run).
#[tokio::test]
async fn a_record_missing_its_parts_is_reported_never_run_again() {
    let server = RedisServer::start().await;
    for open in [false, true] {
        let prefix = testkit::unique_prefix("parts-gone");
        let store = redis_store(&server.url(), &prefix).await;
        let (app, probe) = app(&store, |b| b.fail_open(open));
        let first = send(&app, post_key("/stream", "s", "")).await;
        assert_eq!(first.status, StatusCode::OK);
        let mut r = server.connection().await;
        let parts: Vec<String> = r.keys(format!("{prefix}:*:parts")).await.unwrap();
        assert_eq!(parts.len(), 1, "a streamed record: {parts:?}");
        let _: () = r.del(&parts[0]).await.unwrap();
        let retry = send(&app, post_key("/stream", "s", "")).await;
        assert_eq!(
            retry.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "fail_open {open}: {retry:?}"
        );
        assert_eq!(retry.problem(), "record-unreadable");
        assert_eq!(probe.runs(), 1, "fail_open {open}: never run again");
    }
}

/// The parts of a record being streamed vanish mid-stream (Redis evicted the list, or someone
/// deleted it): the client still gets the whole response, and the layer, unable to store the
/// body it sent, stores the outcome without it (status and headers), so a retry gets 410
/// `response-not-stored` naming the original status, and never runs the handler again (before:
/// the refused completion released the key, a second run; then it stored "outcome unknown",
/// though the handler had answered 200 and the client had it all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_lost_mid_stream_leave_the_outcome_without_its_body_not_a_second_run() {
    use http_body_util::BodyExt;
    use support::within;
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("parts-lost-mid-stream");
    let (app, probe) = app(&redis_store(&server.url(), &prefix).await, |b| b);
    let (addr, _server) = serve(app).await;
    let client = client();
    // Ends with a grpc-status trailer: the outcome kept without its body names it.
    let request = || {
        Request::post("/stream?grpc_status=5")
            .header("idempotency-key", "s")
            .header("te", "trailers")
            .header("authorization", "alice")
            .body(Body::empty())
            .unwrap()
    };
    let mut first = request();
    *first.uri_mut() = format!("http://{addr}/stream?grpc_status=5")
        .parse()
        .unwrap();
    let first = within("the response", client.request(first)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let mut body = first.into_body();
    let mut got = Vec::new();
    let mut r = server.connection().await;
    let mut deleted = false;
    let mut trailers = None;
    while let Some(frame) = within("a frame", body.frame()).await {
        match frame.unwrap().into_data() {
            Ok(data) => got.extend_from_slice(&data),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
        let parts: Vec<String> = r.keys(format!("{prefix}:*:parts")).await.unwrap();
        if !deleted && got.len() > 30 && !parts.is_empty() {
            let _: () = r.del(&parts[0]).await.unwrap();
            deleted = true;
        }
    }
    assert!(deleted, "the parts were there to delete mid-stream");
    let expected: String = (0..10).map(|i| format!("run 1 part {i};")).collect();
    assert_eq!(
        String::from_utf8(got).unwrap(),
        expected,
        "the client got it all"
    );
    assert_eq!(
        trailers.as_ref().and_then(|t| t.get("grpc-status")),
        Some(&http::HeaderValue::from_static("5")),
        "and its trailer"
    );
    let retry = within("the retry", http(&client, addr, request())).await;
    assert_eq!(probe.runs(), 1, "ran again: {retry:?}");
    assert_eq!(retry.status, StatusCode::GONE, "{retry:?}");
    assert_eq!(retry.problem(), "response-not-stored");
    assert_eq!(retry.json()["original_status"], 200, "{retry:?}");
    assert_eq!(retry.json()["original_grpc_status"], 5, "{retry:?}");
}

/// A streamed response with a `content-length`: the client has the whole body when the last
/// byte is written, while the last part and the completion are still on their way to the store
/// (instance A's store replies come 150 ms late). A retry at once on instance B finds the key
/// in flight with parts stored; within the completion grace it waits for the end and replays
/// it (before, parts stored ended the wait at once: 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_right_after_a_streamed_response_gets_the_replay() {
    use http_body_util::BodyExt;
    use support::within;
    let server = RedisServer::start_owned().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("streamed-grace");
    let (a, probe) = app(&redis_store(&proxy.url(), &prefix).await, |b| b);
    let b = app_with(&redis_store(&server.url(), &prefix).await, &probe, |b| {
        b.completion_grace(Duration::from_secs(10))
    });
    let (addr_a, _server_a) = serve(a).await;
    let (addr_b, _server_b) = serve(b).await;
    proxy.delay_replies(Duration::from_millis(150));
    let client = client();
    let request = |addr: std::net::SocketAddr| {
        Request::post(format!("http://{addr}/stream?length=true"))
            .header("idempotency-key", "s")
            .header("authorization", "alice")
            .body(Body::empty())
            .unwrap()
    };
    let first = within("the response", client.request(request(addr_a)))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let body = within("the body", first.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    let expected: String = (0..10).map(|i| format!("run 1 part {i};")).collect();
    assert_eq!(body, expected);
    let retry = within("the retry", client.request(request(addr_b)))
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::OK, "{retry:?}");
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let replayed = within("the replay", retry.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(replayed, body);
    assert_eq!(probe.runs(), 1);
    proxy.delay_replies(Duration::ZERO);
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

/// A whole response goes to the client as soon as its outcome is on its way to the store, not
/// after the store answers: with everything between this instance and Redis black-holed once the
/// handler has started, the client still gets its response, and at that moment the key is
/// still held and nothing is stored (before: the response waited for the completion, which
/// waited out the lease, so the lock was gone by then). Once the path heals, the outcome
/// lands and a retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_goes_out_before_its_outcome_is_stored() {
    let server = RedisServer::start().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("respond-first");
    let store = redis_store(&proxy.url(), &prefix).await;
    let (router, probe) = app(&store, |b| b);
    let (addr, _server) = serve(router).await;
    let client = client();
    probe.close();
    let first = tokio::spawn({
        let client = client.clone();
        async move { http(&client, addr, post_key("/things", "early", "{}")).await }
    });
    probe.started(1).await;
    proxy.blackhole(true);
    probe.open();
    let first = support::within("the response, with the store unreachable", first)
        .await
        .unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let mut r = server.connection().await;
    let locks: Vec<String> = r.keys(format!("{prefix}:{{*}}")).await.unwrap();
    assert_eq!(locks.len(), 1, "the key is still held: {locks:?}");
    let ttl: i64 = r.pttl(&locks[0]).await.unwrap();
    assert!(ttl > 0, "held, with a lease: {ttl}");
    proxy.heal();
    let retry = support::within("the replay once the outcome landed", async {
        loop {
            let retry = http(&client, addr, post_key("/things", "early", "{}")).await;
            if retry.status != StatusCode::CONFLICT {
                return retry;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(probe.runs(), 1);
}

/// A duplicate that reaches another instance while the first instance's response is out and
/// its outcome still on the way to Redis waits for it (the completion grace, woken by the
/// completion) and replays it, rather than answering 409 (before: 409 at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_during_the_completion_round_trip_gets_the_replay() {
    let server = RedisServer::start().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("grace");
    let store_a = redis_store(&proxy.url(), &prefix).await;
    let store_b = redis_store(&server.url(), &prefix).await;
    let (router_a, probe) = app(&store_a, |b| b);
    // A long grace, so that the test does not depend on timing: the duplicate waits until the
    // outcome lands, which the test lets happen only once the duplicate is waiting.
    let router_b = app_with(&store_b, &probe, |b| {
        b.completion_grace(Duration::from_secs(10))
    });
    let (addr_a, _a) = serve(router_a).await;
    let (addr_b, _b) = serve(router_b).await;
    let client = client();
    probe.close();
    let first = tokio::spawn({
        let client = client.clone();
        async move { http(&client, addr_a, post_key("/things", "grace", "{}")).await }
    });
    probe.started(1).await;
    proxy.blackhole(true);
    probe.open();
    let first = support::within("the first response", first).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);

    let duplicate = tokio::spawn({
        let client = client.clone();
        async move { http(&client, addr_b, post_key("/things", "grace", "{}")).await }
    });
    // The duplicate found the key in flight and waits for its completion (subscribed to it).
    let mut r = server.connection().await;
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg(format!("{prefix}*"))
            .query_async(&mut r)
            .await
            .unwrap();
        if !channels.is_empty() {
            break;
        }
        assert!(
            !duplicate.is_finished(),
            "the duplicate answered without waiting: {:?}",
            duplicate.await.unwrap()
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicate never waited for the completion"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.heal();
    let duplicate = support::within("the duplicate's answer", duplicate)
        .await
        .unwrap();
    assert_eq!(duplicate.status, StatusCode::CREATED, "{duplicate:?}");
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(probe.runs(), 1);
}

/// A duplicate on instance B finds a streamed record being written on instance A and joins it.
/// Right then the writer's parts are lost (deleted here; evicted under `maxmemory`), and the
/// writer stores in their place its outcome without its body, one whole part. The joiner's
/// first read finds that complete one-part record: it replays it (410 `response-not-stored`,
/// as a retry a moment later gets), not 500 `record-unreadable` ("a streamed record starts
/// with the wrong part") as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_that_finds_the_record_stored_whole_replays_it() {
    use support::within;
    let pair = HookedPair::start("join-whole", |b| {
        b.on_conflict(tower_idempotency::OnConflict::Wait(Duration::from_secs(10)))
    })
    .await;
    let HookedPair {
        server,
        prefix,
        probe,
        hooked,
        addr_a,
        addr_b,
        ..
    } = &pair;
    let (prefix, hooked, addr_a, addr_b) = (prefix.as_str(), hooked.clone(), *addr_a, *addr_b);
    let client = client();
    let request = || {
        Request::post("/stream")
            .header("idempotency-key", "s")
            .header("authorization", "alice")
            .body(Body::empty())
            .unwrap()
    };
    let mut first = request();
    *first.uri_mut() = format!("http://{addr_a}/stream").parse().unwrap();
    let first = within("the response", client.request(first)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let reading = tokio::spawn(http_body_util::BodyExt::collect(first.into_body()));
    let mut r = server.connection().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (parts, state) = loop {
        let parts: Vec<String> = r.keys(format!("{prefix}:*:parts")).await.unwrap();
        let state: Vec<String> = r.keys(format!("{prefix}:*:state")).await.unwrap();
        if let (Some(parts), Some(state)) = (parts.first(), state.first()) {
            break (parts.clone(), state.clone());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no part stored within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    // Between B's look that decides to join (the record being written, parts stored) and its
    // first read, the parts go and A stores its outcome whole in their place. B looks twice:
    // `begin`, then `begin_wait` (which returns at once, parts being there): the second look.
    let (told, replaced) = tokio::sync::oneshot::channel();
    let mut admin = server.connection().await;
    let second = hooked.clone();
    let lose_the_parts = move || async move {
        let _: () = admin.del(&parts).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut whole = false;
        while !whole && std::time::Instant::now() < deadline {
            whole = admin.hexists(&state, "d").await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = told.send(whole);
    };
    hooked.after_reply_to(b"_begin", move || {
        second.after_reply_to(b"_begin", lose_the_parts);
        std::future::ready(())
    });
    let joined = within("the duplicate", http(&client, addr_b, request())).await;
    assert!(
        replaced.await.unwrap_or(false),
        "the writer did not store its outcome whole within 10 s"
    );
    let got = within("the first body", reading).await.unwrap().unwrap();
    let expected: String = (0..10).map(|i| format!("run 1 part {i};")).collect();
    assert_eq!(got.to_bytes(), expected, "the first client got it all");
    assert_eq!(probe.runs(), 1, "ran again: {joined:?}");
    assert_eq!(joined.status, StatusCode::GONE, "{joined:?}");
    assert_eq!(joined.problem(), "response-not-stored");
}

/// With `cancel_on_disconnect`, only the handler is cancellable: once it has returned (here it
/// panicked), recording its unknown outcome goes on when the client leaves meanwhile. Before,
/// the client's leaving dropped the record on its way to Redis, the lease was released, and
/// the retry ran the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_being_stored_is_not_cancelled_with_the_client() {
    use support::within;
    let server = RedisServer::start_owned().await;
    let prefix = testkit::unique_prefix("cancel-unknown");
    let hooked = testkit::HookedConnection::new(server.connection().await);
    let lock_client = distlock::LockClient::builder()
        .prefix(&prefix)
        .unwrap()
        .redis(hooked.clone())
        .unwrap();
    lock_client.prepare().await.unwrap();
    let store = Store::from_client(lock_client);
    let (app, probe) = app(&store, |b| {
        b.cancel_on_disconnect(true)
            .on_conflict(tower_idempotency::OnConflict::Wait(Duration::from_secs(10)))
    });
    let (hold, held) = tokio::sync::oneshot::channel::<()>();
    hooked.before_sending(b"_complete", move || async move {
        let _ = held.await;
    });
    let first = tokio::time::timeout(
        Duration::from_millis(300),
        send(&app, post_key("/panics", "p", "")),
    )
    .await;
    assert!(
        first.is_err(),
        "the outcome's record is held: the client leaves first"
    );
    assert_eq!(probe.runs(), 1);
    // A shutdown now waits for the record (before: `drain` saw no execution left once the
    // client's had gone, and the process could exit with the record unsent).
    assert!(
        !store.drain(Duration::from_millis(300)).await,
        "drained with the outcome's record still held"
    );
    drop(hold);
    assert!(
        store.drain(Duration::from_secs(10)).await,
        "drained once it is stored"
    );
    let again = within("the retry", send(&app, post_key("/panics", "p", ""))).await;
    assert_eq!(probe.runs(), 1, "ran again: {again:?}");
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR, "{again:?}");
    assert_eq!(again.problem(), "outcome-unknown");
}

/// The store's connection drops in the middle of a replay of a streamed record (one of its
/// reads loses its reply and the connection is cut, as a network blip or a failover would):
/// the reads are retried once the store answers again and the client gets the whole body,
/// once (before, the body broke off at the first failed read, and the client had to send the
/// request again for a record that was there all along). A duplicate joining a stream live
/// reads through the same retries (distlock's `replies::a_read_whose_reply_is_lost_is_tried_again`
/// covers a follower).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_on_when_the_store_connection_drops() {
    replay_through_a_connection_drop(Cut::ReplyLost).await;
}

/// The same, the connection cut in the middle of a reply (a part of 64 KiB arrives in
/// pieces): the client reads the start of the reply and then the end of the stream, which the
/// redis client reports as a parse error. Before, that counted as an answer that a retry would
/// not change, and the body broke off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_on_when_the_store_connection_drops_mid_reply() {
    replay_through_a_connection_drop(Cut::MidReply).await;
}

/// How the store's connection drops while a streamed record is replayed.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// The next reply is lost whole, and the connection cut.
    ReplyLost,
    /// The next piece of a reply goes to the client, and the connection is cut after it.
    MidReply,
}

async fn replay_through_a_connection_drop(how: Cut) {
    use http_body_util::BodyExt;
    use support::within;
    let server = RedisServer::start_owned().await;
    let proxy = testkit::FaultProxy::start(&server).await;
    let prefix = testkit::unique_prefix("replay-drop");
    let (router, probe) = app(&redis_store(&proxy.url(), &prefix).await, |b| b);
    let (addr, _server) = serve(router).await;
    let client = client();
    // 2 MiB in 1 KiB frames: stored as 32 parts of 64 KiB, read back four at a time.
    let request = || {
        Request::post(format!("http://{addr}/download?kib=2048"))
            .header("idempotency-key", "dl")
            .header("authorization", "alice")
            .body(Body::empty())
            .unwrap()
    };
    let first = within("the response", client.request(request()))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let body = within("the body", first.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body.len(), 2 << 20);
    for attempt in 0..3 {
        let retry = within("the replay", client.request(request()))
            .await
            .unwrap();
        assert_eq!(retry.status(), StatusCode::OK, "{retry:?}");
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
        let mut replay = retry.into_body();
        let mut got = Vec::new();
        let frame = within("the first frame", replay.frame())
            .await
            .expect("a frame")
            .expect("data");
        got.extend_from_slice(frame.data_ref().expect("data"));
        match how {
            // The next reply from the store is lost and its connection cut.
            Cut::ReplyLost => proxy.drop_next_replies(1),
            Cut::MidReply => proxy.cut_after_next_replies(1),
        }
        let rest = within("the rest of the replay", replay.collect()).await;
        let rest = rest.unwrap_or_else(|e| panic!("attempt {attempt}: the replay broke off: {e}"));
        got.extend_from_slice(&rest.to_bytes());
        assert_eq!(got.len(), body.len(), "attempt {attempt}");
        assert!(got == body[..], "attempt {attempt}: other bytes");
        match how {
            Cut::ReplyLost => assert!(proxy.dropped() > attempt, "a reply was dropped"),
            Cut::MidReply => assert!(
                proxy.cut_after_replies() > attempt,
                "a connection was cut after a piece of a reply"
            ),
        }
    }
    assert_eq!(probe.runs(), 1);
}

/// A stored streamed record goes between the look that finds it complete and the read of its
/// end (it expired at that moment, or a failover to a replica that never had it lost it): the
/// store holds no record any more, which is not a broken one. The request is answered 503
/// `store-unavailable`, so that its retry decides on what the store holds now (here it runs
/// the handler: the record is gone), not 500 `record-unreadable` (before), which tells the
/// client its outcome is lost for good and logs an integrity alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_gone_between_the_look_and_the_read_is_not_reported_broken() {
    record_changed_between_the_look_and_the_read(false).await;
}

/// The same, and meanwhile a retry on another instance ran the handler again and stored a new
/// record with as many parts: the read finds a complete record, another writer's. Not a
/// broken record either: 503, and the retry replays the new one (before the writer's fence was
/// compared too, 500 `record-unreadable`: the new record's end does not open under the old
/// writer's fence).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stored_again_between_the_look_and_the_read_is_not_reported_broken() {
    record_changed_between_the_look_and_the_read(true).await;
}

async fn record_changed_between_the_look_and_the_read(stored_again: bool) {
    use support::within;
    let pair = HookedPair::start("record-gone", |b| b).await;
    let HookedPair {
        server,
        prefix,
        probe,
        hooked,
        addr_a,
        addr_b,
        ..
    } = &pair;
    let (addr_a, addr_b) = (*addr_a, *addr_b);
    let client = client();
    let request = || {
        Request::post("/download?kib=256")
            .header("idempotency-key", "gone")
            .header("authorization", "alice")
            .body(Body::empty())
            .unwrap()
    };
    let first = within("the first response", http(&client, addr_a, request())).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    let mut admin = server.connection().await;
    let keys: Vec<String> = admin.keys(format!("{prefix}:*")).await.unwrap();
    assert!(
        keys.iter().any(|k| k.ends_with(":parts")),
        "a streamed record: {keys:?}"
    );
    let rerun = client.clone();
    hooked.after_reply_to(b"_begin", move || async move {
        let _: () = admin.del(&keys).await.unwrap();
        if stored_again {
            let again = http(&rerun, addr_a, request()).await;
            assert_eq!(again.status, StatusCode::OK, "{again:?}");
            assert!(!again.replayed(), "the record was gone: run again");
        }
    });
    let replay = within("the replay", http(&client, addr_b, request())).await;
    assert_eq!(replay.status, StatusCode::SERVICE_UNAVAILABLE, "{replay:?}");
    assert_eq!(replay.problem(), "store-unavailable");
    let runs = if stored_again { 2 } else { 1 };
    assert_eq!(probe.runs(), runs);
    let retry = within("the retry", http(&client, addr_b, request())).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    if stored_again {
        assert!(retry.replayed(), "the record stored again is replayed");
        assert_eq!(probe.runs(), 2);
    } else {
        assert!(!retry.replayed(), "the record is gone: the handler runs");
        assert_eq!(probe.runs(), 2);
    }
}

/// Two instances of the test service on one Redis: A connected directly, B through a
/// `HookedConnection`, so that a test can hold B's commands or act between them; `configure`
/// sets B's layer. The servers stop when this is dropped.
struct HookedPair {
    server: RedisServer,
    prefix: String,
    probe: support::Probe,
    hooked: testkit::HookedConnection,
    addr_a: std::net::SocketAddr,
    addr_b: std::net::SocketAddr,
    _servers: [tokio::task::JoinHandle<()>; 2],
}

impl HookedPair {
    async fn start(
        test: &str,
        configure: impl FnOnce(
            tower_idempotency::IdempotencyLayerBuilder,
        ) -> tower_idempotency::IdempotencyLayerBuilder,
    ) -> Self {
        let server = RedisServer::start_owned().await;
        let prefix = testkit::unique_prefix(test);
        let (a, probe) = app(&redis_store(&server.url(), &prefix).await, |b| b);
        let hooked = testkit::HookedConnection::new(server.connection().await);
        let b_client = distlock::LockClient::builder()
            .prefix(&prefix)
            .unwrap()
            .redis(hooked.clone())
            .unwrap();
        b_client.prepare().await.unwrap();
        let b = app_with(&Store::from_client(b_client), &probe, configure);
        let (addr_a, server_a) = serve(a).await;
        let (addr_b, server_b) = serve(b).await;
        HookedPair {
            server,
            prefix,
            probe,
            hooked,
            addr_a,
            addr_b,
            _servers: [server_a, server_b],
        }
    }
}

/// Where records are sealed: on Redis (every store outside the process), a part is the
/// AES-256-GCM envelope (version 3) and holds none of the response; on the in-memory store it
/// is kept in clear (version 0x83), which only the process can read. Also when the layer's
/// own lease settings rebuild the store's client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_sealed_on_redis_and_kept_in_clear_in_memory() {
    use axum::routing::post;
    use std::sync::{Arc, Mutex};
    use tower_idempotency::{IdempotencyContext, IdempotencyLayer};
    let server = RedisServer::start().await;
    let redis = redis_store(&server.url(), &testkit::unique_prefix("sealed-where")).await;
    for (store, sealed) in [(Store::memory(), false), (redis, true)] {
        for lease in [false, true] {
            let name = Arc::new(Mutex::new(String::new()));
            let seen = name.clone();
            let handler = move |ctx: IdempotencyContext| {
                *seen.lock().unwrap() = ctx.key().to_owned();
                std::future::ready((StatusCode::CREATED, "+15550100 Ada Lovelace"))
            };
            let mut builder = IdempotencyLayer::builder(store.clone())
                .secret(support::SECRET)
                .unwrap()
                .global_keys();
            if lease {
                builder = builder.lease(Duration::from_secs(20)).unwrap();
            }
            let app = axum::Router::new()
                .route("/signup", post(handler))
                .layer(builder.build().unwrap());
            let key = format!("k-{lease}");
            let reply = send(&app, post_key("/signup", &key, "{}")).await;
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
            let name = name.lock().unwrap().clone();
            let read = store
                .client()
                .once(&name)
                .unwrap()
                .parts(0, 1)
                .await
                .unwrap();
            let part = &read.parts()[0];
            let stored = |needle: &[u8]| part.windows(needle.len()).any(|w| w == needle);
            assert_eq!(&part[..3], b"TIR");
            if sealed {
                assert_eq!(part[3], 0x03, "sealed on Redis (lease: {lease})");
                assert!(!stored(b"+15550100"), "nothing of the response in Redis");
            } else {
                assert_eq!(part[3], 0x83, "in clear in memory (lease: {lease})");
                assert!(stored(b"+15550100"));
            }
            assert!(send(&app, post_key("/signup", &key, "{}")).await.replayed());
        }
    }
}
