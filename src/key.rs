//! Where the client's idempotency key comes from.
//!
//! | source | for | example |
//! |---|---|---|
//! | [`header()`] | APIs following the IETF draft or Stripe | `Idempotency-Key: "8e03978e-40d5"` |
//! | [`json`] | signup: one account per phone number; webhooks: one delivery per event id | `json("/phone")` |
//! | [`form`] | HTML form posts | `form("email")` |
//! | [`path`] | one action per resource | `path("order_id")` on `/orders/{order_id}/pay` |
//! | [`query`] | legacy callbacks | `query("txn")` |
//! | a closure | anything else | `\|parts, body\| Ok(Some(...))` |
//!
//! Sources combine with [`KeySourceExt::or`]: `header().or(json("/id"))` takes the header when
//! present and the event id otherwise.
//!
//! The raw key never reaches the store: the store key is an HKDF-SHA256 of the scope and the
//! key under the server secret (see
//! [`secret`](crate::IdempotencyLayerBuilder::secret)). A key that names a thing (a body field,
//! a path or query parameter, a closure's) is guessable: the layer refuses it without a secret.

use std::fmt;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName};
use http::request::Parts;

use crate::{ConfigError, Rejection};

/// The longest key accepted, in characters (the IETF draft's limit for the header).
pub const MAX_KEY_LEN: usize = 255;

/// The header of the IETF draft "The Idempotency-Key HTTP Header Field".
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Extracts the client's key from a request.
///
/// Return `Ok(None)` when this source has no key for the request (the layer answers 400 when a
/// key is required), or a [`Rejection`] when the key is there but unusable. Closures with the
/// same signature are key sources too.
///
/// ```
/// use tower_idempotency::{KeySource, Rejection};
///
/// let tenant_order = |parts: &http::request::Parts, _body: &bytes::Bytes| -> Result<Option<String>, Rejection> {
///     Ok(parts.headers.get("x-order-ref").and_then(|v| v.to_str().ok()).map(String::from))
/// };
/// let req = http::Request::builder().header("x-order-ref", "A-17").body(()).unwrap();
/// let (parts, ()) = req.into_parts();
/// assert_eq!(tenant_order.extract(&parts, &bytes::Bytes::new()).unwrap().as_deref(), Some("A-17"));
/// ```
pub trait KeySource: Send + Sync + 'static {
    /// The key, or `None` if this source has none for the request.
    ///
    /// # Errors
    /// A [`Rejection`] (400, 415) when the key is present but unusable or the body is malformed.
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection>;

    /// Where the key is looked for, for the "missing key" message.
    fn describe(&self) -> String {
        "the request".to_owned()
    }

    /// Whether the key may come from the body. When it cannot (a header, the path, the query),
    /// the layer looks for the key before reading the body, so a keyless request is refused at
    /// once rather than after its upload. Closures are assumed to read the body.
    fn needs_body(&self) -> bool {
        true
    }

    /// Whether clients choose the key freely (a header), as opposed to a key that names a thing
    /// (a phone number, an event id, an order id). A layer with a client-chosen key needs a
    /// principal or an explicit [`global_keys`](crate::IdempotencyLayerBuilder::global_keys).
    /// Closures are assumed to be client-chosen.
    fn client_chosen(&self) -> bool {
        true
    }

    /// Whether whoever reads the store could guess the key: a phone number, an e-mail, an
    /// order id (a body field, a path or query parameter), as opposed to the random key a client
    /// sends in a header. A layer whose key may be guessable needs a server secret
    /// ([`secret`](crate::IdempotencyLayerBuilder::secret)), without which names and records
    /// in the store derive from the key alone. Closures and other sources are assumed
    /// guessable.
    fn guessable(&self) -> bool {
        true
    }

    /// Whether the key may come from a path parameter: the layer then collects the parameters
    /// the router matched (see [`path`]).
    fn uses_path_params(&self) -> bool {
        false
    }
}

impl<F> KeySource for F
where
    F: Fn(&Parts, &Bytes) -> Result<Option<String>, Rejection> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        self(parts, body)
    }
}

