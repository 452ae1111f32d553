//! An execution driven by whoever holds it ([`Execution`]: the response future, then the
//! response body; dropped before its end it goes on in a task of its own, or is cancelled), and
//! driving it from the task that waits for what it produces, without waking that task
//! ([`Driving`]).
//!
//! The response future drives the execution until the response head comes through a oneshot;
//! a fed response body drives it (a replay's reading, a `cancel_on_disconnect` execution)
//! while it receives its frames from a channel. Both poll the execution and then the channel,
//! from the same task. A message the execution sends while it is driven would wake the waker
//! the channel holds from the previous poll: the task's own. Tokio treats a task woken during
//! its own poll as one that yielded; on a multi-thread runtime it is put back in the shared
//! queue and another worker is woken to steal it: a futex wake-up and a thread hop per frame,
//! for a message the task reads a moment later in the same poll. Likewise, room the receiver
//! makes in a full channel wakes the execution's pending send, whose waker is the task's own.
//!
//! [`Driving`] hands the channel and the execution wakers that forward to the task except when
//! the wake can only come from the poll in progress: the channel's, while the execution is
//! driven (the channel is read right after); the execution's, while the channel is read, when
//! that read returns a frame (the caller polls again for the next one, and drives the
//! execution first). A wake the execution gets while the channel is read and nothing came is
//! forwarded, so nothing is ever lost; a wake from anything else (a timer, a socket, the
//! execution yielding to the runtime's budget while driven) reaches the task as it would
//! without this.
//!
//! A detached execution its holder drops before its end (the common case: the response has
//! gone out, the store's answer to the completion has not come) is not spawned there but when
//! what it waits for wakes it ([`Parking`]): the poll that drops it has just woken the store
//! client's task (the command it sent), and a second task made ready in the same poll makes
//! Tokio wake an idle worker to steal one of them, a futex wake-up per request for a task
//! with nothing to do until the store answers. (A runtime shutting down drops a parked
//! execution when its drivers wake what waits on them, rather than with its tasks.)

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// A future driven by whoever holds it.
pub(crate) type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A future driven by whoever holds it (the response future, then the response body). Dropped
/// before its end it is either spawned, to run on in a task of its own (detached), or cancelled.
pub(crate) struct Execution {
    driver: Option<Driver>,
    /// Where it goes on when dropped before its end; `None`: dropping it cancels it.
    detach: Option<tokio::runtime::Handle>,
    /// The waker a detached execution is polled with: it forwards to the holder's task, and
    /// spawns the execution once its holder has dropped it ([`Parking`]). Made at its first
    /// poll as a detached execution (it stays one), so every poll since was with it.
    parking: Option<(Arc<Parking>, Waker)>,
}

impl Execution {
    /// A future that dropping cancels (a replay's reading, a `cancel_on_disconnect` execution).
    pub(crate) fn cancellable(driver: Driver) -> Self {
        Execution {
            driver: Some(driver),
            detach: None,
            parking: None,
        }
    }

    /// A future that, dropped before its end, goes on in a task of its own on `runtime`
    /// (`None`: dropping it cancels it).
    pub(crate) fn detached(driver: Driver, runtime: Option<tokio::runtime::Handle>) -> Self {
        Execution {
            driver: Some(driver),
            detach: runtime,
            parking: None,
        }
    }

    /// Polls it; returns whether it has ended.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(driver) = &mut self.driver else {
            return true;
        };
        let ready = if self.detach.is_some() {
            let (parking, waker) = self.parking.get_or_insert_with(|| {
                let parking = Arc::new(Parking::default());
                let waker = Waker::from(parking.clone());
                (parking, waker)
            });
            parking.hold(cx.waker());
            driver
                .as_mut()
                .poll(&mut Context::from_waker(waker))
                .is_ready()
        } else {
            driver.as_mut().poll(cx).is_ready()
        };
        if ready {
            self.driver = None;
        }
        self.driver.is_none()
    }

    /// Whether dropping it before its end lets it go on.
    pub(crate) fn is_detached(&self) -> bool {
        self.detach.is_some()
    }

    /// From now on it is never cancelled: dropped before its end, it goes on in a task of its
    /// own (on the current runtime, if there is one).
    pub(crate) fn detach(&mut self) {
        if self.detach.is_none() && self.driver.is_some() {
            self.detach = tokio::runtime::Handle::try_current().ok();
        }
    }
}

