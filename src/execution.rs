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

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use http::Response;
use http_body::Body;
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::body::{BoxError, ResponseBody};
use crate::complete;
use crate::drive::{Driver, Execution};
use crate::live::Live;
use crate::metrics::Event;
use crate::run::{Finished, Run};
use crate::{KeepBody, Outcome};

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
    let driver: Driver = if span.is_disabled() {
        crate::future::boxed(|| execute(future, run, reply, live))
    } else {
        crate::future::boxed(|| execute(future, run, reply, live).instrument(span))
    };
    Some(Started {
        result,
        execution: Execution::detached(driver, detach),
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
        Outcome::Retryable => run.span.record("outcome", "retryable"),
        Outcome::Unknown => &run.span,
        _ => run.span.record("outcome", "final"),
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
