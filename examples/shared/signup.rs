//! The registration service of reference article 004: `POST /signup` with
//! `{"phone": "...", "name": "..."}`. Its handler does the classic check-then-insert, which lets
//! two concurrent signups with one phone number both pass the check; the idempotency layer keyed
//! by the phone number closes that hole on every instance at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, Store, key};

#[derive(Debug, Deserialize)]
pub(crate) struct Signup {
    pub(crate) phone: String,
    pub(crate) name: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct User {
    pub(crate) id: u64,
    pub(crate) phone: String,
    pub(crate) name: String,
    /// The fencing token of the execution that created the row.
    pub(crate) fence: Option<u64>,
}

/// The "users table". Rows are never deduplicated here: that is the layer's job.
#[derive(Clone, Default)]
pub(crate) struct Users {
    rows: Arc<Mutex<Vec<User>>>,
    /// Simulated latency of the insert (the window in which duplicates race).
    pub(crate) work: Duration,
}

impl Users {
    pub(crate) fn with_work(work: Duration) -> Self {
        Users {
            rows: Arc::default(),
            work,
        }
    }

    pub(crate) fn rows(&self) -> Vec<User> {
        self.rows.lock().unwrap().clone()
    }

    pub(crate) fn count_by_phone(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for u in self.rows.lock().unwrap().iter() {
            *out.entry(u.phone.clone()).or_default() += 1;
        }
        out
    }
}

async fn signup(
    State(users): State<Users>,
    ctx: Option<IdempotencyContext>,
    Json(form): Json<Signup>,
) -> Result<(StatusCode, Json<User>), (StatusCode, String)> {
    // Article 004's register(): check, then insert. Not atomic on its own.
    let exists = users
        .rows
        .lock()
        .unwrap()
        .iter()
        .any(|u| u.phone == form.phone);
    if exists {
        return Err((
            StatusCode::CONFLICT,
            "phone number already registered".into(),
        ));
    }
    tokio::time::sleep(users.work).await;
    let mut rows = users.rows.lock().unwrap();
    let user = User {
        id: rows.len() as u64 + 1,
        phone: form.phone,
        name: form.name,
        fence: ctx.as_ref().and_then(IdempotencyContext::fence),
    };
    rows.push(user.clone());
    Ok((StatusCode::CREATED, Json(user)))
}

async fn list(State(users): State<Users>) -> Json<Vec<User>> {
    Json(users.rows())
}

/// The service without any protection (for comparison).
pub(crate) fn unprotected(users: Users) -> Router {
    Router::new()
        .route("/signup", post(signup))
        .route("/users", get(list))
        .with_state(users)
}

/// The service with signups made idempotent by phone number (a key that names a person, global
/// by nature, and guessable: the server secret keeps it out of reach in the store).
pub(crate) fn app(
    store: Store,
    secret: &[u8],
    users: Users,
) -> Result<Router, tower_idempotency::ConfigError> {
    let layer = IdempotencyLayer::builder(store)
        .secret(secret)?
        .key(key::json("/phone")?)
        .build()?;
    Ok(Router::new()
        .route("/signup", post(signup).layer(layer))
        .route("/users", get(list))
        .with_state(users))
}
