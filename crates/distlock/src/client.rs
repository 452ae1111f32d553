//! The client: a store (Redis or memory), a default configuration and a key prefix.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::backend::memory::MemoryBackend;
use crate::backend::redis::{Conn, RedisBackend, Source, spawn_notifiers};
use crate::backend::redlock::RedlockBackend;
use crate::backend::waiters::Waiters;
use crate::watchdog::Watchdog;
use crate::{ConfigError, Lock, LockConfig, LockName, MemoryLimits, Once, OwnerId};

/// Entry point: makes [`Lock`]s and [`Once`]s on one store. Cheap to clone (one `Arc`); share one
/// per process and store, so that every lock shares its connection and its one pub/sub connection.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // In one process, or in tests:
/// let local = distlock::LockClient::memory();
///
/// // On Redis (lazy: the service starts even while Redis is down, and reconnects by itself):
/// let shared = distlock::LockClient::builder()
///     .prefix("myapp")?
///     .connect("redis://127.0.0.1:6379/")?;
/// assert_eq!(shared.prefix(), "myapp");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockClient {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    backend: Arc<dyn Backend>,
    config: Arc<LockConfig>,
    prefix: String,
    watchdog: Watchdog,
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("store", &self.inner.backend.describe())
            .field("prefix", &self.inner.prefix)
            .field("config", &self.inner.config)
            .finish()
    }
}

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "distlock";

/// The lock [`LockClient::prepare`] releases (never holds) to check the store's rights.
const PROBE_NAME: &str = "distlock-prepare";

impl LockClient {
    /// A builder with the default configuration and prefix `distlock`.
    ///
    /// ```
    /// let client = distlock::LockClient::builder().memory(Default::default());
    /// assert_eq!(client.prefix(), "distlock");
    /// ```
    pub fn builder() -> LockClientBuilder {
        LockClientBuilder {
            config: LockConfig::default(),
            prefix: DEFAULT_PREFIX.to_owned(),
            notifications: Vec::new(),
            node_timeout: None,
            replicas: None,
            tls: None,
        }
    }

    /// An in-memory client with default configuration and limits: the same API and semantics as
    /// on Redis, within one process.
    ///
    /// ```
    /// let client = distlock::LockClient::memory();
    /// assert!(client.store().starts_with("memory"));
    /// ```
    pub fn memory() -> Self {
        LockClient::builder().memory(MemoryLimits::default())
    }

    /// A client on the same store (same connections, same locks) whose locks default to
    /// `config`.
    ///
    /// # Errors
    /// If the store cannot honour `config`: a [replica check](LockClientBuilder::replicas) or
    /// a Redlock [node timeout](LockClientBuilder::node_timeout) that does not fit in its
    /// command timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// let client = distlock::LockClient::memory();
    /// let short = distlock::LockConfig::builder().lease(Duration::from_secs(1)).build().unwrap();
    /// assert_eq!(client.with_config(short)?.config().lease(), Duration::from_secs(1));
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn with_config(&self, config: LockConfig) -> Result<LockClient, ConfigError> {
        self.inner.backend.check_config(&config)?;
        Ok(LockClient {
            inner: Arc::new(ClientInner {
                backend: self.inner.backend.clone(),
                config: Arc::new(config),
                prefix: self.inner.prefix.clone(),
                watchdog: self.inner.watchdog.clone(),
            }),
        })
    }

    /// An exclusive lock on `name`.
    ///
    /// # Errors
    /// If the name is empty, too long, or contains braces or control characters.
    ///
    /// ```
    /// let client = distlock::LockClient::memory();
    /// assert!(client.lock("nightly-report").is_ok());
    /// assert!(client.lock("").is_err());
    /// ```
    pub fn lock(&self, name: &str) -> Result<Lock, ConfigError> {
        Ok(Lock::new(self.clone(), self.name(name)?, None))
    }

    /// A reentrant lock on `name` for `owner`: acquisitions by the same owner nest (each guard
    /// is one hold; the lock is free when every hold is released), others wait. Same fencing,
    /// watchdog and loss signal as an exclusive lock; the fence is that of the first hold.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let client = distlock::LockClient::memory();
    /// let me = distlock::OwnerId::random();
    /// let outer = client.reentrant("ledger", &me)?.try_acquire().await?;
    /// let inner = client.reentrant("ledger", &me)?.try_acquire().await?;
    /// assert_eq!(inner.fence(), outer.fence());
    /// let other = distlock::OwnerId::random();
    /// assert!(client.reentrant("ledger", &other)?.try_acquire().await.is_err());
    /// # Ok(()) }
    /// ```
    pub fn reentrant(&self, name: &str, owner: &OwnerId) -> Result<Lock, ConfigError> {
        Ok(Lock::new(
            self.clone(),
            self.name(name)?,
            Some(owner.clone()),
        ))
    }

