//! The layer outside axum: a plain tower stack built with `ServiceBuilder`, with `Full<Bytes>`
//! requests and `String` responses (the layer is generic over body types; the inner service
//! gets the layer's `RequestBody` around the original body type).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{
    IdempotencyContext, IdempotencyLayer, RequestBody, Store, key::RouteTemplate,
};

/// The layer on the memory store, with keys global to the service.
fn memory_layer() -> IdempotencyLayer {
    IdempotencyLayer::builder(Store::memory())
        .global_keys()
        .build()
        .unwrap()
}

#[tokio::test]
async fn works_in_a_service_builder_with_other_body_types() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let mut svc = ServiceBuilder::new().layer(memory_layer()).service_fn(
        move |req: Request<RequestBody<Full<Bytes>>>| {
            let counter = counter.clone();
            async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let fence = req
                    .extensions()
                    .get::<IdempotencyContext>()
                    .and_then(|c| c.fence());
                let body = req.into_body().collect().await.unwrap().to_bytes();
                let mut res = Response::new(format!(
                    "run {n} fence {fence:?} body {}",
                    String::from_utf8_lossy(&body)
                ));
                *res.status_mut() = StatusCode::ACCEPTED;
                Ok::<_, Infallible>(res)
            }
        },
    );
    let request = || {
        let mut r = Request::post("/jobs/7")
            .header("idempotency-key", "job-7")
            .body(Full::new(Bytes::from_static(b"payload")))
            .unwrap();
        r.extensions_mut()
            .insert(RouteTemplate("/jobs/{id}".into()));
        r
    };
    let first = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first_body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &first_body[..],
        b"run 1 fence Some(1) body payload",
        "the handler sees the original body"
    );
    let second = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(
        second.into_body().collect().await.unwrap().to_bytes(),
        first_body
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A waker that counts its wakes.
struct Wakes(AtomicUsize);

impl std::task::Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// The response future drives the execution and then waits for its response head from it, in
/// one task. The head a handler returns after its first poll must not wake the task that is
/// polling: tokio reschedules a task woken during its own poll as one that yielded (on a
/// multi-thread runtime, another worker woken to steal it), once per request whose handler
/// waits for anything.
#[tokio::test]
async fn a_handler_that_answers_later_does_not_wake_the_task_polling_it() {
    let (answer, answered) = tokio::sync::oneshot::channel::<()>();
    let answered = Arc::new(std::sync::Mutex::new(Some(answered)));
    let svc = ServiceBuilder::new().layer(memory_layer()).service_fn(
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let answered = answered.lock().unwrap().take();
            async move {
                if let Some(answered) = answered {
                    let _ = answered.await;
                }
                Ok::<_, Infallible>(Response::new("done".to_owned()))
            }
        },
    );
    let request = Request::post("/orders")
        .header("idempotency-key", "order-1")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let mut future = std::pin::pin!(svc.oneshot(request));
    let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
    let waker = std::task::Waker::from(wakes.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(
        future.as_mut().poll(&mut cx).is_pending(),
        "the handler waits"
    );
    answer.send(()).unwrap();
    let woken = wakes.0.load(Ordering::SeqCst);
    assert_eq!(woken, 1, "the handler's answer wakes the task once");
    let response = match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(response) => response.unwrap(),
        std::task::Poll::Pending => panic!("the answered handler's response is ready"),
    };
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        woken,
        "the response head woke the task that was polling for it"
    );
}

/// A streamed response's head goes to the connection as soon as the handler returns it, with
/// the frames already read; storing the record's head and reading the handler's body further
/// come after. When the response future resolves, the layer has read the handler's body only
/// as far as it had to (its first frame, then a poll that found nothing more).
#[tokio::test]
async fn a_streamed_head_is_handed_over_before_the_execution_goes_on() {
    let polls = Arc::new(AtomicUsize::new(0));
    let counter = polls.clone();
    let svc = ServiceBuilder::new().layer(memory_layer()).service_fn(
        move |_req: Request<RequestBody<Full<Bytes>>>| {
            let counter = counter.clone();
            async move {
                let frames = futures_util::stream::poll_fn(move |_| {
                    match counter.fetch_add(1, Ordering::SeqCst) {
                        0 => std::task::Poll::Ready(Some(Ok::<_, Infallible>(
                            http_body::Frame::data(Bytes::from_static(b"data: 1\n\n")),
                        ))),
                        // The next event is not there yet (nothing wakes this: the test
                        // looks only at the head and the first frame).
                        _ => std::task::Poll::Pending,
                    }
                });
                Ok::<_, Infallible>(Response::new(http_body_util::StreamBody::new(frames)))
            }
        },
    );
    let request = Request::post("/events")
        .header("idempotency-key", "stream-1")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), svc.oneshot(request))
        .await
        .expect("the response head comes at once")
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        polls.load(Ordering::SeqCst),
        2,
        "the handler's body was read further before its head was handed over"
    );
    let mut body = response.into_body();
    let first = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
        .await
        .expect("the first frame comes at once")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "data: 1\n\n");
}