impl Drop for Execution {
    fn drop(&mut self) {
        let (Some(driver), Some(runtime)) = (self.driver.take(), self.detach.take()) else {
            return;
        };
        match &self.parking {
            Some((parking, _)) => parking.park(driver, runtime),
            // Not polled since it was detached: what it waits for would wake its holder.
            None => {
                runtime.spawn(driver);
            }
        }
    }
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("ended", &self.driver.is_none())
            .field("detached", &self.detach.is_some())
            .finish()
    }
}

/// Where a detached execution waits, dropped by its holder before its end, for what it waits
/// for: the wake spawns it. Spawning it at the drop instead would make a second task runnable
/// in the poll that has just woken the store client's task (the command the execution sent);
/// Tokio then pushes that task out of the worker's next-task slot and wakes an idle worker to
/// steal it: a futex wake-up and a thread hop per request, for a task that has nothing to do
/// until the store answers.
#[derive(Default)]
struct Parking {
    state: Mutex<Parked>,
}

#[derive(Default)]
enum Parked {
    /// Not polled yet.
    #[default]
    Idle,
    /// Driven by its holder: a wake goes to the holder's task, and is remembered until the
    /// next poll.
    Held { task: Waker, woken: bool },
    /// Dropped by its holder: the next wake spawns it.
    Waiting(Driver, tokio::runtime::Handle),
    /// Spawned: it polls itself with its own task's waker from now on.
    Gone,
}

impl Parking {
    fn lock(&self) -> MutexGuard<'_, Parked> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The holder polls it for the task of `task`.
    fn hold(&self, task: &Waker) {
        let mut state = self.lock();
        // What it replaces is dropped once the lock is released: a waker's drop is foreign code.
        let replaced = match &mut *state {
            Parked::Held { task: held, woken } => {
                *woken = false;
                (!held.will_wake(task)).then(|| Parked::Held {
                    task: std::mem::replace(held, task.clone()),
                    woken: false,
                })
            }
            _ => Some(std::mem::replace(
                &mut *state,
                Parked::Held {
                    task: task.clone(),
                    woken: false,
                },
            )),
        };
        drop(state);
        drop(replaced);
    }

    /// The holder dropped it before its end: spawned now if woken since its last poll, else at
    /// the next wake.
    fn park(&self, driver: Driver, runtime: tokio::runtime::Handle) {
        let mut state = self.lock();
        if let Parked::Held { woken: false, .. } = &*state {
            let held = std::mem::replace(&mut *state, Parked::Waiting(driver, runtime));
            drop(state);
            drop(held);
            return;
        }
        let held = std::mem::replace(&mut *state, Parked::Gone);
        drop(state);
        drop(held);
        runtime.spawn(driver);
    }
}

impl Wake for Parking {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, Parked::Gone) {
            Parked::Held { task, .. } => {
                *state = Parked::Held {
                    task: task.clone(),
                    woken: true,
                };
                drop(state);
                task.wake();
            }
            Parked::Waiting(driver, runtime) => {
                drop(state);
                runtime.spawn(driver);
            }
            other => *state = other,
        }
    }
}

impl Drop for Parking {
    /// Its last waker dropped unwoken: it is spawned rather than dropped, so that it is never
    /// cancelled (nor dropped wherever that waker was).
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Parked::Waiting(driver, runtime) = std::mem::take(state) {
            runtime.spawn(driver);
        }
    }
}

const IDLE: u8 = 0;
const DRIVING: u8 = 1;
const RECEIVING: u8 = 2;

/// Wakers for driving an execution and receiving from it in one task; see the module docs.
#[derive(Debug)]
pub(crate) struct Driving {
    shared: Arc<Shared>,
    /// The channel's waker (wakes the task unless the execution is being driven).
    receiver: Waker,
    /// The execution's waker (wakes the task unless the channel is being read).
    driven: Waker,
}

#[derive(Debug, Default)]
struct Shared {
    task: AtomicWaker,
    phase: AtomicU8,
    /// The execution was woken while the channel was being read.
    missed: AtomicBool,
}

/// The channel side: the [`Shared`] itself.
impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.phase.load(Ordering::SeqCst) != DRIVING {
            self.task.wake();
        }
    }
}

/// The execution side.
#[derive(Debug)]
struct Driven(Arc<Shared>);

