//! A gRPC payment service (`examples/proto/payments.proto`) behind the idempotency layer: the
//! key is the `idempotency-key` metadata entry, scoped to the merchant that an authentication
//! interceptor established; rejections are gRPC statuses; a replay carries the first call's
//! message and its `grpc-status` trailer.
//!
//! The messages are prost derives matching the `.proto` field for field, and the service is
//! wired with tonic's own `Grpc` server and client types (what `tonic-build` generates), so the
//! example needs no build script and no `protoc`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tonic::server::{NamedService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;
use tower::Service;
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, Store, principal,
};

/// `payments.v1.CreatePaymentRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CreatePaymentRequest {
    #[prost(string, tag = "1")]
    pub(crate) order_id: String,
    #[prost(uint64, tag = "2")]
    pub(crate) amount: u64,
    #[prost(string, tag = "3")]
    pub(crate) currency: String,
}

/// `payments.v1.Payment`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Payment {
    #[prost(string, tag = "1")]
    pub(crate) id: String,
    #[prost(string, tag = "2")]
    pub(crate) order_id: String,
    #[prost(uint64, tag = "3")]
    pub(crate) amount: u64,
    #[prost(string, tag = "4")]
    pub(crate) currency: String,
    #[prost(uint64, tag = "5")]
    pub(crate) fence: u64,
}

pub(crate) const CREATE_PAYMENT: &str = "/payments.v1.Payments/CreatePayment";

/// The payments "table": never deduplicated here, that is the layer's job.
#[derive(Clone, Default)]
pub(crate) struct Ledger {
    payments: Arc<Mutex<Vec<Payment>>>,
    /// Every call of the handler, including those that charged nothing.
    pub(crate) calls: Arc<std::sync::atomic::AtomicUsize>,
    /// Simulated latency of the charge.
    pub(crate) work: Duration,
}

impl Ledger {
    pub(crate) fn with_work(work: Duration) -> Self {
        Ledger {
            payments: Arc::default(),
            calls: Arc::default(),
            work,
        }
    }

    pub(crate) fn payments(&self) -> Vec<Payment> {
        self.payments.lock().unwrap().clone()
    }
}

/// The merchant an authentication interceptor established from the bearer token.
#[derive(Clone, Debug)]
pub(crate) struct Merchant(pub(crate) String);

/// The authentication interceptor (a stand-in for a real one): `authorization: Bearer
/// <merchant>` establishes the merchant; without it, `UNAUTHENTICATED`.
pub(crate) fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let merchant = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned)
        .ok_or_else(|| Status::unauthenticated("a bearer token is required"))?;
    request.extensions_mut().insert(Merchant(merchant));
    Ok(request)
}

/// The idempotency layer for the service: keys from the `idempotency-key` metadata entry,
/// scoped to the merchant, rejections as gRPC statuses.
pub(crate) fn idempotency(
    store: Store,
    secret: &[u8],
) -> Result<IdempotencyLayer, tower_idempotency::ConfigError> {
    idempotency_with(store, secret, |b| b)
}

/// [`idempotency`], configured further by `configure` (a test's record limit, say).
pub(crate) fn idempotency_with(
    store: Store,
    secret: &[u8],
    configure: impl FnOnce(IdempotencyLayerBuilder) -> IdempotencyLayerBuilder,
) -> Result<IdempotencyLayer, tower_idempotency::ConfigError> {
    let builder = IdempotencyLayer::builder(store)
        .secret(secret)?
        .principal(principal::extension(|m: &Merchant| m.0.clone()))
        .grpc_rejections();
    configure(builder).build()
}

/// The `payments.v1.Payments` service.
#[derive(Clone)]
pub(crate) struct PaymentsServer {
    ledger: Ledger,
}

impl PaymentsServer {
    pub(crate) fn new(ledger: Ledger) -> Self {
        PaymentsServer { ledger }
    }
}

impl NamedService for PaymentsServer {
    const NAME: &'static str = "payments.v1.Payments";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `CreatePayment`: charges once per call, recording the execution's fencing token.
struct CreatePayment(Ledger);

impl UnaryService<CreatePaymentRequest> for CreatePayment {
    type Response = Payment;
    type Future = BoxFuture<Result<Response<Payment>, Status>>;

    fn call(&mut self, request: Request<CreatePaymentRequest>) -> Self::Future {
        let ledger = self.0.clone();
        Box::pin(async move {
            let fence = request
                .extensions()
                .get::<IdempotencyContext>()
                .and_then(IdempotencyContext::fence)
                .unwrap_or(0);
            ledger
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let create = request.into_inner();
            if create.amount == 0 {
                return Err(Status::invalid_argument("the amount must be above zero"));
            }
            if create.order_id == "provider-down" {
                // Nothing was charged: a gRPC UNAVAILABLE is retryable by default.
                return Err(Status::unavailable("the card network is unreachable"));
            }
            tokio::time::sleep(ledger.work).await;
            let mut payments = ledger.payments.lock().unwrap();
            let payment = Payment {
                id: format!("pay_{}", payments.len() + 1),
                order_id: create.order_id,
                amount: create.amount,
                currency: create.currency,
                fence,
            };
            payments.push(payment.clone());
            Ok(Response::new(payment))
        })
    }
}

impl<B> Service<http::Request<B>> for PaymentsServer
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let ledger = self.ledger.clone();
        Box::pin(async move {
            if request.uri().path() != CREATE_PAYMENT {
                return Ok(Status::unimplemented(request.uri().path().to_owned()).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
            Ok(grpc.unary(CreatePayment(ledger), request).await)
        })
    }
}

/// Calls `CreatePayment` on `channel` with an idempotency key and a merchant token; returns the
/// payment and whether it was a replay.
pub(crate) async fn create_payment(
    channel: tonic::transport::Channel,
    merchant: &str,
    key: Option<&str>,
    create: CreatePaymentRequest,
) -> Result<(Payment, bool), Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut request = Request::new(create);
    let metadata = request.metadata_mut();
    metadata.insert(
        "authorization",
        format!("Bearer {merchant}")
            .parse()
            .map_err(|_| Status::invalid_argument("merchant"))?,
    );
    if let Some(key) = key {
        metadata.insert(
            "idempotency-key",
            key.parse().map_err(|_| Status::invalid_argument("key"))?,
        );
    }
    let response = grpc
        .unary(
            request,
            http::uri::PathAndQuery::from_static(CREATE_PAYMENT),
            ProstCodec::default(),
        )
        .await?;
    let replayed = response
        .metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    Ok((response.into_inner(), replayed))
}