/// A boxed source, for choosing the source at run time.
///
/// ```
/// use tower_idempotency::{KeySource, key};
/// let from_config: Box<dyn KeySource> = if true { Box::new(key::header()) } else { Box::new(key::query("k")) };
/// let layer = tower_idempotency::IdempotencyLayer::builder(tower_idempotency::Store::memory()).key(from_config);
/// ```
impl KeySource for Box<dyn KeySource> {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        (**self).extract(parts, body)
    }

    fn describe(&self) -> String {
        (**self).describe()
    }

    fn needs_body(&self) -> bool {
        (**self).needs_body()
    }

    fn client_chosen(&self) -> bool {
        (**self).client_chosen()
    }

    fn guessable(&self) -> bool {
        (**self).guessable()
    }

    fn uses_path_params(&self) -> bool {
        (**self).uses_path_params()
    }
}

/// Combinators for key sources.
pub trait KeySourceExt: KeySource + Sized {
    /// Tries `self`, then `other` when `self` has no key or does not apply to the request (a
    /// JSON field on a form post): `json("/id").or(header())` takes the header of a form post.
    ///
    /// ```
    /// use tower_idempotency::key::{header, json, KeySourceExt};
    /// let source = header().or(json("/id").unwrap());
    /// ```
    fn or<B: KeySource>(self, other: B) -> Or<Self, B> {
        Or(self, other)
    }
}

impl<T: KeySource> KeySourceExt for T {}

/// `a` or else `b`: see [`KeySourceExt::or`].
#[derive(Debug, Clone)]
pub struct Or<A, B>(A, B);

impl<A: KeySource, B: KeySource> KeySource for Or<A, B> {
    /// The first source's key; when it has none, or does not apply to this request (a JSON
    /// field of a form post: 415), the second's. A key that is there but malformed is an error
    /// at once. When neither applies, the first one's rejection; when one applies and has no
    /// key, no key.
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        let first = match self.0.extract(parts, body) {
            Ok(Some(key)) => return Ok(Some(key)),
            Ok(None) => None,
            Err(rejection) if rejection.not_applicable() => Some(rejection),
            Err(rejection) => return Err(rejection),
        };
        match (self.1.extract(parts, body), first) {
            (Err(second), Some(first)) if second.not_applicable() => Err(first),
            (Err(second), None) if second.not_applicable() => Ok(None),
            (other, _) => other,
        }
    }

    fn describe(&self) -> String {
        format!("{} or {}", self.0.describe(), self.1.describe())
    }

    fn needs_body(&self) -> bool {
        self.0.needs_body() || self.1.needs_body()
    }

    fn client_chosen(&self) -> bool {
        self.0.client_chosen() || self.1.client_chosen()
    }

    fn guessable(&self) -> bool {
        self.0.guessable() || self.1.guessable()
    }

    fn uses_path_params(&self) -> bool {
        self.0.uses_path_params() || self.1.uses_path_params()
    }
}

/// Checks a key taken from the body, path or query: 1 to 255 characters, no control characters.
fn check_key(key: String, from: &dyn fmt::Display) -> Result<String, Rejection> {
    if key.is_empty() {
        return Err(Rejection::InvalidKey {
            reason: format!("The idempotency key in {from} is empty."),
        });
    }
    if key.chars().count() > MAX_KEY_LEN {
        return Err(Rejection::InvalidKey {
            reason: format!(
                "The idempotency key in {from} is longer than {MAX_KEY_LEN} characters."
            ),
        });
    }
    if key.chars().any(char::is_control) {
        return Err(Rejection::InvalidKey {
            reason: format!("The idempotency key in {from} contains control characters."),
        });
    }
    Ok(key)
}

/// The key from a header: see [`header()`].
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: HeaderName,
}