/// Called with no Tokio runtime (an executor of another kind), a protected request is refused
/// with 503 (the handler not run), never a panic: the check came after the body was read with a
/// Tokio timer, which panics without a runtime.
#[test]
fn without_a_tokio_runtime_a_protected_request_is_refused_not_a_panic() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let mut svc = ServiceBuilder::new().layer(memory_layer()).service_fn(
        move |_: Request<RequestBody<Full<Bytes>>>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, Infallible>(Response::new(String::from("ran"))) }
        },
    );
    let request = Request::post("/pay")
        .header("idempotency-key", "k")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let mut future = std::pin::pin!(svc.call(request));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        future.as_mut().poll(&mut cx)
    }));
    let Ok(std::task::Poll::Ready(Ok(response))) = polled else {
        panic!(
            "not answered at once (or a panic): {:?}",
            polled.map(|p| p.is_ready())
        );
    };
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// The handler gets the request's trailers: the layer reads the body to find the key and the
/// fingerprint, and handed the handler its data only (the trailers were dropped).
#[tokio::test]
async fn the_handler_gets_the_request_trailers() {
    let svc = ServiceBuilder::new().layer(memory_layer()).service_fn(
        |req: Request<RequestBody<http_body_util::StreamBody<Frames>>>| async move {
            let collected = req.into_body().collect().await.unwrap();
            let trailer = collected
                .trailers()
                .and_then(|t| t.get("x-checksum"))
                .map_or("none".to_owned(), |v| v.to_str().unwrap().to_owned());
            Ok::<_, Infallible>(Response::new(format!(
                "{} {trailer}",
                String::from_utf8_lossy(&collected.to_bytes())
            )))
        },
    );
    let request = |checksum: &'static str| {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", checksum.parse().unwrap());
        let frames: Vec<Result<http_body::Frame<Bytes>, Infallible>> = vec![
            Ok(http_body::Frame::data(Bytes::from_static(b"{}"))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        Request::post("/pay")
            .header("idempotency-key", "trailers")
            .body(http_body_util::StreamBody::new(futures_util::stream::iter(
                frames,
            )))
            .unwrap()
    };
    let response = svc.clone().oneshot(request("abc")).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "{} abc");
    // The handler saw them, so they are part of the request: other trailers under the same
    // key are another request (422), not a replay of this one (before: replayed).
    let again = svc.clone().oneshot(request("abc")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let other = svc.oneshot(request("xyz")).await.unwrap();
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
}

type Frames =
    futures_util::stream::Iter<std::vec::IntoIter<Result<http_body::Frame<Bytes>, Infallible>>>;

/// A service whose `call` panics before returning its future (a synchronous `service_fn` that
/// did its work, or a `map_request` below the layer): the panic reaches the caller as without
/// the layer, and the outcome is recorded as unknown, so the retry gets 500 `outcome-unknown`
/// instead of a second run (before: the key was released as the panic unwound through the
/// response future, and the retry ran it again).
#[tokio::test]
async fn a_panic_in_the_services_call_leaves_an_unknown_outcome() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let svc = ServiceBuilder::new()
        .layer(memory_layer())
        .service(tower::service_fn(
            move |_req: Request<RequestBody<Full<Bytes>>>| {
                // The work, then a panic, before any future is returned.
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("the service panics in call");
                }
                std::future::ready(Ok::<_, Infallible>(Response::new(String::from("ran"))))
            },
        ));
    let request = || {
        let mut r = Request::post("/jobs/8")
            .header("idempotency-key", "job-8")
            .body(Full::new(Bytes::from_static(b"payload")))
            .unwrap();
        r.extensions_mut()
            .insert(RouteTemplate("/jobs/{id}".into()));
        r
    };
    let first = tokio::spawn(svc.clone().oneshot(request())).await;
    assert!(
        first.as_ref().is_err_and(|e| e.is_panic()),
        "the panic reaches the caller: {first:?}"
    );
    let retry = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran again");
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = retry.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("outcome-unknown"),
        "{body:?}"
    );
}
