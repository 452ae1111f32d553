//! Keys that name a thing, as people and providers drive the two use cases: the signup by phone
//! number (a misspelt field corrected, another person with a registered number, resends,
//! double submits) and a Stripe webhook (signed deliveries, retried to another instance with
//! the event serialised afresh, forged ones first), over real sockets with two instances
//! sharing one store, on the in-memory store and on Redis. Also: a key clients generate in the
//! body is scoped per principal, a timeout inside the layer never runs a handler twice, and a
//! person's browser gets a page where an API client gets problem+json.

#[macro_use]
mod support;

#[path = "../examples/shared/signup.rs"]
#[allow(dead_code)]
mod signup_app;
#[path = "../examples/shared/webhook.rs"]
#[allow(dead_code)]
mod webhook_app;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use support::{Client, Reply, TestStore, client, http, serve, within};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::key::{self, KeySourceExt};

const BROWSER_ACCEPT: &str =
    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8";

/// Two instances of `app` sharing the test's store (the second through a client of its own).
async fn two_instances(
    s: &TestStore,
    app: impl Fn(tower_idempotency::Store) -> Router,
) -> [std::net::SocketAddr; 2] {
    let (a, _) = serve(app(s.store.clone())).await;
    let (b, _) = serve(app(s.twin().await)).await;
    [a, b]
}

