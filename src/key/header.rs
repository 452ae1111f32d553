//! Keys from a header: the IETF draft's `Idempotency-Key`, or another one.

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;

use super::{KeySource, MAX_KEY_LEN};
use crate::{ConfigError, Rejection};

/// The header of the IETF draft "The Idempotency-Key HTTP Header Field".
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

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

/// Another header, with the same rules as [`header()`]. Its keys are ones the client makes up
/// for one request ([`KeyKind::Request`](super::KeyKind::Request)); for a header that carries a
/// thing's name (an order id, an e-mail), say so with
/// [`names_a_thing`](super::KeySourceExt::names_a_thing), which also makes the server secret
/// required.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
