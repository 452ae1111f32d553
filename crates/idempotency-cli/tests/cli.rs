//! The `idempotency` binary against a real Redis, with a layer of the service's making records
//! there: inspect, purge, and list what has run for too long; with the secret from the
//! environment.

use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use serde_json::Value;
use testkit::RedisServer;
use tokio::sync::watch;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, Store};

const BIN: &str = env!("CARGO_BIN_EXE_idempotency");
const SECRET: &str = "the service's secret, 32 bytes..";

/// A service on `server` under `prefix`: `POST /pay` keyed by the header and scoped to the
/// `x-customer` header, held while `open` is false.
async fn service(server: &RedisServer, prefix: &str, open: Arc<watch::Sender<bool>>) -> Router {
    let client = distlock::LockClient::builder()
        .prefix(prefix)
        .unwrap()
        .connect(&server.url())
        .unwrap();
    client.prepare().await.unwrap();
    let layer = IdempotencyLayer::builder(Store::from_client(client))
        .secret(SECRET)
        .unwrap()
        .principal(|p: &http::request::Parts| {
            Some(p.headers.get("x-customer")?.to_str().ok()?.to_owned())
        })
        .build()
        .unwrap();
    Router::new().route(
        "/pay",
        post(move || {
            let mut open = open.subscribe();
            async move {
                open.wait_for(|open| *open).await.unwrap();
                (StatusCode::CREATED, "paid")
            }
        })
        .route_layer(layer),
    )
}

fn pay(key: &str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("x-customer", "alice")
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap()
}

async fn cli(server: &RedisServer, prefix: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(BIN)
        .args(["--redis", &server.url(), "--prefix", prefix])
        .args(args)
        .env("IDEMPOTENCY_SECRET", SECRET)
        .env_remove("IDEMPOTENCY_PREVIOUS_SECRETS")
        .env_remove("REDIS_URL")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap()
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

const KEY: [&str; 9] = [
    "--route",
    "/pay",
    "--principal",
    "alice",
    "--key",
    "k-1",
    "--json",
    "--method",
    "POST",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_purge_and_list_through_the_binary() {
    let server = RedisServer::start().await;
    let prefix = testkit::unique_prefix("idem-cli");
    let open = Arc::new(watch::Sender::new(false));
    let app = service(&server, &prefix, open.clone()).await;

    let absent = json(&cli(&server, &prefix, &[&["inspect"][..], &KEY].concat()).await);
    assert_eq!(absent["in_flight"], Value::Array(vec![]));
    assert_eq!(absent["completed"], Value::Array(vec![]));

    // In flight: listed, inspected, and left alone by a purge.
    let running = tokio::spawn(app.clone().oneshot(pay("k-1")));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let listed = loop {
        let listed = json(
            &cli(
                &server,
                &prefix,
                &["in-flight", "--older-than", "0s", "--json"],
            )
            .await,
        );
        if listed.as_array().is_some_and(|l| !l.is_empty()) {
            break listed;
        }
        assert!(tokio::time::Instant::now() < deadline, "never in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert!(listed[0]["since_unix_ms"].as_u64().is_some());
    let old = json(
        &cli(
            &server,
            &prefix,
            &["in-flight", "--older-than", "1h", "--json"],
        )
        .await,
    );
    assert_eq!(old, Value::Array(vec![]));
    let inspected = json(&cli(&server, &prefix, &[&["inspect"][..], &KEY].concat()).await);
    assert_eq!(inspected["in_flight"][0]["name"], listed[0]["name"]);
    let purge = json(&cli(&server, &prefix, &[&["purge"][..], &KEY].concat()).await);
    assert_eq!(purge["deleted"], 0);
    assert_eq!(purge["in_flight"].as_array().unwrap().len(), 1);
    open.send_replace(true);
    let first = tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the request ends")
        .unwrap()
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);

    // Completed: its status, body, when.
    let done = json(&cli(&server, &prefix, &[&["inspect"][..], &KEY].concat()).await);
    let completed = &done["completed"][0];
    assert_eq!(completed["status"], 201);
    assert_eq!(completed["body_len"], 4);
    assert_eq!(completed["outcome_unknown"], false);
    assert!(completed["expires_at_unix_ms"].as_u64() > completed["stored_at_unix_ms"].as_u64());
    // Human-readable too.
    let text = cli(
        &server,
        &prefix,
        &[
            "inspect",
            "--route",
            "/pay",
            "--principal",
            "alice",
            "--key",
            "k-1",
        ],
    )
    .await;
    assert!(String::from_utf8_lossy(&text.stdout).contains("status 201"));

    // Purged: the next request runs the handler again.
    let purge = json(&cli(&server, &prefix, &[&["purge"][..], &KEY].concat()).await);
    assert_eq!(purge["deleted"], 1);
    let again = app.clone().oneshot(pay("k-1")).await.unwrap();
    assert!(!again.headers().contains_key("idempotent-replayed"));

    // Another principal's key, or a wrong secret, finds nothing.
    let bob = json(
        &cli(
            &server,
            &prefix,
            &[
                "inspect",
                "--route",
                "/pay",
                "--principal",
                "bob",
                "--key",
                "k-1",
                "--json",
            ],
        )
        .await,
    );
    assert_eq!(bob["completed"], Value::Array(vec![]));
    let wrong = tokio::process::Command::new(BIN)
        .args(["--redis", &server.url(), "--prefix", &prefix])
        .args([&["inspect"][..], &KEY].concat())
        .env("IDEMPOTENCY_SECRET", "another secret, 32 bytes long...")
        .output()
        .await
        .unwrap();
    assert_eq!(json(&wrong)["completed"], Value::Array(vec![]));
}

#[tokio::test]
async fn bad_input_is_a_clear_error() {
    let server = RedisServer::start().await;
    // No secret.
    let out = tokio::process::Command::new(BIN)
        .args(["--redis", &server.url(), "in-flight", "--older-than", "1s"])
        .env_remove("IDEMPOTENCY_SECRET")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret"));
    // A bad duration, a secret too short, an unreachable Redis.
    let out = cli(&server, "p", &["in-flight", "--older-than", "soon"]).await;
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a duration"),
        "{out:?}"
    );
    let out = tokio::process::Command::new(BIN)
        .args(["--redis", &server.url(), "in-flight", "--older-than", "1s"])
        .env("IDEMPOTENCY_SECRET", "short")
        .output()
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("too short"));
    let port = testkit::free_port().unwrap();
    let out = tokio::process::Command::new(BIN)
        .args([
            "--redis",
            &format!("redis://127.0.0.1:{port}/"),
            "in-flight",
            "--older-than",
            "1s",
        ])
        .env("IDEMPOTENCY_SECRET", SECRET)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("idempotency: "),
        "{out:?}"
    );
}

