//! Streaming responses through the layer, over HTTP on loopback, each figure a ratio against a
//! baseline taken in the same round:
//!
//! * **time to first byte** of a server-sent-events response (first event at once, more
//!   later), with the layer on the memory and the Redis store / without it; and, on Redis,
//!   beyond one round trip (the layer's begin is one: the goal is <= 1.05 + one round trip);
//! * **replay throughput** of a stored 10 MiB record, part by part, against a handler serving
//!   the same bytes (goal >= 0.8), each round the median of nine interleaved transfers;
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

#[derive(serde::Deserialize)]
struct Mib {
    mib: usize,
}

fn app(store: Option<Store>) -> Router {
    let routes = Router::new()
        .route("/sse", post(sse))
        .route("/download", post(download));
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
async fn throughput(addr: SocketAddr, path: &str, key: &str) -> f64 {
    let mut sender = connect(addr).await;
    sender.ready().await.unwrap();
    let started = Instant::now();
    let response = sender.send_request(request(addr, path, key)).await.unwrap();
    let mut body = response.into_body();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        len += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    len as f64 / started.elapsed().as_secs_f64()
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

/// `--profile ttfb <none|memory|redis> <n>`: only the time-to-first-byte loop, `n` requests
/// on one variant; `--profile replay <none|memory|redis> <n>`: `n` transfers of a 10 MiB
/// record (a handler serving it, for `none`); for `perf stat` / `perf record` (prints the p50,
/// or the median throughput).
fn profile(args: &[String], servers: &tokio::runtime::Runtime, client: &tokio::runtime::Runtime) {
    let what = args.first().map_or("ttfb", String::as_str);
    let variant = args.get(1).map_or("memory", String::as_str);
    let n: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(2_000);
    let redis = (variant == "redis").then(|| client.block_on(RedisServer::start_owned()));
    let store = match &redis {
        None if variant == "none" => None,
        None => Some(Store::memory_with(
            distlock::MemoryLimits::new(100_000, 1 << 30).unwrap(),
        )),
        Some(redis) => Some(servers.block_on(async { Store::redis(&redis.url()).unwrap() })),
    };
    let addr = servers.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app(store)).await.unwrap() });
        addr
    });
    if what == "replay" {
        let path = "/download?mib=10";
        let key = if variant == "none" { "-" } else { "stored" };
        let mut rates = client.block_on(async {
            throughput(addr, path, key).await;
            let mut rates = Vec::with_capacity(n);
            for _ in 0..n {
                rates.push(throughput(addr, path, key).await);
            }
            rates
        });
        rates.sort_by(f64::total_cmp);
        let median = rates.get(rates.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "replay {variant}, {n} transfers of 10 MiB: median {:.0} MB/s",
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
    let addrs: Vec<SocketAddr> = ["none", "memory", "redis"]
        .iter()
        .map(|variant| {
            let store = match *variant {
                "none" => None,
                "memory" => Some(Store::memory_with(
                    distlock::MemoryLimits::new(100_000, 1 << 30).unwrap(),
                )),
                _ => Some(servers.block_on(async { Store::redis(&url).unwrap() })),
            };
            servers.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                tokio::spawn(async move { axum::serve(listener, app(store)).await.unwrap() });
                addr
            })
        })
        .collect();
    let (none, memory, redis_addr) = (addrs[0], addrs[1], addrs[2]);
    let n = if mode.full { 200 } else { 10 };
    let pings = if mode.full { 60 } else { 5 };
    let big = if mode.full { 100 } else { 4 };
    let replay_mib = if mode.full { 10 } else { 1 };
    let transfers = if mode.full { 9 } else { 1 };
    // Records for the replays.
    client.block_on(async {
        for addr in [memory, redis_addr] {
            throughput(addr, &format!("/download?mib={replay_mib}"), "stored").await;
        }
    });

    let (mut t_none, mut t_mem, mut t_redis, mut rtt, mut rtt_servers) = Default::default();
    let mut idle_redis = Series::default();
    let (mut r_handler, mut r_mem, mut r_redis): (Series, Series, Series) = Default::default();
    let (mut m_none, mut m_redis) = (Series::default(), Series::default());
    for round in 0..mode.rounds {
        eprintln!("round {}/{}", round + 1, mode.rounds);
        client.block_on(async {
            let t: &mut [(&mut Series, SocketAddr)] = &mut [
                (&mut t_none, none),
                (&mut t_mem, memory),
                (&mut t_redis, redis_addr),
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
            let path = format!("/download?mib={replay_mib}");
            let (mut h, mut m, mut r) = Default::default();
            for _ in 0..transfers {
                Series::push(&mut h, throughput(none, &path, "-").await);
                Series::push(&mut m, throughput(memory, &path, "stored").await);
                Series::push(&mut r, throughput(redis_addr, &path, "stored").await);
            }
            let (h, m, r): (Series, Series, Series) = (h, m, r);
            r_handler.push(h.median());
            r_mem.push(m.median());
            r_redis.push(r.median());
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
    row(&[
        &format!("handler serving {replay_mib} MiB, no layer (MB/s)"),
        &span(&mb(&r_handler)),
    ]);
    row(&[
        "replay throughput, memory store / handler",
        &r_mem.ratio(&r_handler).fmt_ratio(),
    ]);
    row(&[
        "replay throughput, Redis store / handler",
        &r_redis.ratio(&r_handler).fmt_ratio(),
    ]);
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

fn span(s: &Series) -> String {
    format!("{:.0} / {:.0} / {:.0}", s.min(), s.median(), s.max())
}

fn mb(s: &Series) -> Series {
    Series(s.0.iter().map(|b| b / 1e6).collect())
}