    /// The names under this client's prefix that match the glob `pattern` (`*` any run of
    /// characters, `?` one; on Redis also `[...]` and `\\`) and have a run-once state (a
    /// record, a holder, a fencing counter), sorted: for operators, with [`Once::inspect`]
    /// (leases in flight for too long, say). On Redis a `SCAN` (a page at a time, never
    /// `KEYS`), on every master of a Cluster.
    ///
    /// # Errors
    /// [`LockError::Unavailable`](crate::LockError::Unavailable) if the store cannot be
    /// reached; [`LockError::Unsupported`](crate::LockError::Unsupported) on Redlock.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use distlock::Begin;
    /// let client = distlock::LockClient::memory();
    /// for name in ["order.1", "order.2", "invoice.1"] {
    ///     let Begin::Acquired(guard) = client.once(name)?.begin("").await? else { unreachable!() };
    ///     guard.complete(b"done").await?;
    /// }
    /// assert_eq!(client.scan("order.*").await?, ["order.1", "order.2"]);
    /// # Ok(()) }
    /// ```
    pub async fn scan(&self, pattern: &str) -> Result<Vec<String>, crate::LockError> {
        let timeout = self.config().op_timeout().saturating_mul(10);
        crate::backend::timed(timeout, self.backend().scan(self.prefix(), pattern))
            .await
            .unwrap_or_else(|_| Err(crate::LockError::timeout(pattern, false, timeout)))
    }

    /// A run-once lock on `name` (see [`Once`]).
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("evt_1").unwrap();
    /// assert_eq!(once.name().as_str(), "evt_1");
    /// ```
    pub fn once(&self, name: &str) -> Result<Once, ConfigError> {
        Ok(Once::new(self.clone(), self.name(name)?))
    }

    fn name(&self, name: &str) -> Result<LockName, ConfigError> {
        LockName::new(&self.inner.prefix, name)
    }

    /// The default configuration of this client's locks.
    ///
    /// ```
    /// assert_eq!(distlock::LockClient::memory().config(), &distlock::LockConfig::default());
    /// ```
    pub fn config(&self) -> &LockConfig {
        &self.inner.config
    }

    pub(crate) fn shared_config(&self) -> Arc<LockConfig> {
        self.inner.config.clone()
    }

    /// The key prefix.
    ///
    /// ```
    /// assert_eq!(distlock::LockClient::memory().prefix(), "distlock");
    /// ```
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The pub/sub channel on which a Redis store announces every record a purge deleted
    /// ([`Once::purge`](crate::Once::purge)), with the purged name
    /// ([`LockName::as_str`]) as the message: for caches of completed records kept outside the
    /// store. `prefix:purged`.
    ///
    /// ```
    /// assert_eq!(distlock::LockClient::memory().purge_channel(), "distlock:purged");
    /// ```
    pub fn purge_channel(&self) -> String {
        crate::name::purge_channel(&self.inner.prefix)
    }

    /// A short description of the store, for logs.
    ///
    /// ```
    /// println!("locks in {}", distlock::LockClient::memory().store());
    /// ```
    pub fn store(&self) -> String {
        self.inner.backend.describe()
    }

    /// Whether the store can stream run-once records ([`OnceGuard::append`](crate::OnceGuard::append),
    /// [`Once::parts`](crate::Once::parts), [`Once::follow`](crate::Once::follow)): one Redis
    /// (standalone, Sentinel, Cluster), Postgres and memory can; Redlock cannot (a reader would
    /// need a quorum read of every part), and its records are written whole.
    ///
    /// ```
    /// assert!(distlock::LockClient::memory().supports_streaming());
    /// ```
    pub fn supports_streaming(&self) -> bool {
        self.inner.backend.supports_streaming()
    }

    /// Whether an operation this client sends reaches the store ahead of every operation it
    /// sends after it: memory, Redis (one connection per server, commands in order) and
    /// Redlock do; Postgres does not (each operation takes a connection of the pool, and a
    /// later one may overtake one still on its way). There, a write must be answered before a
    /// read that must see it is sent.
    ///
    /// ```
    /// assert!(distlock::LockClient::memory().sends_in_order());
    /// ```
    pub fn sends_in_order(&self) -> bool {
        self.inner.backend.sends_in_order()
    }

    /// The largest run-once record this client's locks store: a record written whole
    /// ([`OnceGuard::complete`](crate::OnceGuard::complete)), or one part of a streamed one.
    /// Larger ones are refused with [`LockError::TooLarge`](crate::LockError::TooLarge)
    /// before anything is sent (the guard still holds the lock after
    /// [`try_complete`](crate::OnceGuard::try_complete)). Check a limit of your own against it
    /// when you build (the `tower-idempotency` layer's record limit, for example).
    ///
    /// [`MAX_PART_LEN`](crate::once::MAX_PART_LEN) (512 MiB, the largest Redis string) on
    /// every store but Redlock. On Redlock a record travels to every master within a timeout:
    /// each master is given the [node timeout](LockClientBuilder::node_timeout) plus the
    /// record's size at an assumed slowest link of 10 MiB/s, and a completion (or a `begin`
    /// that reads the record back: one node timeout to find it, then its transfer from one
    /// master) must fit in the command timeout ([`LockConfig::op_timeout`]): the limit is
    /// what 10 MiB/s carries in the command timeout less two node timeouts (about 18 MiB with
    /// the defaults). Raise the command timeout for larger records.
    ///
    /// ```
    /// assert_eq!(
    ///     distlock::LockClient::memory().max_record_len(),
    ///     distlock::once::MAX_PART_LEN
    /// );
    /// ```
    pub fn max_record_len(&self) -> usize {
        self.inner.backend.max_record_len(&self.inner.config)
    }

    /// Whether a run-once guard can bind a transaction its work's writes commit in, with its
    /// record ([`OnceGuard::transaction`](crate::OnceGuard::transaction)): the Postgres store.
    ///
    /// ```
    /// assert!(!distlock::LockClient::memory().supports_transactions());
    /// ```
    pub fn supports_transactions(&self) -> bool {
        self.inner.backend.supports_transactions()
    }

