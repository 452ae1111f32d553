//! The gRPC example (`examples/grpc.rs`) with a real tonic client over HTTP/2: retries replay
//! the first call's message and `grpc-status` trailer, concurrent calls with one key charge
//! once, and rejections are the gRPC statuses a client expects. On memory and on Redis.

#[macro_use]
mod support;

#[path = "../examples/shared/payments.rs"]
#[allow(dead_code)]
mod payments;

use std::sync::atomic::Ordering;
use std::time::Duration;

use payments::{CreatePaymentRequest, Ledger, PaymentsServer, create_payment};
use support::{SECRET, TestStore, within};
use tonic::Code;
use tonic::transport::Channel;
use tower_idempotency::{IdempotencyLayerBuilder, Store};

async fn serve(store: &Store, ledger: &Ledger) -> Channel {
    serve_with(store, ledger, |b| b).await
}

async fn serve_with(
    store: &Store,
    ledger: &Ledger,
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> Channel {
    let server = tonic::transport::Server::builder()
        .layer(tonic::service::InterceptorLayer::new(
            payments::authenticate,
        ))
        .layer(payments::idempotency_with(store.clone(), SECRET, configure).unwrap())
        .add_service(PaymentsServer::new(ledger.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        server.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn create(order: &str, amount: u64) -> CreatePaymentRequest {
    CreatePaymentRequest {
        order_id: order.into(),
        amount,
        currency: "eur".into(),
    }
}

async fn calls_and_retries(s: TestStore) {
    let ledger = Ledger::with_work(Duration::from_millis(50));
    let channel = serve(&s.store, &ledger).await;
    let (first, replayed) = create_payment(channel.clone(), "m1", Some("k1"), create("o1", 500))
        .await
        .unwrap();
    assert!(!replayed);
    // The retry gets the same message: the replay carries its grpc-status trailer (tonic
    // refuses a response without one).
    let (again, replayed) = create_payment(channel.clone(), "m1", Some("k1"), create("o1", 500))
        .await
        .unwrap();
    assert!(replayed);
    assert_eq!(again, first);
    // The same key from another merchant is another key.
    let (other, replayed) = create_payment(channel.clone(), "m2", Some("k1"), create("o1", 500))
        .await
        .unwrap();
    assert!(!replayed);
    assert_ne!(other.id, first.id);
    // A key reused with another request: INVALID_ARGUMENT; none: INVALID_ARGUMENT.
    let reused = create_payment(channel.clone(), "m1", Some("k1"), create("o1", 999))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::InvalidArgument, "{reused:?}");
    assert!(reused.message().starts_with("key-reused"));
    let keyless = create_payment(channel.clone(), "m1", None, create("o1", 1))
        .await
        .unwrap_err();
    assert_eq!(keyless.code(), Code::InvalidArgument, "{keyless:?}");
    assert!(keyless.message().starts_with("missing-key"));
    // Unauthenticated: the interceptor answers before the layer.
    let mut unauthenticated = tonic::client::Grpc::new(channel.clone());
    unauthenticated.ready().await.unwrap();
    let status = unauthenticated
        .unary::<_, payments::Payment, _>(
            tonic::Request::new(create("o1", 1)),
            http::uri::PathAndQuery::from_static(payments::CREATE_PAYMENT),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    // The handler's own errors: INVALID_ARGUMENT, as a 4xx, is refused without effect (not
    // stored: the corrected call runs with the key), UNAVAILABLE retryable.
    let calls = ledger.calls.load(Ordering::SeqCst);
    for _ in 0..2 {
        let zero = create_payment(channel.clone(), "m1", Some("zero"), create("o2", 0))
            .await
            .unwrap_err();
        assert_eq!(zero.code(), Code::InvalidArgument);
    }
    assert_eq!(ledger.calls.load(Ordering::SeqCst), calls + 2, "not stored");
    for _ in 0..2 {
        let down = create_payment(
            channel.clone(),
            "m1",
            Some("down"),
            create("provider-down", 5),
        )
        .await
        .unwrap_err();
        assert_eq!(down.code(), Code::Unavailable);
    }
    assert_eq!(ledger.calls.load(Ordering::SeqCst), calls + 4, "run again");
    assert_eq!(ledger.payments().len(), 2);
}

async fn concurrent_calls_charge_once(s: TestStore) {
    let ledger = Ledger::with_work(Duration::from_millis(200));
    let channel = serve(&s.store, &ledger).await;
    // 20 calls with one key at once: one executes, the others get ABORTED while it runs.
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let channel = channel.clone();
            tokio::spawn(async move {
                create_payment(channel, "m1", Some("burst"), create("o3", 700)).await
            })
        })
        .collect();
    let mut created = Vec::new();
    for call in calls {
        match within("a concurrent call", call).await.unwrap() {
            Ok((payment, _)) => created.push(payment),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert!(status.message().starts_with("conflict"));
            }
        }
    }
    assert!(!created.is_empty());
    // Clients that retry on ABORTED all end with the one payment.
    let retries: Vec<_> = (0..5)
        .map(|_| {
            let channel = channel.clone();
            tokio::spawn(async move {
                loop {
                    match create_payment(channel.clone(), "m1", Some("burst"), create("o3", 700))
                        .await
                    {
                        Ok((payment, _)) => return payment,
                        Err(s) if s.code() == Code::Aborted => {
                            tokio::time::sleep(Duration::from_millis(20)).await
                        }
                        Err(s) => panic!("{s:?}"),
                    }
                }
            })
        })
        .collect();
    for retry in retries {
        let payment = within("a retrying client", retry).await.unwrap();
        assert_eq!(payment, created[0]);
    }
    assert_eq!(ledger.payments().len(), 1, "charged once");
}

/// A response over the record limit is sent in full and stored without its body: the retry is
/// told so (FAILED_PRECONDITION, never run again), and with the outcome a gRPC client knows it
/// by, the first call's `grpc-status` (before: only "status 200", which every gRPC response
/// has). Its trailers are kept with the outcome.
async fn a_response_not_kept_names_its_grpc_status(s: TestStore) {
    let ledger = Ledger::default();
    let channel = serve_with(&s.store, &ledger, |b| b.record_limit(4)).await;
    let (first, replayed) = create_payment(channel.clone(), "m1", Some("big"), create("o1", 5))
        .await
        .unwrap();
    assert!(!replayed, "the first call gets its payment: {first:?}");
    let retry = create_payment(channel.clone(), "m1", Some("big"), create("o1", 5))
        .await
        .unwrap_err();
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert!(
        retry.message().starts_with("response-not-stored"),
        "{retry:?}"
    );
    assert!(
        retry.message().contains("grpc-status 0"),
        "the first call's grpc-status (OK) is named: {retry:?}"
    );
    assert_eq!(ledger.calls.load(Ordering::SeqCst), 1, "never run again");
}

both_stores!(
    calls_and_retries,
    concurrent_calls_charge_once,
    a_response_not_kept_names_its_grpc_status
);

/// A trailers-only gRPC reply (its `grpc-status` in the head) whose outcome is stored without
/// its body: the retry's rejection carries one `grpc-status`, its own (before: the stored `0`
/// was copied beside it, and a client that reads the last value took the retry for a success).
#[tokio::test]
async fn a_trailers_only_reply_not_kept_is_refused_with_one_grpc_status() {
    use axum::response::IntoResponse;
    let layer = tower_idempotency::IdempotencyLayer::builder(Store::memory())
        .secret(SECRET)
        .unwrap()
        .principal(|_: &http::request::Parts| Some("anonymous".into()))
        .grpc_rejections()
        .build()
        .unwrap();
    let app = axum::Router::new()
        .route(
            "/p.S/M",
            axum::routing::post(|| async {
                let mut reply = (
                    [("content-type", "application/grpc"), ("grpc-status", "0")],
                    (),
                )
                    .into_response();
                reply
                    .extensions_mut()
                    .insert(tower_idempotency::KeepBody::No);
                reply
            }),
        )
        .layer(layer);
    let call = || {
        http::Request::post("/p.S/M")
            .header("content-type", "application/grpc")
            .header("idempotency-key", "k")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let first = support::send(&app, call()).await;
    assert_eq!(first.headers["grpc-status"], "0", "{first:?}");
    let retry = support::send(&app, call()).await;
    let statuses: Vec<_> = retry.headers.get_all("grpc-status").iter().collect();
    assert_eq!(
        statuses,
        [&http::HeaderValue::from(Code::FailedPrecondition as u16)],
        "{retry:?}"
    );
    let message = retry.headers["grpc-message"].to_str().unwrap();
    assert!(message.contains("grpc-status 0"), "{message}");
}

/// The store unreachable: UNAVAILABLE, the handler not run.
#[tokio::test]
async fn an_unreachable_store_is_unavailable() {
    let port = testkit::free_port().unwrap();
    let store = Store::redis(&format!("redis://127.0.0.1:{port}/")).unwrap();
    let ledger = Ledger::default();
    let channel = serve(&store, &ledger).await;
    let status = create_payment(channel, "m1", Some("k"), create("o", 1))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with("store-unavailable"));
    assert_eq!(ledger.calls.load(Ordering::SeqCst), 0);
}
