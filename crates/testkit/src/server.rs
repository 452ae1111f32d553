//! Real Redis servers for tests: `REDIS_URL`, a local `redis-server` process, or a container.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

/// Why no server could be had. The message says how to fix it.
#[derive(Debug)]
pub struct HarnessError(pub String);

impl std::fmt::Display for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HarnessError {}

/// How to start an owned `redis-server`.
///
/// ```
/// let opts = testkit::ServerOptions::default().append_only(true);
/// assert!(opts.args().iter().any(|a| a == "always"));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    append_only: bool,
    cluster: bool,
    extra: Vec<String>,
    /// TLS arguments (certificates, client authentication), and the TLS port once chosen.
    tls: Option<(Vec<String>, Option<u16>)>,
}

impl ServerOptions {
    /// Persist every write to an append-only file with `fsync` on every write, so a restart (even
    /// after `SIGKILL`) keeps the data.
    #[must_use]
    pub fn append_only(mut self, on: bool) -> Self {
        self.append_only = on;
        self
    }

    /// A Redis Cluster node (on a port whose cluster bus port, +10000, is free too).
    #[must_use]
    pub fn cluster_node(mut self) -> Self {
        self.cluster = true;
        self
    }

    /// Extra `redis-server` arguments, e.g. `["--maxmemory", "10mb"]`.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra.push(arg.into());
        self
    }

    /// Serve TLS too, on a port of its own ([`RedisServer::tls_url`]), with `ca`'s server
    /// certificate; clients must present a certificate of `ca` when `mutual`. The plain port
    /// stays open for the harness's own administration.
    ///
    /// ```
    /// let ca = testkit::TestCa::new("doc").unwrap();
    /// let opts = testkit::ServerOptions::default().tls(&ca, true);
    /// assert!(opts.args().iter().any(|a| a == "--tls-auth-clients"));
    /// ```
    #[must_use]
    pub fn tls(mut self, ca: &crate::TestCa, mutual: bool) -> Self {
        self.tls = Some((ca.server_args(mutual), None));
        self
    }

    /// The persistence and extra arguments passed to `redis-server`.
    pub fn args(&self) -> Vec<String> {
        // DEBUG SLEEP lets tests slow the server down (loopback clients only).
        let mut args: Vec<String> = vec![
            "--save".into(),
            String::new(),
            "--enable-debug-command".into(),
            "local".into(),
            // Replicas sync at once instead of after the default 5 s gathering delay.
            "--repl-diskless-sync-delay".into(),
            "0".into(),
        ];
        if self.append_only {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        } else {
            args.extend(["--appendonly", "no"].map(String::from));
        }
        if self.cluster {
            args.extend(
                ["--cluster-enabled", "yes", "--cluster-node-timeout", "3000"].map(String::from),
            );
        }
        if let Some((tls, port)) = &self.tls {
            args.extend(tls.iter().cloned());
            if let Some(port) = port {
                args.extend(["--tls-port".to_owned(), port.to_string()]);
            }
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

enum Kind {
    /// `REDIS_URL`: shared, not ours to stop.
    External,
    /// A `redis-server` child process on a loopback port.
    Process(Box<Process>),
    /// A container, when a Docker engine answers.
    Container(Box<testcontainers::ContainerAsync<testcontainers::GenericImage>>),
}

struct Process {
    binary: PathBuf,
    dir: tempfile::TempDir,
    options: ServerOptions,
    child: Mutex<Option<Child>>,
}

/// A Redis server for one test.
///
/// [`RedisServer::start`] takes, in order: `REDIS_URL` if set; else a `redis-server` binary on
/// `PATH` (or `REDIS_SERVER_BIN`, e.g. a `valkey-server`), started on a free loopback port with
/// its own temp dir and no persistence, killed on drop (with `TESTKIT_ACL` set to ACL rules, its
/// [`url`](Self::url) logs in as a user with only those rules); else a `redis:7` container when a Docker engine answers. If none
/// works the test fails with a message that says how to fix it; it never passes silently.
///
/// Fault injection ([`stop`](Self::stop), [`pause`](Self::pause), [`restart`](Self::restart))
/// needs a server the test owns: use [`RedisServer::start_owned`].
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// let server = testkit::RedisServer::start_owned().await;
/// let client = server.client();
/// server.pause().await;
/// server.resume().await;
/// server.stop().await;
/// server.restart().await;
/// # drop(client);
/// # }
/// ```
pub struct RedisServer {
    kind: Kind,
    url: Mutex<String>,
    port: Mutex<u16>,
    /// The URL handed to the test when it logs in as an ACL user (`TESTKIT_ACL`).
    user_url: Mutex<Option<String>>,
}

/// The password of the ACL users the harness creates (loopback servers of one test only).
const USER_PASSWORD: &str = "testkit-password";

impl std::fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisServer")
            .field("url", &self.url())
            .field("pid", &self.pid())
            .finish()
    }
}

