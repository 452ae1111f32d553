//! Operating it: what happened to a key, clearing it, what has run for too long; on the memory
//! store and on Redis, through the layer's own API (the CLI has tests of its own).

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use support::{TestStore, send, wait_until};
use tokio::sync::watch;
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::operate::RequestKey;
use tower_idempotency::{IdempotencyLayer, Store};

/// A handler counting its runs, held while the gate is closed; `/panics` panics.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    open: Arc<watch::Sender<bool>>,
}

impl Handler {
    fn new() -> Self {
        Handler {
            runs: Arc::default(),
            open: Arc::new(watch::Sender::new(true)),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn app(&self, layer: IdempotencyLayer) -> Router {
        let ok = {
            let handler = self.clone();
            move |body: String| {
                let handler = handler.clone();
                async move {
                    let run = handler.runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut open = handler.open.subscribe();
                    open.wait_for(|open| *open).await.unwrap();
                    (StatusCode::CREATED, format!("run {run}: {body}"))
                }
            }
        };
        let panics = {
            let handler = self.clone();
            move || {
                handler.runs.fetch_add(1, Ordering::SeqCst);
                async move {
                    panic!("a handler that panics");
                    #[allow(unreachable_code)]
                    StatusCode::OK
                }
            }
        };
        Router::new()
            .route("/pay", post(ok).route_layer(layer.clone()))
            .route("/panics", post(panics).route_layer(layer))
    }
}

fn layer(store: &Store) -> IdempotencyLayer {
    IdempotencyLayer::builder(store.clone())
        .secret(support::SECRET)
        .unwrap()
        .principal(|p: &http::request::Parts| {
            Some(p.headers.get("x-customer")?.to_str().ok()?.to_owned())
        })
        .build()
        .unwrap()
}

fn pay(customer: &str, key: &str, body: &str) -> http::Request<axum::body::Body> {
    let mut request = support::post_key("/pay", key, body);
    request
        .headers_mut()
        .insert("x-customer", customer.parse().unwrap());
    request
}

fn near(at: Option<SystemTime>, expected: SystemTime) -> bool {
    let Some(at) = at else { return false };
    let diff = at
        .duration_since(expected)
        .or_else(|e| Ok::<_, ()>(e.duration()))
        .unwrap();
    diff < Duration::from_secs(10)
}

/// A key in flight, then completed, then purged; the purge never touches the execution in
/// flight.
async fn a_key_is_inspected_and_purged(s: TestStore) {
    let handler = Handler::new();
    let layer = layer(&s.store);
    let app = handler.app(layer.clone());
    let key = RequestKey::new(http::Method::POST, "/pay", "k-1").principal("alice");
    assert!(layer.inspect(&key).await.unwrap().is_absent());

    handler.open.send_replace(false);
    let running = tokio::spawn({
        let app = app.clone();
        async move { send(&app, pay("alice", "k-1", r#"{"amount":5}"#)).await }
    });
    wait_until("the handler runs", || handler.runs() == 1).await;
    let started = SystemTime::now();
    let state = layer.inspect(&key).await.unwrap();
    assert_eq!(state.in_flight.len(), 1, "{state:?}");
    let in_flight = &state.in_flight[0];
    assert!(in_flight.lease_left.is_some() && in_flight.fence > 0);
    assert!(near(in_flight.since, started), "{in_flight:?}");
    assert!(state.completed.is_empty());
    // Another principal's key is another key.
    let bob = RequestKey::new(http::Method::POST, "/pay", "k-1").principal("bob");
    assert!(layer.inspect(&bob).await.unwrap().is_absent());
    // Listed as running for longer than nothing, not for longer than an hour.
    let long = layer.in_flight(Duration::ZERO).await.unwrap();
    assert_eq!(long.len(), 1, "{long:?}");
    assert_eq!(long[0].name, in_flight.name);
    assert!(
        layer
            .in_flight(Duration::from_secs(3600))
            .await
            .unwrap()
            .is_empty()
    );
    // A purge leaves the execution alone.
    let purge = layer.purge(&key).await.unwrap();
    assert_eq!((purge.deleted, purge.in_flight.len()), (0, 1), "{purge:?}");
    handler.open.send_replace(true);
    let first = support::within("the first request", running).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);

    let state = layer.inspect(&key).await.unwrap();
    assert!(state.in_flight.is_empty());
    let [done] = &state.completed[..] else {
        panic!("{state:?}")
    };
    assert_eq!(done.status, StatusCode::CREATED);
    assert_eq!(done.body_len, Some(first.body.len() as u64));
    assert!(!done.outcome_unknown);
    assert!(near(done.stored_at, SystemTime::now()), "{done:?}");
    assert!(near(
        done.expires_at,
        SystemTime::now() + Duration::from_secs(24 * 3600)
    ));
    assert!(
        send(&app, pay("alice", "k-1", r#"{"amount":5}"#))
            .await
            .replayed()
    );

    let purge = layer.purge(&key).await.unwrap();
    assert_eq!((purge.deleted, purge.in_flight.len()), (1, 0));
    assert!(layer.inspect(&key).await.unwrap().is_absent());
    let again = send(&app, pay("alice", "k-1", r#"{"amount":5}"#)).await;
    assert!(!again.replayed(), "the handler runs again after the purge");
    assert_eq!(handler.runs(), 2);
}

/// An outcome unknown (a panic) is shown as such, and an operator who reconciled it clears it.
async fn an_unknown_outcome_is_shown_and_cleared(s: TestStore) {
    let handler = Handler::new();
    let layer = layer(&s.store);
    let app = handler.app(layer.clone());
    let request = || {
        let mut r = support::post_key("/panics", "p-1", "");
        r.headers_mut()
            .insert("x-customer", "carol".parse().unwrap());
        r
    };
    let crashed = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request()).await }
    });
    assert!(support::within("the panic", crashed).await.is_err());
    let key = RequestKey::new(http::Method::POST, "/panics", "p-1").principal("carol");
    let state = layer.inspect(&key).await.unwrap();
    let [unknown] = &state.completed[..] else {
        panic!("{state:?}")
    };
    assert!(unknown.outcome_unknown, "{unknown:?}");
    assert_eq!(unknown.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(send(&app, request()).await.problem(), "outcome-unknown");
    assert_eq!(layer.purge(&key).await.unwrap().deleted, 1);
    let runs = handler.runs();
    let _ = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request()).await }
    })
    .await;
    assert_eq!(handler.runs(), runs + 1, "run again after the purge");
}

/// A key that names a thing: every outcome about the thing, whatever its request, is shown
/// and purged.
async fn every_outcome_about_a_thing(s: TestStore) {
    let handler = Handler::new();
    let layer = IdempotencyLayer::builder(s.store.clone())
        .secret(support::SECRET)
        .unwrap()
        .key(key::json("/phone").unwrap().names_a_thing())
        .build()
        .unwrap();
    let app = handler.app(layer.clone());
    for name in ["Ada", "Bob"] {
        let body = format!(r#"{{"phone":"+15550111","name":"{name}"}}"#);
        let r = send(&app, support::post_key("/pay", "unused", &body)).await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let other = r#"{"phone":"+15550112","name":"Eve"}"#;
    send(&app, support::post_key("/pay", "unused", other)).await;
    let phone = RequestKey::new(http::Method::POST, "/pay", "+15550111");
    let state = layer.inspect(&phone).await.unwrap();
    assert_eq!(state.completed.len(), 2, "{state:?}");
    assert_eq!(layer.purge(&phone).await.unwrap().deleted, 2);
    assert!(layer.inspect(&phone).await.unwrap().is_absent());
    let untouched = RequestKey::new(http::Method::POST, "/pay", "+15550112");
    assert_eq!(layer.inspect(&untouched).await.unwrap().completed.len(), 1);
}

/// During a rotation, what was stored under a previous secret is found and purged too.
async fn under_a_previous_secret(s: TestStore) {
    let handler = Handler::new();
    send(&handler.app(layer(&s.store)), pay("dave", "k-9", "{}")).await;
    let rotated = IdempotencyLayer::builder(s.store.clone())
        .secret("the new secret, 32 bytes long...")
        .unwrap()
        .previous_secrets([support::SECRET])
        .unwrap()
        .principal(|p: &http::request::Parts| {
            Some(p.headers.get("x-customer")?.to_str().ok()?.to_owned())
        })
        .build()
        .unwrap();
    let key = RequestKey::new(http::Method::POST, "/pay", "k-9").principal("dave");
    assert_eq!(rotated.inspect(&key).await.unwrap().completed.len(), 1);
    assert_eq!(rotated.purge(&key).await.unwrap().deleted, 1);
}

both_stores!(
    a_key_is_inspected_and_purged,
    an_unknown_outcome_is_shown_and_cleared,
    every_outcome_about_a_thing,
    under_a_previous_secret,
);
