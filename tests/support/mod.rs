//! Test support for the layer: a service whose handlers count their executions and can be held
//! at a gate, and stores on memory or a real Redis.

#![allow(dead_code, unreachable_pub, unused_macros)]

/// Defines, for each scenario `async fn name(s: TestStore)` of the including file, a test on
/// the memory store (`memory::name`), one on a real Redis (`redis::name`) and, with the
/// `postgres` feature, one on a real PostgreSQL (`postgres::name`). The file declares
/// `#[macro_use] mod support;` and has `TestStore` in scope.
macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
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
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::TestStore::postgres(stringify!($name)).await).await;
                }
            )*
        }
    };
}

pub mod streaming;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Query;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use distlock::LockClient;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use testkit::RedisServer;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, Outcome, Store,
};

/// The server secret of the layers under test.
pub const SECRET: &[u8] = b"test secret: 32 bytes, not used for anything real";

/// How long any test waits for something that should happen soon.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Waits until `cond` holds, checking every few milliseconds; fails the test with `what` if it
/// does not within [`DEADLINE`].
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {DEADLINE:?} for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Awaits `future` for at most [`DEADLINE`]; fails the test with `what` otherwise.
pub async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

/// Counts handler runs (in all and per key); a closed gate holds handlers until opened.
#[derive(Clone)]
pub struct Probe {
    pub runs: Arc<AtomicUsize>,
    /// Handler runs that got past the gate and returned their response.
    pub finished: Arc<AtomicUsize>,
    pub by_key: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    pub gate: Arc<Semaphore>,
    pub gated: Arc<std::sync::atomic::AtomicBool>,
}

impl Probe {
    fn new() -> Self {
        Probe {
            runs: Arc::new(AtomicUsize::new(0)),
            finished: Arc::new(AtomicUsize::new(0)),
            by_key: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            gated: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// Waits (with a deadline) until `n` handler runs have started.
    pub async fn started(&self, n: usize) {
        wait_until(&format!("{n} handler run(s) started"), || self.runs() >= n).await;
    }

    /// Handlers wait at the gate until [`open`](Self::open).
    pub fn close(&self) {
        self.gated.store(true, Ordering::SeqCst);
    }

    pub fn open(&self) {
        self.gated.store(false, Ordering::SeqCst);
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }

    /// Runs per key (the `Idempotency-Key` header, or "" without one).
    pub fn runs_of(&self, key: &str) -> usize {
        self.by_key.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub fn max_runs_per_key(&self) -> usize {
        self.by_key
            .lock()
            .unwrap()
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }

    fn count_key(&self, headers: &HeaderMap) {
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        *self.by_key.lock().unwrap().entry(key).or_default() += 1;
    }

    async fn enter(&self) -> usize {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if self.gated.load(Ordering::SeqCst) {
            self.gate.acquire().await.unwrap().forget();
        }
        n
    }
}

async fn create(
    State(p): State<Probe>,
    ctx: Option<IdempotencyContext>,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    p.count_key(&headers);
    let run = p.enter().await;

    let held = ctx
        .as_ref()
        .and_then(|c| c.lease())
        .is_some_and(|l| l.is_held());
    let fence = ctx.as_ref().and_then(IdempotencyContext::fence);
    p.finished.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        [
            ("x-run", run.to_string()),
            ("set-cookie", format!("session={run}")),
            ("location", format!("/things/{run}")),
        ],
        axum::Json(serde_json::json!({
            "run": run,
            "fence": fence,
            "held_at_end": held,
            "echo": String::from_utf8_lossy(&body),
        })),
    )
}

/// 500 on the first run, 201 afterwards.
async fn flaky(State(p): State<Probe>) -> impl IntoResponse {
    let run = p.enter().await;
    if run == 1 {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failed run {run}"),
        )
    } else {
        (StatusCode::CREATED, format!("ok run {run}"))
    }
}

async fn status_from_body(State(p): State<Probe>, body: Bytes) -> impl IntoResponse {
    let run = p.enter().await;
    let code: u16 = std::str::from_utf8(&body).unwrap().trim().parse().unwrap();
    (
        StatusCode::from_u16(code).unwrap(),
        format!("status {code} run {run}"),
    )
}

/// A 6 KB body, with a `grpc-status` trailer (as a gRPC call ends: kept with an outcome
/// stored without its body).
async fn big(State(p): State<Probe>) -> impl IntoResponse {
    let run = p.enter().await;
    let chunk = format!("run {run};").repeat(1000);
    let body = http_body_util::Full::new(Bytes::from(chunk)).with_trailers(async {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        Some(Ok(trailers))
    });
    (
        StatusCode::OK,
        [("location", format!("/big/{run}"))],
        Body::new(body),
    )
}

async fn panics(State(p): State<Probe>) -> &'static str {
    let run = p.enter().await;
    if run == 1 {
        panic!("handler panic on the first run");
    }
    "ok"
}

