//! Whether the local replay cache (`Store::replay_cache`) pays: two instances of a service on
//! one Redis behind a round-robin balancer, with and without the cache, in the same rounds.
//!
//! `cargo bench --bench replay_cache` (`BENCH_ROUNDS`, `BENCH_WINDOW_MS` as elsewhere).
//!
//! * **Mixed**: 32 clients, each sending a new key, then a retry of the key it sent before
//!   (so a retry comes one request later, as a client's retry after a timeout does), every
//!   request to the next instance in turn (the balancer). Reports the hit rate (replays served
//!   by a cache / replays), and per request pair (execute + retry) Redis's CPU and this
//!   process's CPU (the two instances and the load, the same load in both variants).
//! * **Executes only**: the same clients, new keys only: what keeping records costs a run.
//! * **One connection**: one client on one instance, a new key then its retry, in turn: the
//!   retry's p50 latency (a cache hit when cached).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use common::ops::process_cpu;
use common::{Mode, Series, connect, percentile_us, row};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use testkit::RedisServer;
use tower_idempotency::{IdempotencyLayer, ReplayCache, Store};

const CLIENTS: usize = 32;

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn pay(body: Bytes) -> (StatusCode, axum::Json<serde_json::Value>) {
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": "pay_1", "amount": body.len(), "status": "paid"})),
    )
}

