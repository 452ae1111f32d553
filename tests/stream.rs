//! Streaming responses through the layer: the first event reaches the client before the
//! handler finishes; the record is appended as the body passes; a duplicate joins the live
//! stream and gets the same bytes; a client that leaves mid-stream gets the whole stream on
//! retry; trailers round-trip; a record the layer cannot finish reading breaks the body off
//! (never a complete short one); a 100 MiB response passes while the layer holds only a chunk.

#[macro_use]
mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use http_body_util::BodyExt;
use support::streaming::{Tokens, all_events, app, event, read_all, request};
use support::{TestStore, wait_until, within};
use tower::ServiceExt;

fn app_with_limit(s: &TestStore, t: &Tokens, limit: usize) -> axum::Router {
    app(s, t, |b| b.record_limit(limit))
}

async fn the_first_event_arrives_before_the_handler_finishes(s: TestStore) {
    let t = Tokens::new(false);
    let (addr, _server) = support::serve(app(&s, &t, |b| b)).await;
    let client = support::client();
    let mut req = request("/tokens", "ttfb");
    *req.uri_mut() = format!("http://{addr}/tokens").parse().unwrap();
    let response = within("the head", client.request(req)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = within("the first event", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), event(1, 0));
    assert_eq!(
        t.finished.load(Ordering::SeqCst),
        0,
        "the handler is still streaming"
    );
    t.open();
    let rest = within("the rest", body.collect()).await.unwrap().to_bytes();
    assert_eq!(rest.len(), all_events(1, 10).len() - event(1, 0).len());
}

async fn a_joiner_gets_the_same_bytes_live_and_after_the_end(s: TestStore) {
    let t = Tokens::new(false);
    let app = app(&s, &t, |b| b);
    let first = app
        .clone()
        .oneshot(request("/tokens", "join"))
        .await
        .unwrap();
    let mut first_body = first.into_body();
    let head = within("the first event", first_body.frame())
        .await
        .unwrap()
        .unwrap();
    // Let the layer append the head and the first event.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let joiner = within(
        "the joiner's head",
        app.clone().oneshot(request("/tokens", "join")),
    )
    .await
    .unwrap();
    assert_eq!(joiner.status(), StatusCode::OK);
    assert_eq!(joiner.headers()["idempotent-replayed"], "true");
    assert_eq!(joiner.headers()["content-type"], "text/event-stream");
    let mut joiner_body = joiner.into_body();
    let joined_first = within("the joiner's first event", joiner_body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(joined_first.into_data().unwrap(), event(1, 0));
    assert_eq!(
        t.finished.load(Ordering::SeqCst),
        0,
        "joined before the end"
    );
    t.open();
    let (rest, _) = read_all(Body::new(first_body)).await.unwrap();
    let (joined_rest, _) = read_all(Body::new(joiner_body)).await.unwrap();
    let mut whole = head.into_data().unwrap().to_vec();
    whole.extend_from_slice(&rest);
    assert_eq!(whole, all_events(1, 10));
    let mut joined = event(1, 0).to_vec();
    joined.extend_from_slice(&joined_rest);
    assert_eq!(joined, whole, "the joiner got the same bytes");
    // After the end: the replay, part by part.
    let after = app
        .clone()
        .oneshot(request("/tokens", "join"))
        .await
        .unwrap();
    assert_eq!(after.headers()["idempotent-replayed"], "true");
    let (replayed, _) = read_all(after.into_body()).await.unwrap();
    assert_eq!(replayed, whole);
    assert_eq!(t.runs(), 1);
}

async fn a_client_that_leaves_mid_stream_gets_the_whole_stream_on_retry(s: TestStore) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = Tokens::new(false);
    let (addr, _server) = support::serve(app(&s, &t, |b| b)).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(b"POST /tokens HTTP/1.1\r\nhost: x\r\nidempotency-key: leave\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("token 0") {
        let mut buf = [0u8; 1024];
        let n = within("the first event on the socket", socket.read(&mut buf))
            .await
            .unwrap();
        assert!(n > 0, "the connection closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(socket); // the client gives up mid-stream
    tokio::time::sleep(Duration::from_millis(50)).await;
    t.open();
    let client = support::client();
    let retry = support::http(&client, addr, request("/tokens", "leave")).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.replayed());
    assert_eq!(retry.body, all_events(1, 10), "the whole stream, once");
    assert_eq!(t.runs(), 1);
    wait_until("the execution finished", || {
        t.finished.load(Ordering::SeqCst) == 1
    })
    .await;
}

