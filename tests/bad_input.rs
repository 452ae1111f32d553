//! A table of malformed requests. Each gets its documented 4xx with a problem+json body; the
//! handler never runs; nothing is stored (on Redis: no key is written at all).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use support::{TestStore, send};
use tower_idempotency::{IdempotencyLayer, KeySourceExt, Store, key};

fn router(store: &Store, runs: Arc<AtomicUsize>) -> Router {
    let handler = move || {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            StatusCode::CREATED
        }
    };
    let with = |k: Box<dyn tower_idempotency::KeySource>| {
        IdempotencyLayer::builder(store.clone())
            .secret(support::SECRET)
            .unwrap()
            .global_keys()
            .key(k)
            .body_limit(1024)
            .read_timeout(Duration::from_millis(300))
            .build()
            .unwrap()
    };
    Router::new()
        .route(
            "/h",
            post(handler.clone()).layer(with(Box::new(key::header()))),
        )
        .route(
            "/j",
            post(handler.clone()).layer(with(Box::new(key::json("/id").unwrap()))),
        )
        .route(
            "/f",
            post(handler.clone()).layer(with(Box::new(key::form("email")))),
        )
        .route(
            "/q",
            post(handler.clone()).layer(with(Box::new(key::query("txn")))),
        )
        .route(
            "/o",
            post(handler.clone()).layer(with(Box::new(
                key::json("/id").unwrap().or(key::form("email")),
            ))),
        )
        .route(
            "/p/{id}",
            post(handler.clone()).layer(with(Box::new(key::path("id")))),
        )
        .route(
            "/u",
            post(handler).layer(
                IdempotencyLayer::builder(store.clone())
                    .secret(support::SECRET)
                    .unwrap()
                    .principal(tower_idempotency::principal::claim("sub"))
                    .build()
                    .unwrap(),
            ),
        )
}

fn to(path: &str, content_type: &str, body: &'static str) -> Request<Body> {
    Request::post(path)
        .header("content-type", content_type)
        .header("idempotency-key", "k")
        .body(Body::from(body))
        .unwrap()
}

fn header(values: &[&[u8]], body: Body) -> Request<Body> {
    let mut r = Request::post("/h").body(body).unwrap();
    for v in values {
        r.headers_mut()
            .append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
    }
    r
}

fn json(content_type: Option<&str>, body: impl Into<Body>) -> Request<Body> {
    let mut b = Request::post("/j");
    if let Some(ct) = content_type {
        b = b.header("content-type", ct);
    }
    b.body(body.into()).unwrap()
}

fn form(content_type: &str, body: &'static str) -> Request<Body> {
    Request::post("/f")
        .header("content-type", content_type)
        .body(Body::from(body))
        .unwrap()
}

fn query(q: &str) -> Request<Body> {
    Request::post(format!("/q{q}")).body(Body::empty()).unwrap()
}

fn chunks(n: usize, size: usize) -> Body {
    Body::from_stream(futures_util::stream::iter(
        (0..n).map(move |_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; size]))),
    ))
}

