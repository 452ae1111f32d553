//! A connection that runs a hook between a reply and its handling: another client's commands
//! placed exactly there, or the client's own thread stalled (a process descheduled with the
//! reply in hand).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A multiplexed connection that, once armed, runs its hook after the next reply (of a command
/// or a pipeline) came and before it is handed on. Clones share the hook.
#[derive(Clone)]
pub struct HookedConnection {
    inner: MultiplexedConnection,
    hook: Arc<Mutex<Option<Hook>>>,
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
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    async fn run_hook(&self) {
        let hook = self.hook.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(hook) = hook {
            hook().await;
        }
    }
}

impl ConnectionLike for HookedConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let reply = self.inner.req_packed_command(cmd).await;
            self.run_hook().await;
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let replies = self
                .inner
                .req_packed_commands(pipeline, offset, count)
                .await;
            self.run_hook().await;
            replies
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}