    /// The bounds of the in-memory store ([`LockClientBuilder::memory`]); `None` for Redis.
    ///
    /// ```
    /// let limits = distlock::MemoryLimits::new(1_000, 1 << 20).unwrap();
    /// let client = distlock::LockClient::builder().memory(limits);
    /// assert_eq!(client.memory_limits(), Some(limits));
    /// ```
    pub fn memory_limits(&self) -> Option<MemoryLimits> {
        self.inner.backend.memory_limits()
    }

    /// Connects to the store, loads the lock scripts and runs one of them now, so that the first
    /// acquisition does not pay for it and a misconfigured store shows up at startup. Optional:
    /// everything also happens on first use.
    ///
    /// The check runs the release script on a lock nobody holds (`FCALL`, or `EVALSHA` where
    /// functions are not available, on this client's keys: it reads one key and writes
    /// nothing), so it also proves that the Redis user may run scripts on keys under the prefix.
    /// Before that, a read-only script checks, without running any of them, that the user may
    /// run every command the lock sends on those keys, from its scripts or not (Redis 7 and
    /// Valkey: `redis.acl_check_cmd`; nothing reaches the ACL log), and names the first one
    /// refused. On Redlock every master is checked, and the client is ready when a quorum is.
    ///
    /// It also reads the eviction policy where the user may (`CONFIG GET`, checked first: a
    /// user or a managed service that may not is not asked, and nothing is said): a Redis
    /// whose `maxmemory-policy` is not `noeviction` may evict a held lock or a stored record
    /// when it fills up (and under `allkeys-*` a fencing counter), which is logged as a
    /// warning (`tracing::warn!`), not refused: see
    /// [`prepare_with_warnings`](Self::prepare_with_warnings) for why, and to get the warnings
    /// instead.
    ///
    /// # Errors
    /// * [`LockError::Config`](crate::LockError::Config) when the store refuses what the lock
    ///   needs, naming it: a command the ACL user may not run or the server does not offer
    ///   (`NOPERM`, or a command disabled or renamed, as managed services do with `EVAL`,
    ///   `SCRIPT` and `CONFIG`; `HINCRBY` when the user may not draw fencing tokens), keys
    ///   under the prefix the user may not access, or a TLS
    ///   handshake that failed (an untrusted CA, a name mismatch, a client certificate the
    ///   server wanted). Retrying cannot fix these. See [the crate docs](crate#acl) for the
    ///   commands required.
    /// * [`LockError::Unavailable`](crate::LockError::Unavailable) if the store cannot be
    ///   reached in time.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// distlock::LockClient::memory().prepare().await?;
    /// # Ok(()) }
    /// ```
    pub async fn prepare(&self) -> Result<(), crate::LockError> {
        for warning in self.prepare_with_warnings().await? {
            tracing::warn!("distlock: {warning}");
        }
        Ok(())
    }

    /// [`prepare`](Self::prepare), returning what it found that weakens a promise instead of
    /// logging it: for a caller that reports it its own way (a command-line tool on its
    /// standard error), or refuses to start on it.
    ///
    /// Today that is an evicting Redis ([`StoreWarning::Eviction`](crate::StoreWarning)): a
    /// `maxmemory-policy` other than `noeviction`, read with `CONFIG GET` where the user may run
    /// it (checked first, so nothing is refused: managed services and least-privilege users
    /// that may not are not asked, and get no warning; Redis 6 cannot check beforehand, and a
    /// refusal there is only a debug line). A warning, not an error: the lock works
    /// until the server fills up, the policy is often the operator's (the default of some
    /// managed services), and it can change after startup anyway; refusing would turn a risk
    /// into an outage at every start.
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let warnings = distlock::LockClient::memory().prepare_with_warnings().await?;
    /// assert!(warnings.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn prepare_with_warnings(
        &self,
    ) -> Result<Vec<crate::StoreWarning>, crate::LockError> {
        let timeout = self.inner.config.op_timeout().max(Duration::from_secs(1)) * 4;
        let check = async {
            let probe = self.name(PROBE_NAME)?;
            let warnings = self.inner.backend.prepare(&probe).await?;
            self.probe().await?;
            Ok(warnings)
        };
        let result = match tokio::time::timeout(timeout, check).await {
            Ok(result) => result,
            Err(_) => Err(crate::LockError::timeout("(prepare)", false, timeout)),
        };
        result.map_err(|e| crate::refusal::explain(e, &self.store()))
    }

    /// Releases a lock nobody holds, with a fresh token: the release script on this client's
    /// keys (a `GET`, nothing written).
    async fn probe(&self) -> Result<(), crate::LockError> {
        let op = crate::backend::Op {
            name: self.name(PROBE_NAME)?,
            token: crate::Token::random(),
            lease: self.inner.config.lease(),
            drift: self.inner.config.drift(),
            fencing: false,
            state_ttl: None,
            mode: crate::backend::Mode::Exclusive,
        };
        self.inner.backend.release(&op).await.map(|_| ())
    }

    /// Waits, at most `within`, until this client's background work is done: the releases of
    /// dropped guards and the cleanups of acquisitions that failed ambiguously or were
    /// dropped in flight (and, on Redlock, the background raises of lagging fence counters).
    /// Returns whether it all finished. Call it before a process exits: the
    /// runtime going away cancels that work, and the locks it would have freed then stay held
    /// until their leases end.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let client = distlock::LockClient::memory();
    /// drop(client.lock("job")?.try_acquire().await?); // released in the background
    /// assert!(client.settle(std::time::Duration::from_secs(1)).await);
    /// assert!(client.lock("job")?.try_acquire().await.is_ok());
    /// # Ok(()) }
    /// ```
    pub async fn settle(&self, within: Duration) -> bool {
        self.inner
            .backend
            .waiters()
            .background()
            .settle(within)
            .await
    }

    pub(crate) fn watchdog(&self) -> &Watchdog {
        &self.inner.watchdog
    }

    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }
}

