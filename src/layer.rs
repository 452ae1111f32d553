//! The layer and its builder; every option is checked when the layer is built.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{Method, Response, StatusCode};
use tower_layer::Layer;

use crate::key::{self, KeyKind, KeySource};
use crate::outcome::default_outcome;
use crate::principal::PrincipalSource;
use crate::problem::PROBLEM_BASE;
use crate::problem::html::{Page, RenderHtml, default_page};
use crate::secret::{Keys, MIN_SECRET_LEN};
use crate::{
    ConfigError, Idempotency, Identity, Outcome, Rejection, ResponseBody, Store, UnknownOutcome,
};

/// What to do with a request whose key is in flight (another request with the same key and
/// fingerprint is being processed).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::OnConflict;
/// let patient = OnConflict::Wait(Duration::from_secs(10));
/// # let _ = patient;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnConflict {
    /// Answer 409 Conflict with `Retry-After` (the IETF draft's behaviour; default), after the
    /// [`completion_grace`](IdempotencyLayerBuilder::completion_grace): a first request whose
    /// response has gone out while its outcome is being stored is replayed, not refused.
    Reject,
    /// Wait up to this long for the first request to finish (woken by its completion, not by
    /// polling) and replay its response; 409 if it is still running then. If the first request
    /// fails without storing a response, this one runs instead.
    Wait(Duration),
}

/// The default [`completion_grace`](IdempotencyLayerBuilder::completion_grace).
pub const DEFAULT_COMPLETION_GRACE: Duration = Duration::from_millis(50);

/// The longest [`completion_grace`](IdempotencyLayerBuilder::completion_grace).
pub const MAX_COMPLETION_GRACE: Duration = Duration::from_secs(10);

/// Which response headers are stored and replayed.
///
/// ```
/// use tower_idempotency::ReplayHeaders;
/// let only = ReplayHeaders::allow(["content-type", "location"]).unwrap();
/// let more = ReplayHeaders::default_deny().and_deny(["x-request-id"]).unwrap();
/// # let _ = (only, more);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayHeaders {
    allow: bool,
    names: Vec<HeaderName>,
}

/// Headers never replayed by default: hop-by-hop headers, `Set-Cookie` (a session must not be
/// handed to whoever retries), `Date`, and `Content-Length` (recomputed). (`Trailer` is
/// replayed: it declares the trailer fields the replay sends too, and an HTTP/1.1 server sends
/// only the ones declared.)
pub const DEFAULT_DENIED: [HeaderName; 11] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::SET_COOKIE,
    header::DATE,
    header::CONTENT_LENGTH,
    HeaderName::from_static("idempotent-replayed"),
];

fn names<I, N>(list: I) -> Result<Vec<HeaderName>, ConfigError>
where
    I: IntoIterator<Item = N>,
    N: AsRef<str>,
{
    list.into_iter()
        .map(|n| {
            HeaderName::try_from(n.as_ref()).map_err(|e| ConfigError::Invalid {
                field: "header name",
                reason: format!("{:?}: {e}", n.as_ref()),
            })
        })
        .collect()
}

impl ReplayHeaders {
    /// Replay every header but [`DEFAULT_DENIED`] (the default).
    ///
    /// ```
    /// let d = tower_idempotency::ReplayHeaders::default_deny();
    /// assert!(!d.keeps(&http::header::SET_COOKIE));
    /// assert!(d.keeps(&http::header::LOCATION));
    /// ```
    pub fn default_deny() -> Self {
        ReplayHeaders {
            allow: false,
            names: DEFAULT_DENIED.to_vec(),
        }
    }

    /// Also deny these headers.
    ///
    /// # Errors
    /// If a name is not a valid header name.
    ///
    /// ```
    /// let d = tower_idempotency::ReplayHeaders::default_deny().and_deny(["x-trace"]).unwrap();
    /// assert!(!d.keeps(&http::HeaderName::from_static("x-trace")));
    /// ```
    pub fn and_deny<I, N>(mut self, list: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = N>,
        N: AsRef<str>,
    {
        let extra = names(list)?;
        if self.allow {
            self.names.retain(|n| !extra.contains(n));
        } else {
            self.names.extend(extra);
        }
        Ok(self)
    }

    /// Replay only these headers (hop-by-hop headers, `Set-Cookie` and `Content-Length` are
    /// still never replayed).
    ///
    /// # Errors
    /// If a name is not a valid header name.
    ///
    /// ```
    /// let a = tower_idempotency::ReplayHeaders::allow(["content-type"]).unwrap();
    /// assert!(a.keeps(&http::header::CONTENT_TYPE));
    /// assert!(!a.keeps(&http::header::LOCATION));
    /// ```
    pub fn allow<I, N>(list: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = N>,
        N: AsRef<str>,
    {
        let mut names = names(list)?;
        names.retain(|n| !DEFAULT_DENIED.contains(n) || *n == header::DATE);
        Ok(ReplayHeaders { allow: true, names })
    }

    /// Whether a header is stored and replayed.
    ///
    /// ```
    /// assert!(tower_idempotency::ReplayHeaders::default_deny().keeps(&http::header::CONTENT_TYPE));
    /// ```
    pub fn keeps(&self, name: &HeaderName) -> bool {
        self.names.contains(name) == self.allow
    }
}

/// Decides what a retry may do when the handler did not say.
pub(crate) type DefaultOutcome = dyn Fn(StatusCode) -> Outcome + Send + Sync;

/// Renders a rejection in the API's own error format.
pub(crate) type Render = dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync;

/// How rejections are rendered.
#[derive(Clone)]
pub(crate) enum Rendering {
    /// problem+json under a `type` base.
    Problem(String),
    /// The user's format, with the rejection's status.
    Custom(Arc<Render>),
    /// gRPC trailers-only responses (HTTP 200, `grpc-status`).
    Grpc,
}

/// The checked configuration, shared by every clone of the layer and its services.
pub(crate) struct Config {
    pub(crate) store: Store,
    /// The store's client for the locks of the things keys name: their fence counters live as
    /// long as a record (the retention after their last use), and start again from the clock.
    pub(crate) things: distlock::LockClient,
    pub(crate) keys: Keys,
    /// The previous secrets' keys, consulted while a rotation is under way.
    pub(crate) previous: Vec<Keys>,
    pub(crate) key: Arc<dyn KeySource>,
    /// What the key identifies (the source's kind, read once).
    pub(crate) kind: KeyKind,
    pub(crate) identity: Identity,
    pub(crate) key_required: bool,
    pub(crate) principal: Option<Arc<dyn PrincipalSource>>,
    pub(crate) methods: Vec<Method>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) body_limit: usize,
    pub(crate) read_timeout: Duration,
    pub(crate) stall_timeout: Duration,
    pub(crate) record_limit: usize,
    pub(crate) chunk_size: usize,
    pub(crate) retention: Duration,
    pub(crate) on_conflict: OnConflict,
    pub(crate) completion_grace: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) default_outcome: Arc<DefaultOutcome>,
    pub(crate) unknown_outcome: UnknownOutcome,
    pub(crate) cancel_on_disconnect: bool,
    /// Whether the handler's writes commit with its outcome, in the transaction the layer
    /// opens (the Postgres store).
    pub(crate) same_transaction: bool,
    pub(crate) replay_headers: ReplayHeaders,
    pub(crate) fail_open: bool,
    pub(crate) cover_unmatched: bool,
    pub(crate) rendering: Rendering,
    /// Pages for browsers (see `problem::html`), if they get them.
    pub(crate) html: Option<Arc<RenderHtml>>,
    /// Whether records are sealed: on every store but the in-memory one, whose records never
    /// leave the process (see `record::seal`).
    pub(crate) seal: bool,
}

