//! What the layer leaves in traces under the usual `info` filter: one `idempotency` span per
//! covered request with its decision, outcome, a short prefix of the key's hash (never the key)
//! and the store's round-trip time; a handler whose client left runs on in that span, inside
//! the request's own. In a binary of its own: the recording subscriber is the process's global
//! one (a scoped one can find callsites cached as disabled by other tests).

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use support::{SECRET, send, serve, wait_until};
use tokio::sync::Semaphore;
use tower_idempotency::{IdempotencyLayer, Store};
use tracing::Subscriber;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// A span as recorded: its name, level and fields (as text).
#[derive(Debug, Clone)]
struct SpanRecord {
    name: String,
    level: tracing::Level,
    fields: HashMap<String, String>,
}

/// An event: its message and the names of the spans it happened in, innermost first.
#[derive(Debug, Clone)]
struct EventRecord {
    message: String,
    scope: Vec<String>,
}

#[derive(Default)]
struct Recorded {
    spans: HashMap<u64, SpanRecord>,
    events: Vec<EventRecord>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Recorded>>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let record = SpanRecord {
            name: attrs.metadata().name().to_owned(),
            level: *attrs.metadata().level(),
            fields,
        };
        self.0.lock().unwrap().spans.insert(id.into_u64(), record);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some(span) = self.0.lock().unwrap().spans.get_mut(&id.into_u64()) {
            values.record(&mut Fields(&mut span.fields));
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let scope = ctx
            .event_scope(event)
            .map(|scope| scope.map(|span| span.name().to_owned()).collect())
            .unwrap_or_default();
        self.0.lock().unwrap().events.push(EventRecord {
            message: fields.remove("message").unwrap_or_default(),
            scope,
        });
    }
}

/// The process's recorder, under an `info` filter.
fn recorder() -> &'static Recorder {
    static RECORDER: OnceLock<Recorder> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let recorder = Recorder::default();
        tracing_subscriber::registry()
            .with(tracing_subscriber::EnvFilter::new("info"))
            .with(recorder.clone())
            .init();
        recorder
    })
}

/// The `idempotency` spans of requests to `route`, in creation order.
fn spans_of(route: &str) -> Vec<SpanRecord> {
    let recorded = recorder().0.lock().unwrap();
    let mut spans: Vec<(&u64, &SpanRecord)> = recorded
        .spans
        .iter()
        .filter(|(_, s)| {
            s.name == "idempotency" && s.fields.get("route").map(String::as_str) == Some(route)
        })
        .collect();
    spans.sort_by_key(|(id, _)| **id);
    spans.into_iter().map(|(_, s)| s.clone()).collect()
}

fn field<'a>(span: &'a SpanRecord, name: &str) -> Option<&'a str> {
    span.fields.get(name).map(String::as_str)
}