/// Builder for [`LockClient`]; ends with the store: [`redis`](Self::redis),
/// [`connect`](Self::connect) or [`memory`](Self::memory).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let redis = redis::Client::open("redis://127.0.0.1:6379/")?;
/// let conn = redis.get_connection_manager_lazy(Default::default())?;
/// let client = distlock::LockClient::builder()
///     .config(distlock::LockConfig::builder().lease(Duration::from_secs(30)).build()?)
///     .notifications(redis)
///     .redis(conn)?;
/// assert_eq!(client.config().lease(), Duration::from_secs(30));
/// # Ok(()) }
/// ```
#[must_use]
pub struct LockClientBuilder {
    config: LockConfig,
    prefix: String,
    notifications: Vec<Source>,
    node_timeout: Option<Duration>,
    replicas: Option<(usize, Duration)>,
    tls: Option<crate::Tls>,
}

impl std::fmt::Debug for LockClientBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClientBuilder")
            .field("config", &self.config)
            .field("prefix", &self.prefix)
            .field("notifications", &self.notifications.len())
            .field("node_timeout", &self.node_timeout)
            .field("replicas", &self.replicas)
            .field("tls", &self.tls)
            .finish()
    }
}

impl LockClientBuilder {
    /// Default configuration of the client's locks.
    ///
    /// ```
    /// let c = distlock::LockClient::builder().config(distlock::LockConfig::default());
    /// ```
    pub fn config(mut self, config: LockConfig) -> Self {
        self.config = config;
        self
    }

    /// Key prefix (default `distlock`); may be empty. Braces and control characters are refused.
    ///
    /// ```
    /// assert!(distlock::LockClient::builder().prefix("jobs").is_ok());
    /// assert!(distlock::LockClient::builder().prefix("{jobs}").is_err());
    /// ```
    pub fn prefix(mut self, prefix: &str) -> Result<Self, ConfigError> {
        LockName::new(prefix, "probe")?;
        self.prefix = prefix.to_owned();
        Ok(self)
    }

    /// Waiters are woken by release announcements received over one pub/sub connection opened
    /// from `client` (for Redis Cluster, any node: announcements reach every node). Without it
    /// waiters poll with backoff.
    ///
    /// ```
    /// let redis = redis::Client::open("redis://127.0.0.1/").unwrap();
    /// let b = distlock::LockClient::builder().notifications(redis);
    /// ```
    pub fn notifications(mut self, client: redis::Client) -> Self {
        self.notifications.push(Source::Client(Box::new(client)));
        self
    }

    /// (Redlock) The timeout of one node's answer (default: 1% of the lease, at least 50 ms and
    /// at most a third of the command timeout). It must be small against the lease, so that a
    /// node that is down costs little of the validity. An operation that carries a run-once
    /// record is given this plus the record's size at 10 MiB/s (see
    /// [`LockClient::max_record_len`]).
    ///
    /// ```
    /// let b = distlock::LockClient::builder().node_timeout(std::time::Duration::from_millis(20));
    /// ```
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// (Single Redis, Sentinel) After acquiring, `WAIT` until `replicas` replicas acknowledged
    /// the lock, at most `timeout`; fewer in time counts as not acquired (the lock is released
    /// and [`LockError::NotReplicated`](crate::LockError::NotReplicated) returned), like
    /// Redisson's replica check. Renewals and [`Once`] completions wait the same way; one that
    /// too few replicas acknowledged counts as failed (the watchdog retries a renewal, a
    /// completion is retried within the lease).
    ///
    /// What it buys: a failover no longer loses the lock (or a stored record) when the promoted
    /// replica is one that acknowledged it; with `replicas` equal to the number of replicas,
    /// whichever is promoted has it. What it does not: it is not consensus. With fewer, the
    /// lock can still be lost if a replica that did not acknowledge is promoted; and `WAIT`
    /// costs a replication round trip per operation. Not for Redis Cluster connections (`WAIT`
    /// would go to an arbitrary node) or Redlock (which does not rely on replicas).
    ///
    /// # Errors
    /// If `replicas` or `timeout` is zero. The timeout must also be below the command timeout
    /// of every configuration the client's locks run with: checked when the client is built,
    /// and by every `with_config`.
    ///
    /// ```
    /// let b = distlock::LockClient::builder()
    ///     .replicas(1, std::time::Duration::from_millis(100))
    ///     .unwrap();
    /// ```
    pub fn replicas(mut self, replicas: usize, timeout: Duration) -> Result<Self, ConfigError> {
        if replicas == 0 {
            return Err(ConfigError::invalid("replicas", "must be at least 1"));
        }
        if timeout.is_zero() {
            return Err(ConfigError::invalid(
                "replicas",
                "the WAIT timeout must be above zero",
            ));
        }
        self.replicas = Some((replicas, timeout));
        Ok(self)
    }