const FIX: &str = "install redis-server (Debian: `apt-get install -y redis-server`), set REDIS_URL to a \
     Redis you own, or run a Docker engine";

impl RedisServer {
    /// A server for a test that only talks to it. Panics (failing the test) with instructions if
    /// none can be had.
    pub async fn start() -> Self {
        match Self::try_start().await {
            Ok(server) => server,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`start`](Self::start) but returns the error.
    pub async fn try_start() -> Result<Self, HarnessError> {
        if let Ok(url) = std::env::var("REDIS_URL")
            && !url.is_empty()
        {
            let port = redis::Client::open(url.as_str())
                .ok()
                .and_then(|c| match c.get_connection_info().addr() {
                    redis::ConnectionAddr::Tcp(_, port) => Some(*port),
                    _ => None,
                })
                .unwrap_or(0);
            let server = RedisServer {
                kind: Kind::External,
                url: Mutex::new(url),
                port: Mutex::new(port),
                user_url: Mutex::new(None),
            };
            server.wait_ready(Duration::from_secs(10)).await?;
            return Ok(server);
        }
        let server = Self::try_start_owned(ServerOptions::default()).await?;
        if let Ok(rules) = std::env::var("TESTKIT_ACL")
            && !rules.trim().is_empty()
        {
            let url = server.acl_user("testkit", &rules).await;
            *server.user_url.lock().unwrap() = Some(url);
        }
        Ok(server)
    }

    /// A server this test owns (never `REDIS_URL`), for fault injection.
    pub async fn start_owned() -> Self {
        Self::start_with(ServerOptions::default()).await
    }

    /// An owned server with options.
    pub async fn start_with(options: ServerOptions) -> Self {
        match Self::try_start_owned(options).await {
            Ok(server) => server,
            Err(e) => panic!("{e}"),
        }
    }

    /// `n` independent owned servers.
    pub async fn start_many(n: usize) -> Vec<Self> {
        let mut servers = Vec::with_capacity(n);
        for _ in 0..n {
            servers.push(Self::start_owned().await);
        }
        servers
    }

    /// Like [`start_with`](Self::start_with) but returns the error.
    pub async fn try_start_owned(options: ServerOptions) -> Result<Self, HarnessError> {
        let process_error = match find_binary() {
            Some(binary) => match Self::spawn_process(binary, options).await {
                Ok(server) => return Ok(server),
                Err(e) => e.0,
            },
            None => "no redis-server binary on PATH (or REDIS_SERVER_BIN)".to_owned(),
        };
        let container_error = match start_container().await {
            Ok(server) => return Ok(server),
            Err(e) => e.0,
        };
        Err(HarnessError(format!(
            "no Redis server for the tests: {process_error}; and no container: {container_error}. \
             To fix: {FIX}"
        )))
    }

    async fn spawn_process(binary: PathBuf, options: ServerOptions) -> Result<Self, HarnessError> {
        let mut last = String::new();
        for _ in 0..5 {
            let dir = tempfile::tempdir()
                .map_err(|e| HarnessError(format!("cannot create a temp dir: {e}")))?;
            let port = if options.cluster {
                free_port_pair()?
            } else {
                free_port()?
            };
            let mut options = options.clone();
            if let Some((_, tls_port)) = &mut options.tls {
                *tls_port = Some(free_port()?);
            }
            let process = Process {
                binary: binary.clone(),
                dir,
                options,
                child: Mutex::new(None),
            };
            let server = RedisServer {
                url: Mutex::new(format!("redis://127.0.0.1:{port}/")),
                port: Mutex::new(port),
                user_url: Mutex::new(None),
                kind: Kind::Process(Box::new(process)),
            };
            match server.launch().await {
                Ok(()) => return Ok(server),
                Err(e) => last = e.0,
            }
        }
        Err(HarnessError(format!(
            "redis-server would not start: {last}"
        )))
    }

    fn process(&self, what: &str) -> &Process {
        match &self.kind {
            Kind::Process(p) => p,
            _ => panic!(
                "{what} needs a redis-server process owned by the test: use RedisServer::start_owned() \
                 (REDIS_URL servers and containers are not ours to {what})"
            ),
        }
    }

    async fn launch(&self) -> Result<(), HarnessError> {
        let process = self.process("launch");
        let port = self.port();
        let child = Command::new(&process.binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--protected-mode", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(process.dir.path())
            .arg("--logfile")
            .arg(process.dir.path().join("redis.log"))
            .args(process.options.args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| HarnessError(format!("cannot run {}: {e}", process.binary.display())))?;
        *process.child.lock().unwrap() = Some(child);
        if let Err(e) = self.wait_ready(Duration::from_secs(10)).await {
            self.kill();
            let log =
                std::fs::read_to_string(process.dir.path().join("redis.log")).unwrap_or_default();
            let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            return Err(HarnessError(format!("{e}; log: {tail}")));
        }
        Ok(())
    }

    async fn wait_ready(&self, limit: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + limit;
        let client = self.client();
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Kind::Process(p) = &self.kind
                && let Some(child) = p.child.lock().unwrap().as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(HarnessError(format!("redis-server exited: {status}")));
            }
            let attempt = tokio::time::timeout(Duration::from_secs(1), async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("PING").query_async::<String>(&mut conn).await
            })
            .await;
            match attempt {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "PING timed out".into(),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(HarnessError(format!(
            "Redis at {} did not answer within {limit:?}: {last}",
            self.url()
        )))
    }

    /// The URL, e.g. `redis://127.0.0.1:40123/`. For a server from [`start`](Self::start)
    /// while `TESTKIT_ACL` holds ACL rules, the URL of a user with only those rules (the
    /// harness's own [`client`](Self::client) and [`connection`](Self::connection) keep the
    /// default user's rights).
    pub fn url(&self) -> String {
        if let Some(url) = self.user_url.lock().unwrap().as_ref() {
            return url.clone();
        }
        self.admin_url()
    }

    fn admin_url(&self) -> String {
        self.url.lock().unwrap().clone()
    }

    /// The `rediss://` URL of a server started with [`ServerOptions::tls`].
    ///
    /// # Panics
    /// If the server does not serve TLS.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.tls_port())
    }

