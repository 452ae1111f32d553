//! Lease renewal and the loss signal for every guard of one client, driven by one task.
//!
//! A guard registers its lease; the task keeps one event per lease in a queue ordered by time:
//! the next renewal, or the end of the lease as last proven (`sent + lease - drift`) while a
//! renewal is in flight or renewals have stopped. At a renewal event it sends the renewal in a
//! task of its own (so a slow store never delays other leases); at the end of a lease it fires
//! the loss signal, to the instant, whether or not a renewal is still in flight. A guard that
//! goes away takes its event out of the queue, so a released lock costs nothing more.
//!
//! Registering a lease costs a map insertion under a mutex, with no task spawned and no timer
//! armed: the task sleeps until the earliest event, and is woken only when a new lease needs
//! attention before that. With nothing due, it sleeps for half the shortest delay from an
//! acquisition to its first event seen so far (at most a second): a new lease's first event then
//! comes after the task's wake-up, and an idle client wakes it about once a second.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::time::timeout;

use crate::backend::{Backend, Op};
use crate::lease::LeaseShared;
use crate::{Backoff, LockConfig, LossReason};

/// The longest the task sleeps when it has nothing due earlier (a backstop).
const IDLE_MAX: Duration = Duration::from_secs(1);
/// The shortest: what it sleeps with leases whose first event comes within twice this.
const IDLE_MIN: Duration = Duration::from_millis(50);

/// One client's watchdog. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct Watchdog {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    queue: Mutex<Queue>,
    /// Shared with the task, which must not keep the rest alive while it sleeps.
    wake: Arc<Notify>,
    /// The task, to start it again if its runtime went away.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// When the task will next look at the queue, in nanoseconds after `base` (0: not asleep).
    asleep_until: AtomicU64,
    /// How long the task sleeps when nothing is due earlier, in nanoseconds (0: [`IDLE_MAX`]):
    /// half the shortest delay from an acquisition to its lease's first event seen so far,
    /// within [`IDLE_MIN`, `IDLE_MAX`]. A new lease's first event then comes after the task's
    /// wake-up and does not wake it, and an idle client's task wakes about once a second
    /// (with the default lease) instead of 20 times.
    idle: AtomicU64,
    /// How many times the task looked at the queue.
    #[cfg(test)]
    rounds: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    events: BTreeMap<(Instant, u64), Arc<Hold>>,
    next_id: u64,
}

/// One registered lease.
#[derive(Debug)]
pub(crate) struct Hold {
    id: u64,
    watchdog: Weak<Inner>,
    backend: Arc<dyn Backend>,
    op: Op,
    config: Arc<LockConfig>,
    lease: Arc<LeaseShared>,
    /// The instant the hold cap is reached, if there is a cap.
    cap: Option<Instant>,
    state: Mutex<HoldState>,
}

#[derive(Debug)]
struct HoldState {
    /// The queue entry of this hold, if any.
    event: Option<(Instant, u64)>,
    next_renewal: Instant,
    renewing: bool,
    in_flight: bool,
    capped: bool,
    done: bool,
    retry: Backoff,
}

fn base() -> Instant {
    static BASE: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(crate::clock::now);
    *BASE
}

fn nanos(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(base()).as_nanos()).unwrap_or(u64::MAX)
}

impl Watchdog {
    /// Registers a lease acquired (sent) at `acquired`: renewed while it lives (if the config
    /// says so) and declared lost at the end of its proven validity.
    pub(crate) fn register(
        &self,
        backend: Arc<dyn Backend>,
        op: Op,
        config: Arc<LockConfig>,
        lease: Arc<LeaseShared>,
        acquired: Instant,
    ) -> Arc<Hold> {
        let renew_every = config.renew_every();
        let mut queue = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.next_id += 1;
        let hold = Arc::new(Hold {
            id: queue.next_id,
            watchdog: Arc::downgrade(&self.inner),
            cap: config.max_hold().and_then(|c| acquired.checked_add(c)),
            state: Mutex::new(HoldState {
                event: None,
                next_renewal: acquired + renew_every,
                renewing: config.watchdog(),
                in_flight: false,
                capped: false,
                done: false,
                retry: Backoff::new(renew_every / 8 + Duration::from_millis(1), renew_every / 2),
            }),
            backend,
            op,
            config,
            lease,
        });
        let at = {
            let mut state = hold.state.lock().unwrap_or_else(|e| e.into_inner());
            let at = state.next_event(&hold);
            schedule(&mut queue, &hold, &mut state, at);
            at
        };
        drop(queue);
        let idle = (at.saturating_duration_since(acquired) / 2).clamp(IDLE_MIN, IDLE_MAX);
        let idle = u64::try_from(idle.as_nanos()).unwrap_or(u64::MAX);
        // Lowered, never raised (0 stands for the longest sleep: `fetch_min` would keep it).
        let _ = (self.inner.idle).fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
            (now == 0 || idle < now).then_some(idle)
        });
        self.ensure_running();
        wake_if_before(&self.inner, at);
        hold
    }

    /// Stops watching a hold (released, completed or dropped).
    pub(crate) fn unregister(&self, hold: &Hold) {
        let mut queue = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = hold.state.lock().unwrap_or_else(|e| e.into_inner());
        state.done = true;
        if let Some(event) = state.event.take() {
            queue.events.remove(&event);
        }
    }

    /// How many times the task looked at the queue.
    #[cfg(test)]
    pub(crate) fn rounds(&self) -> u64 {
        self.inner.rounds.load(Ordering::Relaxed)
    }

    /// How long the task sleeps when nothing is due earlier.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> Duration {
        Duration::from_nanos(idle_nanos(&self.inner))
    }

    fn ensure_running(&self) {
        let mut task = self.inner.task.lock().unwrap_or_else(|e| e.into_inner());
        if task
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
        {
            *task = Some(tokio::spawn(run(Arc::downgrade(&self.inner))));
        }
    }
}