fn post_key(route: &str, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(route).header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from("{}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_covered_request_leaves_an_info_span_with_its_decision() {
    recorder();
    let store = Store::memory();
    let gate = Arc::new(Semaphore::new(0));
    let layer = |required: bool| {
        IdempotencyLayer::builder(store.clone())
            .secret(SECRET)
            .unwrap()
            .global_keys()
            .key_required(required)
            .build()
            .unwrap()
    };
    let gated = {
        let gate = gate.clone();
        move || async move {
            gate.acquire().await.unwrap().forget();
            (StatusCode::CREATED, "created")
        }
    };
    let app = Router::new()
        .route(
            "/traced",
            post(|| async { (StatusCode::CREATED, "created") }).route_layer(layer(true)),
        )
        .route(
            "/traced-retryable",
            post(|| async { StatusCode::SERVICE_UNAVAILABLE }).route_layer(layer(true)),
        )
        .route("/traced-gated", post(gated).route_layer(layer(true)))
        .route(
            "/traced-optional",
            post(|| async { "ok" }).route_layer(layer(false)),
        );

    let secret_key = "customer-7-order-991";
    assert_eq!(
        send(&app, post_key("/traced", Some(secret_key)))
            .await
            .status,
        StatusCode::CREATED
    );
    assert!(
        send(&app, post_key("/traced", Some(secret_key)))
            .await
            .replayed()
    );
    assert_eq!(
        send(&app, post_key("/traced", None)).await.status,
        StatusCode::BAD_REQUEST
    );
    let spans = spans_of("/traced");
    assert_eq!(spans.len(), 3, "{spans:?}");
    assert!(spans.iter().all(|s| s.level == tracing::Level::INFO));
    let (executed, replayed, refused) = (&spans[0], &spans[1], &spans[2]);
    assert_eq!(
        field(executed, "decision"),
        Some("executed"),
        "{executed:?}"
    );
    assert_eq!(field(executed, "outcome"), Some("final"), "{executed:?}");
    let key = field(executed, "key").expect("the key's hash prefix");
    assert!(
        key.len() == 12 && key.bytes().all(|b| b.is_ascii_hexdigit()),
        "{key}"
    );
    assert!(field(executed, "store_us").is_some_and(|us| us.parse::<u64>().is_ok()));
    assert_eq!(
        field(replayed, "decision"),
        Some("replayed"),
        "{replayed:?}"
    );
    assert_eq!(
        field(replayed, "key"),
        Some(key),
        "the same key, the same prefix"
    );
    assert_eq!(field(refused, "decision"), Some("rejected"));
    assert_eq!(field(refused, "reason"), Some("missing-key"));
    for span in &spans {
        assert!(
            span.fields.values().all(|v| !v.contains(secret_key)),
            "the raw key in a span: {span:?}"
        );
    }

    send(&app, post_key("/traced-retryable", Some("r"))).await;
    let retryable = spans_of("/traced-retryable");
    assert_eq!(
        field(&retryable[0], "outcome"),
        Some("retryable"),
        "{retryable:?}"
    );

    // A conflict while the first runs, then the first ends.
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_key("/traced-gated", Some("g"))).await }
    });
    wait_until("the first request runs", || {
        spans_of("/traced-gated")
            .first()
            .and_then(|s| field(s, "decision").map(str::to_owned))
            == Some("executed".into())
    })
    .await;
    assert_eq!(
        send(&app, post_key("/traced-gated", Some("g")))
            .await
            .status,
        StatusCode::CONFLICT
    );
    gate.add_permits(1);
    first.await.unwrap();
    let gated = spans_of("/traced-gated");
    assert_eq!(field(&gated[1], "decision"), Some("conflict"), "{gated:?}");

    send(&app, post_key("/traced-optional", None)).await;
    let optional = spans_of("/traced-optional");
    assert_eq!(
        field(&optional[0], "decision"),
        Some("passed-through"),
        "{optional:?}"
    );
}

/// The client hangs up while the handler runs: what is left of the handler runs in a task of
/// its own, and its logs stay in the idempotency span and the request's span around it (under
/// a `debug` span, disabled at `info`, they had none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_client_left_logs_in_the_requests_span() {
    use tokio::io::AsyncWriteExt;
    recorder();
    let store = Store::memory();
    let gate = Arc::new(Semaphore::new(0));
    let started = Arc::new(Semaphore::new(0));
    let handler = {
        let (gate, started) = (gate.clone(), started.clone());
        move || async move {
            started.add_permits(1);
            gate.acquire().await.unwrap().forget();
            tracing::info!("booked after the client left");
            (StatusCode::CREATED, "booked")
        }
    };
    let layer = IdempotencyLayer::builder(store.clone())
        .secret(SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/traced-detached", post(handler).route_layer(layer))
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| {
                use tracing::Instrument;
                let span = tracing::info_span!("request", path = %request.uri().path());
                next.run(request).instrument(span)
            },
        ));
    let (addr, _server) = serve(app).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            b"POST /traced-detached HTTP/1.1\r\nhost: x\r\nidempotency-key: d\r\n\
              content-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    support::within("the handler starts", started.acquire())
        .await
        .unwrap()
        .forget();
    drop(socket);
    // Let the server see the hang-up before the handler goes on.
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.add_permits(1);
    wait_until("the handler's log", || {
        recorder()
            .0
            .lock()
            .unwrap()
            .events
            .iter()
            .any(|e| e.message == "booked after the client left")
    })
    .await;
    let events = recorder().0.lock().unwrap().events.clone();
    let booked = events
        .iter()
        .find(|e| e.message == "booked after the client left")
        .unwrap();
    assert!(
        booked.scope.iter().any(|s| s == "idempotency")
            && booked.scope.iter().any(|s| s == "request"),
        "{booked:?}"
    );
    wait_until("the outcome recorded", || {
        spans_of("/traced-detached")
            .first()
            .is_some_and(|s| field(s, "outcome") == Some("final"))
    })
    .await;
}