    /// The TLS port of a server started with [`ServerOptions::tls`].
    ///
    /// # Panics
    /// If the server does not serve TLS.
    pub fn tls_port(&self) -> u16 {
        match &self.process("serve TLS").options.tls {
            Some((_, Some(port))) => *port,
            _ => panic!("the server was not started with ServerOptions::tls"),
        }
    }

    /// Creates (or redefines) the ACL user `name` with `rules` (the part of an `ACL SETUSER` line
    /// after the user name, e.g. `~app:* +get`), switched on with a password, and returns the
    /// URL that logs in as it. The default user keeps every right, for the harness.
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() {
    /// let server = testkit::RedisServer::start_owned().await;
    /// let url = server.acl_user("reader", "~app:* -@all +get").await;
    /// assert!(url.starts_with("redis://reader:"));
    /// # }
    /// ```
    pub async fn acl_user(&self, name: &str, rules: &str) -> String {
        let mut conn = self.connection().await;
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg(name).arg("reset").arg("on");
        cmd.arg(format!(">{USER_PASSWORD}"));
        for rule in rules.split_whitespace() {
            cmd.arg(rule);
        }
        let () = cmd
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("ACL SETUSER {name} {rules}: {e}"));
        format!("redis://{name}:{USER_PASSWORD}@127.0.0.1:{}/", self.port())
    }

