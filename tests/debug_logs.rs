//! What the layer logs: its debug span names the route, never the path the client sent. In a
//! test binary of its own: a subscriber set for one test (`with_default`) while other tests of
//! the process hit the same callsites concurrently can find them cached as disabled (it
//! failed once in CI that way, its logs empty, when it ran among the router tests).

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use support::{SECRET, counting, send};
use tower_idempotency::key;
use tower_idempotency::{IdempotencyLayer, IdempotencyLayerBuilder, Store};

fn builder(store: &Store) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store.clone())
        .secret(SECRET)
        .unwrap()
}

fn post_req(path: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Body::empty())
        .unwrap()
}

/// The layer's debug span names the route template, never the path the client sent: with
/// `key::path("phone")` the path holds a phone number, and spans are exported and logged
/// (before, the span's `path` field carried `/users/+15550100/verify` into every debug line of
/// the request and every exported span).
#[test]
fn debug_logs_name_the_route_never_the_path() {
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        // Callsites hit before this subscriber existed (by another test of the process, when
        // this file ran among others) may hold a cached "never": looked at again now.
        tracing::callsite::rebuild_interest_cache();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (runs, verify) = counting();
            let app = Router::new()
                .route("/users/{phone}/verify", post(verify))
                .layer(
                    builder(&Store::memory())
                        .key(key::path("phone"))
                        .build()
                        .unwrap(),
                );
            let first = send(&app, post_req("/users/+15550100/verify")).await;
            let again = send(&app, post_req("/users/+15550100/verify")).await;
            assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
            assert!(again.replayed(), "{again:?}");
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        });
    });
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("route=\"/users/{phone}/verify\""),
        "the span names the route: {logs}"
    );
    assert!(
        !logs.contains("15550100"),
        "the phone number is in the logs: {logs}"
    );
}
