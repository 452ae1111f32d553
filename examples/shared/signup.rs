//! The registration service of reference article 004: `POST /signup` with
//! `{"phone": "...", "name": "..."}`. Its handler does the classic check-then-insert, which lets
//! two concurrent signups with one phone number both pass the check; the idempotency layer keyed
//! by the phone number closes that hole on every instance at once.
//!
//! The phone number is a key that names a thing: an identical resend is replayed, a signup
//! refused without effect (a misspelt field: 422) holds nothing, so the corrected one runs, and
//! another person's signup with a registered number reaches the handler and gets its answer
//! (409 "already registered"), never an instruction to change a key nobody chose.
//!
//! The same service for people: `GET /` serves an HTML form (no JavaScript) whose every render
//! carries its own idempotency key in a hidden field (a key the client chose for one request).
//! `POST /signup/form` answers post/redirect/get, `303 See Other` to the account's page, and the
//! layer keyed by that hidden field replays the redirect for a second click, a resubmission
//! after the back button, or the same form sent from another tab to another instance: one
//! account, one result page. A refusal is a page, not JSON.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, OnConflict, Store};

/// The hidden form field that carries the idempotency key of one render of the form.
pub(crate) const FORM_KEY_FIELD: &str = "idempotency_key";

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

/// The users table: in memory, or (feature `postgres`, `DATABASE_URL`) a Postgres table
/// written in the layer's transaction. Rows are never deduplicated here (no unique constraint
/// on the phone number): that is the layer's job.
#[derive(Clone, Default)]
pub(crate) struct Users {
    rows: Arc<Mutex<Vec<User>>>,
    /// Simulated latency of the insert (the window in which duplicates race).
    pub(crate) work: Duration,
    /// The Postgres table, and a connection to read it (and write it outside a transaction).
    #[cfg(feature = "postgres")]
    pub(crate) table: Option<(Arc<tokio_postgres::Client>, String)>,
}

impl Users {
    pub(crate) fn with_work(work: Duration) -> Self {
        Users {
            rows: Arc::default(),
            work,
            #[cfg(feature = "postgres")]
            table: None,
        }
    }

    /// The users in `table` of the database at `url` (made if missing).
    #[cfg(feature = "postgres")]
    pub(crate) async fn postgres(url: &str, table: &str, work: Duration) -> Result<Self, String> {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot connect to {url}: {e}"))?;
        tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, phone text NOT NULL, \
                 name text NOT NULL, fence bigint)"
            ))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Users {
            rows: Arc::default(),
            work,
            table: Some((Arc::new(client), table.to_owned())),
        })
    }

    pub(crate) async fn rows(&self) -> Vec<User> {
        #[cfg(feature = "postgres")]
        if let Some((client, table)) = &self.table {
            let rows = client
                .query(
                    &format!("SELECT id, phone, name, fence FROM {table} ORDER BY id"),
                    &[],
                )
                .await
                .unwrap_or_default();
            return rows
                .iter()
                .map(|row| User {
                    id: row.get::<_, i64>(0) as u64,
                    phone: row.get(1),
                    name: row.get(2),
                    fence: row.get::<_, Option<i64>>(3).map(|f| f as u64),
                })
                .collect();
        }
        self.rows.lock().unwrap().clone()
    }

    pub(crate) async fn count_by_phone(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for u in self.rows().await {
            *out.entry(u.phone).or_default() += 1;
        }
        out
    }
}

