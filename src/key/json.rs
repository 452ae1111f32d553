//! Keys from a JSON body, by JSON pointer.

use std::fmt;

use bytes::Bytes;
use http::request::Parts;

use super::{KeyKind, KeySource, check_key, content_type_is};
use crate::{ConfigError, Rejection};

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

    /// A field names a thing (a phone number, an event id) unless it is said to be
    /// [`per_request`](super::KeySourceExt::per_request).
    fn kind(&self) -> KeyKind {
        KeyKind::Thing
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(req: http::request::Builder) -> Parts {
        req.body(()).unwrap().into_parts().0
    }

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
}
