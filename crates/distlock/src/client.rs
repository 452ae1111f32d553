//! The client: a store (Redis or memory), a default configuration and a key prefix.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::backend::memory::MemoryBackend;
use crate::backend::redis::{Conn, RedisBackend, spawn_notifier};
use crate::backend::waiters::Waiters;
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
            notifications: None,
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
    /// ```
    /// use std::time::Duration;
    /// let client = distlock::LockClient::memory();
    /// let short = distlock::LockConfig::builder().lease(Duration::from_secs(1)).build().unwrap();
    /// assert_eq!(client.with_config(short).config().lease(), Duration::from_secs(1));
    /// ```
    #[must_use]
    pub fn with_config(&self, config: LockConfig) -> LockClient {
        LockClient {
            inner: Arc::new(ClientInner {
                backend: self.inner.backend.clone(),
                config: Arc::new(config),
                prefix: self.inner.prefix.clone(),
            }),
        }
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

    /// A short description of the store, for logs.
    ///
    /// ```
    /// println!("locks in {}", distlock::LockClient::memory().store());
    /// ```
    pub fn store(&self) -> String {
        self.inner.backend.describe()
    }

    /// Connects to the store and loads the lock scripts now, so that the first acquisition does
    /// not pay for it (and a misconfigured URL shows up at startup). Optional: everything also
    /// happens on first use.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// distlock::LockClient::memory().prepare().await?;
    /// # Ok(()) }
    /// ```
    pub async fn prepare(&self) -> Result<(), crate::LockError> {
        let timeout = self.inner.config.op_timeout().max(Duration::from_secs(1)) * 4;
        match tokio::time::timeout(timeout, self.inner.backend.prepare()).await {
            Ok(result) => result,
            Err(_) => Err(crate::LockError::timeout("(prepare)", false, timeout)),
        }
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
///     .redis(conn);
/// assert_eq!(client.config().lease(), Duration::from_secs(30));
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use]
pub struct LockClientBuilder {
    config: LockConfig,
    prefix: String,
    notifications: Option<redis::Client>,
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
        self.notifications = Some(client);
        self
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
    /// let client = distlock::LockClient::builder().redis(conn);
    /// assert_eq!(client.store(), "redis");
    /// # Ok(()) }
    /// ```
    pub fn redis<C>(self, conn: C) -> LockClient
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        let describe = match &self.notifications {
            Some(client) => format!("redis ({})", client.get_connection_info().addr()),
            None => "redis".to_owned(),
        };
        self.redis_described(conn, describe)
    }

    fn redis_described<C: Conn>(self, conn: C, describe: String) -> LockClient {
        let waiters = match self.notifications {
            Some(client) => spawn_notifier(client, self.config.op_timeout()),
            None => Waiters::local(),
        };
        LockClient {
            inner: Arc::new(ClientInner {
                backend: Arc::new(RedisBackend::new(conn, waiters, describe)),
                config: Arc::new(self.config),
                prefix: self.prefix,
            }),
        }
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
        let client = redis::Client::open(url)
            .map_err(|e| ConfigError::invalid("url", format!("{url:?}: {e}")))?;
        let timeout = self.config.op_timeout();
        let manager_config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let conn = client
            .get_connection_manager_lazy(manager_config)
            .map_err(|e| ConfigError::invalid("url", format!("{url:?}: {e}")))?;
        let describe = format!("redis ({})", client.get_connection_info().addr());
        Ok(self.notifications(client).redis_described(conn, describe))
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
            }),
        }
    }
}
