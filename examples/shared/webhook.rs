//! A Stripe webhook receiver a user can copy: `POST /webhooks/stripe`.
//!
//! Stripe signs every delivery (`Stripe-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
//! "<t>.<raw body>">`), retries a delivery that timed out or got a non-2xx for days, and
//! serialises the event afresh for every attempt (`pending_webhooks` changes). So:
//!
//! 1. the signature is checked first, against `WEBHOOK_SECRET`, within 5 minutes of its
//!    timestamp and in constant time, **before the idempotency key is taken**: a forged
//!    delivery is answered 400, creates no record and never blocks the real one;
//! 2. the key is the event id, a key that names a thing, and the event id alone identifies the
//!    event (`Identity::Key`): a redelivery with another body is the same event and gets the
//!    stored 2xx, so Stripe stops; one that arrives while the first still runs waits for it;
//! 3. `payment_intent.succeeded` is applied to the ledger once across instances; other event
//!    types are acknowledged and ignored. Records are kept for 7 days, past Stripe's 3-day
//!    retry window.
//!
//! The ledger is in memory, or (feature `postgres`, `DATABASE_URL`) a Postgres table written in
//! the layer's transaction: the entry and the event's outcome commit together, so a process
//! killed at any moment never applies an event twice.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Identity, OnConflict, Store};

/// How far a signature's timestamp may be from now (Stripe's libraries' default).
pub(crate) const TOLERANCE: Duration = Duration::from_secs(300);

/// How long an event's outcome is kept: past Stripe's 3-day retry window.
pub(crate) const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The largest delivery read (Stripe's events are a few KiB).
const MAX_BODY: usize = 256 * 1024;

/// A Stripe event, as much of it as the ledger needs.
#[derive(Debug, Deserialize)]
pub(crate) struct Event {
    pub(crate) id: String,
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) data: EventData,
}

#[derive(Debug, Deserialize)]
pub(crate) struct EventData {
    pub(crate) object: EventObject,
}

#[derive(Debug, Deserialize)]
pub(crate) struct EventObject {
    pub(crate) id: String,
    #[serde(default)]
    pub(crate) amount: Option<u64>,
}

/// One applied event.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Entry {
    pub(crate) event: String,
    pub(crate) amount: u64,
    /// The fencing token of the execution that booked it.
    #[serde(skip)]
    pub(crate) fence: Option<u64>,
}

/// The ledger: in memory, or a table in the application's Postgres database.
#[derive(Clone, Default)]
pub(crate) struct Ledger {
    inner: Arc<Mutex<LedgerState>>,
    /// Latency of applying a payment.
    pub(crate) work: Duration,
    /// The Postgres table, and a connection to read it (and write it outside a transaction).
    #[cfg(feature = "postgres")]
    pub(crate) table: Option<(Arc<tokio_postgres::Client>, String)>,
}

#[derive(Default)]
struct LedgerState {
    entries: Vec<Entry>,
    /// The highest fencing token seen per event: writes with a lower one are stale and refused.
    fences: std::collections::HashMap<String, u64>,
}

impl Ledger {
    pub(crate) fn with_work(work: Duration) -> Self {
        Ledger {
            inner: Arc::default(),
            work,
            #[cfg(feature = "postgres")]
            table: None,
        }
    }

