//! Streaming responses through the layer, over HTTP on loopback, each figure a ratio against a
//! baseline taken in the same round:
//!
//! * **time to first byte** of a server-sent-events response (first event at once, more
//!   later), with the layer on the memory and the Redis store / without it; and, on Redis,
//!   beyond one round trip (the layer's begin is one: the goal is <= 1.05 + one round trip);
//!   and with a [`Minimal`] layer that does only what any idempotency layer must before its
//!   handler runs (name the key under the secret, fingerprint the request, claim the key in a
//!   map): the floor of that ratio on this machine, in the same run;
//! * **replay throughput** of a stored 10 MiB record, part by part, against a handler serving
//!   the same bytes from memory it holds (goal >= 0.8), each round the median of nine
//!   interleaved transfers; with the CPU each transfer takes per MiB, in this process and in
//!   Redis, and from those the most a Redis replay could reach on this machine's cores;
//! * **the layer's peak memory** while 100 MiB stream through it (Redis store, so the record
//!   lives in Redis), as the peak of live heap bytes with the layer minus without it, in
//!   chunks' worth (goal < 2).
//!
//! ```sh
//! cargo bench --bench stream                 # 5 rounds
//! BENCH_ROUNDS=9 cargo bench --bench stream
//! cargo bench --bench stream -- --profile ttfb memory 2000   # one loop, for perf
//! cargo bench --bench stream -- --profile replay memory 50   # 50 replays of 10 MiB
//! ```

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use common::{Mode, Series, connect, row};
use http_body::Frame;
use http_body_util::{BodyExt, Empty, StreamBody};
use peak_alloc::PeakAlloc;
use testkit::RedisServer;
use tower_idempotency::{IdempotencyLayer, Store};

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

const CHUNK: usize = 64 * 1024;
static DATA: [u8; CHUNK] = [b'x'; CHUNK];

/// Events of [`sse`], and the time between two.
const EVENTS: u32 = 6;
const EVENT_GAP: Duration = Duration::from_millis(2);

/// Server-sent events: the first at once, five more 2 ms apart.
async fn sse() -> Response {
    let events = futures_util::stream::unfold(0u32, |i| async move {
        if i == EVENTS {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(EVENT_GAP).await;
        }
        let event = Bytes::from(format!("data: event {i}\n\n"));
        Some((Ok::<_, Infallible>(Frame::data(event)), i + 1))
    });
    (
        [("content-type", "text/event-stream")],
        Body::new(StreamBody::new(events)),
    )
        .into_response()
}

/// `?mib=N` MiB in 64 KiB chunks, all ready at once.
async fn download(axum::extract::Query(q): axum::extract::Query<Mib>) -> Response {
    let chunks = futures_util::stream::iter(
        (0..q.mib * 16).map(|_| Ok::<_, Infallible>(Frame::data(Bytes::from_static(&DATA)))),
    );
    Body::new(StreamBody::new(chunks)).into_response()
}

/// Bytes a handler holds in memory (a file it serves, an export it built): distinct memory,
/// unlike [`DATA`], which a loop sends again and again from the CPU's cache.
const OBJECT_MIB: usize = 16;
static OBJECT: std::sync::LazyLock<Bytes> = std::sync::LazyLock::new(|| {
    (0..OBJECT_MIB << 20)
        .map(|i| b'a' + (i % 26) as u8)
        .collect::<Vec<u8>>()
        .into()
});

/// `?mib=N` MiB (N at most 16) of [`OBJECT`], in 64 KiB chunks (slices, no copy), all ready at
/// once.
async fn object(axum::extract::Query(q): axum::extract::Query<Mib>) -> Response {
    assert!(q.mib <= OBJECT_MIB, "the object holds {OBJECT_MIB} MiB");
    let chunks = (0..q.mib * 16)
        .map(|i| Ok::<_, Infallible>(Frame::data(OBJECT.slice(i * CHUNK..(i + 1) * CHUNK))));
    Body::new(StreamBody::new(futures_util::stream::iter(chunks))).into_response()
}

