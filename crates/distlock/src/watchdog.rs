//! The task that lives beside every guard: renews the lease, fires the loss signal at the exact
//! instant the lease can no longer be proven held, and releases the lock when the guard is dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until, timeout};

use crate::backend::{Backend, Op};
use crate::lease::LeaseShared;
use crate::{Backoff, LockConfig, LossReason};

/// What the guard tells its watchdog when it goes.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The guard released (or completed) the lock itself: just stop.
    Quiet,
}

/// Starts the watchdog of one hold. Dropping the returned sender (dropping the guard) makes the
/// watchdog release the lock, best effort, within one command timeout; the lease is the backstop.
pub(crate) fn spawn(
    backend: Arc<dyn Backend>,
    op: Op,
    shared: Arc<LeaseShared>,
    config: Arc<LockConfig>,
    acquired: std::time::Instant,
) -> oneshot::Sender<Stop> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(run(backend, op, shared, config, acquired.into(), rx));
    tx
}

async fn run(
    backend: Arc<dyn Backend>,
    op: Op,
    shared: Arc<LeaseShared>,
    config: Arc<LockConfig>,
    acquired: Instant,
    mut stop: oneshot::Receiver<Stop>,
) {
    let cap = config.max_hold().map(|c| acquired + c);
    let mut next_renewal = acquired + config.renew_every();
    let mut renewing = config.watchdog();
    let mut capped = false;
    let mut retry = Backoff::new(
        config.renew_every() / 8 + Duration::from_millis(1),
        config.renew_every() / 2,
    );
    // Once the lease is lost only the first branch stays enabled: wait for the guard to go.
    loop {
        let valid_until: Instant = shared.valid_until().into();
        let lost = shared.loss().is_some();
        tokio::select! {
            biased;
            message = &mut stop => {
                if message.is_err() {
                    release(&*backend, &op, &config).await;
                }
                return;
            }
            () = sleep_until(valid_until), if !lost => {
                let reason = if capped { LossReason::HoldLimit } else { LossReason::Expired };
                if shared.set_lost(reason) {
                    tracing::warn!(lock = op.name.as_str(), %reason, "lease lost");
                }
            }
            () = sleep_until(next_renewal), if renewing && !lost => {
                let sent = Instant::now();
                let lease = match cap {
                    None => config.lease(),
                    Some(cap) => config.lease().min(cap.saturating_duration_since(sent)),
                };
                if lease <= config.drift() * 2 {
                    // The cap leaves no useful lease: stop renewing and let it run out.
                    renewing = false;
                    capped = true;
                    continue;
                }
                let outcome = tokio::select! {
                    biased;
                    message = &mut stop => {
                        if message.is_err() {
                            release(&*backend, &op, &config).await;
                        }
                        return;
                    }
                    () = sleep_until(valid_until) => None,
                    outcome = timeout(config.op_timeout(), backend.extend(&op, lease)) => Some(outcome),
                };
                match outcome {
                    // The lease ran out while the renewal was in flight; the next turn fires it.
                    None => {}
                    Some(Ok(Ok(true))) => {
                        shared.renewed((sent + lease - config.drift()).into_std());
                        if cap.is_some_and(|cap| sent + lease >= cap) {
                            capped = true;
                            renewing = false;
                        }
                        next_renewal = sent + config.renew_every();
                        retry.reset();
                    }
                    Some(Ok(Ok(false))) if shared.set_lost(LossReason::NotOwner) => {
                        tracing::warn!(lock = op.name.as_str(), "lease lost: the lock is no longer ours");
                    }
                    Some(Ok(Ok(false))) => {}
                    Some(Ok(Err(error))) => {
                        tracing::debug!(lock = op.name.as_str(), %error, "renewal failed, retrying");
                        next_renewal = Instant::now() + retry.next_delay();
                    }
                    Some(Err(_)) => {
                        tracing::debug!(lock = op.name.as_str(), "renewal timed out, retrying");
                        next_renewal = Instant::now() + retry.next_delay();
                    }
                }
            }
        }
    }
}

/// Best-effort compare-and-delete with a deadline. Never deletes someone else's lock.
pub(crate) async fn release(backend: &dyn Backend, op: &Op, config: &LockConfig) {
    match timeout(
        config.op_timeout(),
        crate::backend::release_and_wake(backend, op),
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
