//! The response future: an explicit state machine around the begin step, the inner service's
//! readiness and the protected execution.
//!
//! ```text
//! Beginning ──(reject / replay)──────────────────────────────────────────▶ Done
//!     │ run (lease taken, or unprotected)
//!     ▼
//! Calling (inner service ready? then call it) ──(unprotected)──▶ Unprotected ─▶ Done
//!     │ protected: the execution starts
//!     ▼
//! Running (drive the execution until its head is known; dropping this detaches it, never
//!          cancels it, unless `cancel_on_disconnect`) ──▶ Done (the body drives what is left)
//! ```
//!
//! The inner service is asked for readiness only once the handler is about to be called, so
//! that a request reading its body or waiting for a duplicate does not pin a `ConcurrencyLimit`
//! or `Buffer` slot meanwhile (tower's `Oneshot` shape).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::sync::oneshot;
use tower_service::Service;

use crate::Rejection;
use crate::begin::Decision;
use crate::body::{BoxError, RequestBody, ResponseBody};
use crate::drive::Driving;
use crate::drive::Execution;
use crate::execution::{self, Started};
use crate::layer::Config;
use crate::run::{Finished, Run};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The future `make` makes, on the heap: the room is allocated first and the future written
/// into it, where `Box::pin(make())` may build it on the stack and copy its whole size (that of
/// its largest state, kilobytes for the begin step) to the heap.
pub(crate) fn boxed<F>(make: impl FnOnce() -> F) -> BoxFuture<F::Output>
where
    F: Future + Send + 'static,
{
    let slot: Box<std::mem::MaybeUninit<F>> = Box::new_uninit();
    let future: Box<F> = Box::write(slot, make());
    Box::into_pin(future)
}

