//! The Postgres store in same-transaction mode: a handler's writes commit with its outcome, or
//! not at all (a retryable outcome, a panic, an error roll them back and the retry runs
//! cleanly); duplicates meanwhile never wait on the row, nor hold a pool connection while they
//! wait. On a real PostgreSQL, through real sockets.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use support::{client, http, post_key, serve, within};
use tokio::sync::watch;
use tower_idempotency::{IdempotencyLayer, OnConflict, Outcome, Store, Transaction};

struct Db {
    admin: tokio_postgres::Client,
    ledger: String,
    store: Store,
    /// The store's table.
    table: String,
}

async fn db(test: &str) -> Db {
    let server = testkit::PostgresServer::shared().await;
    let table = testkit::unique_table(test);
    let (admin, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let ledger = format!("{table}_ledger");
    admin
        .batch_execute(&format!(
            "CREATE TABLE {ledger} (event text PRIMARY KEY, amount bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let store = support::postgres_store(&server.url(), &table).await;
    Db {
        admin,
        ledger,
        store,
        table,
    }
}

impl Db {
    async fn rows(&self) -> i64 {
        self.admin
            .query_one(&format!("SELECT count(*) FROM {}", self.ledger), &[])
            .await
            .unwrap()
            .get(0)
    }
}

#[derive(Clone)]
struct App {
    ledger: Arc<String>,
    runs: Arc<AtomicUsize>,
    open: Arc<watch::Sender<bool>>,
}

/// `POST /apply?fail=...`: inserts a ledger row in the layer's transaction, then ends as asked.
async fn apply(
    State(app): State<App>,
    tx: Transaction,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let event = q.get("event").cloned().unwrap_or_default();
    tx.execute(
        &format!("INSERT INTO {} (event, amount) VALUES ($1, 5)", app.ledger),
        &[&event],
    )
    .await
    .unwrap();
    let mut open = app.open.subscribe();
    open.wait_for(|open| *open).await.unwrap();
    match q.get("fail").map(String::as_str) {
        Some("retryable") => (
            StatusCode::BAD_GATEWAY,
            axum::Extension(Outcome::Retryable),
            "provider down",
        )
            .into_response(),
        Some("panic") => panic!("the handler fails after its write"),
        Some("status") => (StatusCode::UNPROCESSABLE_ENTITY, "refused").into_response(),
        _ => (StatusCode::CREATED, format!("applied {event} in run {run}")).into_response(),
    }
}

fn make(db: &Db, on_conflict: OnConflict) -> (Router, App) {
    let app = App {
        ledger: Arc::new(db.ledger.clone()),
        runs: Arc::default(),
        open: Arc::new(watch::Sender::new(true)),
    };
    let layer = IdempotencyLayer::builder(db.store.clone())
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .same_transaction(true)
        .on_conflict(on_conflict)
        .build()
        .unwrap();
    let router = Router::new()
        .route("/apply", post(apply).route_layer(layer))
        .with_state(app.clone());
    (router, app)
}

/// Writes and the outcome commit together: replayed afterwards, the row there once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_commit_with_the_outcome() {
    let db = db("commit").await;
    let (router, app) = make(&db, OnConflict::Reject);
    let (addr, _server) = serve(router).await;
    let c = client();
    let first = http(&c, addr, post_key("/apply?event=e1", "k-1", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(db.rows().await, 1);
    let again = http(&c, addr, post_key("/apply?event=e1", "k-1", "{}")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(db.rows().await, 1);
}

/// A handler that writes and then fails (a retryable outcome, a panic, a 4xx that holds
/// nothing) leaves no row and no record; its retry runs, and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_writes_then_fails_leaves_nothing() {
    let db = db("rollback").await;
    let (router, app) = make(&db, OnConflict::Reject);
    let (addr, _server) = serve(router).await;
    let c = client();
    for (i, fail) in ["retryable", "panic", "status"].into_iter().enumerate() {
        let event = format!("e{i}");
        let mut failing = post_key(&format!("/apply?event={event}&fail={fail}"), &event, "{}");
        *failing.uri_mut() = format!("http://{addr}{}", failing.uri()).parse().unwrap();
        // A panic reaches the server as without the layer (the connection ends, no answer).
        match c.request(failing).await {
            Ok(failed) => assert_ne!(failed.status(), StatusCode::CREATED, "{fail}"),
            Err(error) => assert_eq!(fail, "panic", "{error}"),
        }
        assert_eq!(db.rows().await, 0, "{fail}: the write was rolled back");
        // The retry (the client fixed what was wrong) runs cleanly.
        let retry = http(
            &c,
            addr,
            post_key(&format!("/apply?event={event}"), &event, "{}"),
        )
        .await;
        assert_eq!(retry.status, StatusCode::CREATED, "{fail}: {retry:?}");
        assert!(!retry.replayed());
        assert_eq!(db.rows().await, 1, "{fail}");
        db.admin
            .execute(&format!("DELETE FROM {}", db.ledger), &[])
            .await
            .unwrap();
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 6);
}

/// While a handler's transaction holds the key's row, duplicates are told at once (409), or
/// wait (`OnConflict::Wait`) without holding a connection of the pool: thirty of them wait at
/// once, more than the pool has connections, and a request with another key still goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_never_wait_on_the_row_nor_hold_a_connection() {
    let db = db("waiting").await;
    let (router, app) = make(&db, OnConflict::Wait(Duration::from_secs(30)));
    let (addr, _server) = serve(router).await;
    let c = client();
    app.open.send_replace(false);
    let first = tokio::spawn({
        let c = c.clone();
        async move { http(&c, addr, post_key("/apply?event=busy", "busy", "{}")).await }
    });
    support::wait_until("the first handler runs", || {
        app.runs.load(Ordering::SeqCst) == 1
    })
    .await;
    let waiting: Vec<_> = (0..30)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                http(&c, addr, post_key("/apply?event=busy", "busy", "{}")).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    // The other request is held at the gate too: let it and the first through together.
    let other = tokio::spawn({
        let c = c.clone();
        async move {
            within(
                "another key while thirty duplicates wait",
                http(&c, addr, post_key("/apply?event=other", "other", "{}")),
            )
            .await
        }
    });
    support::wait_until("the other key's handler runs", || {
        app.runs.load(Ordering::SeqCst) == 2
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    app.open.send_replace(true);
    assert_eq!(other.await.unwrap().status, StatusCode::CREATED);
    let first = within("the first request", first).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    for w in waiting {
        let r = within("a waiting duplicate", w).await.unwrap();
        assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
        assert!(r.replayed());
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(db.rows().await, 2);
    // Without waiting: 409 at once.
    let (router, app) = make(&db, OnConflict::Reject);
    let (addr, _server) = serve(router).await;
    app.open.send_replace(false);
    let held = tokio::spawn({
        let c = c.clone();
        async move { http(&c, addr, post_key("/apply?event=held", "held", "{}")).await }
    });
    support::wait_until("the handler runs", || app.runs.load(Ordering::SeqCst) == 1).await;
    let started = Instant::now();
    let conflict = http(&c, addr, post_key("/apply?event=held", "held", "{}")).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert!(started.elapsed() < Duration::from_secs(2));
    app.open.send_replace(true);
    within("the held request", held).await.unwrap();
}

/// Same-transaction mode needs the Postgres store: refused when built on another.
/// Without same-transaction mode too, an answer goes out only once its record is stored: a
/// client that reads it and sends again (a changed form, to another instance) is answered from
/// the record. (The answer went out once the completion was handed to the pool, before a
/// connection had even run it: another instance could find the key still held, and refuse a
/// changed form without the first answer's link.) Here the record's row is locked by another
/// transaction when the handler ends: the answer waits for the completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_goes_out_once_its_record_is_stored() {
    let db = db("stored-first").await;
    let (open, _) = watch::channel(false);
    let open = Arc::new(open);
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::builder(db.store.clone())
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let router = Router::new().route(
        "/pay",
        post({
            let (open, runs) = (open.clone(), runs.clone());
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                open.subscribe().wait_for(|o| *o).await.unwrap();
                (StatusCode::CREATED, "paid")
            }
        })
        .route_layer(layer.clone()),
    );
    let (addr, _server) = serve(router).await;
    let c = client();
    let answer = tokio::spawn({
        let c = c.clone();
        async move { http(&c, addr, post_key("/pay", "k-1", "{}")).await }
    });
    support::wait_until("the handler runs", || runs.load(Ordering::SeqCst) == 1).await;
    // The key's row exists (taken): lock it in a transaction of our own.
    let (mut locker, connection) = tokio_postgres::connect(
        &testkit::PostgresServer::shared().await.url(),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let tx = locker.transaction().await.unwrap();
    let locked = tx
        .query(&format!("SELECT name FROM {} FOR UPDATE", db.table), &[])
        .await
        .unwrap();
    assert_eq!(locked.len(), 1, "the key's row");
    open.send_replace(true);
    let mut answer = answer;
    let early = tokio::time::timeout(Duration::from_millis(300), &mut answer).await;
    assert!(
        early.is_err(),
        "answered while its record could not be stored: {early:?}"
    );
    tx.commit().await.unwrap();
    let answer = within("the answer", answer).await.unwrap();
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    let key = tower_idempotency::operate::RequestKey::new(http::Method::POST, "/pay", "k-1");
    assert_eq!(layer.inspect(&key).await.unwrap().completed.len(), 1);
}

#[tokio::test]
async fn same_transaction_is_refused_on_another_store() {
    let err = IdempotencyLayer::builder(Store::memory())
        .global_keys()
        .same_transaction(true)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("same_transaction"), "{err}");
}

/// Not in same-transaction mode either, a response waits for its outcome to be stored on
/// Postgres, whose operations each take a connection of the pool (a later one may overtake
/// one on its way): a retry sent the moment the response arrives, with no grace to wait in, is
/// replayed, never told the key is in flight, and an operator looking then finds the outcome.
/// Before, a response went out once its outcome was on its way (as on Redis, where the
/// connection keeps commands in order), and this failed within a few rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_right_after_the_response_is_replayed() {
    let server = testkit::PostgresServer::shared().await;
    let store = support::postgres_store(&server.url(), &testkit::unique_table("right_after")).await;
    let layer = IdempotencyLayer::builder(store)
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .completion_grace(Duration::ZERO)
        .build()
        .unwrap();
    let (router, probe) = support::app_with_layer(layer.clone());
    for i in 0..40 {
        let key = format!("k-{i}");
        let first = support::send(&router, post_key("/things", &key, "{}")).await;
        assert!(first.status.is_success(), "{first:?}");
        let again = support::send(&router, post_key("/things", &key, "{}")).await;
        assert!(again.replayed(), "round {i}: {again:?}");
        let looked =
            tower_idempotency::operate::RequestKey::new(axum::http::Method::POST, "/things", &key);
        let state = layer.inspect(&looked).await.unwrap();
        assert_eq!(state.completed.len(), 1, "round {i}: {state:?}");
    }
    assert_eq!(probe.runs(), 40);
}
