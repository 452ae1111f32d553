//! Payment webhook receiver: each event is applied to the ledger once, however often the
//! provider delivers it, even while an earlier delivery is still running.
//!
//! ```sh
//! cargo run --example webhook                                # in-memory store, 127.0.0.1:3000
//! curl -i -X POST localhost:3000/webhooks/payments -H 'content-type: application/json' \
//!      -d '{"id":"evt_1","order_id":"ord_9","amount":1000}'
//! curl localhost:3000/ledger
//! ```

#[path = "shared/env.rs"]
mod env;
#[path = "shared/webhook.rs"]
#[allow(dead_code)] // each example uses part of the shared service
mod webhook_app;

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let store = env::store()?;
    let secret = env::secret(&store)?;
    let app = webhook_app::app(
        store.clone(),
        &secret,
        webhook_app::Ledger::with_work(Duration::from_millis(500)),
    )?;
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "webhook receiver on http://{} (idempotency store: {})",
        listener.local_addr()?,
        store.describe()
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Handlers whose clients left run on: let them finish and store their outcomes.
    if !store.drain(Duration::from_secs(30)).await {
        eprintln!("requests still running at exit: their keys stay held until their leases end");
    }
    Ok(())
}
