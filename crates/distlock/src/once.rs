//! Run-once: a lock whose holder can store a completion record atomically with its release, so
//! that later callers get the record instead of the lock.
//!
//! This is what an idempotent endpoint needs, in two round trips: `begin` either takes the lock,
//! returns the stored record, or reports who is in flight (with their tag, for example a request
//! fingerprint); `complete` stores the record only if the lease is still ours.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::backend::{Attempt, Mode, Op};
use crate::lock::acquire_until;
use crate::{
    ConfigError, LockClient, LockConfig, LockError, LockGuard, LockName, LossReason, Token,
};

/// A run-once lock on one name. See the [module docs](crate::once).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::Begin;
/// let client = distlock::LockClient::memory();
/// let once = client.once("payment-evt_123")?;
///
/// let Begin::Acquired(guard) = once.begin("fingerprint-A").await? else { unreachable!() };
/// // apply the payment, fenced with guard.fence() ...
/// guard.complete(b"201 Created").await?;
///
/// match once.begin("fingerprint-A").await? {
///     Begin::Done(record) => assert_eq!(&record[..], b"201 Created"),
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Once {
    client: LockClient,
    name: LockName,
    retention: Duration,
    config: Arc<LockConfig>,
}

/// What [`Once::begin`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin {
    /// Nobody completed the work and nobody is doing it: it is ours to do.
    Acquired(OnceGuard),
    /// The work was completed; this is the stored record.
    Done(Bytes),
    /// Someone holds the lock and is doing the work.
    InFlight {
        /// The tag the holder passed to `begin`.
        tag: Bytes,
        /// The holder's remaining lease, if known.
        retry_after: Option<Duration>,
    },
}

impl Once {
    pub(crate) fn new(client: LockClient, name: LockName) -> Self {
        let config = client.shared_config();
        Once {
            client,
            name,
            retention: Duration::from_secs(24 * 3600),
            config,
        }
    }

    /// How long a completion record is kept (default 24 hours). It must be at least the lease.
    ///
    /// ```
    /// use std::time::Duration;
    /// let once = distlock::LockClient::memory().once("k")?.retention(Duration::from_secs(3600))?;
    /// assert_eq!(once.retention_period(), Duration::from_secs(3600));
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn retention(mut self, retention: Duration) -> Result<Self, ConfigError> {
        if retention > crate::config::MAX_TTL {
            return Err(ConfigError::invalid(
                "retention",
                format!(
                    "{retention:?} is above the longest expiry accepted ({:?})",
                    crate::config::MAX_TTL
                ),
            ));
        }
        if retention < self.config.lease() {
            return Err(ConfigError::invalid(
                "retention",
                format!(
                    "{retention:?} is shorter than the lease {:?}: the state could expire while the work runs",
                    self.config.lease()
                ),
            ));
        }
        self.retention = retention;
        Ok(self)
    }

    /// The record retention.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.retention_period(), std::time::Duration::from_secs(86_400));
    /// ```
    pub fn retention_period(&self) -> Duration {
        self.retention
    }

    /// The same run-once lock with other timing (the retention must still cover the lease).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let config = distlock::LockConfig::builder().lease(Duration::from_secs(5)).build()?;
    /// let once = distlock::LockClient::memory().once("k")?.with_config(config)?;
    /// # Ok(()) }
    /// ```
    pub fn with_config(mut self, config: LockConfig) -> Result<Self, ConfigError> {
        self.client.backend().check_config(&config)?;
        self.config = Arc::new(config);
        let retention = self.retention;
        self.retention(retention)
    }

