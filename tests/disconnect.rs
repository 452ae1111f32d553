//! The client goes away after the handler started, in each way a real server sees it: the TCP
//! connection closed mid-handler (through `axum::serve`), tower-http's `TimeoutLayer` outside
//! the layer, an HTTP/2 stream reset, and a hang-up while the outcome is being stored (Redis
//! slowed with `DEBUG SLEEP`). In every case the handler runs to its end exactly once, its
//! outcome is stored, and the client's retry gets the replay.
//!
//! The file depends on nothing but the layer's public API, so that it runs unchanged against
//! earlier versions (where each of these cases executed the handler twice).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use testkit::RedisServer;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, Store};

const DEADLINE: Duration = Duration::from_secs(20);

/// Counts executions; a closed gate holds them until opened.
#[derive(Clone)]
struct Payments {
    started: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
    work: Duration,
}

impl Payments {
    fn gated() -> Self {
        Payments {
            started: Arc::default(),
            finished: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
            work: Duration::ZERO,
        }
    }

    fn slow(work: Duration) -> Self {
        let p = Self::gated();
        p.gate.add_permits(1000);
        Payments { work, ..p }
    }

    fn open(&self) {
        self.gate.add_permits(1000);
    }

    async fn wait_started(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while self.started.load(Ordering::SeqCst) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the handler did not start"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// `POST /pay`: "commits" a payment (the counter) and answers 201 with its number.
async fn pay(State(p): State<Payments>) -> (StatusCode, String) {
    let n = p.started.fetch_add(1, Ordering::SeqCst) + 1;
    p.gate.acquire().await.unwrap().forget();
    tokio::time::sleep(p.work).await;
    p.finished.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("payment {n}"))
}

fn app(store: &Store, payments: &Payments) -> Router {
    Router::new()
        .route("/pay", post(pay))
        .layer(
            IdempotencyLayer::builder(store.clone())
                .global_keys()
                .build()
                .unwrap(),
        )
        .with_state(payments.clone())
}

fn pay_request(key: &str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

async fn serve(router: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Retries `key` until the answer is neither 409 (the first execution may still be running or
/// storing its outcome) nor 503 (the store is reconnecting), within the deadline; returns
/// status, replayed flag and body.
async fn retry(app: &Router, key: &str) -> (StatusCode, bool, String) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let response = app.clone().oneshot(pay_request(key)).await.unwrap();
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        if status != StatusCode::CONFLICT && status != StatusCode::SERVICE_UNAVAILABLE {
            return (
                status,
                replayed,
                String::from_utf8_lossy(&body).into_owned(),
            );
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the key stayed in flight or the store unavailable: {status}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The retry is a replay of the one execution there was.
async fn assert_replayed_once(app: &Router, payments: &Payments, key: &str) {
    let (status, replayed, body) = retry(app, key).await;
    assert_eq!(
        payments.started.load(Ordering::SeqCst),
        1,
        "the handler ran once for the request and its retry (got {status} {body:?})"
    );
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed, "the retry is a replay");
    assert_eq!(body, "payment 1");
    assert_eq!(payments.finished.load(Ordering::SeqCst), 1);
}

async fn memory() -> (Store, Option<RedisServer>) {
    (Store::memory(), None)
}

async fn redis() -> (Store, Option<RedisServer>) {
    let server = RedisServer::start_owned().await;
    let client = distlock::LockClient::builder()
        .prefix(&testkit::unique_prefix("disconnect"))
        .unwrap()
        .connect(&server.url())
        .unwrap();
    client.prepare().await.expect("redis answers");
    (Store::from_client(client), Some(server))
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (store, _server) = super::memory().await;
                    super::$name(store).await;
                }
            )*
        }
        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (store, _server) = super::redis().await;
                    super::$name(store).await;
                }
            )*
        }
    };
}

both!(
    the_connection_closes_mid_handler,
    a_timeout_layer_outside_gives_up,
    an_http2_stream_is_reset,
);