#[derive(serde::Deserialize)]
struct Mib {
    mib: usize,
}

fn routes() -> Router {
    Router::new()
        .route("/sse", post(sse))
        .route("/download", post(download))
        .route("/object", post(object))
}

fn app(store: Option<Store>) -> Router {
    let routes = routes();
    match store {
        None => routes,
        Some(store) => routes.layer(
            IdempotencyLayer::builder(store)
                .secret("bench secret: 32 bytes, not for real use")
                .unwrap()
                .global_keys()
                .record_limit(256 << 20)
                .build()
                .unwrap(),
        ),
    }
}

/// The least an idempotency layer must do before its handler runs, and nothing more: name the
/// key under the server secret (HKDF-SHA256, as the layer does), fingerprint the request
/// (HMAC-SHA256 of its method and path), and claim the key in a map behind a lock, sized for
/// the memory store's default of 100,000 keys. It keeps no response, takes no lease, sets no
/// timer: its time to first byte is a floor for any layer doing that work, measured in the same
/// run as the real one.
#[derive(Clone)]
struct Minimal {
    state: std::sync::Arc<MinimalState>,
}

struct MinimalState {
    keys: hkdf::Hkdf<sha2::Sha256>,
    fingerprint: hmac::Hmac<sha2::Sha256>,
    claimed: std::sync::Mutex<std::collections::HashMap<[u8; 32], [u8; 32]>>,
}

impl Minimal {
    fn new() -> Self {
        use hmac::KeyInit;
        let keys = hkdf::Hkdf::new(
            Some(b"minimal"),
            b"bench secret: 32 bytes, not for real use",
        );
        let mut key = [0u8; 32];
        keys.expand(b"fingerprint", &mut key).unwrap();
        // Its memory touched once, so that a claim never pays for a fresh page (`clear` keeps
        // the allocation): the floor errs low, never high.
        let mut claimed = std::collections::HashMap::with_capacity(100_000);
        for i in 0..100_000u32 {
            let mut name = [0u8; 32];
            name[..4].copy_from_slice(&i.to_be_bytes());
            claimed.insert(name, [0u8; 32]);
        }
        claimed.clear();
        Minimal {
            state: std::sync::Arc::new(MinimalState {
                keys,
                fingerprint: hmac::Hmac::new_from_slice(&key).unwrap(),
                claimed: std::sync::Mutex::new(claimed),
            }),
        }
    }
}

impl<S> tower::Layer<S> for Minimal {
    type Service = MinimalService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MinimalService {
            inner,
            state: self.state.clone(),
        }
    }
}

#[derive(Clone)]
struct MinimalService<S> {
    inner: S,
    state: std::sync::Arc<MinimalState>,
}

impl<S, B> tower::Service<http::Request<B>> for MinimalService<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> S::Future {
        use hmac::Mac;
        let key = request
            .headers()
            .get("idempotency-key")
            .map_or(&[][..], |v| v.as_bytes());
        let mut name = [0u8; 32];
        self.state
            .keys
            .expand_multi_info(&[b"key", key], &mut name)
            .unwrap();
        let mut mac = self.state.fingerprint.clone();
        mac.update(request.method().as_str().as_bytes());
        mac.update(request.uri().path().as_bytes());
        let fingerprint: [u8; 32] = mac.finalize().into_bytes().into();
        let fresh = self
            .state
            .claimed
            .lock()
            .unwrap()
            .insert(name, fingerprint)
            .is_none();
        std::hint::black_box(fresh);
        self.inner.call(request)
    }
}

fn request(addr: SocketAddr, path: &str, key: &str) -> http::Request<Empty<Bytes>> {
    http::Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .body(Empty::new())
        .unwrap()
}

