//! A Stripe webhook receiver: every `payment_intent.succeeded` event is applied to the ledger
//! once, however often and to however many instances Stripe delivers it, even while an earlier
//! delivery still runs; forged deliveries are refused before anything else.
//!
//! ```sh
//! export WEBHOOK_SECRET=whsec_test IDEMPOTENCY_SECRET=$(head -c32 /dev/urandom | base64)
//! cargo run --example webhook                 # in-memory store, 127.0.0.1:3000
//! body='{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1","amount":1000}}}'
//! t=$(date +%s); v1=$(printf '%s.%s' "$t" "$body" | openssl dgst -sha256 -hmac "$WEBHOOK_SECRET" | cut -d' ' -f2)
//! curl -i localhost:3000/webhooks/stripe -H "stripe-signature: t=$t,v1=$v1" \
//!      -H 'content-type: application/json' -d "$body"
//! curl localhost:3000/ledger
//! ```
//!
//! `REDIS_URL` (a shared store for several instances), `IDEMPOTENCY_SECRET` (the same on every
//! instance), `WEBHOOK_SECRET` (the endpoint's signing secret), `BIND` (127.0.0.1:3000) and
//! `WORK_MS` (how long applying a payment takes, 500 by default) come from the environment.
//! With `DATABASE_URL` (and `--features postgres`) the ledger is the table `ledger` of that
//! database, and each entry commits with its event's outcome in one transaction: killed at any
//! moment, the service never applies an event twice.

#[path = "shared/env.rs"]
mod env;
#[path = "shared/webhook.rs"]
#[allow(dead_code)] // each example uses part of the shared service
mod webhook_app;

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let work = match std::env::var("WORK_MS") {
        Ok(ms) => Duration::from_millis(ms.parse().map_err(|e| format!("WORK_MS={ms:?}: {e}"))?),
        Err(_) => Duration::from_millis(500),
    };
    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let webhook_secret = match std::env::var("WEBHOOK_SECRET") {
        Ok(s) if !s.is_empty() => s,
        _ => {
            let mut random = [0u8; 24];
            rand::fill(&mut random[..]);
            let s = format!("whsec_{}", hex::encode(random));
            println!("WEBHOOK_SECRET is not set: using {s} for this process");
            s
        }
    };
    let ledger = match env::database_url()? {
        #[cfg(feature = "postgres")]
        Some(url) => webhook_app::Ledger::postgres(&url, "ledger", work).await?,
        _ => webhook_app::Ledger::with_work(work),
    };
    let app = webhook_app::app(store.clone(), &secret, webhook_secret.as_bytes(), ledger)?;
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "Stripe webhook receiver on http://{}/webhooks/stripe (idempotency store: {})",
        listener.local_addr()?,
        store.describe()
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Handlers whose senders left run on: let them finish and store their outcomes.
    if !store.drain(Duration::from_secs(30)).await {
        eprintln!("requests still running at exit: their keys stay held until their leases end");
    }
    Ok(())
}
