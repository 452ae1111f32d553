//! A streaming endpoint behind the layer: `POST /v1/chat/completions` streams its answer token
//! by token as server-sent events, like an LLM API, and SDKs retry it after a dropped
//! connection. The layer sends every token as it comes, stores the stream as it passes, and
//! gives a retry the whole stream once: live if the first call is still streaming, replayed
//! from the store if it ended. The model never runs twice.
//!
//! ```sh
//! cargo run --example stream          # serves on 127.0.0.1:3000 and runs the demo below
//! ```
//!
//! The demo client (what an SDK does), on a real connection:
//!
//! 1. `POST /v1/chat/completions` with `Idempotency-Key: chat-42`, reads three tokens, and hangs
//!    up (its timeout, a dropped Wi-Fi);
//! 2. retries at once with the same key: it receives the whole stream from the first token,
//!    the ones already sent and the live ones;
//! 3. retries after the end: the same bytes again, replayed from the store.
//!
//! By hand: `curl -N -X POST localhost:3000/v1/chat/completions -H 'authorization: Bearer demo'
//! -H 'idempotency-key: k1' -d '{"prompt":"hi"}'`, press Ctrl-C after a few tokens, run it again.

#[path = "shared/env.rs"]
mod env;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::{IdempotencyLayer, OnConflict, principal};

const ANSWER: &[&str] = &[
    "Idempotency",
    " keys",
    " make",
    " retries",
    " safe",
    ":",
    " the",
    " second",
    " call",
    " gets",
    " the",
    " first",
    " call's",
    " answer",
    ".",
];

/// How often the model was run.
#[derive(Clone, Default)]
struct Model {
    runs: Arc<AtomicUsize>,
}

/// The API client an authentication layer established (a stand-in: the bearer token is the
/// client's name).
#[derive(Clone)]
struct ApiClient(String);

async fn authenticate(mut request: Request, next: Next) -> Response {
    let client = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match client {
        Some(client) => {
            request.extensions_mut().insert(ApiClient(client));
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

/// Streams the answer, one token every 150 ms, as server-sent events.
async fn completions(State(model): State<Model>) -> Response {
    let run = model.runs.fetch_add(1, Ordering::SeqCst) + 1;
    println!("  [server] model run #{run}");
    let tokens = futures_util::stream::unfold(0usize, |i| async move {
        if i > ANSWER.len() {
            return None;
        }
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let event = match ANSWER.get(i) {
            Some(token) => format!("data: {{\"token\":{token:?}}}\n\n"),
            None => "data: [DONE]\n\n".to_owned(),
        };
        Some((Ok::<_, Infallible>(Bytes::from(event)), i + 1))
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(tokens),
    )
        .into_response()
}

fn app(
    store: tower_idempotency::Store,
    secret: &[u8],
    model: Model,
) -> Result<Router, tower_idempotency::ConfigError> {
    let idempotency = IdempotencyLayer::builder(store)
        .secret(secret)?
        .principal(principal::extension(|c: &ApiClient| c.0.clone()))
        // A retry that arrives while the first call streams joins it.
        .on_conflict(OnConflict::Wait(Duration::from_secs(30)))
        .build()?;
    Ok(Router::new()
        .route(
            "/v1/chat/completions",
            post(completions).route_layer(idempotency),
        )
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(model))
}

/// Writes the request on a raw connection; reads until `stop` says so or the response ends.
async fn call(
    addr: std::net::SocketAddr,
    key: &str,
    stop: impl Fn(&str) -> bool,
) -> std::io::Result<String> {
    let mut socket = tokio::net::TcpStream::connect(addr).await?;
    let body = r#"{"prompt":"why idempotency keys?"}"#;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer demo\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if stop(&String::from_utf8_lossy(&seen)) {
            break; // hang up: the socket is dropped here
        }
    }
    Ok(String::from_utf8_lossy(&seen).into_owned())
}

fn tokens(response: &str) -> Vec<String> {
    response
        .lines()
        .filter_map(|l| l.strip_prefix("data: {\"token\":"))
        .map(|t| t.trim_end_matches('}').to_owned())
        .collect()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let store = env::store().await?;
    let secret = env::secret(&store)?;
    let model = Model::default();
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(
        axum::serve(listener, app(store.clone(), &secret, model.clone())?).into_future(),
    );
    println!(
        "streaming completions on http://{addr} (idempotency store: {})",
        store.describe()
    );

    println!("1. a client reads three tokens and hangs up");
    let first = call(addr, "chat-42", |seen| tokens(seen).len() >= 3).await?;
    println!("   got {:?}", tokens(&first));
    println!("2. it retries at once with the same key");
    let retry = call(addr, "chat-42", |_| false).await?;
    println!(
        "   got {:?} (replayed: {})",
        tokens(&retry),
        retry.contains("idempotent-replayed: true")
    );
    println!("3. and once more after the end");
    let after = call(addr, "chat-42", |_| false).await?;
    println!(
        "   got {} tokens (replayed: {})",
        tokens(&after).len(),
        after.contains("idempotent-replayed: true")
    );
    let runs = model.runs.load(Ordering::SeqCst);
    println!("the model ran {runs} time(s) for three calls");
    if runs != 1 || tokens(&retry).len() != ANSWER.len() || tokens(&after) != tokens(&retry) {
        return Err("unexpected: the retry should get the whole stream from one run".into());
    }
    println!("serving until Ctrl-C");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        result = server => { result??; }
    }
    Ok(())
}