/// How long the task sleeps when nothing is due earlier (see [`Inner::idle`]), in nanoseconds.
fn idle_nanos(inner: &Inner) -> u64 {
    match inner.idle.load(Ordering::Relaxed) {
        0 => u64::try_from(IDLE_MAX.as_nanos()).unwrap_or(u64::MAX),
        idle => idle,
    }
}

/// Wakes the task if it sleeps past `at`.
fn wake_if_before(inner: &Inner, at: Instant) {
    let asleep_until = inner.asleep_until.load(Ordering::Acquire);
    if asleep_until == 0 || nanos(at) < asleep_until {
        inner.wake.notify_one();
    }
}

impl HoldState {
    /// The next instant this hold needs attention.
    fn next_event(&self, hold: &Hold) -> Instant {
        let valid_until = hold.lease.valid_until();
        if self.renewing && !self.in_flight {
            self.next_renewal.min(valid_until)
        } else {
            valid_until
        }
    }
}

/// Puts the hold's single event at `at`.
fn schedule(queue: &mut Queue, hold: &Arc<Hold>, state: &mut HoldState, at: Instant) {
    if let Some(old) = state.event.take() {
        queue.events.remove(&old);
    }
    if !state.done {
        queue.events.insert((at, hold.id), hold.clone());
        state.event = Some((at, hold.id));
    }
}

async fn run(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        #[cfg(test)]
        strong.rounds.fetch_add(1, Ordering::Relaxed);
        let now = crate::clock::now();
        let mut due = Vec::new();
        let next = {
            let mut queue = strong.queue.lock().unwrap_or_else(|e| e.into_inner());
            while let Some(entry) = queue.events.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            queue.events.first_key_value().map(|(k, _)| k.0)
        };
        for hold in due {
            attend(&strong, &hold, now);
        }
        let idle = now + Duration::from_nanos(idle_nanos(&strong));
        let wake_at = next.map_or(idle, |next| next.min(idle));
        let wake = strong.wake.clone();
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        strong
            .asleep_until
            .store(nanos(wake_at).max(1), Ordering::Release);
        // Anything scheduled meanwhile before `wake_at` has notified, and `notified` was enabled
        // before `asleep_until` was published: nothing is missed.
        let recheck = {
            let queue = strong.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue
                .events
                .first_key_value()
                .is_some_and(|(k, _)| k.0 < wake_at)
        };
        drop(strong);
        if !recheck {
            tokio::select! {
                () = tokio::time::sleep_until(wake_at.into()) => {}
                () = &mut notified => {}
            }
        }
        if let Some(strong) = inner.upgrade() {
            strong.asleep_until.store(0, Ordering::Release);
        }
    }
}

