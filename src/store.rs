//! Where outcomes and leases live: Redis (shared by every instance) or memory (one process).
//!
//! Both are [`distlock`] run-once locks ([`distlock::Once`]): the lease, owner token, fencing
//! token, watchdog renewal, loss signal, waiting by notification and backoff all come from the
//! lock crate. Per request there is one store name, `idem:{<sha256>}`, with its state in
//! `idem:{<sha256>}:state` (fencing counter, in-flight fingerprint, stored record): one hash slot,
//! so the same code runs on Redis Cluster.

use distlock::{ConfigError, LockClient, MemoryLimits};

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
        Store {
            client: LockClient::builder()
                .prefix(DEFAULT_PREFIX)
                .expect("the default prefix is valid")
                .memory(limits),
        }
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
        Ok(Store {
            client: LockClient::builder().prefix(DEFAULT_PREFIX)?.connect(url)?,
        })
    }

    /// A store on a lock client you built (a cluster or Sentinel connection, another prefix).
    ///
    /// ```
    /// let client = distlock::LockClient::builder().prefix("myapp-idem").unwrap().memory(Default::default());
    /// let store = tower_idempotency::Store::from_client(client);
    /// ```
    pub fn from_client(client: LockClient) -> Self {
        Store { client }
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
