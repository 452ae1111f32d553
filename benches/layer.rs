//! The layer's own cost per request, in process (no HTTP, no sockets): the same trivial JSON
//! handler called through an axum `Router` without the layer, with it on the memory store
//! (execute: a new key each time; replay: a stored key), and in `cancel_on_disconnect` mode
//! (the execution driven inline instead of spawned, which isolates what detaching costs), and
//! the same request after the thread slept (a CPU that was idle, as at low traffic). In each
//! round the `idempotent` peer (benches/peers/idempotent, `--round`) then measures its memory
//! layer in its own process with the same request and the same timing code
//! (`common::in_process`): warm, and after sleeping.
//!
//! ```sh
//! cargo bench --bench layer -- --ratios                  # per-round ratios: no layer, the peer
//! cargo bench --bench layer                              # criterion: time per request
//! cargo bench --bench layer -- --profile execute 20000   # a fixed run, for callgrind/perf
//!                                                        # (execute, replay, inline, none, full):
//! valgrind --tool=callgrind target/release/deps/layer-* --profile execute 20000
//! # (common::profiled: every poll of a profiled request in `poll_profiled`)
//! REDIS_URL=redis://127.0.0.1:6379 target/release/deps/layer-* --profile execute 2000
//! # the same on the Redis store, with keys of this run only (`scripts/footprint.py`)
//! ```

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::Series;
use common::in_process::{PAUSE, after_pause, per_request};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use criterion::{Criterion, criterion_group};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, Store};

async fn pay(body: bytes::Bytes) -> (StatusCode, axum::Json<serde_json::Value>) {
    static ID: AtomicU64 = AtomicU64::new(0);
    let id = ID.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "status": "paid", "bytes": body.len()})),
    )
}

fn app(variant: &str) -> Router {
    app_on(variant, Store::memory())
}

/// [`app`] on `store`.
fn app_on(variant: &str, store: Store) -> Router {
    let routes = Router::new().route("/pay", post(pay));
    let layer = |cancel: bool| {
        // The default store: 100,000 entries (the "full" variants fill it first).
        IdempotencyLayer::builder(store.clone())
            .secret("bench secret: 32 bytes, not for real use")
            .unwrap()
            .global_keys()
            .cancel_on_disconnect(cancel)
            .build()
            .unwrap()
    };
    let app = match variant {
        "none" => routes,
        "inline" => routes.layer(layer(true)),
        _ => routes.layer(layer(false)),
    };
    // What `axum::serve` does once (`into_make_service`): routes become services, the layer is
    // applied once, not per request.
    app.with_state(())
}

fn request(key: &str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":1000,"currency":"eur"}"#))
        .unwrap()
}

async fn one(app: &Router, key: &str) -> usize {
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    body.len()
}

/// [`one`], and whether the answer was a success (the profile loop checks every answer).
async fn succeeded(app: &Router, key: &str) -> bool {
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let success = response.status().is_success();
    response.into_body().collect().await.unwrap();
    success
}

/// More keys than the default store holds: from here on every new key evicts an old record.
const FILL: u64 = 120_000;

async fn fill_store(app: &Router, n: u64) {
    for i in 0..n {
        one(app, &format!("fill-{i}")).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn layer(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("in-process request");
    for (name, variant) in [
        ("no layer", "none"),
        ("memory store, execute", "detached"),
        (
            "memory store, execute, inline (cancel_on_disconnect)",
            "inline",
        ),
    ] {
        let app = rt.block_on(async { app(variant) });
        let mut n = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                n += 1;
                rt.block_on(one(&app, black_box(&format!("k-{n}"))))
            })
        });
    }
    // A full store: every new key evicts the oldest record (O(log n), as on an empty store).
    let full = rt.block_on(async {
        let full = app("detached");
        fill_store(&full, FILL).await;
        full
    });
    let mut n = 0u64;
    g.bench_function("memory store, execute, full store", |b| {
        b.iter(|| {
            n += 1;
            rt.block_on(one(&full, black_box(&format!("k-{n}"))))
        })
    });
    let app = rt.block_on(async { app("detached") });
    rt.block_on(one(&app, "stored"));
    g.bench_function("memory store, replay", |b| {
        b.iter(|| rt.block_on(one(&app, black_box("stored"))))
    });
    g.finish();
}

criterion_group!(benches, layer);

/// [`one`] with the key owned: the shape `common::in_process` calls.
async fn call(app: &Router, key: String) -> usize {
    one(app, &key).await
}