/// A hold's event is due: fire the loss signal, or start a renewal, or reschedule.
fn attend(inner: &Inner, hold: &Arc<Hold>, now: Instant) {
    let mut queue = inner.queue.lock().unwrap_or_else(|e| e.into_inner());
    let mut state = hold.state.lock().unwrap_or_else(|e| e.into_inner());
    state.event = None;
    if state.done {
        return;
    }
    let valid_until = hold.lease.valid_until();
    if now >= valid_until {
        let reason = if state.capped {
            LossReason::HoldLimit
        } else {
            LossReason::Expired
        };
        if hold.lease.set_lost(reason) {
            tracing::warn!(lock = hold.op.name.as_str(), %reason, "lease lost");
        }
        return;
    }
    if state.renewing && !state.in_flight && now >= state.next_renewal {
        let config = &hold.config;
        let lease = match hold.cap {
            None => config.lease(),
            // Whole milliseconds, as Redis keeps them: the lease counted here is the one set.
            Some(cap) => whole_millis(config.lease().min(cap.saturating_duration_since(now))),
        };
        if lease <= config.drift() * 2 {
            // The cap leaves no useful lease: stop renewing and let this one run out.
            state.renewing = false;
            state.capped = true;
        } else {
            state.in_flight = true;
            tokio::spawn(renew(hold.clone(), lease, now));
        }
    }
    let at = state.next_event(hold);
    schedule(&mut queue, hold, &mut state, at);
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Sends one renewal, then records its outcome and schedules the hold's next event.
async fn renew(hold: Arc<Hold>, lease: Duration, sent: Instant) {
    let config = hold.config.clone();
    let outcome = timeout(config.op_timeout(), hold.backend.extend(&hold.op, lease)).await;
    let Some(watchdog) = hold.watchdog.upgrade() else {
        return;
    };
    let at = {
        let mut queue = watchdog.queue.lock().unwrap_or_else(|e| e.into_inner());
        let mut state = hold.state.lock().unwrap_or_else(|e| e.into_inner());
        state.in_flight = false;
        if state.done {
            return;
        }
        match outcome {
            Ok(Ok(true)) => {
                hold.lease.renewed(sent + lease - config.drift());
                state.next_renewal = sent + config.renew_every();
                state.retry.reset();
                // (The capped lease was cut to whole milliseconds: within one of the cap is at it.)
                if hold
                    .cap
                    .is_some_and(|cap| sent + lease + Duration::from_millis(1) > cap)
                {
                    state.renewing = false;
                    state.capped = true;
                }
            }
            Ok(Ok(false)) => {
                if hold.lease.set_lost(LossReason::NotOwner) {
                    tracing::warn!(
                        lock = hold.op.name.as_str(),
                        "lease lost: the lock is no longer ours"
                    );
                }
                if let Some(event) = state.event.take() {
                    queue.events.remove(&event);
                }
                return;
            }
            Ok(Err(error)) => {
                tracing::debug!(lock = hold.op.name.as_str(), %error, "renewal failed, retrying");
                state.next_renewal = crate::clock::now() + state.retry.next_delay();
            }
            Err(_) => {
                tracing::debug!(lock = hold.op.name.as_str(), "renewal timed out, retrying");
                state.next_renewal = crate::clock::now() + state.retry.next_delay();
            }
        }
        if hold.lease.loss().is_some() {
            if let Some(event) = state.event.take() {
                queue.events.remove(&event);
            }
            return;
        }
        let at = state.next_event(&hold);
        schedule(&mut queue, &hold, &mut state, at);
        at
    };
    wake_if_before(&watchdog, at);
}

/// Best-effort compare-and-delete with a deadline, for a guard that was dropped. Never deletes
/// someone else's lock; the lease is the backstop if the store cannot be reached.
pub(crate) async fn release(backend: Arc<dyn Backend>, op: Op, config: Arc<LockConfig>) {
    match timeout(
        config.op_timeout(),
        crate::backend::release_and_wake(&*backend, &op),
    )
    .await
    {
        Ok(Ok(held)) => {
            tracing::debug!(
                lock = op.name.as_str(),
                still_held = held,
                "released on drop"
            );
        }
        Ok(Err(error)) => {
            tracing::debug!(lock = op.name.as_str(), %error, "release on drop failed; the lease will expire");
        }
        Err(_) => {
            tracing::debug!(
                lock = op.name.as_str(),
                "release on drop timed out; the lease will expire"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{LockClient, LockConfig};

    /// A held lock with the default lease (renewed every 3.3 s) keeps the task asleep between
    /// its renewals, apart from a wake-up a second at most: it used to look at the queue every
    /// 50 ms (600 times in these 30 s), each a wake-up of an idle worker. And every renewal
    /// still happens: the lease outlives 30 s, three times its length.
    #[tokio::test(start_paused = true)]
    async fn an_idle_task_wakes_for_renewals_not_on_a_tick() {
        let client = LockClient::memory();
        let guard = client.lock("idle").unwrap().try_acquire().await.unwrap();
        let start = client.watchdog().rounds();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let rounds = client.watchdog().rounds() - start;
        assert!(
            guard.is_held(),
            "the lease was renewed through 30 s (3 leases)"
        );
        assert!(
            (9..=45).contains(&rounds),
            "the task looked at the queue {rounds} times in 30 s: at most once a second plus \
             the renewals' events, not every 50 ms (600)"
        );
        assert_eq!(
            LockConfig::default().renew_every(),
            Duration::from_secs(10) / 3
        );
    }

    /// A lease renewed more often than the task's idle sleep still gets every renewal on time:
    /// its registration lowers the sleep (to half its first renewal's delay, at least 50 ms, so
    /// that the next such lease does not wake the task), and a new lease due before the
    /// wake-up wakes it.
    #[tokio::test(start_paused = true)]
    async fn short_leases_are_renewed_on_time() {
        let config = LockConfig::builder()
            .lease(Duration::from_millis(300))
            .build()
            .unwrap();
        let client = LockClient::memory().with_config(config).unwrap();
        assert_eq!(client.watchdog().idle(), Duration::from_secs(1));
        let guard = client.lock("short").unwrap().try_acquire().await.unwrap();
        assert_eq!(
            client.watchdog().idle(),
            Duration::from_millis(50),
            "a lease renewed every 100 ms lowers the idle sleep"
        );
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(guard.is_held(), "a 300 ms lease renewed through 3 s");
    }
}
