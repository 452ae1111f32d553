//! The floor: the least a layer that runs each key once does per request, written as
//! plainly as axum allows, on a memory store (`--serve floor`) and on Valkey (`--serve
//! floor-valkey`), for the bench's server-CPU and store-CPU figures. Its cost is what any layer
//! must add; what ours adds beyond it is its own.
//!
//! Per request with an `Idempotency-Key` header, and nothing else:
//! * the body is read whole and fingerprinted: HMAC-SHA256 of the method, the path and the body,
//!   length-prefixed, under a key (ours uses the same MAC);
//! * the key is claimed while the handler runs (memory: in one map under one mutex; Valkey: a
//!   lease, `SET NX PX` with a random token, in the same script call that would have found a
//!   stored record): a second request with it gets 409 meanwhile, and a claim whose request is
//!   dropped is released;
//! * the response is read whole and stored with the fingerprint and an expiry (on Valkey only if
//!   the lease is still the request's, in one script call that frees it); a later request with
//!   the key and the same fingerprint gets it back (marked `idempotency-replayed`), one with
//!   another fingerprint gets 422.
//!
//! Left out, so that it stays a floor: what ours does beyond that (problem responses, key
//! scopes and derivation, sealing, size limits, streaming, fences, lease renewal, eviction of
//! old records, waking waiters, tracing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// How long a stored response replays (as the bench's other layers: an hour).
const RETENTION: Duration = Duration::from_secs(3600);
/// How long a Valkey lease outlives a server that died holding it.
const LEASE: Duration = Duration::from_secs(30);
/// The largest body read (a larger one gets 413).
const LIMIT: usize = 1 << 20;

type Fingerprint = [u8; 32];

/// A stored response and the fingerprint of the request that made it.
#[derive(Clone)]
struct Stored {
    fingerprint: Fingerprint,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Stored {
    /// fingerprint, status (u16), header count (u16), each name and value (u16 length first),
    /// then the body.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.body.len());
        out.put_slice(&self.fingerprint);
        out.put_u16(self.status.as_u16());
        out.put_u16(self.headers.len() as u16);
        for (name, value) in &self.headers {
            for field in [name.as_str().as_bytes(), value.as_bytes()] {
                out.put_u16(field.len() as u16);
                out.put_slice(field);
            }
        }
        out.put_slice(&self.body);
        out
    }

    fn decode(mut bytes: Bytes) -> Option<Stored> {
        fn u16_of(bytes: &mut Bytes) -> Option<u16> {
            (bytes.remaining() >= 2).then(|| bytes.get_u16())
        }
        fn field(bytes: &mut Bytes) -> Option<Bytes> {
            let len = usize::from(u16_of(bytes)?);
            (bytes.remaining() >= len).then(|| bytes.split_to(len))
        }
        if bytes.remaining() < 32 {
            return None;
        }
        let fingerprint = bytes.split_to(32).as_ref().try_into().ok()?;
        let status = StatusCode::from_u16(u16_of(&mut bytes)?).ok()?;
        let mut headers = HeaderMap::new();
        for _ in 0..u16_of(&mut bytes)? {
            let name = HeaderName::from_bytes(&field(&mut bytes)?).ok()?;
            let value = HeaderValue::from_maybe_shared(field(&mut bytes)?).ok()?;
            headers.append(name, value);
        }
        Some(Stored {
            fingerprint,
            status,
            headers,
            body: bytes,
        })
    }

    fn response(&self, replayed: bool) -> Response {
        let mut response = Response::new(Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        if replayed {
            response
                .headers_mut()
                .insert("idempotency-replayed", HeaderValue::from_static("true"));
        }
        response
    }
}

enum Slot {
    /// Claimed: its handler runs.
    Running,
    Done {
        expires: Instant,
        stored: Stored,
    },
}

/// Where the floor keeps its claims and records.
enum Slots {
    Memory(Mutex<HashMap<String, Slot>>),
    Valkey {
        connection: redis::aio::MultiplexedConnection,
        begin: redis::Script,
        complete: redis::Script,
        release: redis::Script,
    },
}

/// What a request finds when it begins.
enum Begun {
    Claimed { token: u64 },
    Stored(Stored),
    Busy,
}

/// The floor's state: its store, the fingerprint key.
pub(crate) struct Floor {
    slots: Slots,
    mac: Hmac<Sha256>,
}

impl Floor {
    fn with(slots: Slots) -> Arc<Floor> {
        Arc::new(Floor {
            slots,
            mac: Hmac::new_from_slice(b"bench secret: 32 bytes, not for real use")
                .expect("HMAC takes keys of any length"),
        })
    }

    /// On a memory store.
    pub(crate) fn memory() -> Arc<Floor> {
        Floor::with(Slots::Memory(Mutex::new(HashMap::new())))
    }

