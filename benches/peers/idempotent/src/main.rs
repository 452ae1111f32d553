//! The `idempotent` crate's axum layer as a server for benches/http.rs, on the bench's terms:
//! the same handler and the same contract as the bench's own `--serve` variants.
//!
//! ```sh
//! idempotent-peer <variant> <redis_url>   # variant: memory | valkey
//! ```
//!
//! ```sh
//! idempotent-peer --profile <execute|replay|none> <n>   # in process, like benches/layer.rs
//! REDIS_URL=redis://… idempotent-peer --profile execute <n>   # the same on its Valkey store
//! idempotent-peer --round <window_ms> <warmup_ms> <idle_n>  # one round of benches/layer.rs's comparison
//! ```
//!
//! It prints its port on the first line of stdout, and exits when stdin closes. The URL is
//! read by the `valkey` variant only, but always given, as the bench gives it to every variant.
//!
//! The layer is configured as a service would configure it: keys from the `Idempotency-Key`
//! header, a 30 s processing lease, responses replayed for an hour, the default fingerprint
//! (method, path, query and body), keys not scoped (the load generator is one client). A
//! replayed response carries `idempotent-replayed: true`.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderName, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use idempotent::memory::MemoryStore;
use idempotent::middleware::IdempotencyLayer;
use idempotent::valkey::ValkeyStore;

/// How long a claim outlives a server that died holding it (renewed while the handler runs).
const PROCESSING_TTL: Duration = Duration::from_secs(30);
/// How long a stored response replays.
const COMPLETED_TTL: Duration = Duration::from_secs(3600);

/// The bench's handler (`pay` in benches/http.rs), unchanged.
async fn pay(body: Bytes) -> (StatusCode, axum::Json<serde_json::Value>) {
    static ID: AtomicU64 = AtomicU64::new(0);
    let id = ID.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "status": "paid", "bytes": body.len()})),
    )
}

/// The peer's layer over `store`, configured as a service would.
fn layer<S>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store)
        .header(HeaderName::from_static("idempotency-key"))
        .processing_ttl(PROCESSING_TTL)
        .completed_ttl(COMPLETED_TTL)
}

async fn app(variant: &str, redis_url: &str) -> Router {
    let routes = Router::new().route("/pay", post(pay));
    match variant {
        "memory" => routes.layer(layer(
            MemoryStore::builder()
                .try_build()
                .expect("the memory store"),
        )),
        "valkey" => routes.layer(layer(
            ValkeyStore::with_url(redis_url)
                .prefix("pay")
                .try_build()
                .await
                .unwrap_or_else(|e| panic!("the Valkey store at {redis_url}: {e}")),
        )),
        other => panic!("unknown variant {other} (expected memory or valkey)"),
    }
}

/// The request of benches/layer.rs, byte for byte.
fn request(key: &str) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/pay")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            r#"{"amount":1000,"currency":"eur"}"#,
        ))
        .unwrap()
}

async fn one(app: &Router, key: &str) -> usize {
    use tower::ServiceExt;
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    body.len()
}

/// [`one`], and whether the answer was a success (the profile loop checks every answer).
async fn succeeded(app: &Router, key: &str) -> bool {
    use tower::ServiceExt;
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let success = response.status().is_success();
    axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    success
}

/// The helper benches/layer.rs profiles its requests with: the same span for callgrind.
#[path = "../../../common/profiled.rs"]
#[allow(dead_code, unreachable_pub)]
mod profiled;

/// The bench's route, with the layer on a new memory store or without.
fn in_process_app(layered: bool) -> Router {
    let routes = Router::new().route("/pay", post(pay));
    let app = if layered {
        routes.layer(layer(
            MemoryStore::builder()
                .try_build()
                .expect("the memory store"),
        ))
    } else {
        routes
    };
    // What `axum::serve` does once, as benches/layer.rs does for ours: without it, every call
    // would make the route and apply the layer again.
    app.with_state(())
}

