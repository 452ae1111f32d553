//! Memory: the signup example's peak RSS under 10,000 completed and 10,000 in-flight keys on
//! the in-memory store, and what the same example stores in Redis per request: the lease while
//! a signup runs and the record after it (`MEMORY USAGE` of every key it wrote, and the growth
//! of `used_memory` over all the signups).
//!
//! ```sh
//! cargo bench --bench memory
//! ```
//!
//! Under `cargo test` it runs with 200 keys, to prove the harness works.

mod common;

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Mode, row};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use redis::aio::MultiplexedConnection;
use testkit::RedisServer;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Requests retried after a connection reset.
static RETRIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Resident set size now and at its peak, from /proc/<pid>/status, in KiB.
fn rss(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn example_binary() -> std::path::PathBuf {
    // Build the example with the same profile as this harness.
    let profile = if cfg!(debug_assertions) {
        "dev"
    } else {
        "release"
    };
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "--example",
            "signup",
            "--profile",
            profile,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build --example signup");
    let dir = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join(dir).join("examples").join("signup")
}

/// The signup example (handler work: 300 ms) on a free port, on Redis when `redis` is given,
/// else on its in-memory store; without the layer when `layer` is false. Returns once it has
/// printed its banner.
fn spawn_example(redis: Option<&str>, layer: bool) -> (Child, SocketAddr) {
    let port = testkit::free_port().unwrap();
    let mut cmd = Command::new(example_binary());
    cmd.env("BIND", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .env("IDEMPOTENCY", if layer { "on" } else { "off" })
        // Else the example prints a notice before its banner (memory) or refuses (Redis).
        .env("IDEMPOTENCY_SECRET", "memory bench secret, 32 bytes or so")
        .stdout(Stdio::piped());
    match redis {
        Some(url) => cmd.env("REDIS_URL", url),
        None => cmd.env_remove("REDIS_URL"),
    };
    let mut child = cmd.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    out.read_line(&mut banner).unwrap();
    assert!(
        banner.contains("signup service"),
        "unexpected banner: {banner}"
    );
    // Keep draining its stdout: a closed pipe would fail its next print.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (child, format!("127.0.0.1:{port}").parse().unwrap())
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// One signup. A connection the OS resets (the listen backlog overflows when thousands of
/// connections open at once) is retried, up to three times: signups are idempotent, so a
/// retry whose first attempt did reach the handler gets 409 (still running) or the replay.
async fn signup(client: &HttpClient, addr: SocketAddr, phone: u64) -> u16 {
    let mut tries = 0;
    loop {
        let req = http::Request::post(format!("http://{addr}/signup"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"phone":"+1{phone:010}","name":"Ada Lovelace"}}"#
            ))))
            .unwrap();
        match client.request(req).await {
            Ok(res) => {
                let status = res.status().as_u16();
                res.into_body().collect().await.unwrap();
                return status;
            }
            Err(_) if tries < 3 => {
                tries += 1;
                RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("signup {phone}: {e:?}"),
        }
    }
}

/// Signs up `phones`, 64 requests at a time, each expecting 201 Created.
async fn signups(client: &HttpClient, addr: SocketAddr, phones: std::ops::Range<u64>) {
    let mut next = phones.start;
    while next < phones.end {
        let batch: Vec<_> = (next..(next + 64).min(phones.end))
            .map(|p| {
                let c = client.clone();
                tokio::spawn(async move { signup(&c, addr, p).await })
            })
            .collect();
        for b in batch {
            assert_eq!(b.await.unwrap(), 201);
        }
        next += 64;
    }
}

/// Every key in the database with its `MEMORY USAGE` (a key that expires or is deleted between
/// the listing and its measure is left out).
async fn usage(conn: &mut MultiplexedConnection) -> Vec<(String, i64)> {
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(conn).await.unwrap();
    let mut out = Vec::new();
    for key in keys {
        let bytes: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .arg("SAMPLES")
            .arg(0)
            .query_async(conn)
            .await
            .unwrap();
        if let Some(bytes) = bytes {
            out.push((key, bytes));
        }
    }
    out.sort();
    out
}

async fn used_memory(conn: &mut MultiplexedConnection) -> i64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

/// What a key holds, from its name: the suffix after the hash tag, or `lock` for the lease.
fn role(key: &str) -> &str {
    match key.rsplit_once(':') {
        Some((_, suffix)) if !suffix.starts_with('{') => suffix,
        _ => "lock",
    }
}

fn describe(keys: &[(String, i64)]) -> String {
    let total: i64 = keys.iter().map(|(_, b)| b).sum();
    let parts: Vec<String> = keys
        .iter()
        .map(|(k, b)| format!("`{}` {b}", role(k)))
        .collect();
    format!(
        "{total} bytes in {} keys ({})",
        keys.len(),
        parts.join(", ")
    )
}

