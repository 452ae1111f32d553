//! What the handler learns about the idempotent execution it runs in.

use std::sync::Arc;

use distlock::LeaseWatch;

use crate::Outcome;
use crate::outcome::DecisionCell;

/// Inserted into the request extensions before the handler runs (and available as an axum
/// extractor): the fencing token to pass with the handler's own writes, the lease to watch, and
/// the hashed store key.
///
/// ```no_run
/// use axum::{Router, routing::post};
/// use tower_idempotency::IdempotencyContext;
///
/// async fn pay(ctx: IdempotencyContext) -> String {
///     // UPDATE orders SET paid = true, fence = $1 WHERE id = $2 AND fence < $1
///     format!("paid with fence {}", ctx.fence().unwrap_or(0))
/// }
/// let app: Router = Router::new().route("/pay", post(pay));
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    key: Arc<str>,
    lease: Option<LeaseWatch>,
    decision: Option<Arc<DecisionCell>>,
    /// The store names held for this request by layers further out (see [`holds`](Self::holds)),
    /// other than `key`: empty (no allocation) under one layer.
    outer: Vec<Arc<str>>,
}

impl IdempotencyContext {
    /// The context of a request whose execution holds `key`, in `extensions` (replacing that of a
    /// layer further out, whose names it keeps).
    pub(crate) fn protect(
        extensions: &mut http::Extensions,
        key: Arc<str>,
        lease: LeaseWatch,
        decision: Arc<DecisionCell>,
    ) {
        Self::install(extensions, key, Some(lease), Some(decision));
    }

    /// The context of a request run unprotected under `key` (fail-open), in `extensions`.
    pub(crate) fn unprotect(extensions: &mut http::Extensions, key: String) {
        Self::install(extensions, key.into(), None, None);
    }

    fn install(
        extensions: &mut http::Extensions,
        key: Arc<str>,
        lease: Option<LeaseWatch>,
        decision: Option<Arc<DecisionCell>>,
    ) {
        let outer = Self::held(extensions);
        extensions.insert(IdempotencyContext {
            key,
            lease,
            decision,
            outer,
        });
    }

    /// Whether a layer the request went through holds `name` (a layer on the router and one on
    /// a route, a batch endpoint that forwards its requests with their extensions): a layer
    /// finding its own name passes the request through, instead of finding its key held by the
    /// execution it runs inside (409 for every request); a layer with another name (another
    /// key) protects the request as well.
    pub(crate) fn holds(extensions: &http::Extensions, name: &str) -> bool {
        extensions.get::<IdempotencyContext>().is_some_and(|ctx| {
            (ctx.is_protected() && &*ctx.key == name) || ctx.outer.iter().any(|n| &**n == name)
        })
    }

    /// The names held by the layers `extensions` went through.
    fn held(extensions: &http::Extensions) -> Vec<Arc<str>> {
        match extensions.get::<IdempotencyContext>() {
            None => Vec::new(),
            Some(ctx) => {
                let mut held = ctx.outer.clone();
                if ctx.is_protected() {
                    held.push(ctx.key.clone());
                }
                held
            }
        }
    }

    /// Decides what a retry may do with this execution's response (see [`Outcome`]): call it
    /// when the handler knows, for example `Outcome::Retryable` on an error path that committed
    /// nothing. An [`Outcome`] in the response extensions takes precedence. Without either,
    /// the layer's default rule decides from the status
    /// ([`default_outcome`](crate::outcome::default_outcome)). Does nothing when the request runs
    /// unprotected.
    ///
    /// ```
    /// # fn f(ctx: tower_idempotency::IdempotencyContext) {
    /// use tower_idempotency::Outcome;
    /// // The card was declined before anything was booked.
    /// ctx.set_outcome(Outcome::Retryable);
    /// # }
    /// ```
    pub fn set_outcome(&self, outcome: Outcome) {
        if let Some(decision) = &self.decision {
            decision.set(outcome);
        }
    }

    /// The store key (an HKDF-SHA256 of the scope and the client's key under the server
    /// secret: never the raw key), useful in logs.
    ///
    /// ```
    /// # fn f(ctx: tower_idempotency::IdempotencyContext) {
    /// tracing::info!(idempotency_key = ctx.key(), "charging");
    /// # }
    /// ```
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fencing token of this execution: strictly greater than that of any earlier execution
    /// for the same key (for a [key that names a thing](crate::key::KeyKind::Thing), of any
    /// earlier execution about the thing, whatever its request). `None` when the request runs
    /// unprotected (store down in fail-open mode).
    ///
    /// ```
    /// # fn f(ctx: tower_idempotency::IdempotencyContext) {
    /// if let Some(fence) = ctx.fence() { /* write with fence */ }
    /// # }
    /// ```
    pub fn fence(&self) -> Option<u64> {
        self.lease.as_ref().map(LeaseWatch::fence)
    }

    /// The lease: `is_held()`, `check()`, and `lost().await` to stop work whose lease is gone
    /// (for a key that names a thing, the thing's lease).
    ///
    /// ```
    /// # async fn f(ctx: tower_idempotency::IdempotencyContext) {
    /// if let Some(lease) = ctx.lease() {
    ///     if lease.check().is_err() { return; }
    /// }
    /// # }
    /// ```
    pub fn lease(&self) -> Option<&LeaseWatch> {
        self.lease.as_ref()
    }

    /// Whether the request runs under a lease (false only in fail-open mode while the store is
    /// unreachable).
    ///
    /// ```
    /// # fn f(ctx: tower_idempotency::IdempotencyContext) {
    /// assert!(ctx.is_protected());
    /// # }
    /// ```
    pub fn is_protected(&self) -> bool {
        self.lease.is_some()
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::extract::FromRequestParts;
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::IdempotencyContext;

    /// The handler asked for an [`IdempotencyContext`] but the route has no
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) (or the method is not covered).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct MissingIdempotencyContext;

    impl MissingIdempotencyContext {
        /// 500: a server configuration error.
        pub fn status(&self) -> StatusCode {
            StatusCode::INTERNAL_SERVER_ERROR
        }

        /// The explanation.
        pub fn body_text(&self) -> &'static str {
            "this route's handler needs IdempotencyLayer, which did not run for this request"
        }
    }

    impl std::fmt::Display for MissingIdempotencyContext {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.body_text())
        }
    }

    impl std::error::Error for MissingIdempotencyContext {}

    impl IntoResponse for MissingIdempotencyContext {
        fn into_response(self) -> Response {
            (self.status(), self.body_text()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
        type Rejection = MissingIdempotencyContext;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<IdempotencyContext>()
                .cloned()
                .ok_or(MissingIdempotencyContext)
        }
    }

    impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for IdempotencyContext {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<IdempotencyContext>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingIdempotencyContext;
