//! The floor: the least a layer with the guarantees ours gives on its memory store does per
//! request, written as plainly as axum allows, for the bench's server-CPU figures (`--serve
//! floor`). Its cost is what any layer must add; what ours adds beyond it is its own.
//!
//! Per request with an `Idempotency-Key` header, and nothing else:
//! * the body is read whole and fingerprinted: HMAC-SHA256 of the method, the path and the body,
//!   length-prefixed, under a key (ours uses the same MAC);
//! * the key is claimed in one map under one mutex while the handler runs: a second request
//!   with it gets 409 meanwhile, and a claim whose request is dropped is released;
//! * the response is read whole and stored with the fingerprint and an expiry; a later request
//!   with the key and the same fingerprint gets it back (marked `idempotency-replayed`), one with
//!   another fingerprint gets 422.
//!
//! Left out, so that it stays a floor: what ours does beyond that (problem responses, key
//! scopes and derivation, sealing, size limits, streaming, fences, eviction of old records,
//! tracing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// How long a stored response replays (as the bench's other layers: an hour).
const RETENTION: Duration = Duration::from_secs(3600);
/// The largest body read (a larger one gets 413).
const LIMIT: usize = 1 << 20;

type Fingerprint = [u8; 32];

enum Slot {
    /// Claimed: its handler runs.
    Running,
    Done {
        fingerprint: Fingerprint,
        expires: Instant,
        response: axum::http::response::Parts,
        body: bytes::Bytes,
    },
}

/// The floor's state: one map of keys, the fingerprint key.
pub(crate) struct Floor {
    slots: Mutex<HashMap<String, Slot>>,
    mac: Hmac<Sha256>,
}

impl Floor {
    pub(crate) fn new() -> Arc<Floor> {
        Arc::new(Floor {
            slots: Mutex::new(HashMap::new()),
            mac: Hmac::new_from_slice(b"bench secret: 32 bytes, not for real use")
                .expect("HMAC takes keys of any length"),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Releases a claim whose request ended without a stored response (dropped, or failed).
struct Claim<'a> {
    floor: &'a Floor,
    key: &'a str,
    stored: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.stored {
            self.floor.slots().remove(self.key);
        }
    }
}

/// The middleware (`axum::middleware::from_fn_with_state`).
pub(crate) async fn floor(
    State(floor): State<Arc<Floor>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return next.run(request).await;
    };
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, LIMIT).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let mut mac = floor.mac.clone();
    for field in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        &body,
    ] {
        mac.update(&(field.len() as u64).to_be_bytes());
        mac.update(field);
    }
    let fingerprint: Fingerprint = mac.finalize().into_bytes().into();
    {
        let mut slots = floor.slots();
        match slots.get(&key) {
            Some(Slot::Running) => return StatusCode::CONFLICT.into_response(),
            Some(Slot::Done {
                fingerprint: stored,
                expires,
                response,
                body,
            }) if *expires > Instant::now() => {
                if *stored != fingerprint {
                    return StatusCode::UNPROCESSABLE_ENTITY.into_response();
                }
                let mut replay = Response::from_parts(response.clone(), Body::from(body.clone()));
                replay
                    .headers_mut()
                    .insert("idempotency-replayed", HeaderValue::from_static("true"));
                return replay;
            }
            _ => {
                slots.insert(key.clone(), Slot::Running);
            }
        }
    }
    let mut claim = Claim {
        floor: &floor,
        key: &key,
        stored: false,
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    let (response, body) = response.into_parts();
    let Ok(body) = axum::body::to_bytes(body, LIMIT).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    floor.slots().insert(
        key.clone(),
        Slot::Done {
            fingerprint,
            expires: Instant::now() + RETENTION,
            response: response.clone(),
            body: body.clone(),
        },
    );
    claim.stored = true;
    Response::from_parts(response, Body::from(body))
}