/// Answers 201 without echoing anything of the request.
async fn quiet(State(p): State<Probe>) -> impl IntoResponse {
    let run = p.enter().await;
    p.finished.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("created {run}"))
}

#[derive(serde::Deserialize)]
pub struct Decide {
    status: u16,
    /// `final` or `retryable` in a response extension, `ctx-final` or `ctx-retryable` through
    /// the context; nothing: the default rule.
    outcome: Option<String>,
    /// On `true`, the response also describes its representation: `content-encoding: gzip`
    /// (the body is not really compressed), `content-language`, `etag`, `last-modified`.
    #[serde(default)]
    representation: bool,
}

/// Answers `?status=` with the decision `?outcome=` (see [`Decide`]).
async fn decide(
    State(p): State<Probe>,
    ctx: Option<IdempotencyContext>,
    Query(q): Query<Decide>,
) -> Response {
    let run = p.enter().await;
    let mut response = (
        StatusCode::from_u16(q.status).unwrap(),
        [("location", format!("/things/{run}"))],
        format!("status {} run {run}", q.status),
    )
        .into_response();
    if q.representation {
        let headers = response.headers_mut();
        for (name, value) in [
            ("content-encoding", "gzip"),
            ("content-language", "en"),
            ("etag", "\"v1\""),
            ("last-modified", "Sun, 22 Nov 2026 10:00:00 GMT"),
        ] {
            headers.insert(name, http::HeaderValue::from_static(value));
        }
    }
    match q.outcome.as_deref() {
        Some("final") => {
            response.extensions_mut().insert(Outcome::Final);
        }
        Some("retryable") => {
            response.extensions_mut().insert(Outcome::Retryable);
        }
        Some("ctx-final") => ctx.unwrap().set_outcome(Outcome::Final),
        Some("ctx-retryable") => ctx.unwrap().set_outcome(Outcome::Retryable),
        _ => {}
    }
    p.finished.fetch_add(1, Ordering::SeqCst);
    response
}

/// Streams `run N part i;` ten times, 20 ms apart, then (on `?fail=true`) breaks off with an
/// error or (on `?panic=true`) panics; 20 ms after the last part it ends. On `?length=true` the
/// head announces the body's length (`content-length`), so the server has written the whole
/// response 20 ms before the body ends; `&off=N` announces N bytes more (or, negative, fewer)
/// than the body has, as a handler with a bug would; `?hang=true` never ends the body after its
/// last part.
async fn stream(State(p): State<Probe>, Query(q): Query<StreamQuery>) -> Response {
    let run = p.enter().await;
    let length: usize = (0..10).map(|i| format!("run {run} part {i};").len()).sum();
    let frames = futures_util::stream::iter(0..11).then(move |i| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if i < 10 {
            Ok(http_body::Frame::data(Bytes::from(format!(
                "run {run} part {i};"
            ))))
        } else if q.fail {
            Err(std::io::Error::other("the body broke off"))
        } else if q.panic {
            panic!("the body panics half-way");
        } else if q.hang {
            std::future::pending::<()>().await;
            Ok(http_body::Frame::data(Bytes::new()))
        } else if let Some(status) = q.grpc_status {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", status.into());
            Ok(http_body::Frame::trailers(trailers))
        } else {
            Ok(http_body::Frame::data(Bytes::new()))
        }
    });
    let body = Body::new(http_body_util::StreamBody::new(frames));
    let mut response = (StatusCode::OK, body).into_response();
    if q.grpc_status.is_some() {
        // HTTP/1.1 sends only the trailers a response declares.
        response
            .headers_mut()
            .insert(http::header::TRAILER, "grpc-status".parse().unwrap());
    }
    if q.length {
        let announced = length.saturating_add_signed(q.off);
        response
            .headers_mut()
            .insert(http::header::CONTENT_LENGTH, announced.into());
    }
    response
}

