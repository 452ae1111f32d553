//! The layer's behavioural suite, run against the in-memory store, a real Redis, a real Redis
//! Cluster, and a Sentinel-managed master across a forced failover.

mod support;

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use support::{Reply, TestStore, app, post_key, send};
use tower_idempotency::{OnConflict, key};

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        /// Runs every scenario, one after the other, on stores made by `make`.
        async fn run_all<F, Fut>(make: F)
        where
            F: Fn(&'static str) -> Fut,
            Fut: Future<Output = TestStore>,
        {
            $( $name(make(stringify!($name)).await).await; )*
        }
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::TestStore::memory().await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::TestStore::redis(stringify!($name)).await).await;
                }
            )*
        }
    };
}

suite!(
    a_retry_replays_the_stored_response_byte_for_byte,
    concurrent_duplicates_run_the_handler_once,
    waiting_duplicates_get_the_first_response,
    a_key_reused_for_another_request_is_refused,
    rejections_never_run_the_handler_or_store_anything,
    methods_not_covered_pass_through,
    failures_and_transient_statuses_are_not_stored,
    a_panicking_handler_releases_its_key,
    a_dropped_request_releases_its_key,
    a_lost_lease_stores_nothing,
    keys_are_scoped_to_the_principal,
    a_response_too_large_to_store_is_not_run_again,
    keys_from_the_json_body,
    fencing_tokens_grow_across_attempts,
);

async fn a_retry_replays_the_stored_response_byte_for_byte(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    let first = send(&app, post_key("/things", "k-1", r#"{"a":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert!(first.headers.contains_key("set-cookie"));
    for _ in 0..3 {
        let again = send(&app, post_key("/things", "k-1", r#"{"a":1}"#)).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert_eq!(again.body, first.body, "byte-identical body");
        assert!(again.replayed());
        assert_eq!(again.headers["location"], first.headers["location"]);
        assert_eq!(again.headers["content-type"], first.headers["content-type"]);
        assert_eq!(again.headers["x-run"], "1");
        assert!(
            !again.headers.contains_key("set-cookie"),
            "Set-Cookie is never replayed"
        );
    }
    assert_eq!(probe.runs(), 1);
    // Quoted (IETF structured field) and bare forms of one key are the same key.
    let quoted = send(&app, post_key("/things", "\"k-1\"", r#"{"a":1}"#)).await;
    assert!(quoted.replayed());
}

async fn concurrent_duplicates_run_the_handler_once(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    probe.close();
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            send(&app, post_key("/things", "dup", "{}")).await
        }));
    }
    // Every duplicate but the one holding the key answers while it is held at the gate.
    let mut replies: Vec<Reply> = Vec::new();
    let mut pending = Vec::new();
    for t in tasks {
        pending.push(t);
    }
    let mut conflicts = 0;
    while conflicts < 199 {
        let mut still = Vec::new();
        for t in pending {
            if t.is_finished() {
                let r = t.await.unwrap();
                assert_eq!(r.status, StatusCode::CONFLICT, "{r:?}");
                assert_eq!(r.problem(), "conflict");
                assert!(r.headers.contains_key("retry-after"));
                conflicts += 1;
                replies.push(r);
            } else {
                still.push(t);
            }
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(pending.len(), 1);
    probe.open();
    let winner = pending.pop().unwrap().await.unwrap();
    assert_eq!(winner.status, StatusCode::CREATED);
    assert_eq!(
        probe.runs(),
        1,
        "the handler ran once for 200 concurrent duplicates"
    );
    let retry = send(&app, post_key("/things", "dup", "{}")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, winner.body);
}

async fn waiting_duplicates_get_the_first_response(s: TestStore) {
    let (app, probe) = app(&s.store, |b| {
        b.on_conflict(OnConflict::Wait(Duration::from_secs(30)))
    });
    probe.close();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "w", "{}")).await }
    });
    while probe.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiters: Vec<_> = (0..20)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, post_key("/things", "w", "{}")).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    probe.open();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        assert_eq!(r.body, first.body);
        assert!(r.replayed());
    }
    assert_eq!(probe.runs(), 1);
}

