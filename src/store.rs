//! Where outcomes and leases live: Redis (shared by every instance) or memory (one process).
//!
//! Both are [`distlock`] run-once locks ([`distlock::Once`]): the lease, owner token, fencing
//! token, watchdog renewal, loss signal, waiting by notification and backoff all come from the
//! lock crate. Per request there is one store name, `idem:{<sha256>}`, with its state in
//! `idem:{<sha256>}:state` (fencing counter, in-flight fingerprint, stored record): one hash slot,
//! so the same code runs on Redis Cluster.

use std::sync::Arc;
use std::time::Duration;

use distlock::{ConfigError, LockClient, MemoryLimits};

use crate::cache::{Cache, ReplayCache, ReplayCacheStats};
use crate::live::Executions;

/// The key prefix of the layer's store entries.
pub const DEFAULT_PREFIX: &str = "idem";

/// The store behind an [`IdempotencyLayer`](crate::IdempotencyLayer). Cheap to clone.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ConfigError> {
/// use tower_idempotency::Store;
/// let local = Store::memory();
/// let shared = Store::redis("redis://127.0.0.1:6379/")?; // connects lazily, reconnects by itself
/// assert!(shared.describe().starts_with("redis"));
/// # let _ = local;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Store {
    client: LockClient,
    /// The protected executions of every layer on this store (and its clones) still running.
    executions: Arc<Executions>,
    /// The Redis a replay cache hears purges from (a store made by [`Store::redis`]).
    redis: Option<redis::Client>,
    /// The local replay cache, if there is one.
    cache: Option<Arc<Cache>>,
}

impl Store {
    /// The in-memory store: for one process, examples and tests.
    ///
    /// Default bounds ([`MemoryLimits::default`]): 100,000 entries and 64 MiB of keys and
    /// records. A request in flight takes two entries, a stored outcome one; with small
    /// responses the entry bound comes first (100,000 stored outcomes of a small JSON response
    /// took about 90 MB of process memory, indexes and allocator included: the peak RSS of
    /// `cargo bench --bench layer -- --profile full 1`), with 1 KiB responses the byte bound
    /// does (about 50,000 outcomes).
    ///
    /// When a new key finds the store full, expired outcomes go first, then the oldest stored
    /// outcomes (a retry of an evicted key runs its handler again: size the bounds for your
    /// request rate times [`retention`](crate::IdempotencyLayerBuilder::retention)), each at
    /// O(log n) cost, with a warning once a minute. Requests in flight are never evicted: when
    /// every entry is in flight a new key is answered 503 `store-full`
    /// ([`Rejection::StoreFull`](crate::Rejection::StoreFull)) without running the handler.
    ///
    /// ```
    /// assert!(tower_idempotency::Store::memory().describe().starts_with("memory"));
    /// ```
    pub fn memory() -> Self {
        Self::memory_with(MemoryLimits::default())
    }

    /// The in-memory store with other bounds.
    ///
    /// ```
    /// let limits = distlock::MemoryLimits::new(1_000, 1 << 20).unwrap();
    /// let store = tower_idempotency::Store::memory_with(limits);
    /// ```
    pub fn memory_with(limits: MemoryLimits) -> Self {
        Self::from_client(
            LockClient::builder()
                .prefix(DEFAULT_PREFIX)
                .expect("the default prefix is valid")
                .memory(limits),
        )
    }

    /// Redis at `url`, shared by every instance of the service. Must be called inside a Tokio
    /// runtime; the connection is made on first use.
    ///
    /// # Errors
    /// If `url` is not a Redis URL.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// assert!(tower_idempotency::Store::redis("not a url").is_err());
    /// # }
    /// ```
    pub fn redis(url: &str) -> Result<Self, ConfigError> {
        let mut store =
            Self::from_client(LockClient::builder().prefix(DEFAULT_PREFIX)?.connect(url)?);
        store.redis = redis::Client::open(url).ok();
        Ok(store)
    }

