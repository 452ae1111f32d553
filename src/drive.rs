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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
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
}

impl Execution {
    /// A future that dropping cancels (a replay's reading, a `cancel_on_disconnect` execution).
    pub(crate) fn cancellable(driver: Driver) -> Self {
        Execution {
            driver: Some(driver),
            detach: None,
        }
    }

    /// A future that, dropped before its end, goes on in a task of its own on `runtime`
    /// (`None`: dropping it cancels it).
    pub(crate) fn detached(driver: Driver, runtime: Option<tokio::runtime::Handle>) -> Self {
        Execution {
            driver: Some(driver),
            detach: runtime,
        }
    }

    /// Polls it; returns whether it has ended.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = &mut self.driver
            && driver.as_mut().poll(cx).is_ready()
        {
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
        if let (Some(driver), Some(runtime)) = (self.driver.take(), self.detach.take()) {
            runtime.spawn(driver);
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