async fn trailers_round_trip(s: TestStore) {
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| b);
    let first = app
        .clone()
        .oneshot(request("/tokens?n=3&trailers=true", "trailers"))
        .await
        .unwrap();
    let (body, trailers) = read_all(first.into_body()).await.unwrap();
    assert_eq!(trailers.unwrap()["x-tokens"], "3");
    let again = app
        .clone()
        .oneshot(request("/tokens?n=3&trailers=true", "trailers"))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let (replayed, replayed_trailers) = read_all(again.into_body()).await.unwrap();
    assert_eq!(replayed, body);
    assert_eq!(replayed_trailers.unwrap()["x-tokens"], "3");
    assert_eq!(t.runs(), 1);
}

async fn a_body_not_kept_is_never_replayed_as_a_success(s: TestStore) {
    // The handler opts out; and another stream goes over the record limit mid-way, with a
    // joiner following it: the joiner's body breaks off, retries get 410.
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| b);
    let first = app
        .clone()
        .oneshot(request("/tokens?not_kept=true", "opt-out"))
        .await
        .unwrap();
    let (body, _) = read_all(first.into_body()).await.unwrap();
    assert_eq!(body, all_events(1, 10), "the client gets it all");
    let retry = support::send(&app, request("/tokens?not_kept=true", "opt-out")).await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.problem(), "response-not-stored");
    assert_eq!(retry.json()["original_status"], 200);
    // The same for a streamed body with no data at all (not ready at once, then only
    // trailers): not kept either (it was stored as a 200 with an empty body).
    let first = app
        .clone()
        .oneshot(request(
            "/tokens?not_kept=true&n=0&trailers=true&delay=30",
            "opt-out-empty",
        ))
        .await
        .unwrap();
    let (body, trailers) = read_all(first.into_body()).await.unwrap();
    assert!(body.is_empty());
    assert_eq!(trailers.unwrap()["x-tokens"], "0");
    let retry = support::send(
        &app,
        request(
            "/tokens?not_kept=true&n=0&trailers=true&delay=30",
            "opt-out-empty",
        ),
    )
    .await;
    assert_eq!(retry.status, StatusCode::GONE, "{retry:?}");
    assert_eq!(retry.problem(), "response-not-stored");
    // Its trailers were kept with the outcome: a gRPC client learns its `grpc-status`.
    assert_eq!(retry.json()["original_grpc_status"], 0, "{retry:?}");

    let t = Tokens::new(false);
    let app_limited = app_with_limit(&s, &t, 200);
    let first = app_limited
        .clone()
        .oneshot(request("/tokens?trailers=true", "over"))
        .await
        .unwrap();
    let mut first_body = first.into_body();
    within("the first event", first_body.frame())
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let joiner = app_limited
        .clone()
        .oneshot(request("/tokens?trailers=true", "over"))
        .await
        .unwrap();
    t.open();
    let (rest, _) = read_all(Body::new(first_body)).await.unwrap();
    assert!(!rest.is_empty(), "the first client gets the whole body");
    assert!(
        read_all(joiner.into_body()).await.is_err(),
        "the joiner cannot get the body the record did not keep: it breaks off"
    );
    let retry = support::send(&app_limited, request("/tokens?trailers=true", "over")).await;
    assert_eq!(retry.status, StatusCode::GONE);
    // Over the limit after parts were appended: the end keeps the `grpc-status` trailer.
    assert_eq!(retry.json()["original_grpc_status"], 0, "{retry:?}");
    assert_eq!(t.runs(), 1);
}

/// In `cancel_on_disconnect` mode the client's reads drive the execution. Over a socket, hyper
/// drops a response body right after writing its trailers, without reading it to its end: the
/// client has the whole response, so its outcome must still be stored and a retry replayed.
async fn trailers_written_over_a_socket_are_stored_when_cancellable(s: TestStore) {
    trailers_over_a_socket(s, false).await;
}

