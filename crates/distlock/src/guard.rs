//! The guard of a held lock.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, Op};
use crate::lease::{LeaseShared, LeaseWatch};
use crate::watchdog::{self, Hold, Watchdog};
use crate::{LockConfig, LockError, LossReason, Token};

/// Proof of a held lock. While it lives a watchdog renews the lease; dropping it releases the
/// lock (a spawned compare-and-delete, never a blocking call in `Drop`), with the lease as the
/// backstop if that release cannot reach the store.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// let client = distlock::LockClient::memory();
/// let lock = client.lock("nightly-report")?;
/// let guard = lock.try_acquire().await?;
/// assert!(guard.is_held());
/// assert!(matches!(lock.try_acquire().await, Err(distlock::LockError::Held { .. })));
/// assert!(guard.release().await?, "it was still ours");
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping the guard releases the lock"]
pub struct LockGuard {
    backend: Arc<dyn Backend>,
    op: Op,
    config: Arc<LockConfig>,
    lease: LeaseWatch,
    watchdog: Watchdog,
    /// Registered with the watchdog until released, completed or dropped.
    hold: Option<Arc<Hold>>,
}

impl LockGuard {
    /// Wraps a confirmed acquisition that was sent at `sent` and registers it with the
    /// client's watchdog.
    pub(crate) fn start(
        watchdog: &Watchdog,
        backend: Arc<dyn Backend>,
        op: Op,
        config: Arc<LockConfig>,
        fence: u64,
        sent: Instant,
    ) -> Self {
        let valid_until = sent + op.lease - config.drift();
        let shared = LeaseShared::new(op.name.clone(), fence, valid_until);
        let hold = watchdog.register(
            backend.clone(),
            op.clone(),
            config.clone(),
            shared.clone(),
            sent,
        );
        LockGuard {
            backend,
            op,
            config,
            lease: LeaseWatch::new(shared),
            watchdog: watchdog.clone(),
            hold: Some(hold),
        }
    }

    /// The fencing token: strictly greater than that of every earlier holder of this lock.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let lock = distlock::LockClient::memory().lock("job")?;
    /// let a = lock.try_acquire().await?;
    /// let fa = a.fence();
    /// drop(a);
    /// # tokio::task::yield_now().await;
    /// let b = lock.acquire(std::time::Duration::from_secs(1)).await?;
    /// assert!(b.fence() > fa);
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> u64 {
        self.lease.fence()
    }

    /// The lock name.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert_eq!(guard.name(), "job");
    /// # Ok(()) }
    /// ```
    pub fn name(&self) -> &str {
        self.op.name.as_str()
    }

    /// The owner token of this acquisition (the hold token for a reentrant lock).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert_eq!(guard.token().as_str().len(), 32);
    /// # Ok(()) }
    /// ```
    pub fn token(&self) -> &Token {
        &self.op.token
    }

    /// The timing this lock runs with.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert_eq!(guard.config(), &distlock::LockConfig::default());
    /// # Ok(()) }
    /// ```
    pub fn config(&self) -> &LockConfig {
        &self.config
    }

    /// A cloneable view of the lease to hand to the protected work: fence, `is_held`, and the
    /// loss signal.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// let lease = guard.lease();
    /// assert_eq!(lease.fence(), guard.fence());
    /// # Ok(()) }
    /// ```
    pub fn lease(&self) -> LeaseWatch {
        self.lease.clone()
    }

    /// Whether the lease can be proven held right now. See [`LeaseWatch::is_held`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert!(guard.is_held());
    /// # Ok(()) }
    /// ```
    pub fn is_held(&self) -> bool {
        self.lease.is_held()
    }

    /// Resolves when the lease is lost, with the reason. See [`LeaseWatch::lost`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// let still_held = tokio::time::timeout(std::time::Duration::from_millis(20), guard.lost()).await;
    /// assert!(still_held.is_err(), "the watchdog keeps it");
    /// # Ok(()) }
    /// ```
    pub async fn lost(&self) -> LossReason {
        self.lease.lost().await
    }

    /// Releases the lock now and reports whether it was still ours (`false`: the lease had
    /// expired and the lock was gone or taken by someone else, and nothing was deleted).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store could not be reached; the lock then expires at
    /// the end of its lease.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert!(guard.release().await?);
    /// # Ok(()) }
    /// ```
    pub async fn release(mut self) -> Result<bool, LockError> {
        self.disarm();
        // Dropped before its answer (the caller's future cancelled), the release is made again
        // in a task, as a dropped guard's is: its first poll may not have sent it (a client
        // discards a queued command whose caller went away; a reconnect may be under way).
        // Made twice, the second finds the lock gone, or someone else's, and touches nothing.
        let pending = ReleasePending(Some(&self));
        let release = crate::backend::release_and_wake(&*self.backend, &self.op);
        let result = match crate::backend::timed(self.config.op_timeout(), release).await {
            Ok(result) => result,
            Err(_) => Err(LockError::timeout(
                self.op.name.as_str(),
                false,
                self.config.op_timeout(),
            )),
        };
        pending.answered();
        result
    }

    /// Releases in a task (a compare-and-delete with a deadline), never blocking. Without a
    /// runtime the lease is the backstop.
    fn release_in_background(&self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let task = self.backend.waiters().task();
            let release =
                watchdog::release(self.backend.clone(), self.op.clone(), self.config.clone());
            runtime.spawn(async move {
                release.await;
                drop(task);
            });
        }
    }

    /// Stops watching the lease without releasing, and marks the lease as over.
    pub(crate) fn disarm(&mut self) {
        if let Some(hold) = self.hold.take() {
            self.watchdog.unregister(&hold);
        }
        self.lease.shared().set_lost(LossReason::Released);
    }

    pub(crate) fn op(&self) -> &Op {
        &self.op
    }

    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(hold) = self.hold.take() else { return };
        self.watchdog.unregister(&hold);
        self.lease.shared().set_lost(LossReason::Released);
        self.release_in_background();
    }
}

/// An explicit release not answered yet: dropped before [`answered`](Self::answered), it
/// releases in the background.
struct ReleasePending<'a>(Option<&'a LockGuard>);

impl ReleasePending<'_> {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for ReleasePending<'_> {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            guard.release_in_background();
        }
    }
}
