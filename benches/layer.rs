//! The layer's own cost per request, in process (no HTTP, no sockets): the same trivial JSON
//! handler called through an axum `Router` without the layer, with it on the memory store
//! (execute: a new key each time; replay: a stored key), and in `cancel_on_disconnect` mode
//! (the execution driven inline instead of spawned, which isolates what detaching costs), and
//! the same request after the thread slept (a CPU that was idle, as at low traffic).
//!
//! ```sh
//! cargo bench --bench layer -- --ratios                  # per-round ratios against no layer
//! cargo bench --bench layer                              # criterion: time per request
//! cargo bench --bench layer -- --profile execute 20000   # a fixed run, for callgrind/perf
//!                                                        # (execute, replay, inline, none, full):
//! valgrind --tool=callgrind target/release/deps/layer-* --profile execute 20000
//! # (common::profiled: every poll of a profiled request in `poll_profiled`)
//! ```

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::Series;
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
    let routes = Router::new().route("/pay", post(pay));
    let layer = |cancel: bool| {
        // The default store: 100,000 entries (the "full" variants fill it first).
        IdempotencyLayer::builder(Store::memory())
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

/// Time per request (µs) of `app` over `window`, keys from `key`.
async fn per_request(app: &Router, window: Duration, mut key: impl FnMut() -> String) -> f64 {
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < window {
        for _ in 0..100 {
            black_box(one(app, &key()).await);
        }
        n += 100;
    }
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// The pause before each request of [`after_pause`]: long enough for the CPU to go idle.
const PAUSE: Duration = Duration::from_millis(10);

/// Median time (µs) of `n` requests of `app`, each after a [`PAUSE`]: with `sleep`, the thread
/// sleeps and the CPU goes idle (on this VM a halted vCPU, which comes back with cold caches,
/// TLB and predictors), as between the requests of a service at low traffic; without, it spins,
/// so the CPU stays awake and only time passes (timers, the store's expiries). The runtime is
/// blocked during the pause.
async fn after_pause(app: &Router, n: usize, sleep: bool, mut key: impl FnMut() -> String) -> f64 {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let key = key();
        if sleep {
            std::thread::sleep(PAUSE);
        } else {
            let spin = Instant::now();
            while spin.elapsed() < PAUSE {
                std::hint::spin_loop();
            }
        }
        let started = Instant::now();
        black_box(one(app, &key).await);
        samples.push(started.elapsed());
    }
    common::percentile_us(&mut samples, 50.0)
}

/// Rounds of: no layer, then each variant, back to back; the layer's added time per request
/// and throughput ratios, min / median / max over the rounds.
fn ratios(mode: common::Mode) {
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
        let idle_n = if mode.full { 60 } else { 3 };
        for _ in 0..mode.rounds {
            // A new store per round: "empty" is a store filling up from nothing.
            let empty = app("detached");
            per_request(&none, mode.warmup, &mut fresh).await;
            t_none.push(per_request(&none, mode.window, &mut fresh).await);
            t_empty.push(per_request(&empty, mode.window, &mut fresh).await);
            let inline = app("inline");
            t_inline.push(per_request(&inline, mode.window, &mut fresh).await);
            per_request(&full, mode.warmup, &mut fresh).await;
            t_full.push(per_request(&full, mode.window, &mut fresh).await);
            t_replay.push(per_request(&replay, mode.window, || "stored".to_owned()).await);
            idle_none.push(after_pause(&none, idle_n, true, &mut fresh).await);
            idle_execute.push(after_pause(&empty, idle_n, true, &mut fresh).await);
            busy_none.push(after_pause(&none, idle_n, false, &mut fresh).await);
            busy_execute.push(after_pause(&empty, idle_n, false, &mut fresh).await);
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
    });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        let variant = args.get(at + 1).map_or("execute", String::as_str);
        let n: u64 = args
            .get(at + 2)
            .and_then(|n| n.parse().ok())
            .unwrap_or(20_000);
        let rt = runtime();
        let app = rt.block_on(async {
            app(match variant {
                "none" => "none",
                "inline" => "inline",
                _ => "detached",
            })
        });
        rt.block_on(async {
            if variant == "full" {
                fill_store(&app, FILL).await;
            }
            one(&app, "stored").await;
            for i in 0..n {
                let key = if variant == "replay" {
                    "stored".to_owned()
                } else {
                    format!("k-{i}")
                };
                black_box(common::profiled::profiled(one(&app, &key)).await);
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
