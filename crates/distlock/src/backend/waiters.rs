//! Local registry of tasks waiting for a lock to be released.
//!
//! One slot per channel, shared by every waiter of that lock in this client; a release wakes one
//! waiter (`notify_one`), not all of them, so a release never starts a stampede. A backend may
//! have pub/sub feeds (one per Redis node): the first waiter of a channel subscribes it on every
//! feed and the last one unsubscribes it. An announcement carries the releaser's token, so the
//! same release heard from several nodes wakes one waiter, not one per node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

/// A request to a pub/sub task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Subscribe the channel; send on the acknowledgement once the server confirmed (nothing
    /// is sent if the subscription could not be made).
    Subscribe(String, mpsc::Sender<()>),
    /// No waiter is left on the channel.
    Unsubscribe(String),
}

#[derive(Debug)]
struct Slot {
    notify: Arc<Notify>,
    waiters: usize,
    /// The token of the last release announced on this channel.
    last: Vec<u8>,
}

/// Starts the pub/sub tasks once a Tokio runtime is there.
type Starter = Box<dyn FnOnce(&tokio::runtime::Handle) + Send>;

/// Waiters by channel.
#[derive(Default)]
pub(crate) struct Waiters {
    slots: Mutex<HashMap<String, Slot>>,
    feeds: Vec<mpsc::UnboundedSender<Command>>,
    /// The pub/sub tasks not started yet (the client was built outside a runtime).
    starter: Mutex<Option<Starter>>,
    /// Background releases and cleanups still running.
    background: Arc<Background>,
}

/// A count of background tasks (releases of dropped guards, cleanups of acquisitions), so that
/// a process can wait for them before it exits.
#[derive(Debug, Default)]
pub(crate) struct Background {
    running: std::sync::atomic::AtomicUsize,
    idle: Notify,
}

/// One background task; counted until dropped.
#[derive(Debug)]
pub(crate) struct Task(Arc<Background>);

impl Drop for Task {
    fn drop(&mut self) {
        if self
            .0
            .running
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
            == 1
        {
            self.0.idle.notify_waiters();
        }
    }
}

impl Background {
    /// Waits until no background task runs. Returns false if some still did after `limit`.
    pub(crate) async fn settle(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let idle = self.idle.notified();
                tokio::pin!(idle);
                idle.as_mut().enable();
                if self.running.load(std::sync::atomic::Ordering::Acquire) == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

impl std::fmt::Debug for Waiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("feeds", &self.feeds.len())
            .finish_non_exhaustive()
    }
}

impl Waiters {
    /// A registry with no remote feed: only local wake-ups (and polling).
    pub(crate) fn local() -> Arc<Self> {
        Arc::new(Waiters::default())
    }

    /// A registry whose subscriptions are forwarded to pub/sub tasks.
    pub(crate) fn with_feeds(feeds: Vec<mpsc::UnboundedSender<Command>>) -> Arc<Self> {
        Arc::new(Waiters {
            slots: Mutex::default(),
            feeds,
            starter: Mutex::default(),
            background: Arc::default(),
        })
    }

    /// Counts a background task until the returned value is dropped.
    pub(crate) fn task(&self) -> Task {
        self.background
            .running
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Task(self.background.clone())
    }

    /// The background task count.
    pub(crate) fn background(&self) -> &Background {
        &self.background
    }

    /// Sets what starts the pub/sub tasks, and runs it now if a runtime is there (else at the
    /// first registration inside one): building a client never needs a runtime.
    pub(crate) fn start_with(&self, starter: Starter) {
        *self.starter.lock().unwrap_or_else(|e| e.into_inner()) = Some(starter);
        self.start();
    }

    fn start(&self) {
        let mut starter = self.starter.lock().unwrap_or_else(|e| e.into_inner());
        if starter.is_some()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            && let Some(start) = starter.take()
        {
            start(&runtime);
        }
    }

    /// Registers a waiter on `channel`.
    pub(crate) fn register(self: &Arc<Self>, channel: &str) -> Waiter {
        self.start();
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
                        last: Vec::new(),
                    },
                );
                if !self.feeds.is_empty() {
                    let (tx, rx) = mpsc::channel(self.feeds.len());
                    for feed in &self.feeds {
                        let _ = feed.send(Command::Subscribe(channel.to_owned(), tx.clone()));
                    }
                    ack = Some(rx);
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

    /// A release of `channel` by `token` was announced: wakes one waiter (or lets the next one
    /// that waits pass at once), unless this same release was already announced.
    pub(crate) fn wake(&self, channel: &str, token: &[u8]) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(channel) {
            if !token.is_empty() && slot.last == token {
                return;
            }
            slot.last.clear();
            slot.last.extend_from_slice(token);
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
                for feed in &self.feeds {
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
    ack: Option<mpsc::Receiver<()>>,
}

impl Waiter {
    /// Waits (at most `limit`) until a feed confirmed the subscription. Returns whether
    /// notifications are live; when they are not, the caller relies on polling.
    pub(crate) async fn subscribed(&mut self, limit: Duration) -> bool {
        match self.ack.take() {
            None => self.registry.feeds.is_empty() || self.registry.is_waited(&self.channel),
            Some(mut rx) => matches!(tokio::time::timeout(limit, rx.recv()).await, Ok(Some(()))),
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

    async fn woke(w: &Waiter) -> bool {
        tokio::time::timeout(Duration::from_millis(50), w.notified())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_release_wakes_one_waiter_not_all() {
        let reg = Waiters::local();
        let a = reg.register("c");
        let b = reg.register("c");
        reg.wake("c", b"t1");
        let (wa, wb) = (woke(&a).await, woke(&b).await);
        assert!(wa ^ wb, "exactly one waiter wakes: {wa} {wb}");
    }

    #[tokio::test]
    async fn the_same_release_heard_twice_wakes_once() {
        let reg = Waiters::local();
        let a = reg.register("c");
        let b = reg.register("c");
        reg.wake("c", b"t1");
        reg.wake("c", b"t1"); // the same release, from another node
        assert_eq!(u8::from(woke(&a).await) + u8::from(woke(&b).await), 1);
        reg.wake("c", b"t2"); // a new release
        assert_eq!(u8::from(woke(&a).await) + u8::from(woke(&b).await), 1);
    }

    #[tokio::test]
    async fn first_waiter_subscribes_on_every_feed_and_last_unsubscribes() {
        let (tx1, mut rx1) = mpsc::unbounded_channel();
        let (tx2, mut rx2) = mpsc::unbounded_channel();
        let reg = Waiters::with_feeds(vec![tx1, tx2]);
        let mut a = reg.register("c");
        let b = reg.register("c");
        let ack = match rx1.try_recv().unwrap() {
            Command::Subscribe(ch, ack) => {
                assert_eq!(ch, "c");
                ack
            }
            other => panic!("{other:?}"),
        };
        assert!(matches!(rx2.try_recv().unwrap(), Command::Subscribe(..)));
        assert!(
            rx1.try_recv().is_err(),
            "the second waiter shares the subscription"
        );
        ack.try_send(()).unwrap();
        assert!(
            a.subscribed(Duration::from_secs(1)).await,
            "one feed's confirmation suffices"
        );
        drop(a);
        assert!(rx1.try_recv().is_err());
        drop(b);
        assert!(matches!(rx1.try_recv().unwrap(), Command::Unsubscribe(ch) if ch == "c"));
        assert!(matches!(rx2.try_recv().unwrap(), Command::Unsubscribe(_)));
        assert!(reg.channels().is_empty());
    }
}