fn signup(body: &str) -> Request<Body> {
    Request::post("/signup")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn ada(phone: &str) -> String {
    format!(r#"{{"phone":"{phone}","name":"Ada"}}"#)
}

async fn signups(s: &TestStore) -> (signup_app::Users, [std::net::SocketAddr; 2], Client) {
    let users = signup_app::Users::with_work(Duration::from_millis(100));
    let addrs = two_instances(s, |store| {
        signup_app::app(store, support::SECRET, users.clone()).unwrap()
    })
    .await;
    (users, addrs, client())
}

/// A misspelt field is the framework's 422 and holds nothing: the corrected signup runs.
async fn a_misspelt_signup_corrected_makes_one_account(s: TestStore) {
    let (users, [a, b], c) = signups(&s).await;
    let phone = "+15550101";
    let typo = http(
        &c,
        a,
        signup(&format!(r#"{{"phone":"{phone}","nmae":"Ada"}}"#)),
    )
    .await;
    assert_eq!(typo.status, StatusCode::UNPROCESSABLE_ENTITY, "{typo:?}");
    assert!(!typo.replayed());
    // The app's own validation, the same: nothing created, nothing held.
    let empty = http(
        &c,
        b,
        signup(&format!(r#"{{"phone":"{phone}","name":" "}}"#)),
    )
    .await;
    assert_eq!(empty.status, StatusCode::UNPROCESSABLE_ENTITY, "{empty:?}");
    let fixed = http(&c, b, signup(&ada(phone))).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{fixed:?}");
    assert!(!fixed.replayed());
    assert_eq!(users.count_by_phone().await.get(phone), Some(&1));
}

/// Another person with a registered phone number reaches the application and gets its answer;
/// the first person's identical resend still gets the stored 201.
async fn another_person_with_a_registered_phone_gets_the_apps_answer(s: TestStore) {
    let (users, [a, b], c) = signups(&s).await;
    let phone = "+15550102";
    let first = http(&c, a, signup(&ada(phone))).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let bob = format!(r#"{{"phone":"{phone}","name":"Bob"}}"#);
    for addr in [b, a] {
        let taken = http(&c, addr, signup(&bob)).await;
        assert_eq!(taken.status, StatusCode::CONFLICT, "{taken:?}");
        assert_eq!(
            taken.body, "phone number already registered",
            "the app's answer"
        );
        assert!(!taken.replayed());
    }
    let resend = http(&c, b, signup(&ada(phone))).await;
    assert_eq!(resend.status, StatusCode::CREATED, "{resend:?}");
    assert!(resend.replayed());
    assert_eq!(resend.body, first.body);
    assert_eq!(users.count_by_phone().await.get(phone), Some(&1));
    assert_eq!(users.rows().await.len(), 1);
}

/// Twelve identical submits at once, to two instances: one account; the others get the layer's
/// 409 (never the app's "already registered", which would mean a second run) or the replay.
async fn twelve_identical_signups_at_once_make_one_account(s: TestStore) {
    let (users, addrs, c) = signups(&s).await;
    let phone = "+15550103";
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { http(&c, addrs[i % 2], signup(&ada(phone))).await })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => assert_eq!(r.problem(), "conflict", "{r:?}"),
            _ => panic!("{r:?}"),
        }
    }
    assert!(created >= 1);
    assert_eq!(users.count_by_phone().await.get(phone), Some(&1));
    // Different people about one phone at once: one runs, the rest wait their turn or get 409.
    let phone = "+15550104";
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let c = c.clone();
            let body = format!(r#"{{"phone":"{phone}","name":"Person {i}"}}"#);
            tokio::spawn(async move { http(&c, addrs[i % 2], signup(&body)).await })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert!(
            [StatusCode::CREATED, StatusCode::CONFLICT].contains(&r.status),
            "{r:?}"
        );
    }
    assert_eq!(
        users.count_by_phone().await.get(phone),
        Some(&1),
        "check-then-insert never raced"
    );
}

const WEBHOOK_SECRET: &[u8] = b"whsec_test_secret";

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A Stripe event as one delivery attempt serialises it: the attempt changes
/// `pending_webhooks` and the members' order.
fn event(id: &str, amount: u64, attempt: u64) -> String {
    if attempt.is_multiple_of(2) {
        format!(
            r#"{{"id":"{id}","object":"event","type":"payment_intent.succeeded","data":{{"object":{{"id":"pi_{id}","amount":{amount}}}}},"pending_webhooks":{}}}"#,
            3 - attempt.min(2)
        )
    } else {
        format!(
            r#"{{"pending_webhooks":{},"type":"payment_intent.succeeded","data":{{"object":{{"amount":{amount},"id":"pi_{id}"}}}},"id":"{id}","object":"event"}}"#,
            3 - attempt.min(2)
        )
    }
}

fn delivery(body: &str, signature: &str) -> Request<Body> {
    Request::post("/webhooks/stripe")
        .header("content-type", "application/json")
        .header("stripe-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn signed(body: &str) -> Request<Body> {
    delivery(
        body,
        &webhook_app::sign(WEBHOOK_SECRET, unix_now(), body.as_bytes()),
    )
}

async fn receivers(
    s: &TestStore,
    work: Duration,
) -> (webhook_app::Ledger, [std::net::SocketAddr; 2]) {
    let ledger = webhook_app::Ledger::with_work(work);
    let addrs = two_instances(s, |store| {
        webhook_app::app(store, support::SECRET, WEBHOOK_SECRET, ledger.clone()).unwrap()
    })
    .await;
    (ledger, addrs)
}

async fn applied(ledger: &webhook_app::Ledger, id: &str) -> Vec<u64> {
    (ledger.entries().await.into_iter())
        .filter(|e| e.event == id)
        .map(|e| e.amount)
        .collect()
}

/// The first attempt times out on the sender's side while the receiver works; the retry goes
/// to the other instance with the event serialised afresh: one application, a 2xx for the
/// retry (so the provider stops), and the same for later retries.
async fn a_timed_out_delivery_retried_elsewhere_is_applied_once(s: TestStore) {
    let (ledger, [a, b]) = receivers(&s, Duration::from_millis(400)).await;
    let c = client();
    let first = tokio::spawn({
        let c = c.clone();
        async move {
            let sent = http(&c, a, signed(&event("evt_timeout", 1200, 0)));
            // The sender's timeout: it hangs up long before the 400 ms of work end.
            tokio::time::timeout(Duration::from_millis(60), sent).await
        }
    });
    assert!(first.await.unwrap().is_err(), "the sender gave up");
    let retry = http(&c, b, signed(&event("evt_timeout", 1200, 1))).await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert!(retry.replayed(), "the first delivery's answer: {retry:?}");
    let later = http(&c, a, signed(&event("evt_timeout", 1200, 2))).await;
    assert_eq!(later.status, StatusCode::OK);
    assert_eq!(later.body, retry.body);
    assert_eq!(applied(&ledger, "evt_timeout").await, [1200]);
    // Another event type is acknowledged and ignored.
    let other = r#"{"id":"evt_other","type":"customer.created","data":{"object":{"id":"cus_1"}}}"#;
    let ack = http(&c, a, signed(other)).await;
    assert_eq!(ack.status, StatusCode::OK, "{ack:?}");
    assert!(applied(&ledger, "evt_other").await.is_empty());
}

/// A forged delivery of the event arrives first (its amount changed, its signature made with
/// another secret): refused before the key is taken, so the real one, after it, is applied.
async fn a_forged_delivery_first_never_blocks_the_real_one(s: TestStore) {
    let (ledger, [a, b]) = receivers(&s, Duration::from_millis(20)).await;
    let c = client();
    let forged_body = event("evt_forged", 999_999, 0);
    let forged = delivery(
        &forged_body,
        &webhook_app::sign(b"whsec_attacker", unix_now(), forged_body.as_bytes()),
    );
    let refused = http(&c, a, forged).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{refused:?}");
    let real = http(&c, b, signed(&event("evt_forged", 1500, 1))).await;
    assert_eq!(real.status, StatusCode::OK, "{real:?}");
    assert!(!real.replayed(), "no record of the forged one: {real:?}");
    // Forged again, after the real one: still refused, not a replay of the real answer.
    let again = delivery(
        &forged_body,
        &webhook_app::sign(b"whsec_attacker", unix_now(), forged_body.as_bytes()),
    );
    assert_eq!(http(&c, a, again).await.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        applied(&ledger, "evt_forged").await,
        [1500],
        "never the forged amount"
    );
}

/// A bad signature (a wrong one, a stale timestamp, none) is answered 400 and not stored: the
/// same delivery signed properly then runs.
async fn a_bad_signature_then_a_good_one(s: TestStore) {
    let (ledger, [a, b]) = receivers(&s, Duration::from_millis(20)).await;
    let c = client();
    let body = event("evt_sig", 700, 0);
    let stale = webhook_app::sign(WEBHOOK_SECRET, unix_now() - 3600, body.as_bytes());
    let wrong = format!("t={},v1={}", unix_now(), "ab".repeat(32));
    for (addr, signature) in [(a, stale.as_str()), (b, wrong.as_str()), (a, "")] {
        let r = http(&c, addr, delivery(&body, signature)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{signature}: {r:?}");
    }
    let good = http(&c, b, signed(&body)).await;
    assert_eq!(good.status, StatusCode::OK, "{good:?}");
    assert!(!good.replayed());
    assert_eq!(applied(&ledger, "evt_sig").await, [700]);
}

/// A key that clients generate and send in the body is a per-request key: scoped to the
/// principal like the header, so two clients who pick the same key never get each other's
/// response.
async fn a_body_key_clients_generate_is_scoped_per_principal(s: TestStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = |store| {
        let runs = runs.clone();
        let layer = IdempotencyLayer::builder(store)
            .secret(support::SECRET)
            .unwrap()
            .key(key::json("/idempotency_key").unwrap().per_request())
            .principal(|p: &http::request::Parts| {
                Some(p.headers.get("x-customer")?.to_str().ok()?.to_owned())
            })
            .build()
            .unwrap();
        Router::new().route(
            "/charges",
            post(move |body: String| async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!("run {n}: {body}"))
            })
            .route_layer(layer),
        )
    };
    let [a, b] = two_instances(&s, app).await;
    let c = client();
    let charge = |who: &str, amount: u64| {
        Request::post("/charges")
            .header("content-type", "application/json")
            .header("x-customer", who)
            .body(Body::from(format!(
                r#"{{"idempotency_key":"k-1","amount":{amount}}}"#
            )))
            .unwrap()
    };
    let alice = http(&c, a, charge("alice", 10)).await;
    let bob = http(&c, b, charge("bob", 20)).await;
    assert_eq!(
        (alice.status, bob.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!bob.replayed(), "not alice's response: {bob:?}");
    assert_ne!(alice.body, bob.body);
    let alice_again = http(&c, b, charge("alice", 10)).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    // A key reused for another request is refused, as with the header.
    let reused = http(&c, a, charge("alice", 11)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{reused:?}"
    );
    assert_eq!(reused.problem(), "key-reused");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Without a principal the layer cannot scope the key: 500, and nothing runs.
    let nobody = Request::post("/charges")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"idempotency_key":"k-1","amount":10}"#))
        .unwrap();
    assert_eq!(http(&c, a, nobody).await.problem(), "principal-missing");
}

/// tower-http's `TimeoutLayer` inside the layer answers 408 for a handler that did its work and
/// then stalled: the retry must not run it again (408 is not "not processed").
async fn a_timeout_inside_the_layer_never_runs_the_handler_twice(s: TestStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::builder(s.store.clone())
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let handler = {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            // The charge is booked; then a slow notification stalls the handler.
            tokio::time::sleep(Duration::from_secs(5)).await;
            StatusCode::CREATED
        }
    };
    let app = Router::new().route(
        "/charges",
        post(handler)
            .layer(tower_http::timeout::TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                Duration::from_millis(100),
            ))
            .route_layer(layer),
    );
    let (addr, _server) = serve(app).await;
    let c = client();
    let charge = || support::post_key("/charges", "charge-1", "{}");
    let first = within("the timeout's answer", http(&c, addr, charge())).await;
    assert_eq!(first.status, StatusCode::REQUEST_TIMEOUT, "{first:?}");
    let retry = within("the retry", http(&c, addr, charge())).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran again: {retry:?}"
    );
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR, "{retry:?}");
    assert_eq!(retry.problem(), "outcome-unknown");
}

