//! A lock handle, and the acquisition machinery every lock kind shares: one attempt with its
//! ambiguity cleanup, and waiting by notification with a polling fallback.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Attempt, Backend, Mode, Op};
use crate::clock;
use crate::{Backoff, LockClient, LockConfig, LockError, LockGuard, LockName, OwnerId, Token};

/// A named lock. Cheap to clone; make one per name and acquire it as often as needed.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use std::time::Duration;
/// let client = distlock::LockClient::memory();
/// let lock = client.lock("nightly-report")?;
/// let guard = lock.acquire(Duration::from_secs(30)).await?;
/// // ... work, passing guard.fence() to every write ...
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Lock {
    client: LockClient,
    name: LockName,
    owner: Option<OwnerId>,
    config: Arc<LockConfig>,
}

impl Lock {
    pub(crate) fn new(client: LockClient, name: LockName, owner: Option<OwnerId>) -> Self {
        let config = client.shared_config();
        Lock {
            client,
            name,
            owner,
            config,
        }
    }

    /// The same lock with other timing.
    ///
    /// # Errors
    /// If the store cannot honour `config` (see [`LockClient::with_config`]).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let short = distlock::LockConfig::builder().lease(Duration::from_secs(2)).build()?;
    /// let lock = distlock::LockClient::memory().lock("job")?.with_config(short)?;
    /// assert_eq!(lock.config().lease(), Duration::from_secs(2));
    /// # Ok(()) }
    /// ```
    pub fn with_config(mut self, config: LockConfig) -> Result<Self, crate::ConfigError> {
        self.client.backend().check_config(&config)?;
        self.config = Arc::new(config);
        Ok(self)
    }

    /// The lock name and its keys.
    ///
    /// ```
    /// let lock = distlock::LockClient::memory().lock("job").unwrap();
    /// assert_eq!(lock.name().lock_key(), "distlock:{job}");
    /// ```
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// The timing this lock runs with.
    ///
    /// ```
    /// let lock = distlock::LockClient::memory().lock("job").unwrap();
    /// assert_eq!(lock.config(), &distlock::LockConfig::default());
    /// ```
    pub fn config(&self) -> &LockConfig {
        &self.config
    }

    fn op(&self) -> Op {
        Op {
            name: self.name.clone(),
            token: Token::random(),
            lease: self.config.lease(),
            drift: self.config.drift(),
            fencing: self.config.fencing(),
            state_ttl: self.config.fence_ttl(),
            mode: match &self.owner {
                Some(owner) => Mode::Reentrant {
                    owner: owner.clone(),
                },
                None => Mode::Exclusive,
            },
        }
    }

    /// One attempt: the lock if it is free (or, for a reentrant lock, held by the same owner).
    ///
    /// # Errors
    /// [`LockError::Held`] if another owner holds it; [`LockError::Unavailable`] if the store
    /// could not be reached (a cleanup is sent when the attempt may have succeeded).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let lock = distlock::LockClient::memory().lock("job")?;
    /// let _guard = lock.try_acquire().await?;
    /// match lock.try_acquire().await {
    ///     Err(distlock::LockError::Held { retry_after, .. }) => assert!(retry_after.is_some()),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn try_acquire(&self) -> Result<LockGuard, LockError> {
        self.acquire_with(None).await
    }

    /// Waits up to `wait` for the lock: woken by release notifications, backed by polling with
    /// exponential backoff and full jitter (capped by the holder's remaining lease, so a crashed
    /// holder's lock is taken as soon as it expires).
    ///
    /// # Errors
    /// [`LockError::WaitTimeout`] when `wait` passes; [`LockError::Unavailable`] as soon as the
    /// store cannot be reached (not at the deadline).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// let lock = distlock::LockClient::memory().lock("job")?;
    /// let first = lock.try_acquire().await?;
    /// let waiter = tokio::spawn({
    ///     let lock = lock.clone();
    ///     async move { lock.acquire(Duration::from_secs(5)).await.map(|g| g.fence()) }
    /// });
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// first.release().await?;
    /// assert_eq!(waiter.await.unwrap()?, 2);
    /// # Ok(()) }
    /// ```
    pub async fn acquire(&self, wait: Duration) -> Result<LockGuard, LockError> {
        self.acquire_with(Some(clock::after(clock::now(), wait)))
            .await
    }

    async fn acquire_with(&self, deadline: Option<Instant>) -> Result<LockGuard, LockError> {
        let started = clock::now();
        let mut op = self.op();
        let backend = self.client.backend();
        let (attempt, sent) =
            acquire_until(backend, &mut op, &self.config, deadline, false).await?;
        match attempt {
            Attempt::Acquired { fence } => Ok(LockGuard::start(
                self.client.watchdog(),
                backend.clone(),
                op,
                self.config.clone(),
                fence,
                sent,
            )),
            Attempt::Held { ttl, .. } => Err(match deadline {
                None => LockError::Held {
                    name: self.name.as_str().to_owned(),
                    retry_after: ttl,
                },
                Some(_) => LockError::WaitTimeout {
                    name: self.name.as_str().to_owned(),
                    waited: started.elapsed(),
                },
            }),
            Attempt::Done { .. } => Err(LockError::protocol(
                self.name.as_str(),
                "a completion record on a plain lock",
            )),
        }
    }
}

