//! The response future: an explicit state machine around the inner service's future.
//!
//! ```text
//! Beginning ──(reject / replay)──────────────────────────────▶ Done
//!     │ run (lease taken, or unprotected)
//!     ▼
//! Running (the handler) ──(error: lease released on drop)────▶ Done
//!     │ response
//!     ▼
//! Completing (store the response, release) ──────────────────▶ Done
//! ```
//!
//! The lease lives in the state while the handler runs: dropping the future (the client went
//! away) or a panic in the handler drops it, and dropping it releases the lock in the background.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::begin::{Decision, Run};
use crate::body::ResponseBody;
use crate::metrics::{Outcome, count};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// Response future of [`Idempotency`](crate::Idempotency).
    pub struct ResponseFuture<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ResBody: Body,
    {
        #[pin]
        state: State<S, ReqBody, ResBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody, ResBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        ResBody: Body,
    {
        Passthrough { #[pin] future: S::Future },
        Beginning { begin: BoxFuture<Decision<ReqBody>>, inner: Option<S> },
        Running { #[pin] future: S::Future, run: Option<Box<Run>> },
        Completing { complete: BoxFuture<Response<ResponseBody<ResBody>>> },
        Done,
    }
}

impl<S, ReqBody, ResBody> std::fmt::Debug for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Passthrough { .. } => "Passthrough",
            State::Beginning { .. } => "Beginning",
            State::Running { .. } => "Running",
            State::Completing { .. } => "Completing",
            State::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<S, ReqBody, ResBody> ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    pub(crate) fn passthrough(future: S::Future) -> Self {
        ResponseFuture {
            state: State::Passthrough { future },
        }
    }

    pub(crate) fn beginning(begin: BoxFuture<Decision<ReqBody>>, inner: S) -> Self {
        ResponseFuture {
            state: State::Beginning {
                begin,
                inner: Some(inner),
            },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Passthrough { future } => {
                    let response = ready!(future.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(response.map(|r| r.map(ResponseBody::inner)));
                }
                StateProj::Beginning { begin, inner } => match ready!(begin.as_mut().poll(cx)) {
                    Decision::Respond(response) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response.map(ResponseBody::full)));
                    }
                    Decision::Run { request, run } => {
                        let mut service = inner.take().expect("the service is called once");
                        let future = service.call(request);
                        this.state.set(State::Running { future, run });
                    }
                },
                StateProj::Running { future, run } => match ready!(future.poll(cx)) {
                    Err(error) => {
                        // Dropping the guard releases the lease: a retry runs the handler again.
                        if run.take().is_some() {
                            count(Outcome::NotStored);
                        }
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                    Ok(response) => match run.take() {
                        None => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                        }
                        Some(run) => {
                            let complete = Box::pin(crate::complete::complete(run, response));
                            this.state.set(State::Completing { complete });
                        }
                    },
                },
                StateProj::Completing { complete } => {
                    let response = ready!(complete.as_mut().poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done => panic!("ResponseFuture polled after it completed"),
            }
        }
    }
}