/// The `Idempotency-Key` header. The value may be a Structured Fields string as in the IETF
/// draft (`"abc"`, with `\"` and `\\` escapes) or a bare token as Stripe sends it. The key must be
/// 1 to 255 visible ASCII characters; several `Idempotency-Key` headers are refused.
///
/// ```
/// use tower_idempotency::KeySource;
/// let req = http::Request::builder().header("idempotency-key", "\"8e03978e\"").body(()).unwrap();
/// let (parts, ()) = req.into_parts();
/// let key = tower_idempotency::key::header().extract(&parts, &bytes::Bytes::new()).unwrap();
/// assert_eq!(key.as_deref(), Some("8e03978e"));
/// ```
pub fn header() -> HeaderKey {
    HeaderKey {
        name: IDEMPOTENCY_KEY,
    }
}

/// Another header, with the same rules as [`header()`]. Its keys count as ones the client
/// makes up ([`KeySource::guessable`] is false): a header that carries a thing's name (an
/// order id, an e-mail) needs the server secret set all the same.
///
/// # Errors
/// If `name` is not a valid header name.
///
/// ```
/// assert!(tower_idempotency::key::header_named("x-request-id").is_ok());
/// assert!(tower_idempotency::key::header_named("bad name").is_err());
/// ```
pub fn header_named(name: &str) -> Result<HeaderKey, ConfigError> {
    let name = HeaderName::try_from(name).map_err(|e| ConfigError::Invalid {
        field: "key header",
        reason: format!("{name:?}: {e}"),
    })?;
    Ok(HeaderKey { name })
}

impl KeySource for HeaderKey {
    fn extract(&self, parts: &Parts, _body: &Bytes) -> Result<Option<String>, Rejection> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(Rejection::DuplicateKey);
        }
        let invalid = |reason: &str| Rejection::InvalidKey {
            reason: format!("The {} header {reason}.", self.name),
        };
        let raw = value.as_bytes();
        if raw.iter().any(|b| !(0x20..=0x7e).contains(b)) {
            return Err(invalid("must contain only visible ASCII characters"));
        }
        let raw = std::str::from_utf8(raw).expect("checked ASCII");
        let key = if let Some(quoted) = raw.strip_prefix('"') {
            unquote(quoted).ok_or_else(|| invalid("is not a valid quoted string"))?
        } else {
            if raw.contains(' ') {
                return Err(invalid(
                    "must contain only visible ASCII characters (quote it to include spaces)",
                ));
            }
            raw.to_owned()
        };
        if key.is_empty() {
            return Err(invalid("is empty"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(invalid(&format!("is longer than {MAX_KEY_LEN} characters")));
        }
        Ok(Some(key))
    }

    fn describe(&self) -> String {
        format!("the {} header", self.name)
    }

    fn needs_body(&self) -> bool {
        false
    }

    /// A key a client makes up (a UUID, as the IETF draft asks), not a thing anyone can name.
    fn guessable(&self) -> bool {
        false
    }
}

/// The inside of a Structured Fields string after its opening quote; `None` if malformed.
fn unquote(rest: &str) -> Option<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                c @ ('"' | '\\') => out.push(c),
                _ => return None,
            },
            '"' => return chars.next().is_none().then_some(out),
            c => out.push(c),
        }
    }
    None
}

fn content_type_is(parts: &Parts, check: impl Fn(&str) -> bool) -> bool {
    parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .is_some_and(|essence| check(&essence))
}

/// The key from a JSON body: see [`json`].
#[derive(Debug, Clone)]
pub struct JsonKey {
    pointer: String,
    /// Its reference tokens, unescaped.
    tokens: Vec<String>,
}

