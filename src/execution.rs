//! The protected execution: the handler, its response body and the storing of its outcome, run
//! to their end in a task of their own.
//!
//! Once the handler has been called under a lease, the client going away (hyper drops the
//! response future when the connection closes; a `TimeoutLayer` outside the layer; an HTTP/2
//! stream reset) must not cancel it: a cancelled handler may have committed its work, and a
//! released key lets the client's retry run it again. So the service spawns the protected part
//! and the response future only awaits its result: dropping the response future (or the
//! response body) detaches from the execution, which goes on, stores the outcome, and leaves
//! the replay for the retry.
//!
//! The response head is handed to the client as soon as the handler returns it; a final
//! response's body goes to the client and into the store through [`crate::tee`].
//!
//! With [`cancel_on_disconnect`](crate::IdempotencyLayerBuilder::cancel_on_disconnect) nothing
//! is spawned: the response future drives the execution until the head is known, then hands
//! it to the response body, which drives it while the client reads. The client going away
//! drops it: the handler is cancelled and the key released (for handlers known to be
//! cancel-safe).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures_util::FutureExt;
use http::Response;
use http_body::Body;
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::begin::Run;
use crate::body::{BoxError, ResponseBody};
use crate::complete;
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

/// An execution driven by whoever holds it (not spawned): dropping it cancels it.
pub(crate) type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A started execution: its result, and its driver when it runs inline.
pub(crate) struct Started<B, E> {
    pub(crate) result: oneshot::Receiver<Finished<B, E>>,
    pub(crate) driver: Option<Driver>,
}

/// Starts the execution of `future` (the handler, just called) under `run`'s lease: spawned
/// (the default), or inline for `cancel_on_disconnect`. `None` when it should be spawned and
/// there is no Tokio runtime (the future is dropped unpolled; the lease is released).
pub(crate) fn start<F, B, E>(future: F, run: Box<Run>) -> Option<Started<B, E>>
where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    E: Send + 'static,
{
    let (reply, result) = oneshot::channel();
    let inline = run.config.cancel_on_disconnect;
    let span = run.span.clone();
    let execution = execute(future, run, reply);
    if inline {
        let driver: Driver = if span.is_disabled() {
            Box::pin(execution)
        } else {
            Box::pin(execution.instrument(span))
        };
        return Some(Started {
            result,
            driver: Some(driver),
        });
    }
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    if span.is_disabled() {
        runtime.spawn(execution);
    } else {
        runtime.spawn(execution.instrument(span));
    }
    Some(Started {
        result,
        driver: None,
    })
}

async fn execute<F, B, E>(future: F, run: Box<Run>, reply: oneshot::Sender<Finished<B, E>>)
where
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
    let outcome = parts
        .extensions
        .remove::<Outcome>()
        .or_else(|| run.decision.get())
        .or_else(|| crate::outcome::grpc_outcome(&parts.headers))
        .unwrap_or_else(|| (run.config.default_outcome)(parts.status));
    if outcome == Outcome::Retryable {
        // Released before the client sees the answer: its retry runs the handler again.
        complete::release(run, Event::NotStored).await;
        let _ = reply.send(Finished::Response(Response::from_parts(
            parts,
            ResponseBody::inner(body),
        )));
        return;
    }

    let keep = parts.extensions.remove::<KeepBody>() != Some(KeepBody::No);
    crate::tee::tee(run, parts, body, keep, reply).await;
}