    /// Clients subscribed to `channel` (`PUBSUB NUMSUB`).
    pub async fn subscribers(&self, channel: &str) -> u64 {
        let (_, n): (String, u64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query_async(&mut self.connection().await)
            .await
            .unwrap_or_else(|e| panic!("PUBSUB NUMSUB {channel}: {e}"));
        n
    }

    /// Waits, looking every 5 ms for up to `limit`, until a client subscribed to `channel`;
    /// returns whether one did (a waiter that subscribed waits for announcements there).
    pub async fn subscribed(&self, channel: &str, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if self.subscribers(channel).await > 0 {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// How many times the server has run `command` (`INFO commandstats`, lower-case name, e.g.
    /// `"fcall"` or `"evalsha"`), 0 if never.
    pub async fn command_calls(&self, command: &str) -> u64 {
        self.command_stat(command, "calls").await
    }

    /// How many times the server refused `command` before running it (an ACL refusal, out of
    /// memory: `rejected_calls` in `INFO commandstats`), 0 if never.
    pub async fn command_rejections(&self, command: &str) -> u64 {
        self.command_stat(command, "rejected_calls").await
    }

    /// Every command the server has run, with how many times (`INFO commandstats`: lower-case
    /// names, subcommands as `client|setinfo`; the commands scripts run count too), read on
    /// `conn`: each reading adds its `INFO` to the next (a reading does not count itself).
    pub async fn command_counts(
        conn: &mut redis::aio::MultiplexedConnection,
    ) -> std::collections::BTreeMap<String, u64> {
        command_field(conn, "calls").await
    }

    async fn command_stat(&self, command: &str, field: &str) -> u64 {
        command_field(&mut self.connection().await, field)
            .await
            .get(command)
            .copied()
            .unwrap_or(0)
    }

    /// How many script calls the server has run, either way the lock sends them (`FCALL` of a
    /// function, `EVALSHA` of a script).
    pub async fn script_calls(&self) -> u64 {
        self.command_calls("fcall").await + self.command_calls("evalsha").await
    }

    /// The server's version as it reports it (`INFO server`): `("redis", "7.0.15")` or
    /// `("valkey", "9.1.2")`.
    pub async fn version(&self) -> (String, String) {
        let mut conn = self.connection().await;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("INFO server: {e}"));
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_owned())
        };
        match field("valkey_version:") {
            Some(v) => ("valkey".into(), v),
            None => ("redis".into(), field("redis_version:").unwrap_or_default()),
        }
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        *self.port.lock().unwrap()
    }