async fn a_key_reused_for_another_request_is_refused(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    // While the first is in flight...
    probe.close();
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "k", r#"{"amount":10}"#)).await }
    });
    while probe.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let other = send(&app, post_key("/things", "k", r#"{"amount":99}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem(), "key-reused");
    probe.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    // ...and after it completed: another body, another content type.
    let other = send(&app, post_key("/things", "k", r#"{"amount":99}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    let mut text = post_key("/things", "k", r#"{"amount":10}"#);
    text.headers_mut()
        .insert("content-type", "text/plain".parse().unwrap());
    assert_eq!(
        send(&app, text).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // Another path of the same route is another request.
    assert_eq!(probe.runs(), 1);
}

async fn rejections_never_run_the_handler_or_store_anything(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b.body_limit(1024));
    let long = "k".repeat(256);
    let cases: Vec<(Request<Body>, StatusCode, &str)> = vec![
        (
            Request::post("/things").body(Body::from("{}")).unwrap(),
            StatusCode::BAD_REQUEST,
            "missing-key",
        ),
        (
            Request::post("/things")
                .header("idempotency-key", "a")
                .header("idempotency-key", "b")
                .body(Body::empty())
                .unwrap(),
            StatusCode::BAD_REQUEST,
            "duplicate-key",
        ),
        (
            post_key("/things", "", "{}"),
            StatusCode::BAD_REQUEST,
            "invalid-key",
        ),
        (
            post_key("/things", &long, "{}"),
            StatusCode::BAD_REQUEST,
            "invalid-key",
        ),
        (
            Request::post("/things")
                .header(
                    "idempotency-key",
                    http::HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
                )
                .body(Body::empty())
                .unwrap(),
            StatusCode::BAD_REQUEST,
            "invalid-key",
        ),
        (
            post_key("/things", "big", &"x".repeat(2000)),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
    ];
    for (request, status, slug) in cases {
        let r = send(&app, request).await;
        assert_eq!(r.status, status, "{slug}: {r:?}");
        assert_eq!(r.problem(), slug);
    }
    // A chunked body (no Content-Length) that crosses the limit midway.
    let chunks = futures_util::stream::iter(
        (0..4).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 400]))),
    );
    let streamed = Request::post("/things")
        .header("idempotency-key", "chunked")
        .body(Body::from_stream(chunks))
        .unwrap();
    let r = send(&app, streamed).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(probe.runs(), 0, "no rejection ran the handler");
    // Nothing was stored: the same keys with valid requests run normally.
    for key in ["big", "chunked"] {
        let ok = send(&app, post_key("/things", key, "{}")).await;
        assert_eq!(ok.status, StatusCode::CREATED);
        assert!(!ok.replayed());
    }
    assert_eq!(probe.runs(), 2);
}

async fn methods_not_covered_pass_through(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    for _ in 0..3 {
        let r = send(&app, Request::get("/things").body(Body::empty()).unwrap()).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert!(!r.replayed());
    }
    assert_eq!(probe.runs(), 3);
}

async fn failures_and_transient_statuses_are_not_stored(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    let first = send(&app, post_key("/flaky", "f", "")).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let second = send(&app, post_key("/flaky", "f", "")).await;
    assert_eq!(
        second.status,
        StatusCode::CREATED,
        "a 500 is not stored: the retry runs"
    );
    assert!(!second.replayed());
    let third = send(&app, post_key("/flaky", "f", "")).await;
    assert!(third.replayed());
    assert_eq!(probe.runs(), 2);
    // 429 and 409 from the handler are not stored; 422 (deterministic) is.
    for (code, stored) in [("429", false), ("409", false), ("422", true), ("400", true)] {
        let key = format!("status-{code}");
        let a = send(&app, post_key("/status", &key, code)).await;
        let b = send(&app, post_key("/status", &key, code)).await;
        assert_eq!(a.status.as_str(), code);
        assert_eq!(b.replayed(), stored, "{code}");
    }
}

