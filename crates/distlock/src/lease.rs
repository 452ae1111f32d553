//! What a holder can prove about its lease, and the signal when it no longer can.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::{LockError, LockName, LossReason};

/// Instants are stored as nanoseconds after this one, so that they fit an atomic.
static EPOCH: LazyLock<Instant> = LazyLock::new(crate::clock::now);

fn to_nanos(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(*EPOCH).as_nanos()).unwrap_or(u64::MAX)
}

fn from_nanos(nanos: u64) -> Instant {
    *EPOCH + Duration::from_nanos(nanos)
}

const HELD: u8 = 0;

fn encode(reason: LossReason) -> u8 {
    match reason {
        LossReason::Expired => 1,
        LossReason::NotOwner => 2,
        LossReason::HoldLimit => 3,
        LossReason::Released => 4,
    }
}

fn decode(code: u8) -> Option<LossReason> {
    match code {
        1 => Some(LossReason::Expired),
        2 => Some(LossReason::NotOwner),
        3 => Some(LossReason::HoldLimit),
        4 => Some(LossReason::Released),
        _ => None,
    }
}

#[derive(Debug)]
pub(crate) struct LeaseShared {
    name: LockName,
    fence: u64,
    valid_until: AtomicU64,
    lost: AtomicU8,
    notify: Notify,
}

impl LeaseShared {
    pub(crate) fn new(name: LockName, fence: u64, valid_until: Instant) -> Arc<Self> {
        Arc::new(LeaseShared {
            name,
            fence,
            valid_until: AtomicU64::new(to_nanos(valid_until)),
            lost: AtomicU8::new(HELD),
            notify: Notify::new(),
        })
    }

    pub(crate) fn valid_until(&self) -> Instant {
        from_nanos(self.valid_until.load(Ordering::Acquire))
    }

    /// Records a confirmed renewal; ignored once the lease was declared lost.
    pub(crate) fn renewed(&self, valid_until: Instant) {
        if self.loss().is_none() {
            self.valid_until
                .store(to_nanos(valid_until), Ordering::Release);
        }
    }

    /// Declares the lease lost; the first reason sticks. Returns whether this call set it.
    pub(crate) fn set_lost(&self, reason: LossReason) -> bool {
        let set = self
            .lost
            .compare_exchange(HELD, encode(reason), Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if set {
            self.notify.notify_waiters();
        }
        set
    }

    pub(crate) fn loss(&self) -> Option<LossReason> {
        decode(self.lost.load(Ordering::Acquire))
    }

    /// Resolves when the lease is declared lost.
    pub(crate) async fn wait_lost(&self) -> LossReason {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = self.loss() {
                return reason;
            }
            notified.await;
        }
    }
}

/// A cheap, cloneable view of a held lease: its fencing token, whether it can still be proven
/// held, and a future that resolves when it no longer can.
///
/// Hand it to the code doing the protected work, so that work can stop (or refuse to write)
/// as soon as the lock is lost, instead of finding out at release time.
///
/// A lease counts as held until `sent + lease - drift`, where `sent` is when the last successful
/// acquisition or renewal was *sent* (measured with [`Instant`], never the wall clock). The loss
/// signal fires at that instant if no later renewal was confirmed, immediately if a renewal
/// finds the lock owned by someone else, and when the hold cap is reached.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// let client = distlock::LockClient::memory();
/// let guard = client.lock("report")?.try_acquire().await?;
/// let lease = guard.lease();
/// let work = tokio::spawn(async move {
///     tokio::select! {
///         reason = lease.lost() => Err(reason),
///         _ = tokio::time::sleep(std::time::Duration::from_millis(10)) => Ok(lease.fence()),
///     }
/// });
/// assert_eq!(work.await.unwrap(), Ok(guard.fence()));
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    shared: Arc<LeaseShared>,
}

impl LeaseWatch {
    pub(crate) fn new(shared: Arc<LeaseShared>) -> Self {
        LeaseWatch { shared }
    }