impl Wake for Driven {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let shared = &self.0;
        if shared.phase.load(Ordering::SeqCst) != RECEIVING {
            shared.task.wake();
            return;
        }
        shared.missed.store(true, Ordering::SeqCst);
        // The receive may have ended between the check and the record, its poller already past
        // looking at `missed`: whichever of the two sees the other's write wakes the task.
        if shared.phase.load(Ordering::SeqCst) != RECEIVING
            && shared.missed.swap(false, Ordering::SeqCst)
        {
            shared.task.wake();
        }
    }
}

impl Driving {
    pub(crate) fn new() -> Self {
        let shared = Arc::new(Shared::default());
        Driving {
            receiver: Waker::from(shared.clone()),
            driven: Waker::from(Arc::new(Driven(shared.clone()))),
            shared,
        }
    }

    /// Drives `execution` (if any) for the task of `cx`, then polls `receive`: returns whether
    /// the execution ended, and what `receive` gave.
    pub(crate) fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        execution: Option<&mut Execution>,
        receive: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> (bool, Poll<T>) {
        let shared = &self.shared;
        shared.task.register(cx.waker());
        let mut ended = false;
        if let Some(execution) = execution {
            shared.phase.store(DRIVING, Ordering::SeqCst);
            ended = execution.poll(&mut Context::from_waker(&self.driven));
        }
        shared.missed.store(false, Ordering::SeqCst);
        shared.phase.store(RECEIVING, Ordering::SeqCst);
        let received = receive(&mut Context::from_waker(&self.receiver));
        shared.phase.store(IDLE, Ordering::SeqCst);
        if received.is_pending() && shared.missed.swap(false, Ordering::SeqCst) {
            cx.waker().wake_by_ref();
        }
        (ended, received)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;
    use tokio::sync::oneshot;

    /// A detached execution that waits for `go`, then says so on `done`; counts its polls.
    fn waiting(
        go: oneshot::Receiver<()>,
        done: oneshot::Sender<()>,
        polls: Arc<AtomicUsize>,
    ) -> Execution {
        let mut go = go;
        let driver: Driver = Box::pin(async move {
            std::future::poll_fn(|cx| {
                polls.fetch_add(1, Ordering::SeqCst);
                Pin::new(&mut go).poll(cx).map(|_| ())
            })
            .await;
            let _ = done.send(());
        });
        Execution::detached(driver, Some(tokio::runtime::Handle::current()))
    }

    /// A driver that waits for `go`, then says so on `done`.
    fn waits_for(go: oneshot::Receiver<()>, done: oneshot::Sender<()>) -> Driver {
        Box::pin(async move {
            let _ = go.await;
            let _ = done.send(());
        })
    }

    async fn ended(done: oneshot::Receiver<()>, what: &str) {
        tokio::time::timeout(Duration::from_secs(10), done)
            .await
            .unwrap_or_else(|_| panic!("{what}: the execution did not end within 10 s"))
            .expect("the execution ended without saying so");
    }

    fn poll_once(execution: &mut Execution) -> bool {
        execution.poll(&mut Context::from_waker(Waker::noop()))
    }

    /// Dropped while it waits, it takes no task until what it waits for wakes it; then it runs
    /// to its end in a task of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_detached_execution_dropped_while_it_waits_is_spawned_when_woken() {
        let metrics = tokio::runtime::Handle::current().metrics();
        let (go, wait) = oneshot::channel();
        let (said, done) = oneshot::channel();
        let polls = Arc::new(AtomicUsize::new(0));
        let mut execution = waiting(wait, said, polls.clone());
        assert!(!poll_once(&mut execution));
        let tasks = metrics.num_alive_tasks();
        drop(execution);
        assert_eq!(
            metrics.num_alive_tasks(),
            tasks,
            "no task before it is woken"
        );
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "not polled before it is woken"
        );
        go.send(()).unwrap();
        ended(done, "woken after its drop").await;
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    /// Woken between its last poll and its drop, it is spawned at the drop: the wake is not
    /// lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_detached_execution_woken_before_its_drop_runs_on() {
        let (go, wait) = oneshot::channel();
        let (said, done) = oneshot::channel();
        let mut execution = waiting(wait, said, Arc::new(AtomicUsize::new(0)));
        assert!(!poll_once(&mut execution));
        go.send(()).unwrap();
        drop(execution);
        ended(done, "woken before its drop").await;
    }

    /// What it waits for drops its waker without waking it: it is spawned then, never dropped
    /// (a dropped execution would be a cancelled one).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_detached_execution_whose_waker_is_dropped_unwoken_runs_on() {
        let slot: Arc<std::sync::Mutex<Option<Waker>>> = Arc::default();
        let (said, done) = oneshot::channel();
        let held = slot.clone();
        let mut first = true;
        let driver: Driver = Box::pin(async move {
            std::future::poll_fn(|cx| {
                if std::mem::take(&mut first) {
                    *held.lock().unwrap() = Some(cx.waker().clone());
                    Poll::Pending
                } else {
                    Poll::Ready(())
                }
            })
            .await;
            let _ = said.send(());
        });
        let mut execution = Execution::detached(driver, Some(tokio::runtime::Handle::current()));
        assert!(!poll_once(&mut execution));
        drop(execution);
        drop(slot.lock().unwrap().take());
        ended(done, "its waker dropped").await;
    }

    /// While its holder drives it, a wake reaches the holder's task, and nothing is spawned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wake_while_it_is_held_reaches_the_holder() {
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let metrics = tokio::runtime::Handle::current().metrics();
        let (go, wait) = oneshot::channel();
        let (said, mut done) = oneshot::channel();
        let mut execution = waiting(wait, said, Arc::new(AtomicUsize::new(0)));
        let holder = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(holder.clone());
        assert!(!execution.poll(&mut Context::from_waker(&waker)));
        let tasks = metrics.num_alive_tasks();
        go.send(()).unwrap();
        assert_eq!(holder.0.load(Ordering::SeqCst), 1, "the holder was woken");
        assert_eq!(metrics.num_alive_tasks(), tasks, "nothing spawned");
        assert!(execution.poll(&mut Context::from_waker(&waker)), "it ended");
        assert!(done.try_recv().is_ok());
    }

    /// A driver that wakes itself in its poll (at once, or deferred to the end of the holder's
    /// poll as Tokio's `yield_now` does) and is dropped runs on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_detached_execution_that_woke_itself_runs_on_after_its_drop() {
        for deferred in [false, true] {
            let (said, done) = oneshot::channel();
            let driver: Driver = Box::pin(async move {
                if deferred {
                    tokio::task::yield_now().await;
                } else {
                    let mut once = true;
                    std::future::poll_fn(|cx| {
                        if std::mem::take(&mut once) {
                            cx.waker().wake_by_ref();
                            Poll::Pending
                        } else {
                            Poll::Ready(())
                        }
                    })
                    .await;
                }
                let _ = said.send(());
            });
            let mut execution =
                Execution::detached(driver, Some(tokio::runtime::Handle::current()));
            assert!(!poll_once(&mut execution));
            drop(execution);
            ended(done, if deferred { "deferred" } else { "at once" }).await;
        }
    }

    /// A cancellable execution polled and then detached runs on when dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancellable_execution_detached_after_a_poll_runs_on() {
        let (go, wait) = oneshot::channel();
        let (said, done) = oneshot::channel();
        let mut execution = Execution::cancellable(waits_for(wait, said));
        assert!(!poll_once(&mut execution));
        execution.detach();
        assert!(execution.is_detached());
        drop(execution);
        go.send(()).unwrap();
        ended(done, "detached after a poll").await;
    }

    /// Wakes racing drops on two workers: every execution runs to its end, once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_racing_drops_lose_no_execution() {
        const N: usize = 2_000;
        let mut ends = Vec::with_capacity(N);
        for i in 0..N {
            let (go, wait) = oneshot::channel();
            let (said, done) = oneshot::channel();
            let mut execution = waiting(wait, said, Arc::new(AtomicUsize::new(0)));
            assert!(!poll_once(&mut execution));
            let waker = tokio::spawn(async move {
                let _ = go.send(());
            });
            if i % 2 == 0 {
                tokio::task::yield_now().await;
            }
            drop(execution);
            ends.push((waker, done));
        }
        for (i, (waker, done)) in ends.into_iter().enumerate() {
            waker.await.unwrap();
            ended(done, &format!("execution {i}")).await;
        }
    }

    /// A cancellable execution is dropped, not spawned: dropping it cancels it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancellable_execution_dropped_is_cancelled() {
        let (go, wait) = oneshot::channel();
        let (said, done) = oneshot::channel();
        let mut execution = Execution::cancellable(waits_for(wait, said));
        assert!(!poll_once(&mut execution));
        drop(execution);
        assert!(go.send(()).is_err(), "its receiver went with it");
        assert!(done.await.is_err(), "it never ran on");
    }
}