/// One acquisition attempt with a timeout. Returns the attempt and when it was sent. If the
/// attempt may have succeeded without our knowing (timeout, broken connection, or the caller
/// dropping this future while the command was in flight), a release with the attempt's token is
/// sent in the background, and an error says so.
pub(crate) async fn attempt(
    backend: &Arc<dyn Backend>,
    op: &Op,
    config: &LockConfig,
) -> Result<(Attempt, Instant), LockError> {
    let sent = clock::now();
    // Armed while the command is in flight: a caller that gives up (drops this future) after the
    // command was sent may have taken the lock, and must not leave it held for a whole lease.
    let mut in_flight = CleanupOnDrop {
        backend,
        op,
        config,
        sent,
        armed: true,
    };
    let outcome = crate::backend::timed(config.op_timeout(), backend.acquire(op)).await;
    in_flight.armed = false;
    let handled = clock::now();
    let error = match outcome {
        // Taken, but handled when its lease can no longer be proven (the process stalled
        // between the store's answer and here, so the timeout could not fire): a guard already
        // lost is never handed out, and on one Redis its fence, drawn behind the `SET`, may
        // have been drawn after the lease ended (see `RedisBackend::acquire_plain`). Cleaned
        // up like a timeout.
        Ok(Ok(Attempt::Acquired { .. })) if handled >= sent + op.lease - config.drift() => {
            LockError::late(op.name.as_str(), handled - sent)
        }
        Ok(Ok(attempt)) => return Ok((attempt, sent)),
        Ok(Err(error)) => error,
        Err(_) => LockError::timeout(op.name.as_str(), true, config.op_timeout()),
    };
    if let LockError::Unavailable {
        ambiguous: true, ..
    } = error
    {
        spawn_cleanup(backend.clone(), op.clone(), config.clone(), sent);
    }
    Err(error)
}

/// Sends the ambiguity cleanup of an attempt whose future was dropped mid-flight.
struct CleanupOnDrop<'a> {
    backend: &'a Arc<dyn Backend>,
    op: &'a Op,
    config: &'a LockConfig,
    sent: Instant,
    armed: bool,
}

impl Drop for CleanupOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::debug!(
                lock = self.op.name.as_str(),
                "acquisition dropped in flight; cleaning up"
            );
            spawn_cleanup(
                self.backend.clone(),
                self.op.clone(),
                self.config.clone(),
                self.sent,
            );
        }
    }
}

/// Releases a lock an ambiguous attempt may have taken, retrying with backoff until the lease
/// it would have had is over (after that, expiry did the job). Without a runtime (the caller's
/// runtime is shutting down) the lease is the backstop.
fn spawn_cleanup(backend: Arc<dyn Backend>, op: Op, config: LockConfig, sent: Instant) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let until = sent + op.lease;
    let task = backend.waiters().task();
    runtime.spawn(async move {
        let _task = task;
        let mut backoff = Backoff::new(config.retry_base(), config.retry_max());
        loop {
            match tokio::time::timeout(config.op_timeout(), backend.release(&op)).await {
                Ok(Ok(released)) => {
                    tracing::debug!(
                        lock = op.name.as_str(),
                        released,
                        "ambiguous acquisition cleaned up"
                    );
                    // The lock was taken and is free again: wake the next waiter of this
                    // client as a release would (a client without pub/sub hears no
                    // announcement; one with it hears this token as already heard).
                    if released {
                        crate::backend::wake_next(&*backend, &op);
                    }
                    return;
                }
                _ if clock::now() >= until => return,
                _ => tokio::time::sleep(backoff.next_delay()).await,
            }
        }
    });
}