/// Median time from sending a request to its first body byte, over `n` new keys; and the
/// median time the server had been idle when each request (after the first) came: from the
/// handler's last event of the one before (the first byte's arrival, plus the events' span)
/// to sending it. That is about 30 ms here, not the events' 2 ms: `axum::serve` leaves
/// Nagle's algorithm on, so every event after the first, and the end, wait in the kernel for
/// the client's delayed ACK, in every variant alike (the client cannot see the server's last
/// write: the events arrive together with the end).
async fn ttfb(addr: SocketAddr, tag: &str, n: usize) -> (f64, f64) {
    let mut sender = connect(addr).await;
    let mut samples = Vec::with_capacity(n);
    let mut idle = Vec::with_capacity(n);
    let mut last_event: Option<Instant> = None;
    for i in 0..n {
        sender.ready().await.unwrap();
        if let Some(last) = last_event {
            idle.push(last.elapsed());
        }
        let started = Instant::now();
        let response = sender
            .send_request(request(addr, "/sse", &format!("{tag}-{i}")))
            .await
            .unwrap();
        let mut body = response.into_body();
        let first = body.frame().await.unwrap().unwrap();
        samples.push(started.elapsed());
        assert!(first.is_data());
        last_event = Some(Instant::now() + EVENT_GAP * (EVENTS - 1));
        while body.frame().await.is_some() {}
    }
    let idle = if idle.is_empty() {
        0.0
    } else {
        common::percentile_us(&mut idle, 50.0)
    };
    (common::percentile_us(&mut samples, 50.0), idle)
}

/// Reads a response of `path` with `key` to its end: bytes per second.
async fn throughput(addr: SocketAddr, path: &str, key: &str, replayed: bool) -> f64 {
    transfer(addr, path, key, replayed, None).await.rate
}

/// One transfer: its rate, and the CPU it took per MiB, in this process (the server's
/// threads and the client's) and in Redis.
struct Transfer {
    /// Bytes per second.
    rate: f64,
    /// CPU time of this process, µs per MiB.
    cpu: f64,
    /// CPU time of Redis, µs per MiB (when a connection to it is given).
    store_cpu: f64,
}

/// Reads a response of `path` with `key` to its end, timing it and the CPU it takes (of Redis
/// too, read with `INFO cpu` on `redis` before and after). Panics unless it is a 200 of the
/// `mib=` the path asks for, marked replayed or not as `replayed` says: a failed or short
/// transfer is never timed as a replay.
async fn transfer(
    addr: SocketAddr,
    path: &str,
    key: &str,
    replayed: bool,
    redis: Option<&mut redis::aio::MultiplexedConnection>,
) -> Transfer {
    let mut redis = redis;
    let store_before = match redis.as_deref_mut() {
        Some(conn) => redis_cpu(conn).await,
        None => Duration::ZERO,
    };
    let mut sender = connect(addr).await;
    sender.ready().await.unwrap();
    let cpu_before = own_cpu();
    let started = Instant::now();
    let response = sender.send_request(request(addr, path, key)).await.unwrap();
    assert_eq!(response.status(), 200, "{path} with key {key}");
    assert_eq!(
        response.headers().contains_key("idempotent-replayed"),
        replayed,
        "{path} with key {key}: replayed"
    );
    let mut body = response.into_body();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        len += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    let elapsed = started.elapsed();
    let cpu = own_cpu().saturating_sub(cpu_before);
    let store_cpu = match redis {
        Some(conn) => redis_cpu(conn).await.saturating_sub(store_before),
        None => Duration::ZERO,
    };
    assert_eq!(
        len,
        mib_of(path) << 20,
        "{path} with key {key}: the whole body"
    );
    let mib = len as f64 / f64::from(1 << 20);
    Transfer {
        rate: len as f64 / elapsed.as_secs_f64(),
        cpu: cpu.as_secs_f64() * 1e6 / mib,
        store_cpu: store_cpu.as_secs_f64() * 1e6 / mib,
    }
}