/// The same over HTTP/2 (prior knowledge, as gRPC clients speak it): the server sends the
/// trailers as the stream's last frame and stops reading the body; the outcome is stored.
async fn trailers_over_http2_are_stored_when_cancellable(s: TestStore) {
    trailers_over_a_socket(s, true).await;
}

async fn trailers_over_a_socket(s: TestStore, http2: bool) {
    let t = Tokens::new(true);
    let (addr, _server) = support::serve(app(&s, &t, |b| b.cancel_on_disconnect(true))).await;
    let client: support::Client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(http2)
            .build_http();
    let key = if http2 {
        "h2-trailers"
    } else {
        "socket-trailers"
    };
    let send = || {
        let mut req = request("/tokens", key);
        *req.uri_mut() = format!("http://{addr}/tokens?n=3&trailers=true")
            .parse()
            .unwrap();
        // HTTP/1.1 carries trailers only to a client that says it takes them.
        req.headers_mut()
            .insert("te", http::HeaderValue::from_static("trailers"));
        client.request(req)
    };
    let first = within("the response", send()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    if http2 {
        assert_eq!(first.version(), http::Version::HTTP_2);
    }
    let (body, trailers) = read_all(Body::new(first.into_body())).await.unwrap();
    assert_eq!(body, all_events(1, 3));
    assert_eq!(trailers.expect("trailers")["x-tokens"], "3");
    let again = within("the retry", send()).await.unwrap();
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the outcome was not stored: {again:?}"
    );
    let replay_head = format!("{:?}", again.headers());
    let (replayed, replayed_trailers) = read_all(Body::new(again.into_body())).await.unwrap();
    assert_eq!(replayed, body);
    let replayed_trailers =
        replayed_trailers.unwrap_or_else(|| panic!("no trailers replayed: {replay_head}"));
    assert_eq!(replayed_trailers["x-tokens"], "3");
    assert_eq!(t.runs(), 1, "the handler ran again");
}

