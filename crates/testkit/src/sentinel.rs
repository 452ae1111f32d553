//! A Sentinel-managed group on loopback: one master, replicas, and three sentinels.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{HarnessError, RedisServer, ServerOptions, free_port};

/// The service name the sentinels monitor.
pub const SERVICE: &str = "mymaster";

struct SentinelProcess {
    child: Child,
    port: u16,
    tls_port: Option<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A master with replicas watched by three sentinels (quorum 2).
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// let group = testkit::RedisSentinel::start(2).await;
/// let before = group.master_port().await;
/// group.failover().await;
/// assert_ne!(group.master_port().await, before);
/// # }
/// ```
pub struct RedisSentinel {
    servers: Vec<RedisServer>,
    sentinels: Vec<SentinelProcess>,
    proxy: Option<crate::FaultProxy>,
}

impl std::fmt::Debug for RedisSentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSentinel")
            .field("servers", &self.servers)
            .field("sentinels", &self.sentinel_urls())
            .finish()
    }
}

fn find_redis_server() -> Result<String, HarnessError> {
    if let Ok(bin) = std::env::var("REDIS_SERVER_BIN") {
        return Ok(bin);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
        .ok_or_else(|| {
            HarnessError("no redis-server on PATH: apt-get install -y redis-server".into())
        })
}

impl RedisSentinel {
    /// Starts a master, `replicas` replicas and three sentinels; panics with instructions when
    /// it cannot.
    pub async fn start(replicas: usize) -> Self {
        match Self::try_start(replicas).await {
            Ok(group) => group,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`start`](Self::start) but returns the error.
    pub async fn try_start(replicas: usize) -> Result<Self, HarnessError> {
        Self::try_start_inner(replicas, false, None).await
    }

    /// A group in which everything also speaks TLS with `ca`'s certificates: the servers (and
    /// their replication), and the sentinels, which monitor the master at its TLS port and so
    /// name TLS addresses to clients. [`tls_sentinel_urls`](Self::tls_sentinel_urls) reach
    /// the sentinels over TLS.
    pub async fn start_tls(replicas: usize, ca: &crate::TestCa) -> Self {
        match Self::try_start_inner(replicas, false, Some(ca)).await {
            Ok(group) => group,
            Err(e) => panic!("{e}"),
        }
    }

    /// The sentinels' `rediss://` URLs (a group from [`start_tls`](Self::start_tls)).
    pub fn tls_sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .filter_map(|s| s.tls_port)
            .map(|port| format!("rediss://127.0.0.1:{port}/"))
            .collect()
    }

    /// A group whose sentinels monitor (and name to clients) a [`FaultProxy`](crate::FaultProxy)
    /// in front of the master, so that a test can hang the master as clients see it. Their own
    /// links pass through it too: they flag the master down only after 30 s (not 2 s), so that
    /// a fault a test injects there is the clients' alone.
    pub async fn start_behind_proxy(replicas: usize) -> Self {
        match Self::try_start_inner(replicas, true, None).await {
            Ok(group) => group,
            Err(e) => panic!("{e}"),
        }
    }

    /// The proxy in front of the master, for a group started behind one.
    pub fn proxy(&self) -> Option<&crate::FaultProxy> {
        self.proxy.as_ref()
    }

    async fn try_start_inner(
        replicas: usize,
        proxied: bool,
        tls: Option<&crate::TestCa>,
    ) -> Result<Self, HarnessError> {
        let binary = find_redis_server()?;
        let server_options = match tls {
            Some(ca) => ServerOptions::default()
                .tls(ca, false)
                .arg("--tls-replication")
                .arg("yes"),
            None => ServerOptions::default(),
        };
        let master = RedisServer::try_start_owned(server_options.clone()).await?;
        // Replication and the sentinels use the TLS port when there is one.
        let master_port = match tls {
            Some(_) => master.tls_port(),
            None => master.port(),
        };
        let proxy = if proxied {
            Some(crate::FaultProxy::to(format!("127.0.0.1:{master_port}")).await?)
        } else {
            None
        };
        let monitored = proxy.as_ref().map_or(master_port, crate::FaultProxy::port);
        // Behind a proxy the sentinels' own links go through it too: faults injected there
        // (a hang) must not make them flag the master down (and their clients skip it) within
        // a test, which is about the client's view. Otherwise 2 s, for failovers in tests.
        let down_after_ms = if proxied { 30_000 } else { 2_000 };
        let mut servers = vec![master];
        for _ in 0..replicas {
            let options = server_options
                .clone()
                .arg("--replicaof")
                .arg("127.0.0.1")
                .arg(master_port.to_string());
            servers.push(RedisServer::try_start_owned(options).await?);
        }
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().map_err(|e| HarnessError(e.to_string()))?;
            let port = free_port()?;
            let tls_port = match tls {
                Some(_) => Some(free_port()?),
                None => None,
            };
            let tls_conf = match (tls, tls_port) {
                (Some(ca), Some(tls_port)) => format!(
                    "tls-port {tls_port}\ntls-replication yes\ntls-auth-clients no\n\
                     tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n",
                    ca.server_cert_path().display(),
                    ca.server_key_path().display(),
                    ca.ca_path().display()
                ),
                _ => String::new(),
            };
            let conf = dir.path().join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n{tls_conf}\
                     sentinel monitor {SERVICE} 127.0.0.1 {monitored} 2\n\
                     sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n\
                     sentinel failover-timeout {SERVICE} 10000\n\
                     sentinel parallel-syncs {SERVICE} 1\n",
                    dir.path().display()
                ),
            )
            .map_err(|e| HarnessError(e.to_string()))?;
            let child = Command::new(&binary)
                .arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| HarnessError(format!("cannot start a sentinel: {e}")))?;
            sentinels.push(SentinelProcess {
                child,
                port,
                tls_port,
                _dir: dir,
            });
        }
        let group = RedisSentinel {
            servers,
            sentinels,
            proxy,
        };
        group.wait_ready(Duration::from_secs(30)).await?;
        Ok(group)
    }

    async fn wait_ready(&self, limit: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let mut master = self.servers[0].connection().await;
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut master)
                .await
                .unwrap_or_default();
            let online = info.matches("state=online").count();
            let mut ready = online + 1 >= self.servers.len();
            for url in self.sentinel_urls() {
                let replicas = async {
                    let client = redis::Client::open(url.as_str())?;
                    let mut conn = client.get_multiplexed_async_connection().await?;
                    let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                        .arg("REPLICAS")
                        .arg(SERVICE)
                        .query_async(&mut conn)
                        .await?;
                    let others: Vec<redis::Value> = redis::cmd("SENTINEL")
                        .arg("SENTINELS")
                        .arg(SERVICE)
                        .query_async(&mut conn)
                        .await?;
                    redis::RedisResult::Ok((replicas.len(), others.len()))
                };
                match replicas.await {
                    Ok((r, s)) if r + 1 >= self.servers.len() && s >= 2 => {}
                    _ => ready = false,
                }
            }
            if ready {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(HarnessError(format!(
            "the sentinels did not see the whole group within {limit:?}"
        )))
    }

    /// The sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("redis://127.0.0.1:{}/", s.port))
            .collect()
    }

    /// The master and the replicas, as started (roles change with failovers).
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// The current master's port, as the first sentinel reports it.
    pub async fn master_port(&self) -> u16 {
        self.master_port_from(&self.sentinel_urls()[0]).await
    }

    async fn master_port_from(&self, sentinel: &str) -> u16 {
        let client = redis::Client::open(sentinel).expect("valid URL");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("sentinel answers");
        let (_, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(SERVICE)
            .query_async(&mut conn)
            .await
            .expect("the sentinel knows the master");
        port
    }

    async fn role(port: u16) -> Option<Vec<u8>> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut c).await.ok()?;
        match role.first() {
            Some(redis::Value::BulkString(b)) => Some(b.clone()),
            _ => None,
        }
    }

    /// Forces a failover (`SENTINEL FAILOVER`) and waits until it is over: every sentinel names
    /// the promoted replica, which answers as master with every other server (the old master
    /// included) as a replica in sync.
    pub async fn failover(&self) {
        let before = self.master_port().await;
        let client = redis::Client::open(self.sentinel_urls()[0].as_str()).expect("valid URL");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("sentinel answers");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let result: redis::RedisResult<String> = redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(SERVICE)
                .query_async(&mut conn)
                .await;
            if result.is_ok() {
                break;
            }
            // NOGOODSLAVE while replicas are still syncing: try again.
            assert!(
                Instant::now() < deadline,
                "SENTINEL FAILOVER kept failing: {result:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        loop {
            let now = self.master_port().await;
            if now != before {
                let master = redis::Client::open(format!("redis://127.0.0.1:{now}/")).expect("URL");
                if let Ok(mut c) = master.get_multiplexed_async_connection().await {
                    let role: redis::RedisResult<Vec<redis::Value>> =
                        redis::cmd("ROLE").query_async(&mut c).await;
                    let info: String = redis::cmd("INFO")
                        .arg("replication")
                        .query_async(&mut c)
                        .await
                        .unwrap_or_default();
                    let is_master = matches!(
                        role.as_deref(),
                        Ok([redis::Value::BulkString(b), ..]) if b == b"master"
                    );
                    let mut agreed = true;
                    for url in self.sentinel_urls() {
                        agreed &= self.master_port_from(&url).await == now;
                    }
                    let demoted = Self::role(before).await.as_deref() != Some(b"master");
                    let in_sync = info.matches("state=online").count() + 1 >= self.servers.len();
                    if is_master && in_sync && agreed && demoted {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no new master after SENTINEL FAILOVER"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
