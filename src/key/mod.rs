//! Where the idempotency key comes from, and what it identifies.
//!
//! A key is one of two kinds ([`KeyKind`]), chosen with the source, so that a reader of the
//! router sees which applies:
//!
//! | kind | for | a different request with the key | scoped | default of |
//! |---|---|---|---|---|
//! | [`KeyKind::Request`]: a key the client chose for one request | `Idempotency-Key` (IETF draft, Stripe's API), a generated id in the body | 422 `key-reused` ("use a new key") | per [`principal`](crate::principal), or declared [`global_keys`](crate::IdempotencyLayerBuilder::global_keys) | [`header()`], [`header_named`], closures |
//! | [`KeyKind::Thing`]: a key that names a thing | a phone number, an e-mail address, an event or order id | runs the handler, after the first one ended (the application answers: "already registered") | global, or per principal if one is set | [`json`], [`form`], [`path`], [`query`] |
//!
//! Both kinds replay an identical resend, answer 409 (or wait, [`OnConflict::Wait`](crate::OnConflict))
//! while a request with the key is in flight, and store nothing for a request refused without
//! effect ([`outcome`](crate::outcome)): the corrected request runs. What makes two requests
//! "identical" beyond their key is the layer's [`Identity`](crate::Identity) (the whole request
//! by default; selected JSON fields; or the key alone, for a provider's events).
//!
//! | source | example |
//! |---|---|
//! | [`header()`] | `Idempotency-Key: "8e03978e-40d5"` |
//! | [`json`] | `json("/phone")`, `json("/id")` (an event), `json("/idempotency_key")?.per_request()` |
//! | [`form`] | `form("email")`, `form("idempotency_key").per_request()` (a key in a hidden field) |
//! | [`path`] | `path("order_id")` on `/orders/{order_id}/pay` |
//! | [`query`] | `query("txn")` |
//! | a closure | `\|parts, body\| Ok(Some(...))` |
//!
//! [`KeySourceExt::per_request`] and [`KeySourceExt::names_a_thing`] set the kind of any source;
//! sources of one kind combine with [`KeySourceExt::or`].
//!
//! The raw key never reaches the store: the store key is an HKDF-SHA256 of the scope and the
//! key under the server secret (see [`secret`](crate::IdempotencyLayerBuilder::secret)). A key
//! that names a thing is guessable: the layer refuses it without a secret.

mod form;
mod header;
mod json;
mod path;

use std::fmt;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;

use crate::{ConfigError, Rejection};

pub use form::{FormKey, QueryKey, form, query};
pub use header::{HeaderKey, IDEMPOTENCY_KEY, header, header_named};
pub use json::{JsonKey, json};
#[cfg(feature = "axum")]
pub(crate) use path::collect_path_params;
pub use path::{PathKey, RouteTemplate, path};
pub(crate) use path::{original_target, route_template, target, template_in};

/// The longest key accepted, in characters (the IETF draft's limit for the header).
pub const MAX_KEY_LEN: usize = 255;

