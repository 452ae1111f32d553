//! The streaming app the streaming tests share: an LLM-style endpoint of server-sent events
//! held at a gate, and a large download.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::Semaphore;
use tower_idempotency::{IdempotencyLayer, IdempotencyLayerBuilder, KeepBody, OnConflict};

use super::{SECRET, TestStore, within};

/// The streaming endpoints' state: runs, and a gate each event after the first waits at.
#[derive(Clone)]
pub struct Tokens {
    pub runs: Arc<AtomicUsize>,
    pub finished: Arc<AtomicUsize>,
    pub gate: Arc<Semaphore>,
}

impl Tokens {
    pub fn new(open: bool) -> Self {
        let gate = Arc::new(Semaphore::new(0));
        if open {
            gate.add_permits(Semaphore::MAX_PERMITS / 2);
        }
        Tokens {
            runs: Arc::default(),
            finished: Arc::default(),
            gate,
        }
    }

    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }

    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[derive(serde::Deserialize)]
pub struct TokensQuery {
    #[serde(default = "ten")]
    n: usize,
    #[serde(default)]
    trailers: bool,
    #[serde(default)]
    not_kept: bool,
    /// Milliseconds before anything (the body is not ready at its first poll).
    #[serde(default)]
    delay: u64,
}

fn ten() -> usize {
    10
}

pub fn event(run: usize, i: usize) -> Bytes {
    Bytes::from(format!("event: token\ndata: run {run} token {i}\n\n"))
}

/// An LLM-style stream: `n` server-sent events; the first at once, each next one after a
/// permit of the gate and a few milliseconds (so the layer appends them one by one); trailers
/// at the end when asked.
pub async fn tokens(State(t): State<Tokens>, Query(q): Query<TokensQuery>) -> Response {
    let run = t.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let gate = t.gate.clone();
    let finished = t.finished.clone();
    let frames = futures_util::stream::unfold(0usize, move |i| {
        let gate = gate.clone();
        let finished = finished.clone();
        async move {
            if i > q.n {
                return None;
            }
            if i == 0 && q.delay > 0 {
                tokio::time::sleep(Duration::from_millis(q.delay)).await;
            }
            if i == q.n {
                finished.fetch_add(1, Ordering::SeqCst);
                if !q.trailers {
                    return None;
                }
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-tokens", q.n.to_string().parse().unwrap());
                // As a gRPC response ends (the layer names it when the body is not kept).
                trailers.insert("grpc-status", "0".parse().unwrap());
                return Some((Ok::<_, Infallible>(Frame::trailers(trailers)), i + 1));
            }
            if i > 0 {
                gate.acquire().await.unwrap().forget();
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            Some((Ok(Frame::data(event(run, i))), i + 1))
        }
    });
    let mut response = (
        [("content-type", "text/event-stream")],
        Body::new(StreamBody::new(frames)),
    )
        .into_response();
    if q.not_kept {
        response.extensions_mut().insert(KeepBody::No);
    }
    if q.trailers {
        // HTTP/1.1 servers (hyper) send only the trailer fields the head declares.
        response.headers_mut().insert(
            "trailer",
            http::HeaderValue::from_static("x-tokens, grpc-status"),
        );
    }
    response
}

/// `mib` MiB in 64 KiB chunks, all ready at once (a run, counted with the streams').
async fn download(State(t): State<Tokens>, Query(q): Query<DownloadQuery>) -> Response {
    t.runs.fetch_add(1, Ordering::SeqCst);
    static CHUNK: [u8; 64 * 1024] = [b'x'; 64 * 1024];
    let chunks: Vec<Bytes> = if q.one_frame {
        vec![Bytes::from(vec![b'x'; q.mib << 20])]
    } else {
        (0..q.mib * 16)
            .map(|_| Bytes::from_static(&CHUNK))
            .collect()
    };
    let chunks = futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|c| Ok::<_, Infallible>(Frame::data(c))),
    );
    let mut response = Body::new(StreamBody::new(chunks)).into_response();
    if q.not_kept {
        response.extensions_mut().insert(KeepBody::No);
    }
    if q.length {
        response
            .headers_mut()
            .insert(http::header::CONTENT_LENGTH, (q.mib << 20).into());
    }
    response
}

#[derive(serde::Deserialize)]
pub struct DownloadQuery {
    mib: usize,
    #[serde(default)]
    not_kept: bool,
    /// Announce the length (`content-length`) instead of a chunked body.
    #[serde(default)]
    length: bool,
    /// The whole body in one frame (with no size hint: a stream's).
    #[serde(default)]
    one_frame: bool,
}

pub fn app(
    s: &TestStore,
    tokens_state: &Tokens,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> Router {
    let layer = configure(
        IdempotencyLayer::builder(s.store.clone())
            .secret(SECRET)
            .unwrap()
            .global_keys()
            .chunk_size(1024)
            .on_conflict(OnConflict::Wait(Duration::from_secs(20))),
    )
    .build()
    .unwrap();
    Router::new()
        .route("/tokens", post(tokens))
        .route("/download", post(download))
        .layer(layer)
        .with_state(tokens_state.clone())
}

pub fn request(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

pub fn all_events(run: usize, n: usize) -> Bytes {
    let mut out = Vec::new();
    for i in 0..n {
        out.extend_from_slice(&event(run, i));
    }
    Bytes::from(out)
}

/// Reads a body to its end: its bytes and trailers, or the error it broke off with.
pub async fn read_all(body: Body) -> Result<(Bytes, Option<http::HeaderMap>), String> {
    let collected = within("the body", body.collect())
        .await
        .map_err(|e| e.to_string())?;
    let trailers = collected.trailers().cloned();
    Ok((collected.to_bytes(), trailers))
}