/// The `mib=` of a path.
fn mib_of(path: &str) -> usize {
    path.split_once("mib=")
        .and_then(|(_, n)| n.parse().ok())
        .expect("a path with mib=N")
}

/// CPU time of this process so far (all its threads: the servers' and the client's).
fn own_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Redis's CPU time so far, user and system, from `INFO cpu` (seconds, to the microsecond).
async fn redis_cpu(conn: &mut redis::aio::MultiplexedConnection) -> Duration {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap();
    let seconds: f64 = info
        .lines()
        .filter_map(|line| {
            let value = line
                .strip_prefix("used_cpu_sys:")
                .or_else(|| line.strip_prefix("used_cpu_user:"))?;
            value.trim().parse::<f64>().ok()
        })
        .sum();
    Duration::from_secs_f64(seconds)
}

/// What a replay from Redis cannot do without, apart from serving the bytes (the handler's own
/// work): Redis sending them, reading them with redis-rs (`LRANGE`, four 64 KiB parts per round
/// trip, as the layer reads a record's parts) and opening each batch as it comes (AES-256-GCM
/// with ring: every record on Redis is sealed). Redis's CPU and this process's, µs per MiB,
/// each the median of `n` passes over `mib` MiB.
struct Unavoidable {
    redis: f64,
    read: f64,
    open: f64,
}

/// The list [`unavoidable`] reads: `mib` MiB of [`OBJECT`] in 64 KiB parts, sealed.
const PARTS: &str = "{bench}:parts";

/// The cipher of [`PARTS`], and the nonce of part `i`.
fn cipher() -> ring::aead::LessSafeKey {
    use ring::aead::{AES_256_GCM, LessSafeKey, UnboundKey};
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &[7; 32]).unwrap())
}

fn nonce(i: usize) -> ring::aead::Nonce {
    let mut nonce = [0u8; 12];
    nonce[..8].copy_from_slice(&(i as u64).to_be_bytes());
    ring::aead::Nonce::assume_unique_for_key(nonce)
}

async fn store_parts(conn: &mut redis::aio::MultiplexedConnection, mib: usize) {
    let key = cipher();
    let _: () = redis::cmd("DEL")
        .arg(PARTS)
        .query_async(conn)
        .await
        .unwrap();
    for i in 0..mib * 16 {
        let mut part = OBJECT[i * CHUNK..(i + 1) * CHUNK].to_vec();
        let tag = key
            .seal_in_place_separate_tag(nonce(i), ring::aead::Aad::from(b"aad"), &mut part)
            .unwrap();
        part.extend_from_slice(tag.as_ref());
        let _: () = redis::cmd("RPUSH")
            .arg(PARTS)
            .arg(part)
            .query_async(conn)
            .await
            .unwrap();
    }
}

async fn unavoidable(
    conn: &mut redis::aio::MultiplexedConnection,
    mib: usize,
    n: usize,
) -> Unavoidable {
    let key = cipher();
    let parts = mib * 16;
    let (mut sending, mut read, mut open) = Default::default();
    for _ in 0..n {
        let redis_before = redis_cpu(conn).await;
        let (mut reading, mut opening) = (Duration::ZERO, Duration::ZERO);
        let mut len = 0;
        for from in (0..parts).step_by(4) {
            let before = own_cpu();
            let mut batch: Vec<Vec<u8>> = redis::cmd("LRANGE")
                .arg(PARTS)
                .arg(from)
                .arg(from + 3)
                .query_async(conn)
                .await
                .unwrap();
            let read_at = own_cpu();
            for (i, part) in batch.iter_mut().enumerate() {
                let opened = key
                    .open_in_place(nonce(from + i), ring::aead::Aad::from(b"aad"), part)
                    .unwrap();
                len += opened.len();
            }
            opening += own_cpu().saturating_sub(read_at);
            reading += read_at.saturating_sub(before);
        }
        let sent = redis_cpu(conn).await.saturating_sub(redis_before);
        assert_eq!(len, mib << 20, "the parts read back and opened");
        let per_mib = |d: Duration| d.as_secs_f64() * 1e6 / mib as f64;
        Series::push(&mut sending, per_mib(sent));
        Series::push(&mut read, per_mib(reading));
        Series::push(&mut open, per_mib(opening));
    }
    let (sending, read, open): (Series, Series, Series) = (sending, read, open);
    Unavoidable {
        redis: sending.median(),
        read: read.median(),
        open: open.median(),
    }
}

