//! The layer's behavioural suite, run against the in-memory store, a real Redis, a real Redis
//! Cluster, and a Sentinel-managed master across a forced failover.

#[macro_use]
mod support;

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use support::{Reply, TestStore, app, open_request, post_key, send, serve, wait_until, within};
use tower::ServiceExt;
use tower_idempotency::key::KeySourceExt;
use tower_idempotency::{OnConflict, Outcome, UnknownOutcome, key, principal};

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
        both_stores!($($name),*);
    };
}

suite!(
    a_retry_replays_the_stored_response_byte_for_byte,
    concurrent_duplicates_run_the_handler_once,
    waiting_duplicates_get_the_first_response,
    a_key_reused_for_another_request_is_refused,
    rejections_never_run_the_handler_or_store_anything,
    methods_not_covered_pass_through,
    the_handler_decides_what_a_retry_may_do,
    a_panicking_handler_leaves_an_unknown_outcome,
    a_body_that_breaks_off_leaves_an_unknown_outcome,
    a_dropped_request_still_completes,
    a_client_that_hangs_up_mid_handler_gets_the_replay,
    cancel_safe_handlers_can_opt_out,
    a_response_written_in_full_is_stored_when_cancellable,
    a_body_longer_than_its_head_announces_is_replayed_as_sent,
    a_body_shorter_than_its_head_announces_is_never_replayed_as_complete,
    a_body_that_goes_on_after_its_announced_length_is_stored_at_it,
    a_body_of_known_length_is_announced_as_without_the_layer,
    a_body_shorter_than_its_size_hint_is_never_replayed_as_complete,
    streamed_bodies_are_forwarded_and_stored,
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
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    while conflicts < 199 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {conflicts} of 199 duplicates answered 409 in time"
        );
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
    probe.started(1).await;
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
    probe.started(1).await;
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

async fn decide(app: &axum::Router, key: &str, query: &str) -> Reply {
    send(app, post_key(&format!("/decide?{query}"), key, "")).await
}

/// What a retry of a decided request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// The stored response.
    Stored,
    /// A second run.
    Released,
    /// An outcome-unknown problem.
    Unknown,
}
use Retry::{Released, Stored, Unknown};

async fn the_handler_decides_what_a_retry_may_do(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    // (query, what a retry gets): a 5xx is final unless the handler says otherwise (the work may
    // have committed); a 4xx is refused without effect (nothing stored, the retry runs) but 402
    // (a result) and 408 (a timeout cut the handler short: unknown); 503 is not processed.
    let cases = [
        ("status=500", Stored),
        ("status=201", Stored),
        ("status=502", Stored),
        ("status=402", Stored),
        ("status=422", Released),
        ("status=400", Released),
        ("status=404", Released),
        ("status=503", Released),
        ("status=429", Released),
        ("status=409", Released),
        ("status=401", Released),
        ("status=403", Released),
        ("status=408", Unknown),
        ("status=500&outcome=retryable", Released),
        ("status=201&outcome=retryable", Released),
        ("status=503&outcome=final", Stored),
        ("status=500&outcome=ctx-retryable", Released),
        ("status=429&outcome=ctx-final", Stored),
        ("status=422&outcome=ctx-final", Stored),
    ];
    for (i, (query, expected)) in cases.into_iter().enumerate() {
        let key = format!("decision-{i}");
        let runs = probe.runs();
        let first = decide(&app, &key, query).await;
        assert!(!first.replayed());
        let again = decide(&app, &key, query).await;
        assert_eq!(again.replayed(), expected != Released, "{query}: {again:?}");
        match expected {
            Stored => {
                assert_eq!(again.status, first.status, "{query}");
                assert_eq!(again.body, first.body, "{query}");
            }
            Unknown => assert_eq!(again.problem(), "outcome-unknown", "{query}"),
            Released => {}
        }
        let ran = if expected == Released { 2 } else { 1 };
        assert_eq!(probe.runs(), runs + ran, "{query}: run {ran} time(s)");
    }
    // A default rule of the user's own.
    let (app, probe) = app_with_default(&s.store);
    let first = decide(&app, "own-rule", "status=502").await;
    assert!(!first.replayed());
    assert!(!decide(&app, "own-rule", "status=502").await.replayed());
    assert_eq!(probe.runs(), 2);
}

