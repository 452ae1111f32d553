//! Rejections: every request the layer answers itself gets an `application/problem+json` body
//! (RFC 9457) and the handler never runs.
//!
//! | type (slug) | status | when |
//! |---|---|---|
//! | `missing-key` | 400 | the key is required and the request has none |
//! | `invalid-key` | 400 | empty, longer than 255 characters, not visible ASCII, not a string (a body key: numbers are refused too) |
//! | `duplicate-key` | 400 | several `Idempotency-Key` headers |
//! | `malformed-body` | 400 | the key comes from the body and the body does not parse |
//! | `request-timeout` | 408 | the request body did not arrive within the read timeout |
//! | `conflict` | 409 | a request with this key is in flight (with `Retry-After`) |
//! | `body-too-large` | 413 | the request body is over the buffering limit |
//! | `unsupported-media-type` | 415 | the key comes from a JSON or form body of another content type |
//! | `not-acceptable` | 406 | the stored response varies (`Vary`) on a negotiation header (`Accept`, `Accept-Encoding`, `Accept-Language`, `Origin`) that this retry sends differently: it cannot be replayed to it |
//! | `key-reused` | 422 | the key was used for a request with another fingerprint |
//! | `record-unreadable` | 500 | the stored outcome for this key is corrupt or from an unknown format |
//! | `principal-missing` | 500 | keys are scoped to a principal and the request has none (the layer runs before authentication?) |
//! | `outcome-unknown` | 500 | a retry of a request whose handler panicked, failed or whose body broke off: it may have done its work (with the attempt's `fence`, for reconciliation) |
//! | `store-unavailable` | 503 | the store cannot be reached (with `Retry-After`; fail-closed mode) |
//! | `store-full` | 503 | the in-memory store is full of requests in flight, none of which may be evicted (with `Retry-After`; fail-closed mode) |
//! | `response-not-stored` | 410 | a retry of a request whose response body was not stored (over the record limit, opted out with [`KeepBody::No`](crate::KeepBody), or refused or lost by the store): it was processed (the `original_status` member says with which status, `original_grpc_status` with which `grpc-status` for a gRPC response, and stored headers such as `Location` are kept), the body cannot be replayed |
//!
//! The [`Rejection`] itself travels in the response extensions, so outer middleware and tests can
//! tell which rule answered. The `type` URIs point at these docs by default
//! ([`problem_base`](crate::IdempotencyLayerBuilder::problem_base) changes the base), and
//! [`render_rejections`](crate::IdempotencyLayerBuilder::render_rejections) renders them in
//! your API's own error format (the status codes stay). A person's browser gets an HTML page
//! instead ([`html`]).

pub mod html;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// Base of the problem `type` URIs; the slug follows.
pub const PROBLEM_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#";