/// A body whole at once, with trailers (a small gRPC-like answer, served over HTTP/1.1 to a
/// client that takes trailers): hyper sends it chunked, with its trailers, without the layer.
/// Through the layer the first response and the replay must keep them. Before, a whole body
/// announced its exact length, hyper wrote a `content-length` and dropped the trailers.
async fn trailers_of_a_body_whole_at_once_reach_an_http1_client(s: TestStore) {
    async fn answer() -> axum::response::Response {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", http::HeaderValue::from_static("c-1"));
        let frames = futures_util::stream::iter([
            Ok::<_, std::io::Error>(http_body::Frame::data(bytes::Bytes::from_static(b"paid"))),
            Ok(http_body::Frame::trailers(trailers)),
        ]);
        let mut response =
            axum::response::Response::new(Body::new(http_body_util::StreamBody::new(frames)));
        response.headers_mut().insert(
            http::header::TRAILER,
            http::HeaderValue::from_static("x-checksum"),
        );
        response
    }
    let layer = tower_idempotency::IdempotencyLayer::builder(s.store.clone())
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let with = axum::Router::new()
        .route("/pay", axum::routing::post(answer))
        .layer(layer);
    let without = axum::Router::new().route("/pay", axum::routing::post(answer));
    let (with, _a) = support::serve(with).await;
    let (without, _b) = support::serve(without).await;
    let client = support::client();
    let send = |addr: std::net::SocketAddr| {
        let mut req = request("/pay", "whole-trailers");
        *req.uri_mut() = format!("http://{addr}/pay").parse().unwrap();
        req.headers_mut()
            .insert("te", http::HeaderValue::from_static("trailers"));
        client.request(req)
    };
    for (what, addr) in [
        ("without the layer", without),
        ("the first response", with),
        ("the replay", with),
    ] {
        let response = within("the response", send(addr)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{what}");
        let head = format!("{:?}", response.headers());
        let (body, trailers) = read_all(Body::new(response.into_body())).await.unwrap();
        assert_eq!(body, "paid", "{what}");
        assert_eq!(
            trailers.as_ref().and_then(|t| t.get("x-checksum")),
            Some(&http::HeaderValue::from_static("c-1")),
            "{what}: no trailers ({head})"
        );
    }
}

/// A raw HTTP/1.1 `POST` of `target` with idempotency key `key` (and `extra` header lines)
/// from a socket with a small receive window, so that the server's buffers fill after a few
/// MiB: the socket, and what it read up to the response's head (a 200).
async fn small_window_post(
    addr: std::net::SocketAddr,
    target: &str,
    key: &str,
    extra: &str,
) -> (tokio::net::TcpStream, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let request = format!(
        "POST {target} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\ncontent-length: 0\r\n{extra}\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 1024];
    let n = within("the head on the socket", stream.read(&mut head))
        .await
        .unwrap();
    head.truncate(n);
    assert!(head.starts_with(b"HTTP/1.1 200"), "{target}: {head:?}");
    (stream, head)
}

/// A client that stops reading a large streamed response without closing its connection (a
/// phone that lost its network: the server's TCP retransmits for many minutes) must not hold the
/// execution, and with it the key, for as long as its connection lives: once a frame has waited
/// `stall_timeout` for it, the response is no longer sent to it and the execution goes on,
/// storing the outcome. The retry, on another connection while the first is still open, gets
/// the whole response. (Fails with the timeout out of reach: the execution waits on the first
/// client, and the retry follows it no further than where it stopped.)
async fn a_client_that_stops_reading_does_not_hold_the_key(s: TestStore) {
    use tokio::io::AsyncReadExt;
    const MIB: usize = 16;
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| {
        b.chunk_size(64 * 1024)
            .stall_timeout(Duration::from_millis(300))
    });
    let (addr, _server) = support::serve(app).await;
    let (mut stalled, _) =
        small_window_post(addr, &format!("/download?mib={MIB}"), "stall", "").await;
    // From here on the first client reads nothing, and keeps its connection open.
    let client = support::client();
    let mut retry = request(&format!("/download?mib={MIB}"), "stall");
    *retry.uri_mut() = format!("http://{addr}/download?mib={MIB}").parse().unwrap();
    let response = within("the retry's head", client.request(retry))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let body = within("the retry's whole body", response.into_body().collect())
        .await
        .expect("the retry's body broke off")
        .to_bytes();
    assert_eq!(body.len(), MIB << 20);
    assert!(body.iter().all(|b| *b == b'x'));
    assert_eq!(t.runs(), 1);
    // The first client, reading on, gets what was sent to it, and a body that breaks off (its
    // connection closed without the chunked body's end), never a complete-looking short one.
    let mut rest = Vec::new();
    within(
        "the stalled connection's end",
        stalled.read_to_end(&mut rest),
    )
    .await
    .unwrap();
    assert!(rest.len() < MIB << 20, "{} bytes", rest.len());
    assert!(
        !rest.ends_with(b"\r\n0\r\n\r\n"),
        "a short body ended as complete"
    );
}

/// A body that will not be kept cannot be replayed: its client, however long it pauses, is
/// never given up (its retry would get 410, and it would have nothing). Opted out
/// (`KeepBody::No`), announced (`content-length`) over the record limit, or over it in the
/// frames read before the head went out: a client that stops reading for three times the
/// stall timeout, then reads on, gets the whole response (it broke off at about 3 MB when the
/// stall timeout applied to it; for a body over the limit in its first frame, until
/// 2026-11-23).
async fn a_client_pausing_on_a_body_not_kept_gets_it_all(s: TestStore) {
    use tokio::io::AsyncReadExt;
    const MIB: usize = 16;
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| {
        // A limit above what the buffers between the execution and a paused client hold
        // (about 3 MB here): the client is paused long before the body crosses it.
        b.chunk_size(64 * 1024)
            .record_limit(8 << 20)
            .stall_timeout(Duration::from_millis(300))
    });
    let (addr, _server) = support::serve(app).await;
    for (query, key, end) in [
        ("not_kept=true", "pause-opted-out", &b"\r\n0\r\n\r\n"[..]),
        ("length=true", "pause-over-limit", &b"xxxx"[..]),
        ("one_frame=true", "pause-one-frame", &b"\r\n0\r\n\r\n"[..]),
    ] {
        let target = format!("/download?mib={MIB}&{query}");
        let (mut paused, mut received) =
            small_window_post(addr, &target, key, "connection: close\r\n").await;
        tokio::time::sleep(Duration::from_millis(900)).await;
        within(
            "the rest, to the connection's end",
            paused.read_to_end(&mut received),
        )
        .await
        .unwrap();
        assert!(
            received.len() > MIB << 20,
            "{query}: {} bytes",
            received.len()
        );
        assert!(
            received.ends_with(end),
            "{query}: the body broke off before its end"
        );
    }
    assert_eq!(t.runs(), 3);
}