    /// The ledger in `table` of the database at `url` (made if missing).
    #[cfg(feature = "postgres")]
    pub(crate) async fn postgres(url: &str, table: &str, work: Duration) -> Result<Self, String> {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, event text NOT NULL, \
                 amount bigint NOT NULL, fence bigint)"
            ))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Ledger {
            inner: Arc::default(),
            work,
            table: Some((Arc::new(client), table.to_owned())),
        })
    }

    /// Every applied entry, in the order applied.
    pub(crate) async fn entries(&self) -> Vec<Entry> {
        #[cfg(feature = "postgres")]
        if let Some((client, table)) = &self.table {
            let rows = client
                .query(
                    &format!("SELECT event, amount, fence FROM {table} ORDER BY id"),
                    &[],
                )
                .await
                .unwrap_or_default();
            return rows
                .iter()
                .map(|row| Entry {
                    event: row.get(0),
                    amount: row.get::<_, i64>(1) as u64,
                    fence: row.get::<_, Option<i64>>(2).map(|f| f as u64),
                })
                .collect();
        }
        self.inner.lock().unwrap().entries.clone()
    }

    /// Books a payment: in the layer's transaction when there is one (it commits with the
    /// event's outcome), else in the ledger's own store.
    async fn book(
        &self,
        event: &str,
        amount: u64,
        fence: Option<u64>,
        #[cfg(feature = "postgres")] tx: Option<&tower_idempotency::Transaction>,
    ) -> Result<(), String> {
        #[cfg(feature = "postgres")]
        if let Some((client, table)) = &self.table {
            let insert = format!("INSERT INTO {table} (event, amount, fence) VALUES ($1, $2, $3)");
            let fence = fence.map(|f| f as i64);
            let amount = amount as i64;
            let client: &tokio_postgres::Client = match tx {
                Some(tx) => tx,
                None => client,
            };
            return client
                .execute(&insert, &[&event, &amount, &fence])
                .await
                .map(|_| ())
                .map_err(|e| e.to_string());
        }
        self.apply(event, amount, fence).map_err(str::to_owned)
    }

    /// Books a payment, refusing a write fenced with a token lower than one already seen for
    /// the event (a stale holder whose lease was lost).
    fn apply(&self, event: &str, amount: u64, fence: Option<u64>) -> Result<(), &'static str> {
        let mut state = self.inner.lock().unwrap();
        if let Some(fence) = fence {
            let seen = state.fences.entry(event.to_owned()).or_default();
            if fence < *seen {
                return Err("stale fencing token");
            }
            *seen = fence;
        }
        state.entries.push(Entry {
            event: event.to_owned(),
            amount,
            fence,
        });
        Ok(())
    }
}

/// The value of `Stripe-Signature` for `body` signed with `secret` at `t` (what Stripe sends;
/// tests and the README's curl recipe sign deliveries with it).
pub(crate) fn sign(secret: &[u8], t: u64, body: &[u8]) -> String {
    format!(
        "t={t},v1={}",
        hex::encode(mac(secret, t, body).finalize().into_bytes())
    )
}

fn mac(secret: &[u8], t: u64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// Checks a `Stripe-Signature` header for `body` at `now` (unix seconds): one `t`, at least
/// one `v1` (several during a secret's rotation), one of which is the HMAC, compared in
/// constant time.
pub(crate) fn verify(
    secret: &[u8],
    header: Option<&str>,
    body: &[u8],
    now: u64,
) -> Result<(), &'static str> {
    let header = header.ok_or("no Stripe-Signature header")?;
    let mut t = None;
    let mut signatures = Vec::new();
    for item in header.split(',') {
        match item.trim().split_once('=') {
            Some(("t", value)) if t.is_none() => {
                t = Some(value.parse::<u64>().map_err(|_| "a malformed timestamp")?)
            }
            Some(("t", _)) => return Err("more than one timestamp"),
            Some(("v1", value)) => signatures.push(value),
            _ => {}
        }
    }
    let t = t.ok_or("no timestamp")?;
    if now.abs_diff(t) > TOLERANCE.as_secs() {
        return Err("the timestamp is outside the tolerance");
    }
    let valid = signatures.iter().any(|hex_signature| {
        hex::decode(hex_signature)
            .is_ok_and(|given| mac(secret, t, body).verify_slice(&given).is_ok())
    });
    if valid {
        Ok(())
    } else {
        Err("no valid signature")
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The signing secret of the endpoint (`whsec_...`).
#[derive(Clone)]
struct SigningSecret(Arc<Vec<u8>>);

/// Verifies the signature on the raw body before anything else sees the delivery: a bad one is
/// answered 400 (Stripe retries it, the real delivery is not blocked).
async fn verify_signature(
    State(secret): State<SigningSecret>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "delivery too large").into_response();
    };
    let header = parts
        .headers
        .get("stripe-signature")
        .and_then(|v| v.to_str().ok());
    if let Err(why) = verify(&secret.0, header, &body, now()) {
        tracing::warn!(why, "webhook: signature refused");
        return (StatusCode::BAD_REQUEST, format!("signature refused: {why}")).into_response();
    }
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// `POST /webhooks/stripe`: applies `payment_intent.succeeded` to the ledger; acknowledges the
/// others.
async fn stripe_webhook(
    State(ledger): State<Ledger>,
    ctx: Option<IdempotencyContext>,
    #[cfg(feature = "postgres")] tx: Option<tower_idempotency::Transaction>,
    Json(event): Json<Event>,
) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    if event.kind != "payment_intent.succeeded" {
        return Ok(Json(
            serde_json::json!({ "received": true, "ignored": event.kind }),
        ));
    }
    let amount = event.data.object.amount.ok_or((
        StatusCode::BAD_REQUEST,
        "a payment_intent without an amount".to_owned(),
    ))?;
    // Half the work before the payment is booked (checks), half after (notifications): a
    // sender that times out in the second half leaves a booked payment behind.
    tokio::time::sleep(ledger.work / 2).await;
    let fence = ctx.as_ref().and_then(IdempotencyContext::fence);
    let booked = ledger
        .book(
            &event.id,
            amount,
            fence,
            #[cfg(feature = "postgres")]
            tx.as_ref(),
        )
        .await;
    tokio::time::sleep(ledger.work / 2).await;
    match booked {
        Ok(()) => Ok(Json(serde_json::json!({
            "received": true,
            "payment_intent": event.data.object.id,
            // The execution that booked it (the ledger entry carries it too).
            "fence": fence,
        }))),
        Err(why) => Err((StatusCode::CONFLICT, why)),
    }
}