/// Rounds of: no layer, then each variant, back to back; the layer's added time per request
/// and throughput ratios, min / median / max over the rounds.
fn ratios(mode: common::Mode) {
    let peer = common::peer::idempotent_server()
        .unwrap_or_else(|e| panic!("the idempotent peer cannot be built: {e}"));
    let rt = runtime();
    rt.block_on(async {
        let none = app("none");
        let full = app("detached");
        fill_store(&full, FILL).await;
        let replay = app("detached");
        one(&replay, "stored").await;
        let mut counter = 0u64;
        let mut fresh = move || {
            counter += 1;
            format!("k-{counter}")
        };
        let (mut t_none, mut t_empty, mut t_full, mut t_replay) = (
            Series::default(),
            Series::default(),
            Series::default(),
            Series::default(),
        );
        let mut t_inline = Series::default();
        let (mut idle_none, mut idle_execute) = (Series::default(), Series::default());
        let (mut busy_none, mut busy_execute) = (Series::default(), Series::default());
        // The `idempotent` peer's (no layer, execute) on its memory store.
        let (mut peer_warm, mut peer_idle) = (
            (Series::default(), Series::default()),
            (Series::default(), Series::default()),
        );
        let idle_n = if mode.full { 60 } else { 3 };
        for _ in 0..mode.rounds {
            // A new store per round: "empty" is a store filling up from nothing.
            let empty = app("detached");
            per_request(mode.warmup, &mut fresh, |k| call(&none, k)).await;
            t_none.push(per_request(mode.window, &mut fresh, |k| call(&none, k)).await);
            t_empty.push(per_request(mode.window, &mut fresh, |k| call(&empty, k)).await);
            let inline = app("inline");
            t_inline.push(per_request(mode.window, &mut fresh, |k| call(&inline, k)).await);
            per_request(mode.warmup, &mut fresh, |k| call(&full, k)).await;
            t_full.push(per_request(mode.window, &mut fresh, |k| call(&full, k)).await);
            t_replay
                .push(per_request(mode.window, || "stored".to_owned(), |k| call(&replay, k)).await);
            idle_none.push(after_pause(idle_n, true, &mut fresh, |k| call(&none, k)).await);
            idle_execute.push(after_pause(idle_n, true, &mut fresh, |k| call(&empty, k)).await);
            busy_none.push(after_pause(idle_n, false, &mut fresh, |k| call(&none, k)).await);
            busy_execute.push(after_pause(idle_n, false, &mut fresh, |k| call(&empty, k)).await);
            // The peer, right after, in its own process, measured by the same code.
            let theirs = peer_round(&peer, mode.window, mode.warmup, idle_n);
            peer_warm.0.push(theirs[0]);
            peer_warm.1.push(theirs[1]);
            peer_idle.0.push(theirs[2]);
            peer_idle.1.push(theirs[3]);
        }
        let fmt_us = |s: &Series| format!("{:.2} / {:.2} / {:.2} µs", s.min(), s.median(), s.max());
        println!(
            "\n## The layer in process ({} rounds of {} ms; {})\n",
            mode.rounds,
            mode.window.as_millis(),
            common::machine()
        );
        common::row(&[
            "variant",
            "time per request",
            "added by the layer",
            "throughput / no layer",
        ]);
        common::row(&["---", "---", "---", "---"]);
        common::row(&["no layer", &fmt_us(&t_none), "", "1"]);
        for (name, t) in [
            ("execute, store filling from empty", &t_empty),
            (
                "execute, store filling from empty, cancel_on_disconnect (never detached)",
                &t_inline,
            ),
            (
                "execute, full store (100,000 entries, each new key evicts one)",
                &t_full,
            ),
            ("replay", &t_replay),
        ] {
            common::row(&[
                name,
                &fmt_us(t),
                &fmt_us(&t.minus(&t_none)),
                &t_none.ratio(t).fmt_ratio(),
            ]);
        }
        println!(
            "\nWhat being detachable costs (execute minus cancel_on_disconnect): {}",
            fmt_us(&t_empty.minus(&t_inline))
        );
        println!(
            "\nAfter a pause of {} ms before each request (median of {idle_n} per round): the \
             thread sleeps (the CPU goes idle) or spins (the CPU stays awake):\n",
            PAUSE.as_millis()
        );
        common::row(&["variant", "time per request", "added by the layer"]);
        common::row(&["---", "---", "---"]);
        for (name, layer, base) in [
            ("after sleeping", &idle_execute, &idle_none),
            ("after spinning", &busy_execute, &busy_none),
        ] {
            common::row(&[&format!("no layer, {name}"), &fmt_us(base), ""]);
            common::row(&[
                &format!("execute, {name}"),
                &fmt_us(layer),
                &fmt_us(&layer.minus(base)),
            ]);
        }
        println!(
            "\nAgainst `idempotent` (its memory store, in its own process, the same request and \
             timing code, right after ours in each round): time per request\n"
        );
        common::row(&["", "ours", "idempotent", "ours / idempotent"]);
        common::row(&["---", "---", "---", "---"]);
        for (name, ours, theirs) in [
            ("no layer, warm", t_none.clone(), peer_warm.0.clone()),
            (
                "execute, added to no layer, warm",
                t_empty.minus(&t_none),
                peer_warm.1.minus(&peer_warm.0),
            ),
            (
                "no layer, after sleeping",
                idle_none.clone(),
                peer_idle.0.clone(),
            ),
            (
                "execute, added to no layer, after sleeping",
                idle_execute.minus(&idle_none),
                peer_idle.1.minus(&peer_idle.0),
            ),
        ] {
            common::row(&[
                name,
                &fmt_us(&ours),
                &fmt_us(&theirs),
                &ours.ratio(&theirs).fmt_ratio(),
            ]);
        }
    });
}

