//! Local registry of tasks waiting for a lock to be released.
//!
//! One slot per channel, shared by every waiter of that lock in this client; a release wakes one
//! waiter (`notify_one`), not all of them, so a release never starts a stampede. When a backend has a
//! pub/sub feed, the first waiter of a channel subscribes it and the last one unsubscribes it, all
//! over the backend's one shared pub/sub connection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot};

/// A request to the pub/sub task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Subscribe the channel; answer on the sender once the server confirmed (or drop it if the
    /// subscription could not be made).
    Subscribe(String, oneshot::Sender<()>),
    /// No waiter is left on the channel.
    Unsubscribe(String),
}

#[derive(Debug)]
struct Slot {
    notify: Arc<Notify>,
    waiters: usize,
}

/// Waiters by channel.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    slots: Mutex<HashMap<String, Slot>>,
    feed: Option<mpsc::UnboundedSender<Command>>,
}

impl Waiters {
    /// A registry with no remote feed: only local wake-ups (and polling).
    pub(crate) fn local() -> Arc<Self> {
        Arc::new(Waiters::default())
    }

    /// A registry whose subscriptions are forwarded to a pub/sub task.
    pub(crate) fn with_feed(feed: mpsc::UnboundedSender<Command>) -> Arc<Self> {
        Arc::new(Waiters {
            slots: Mutex::default(),
            feed: Some(feed),
        })
    }

    /// Registers a waiter on `channel`.
    pub(crate) fn register(self: &Arc<Self>, channel: &str) -> Waiter {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut ack = None;
        let notify = match slots.get_mut(channel) {
            Some(slot) => {
                slot.waiters += 1;
                slot.notify.clone()
            }
            None => {
                let notify = Arc::new(Notify::new());
                slots.insert(
                    channel.to_owned(),
                    Slot {
                        notify: notify.clone(),
                        waiters: 1,
                    },
                );
                if let Some(feed) = &self.feed {
                    let (tx, rx) = oneshot::channel();
                    if feed
                        .send(Command::Subscribe(channel.to_owned(), tx))
                        .is_ok()
                    {
                        ack = Some(rx);
                    }
                }
                notify
            }
        };
        Waiter {
            registry: self.clone(),
            channel: channel.to_owned(),
            notify,
            ack,
        }
    }

    /// Wakes one waiter of `channel` (or lets the next one that waits pass at once).
    pub(crate) fn wake(&self, channel: &str) {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get(channel) {
            slot.notify.notify_one();
        }
    }

    /// Wakes every waiter: used after a pub/sub reconnect, when releases may have been missed.
    pub(crate) fn wake_all(&self) {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        for slot in slots.values() {
            slot.notify.notify_waiters();
        }
    }

    /// Channels with at least one waiter.
    pub(crate) fn channels(&self) -> Vec<String> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.keys().cloned().collect()
    }

    /// Whether a channel still has waiters.
    pub(crate) fn is_waited(&self, channel: &str) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.contains_key(channel)
    }

    fn unregister(&self, channel: &str) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(channel) {
            slot.waiters -= 1;
            if slot.waiters == 0 {
                slots.remove(channel);
                if let Some(feed) = &self.feed {
                    let _ = feed.send(Command::Unsubscribe(channel.to_owned()));
                }
            }
        }
    }
}

/// One task's registration; unregisters on drop.
#[derive(Debug)]
pub(crate) struct Waiter {
    registry: Arc<Waiters>,
    channel: String,
    notify: Arc<Notify>,
    ack: Option<oneshot::Receiver<()>>,
}

impl Waiter {
    /// Waits (at most `limit`) until the subscription is confirmed. Returns whether notifications
    /// are live; when they are not, the caller relies on polling.
    pub(crate) async fn subscribed(&mut self, limit: Duration) -> bool {
        match self.ack.take() {
            None => self.registry.feed.is_none() || self.registry.is_waited(&self.channel),
            Some(rx) => matches!(tokio::time::timeout(limit, rx).await, Ok(Ok(()))),
        }
    }

    /// Resolves when a release of the lock was announced.
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.registry.unregister(&self.channel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_release_wakes_one_waiter_not_all() {
        let reg = Waiters::local();
        let a = reg.register("c");
        let b = reg.register("c");
        reg.wake("c");
        let woke_a = tokio::time::timeout(Duration::from_millis(50), a.notified())
            .await
            .is_ok();
        let woke_b = tokio::time::timeout(Duration::from_millis(50), b.notified())
            .await
            .is_ok();
        assert!(
            woke_a ^ woke_b,
            "exactly one waiter wakes: {woke_a} {woke_b}"
        );
    }

    #[tokio::test]
    async fn first_waiter_subscribes_and_last_unsubscribes() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reg = Waiters::with_feed(tx);
        let a = reg.register("c");
        let b = reg.register("c");
        match rx.try_recv().unwrap() {
            Command::Subscribe(ch, ack) => {
                assert_eq!(ch, "c");
                ack.send(()).unwrap();
            }
            other => panic!("{other:?}"),
        }
        assert!(
            rx.try_recv().is_err(),
            "the second waiter shares the subscription"
        );
        drop(a);
        assert!(rx.try_recv().is_err());
        drop(b);
        assert!(matches!(rx.try_recv().unwrap(), Command::Unsubscribe(ch) if ch == "c"));
        assert!(reg.channels().is_empty());
    }
}
