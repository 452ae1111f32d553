//! A connection that runs a hook between a reply and its handling: another client's commands
//! placed exactly there, or the client's own thread stalled (a process descheduled with the
//! reply in hand).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A hook and what it waits for: the next reply (`None`), or the reply to the next command
/// whose packed form contains these bytes.
type Armed = (Option<Vec<u8>>, Hook);

/// A multiplexed connection that, once armed, runs its hook after the next reply (of a command
/// or a pipeline), or after the reply to a given command, came and before it is handed on.
/// Clones share the hook.
#[derive(Clone)]
pub struct HookedConnection {
    inner: MultiplexedConnection,
    hook: Arc<Mutex<Option<Armed>>>,
}

impl std::fmt::Debug for HookedConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookedConnection").finish_non_exhaustive()
    }
}

impl HookedConnection {
    /// Wraps `inner`, with no hook armed.
    pub fn new(inner: MultiplexedConnection) -> Self {
        HookedConnection {
            inner,
            hook: Arc::default(),
        }
    }

    /// Runs `hook` after the next reply; it may block its thread (a stall) or await other
    /// clients' commands (an interleaving).
    pub fn after_next_reply<F>(&self, hook: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let hook: Hook = Box::new(move || Box::pin(hook()));
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some((None, hook));
    }

    /// Runs `hook` after the reply to the next command (or pipeline) whose packed form
    /// contains `needle` (a function's name, a key), whatever else the connection carries
    /// meanwhile. The hook runs in the task that sent that command, and a pending hook holds
    /// that command's caller only.
    pub fn after_reply_to<F>(&self, needle: &[u8], hook: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let hook: Hook = Box::new(move || Box::pin(hook()));
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some((Some(needle.to_vec()), hook));
    }

    /// The hook for the command packed as `sent` (`None`: for whichever reply comes next).
    fn take_hook(&self, sent: Option<&[u8]>) -> Option<Hook> {
        let mut armed = self.hook.lock().unwrap_or_else(|e| e.into_inner());
        let mine = match (&*armed, sent) {
            (Some((None, _)), None) => true,
            (Some((Some(needle), _)), Some(sent)) => {
                sent.windows(needle.len()).any(|w| w == &needle[..])
            }
            _ => false,
        };
        if mine {
            armed.take().map(|(_, hook)| hook)
        } else {
            None
        }
    }

    /// Sends through the inner connection; runs the hook armed for this command, or for the
    /// next reply, once the reply came.
    async fn hooked<T>(&self, sent: Vec<u8>, reply: impl Future<Output = T>) -> T {
        let mine = self.take_hook(Some(&sent));
        let reply = reply.await;
        if let Some(hook) = mine.or_else(|| self.take_hook(None)) {
            hook().await;
        }
        reply
    }
}

impl ConnectionLike for HookedConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut inner = self.inner.clone();
            self.hooked(cmd.get_packed_command(), inner.req_packed_command(cmd))
                .await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let mut inner = self.inner.clone();
            self.hooked(
                pipeline.get_packed_pipeline(),
                inner.req_packed_commands(pipeline, offset, count),
            )
            .await
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}
