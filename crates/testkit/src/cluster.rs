//! A real local Redis Cluster: masters with replicas, on loopback ports.

use std::time::{Duration, Instant};

use crate::{HarnessError, RedisServer, ServerOptions};

/// A Redis Cluster of `redis-server` processes, made with `redis-cli --cluster create`.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// let cluster = testkit::RedisCluster::start(3, 1).await;
/// let conn = cluster.connection().await;
/// # drop(conn);
/// # }
/// ```
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each; panics with instructions when it
    /// cannot (no `redis-server` or `redis-cli`).
    pub async fn start(masters: usize, replicas: usize) -> Self {
        match Self::try_start(masters, replicas).await {
            Ok(cluster) => cluster,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`start`](Self::start) but returns the error.
    pub async fn try_start(masters: usize, replicas: usize) -> Result<Self, HarnessError> {
        Self::try_start_with(masters, replicas, ServerOptions::default()).await
    }

    /// A cluster whose nodes also serve TLS with `ca`'s certificates (the cluster bus and
    /// replication too: `tls-cluster` and `tls-replication`); [`tls_urls`](Self::tls_urls)
    /// reach them.
    pub async fn start_tls(masters: usize, replicas: usize, ca: &crate::TestCa) -> Self {
        let options = ServerOptions::default()
            .tls(ca, false)
            .arg("--tls-cluster")
            .arg("yes")
            .arg("--tls-replication")
            .arg("yes");
        match Self::try_start_with(masters, replicas, options).await {
            Ok(cluster) => cluster,
            Err(e) => panic!("{e}"),
        }
    }

    /// The nodes' `rediss://` URLs (a cluster from [`start_tls`](Self::start_tls)).
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::tls_url).collect()
    }

    async fn try_start_with(
        masters: usize,
        replicas: usize,
        options: ServerOptions,
    ) -> Result<Self, HarnessError> {
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let node = RedisServer::try_start_owned(options.clone().cluster_node()).await?;
            if node.pid().is_none() {
                return Err(HarnessError(
                    "a cluster needs redis-server processes, not containers".into(),
                ));
            }
            nodes.push(node);
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = tokio::process::Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .await
            .map_err(|e| {
                HarnessError(format!("cannot run redis-cli (install redis-tools): {e}"))
            })?;
        if !output.status.success() {
            return Err(HarnessError(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_ok(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    async fn wait_ok(&self, limit: Duration) -> Result<(), HarnessError> {
        let deadline = Instant::now() + limit;
        'outer: while Instant::now() < deadline {
            for node in &self.nodes {
                let mut conn = node.connection().await;
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                if !info.contains("cluster_state:ok") || !info.contains("cluster_slots_ok:16384") {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue 'outer;
                }
            }
            // Every node answers with a full slot map: a cluster client can route.
            let client = self.client();
            if let Ok(mut conn) = client.get_async_connection().await {
                let pong: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(HarnessError(format!(
            "the cluster did not become ready within {limit:?}"
        )))
    }

    /// The nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// A cluster client.
    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::new(self.urls()).expect("valid node URLs")
    }

    /// A cluster connection (follows MOVED/ASK by itself).
    pub async fn connection(&self) -> redis::cluster_async::ClusterConnection {
        self.client()
            .get_async_connection()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to the cluster: {e}"))
    }
}