/// One round of the peer's `--round` mode: its (no layer, execute) time per request over
/// `window` (no layer warmed up for `warmup` first), then after a pause (median of `idle_n`),
/// in µs. The peer is killed, and the bench fails, past a deadline.
fn peer_round(
    peer: &std::path::Path,
    window: Duration,
    warmup: Duration,
    idle_n: usize,
) -> [f64; 4] {
    use std::io::Read;
    let mut child = std::process::Command::new(peer)
        .args([
            "--round",
            &window.as_millis().to_string(),
            &warmup.as_millis().to_string(),
            &idle_n.to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run the idempotent peer {}: {e}", peer.display()));
    // Ten times what the round should take, and a minute.
    let deadline = std::time::Instant::now()
        + Duration::from_secs(60)
        + 10 * (warmup + 2 * window + 2 * (idle_n as u32) * PAUSE);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the idempotent peer") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the idempotent peer's --round did not end in time: killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().map(|mut s| s.read_to_string(&mut out));
    child.stderr.take().map(|mut s| s.read_to_string(&mut err));
    // One line of four numbers, nothing else.
    let figures: Option<Vec<f64>> = out.trim().split(' ').map(|f| f.parse().ok()).collect();
    match figures.as_deref() {
        Some(&[a, b, c, d]) if status.success() && !out.trim().contains('\n') => [a, b, c, d],
        _ => panic!("the idempotent peer's --round printed {out:?} ({status}): {err}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        let variant = args.get(at + 1).map_or("execute", String::as_str);
        let n: u64 = args
            .get(at + 2)
            .and_then(|n| n.parse().ok())
            .unwrap_or(20_000);
        // On the Redis store at `REDIS_URL` if set (its records outlive the process: this run's
        // keys carry the process id and the time), else on a new memory store.
        let redis = std::env::var("REDIS_URL").ok();
        let run = common::profiled::run_prefix(redis.is_some());
        if redis.is_some() && variant == "full" {
            panic!("--profile full fills the memory store's bound: not with REDIS_URL");
        }
        let rt = runtime();
        let app = rt.block_on(async {
            let store = match redis.as_deref() {
                Some(url) => Store::redis(url)
                    .unwrap_or_else(|e| panic!("the Redis store at REDIS_URL: {e}")),
                None => Store::memory(),
            };
            app_on(
                match variant {
                    "none" => "none",
                    "inline" => "inline",
                    _ => "detached",
                },
                store,
            )
        });
        rt.block_on(async {
            if variant == "full" {
                fill_store(&app, FILL).await;
            }
            let stored = format!("{run}stored");
            // A store that cannot be reached answers 503: profiling that would be no use.
            assert!(succeeded(&app, &stored).await, "the first request failed");
            let mut failed = 0u64;
            for i in 0..n {
                let key = if variant == "replay" {
                    stored.clone()
                } else {
                    format!("{run}k-{i}")
                };
                failed += u64::from(!black_box(
                    common::profiled::profiled(succeeded(&app, &key)).await,
                ));
            }
            assert_eq!(failed, 0, "{failed} of {n} requests were not answered 2xx");
            if variant == "replay" {
                let again = app.clone().oneshot(request(&stored)).await.unwrap();
                assert!(
                    again
                        .headers()
                        .contains_key(tower_idempotency::IDEMPOTENT_REPLAYED),
                    "the replay variant did not replay"
                );
            }
        });
        return;
    }
    let mode = common::Mode::from_args();
    // `cargo test` (no `--bench`) runs the ratio rounds once, briefly, to prove they work.
    if args.iter().any(|a| a == "--ratios") || !mode.full {
        ratios(mode);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
