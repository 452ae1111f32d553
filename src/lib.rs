//! Make HTTP endpoints safe to call twice, across every instance of a service.
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, Store, principal};
//!
//! #[derive(Clone)]
//! struct Customer { id: String } // put into the request by your authentication layer
//!
//! async fn pay() -> &'static str { "paid" }
//!
//! let layer = IdempotencyLayer::builder(Store::redis("redis://127.0.0.1:6379/")?)
//!     .secret(std::env::var("IDEMPOTENCY_SECRET")?)?
//!     .principal(principal::extension(|c: &Customer| c.id.clone()))
//!     .build()?;
//! let app: Router = Router::new().route("/payments", post(pay)).layer(layer);
//! # Ok(()) }
//! ```
//!
//! Per covered request (POST and PATCH by default):
//!
//! 1. **Key**: from the `Idempotency-Key` header, a JSON field (`/phone`), a form field, a path
//!    or query parameter, or a closure ([`key`]). It is scoped to the method, the matched route
//!    and the principal ([`principal`]; a key chosen by clients needs one, or the explicit
//!    [`global_keys`](IdempotencyLayerBuilder::global_keys)). With the server
//!    [`secret`](IdempotencyLayerBuilder::secret), the store sees only keyed hashes, records
//!    sealed with AES-256-GCM, lease tokens and fence counters: nothing readable or forgeable
//!    without the request and the secret.
//! 2. **Fingerprint**: SHA-256 of the method, path, chosen headers and body. A key reused for a
//!    different request gets **422**.
//! 3. **Begin**, one atomic step in the store: a stored response is **replayed** (same status,
//!    headers and body, plus `Idempotent-Replayed: true`); a request in flight gets **409** with
//!    `Retry-After` (or, with [`OnConflict::Wait`], waits for it and replays its response);
//!    otherwise the request takes a **lease** ([`distlock`]: owner token, fencing token, watchdog
//!    renewal while the handler runs).
//! 4. The **handler runs**, in a task of its own: once called, it runs to its end whatever
//!    happens to the client (a closed connection, a timeout outside the layer, an HTTP/2 reset),
//!    so the client's retry gets the replay instead of a second execution.
//!    [`IdempotencyContext`] (request extension and axum extractor) gives it the fencing token
//!    and the lease.
//! 5. **Complete**, one atomic step: only if the lease is still ours, the response is stored for
//!    the retention (24 h) and the lease dropped. The handler decides what a retry may do
//!    ([`Outcome`]: final, even a 5xx, or retryable: the key is released and nothing stored);
//!    without a decision the status decides ([`outcome`]). A panic or a body that breaks off
//!    records an `outcome-unknown` problem for retries (or releases the key:
//!    [`UnknownOutcome`]).
//!
//! Rejections are `application/problem+json` responses ([`problem`]); the handler never runs for
//! them. With the store unreachable the layer fails closed (503) unless built with
//! [`fail_open`](IdempotencyLayerBuilder::fail_open).
//!
//! # What it guarantees
//!
//! * Concurrent duplicates (same key, any instance sharing the store) run the handler **at most
//!   once at a time**; once a response is stored, **never again** within the retention.
//! * A stored response is replayed byte for byte; a record that cannot be read is reported (500),
//!   never re-executed.
//! * A response too large to store is still never a reason to run the handler again, and never
//!   replayed as a 2xx (retries get a 410 problem naming the original status).
//! * The client going away never cancels a handler that started (unless the layer is built
//!   with [`cancel_on_disconnect`](IdempotencyLayerBuilder::cancel_on_disconnect) for handlers
//!   known to be cancel-safe).
//!
//! And its limits: a handler that outlives its lease (the store unreachable for longer than the
//! lease, or the process stalled) may overlap with a retry: its completion is then refused and
//! counted (`lease_lost`), and the fencing token lets the handler's own writes reject the stale
//! one. A single Redis that fails over can lose in-flight leases (see [`distlock`]).
//!
//! # Redis in production
//!
//! [`Store::redis`] takes `redis://` and `rediss://` (TLS, the system's roots) URLs; for a
//! private CA, mutual TLS, Redis Cluster, Sentinel or Redlock, build a [`distlock::LockClient`]
//! and use [`Store::from_client`]. Tested on Redis 7 and Valkey 9. A least-privilege ACL user
//! for the layer's default key prefix `idem` ([`distlock::acl_rules`] gives the rules for any
//! prefix):
//!
//! ```text
//! ACL SETUSER idempotency on >PASSWORD resetkeys ~idem:* resetchannels &idem:* -@all +evalsha +script|load +get +set +del +pexpire +pttl +type +hget +hset +hdel +hexists +hincrby +hlen +publish +subscribe +unsubscribe +wait +role +cluster|slots
//! ```
//!
//! A store that refuses what the layer needs (an ACL user without `EVALSHA`, a managed service
//! that disabled scripting) is reported by `store.client().prepare()` at startup, naming the
//! command.

mod begin;
mod body;
mod complete;
mod context;
mod execution;
mod fingerprint;
mod future;
pub mod key;
pub mod layer;
mod metrics;
pub mod outcome;
pub mod principal;
pub mod problem;
mod record;
mod replay;
mod scope;
mod secret;
mod service;
mod store;

pub use body::{BoxError, RequestBody, ResponseBody};
pub use context::IdempotencyContext;
#[cfg(feature = "axum")]
pub use context::MissingIdempotencyContext;
pub use distlock;
pub use distlock::ConfigError;
pub use future::ResponseFuture;
pub use key::{KeySource, KeySourceExt};
pub use layer::{IdempotencyLayer, IdempotencyLayerBuilder, OnConflict, ReplayHeaders};
pub use outcome::{Outcome, UnknownOutcome};
pub use problem::Rejection;
pub use replay::IDEMPOTENT_REPLAYED;
pub use secret::MIN_SECRET_LEN;
pub use service::Idempotency;
pub use store::{DEFAULT_PREFIX, Store};

/// Entry points for the fuzz targets in `fuzz/`: not a stable API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    /// Decodes a record's plaintext, and opens `bytes` as a sealed record under a fixed key;
    /// must never panic, whatever the bytes.
    pub fn decode_record(bytes: &[u8]) -> Result<(), String> {
        let sealer = crate::record::Sealer::new(&[7; 32], "fuzz");
        let _ = crate::record::Record::open(&sealer, bytes);
        crate::record::Record::decode(&bytes::Bytes::copy_from_slice(bytes)).map(|_| ())
    }

    /// The fingerprint of a request's parts and body.
    pub fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> [u8; 32] {
        let keys = crate::secret::Keys::new(Some(b"fuzzing secret, 32 bytes long..."));
        crate::fingerprint::fingerprint(
            keys.fingerprinter(),
            parts,
            &[http::header::CONTENT_TYPE],
            body,
        )
    }
}
