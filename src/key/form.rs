//! Keys from `name=value` pairs: a form body's fields and the query string's parameters.

use bytes::Bytes;
use http::request::Parts;

use super::{KeyKind, KeySource, check_key, content_type_is};
use crate::Rejection;

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

    fn kind(&self) -> KeyKind {
        KeyKind::Thing
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

    fn kind(&self) -> KeyKind {
        KeyKind::Thing
    }
}
