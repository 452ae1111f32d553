//! Local registry of tasks waiting for a lock to be released, or for a streamed record to grow.
//!
//! One slot per channel, shared by every waiter of that lock in this client. Two kinds of
//! waiters share it:
//!
//! * **acquirers** wait for the lock: a release wakes one of them (`notify_one`), not all, so a
//!   release never starts a stampede;
//! * **readers** follow a streamed run-once record: every announcement (a part appended, a
//!   release, a completion) wakes every reader, since each of them wants the news. A reader
//!   marks what it has seen before it looks at the store, so an announcement made between its
//!   look and its wait is never missed.
//!
//! A backend may have pub/sub feeds (one per Redis node): the first waiter of a channel
//! subscribes it on every feed and the last one unsubscribes it; every waiter of the channel
//! waits for the same confirmation. A release announcement carries the releaser's token, so the
//! same release heard from several nodes wakes one acquirer, not one per node; a progress
//! announcement starts with `+` (a token never does).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};

/// A request to a pub/sub task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Subscribe the channel; confirm on the acknowledgement once the server confirmed (drop it
    /// if the subscription could not be made).
    Subscribe(String, Ack),
    /// No waiter is left on the channel.
    Unsubscribe(String),
}

/// The confirmation of one channel's subscription, shared by every feed it was sent to: the
/// first confirmation counts; when every feed dropped its copy unconfirmed, the waiters know at
/// once that they must poll.
#[derive(Debug, Clone)]
pub(crate) struct Ack(Arc<watch::Sender<bool>>);

impl Ack {
    /// The server confirmed the subscription.
    pub(crate) fn confirm(&self) {
        self.0.send_replace(true);
    }
}

/// What a waiter waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The lock: woken one at a time by releases (and by progress, if it asks).
    Acquirer,
    /// A streamed record: woken, with every other reader, by every announcement.
    Reader,
}

/// A progress announcement: anything but a token (tokens are hex).
pub(crate) fn is_progress(payload: &[u8]) -> bool {
    payload.first() == Some(&b'+')
}

#[derive(Debug)]
struct Slot {
    /// Acquirers: one is woken per release.
    notify: Arc<Notify>,
    acquirers: usize,
    readers: usize,

    /// Bumped by every announcement: wakes every reader.
    progress: watch::Sender<u64>,
    /// Bumped by progress announcements only (a part appended): wakes every run-once acquirer
    /// (a waiting duplicate joins the stream), while a release still wakes one of them.
    appends: watch::Sender<u64>,
    /// Whether a feed confirmed the subscription (`None`: no feed, local wake-ups only).
    confirmed: Option<watch::Receiver<bool>>,
}

/// One release in this many wakes the next local acquirer only once answered (see
/// [`Waiters::may_hand_over`]).
const FAIR_EVERY: u32 = 9;

/// Release tokens remembered: more than the releases a store's announcement can lag behind
/// (local hand-overs take one round trip each), across every channel of the client.
const RECENT: usize = 64;

fn bump(signal: &watch::Sender<u64>) {
    signal.send_modify(|n| *n = n.wrapping_add(1));
}

/// Starts the pub/sub tasks once a Tokio runtime is there.
type Starter = Box<dyn FnOnce(&tokio::runtime::Handle) + Send>;

/// Waiters by channel.
#[derive(Default)]
pub(crate) struct Waiters {
    slots: Mutex<HashMap<String, Slot>>,
    /// The tokens of the last releases announced (or made here), newest last: the same release
    /// heard again (from another node, or from the store after it was made here) wakes no one.
    /// Several, because local hand-overs run ahead of the store's announcements. Locked inside
    /// `slots`, never the other way round.
    recent: Mutex<VecDeque<Vec<u8>>>,
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
            recent: Mutex::default(),
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

    /// Registers an acquirer on `channel`.
    pub(crate) fn register(self: &Arc<Self>, channel: &str) -> Waiter {
        self.register_as(channel, Kind::Acquirer)
    }

