//! Make HTTP endpoints safe to call twice, across every instance of a service.
//!
//! Three recipes, side by side: an API whose clients send `Idempotency-Key`, a signup keyed by
//! the phone number, and a provider's webhooks keyed by the event id.
//!
//! | | key | kind | a different request with the key | identity | while the first runs |
//! |---|---|---|---|---|---|
//! | API | [`key::header()`] (default) | for one request, scoped per [`principal`] | 422 `key-reused` | the whole request | 409 |
//! | signup | `key::json("/phone")?.names_a_thing()` | names a thing, global | runs after the first (the app answers "already registered") | the whole request | 409 |
//! | webhooks | `key::json("/id")?.names_a_thing()` | names a thing, global | the same event: replayed | [`Identity::Key`] | waits ([`OnConflict::Wait`]) |
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use tower_idempotency::key::{self, KeySourceExt};
//! use tower_idempotency::{IdempotencyLayer, Identity, OnConflict, Store, principal};
//!
//! #[derive(Clone)]
//! struct Customer { id: String } // put into the request by your authentication layer
//!
//! async fn pay() -> &'static str { "paid" }
//! async fn signup() -> &'static str { "created" }
//! async fn stripe_event() -> &'static str { "received" }
//!
//! let store = Store::redis("redis://127.0.0.1:6379/")?;
//! let secret = std::env::var("IDEMPOTENCY_SECRET")?; // the same on every instance
//!
//! // An API: the client's Idempotency-Key, scoped to the customer.
//! let payments = IdempotencyLayer::builder(store.clone())
//!     .secret(&secret)?
//!     .principal(principal::extension(|c: &Customer| c.id.clone()))
//!     .build()?;
//! // One account per phone number; a misspelt signup (422) holds nothing.
//! let signups = IdempotencyLayer::builder(store.clone())
//!     .secret(&secret)?
//!     .key(key::json("/phone")?.names_a_thing())
//!     .build()?;
//! // One application per event, however the provider serialises each delivery. (Check the
//! // provider's signature in a layer outside this one: see examples/webhook.)
//! let events = IdempotencyLayer::builder(store)
//!     .secret(&secret)?
//!     .key(key::json("/id")?.names_a_thing())
//!     .identity(Identity::Key)
//!     .on_conflict(OnConflict::Wait(Duration::from_secs(10)))
//!     .retention(Duration::from_secs(7 * 24 * 3600)) // past the provider's 3-day retries
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/payments", post(pay).route_layer(payments))
//!     .route("/signup", post(signup).route_layer(signups))
//!     .route("/webhooks/stripe", post(stripe_event).route_layer(events));
//! # Ok(()) }
//! ```
//!
//! Per covered request (POST and PATCH by default):
//!
//! 1. **Key**: from the `Idempotency-Key` header, a JSON field (`/phone`), a form field, a path
//!    or query parameter, or a closure ([`key`]), of one of two kinds ([`KeyKind`]): a key the
//!    client chose for one request, or a key that names a thing. It is scoped to the method,
//!    the matched route and the principal ([`principal`]; a per-request key needs one, or the
//!    explicit [`global_keys`](IdempotencyLayerBuilder::global_keys)). With the server
//!    [`secret`](IdempotencyLayerBuilder::secret), Redis (Cluster, Sentinel, Redlock) sees only
//!    keyed hashes, records sealed with AES-256-GCM, lease tokens and fence counters: nothing
//!    readable or forgeable without the request and the secret. (The in-memory store, which
//!    never leaves the process, keeps its records in clear.)
//! 2. **Identity** ([`Identity`]): HMAC-SHA256 (under the server secret) of what identifies
//!    the request beyond its key (the whole request by default). An identical resend is
//!    replayed; a different request gets **422** with a per-request key, and runs, once no other
//!    request about the thing runs, with a key that names a thing.
//! 3. **Begin**, one atomic step in the store: a stored response is **replayed** (same status,
//!    headers and body, plus `Idempotent-Replayed: true`); a request in flight gets **409** with
//!    `Retry-After` (or, with [`OnConflict::Wait`], waits for it and replays its response);
//!    otherwise the request takes a **lease** ([`distlock`]: owner token, fencing token, watchdog
//!    renewal while the handler runs).
//! 4. The **handler runs**, driven by the response future (and, if that future is dropped, in a
//!    task of its own): once called, it runs to its end whatever happens to the client (a closed connection, a timeout outside the layer, an HTTP/2 reset),
//!    so the client's retry gets the replay instead of a second execution.
//!    [`IdempotencyContext`] (request extension and axum extractor) gives it the fencing token
//!    and the lease.
//! 5. **Complete**, one atomic step: only if the lease is still ours, the response is stored for
//!    the retention (24 h) and the lease dropped. The handler decides what a retry may do
//!    ([`Outcome`]: final, even a 5xx, or retryable: the key is released and nothing stored);
//!    without a decision the status decides ([`outcome`]: a 4xx was refused without effect and
//!    holds nothing, a 408 from a timeout inside the layer is unknown). A panic or a body that breaks off
//!    records an `outcome-unknown` problem for retries (or releases the key:
//!    [`UnknownOutcome`]).
//!
//! Rejections are `application/problem+json` responses ([`problem`]), or HTML pages for a
//! person's browser ([`problem::html`]); the handler never runs for them. With the store unreachable the layer fails closed (503) unless built with
//! [`fail_open`](IdempotencyLayerBuilder::fail_open).
//!
//! # Streaming responses
//!
//! A response whose body is not complete at once (server-sent events, a large download) is
//! streamed: its head and every frame go to the client as they come (the time to first byte
//! is the handler's), and its record is appended to the store chunk by chunk as it passes
//! ([`chunk_size`](IdempotencyLayerBuilder::chunk_size); the layer holds at most a chunk of
//! it), then ended with its trailers. A duplicate that arrives meanwhile with
//! [`OnConflict::Wait`] **joins the live stream**: the head, every chunk stored so far, then
//! the live ones, byte for byte what the first client gets. A completed streamed record is
//! replayed part by part. A stream that cannot be read to its end (its writer died, a part is
//! missing or altered) breaks the body off with an error, never a complete short body. A
//! handler can keep a body out of the store with [`KeepBody::No`]. Records stream on memory,
//! Redis and Postgres (where a duplicate in another process polls for the parts; in
//! same-transaction mode the body is stored whole, with the handler's writes). Redlock does
//! not stream records: there the body is kept in memory up to the record limit and stored at
//! the end.
//!
//! # Where to put it
//!
//! * **After authentication** (authentication is an outer layer), so the
//!   [`principal`] is there to scope keys with.
//! * **Inside compression** (tower-http's `CompressionLayer` is an outer layer): records are
//!   stored uncompressed and each replay is compressed for the client that asks. With
//!   compression inside, a stored body is replayed only to retries that negotiate the same
//!   encoding (its `Vary`); others get 406. The `Vary` check covers the negotiation headers
//!   (`Accept`, `Accept-Encoding`, `Accept-Language`, `Origin`); a response that varies on
//!   another request header (`Vary: X-Tenant`) is told apart by naming that header in
//!   [`fingerprint_headers`](IdempotencyLayerBuilder::fingerprint_headers): a retry that sends
//!   it differently is then another request (422).
//! * On **the routes it protects**, with `post(handler).route_layer(layer)` (this crate's docs
//!   and examples use that form): the route's key is written where the route is, each route can
//!   have the kind of key it needs, and axum's 405 stays for methods a route does not have.
//!   Under `Router::layer` (or `Router::route_layer`) axum layers its 405 fallback too, and a
//!   covered method gets the layer's answer instead.
//!   Requests that match no route pass through either way (axum's 404).
//! * **On, not above, a `Router::nest_service`**: axum routes a nested *service* without a
//!   `MatchedPath`, exactly as it routes its fallback, so a layer above cannot tell the two
//!   apart and lets both through: put the layer on the nested service (a `Router` with the
//!   layer on its routes; around any other service, build it with
//!   [`cover_unmatched`](IdempotencyLayerBuilder::cover_unmatched)), or use `Router::nest`,
//!   whose routes an outer layer covers. Layers nest: a layer inside another passes a request
//!   through when an enclosing layer runs it under the same store name (the same layer on a
//!   router and on a router nested in it), and protects it too when its key is another (a
//!   router-wide header key and a route's phone number: both apply).
//! * Keys are scoped per **route template**: under `Router::nest("/shops/{shop}", ...)` the
//!   same key used in two shops is one key with another request: for a per-request key,
//!   refused with 422; for a key that names a thing (a `key::path("id")` order id), run one at
//!   a time with the other shop's, never replayed across them. When a key is only unique
//!   within a path parameter, make the key carry it (a [`KeySource`] of your own) or scope by
//!   a [`principal`].
//! * Timeouts **outside**: a `TimeoutLayer` outside answers the client and leaves the handler to
//!   finish and store its outcome. Inside, it cancels the handler, and the layer sees only
//!   what the timeout answers in its place: tower's `Timeout` returns an error, an unknown
//!   outcome ([`UnknownOutcome`]); tower-http's `TimeoutLayer` returns a response, 408 by
//!   default, which the default outcome rule counts as unknown too (the cancelled run may have
//!   done part of its work): a retry gets `outcome-unknown`, never a second run (with another
//!   status, that response is stored and replayed).
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use axum::{Router, routing::post};
//! # use tower_idempotency::{IdempotencyLayer, Store, principal};
//! # #[derive(Clone)] struct User { id: String }
//! # async fn create_order() {}
//! # let auth = tower::layer::util::Identity::new();
//! let idempotency = IdempotencyLayer::builder(Store::redis("redis://127.0.0.1:6379/")?)
//!     .secret(std::env::var("IDEMPOTENCY_SECRET")?)?
//!     .principal(principal::extension(|u: &User| u.id.clone()))
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order).route_layer(idempotency))
//!     .layer(auth) // your authentication layer: it runs first and inserts the User
//!     .layer(tower_http::compression::CompressionLayer::new());
//! # Ok(()) }
//! ```
//!
//! # What it guarantees
//!
//! * Concurrent duplicates (same key, any instance sharing the store) run the handler **at most
//!   once at a time**; once a response is stored, **never again** within the retention.
//! * A stored response is replayed byte for byte; a record that cannot be read is reported (500),
//!   never re-executed.
//! * A response too large to store (or that the store refuses or loses) is still never a reason
//!   to run the handler again, and never replayed as a 2xx (retries get a 410 problem naming
//!   the original status).
//! * The client going away never cancels a handler that started (unless the layer is built
//!   with [`cancel_on_disconnect`](IdempotencyLayerBuilder::cancel_on_disconnect) for handlers
//!   known to be cancel-safe).
//!
//! And its limits: a handler that outlives its lease (the store unreachable for longer than the
//! lease, or the process stalled) may overlap with a retry: its completion is then refused and
//! counted (`lease_lost`), and the fencing token lets the handler's own writes reject the stale
//! one. A single Redis that fails over can lose in-flight leases (see [`distlock`]).
//!
//! # Traces and metrics
//!
//! Every covered request gets an `info` span named `idempotency` (a child of the span the
//! request is in, such as tower-http's `TraceLayer`'s), and a handler whose client left runs on
//! inside it. Its fields:
//!
//! | field | value |
//! |---|---|
//! | `method`, `route` | the method and the route template (never the path: it can hold the key) |
//! | `decision` | `executed`, `replayed`, `joined` (a live stream), `conflict`, `rejected`, `passed-through` |
//! | `reason` | for `rejected`: the problem's slug (`missing-key`, `key-reused`, `store-unavailable`, ...); for `passed-through`: `fail-open` or `enclosing-layer` when it is one of those |
//! | `outcome` | for `executed`: `final`, `retryable` or `unknown` |
//! | `key` | the first 12 hex digits of the key's keyed hash (the store name): enough to follow one key, never the key |
//! | `store_us` | the store's first round trip (begin), in microseconds |
//!
//! With the `metrics` feature, through the [`metrics`](https://docs.rs/metrics) facade:
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `idempotency_outcomes_total` | `outcome`: `executed`, `replayed`, `conflict`, `mismatch` (a per-request key reused), `rejected`, `lease_lost`, `store_error`, `fail_open`, `not_stored` (retryable), `outcome_unknown`, `passthrough` | requests, by what became of them |
//! | `idempotency_store_seconds` | `op`: `begin`, `complete`, `thing` (the lock of a key that names a thing) | store latency |
//!
//! `examples/otel.rs` exports the spans with OpenTelemetry.
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
//! ACL SETUSER idempotency on >PASSWORD resetkeys ~idem:* resetchannels &idem:* -@all +fcall +evalsha +script|load +get +set +del +pexpire +pttl +type +hget +hmget +hset +hdel +hexists +hincrby +hsetnx +hlen +rpush +lindex +llen +lrange +publish +subscribe +unsubscribe +wait +role +cluster|slots
//! ```
//!
//! A store that refuses what the layer needs (an ACL user without either `FCALL` or
//! `EVALSHA`, a managed service that disabled scripting) is reported by
//! `store.client().prepare()` at startup, naming the command.

