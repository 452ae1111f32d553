//! The HTTP edge cases a real axum application hits, each through a real `Router`: nested
//! routers and path keys, fallbacks, `.or()` sources, keyless requests with slow bodies,
//! `Retry-After`, the problem format, compression and `Vary`, the header policy at replay,
//! tower-http layers around the layer, concurrency slots, and plain tower stacks on hyper's
//! `Incoming` and tower-http's `Limited` bodies.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use support::{Reply, SECRET, counting, send, within};
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::{IdempotencyLayer, IdempotencyLayerBuilder, ReplayHeaders, Store};

fn builder(store: &Store) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store.clone())
        .secret(SECRET)
        .unwrap()
}

fn post_req(path: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

/// `key::path` reads what axum matched, also under `Router::nest` (the nested router sees the
/// path without its prefix), percent-decoded like axum's `Path`.
#[tokio::test]
async fn path_keys_under_a_nested_router() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let orders = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .layer(builder(&store).key(key::path("id")).build().unwrap());
    let app = Router::new().nest("/api", orders);
    let a = send(&app, post_req("/api/orders/42/pay", None, "")).await;
    let b = send(&app, post_req("/api/orders/43/pay", None, "")).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert_eq!(
        b.status,
        StatusCode::CREATED,
        "another order is another key: {b:?}"
    );
    assert!(!b.replayed());
    assert!(
        send(&app, post_req("/api/orders/42/pay", None, ""))
            .await
            .replayed()
    );
    // Percent-decoded: %41 is the key A (the same order; the path differs as text, so the
    // request is another one about it: it runs, never replayed); %2F is a slash inside the id,
    // not a separator.
    let a_text = send(&app, post_req("/api/orders/A/pay", None, "")).await;
    let same_key = send(&app, post_req("/api/orders/%41/pay", None, "")).await;
    assert_eq!(same_key.status, StatusCode::CREATED, "{same_key:?}");
    assert!(!same_key.replayed() && same_key.body != a_text.body);
    let slash = send(&app, post_req("/api/orders/a%2Fb/pay", None, "")).await;
    let literal = send(&app, post_req("/api/orders/a%252Fb/pay", None, "")).await;
    assert!(
        !slash.replayed() && !literal.replayed(),
        "two ids: a/b and a%2Fb"
    );
    // Not UTF-8 once decoded: refused with axum's own rule (400), the handler not run.
    let before = runs.load(Ordering::SeqCst);
    let bad = send(&app, post_req("/api/orders/%FF/pay", None, "")).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{bad:?}");
    assert_eq!(runs.load(Ordering::SeqCst), before);
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}