/// Attempts until the lock is taken (or completed), or until `deadline` (a single attempt when
/// `None`). Returns the last attempt: `Held` means the deadline passed, or (run-once) that the
/// holder is streaming its record (`parts > 0`), which a waiting duplicate can follow live.
///
/// Every attempt after the first draws a new token into `op` (the caller's guard takes the
/// one that won). A failed attempt can leave its token announced as released (Redlock rolls a
/// split vote back on the nodes it won, and the rollback announces itself), and announcements
/// already heard wake no one: with the same token, the release of a later winning attempt would
/// wake none of this client's waiters.
pub(crate) async fn acquire_until(
    backend: &Arc<dyn Backend>,
    op: &mut Op,
    config: &LockConfig,
    deadline: Option<Instant>,
    follow: bool,
) -> Result<(Attempt, Instant), LockError> {
    // Timers and the watchdog's task are Tokio's: under another executor, say so rather than
    // panic inside them.
    if !crate::clock::on_tokio() {
        return Err(LockError::Config(crate::ConfigError::invalid(
            "runtime",
            "locks run on Tokio: acquire inside a Tokio runtime (#[tokio::main], or Runtime::enter)",
        )));
    }
    let Some(deadline) = deadline else {
        return attempt(backend, op, config).await;
    };
    // A run-once waiter that follows records live also wakes on the holder's progress: its
    // first part ends the wait. (One that waits for the record waits through the parts.)
    let once = follow && matches!(op.mode, Mode::Once { .. });
    let mut waiter = None;
    let mut backoff = Backoff::new(config.retry_base(), config.retry_max());
    // Woken by a release, and the attempt that followed found the lock still held. A local
    // release wakes its waiter as soon as it is sent (`release_and_wake`); should the release
    // reach the store after that waiter's attempt (a reconnect, a script reloaded), its
    // announcement wakes no one (the waiter counts it as heard): look again after the shortest
    // delay, whether or not this lock polls.
    let mut woken = false;
    let mut unspent = Unspent {
        backend,
        name: op.name.clone(),
        armed: false,
    };
    if backend.waiters().has_acquirers(op.name.channel()) {
        // Others in this client already wait for this lock: queue behind them (releases wake
        // waiters in arrival order) instead of barging past them with an attempt of our own.
        let mut registered = backend.waiters().register(op.name.channel());
        // Releases in this client wake the next waiter directly, so wait for that (with the
        // longest polling delay as the fallback).
        let left = deadline.saturating_duration_since(clock::now());
        woken = tokio::time::timeout(config.retry_max().min(left), registered.woken(once))
            .await
            .is_ok();
        registered.mark_seen();
        waiter = Some(registered);
    }
    let (mut last, mut sent) = look(backend, op, config, &mut unspent, woken).await?;
    loop {
        let Attempt::Held { ttl, parts, .. } = &last else {
            return Ok((last, sent));
        };
        if once && *parts > 0 {
            // Woken by the holder's first part, as every such waiter was.
            unspent.armed = false;
            return Ok((last, sent));
        }
        let now = clock::now();
        if now >= deadline {
            return Ok((last, sent));
        }
        let left = deadline - now;
        match &mut waiter {
            None => {
                // Subscribe first, then look again: a release between our attempt and the
                // subscription would otherwise go unnoticed until the next poll.
                let mut registered = backend.waiters().register(op.name.channel());
                registered.subscribed(config.op_timeout().min(left)).await;
                waiter = Some(registered);
            }
            Some(registered) => {
                if woken && backend.rolls_back() {
                    // Woken, and the lock was still held: on Redlock the wake may have been
                    // another client's rolled-back attempt, woken in turn by ours. Back off
                    // before listening again, so that such waiters do not keep each other
                    // trying at the network's pace for as long as the lock is held.
                    tokio::time::sleep(backoff.next_delay().min(left)).await;
                }
                let mut delay = if config.polling() {
                    backoff.next_delay().min(left)
                } else {
                    left
                };
                if let Some(ttl) = ttl {
                    // Wake when the holder's lease ends: a crashed holder sends no release.
                    delay = delay.min(*ttl + Duration::from_millis(1));
                }
                if woken {
                    delay = delay.min(config.retry_base());
                }
                woken = tokio::select! {
                    () = registered.woken(once) => true,
                    () = tokio::time::sleep(delay) => false,
                };
                // Announcements from here on wake the next wait.
                registered.mark_seen();
            }
        }
        op.token = Token::random();
        (last, sent) = look(backend, op, config, &mut unspent, woken).await?;
    }
}

/// One look at the lock by a waiter, `woken` if a release woke it for this one; leaves
/// `unspent` armed while a wake it took may not have been spent (see [`Unspent`]).
async fn look(
    backend: &Arc<dyn Backend>,
    op: &Op,
    config: &LockConfig,
    unspent: &mut Unspent<'_>,
    woken: bool,
) -> Result<(Attempt, Instant), LockError> {
    unspent.armed |= woken;
    let looked = attempt(backend, op, config).await;
    unspent.armed = match &looked {
        Ok((Attempt::Acquired { .. }, _)) => false,
        // Held after a wake: the release may reach the store after this look (a local
        // hand-over runs ahead of it), and its announcement will wake no one; the waiter looks
        // again after the shortest delay. Until then the wake is not spent.
        Ok((Attempt::Held { .. }, _)) => woken,
        Ok((Attempt::Done { .. }, _)) => true,
        // The caller has the error and decides; passing the wake on would hand it round the
        // waiters at the pace of the failure, each one failing in turn.
        Err(_) => false,
    };
    looked
}

/// A wake a waiter took and may not have spent. A release wakes one waiter of its client, and
/// nothing else is coming to wake the others: should the waiter go without spending it on the
/// lock (its caller gave up mid-look or while it waited to look again, as a request whose
/// client left; its deadline came), the wake goes to the next waiter of this client, since the
/// lock may be free. A run-once record found done is passed on too, woken or not: every
/// waiting duplicate wants it, and its completion woke one.
struct Unspent<'a> {
    backend: &'a Arc<dyn Backend>,
    name: LockName,
    armed: bool,
}

impl Drop for Unspent<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.backend.waiters().pass_on(self.name.channel());
        }
    }
}
