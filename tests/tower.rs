//! The layer outside axum: a plain tower stack built with `ServiceBuilder`, with `Full<Bytes>`
//! requests and `String` responses (the layer is generic over body types; the inner service
//! gets the layer's `RequestBody` around the original body type).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, RequestBody, Store, key::RouteTemplate,
};

#[tokio::test]
async fn works_in_a_service_builder_with_other_body_types() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let mut svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::builder(Store::memory())
                .global_keys()
                .build()
                .unwrap(),
        )
        .service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let counter = counter.clone();
            async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let fence = req
                    .extensions()
                    .get::<IdempotencyContext>()
                    .and_then(|c| c.fence());
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let mut res = Response::new(format!(
                    "run {n} fence {fence:?} body {}",
                    String::from_utf8_lossy(&body)
                ));
                *res.status_mut() = StatusCode::ACCEPTED;
                Ok::<_, Infallible>(res)
            }
        });
    let request = || {
        let mut r = Request::post("/jobs/7")
            .header("idempotency-key", "job-7")
            .body(Full::new(Bytes::from_static(b"payload")))
            .unwrap();
        r.extensions_mut()
            .insert(RouteTemplate("/jobs/{id}".into()));
        r
    };
    let first = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first_body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &first_body[..],
        b"run 1 fence Some(1) body payload",
        "the handler sees the original body"
    );
    let second = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(
        second.into_body().collect().await.unwrap().to_bytes(),
        first_body
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