async fn a_panicking_handler_releases_its_key(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    let crashed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/panics", "p", "")).await }
    });
    assert!(crashed.await.unwrap_err().is_panic());
    // The lease is released in the background: a retry soon runs the handler again.
    let mut retry = None;
    for _ in 0..200 {
        let r = send(&app, post_key("/panics", "p", "")).await;
        if r.status != StatusCode::CONFLICT {
            retry = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = retry.expect("the key was released after the panic");
    assert_eq!(retry.status, StatusCode::OK);
    assert!(!retry.replayed(), "nothing was stored for the panicked run");
    assert_eq!(probe.runs(), 2);
}

async fn a_dropped_request_releases_its_key(s: TestStore) {
    let (app, probe) = app(&s.store, |b| {
        b.on_conflict(OnConflict::Wait(Duration::from_secs(30)))
    });
    probe.close();
    let abandoned = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "gone", "{}")).await }
    });
    while probe.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    abandoned.abort(); // The client went away mid-handler.
    let _ = abandoned.await;
    probe.open();
    // A waiting retry takes over as soon as the abandoned lease is released.
    let retry = send(&app, post_key("/things", "gone", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(retry.json()["run"], 2);
}

async fn a_lost_lease_stores_nothing(s: TestStore) {
    // No renewal and a short lease: a slow handler outlives its lease.
    let lock = distlock::LockConfig::builder()
        .lease(Duration::from_millis(200))
        .watchdog(false)
        .build()
        .unwrap();
    let (app, probe) = app(&s.store, |b| {
        b.lock_config(lock)
            .on_conflict(OnConflict::Wait(Duration::from_secs(30)))
    });
    probe.close();
    let slow = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "slow", "{}")).await }
    });
    while probe.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A retry waits; when the slow holder's lease expires it takes over, runs, and completes.
    let retry = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "slow", "{}")).await }
    });
    while probe.runs() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    probe.open();
    let retry = retry.await.unwrap();
    let slow = slow.await.unwrap();
    assert_eq!(
        slow.status,
        StatusCode::CREATED,
        "the slow client still gets its response"
    );
    assert_eq!(
        slow.json()["held_at_end"],
        false,
        "the handler could see its lease was gone"
    );
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.json()["fence"].as_u64() > slow.json()["fence"].as_u64());
    // Exactly one outcome is stored: whichever completed under a valid lease.
    let later = send(&app, post_key("/things", "slow", "{}")).await;
    assert!(later.replayed());
    assert_eq!(
        later.body, retry.body,
        "the lost lease's completion was refused"
    );
}

async fn keys_are_scoped_to_the_principal(s: TestStore) {
    let (app, probe) = app(&s.store, |b| {
        b.principal(|parts| {
            parts
                .headers
                .get("authorization")?
                .to_str()
                .ok()
                .map(String::from)
        })
    });
    let as_user = |who: &str| {
        let mut r = post_key("/things", "shared-key", "{}");
        r.headers_mut()
            .insert("authorization", who.parse().unwrap());
        r
    };
    let alice = send(&app, as_user("alice")).await;
    let bob = send(&app, as_user("bob")).await;
    assert!(!bob.replayed(), "bob never gets alice's response");
    assert_ne!(alice.body, bob.body);
    assert!(send(&app, as_user("alice")).await.replayed());
    assert_eq!(probe.runs(), 2);
}