both_stores!(
    the_first_event_arrives_before_the_handler_finishes,
    trailers_of_a_body_whole_at_once_reach_an_http1_client,
    trailers_over_http2_are_stored_when_cancellable,
    trailers_written_over_a_socket_are_stored_when_cancellable,
    a_joiner_gets_the_same_bytes_live_and_after_the_end,
    a_client_that_leaves_mid_stream_gets_the_whole_stream_on_retry,
    trailers_round_trip,
    a_body_not_kept_is_never_replayed_as_a_success,
    a_client_that_stops_reading_does_not_hold_the_key,
    a_client_pausing_on_a_body_not_kept_gets_it_all,
);

/// The writer's lease is lost mid-stream (no renewal, a short lease): it appends nothing more,
/// its completion is refused, a joiner's body breaks off, and a retry runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_mid_stream_stops_the_record_and_breaks_joiners_off() {
    let s = TestStore::redis("lost-mid-stream").await;
    let t = Tokens::new(false);
    let lock = distlock::LockConfig::builder()
        .lease(Duration::from_millis(400))
        .watchdog(false)
        .build()
        .unwrap();
    let app = app(&s, &t, |b| b.lock_config(lock));
    let first = app
        .clone()
        .oneshot(request("/tokens", "lost"))
        .await
        .unwrap();
    let mut first_body = first.into_body();
    within("the first event", first_body.frame())
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let joiner = app
        .clone()
        .oneshot(request("/tokens", "lost"))
        .await
        .unwrap();
    assert_eq!(joiner.headers()["idempotent-replayed"], "true");
    // The lease runs out while the handler waits at the gate.
    let joined = read_all(joiner.into_body()).await;
    assert!(
        joined.is_err(),
        "the joiner sees its stream break off: {joined:?}"
    );
    t.open();
    let (rest, _) = read_all(Body::new(first_body)).await.unwrap();
    assert!(
        !rest.is_empty(),
        "the first client still gets its whole body"
    );
    let retry = support::send(&app, request("/tokens", "lost")).await;
    assert!(!retry.replayed(), "nothing was stored by the lost lease");
    assert_eq!(t.runs(), 2);
}

/// The one streamed record `s` holds in Redis: a connection to its server, the key of its parts
/// list, and the parts.
async fn stored_parts(
    s: &TestStore,
) -> (::redis::aio::MultiplexedConnection, String, Vec<Vec<u8>>) {
    use ::redis::AsyncCommands;
    let mut r = s.server.as_ref().unwrap().connection().await;
    let lists: Vec<String> = r
        .keys(format!("{}:*:parts", s.store.client().prefix()))
        .await
        .unwrap();
    assert_eq!(lists.len(), 1, "{lists:?}");
    let parts: Vec<Vec<u8>> = r.lrange(&lists[0], 0, -1).await.unwrap();
    (r, lists[0].clone(), parts)
}

