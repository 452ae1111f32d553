//! The example services, under duplicate load: one account per phone number, each payment
//! event applied to the ledger exactly once. On the in-memory store and on Redis.

#[macro_use]
mod support;

#[path = "../examples/shared/signup.rs"]
#[allow(dead_code)]
mod signup_app;
#[path = "../examples/shared/webhook.rs"]
#[allow(dead_code)]
mod webhook_app;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use support::{TestStore, send};
use tower::ServiceExt;

fn signup(phone: &str) -> Request<Body> {
    Request::post("/signup")
        .header("content-type", "application/json")
        .body(Body::from(format!(r#"{{"phone":"{phone}","name":"Ada"}}"#)))
        .unwrap()
}

const WEBHOOK_SECRET: &[u8] = b"whsec_examples";

/// A signed Stripe delivery of `event`; `attempt` changes what the sender serialises afresh.
fn delivery(event: &str, amount: u64, attempt: usize) -> Request<Body> {
    let body = format!(
        r#"{{"id":"{event}","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_{event}","amount":{amount}}}}},"pending_webhooks":{attempt}}}"#
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    Request::post("/webhooks/stripe")
        .header("content-type", "application/json")
        .header(
            "stripe-signature",
            webhook_app::sign(WEBHOOK_SECRET, now, body.as_bytes()),
        )
        .body(Body::from(body))
        .unwrap()
}

async fn signups_create_one_account_per_phone(s: TestStore) {
    let users = signup_app::Users::with_work(Duration::from_millis(50));
    let app = signup_app::app(s.store.clone(), support::SECRET, users.clone()).unwrap();
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, signup(&format!("+1555000{}", i % 3))).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            StatusCode::CREATED => {}
            // Only the layer's own 409 (a duplicate in flight, problem+json): the handler's
            // "already registered" 409 would mean it ran a second time.
            StatusCode::CONFLICT => assert_eq!(r.problem(), "conflict", "{r:?}"),
            _ => panic!("unexpected answer: {r:?}"),
        }
    }
    let counts = users.count_by_phone().await;
    assert_eq!(counts.len(), 3);
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let retry = send(&app, signup("+15550000")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
}

async fn every_payment_event_is_applied_once(s: TestStore) {
    let ledger = webhook_app::Ledger::with_work(Duration::from_millis(30));
    let app = webhook_app::app(
        s.store.clone(),
        support::SECRET,
        WEBHOOK_SECRET,
        ledger.clone(),
    )
    .unwrap();
    // 10 events, each delivered 6 times concurrently, each attempt serialised afresh.
    let tasks: Vec<_> = (0..10)
        .flat_map(|e| (0..6).map(move |attempt| (e, attempt)))
        .map(|(e, attempt)| {
            let app = app.clone();
            tokio::spawn(async move {
                let r = send(&app, delivery(&format!("evt_{e}"), 100 + e, attempt)).await;
                assert_eq!(
                    r.status,
                    StatusCode::OK,
                    "retries wait for the first delivery: {r:?}"
                );
                r
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let entries = ledger.entries().await;
    assert_eq!(entries.len(), 10, "one ledger entry per event: {entries:?}");
    let total: u64 = entries.iter().map(|e| e.amount).sum();
    assert_eq!(
        total,
        (0..10).map(|e| 100 + e).sum::<u64>(),
        "nothing lost, nothing applied twice"
    );
}

both_stores!(
    signups_create_one_account_per_phone,
    every_payment_event_is_applied_once
);

/// With the users and the ledger in Postgres (what `DATABASE_URL` does to the examples): the
/// same HTTP interface, `GET /users` and `GET /ledger` read the tables, written in the layer's
/// transaction: one account per phone number, one ledger entry per event.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_examples_keep_their_tables() {
    use http_body_util::BodyExt;
    let s = TestStore::postgres("examples_on_postgres").await;
    let (url, table) = s.postgres.clone().unwrap();
    let users =
        signup_app::Users::postgres(&url, &format!("{table}_users"), Duration::from_millis(50))
            .await
            .unwrap();
    let app = signup_app::app(s.store.clone(), support::SECRET, users.clone()).unwrap();
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, signup(&format!("+1555000{}", i % 3))).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert!(
            r.status == StatusCode::CREATED || r.problem() == "conflict",
            "{r:?}"
        );
    }
    let listed = send(&app, Request::get("/users").body(Body::empty()).unwrap()).await;
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&listed.body).unwrap();
    assert_eq!(
        listed.len(),
        3,
        "one account per phone, read from the table: {listed:?}"
    );
    assert!(listed.iter().all(|u| u["fence"].as_u64().is_some()));

    let ledger =
        webhook_app::Ledger::postgres(&url, &format!("{table}_ledger"), Duration::from_millis(30))
            .await
            .unwrap();
    let app = webhook_app::app(s.store.clone(), support::SECRET, WEBHOOK_SECRET, ledger).unwrap();
    let tasks: Vec<_> = (0..5u64)
        .flat_map(|e| (0..4).map(move |attempt| (e, attempt)))
        .map(|(e, attempt)| {
            let app = app.clone();
            tokio::spawn(async move {
                send(&app, delivery(&format!("evt_{e}"), 100 + e, attempt)).await
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().status, StatusCode::OK);
    }
    let response = app
        .clone()
        .oneshot(Request::get("/ledger").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let entries: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
    assert_eq!(entries.len(), 5, "{entries:?}");
}