impl Config {
    /// A rejection as a response: problem+json, the user's format (with the rejection's
    /// status), or a gRPC status.
    pub(crate) fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        match &self.rendering {
            Rendering::Problem(base) => rejection.to_response_with_base(base),
            Rendering::Custom(render) => rejection.finish(render(rejection)),
            Rendering::Grpc => rejection.to_grpc_response(),
        }
    }

    /// A rejection as a response with the layer's body type, rendered as the layer is
    /// configured.
    pub(crate) fn problem<B>(&self, rejection: &Rejection) -> Response<ResponseBody<B>> {
        self.render(rejection)
            .map(|body| ResponseBody::full(body, None))
    }

    /// The `Retry-After` of a 409: when the holder's lease ends (a crashed holder's key frees
    /// then; a live holder renews), at most the configured `retry_after`.
    pub(crate) fn conflict_retry_after(&self, holder: Option<Duration>) -> Duration {
        holder.map_or(self.retry_after, |left| left.min(self.retry_after))
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("store", &self.store.describe())
            .field("secret", &self.keys.has_secret())
            .field("previous_secrets", &self.previous.len())
            .field("key", &self.key.describe())
            .field("kind", &self.kind)
            .field("identity", &self.identity)
            .field("key_required", &self.key_required)
            .field("principal", &self.principal.is_some())
            .field("methods", &self.methods)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("body_limit", &self.body_limit)
            .field("read_timeout", &self.read_timeout)
            .field("stall_timeout", &self.stall_timeout)
            .field("record_limit", &self.record_limit)
            .field("chunk_size", &self.chunk_size)
            .field("retention", &self.retention)
            .field("on_conflict", &self.on_conflict)
            .field("retry_after", &self.retry_after)
            .field("unknown_outcome", &self.unknown_outcome)
            .field("cancel_on_disconnect", &self.cancel_on_disconnect)
            .field("same_transaction", &self.same_transaction)
            .field("replay_headers", &self.replay_headers)
            .field("fail_open", &self.fail_open)
            .field("cover_unmatched", &self.cover_unmatched)
            .field(
                "rendering",
                &match &self.rendering {
                    Rendering::Problem(base) => base.as_str(),
                    Rendering::Custom(_) => "custom",
                    Rendering::Grpc => "grpc",
                },
            )
            .field("html", &self.html.is_some())
            .finish()
    }
}

/// Makes the wrapped endpoints idempotent. Cheap to clone (one `Arc`).
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{Router, routing::post};
/// use tower_idempotency::{IdempotencyLayer, Store, key};
///
/// async fn signup() -> &'static str { "created" }
///
/// let store = Store::redis("redis://127.0.0.1:6379/")?;
/// let layer = IdempotencyLayer::builder(store)
///     .secret(std::env::var("IDEMPOTENCY_SECRET")?)?
///     .key(key::json("/phone")?)
///     .build()?;
/// let app: Router = Router::new().route("/signup", post(signup)).layer(layer);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A builder on `store`.
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, Identity, KeySourceExt, OnConflict, Store, key};
    /// let layer = IdempotencyLayer::builder(Store::memory())
    ///     .secret("a secret of 32 random bytes.....")?
    ///     .key(key::json("/id")?) // a webhook: the event id names the event
    ///     .identity(Identity::Key)
    ///     .on_conflict(OnConflict::Wait(Duration::from_secs(5)))
    ///     .retention(Duration::from_secs(3600))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn builder(store: Store) -> IdempotencyLayerBuilder {
        IdempotencyLayerBuilder {
            store,
            secret: None,
            previous: Vec::new(),
            lease: None,
            key: Arc::new(key::header()),
            identity: Identity::Request,
            key_required: true,
            principal: None,
            global_keys: false,
            methods: vec![Method::POST, Method::PATCH],
            fingerprint_headers: vec![header::CONTENT_TYPE],
            body_limit: 1 << 20,
            read_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(30),
            record_limit: None,
            chunk_size: 64 * 1024,
            retention: Duration::from_secs(24 * 3600),
            on_conflict: OnConflict::Reject,
            completion_grace: DEFAULT_COMPLETION_GRACE,
            retry_after: Duration::from_secs(5),
            default_outcome: Arc::new(default_outcome),
            unknown_outcome: UnknownOutcome::default(),
            cancel_on_disconnect: false,
            same_transaction: false,
            replay_headers: ReplayHeaders::default_deny(),
            fail_open: false,
            cover_unmatched: false,
            rendering: Rendering::Problem(PROBLEM_BASE.to_owned()),
            html: HtmlPages::Default,
        }
    }

    pub(crate) fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// Waits, at most `within`, until every protected execution of the layers on this layer's
    /// store has ended and its outcome is stored: [`Store::drain`]. Returns whether it all
    /// finished. Call it once the server has stopped, before the process exits.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build()?;
    /// assert!(layer.drain(Duration::from_secs(1)).await, "nothing runs");
    /// # Ok(()) }
    /// ```
    pub async fn drain(&self, within: Duration) -> bool {
        self.config.store.drain(within).await
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_config(inner, self.config.clone())
    }
}

