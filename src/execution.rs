//! The protected execution: the handler, its response body and the storing of its outcome, run
//! to their end whatever happens to the client.
//!
//! Once the handler has been called under a lease, the client going away (hyper drops the
//! response future when the connection closes; a `TimeoutLayer` outside the layer; an HTTP/2
//! stream reset) must not cancel it: a cancelled handler may have committed its work, and a
//! released key lets the client's retry run it again. The execution is an [`Execution`]: the
//! response future drives it (no task, no channel hop: the handler runs where it would run
//! without the layer), then the response body while the client reads a streamed response, and
//! whoever drops it before its end hands it to a task of its own, where it goes on, stores the
//! outcome, and leaves the replay for the retry.
//!
//! The response head is handed to the client as soon as the handler returns it; a final
//! response's body goes to the client and into the store through [`crate::tee`]. A whole body
//! goes out as soon as its record is on its way to the store (the store command sent, not yet
//! answered): the client does not wait for the completion round trip, while the lease keeps
//! the key until the record is stored (a duplicate arriving meanwhile waits for it, see
//! [`crate::begin`]).
//!
//! With [`cancel_on_disconnect`](crate::IdempotencyLayerBuilder::cancel_on_disconnect), the
//! client going away before the handler has returned (or while a streamed body is being sent)
//! cancels the execution: the handler is dropped and the key released (for handlers known to be
//! cancel-safe). Once a whole response is ready, its storing is never cancelled.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Context;

use futures_util::FutureExt;
use http::Response;
use http_body::Body;
use tokio::sync::{Notify, oneshot};
use tracing::Instrument;

use crate::begin::Run;
use crate::body::{BoxError, ResponseBody};
use crate::complete;
use crate::layer::Config;
use crate::metrics::Event;
use crate::{KeepBody, Outcome};

/// How a protected execution ended, as the response future learns it.
// Moved once, through a oneshot channel that has room for it: boxing the response would only
// add an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Finished<B, E> {
    /// The response head, with a body that is whole or fed by the execution.
    Response(Response<ResponseBody<B>>),
    /// The service returned an error (its outcome is handled as unknown).
    Error(E),
    /// The handler panicked: the panic resumes in the response future, as without the layer.
    Panic(Box<dyn Any + Send>),
}

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

/// A started execution: its result, and the execution to drive.
pub(crate) struct Started<B, E> {
    pub(crate) result: oneshot::Receiver<Finished<B, E>>,
    pub(crate) execution: Execution,
}

/// Starts the execution of `future` (the handler, just called) under `run`'s lease: detached
/// (the default: dropped, it runs on in a task of its own), or cancellable for
/// `cancel_on_disconnect`. `None` when it should be detached and there is no Tokio runtime to
/// run it on (the future is dropped unpolled; the lease is released).
pub(crate) fn start<F, B, E>(future: F, run: Box<Run>) -> Option<Started<B, E>>
where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    E: Send + 'static,
{
    let (reply, result) = oneshot::channel();
    let detach = if run.config.cancel_on_disconnect {
        None
    } else {
        Some(tokio::runtime::Handle::try_current().ok()?)
    };
    let span = run.span.clone();
    let live = Live::new(&run.config);
    let execution = execute(future, run, reply, live);
    let driver: Driver = if span.is_disabled() {
        Box::pin(execution)
    } else {
        Box::pin(execution.instrument(span))
    };
    Some(Started {
        result,
        execution: Execution {
            driver: Some(driver),
            detach,
        },
    })
}

async fn execute<F, B, E>(
    future: F,
    run: Box<Run>,
    reply: oneshot::Sender<Finished<B, E>>,
    _live: Live,
) where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body,
    B::Error: Into<BoxError>,
{
    let response = match AssertUnwindSafe(future).catch_unwind().await {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            complete::unknown(run, "the service returned an error").await;
            let _ = reply.send(Finished::Error(error));
            return;
        }
        Err(panic) => {
            complete::unknown(run, "the handler panicked").await;
            let _ = reply.send(Finished::Panic(panic));
            return;
        }
    };
    let (mut parts, body) = response.into_parts();
    let decided = parts
        .extensions
        .remove::<Outcome>()
        .or_else(|| run.decision.get())
        .or_else(|| crate::outcome::grpc_outcome(&parts.headers));
    let outcome = match decided {
        Some(outcome) => outcome,
        // The application's policy, after the handler ran: a panic there is a handler's.
        None => match std::panic::catch_unwind(AssertUnwindSafe(|| {
            (run.config.default_outcome)(parts.status)
        })) {
            Ok(outcome) => outcome,
            Err(panic) => {
                complete::unknown(run, "the default outcome policy panicked").await;
                let _ = reply.send(Finished::Panic(panic));
                return;
            }
        },
    };
    match outcome {
        // Released before the client sees the answer: its retry runs the handler again.
        Outcome::Retryable => complete::release(run, Event::NotStored).await,
        // Recorded (or released, as the policy says) before the client sees the answer.
        Outcome::Unknown => complete::unknown(run, "the response says it was cut short").await,
        _ => {
            let keep = parts.extensions.remove::<KeepBody>() != Some(KeepBody::No);
            crate::tee::tee(run, parts, body, keep, reply).await;
            return;
        }
    }
    let _ = reply.send(Finished::Response(Response::from_parts(
        parts,
        ResponseBody::inner(body),
    )));
}