/// A client writes its request on a real socket and closes the connection while the handler
/// runs (as a client with a timeout does), then retries.
async fn the_connection_closes_mid_handler(store: Store) {
    use tokio::io::AsyncWriteExt;
    let payments = Payments::gated();
    let app = app(&store, &payments);
    let addr = serve(app.clone()).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: hang-up\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    payments.wait_started(1).await;
    drop(socket);
    // Give the server time to notice the closed connection before the handler may finish.
    tokio::time::sleep(Duration::from_millis(100)).await;
    payments.open();
    assert_replayed_once(&app, &payments, "hang-up").await;
}

/// tower-http's `TimeoutLayer` outside the layer answers 408 and drops the inner future.
async fn a_timeout_layer_outside_gives_up(store: Store) {
    let payments = Payments::slow(Duration::from_millis(400));
    let app = app(&store, &payments).layer(tower_http::timeout::TimeoutLayer::with_status_code(
        StatusCode::REQUEST_TIMEOUT,
        Duration::from_millis(100),
    ));
    let first = app.clone().oneshot(pay_request("timed-out")).await.unwrap();
    assert_eq!(first.status(), StatusCode::REQUEST_TIMEOUT);
    assert_replayed_once(&app, &payments, "timed-out").await;
}

/// An HTTP/2 client resets its stream while the handler runs; the connection stays up.
async fn an_http2_stream_is_reset(store: Store) {
    let payments = Payments::gated();
    let app = app(&store, &payments);
    let addr = serve(app.clone()).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Body>();
    let request = |key: &str| {
        Request::post(format!("http://{addr}/pay"))
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    };
    let abandoned = tokio::spawn({
        let client = client.clone();
        let request = request("reset");
        async move { client.request(request).await }
    });
    payments.wait_started(1).await;
    abandoned.abort(); // drops the response future: the client sends RST_STREAM
    let _ = abandoned.await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    payments.open();
    // The retry goes over the same HTTP/2 connection.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let (status, replayed, body) = loop {
        let response = client.request(request("reset")).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        if status != StatusCode::CONFLICT {
            break (status, replayed, body);
        }
        assert!(tokio::time::Instant::now() < deadline, "still in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(payments.started.load(Ordering::SeqCst), 1, "one execution");
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed);
    assert_eq!(&body[..], b"payment 1");
}

/// The client hangs up while the outcome is being stored: Redis is asleep (`DEBUG SLEEP`) when
/// the handler returns, so the completion waits on it, longer than the command timeout (the
/// completion is retried within the lease) and the client leaves meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_leaves_while_the_outcome_is_stored() {
    use tokio::io::AsyncWriteExt;
    let server = RedisServer::start_owned().await;
    let config = distlock::LockConfig::builder()
        .lease(Duration::from_secs(6))
        .op_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let client = distlock::LockClient::builder()
        .config(config)
        .prefix(&testkit::unique_prefix("leaves-while-stored"))
        .unwrap()
        .connect(&server.url())
        .unwrap();
    client.prepare().await.unwrap();
    let store = Store::from_client(client);
    let payments = Payments::gated();
    let app = app(&store, &payments);
    let addr = serve(app.clone()).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: storing\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    payments.wait_started(1).await;

    // Put Redis to sleep, and prove it sleeps before the handler returns.
    let admin = redis::Client::open(server.url()).unwrap();
    let no_timeout = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut sleeper = admin
        .get_multiplexed_async_connection_with_config(&no_timeout)
        .await
        .unwrap();
    let mut probe = admin
        .get_multiplexed_async_connection_with_config(&no_timeout)
        .await
        .unwrap();
    let asleep = tokio::spawn(async move {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(1.5)
            .query_async::<()>(&mut sleeper)
            .await
    });
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let ping = redis::cmd("PING");
        if tokio::time::timeout(
            Duration::from_millis(100),
            ping.query_async::<String>(&mut probe),
        )
        .await
        .is_err()
        {
            break; // no answer: Redis sleeps
        }
        assert!(tokio::time::Instant::now() < deadline, "Redis never slept");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    payments.open();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while payments.finished.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the handler hangs");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The handler returned; its completion waits on Redis, past the command timeout.
    tokio::time::sleep(Duration::from_millis(400)).await;
    drop(socket);
    asleep.await.unwrap().unwrap();
    assert_replayed_once(&app, &payments, "storing").await;
}