    /// Registers a waiter of `kind` on `channel`.
    pub(crate) fn register_as(self: &Arc<Self>, channel: &str, kind: Kind) -> Waiter {
        self.start();
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.entry(channel.to_owned()).or_insert_with(|| {
            let confirmed = (!self.feeds.is_empty()).then(|| {
                let (tx, rx) = watch::channel(false);
                let ack = Ack(Arc::new(tx));
                for feed in &self.feeds {
                    let _ = feed.send(Command::Subscribe(channel.to_owned(), ack.clone()));
                }
                rx
            });
            Slot {
                notify: Arc::new(Notify::new()),
                acquirers: 0,
                readers: 0,
                progress: watch::channel(0).0,
                appends: watch::channel(0).0,
                confirmed,
            }
        });
        match kind {
            Kind::Acquirer => slot.acquirers += 1,
            Kind::Reader => slot.readers += 1,
        }
        Waiter {
            registry: self.clone(),
            channel: channel.to_owned(),
            kind,
            notify: slot.notify.clone(),
            progress: slot.progress.subscribe(),
            appends: slot.appends.subscribe(),
            confirmed: slot.confirmed.clone(),
        }
    }

    /// An announcement on `channel`: a release by `token` wakes one acquirer (or lets the next
    /// one that waits pass at once), unless this same release was already announced, and every
    /// reader; progress (see [`is_progress`]) wakes every reader and every acquirer that asked
    /// for it ([`Waiter::woken`]).
    pub(crate) fn wake(&self, channel: &str, token: &[u8]) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(channel) {
            bump(&slot.progress);
            if is_progress(token) {
                bump(&slot.appends);
                return;
            }
            if !token.is_empty() && !self.heard(token) {
                return;
            }
            slot.notify.notify_one();
        }
    }

    /// Passes a wake on to the next acquirer of `channel`: one that a release woke did not
    /// spend it on the lock (its attempt failed or was dropped), or found the run-once record
    /// done, which every waiting duplicate wants.
    pub(crate) fn pass_on(&self, channel: &str) {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get(channel) {
            slot.notify.notify_one();
        }
    }

    /// Remembers `token`'s release as announced, so that its announcement, if it comes, wakes
    /// no one; returns whether it was new. Tokens are random: one list for every channel, kept
    /// while channels come and go (a slot is dropped with its last waiter, and made again by
    /// the next).
    pub(crate) fn heard(&self, token: &[u8]) -> bool {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.iter().any(|t| t == token) {
            return false;
        }
        let mut entry = if recent.len() == RECENT {
            recent.pop_front().unwrap_or_default()
        } else {
            Vec::new()
        };
        entry.clear();
        entry.extend_from_slice(token);
        recent.push_back(entry);
        true
    }

    /// A streamed record on `channel` grew: wakes every reader (a local shortcut; the store's
    /// announcement follows).
    pub(crate) fn progress(&self, channel: &str) {
        self.wake(channel, b"+");
    }

    /// Wakes every waiter: used after a pub/sub reconnect, when releases may have been missed.
    pub(crate) fn wake_all(&self) {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        for slot in slots.values() {
            slot.notify.notify_waiters();
            bump(&slot.progress);
            bump(&slot.appends);
        }
    }

    /// Channels with at least one waiter.
    pub(crate) fn channels(&self) -> Vec<String> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.keys().cloned().collect()
    }

    /// Whether a channel still has waiters (of either kind).
    pub(crate) fn is_waited(&self, channel: &str) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.contains_key(channel)
    }

    /// Whether a release on `channel`, sent and not yet answered, may wake the next local
    /// acquirer now: its acquisition then follows the release on the connection and the lock
    /// changes hands in the release's round trip, before other clients' waiters (woken by the
    /// store's announcement) can try. So not always: one release in [`FAIR_EVERY`], drawn at
    /// random (nothing about a channel's local waiters lasts from one release to the next, so
    /// a count could restart every time), wakes the local acquirer only once answered, and other
    /// clients' waiters race it as they did before hand-overs.
    pub(crate) fn may_hand_over(&self, channel: &str) -> bool {
        self.has_acquirers(channel) && fastrand::u32(..FAIR_EVERY) != 0
    }

    /// Whether tasks of this client wait to acquire the lock of `channel`.
    pub(crate) fn has_acquirers(&self, channel: &str) -> bool {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.get(channel).is_some_and(|s| s.acquirers > 0)
    }

    fn unregister(&self, channel: &str, kind: Kind) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(channel) {
            match kind {
                Kind::Acquirer => slot.acquirers -= 1,
                Kind::Reader => slot.readers -= 1,
            }
            if slot.acquirers + slot.readers == 0 {
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
    kind: Kind,
    notify: Arc<Notify>,
    progress: watch::Receiver<u64>,
    appends: watch::Receiver<u64>,
    confirmed: Option<watch::Receiver<bool>>,
}

impl Waiter {
    /// Waits (at most `limit`) until a feed confirmed the channel's subscription (whichever
    /// waiter asked for it). Returns whether notifications are live; when they are not, the
    /// caller relies on polling.
    pub(crate) async fn subscribed(&mut self, limit: Duration) -> bool {
        match &mut self.confirmed {
            None => true,
            Some(rx) => matches!(
                tokio::time::timeout(limit, rx.wait_for(|confirmed| *confirmed)).await,
                Ok(Ok(_))
            ),
        }
    }

    /// Resolves when a release of the lock was announced (acquirers).
    #[cfg(test)]
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }

    /// Marks every announcement so far as seen: [`progressed`](Self::progressed) then resolves
    /// only on a later one. Call it before looking at the store.
    pub(crate) fn mark_seen(&mut self) {
        self.progress.borrow_and_update();
        self.appends.borrow_and_update();
    }

    /// Resolves when something was announced (a part, a release, a completion) since
    /// [`mark_seen`](Self::mark_seen).
    pub(crate) async fn progressed(&mut self) {
        if self.progress.changed().await.is_err() {
            // The slot outlives its waiters: not reached. Never resolve rather than spin.
            std::future::pending::<()>().await;
        }
    }

    /// Resolves on a release meant for this acquirer or, with `appends`, on a part appended
    /// since [`mark_seen`](Self::mark_seen) (every such acquirer wakes: each wants to join the
    /// stream).
    pub(crate) async fn woken(&mut self, appends: bool) {
        let notify = self.notify.clone();
        if appends {
            tokio::select! {
                () = notify.notified() => {}
                changed = self.appends.changed() => if changed.is_err() {
                    notify.notified().await;
                },
            }
        } else {
            notify.notified().await;
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.registry.unregister(&self.channel, self.kind);
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

    /// Local releases hand the lock over faster than the store's announcements come back: the
    /// announcement of a release that already woke its waiter, arriving after later releases
    /// woke theirs, must wake no one (each such stray wake is a failed attempt).
    #[tokio::test]
    async fn a_late_announcement_of_an_earlier_release_wakes_no_one() {
        let reg = Waiters::local();
        let waiters: Vec<_> = (0..3).map(|_| reg.register("c")).collect();
        let woken = || async {
            let mut n = 0;
            for w in &waiters {
                n += u8::from(woke(w).await);
            }
            n
        };
        reg.wake("c", b"t1"); // released here, its waiter woken at once
        assert_eq!(woken().await, 1);
        reg.wake("c", b"t2"); // the next release here
        assert_eq!(woken().await, 1);
        reg.wake("c", b"t1"); // the store's announcement of the first, late
        reg.wake("c", b"t2");
        assert_eq!(woken().await, 0, "late announcements woke a waiter");
        // Even when every waiter had left in between (the channel's slot dropped and made
        // again by the next waiter).
        drop(waiters);
        let next = reg.register("c");
        reg.wake("c", b"t2");
        assert!(
            !woke(&next).await,
            "a late announcement woke the next waiter"
        );
        reg.wake("c", b"t3");
        assert!(woke(&next).await, "a new release wakes it");
    }

    async fn progressed(w: &mut Waiter) -> bool {
        tokio::time::timeout(Duration::from_millis(50), w.progressed())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn progress_wakes_every_reader_and_no_acquirer() {
        let reg = Waiters::local();
        let mut readers: Vec<_> = (0..5).map(|_| reg.register_as("c", Kind::Reader)).collect();
        let acquirer = reg.register("c");
        for r in &mut readers {
            r.mark_seen();
        }
        reg.progress("c");
        for r in &mut readers {
            assert!(progressed(r).await, "every reader wakes");
            assert!(!progressed(r).await, "once per announcement");
        }
        assert!(!woke(&acquirer).await, "progress frees no lock");
        assert!(!reg.has_acquirers("other"));
        assert!(reg.has_acquirers("c"));
        drop(acquirer);
        assert!(!reg.has_acquirers("c"), "readers do not queue acquirers");
        assert!(reg.is_waited("c"));
    }

    #[tokio::test]
    async fn a_release_wakes_one_acquirer_and_every_reader() {
        let reg = Waiters::local();
        let (a, b) = (reg.register("c"), reg.register("c"));
        let mut readers: Vec<_> = (0..3).map(|_| reg.register_as("c", Kind::Reader)).collect();
        for r in &mut readers {
            r.mark_seen();
        }
        reg.wake("c", b"t1");
        assert!(woke(&a).await ^ woke(&b).await, "one acquirer");
        for r in &mut readers {
            assert!(progressed(r).await, "every reader sees the release");
        }
    }

    /// Run-once acquirers asking for appends: a part wakes them all (each joins the stream), a
    /// release still wakes one.
    #[tokio::test]
    async fn an_append_wakes_every_acquirer_that_asked_and_a_release_one() {
        let reg = Waiters::local();
        let mut a = reg.register("c");
        let mut b = reg.register("c");
        async fn woken(w: &mut Waiter) -> bool {
            let woke = tokio::time::timeout(Duration::from_millis(50), w.woken(true))
                .await
                .is_ok();
            w.mark_seen();
            woke
        }
        a.mark_seen();
        b.mark_seen();
        reg.progress("c");
        assert!(
            woken(&mut a).await && woken(&mut b).await,
            "both join the stream"
        );
        reg.wake("c", b"t1");
        let (wa, wb) = (woken(&mut a).await, woken(&mut b).await);
        assert!(wa ^ wb, "one acquirer per release: {wa} {wb}");
    }

    /// An announcement between a reader's look at the store and its wait is not missed: it
    /// marked what it had seen before looking.
    #[tokio::test]
    async fn an_announcement_before_the_wait_is_not_missed() {
        let reg = Waiters::local();
        let mut r = reg.register_as("c", Kind::Reader);
        r.mark_seen();
        reg.progress("c"); // while the reader looks at the store
        assert!(progressed(&mut r).await);
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
        let mut b = b;
        assert!(
            tokio::time::timeout(
                Duration::from_millis(50),
                b.subscribed(Duration::from_secs(1))
            )
            .await
            .is_err(),
            "a later waiter waits for the same confirmation"
        );
        ack.confirm();
        assert!(
            a.subscribed(Duration::from_secs(1)).await,
            "one feed's confirmation suffices"
        );
        assert!(b.subscribed(Duration::from_secs(1)).await);
        drop(a);
        assert!(rx1.try_recv().is_err());
        drop(b);
        assert!(matches!(rx1.try_recv().unwrap(), Command::Unsubscribe(ch) if ch == "c"));
        assert!(matches!(rx2.try_recv().unwrap(), Command::Unsubscribe(_)));
        assert!(reg.channels().is_empty());
    }
}