/// A stored streamed record replayed to an HTTP/1.0 client (nginx speaks HTTP/1.0 to its
/// upstreams by default), whose body breaks off (a part altered in Redis): such a client has no
/// chunked encoding to tell a break from an end, so the replay announces its length, known from
/// the record's end, and a short body is visible as short (before: no `content-length`, and
/// the connection's close read as a complete short 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_breaks_off_is_visible_to_an_http_1_0_client() {
    use ::redis::AsyncCommands;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestStore::redis("http10-replay").await;
    let t = Tokens::new(true);
    let (addr, _server) = support::serve(app(&s, &t, |b| b)).await;
    let post = || async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request =
            "POST /tokens HTTP/1.0\r\nidempotency-key: http10\r\ncontent-length: 0\r\n\r\n";
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut all = Vec::new();
        within("the response to its end", stream.read_to_end(&mut all))
            .await
            .unwrap();
        let at = all
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head");
        let head = String::from_utf8_lossy(&all[..at]).to_lowercase();
        (head, all[at + 4..].to_vec())
    };
    let (head, whole) = post().await;
    assert!(
        head.starts_with("http/1.0 200") || head.starts_with("http/1.1 200"),
        "{head}"
    );
    assert!(!whole.is_empty());
    let (mut r, list, parts) = stored_parts(&s).await;
    assert!(parts.len() > 9, "three batches: {}", parts.len());
    // A part of the last batch altered: the first batches go out, then the body breaks off.
    let late = parts.len() - 2;
    let mut altered = parts[late].clone();
    altered[10] ^= 1;
    let _: () = r.lset(&list, late as isize, &altered).await.unwrap();
    let (head, body) = post().await;
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert!(
        !body.is_empty() && body.len() < whole.len(),
        "{} of {}",
        body.len(),
        whole.len()
    );
    assert!(
        head.contains(&format!("content-length: {}", whole.len())),
        "a body of {} bytes where {} were stored, and nothing in the head to tell: {head}",
        body.len(),
        whole.len()
    );
    assert_eq!(t.runs(), 1, "never run again");
}

/// A stored streamed record whose parts are altered, swapped or missing in Redis is reported:
/// the body breaks off, never a complete short one; the handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_or_missing_chunk_is_reported_never_replayed_short() {
    use ::redis::AsyncCommands;
    let s = TestStore::redis("corrupt-chunk").await;
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| b);
    let first = app
        .clone()
        .oneshot(request("/tokens", "corrupt"))
        .await
        .unwrap();
    let (whole, _) = read_all(first.into_body()).await.unwrap();
    let (mut r, list, parts) = stored_parts(&s).await;
    assert!(parts.len() >= 4, "head, chunks, end: {}", parts.len());
    let replay = || async {
        let response = app
            .clone()
            .oneshot(request("/tokens", "corrupt"))
            .await
            .unwrap();
        if response.status() == StatusCode::INTERNAL_SERVER_ERROR {
            // Reported before any body: record-unreadable.
            let body = read_all(response.into_body()).await.unwrap().0;
            assert!(String::from_utf8_lossy(&body).contains("record-unreadable"));
            return Err("record-unreadable".to_owned());
        }
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        read_all(response.into_body()).await
    };
    assert_eq!(replay().await.unwrap().0, whole, "intact: replayed whole");
    // A chunk altered.
    let mut altered = parts[1].clone();
    let last = altered.len() - 1;
    altered[last] ^= 1;
    let _: () = r.lset(&list, 1, &altered).await.unwrap();
    assert!(
        replay().await.is_err(),
        "an altered chunk breaks the body off"
    );
    // Two chunks swapped.
    let _: () = r.lset(&list, 1, &parts[2]).await.unwrap();
    let _: () = r.lset(&list, 2, &parts[1]).await.unwrap();
    assert!(replay().await.is_err(), "swapped chunks break the body off");
    // A chunk altered in the last batch, read ahead while the first batches were being sent.
    let _: () = r.lset(&list, 1, &parts[1]).await.unwrap();
    let _: () = r.lset(&list, 2, &parts[2]).await.unwrap();
    assert!(
        parts.len() > 9,
        "the record spans three batches of four parts: {}",
        parts.len()
    );
    let late = parts.len() - 2;
    let mut altered = parts[late].clone();
    altered[10] ^= 1;
    let _: () = r.lset(&list, late as isize, &altered).await.unwrap();
    assert!(
        replay().await.is_err(),
        "an altered chunk in a batch read ahead breaks the body off"
    );
    let _: () = r.lset(&list, late as isize, &parts[late]).await.unwrap();
    assert_eq!(replay().await.unwrap().0, whole, "restored: replayed whole");
    // A chunk missing (the list shorter than the record says).
    let _: i64 = r.lrem(&list, 1, &parts[2]).await.unwrap();
    let missing = replay().await;
    assert_eq!(
        missing,
        Err("record-unreadable".to_owned()),
        "a missing chunk"
    );
    assert_eq!(t.runs(), 1, "never run again");
}