mod begin;
mod body;
mod cache;
mod complete;
mod context;
mod drive;
mod execution;
mod fingerprint;
mod future;
mod headers;
pub mod identity;
pub mod key;
pub mod layer;
mod live;
mod metrics;
pub mod operate;
pub mod outcome;
pub mod principal;
pub mod problem;
mod record;
mod replay;
mod run;
mod scope;
mod secret;
mod service;
mod store;
mod tee;
#[cfg(feature = "postgres")]
mod transaction;

pub use body::{BoxError, RequestBody, ResponseBody};
pub use cache::{ReplayCache, ReplayCacheStats};
pub use context::IdempotencyContext;
#[cfg(feature = "axum")]
pub use context::MissingIdempotencyContext;
pub use distlock;
pub use distlock::ConfigError;
pub use future::ResponseFuture;
pub use identity::Identity;
pub use key::{KeyKind, KeySource, KeySourceExt};
pub use layer::{
    DEFAULT_COMPLETION_GRACE, IdempotencyLayer, IdempotencyLayerBuilder, MAX_COMPLETION_GRACE,
    OnConflict, ReplayHeaders,
};
pub use outcome::{KeepBody, Outcome, UnknownOutcome};
pub use problem::Rejection;
pub use replay::IDEMPOTENT_REPLAYED;
pub use secret::MIN_SECRET_LEN;
pub use service::Idempotency;
pub use store::{DEFAULT_PREFIX, Store};
#[cfg(all(feature = "postgres", feature = "axum"))]
pub use transaction::MissingTransaction;
#[cfg(feature = "postgres")]
pub use transaction::Transaction;

#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals;

/// The README's Rust snippets compile as shown.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