    /// A client for this server.
    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.admin_url()).expect("the harness builds valid URLs")
    }

    /// A multiplexed connection without a response timeout, for test administration such as
    /// `DEBUG SLEEP` (panics if the server does not answer).
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        self.client()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.url()))
    }

    /// The pid of the server process, if the test owns one.
    pub fn pid(&self) -> Option<u32> {
        match &self.kind {
            Kind::Process(p) => p.child.lock().unwrap().as_ref().map(Child::id),
            _ => None,
        }
    }

    /// Whether the test owns the server (and may stop, pause or restart it).
    pub fn is_owned(&self) -> bool {
        !matches!(self.kind, Kind::External)
    }

    /// The server's data directory (owned processes).
    pub fn dir(&self) -> &Path {
        self.process("inspect").dir.path()
    }

    fn signal(&self, signal: Signal) {
        let pid = self.pid().expect("the server is not running");
        let pid = Pid::from_raw(pid as i32).expect("a child pid is positive");
        kill_process(pid, signal).expect("signal the redis-server we started");
    }

    /// Freezes the server with SIGSTOP: connections stay open, nothing is answered, and keys do
    /// not expire until [`resume`](Self::resume).
    pub async fn pause(&self) {
        match &self.kind {
            Kind::Container(c) => container_op(c.pause().await),
            _ => self.signal(Signal::STOP),
        }
    }

    /// Resumes a paused server with SIGCONT.
    pub async fn resume(&self) {
        match &self.kind {
            Kind::Container(c) => container_op(c.unpause().await),
            _ => self.signal(Signal::CONT),
        }
    }

    /// Kills the server with SIGKILL (a crash: whatever was not persisted is lost) and reaps it.
    pub async fn stop(&self) {
        match &self.kind {
            Kind::Container(c) => container_op(c.stop().await),
            _ => self.kill(),
        }
    }

    fn kill(&self) {
        let process = self.process("stop");
        if let Some(mut child) = process.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data directory (after [`stop`](Self::stop),
    /// or kills it first). With [`ServerOptions::append_only`] the data survives.
    pub async fn restart(&self) {
        match &self.kind {
            Kind::Container(c) => {
                container_op(c.start().await);
                let port = c
                    .get_host_port_ipv4(6379)
                    .await
                    .expect("the restarted container exposes 6379");
                *self.port.lock().unwrap() = port;
                *self.url.lock().unwrap() = format!("redis://127.0.0.1:{port}/");
                self.wait_ready(Duration::from_secs(30))
                    .await
                    .expect("container restarted");
            }
            _ => {
                self.kill();
                if let Err(e) = self.launch().await {
                    panic!("restart on port {} failed: {e}", self.port());
                }
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Kind::Process(p) = &self.kind
            && let Some(mut child) = p.child.lock().unwrap().take()
        {
            // SIGKILL also ends a SIGSTOPped process.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn container_op<T>(result: testcontainers::core::error::Result<T>) {
    if let Err(e) = result {
        panic!("container operation failed: {e}");
    }
}

fn find_binary() -> Option<PathBuf> {
    if let Ok(bin) = std::env::var("REDIS_SERVER_BIN") {
        return Some(PathBuf::from(bin));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["redis-server", "valkey-server"] {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

/// A loopback port `p` such that `p` and `p + 10000` (a cluster bus port) were free a moment ago.
pub fn free_port_pair() -> Result<u16, HarnessError> {
    let bindable = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    let seed = crate::now_ns();
    for i in 0..500u64 {
        let port = 20_000 + ((seed / 1000 + i * 7919) % 35_000) as u16;
        if bindable(port) && bindable(port + 10_000) {
            return Ok(port);
        }
    }
    Err(HarnessError(
        "no free pair of loopback ports for a cluster node".into(),
    ))
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16, HarnessError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| HarnessError(format!("no free loopback port: {e}")))
}

async fn start_container() -> Result<RedisServer, HarnessError> {
    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::AsyncRunner;

    let image = testcontainers::GenericImage::new("redis", "7")
        .with_exposed_port(6379.tcp())
        .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"));
    let started = tokio::time::timeout(Duration::from_secs(120), image.start()).await;
    let container = match started {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(HarnessError(format!("Docker engine unavailable ({e})"))),
        Err(_) => {
            return Err(HarnessError(
                "Docker did not start a container within 120 s".into(),
            ));
        }
    };
    let port = container
        .get_host_port_ipv4(6379)
        .await
        .map_err(|e| HarnessError(format!("container port: {e}")))?;
    let server = RedisServer {
        kind: Kind::Container(Box::new(container)),
        url: Mutex::new(format!("redis://127.0.0.1:{port}/")),
        port: Mutex::new(port),
        user_url: Mutex::new(None),
    };
    server.wait_ready(Duration::from_secs(30)).await?;
    Ok(server)
}

/// `field` of every command in `INFO commandstats`, read on `conn`.
async fn command_field(
    conn: &mut redis::aio::MultiplexedConnection,
    field: &str,
) -> std::collections::BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("INFO commandstats: {e}"));
    info.lines()
        .filter_map(|line| {
            let (command, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let value = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))?;
            Some((command.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}