/// Timing shared with benches/layer.rs.
#[path = "../../../common/in_process.rs"]
#[allow(dead_code, unreachable_pub)]
mod in_process;

/// [`one`] with the key owned: the shape `in_process` calls.
async fn call(app: &Router, key: String) -> usize {
    one(app, &key).await
}

/// `--round <window_ms> <warmup_ms> <idle_n>`: one round of benches/layer.rs's comparison, as
/// it measures ours: no layer and execute (a new key each time, on a store filling from
/// empty), time per request over the window, then the median of `idle_n` requests each after
/// the thread slept. Prints the four figures in µs, on one line.
fn round(window: Duration, warmup: Duration, idle_n: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (none, execute) = (in_process_app(false), in_process_app(true));
        let mut counter = 0u64;
        let mut fresh = move || {
            counter += 1;
            format!("k-{counter}")
        };
        in_process::per_request(warmup, &mut fresh, |k| call(&none, k)).await;
        let warm_none = in_process::per_request(window, &mut fresh, |k| call(&none, k)).await;
        let warm = in_process::per_request(window, &mut fresh, |k| call(&execute, k)).await;
        let idle_none = in_process::after_pause(idle_n, true, &mut fresh, |k| call(&none, k)).await;
        let idle = in_process::after_pause(idle_n, true, &mut fresh, |k| call(&execute, k)).await;
        println!("{warm_none} {warm} {idle_none} {idle}");
    });
}

/// `--profile <execute|replay|none> <n>`: n requests in process on a current-thread runtime,
/// as `cargo bench --bench layer -- --profile` runs ours.
fn profile(variant: &str, n: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // On its Valkey store at `REDIS_URL` if set (its records outlive the process: this run's
    // keys carry the process id and the time), as benches/layer.rs runs ours.
    let redis = std::env::var("REDIS_URL").ok();
    let run = profiled::run_prefix(redis.is_some());
    runtime.block_on(async {
        let app = match (&redis, variant) {
            (Some(url), "execute" | "replay") => app("valkey", url).await.with_state(()),
            _ => in_process_app(variant != "none"),
        };
        let stored = format!("{run}stored");
        // A store that cannot be reached answers an error: profiling that would be no use.
        assert!(succeeded(&app, &stored).await, "the first request failed");
        let started = std::time::Instant::now();
        let mut failed = 0u64;
        for i in 0..n {
            let key = if variant == "replay" {
                stored.clone()
            } else {
                format!("{run}k-{i}")
            };
            failed += u64::from(!std::hint::black_box(
                profiled::profiled(succeeded(&app, &key)).await,
            ));
        }
        assert_eq!(failed, 0, "{failed} of {n} requests were not answered 2xx");
        if variant == "replay" {
            use tower::ServiceExt;
            let again = app.clone().oneshot(request(&stored)).await.unwrap();
            assert!(
                again.headers().contains_key("idempotent-replayed"),
                "the replay variant did not replay"
            );
        }
        let per = started.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("{variant}: {per:.2} µs per request");
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, window, warmup, idle_n] = args.as_slice()
        && flag == "--round"
    {
        let ms = |v: &str| Duration::from_millis(v.parse().expect("milliseconds"));
        round(
            ms(window),
            ms(warmup),
            idle_n.parse().expect("a number of requests"),
        );
        return;
    }
    if let [flag, variant, n] = args.as_slice()
        && flag == "--profile"
    {
        profile(variant, n.parse().expect("a number of requests"));
        return;
    }
    let [variant, redis_url] = args.as_slice() else {
        eprintln!("usage: idempotent-peer <memory|valkey> <redis_url>");
        std::process::exit(2);
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = app(variant, redis_url).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{}", listener.local_addr().unwrap().port()).unwrap();
        stdout.flush().unwrap();
        drop(stdout);
        // Stop when the driver goes away (stdin closes).
        std::thread::spawn(|| {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
            std::process::exit(0);
        });
        axum::serve(listener, app).await.unwrap();
    });
}