    pub(crate) fn shared(&self) -> &Arc<LeaseShared> {
        &self.shared
    }

    /// The fencing token of this hold: strictly greater than every earlier holder's of this lock.
    /// Pass it with every write to the protected resource, and have the resource reject a token
    /// lower than one it has already seen.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let lock = distlock::LockClient::memory().lock("job")?;
    /// let first = lock.try_acquire().await?;
    /// let f1 = first.lease().fence();
    /// first.release().await?;
    /// let second = lock.try_acquire().await?;
    /// assert!(second.lease().fence() > f1);
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> u64 {
        self.shared.fence
    }

    /// The lock name.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert_eq!(guard.lease().name(), "job");
    /// # Ok(()) }
    /// ```
    pub fn name(&self) -> &str {
        self.shared.name.as_str()
    }

    /// Whether the lease can be proven held right now: no loss was signalled and the last
    /// confirmed lease has not run out (checked against the clock, even if the watchdog is late).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// let lease = guard.lease();
    /// assert!(lease.is_held());
    /// guard.release().await?;
    /// assert!(!lease.is_held());
    /// # Ok(()) }
    /// ```
    pub fn is_held(&self) -> bool {
        self.shared.loss().is_none() && crate::clock::now() < self.shared.valid_until()
    }

    /// How much longer the lease is proven held, or `None` if it is not.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert!(guard.lease().remaining().unwrap() <= guard.config().lease());
    /// # Ok(()) }
    /// ```
    pub fn remaining(&self) -> Option<Duration> {
        if self.shared.loss().is_some() {
            return None;
        }
        self.shared
            .valid_until()
            .checked_duration_since(crate::clock::now())
            .filter(|d| !d.is_zero())
    }

    /// The end of the lease as last proven: `sent + lease - drift` of the last confirmed
    /// acquisition or renewal (later renewals move it). Past it the lease is not held, whatever
    /// the watchdog has or has not noticed; a loss for another reason ([`LossReason::NotOwner`],
    /// [`LossReason::Released`]) can end the lease earlier.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// assert!(guard.lease().valid_until() > std::time::Instant::now());
    /// # Ok(()) }
    /// ```
    pub fn valid_until(&self) -> Instant {
        self.shared.valid_until()
    }

    /// Why the lease was lost, if it was.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// let lease = guard.lease();
    /// assert_eq!(lease.loss(), None);
    /// guard.release().await?;
    /// assert_eq!(lease.loss(), Some(distlock::LossReason::Released));
    /// # Ok(()) }
    /// ```
    pub fn loss(&self) -> Option<LossReason> {
        self.shared.loss()
    }

    /// `Ok` while the lease is proven held, else [`LockError::LeaseLost`]: call it before every
    /// side effect the lock protects.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let guard = distlock::LockClient::memory().lock("job")?.try_acquire().await?;
    /// guard.lease().check()?;
    /// # Ok(()) }
    /// ```
    pub fn check(&self) -> Result<(), LockError> {
        if self.is_held() {
            return Ok(());
        }
        Err(LockError::LeaseLost {
            name: self.name().to_owned(),
            reason: self.loss().unwrap_or(LossReason::Expired),
        })
    }

    /// Resolves when the lease is lost (or released), with the reason.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// let config = distlock::LockConfig::builder()
    ///     .lease(Duration::from_millis(60))
    ///     .watchdog(false)
    ///     .build()?;
    /// let client = distlock::LockClient::builder().config(config).memory(Default::default());
    /// let guard = client.lock("job")?.try_acquire().await?;
    /// // Without renewal the lease runs out; the signal fires at sent + lease - drift.
    /// assert_eq!(guard.lease().lost().await, distlock::LossReason::Expired);
    /// # Ok(()) }
    /// ```
    pub async fn lost(&self) -> LossReason {
        self.shared.wait_lost().await
    }
}
