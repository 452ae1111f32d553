//! A connection that runs a hook between a reply and its handling (another client's commands
//! placed exactly there, or the client's own thread stalled: a process descheduled with the
//! reply in hand), or before a command is sent (a command held on its way).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A hook and where it runs: after the next reply (no needle), or before sending or after the
/// reply of the next command whose packed form contains the needle.
struct Armed {
    needle: Option<Vec<u8>>,
    before: bool,
    hook: Hook,
}

/// A multiplexed connection that, once armed, runs its hook after the next reply (of a command
/// or a pipeline), or before sending or after the reply of a given command, and before it is
/// handed on. Clones share the hook.
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
        self.arm(None, false, Box::new(move || Box::pin(hook())));
    }

    /// Runs `hook` after the reply to the next command (or pipeline) whose packed form
    /// contains `needle` (a function's name, a key), whatever else the connection carries
    /// meanwhile. The hook runs in the task that sent that command, and a pending hook holds
    /// that command's caller only.
    pub fn after_reply_to<F>(&self, needle: &[u8], hook: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.arm(Some(needle), false, Box::new(move || Box::pin(hook())));
    }

    /// Runs `hook` before sending the next command (or pipeline) whose packed form contains
    /// `needle`: a command held on its way (a pending hook), whose caller may give up before
    /// it is sent.
    pub fn before_sending<F>(&self, needle: &[u8], hook: impl FnOnce() -> F + Send + 'static)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.arm(Some(needle), true, Box::new(move || Box::pin(hook())));
    }

    fn arm(&self, needle: Option<&[u8]>, before: bool, hook: Hook) {
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(Armed {
            needle: needle.map(<[u8]>::to_vec),
            before,
            hook,
        });
    }

    /// The hook for the command packed as `sent` (`None`: for whichever reply comes next),
    /// and whether it runs before sending.
    fn take_hook(&self, sent: Option<&[u8]>) -> Option<(bool, Hook)> {
        let mut armed = self.hook.lock().unwrap_or_else(|e| e.into_inner());
        let mine = match (armed.as_ref().map(|a| &a.needle), sent) {
            (Some(None), None) => true,
            (Some(Some(needle)), Some(sent)) => {
                needle.is_empty() || sent.windows(needle.len()).any(|w| w == &needle[..])
            }
            _ => false,
        };
        if mine {
            armed.take().map(|a| (a.before, a.hook))
        } else {
            None
        }
    }

    /// Sends through the inner connection, running the hook armed for this command (before
    /// sending it or once its reply came), or the one for the next reply.
    async fn hooked<T>(&self, sent: Vec<u8>, reply: impl Future<Output = T>) -> T {
        let mut after = None;
        match self.take_hook(Some(&sent)) {
            Some((true, hook)) => hook().await,
            Some((false, hook)) => after = Some(hook),
            None => {}
        }
        let reply = reply.await;
        if let Some(hook) = after.or_else(|| self.take_hook(None).map(|(_, hook)| hook)) {
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