    /// Trusted roots and a client certificate for `rediss://` URLs given to
    /// [`connect`](Self::connect), [`connect_redlock`](Self::connect_redlock),
    /// [`connect_cluster`](Self::connect_cluster) and [`sentinel`](Self::sentinel) (see
    /// [`Tls`](crate::Tls)). Without it, `rediss://` URLs trust the system's roots.
    ///
    /// ```
    /// let b = distlock::LockClient::builder().tls(distlock::Tls::new());
    /// ```
    pub fn tls(mut self, tls: crate::Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Locks on the master of a Sentinel-managed group: commands follow the master across
    /// failovers, and so do notifications. See [`sentinel`](crate::sentinel) for what a
    /// failover costs. `rediss://` sentinel URLs mean TLS to the sentinels and to the master,
    /// with the builder's [`tls`](Self::tls) settings; for the master's credentials (an ACL
    /// user) or other TLS choices use [`sentinel_with`](Self::sentinel_with).
    ///
    /// # Errors
    /// If a sentinel URL is invalid.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::ConfigError> {
    /// let client = distlock::LockClient::builder()
    ///     .sentinel(&["redis://127.0.0.1:26379/"], "mymaster")?;
    /// assert!(client.store().contains("sentinel"));
    /// # Ok(()) }
    /// ```
    pub fn sentinel<S: AsRef<str>>(
        self,
        sentinels: &[S],
        service: &str,
    ) -> Result<LockClient, ConfigError> {
        let builder = crate::sentinel::SentinelConnection::builder(sentinels, service);
        self.sentinel_with(builder)
    }

    /// Locks on the master of a Sentinel-managed group, connected as `sentinel` says (TLS, the
    /// master's credentials); the builder's [`tls`](Self::tls) settings apply unless
    /// `sentinel` has its own.
    ///
    /// # Errors
    /// As [`SentinelConnectionBuilder::build`](crate::sentinel::SentinelConnectionBuilder::build).
    ///
    /// ```
    /// # fn main() -> Result<(), distlock::ConfigError> {
    /// use distlock::sentinel::SentinelConnection;
    /// let client = distlock::LockClient::builder().sentinel_with(
    ///     SentinelConnection::builder(&["redis://127.0.0.1:26379/"], "mymaster")
    ///         .master_auth(Some("locks"), "secret"),
    /// )?;
    /// assert!(client.store().contains("mymaster"));
    /// # Ok(()) }
    /// ```
    pub fn sentinel_with(
        mut self,
        sentinel: crate::sentinel::SentinelConnectionBuilder,
    ) -> Result<LockClient, ConfigError> {
        let sentinel = match self.tls.take() {
            Some(tls) => sentinel.default_tls(tls),
            None => sentinel,
        };
        let service = sentinel.service().to_owned();
        let conn = sentinel.build()?;
        self.notifications.push(Source::Sentinel(conn.sentinel()));
        self.redis_described(conn, format!("redis sentinel ({service})"))
    }

    /// Locks on the Redis Cluster reached through the nodes at `urls` (`rediss://` with the
    /// builder's [`tls`](Self::tls) settings), with notifications from the first node. Connects
    /// now: a cluster client needs the slot map. Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// [`LockError::Config`](crate::LockError::Config) if a URL is invalid (or the URLs mix
    /// `redis://` and `rediss://`), [`LockError::Unavailable`](crate::LockError::Unavailable)
    /// if no node answers.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let client = distlock::LockClient::builder()
    ///     .connect_cluster(&["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"])
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster<S: AsRef<str>>(
        self,
        urls: &[S],
    ) -> Result<LockClient, crate::LockError> {
        let mut infos = Vec::with_capacity(urls.len());
        for url in urls {
            let info = redis::IntoConnectionInfo::into_connection_info(url.as_ref())
                .map_err(|e| ConfigError::invalid("url", format!("{:?}: {e}", url.as_ref())))?;
            infos.push(crate::tls::quiet(info));
        }
        let Some(first) = urls.first() else {
            return Err(
                ConfigError::invalid("url", "a cluster needs at least one node URL").into(),
            );
        };
        let tls = infos.iter().filter(|i| crate::tls::is_tls(i)).count();
        if tls != 0 && tls != infos.len() {
            return Err(
                ConfigError::invalid("url", "the node URLs mix redis:// and rediss://").into(),
            );
        }
        let notifications = crate::tls::client(first.as_ref(), self.tls.as_ref())?;
        let timeout = self.config.op_timeout();
        let mut cluster = redis::cluster::ClusterClientBuilder::new(infos)
            .connection_timeout(timeout)
            .response_timeout(timeout);
        if let Some(tls) = &self.tls {
            cluster = cluster.certs(tls.certificates());
        }
        let cluster = cluster
            .build()
            .map_err(|e| ConfigError::invalid("url", e.to_string()))?;
        let conn = match tokio::time::timeout(timeout * 4, cluster.get_async_connection()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                let error = crate::LockError::from_redis("(cluster)", false, e);
                return Err(crate::refusal::explain(error, "redis cluster"));
            }
            Err(_) => return Err(crate::LockError::timeout("(cluster)", false, timeout * 4)),
        };
        let describe = format!("redis cluster ({} nodes given)", urls.len());
        Ok(self
            .notifications(notifications)
            .redis_described(conn, describe)?)
    }

