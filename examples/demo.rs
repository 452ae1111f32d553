//! Fires 50 concurrent duplicate signups (one phone number) at the signup service running in
//! this process, then a retry, and prints what each got: one 201, 49 × 409, the retry replayed.
//! For contrast it first does the same without the layer.
//!
//! ```sh
//! cargo run --example demo                                    # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example demo  # Redis
//! ```

#[path = "shared/env.rs"]
mod env;
#[path = "shared/signup.rs"]
#[allow(dead_code)] // each example uses part of the shared service
mod signup_app;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const DUPLICATES: usize = 50;

async fn serve(app: Router) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Sends one signup; returns (status, replayed).
async fn signup(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    addr: std::net::SocketAddr,
    phone: &str,
) -> Result<(u16, bool), Box<dyn std::error::Error + Send + Sync>> {
    let request = http::Request::post(format!("http://{addr}/signup"))
        .header("content-type", "application/json")
        .body(Body::from(format!(r#"{{"phone":"{phone}","name":"Ada"}}"#)))?;
    let response = client.request(request).await?;
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status().as_u16();
    response.into_body().collect().await?;
    Ok((status, replayed))
}

async fn burst(
    addr: std::net::SocketAddr,
    phone: &str,
) -> Result<BTreeMap<String, usize>, Box<dyn std::error::Error + Send + Sync>> {
    let client = Client::builder(TokioExecutor::new()).build_http();
    let tasks: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let client = client.clone();
            let phone = phone.to_owned();
            tokio::spawn(async move { signup(&client, addr, &phone).await })
        })
        .collect();
    let mut tally = BTreeMap::new();
    for task in tasks {
        let (status, replayed) = task.await??;
        let label = if replayed {
            format!("{status} (replayed)")
        } else {
            status.to_string()
        };
        *tally.entry(label).or_default() += 1;
    }
    Ok(tally)
}

fn print_tally(title: &str, tally: &BTreeMap<String, usize>) {
    println!("{title}");
    println!("  {:<16} {:>5}", "response", "count");
    for (label, count) in tally {
        println!("  {label:<16} {count:>5}");
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let work = Duration::from_millis(200);
    let phone = format!("+1555{:07}", std::process::id());

    let bare_users = signup_app::Users::with_work(work);
    let bare = serve(signup_app::unprotected(bare_users.clone())).await?;
    let tally = burst(bare, &phone).await?;
    print_tally(
        &format!("without the layer: {DUPLICATES} concurrent signups for {phone}"),
        &tally,
    );
    println!(
        "  rows for {phone}: {}\n",
        bare_users
            .count_by_phone()
            .await
            .get(&phone)
            .copied()
            .unwrap_or(0)
    );

    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let users = signup_app::Users::with_work(work);
    let addr = serve(signup_app::app(store.clone(), &secret, users.clone())?).await?;
    let tally = burst(addr, &phone).await?;
    print_tally(
        &format!(
            "with IdempotencyLayer ({}): {DUPLICATES} concurrent signups for {phone}",
            store.describe()
        ),
        &tally,
    );
    let client = Client::builder(TokioExecutor::new()).build_http();
    let (status, replayed) = signup(&client, addr, &phone).await?;
    println!(
        "  a retry afterwards: {status}{}",
        if replayed { " (replayed)" } else { "" }
    );
    let rows = users
        .count_by_phone()
        .await
        .get(&phone)
        .copied()
        .unwrap_or(0);
    println!("  rows for {phone}: {rows}");

    let created = tally.get("201").copied().unwrap_or(0);
    let conflicts = tally.get("409").copied().unwrap_or(0);
    if created != 1 || conflicts != DUPLICATES - 1 || !(status == 201 && replayed) || rows != 1 {
        return Err(
            "unexpected outcome: expected one 201, the rest 409, a replayed retry and one row"
                .into(),
        );
    }
    println!("\nok: one account, one execution, every duplicate answered");
    Ok(())
}
