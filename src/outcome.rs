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
//! Without a decision, [`default_outcome`] decides from the status:
//!
//! | status | outcome | why |
//! |---|---|---|
//! | 2xx, 3xx | final | the work was done |
//! | 402 | final | a result of the work (a declined card), as Stripe replays it |
//! | 408 | unknown | inside the layer, a timeout (tower-http's `TimeoutLayer`) answers 408 for a handler it cancelled, which may have done part of its work: never "not processed" |
//! | other 4xx: 400, 401, 403, 404, 409, 413, 415, 422, 429, ... | retryable | refused without effect (an extractor's rejection, a validation error, "already registered", authentication): nothing is stored, the corrected request runs |
//! | 503 | retryable | not processed, try later |
//! | other 5xx | final | the handler may have committed before it failed |
//!
//! [`IdempotencyLayerBuilder::default_outcome`](crate::IdempotencyLayerBuilder::default_outcome)
//! replaces the rule. A gRPC error (a trailers-only response: HTTP 200 with `grpc-status`) is
//! decided by its gRPC code the same way ([`grpc_outcome`]).
//!
//! Compared with others: Stripe saves no result when a request fails validation or conflicts
//! with one in flight, and replays everything an endpoint that started executing answered,
//! 500s included; AWS Lambda Powertools deletes the record when the function raises, which
//! runs a function that failed after its side effect again; `@nestjs/idempotency` stores what
//! its `storeIf` allows (by default statuses below 500), which replays a validation error for
//! the whole retention and runs a failed handler again. Here a 4xx is what the application
//! refused, so nothing happened and nothing is kept; a 5xx (but 503) may have committed, so it
//! is kept; and what a timeout cut short is unknown. The handler, which knows whether it
//! committed, can always say otherwise.
//!
//! # Outcome unknown
//!
//! A handler that panics, a service that returns an error (for example tower's `Timeout`
//! inside the layer cancelled the handler), a 408 (tower-http's `TimeoutLayer` inside the layer)
//! or an [`Outcome::Unknown`] of the handler's, or a response body that fails half-way: the work
//! may or may not have happened. [`UnknownOutcome::Record`] (the default) stores an `outcome-unknown`
//! problem (500, with the attempt's fencing token so that an operator can reconcile) that every
//! retry receives; [`UnknownOutcome::Release`] releases the key so that a retry runs the handler
//! again. The default is `Record` by the same principle: running twice is the failure this
//! layer exists to prevent; an attempt recorded as unknown can be reconciled (its fencing token
//! names it) and its key cleared ([`IdempotencyLayer::purge`](crate::IdempotencyLayer::purge),
//! or `idempotency purge`), a double charge cannot be undone.

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
    /// The work may or may not have been done (it was cut short): what the layer's
    /// [`UnknownOutcome`] policy says (by default retries get an `outcome-unknown` problem; see
    /// the [module docs](self#outcome-unknown)). The response still goes to the client.
    Unknown,
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

/// The default decision when the handler gave none (see the [module docs](self)): retryable
/// for a 4xx (refused without effect) but 402 (final) and 408 (unknown: a timeout inside the
/// layer cut the handler short), and for 503; final for every other status.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::{Outcome, outcome::default_outcome};
/// assert_eq!(default_outcome(StatusCode::CREATED), Outcome::Final);
/// assert_eq!(default_outcome(StatusCode::INTERNAL_SERVER_ERROR), Outcome::Final);
/// assert_eq!(default_outcome(StatusCode::UNPROCESSABLE_ENTITY), Outcome::Retryable);
/// assert_eq!(default_outcome(StatusCode::TOO_MANY_REQUESTS), Outcome::Retryable);
/// assert_eq!(default_outcome(StatusCode::PAYMENT_REQUIRED), Outcome::Final);
/// assert_eq!(default_outcome(StatusCode::REQUEST_TIMEOUT), Outcome::Unknown);
/// ```
pub fn default_outcome(status: StatusCode) -> Outcome {
    match status.as_u16() {
        402 => Outcome::Final,
        408 => Outcome::Unknown,
        400..=499 | 503 => Outcome::Retryable,
        _ => Outcome::Final,
    }
}

/// The default decision for a gRPC trailers-only response (`grpc-status` in its headers), by
/// its gRPC code as [`default_outcome`] decides by status; `None` for any other response.
///
/// | code | outcome |
/// |---|---|
/// | `OK` and every code not listed (`INTERNAL`, `UNKNOWN`, `DATA_LOSS`, ...) | final |
/// | `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `RESOURCE_EXHAUSTED`, `FAILED_PRECONDITION`, `ABORTED`, `OUT_OF_RANGE`, `UNAVAILABLE`, `UNAUTHENTICATED` | retryable |
/// | `DEADLINE_EXCEEDED`, `CANCELLED` | unknown |
///
/// ```
/// use tower_idempotency::{Outcome, outcome::grpc_outcome};
/// let mut headers = http::HeaderMap::new();
/// headers.insert("content-type", "application/grpc".parse().unwrap());
/// headers.insert("grpc-status", "14".parse().unwrap()); // UNAVAILABLE
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Retryable));
/// headers.insert("grpc-status", "3".parse().unwrap()); // INVALID_ARGUMENT
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Retryable));
/// headers.insert("grpc-status", "13".parse().unwrap()); // INTERNAL
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Final));
/// headers.insert("grpc-status", "4".parse().unwrap()); // DEADLINE_EXCEEDED
/// assert_eq!(grpc_outcome(&headers), Some(Outcome::Unknown));
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
        3 | 5 | 6 | 7 | 8 | 9 | 10 | 11 | 14 | 16 => Outcome::Retryable,
        1 | 4 => Outcome::Unknown,
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
            Outcome::Unknown => 3,
        };
        self.0.store(code, Ordering::Release);
    }

    pub(crate) fn get(&self) -> Option<Outcome> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(Outcome::Final),
            2 => Some(Outcome::Retryable),
            3 => Some(Outcome::Unknown),
            _ => None,
        }
    }
}