    /// This Redis store with a local replay cache: the responses this instance stored, kept
    /// in its memory, so that a retry that lands on it is replayed without a round trip to
    /// Redis (about half the retries behind a round-robin balancer of two instances, a third
    /// with three; docs/BENCHMARKS.md has the figures). Streamed records are not cached.
    ///
    /// A purge ([`IdempotencyLayer::purge`](crate::IdempotencyLayer::purge), the
    /// `idempotency purge` command) reaches every instance's cache through Redis pub/sub, on
    /// the store's purge channel (`idem:purged`; the ACL rules of
    /// [`distlock::acl_rules`] allow it): the instance that purges forgets the record at once,
    /// the others as soon as the announcement arrives (a retry in between is replayed, as if
    /// it had come just before the purge). The cache serves only while its subscription is
    /// proven by a heartbeat it hears back ([`ReplayCache::heartbeat`]); otherwise it is empty
    /// and the store is asked. A record Redis loses without a purge (evicted, flushed, lost in
    /// a failover) may be replayed here for at most [`ReplayCache::max_age`].
    ///
    /// # Errors
    /// If the store was not made by [`Store::redis`] (its purges could not be heard), or
    /// there is no Tokio runtime to listen on.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{ReplayCache, Store};
    /// let store = Store::redis("redis://127.0.0.1:6379/")?.replay_cache(ReplayCache::default())?;
    /// assert!(Store::memory().replay_cache(ReplayCache::default()).is_err());
    /// # let _ = store;
    /// # Ok(()) }
    /// ```
    pub fn replay_cache(mut self, limits: ReplayCache) -> Result<Self, ConfigError> {
        let Some(client) = self.redis.clone() else {
            return Err(ConfigError::Invalid {
                field: "replay_cache",
                reason: format!(
                    "{} cannot announce purges to a local cache: a replay cache needs Store::redis",
                    self.describe()
                ),
            });
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::Invalid {
                field: "replay_cache",
                reason: "the cache listens for purges on a Tokio task: build it inside a runtime"
                    .into(),
            });
        }
        self.cache = Some(Cache::start(limits, client, self.client.purge_channel()));
        Ok(self)
    }

    /// What the replay cache has done, if the store has one.
    ///
    /// ```
    /// assert!(tower_idempotency::Store::memory().replay_cache_stats().is_none());
    /// ```
    pub fn replay_cache_stats(&self) -> Option<ReplayCacheStats> {
        self.cache.as_ref().map(|cache| cache.stats())
    }

    /// The replay cache, if any.
    pub(crate) fn cache(&self) -> Option<&Cache> {
        self.cache.as_deref()
    }

    /// (Feature `postgres`) A PostgreSQL database at `url`
    /// (`postgres://user:password@host:port/database`), shared by every instance, with its
    /// leases and outcomes in `table` (created by [`prepare`](Self::prepare) if missing), through
    /// a pool of up to 16 connections. A streamed response is stored as it passes, and a
    /// duplicate joins it live (as on Redis; a duplicate in another process polls for the
    /// parts). With [`same_transaction`](crate::IdempotencyLayerBuilder::same_transaction) a
    /// handler's writes commit with its outcome, and its response is stored whole with them.
    /// Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// If `url` is not a PostgreSQL URL, or `table` not a table name.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = tower_idempotency::Store::postgres("postgres://app@127.0.0.1/app", "idempotency")?;
    /// store.prepare().await?; // the tables and their functions
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn postgres(url: &str, table: &str) -> Result<Self, ConfigError> {
        Ok(Self::from_client(
            LockClient::builder()
                .prefix(DEFAULT_PREFIX)?
                .connect_postgres(url, table)?,
        ))
    }

    /// A store on a lock client you built (a cluster or Sentinel connection, another prefix).
    ///
    /// ```
    /// let client = distlock::LockClient::builder().prefix("myapp-idem").unwrap().memory(Default::default());
    /// let store = tower_idempotency::Store::from_client(client);
    /// ```
    pub fn from_client(client: LockClient) -> Self {
        Store {
            client,
            executions: Arc::default(),
            redis: None,
            cache: None,
        }
    }

    /// This store on `client` (the same client with another configuration), still counting
    /// the executions of the layers on this one.
    pub(crate) fn with_client(&self, client: LockClient) -> Self {
        Store {
            client,
            executions: self.executions.clone(),
            redis: self.redis.clone(),
            cache: self.cache.clone(),
        }
    }

    /// The protected executions running on this store.
    pub(crate) fn executions(&self) -> &Executions {
        &self.executions
    }

    /// Waits, at most `within`, until every protected execution of the layers on this store
    /// (built on it or on a clone of it) has ended, its outcome stored, and the lock client's
    /// background work after them is done (see [`LockClient::settle`]). Returns whether it all
    /// finished.
    ///
    /// Call it once the server has stopped, before the process exits: a graceful shutdown
    /// waits for connections, and a handler whose client left runs on in a task of its own,
    /// which the runtime going away would drop mid-handler (its work perhaps done, its outcome
    /// not stored, its key held until the lease ends; the retry would run it again).
    ///
    /// ```no_run
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use axum::{Router, routing::post};
    /// use tower_idempotency::{IdempotencyLayer, Store};
    ///
    /// async fn pay() -> &'static str { "paid" }
    ///
    /// let store = Store::memory();
    /// let layer = IdempotencyLayer::builder(store.clone()).global_keys().build()?;
    /// let app: Router = Router::new().route("/pay", post(pay)).layer(layer);
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(async { let _ = tokio::signal::ctrl_c().await; })
    ///     .await?;
    /// if !store.drain(Duration::from_secs(30)).await {
    ///     eprintln!("protected requests still running at exit");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn drain(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        let ended = tokio::time::timeout_at(deadline, self.executions.none_live()).await;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        ended.is_ok() && self.client.settle(left).await
    }

    /// The lock client underneath.
    ///
    /// ```
    /// assert_eq!(tower_idempotency::Store::memory().client().prefix(), "idem");
    /// ```
    pub fn client(&self) -> &LockClient {
        &self.client
    }

    /// A description for logs: `memory (...)` or `redis (127.0.0.1:6379)`.
    ///
    /// ```
    /// println!("idempotency store: {}", tower_idempotency::Store::memory().describe());
    /// ```
    pub fn describe(&self) -> String {
        self.client.store()
    }

    /// Connects and loads the scripts now (optional; everything also happens on first use).
    ///
    /// # Errors
    /// If the store cannot be reached.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// tower_idempotency::Store::memory().prepare().await?;
    /// # Ok(()) }
    /// ```
    pub async fn prepare(&self) -> Result<(), distlock::LockError> {
        self.client.prepare().await
    }
}
