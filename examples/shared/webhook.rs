//! A payment provider's webhook: `POST /webhooks/payments` with
//! `{"id": "evt_...", "order_id": "...", "amount": 1000}`. Providers retry deliveries, sometimes
//! while the first is still running; each event must be applied to the ledger exactly once.
//! Deliveries are deduplicated by the `Idempotency-Key` header when the provider sends one, else
//! by the event id in the body. A retry that arrives while the first delivery runs waits for it
//! and gets the same answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, OnConflict, Store};

#[derive(Debug, Deserialize)]
pub(crate) struct PaymentEvent {
    pub(crate) id: String,
    pub(crate) order_id: String,
    pub(crate) amount: u64,
}

/// One applied event.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Entry {
    pub(crate) event: String,
    pub(crate) order_id: String,
    pub(crate) amount: u64,
    pub(crate) fence: Option<u64>,
}

/// The ledger: what each order has been paid, and every applied event.
#[derive(Clone, Default)]
pub(crate) struct Ledger {
    inner: Arc<Mutex<LedgerState>>,
    /// Simulated latency of applying a payment.
    pub(crate) work: Duration,
}

#[derive(Default)]
struct LedgerState {
    entries: Vec<Entry>,
    paid: HashMap<String, u64>,
    /// The highest fencing token seen per event: writes with a lower one are stale and refused.
    fences: HashMap<String, u64>,
}

impl Ledger {
    pub(crate) fn with_work(work: Duration) -> Self {
        Ledger {
            inner: Arc::default(),
            work,
        }
    }

    pub(crate) fn entries(&self) -> Vec<Entry> {
        self.inner.lock().unwrap().entries.clone()
    }

    pub(crate) fn paid(&self, order: &str) -> u64 {
        self.inner
            .lock()
            .unwrap()
            .paid
            .get(order)
            .copied()
            .unwrap_or(0)
    }

    /// Applies a payment, refusing a write fenced with a token lower than one already seen for
    /// the event (a stale holder whose lease was lost).
    fn apply(&self, event: &PaymentEvent, fence: Option<u64>) -> Result<Entry, &'static str> {
        let mut state = self.inner.lock().unwrap();
        if let Some(fence) = fence {
            let seen = state.fences.entry(event.id.clone()).or_default();
            if fence < *seen {
                return Err("stale fencing token");
            }
            *seen = fence;
        }
        let entry = Entry {
            event: event.id.clone(),
            order_id: event.order_id.clone(),
            amount: event.amount,
            fence,
        };
        *state.paid.entry(event.order_id.clone()).or_default() += event.amount;
        state.entries.push(entry.clone());
        Ok(entry)
    }
}

async fn payment(
    State(ledger): State<Ledger>,
    ctx: Option<IdempotencyContext>,
    Json(event): Json<PaymentEvent>,
) -> Result<Json<Entry>, (StatusCode, String)> {
    // Half the work before the payment is booked (checks), half after (notifications): a
    // client that gives up in the second half leaves a committed payment behind.
    tokio::time::sleep(ledger.work / 2).await;
    let fence = ctx.as_ref().and_then(IdempotencyContext::fence);
    let entry = ledger.apply(&event, fence);
    tokio::time::sleep(ledger.work / 2).await;
    match entry {
        Ok(entry) => Ok(Json(entry)),
        Err(why) => Err((StatusCode::CONFLICT, why.into())),
    }
}

async fn show(State(ledger): State<Ledger>) -> Json<Vec<Entry>> {
    Json(ledger.entries())
}

/// The webhook service. Its only client is the payment provider, so its keys are global.
pub(crate) fn app(
    store: Store,
    secret: &[u8],
    ledger: Ledger,
) -> Result<Router, tower_idempotency::ConfigError> {
    let layer = IdempotencyLayer::builder(store)
        .secret(secret)?
        .key(key::header().or(key::json("/id")?))
        .global_keys()
        .on_conflict(OnConflict::Wait(Duration::from_secs(10)))
        .build()?;
    Ok(Router::new()
        .route("/webhooks/payments", post(payment))
        .route_layer(layer)
        .route("/ledger", get(show))
        .with_state(ledger))
}