/// Peak live heap bytes while 100 MiB stream from `path` (a new key), above the level before.
async fn peak_heap(addr: SocketAddr, key: &str, mib: usize) -> f64 {
    let mut sender = connect(addr).await;
    sender.ready().await.unwrap();
    let base = HEAP.current_usage();
    HEAP.reset_peak_usage();
    let response = sender
        .send_request(request(addr, &format!("/download?mib={mib}"), key))
        .await
        .unwrap();
    let mut body = response.into_body();
    while body.frame().await.is_some() {}
    HEAP.peak_usage().saturating_sub(base) as f64
}

/// Median round trip of a PING to Redis.
async fn redis_rtt(server: &RedisServer) -> f64 {
    ping_rtt(server.connection().await, Duration::ZERO, 200).await
}

/// The same round trip as the servers make it for a request's begin: from a task on their
/// (multi-thread) runtime, each PING after `pause`, the time the servers were idle before each
/// request of [`ttfb`] (measured there). A round trip after a pause costs far more than one of
/// a back-to-back series (the workers have parked, the CPUs have gone idle, and the reply
/// wakes a parked thread), and the longer the pause the more: the back-to-back figure, or
/// one after a shorter pause, would flatter the subtraction.
async fn servers_rtt(
    servers: &tokio::runtime::Handle,
    server: &RedisServer,
    pause: Duration,
    n: usize,
) -> f64 {
    let client = server.client();
    servers
        .spawn(async move {
            let conn = client.get_multiplexed_async_connection().await.unwrap();
            ping_rtt(conn, pause, n).await
        })
        .await
        .unwrap()
}

/// Median of `n` PINGs on `conn`, each after `pause`, in µs.
async fn ping_rtt(mut conn: redis::aio::MultiplexedConnection, pause: Duration, n: usize) -> f64 {
    let mut samples = Vec::new();
    for _ in 0..n {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let started = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        samples.push(started.elapsed());
    }
    common::percentile_us(&mut samples, 50.0)
}

/// `--profile ttfb <none|memory|redis|minimal> <n>`: only the time-to-first-byte loop, `n`
/// requests on one variant; `--profile replay <none|memory|redis> <n>`: `n` transfers of a
/// 10 MiB record (a handler serving it, for `none`); for `perf stat` / `perf record` (prints
/// the p50, or the median throughput).
fn profile(args: &[String], servers: &tokio::runtime::Runtime, client: &tokio::runtime::Runtime) {
    let what = args.first().map_or("ttfb", String::as_str);
    let variant = args.get(1).map_or("memory", String::as_str);
    let n: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(2_000);
    let redis = (variant == "redis").then(|| client.block_on(RedisServer::start_owned()));
    let store = match &redis {
        None if variant == "none" || variant == "minimal" => None,
        None => Some(Store::memory_with(
            distlock::MemoryLimits::new(100_000, 1 << 30).unwrap(),
        )),
        Some(redis) => Some(servers.block_on(async { Store::redis(&redis.url()).unwrap() })),
    };
    let app = if variant == "minimal" {
        routes().layer(Minimal::new())
    } else {
        app(store)
    };
    let addr = servers.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    });
    if what == "replay" {
        let path = args.get(3).map_or("/object?mib=10", String::as_str);
        let (key, stored) = if variant == "none" {
            ("-", false)
        } else {
            ("stored", true)
        };
        let mut rates = client.block_on(async {
            throughput(addr, path, key, false).await;
            let mut rates = Vec::with_capacity(n);
            for _ in 0..n {
                rates.push(throughput(addr, path, key, stored).await);
            }
            rates
        });
        rates.sort_by(f64::total_cmp);
        let median = rates.get(rates.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "replay {variant}, {n} transfers of {path}: median {:.0} MB/s",
            median / 1e6
        );
        return;
    }
    let (p50, idle) = client.block_on(ttfb(addr, "profile", n));
    println!(
        "TTFB {variant}, {n} requests: p50 {p50:.0} µs, servers idle before each {idle:.0} µs"
    );
}