#[derive(serde::Deserialize)]
pub struct StreamQuery {
    #[serde(default)]
    fail: bool,
    #[serde(default)]
    panic: bool,
    #[serde(default)]
    length: bool,
    #[serde(default)]
    off: isize,
    #[serde(default)]
    hang: bool,
    /// Ends the body with a `grpc-status` trailer.
    #[serde(default)]
    grpc_status: Option<u16>,
}

/// The service under test, with the layer configured by `configure`.
pub fn app(
    store: &Store,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> (Router, Probe) {
    let probe = Probe::new();
    (app_with(store, &probe, configure), probe)
}

/// The service under test with a layer built by the test itself.
pub fn app_with_layer(layer: IdempotencyLayer) -> (Router, Probe) {
    let probe = Probe::new();
    (routes().layer(layer).with_state(probe.clone()), probe)
}

fn routes() -> Router<Probe> {
    Router::new()
        .route("/things", post(create).get(create))
        .route("/signup", post(create))
        .route("/flaky", post(flaky))
        .route("/status", post(status_from_body))
        .route("/big", post(big))
        .route("/panics", post(panics))
        .route("/quiet", post(quiet))
        .route("/decide", post(decide))
        .route("/stream", post(stream))
        .route("/download", post(download))
        .route("/sized", post(sized))
}

#[derive(serde::Deserialize)]
struct SizedQuery {
    len: usize,
    /// How many bytes more (or fewer) than it has the body says it has.
    #[serde(default)]
    off: i64,
}

/// `len` bytes in one frame, in a body whose size hint says it has exactly `len + off` and no
/// `content-length` header: servers announce such a hint as the length (axum's routes and
/// hyper both do).
async fn sized(State(p): State<Probe>, Query(q): Query<SizedQuery>) -> Response {
    p.enter().await;
    let hint = (q.len as u64).saturating_add_signed(q.off);
    let data = Some(Bytes::from(vec![b'x'; q.len]));
    Body::new(Hinted { data, hint }).into_response()
}

/// A body of one frame with an exact size hint of its own (see [`sized`]).
struct Hinted {
    data: Option<Bytes>,
    hint: u64,
}

impl http_body::Body for Hinted {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.data.take().map(|d| Ok(http_body::Frame::data(d))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.hint)
    }
}

#[derive(serde::Deserialize)]
struct DownloadQuery {
    kib: usize,
}

/// `kib` KiB in 1 KiB frames, all ready at once (over a chunk: streamed into the store).
async fn download(State(p): State<Probe>, Query(q): Query<DownloadQuery>) -> Response {
    p.enter().await;
    static KIB: [u8; 1024] = [b'x'; 1024];
    let frames = futures_util::stream::iter(
        (0..q.kib).map(|_| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(&KIB)))),
    );
    Body::new(http_body_util::StreamBody::new(frames)).into_response()
}

/// Another instance of the service, sharing `probe` (as instances share a database).
pub fn app_with(
    store: &Store,
    probe: &Probe,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> Router {
    let probe = probe.clone();
    let layer = configure(
        IdempotencyLayer::builder(store.clone())
            .secret(SECRET)
            .unwrap()
            .principal(by_authorization),
    )
    .build()
    .expect("valid layer");
    routes().layer(layer).with_state(probe)
}

/// The test services' principal: the `authorization` header's value, or "anonymous". (A real
/// service takes it from what its authentication layer established: see
/// `tower_idempotency::principal`.)
fn by_authorization(parts: &http::request::Parts) -> Option<String> {
    Some(
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("anonymous")
            .to_owned(),
    )
}

/// Serves `router` on a free loopback port until the returned handle is dropped.
pub async fn serve(router: Router) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    (addr, handle)
}