/// A string in a JSON body, by JSON pointer (RFC 6901): `/phone`, `/data/object/id`. The
/// request must be `application/json` (or `+json`), else 415; malformed JSON is 400; a missing
/// field is a missing key; `null`, numbers, booleans, arrays and objects are refused (400), and
/// so is a member on the key's way given twice (`{"phone":"A","phone":"B"}`), as a repeated form
/// field or query parameter is: parsers differ on which one they keep.
///
/// # Errors
/// If `pointer` is not a JSON pointer (it must start with `/`).
///
/// ```
/// use tower_idempotency::KeySource;
/// let source = tower_idempotency::key::json("/phone")?;
/// let req = http::Request::builder().header("content-type", "application/json").body(()).unwrap();
/// let (parts, ()) = req.into_parts();
/// let body = bytes::Bytes::from_static(br#"{"phone":"+15550100","name":"Ada"}"#);
/// assert_eq!(source.extract(&parts, &body).unwrap().as_deref(), Some("+15550100"));
/// # Ok::<(), tower_idempotency::ConfigError>(())
/// ```
pub fn json(pointer: &str) -> Result<JsonKey, ConfigError> {
    if !pointer.starts_with('/') {
        return Err(ConfigError::Invalid {
            field: "json pointer",
            reason: format!("{pointer:?} must start with '/', e.g. \"/id\""),
        });
    }
    Ok(JsonKey {
        pointer: pointer.to_owned(),
        tokens: pointer_tokens(pointer),
    })
}

impl KeySource for JsonKey {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        if !content_type_is(parts, |t| t == "application/json" || t.ends_with("+json")) {
            return Err(Rejection::UnsupportedMediaType {
                expected: "application/json",
            });
        }
        let repeated = std::cell::Cell::new(false);
        let mut reader = serde_json::Deserializer::from_slice(body);
        let found = serde::de::DeserializeSeed::deserialize(
            Path {
                tokens: &self.tokens,
                repeated: &repeated,
            },
            &mut reader,
        )
        .and_then(|found| reader.end().map(|()| found));
        let from = format!("the JSON field {}", self.pointer);
        let found = match found {
            Ok(found) => found,
            Err(_) if repeated.get() => {
                // As a form field or query parameter given twice: which one is the key would
                // depend on the parser (serde_json keeps the last, others the first).
                return Err(Rejection::InvalidKey {
                    reason: format!("The JSON body has {from}, or an object on its way, twice."),
                });
            }
            Err(e) => {
                return Err(Rejection::MalformedBody {
                    reason: format!("The JSON body does not parse: {e}."),
                });
            }
        };
        match found.as_ref() {
            None => Ok(None),
            Some(serde_json::Value::String(s)) => check_key(s.clone(), &from).map(Some),
            Some(other) => Err(Rejection::InvalidKey {
                reason: format!(
                    "The idempotency key in {from} must be a JSON string, not {}.",
                    match other {
                        serde_json::Value::Null => "null",
                        serde_json::Value::Bool(_) => "a boolean",
                        serde_json::Value::Number(_) => "a number",
                        serde_json::Value::Array(_) => "an array",
                        _ => "an object",
                    }
                ),
            }),
        }
    }

    fn describe(&self) -> String {
        format!("the JSON field {}", self.pointer)
    }

    fn client_chosen(&self) -> bool {
        false
    }
}

/// A JSON pointer's reference tokens (RFC 6901: `~1` is `/`, `~0` is `~`).
fn pointer_tokens(pointer: &str) -> Vec<String> {
    pointer
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// An array index as a JSON pointer token names one: digits, no leading zero.
fn pointer_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() > 1) {
        return None;
    }
    token.parse().ok()
}

/// Reads a JSON document, keeping the value at `tokens` (what `Value::pointer` would give) and
/// refusing a member on the way given twice (`repeated` set, then an error). Everything off
/// the way is read as a `Value` and dropped, so that the document is checked as before (its
/// nesting limit included).
struct Path<'a> {
    tokens: &'a [String],
    repeated: &'a std::cell::Cell<bool>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Path<'_> {
    type Value = Option<serde_json::Value>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        if self.tokens.is_empty() {
            return serde::Deserialize::deserialize(d).map(Some);
        }
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Path<'_> {
    type Value = Option<serde_json::Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (token, rest) = (&self.tokens[0], &self.tokens[1..]);
        let mut found = None;
        let mut seen = false;
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if name == token.as_str() {
                if seen {
                    self.repeated.set(true);
                    return Err(serde::de::Error::custom(format_args!(
                        "member {token:?} given twice"
                    )));
                }
                seen = true;
                found = map.next_value_seed(Path {
                    tokens: rest,
                    repeated: self.repeated,
                })?;
            } else {
                map.next_value::<serde_json::Value>()?;
            }
        }
        Ok(found)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let index = pointer_index(&self.tokens[0]);
        let mut found = None;
        let mut at = 0;
        loop {
            if Some(at) == index {
                let seed = Path {
                    tokens: &self.tokens[1..],
                    repeated: self.repeated,
                };
                match seq.next_element_seed(seed)? {
                    Some(value) => found = value,
                    None => break,
                }
            } else if seq.next_element::<serde_json::Value>()?.is_none() {
                break;
            }
            at += 1;
        }
        Ok(found)
    }

    // A scalar has nothing under it: the pointer does not resolve.
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// The key from a form body: see [`form`].
#[derive(Debug, Clone)]
pub struct FormKey {
    field: String,
}