pin_project! {
    /// Response future of [`Idempotency`](crate::Idempotency).
    pub struct ResponseFuture<S, ReqBody, ResBody>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    {
        #[pin]
        state: State<S, ReqBody, ResBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, ResBody>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    {
        Beginning { begin: BoxFuture<Decision<ReqBody, ResBody>>, inner: Option<S> },
        Calling { inner: S, request: Option<Request<RequestBody<ReqBody>>>, run: Option<Box<Run>> },
        Unprotected { #[pin] future: S::Future },
        Running {
            result: oneshot::Receiver<Finished<ResBody, S::Error>>,
            // Driven here until its head is known, then by the response body.
            execution: Option<Execution>,
            // Made when the head is not known at the first poll (see `crate::drive`).
            driving: Option<Driving>,
            fence: u64,
            config: Arc<Config>,
        },
        Done,
    }
}

impl<S, ReqBody, ResBody> std::fmt::Debug for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Beginning { .. } => "Beginning",
            State::Calling { .. } => "Calling",
            State::Unprotected { .. } => "Unprotected",
            State::Running { .. } => "Running",
            State::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
{
    /// Calls `inner` with `request` unprotected, once it is ready.
    pub(crate) fn passthrough(inner: S, request: Request<RequestBody<ReqBody>>) -> Self {
        ResponseFuture {
            state: State::Calling {
                inner,
                request: Some(request),
                run: None,
            },
        }
    }

    pub(crate) fn beginning(begin: BoxFuture<Decision<ReqBody, ResBody>>, inner: S) -> Self {
        ResponseFuture {
            state: State::Beginning {
                begin,
                inner: Some(inner),
            },
        }
    }
}

/// A rejection rendered without the layer's configuration: for states that cannot happen.
fn respond<B>(rejection: Rejection) -> Response<ResponseBody<B>> {
    rejection
        .to_response()
        .map(|body| ResponseBody::full(body, None))
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Beginning { begin, inner } => match ready!(begin.as_mut().poll(cx)) {
                    Decision::Respond(response) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response));
                    }
                    Decision::Run { request, run } => {
                        let Some(inner) = inner.take() else {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(respond(Rejection::StoreUnavailable {
                                retry_after: std::time::Duration::from_secs(1),
                            })));
                        };
                        this.state.set(State::Calling {
                            inner,
                            request: Some(request),
                            run,
                        });
                    }
                },
                StateProj::Calling {
                    inner,
                    request,
                    run,
                } => {
                    if let Err(error) = ready!(inner.poll_ready(cx)) {
                        // Not called: dropping the run releases its lease.
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                    let Some(request) = request.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(respond(Rejection::StoreUnavailable {
                            retry_after: std::time::Duration::from_secs(1),
                        })));
                    };
                    let Some(run) = run.take() else {
                        let future = inner.call(request);
                        this.state.set(State::Unprotected { future });
                        continue;
                    };
                    let fence = run.guard.fence();
                    let config = run.config.clone();
                    // A service may do its work in `call` itself and panic there: the panic
                    // goes through the execution like a handler's (the outcome is unknown, the
                    // key is not released) and then reaches the caller.
                    let called = std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request)));
                    let started = match called {
                        Ok(future) => execution::start(future, run),
                        Err(panic) => execution::start(panicked(panic), run),
                    };
                    match started {
                        Some(Started { result, execution }) => {
                            this.state.set(State::Running {
                                result,
                                execution: Some(execution),
                                driving: None,
                                fence,
                                config,
                            });
                        }
                        None => {
                            tracing::error!(
                                "tower-idempotency needs a Tokio runtime to run protected requests"
                            );
                            this.state.set(State::Done);
                            let rejection = Rejection::StoreUnavailable {
                                retry_after: config.retry_after,
                            };
                            return Poll::Ready(Ok(config.problem(&rejection)));
                        }
                    }
                }
                StateProj::Unprotected { future } => {
                    let response = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(response.map(|r| r.map(ResponseBody::inner)));
                }
                StateProj::Running {
                    result,
                    execution,
                    driving,
                    fence,
                    config,
                } => {
                    let polled = match driving {
                        Some(driving) => {
                            let (ended, polled) = driving
                                .poll(cx, execution.as_mut(), |cx| Pin::new(&mut *result).poll(cx));
                            if ended {
                                *execution = None;
                            }
                            polled
                        }
                        None => {
                            if let Some(running) = execution
                                && running.poll(cx)
                            {
                                *execution = None;
                            }
                            match Pin::new(&mut *result).poll(cx) {
                                Poll::Ready(finished) => Poll::Ready(finished),
                                // The head comes later: from now on the channel holds a waker
                                // that driving the execution does not set off.
                                Poll::Pending => {
                                    driving
                                        .insert(Driving::new())
                                        .poll(cx, None, |cx| Pin::new(&mut *result).poll(cx))
                                        .1
                                }
                            }
                        }
                    };
                    let finished = ready!(polled);
                    let execution = execution.take();
                    let fence = *fence;
                    let config = config.clone();
                    this.state.set(State::Done);
                    return Poll::Ready(match finished {
                        Ok(Finished::Response(mut response)) => {
                            // What is left: storing a whole body (never cancelled), or
                            // feeding a streamed one. A detached execution goes on in a task
                            // of its own, at its own pace, whatever the client reads; a
                            // cancellable one is driven by the body as the client reads it.
                            if let Some(execution) = execution
                                && !execution.is_detached()
                                && let Some(mut rest) = response.body_mut().drive(execution)
                            {
                                rest.detach();
                            }
                            Ok(response)
                        }
                        Ok(Finished::Error(error)) => Err(error),
                        Ok(Finished::Panic(panic)) => std::panic::resume_unwind(panic),
                        // The execution ended without an answer (its runtime shut down).
                        Err(_) => Ok(config.problem(&Rejection::OutcomeUnknown { fence })),
                    });
                }
                StateProj::Done => panic!("ResponseFuture polled after it completed"),
            }
        }
    }
}

/// A future that resumes a panic caught while it was being made (in a service's `call`).
async fn panicked<T>(panic: Box<dyn Any + Send>) -> T {
    std::panic::resume_unwind(panic)
}