fn app_with_default(store: &tower_idempotency::Store) -> (axum::Router, support::Probe) {
    app(store, |b| {
        b.default_outcome(|status| match status.as_u16() {
            502 => Outcome::Retryable,
            _ => tower_idempotency::outcome::default_outcome(status),
        })
    })
}

async fn a_panicking_handler_leaves_an_unknown_outcome(s: TestStore) {
    // Default: the panic may have come after a side effect, so it is never run again; retries
    // get outcome-unknown with the attempt's fence.
    let (app, probe) = app(&s.store, |b| b);
    let crashed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/panics", "p", "")).await }
    });
    assert!(
        within("the panic", crashed).await.unwrap_err().is_panic(),
        "the panic reaches the caller, as without the layer"
    );
    let retry = send(&app, post_key("/panics", "p", "")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR, "{retry:?}");
    assert_eq!(retry.problem(), "outcome-unknown");
    assert!(retry.replayed());
    assert!(retry.json()["fence"].as_u64().unwrap() >= 1);
    assert_eq!(probe.runs(), 1);

    // Release: the key is freed, the retry runs again.
    let (app, probe) = support::app(&s.store, |b| b.on_unknown_outcome(UnknownOutcome::Release));
    let crashed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/panics", "p2", "")).await }
    });
    assert!(within("the panic", crashed).await.unwrap_err().is_panic());
    let retry = send(&app, post_key("/panics", "p2", "")).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(probe.runs(), 2);

    // A panic in the application's own outcome policy, after the handler ran: the same as a
    // handler's (before, the key was released and the retry ran the handler again).
    let (app, probe) = support::app(&s.store, |b| {
        b.default_outcome(|status| {
            assert_ne!(status, StatusCode::CREATED, "a bug in the outcome policy");
            Outcome::Final
        })
    });
    let crashed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "p3", "{}")).await }
    });
    assert!(within("the panic", crashed).await.unwrap_err().is_panic());
    let retry = send(&app, post_key("/things", "p3", "{}")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR, "{retry:?}");
    assert_eq!(retry.problem(), "outcome-unknown");
    assert_eq!(probe.runs(), 1, "the handler ran; it is never run again");
}

async fn a_body_that_breaks_off_leaves_an_unknown_outcome(s: TestStore) {
    for (how, policy, rerun) in [
        ("fail", UnknownOutcome::Record, false),
        ("fail", UnknownOutcome::Release, true),
        ("panic", UnknownOutcome::Record, false),
    ] {
        let (app, probe) = app(&s.store, |b| b.on_unknown_outcome(policy));
        let key = format!("broken-{how}-{policy:?}");
        let path = format!("/stream?{how}=true");
        let response = app
            .clone()
            .oneshot(post_key(&path, &key, ""))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            response.into_body().collect().await.is_err(),
            "{how}: the client sees an aborted body, never a complete short one"
        );
        let retry = app
            .clone()
            .oneshot(post_key(&path, &key, ""))
            .await
            .unwrap();
        let replayed = retry.headers().contains_key("idempotent-replayed");
        if rerun {
            assert!(!replayed, "{policy:?}: released, so the retry runs again");
            assert!(
                retry.into_body().collect().await.is_err(),
                "and breaks off again"
            );
            assert_eq!(probe.runs(), 2);
        } else {
            assert!(replayed, "{how}");
            assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
            let body = retry.into_body().collect().await.unwrap().to_bytes();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert!(
                problem["type"]
                    .as_str()
                    .unwrap()
                    .ends_with("outcome-unknown")
            );
            assert_eq!(probe.runs(), 1, "{how}");
        }
    }
}