async fn a_response_too_large_to_store_is_not_run_again(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b.record_limit(1000));
    let first = send(&app, post_key("/big", "big", "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 6000, "the client gets the whole body");
    let retry = send(&app, post_key("/big", "big", "")).await;
    assert_eq!(retry.status, StatusCode::OK, "the original status");
    assert!(retry.replayed());
    assert_eq!(retry.problem(), "response-not-stored");
    assert_eq!(probe.runs(), 1);
}

async fn keys_from_the_json_body(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b.key(key::json("/phone").unwrap()));
    let signup = |body: &str| {
        Request::post("/signup")
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    };
    let first = send(&app, signup(r#"{"phone":"+15550100","name":"Ada"}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&app, signup(r#"{"phone":"+15550100","name":"Ada"}"#)).await;
    assert!(again.replayed());
    let other = send(&app, signup(r#"{"phone":"+15550100","name":"Eve"}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    for (body, status) in [
        (r#"{"name":"no phone"}"#, StatusCode::BAD_REQUEST),
        (r#"{"phone":null}"#, StatusCode::BAD_REQUEST),
        (r#"{"phone":5550100}"#, StatusCode::BAD_REQUEST),
        (r#"{"phone":"#, StatusCode::BAD_REQUEST),
    ] {
        assert_eq!(send(&app, signup(body)).await.status, status, "{body}");
    }
    let wrong_type = Request::post("/signup")
        .header("content-type", "text/plain")
        .body(Body::from(r#"{"phone":"+15550101"}"#))
        .unwrap();
    assert_eq!(
        send(&app, wrong_type).await.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    assert_eq!(probe.runs(), 1);
}

async fn fencing_tokens_grow_across_attempts(s: TestStore) {
    // Nothing is stored, so every request with the key runs: each attempt's fencing token is
    // greater than the one before, and the handler sees it.
    let (app, probe) = app(&s.store, |b| b.store_if(|_| false));
    let mut last = 0;
    for _ in 0..4 {
        let r = send(&app, post_key("/things", "fenced", "{}")).await;
        assert!(!r.replayed());
        let fence = r.json()["fence"].as_u64().unwrap();
        assert!(fence > last, "{fence} after {last}");
        last = fence;
    }
    assert_eq!(probe.runs(), 4);
}

/// The whole suite on a Redis Cluster (3 masters with a replica each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_on_a_redis_cluster() {
    let cluster = testkit::RedisCluster::start(3, 1).await;
    run_all(|name| TestStore::cluster(&cluster, name)).await;
}

/// The whole suite on a Sentinel-managed master, then a forced failover in the middle of a
/// request, then the suite again on the new master. With the replica check covering every
/// replica, a lease and a stored response survive the failover whichever replica is promoted:
/// the request in flight completes on the new master (its completion is retried within the
/// lease) and its retry is a replay. (Without it, or with fewer replicas acknowledging, a lease
/// can be lost in a failover: see `distlock::sentinel`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_on_sentinel_across_a_failover() {
    let group = testkit::RedisSentinel::start(2).await;
    run_all(|name| TestStore::sentinel(&group, name)).await;

    let s = TestStore::sentinel(&group, "failover").await;
    let (app, probe) = app(&s.store, |b| b);
    let before = send(&app, post_key("/things", "stored-before", "{}")).await;
    assert_eq!(before.status, StatusCode::CREATED);
    probe.close();
    let in_flight = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "in-flight", "{}")).await }
    });
    while probe.runs() < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    group.failover().await;
    probe.open();
    let finished = in_flight.await.unwrap();
    assert_eq!(finished.status, StatusCode::CREATED);
    // The same client follows the new master (after at most a few unavailable answers).
    let mut replay = None;
    for _ in 0..100 {
        let r = send(&app, post_key("/things", "stored-before", "{}")).await;
        if r.status != StatusCode::SERVICE_UNAVAILABLE {
            replay = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replay = replay.expect("the layer reaches the new master");
    assert!(
        replay.replayed(),
        "a response stored before the failover survives it"
    );
    assert_eq!(replay.body, before.body);
    let retry = send(&app, post_key("/things", "in-flight", "{}")).await;
    assert!(
        retry.replayed(),
        "the request in flight during the failover completed once"
    );
    assert_eq!(probe.runs(), 2);

    run_all(|name| TestStore::sentinel(&group, name)).await;
}