    /// On the Valkey (or Redis) server at `url`, over one multiplexed connection.
    pub(crate) async fn valkey(url: &str) -> Arc<Floor> {
        let client =
            redis::Client::open(url).unwrap_or_else(|e| panic!("the floor's Valkey at {url}: {e}"));
        let connection = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("the floor's Valkey at {url}: {e}"));
        Floor::with(Slots::Valkey {
            connection,
            begin: redis::Script::new(include_str!("floor_begin.lua")),
            complete: redis::Script::new(include_str!("floor_complete.lua")),
            release: redis::Script::new(include_str!("floor_release.lua")),
        })
    }

    fn map(map: &Mutex<HashMap<String, Slot>>) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn begin(&self, key: &str) -> redis::RedisResult<Begun> {
        match &self.slots {
            Slots::Memory(map) => {
                let mut map = Floor::map(map);
                Ok(match map.get(key) {
                    Some(Slot::Running) => Begun::Busy,
                    Some(Slot::Done { expires, stored }) if *expires > Instant::now() => {
                        Begun::Stored(stored.clone())
                    }
                    _ => {
                        map.insert(key.to_owned(), Slot::Running);
                        Begun::Claimed { token: 0 }
                    }
                })
            }
            Slots::Valkey {
                connection, begin, ..
            } => {
                let token = fastrand::u64(..);
                let reply: redis::Value = begin
                    .key(record_key(key))
                    .key(lease_key(key))
                    .arg(token)
                    .arg(LEASE.as_millis() as u64)
                    .invoke_async(&mut connection.clone())
                    .await?;
                Ok(match reply {
                    redis::Value::Int(0) => Begun::Claimed { token },
                    redis::Value::BulkString(record) => match Stored::decode(Bytes::from(record)) {
                        Some(stored) => Begun::Stored(stored),
                        None => return Err(unreadable()),
                    },
                    redis::Value::Int(2) => Begun::Busy,
                    _ => return Err(unreadable()),
                })
            }
        }
    }

    async fn complete(&self, key: &str, token: u64, stored: Stored) -> redis::RedisResult<()> {
        match &self.slots {
            Slots::Memory(map) => {
                let expires = Instant::now() + RETENTION;
                Floor::map(map).insert(key.to_owned(), Slot::Done { expires, stored });
            }
            Slots::Valkey {
                connection,
                complete,
                ..
            } => {
                // 0: the lease was lost, the record not stored; the response still goes out.
                let _: u8 = complete
                    .key(record_key(key))
                    .key(lease_key(key))
                    .arg(token)
                    .arg(stored.encode())
                    .arg(RETENTION.as_millis() as u64)
                    .invoke_async(&mut connection.clone())
                    .await?;
            }
        }
        Ok(())
    }

    fn release(&self, key: &str, token: u64) {
        match &self.slots {
            Slots::Memory(map) => {
                Floor::map(map).remove(key);
            }
            Slots::Valkey {
                connection,
                release,
                ..
            } => {
                let (release, mut connection, key) =
                    (release.clone(), connection.clone(), key.to_owned());
                tokio::spawn(async move {
                    let _: redis::RedisResult<u8> = release
                        .key(lease_key(&key))
                        .arg(token)
                        .invoke_async(&mut connection)
                        .await;
                });
            }
        }
    }
}

/// The keys of one idempotency key's record and lease, under one hash tag.
fn record_key(key: &str) -> String {
    format!("floor:{{{key}}}:record")
}

fn lease_key(key: &str) -> String {
    format!("floor:{{{key}}}:lease")
}

fn unreadable() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Client, "a reply the floor cannot read"))
}

/// Releases a claim whose request ended without a stored response (dropped, or failed).
struct Claim<'a> {
    floor: &'a Floor,
    key: &'a str,
    token: u64,
    done: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.floor.release(self.key, self.token);
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
    let token = match floor.begin(&key).await {
        Ok(Begun::Claimed { token }) => token,
        Ok(Begun::Stored(stored)) if stored.fingerprint == fingerprint => {
            return stored.response(true);
        }
        Ok(Begun::Stored(_)) => return StatusCode::UNPROCESSABLE_ENTITY.into_response(),
        Ok(Begun::Busy) => return StatusCode::CONFLICT.into_response(),
        Err(_) => return StatusCode::SERVICE_UNAVAILABLE.into_response(),
    };
    let mut claim = Claim {
        floor: &floor,
        key: &key,
        token,
        done: false,
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    let (response, body) = response.into_parts();
    let Ok(body) = axum::body::to_bytes(body, LIMIT).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let stored = Stored {
        fingerprint,
        status: response.status,
        headers: response.headers,
        body,
    };
    let answer = stored.response(false);
    // Stored or not (the store down, the lease lost), the response goes out; released only if
    // the completion was not sent.
    claim.done = floor.complete(&key, token, stored).await.is_ok();
    answer
}
