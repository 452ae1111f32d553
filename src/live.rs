//! The protected executions that have not ended, whoever drives them: what
//! [`Store::drain`](crate::Store::drain) waits for.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

use crate::layer::Config;

/// The protected executions of a layer that have not ended, whoever drives them (a response
/// future, a body, a task of their own): what [`Store::drain`](crate::Store::drain) waits for.
#[derive(Debug, Default)]
pub(crate) struct Executions {
    live: AtomicUsize,
    ended: Notify,
}

impl Executions {
    /// Waits until none is live.
    pub(crate) async fn none_live(&self) {
        loop {
            let ended = self.ended.notified();
            let mut ended = pin!(ended);
            // Registered before the count is read: an end in between wakes it.
            ended.as_mut().enable();
            if self.live.load(Ordering::Acquire) == 0 {
                return;
            }
            ended.await;
        }
    }
}

/// An execution counted as live until this is dropped (with the execution's future: it ended,
/// or it was cancelled; or with a task it handed its outcome to).
pub(crate) struct Live(Arc<Config>);

impl Live {
    pub(crate) fn new(config: &Arc<Config>) -> Self {
        config
            .store
            .executions()
            .live
            .fetch_add(1, Ordering::AcqRel);
        Live(config.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let executions = self.0.store.executions();
        if executions.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            executions.ended.notify_waiters();
        }
    }
}