/// A field of an `application/x-www-form-urlencoded` body (415 for other content types).
///
/// ```
/// use tower_idempotency::KeySource;
/// let req = http::Request::builder()
///     .header("content-type", "application/x-www-form-urlencoded")
///     .body(()).unwrap();
/// let (parts, ()) = req.into_parts();
/// let body = bytes::Bytes::from_static(b"email=ada%40example.com&name=Ada");
/// let key = tower_idempotency::key::form("email").extract(&parts, &body).unwrap();
/// assert_eq!(key.as_deref(), Some("ada@example.com"));
/// ```
pub fn form(field: &str) -> FormKey {
    FormKey {
        field: field.to_owned(),
    }
}

impl KeySource for FormKey {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        if !content_type_is(parts, |t| t == "application/x-www-form-urlencoded") {
            return Err(Rejection::UnsupportedMediaType {
                expected: "application/x-www-form-urlencoded",
            });
        }
        lookup_pair(body, &self.field, &self.describe())
    }

    fn describe(&self) -> String {
        format!("the form field {:?}", self.field)
    }

    fn client_chosen(&self) -> bool {
        false
    }
}

fn lookup_pair(input: &[u8], name: &str, from: &str) -> Result<Option<String>, Rejection> {
    let mut found = form_urlencoded::parse(input).filter(|(k, _)| k == name);
    let Some((_, value)) = found.next() else {
        return Ok(None);
    };
    if found.next().is_some() {
        return Err(Rejection::InvalidKey {
            reason: format!("{from} appears more than once."),
        });
    }
    check_key(value.into_owned(), &from).map(Some)
}

/// The key from the query string: see [`query`].
#[derive(Debug, Clone)]
pub struct QueryKey {
    param: String,
}

/// A query parameter.
///
/// ```
/// use tower_idempotency::KeySource;
/// let req = http::Request::builder().uri("/callback?txn=T-9&x=1").body(()).unwrap();
/// let (parts, ()) = req.into_parts();
/// let key = tower_idempotency::key::query("txn").extract(&parts, &bytes::Bytes::new()).unwrap();
/// assert_eq!(key.as_deref(), Some("T-9"));
/// ```
pub fn query(param: &str) -> QueryKey {
    QueryKey {
        param: param.to_owned(),
    }
}

impl KeySource for QueryKey {
    fn extract(&self, parts: &Parts, _body: &Bytes) -> Result<Option<String>, Rejection> {
        let query = parts.uri.query().unwrap_or("");
        lookup_pair(query.as_bytes(), &self.param, &self.describe())
    }

    fn describe(&self) -> String {
        format!("the query parameter {:?}", self.param)
    }

    fn needs_body(&self) -> bool {
        false
    }

    fn client_chosen(&self) -> bool {
        false
    }
}

/// The key from a path parameter: see [`path`].
#[derive(Debug, Clone)]
pub struct PathKey {
    param: String,
}