/// RSS of the signup example on the in-memory store (KiB): at start, after `keys` completed
/// signups, and at the peak while `keys` more are in flight.
async fn rss_under_load(client: &HttpClient, keys: u64, layer: bool) -> (u64, u64, u64) {
    let (child, addr) = spawn_example(None, layer);
    let pid = child.id();
    let (start, _) = rss(pid);
    signups(client, addr, 0..keys).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (completed, _) = rss(pid);

    // In-flight: every handler takes 300 ms; opened in bursts of 500.
    let started = Instant::now();
    let mut inflight = Vec::new();
    for p in keys..2 * keys {
        let c = client.clone();
        inflight.push(tokio::spawn(async move { signup(&c, addr, p).await }));
        if p % 500 == 499 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let mut peak = 0;
    while started.elapsed() < Duration::from_millis(250) {
        peak = peak.max(rss(pid).0);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for f in inflight {
        let status = f.await.unwrap();
        assert!(status == 201 || status == 409, "in-flight signup: {status}");
    }
    let peak = rss(pid).1.max(peak);
    stop(child);
    (start, completed, peak)
}

fn main() {
    let mode = Mode::from_args();
    let keys: u64 = if mode.full { 10_000 } else { 200 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let client: HttpClient = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build_http();

        // The example on the in-memory store, without and with the layer.
        let bare = rss_under_load(&client, keys, false).await;
        let ours = rss_under_load(&client, keys, true).await;

        // The same example on Redis: one signup in flight, then completed, then many.
        let server = RedisServer::start_owned().await;
        let mut conn = server.connection().await;
        let (child, addr) = spawn_example(Some(&server.url()), true);
        let one = {
            let c = client.clone();
            tokio::spawn(async move { signup(&c, addr, 0).await })
        };
        tokio::time::sleep(Duration::from_millis(150)).await;
        let in_flight = usage(&mut conn).await;
        assert_eq!(one.await.unwrap(), 201);
        // The response goes out once its completion is sent, so the lease may still be there
        // for a round trip: wait (up to 5 s) until it is gone.
        let settled = Instant::now() + Duration::from_secs(5);
        let completed = loop {
            let keys = usage(&mut conn).await;
            if !keys.iter().any(|(k, _)| role(k) == "lock") {
                break keys;
            }
            assert!(
                Instant::now() < settled,
                "the lease is still held 5 s after the response: {keys:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let before = used_memory(&mut conn).await;
        signups(&client, addr, 1..keys + 1).await;
        let after = used_memory(&mut conn).await;
        stop(child);
        assert!(
            !in_flight.is_empty() && !completed.is_empty(),
            "the example wrote no keys to Redis"
        );

        let per_key = |kib: u64| kib as i64 * 1024 / keys as i64;
        let grow = |a: u64, b: u64| per_key(b) - per_key(a);
        println!("\n## Memory ({keys} keys; {})\n", common::machine());
        row(&[
            "figure",
            "without the layer",
            "with the layer (in-memory store)",
            "the layer's share",
        ]);
        row(&["---", "---", "---", "---"]);
        row(&[
            "signup example RSS at start",
            &format!("{} KiB", bare.0),
            &format!("{} KiB", ours.0),
            &format!("{} KiB", ours.0 as i64 - bare.0 as i64),
        ]);
        row(&[
            &format!("after {keys} completed signups"),
            &format!("{} KiB (+{} B per signup)", bare.1, grow(bare.0, bare.1)),
            &format!("{} KiB (+{} B per signup)", ours.1, grow(ours.0, ours.1)),
            &format!(
                "{} B per completed key",
                grow(ours.0, ours.1) - grow(bare.0, bare.1)
            ),
        ]);
        row(&[
            &format!("peak with {keys} more in flight"),
            &format!("{} KiB (+{} B per request)", bare.2, grow(bare.1, bare.2)),
            &format!("{} KiB (+{} B per request)", ours.2, grow(ours.1, ours.2)),
            &format!(
                "{} B per in-flight key",
                grow(ours.1, ours.2) - grow(bare.1, bare.2)
            ),
        ]);
        println!("\n| Redis | bytes |\n| --- | --- |");
        row(&["one signup in flight", &describe(&in_flight)]);
        row(&["one completed signup", &describe(&completed)]);
        row(&[
            &format!("used_memory growth over {keys} more signups"),
            &format!("{} bytes per signup", (after - before) / keys as i64),
        ]);
        println!(
            "\n{} requests were retried after a connection reset.",
            RETRIES.load(std::sync::atomic::Ordering::Relaxed)
        );
    });
}
