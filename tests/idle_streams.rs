//! The memory an open stream costs while it is idle: an LLM-style endpoint holds thousands of
//! streams open at once, each sending a token now and then. In a test binary of its own: it
//! counts the live heap bytes of the whole process, which other tests would disturb.

mod support;

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::handler::Handler;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use peak_alloc::PeakAlloc;
use support::streaming::{self, Tokens};
use support::{DEADLINE, SECRET, TestStore, within};
use tower_idempotency::IdempotencyLayer;

/// Counts the process's live heap bytes.
#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

fn live() -> isize {
    HEAP.current_usage() as isize
}

/// Streams held open at once.
const STREAMS: usize = 32;

/// The chunk size of the layer under test (its default).
const CHUNK: usize = 64 * 1024;

/// The live heap once it has stopped changing: unchanged over 200 ms (the idle flush of a
/// stream's first event, 10 ms after it, included), within [`DEADLINE`].
async fn settled_heap() -> isize {
    let started = Instant::now();
    let mut last = live();
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = live();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= Duration::from_millis(200) {
            return now;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the heap never settled: {now} bytes live"
        );
    }
}

/// Streams held open by [`idle_streams`]: the heap they hold, per stream; each response with
/// the bytes read of it; the server's address.
struct Idle {
    held: isize,
    open: Vec<(http::Response<hyper::body::Incoming>, Bytes)>,
    addr: std::net::SocketAddr,
}

/// Opens [`STREAMS`] streams of `path` on `router`, each on a connection of its own, and reads
/// at least the first `first` bytes of each (what the handler sends before its gate). The
/// streams stay open, idle at the gate.
async fn idle_streams(router: Router, path: &str, first: usize, tag: &str) -> Idle {
    let (addr, _server) = support::serve(router).await;
    let mut senders = Vec::new();
    for _ in 0..STREAMS {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        senders.push(sender);
    }
    let before = settled_heap().await;
    let mut open = Vec::new();
    for (i, sender) in senders.iter_mut().enumerate() {
        let request = http::Request::post(format!("http://{addr}{path}"))
            .header("idempotency-key", format!("{tag}-{i}"))
            .body(Body::empty())
            .unwrap();
        let mut response = within("the head of a stream", sender.send_request(request))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut read = Vec::new();
        while read.len() < first {
            let frame = within("the first bytes", response.body_mut().frame())
                .await
                .expect("the first bytes")
                .unwrap()
                .into_data()
                .unwrap();
            read.extend_from_slice(&frame);
        }
        open.push((response, Bytes::from(read)));
    }
    let held = (settled_heap().await - before) / STREAMS as isize;
    // The connections stay open with their bodies (the senders are dropped: no more requests).
    Idle { held, open, addr }
}

/// Reads the rest of each body to its end: the whole bodies.
async fn finish(open: Vec<(http::Response<hyper::body::Incoming>, Bytes)>) -> Vec<Vec<u8>> {
    let mut bodies = Vec::new();
    for (response, first) in open {
        let rest = within("a stream's end", response.into_body().collect())
            .await
            .unwrap()
            .to_bytes();
        bodies.push([first, rest].concat());
    }
    bodies
}

/// Holds [`STREAMS`] streams of `path` open and idle (after their first `first` bytes) with
/// `handler` bare, then behind the layer on `s`: asserts that the layer holds less than half a
/// chunk per idle stream, then lets the streams end and checks that they were stored (a retry
/// is the first client's body, replayed).
async fn compare<H, T>(s: &TestStore, handler: H, path: &str, first: usize)
where
    H: Handler<T, Tokens>,
    T: 'static,
{
    let route = path.split('?').next().unwrap_or(path);
    let tokens = Tokens::new(false);
    let bare = Router::new()
        .route(route, post(handler.clone()))
        .with_state(tokens.clone());
    let without = idle_streams(bare, path, first, "bare").await;
    tokens.open();
    finish(without.open).await;
    let without = without.held;

    let tokens = Tokens::new(false);
    let layer = IdempotencyLayer::builder(s.store.clone())
        .secret(SECRET)
        .unwrap()
        .global_keys()
        .chunk_size(CHUNK)
        .build()
        .unwrap();
    let layered = Router::new()
        .route(route, post(handler))
        .layer(layer)
        .with_state(tokens.clone());
    let Idle { held, open, addr } = idle_streams(layered, path, first, "layered").await;
    let layer = held - without;
    assert!(
        layer < (CHUNK / 2) as isize,
        "{path}: the layer holds {layer} bytes per idle stream (without it: {without}), a chunk is {CHUNK}"
    );
    tokens.open();
    let bodies = finish(open).await;
    let client = support::client();
    let retry = support::http(&client, addr, streaming::request(path, "layered-7")).await;
    assert_eq!(retry.status, 200);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, bodies[7]);
    assert_eq!(tokens.runs(), STREAMS);
}

/// An open stream idle between two events holds no chunk-sized buffer: the chunk being filled
/// grows with the data it holds. Before, every streamed response kept a buffer of the chunk
/// size (64 KiB) from its head to its end, and a new one after each idle flush: 32 idle
/// streams cost 2 MiB, 10,000 would cost 640 MiB. The streams are still stored: once they end,
/// a retry is the first client's body, replayed.
async fn an_idle_stream_holds_no_chunk_sized_buffer(s: TestStore) {
    let first = streaming::event(1, 0).len();
    compare(&s, streaming::tokens, "/tokens?n=3", first).await;
}

/// One frame of exactly a chunk, then nothing until the gate opens, then the end.
async fn block(State(t): State<Tokens>) -> Response {
    t.runs.fetch_add(1, Ordering::SeqCst);
    let gate = t.gate.clone();
    let frames = futures_util::stream::unfold(0, move |i| {
        let gate = gate.clone();
        async move {
            if i > 0 {
                gate.acquire().await.unwrap().forget();
                return None;
            }
            let frame = Frame::data(Bytes::from(vec![b'x'; CHUNK]));
            Some((Ok::<_, Infallible>(frame), 1))
        }
    });
    Body::new(StreamBody::new(frames)).into_response()
}

/// A stream idle right after a frame that filled a chunk holds no chunk-sized buffer either:
/// the next chunk's buffer, made full for a steady stream, is given back in the pause. Before,
/// such a stream held it until its next frame (a download whose frames divide the chunk size,
/// from a slow source). On Redis: the memory store keeps the record itself in the process.
async fn an_idle_stream_after_a_full_chunk_holds_no_chunk_sized_buffer(s: TestStore) {
    compare(&s, block, "/block", CHUNK).await;
}

/// Every case in one test: the heap is the process's, and tests of one binary run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_hold_no_chunk_sized_buffer() {
    an_idle_stream_holds_no_chunk_sized_buffer(TestStore::memory().await).await;
    an_idle_stream_holds_no_chunk_sized_buffer(TestStore::redis("idle_streams").await).await;
    an_idle_stream_after_a_full_chunk_holds_no_chunk_sized_buffer(
        TestStore::redis("idle_streams_full").await,
    )
    .await;
}
