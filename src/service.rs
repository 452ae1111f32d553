//! The middleware service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::ResponseFuture;
use crate::body::{BoxError, RequestBody, ResponseBody};
use crate::layer::Config;

/// Makes an inner service idempotent; built by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Requests whose method is not covered go straight to the inner service. Covered requests have
/// their key and fingerprint computed (reading the body when the key or the fingerprint needs
/// it; the inner service gets the same bytes as a [`RequestBody`]), and the store consulted
/// before the inner service is called. The protected execution (the handler, its body and the
/// storing of its outcome) is driven by the response future and, if that is dropped before the
/// end, goes on in a task of its own, so it needs `Send + 'static` futures and bodies, and a
/// Tokio runtime.
///
/// ```
/// use tower_idempotency::{Idempotency, IdempotencyLayer, RequestBody, Store};
/// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build().unwrap();
/// let svc = tower::service_fn(|_req: http::Request<RequestBody<axum::body::Body>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
/// });
/// let wrapped: Idempotency<_> = tower::Layer::layer(&layer, svc);
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Idempotency<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Idempotency { inner, config }
    }

    /// Wraps `inner` with the configuration of `layer`.
    ///
    /// ```
    /// # use tower_idempotency::{Idempotency, IdempotencyLayer, Store};
    /// let svc = Idempotency::new(tower::service_fn(|_: http::Request<tower_idempotency::RequestBody<axum::body::Body>>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// }), &IdempotencyLayer::builder(Store::memory()).global_keys().build().unwrap());
    /// ```
    pub fn new(inner: S, layer: &crate::IdempotencyLayer) -> Self {
        Idempotency::from_config(inner, layer.config().clone())
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Whether axum routed the request to a fallback (no route matched): it passes through
/// untouched, so an unknown path gets the router's 404, not a key rejection. (Under
/// `Router::layer` the fallback is layered too; axum marks every request it routes with
/// `OriginalUri`, and matched ones with `MatchedPath`. A service nested with `nest_service`
/// gets no `MatchedPath` either, and nothing public tells it from the fallback: a layer that
/// wraps such a service itself is built with `cover_unmatched`.)
fn unmatched<B>(request: &Request<B>) -> bool {
    #[cfg(feature = "axum")]
    {
        let extensions = request.extensions();
        extensions.get::<axum::extract::OriginalUri>().is_some()
            && extensions.get::<axum::extract::MatchedPath>().is_none()
    }
    #[cfg(not(feature = "axum"))]
    {
        let _ = request;
        false
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, ResBody>;

    /// Always ready: the inner service is asked for readiness in the response future, once the
    /// handler is about to be called (a request reading its body or waiting for a duplicate
    /// holds no slot of a `ConcurrencyLimit` or `Buffer` below).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let inner = self.inner.clone();
        if !self.config.methods.contains(request.method())
            || (unmatched(&request) && !self.config.cover_unmatched)
        {
            crate::metrics::count(crate::metrics::Event::Passthrough);
            return ResponseFuture::passthrough(inner, request.map(RequestBody::new));
        }
        // The route template, never the path itself: a path can hold the key (a phone number
        // in `/users/{phone}`) or other personal data, and spans may be exported. The fields
        // filled in as the request goes: see the crate docs, "Traces and metrics".
        let span = tracing::info_span!(
            "idempotency",
            method = %request.method(),
            route = crate::key::template_in(request.extensions()).unwrap_or("(no route template)"),
            decision = tracing::field::Empty,
            reason = tracing::field::Empty,
            outcome = tracing::field::Empty,
            key = tracing::field::Empty,
            store_us = tracing::field::Empty,
        );
        let config = self.config.clone();
        // No subscriber is interested (the usual case in production): no span to enter.
        let begin: crate::future::BoxFuture<_> = if span.is_disabled() {
            crate::future::boxed(|| crate::begin::begin(config, request, span))
        } else {
            crate::future::boxed(|| {
                crate::begin::begin(config, request, span.clone()).instrument(span)
            })
        };
        ResponseFuture::beginning(begin, inner)
    }
}