/// Why an account was not created.
enum Refused {
    AlreadyRegistered,
    Invalid(&'static str),
    /// The database failed.
    #[allow(dead_code)]
    Failed(String),
}

/// The application's own validation: nothing is created for a signup that fails it.
fn validate(phone: &str, name: &str) -> Result<(), Refused> {
    let digits = phone.chars().filter(char::is_ascii_digit).count();
    let allowed = phone
        .chars()
        .enumerate()
        .all(|(i, c)| c.is_ascii_digit() || c == ' ' || (i == 0 && c == '+'));
    if !allowed || !(6..=15).contains(&digits) {
        return Err(Refused::Invalid(
            "the phone number must be 6 to 15 digits, with an optional leading +",
        ));
    }
    if name.trim().is_empty() {
        return Err(Refused::Invalid("the name must not be empty"));
    }
    Ok(())
}

/// Article 004's register(): check, then insert. Not atomic on its own.
async fn register(
    users: &Users,
    phone: String,
    name: String,
    ctx: Option<&IdempotencyContext>,
    #[cfg(feature = "postgres")] tx: Option<tower_idempotency::Transaction>,
) -> Result<User, Refused> {
    validate(&phone, &name)?;
    let fence = ctx.and_then(IdempotencyContext::fence);
    #[cfg(feature = "postgres")]
    if let Some((client, table)) = &users.table {
        let client: &tokio_postgres::Client = match &tx {
            Some(tx) => tx,
            None => client,
        };
        let exists = client
            .query_opt(
                &format!("SELECT 1 FROM {table} WHERE phone = $1"),
                &[&phone],
            )
            .await
            .map_err(|e| Refused::Failed(e.to_string()))?;
        if exists.is_some() {
            return Err(Refused::AlreadyRegistered);
        }
        tokio::time::sleep(users.work).await;
        let row = client
            .query_one(
                &format!(
                    "INSERT INTO {table} (phone, name, fence) VALUES ($1, $2, $3) RETURNING id"
                ),
                &[&phone, &name, &fence.map(|f| f as i64)],
            )
            .await
            .map_err(|e| Refused::Failed(e.to_string()))?;
        return Ok(User {
            id: row.get::<_, i64>(0) as u64,
            phone,
            name,
            fence,
        });
    }
    let exists = users.rows.lock().unwrap().iter().any(|u| u.phone == phone);
    if exists {
        return Err(Refused::AlreadyRegistered);
    }
    // The insert, as a database runs it: once sent, it commits whether or not the client (and
    // with it this request's future) is still there.
    let insert = tokio::spawn({
        let users = users.clone();
        async move {
            tokio::time::sleep(users.work).await;
            let mut rows = users.rows.lock().unwrap();
            let user = User {
                id: rows.len() as u64 + 1,
                phone,
                name,
                fence,
            };
            rows.push(user.clone());
            user
        }
    });
    Ok(insert.await.expect("the insert does not panic"))
}

async fn signup(
    State(users): State<Users>,
    ctx: Option<IdempotencyContext>,
    #[cfg(feature = "postgres")] tx: Option<tower_idempotency::Transaction>,
    Json(form): Json<Signup>,
) -> Result<(StatusCode, Json<User>), (StatusCode, String)> {
    let registered = register(
        &users,
        form.phone,
        form.name,
        ctx.as_ref(),
        #[cfg(feature = "postgres")]
        tx,
    );
    match registered.await {
        Ok(user) => Ok((StatusCode::CREATED, Json(user))),
        Err(Refused::AlreadyRegistered) => Err((
            StatusCode::CONFLICT,
            "phone number already registered".into(),
        )),
        Err(Refused::Invalid(why)) => Err((StatusCode::UNPROCESSABLE_ENTITY, why.into())),
        Err(Refused::Failed(why)) => Err((StatusCode::SERVICE_UNAVAILABLE, why)),
    }
}

/// The form as a browser posts it.
#[derive(Debug, Deserialize)]
pub(crate) struct FormSignup {
    pub(crate) phone: String,
    pub(crate) name: String,
    #[serde(rename = "idempotency_key")]
    pub(crate) key: String,
}

/// Text for HTML.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn page(title: &str, body: &str) -> String {
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 32rem; margin: 3rem auto; color: #1d2330; }}
h1 {{ font-size: 1.6rem; }}
label {{ display: block; margin: 1rem 0 .3rem; font-weight: 600; }}
input {{ width: 100%; padding: .5rem; font-size: 1rem; box-sizing: border-box; }}
button {{ margin-top: 1.5rem; padding: .6rem 1.6rem; font-size: 1rem; background: #2456d6; color: white; border: 0; border-radius: .3rem; }}
.card {{ border: 1px solid #d5dae3; border-radius: .5rem; padding: 1rem 1.5rem; background: #f6f8fb; }}
.count {{ font-size: 1.2rem; font-weight: 700; color: #137333; }}
.error {{ color: #b3261e; font-weight: 600; }}
</style></head><body>{body}</body></html>"#
    )
}

/// The signup form carrying `key`, filled with what was sent, and the reason it was refused.
fn form_page(key: &str, name: &str, phone: &str, error: Option<&str>) -> String {
    let error = error.map_or(String::new(), |e| {
        format!(r#"<p class="error" id="error">{}</p>"#, escape(e))
    });
    page(
        "Sign up",
        &format!(
            r#"<h1>Create your account</h1>{error}
<form method="post" action="/signup/form">
<input type="hidden" name="{FORM_KEY_FIELD}" value="{key}">
<label for="name">Name</label><input id="name" name="name" value="{name}" required>
<label for="phone">Phone number</label><input id="phone" name="phone" type="tel" value="{phone}" required>
<button id="submit" type="submit">Sign up</button>
</form>"#,
            key = escape(key),
            name = escape(name),
            phone = escape(phone),
        ),
    )
}

/// `GET /`: the signup form, with a fresh idempotency key in a hidden field.
async fn form() -> impl IntoResponse {
    let mut key = [0u8; 16];
    rand::fill(&mut key[..]);
    let key: String = key.iter().map(|b| format!("{b:02x}")).collect();
    Html(form_page(&key, "", "", None))
}

/// `POST /signup/form`: creates the account and answers `303 See Other` to its page
/// (post/redirect/get: reloading the result page never posts again).
async fn form_signup(
    State(users): State<Users>,
    ctx: Option<IdempotencyContext>,
    #[cfg(feature = "postgres")] tx: Option<tower_idempotency::Transaction>,
    Form(form): Form<FormSignup>,
) -> Response {
    let (key, name, phone) = (form.key.clone(), form.name.clone(), form.phone.clone());
    let registered = register(
        &users,
        form.phone,
        form.name,
        ctx.as_ref(),
        #[cfg(feature = "postgres")]
        tx,
    );
    match registered.await {
        Ok(user) => (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/accounts/{}", user.id))],
        )
            .into_response(),
        Err(Refused::AlreadyRegistered) => (
            StatusCode::CONFLICT,
            Html(page(
                "Already registered",
                r#"<h1>This phone number is already registered</h1><p><a href="/">Back</a></p>"#,
            )),
        )
            .into_response(),
        // Nothing was created: the same form (and key) comes back to be corrected.
        Err(Refused::Invalid(why)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Html(form_page(&key, &name, &phone, Some(why))),
        )
            .into_response(),
        Err(Refused::Failed(why)) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// `GET /accounts/{id}`: the result page.
async fn account(State(users): State<Users>, Path(id): Path<u64>) -> Response {
    let rows = users.rows().await;
    let Some(user) = rows.iter().find(|u| u.id == id) else {
        return (
            StatusCode::NOT_FOUND,
            Html(page("Not found", "<h1>No such account</h1>")),
        )
            .into_response();
    };
    let same_phone = rows.iter().filter(|u| u.phone == user.phone).count();
    Html(page(
        "Welcome",
        &format!(
            r#"<h1>Welcome, {name}!</h1>
<div class="card">
<p>Account <strong id="account">#{id}</strong> for <strong id="phone">{phone}</strong>.</p>
<p>Accounts with this phone number: <span class="count" id="count">{same_phone}</span></p>
</div>"#,
            name = escape(&user.name),
            id = user.id,
            phone = escape(&user.phone),
        ),
    ))
    .into_response()
}

async fn list(State(users): State<Users>) -> Json<Vec<User>> {
    Json(users.rows().await)
}

/// The service without any protection (for comparison).
pub(crate) fn unprotected(users: Users) -> Router {
    Router::new()
        .route("/", get(form))
        .route("/signup", post(signup))
        .route("/signup/form", post(form_signup))
        .route("/accounts/{id}", get(account))
        .route("/users", get(list))
        .with_state(users)
}

/// The service with signups made idempotent: the JSON API by phone number (a key that names a
/// thing, global by nature, and guessable: the server secret keeps it out of reach in the
/// store), the HTML form by the key of its render (a key the client chose for one request: a
/// second click, a resubmission or another tab waits for the first submission and gets its
/// redirect; any visitor may send it, so keys are global).
pub(crate) fn app(
    store: Store,
    secret: &[u8],
    users: Users,
) -> Result<Router, tower_idempotency::ConfigError> {
    // With the users in the store's database: inserted in the layer's transaction.
    #[cfg(feature = "postgres")]
    let in_transaction = users.table.is_some() && store.client().supports_transactions();
    let by_phone = IdempotencyLayer::builder(store.clone())
        .secret(secret)?
        .key(key::json("/phone")?.names_a_thing());
    #[cfg(feature = "postgres")]
    let by_phone = by_phone.same_transaction(in_transaction);
    let by_phone = by_phone.build()?;
    let by_form = IdempotencyLayer::builder(store)
        .secret(secret)?
        .key(key::form(FORM_KEY_FIELD).per_request())
        .global_keys()
        // A browser's second click cancels the first navigation and waits for its own answer:
        // give it the first submission's redirect, not a 409 page.
        .on_conflict(OnConflict::Wait(Duration::from_secs(10)));
    #[cfg(feature = "postgres")]
    let by_form = by_form.same_transaction(in_transaction);
    let by_form = by_form.build()?;
    Ok(Router::new()
        .route("/", get(form))
        .route("/signup", post(signup).route_layer(by_phone))
        .route("/signup/form", post(form_signup).route_layer(by_form))
        .route("/accounts/{id}", get(account))
        .route("/users", get(list))
        .with_state(users))
}