/// Builder for [`IdempotencyLayer`]; [`build`](Self::build) checks the options against each
/// other and says which one cannot work.
#[must_use]
pub struct IdempotencyLayerBuilder {
    store: Store,
    secret: Option<Vec<u8>>,
    previous: Vec<Vec<u8>>,
    lease: Option<distlock::LockConfig>,
    key: Arc<dyn KeySource>,
    identity: Identity,
    key_required: bool,
    principal: Option<Arc<dyn PrincipalSource>>,
    global_keys: bool,
    methods: Vec<Method>,
    fingerprint_headers: Vec<HeaderName>,
    body_limit: usize,
    read_timeout: Duration,
    stall_timeout: Duration,
    record_limit: Option<usize>,
    chunk_size: usize,
    retention: Duration,
    on_conflict: OnConflict,
    completion_grace: Duration,
    retry_after: Duration,
    default_outcome: Arc<DefaultOutcome>,
    unknown_outcome: UnknownOutcome,
    cancel_on_disconnect: bool,
    same_transaction: bool,
    replay_headers: ReplayHeaders,
    fail_open: bool,
    cover_unmatched: bool,
    rendering: Rendering,
    html: HtmlPages,
}

/// Whether browsers get pages: by default with problem+json rendering only.
enum HtmlPages {
    Default,
    Custom(Arc<RenderHtml>),
    Off,
}

impl std::fmt::Debug for IdempotencyLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("store", &self.store.describe())
            .field("key", &self.key.describe())
            .finish_non_exhaustive()
    }
}

/// The longest stored response body accepted: 16 GiB (a streamed record is stored in parts of
/// at most [`MAX_CHUNK_SIZE`]), or half the address space where `usize` is 32 bits.
pub const MAX_RECORD_LIMIT: usize = record_cap(usize::MAX as u64) as usize;

/// [`MAX_RECORD_LIMIT`] where `usize::MAX` is `usize_max`: computed in 64 bits (as a `usize`,
/// `16 << 30` wraps to 0 on 32-bit targets, and no limit could be built there).
const fn record_cap(usize_max: u64) -> u64 {
    let cap = 16 << 30;
    if cap < usize_max / 2 {
        cap
    } else {
        usize_max / 2
    }
}

// Every target can build a layer: the largest limit holds the default ones.
const _: () = assert!(MAX_RECORD_LIMIT >= MAX_WHOLE_RECORD_LIMIT && MAX_RECORD_LIMIT >= 64 << 20);

/// The longest response body stored on a store that does not stream (Redlock): it is kept in
/// memory and stored as one value (Redis values are at most 512 MB).
pub const MAX_WHOLE_RECORD_LIMIT: usize = 256 << 20;

/// The room left for a whole record's head (status, headers, trailers) beside its body, under
/// what a store that does not stream carries.
const RECORD_HEAD_ROOM: usize = 256 << 10;

/// The largest chunk a streamed record is stored in.
pub const MAX_CHUNK_SIZE: usize = 64 << 20;

impl IdempotencyLayerBuilder {
    /// The server secret (at least [`MIN_SECRET_LEN`] bytes; 32 random bytes recommended, the
    /// same on every instance), for example from an environment variable.
    ///
    /// With it, nothing in the store can be computed or forged without it: the store name of a
    /// key and the request fingerprint are HMAC-SHA256 under keys derived from it, and each
    /// record is sealed with AES-256-GCM under a key derived from it, the raw idempotency key
    /// and its scope (see the `secret` module). That is for the stores outside the process
    /// (Redis, Cluster, Sentinel, Redlock): the in-memory store keeps its records in clear,
    /// where only the process can read them. Without it the same derivations run with an
    /// empty secret: raw input still never reaches the store, but names and fingerprints of
    /// guessable keys (a phone number) can be recovered by enumeration, and whoever knows a key
    /// can open or forge its record. Keys that name a thing ([`KeyKind::Thing`]: a phone number
    /// or an e-mail in the body, an order id in the path or the query, any source said to
    /// [`names_a_thing`](crate::KeySourceExt::names_a_thing)) can be guessed, and are refused
    /// without a secret. A per-request key, which the client makes up, is not.
    ///
    /// Rotating the secret without a window: keep the old one as a
    /// [`previous_secrets`](Self::previous_secrets) entry for a retention (README, "Rotating
    /// the secret").
    ///
    /// # Errors
    /// If the secret is shorter than [`MIN_SECRET_LEN`] bytes.
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let secret = std::env::var("IDEMPOTENCY_SECRET")
    ///     .unwrap_or_else(|_| "change me: 32 random bytes, base64".into());
    /// let b = IdempotencyLayer::builder(Store::memory()).secret(secret)?;
    /// # Ok(()) }
    /// ```
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Result<Self, ConfigError> {
        let secret = secret.as_ref();
        if secret.len() < MIN_SECRET_LEN {
            return Err(ConfigError::Invalid {
                field: "secret",
                reason: format!(
                    "{} bytes is too short to be a secret: use at least {MIN_SECRET_LEN} (32 random bytes recommended)",
                    secret.len()
                ),
            });
        }
        self.secret = Some(secret.to_vec());
        Ok(self)
    }

    /// Secrets that were current before [`secret`](Self::secret), still consulted while a
    /// rotation is under way: a request finds a lease or a record made under any of them, and
    /// recognises a fingerprint made under any of them; its own lease is taken, and its record
    /// stored, under the current secret (and a lease under each previous one too, so that an
    /// instance still on one of them is kept out). Each previous secret costs a request one
    /// more round trip to begin, and a release after it ran. See README, "Rotating the secret".
    ///
    /// # Errors
    /// If a secret is shorter than [`MIN_SECRET_LEN`] bytes.
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let b = IdempotencyLayer::builder(Store::memory())
    ///     .secret("the new secret: 32 random bytes.")?
    ///     .previous_secrets(["the old secret: 32 random bytes."])?;
    /// # Ok(()) }
    /// ```
    pub fn previous_secrets<I, S>(mut self, secrets: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[u8]>,
    {
        let mut previous = Vec::new();
        for secret in secrets {
            let secret = secret.as_ref();
            if secret.len() < MIN_SECRET_LEN {
                return Err(ConfigError::Invalid {
                    field: "previous_secrets",
                    reason: format!(
                        "{} bytes is too short to be a secret: use at least {MIN_SECRET_LEN}",
                        secret.len()
                    ),
                });
            }
            previous.push(secret.to_vec());
        }
        self.previous = previous;
        Ok(self)
    }

    /// Where the key comes from and what it identifies (default: the `Idempotency-Key` header,
    /// a key the client chose for one request). See [`key`] for the two kinds of key.
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Store, key};
    /// let b = IdempotencyLayer::builder(Store::memory()).key(key::json("/phone")?);
    /// # Ok(()) }
    /// ```
    pub fn key(mut self, source: impl KeySource) -> Self {
        self.key = Arc::new(source);
        self
    }

