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
//! The response head is handed to the client as soon as the handler returns it. A body that is
//! complete at once (the common case: JSON built in memory) is stored and sent whole; any other
//! body is forwarded frame by frame as it comes, and kept for the record as it passes.
//!
//! With [`cancel_on_disconnect`](crate::IdempotencyLayerBuilder::cancel_on_disconnect) nothing
//! is spawned: the response future drives the execution until the head is known, then hands
//! it to the response body, which drives it while the client reads. The client going away
//! drops it: the handler is cancelled and the key released (for handlers known to be
//! cancel-safe).

use std::any::Any;
use std::future::{Future, poll_fn};
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, Response};
use http_body::{Body, Frame};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::Outcome;
use crate::begin::Run;
use crate::body::{BoxError, Feed, Message, ResponseBody};
use crate::complete;
use crate::metrics::Event;

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

/// The most read from a body before its head goes out: a body complete within it is stored and
/// sent whole; a longer one is forwarded frame by frame.
const WHOLE_LIMIT: usize = 64 * 1024;

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
    let execution = execute(future, *run, reply).instrument(span);
    if inline {
        return Some(Started {
            result,
            driver: Some(Box::pin(execution)),
        });
    }
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    runtime.spawn(execution);
    Some(Started {
        result,
        driver: None,
    })
}

async fn execute<F, B, E>(future: F, run: Run, reply: oneshot::Sender<Finished<B, E>>)
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

    let mut body = pin!(body);
    let mut kept = Kept::new(run.config.record_limit);
    let mut early: Vec<Frame<Bytes>> = Vec::new();
    let mut early_len = 0;
    // What the body has ready now, up to a limit: most bodies are complete at once.
    let failed = loop {
        let polled = poll_fn(|cx| match poll_frame(body.as_mut(), cx) {
            Poll::Ready(frame) => Poll::Ready(Some(frame)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        match polled {
            None => break None,
            Some(None) => {
                let (data, trailers) = whole(early);
                complete::response(
                    run,
                    parts.status,
                    &parts.headers,
                    kept.body().as_deref(),
                    trailers.as_ref(),
                )
                .await;
                let _ = reply.send(Finished::Response(Response::from_parts(
                    parts,
                    ResponseBody::full(data, trailers),
                )));
                return;
            }
            Some(Some(Ok(frame))) => {
                kept.add(&frame);
                early_len += frame.data_ref().map_or(0, Bytes::len);
                early.push(frame);
                if early_len > WHOLE_LIMIT {
                    break None;
                }
            }
            Some(Some(Err(error))) => break Some(error),
        }
    };

    // A streamed body: the head goes out now, the frames as they come.
    let status = parts.status;
    let headers = parts.headers.clone();
    let (mut feed, live) = Feed::channel();
    let _ = reply.send(Finished::Response(Response::from_parts(parts, live)));
    for frame in early {
        feed.send(Message::Frame(frame)).await;
    }
    let mut failed: Option<BoxError> = failed;
    while failed.is_none() {
        let next = poll_fn(|cx| poll_frame(body.as_mut(), cx)).await;
        match next {
            None => break,
            Some(Ok(frame)) => {
                kept.add(&frame);
                feed.send(Message::Frame(frame)).await;
            }
            Some(Err(error)) => failed = Some(error),
        }
    }
    match failed {
        Some(error) => {
            tracing::warn!(%error, "idempotency: the response body failed half-way");
            complete::unknown(run, "the response body failed half-way").await;
            feed.send(Message::Error(error)).await;
        }
        None => {
            let body = kept.body();
            complete::response(
                run,
                status,
                &headers,
                body.as_deref(),
                kept.trailers.as_ref(),
            )
            .await;
            feed.send(Message::End).await;
        }
    }
}

/// The next frame of the handler's body with `Bytes` data (no copy when the data is `Bytes`),
/// its error boxed. A body that panics is a body that broke off: the outcome is unknown.
fn poll_frame<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let Ok(polled) = std::panic::catch_unwind(AssertUnwindSafe(|| body.poll_frame(cx))) else {
        return Poll::Ready(Some(Err("the response body panicked".into())));
    };
    polled.map(|frame| {
        frame.map(|frame| {
            frame
                .map(|f| f.map_data(|mut d| d.copy_to_bytes(d.remaining())))
                .map_err(Into::into)
        })
    })
}

/// Data and trailers of frames read whole.
fn whole(frames: Vec<Frame<Bytes>>) -> (Bytes, Option<HeaderMap>) {
    let mut data = Vec::with_capacity(frames.len());
    let mut trailers = None;
    for frame in frames {
        match frame.into_data() {
            Ok(d) => data.push(d),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    (concat(data), trailers)
}

fn concat(mut chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut out = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            for c in chunks {
                out.extend_from_slice(&c);
            }
            out.freeze()
        }
    }
}

/// The body kept for the record while it passes, up to the storage limit.
struct Kept {
    chunks: Vec<Bytes>,
    len: usize,
    limit: usize,
    over: bool,
    trailers: Option<HeaderMap>,
}

impl Kept {
    fn new(limit: usize) -> Self {
        Kept {
            chunks: Vec::new(),
            len: 0,
            limit,
            over: false,
            trailers: None,
        }
    }

    fn add(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.len += data.len();
            if self.over {
                return;
            }
            if self.len > self.limit {
                self.over = true;
                self.chunks = Vec::new();
            } else {
                self.chunks.push(data.clone());
            }
        } else if let Some(trailers) = frame.trailers_ref() {
            self.trailers = Some(trailers.clone());
        }
    }

    /// The whole body, or `None` when it was over the limit.
    fn body(&mut self) -> Option<Bytes> {
        (!self.over).then(|| concat(std::mem::take(&mut self.chunks)))
    }
}