/// A parameter of the matched route, e.g. `order_id` in `/orders/{order_id}/pay`,
/// percent-decoded as axum's `Path` decodes it. Under axum the layer takes the parameters the
/// router matched (so nested routers work); with other routers it matches the path against a
/// [`RouteTemplate`] extension.
///
/// ```
/// use tower_idempotency::KeySource;
/// let mut req = http::Request::builder().uri("/orders/42/pay").body(()).unwrap();
/// req.extensions_mut().insert(tower_idempotency::key::RouteTemplate("/orders/{order_id}/pay".into()));
/// let (parts, ()) = req.into_parts();
/// let key = tower_idempotency::key::path("order_id").extract(&parts, &bytes::Bytes::new()).unwrap();
/// assert_eq!(key.as_deref(), Some("42"));
/// ```
pub fn path(param: &str) -> PathKey {
    PathKey {
        param: param.to_owned(),
    }
}

/// The route template of a request (`/orders/{order_id}/pay`), for routers other than axum's.
/// The layer uses it to scope keys per route and to find path parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTemplate(pub String);

/// The route template: axum's `MatchedPath`, else a [`RouteTemplate`] extension.
pub(crate) fn route_template(parts: &Parts) -> Option<&str> {
    template_in(&parts.extensions)
}

/// [`route_template`] from a request's extensions.
pub(crate) fn template_in(extensions: &http::Extensions) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = extensions.get::<axum::extract::MatchedPath>() {
        return Some(matched.as_str());
    }
    extensions.get::<RouteTemplate>().map(|t| t.0.as_str())
}

/// The path and query the client sent: axum's `OriginalUri` (a nested router sees the path
/// without its prefix, which may hold parameters of its own), else the request's.
pub(crate) fn original_target(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    #[cfg(not(feature = "axum"))]
    let uri = &parts.uri;
    target(uri)
}

/// The path and query of `uri` (the path alone when it has no query).
pub(crate) fn target(uri: &http::Uri) -> &str {
    uri.path_and_query().map_or(uri.path(), |pq| pq.as_str())
}

/// The path parameters the router matched, percent-decoded (collected by the layer from axum).
#[derive(Debug, Clone)]
pub(crate) enum PathParams {
    Matched(Vec<(String, String)>),
    /// A parameter was not valid UTF-8 once percent-decoded.
    InvalidUtf8,
}

/// Collects the parameters axum matched (for `Router::nest`ed routes too: the parameters, not
/// the path, which the nested router sees without its prefix).
#[cfg(feature = "axum")]
pub(crate) fn collect_path_params(parts: &mut Parts) {
    use axum::extract::{FromRequestParts, RawPathParams, rejection::RawPathParamsRejection};
    use futures_util::FutureExt;
    if parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .is_none()
    {
        return;
    }
    let params = match RawPathParams::from_request_parts(parts, &()).now_or_never() {
        Some(Ok(params)) => PathParams::Matched(
            params
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        ),
        Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => PathParams::InvalidUtf8,
        _ => return,
    };
    parts.extensions.insert(params);
}

