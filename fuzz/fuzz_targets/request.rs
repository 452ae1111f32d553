//! Arbitrary requests through the whole layer (every key source, fingerprinting, the state
//! machine, the in-memory store): no panic, and every answer is one the layer documents.
#![no_main]

use std::sync::LazyLock;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::{IdempotencyLayer, Store};

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
});

static APP: LazyLock<Router> = LazyLock::new(|| {
    let _guard = RUNTIME.enter();
    let store = Store::memory();
    let layer = |k: Box<dyn tower_idempotency::KeySource>| {
        IdempotencyLayer::builder(store.clone())
            .secret("fuzzing secret, 32 bytes long...")
            .unwrap()
            .global_keys()
            .key(k)
            .body_limit(4096)
            .build()
            .unwrap()
    };
    let ok = || async { (StatusCode::CREATED, "created") };
    Router::new()
        .route("/h", post(ok).patch(ok).layer(layer(Box::new(key::header()))))
        .route("/j", post(ok).layer(layer(Box::new(key::json("/a/0/id").unwrap()))))
        .route("/f", post(ok).layer(layer(Box::new(key::form("k")))))
        .route("/q/{id}", post(ok).layer(layer(Box::new(key::query("k").or(key::path("id"))))))
});

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else { return };
    let path = ["/h", "/j", "/f", "/q/x?k=1"][selector as usize % 4];
    let method = if selector & 0x10 == 0 { Method::POST } else { Method::PATCH };
    let mut request = Request::builder().method(method).uri(path).body(Body::empty()).unwrap();
    // The input is header lines "name\0value\n" up to a blank line, then the body.
    let (head, body) = match rest.windows(2).position(|w| w == b"\n\n") {
        Some(at) => (&rest[..at], &rest[at + 2..]),
        None => (rest, &[][..]),
    };
    for line in head.split(|b| *b == b'\n') {
        let mut parts = line.splitn(2, |b| *b == 0);
        let (Some(name), Some(value)) = (parts.next(), parts.next()) else { continue };
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            request.headers_mut().append(name, value);
        }
    }
    *request.body_mut() = Body::from(body.to_vec());
    let (parts, _) = Request::builder().uri(path).body(()).unwrap().into_parts();
    let _ = tower_idempotency::internals::fingerprint(&parts, body);
    RUNTIME.block_on(async {
        let response = APP.clone().oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        assert!(
            // 405 is the router refusing PATCH on POST-only routes.
            matches!(status, 201 | 400 | 405 | 408 | 409 | 413 | 415 | 422),
            "undocumented status {status}"
        );
        let _ = response.into_body().collect().await;
    });
});