/// Why the layer answered a request itself.
///
/// ```
/// use tower_idempotency::Rejection;
/// let r = Rejection::MissingKey { source: "the Idempotency-Key header".into() };
/// assert_eq!(r.status(), http::StatusCode::BAD_REQUEST);
/// assert_eq!(r.slug(), "missing-key");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// The key is required and the request has none.
    MissingKey {
        /// Where the key was looked for.
        source: String,
    },
    /// The key is there but unusable.
    InvalidKey {
        /// What is wrong with it.
        reason: String,
    },
    /// Several `Idempotency-Key` headers.
    DuplicateKey,
    /// The key comes from the body, which does not parse.
    MalformedBody {
        /// The parser's complaint.
        reason: String,
    },
    /// The body did not arrive in time.
    RequestTimeout {
        /// The read timeout.
        after: Duration,
    },
    /// A request with this key is being processed.
    Conflict {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The request body is over the buffering limit.
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The key comes from a body of another content type.
    UnsupportedMediaType {
        /// What was expected.
        expected: &'static str,
    },
    /// The key was used before for a request with another fingerprint.
    KeyReused,
    /// The stored outcome cannot be decoded.
    RecordUnreadable {
        /// What is wrong with it.
        reason: String,
    },
    /// The store cannot be reached.
    StoreUnavailable {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The in-memory store is full of requests in flight (stored outcomes are evicted to make
    /// room, leases in flight never are).
    StoreFull {
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The original response's body was not stored (over the record limit, opted out, or
    /// refused or lost by the store).
    ResponseNotStored {
        /// The original status.
        status: StatusCode,
        /// The storage limit in bytes.
        limit: usize,
        /// The original `grpc-status`, when the response had one (in its trailers, or in its
        /// head for a trailers-only response): the outcome a gRPC client knows it by.
        grpc_status: Option<u16>,
    },
    /// The stored response varies on a request header this request sends differently.
    NotAcceptable {
        /// The header.
        header: String,
    },
    /// Keys are scoped to a principal and the request has none.
    PrincipalMissing {
        /// Where the principal was looked for.
        source: String,
    },
    /// The handler started and its outcome is unknown (it panicked, the service failed, or its
    /// response body broke off).
    OutcomeUnknown {
        /// The fencing token of the execution, for reconciliation.
        fence: u64,
    },
}

impl Rejection {
    /// The HTTP status of the problem response.
    ///
    /// ```
    /// use tower_idempotency::Rejection;
    /// assert_eq!(Rejection::KeyReused.status().as_u16(), 422);
    /// ```
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::MissingKey { .. }
            | Rejection::InvalidKey { .. }
            | Rejection::DuplicateKey
            | Rejection::MalformedBody { .. } => StatusCode::BAD_REQUEST,
            Rejection::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Rejection::Conflict { .. } => StatusCode::CONFLICT,
            Rejection::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Rejection::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Rejection::RecordUnreadable { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Rejection::StoreUnavailable { .. } | Rejection::StoreFull { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Rejection::ResponseNotStored { .. } => StatusCode::GONE,
            Rejection::NotAcceptable { .. } => StatusCode::NOT_ACCEPTABLE,
            Rejection::OutcomeUnknown { .. } | Rejection::PrincipalMissing { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The slug of the problem type (appended to [`PROBLEM_BASE`]).
    ///
    /// ```
    /// assert_eq!(tower_idempotency::Rejection::DuplicateKey.slug(), "duplicate-key");
    /// ```
    pub fn slug(&self) -> &'static str {
        match self {
            Rejection::MissingKey { .. } => "missing-key",
            Rejection::InvalidKey { .. } => "invalid-key",
            Rejection::DuplicateKey => "duplicate-key",
            Rejection::MalformedBody { .. } => "malformed-body",
            Rejection::RequestTimeout { .. } => "request-timeout",
            Rejection::Conflict { .. } => "conflict",
            Rejection::BodyTooLarge { .. } => "body-too-large",
            Rejection::UnsupportedMediaType { .. } => "unsupported-media-type",
            Rejection::KeyReused => "key-reused",
            Rejection::RecordUnreadable { .. } => "record-unreadable",
            Rejection::StoreUnavailable { .. } => "store-unavailable",
            Rejection::StoreFull { .. } => "store-full",
            Rejection::ResponseNotStored { .. } => "response-not-stored",
            Rejection::OutcomeUnknown { .. } => "outcome-unknown",
            Rejection::PrincipalMissing { .. } => "principal-missing",
            Rejection::NotAcceptable { .. } => "not-acceptable",
        }
    }

    /// A short summary of the problem type.
    ///
    /// ```
    /// assert!(tower_idempotency::Rejection::KeyReused.title().contains("another"));
    /// ```
    pub fn title(&self) -> &'static str {
        match self {
            Rejection::MissingKey { .. } => "An idempotency key is required",
            Rejection::InvalidKey { .. } => "The idempotency key is not valid",
            Rejection::DuplicateKey => "Only one Idempotency-Key header is allowed",
            Rejection::MalformedBody { .. } => "The request body could not be read for its key",
            Rejection::RequestTimeout { .. } => "The request body did not arrive in time",
            Rejection::Conflict { .. } => "A request with this idempotency key is being processed",
            Rejection::BodyTooLarge { .. } => "The request body is too large",
            Rejection::UnsupportedMediaType { .. } => {
                "The request body has the wrong content type for its key"
            }
            Rejection::KeyReused => "The idempotency key was used for another request",
            Rejection::RecordUnreadable { .. } => {
                "The stored outcome for this idempotency key cannot be read"
            }
            Rejection::StoreUnavailable { .. } => "Idempotency is temporarily unavailable",
            Rejection::StoreFull { .. } => "Too many requests are in flight",
            Rejection::ResponseNotStored { .. } => {
                "The request was processed, but its response body was not stored"
            }
            Rejection::OutcomeUnknown { .. } => {
                "The request was started, and whether it did its work is unknown"
            }
            Rejection::PrincipalMissing { .. } => "The server cannot tell who sent this request",
            Rejection::NotAcceptable { .. } => {
                "The stored response was negotiated for different request headers"
            }
        }
    }

    /// The explanation for this occurrence.
    ///
    /// ```
    /// let r = tower_idempotency::Rejection::BodyTooLarge { limit: 1024 };
    /// assert!(r.detail().contains("1024"));
    /// ```
    pub fn detail(&self) -> String {
        match self {
            Rejection::MissingKey { source } => {
                format!("This request must carry an idempotency key in {source}.")
            }
            Rejection::InvalidKey { reason } => reason.clone(),
            Rejection::DuplicateKey => {
                "The request has more than one Idempotency-Key header.".into()
            }
            Rejection::MalformedBody { reason } => reason.clone(),
            Rejection::RequestTimeout { after } => {
                format!("The request body was not complete within {after:?}.")
            }
            Rejection::Conflict { retry_after } => format!(
                "The first request with this key has not finished. Retry after {} s to get its response.",
                whole_seconds(*retry_after)
            ),
            Rejection::BodyTooLarge { limit } => {
                format!("The request body is over the limit of {limit} bytes.")
            }
            Rejection::UnsupportedMediaType { expected } => {
                format!("The idempotency key is read from the body, which must be {expected}.")
            }
            Rejection::KeyReused => {
                "This idempotency key was already used with a different method, path, \
                 headers or body. Use a new key for a new request."
                    .into()
            }
            Rejection::RecordUnreadable { reason } => format!(
                "The request was processed before, but its stored outcome cannot be read ({reason}); it is not run again."
            ),
            Rejection::StoreUnavailable { retry_after } => format!(
                "The idempotency store cannot be reached; the request was not processed. Retry after {} s.",
                whole_seconds(*retry_after)
            ),
            Rejection::StoreFull { retry_after } => format!(
                "The idempotency store is full of requests in flight; this one was not processed. \
                 Retry after {} s.",
                whole_seconds(*retry_after)
            ),
            Rejection::ResponseNotStored {
                status,
                limit,
                grpc_status,
            } => format!(
                "The original request was processed with status {}{}, but its response body was \
                 not stored (bodies over {limit} bytes are not, nor those the service or the \
                 store did not keep), so it cannot be replayed. Do not send the request again \
                 with a new key unless you mean to repeat it.",
                status.as_u16(),
                grpc_status.map_or(String::new(), |code| format!(" and grpc-status {code}")),
            ),
            Rejection::NotAcceptable { header } => format!(
                "The request with this key was processed, and its response varies on the {header} \
                 header, which this request sends differently: retry with the {header} of the first \
                 request to get the stored response."
            ),
            Rejection::PrincipalMissing { source } => format!(
                "Idempotency keys are scoped to the sender, taken from {source}, and this request \
                 has none; it was not processed."
            ),
            Rejection::OutcomeUnknown { fence } => format!(
                "The first request with this key started (attempt {fence}) and then failed; it may or may \
                 not have done its work, so it is not run again. Check the result before repeating the \
                 request with a new key."
            ),
        }
    }

    /// Whether the rejection says the key source does not apply to this request (a JSON or form
    /// field of a body of another content type), rather than that its key is malformed: in
    /// [`or`](crate::KeySourceExt::or), the next source is tried.
    ///
    /// ```
    /// use tower_idempotency::Rejection;
    /// assert!(Rejection::UnsupportedMediaType { expected: "application/json" }.not_applicable());
    /// assert!(!Rejection::DuplicateKey.not_applicable());
    /// ```
    pub fn not_applicable(&self) -> bool {
        matches!(self, Rejection::UnsupportedMediaType { .. })
    }

    /// The `Retry-After` this rejection carries, if any.
    fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::Conflict { retry_after }
            | Rejection::StoreUnavailable { retry_after }
            | Rejection::StoreFull { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The problem+json body (RFC 9457), with the `type` URI under [`PROBLEM_BASE`].
    ///
    /// ```
    /// let body = tower_idempotency::Rejection::KeyReused.to_json();
    /// let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!(v["status"], 422);
    /// ```
    pub fn to_json(&self) -> Bytes {
        self.to_json_with_base(PROBLEM_BASE)
    }

    /// The problem+json body, with the `type` URI under `base`.
    ///
    /// ```
    /// let body = tower_idempotency::Rejection::KeyReused.to_json_with_base("https://api.example.com/problems/");
    /// let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!(v["type"], "https://api.example.com/problems/key-reused");
    /// ```
    pub fn to_json_with_base(&self, base: &str) -> Bytes {
        let mut value = serde_json::json!({
            "type": format!("{base}{}", self.slug()),
            "title": self.title(),
            "status": self.status().as_u16(),
            "detail": self.detail(),
        });
        match self {
            Rejection::ResponseNotStored {
                status,
                grpc_status,
                ..
            } => {
                value["original_status"] = status.as_u16().into();
                if let Some(code) = grpc_status {
                    value["original_grpc_status"] = (*code).into();
                }
            }
            Rejection::OutcomeUnknown { fence } => value["fence"] = (*fence).into(),
            _ => {}
        }
        // Serializing a `Value` cannot fail.
        Bytes::from(serde_json::to_vec(&value).unwrap_or_default())
    }

    /// The response: status, `Content-Type: application/problem+json`, `Retry-After` where it
    /// applies, and the rejection in the extensions.
    ///
    /// ```
    /// let res = tower_idempotency::Rejection::DuplicateKey.to_response();
    /// assert_eq!(res.headers()["content-type"], "application/problem+json");
    /// ```
    pub fn to_response(&self) -> Response<Bytes> {
        self.to_response_with_base(PROBLEM_BASE)
    }

    /// The response, with the `type` URI under `base`.
    ///
    /// ```
    /// let res = tower_idempotency::Rejection::DuplicateKey.to_response_with_base("urn:problem:");
    /// assert_eq!(res.status(), 400);
    /// ```
    pub fn to_response_with_base(&self, base: &str) -> Response<Bytes> {
        let mut response = Response::new(self.to_json_with_base(base));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        self.finish(response)
    }

    /// Sets on a rendered rejection what every rendering keeps: the status, `Retry-After`
    /// where it applies (unless the renderer set one), and the rejection in the extensions.
    pub(crate) fn finish(&self, mut response: Response<Bytes>) -> Response<Bytes> {
        *response.status_mut() = self.status();
        if let Some(after) = self.retry_after() {
            response
                .headers_mut()
                .entry(header::RETRY_AFTER)
                .or_insert_with(|| HeaderValue::from(whole_seconds(after)));
        }
        response.extensions_mut().insert(self.clone());
        response
    }
}

/// The gRPC status codes a rejection maps to (the numeric values of the gRPC spec).
///
/// ```
/// use tower_idempotency::{Rejection, problem::GrpcCode};
/// assert_eq!(Rejection::KeyReused.grpc_code(), GrpcCode::InvalidArgument);
/// assert_eq!(GrpcCode::Aborted as u8, 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum GrpcCode {
    /// 2: the outcome is unknown.
    Unknown = 2,
    /// 3: the request is malformed or its key reused.
    InvalidArgument = 3,
    /// 4: the request did not arrive in time.
    DeadlineExceeded = 4,
    /// 8: the request is too large.
    ResourceExhausted = 8,
    /// 9: the stored response cannot be replayed to this request.
    FailedPrecondition = 9,
    /// 10: a request with this key is in flight (retry later).
    Aborted = 10,
    /// 13: a server-side problem (an unreadable record, a missing principal).
    Internal = 13,
    /// 14: the store is unavailable (retry later).
    Unavailable = 14,
}

impl Rejection {
    /// The gRPC status of this rejection, for [gRPC rendering](crate::IdempotencyLayerBuilder::grpc_rejections).
    ///
    /// ```
    /// use tower_idempotency::{Rejection, problem::GrpcCode};
    /// let busy = Rejection::Conflict { retry_after: std::time::Duration::from_secs(1) };
    /// assert_eq!(busy.grpc_code(), GrpcCode::Aborted);
    /// ```
    pub fn grpc_code(&self) -> GrpcCode {
        match self {
            Rejection::MissingKey { .. }
            | Rejection::InvalidKey { .. }
            | Rejection::DuplicateKey
            | Rejection::MalformedBody { .. }
            | Rejection::UnsupportedMediaType { .. }
            | Rejection::KeyReused => GrpcCode::InvalidArgument,
            Rejection::RequestTimeout { .. } => GrpcCode::DeadlineExceeded,
            Rejection::Conflict { .. } => GrpcCode::Aborted,
            Rejection::BodyTooLarge { .. } => GrpcCode::ResourceExhausted,
            Rejection::StoreUnavailable { .. } => GrpcCode::Unavailable,
            Rejection::StoreFull { .. } => GrpcCode::ResourceExhausted,
            Rejection::ResponseNotStored { .. } | Rejection::NotAcceptable { .. } => {
                GrpcCode::FailedPrecondition
            }
            Rejection::OutcomeUnknown { .. } => GrpcCode::Unknown,
            Rejection::RecordUnreadable { .. } | Rejection::PrincipalMissing { .. } => {
                GrpcCode::Internal
            }
        }
    }

    /// The rejection as a gRPC "trailers-only" response: HTTP 200, `content-type:
    /// application/grpc`, `grpc-status` and a percent-encoded `grpc-message`, no body; plus
    /// `Retry-After` where it applies and the rejection in the extensions.
    ///
    /// ```
    /// let res = tower_idempotency::Rejection::KeyReused.to_grpc_response();
    /// assert_eq!(res.status(), 200);
    /// assert_eq!(res.headers()["grpc-status"], "3");
    /// ```
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        /// Everything but visible ASCII (and `%` itself) is percent-encoded in `grpc-message`.
        const MESSAGE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(
            "grpc-status",
            HeaderValue::from(u16::from(self.grpc_code() as u8)),
        );
        let message = format!("{}: {}", self.slug(), self.detail());
        let encoded = percent_encoding::utf8_percent_encode(&message, MESSAGE).to_string();
        if let Ok(value) = HeaderValue::from_str(&encoded) {
            headers.insert("grpc-message", value);
        }
        if let Some(after) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(whole_seconds(after)));
        }
        response.extensions_mut().insert(self.clone());
        response
    }
}

/// A delay in whole seconds, rounded up, at least 1 (`Retry-After` has second resolution).
fn whole_seconds(d: Duration) -> u64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1)
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status().as_u16(),
            self.slug(),
            self.detail()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `retry_after(Duration::MAX)` overflowed rounding up to whole seconds (a panic in debug
    /// builds, `Retry-After: 1` in release ones).
    #[test]
    fn the_longest_retry_after_saturates() {
        assert_eq!(whole_seconds(Duration::MAX), u64::MAX);
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn every_rejection_renders_valid_problem_json() {
        let all = [
            Rejection::MissingKey { source: "x".into() },
            Rejection::InvalidKey { reason: "y".into() },
            Rejection::DuplicateKey,
            Rejection::MalformedBody { reason: "z".into() },
            Rejection::RequestTimeout {
                after: Duration::from_secs(3),
            },
            Rejection::Conflict {
                retry_after: Duration::from_millis(10),
            },
            Rejection::BodyTooLarge { limit: 5 },
            Rejection::UnsupportedMediaType {
                expected: "application/json",
            },
            Rejection::KeyReused,
            Rejection::RecordUnreadable {
                reason: "bad magic".into(),
            },
            Rejection::StoreUnavailable {
                retry_after: Duration::from_secs(2),
            },
            Rejection::StoreFull {
                retry_after: Duration::from_secs(3),
            },
            Rejection::ResponseNotStored {
                status: StatusCode::CREATED,
                limit: 9,
                grpc_status: None,
            },
            Rejection::ResponseNotStored {
                status: StatusCode::OK,
                limit: 9,
                grpc_status: Some(13),
            },
            Rejection::OutcomeUnknown { fence: 7 },
            Rejection::PrincipalMissing {
                source: "the claim /sub".into(),
            },
            Rejection::NotAcceptable {
                header: "accept-encoding".into(),
            },
        ];
        for r in all {
            let res = r.to_response();
            let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
            assert_eq!(v["status"], r.status().as_u16());
            assert!(v["type"].as_str().unwrap().ends_with(r.slug()));
            assert!(!v["title"].as_str().unwrap().is_empty());
            assert_eq!(res.extensions().get::<Rejection>(), Some(&r));
            assert!(!r.status().is_success(), "a problem is never a 2xx: {r}");
            let retry = res.headers().get(header::RETRY_AFTER);
            assert_eq!(
                retry.is_some(),
                matches!(
                    r,
                    Rejection::Conflict { .. }
                        | Rejection::StoreUnavailable { .. }
                        | Rejection::StoreFull { .. }
                )
            );
            if let Some(v) = retry {
                assert!(v.to_str().unwrap().parse::<u64>().unwrap() >= 1);
            }
        }
    }
}