/// What a key identifies: see the [module docs](self).
///
/// ```
/// use tower_idempotency::key::{self, KeyKind, KeySource, KeySourceExt};
/// assert_eq!(key::header().kind(), KeyKind::Request);
/// assert_eq!(key::json("/phone")?.kind(), KeyKind::Thing);
/// assert_eq!(key::json("/idempotency_key")?.per_request().kind(), KeyKind::Request);
/// # Ok::<(), tower_idempotency::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyKind {
    /// A key the client chose for one request (the `Idempotency-Key` header, a generated id in
    /// the body): the key with another request is refused (422), and keys are scoped to a
    /// principal or declared global.
    Request,
    /// A key that names a thing (a phone number, an e-mail address, an event or order id):
    /// requests about the thing run one at a time; an identical resend is replayed, a
    /// different request runs once the first has ended. Global unless a principal is set;
    /// guessable, so it needs the server secret.
    Thing,
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyKind::Request => "a key the client chose for one request",
            KeyKind::Thing => "a key that names a thing",
        })
    }
}

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

    /// What the key identifies ([`KeyKind`]). Closures are [`KeyKind::Request`]; set another
    /// kind with [`KeySourceExt::names_a_thing`].
    fn kind(&self) -> KeyKind {
        KeyKind::Request
    }

    /// Whether the key may come from a path parameter: the layer then collects the parameters
    /// the router matched (see [`path`]).
    fn uses_path_params(&self) -> bool {
        false
    }

    /// Checks the source when the layer is built (sources of two kinds combined with
    /// [`KeySourceExt::or`] are refused).
    ///
    /// # Errors
    /// What cannot work, and why.
    fn check(&self) -> Result<(), ConfigError> {
        Ok(())
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

    fn kind(&self) -> KeyKind {
        (**self).kind()
    }

    fn check(&self) -> Result<(), ConfigError> {
        (**self).check()
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

    /// This source's keys are chosen by the client for one request ([`KeyKind::Request`]): a
    /// key the client generates and sends in the body, for example.
    ///
    /// ```
    /// use tower_idempotency::key::{self, KeyKind, KeySource, KeySourceExt};
    /// let source = key::json("/idempotency_key")?.per_request();
    /// assert_eq!(source.kind(), KeyKind::Request);
    /// # Ok::<(), tower_idempotency::ConfigError>(())
    /// ```
    fn per_request(self) -> Kinded<Self> {
        Kinded {
            source: self,
            kind: KeyKind::Request,
        }
    }

    /// This source's keys name a thing ([`KeyKind::Thing`]): an order id in a header, say.
    ///
    /// ```
    /// use tower_idempotency::key::{self, KeyKind, KeySource, KeySourceExt};
    /// let source = key::header_named("x-order-id")?.names_a_thing();
    /// assert_eq!(source.kind(), KeyKind::Thing);
    /// # Ok::<(), tower_idempotency::ConfigError>(())
    /// ```
    fn names_a_thing(self) -> Kinded<Self> {
        Kinded {
            source: self,
            kind: KeyKind::Thing,
        }
    }
}

/// A source with its kind set: see [`KeySourceExt::per_request`] and
/// [`KeySourceExt::names_a_thing`].
#[derive(Debug, Clone)]
pub struct Kinded<S> {
    source: S,
    kind: KeyKind,
}

impl<S: KeySource> KeySource for Kinded<S> {
    fn extract(&self, parts: &Parts, body: &Bytes) -> Result<Option<String>, Rejection> {
        self.source.extract(parts, body)
    }

    fn describe(&self) -> String {
        self.source.describe()
    }

    fn needs_body(&self) -> bool {
        self.source.needs_body()
    }

    fn kind(&self) -> KeyKind {
        self.kind
    }

    fn uses_path_params(&self) -> bool {
        self.source.uses_path_params()
    }

    /// The kind is set here, over whatever the sources inside say.
    fn check(&self) -> Result<(), ConfigError> {
        Ok(())
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

    fn kind(&self) -> KeyKind {
        self.0.kind()
    }

    fn check(&self) -> Result<(), ConfigError> {
        self.0.check()?;
        self.1.check()?;
        let (a, b) = (self.0.kind(), self.1.kind());
        if a != b {
            return Err(ConfigError::Invalid {
                field: "key",
                reason: format!(
                    "{} is {a}, {} is {b}: the two behave differently for a request that \
                     differs from the first; give the combination one kind with \
                     .per_request() or .names_a_thing()",
                    self.0.describe(),
                    self.1.describe()
                ),
            });
        }
        Ok(())
    }

    fn uses_path_params(&self) -> bool {
        self.0.uses_path_params() || self.1.uses_path_params()
    }
}

/// Checks a key taken from the body, path or query: 1 to 255 characters, no control characters.
pub(super) fn check_key(key: String, from: &dyn fmt::Display) -> Result<String, Rejection> {
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

pub(super) fn content_type_is(parts: &Parts, check: impl Fn(&str) -> bool) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(req: http::request::Builder) -> Parts {
        req.body(()).unwrap().into_parts().0
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

    #[test]
    fn kinds_are_set_by_the_source_and_must_agree_in_an_or() {
        assert_eq!(header().kind(), KeyKind::Request);
        assert_eq!(json("/id").unwrap().kind(), KeyKind::Thing);
        assert_eq!(form("email").kind(), KeyKind::Thing);
        assert_eq!(path("id").kind(), KeyKind::Thing);
        assert_eq!(query("id").kind(), KeyKind::Thing);
        let closure = |_: &Parts, _: &Bytes| -> Result<Option<String>, Rejection> { Ok(None) };
        assert_eq!(closure.kind(), KeyKind::Request);
        assert_eq!(form("k").per_request().kind(), KeyKind::Request);
        assert_eq!(header().names_a_thing().kind(), KeyKind::Thing);
        let mixed = header().or(json("/id").unwrap());
        match mixed.check() {
            Err(ConfigError::Invalid { field, reason }) => {
                assert_eq!(field, "key");
                assert!(reason.contains("names_a_thing"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(mixed.clone().names_a_thing().check().is_ok());
        assert_eq!(mixed.names_a_thing().kind(), KeyKind::Thing);
        assert!(
            header()
                .or(json("/k").unwrap().per_request())
                .check()
                .is_ok()
        );
        // Nested: the disagreement is found inside.
        let nested = header().or(query("a")).or(header_named("x-b").unwrap());
        assert!(nested.check().is_err());
    }
}
