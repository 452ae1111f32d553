//! The layer's spans exported with OpenTelemetry: every covered request's `idempotency` span
//! (its decision, outcome, a prefix of the key's hash, the store's round trip) is a child of the
//! request's span, and goes out through `tracing-opentelemetry`. This example exports to
//! standard output (no collector needed); swap the exporter for `opentelemetry-otlp` in
//! production.
//!
//! ```sh
//! cargo run --example otel            # in-memory store, 127.0.0.1:3000 (REDIS_URL, BIND)
//! curl -i localhost:3000/payments -H 'idempotency-key: k-1' -H 'content-type: application/json' -d '{"amount":5}'
//! curl -i localhost:3000/payments -H 'idempotency-key: k-1' -H 'content-type: application/json' -d '{"amount":5}'
//! ```
//!
//! Each request prints its spans: `request` and inside it `idempotency`, with
//! `decision=executed` then `decision=replayed`.

#[path = "shared/env.rs"]
mod env;

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tower_idempotency::IdempotencyLayer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

async fn pay() -> (StatusCode, &'static str) {
    tracing::info!("charging the card");
    tokio::time::sleep(Duration::from_millis(50)).await;
    (StatusCode::CREATED, "paid")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Spans go out when they end; a batch exporter suits production better than this simple one.
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        ))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("otel-example")))
        .init();

    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let layer = IdempotencyLayer::builder(store.clone())
        .secret(&secret)?
        .global_keys() // a demo without authentication; scope keys with .principal(...) in yours
        .build()?;
    let app = Router::new()
        .route("/payments", post(pay).route_layer(layer))
        // The request's own span, the parent of the layer's (tower-http's TraceLayer at `info`
        // does the same).
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| {
                use tracing::Instrument;
                let span = tracing::info_span!("request", method = %request.method(), path = %request.uri().path());
                next.run(request).instrument(span)
            },
        ));
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "payments on http://{} (spans to stdout)",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    store.drain(Duration::from_secs(30)).await;
    provider.shutdown()?;
    Ok(())
}
