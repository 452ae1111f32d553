//! The middleware service.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::ResponseFuture;
use crate::body::ResponseBody;
use crate::layer::Config;

/// Makes an inner service idempotent; built by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// Requests whose method is not covered go straight to the inner service. Covered requests have
/// their body buffered (it is handed on to the inner service unchanged), their key and
/// fingerprint computed, and the store consulted before the inner service is called.
///
/// ```
/// use tower_idempotency::{Idempotency, IdempotencyLayer, Store};
/// let layer = IdempotencyLayer::new(Store::memory());
/// let svc = tower::service_fn(|_req: http::Request<axum::body::Body>| async {
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
    /// let svc = Idempotency::new(tower::service_fn(|_: http::Request<axum::body::Body>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// }), &IdempotencyLayer::new(Store::memory()));
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ReqBody::Data: Send,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if !self.config.methods.contains(request.method()) {
            crate::metrics::count(crate::metrics::Outcome::Passthrough);
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        // The inner service was polled ready: keep that one for the call, leave a clone here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = tracing::debug_span!(
            "idempotency",
            method = %request.method(),
            path = %request.uri().path(),
        );
        let begin = crate::begin::begin(self.config.clone(), request, span.clone());
        ResponseFuture::beginning(Box::pin(begin.instrument(span)), inner)
    }
}
