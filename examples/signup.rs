//! Signup service: one account per phone number, however often and on however many instances
//! the form is submitted. Open http://127.0.0.1:3000/ in a browser for the HTML form (each
//! render carries its own idempotency key in a hidden field; a double-click, the back button and
//! a resubmission, or a second tab all end on the one account's page), or use the JSON API.
//!
//! ```sh
//! cargo run --example signup                                 # in-memory store, 127.0.0.1:3000
//! IDEMPOTENCY_SECRET=$(head -c32 /dev/urandom | base64) # the same on every instance
//! REDIS_URL=redis://127.0.0.1:6379/ BIND=127.0.0.1:3001 cargo run --example signup
//! IDEMPOTENCY=off cargo run --example signup                 # no layer: see the duplicates
//! DATABASE_URL=postgres://... cargo run --example signup --features postgres
//!                     # users in the table `users`, inserted in the layer's transaction
//! curl -i -X POST localhost:3000/signup -H 'content-type: application/json' \
//!      -d '{"phone":"+15550100","name":"Ada"}'
//! ```

#[path = "shared/env.rs"]
mod env;
#[path = "shared/signup.rs"]
#[allow(dead_code)] // each example uses part of the shared service
mod signup_app;

use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let work = Duration::from_millis(300);
    let users = match env::database_url()? {
        #[cfg(feature = "postgres")]
        Some(url) => signup_app::Users::postgres(&url, "users", work).await?,
        _ => signup_app::Users::with_work(work),
    };
    let protected = std::env::var("IDEMPOTENCY").map_or(true, |v| v != "off");
    let app = if protected {
        signup_app::app(store.clone(), &secret, users)?
    } else {
        signup_app::unprotected(users)
    };
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    println!(
        "signup service on http://{} (idempotency store: {})",
        listener.local_addr()?,
        if protected {
            store.describe()
        } else {
            "none, IDEMPOTENCY=off".into()
        }
    );
    println!(
        "open http://{}/ in a browser and double-click \"Sign up\"",
        listener.local_addr()?
    );
    println!(
        "or:  curl -i -X POST http://{}/signup -H 'content-type: application/json' -d '{{\"phone\":\"+15550100\",\"name\":\"Ada\"}}'",
        listener.local_addr()?
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