/// Under a router nested at a path with a parameter (`/shops/{shop}`), the nested router sees
/// the path without its prefix: two shops' requests for the same order looked the same, and
/// the second shop got the first shop's response replayed. The request is what the client
/// sent (the original URI): the second shop's request is another request. Keys are scoped per
/// route template, so the same order id there is another request about the same key: it runs
/// (one at a time with the first shop's), never replayed; as a JSON body key under a store's
/// prefix.
#[tokio::test]
async fn requests_under_a_nested_path_parameter_are_told_apart() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let shop = Router::new()
        .route("/orders/{id}/pay", post(pay.clone()))
        .layer(builder(&store).key(key::path("id")).build().unwrap());
    let app = Router::new().nest("/shops/{shop}", shop);
    let a = send(&app, post_req("/shops/1/orders/42/pay", None, "")).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let b = send(&app, post_req("/shops/2/orders/42/pay", None, "")).await;
    assert!(!b.replayed(), "shop 2 got shop 1's response: {b:?}");
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    for (path, first) in [
        ("/shops/1/orders/42/pay", &a),
        ("/shops/2/orders/42/pay", &b),
    ] {
        let again = send(&app, post_req(path, None, "")).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "each shop's own response");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let signup = Router::new().route("/signup", post(pay)).layer(
        builder(&store)
            .key(key::json("/phone").unwrap())
            .build()
            .unwrap(),
    );
    let app = Router::new().nest("/stores/{store}", signup);
    let body = r#"{"phone":"+33 6 12 34 56 78"}"#;
    let a = send(&app, post_req("/stores/a/signup", None, body)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let b = send(&app, post_req("/stores/b/signup", None, body)).await;
    assert!(!b.replayed(), "store b got store a's signup: {b:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// With `key_required(false)`, a request without a body has no body key, whatever its content
/// type: it passes through unprotected, as every keyless request does (it was refused 415,
/// while the same request passed with `json(..).or(header())`); with a key required it is 415.
#[tokio::test]
async fn a_body_key_that_cannot_be_there_is_no_key() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = |required: bool| {
        Router::new().route(
            "/pay",
            post(pay.clone()).route_layer(
                builder(&store)
                    .key(key::json("/id").unwrap())
                    .key_required(required)
                    .build()
                    .unwrap(),
            ),
        )
    };
    let bodiless = || Request::post("/pay").body(Body::empty()).unwrap();
    let optional = send(&app(false), bodiless()).await;
    assert_eq!(optional.status, StatusCode::CREATED, "{optional:?}");
    // Also when it says it is JSON (an empty body does not parse as JSON).
    let empty_json = Request::post("/pay")
        .header("content-type", "application/json")
        .body(Body::empty())
        .unwrap();
    let empty_json = send(&app(false), empty_json).await;
    assert_eq!(empty_json.status, StatusCode::CREATED, "{empty_json:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let required = send(&app(true), bodiless()).await;
    assert_eq!(
        required.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "{required:?}"
    );
    // A body of another type may hold the key (JSON sent as text/plain): refused, as before,
    // rather than run unprotected.
    let text = Request::post("/pay")
        .header("content-type", "text/plain")
        .body(Body::from(r#"{"id":"k"}"#))
        .unwrap();
    let text = send(&app(false), text).await;
    assert_eq!(text.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{text:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The layer on a router and on a router (or service) nested in it, sharing a store: the
/// inner one found the key held by the outer one's own execution (409 for every keyed
/// request). The outermost layer protects the request; the inner ones pass it through. (Also
/// how a service nested with `nest_service` is covered: axum routes it as its fallback, which
/// an outer layer passes through, so the layer goes on the nested service.)
#[tokio::test]
async fn a_layer_inside_another_passes_protected_requests_through() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let layer = builder(&store).global_keys().build().unwrap();
    let nested = Router::new()
        .route("/orders", post(pay.clone()))
        .layer(layer.clone());
    let app = Router::new()
        .nest("/api", nested.clone())
        .nest_service("/legacy", nested)
        .layer(layer);
    for path in ["/api/orders", "/legacy/orders"] {
        let first = send(&app, post_req(path, Some(path), "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}: {first:?}");
        let again = send(&app, post_req(path, Some(path), "{}")).await;
        assert!(again.replayed(), "{path}: {again:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A layer that fails open (its store unreachable) between a layer on the router and the same
/// layer on the route: the innermost still finds the outer one's name and passes the request
/// through (the fail-open layer's context, which replaces the outer one's, keeps the names held
/// further out), rather than finding its key held by the execution it runs inside (409).
#[tokio::test]
async fn a_fail_open_layer_between_two_keeps_the_outer_name() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let port = testkit::free_port().unwrap();
    let down = Store::redis(&format!("redis://127.0.0.1:{port}/")).unwrap();
    let failing_open = IdempotencyLayer::builder(down)
        .secret(SECRET)
        .unwrap()
        .key(key::json("/order").unwrap())
        .fail_open(true)
        .build()
        .unwrap();
    let layer = builder(&store).global_keys().build().unwrap();
    let app = Router::new()
        .route(
            "/pay",
            post(pay)
                .route_layer(layer.clone())
                .route_layer(failing_open),
        )
        .layer(layer);
    let body = r#"{"order":"o-1"}"#;
    let first = send(&app, post_req("/pay", Some("k-1"), body)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let again = send(&app, post_req("/pay", Some("k-1"), body)).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A layer on the router keyed by the header, and one on the signup route keyed by the phone
/// number: one person, two tabs, two header keys, one phone number at once. The inner layer
/// must still exclude the second (it passed every request the outer one protected through:
/// the handler ran twice, two accounts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_layer_never_switches_an_inner_one_off() {
    let store = Store::memory();
    let runs = Arc::new(AtomicUsize::new(0));
    let signup = {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
            (StatusCode::CREATED, "account")
        }
    };
    let by_phone = builder(&store)
        .key(key::json("/phone").unwrap())
        .build()
        .unwrap();
    let by_header = builder(&store).global_keys().build().unwrap();
    let app = Router::new()
        .route("/signup", post(signup).route_layer(by_phone))
        .layer(by_header);
    let body = r#"{"phone":"+15550199","name":"Ada"}"#;
    let tabs: Vec<_> = ["tab-1", "tab-2"]
        .into_iter()
        .map(|tab| {
            let app = app.clone();
            tokio::spawn(async move { send(&app, post_req("/signup", Some(tab), body)).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for tab in tabs {
        statuses.push(within("a tab's answer", tab).await.unwrap().status);
    }
    statuses.sort();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "two accounts: {statuses:?}");
    assert_eq!(statuses, [StatusCode::CREATED, StatusCode::CONFLICT]);
}

/// A batch endpoint under the layer forwards its sub-requests, extensions and all, to routes
/// under the same layer: each sub-request is protected by its own key (the batch's context
/// switched the layer off for them: the same sub-request in two batches ran twice).
#[tokio::test]
async fn a_batch_forwarding_its_extensions_keeps_each_sub_request_protected() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let layer = builder(&store).global_keys().build().unwrap();
    let inner = Router::new().route("/pay", post(pay)).layer(layer.clone());
    let batch = {
        let inner = inner.clone();
        move |request: Request<Body>| {
            let inner = inner.clone();
            async move {
                // Two sub-requests, each with its own key, carrying the batch's extensions.
                let mut out = Vec::new();
                for key in ["sub-1", "sub-2"] {
                    let mut sub = post_req("/pay", Some(key), "{}");
                    *sub.extensions_mut() = request.extensions().clone();
                    let reply = send(&inner, sub).await;
                    out.push(format!("{}:{}", reply.status.as_u16(), reply.replayed()));
                }
                out.join(",")
            }
        }
    };
    let app = Router::new().route("/batch", post(batch)).layer(layer);
    let first = send(&app, post_req("/batch", Some("batch-1"), "{}")).await;
    assert_eq!(first.body, "201:false,201:false", "{first:?}");
    // Another batch with the same sub-requests: they are replayed, not run again.
    let second = send(&app, post_req("/batch", Some("batch-2"), "{}")).await;
    assert_eq!(second.body, "201:true,201:true", "{second:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Tenants told apart by host, over HTTP/2 without TLS (h2c): hyper puts `:authority` in the URI
/// and adds no `Host`, so the documented principal (a closure reading `Host`) answered every
/// HTTP/2 request 500 `principal-missing`; `principal::host()` falls back to the authority.
#[tokio::test]
async fn tenants_by_host_over_http2() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = Router::new().route(
        "/pay",
        post(pay).route_layer(
            builder(&store)
                .principal(tower_idempotency::principal::host())
                .build()
                .unwrap(),
        ),
    );
    let (addr, _server) = support::serve(app).await;
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Body>();
    let port = addr.port();
    let pay = |host: &str| {
        let request = Request::post(format!("http://{host}:{port}/pay"))
            .header("idempotency-key", "order-1")
            .body(Body::empty())
            .unwrap();
        let h2 = h2.clone();
        async move {
            let response = h2.request(request).await.unwrap();
            assert_eq!(response.version(), http::Version::HTTP_2);
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            }
        }
    };
    let a = pay("127.0.0.1").await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    let b = pay("localhost").await;
    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert!(!b.replayed(), "another host is another tenant");
    assert!(pay("127.0.0.1").await.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A layer wrapping a plain service nested with `nest_service`: axum routes every request to
/// it without a `MatchedPath`, as to a fallback, so by default the layer passes them all
/// through (the second delivery ran again); built with `cover_unmatched`, it protects them.
#[tokio::test]
async fn a_layer_around_a_nested_service_covers_it_when_told_to() {
    use tower::Layer;
    for cover in [false, true] {
        let store = Store::memory();
        let runs = Arc::new(AtomicUsize::new(0));
        let counter = runs.clone();
        let hooks = tower::service_fn(move |_: Request<tower_idempotency::RequestBody<Body>>| {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                Ok::<_, std::convert::Infallible>(
                    axum::http::Response::builder()
                        .status(StatusCode::CREATED)
                        .body(Body::from(format!("run {n}")))
                        .unwrap(),
                )
            }
        });
        let layer = builder(&store)
            .global_keys()
            .cover_unmatched(cover)
            .build()
            .unwrap();
        let app = Router::new().nest_service("/hooks", layer.layer(hooks));
        let first = send(&app, post_req("/hooks/stripe", Some("evt_1"), "{}")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let again = send(&app, post_req("/hooks/stripe", Some("evt_1"), "{}")).await;
        let expected_runs = if cover { 1 } else { 2 };
        assert_eq!(again.replayed(), cover, "cover {cover}: {again:?}");
        assert_eq!(runs.load(Ordering::SeqCst), expected_runs, "cover {cover}");
    }
}

/// With `Router::layer` the fallback is layered too: requests that matched no route pass
/// through untouched (404, whatever their body), instead of key rejections.
#[tokio::test]
async fn unmatched_requests_pass_through() {
    let store = Store::memory();
    let (_, pay) = counting();
    let app = Router::new().route("/pay", post(pay.clone())).layer(
        builder(&store)
            .key(key::json("/id").unwrap())
            .body_limit(16)
            .build()
            .unwrap(),
    );
    for (body, ct) in [
        ("", "application/json"),
        (&*"x".repeat(100), "application/json"),
        ("a=b", "text/plain"),
    ] {
        let reply = send(
            &app,
            Request::post("/nowhere")
                .header("content-type", ct)
                .body(Body::from(body.to_owned()))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{reply:?}");
    }
    // The route itself is still protected.
    let reply = send(&app, post_req("/pay", None, "{}")).await;
    assert_eq!(reply.problem(), "missing-key");
    // Layered on the method router with `route_layer`, a method the route does not have gets
    // the router's 405 (axum layers its 405 fallback under `Router::layer`/`route_layer`).
    let app = Router::new().route(
        "/pay",
        post(pay).route_layer(
            builder(&store)
                .key(key::json("/id").unwrap())
                .build()
                .unwrap(),
        ),
    );
    let patch = Request::patch("/pay").body(Body::empty()).unwrap();
    let reply = send(&app, patch).await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED, "{reply:?}");
}

/// `.or()`: a source that does not apply to the request (a JSON field of a form post) falls
/// through to the next; a malformed key where the source applies is an error at once.
#[tokio::test]
async fn or_falls_through_when_a_source_does_not_apply() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = Router::new().route("/pay", post(pay)).layer(
        builder(&store)
            .key(key::json("/id").unwrap().per_request().or(key::header()))
            .global_keys()
            .build()
            .unwrap(),
    );
    let form = |key: Option<&str>| {
        let mut b =
            Request::post("/pay").header("content-type", "application/x-www-form-urlencoded");
        if let Some(key) = key {
            b = b.header("idempotency-key", key);
        }
        b.body(Body::from("amount=10")).unwrap()
    };
    let first = send(&app, form(Some("form-1"))).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the header of a form post: {first:?}"
    );
    assert!(send(&app, form(Some("form-1"))).await.replayed());
    let keyless = send(&app, form(None)).await;
    assert_eq!(keyless.problem(), "missing-key", "neither source has a key");
    // JSON: the field applies and wins; malformed JSON is an error, not a fall-through.
    let json = send(
        &app,
        post_req("/pay", Some("header-ignored"), r#"{"id":"evt-1"}"#),
    )
    .await;
    assert_eq!(json.status, StatusCode::CREATED);
    assert!(
        send(&app, post_req("/pay", Some("other"), r#"{"id":"evt-1"}"#))
            .await
            .replayed()
    );
    let broken = send(&app, post_req("/pay", Some("h"), r#"{"id":"#)).await;
    assert_eq!(broken.problem(), "malformed-body");
    // A text body without the header: the header applies and has no key: missing.
    let text = send(
        &app,
        Request::post("/pay")
            .header("content-type", "text/plain")
            .body(Body::from("x"))
            .unwrap(),
    )
    .await;
    assert_eq!(text.problem(), "missing-key", "{text:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A request without its header key is refused at once, before its (slow, large) body.
#[tokio::test]
async fn a_keyless_request_is_refused_before_its_body() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(builder(&store).global_keys().build().unwrap());
    let (addr, _server) = support::serve(app).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    // Announces a body it never sends.
    socket
        .write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let n = within("the refusal, before the body", socket.read(&mut answer))
        .await
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("missing-key"), "{answer}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// `Retry-After` of a 409 says when the holder's lease ends, at most the configured bound.
#[tokio::test]
async fn retry_after_follows_the_holders_lease() {
    let store = Store::memory();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let slow = {
        let gate = gate.clone();
        let started = started.clone();
        move || {
            let gate = gate.clone();
            started.fetch_add(1, Ordering::SeqCst);
            async move {
                gate.acquire().await.unwrap().forget();
                StatusCode::CREATED
            }
        }
    };
    for (lease, bound, expected) in [(30, 10, "10"), (3, 10, "3"), (30, 60, "30")] {
        let lock = distlock::LockConfig::builder()
            .lease(Duration::from_secs(lease))
            .build()
            .unwrap();
        let app = Router::new().route("/pay", post(slow.clone())).layer(
            builder(&store)
                .global_keys()
                .lock_config(lock)
                .retry_after(Duration::from_secs(bound))
                .build()
                .unwrap(),
        );
        let key = format!("lease-{lease}-{bound}");
        let first = tokio::spawn({
            let app = app.clone();
            let key = key.clone();
            async move { send(&app, post_req("/pay", Some(&key), "")).await }
        });
        let n = started.load(Ordering::SeqCst);
        support::wait_until("the first request runs", || {
            started.load(Ordering::SeqCst) > n
        })
        .await;
        let conflict = send(&app, post_req("/pay", Some(&key), "")).await;
        assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
        assert_eq!(
            conflict.headers["retry-after"], expected,
            "lease {lease} s, bound {bound} s"
        );
        gate.add_permits(1);
        within("the first request", first).await.unwrap();
    }
}

/// The problem `type` base is configurable, and rejections can be rendered in the API's own
/// error format; the status codes stay.
#[tokio::test]
async fn problem_types_and_rendering_are_configurable() {
    let store = Store::memory();
    let (_, pay) = counting();
    let app = Router::new().route("/pay", post(pay.clone())).layer(
        builder(&store)
            .global_keys()
            .problem_base("https://api.example.com/problems/")
            .unwrap()
            .build()
            .unwrap(),
    );
    let reply = send(&app, post_req("/pay", None, "")).await;
    assert_eq!(
        reply.json()["type"],
        "https://api.example.com/problems/missing-key"
    );
    let app = Router::new().route("/pay", post(pay)).layer(
        builder(&store)
            .global_keys()
            .render_rejections(|rejection| {
                let body = serde_json::json!({"error": {"code": rejection.slug()}});
                let mut response = http::Response::new(Bytes::from(body.to_string()));
                *response.status_mut() = StatusCode::IM_A_TEAPOT; // overridden: statuses stay
                response
            })
            .build()
            .unwrap(),
    );
    let reply = send(&app, post_req("/pay", None, "")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.json()["error"]["code"], "missing-key");
    let dup = Request::post("/pay")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        send(&app, dup).await.json()["error"]["code"],
        "duplicate-key"
    );
}

fn gzip_app(store: &Store, compression_inside: bool) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            (
                StatusCode::CREATED,
                [("content-type", "text/plain")],
                format!("run {n} ").repeat(200),
            )
        }
    };
    let layer = builder(store).global_keys().build().unwrap();
    let compression = tower_http::compression::CompressionLayer::new();
    let app = if compression_inside {
        Router::new()
            .route("/pay", post(handler))
            .layer(compression)
            .layer(layer)
    } else {
        Router::new()
            .route("/pay", post(handler))
            .layer(layer)
            .layer(compression)
    };
    (app, runs)
}

fn with_encoding(key: &str, encoding: &str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("accept-encoding", encoding)
        .body(Body::empty())
        .unwrap()
}

fn gunzip(reply: &Reply) -> String {
    use std::io::Read;
    let mut out = String::new();
    flate2::read::GzDecoder::new(&reply.body[..])
        .read_to_string(&mut out)
        .unwrap();
    out
}

/// CompressionLayer *outside* the layer (the supported order): records are stored
/// uncompressed and each replay is compressed for the client that asks.
#[tokio::test]
async fn compression_outside_compresses_each_replay_for_its_client() {
    let store = Store::memory();
    let (app, runs) = gzip_app(&store, false);
    let gz = send(&app, with_encoding("c-out", "gzip")).await;
    assert_eq!(gz.headers["content-encoding"], "gzip");
    let plain = send(&app, with_encoding("c-out", "identity")).await;
    assert!(plain.replayed());
    assert!(!plain.headers.contains_key("content-encoding"));
    assert_eq!(gunzip(&gz), String::from_utf8_lossy(&plain.body));
    let gz_again = send(&app, with_encoding("c-out", "gzip")).await;
    assert!(gz_again.replayed());
    assert_eq!(gunzip(&gz_again), gunzip(&gz));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// CompressionLayer *inside* the layer: the stored response is gzip and varies on
/// Accept-Encoding, so it is replayed only to retries that negotiate the same; another
/// Accept-Encoding gets 406, never a gzip body it did not ask for.
#[tokio::test]
async fn compression_inside_replays_only_what_was_negotiated() {
    let store = Store::memory();
    let (app, runs) = gzip_app(&store, true);
    let gz = send(&app, with_encoding("c-in", "gzip")).await;
    assert_eq!(gz.headers["content-encoding"], "gzip");
    let same = send(&app, with_encoding("c-in", "gzip")).await;
    assert!(same.replayed());
    assert_eq!(same.body, gz.body);
    let identity = send(&app, with_encoding("c-in", "identity")).await;
    assert_eq!(identity.status, StatusCode::NOT_ACCEPTABLE, "{identity:?}");
    assert_eq!(identity.problem(), "not-acceptable");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A response stored without a content coding (identity) suits any retry that does not refuse
/// identity, whatever else it accepts: `CompressionLayer` marks such a response `Vary:
/// accept-encoding` too, and a retry sending `Accept-Encoding: gzip` got 406, the stored
/// result out of its reach. A list compared as a list: spacing after commas aside. A retry
/// that refuses identity still gets 406.
#[tokio::test]
async fn an_identity_response_is_replayed_to_a_retry_that_accepts_it() {
    let store = Store::memory();
    let (app, runs) = gzip_app(&store, true);
    let no_preference = Request::post("/pay")
        .header("idempotency-key", "c-plain")
        .body(Body::empty())
        .unwrap();
    let plain = send(&app, no_preference).await;
    assert_eq!(plain.status, StatusCode::CREATED);
    assert!(!plain.headers.contains_key("content-encoding"), "{plain:?}");
    for accepts in ["gzip", "gzip, br", "identity;q=0.5, *;q=0"] {
        let again = send(&app, with_encoding("c-plain", accepts)).await;
        assert_eq!(again.status, StatusCode::CREATED, "{accepts}: {again:?}");
        assert!(again.replayed(), "{accepts}");
        assert_eq!(again.body, plain.body, "{accepts}");
    }
    for refuses in ["gzip, identity;q=0", "*;q=0", "br;q=1, *;q=0.000"] {
        let again = send(&app, with_encoding("c-plain", refuses)).await;
        assert_eq!(
            again.status,
            StatusCode::NOT_ACCEPTABLE,
            "{refuses}: {again:?}"
        );
    }
    let gz = send(&app, with_encoding("c-list", "gzip,deflate")).await;
    assert_eq!(gz.headers["content-encoding"], "gzip");
    let spaced = send(&app, with_encoding("c-list", "gzip, deflate")).await;
    assert!(spaced.replayed(), "{spaced:?}");
    assert_eq!(spaced.body, gz.body);
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Under a header policy that drops Content-Encoding, a stored head without it says
    // nothing of the body's coding: a gzip body stays out of reach of another Accept-Encoding.
    let handler = || async {
        (
            StatusCode::CREATED,
            [("content-type", "text/plain")],
            "run ".repeat(200),
        )
    };
    let layer = builder(&store)
        .global_keys()
        .replay_headers(ReplayHeaders::allow(["content-type"]).unwrap())
        .build()
        .unwrap();
    let dropping = Router::new()
        .route("/pay", post(handler))
        .layer(tower_http::compression::CompressionLayer::new())
        .layer(layer);
    let gz = send(&dropping, with_encoding("c-drop", "gzip")).await;
    assert_eq!(gz.headers["content-encoding"], "gzip");
    for other in ["br", "identity"] {
        let again = send(&dropping, with_encoding("c-drop", other)).await;
        assert_eq!(
            again.status,
            StatusCode::NOT_ACCEPTABLE,
            "{other}: {again:?}"
        );
    }
}

/// A layer whose header policy, on top of the default, drops `x-internal-trace`.
fn denying_trace(store: &Store) -> IdempotencyLayer {
    builder(store)
        .global_keys()
        .replay_headers(
            ReplayHeaders::default_deny()
                .and_deny(["x-internal-trace"])
                .unwrap(),
        )
        .build()
        .unwrap()
}

/// Replay applies the header policy in force now to what was stored under an earlier one.
#[tokio::test]
async fn replay_applies_the_current_header_policy() {
    let store = Store::memory();
    let handler = || async {
        (
            StatusCode::CREATED,
            [("x-internal-trace", "t-1"), ("location", "/p/1")],
            "ok",
        )
    };
    let before = Router::new()
        .route("/pay", post(handler))
        .layer(builder(&store).global_keys().build().unwrap());
    let first = send(&before, post_req("/pay", Some("policy"), "")).await;
    assert_eq!(first.headers["x-internal-trace"], "t-1");
    let after = Router::new()
        .route("/pay", post(handler))
        .layer(denying_trace(&store));
    let replay = send(&after, post_req("/pay", Some("policy"), "")).await;
    assert!(replay.replayed());
    assert!(
        !replay.headers.contains_key("x-internal-trace"),
        "{replay:?}"
    );
    assert_eq!(replay.headers["location"], "/p/1");
}

/// A response with more header values than a record is read back with (8,192; hyper's client
/// reads 100 by default), in its head or its trailers, whole or streamed, reaches its client in
/// full, and its outcome is stored without it: a retry gets 410 `response-not-stored` naming
/// the status, never a replay with headers missing, and never the handler again. Before, the
/// record was stored whole and every retry for the record's lifetime got 500
/// `record-unreadable`, a fault the layer wrote itself (and earlier still, with a policy that
/// drops a header, a panic: a header map panics past 24,576).
#[tokio::test]
async fn a_response_with_more_header_values_than_a_record_holds_is_stored_without_its_body() {
    use axum::http::{HeaderMap, HeaderValue};
    use axum::response::IntoResponse;
    use http_body::Frame;
    use tower::ServiceExt;
    fn many(n: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for _ in 0..n {
            headers.append("x-many", HeaderValue::from_static("1"));
        }
        headers
    }
    #[derive(serde::Deserialize)]
    struct Case {
        head: usize,
        trailers: usize,
        streamed: bool,
    }
    let store = Store::memory();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move |axum::extract::Query(case): axum::extract::Query<Case>| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move {
            let trailers = (case.trailers > 0).then(|| many(case.trailers));
            let frames = futures_util::stream::unfold(0, move |i| {
                let trailers = trailers.clone();
                async move {
                    let frame = match i {
                        0 => {
                            if case.streamed {
                                // Not ready at its first poll: streamed, its head appended first.
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                            Frame::data(Bytes::from_static(b"done"))
                        }
                        1 => Frame::trailers(trailers?),
                        _ => return None,
                    };
                    Some((Ok::<_, std::convert::Infallible>(frame), i + 1))
                }
            });
            let mut response = (
                StatusCode::CREATED,
                many(case.head),
                Body::new(http_body_util::StreamBody::new(frames)),
            )
                .into_response();
            response
                .headers_mut()
                .insert("location", HeaderValue::from_static("/p/1"));
            response
        }
    };
    let app = Router::new()
        .route("/pay", post(handler))
        .layer(builder(&store).global_keys().build().unwrap());
    let cases = [
        // With `location`, as many values as a record holds: kept.
        (8_191, 0, false, true),
        (30_000, 0, false, false),
        (30_000, 0, true, false),
        (0, 9_000, false, false),
        (0, 9_000, true, false),
    ];
    for (i, (head, trailers, streamed, kept)) in cases.into_iter().enumerate() {
        let what = format!("head {head}, trailers {trailers}, streamed {streamed}");
        let path = format!("/pay?head={head}&trailers={trailers}&streamed={streamed}");
        let key = format!("many-{i}");
        let response = app
            .clone()
            .oneshot(post_req(&path, Some(&key), ""))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{what}");
        assert_eq!(response.headers().get_all("x-many").iter().count(), head);
        let body = response.into_body().collect().await.unwrap();
        let got = body
            .trailers()
            .map_or(0, |t| t.get_all("x-many").iter().count());
        assert_eq!(got, trailers, "{what}: the first client's trailers");
        assert_eq!(body.to_bytes(), "done", "{what}");
        let retry = send(&app, post_req(&path, Some(&key), "")).await;
        assert!(retry.replayed(), "{what}: {retry:?}");
        if kept {
            assert_eq!(retry.status, StatusCode::CREATED, "{what}");
            assert_eq!(retry.body, "done", "{what}");
            assert_eq!(retry.headers.get_all("x-many").iter().count(), head);
        } else {
            assert_eq!(retry.status, StatusCode::GONE, "{what}: {retry:?}");
            assert_eq!(retry.problem(), "response-not-stored", "{what}");
            assert_eq!(retry.json()["original_status"], 201, "{what}");
            assert_eq!(retry.headers["location"], "/p/1", "{what}");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), cases.len());
}

/// The header policy applies to trailers too (a gRPC call's status fields excepted): a denied
/// trailer is neither stored nor replayed, whole or streamed. Before, trailers were stored and
/// replayed whatever the policy said (a session token a handler sent as a trailer went to
/// whoever retried).
#[tokio::test]
async fn the_header_policy_applies_to_trailers() {
    use axum::http::{HeaderMap, HeaderValue};
    use http_body::Frame;
    use tower::ServiceExt;
    #[derive(serde::Deserialize)]
    struct Case {
        streamed: bool,
    }
    let handler = |axum::extract::Query(case): axum::extract::Query<Case>| async move {
        let frames = futures_util::stream::unfold(0, move |i| async move {
            let frame = match i {
                0 => {
                    if case.streamed {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    Frame::data(Bytes::from_static(b"done"))
                }
                1 => {
                    let mut trailers = HeaderMap::new();
                    trailers.insert("x-session-token", HeaderValue::from_static("secret"));
                    trailers.insert("x-checksum", HeaderValue::from_static("abc"));
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    Frame::trailers(trailers)
                }
                _ => return None,
            };
            Some((Ok::<_, std::convert::Infallible>(frame), i + 1))
        });
        Body::new(http_body_util::StreamBody::new(frames))
    };
    let store = Store::memory();
    let policy = ReplayHeaders::default_deny()
        .and_deny(["x-session-token", "grpc-status"])
        .unwrap();
    let app = Router::new().route("/pay", post(handler)).layer(
        builder(&store)
            .global_keys()
            .replay_headers(policy)
            .build()
            .unwrap(),
    );
    for streamed in [false, true] {
        let path = format!("/pay?streamed={streamed}");
        let key = format!("trailers-{streamed}");
        let mut names = Vec::new();
        for _ in 0..2 {
            let response = app
                .clone()
                .oneshot(post_req(&path, Some(&key), ""))
                .await
                .unwrap();
            let body = response.into_body().collect().await.unwrap();
            let trailers = body.trailers().cloned().unwrap_or_default();
            assert_eq!(body.to_bytes(), "done");
            let mut got: Vec<_> = trailers.keys().map(|n| n.as_str().to_owned()).collect();
            got.sort();
            names.push(got);
        }
        assert_eq!(
            names[0],
            ["grpc-status", "x-checksum", "x-session-token"],
            "the first client gets them all"
        );
        assert_eq!(
            names[1],
            ["grpc-status", "x-checksum"],
            "streamed {streamed}: the replay"
        );
    }
}

/// A service that forwards an upstream response's `transfer-encoding: chunked` with a body it
/// has whole (a proxy), on plain hyper: its first client gets it, chunked, as without the
/// layer, and the retry gets the replay. Before, the layer announced the body's exact length
/// next to the chunked coding, hyper refused that head and closed the connection: the first
/// client got nothing. (Through an axum `Router` it breaks with or without the layer: axum's
/// route adds that length itself.)
#[tokio::test]
async fn a_chunked_head_over_a_body_of_known_length_reaches_its_client() {
    let store = Store::memory();
    let handler = tower::service_fn(|_: Request<_>| async {
        let mut response =
            http::Response::new(http_body_util::Full::new(Bytes::from_static(b"forwarded")));
        *response.status_mut() = StatusCode::CREATED;
        response.headers_mut().insert(
            http::header::TRANSFER_ENCODING,
            http::HeaderValue::from_static("chunked"),
        );
        Ok::<_, std::convert::Infallible>(response)
    });
    let service = tower::ServiceBuilder::new()
        .layer(builder(&store).global_keys().build().unwrap())
        .service(handler);
    let addr = serve_tower(service).await;
    let client = support::client();
    for replay in [false, true] {
        let reply = within(
            "the response",
            support::http(&client, addr, post_req("/pay", Some("proxy"), "")),
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_eq!(reply.body, "forwarded");
        assert_eq!(reply.replayed(), replay);
    }
}

/// Serves a tower service on plain hyper (HTTP/1 and HTTP/2) on a free loopback port.
async fn serve_tower<S, B>(service: S) -> std::net::SocketAddr
where
    S: tower::Service<Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// tower-http's TraceLayer, TimeoutLayer and CompressionLayer around the layer.
#[tokio::test]
async fn tower_http_layers_around_the_layer() {
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(builder(&store).global_keys().build().unwrap())
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            Duration::from_secs(5),
        ))
        .layer(tower_http::compression::CompressionLayer::new())
        .layer(tower_http::trace::TraceLayer::new_for_http());
    let first = send(&app, post_req("/pay", Some("stacked"), "")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(&app, post_req("/pay", Some("stacked"), "")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The inner service is asked for readiness only when the handler is about to be called: a
/// request whose body is still arriving holds no slot of a `ConcurrencyLimit` below the layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_reading_its_body_holds_no_concurrency_slot() {
    use tokio::io::AsyncWriteExt;
    let store = Store::memory();
    let (runs, pay) = counting();
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(tower::limit::ConcurrencyLimitLayer::new(1))
        .layer(builder(&store).global_keys().build().unwrap());
    let (addr, _server) = support::serve(app).await;
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\ncontent-length: 10\r\n\r\n12345")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let client = support::client();
    let other = within(
        "a second request while the first one's body is incomplete",
        support::http(&client, addr, post_req("/pay", Some("other"), "")),
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    drop(slow);
}

/// A plain tower stack on hyper: the layer takes `Incoming` bodies, and tower-http's
/// `RequestBodyLimitLayer` (`Limited<Incoming>`) in front of it.
#[tokio::test]
async fn plain_tower_stacks_on_hyper_bodies() {
    let store = Store::memory();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = tower::service_fn(
        move |req: Request<
            tower_idempotency::RequestBody<tower_http::body::Limited<hyper::body::Incoming>>,
        >| {
            let counter = counter.clone();
            async move {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let mut response = http::Response::new(http_body_util::Full::new(Bytes::from(
                    format!("run {n}: {}", String::from_utf8_lossy(&body)),
                )));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, std::convert::Infallible>(response)
            }
        },
    );
    let service = tower::ServiceBuilder::new()
        .layer(tower_http::limit::RequestBodyLimitLayer::new(1024))
        .layer(builder(&store).global_keys().build().unwrap())
        .service(handler);
    let addr = serve_tower(service).await;
    let client = support::client();
    let first = support::http(
        &client,
        addr,
        post_req("/jobs", Some("incoming"), "payload"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.body, "run 1: payload");
    let again = support::http(
        &client,
        addr,
        post_req("/jobs", Some("incoming"), "payload"),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    let big = support::http(
        &client,
        addr,
        post_req("/jobs", Some("big"), &"x".repeat(2000)),
    )
    .await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE, "{big:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