    /// What identifies a request beyond its key (default [`Identity::Request`], the whole
    /// request, for both kinds of key): see [`identity`](crate::identity).
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Identity, Store};
    /// let b = IdempotencyLayer::builder(Store::memory()).identity(Identity::json_fields(["/amount"])?);
    /// # Ok(()) }
    /// ```
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = identity;
        self
    }

    /// Whether requests without a key are refused with 400 (default) or passed through
    /// unprotected. (A request without a body is a request without a key, whatever its
    /// content type; one with a body of the wrong type for a body key, not JSON for a `json`
    /// key, is refused with 415 either way.)
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .key_required(false);
    /// ```
    pub fn key_required(mut self, required: bool) -> Self {
        self.key_required = required;
        self
    }

    /// Scopes keys to the principal (user, tenant, API client) the request comes from: the same
    /// key from two principals is two keys, so no one can replay or squat someone else's. Take
    /// it from what authentication established ([`principal::extension`](crate::principal::extension),
    /// [`principal::claim`](crate::principal::claim)), never from raw credentials that change
    /// on refresh. A request without a principal is refused (500 `principal-missing`). See
    /// [`principal`](crate::principal).
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Store, principal};
    /// let layer = IdempotencyLayer::builder(Store::memory())
    ///     .principal(principal::claim("sub"))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn principal(mut self, source: impl PrincipalSource) -> Self {
        self.principal = Some(Arc::new(source));
        self
    }

    /// Declares the keys global: one key means one operation whoever sends it (a provider's
    /// webhook deliveries, a single-tenant service). Needed when the key is chosen by clients
    /// (a header, a closure) and no [`principal`](Self::principal) scopes it; keys that name a
    /// thing (a phone number, an event id) are global by nature and need neither.
    ///
    /// Global means across hosts too: the scope is the method, the route and the key, not the
    /// `Host`, so one service reached through two host names keeps one key. Tenants told apart by
    /// host, sharing routes and a store, scope their keys with
    /// `.principal(principal::host())` ([`host`](crate::principal::host), which reads
    /// HTTP/2's `:authority` too).
    ///
    /// ```
    /// # fn main() -> Result<(), tower_idempotency::ConfigError> {
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// // A webhook endpoint: the provider is the only client.
    /// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build()?;
    /// # Ok(()) }
    /// ```
    pub fn global_keys(mut self) -> Self {
        self.global_keys = true;
        self
    }

    /// The methods covered (default POST and PATCH); other methods pass through untouched.
    /// `HEAD` is refused at build: it is safe, and answered without a body.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .methods([http::Method::POST, http::Method::PUT, http::Method::DELETE]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Request headers included in the fingerprint (default `Content-Type`), besides the method,
    /// path, query, body and trailers. Name here any header a response varies on beyond the
    /// negotiation headers the layer checks itself (`Vary: X-Tenant`): a retry sending it
    /// differently is then another request (422), never a replay of this one.
    ///
    /// # Errors
    /// If a name is not a valid header name.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .fingerprint_headers(["content-type", "x-tenant"]).unwrap();
    /// ```
    pub fn fingerprint_headers<I, N>(mut self, headers: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = N>,
        N: AsRef<str>,
    {
        self.fingerprint_headers = names(headers)?;
        Ok(self)
    }

    /// Largest request body buffered for the key and fingerprint (default 1 MiB); larger
    /// requests get 413.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .body_limit(64 * 1024);
    /// ```
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// How long the request body may take to arrive (default 30 s); slower requests get 408.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .read_timeout(std::time::Duration::from_secs(5));
    /// ```
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }

    /// How long a streamed response waits for its client to read on (default 30 s). A client
    /// that stops reading without closing its connection (a phone that lost its network: the
    /// server's TCP retransmits for many minutes) would hold the execution, and with it the
    /// key, for as long as its connection lives. The response goes to the client in pieces of
    /// at most 16 KiB: once one has waited this long for room (the client took less than
    /// 16 KiB in that time, about 550 bytes/s at the default), the response is no longer sent
    /// to it (if it ever reads on, its body breaks off: over HTTP/1.0, whose bodies end with
    /// the connection, it cannot tell) and the execution goes on at the handler's pace, storing
    /// the outcome for its retry. A body that is not kept cannot be replayed, so its client is
    /// not given up: opted out (`KeepBody::No`), announced (`content-length`) over the record
    /// limit, or from the frame that takes a chunked body over it (before that frame, the
    /// layer cannot know: a chunked body that goes over the limit later can have a stalled
    /// client given up, and its retry gets 410). Not with
    /// [`cancel_on_disconnect`](Self::cancel_on_disconnect), where the client's reading drives
    /// the execution (a stalled client holds the key as long as its connection lives).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .stall_timeout(std::time::Duration::from_secs(10));
    /// ```
    pub fn stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// Largest response body stored for replay (default 64 MiB on stores that stream records,
    /// which hold one chunk of it in memory at a time; 1 MiB on Redlock, which keeps it in
    /// memory and stores it whole; on the in-memory store, a quarter of its
    /// [`max_bytes`](distlock::MemoryLimits::max_bytes) at most, 16 MiB by default, and more is
    /// refused at build: it evicts the oldest outcomes to make room for a record as it
    /// streams). A larger response is still sent in full; its status, headers and
    /// `grpc-status` trailer are stored without the body, and retries get a
    /// `response-not-stored` problem instead of running the handler again.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .record_limit(256 * 1024);
    /// ```
    pub fn record_limit(mut self, bytes: usize) -> Self {
        self.record_limit = Some(bytes);
        self
    }

    /// The size of the chunks a streamed response is stored in (default 64 KiB, from 1 KiB to
    /// [`MAX_CHUNK_SIZE`]): the layer holds at most one chunk of a response in memory. A chunk
    /// is also stored as soon as the body pauses, so duplicates following the stream see its
    /// data (server-sent events) when it happens.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .chunk_size(16 * 1024);
    /// ```
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// How long outcomes are kept for replay (default 24 h).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .retention(std::time::Duration::from_secs(7 * 24 * 3600));
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The lease while a handler runs (default 10 s, renewed every lease/3 while it runs). It
    /// bounds how long a crashed instance blocks retries of its keys.
    ///
    /// # Errors
    /// If the lease cannot work (see [`distlock::LockConfig`]).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .lease(std::time::Duration::from_secs(30)).unwrap();
    /// ```
    pub fn lease(self, lease: Duration) -> Result<Self, ConfigError> {
        // On the lock timing given so far (`lock_config`), else the store's.
        let config = match &self.lease {
            Some(config) => config.clone(),
            None => self.store.client().config().clone(),
        }
        .to_builder()
        .lease(lease)
        .build()?;
        Ok(self.lock_config(config))
    }

    /// Full lock timing (lease, renewal, drift, command timeout, backoff).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .lock_config(distlock::LockConfig::default());
    /// ```
    pub fn lock_config(mut self, config: distlock::LockConfig) -> Self {
        self.lease = Some(config);
        self
    }

    /// What to do while a request with the same key is in flight (default: 409 at once).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .on_conflict(tower_idempotency::OnConflict::Wait(std::time::Duration::from_secs(5)));
    /// ```
    pub fn on_conflict(mut self, on_conflict: OnConflict) -> Self {
        self.on_conflict = on_conflict;
        self
    }

    /// How long a duplicate that finds its key in flight waits for it before the 409 of
    /// [`OnConflict::Reject`] (default 50 ms; zero: 409 at once; at most 10 s).
    ///
    /// A response goes to the client as soon as its outcome is on its way to the store, without
    /// waiting for the store's answer (one round trip less for every request), and the lease
    /// keeps the key until the outcome is stored. A retry sent to the same instance is ordered
    /// behind the store command on its connection; one that reaches another instance within
    /// that round trip would find the key still in flight: the grace makes it wait for the
    /// stored outcome (woken by the completion, not by polling) and replay it. A request that
    /// really is concurrent gets its 409 after the grace. (On Postgres, whose operations each
    /// take a connection of the pool and are not kept in order, a response waits for its
    /// outcome to be stored, up to the command timeout.)
    ///
    /// ```
    /// use std::time::Duration;
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .completion_grace(Duration::from_millis(200));
    /// ```
    pub fn completion_grace(mut self, grace: Duration) -> Self {
        self.completion_grace = grace;
        self
    }

    /// The longest `Retry-After` the layer sends (default 5 s; whole seconds, at least 1): a 409
    /// says when the holder's lease ends (a crashed holder's key frees then), at most this; a
    /// 503 says this.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .retry_after(std::time::Duration::from_secs(2));
    /// ```
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// The base of the problem `type` URIs (default [`PROBLEM_BASE`], these docs); the slug
    /// (`key-reused`, ...) is appended.
    ///
    /// # Errors
    /// If `base` is not a URI.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .problem_base("https://api.example.com/problems/").unwrap();
    /// ```
    pub fn problem_base(mut self, base: impl Into<String>) -> Result<Self, ConfigError> {
        let base = base.into();
        if base.parse::<http::Uri>().is_err() || base.chars().any(char::is_whitespace) {
            return Err(ConfigError::Invalid {
                field: "problem_base",
                reason: format!("{base:?} is not a URI"),
            });
        }
        self.rendering = Rendering::Problem(base);
        Ok(self)
    }

    /// Renders the layer's rejections in your API's own error format. The status code,
    /// `Retry-After` (unless you set one) and the [`Rejection`] extension are set on what you
    /// return.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let b = IdempotencyLayer::builder(Store::memory()).render_rejections(|rejection| {
    ///     let body = serde_json::json!({ "error": { "code": rejection.slug(), "message": rejection.detail() } });
    ///     let mut response = http::Response::new(bytes::Bytes::from(body.to_string()));
    ///     response.headers_mut().insert("content-type", "application/json".parse().unwrap());
    ///     response
    /// });
    /// ```
    pub fn render_rejections<F>(mut self, render: F) -> Self
    where
        F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.rendering = Rendering::Custom(Arc::new(render));
        self
    }

    /// Renders the page a person's browser gets for a rejection (default
    /// [`crate::problem::html::default_page`], with problem+json rendering): see
    /// [`problem::html`](crate::problem::html). A request gets a page when its `Accept` ranks
    /// `text/html` above JSON; the status and `Retry-After` stay the rejection's.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Rejection, Store};
    /// let b = IdempotencyLayer::builder(Store::memory()).html_rejections(|page| {
    ///     let again = page.back().unwrap_or("/");
    ///     format!("<!doctype html><h1>{}</h1><a href=\"{again}\">Back</a>", page.rejection().title())
    /// });
    /// ```
    pub fn html_rejections<F>(mut self, render: F) -> Self
    where
        F: Fn(&Page<'_>) -> String + Send + Sync + 'static,
    {
        self.html = HtmlPages::Custom(Arc::new(render));
        self
    }

    /// Browsers get rejections as the API's other clients do, not as pages.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .no_html_rejections();
    /// ```
    pub fn no_html_rejections(mut self) -> Self {
        self.html = HtmlPages::Off;
        self
    }

    /// Renders rejections as gRPC statuses (for a tonic service): trailers-only responses with
    /// HTTP 200, `grpc-status` and `grpc-message`, as gRPC clients expect. In flight: `ABORTED`;
    /// a reused or malformed key: `INVALID_ARGUMENT`; the store unavailable: `UNAVAILABLE`;
    /// outcome unknown: `UNKNOWN` ([`Rejection::grpc_code`] has them all).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .grpc_rejections();
    /// ```
    pub fn grpc_rejections(mut self) -> Self {
        self.rendering = Rendering::Grpc;
        self
    }

    /// What a retry may do with a response when the handler did not say (with an [`Outcome`]
    /// in the response extensions or through its context). Default: [`default_outcome`]
    /// (retryable for 401, 403, 408, 409, 425, 429 and 503; final for everything else, 5xx
    /// included). See [`outcome`](crate::outcome) for the reasoning.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Outcome, Store};
    /// // Also let clients retry after a gateway error from this service.
    /// let b = IdempotencyLayer::builder(Store::memory()).default_outcome(|status| {
    ///     match status.as_u16() {
    ///         502 | 504 => Outcome::Retryable,
    ///         _ => tower_idempotency::outcome::default_outcome(status),
    ///     }
    /// });
    /// ```
    pub fn default_outcome<F>(mut self, decide: F) -> Self
    where
        F: Fn(StatusCode) -> Outcome + Send + Sync + 'static,
    {
        self.default_outcome = Arc::new(decide);
        self
    }

    /// What happens when a handler's outcome cannot be known: it panicked, the inner service
    /// returned an error, or its response body failed half-way (default
    /// [`UnknownOutcome::Record`]: retries get an `outcome-unknown` problem; see
    /// [`outcome`](crate::outcome#outcome-unknown)).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, Store, UnknownOutcome};
    /// let b = IdempotencyLayer::builder(Store::memory()).on_unknown_outcome(UnknownOutcome::Release);
    /// ```
    pub fn on_unknown_outcome(mut self, policy: UnknownOutcome) -> Self {
        self.unknown_outcome = policy;
        self
    }

    /// For handlers known to be cancel-safe: when the client goes away before its response
    /// ended, cancel the handler and release the key, storing nothing (default `false`: once
    /// the handler was called, it runs to its end and its outcome is stored whatever happens to
    /// the connection, so that the client's retry gets the replay).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .cancel_on_disconnect(true);
    /// ```
    pub fn cancel_on_disconnect(mut self, cancel: bool) -> Self {
        self.cancel_on_disconnect = cancel;
        self
    }

    /// Exactly once for database work (the Postgres store, feature `postgres`): the layer opens
    /// a transaction for each execution and gives it to the handler ([`Transaction`], an axum
    /// extractor), the handler does its writes in it, and the layer stores the outcome in that
    /// same transaction and commits: the writes and the outcome commit together, or neither
    /// does. A handler error, a panic, a retryable outcome or a process that dies before the
    /// commit leaves nothing (the retry runs cleanly); a process that dies after it leaves the
    /// outcome (the retry gets the replay). The response goes out once the commit is confirmed
    /// (a streamed body is gathered first, up to the record limit): a client is never told of
    /// work that did not commit. While the transaction is open it holds the key's row locked:
    /// a duplicate is told the key is in flight at once (409, or waits without holding a
    /// connection). Refused at build on another store.
    ///
    /// [`Transaction`]: crate::Transaction
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum::{Router, routing::post};
    /// use tower_idempotency::{IdempotencyLayer, Store, Transaction, key};
    ///
    /// async fn apply(tx: Transaction) -> Result<&'static str, String> {
    ///     tx.execute("INSERT INTO ledger (event, amount) VALUES ('evt_1', 5)", &[])
    ///         .await
    ///         .map_err(|e| e.to_string())?;
    ///     Ok("applied") // committed with its outcome by the layer
    /// }
    /// let store = Store::postgres("postgres://app@127.0.0.1/app", "idempotency")?;
    /// store.prepare().await?;
    /// let layer = IdempotencyLayer::builder(store)
    ///     .secret(std::env::var("IDEMPOTENCY_SECRET")?)?
    ///     .key(key::json("/id")?)
    ///     .same_transaction(true)
    ///     .build()?;
    /// let app: Router = Router::new().route("/events", post(apply).route_layer(layer));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn same_transaction(mut self, on: bool) -> Self {
        self.same_transaction = on;
        self
    }

    /// Which response headers are stored and replayed (default [`ReplayHeaders::default_deny`]),
    /// trailers included; a gRPC call's status trailers (`grpc-status`, `grpc-message`,
    /// `grpc-status-details-bin`) are kept whatever it says. The policy in force at replay
    /// applies too, to what was stored under an earlier one.
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .replay_headers(tower_idempotency::ReplayHeaders::allow(["content-type", "location"]).unwrap());
    /// ```
    pub fn replay_headers(mut self, policy: ReplayHeaders) -> Self {
        self.replay_headers = policy;
        self
    }

    /// Whether requests axum routed to no route are covered too (default `false`: they pass
    /// through, so an unknown path gets the router's 404, not a key rejection). axum routes a
    /// request without a `MatchedPath` to its fallback, and to a service nested with
    /// `Router::nest_service`, and nothing public tells the two apart: a layer wrapping such a
    /// service itself (a `service_fn`, a tonic service, anything but a `Router` with the layer
    /// on its routes) sees every request as unmatched, and must cover them.
    ///
    /// ```
    /// use tower::Layer;
    /// let layer = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .global_keys()
    ///     .cover_unmatched(true)
    ///     .build()
    ///     .unwrap();
    /// let hooks = layer.layer(tower::service_fn(|_req: http::Request<tower_idempotency::RequestBody<axum::body::Body>>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::empty()))
    /// }));
    /// let app: axum::Router = axum::Router::new().nest_service("/hooks", hooks);
    /// ```
    pub fn cover_unmatched(mut self, cover: bool) -> Self {
        self.cover_unmatched = cover;
        self
    }

    /// When the store cannot be reached: `false` (default) answers 503 with `Retry-After` and
    /// does not run the handler; `true` runs the handler unprotected, and says so in a warning
    /// log, the `fail_open` metric and [`IdempotencyContext::is_protected`](crate::IdempotencyContext::is_protected).
    ///
    /// Only for a store that does not answer (a timeout, a lost connection, no Redlock quorum,
    /// replicas that did not confirm): a store that answers with a refusal (full, a script or
    /// permission error, a broken record) still gets its 503 or 500; and a request that has
    /// just been told its key is in flight never runs beside that execution, even if the store
    /// stops answering while it waits (503).
    ///
    /// ```
    /// let b = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory())
    ///     .fail_open(true);
    /// ```
    pub fn fail_open(mut self, open: bool) -> Self {
        self.fail_open = open;
        self
    }

    /// Checks the options and builds the layer.
    ///
    /// # Errors
    /// The option that cannot work and why: no methods, a zero limit or timeout, a retention
    /// shorter than the lease, a wait longer than the retention, ...
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let err = IdempotencyLayer::builder(Store::memory())
    ///     .global_keys()
    ///     .retention(Duration::from_secs(1))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("retention"));
    /// ```
    pub fn build(self) -> Result<IdempotencyLayer, ConfigError> {
        let invalid = |field, reason: String| Err(ConfigError::Invalid { field, reason });
        if self.methods.is_empty() {
            return invalid("methods", "no method is covered: list at least one".into());
        }
        if self.methods.contains(&Method::HEAD) {
            return invalid(
                "methods",
                "HEAD is safe (RFC 9110) and answered without a body: a record of it could not \
                 replay its length; leave it uncovered"
                    .into(),
            );
        }
        if self.body_limit == 0 {
            return invalid("body_limit", "must be above zero".into());
        }
        if !(1024..=MAX_CHUNK_SIZE).contains(&self.chunk_size) {
            return invalid(
                "chunk_size",
                format!(
                    "{} must be between 1024 and {MAX_CHUNK_SIZE} bytes",
                    self.chunk_size
                ),
            );
        }
        if self.read_timeout.is_zero() {
            return invalid("read_timeout", "must be above zero".into());
        }
        if self.stall_timeout.is_zero() {
            return invalid("stall_timeout", "must be above zero".into());
        }
        if self.retry_after.is_zero() {
            return invalid("retry_after", "must be above zero".into());
        }
        if self.principal.is_some() && self.global_keys {
            return invalid(
                "principal",
                "both a principal and global_keys(): keys are either scoped or global".into(),
            );
        }
        self.key.check()?;
        self.identity.check()?;
        if !self.previous.is_empty() {
            let Some(current) = &self.secret else {
                return invalid(
                    "previous_secrets",
                    "previous secrets without a current one: set .secret(...)".into(),
                );
            };
            if self.previous.iter().any(|p| p == current) {
                return invalid(
                    "previous_secrets",
                    "the current secret is listed as a previous one".into(),
                );
            }
        }
        let kind = self.key.kind();
        if self.principal.is_none() && !self.global_keys && kind == KeyKind::Request {
            return invalid(
                "principal",
                format!(
                    "the key comes from {}, {kind}: scope keys with .principal(...) (who sends \
                     the request) or declare them global with .global_keys()",
                    self.key.describe()
                ),
            );
        }
        if self.secret.is_none() && kind == KeyKind::Thing {
            return invalid(
                "secret",
                format!(
                    "the key comes from {}, {kind}: such keys (phone numbers, e-mails, order \
                     ids) are guessable, and without a server secret their names and records in \
                     the store can be recovered and forged: set .secret(...)",
                    self.key.describe()
                ),
            );
        }
        if self.secret.is_none() {
            tracing::warn!(
                "tower-idempotency: no server secret (IdempotencyLayerBuilder::secret): store names, \
                 fingerprints and record keys derive from the keys alone; guessable keys can be \
                 recovered from the store and their records opened or forged"
            );
        }
        let store = match self.lease {
            Some(config) => self
                .store
                .with_client(self.store.client().with_config(config)?),
            None => self.store,
        };
        let streaming = store.client().supports_streaming();
        let (default_limit, max_limit) = if streaming {
            (64 << 20, MAX_RECORD_LIMIT)
        } else {
            // Redlock carries a record to every master within its command timeout: the body
            // and a head (status, headers, trailers) must fit what the store says it carries.
            let carried = (store.client().max_record_len()).saturating_sub(RECORD_HEAD_ROOM);
            ((1 << 20).min(carried), MAX_WHOLE_RECORD_LIMIT.min(carried))
        };
        // The in-memory store makes room for a record by evicting the oldest outcomes, part by
        // part for a streamed one, before it knows whether the record will fit or be kept: a
        // record may take at most a quarter of its bytes.
        let memory_cap = (store.client().memory_limits()).map(|l| (l.max_bytes() / 4).max(1));
        let record_limit = (self.record_limit)
            .unwrap_or_else(|| memory_cap.map_or(default_limit, |cap| cap.min(default_limit)));
        if let Some(cap) = memory_cap
            && record_limit > cap
        {
            return invalid(
                "record_limit",
                format!(
                    "{record_limit} is over a quarter of the in-memory store's bytes ({cap}): \
                     making room for a record that large, part by part as it streams, would \
                     evict most stored outcomes, also for one that ends up not kept; raise \
                     MemoryLimits or lower the limit"
                ),
            );
        }
        if record_limit == 0 || record_limit > max_limit {
            return invalid(
                "record_limit",
                format!(
                    "{record_limit} must be between 1 and {max_limit} bytes on {}{}",
                    store.describe(),
                    if streaming {
                        ""
                    } else {
                        " (what it carries to every master within its command timeout: raise \
                         the lock's op_timeout for more)"
                    }
                ),
            );
        }
        // The lock crate checks the retention against the lease.
        store.client().once("probe")?.retention(self.retention)?;
        if self.completion_grace > MAX_COMPLETION_GRACE {
            return invalid(
                "completion_grace",
                format!(
                    "{:?} is over {MAX_COMPLETION_GRACE:?}: a longer wait is OnConflict::Wait",
                    self.completion_grace
                ),
            );
        }
        if let OnConflict::Wait(wait) = self.on_conflict {
            if wait.is_zero() {
                return invalid("on_conflict", "a zero wait: use OnConflict::Reject".into());
            }
            if wait >= self.retention {
                return invalid(
                    "on_conflict",
                    format!(
                        "waiting {wait:?} is not shorter than the retention {:?}",
                        self.retention
                    ),
                );
            }
        }
        if self.same_transaction && !store.client().supports_transactions() {
            return invalid(
                "same_transaction",
                format!(
                    "{} cannot hold a transaction for the handler: use the Postgres store",
                    store.describe()
                ),
            );
        }
        let seal = store.client().memory_limits().is_none();
        let things = store.client().with_config(
            (store.client().config().to_builder())
                .fence_ttl(self.retention)
                .build()?,
        )?;
        let html: Option<Arc<RenderHtml>> = match (self.html, &self.rendering) {
            (HtmlPages::Custom(render), _) => Some(render),
            (HtmlPages::Default, Rendering::Problem(_)) => Some(Arc::new(default_page)),
            _ => None,
        };
        Ok(IdempotencyLayer {
            config: Arc::new(Config {
                seal,
                store,
                things,
                keys: Keys::new(self.secret.as_deref()),
                previous: (self.previous.iter())
                    .map(|secret| Keys::new(Some(secret)))
                    .collect(),
                key: self.key,
                kind,
                identity: self.identity,
                key_required: self.key_required,
                principal: self.principal,
                methods: self.methods,
                fingerprint_headers: self.fingerprint_headers,
                body_limit: self.body_limit,
                read_timeout: self.read_timeout,
                stall_timeout: self.stall_timeout,
                record_limit,
                chunk_size: self.chunk_size,
                retention: self.retention,
                on_conflict: self.on_conflict,
                completion_grace: self.completion_grace,
                retry_after: self.retry_after,
                default_outcome: self.default_outcome,
                unknown_outcome: self.unknown_outcome,
                cancel_on_disconnect: self.cancel_on_disconnect,
                same_transaction: self.same_transaction,
                replay_headers: self.replay_headers,
                fail_open: self.fail_open,
                cover_unmatched: self.cover_unmatched,
                rendering: self.rendering,
                html,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> IdempotencyLayerBuilder {
        IdempotencyLayer::builder(Store::memory()).global_keys()
    }

    /// `lease` after `lock_config` changes the lease of that configuration, not of the store's
    /// (it threw the rest of the configuration away).
    #[test]
    fn a_lease_after_a_lock_config_keeps_the_rest_of_it() {
        let timing = distlock::LockConfig::builder()
            .op_timeout(Duration::from_millis(1500))
            .build()
            .unwrap();
        let layer = base()
            .lock_config(timing)
            .lease(Duration::from_secs(30))
            .unwrap()
            .build()
            .unwrap();
        let config = layer.config().store.client().config();
        assert_eq!(config.lease(), Duration::from_secs(30));
        assert_eq!(config.op_timeout(), Duration::from_millis(1500));
    }

    #[test]
    fn refuses_options_that_cannot_work() {
        let cases: Vec<(IdempotencyLayerBuilder, &str)> = vec![
            (base().methods([]), "methods"),
            (base().methods([Method::POST, Method::HEAD]), "methods"),
            (base().body_limit(0), "body_limit"),
            (base().record_limit(0), "record_limit"),
            (base().record_limit(MAX_RECORD_LIMIT + 1), "record_limit"),
            // Over a quarter of the in-memory store's bytes (the default store: 64 MiB).
            (base().record_limit((16 << 20) + 1), "record_limit"),
            (base().chunk_size(100), "chunk_size"),
            (base().chunk_size(MAX_CHUNK_SIZE + 1), "chunk_size"),
            (base().read_timeout(Duration::ZERO), "read_timeout"),
            (base().stall_timeout(Duration::ZERO), "stall_timeout"),
            (base().retry_after(Duration::ZERO), "retry_after"),
            (base().retention(Duration::from_secs(1)), "retention"),
            (
                base().on_conflict(OnConflict::Wait(Duration::ZERO)),
                "on_conflict",
            ),
            (
                base()
                    .retention(Duration::from_secs(60))
                    .on_conflict(OnConflict::Wait(Duration::from_secs(60))),
                "on_conflict",
            ),
        ];
        for (builder, field) in cases {
            match builder.build() {
                Err(ConfigError::Invalid { field: f, reason }) => assert_eq!(f, field, "{reason}"),
                other => panic!("{field}: {other:?}"),
            }
        }
        // On the in-memory store the default record limit is a quarter of its bytes.
        let small = Store::memory_with(distlock::MemoryLimits::new(10, 4096).unwrap());
        let layer = IdempotencyLayer::builder(small).global_keys();
        assert_eq!(layer.build().unwrap().config().record_limit, 1024);
        assert!(base().record_limit(16 << 20).build().is_ok());
        // Scoping: a client-chosen key needs a principal or global_keys(), not both.
        let bare = || IdempotencyLayer::builder(Store::memory());
        for (builder, field) in [
            (bare(), "principal"),
            (
                bare()
                    .global_keys()
                    .principal(|_: &http::request::Parts| None),
                "principal",
            ),
            // A key that names a thing is guessable and needs a secret: from the body, and as
            // much from the path or the query (a phone number in `/users/{phone}`, an order id).
            (bare().key(key::json("/phone").unwrap()), "secret"),
            (bare().key(key::form("email")), "secret"),
            (bare().key(key::path("phone")), "secret"),
            (bare().key(key::query("order")), "secret"),
            (
                bare().key(key::KeySourceExt::or(
                    key::header(),
                    key::KeySourceExt::per_request(key::path("id")),
                )),
                "principal",
            ),
            // A header that carries a thing's name needs the secret too.
            (
                bare().key(key::KeySourceExt::names_a_thing(key::header())),
                "secret",
            ),
            // A body key the client generates is scoped like the header.
            (
                bare().key(key::KeySourceExt::per_request(key::json("/k").unwrap())),
                "principal",
            ),
            // Two kinds in one source: which semantics applies would depend on the request.
            (
                bare()
                    .global_keys()
                    .key(key::KeySourceExt::or(key::header(), key::path("id"))),
                "key",
            ),
            (
                base().identity(Identity::JsonFields(vec!["amount".into()])),
                "identity",
            ),
        ] {
            match builder.build() {
                Err(ConfigError::Invalid { field: f, reason }) => assert_eq!(f, field, "{reason}"),
                other => panic!("{field}: {other:?}"),
            }
        }
        assert!(
            bare()
                .key(key::json("/phone").unwrap())
                .secret([1u8; 16])
                .unwrap()
                .build()
                .is_ok()
        );
        assert!(
            bare()
                .principal(|_: &http::request::Parts| None)
                .build()
                .is_ok()
        );
        // A header key (one the client makes up) builds without one.
        assert!(bare().global_keys().key(key::header()).build().is_ok());
        assert!(bare().secret(b"short").is_err());
        assert!(base().lease(Duration::from_millis(1)).is_err());
        assert!(base().fingerprint_headers(["bad header"]).is_err());
    }

    /// On Redlock a record travels whole to every master within the command timeout: a record
    /// limit over what the store carries is refused when the layer is built (it was stored
    /// and then reported lost, and every later begin timed out).
    #[tokio::test]
    async fn a_record_limit_over_what_redlock_carries_is_refused() {
        let redlock = |op_timeout| {
            let config = distlock::LockConfig::builder()
                .op_timeout(op_timeout)
                .build()
                .unwrap();
            let client = distlock::LockClient::builder()
                .config(config)
                .connect_redlock(&[
                    "redis://127.0.0.1:1/",
                    "redis://127.0.0.1:2/",
                    "redis://127.0.0.1:3/",
                ])
                .unwrap();
            Store::from_client(client)
        };
        let store = redlock(Duration::from_secs(2));
        let carried = store.client().max_record_len();
        let built = |limit| {
            IdempotencyLayer::builder(store.clone())
                .global_keys()
                .record_limit(limit)
                .build()
        };
        match built(carried) {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "record_limit");
                assert!(reason.contains("op_timeout"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(built(carried - RECORD_HEAD_ROOM).is_ok());
        // The default fits whatever the store carries.
        let tight = redlock(Duration::from_millis(400));
        let layer = IdempotencyLayer::builder(tight.clone())
            .global_keys()
            .build()
            .unwrap();
        assert!(layer.config().record_limit + RECORD_HEAD_ROOM <= tight.client().max_record_len());
    }

    /// On a 32-bit target the record limit was 0 (`16 << 30` in a `usize`): `build()` always
    /// failed with "between 1 and 0 bytes".
    #[test]
    fn the_record_limit_fits_every_address_space() {
        assert_eq!(record_cap(u64::MAX), 16 << 30);
        assert_eq!(record_cap(u64::from(u32::MAX)), u64::from(u32::MAX / 2));
        assert!(
            record_cap(u64::from(u32::MAX)) >= 64 << 20,
            "the default fits"
        );
        assert_eq!(MAX_RECORD_LIMIT as u64, record_cap(usize::MAX as u64));
    }

    #[test]
    fn replay_header_policies() {
        let deny = ReplayHeaders::default_deny()
            .and_deny(["x-secret"])
            .unwrap();
        for (name, kept) in [
            ("content-type", true),
            ("set-cookie", false),
            ("date", false),
            ("x-secret", false),
            ("connection", false),
        ] {
            assert_eq!(deny.keeps(&HeaderName::from_static(name)), kept, "{name}");
        }
        let allow = ReplayHeaders::allow(["content-type", "set-cookie", "location"]).unwrap();
        for (name, kept) in [
            ("content-type", true),
            ("location", true),
            ("set-cookie", false),
            ("x-other", false),
        ] {
            assert_eq!(allow.keeps(&HeaderName::from_static(name)), kept, "{name}");
        }
        let narrowed = allow.and_deny(["location"]).unwrap();
        assert!(!narrowed.keeps(&header::LOCATION));
    }
}
