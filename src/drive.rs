//! Driving an execution from the task that waits for what it produces, without waking that task.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

use crate::execution::Execution;

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