/// On a Redis Cluster: the records of many keys spread over every master, all found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_every_master_is_scanned() {
    let cluster = testkit::RedisCluster::start(3, 0).await;
    let prefix = testkit::unique_prefix("idem-cli-cluster");
    let client = distlock::LockClient::builder()
        .prefix(&prefix)
        .unwrap()
        .redis(cluster.connection().await)
        .unwrap();
    client.prepare().await.unwrap();
    let store = Store::from_client(client);
    let open = Arc::new(watch::Sender::new(false));
    let layer = IdempotencyLayer::builder(store)
        .secret(SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let app = Router::new().route(
        "/pay",
        post({
            let open = open.clone();
            move || {
                let mut open = open.subscribe();
                async move {
                    open.wait_for(|open| *open).await.unwrap();
                    (StatusCode::CREATED, "paid")
                }
            }
        })
        .route_layer(layer),
    );
    let running: Vec<_> = (0..12)
        .map(|i| tokio::spawn(app.clone().oneshot(pay(&format!("k-{i}")))))
        .collect();
    let urls = cluster.urls();
    let run = |args: Vec<String>| {
        let urls = urls.clone();
        let prefix = prefix.clone();
        async move {
            let mut command = tokio::process::Command::new(BIN);
            for url in &urls {
                command.args(["--cluster", url]);
            }
            command
                .args(["--prefix", &prefix])
                .args(args)
                .env("IDEMPOTENCY_SECRET", SECRET)
                .env_remove("REDIS_URL")
                .output()
                .await
                .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let listed = json(
            &run(vec![
                "in-flight".into(),
                "--older-than".into(),
                "0s".into(),
                "--json".into(),
            ])
            .await,
        );
        if listed.as_array().unwrap().len() == 12 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "in flight: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    open.send_replace(true);
    for r in running {
        assert_eq!(r.await.unwrap().unwrap().status(), StatusCode::CREATED);
    }
    let done = json(
        &run(["inspect", "--route", "/pay", "--key", "k-5", "--json"]
            .map(String::from)
            .to_vec())
        .await,
    );
    assert_eq!(done["completed"][0]["status"], 201, "{done}");
}