/// One instance of the service on `url`, with or without the cache.
async fn instance(url: &str, cached: bool) -> (SocketAddr, Store) {
    let mut store = Store::redis(url).unwrap();
    if cached {
        store = store.replay_cache(ReplayCache::default()).unwrap();
    }
    store.prepare().await.unwrap();
    let layer = IdempotencyLayer::builder(store.clone())
        .secret("bench-secret-0123456789abcdef0123")
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let app = Router::new().route("/pay", post(pay)).layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let deadline = Instant::now() + Duration::from_secs(10);
    while cached && !store.replay_cache_stats().is_some_and(|s| s.live) {
        assert!(Instant::now() < deadline, "the cache never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (addr, store)
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn new_key() -> String {
    format!("k-{}", SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Sends a payment under `key`; returns whether it was replayed.
async fn send(sender: &mut Sender, key: &str) -> bool {
    let request = http::Request::post("/pay")
        .header("host", "bench")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(br#"{"amount":5}"#)))
        .unwrap();
    sender.ready().await.unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    let replayed = response.headers().contains_key("idempotent-replayed");
    response.into_body().collect().await.unwrap();
    replayed
}

/// What a window of load did.
#[derive(Default)]
struct Window {
    executes: u64,
    replays: u64,
    hits: u64,
    redis_cpu: Duration,
    redis_calls: u64,
    own_cpu: Duration,
}

/// `CLIENTS` clients for `window` after `warmup`, each request to the next of `instances`;
/// with `retries`, each client retries the key it sent before after every new one.
async fn load(
    redis: &RedisServer,
    instances: &[(SocketAddr, Store)],
    retries: bool,
    mode: Mode,
) -> Window {
    let turn = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let executes = Arc::new(AtomicU64::new(0));
    let replays = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let mut senders = Vec::new();
        for (addr, _) in instances {
            senders.push(connect::<Full<Bytes>>(*addr).await);
        }
        let (turn, measuring, stop) = (turn.clone(), measuring.clone(), stop.clone());
        let (executes, replays) = (executes.clone(), replays.clone());
        tasks.push(tokio::spawn(async move {
            let mut previous: Option<String> = None;
            while !stop.load(Ordering::Relaxed) {
                let key = new_key();
                let at = turn.fetch_add(1, Ordering::Relaxed) as usize % senders.len();
                assert!(!send(&mut senders[at], &key).await, "a new key replayed");
                let counted = measuring.load(Ordering::Relaxed);
                if counted {
                    executes.fetch_add(1, Ordering::Relaxed);
                }
                if retries && let Some(earlier) = previous.replace(key) {
                    let at = turn.fetch_add(1, Ordering::Relaxed) as usize % senders.len();
                    assert!(send(&mut senders[at], &earlier).await, "a retry ran again");
                    if counted {
                        replays.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(mode.warmup).await;
    let hits = |instances: &[(SocketAddr, Store)]| -> u64 {
        (instances.iter())
            .filter_map(|(_, s)| s.replay_cache_stats())
            .map(|s| s.hits)
            .sum()
    };
    let redis_pid = redis.pid().expect("testkit started redis-server here");
    let calls0 = redis.script_calls().await;
    let (redis0, own0, hits0) = (
        process_cpu(&redis_pid.to_string()),
        process_cpu("self"),
        hits(instances),
    );
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(mode.window).await;
    measuring.store(false, Ordering::Relaxed);
    let mut window = Window {
        executes: executes.load(Ordering::Relaxed),
        replays: replays.load(Ordering::Relaxed),
        hits: hits(instances) - hits0,
        redis_cpu: process_cpu(&redis_pid.to_string()) - redis0,
        own_cpu: process_cpu("self") - own0,
        redis_calls: 0,
    };
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    // Counted after the load stopped: the calls of the requests the window counted, and of
    // those in flight around it (a few dozen among tens of thousands).
    window.redis_calls = redis.script_calls().await - calls0;
    window
}

/// The retry's latency at one connection, on the instance that ran the request: p50 in µs.
async fn one_connection(instance: &(SocketAddr, Store), mode: Mode) -> f64 {
    let mut sender = connect::<Full<Bytes>>(instance.0).await;
    let warm_until = Instant::now() + mode.warmup;
    let until = warm_until + mode.window;
    let mut samples = Vec::new();
    while Instant::now() < until {
        let key = new_key();
        send(&mut sender, &key).await;
        // The record is cached once Redis answered the completion: give it that time (what a
        // client's retry after a timeout has, many times over).
        tokio::time::sleep(Duration::from_micros(500)).await;
        let started = Instant::now();
        assert!(send(&mut sender, &key).await, "a retry ran again");
        if started > warm_until {
            samples.push(started.elapsed());
        }
    }
    percentile_us(&mut samples, 50.0)
}

#[derive(Default)]
struct Figures {
    hit_rate: Series,
    calls_per_pair: [Series; 2],
    redis_per_pair: [Series; 2],
    own_per_pair: [Series; 2],
    own_per_execute: [Series; 2],
    retry_p50: [Series; 2],
}

fn per(cpu: Duration, n: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / n.max(1) as f64
}

fn main() {
    let mode = Mode::from_args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let server = RedisServer::start_owned().await;
        let url = server.url();
        let mut figures = Figures::default();
        for round in 0..mode.rounds {
            // Both variants in every round, in alternating order.
            for step in 0..2 {
                let cached = (round + step) % 2 == 1;
                let v = usize::from(cached);
                let instances = vec![instance(&url, cached).await, instance(&url, cached).await];
                let mixed = load(&server, &instances, true, mode).await;
                assert!(mixed.replays > 0, "no retries measured");
                if cached {
                    figures
                        .hit_rate
                        .push(mixed.hits as f64 / mixed.replays as f64);
                }
                let pairs = mixed.replays.min(mixed.executes);
                figures.calls_per_pair[v]
                    .push(mixed.redis_calls as f64 / (mixed.executes + mixed.replays) as f64 * 2.0);
                figures.redis_per_pair[v].push(per(mixed.redis_cpu, pairs));
                figures.own_per_pair[v].push(per(mixed.own_cpu, pairs));
                let executes = load(&server, &instances, false, mode).await;
                figures.own_per_execute[v].push(per(executes.own_cpu, executes.executes));
                figures.retry_p50[v].push(one_connection(&instances[0], mode).await);
            }
        }
        report(&figures, mode);
    });
}

fn report(f: &Figures, mode: Mode) {
    println!(
        "\nreplay cache: {}; {} rounds of {:?}; two instances on one Redis, {CLIENTS} clients, round robin\n",
        common::machine(),
        mode.rounds,
        mode.window
    );
    row(&["figure", "min / median / max"]);
    row(&["---", "---"]);
    row(&["hit rate of retries (2 instances)", &f.hit_rate.fmt_ratio()]);
    let ratio = |s: &[Series; 2]| s[1].ratio(&s[0]).fmt_ratio();
    row(&[
        "Redis script calls per execute + retry, cache / none",
        &ratio(&f.calls_per_pair),
    ]);
    row(&[
        "Redis CPU per execute + retry, cache / none",
        &ratio(&f.redis_per_pair),
    ]);
    row(&[
        "process CPU per execute + retry, cache / none",
        &ratio(&f.own_per_pair),
    ]);
    row(&[
        "process CPU per execute (new keys only), cache / none",
        &ratio(&f.own_per_execute),
    ]);
    row(&[
        "retry p50 at one connection, same instance, cache / none",
        &ratio(&f.retry_p50),
    ]);
    println!();
    row(&["absolute (median)", "no cache", "cache"]);
    row(&["---", "---", "---"]);
    let abs = |s: &[Series; 2], unit: &str| [s[0].fmt_abs(unit), s[1].fmt_abs(unit)];
    let calls = [
        format!("{:.2}", f.calls_per_pair[0].median()),
        format!("{:.2}", f.calls_per_pair[1].median()),
    ];
    row(&[
        "Redis script calls per execute + retry",
        &calls[0],
        &calls[1],
    ]);
    for (name, s) in [
        (
            "Redis CPU per execute + retry",
            abs(&f.redis_per_pair, "µs"),
        ),
        (
            "process CPU per execute + retry",
            abs(&f.own_per_pair, "µs"),
        ),
        ("process CPU per execute", abs(&f.own_per_execute, "µs")),
        ("retry p50 at one connection", abs(&f.retry_p50, "µs")),
    ] {
        row(&[name, &s[0], &s[1]]);
    }
}