/// An HTTP/1 request written on a raw TCP connection, so that a test can hang up at any moment
/// (as a client that times out does). Returns the open connection.
pub async fn open_request(
    addr: std::net::SocketAddr,
    path: &str,
    key: &str,
    body: &str,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// An HTTP/1 client over loopback.
pub type Client =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

pub fn client() -> Client {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// Sends `request` to `addr` over HTTP.
pub async fn http(
    client: &Client,
    addr: std::net::SocketAddr,
    mut request: Request<Body>,
) -> Reply {
    let uri = format!("http://{addr}{}", request.uri());
    *request.uri_mut() = uri.parse().unwrap();
    let response = client.request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A response, read in full.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn problem(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        let v = self.json();
        v["type"]
            .as_str()
            .unwrap()
            .rsplit('#')
            .next()
            .unwrap()
            .to_owned()
    }
}

pub async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub fn post_key(path: &str, key: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

/// A store on memory, on a real Redis with a prefix of its own, or on a real PostgreSQL with a
/// table of its own.
pub struct TestStore {
    pub store: Store,
    pub server: Option<RedisServer>,
    /// The PostgreSQL URL and table, for the Postgres store.
    pub postgres: Option<(String, String)>,
}

impl TestStore {
    pub async fn memory() -> Self {
        TestStore {
            store: Store::memory(),
            server: None,
            postgres: None,
        }
    }

    /// A store on a Redis Cluster, with a prefix of its own.
    pub async fn cluster(cluster: &testkit::RedisCluster, test: &str) -> Self {
        let client = LockClient::builder()
            .prefix(&testkit::unique_prefix(test))
            .unwrap()
            .notifications(redis::Client::open(cluster.urls()[0].as_str()).unwrap())
            .redis(cluster.connection().await)
            .unwrap();
        client.prepare().await.expect("the cluster answers");
        TestStore {
            store: Store::from_client(client),
            server: None,
            postgres: None,
        }
    }

    /// A store on the master of a Sentinel group, with the replica check: every replica must
    /// acknowledge acquisitions and completions.
    pub async fn sentinel(group: &testkit::RedisSentinel, test: &str) -> Self {
        let replicas = group.servers().len() - 1;
        let client = LockClient::builder()
            .prefix(&testkit::unique_prefix(test))
            .unwrap()
            // Below the command timeout of the suite's shortest lock (a 2 s lease), which
            // distlock checks for every lock configuration; long enough for two replicas to
            // acknowledge on a 2-core machine running the whole suite (at 100 ms, a missed
            // acknowledgement under load answered the first request 503).
            .replicas(replicas, std::time::Duration::from_millis(400))
            .unwrap()
            .sentinel(&group.sentinel_urls(), testkit::SENTINEL_SERVICE)
            .unwrap();
        let mut ready = false;
        for _ in 0..100 {
            if client.prepare().await.is_ok() {
                ready = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(ready, "the sentinel group's master answers");
        TestStore {
            store: Store::from_client(client),
            server: None,
            postgres: None,
        }
    }

    /// The store of a second instance: the same in-memory store, or another client of the same
    /// Redis under the same prefix.
    pub async fn twin(&self) -> Store {
        #[cfg(feature = "postgres")]
        if let Some((url, table)) = &self.postgres {
            return postgres_store(url, table).await;
        }
        match &self.server {
            None => self.store.clone(),
            Some(server) => redis_store(&server.url(), self.store.client().prefix()).await,
        }
    }

    /// A store on the test binary's PostgreSQL, in a table of its own.
    #[cfg(feature = "postgres")]
    pub async fn postgres(test: &str) -> Self {
        let server = testkit::PostgresServer::shared().await;
        let table = testkit::unique_table(test);
        TestStore {
            store: postgres_store(&server.url(), &table).await,
            server: None,
            postgres: Some((server.url(), table)),
        }
    }

    pub async fn redis(test: &str) -> Self {
        let server = RedisServer::start().await;
        let store = redis_store(&server.url(), &testkit::unique_prefix(test)).await;
        TestStore {
            store,
            server: Some(server),
            postgres: None,
        }
    }
}

/// A store on the PostgreSQL at `url`, in `table` (made if missing).
#[cfg(feature = "postgres")]
pub async fn postgres_store(url: &str, table: &str) -> Store {
    let store = Store::postgres(url, table).unwrap();
    store.prepare().await.expect("postgres answers");
    store
}

/// A store on the Redis at `url`, connected and with its scripts loaded.
pub async fn redis_store(url: &str, prefix: &str) -> Store {
    let client = LockClient::builder()
        .prefix(prefix)
        .unwrap()
        .connect(url)
        .unwrap();
    client.prepare().await.expect("redis answers");
    Store::from_client(client)
}

/// A handler that counts its runs and answers 201 with the run number.
pub fn counting() -> (
    Arc<AtomicUsize>,
    impl Fn() -> std::future::Ready<(StatusCode, String)> + Clone,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        std::future::ready((StatusCode::CREATED, format!("run {n}")))
    };
    (runs, handler)
}