fn decode_segment(segment: &str) -> Option<String> {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

impl KeySource for PathKey {
    fn extract(&self, parts: &Parts, _body: &Bytes) -> Result<Option<String>, Rejection> {
        let invalid_utf8 = || Rejection::InvalidKey {
            reason: format!(
                "{} is not valid UTF-8 once percent-decoded.",
                self.describe()
            ),
        };
        match parts.extensions.get::<PathParams>() {
            Some(PathParams::Matched(params)) => {
                return match params.iter().find(|(name, _)| *name == self.param) {
                    Some((_, value)) => check_key(value.clone(), &self.describe()).map(Some),
                    None => Ok(None),
                };
            }
            Some(PathParams::InvalidUtf8) => return Err(invalid_utf8()),
            None => {}
        }
        let Some(template) = route_template(parts) else {
            return Ok(None);
        };
        let mut actual = parts.uri.path().split('/');
        for segment in template.split('/') {
            let value = actual.next();
            let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) else {
                continue;
            };
            if let Some(rest_name) = name.strip_prefix('*') {
                if rest_name == self.param {
                    let rest: Vec<&str> = value.into_iter().chain(actual).collect();
                    let rest = decode_segment(&rest.join("/")).ok_or_else(invalid_utf8)?;
                    return check_key(rest, &self.describe()).map(Some);
                }
                return Ok(None);
            }
            if name == self.param {
                return match value {
                    Some(v) => {
                        let v = decode_segment(v).ok_or_else(invalid_utf8)?;
                        check_key(v, &self.describe()).map(Some)
                    }
                    None => Ok(None),
                };
            }
        }
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("the path parameter {:?}", self.param)
    }

    fn needs_body(&self) -> bool {
        false
    }

    fn client_chosen(&self) -> bool {
        false
    }

    fn uses_path_params(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_at(pointer: &str, body: &'static str) -> Result<Option<String>, Rejection> {
        let req = http::Request::builder()
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        json(pointer)
            .unwrap()
            .extract(&parts, &Bytes::from_static(body.as_bytes()))
    }

    /// A member on the key's way given twice is refused, as a repeated form field or query
    /// parameter is (serde_json kept the last, `{"phone":"A","phone":"B"}` was keyed on B
    /// while a backend keeping the first acted on A); repeats elsewhere are not the key's.
    #[test]
    fn a_json_member_on_the_keys_way_given_twice_is_refused() {
        for (pointer, body) in [
            ("/phone", r#"{"phone":"A","phone":"B"}"#),
            ("/c/phone", r#"{"c":{"phone":"A"},"c":{"phone":"B"}}"#),
            ("/c/phone", r#"{"c":{"phone":"A","phone":"B"}}"#),
            ("/l/1/id", r#"{"l":[{"id":"x"},{"id":"A","id":"B"}]}"#),
        ] {
            match key_at(pointer, body) {
                Err(Rejection::InvalidKey { reason }) => {
                    assert!(reason.contains("twice"), "{reason}")
                }
                other => panic!("{pointer} in {body}: {other:?}"),
            }
        }
        for (pointer, body, key) in [
            ("/phone", r#"{"x":1,"x":2,"phone":"A"}"#, Some("A")),
            (
                "/c/phone",
                r#"{"c":{"phone":"A","n":1,"n":2},"d":[1,1]}"#,
                Some("A"),
            ),
            (
                "/l/1/id",
                r#"{"l":[{"id":"x","id":"y"},{"id":"A"}]}"#,
                Some("A"),
            ),
            ("/a~1b/m~0n", r#"{"a/b":{"m~n":"A"}}"#, Some("A")),
            ("/l/01", r#"{"l":["x","A"]}"#, None),
            ("/l/2", r#"{"l":["x","A"]}"#, None),
            ("/s/x", r#"{"s":"text"}"#, None),
            ("/phone", r#"[{"phone":"A"}]"#, None),
        ] {
            assert_eq!(
                key_at(pointer, body).unwrap().as_deref(),
                key,
                "{pointer} in {body}"
            );
        }
        // Still the whole document is read: garbage after the key's value is refused.
        assert!(matches!(
            key_at("/phone", r#"{"phone":"A"} x"#),
            Err(Rejection::MalformedBody { .. })
        ));
        assert!(matches!(
            key_at("/phone", r#"{"phone":"A","x":[1,}"#),
            Err(Rejection::MalformedBody { .. })
        ));
    }

    fn parts(req: http::request::Builder) -> Parts {
        req.body(()).unwrap().into_parts().0
    }

    fn header_key(values: &[&[u8]]) -> Result<Option<String>, Rejection> {
        let mut b = http::Request::builder();
        for v in values {
            b = b.header("idempotency-key", http::HeaderValue::from_bytes(v).unwrap());
        }
        header().extract(&parts(b), &Bytes::new())
    }

    #[test]
    fn header_rules() {
        assert_eq!(header_key(&[]).unwrap(), None);
        assert_eq!(
            header_key(&[b"abc-123"]).unwrap().as_deref(),
            Some("abc-123")
        );
        assert_eq!(
            header_key(&[b"\"with space\""]).unwrap().as_deref(),
            Some("with space")
        );
        assert_eq!(
            header_key(&[br#""q\"uote""#]).unwrap().as_deref(),
            Some("q\"uote")
        );
        assert!(matches!(
            header_key(&[b"a", b"b"]),
            Err(Rejection::DuplicateKey)
        ));
        let long = "k".repeat(256);
        let exact = "k".repeat(255);
        for bad in [
            &b""[..],
            b"\"\"",
            b"two words",
            b"\"unterminated",
            b"\"bad\\escape\"",
            b"\"x\"y",
            "nön".as_bytes(),
            long.as_bytes(),
            b"tab\there",
        ] {
            assert!(
                matches!(header_key(&[bad]), Err(Rejection::InvalidKey { .. })),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            header_key(&[exact.as_bytes()]).unwrap().map(|k| k.len()),
            Some(255)
        );
    }

    fn json_key(ct: Option<&str>, body: &str) -> Result<Option<String>, Rejection> {
        let mut b = http::Request::builder();
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        json("/user/phone")
            .unwrap()
            .extract(&parts(b), &Bytes::from(body.to_owned()))
    }

    #[test]
    fn json_rules() {
        let ok = r#"{"user":{"phone":"+1 555 0100"}}"#;
        assert_eq!(
            json_key(Some("application/json"), ok).unwrap().as_deref(),
            Some("+1 555 0100")
        );
        assert!(
            json_key(Some("application/json; charset=utf-8"), ok)
                .unwrap()
                .is_some()
        );
        assert!(
            json_key(Some("application/vnd.api+json"), ok)
                .unwrap()
                .is_some()
        );
        assert!(matches!(
            json_key(None, ok),
            Err(Rejection::UnsupportedMediaType { .. })
        ));
        assert!(matches!(
            json_key(Some("text/plain"), ok),
            Err(Rejection::UnsupportedMediaType { .. })
        ));
        assert!(matches!(
            json_key(Some("application/json"), "{\"user\":"),
            Err(Rejection::MalformedBody { .. })
        ));
        assert_eq!(json_key(Some("application/json"), "{}").unwrap(), None);
        for bad in [
            r#"{"user":{"phone":null}}"#,
            r#"{"user":{"phone":5550100}}"#,
            r#"{"user":{"phone":{}}}"#,
            r#"{"user":{"phone":[]}}"#,
            r#"{"user":{"phone":""}}"#,
            r#"{"user":{"phone":"a\u0000b"}}"#,
        ] {
            assert!(
                matches!(
                    json_key(Some("application/json"), bad),
                    Err(Rejection::InvalidKey { .. })
                ),
                "{bad}"
            );
        }
        assert!(json("phone").is_err());
    }

    #[test]
    fn form_query_path_and_or() {
        let p = parts(
            http::Request::builder()
                .uri("/orders/42/pay?txn=T%201&dup=1&dup=2")
                .header("content-type", "application/x-www-form-urlencoded"),
        );
        let body = Bytes::from_static(b"email=a%40b.c");
        assert_eq!(
            form("email").extract(&p, &body).unwrap().as_deref(),
            Some("a@b.c")
        );
        assert_eq!(form("none").extract(&p, &body).unwrap(), None);
        assert_eq!(
            query("txn").extract(&p, &body).unwrap().as_deref(),
            Some("T 1")
        );
        assert!(query("dup").extract(&p, &body).is_err());
        assert_eq!(
            path("order_id").extract(&p, &body).unwrap(),
            None,
            "no template"
        );
        let mut p2 = p.clone();
        p2.extensions
            .insert(RouteTemplate("/orders/{order_id}/pay".into()));
        assert_eq!(
            path("order_id").extract(&p2, &body).unwrap().as_deref(),
            Some("42")
        );
        let mut p3 = p.clone();
        p3.extensions.insert(RouteTemplate("/{*rest}".into()));
        assert_eq!(
            path("rest").extract(&p3, &body).unwrap().as_deref(),
            Some("orders/42/pay")
        );
        let either = header().or(query("txn"));
        assert_eq!(either.extract(&p, &body).unwrap().as_deref(), Some("T 1"));
        assert!(either.describe().contains(" or "));
    }
}