    /// The name and keys.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.name().as_str(), "k");
    /// ```
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// One atomic step: the stored record, or the lock, or who holds it.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("signup:+15550100")?;
    /// let first = once.begin("fp").await?;
    /// assert!(matches!(first, Begin::Acquired(_)));
    /// match once.begin("other-fp").await? {
    ///     Begin::InFlight { tag, .. } => assert_eq!(&tag[..], b"fp"),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self, tag: impl Into<Bytes>) -> Result<Begin, LockError> {
        self.begin_with(tag.into(), None).await
    }

    /// Like [`begin`](Once::begin), but while someone is in flight waits up to `wait` (woken by
    /// their release) for the record, or for the lock if they gave up without completing.
    /// Returns `InFlight` if they are still at it when `wait` ends.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("evt_1")?;
    /// let Begin::Acquired(guard) = once.begin("fp").await? else { unreachable!() };
    /// let waiting = tokio::spawn({
    ///     let once = once.clone();
    ///     async move { once.begin_wait("fp", Duration::from_secs(5)).await }
    /// });
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// guard.complete(b"done").await?;
    /// assert!(matches!(waiting.await.unwrap()?, Begin::Done(r) if &r[..] == b"done"));
    /// # Ok(()) }
    /// ```
    pub async fn begin_wait(
        &self,
        tag: impl Into<Bytes>,
        wait: Duration,
    ) -> Result<Begin, LockError> {
        self.begin_with(
            tag.into(),
            Some(crate::clock::after(crate::clock::now(), wait)),
        )
        .await
    }

    async fn begin_with(&self, tag: Bytes, deadline: Option<Instant>) -> Result<Begin, LockError> {
        let op = Op {
            name: self.name.clone(),
            token: Token::random(),
            lease: self.config.lease(),
            drift: self.config.drift(),
            fencing: self.config.fencing(),
            state_ttl: None,
            mode: Mode::Once {
                tag,
                retention: self.retention,
            },
        };
        let backend = self.client.backend();
        let (attempt, sent) = acquire_until(backend, &op, &self.config, deadline).await?;
        Ok(match attempt {
            Attempt::Acquired { fence } => Begin::Acquired(OnceGuard {
                guard: LockGuard::start(
                    self.client.watchdog(),
                    backend.clone(),
                    op,
                    self.config.clone(),
                    fence,
                    sent,
                ),
            }),
            Attempt::Done { record } => Begin::Done(record),
            Attempt::Held { ttl, tag } => Begin::InFlight {
                tag: tag.unwrap_or_default(),
                retry_after: ttl,
            },
        })
    }
}

/// The holder of a run-once lock. [`complete`](OnceGuard::complete) stores the record and
/// releases; dropping it (error, panic, cancellation) releases without a record, so a retry does
/// the work again.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::Begin;
/// let once = distlock::LockClient::memory().once("job")?;
/// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
/// assert!(guard.abort().await?);
/// assert!(matches!(once.begin("").await?, Begin::Acquired(_)), "no record: do it again");
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping the guard releases the lock without a record"]
pub struct OnceGuard {
    guard: LockGuard,
}

impl OnceGuard {
    /// The underlying lock guard: fence, lease, loss signal.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.guard().fence(), 1);
    /// # Ok(()) }
    /// ```
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// The fencing token of this attempt.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.fence(), g.guard().fence());
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> u64 {
        self.guard.fence()
    }

    /// Stores `record` and releases, atomically, only if the lock is still ours. A transient
    /// failure is retried while the lease can be proven held: a retry of a completion that did
    /// happen is recognised as such.
    ///
    /// # Errors
    /// [`LockError::LeaseLost`] if the lock was not ours any more (nothing stored: another
    /// holder may be doing the work); [`LockError::Unavailable`] if the store could not be
    /// reached within the lease (the guard is then released on drop; a record may or may not
    /// have been stored).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// g.complete(b"result").await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete(mut self, record: &[u8]) -> Result<(), LockError> {
        let config = self.guard.config().clone();
        let name = self.guard.name().to_owned();
        let lease = self.guard.lease();
        let mut backoff = crate::Backoff::new(config.retry_base(), config.retry_max());
        loop {
            let stored = tokio::time::timeout(
                config.op_timeout(),
                self.guard.backend().complete(self.guard.op(), record),
            )
            .await;
            let error = match stored {
                Ok(Ok(true)) => {
                    self.guard.disarm();
                    crate::backend::wake_next(&**self.guard.backend(), self.guard.op());
                    return Ok(());
                }
                Ok(Ok(false)) => {
                    lease.shared().set_lost(LossReason::NotOwner);
                    self.guard.disarm();
                    return Err(LockError::LeaseLost {
                        name,
                        reason: LossReason::NotOwner,
                    });
                }
                Ok(Err(error)) => error.into_ambiguous(),
                Err(_) => LockError::timeout(&name, true, config.op_timeout()),
            };
            // The completion is idempotent (the store recognises our own earlier attempt), so
            // a transient failure (a dropped connection, a failover) is retried while the
            // lease can still be proven held.
            if !(error.is_unavailable() && lease.is_held()) {
                return Err(error);
            }
            tracing::debug!(lock = %name, %error, "completion failed; retrying within the lease");
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Releases without storing a record; returns whether the lock was still ours.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert!(g.abort().await?);
    /// # Ok(()) }
    /// ```
    pub async fn abort(self) -> Result<bool, LockError> {
        self.guard.release().await
    }
}