/// A form resubmitted with other values under its render's key: a person's browser gets a page
/// with the way forward (the account the first submission made, a fresh form), an API client
/// gets problem+json.
async fn a_refusal_is_a_page_for_a_browser_and_json_for_an_api_client(s: TestStore) {
    let (users, [a, b], c) = signups(&s).await;
    let form = |name: &str, accept: &str| {
        Request::post("/signup/form")
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", accept)
            .header("referer", "http://shop.test/")
            .header("host", "shop.test")
            .body(Body::from(format!(
                "idempotency_key=render-1&name={name}&phone=%2B15550105"
            )))
            .unwrap()
    };
    let first = http(&c, a, form("Ada", BROWSER_ACCEPT)).await;
    assert_eq!(first.status, StatusCode::SEE_OTHER, "{first:?}");
    let account = first.headers["location"].to_str().unwrap().to_owned();
    // Back, a field changed, sent again with the same form (and key).
    let page = http(&c, b, form("Ada%20L", BROWSER_ACCEPT)).await;
    assert_eq!(page.status, StatusCode::UNPROCESSABLE_ENTITY, "{page:?}");
    assert_eq!(page.headers["content-type"], "text/html; charset=utf-8");
    let html = String::from_utf8_lossy(&page.body);
    assert!(html.contains("already sent"), "{html}");
    assert!(
        html.contains(&format!(r#"href="{account}""#)),
        "the account: {html}"
    );
    assert!(html.contains(r#"href="/""#), "a fresh form: {html}");
    let api = http(&c, a, form("Ada%20L", "application/json")).await;
    assert_eq!(api.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(api.problem(), "key-reused");
    let curl = http(&c, a, form("Ada%20L", "*/*")).await;
    assert_eq!(curl.problem(), "key-reused");
    // The first submission's resend is still its redirect; one account.
    let resend = http(&c, b, form("Ada", BROWSER_ACCEPT)).await;
    assert_eq!(resend.status, StatusCode::SEE_OTHER);
    assert_eq!(users.rows().await.len(), 1);
    // A form the app refuses (a malformed phone) holds nothing: corrected, it runs.
    let bad = Request::post("/signup/form")
        .header("content-type", "application/x-www-form-urlencoded")
        .header("accept", BROWSER_ACCEPT)
        .body(Body::from("idempotency_key=render-2&name=Bo&phone=abc"))
        .unwrap();
    let refused: Reply = http(&c, a, bad).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        String::from_utf8_lossy(&refused.body).contains("render-2"),
        "the same form back"
    );
    let corrected = Request::post("/signup/form")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(
            "idempotency_key=render-2&name=Bo&phone=%2B15550106",
        ))
        .unwrap();
    assert_eq!(http(&c, b, corrected).await.status, StatusCode::SEE_OTHER);
    assert_eq!(users.rows().await.len(), 2);
}

both_stores!(
    a_misspelt_signup_corrected_makes_one_account,
    another_person_with_a_registered_phone_gets_the_apps_answer,
    twelve_identical_signups_at_once_make_one_account,
    a_timed_out_delivery_retried_elsewhere_is_applied_once,
    a_forged_delivery_first_never_blocks_the_real_one,
    a_bad_signature_then_a_good_one,
    a_body_key_clients_generate_is_scoped_per_principal,
    a_timeout_inside_the_layer_never_runs_the_handler_twice,
    a_refusal_is_a_page_for_a_browser_and_json_for_an_api_client,
);
