//! What a retry may do after a handler ran: the handler's decision, the default by status, and
//! what happens when the outcome cannot be known.
//!
//! # The decision
//!
//! Once the handler returned a response, it is either **final** (stored, and every retry within
//! the retention gets it replayed, even a 5xx: the work may have committed) or **retryable**
//! (nothing was committed: the key is released and nothing is stored, so a retry runs the
//! handler again). The handler says which, with a response extension or through its
//! [`IdempotencyContext`](crate::IdempotencyContext):
//!
//! ```
//! use axum::{Extension, http::StatusCode, response::IntoResponse};
//! use tower_idempotency::Outcome;
//!
//! async fn charge() -> impl IntoResponse {
//!     // The payment provider refused before anything was booked: let the client try again.
//!     (StatusCode::BAD_GATEWAY, Extension(Outcome::Retryable), "provider unavailable")
//! }
//! ```
//!
//! Without a decision, [`default_outcome`] decides from the status: the statuses that say
//! "not processed" are retryable (408, 409, 425, 429, 503, and 401/403, which an
//! authentication extractor answers before the handler runs: a client that refreshes its token
//! must not get the old 401 replayed for 24 hours); every other status is final, 5xx included.
//! [`IdempotencyLayerBuilder::default_outcome`](crate::IdempotencyLayerBuilder::default_outcome)
//! replaces the rule. A gRPC error (a trailers-only response: HTTP 200 with `grpc-status`) is
//! decided by its gRPC code the same way: `RESOURCE_EXHAUSTED`, `ABORTED`, `UNAVAILABLE`,
//! `UNAUTHENTICATED` and `PERMISSION_DENIED` are retryable, every other code final.
//!
//! Why final by default, even for a 500: a handler that may have committed must never be run
//! again silently. Stripe stores and replays 500s for the same reason. AWS Lambda Powertools
//! deletes the record when the function raises and stores what it returns, which re-runs a
//! handler that failed after its side effect. The IETF draft (`draft-ietf-httpapi-idempotency-key-header`)
//! leaves error responses as an open question. Here the handler, which knows whether it
//! committed, decides; the default only errs on the side of not running twice.
//!
//! # Outcome unknown
//!
//! A handler that panics, a service that returns an error (for example a timeout inside the
//! layer cancelled the handler), or a response body that fails half-way: the work may or may
//! not have happened. [`UnknownOutcome::Record`] (the default) stores an `outcome-unknown`
//! problem (500, with the attempt's fencing token so that an operator can reconcile) that every
//! retry receives; [`UnknownOutcome::Release`] releases the key so that a retry runs the handler
//! again. The default is `Record` by the same principle: running twice is the failure this
//! layer exists to prevent, and an operator can always clear a key, but cannot undo a double
//! charge.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use http::StatusCode;

/// The handler's decision about its response: see the [module docs](self).
///
/// Put it in the response extensions, or call
/// [`IdempotencyContext::set_outcome`](crate::IdempotencyContext::set_outcome); the response
/// extension wins when both are given.
///
/// ```
/// use tower_idempotency::Outcome;
/// let mut response = http::Response::new(());
/// response.extensions_mut().insert(Outcome::Final);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The work may have been done: store the response and replay it to every retry.
    Final,
    /// Nothing was committed: release the key, store nothing; a retry runs the handler again.
    Retryable,
}

/// Whether a final response's body is kept for replay (a response extension; default
/// [`KeepBody::Yes`]). With [`KeepBody::No`] the body goes to the client and is not stored: the
/// outcome (status, headers, a `grpc-status` trailer) is, and retries get
/// `410 response-not-stored` (for large downloads a client can fetch again, or streams not
/// worth storing).
///
/// ```
/// use axum::{Extension, response::IntoResponse};
/// use tower_idempotency::KeepBody;
///
/// async fn export() -> impl IntoResponse {
///     (Extension(KeepBody::No), "a large export the client can download again")
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum KeepBody {
    /// Keep the body for replay, up to the record limit (default).
    #[default]
    Yes,
    /// Do not keep it: store the outcome only.
    No,
}

/// The default decision when the handler gave none: retryable for the statuses that mean "not
/// processed" (401, 403, 408, 409, 425, 429, 503), final for every other status.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::{Outcome, outcome::default_outcome};
/// assert_eq!(default_outcome(StatusCode::CREATED), Outcome::Final);
/// assert_eq!(default_outcome(StatusCode::INTERNAL_SERVER_ERROR), Outcome::Final);
/// assert_eq!(default_outcome(StatusCode::TOO_MANY_REQUESTS), Outcome::Retryable);
/// assert_eq!(default_outcome(StatusCode::UNAUTHORIZED), Outcome::Retryable);
/// ```
pub fn default_outcome(status: StatusCode) -> Outcome {
    match status.as_u16() {
        401 | 403 | 408 | 409 | 425 | 429 | 503 => Outcome::Retryable,
        _ => Outcome::Final,
    }
}

/// The default decision for a gRPC trailers-only response (`grpc-status` in its headers), by
/// its gRPC code; `None` for any other response.
///
/// ```
/// use tower_idempotency::{Outcome, outcome::grpc_outcome};
/// let mut headers = http::HeaderMap::new();
/// headers.insert("content-type", "application/grpc".parse().unwrap());
/// headers.insert("grpc-status", "14".parse().unwrap()); // UNAVAILABLE
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Retryable));
/// headers.insert("grpc-status", "3".parse().unwrap()); // INVALID_ARGUMENT
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Final));
/// ```
pub fn grpc_outcome(headers: &http::HeaderMap) -> Option<Outcome> {
    let grpc = headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"));
    if !grpc {
        return None;
    }
    let code: u8 = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    Some(match code {
        7 | 8 | 10 | 14 | 16 => Outcome::Retryable,
        _ => Outcome::Final,
    })
}

/// What to do when a handler's outcome cannot be known: see the [module docs](self#outcome-unknown).
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, Store, UnknownOutcome};
/// let layer = IdempotencyLayer::builder(Store::memory())
///     .on_unknown_outcome(UnknownOutcome::Release);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum UnknownOutcome {
    /// Store an `outcome-unknown` problem (500, with the fencing token) for every retry
    /// (default).
    #[default]
    Record,
    /// Release the key and store nothing: a retry runs the handler again.
    Release,
}

/// The decision a handler made through its context, shared with the execution.
#[derive(Debug, Default)]
pub(crate) struct DecisionCell(AtomicU8);

impl DecisionCell {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(DecisionCell(AtomicU8::new(0)))
    }

    pub(crate) fn set(&self, outcome: Outcome) {
        let code = match outcome {
            Outcome::Final => 1,
            Outcome::Retryable => 2,
        };
        self.0.store(code, Ordering::Release);
    }

    pub(crate) fn get(&self) -> Option<Outcome> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(Outcome::Final),
            2 => Some(Outcome::Retryable),
            _ => None,
        }
    }
}