    fn waiters(&mut self) -> Arc<Waiters> {
        if self.notifications.is_empty() {
            Waiters::local()
        } else {
            spawn_notifiers(
                std::mem::take(&mut self.notifications),
                self.config.op_timeout(),
            )
        }
    }

    fn build(self, backend: Arc<dyn Backend>) -> Result<LockClient, ConfigError> {
        backend.check_config(&self.config)?;
        Ok(LockClient {
            inner: Arc::new(ClientInner {
                backend,
                config: Arc::new(self.config),
                prefix: self.prefix,
                watchdog: Watchdog::default(),
            }),
        })
    }

    /// Redlock across independent masters (see the [`redlock` docs](crate#redlock)): one
    /// connection per master, all of the same type. Locks, fencing tokens, the watchdog and
    /// the loss signal work as on one Redis; a lock is held while a quorum (N/2 + 1) holds it.
    /// Notifications, if wanted, come from [`notifications`](Self::notifications) given once
    /// per master. Must be called inside a Tokio runtime when notifications are set.
    ///
    /// # Errors
    /// If there is no node, or the node timeout is not small against the command timeout.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut conns = Vec::new();
    /// for port in [7001, 7002, 7003] {
    ///     let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    ///     conns.push(client.get_connection_manager_lazy(Default::default())?);
    /// }
    /// let client = distlock::LockClient::builder().redlock(conns)?;
    /// assert!(client.store().starts_with("redlock"));
    /// # Ok(()) }
    /// ```
    pub fn redlock<C>(self, nodes: Vec<C>) -> Result<LockClient, ConfigError>
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        let described = (0..nodes.len()).map(|i| format!("node {i}")).collect();
        self.redlock_described(nodes, described)
    }

    fn redlock_described<C: Conn>(
        mut self,
        nodes: Vec<C>,
        names: Vec<String>,
    ) -> Result<LockClient, ConfigError> {
        if nodes.is_empty() {
            return Err(ConfigError::invalid(
                "redis",
                "Redlock needs at least one node",
            ));
        }
        let op_timeout = self.config.op_timeout();
        let node_timeout = self.node_timeout.unwrap_or_else(|| {
            (self.config.lease() / 100)
                .max(Duration::from_millis(50))
                .min(op_timeout / 3)
        });
        let waiters = self.waiters();
        let describe = format!(
            "redlock ({} nodes, quorum {}: {})",
            nodes.len(),
            nodes.len() / 2 + 1,
            names.join(", ")
        );
        let nodes = nodes
            .into_iter()
            .zip(names)
            .map(|(conn, name)| RedisBackend::new(conn, Waiters::local(), name))
            .collect();
        let backend = RedlockBackend::new(nodes, node_timeout, waiters, describe);
        self.build(Arc::new(backend))
    }

    /// Redlock on the masters at `urls`: a lazily connected `ConnectionManager` and a
    /// notification connection per master. Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// If a URL is not a Redis URL, or as [`redlock`](Self::redlock).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::ConfigError> {
    /// let client = distlock::LockClient::builder().connect_redlock(&[
    ///     "redis://127.0.0.1:7001/", "redis://127.0.0.1:7002/", "redis://127.0.0.1:7003/",
    /// ])?;
    /// # Ok(()) }
    /// ```
    pub fn connect_redlock<S: AsRef<str>>(mut self, urls: &[S]) -> Result<LockClient, ConfigError> {
        let mut conns = Vec::with_capacity(urls.len());
        let mut names = Vec::with_capacity(urls.len());
        for url in urls {
            let (client, conn) = self.manager(url.as_ref())?;
            let name = client.get_connection_info().addr().to_string();
            // One server named twice (another database number is the same server) would be
            // counted as two votes: a quorum of one server, whose loss takes both.
            if names.contains(&name) {
                return Err(ConfigError::invalid(
                    "redlock",
                    format!(
                        "{name} is named twice: Redlock needs independent masters, each counted once"
                    ),
                ));
            }
            names.push(name);
            self.notifications.push(Source::Client(Box::new(client)));
            conns.push(conn);
        }
        self.redlock_described(conns, names)
    }

    fn manager(
        &self,
        url: &str,
    ) -> Result<(redis::Client, redis::aio::ConnectionManager), ConfigError> {
        let client = crate::tls::client(url, self.tls.as_ref())?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ConfigError::invalid(
                "runtime",
                "connecting starts background tasks: call this inside a Tokio runtime (#[tokio::main], or Runtime::enter)",
            ));
        }
        let timeout = self.config.op_timeout();
        // Our own per-command timeout applies; the manager's default of 500 ms would cut
        // longer ones (WAIT, slow networks) short.
        let manager_config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let conn = client
            .get_connection_manager_lazy(manager_config)
            .map_err(|e| ConfigError::invalid("url", format!("{}: {e}", crate::redact_url(url))))?;
        Ok((client, conn))
    }

    /// Locks on Redis through `conn`: a `ConnectionManager`, `MultiplexedConnection`, cluster
    /// connection or anything else implementing `redis::aio::ConnectionLike + Clone`.
    ///
    /// Must be called inside a Tokio runtime when [`notifications`](Self::notifications) is set
    /// (it starts the pub/sub task).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let redis = redis::Client::open("redis://127.0.0.1/")?;
    /// let conn = redis.get_connection_manager_lazy(Default::default())?;
    /// let client = distlock::LockClient::builder().redis(conn)?;
    /// assert_eq!(client.store(), "redis");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// If the [replica check](Self::replicas) does not fit in the configuration's command
    /// timeout.
    pub fn redis<C>(self, conn: C) -> Result<LockClient, ConfigError>
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        let describe = match self.notifications.first() {
            Some(Source::Client(client)) => {
                format!("redis ({})", client.get_connection_info().addr())
            }
            Some(Source::Sentinel(_)) => "redis (sentinel)".to_owned(),
            None => "redis".to_owned(),
        };
        self.redis_described(conn, describe)
    }

    fn redis_described<C: Conn>(
        mut self,
        conn: C,
        describe: String,
    ) -> Result<LockClient, ConfigError> {
        let waiters = self.waiters();
        // Pipelined fences only on a connection known to reach one server.
        let single = [
            std::any::TypeId::of::<redis::aio::MultiplexedConnection>(),
            std::any::TypeId::of::<redis::aio::ConnectionManager>(),
        ]
        .contains(&std::any::TypeId::of::<C>());
        // A cluster's connection also reaches every master for a scan.
        let cluster = (&conn as &dyn std::any::Any)
            .downcast_ref::<redis::cluster_async::ClusterConnection>()
            .cloned();
        let backend = RedisBackend::new(conn, waiters, describe)
            .with_replicas(self.replicas)
            .with_pipelined_fences(single)
            .with_cluster(cluster);
        self.build(Arc::new(backend))
    }

    /// Locks on the Redis at `url`, through a lazily connected `ConnectionManager` (it reconnects
    /// in the background after failures), with notifications over one pub/sub connection.
    /// Must be called inside a Tokio runtime.
    ///
    /// # Errors
    /// If `url` is not a valid Redis URL.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// assert!(distlock::LockClient::builder().connect("http://nope").is_err());
    /// # }
    /// ```
    pub fn connect(self, url: &str) -> Result<LockClient, ConfigError> {
        let (client, conn) = self.manager(url)?;
        let describe = format!("redis ({})", client.get_connection_info().addr());
        self.notifications(client).redis_described(conn, describe)
    }

    /// (Feature `postgres`) Locks and run-once records in `table` of the PostgreSQL database
    /// `pool` connects to (created by [`LockClient::prepare`] if missing): see
    /// [`postgres`](crate::postgres). Every operation takes a connection from the pool for its
    /// duration only. Records can be streamed (their parts in `{table}_parts`; readers in other
    /// processes poll for them); reentrant locks are not offered.
    /// Must be called inside a Tokio runtime (a task deletes expired rows every minute).
    ///
    /// # Errors
    /// If `table` is not a table name (`letters_digits`, or `schema.table`).
    #[cfg(feature = "postgres")]
    pub fn postgres(
        self,
        pool: deadpool_postgres::Pool,
        table: &str,
    ) -> Result<LockClient, ConfigError> {
        let backend = crate::backend::postgres::PostgresBackend::new(pool, table)?;
        self.build(backend)
    }

    /// (Feature `postgres`) [`postgres`](Self::postgres) with a pool of up to 16 connections
    /// (without TLS) to the database at `url` (`postgres://user:password@host:port/database`).
    ///
    /// # Errors
    /// If `url` or `table` cannot be used.
    #[cfg(feature = "postgres")]
    pub fn connect_postgres(self, url: &str, table: &str) -> Result<LockClient, ConfigError> {
        let config: tokio_postgres::Config = url.parse().map_err(|e| ConfigError::Invalid {
            field: "postgres url",
            reason: format!("{}: {e}", crate::redact_url(url)),
        })?;
        let manager = deadpool_postgres::Manager::from_config(
            config,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(16)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| ConfigError::Invalid {
                field: "postgres pool",
                reason: e.to_string(),
            })?;
        self.postgres(pool, table)
    }

    /// Locks in this process's memory, bounded by `limits`.
    ///
    /// ```
    /// let client = distlock::LockClient::builder().memory(distlock::MemoryLimits::default());
    /// ```
    pub fn memory(self, limits: MemoryLimits) -> LockClient {
        LockClient {
            inner: Arc::new(ClientInner {
                backend: Arc::new(MemoryBackend::new(limits)),
                config: Arc::new(self.config),
                prefix: self.prefix,
                watchdog: Watchdog::default(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LockClient;

    #[test]
    fn connecting_outside_a_runtime_is_a_config_error_not_a_panic() {
        let err = LockClient::builder()
            .connect("redis://127.0.0.1:1/")
            .expect_err("no runtime");
        assert!(err.to_string().contains("Tokio runtime"), "{err}");
        let err = LockClient::builder()
            .connect_redlock(&["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"])
            .expect_err("no runtime");
        assert!(err.to_string().contains("Tokio runtime"), "{err}");
    }

    /// Acquiring (or beginning a run-once record) under another executor than Tokio's is an
    /// error that says so (before: a panic in the watchdog's spawn or a timer).
    #[test]
    fn acquiring_outside_a_runtime_is_an_error_not_a_panic() {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};
        let client = LockClient::memory();
        let lock = client.lock("k").unwrap();
        let once = client.once("o").unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        let taken = std::pin::pin!(lock.try_acquire()).as_mut().poll(&mut cx);
        assert!(
            matches!(&taken, Poll::Ready(Err(crate::LockError::Config(e))) if e.to_string().contains("Tokio runtime")),
            "{taken:?}"
        );
        let begun = std::pin::pin!(once.begin("")).as_mut().poll(&mut cx);
        assert!(
            matches!(&begun, Poll::Ready(Err(crate::LockError::Config(_)))),
            "{begun:?}"
        );
    }

    /// One server named twice for Redlock (here with another database number) is refused:
    /// it would count as two votes (before: accepted, a quorum of two out of three reachable
    /// on that one server).
    #[tokio::test]
    async fn redlock_refuses_a_server_named_twice() {
        let err = LockClient::builder()
            .connect_redlock(&[
                "redis://127.0.0.1:1/",
                "redis://127.0.0.1:2/",
                "redis://127.0.0.1:1/3",
            ])
            .expect_err("the same server twice");
        assert!(err.to_string().contains("named twice"), "{err}");
        assert!(
            LockClient::builder()
                .connect_redlock(&[
                    "redis://127.0.0.1:1/",
                    "redis://127.0.0.1:2/",
                    "redis://127.0.0.1:3/"
                ])
                .is_ok()
        );
    }

    /// A connection that never answers, made without a runtime.
    #[derive(Clone)]
    struct Nowhere;

    impl redis::aio::ConnectionLike for Nowhere {
        fn req_packed_command<'a>(
            &'a mut self,
            _: &'a redis::Cmd,
        ) -> redis::RedisFuture<'a, redis::Value> {
            Box::pin(std::future::pending())
        }
        fn req_packed_commands<'a>(
            &'a mut self,
            _: &'a redis::Pipeline,
            _: usize,
            _: usize,
        ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
            Box::pin(std::future::pending())
        }
        fn get_db(&self) -> i64 {
            0
        }
    }

    #[test]
    fn notifications_and_sentinel_outside_a_runtime_do_not_panic() {
        let redis = redis::Client::open("redis://127.0.0.1:1/").unwrap();
        let client = LockClient::builder()
            .notifications(redis)
            .redis(Nowhere)
            .expect("built without a runtime");
        assert_eq!(client.store(), "redis (127.0.0.1:1)");
        let sentinel = LockClient::builder()
            .sentinel(&["redis://127.0.0.1:1/"], "m")
            .expect("built without a runtime");
        assert!(sentinel.store().contains("sentinel"));
    }

    /// The replica check and the node timeout must fit every configuration a lock runs with,
    /// in whatever order the builder was called, and through every `with_config`.
    #[tokio::test]
    async fn replica_and_node_timeouts_are_checked_against_every_config() {
        use std::time::Duration;
        let short = crate::LockConfig::builder()
            .op_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let err = LockClient::builder()
            .replicas(1, Duration::from_millis(500))
            .unwrap()
            .config(short.clone())
            .redis(Nowhere)
            .expect_err("WAIT 500 ms in a 300 ms command");
        assert!(err.to_string().contains("replicas"), "{err}");
        let client = LockClient::builder()
            .replicas(1, Duration::from_millis(500))
            .unwrap()
            .redis(Nowhere)
            .unwrap();
        assert!(client.with_config(short.clone()).is_err());
        assert!(
            client
                .lock("k")
                .unwrap()
                .with_config(short.clone())
                .is_err()
        );
        assert!(
            client
                .once("k")
                .unwrap()
                .with_config(short.clone())
                .is_err()
        );
        let err = LockClient::builder()
            .node_timeout(Duration::from_millis(200))
            .config(short.clone())
            .redlock(vec![Nowhere, Nowhere, Nowhere])
            .expect_err("three 200 ms rounds in a 300 ms command");
        assert!(err.to_string().contains("node_timeout"), "{err}");
        let redlock = LockClient::builder()
            .node_timeout(Duration::from_millis(200))
            .redlock(vec![Nowhere, Nowhere, Nowhere])
            .unwrap();
        assert!(redlock.lock("k").unwrap().with_config(short).is_err());
        // A node timeout near `Duration::MAX` is refused, not an overflow (it panicked).
        let err = LockClient::builder()
            .node_timeout(Duration::MAX)
            .redlock(vec![Nowhere, Nowhere, Nowhere])
            .expect_err("a node timeout longer than the command timeout");
        assert!(err.to_string().contains("node_timeout"), "{err}");
    }

    #[tokio::test]
    async fn the_longest_waits_and_caps_saturate() {
        use std::time::Duration;
        let config = crate::LockConfig::builder()
            .max_hold(Duration::MAX)
            .build()
            .unwrap();
        let client = LockClient::memory().with_config(config).unwrap();
        let lock = client.lock("k").unwrap();
        let guard = lock.acquire(Duration::MAX).await.unwrap();
        assert!(guard.is_held());
        let once = client.once("o").unwrap();
        assert!(matches!(
            once.begin_wait("t", Duration::MAX).await.unwrap(),
            crate::Begin::Acquired(_)
        ));
        assert!(once.retention(Duration::MAX).is_err());
        assert!(
            crate::LockConfig::builder()
                .fence_ttl(Duration::MAX)
                .build()
                .is_err()
        );
    }

    #[tokio::test]
    async fn connecting_inside_a_runtime_is_lazy_and_succeeds() {
        // Nothing listens on port 1: connecting is lazy, so building still succeeds.
        let client = LockClient::builder()
            .connect("redis://127.0.0.1:1/")
            .unwrap();
        assert!(client.store().contains("127.0.0.1:1"), "{}", client.store());
    }
}
