//! Rotating the server secret without a window: instances on different secrets share a store
//! during a rolling deploy, each step of the documented procedure (add the new secret as a
//! previous one everywhere; make it current; drop the old one after the retention). Two
//! instances over real sockets, on the in-memory store and on Redis.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use support::{TestStore, client, http, post_key, serve, wait_until, within};
use tokio::sync::watch;
use tower_idempotency::{IdempotencyLayer, Store};

const OLD: &[u8] = b"the old secret, 32 bytes long...";
const NEW: &[u8] = b"the new secret, 32 bytes long...";

/// A handler counting its runs, held while the gate is closed.
#[derive(Clone)]
struct Payments {
    runs: Arc<AtomicUsize>,
    open: Arc<watch::Sender<bool>>,
}

impl Payments {
    fn new() -> Self {
        Payments {
            runs: Arc::default(),
            open: Arc::new(watch::Sender::new(true)),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// An instance with `current` and `previous` secrets on `store`.
fn instance(store: Store, current: &[u8], previous: &[&[u8]], payments: &Payments) -> Router {
    let layer = IdempotencyLayer::builder(store)
        .secret(current)
        .unwrap()
        .previous_secrets(previous.iter().copied())
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let payments = payments.clone();
    Router::new().route(
        "/pay",
        post(move || {
            let payments = payments.clone();
            async move {
                let run = payments.runs.fetch_add(1, Ordering::SeqCst) + 1;
                let mut open = payments.open.subscribe();
                open.wait_for(|open| *open).await.unwrap();
                (StatusCode::CREATED, format!("run {run}"))
            }
        })
        .route_layer(layer),
    )
}

/// Two instances, `a` and `b`, with the secrets of one step of a rotation: the same key at once
/// runs once; each replays what the other stored.
async fn exclude_and_replay_across(
    s: &TestStore,
    (a_current, a_previous): (&[u8], &[&[u8]]),
    (b_current, b_previous): (&[u8], &[&[u8]]),
    step: &str,
) {
    let payments = Payments::new();
    let (a, _) = serve(instance(s.store.clone(), a_current, a_previous, &payments)).await;
    let (b, _) = serve(instance(s.twin().await, b_current, b_previous, &payments)).await;
    let c = client();
    // The same key at both instances at once: one execution, the other is told it is in flight.
    payments.open.send_replace(false);
    let key = format!("{step}-at-once");
    let first = tokio::spawn({
        let (c, key) = (c.clone(), key.clone());
        async move { http(&c, a, post_key("/pay", &key, "{}")).await }
    });
    wait_until("the first request runs", || payments.runs() == 1).await;
    let second = within(
        "the second request",
        http(&c, b, post_key("/pay", &key, "{}")),
    )
    .await;
    assert_eq!(second.status, StatusCode::CONFLICT, "{step}: {second:?}");
    payments.open.send_replace(true);
    let first = within("the first request", first).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(payments.runs(), 1, "{step}: one execution");
    // Each replays what the other stored.
    for (from, to, key) in [(a, b, "a-then-b"), (b, a, "b-then-a")] {
        let key = format!("{step}-{key}");
        let stored = http(&c, from, post_key("/pay", &key, "{}")).await;
        assert_eq!(stored.status, StatusCode::CREATED, "{step}: {stored:?}");
        let replayed = http(&c, to, post_key("/pay", &key, "{}")).await;
        assert!(replayed.replayed(), "{step} {key}: {replayed:?}");
        assert_eq!(replayed.body, stored.body);
        // A fingerprint made under either secret is recognised: another body is refused.
        let other = http(&c, to, post_key("/pay", &key, r#"{"other":1}"#)).await;
        assert_eq!(
            other.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{step}: {other:?}"
        );
    }
    assert_eq!(payments.runs(), 3, "{step}");
}

/// Step 1: the new secret added as a previous one. Instance A still has only the old secret.
async fn the_new_secret_added_as_previous(s: TestStore) {
    exclude_and_replay_across(&s, (OLD, &[]), (OLD, &[NEW]), "step-1").await;
}

/// Step 2: the new secret made current, one instance after the other: A has the old one
/// current (and the new one as previous), B the new one (and the old one as previous).
async fn the_new_secret_made_current(s: TestStore) {
    exclude_and_replay_across(&s, (OLD, &[NEW]), (NEW, &[OLD]), "step-2").await;
}

/// Step 3: the old secret dropped (after the retention, when whatever was stored under it has
/// expired): it is no longer consulted, and what is stored under the new one is found.
async fn a_dropped_secret_is_no_longer_consulted(s: TestStore) {
    let payments = Payments::new();
    let (old, _) = serve(instance(s.store.clone(), OLD, &[NEW], &payments)).await;
    let (new, _) = serve(instance(s.twin().await, NEW, &[], &payments)).await;
    let c = client();
    let under_old = http(&c, old, post_key("/pay", "step-3-old", "{}")).await;
    assert_eq!(under_old.status, StatusCode::CREATED);
    let not_consulted = http(&c, new, post_key("/pay", "step-3-old", "{}")).await;
    assert!(!not_consulted.replayed(), "{not_consulted:?}");
    assert_eq!(payments.runs(), 2);
    let under_new = http(&c, new, post_key("/pay", "step-3-new", "{}")).await;
    assert!(
        http(&c, new, post_key("/pay", "step-3-new", "{}"))
            .await
            .replayed()
    );
    assert_eq!(under_new.status, StatusCode::CREATED);
}

both_stores!(
    the_new_secret_added_as_previous,
    the_new_secret_made_current,
    a_dropped_secret_is_no_longer_consulted,
);
