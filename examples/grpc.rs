//! A gRPC payment service: `CreatePayment` made idempotent by the `idempotency-key` metadata
//! entry (see `examples/proto/payments.proto` and `examples/shared/payments.rs`).
//!
//! ```sh
//! cargo run --example grpc           # serves on 127.0.0.1:50051 and calls itself: a create, a
//!                                    # retry with the same key (replayed), a reused key
//! BIND=127.0.0.1:50052 REDIS_URL=redis://127.0.0.1:6379/ IDEMPOTENCY_SECRET=... cargo run --example grpc
//! ```
//!
//! Rejections are gRPC statuses: `ABORTED` while the first call with a key is in flight,
//! `INVALID_ARGUMENT` for a key reused with another request, `UNAVAILABLE` when the store
//! cannot be reached. A retry after the client gave up gets the first call's payment, with its
//! `grpc-status` trailer.

#[path = "shared/env.rs"]
mod env;
#[path = "shared/payments.rs"]
#[allow(dead_code)]
mod payments;

use std::time::Duration;

use payments::{CreatePaymentRequest, Ledger, PaymentsServer, create_payment};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    let bind: std::net::SocketAddr = std::env::var("BIND")
        .unwrap_or_else(|_| "127.0.0.1:50051".into())
        .parse()?;
    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let ledger = Ledger::with_work(Duration::from_millis(100));
    let server = tonic::transport::Server::builder()
        .layer(tonic::service::InterceptorLayer::new(
            payments::authenticate,
        ))
        .layer(payments::idempotency(store.clone(), &secret)?)
        .add_service(PaymentsServer::new(ledger.clone()));
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    println!(
        "payments gRPC service on {addr} (idempotency store: {})",
        store.describe()
    );
    let serving = tokio::spawn(
        server.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let create = CreatePaymentRequest {
        order_id: "ord_1".into(),
        amount: 1000,
        currency: "eur".into(),
    };
    let (first, _) = create_payment(
        channel.clone(),
        "merchant-a",
        Some("pay-ord_1"),
        create.clone(),
    )
    .await?;
    println!("created: {first:?}");
    let (again, replayed) = create_payment(
        channel.clone(),
        "merchant-a",
        Some("pay-ord_1"),
        create.clone(),
    )
    .await?;
    println!("retried: {again:?} (replayed: {replayed})");
    let other = CreatePaymentRequest {
        amount: 9999,
        ..create
    };
    match create_payment(channel, "merchant-a", Some("pay-ord_1"), other).await {
        Err(status) => println!("reused key: {:?} {}", status.code(), status.message()),
        Ok(p) => println!("unexpected: {p:?}"),
    }
    println!(
        "ledger: {} payment(s); serving until Ctrl-C",
        ledger.payments().len()
    );
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        result = serving => { result??; }
    }
    Ok(())
}
