//! Memory while streaming, in a process of its own (RSS is per process): a 100 MiB response
//! streams through the layer (Redis store, the record in Redis) while this process grows by far
//! less than the body: the layer holds a chunk at a time.

mod support;

use http_body_util::BodyExt;
use support::streaming::{Tokens, app, request};
use support::{TestStore, within};
use tower::ServiceExt;

/// Current RSS of this process, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// A 100 MiB response streams through the layer (Redis store, the record in Redis) while this
/// process grows by far less than the body: the layer holds a chunk at a time, not the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_stream_passes_with_bounded_memory() {
    let s = TestStore::redis("big-stream").await;
    let t = Tokens::new(true);
    let app = app(&s, &t, |b| b.chunk_size(64 * 1024).record_limit(128 << 20));
    let (addr, _server) = support::serve(app.clone()).await;
    let client = support::client();
    let mib: usize = 100;
    let mut req = request("/download", "big");
    *req.uri_mut() = format!("http://{addr}/download?mib={mib}").parse().unwrap();
    let before = rss();
    let response = within("the head", client.request(req)).await.unwrap();
    let mut body = response.into_body();
    let (mut len, mut peak) = (0usize, before);
    while let Some(frame) = within("a frame", body.frame()).await {
        len += frame.unwrap().into_data().map_or(0, |d| d.len());
        peak = peak.max(rss());
    }
    assert_eq!(len, mib << 20);
    let growth = peak.saturating_sub(before);
    // Buffering the body would grow it by 100 MiB at least; a chunk at a time stays in the
    // allocator's noise.
    assert!(
        growth < 24 << 20,
        "the process grew by {} MiB while 100 MiB passed",
        growth >> 20
    );
    // And the record is complete: a retry replays the 100 MiB part by part.
    let retry = app
        .clone()
        .oneshot(request("/download?mib=100", "big"))
        .await
        .unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let mut body = retry.into_body();
    let mut replayed = 0usize;
    while let Some(frame) = within("a replayed frame", body.frame()).await {
        replayed += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    assert_eq!(replayed, 100 << 20);
}