fn cases() -> Vec<(&'static str, Request<Body>, StatusCode, &'static str)> {
    use StatusCode as S;
    let long = "k".repeat(256);
    let longer = "k".repeat(1000);
    let deep = format!("{}{}", "[".repeat(500), "]".repeat(500));
    let long_json = format!(r#"{{"id":"{}"}}"#, "x".repeat(256));
    let mut lying = header(&[b"k"], Body::from("{}"));
    lying
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("10000000000"));
    let slow = Body::from_stream(
        futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"{"))])
            .chain(futures_util::stream::pending()),
    );
    vec![
        (
            "no key header",
            header(&[], Body::empty()),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "empty key",
            header(&[b""], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "empty quoted key",
            header(&[b"\"\""], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "256-char key",
            header(&[long.as_bytes()], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "1000-char key",
            header(&[longer.as_bytes()], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "non-ASCII key",
            header(&["clé".as_bytes()], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "obs-text key",
            header(&[b"\xffkey"], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "tab in key",
            header(&[b"a\tb"], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "space in bare key",
            header(&[b"a b"], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "unterminated quote",
            header(&[b"\"abc"], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "bad escape",
            header(&[b"\"a\\x\""], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "text after quote",
            header(&[b"\"a\"b"], Body::empty()),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "two key headers",
            header(&[b"a", b"b"], Body::empty()),
            S::BAD_REQUEST,
            "duplicate-key",
        ),
        (
            "two equal key headers",
            header(&[b"a", b"a"], Body::empty()),
            S::BAD_REQUEST,
            "duplicate-key",
        ),
        (
            "three key headers",
            header(&[b"a", b"b", b"c"], Body::empty()),
            S::BAD_REQUEST,
            "duplicate-key",
        ),
        (
            "body over the limit",
            header(&[b"k1"], Body::from(vec![b'x'; 2000])),
            S::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
        (
            "chunked body over the limit midway",
            header(&[b"k2"], chunks(4, 400)),
            S::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
        (
            "many small chunks over the limit",
            header(&[b"k3"], chunks(2000, 1)),
            S::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
        (
            "declared length over the limit",
            lying,
            S::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
        (
            "body that never finishes",
            header(&[b"k4"], slow),
            S::REQUEST_TIMEOUT,
            "request-timeout",
        ),
        (
            "json: no content type",
            json(None, r#"{"id":"a"}"#),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "json: text/plain",
            json(Some("text/plain"), r#"{"id":"a"}"#),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "json: application/xml",
            json(Some("application/xml"), r#"{"id":"a"}"#),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "json: form content type",
            json(Some("application/x-www-form-urlencoded"), r#"{"id":"a"}"#),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "json: near-miss type",
            json(Some("application/jsonx"), r#"{"id":"a"}"#),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "json: truncated",
            json(Some("application/json"), r#"{"id":"#),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        (
            "json: empty body",
            json(Some("application/json"), ""),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        (
            "json: trailing garbage",
            json(Some("application/json"), r#"{"id":"a"} x"#),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        (
            "json: invalid UTF-8",
            json(
                Some("application/json"),
                Bytes::from_static(b"{\"id\":\"\xff\"}"),
            ),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        (
            "json: nested 500 deep",
            json(Some("application/json"), deep),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        (
            "json: top-level null",
            json(Some("application/json"), "null"),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "json: top-level array",
            json(Some("application/json"), "[]"),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "json: key field missing",
            json(Some("application/json"), r#"{"other":"a"}"#),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "json: key null",
            json(Some("application/json"), r#"{"id":null}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key a number",
            json(Some("application/json"), r#"{"id":42}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key an object",
            json(Some("application/json"), r#"{"id":{"a":1}}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key an array",
            json(Some("application/json"), r#"{"id":["a"]}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key a boolean",
            json(Some("application/json"), r#"{"id":true}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key field twice",
            json(Some("application/json"), r#"{"id":"a","id":"b"}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key field twice, the second null",
            json(
                Some("application/json"),
                r#"{"id":"a","other":1,"id":null}"#,
            ),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key empty",
            json(Some("application/json"), r#"{"id":""}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key too long",
            json(Some("application/json"), long_json),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: key with a NUL",
            json(Some("application/json"), r#"{"id":"a\u0000b"}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "json: over the limit",
            json(
                Some("application/json"),
                format!(r#"{{"id":"a","pad":"{}"}}"#, "x".repeat(2000)),
            ),
            S::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
        (
            "form: JSON content type",
            form("application/json", "email=a%40b.c"),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "form: field missing",
            form("application/x-www-form-urlencoded", "name=ada"),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "form: field twice",
            form("application/x-www-form-urlencoded", "email=a&email=b"),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "form: field empty",
            form("application/x-www-form-urlencoded", "email="),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "query: parameter missing",
            query("?other=1"),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "query: no query at all",
            query(""),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "query: parameter twice",
            query("?txn=a&txn=b"),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "query: parameter empty",
            query("?txn="),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        // Keys valid for one source and not the other: a source that applies and finds a
        // malformed key answers; one that does not apply falls through.
        (
            "or: JSON id is a number (applies, malformed)",
            to("/o", "application/json", r#"{"id":7,"email":"a@b.c"}"#),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "or: JSON without id, form does not apply",
            to("/o", "application/json", r#"{"email":"a@b.c"}"#),
            S::BAD_REQUEST,
            "missing-key",
        ),
        (
            "or: form with an empty email",
            to("/o", "application/x-www-form-urlencoded", "email="),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "or: neither source applies",
            to("/o", "text/plain", "id=1"),
            S::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
        ),
        (
            "or: malformed JSON",
            to("/o", "application/json", r#"{"id":"#),
            S::BAD_REQUEST,
            "malformed-body",
        ),
        // Percent-encoded path keys.
        (
            "path: not UTF-8 once decoded",
            to("/p/%FF%FE", "text/plain", ""),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "path: a control character once decoded",
            to("/p/a%00b", "text/plain", ""),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        (
            "path: over 255 characters once decoded",
            Request::post(format!("/p/{}", "%41".repeat(256)))
                .body(Body::empty())
                .unwrap(),
            S::BAD_REQUEST,
            "invalid-key",
        ),
        // Keys scoped to a principal the request does not have.
        (
            "principal missing",
            to("/u", "application/json", "{}"),
            S::INTERNAL_SERVER_ERROR,
            "principal-missing",
        ),
    ]
}

use futures_util::StreamExt;

async fn every_malformed_request_is_refused(s: TestStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = router(&s.store, runs.clone());
    let cases = cases();
    assert!(cases.len() >= 59, "{} cases", cases.len());
    for (what, request, status, slug) in cases {
        let reply = send(&app, request).await;
        assert_eq!(reply.status, status, "{what}: {reply:?}");
        assert_eq!(reply.problem(), slug, "{what}");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{what}: the handler ran");
    }
    if let Some(server) = &s.server {
        let mut r = server.connection().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", s.store.client().prefix()))
            .query_async(&mut r)
            .await
            .unwrap();
        assert!(keys.is_empty(), "nothing was stored: {keys:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_on_memory() {
    every_malformed_request_is_refused(TestStore::memory().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_on_redis() {
    every_malformed_request_is_refused(TestStore::redis("bad-input").await).await;
}