/// The client hangs up while the completion is being retried: the layer's connections to
/// Redis were killed and Redis refuses new ones (`maxclients`) when the handler returns, so
/// the completion fails and retries within the lease; the client leaves meanwhile; then Redis
/// takes connections again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_leaves_while_the_completion_is_retried() {
    use tokio::io::AsyncWriteExt;
    let server = RedisServer::start_owned().await;
    let config = distlock::LockConfig::builder()
        .lease(Duration::from_secs(6))
        .op_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let client = distlock::LockClient::builder()
        .config(config)
        .prefix(&testkit::unique_prefix("leaves-while-retried"))
        .unwrap()
        .connect(&server.url())
        .unwrap();
    client.prepare().await.unwrap();
    let store = Store::from_client(client);
    let payments = Payments::gated();
    let app = app(&store, &payments);
    let addr = serve(app.clone()).await;
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(
            b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: retried\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    payments.wait_started(1).await;

    let mut admin = server.connection().await;
    let set_maxclients = |n: u32| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxclients").arg(n);
        cmd
    };
    set_maxclients(1)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    for kind in ["normal", "pubsub"] {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .arg("SKIPME")
            .arg("yes")
            .query_async::<i64>(&mut admin)
            .await
            .unwrap();
    }
    payments.open();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while payments.finished.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the handler hangs");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The completion fails and retries (no connection can be made); the client leaves.
    tokio::time::sleep(Duration::from_millis(400)).await;
    drop(socket);
    tokio::time::sleep(Duration::from_millis(400)).await;
    set_maxclients(10_000)
        .query_async::<()>(&mut admin)
        .await
        .unwrap();
    assert_replayed_once(&app, &payments, "retried").await;
}

/// The server stops (a graceful shutdown, as for a deploy) while a handler whose client left
/// runs on in a task of its own: `IdempotencyLayer::drain` waits for it, so that its outcome is
/// stored before the runtime goes away, and the retry, on a new instance, gets the replay.
/// Without it the runtime's end drops the handler mid-run (the work perhaps done, nothing
/// stored, the key held until its lease ends, and the retry then runs it again).
#[test]
fn drain_lets_what_runs_on_after_its_client_left_finish() {
    use std::future::IntoFuture;
    use tokio::io::AsyncWriteExt;
    for on_redis in [false, true] {
        let outer = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let server = on_redis.then(|| outer.block_on(RedisServer::start_owned()));
        // Each runtime its own connection to the store (or the same in-memory store).
        let memory = Store::memory();
        let store = |rt: &tokio::runtime::Runtime| match &server {
            Some(server) => rt.block_on(async { Store::redis(&server.url()).unwrap() }),
            None => memory.clone(),
        };
        let serving = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let payments = Payments::gated();
        let layer = IdempotencyLayer::builder(store(&serving))
            .global_keys()
            .build()
            .unwrap();
        let router = Router::new()
            .route("/pay", post(pay))
            .layer(layer.clone())
            .with_state(payments.clone());
        let drained = serving.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let served = tokio::spawn(
                axum::serve(listener, router)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .into_future(),
            );
            let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
            socket
                .write_all(
                    b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: deploy\r\ncontent-length: 0\r\n\r\n",
                )
                .await
                .unwrap();
            payments.wait_started(1).await;
            drop(socket);
            let _ = stop.send(());
            tokio::time::timeout(DEADLINE, served)
                .await
                .expect("the server stops once its connection is gone")
                .unwrap()
                .unwrap();
            assert_eq!(payments.finished.load(Ordering::SeqCst), 0);
            // The handler's work ends a moment after the server stopped.
            let p = payments.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                p.open();
            });
            layer.drain(DEADLINE).await
        });
        assert!(drained, "redis {on_redis}: drained within the deadline");
        drop(serving);
        assert_eq!(
            payments.finished.load(Ordering::SeqCst),
            1,
            "redis {on_redis}: the handler ran to its end"
        );
        // A new instance on the same store.
        let retry_store = store(&outer);
        outer.block_on(async {
            let app = app(&retry_store, &payments);
            assert_replayed_once(&app, &payments, "deploy").await;
        });
    }
}