async fn a_dropped_request_still_completes(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    probe.close();
    let abandoned = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "gone", "{}")).await }
    });
    probe.started(1).await;
    abandoned.abort(); // The response future is dropped mid-handler.
    let _ = abandoned.await;
    // In flight still: the handler runs on.
    let meanwhile = send(&app, post_key("/things", "gone", "{}")).await;
    assert_eq!(meanwhile.status, StatusCode::CONFLICT, "{meanwhile:?}");
    assert_eq!(meanwhile.problem(), "conflict");
    probe.open();
    wait_until("the detached handler finished", || probe.finished() == 1).await;
    let retry = within(
        "the retry",
        send_until_not_conflict(&app, || post_key("/things", "gone", "{}")),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "the abandoned execution stored its outcome"
    );
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(probe.runs(), 1);
}

/// Sends until the answer is not a 409 (the execution may still be storing its outcome).
async fn send_until_not_conflict(app: &axum::Router, request: impl Fn() -> Request<Body>) -> Reply {
    loop {
        let reply = send(app, request()).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn a_client_that_hangs_up_mid_handler_gets_the_replay(s: TestStore) {
    // Through axum::serve and a real socket: the client closes the connection while the
    // handler runs (as a client that times out does), then retries with the same key.
    let (app, probe) = app(&s.store, |b| {
        b.on_conflict(OnConflict::Wait(Duration::from_secs(20)))
    });
    let (addr, _server) = serve(app).await;
    probe.close();
    let connection = open_request(addr, "/things", "hangup", "{}").await;
    probe.started(1).await;
    drop(connection);
    // The retry arrives while the first execution still runs: it waits for it, and replays.
    let retry = tokio::spawn(async move {
        let client = support::client();
        support::http(&client, addr, post_key("/things", "hangup", "{}")).await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    probe.open();
    let retry = within("the retry", retry).await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(
        probe.runs(),
        1,
        "one execution for the hang-up and its retry"
    );
}

async fn cancel_safe_handlers_can_opt_out(s: TestStore) {
    let (app, probe) = app(&s.store, |b| {
        b.cancel_on_disconnect(true)
            .on_conflict(OnConflict::Wait(Duration::from_secs(20)))
    });
    probe.close();
    let abandoned = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "cancel", "{}")).await }
    });
    probe.started(1).await;
    abandoned.abort();
    let _ = abandoned.await;
    probe.open();
    // The handler was cancelled and the key released: the retry runs it again.
    let retry = send(&app, post_key("/things", "cancel", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(retry.json()["run"], 2);
    assert_eq!(probe.finished(), 1, "the first run never finished");

    // Inline, a streamed body is driven by the client's reads: read to its end, it is stored...
    let first = send(&app, post_key("/stream", "cancel-stream", "")).await;
    let again = send(&app, post_key("/stream", "cancel-stream", "")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    // ...dropped half-way, the execution is cancelled and the key released.
    let runs = probe.runs();
    let response = app
        .clone()
        .oneshot(post_key("/stream", "cancel-drop", ""))
        .await
        .unwrap();
    let mut body = response.into_body();
    let frame = within("the first chunk", body.frame()).await;
    assert!(frame.is_some_and(|f| f.is_ok()));
    drop(body);
    // A retry that arrives before the release lands may join the cancelled stream: it gets an
    // aborted body (never a short complete one) and retries; then the handler runs again.
    let deadline = tokio::time::Instant::now() + support::DEADLINE;
    loop {
        let response = app
            .clone()
            .oneshot(post_key("/stream", "cancel-drop", ""))
            .await
            .unwrap();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status();
        let body = response.into_body().collect().await;
        if !replayed && status == StatusCode::OK && body.is_ok() {
            break;
        }
        assert!(
            replayed && body.is_err() || status == StatusCode::CONFLICT,
            "a join of the cancelled stream breaks off: {status} {replayed}"
        );
        assert!(tokio::time::Instant::now() < deadline, "never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        probe.runs(),
        runs + 2,
        "cancelled: nothing was stored, it ran again"
    );
}

async fn a_response_written_in_full_is_stored_when_cancellable(s: TestStore) {
    // With cancel_on_disconnect the client's reads drive the execution. A head that announces
    // the body's length lets the server finish writing the response before the handler's body
    // has ended (here 20 ms before), and hyper then drops the body without reading it to its
    // end: the client has the whole response, so its outcome must still be stored.
    let (app, probe) = app(&s.store, |b| {
        b.cancel_on_disconnect(true)
            .on_conflict(OnConflict::Wait(Duration::from_secs(20)))
    });
    let (addr, _server) = serve(app).await;
    let client = support::client();
    let path = "/stream?length=true";
    let first = support::http(&client, addr, post_key(path, "sized-stream", "")).await;
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    let expected: String = (0..10).map(|i| format!("run 1 part {i};")).collect();
    assert_eq!(first.body, expected);
    let again = support::http(&client, addr, post_key(path, "sized-stream", "")).await;
    assert!(again.replayed(), "the outcome was not stored: {again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(probe.runs(), 1, "the handler ran again");
}

/// The stream app served in one execution mode, a retry waiting for the execution's end; and a
/// client.
async fn serve_streams(
    s: &TestStore,
    cancel: bool,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<()>,
    support::Client,
    support::Probe,
) {
    let (app, probe) = app(&s.store, |b| {
        b.cancel_on_disconnect(cancel)
            .on_conflict(OnConflict::Wait(Duration::from_secs(20)))
    });
    let (addr, server) = serve(app).await;
    (addr, server, support::client(), probe)
}

/// The whole body `/stream` sends in its first run.
fn first_run_parts() -> String {
    (0..10).map(|i| format!("run 1 part {i};")).collect()
}

/// A head announcing fewer bytes than the body has: the server sends what it announced, and the
/// client has a complete-looking response of that length. A retry gets that response, byte for
/// byte, not the longer body the handler produced (in either execution mode).
async fn a_body_longer_than_its_head_announces_is_replayed_as_sent(s: TestStore) {
    for cancel in [false, true] {
        // The client has its response while the handler still streams what is never sent: the
        // retry waits for the execution's end.
        let (addr, _server, client, probe) = serve_streams(&s, cancel).await;
        let path = "/stream?length=true&off=-12";
        let key = format!("long-{cancel}");
        let first = support::http(&client, addr, post_key(path, &key, "")).await;
        assert_eq!(first.status, StatusCode::OK, "{first:?}");
        let whole = first_run_parts();
        assert_eq!(
            first.body,
            whole[..whole.len() - 12],
            "the announced length"
        );
        let again = support::http(&client, addr, post_key(path, &key, "")).await;
        assert!(again.replayed(), "cancel {cancel}: not stored: {again:?}");
        assert_eq!(
            again.body, first.body,
            "cancel {cancel}: what the client got"
        );
        assert_eq!(probe.runs(), 1, "the handler ran again");
    }
}

/// A head announcing more bytes than the body has: the server aborts the response, the client
/// sees an incomplete body. A retry must not get a complete-looking short response: the
/// outcome is unknown (500, outcome-unknown), and the handler does not run again.
async fn a_body_shorter_than_its_head_announces_is_never_replayed_as_complete(s: TestStore) {
    for cancel in [false, true] {
        let (addr, _server, client, probe) = serve_streams(&s, cancel).await;
        let path = "/stream?length=true&off=7";
        let key = format!("short-{cancel}");
        let mut request = post_key(path, &key, "");
        *request.uri_mut() = format!("http://{addr}{path}").parse().unwrap();
        let response = within("the head", client.request(request)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let read = within("the body", response.into_body().collect()).await;
        assert!(
            read.is_err(),
            "cancel {cancel}: the client sees the body break off"
        );
        let again = support::http(&client, addr, post_key(path, &key, "")).await;
        assert_eq!(
            again.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "cancel {cancel}: never the short body as a success: {again:?}"
        );
        assert_eq!(
            again.json()["type"]
                .as_str()
                .map(|t| t.ends_with("outcome-unknown")),
            Some(true),
            "{again:?}"
        );
        assert_eq!(probe.runs(), 1, "the handler ran again");
    }
}

/// A body that knows its length (an exact size hint, no `content-length` header: a `String`,
/// `Bytes`, `Json`) is announced with it, as the server announces it without the layer, to
/// the first client and in the replay, also when it is over a chunk (streamed into the store).
/// Before, the first client of a body over 64 KiB got it chunked, and its replay with a length.
async fn a_body_of_known_length_is_announced_as_without_the_layer(s: TestStore) {
    for cancel in [false, true] {
        let (addr, _server, client, probe) = serve_streams(&s, cancel).await;
        for len in [10, 70_000] {
            let path = format!("/sized?len={len}");
            let key = format!("known-{cancel}-{len}");
            let first = support::http(&client, addr, post_key(&path, &key, "")).await;
            assert_eq!(first.status, StatusCode::OK, "{first:?}");
            assert_eq!(first.body.len(), len);
            assert_eq!(
                first
                    .headers
                    .get("content-length")
                    .map(|v| v.to_str().unwrap()),
                Some(len.to_string().as_str()),
                "cancel {cancel}, {len} bytes: the first response's length: {:?}",
                first.headers
            );
            let again = support::http(&client, addr, post_key(&path, &key, "")).await;
            assert!(again.replayed(), "{again:?}");
            assert_eq!(again.body, first.body);
            assert_eq!(
                again.headers["content-length"],
                first.headers["content-length"]
            );
        }
        assert_eq!(probe.runs(), 2, "cancel {cancel}: each ran once");
    }
}

/// A body that ends short of the length its size hint promised: without the layer the server
/// announces the hint and aborts the response where the body ends; so does the layer, and a
/// retry is told the outcome is unknown, never replayed the short body as complete. Before,
/// the layer stored and sent the short body as a complete response.
async fn a_body_shorter_than_its_size_hint_is_never_replayed_as_complete(s: TestStore) {
    for cancel in [false, true] {
        let (addr, _server, client, probe) = serve_streams(&s, cancel).await;
        let path = "/sized?len=50&off=50";
        let key = format!("hint-short-{cancel}");
        let mut request = post_key(path, &key, "");
        *request.uri_mut() = format!("http://{addr}{path}").parse().unwrap();
        // The body ends before the head is written: the connection closes with nothing or
        // with the head and a body that breaks off, as without the layer; never a complete
        // response.
        let read = match within("the head", client.request(request)).await {
            Ok(response) => within("the body", response.into_body().collect())
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        };
        assert!(
            read.is_err(),
            "cancel {cancel}: a complete response: {read:?}"
        );
        let again = support::http(&client, addr, post_key(path, &key, "")).await;
        assert_eq!(
            again.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "cancel {cancel}: never the short body as a success: {again:?}"
        );
        assert_eq!(again.problem(), "outcome-unknown");
        assert_eq!(probe.runs(), 1, "the handler ran again");
    }
}

/// A body that never ends after the length its head announces (a server stops reading it
/// there): the client has the whole response, and so does the record; the retry gets it.
async fn a_body_that_goes_on_after_its_announced_length_is_stored_at_it(s: TestStore) {
    for cancel in [false, true] {
        let (addr, _server, client, probe) = serve_streams(&s, cancel).await;
        let path = "/stream?length=true&hang=true";
        let key = format!("hang-{cancel}");
        let first = support::http(&client, addr, post_key(path, &key, "")).await;
        assert_eq!(first.body, first_run_parts());
        let again = within(
            "the retry",
            support::http(&client, addr, post_key(path, &key, "")),
        )
        .await;
        assert!(again.replayed(), "cancel {cancel}: not stored: {again:?}");
        assert_eq!(again.body, first.body);
        assert_eq!(probe.runs(), 1, "the handler ran again");
    }
}

async fn streamed_bodies_are_forwarded_and_stored(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b);
    let first = send(&app, post_key("/stream", "s", "")).await;
    assert_eq!(first.status, StatusCode::OK);
    let expected: String = (0..10).map(|i| format!("run 1 part {i};")).collect();
    assert_eq!(first.body, expected);
    let again = send(&app, post_key("/stream", "s", "")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(probe.runs(), 1);
}

async fn a_lost_lease_stores_nothing(s: TestStore) {
    // No renewal and a short lease: a slow handler outlives its lease. (Long enough that its
    // command timeout leaves room for the Sentinel store's replica check: see
    // `TestStore::sentinel`.)
    let lock = distlock::LockConfig::builder()
        .lease(Duration::from_secs(2))
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
    probe.started(1).await;
    // A retry waits; when the slow holder's lease expires it takes over, runs, and completes.
    let retry = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/things", "slow", "{}")).await }
    });
    probe.started(2).await;
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

/// A user as an authentication layer establishes it (here from `x-user`, with a token in
/// `authorization` that changes on refresh).
#[derive(Clone)]
struct User(String);

async fn authenticate(
    mut request: Request<Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let user = request
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    if let Some(user) = user {
        request
            .extensions_mut()
            .insert(serde_json::json!({ "sub": user.clone() }));
        request.extensions_mut().insert(User(user));
    }
    next.run(request).await
}

async fn keys_are_scoped_to_the_principal(s: TestStore) {
    for how in ["extension", "claim"] {
        let (app, probe) = app(&s.store, |b| match how {
            "extension" => b.principal(principal::extension(|u: &User| u.0.clone())),
            _ => b.principal(principal::claim("sub")),
        });
        let app = app.layer(axum::middleware::from_fn(authenticate));
        let as_user = |who: &str, token: &str| {
            let mut r = post_key("/things", &format!("shared-key-{how}"), "{}");
            r.headers_mut().insert("x-user", who.parse().unwrap());
            r.headers_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            r
        };
        let alice = send(&app, as_user("alice", "t1")).await;
        let bob = send(&app, as_user("bob", "t2")).await;
        assert!(!bob.replayed(), "{how}: bob never gets alice's response");
        assert_ne!(alice.body, bob.body);
        let refreshed = send(&app, as_user("alice", "t3-after-refresh")).await;
        assert!(
            refreshed.replayed(),
            "{how}: a refreshed token is the same user"
        );
        assert_eq!(refreshed.body, alice.body);
        assert_eq!(probe.runs(), 2);
        // No principal (the layer before authentication, say): refused, not shared.
        let anonymous = send(
            &app,
            post_key("/things", &format!("shared-key-{how}"), "{}"),
        )
        .await;
        assert_eq!(anonymous.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(anonymous.problem(), "principal-missing");
        assert_eq!(probe.runs(), 2);
    }
}

async fn a_response_too_large_to_store_is_not_run_again(s: TestStore) {
    let (app, probe) = app(&s.store, |b| b.record_limit(1000));
    let first = send(&app, post_key("/big", "big", "")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.len(), 6000, "the client gets the whole body");
    let retry = send(&app, post_key("/big", "big", "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.problem(), "response-not-stored");
    assert_eq!(
        retry.status,
        StatusCode::GONE,
        "never a 2xx with a body the handler did not produce"
    );
    assert_eq!(retry.json()["original_status"], 200);
    assert_eq!(probe.runs(), 1);
    // Stored headers are kept on the problem (a Location tells where the result is).
    let (app, _) = support::app(&s.store, |b| b.record_limit(10));
    let first = decide(&app, "located", "status=201").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = decide(&app, "located", "status=201").await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.json()["original_status"], 201);
    assert_eq!(retry.headers["location"], first.headers["location"]);
    assert_eq!(retry.headers["content-type"], "application/problem+json");
    // Headers that describe the stored body describe nothing of the problem that replaces
    // it: a client that decodes `content-encoding: gzip` would fail on plain JSON (before:
    // copied onto the 410).
    let first = decide(&app, "encoded", "status=200&representation=true").await;
    assert_eq!(first.headers["content-encoding"], "gzip");
    let retry = decide(&app, "encoded", "status=200&representation=true").await;
    assert_eq!(retry.status, StatusCode::GONE);
    for name in [
        "content-encoding",
        "content-language",
        "etag",
        "last-modified",
    ] {
        assert!(
            !retry.headers.contains_key(name),
            "{name} on the problem: {:?}",
            retry.headers
        );
    }
    assert!(
        retry.headers.contains_key("location"),
        "{:?}",
        retry.headers
    );
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
    // Another request about the same phone number (a key that names a thing) runs: the
    // application answers it; each is replayed to its own resends.
    let other = send(&app, signup(r#"{"phone":"+15550100","name":"Eve"}"#)).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert!(!other.replayed());
    let first_again = send(&app, signup(r#"{"phone":"+15550100","name":"Ada"}"#)).await;
    assert_eq!(
        (first_again.replayed(), &first_again.body),
        (true, &first.body)
    );
    let other_again = send(&app, signup(r#"{"phone":"+15550100","name":"Eve"}"#)).await;
    assert_eq!(
        (other_again.replayed(), &other_again.body),
        (true, &other.body)
    );
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
    assert_eq!(probe.runs(), 2);
    // A key the client generates in the body is a per-request key: another body is refused.
    let (by_client, probe) =
        support::app(&s.store, |b| b.key(key::json("/k").unwrap().per_request()));
    let first = send(&by_client, signup(r#"{"k":"x-1","amount":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(&by_client, signup(r#"{"k":"x-1","amount":2}"#)).await;
    assert_eq!(other.problem(), "key-reused");
    assert_eq!(probe.runs(), 1);
}

async fn fencing_tokens_grow_across_attempts(s: TestStore) {
    // Nothing is stored, so every request with the key runs: each attempt's fencing token is
    // greater than the one before, and the handler sees it.
    let (app, probe) = app(&s.store, |b| b.default_outcome(|_| Outcome::Retryable));
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
    probe.started(2).await;
    group.failover().await;
    probe.open();
    let finished = in_flight.await.unwrap();
    assert_eq!(finished.status, StatusCode::CREATED);
    // The same client follows the new master (after at most a few unavailable answers).
    let mut replay = None;
    for _ in 0..400 {
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

/// A full in-memory store: stored outcomes make room for new keys (the oldest first), requests
/// in flight are never evicted, and when every entry is in flight a new key is answered 503
/// `store-full` (with `Retry-After`) without running the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_store_evicts_outcomes_never_requests_in_flight() {
    // Each key takes two entries while in flight (lease and state), one once stored. With
    // fail-open too: it is for a store that cannot be reached, and a full one still answers
    // 503 (before: the handler ran unprotected, and a duplicate of it ran again).
    for open in [false, true] {
        let store =
            tower_idempotency::Store::memory_with(distlock::MemoryLimits::new(4, 1 << 20).unwrap());
        let (svc, probe) = app(&store, |b| b.fail_open(open));
        probe.close();
        let first: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|key| {
                let svc = svc.clone();
                tokio::spawn(async move { send(&svc, post_key("/things", key, "{}")).await })
            })
            .collect();
        probe.started(2).await;
        let third = {
            let svc = svc.clone();
            tokio::spawn(async move { send(&svc, post_key("/things", "c", "{}")).await })
        };
        support::wait_until("the third request answered or ran", || {
            third.is_finished() || probe.runs() > 2
        })
        .await;
        assert_eq!(
            probe.runs(),
            2,
            "fail_open {open}: the third request ran, unprotected"
        );
        let full = within("the third request", third).await.unwrap();
        assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE, "{full:?}");
        assert_eq!(full.problem(), "store-full");
        assert!(full.headers.contains_key("retry-after"), "{full:?}");
        assert_eq!(probe.runs(), 2, "the refused request did not run");
        probe.open();
        for reply in first {
            let reply = within("a request in flight", reply).await.unwrap();
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        }
        let c = send(&svc, post_key("/things", "c", "{}")).await;
        assert_eq!(
            c.status,
            StatusCode::CREATED,
            "room once they are stored: {c:?}"
        );
    }

    // A record the store cannot hold even empty (a 6 KB response, a 4 KiB budget) evicts no
    // stored outcome on its way to being refused (before: every one went first, and each of
    // their retries ran its handler again). Since the record limit on the in-memory store is a
    // quarter of its bytes it is not kept by that limit, before the store is asked; the store's
    // own refusal is distlock's `what_cannot_fit_evicts_nothing`.
    for unknown in [UnknownOutcome::Record, UnknownOutcome::Release] {
        let store =
            tower_idempotency::Store::memory_with(distlock::MemoryLimits::new(100, 4096).unwrap());
        let (svc, probe) = app(&store, |b| b.on_unknown_outcome(unknown));
        for key in ["a", "b", "c"] {
            let reply = send(&svc, post_key("/things", key, "{}")).await;
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        }
        let big = send(&svc, post_key("/big", "big", "")).await;
        assert_eq!(big.status, StatusCode::OK, "the client gets it: {big:?}");
        for key in ["a", "b", "c"] {
            let again = send(&svc, post_key("/things", key, "{}")).await;
            assert!(again.replayed(), "{key} kept: {again:?}");
            assert_eq!(probe.runs_of(key), 1, "{key} ran once");
        }
        // The refused record's outcome is known (200, the client has it all): it is stored
        // without its body, so the retry is told so, with the status and the stored headers
        // (before: "outcome unknown"; and with `UnknownOutcome::Release`, a second run). Not
        // an unknown outcome, so not released in either mode.
        let again = send(&svc, post_key("/big", "big", "")).await;
        assert_eq!(again.status, StatusCode::GONE, "{unknown:?}: {again:?}");
        assert_eq!(again.problem(), "response-not-stored");
        assert_eq!(again.json()["original_status"], 200, "{again:?}");
        assert_eq!(again.headers["location"], big.headers["location"]);
        // The refused record's `grpc-status` trailer is kept with the replacement.
        assert_eq!(again.json()["original_grpc_status"], 0, "{again:?}");
        assert!(
            !again.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain"),
            "no header of the body it replaces: {again:?}"
        );
        assert_eq!(
            probe.runs(),
            4,
            "{unknown:?}: a, b, c and big each ran once"
        );
    }

    // A streamed record, appended part by part, evicts no stored outcome for a body it cannot
    // keep: the memory store's record limit is at most a quarter of its bytes (before: the
    // default 64 MiB on a 256 KiB store; a 300 KiB stream in 1 KiB chunks evicted every outcome on its way to
    // being refused, and each of their retries ran its handler again).
    let store = tower_idempotency::Store::memory_with(
        distlock::MemoryLimits::new(100, 256 * 1024).unwrap(),
    );
    let (svc, probe) = app(&store, |b| b.chunk_size(1024));
    let keys = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
    for key in keys {
        let reply = send(&svc, post_key("/things", key, "{}")).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let big = send(&svc, post_key("/download?kib=300", "big", "")).await;
    assert_eq!(big.status, StatusCode::OK, "{big:?}");
    assert_eq!(big.body.len(), 300 * 1024, "the client gets it all");
    for key in keys {
        let again = send(&svc, post_key("/things", key, "{}")).await;
        assert!(again.replayed(), "{key} kept: {again:?}");
        assert_eq!(probe.runs_of(key), 1, "{key} ran once");
    }
    let again = send(&svc, post_key("/download?kib=300", "big", "")).await;
    assert_eq!(again.status, StatusCode::GONE, "{again:?}");
    assert_eq!(again.problem(), "response-not-stored");
    assert_eq!(probe.runs(), keys.len() + 1, "each key ran once");

    // Eviction order, on a store of three entries: the oldest stored outcome goes first.
    let store =
        tower_idempotency::Store::memory_with(distlock::MemoryLimits::new(3, 1 << 20).unwrap());
    let (svc, probe) = app(&store, |b| b);
    for key in ["a", "b", "c"] {
        // "c" needs two entries in flight: "a", the oldest outcome, is evicted for it.
        let reply = send(&svc, post_key("/things", key, "{}")).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let b = send(&svc, post_key("/things", "b", "{}")).await;
    assert!(b.replayed(), "kept: {b:?}");
    let c = send(&svc, post_key("/things", "c", "{}")).await;
    assert!(c.replayed(), "kept: {c:?}");
    let a = send(&svc, post_key("/things", "a", "{}")).await;
    assert!(!a.replayed(), "the oldest outcome was evicted: {a:?}");
    assert_eq!(
        (probe.runs_of("a"), probe.runs_of("b"), probe.runs_of("c")),
        (2, 1, 1)
    );
}