async fn show(State(ledger): State<Ledger>) -> Json<Vec<Entry>> {
    Json(ledger.entries().await)
}

/// The webhook service: deliveries are verified, then deduplicated by event id.
pub(crate) fn app(
    store: Store,
    secret: &[u8],
    webhook_secret: &[u8],
    ledger: Ledger,
) -> Result<Router, tower_idempotency::ConfigError> {
    #[cfg(feature = "postgres")]
    let in_transaction = ledger.table.is_some() && store.client().supports_transactions();
    let layer = IdempotencyLayer::builder(store)
        .secret(secret)?
        // The event id names the event: global, and the one thing that identifies a delivery.
        .key(key::json("/id")?.names_a_thing())
        .identity(Identity::Key)
        // A redelivery while the first still runs waits for it and gets its answer.
        .on_conflict(OnConflict::Wait(Duration::from_secs(10)))
        .retention(RETENTION);
    // With the ledger in the store's database: booked in the layer's transaction.
    #[cfg(feature = "postgres")]
    let layer = layer.same_transaction(in_transaction);
    let layer = layer.build()?;
    let signing = SigningSecret(Arc::new(webhook_secret.to_vec()));
    Ok(Router::new()
        .route(
            "/webhooks/stripe",
            post(stripe_webhook)
                .route_layer(layer)
                // Outside the idempotency layer: runs first.
                .route_layer(middleware::from_fn_with_state(signing, verify_signature)),
        )
        .route("/ledger", get(show))
        .with_state(ledger))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_checked_as_stripe_documents() {
        let secret = b"whsec_test";
        let body = br#"{"id":"evt_1"}"#;
        let good = sign(secret, 1_000, body);
        assert!(verify(secret, Some(&good), body, 1_000).is_ok());
        assert!(verify(secret, Some(&good), body, 1_300).is_ok());
        assert!(verify(secret, Some(&good), body, 1_301).is_err(), "too old");
        assert!(
            verify(secret, Some(&good), b"{}", 1_000).is_err(),
            "another body"
        );
        assert!(verify(b"whsec_other", Some(&good), body, 1_000).is_err());
        assert!(verify(secret, None, body, 1_000).is_err());
        let v1 = good.split_once(",v1=").unwrap().1;
        // Several v1 (a rotation): one valid is enough; v0 and unknown items are ignored.
        let rotated = format!("t=1000,v1={},v0=abc,v1={v1},x=y", "00".repeat(32));
        assert!(verify(secret, Some(&rotated), body, 1_000).is_ok());
        assert!(verify(secret, Some(&format!("t=1000,t=1000,v1={v1}")), body, 1_000).is_err());
        assert!(verify(secret, Some(&format!("v1={v1}")), body, 1_000).is_err());
        assert!(verify(secret, Some("t=1000,v1=zz"), body, 1_000).is_err());
    }
}
