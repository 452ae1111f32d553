//! The `idempotent` crate's axum layer as a server for benches/http.rs, on the bench's terms:
//! the same handler and the same contract as the bench's own `--serve` variants.
//!
//! ```sh
//! idempotent-peer <variant> <redis_url>   # variant: memory | valkey
//! ```
//!
//! ```sh
//! idempotent-peer --profile <execute|replay|none> <n>   # in process, like benches/layer.rs
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

/// The helper benches/layer.rs profiles its requests with: the same span for callgrind.
#[path = "../../../common/profiled.rs"]
#[allow(dead_code, unreachable_pub)]
mod profiled;

/// `--profile <execute|replay|none> <n>`: n requests in process on a current-thread runtime,
/// as `cargo bench --bench layer -- --profile` runs ours.
fn profile(variant: &str, n: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let routes = Router::new().route("/pay", post(pay));
        let app = if variant == "none" {
            routes
        } else {
            routes.layer(layer(
                MemoryStore::builder()
                    .try_build()
                    .expect("the memory store"),
            ))
        };
        one(&app, "stored").await;
        let started = std::time::Instant::now();
        for i in 0..n {
            let key = if variant == "replay" {
                "stored".to_owned()
            } else {
                format!("k-{i}")
            };
            std::hint::black_box(profiled::profiled(one(&app, &key)).await);
        }
        let per = started.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("{variant}: {per:.2} µs per request");
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