fn main() {
    let mode = Mode::from_args();
    // The servers: a runtime of their own, as in a service.
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        profile(&args[at + 1..], &servers, &client);
        return;
    }
    let redis = client.block_on(RedisServer::start_owned());
    let url = redis.url();
    let addrs: Vec<SocketAddr> = ["none", "memory", "redis", "minimal"]
        .iter()
        .map(|variant| {
            let app = match *variant {
                "none" => app(None),
                "memory" => app(Some(Store::memory_with(
                    distlock::MemoryLimits::new(100_000, 1 << 30).unwrap(),
                ))),
                "redis" => app(Some(
                    servers.block_on(async { Store::redis(&url).unwrap() }),
                )),
                _ => routes().layer(Minimal::new()),
            };
            servers.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
                addr
            })
        })
        .collect();
    let (none, memory, redis_addr, minimal) = (addrs[0], addrs[1], addrs[2], addrs[3]);
    let n = if mode.full { 200 } else { 10 };
    let pings = if mode.full { 60 } else { 5 };
    let big = if mode.full { 100 } else { 4 };
    let replay_mib = if mode.full { 10 } else { 1 };
    let transfers = if mode.full { 9 } else { 1 };
    // Records for the replays: the bytes a handler holds (distinct memory, as a record's parts
    // are), served again from the store.
    let object = format!("/object?mib={replay_mib}");
    client.block_on(async {
        for addr in [memory, redis_addr] {
            throughput(addr, &object, "stored", false).await;
        }
    });
    let mut info = client.block_on(async {
        let mut conn = redis.connection().await;
        store_parts(&mut conn, replay_mib).await;
        conn
    });

    let (mut t_none, mut t_mem, mut t_redis, mut rtt, mut rtt_servers) = Default::default();
    let mut t_minimal = Series::default();
    let mut idle_redis = Series::default();
    // Per round: the handler serving bytes it holds, the handler sending one 64 KiB buffer
    // again and again (the baseline of the runs before 2026-11-27, 16:00 UTC: its bytes stay
    // in the CPU's cache), the memory store's replay, Redis's.
    let mut replays: [Replays; 4] = Default::default();
    let (mut u_redis, mut u_read, mut u_open) = Default::default();
    let (mut m_none, mut m_redis) = (Series::default(), Series::default());
    for round in 0..mode.rounds {
        eprintln!("round {}/{}", round + 1, mode.rounds);
        client.block_on(async {
            let t: &mut [(&mut Series, SocketAddr)] = &mut [
                (&mut t_none, none),
                (&mut t_mem, memory),
                (&mut t_redis, redis_addr),
                (&mut t_minimal, minimal),
            ];
            let mut idle = 0.0;
            for (series, addr) in t.iter_mut() {
                let (first_byte, idle_before) = ttfb(*addr, &format!("r{round}"), n).await;
                series.push(first_byte);
                if *addr == redis_addr {
                    idle = idle_before;
                }
            }
            idle_redis.push(idle / 1000.0);
            Series::push(&mut rtt, redis_rtt(&redis).await);
            let pause = Duration::from_micros(idle as u64).max(Duration::from_millis(2));
            Series::push(
                &mut rtt_servers,
                servers_rtt(servers.handle(), &redis, pause, pings).await,
            );
            // One transfer of 10 MiB takes a few milliseconds, within reach of a single
            // scheduling hiccup: each round takes the median of several, interleaved.
            let repeated = format!("/download?mib={replay_mib}");
            let mut of_round: [Vec<Transfer>; 4] = Default::default();
            for _ in 0..transfers {
                of_round[0].push(transfer(none, &object, "-", false, None).await);
                of_round[1].push(transfer(none, &repeated, "-", false, None).await);
                of_round[2].push(transfer(memory, &object, "stored", true, None).await);
                of_round[3]
                    .push(transfer(redis_addr, &object, "stored", true, Some(&mut info)).await);
            }
            let u = unavoidable(&mut info, replay_mib, transfers).await;
            Series::push(&mut u_redis, u.redis);
            Series::push(&mut u_read, u.read);
            Series::push(&mut u_open, u.open);
            for (transfers, figures) in of_round.iter().zip(replays.iter_mut()) {
                let median =
                    |f: fn(&Transfer) -> f64| Series(transfers.iter().map(f).collect()).median();
                figures.rate.push(median(|t| t.rate));
                figures.cpu.push(median(|t| t.cpu));
                figures.store_cpu.push(median(|t| t.store_cpu));
            }
            m_none.push(peak_heap(none, &format!("big-{round}"), big).await);
            m_redis.push(peak_heap(redis_addr, &format!("big-{round}"), big).await);
        });
    }

    println!(
        "\n## Streaming ({} rounds; {})\n",
        mode.rounds,
        common::machine()
    );
    row(&["figure", "min / median / max"]);
    row(&["---", "---"]);
    row(&["TTFB no layer, p50 (µs)", &span(&t_none)]);
    row(&[
        "TTFB memory store / no layer",
        &t_mem.ratio(&t_none).fmt_ratio(),
    ]);
    row(&[
        "TTFB minimal layer (key named, request fingerprinted, key claimed; nothing else) / no layer",
        &t_minimal.ratio(&t_none).fmt_ratio(),
    ]);
    row(&[
        "TTFB Redis store / no layer",
        &t_redis.ratio(&t_none).fmt_ratio(),
    ]);
    let beyond = t_redis.minus(&rtt);
    row(&[
        "Redis round trip, PING p50, client's runtime (µs)",
        &span(&rtt),
    ]);
    row(&[
        "TTFB Redis store minus one round trip (client's runtime) / no layer",
        &beyond.ratio(&t_none).fmt_ratio(),
    ]);
    // The layer's begin is a round trip the server makes, from its own runtime.
    let beyond = t_redis.minus(&rtt_servers);
    row(&[
        "servers idle before each TTFB request, Redis variant, p50 (ms)",
        &format!(
            "{:.1} / {:.1} / {:.1}",
            idle_redis.min(),
            idle_redis.median(),
            idle_redis.max()
        ),
    ]);
    row(&[
        "Redis round trip, PING p50, servers' runtime, each after that idle time (µs)",
        &span(&rtt_servers),
    ]);
    row(&[
        "TTFB Redis store minus one round trip (servers' runtime) / no layer",
        &beyond.ratio(&t_none).fmt_ratio(),
    ]);
    let [handler, repeated, r_mem, r_redis] = &replays;
    row(&[
        &format!("handler serving {replay_mib} MiB it holds, no layer (MB/s)"),
        &span(&mb(&handler.rate)),
    ]);
    row(&[
        "replay throughput, memory store / handler",
        &r_mem.rate.ratio(&handler.rate).fmt_ratio(),
    ]);
    row(&[
        "replay throughput, Redis store / handler",
        &r_redis.rate.ratio(&handler.rate).fmt_ratio(),
    ]);
    row(&[
        &format!(
            "handler sending one 64 KiB buffer {} times (MB/s)",
            replay_mib * 16
        ),
        &span(&mb(&repeated.rate)),
    ]);
    for (what, figures) in [("memory", r_mem), ("Redis", r_redis)] {
        row(&[
            &format!("replay throughput, {what} store / handler sending one buffer"),
            &figures.rate.ratio(&repeated.rate).fmt_ratio(),
        ]);
    }
    let (u_redis, u_read, u_open): (Series, Series, Series) = (u_redis, u_read, u_open);
    for (what, figures) in [
        ("handler serving the bytes it holds", handler),
        ("handler sending one buffer", repeated),
        ("memory store's replay", r_mem),
        ("Redis store's replay", r_redis),
    ] {
        row(&[
            &format!("CPU per MiB, {what}: this process (server and client), µs"),
            &span(&figures.cpu),
        ]);
    }
    row(&[
        "CPU per MiB, Redis store's replay: Redis itself, µs",
        &span(&r_redis.store_cpu),
    ]);
    row(&[
        "CPU per MiB, Redis sending 64 KiB parts (LRANGE, 4 a round trip): Redis itself, µs",
        &span(&u_redis),
    ]);
    row(&[
        "CPU per MiB, reading them with redis-rs, this process, µs",
        &span(&u_read),
    ]);
    row(&[
        "CPU per MiB, opening each batch as it comes (AES-256-GCM, ring), this process, µs",
        &span(&u_open),
    ]);
    // The most a Redis replay could reach here, round by round: the work it cannot do without,
    // each at the CPU per byte measured in this round, on every core with nothing else to do,
    // against the handler's rate. Serving the bytes costs at least what the cheaper of the two
    // handlers spent (the one sending a buffer from the CPU's cache, as a replay sends a part it
    // has just opened); Redis sending them, what it spent on the plain `LRANGE`s; the layer's
    // own work counts for nothing. The first bound counts only those two, the second also
    // opening the parts (every record on Redis is sealed), the third also reading them with
    // redis-rs.
    let serving = Series(
        handler
            .cpu
            .0
            .iter()
            .zip(&repeated.cpu.0)
            .map(|(a, b)| a.min(*b))
            .collect(),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let bound = |parts: &[&Series]| {
        Series(
            (0..handler.rate.0.len())
                .map(|i| {
                    let us_per_mib: f64 = parts.iter().map(|p| p.0[i]).sum();
                    let seconds_per_byte = us_per_mib / 1e6 / f64::from(1 << 20);
                    cores / seconds_per_byte / handler.rate.0[i]
                })
                .collect(),
        )
    };
    for (what, parts) in [
        ("serving + Redis sending", &[&serving, &u_redis][..]),
        (
            "serving + Redis sending + opening",
            &[&serving, &u_redis, &u_open],
        ),
        (
            "serving + Redis sending + opening + reading",
            &[&serving, &u_redis, &u_open, &u_read],
        ),
    ] {
        row(&[
            &format!(
                "most a Redis replay / handler could reach on {cores} cores, the layer costing \
                 nothing: {what}"
            ),
            &bound(parts).fmt_ratio(),
        ]);
    }
    let layer_peak = Series(
        m_redis
            .0
            .iter()
            .zip(&m_none.0)
            .map(|(l, n)| (l - n) / CHUNK as f64)
            .collect(),
    );
    row(&[
        &format!("peak heap streaming {big} MiB, no layer (KiB)"),
        &span(&Series(m_none.0.iter().map(|b| b / 1024.0).collect())),
    ]);
    row(&[
        &format!("the layer's peak heap streaming {big} MiB (Redis store), in 64 KiB chunks"),
        &layer_peak.fmt_ratio(),
    ]);
}

/// One figure of a replay variant, per round.
#[derive(Default)]
struct Replays {
    /// Bytes per second.
    rate: Series,
    /// This process's CPU, µs per MiB.
    cpu: Series,
    /// Redis's CPU, µs per MiB.
    store_cpu: Series,
}

fn span(s: &Series) -> String {
    format!("{:.0} / {:.0} / {:.0}", s.min(), s.median(), s.max())
}

fn mb(s: &Series) -> Series {
    Series(s.0.iter().map(|b| b / 1e6).collect())
}
