//! Request fingerprints: what tells a resend (replayed) from a different request with the same
//! key, as the layer's [`Identity`] says.

use hmac::Mac;
use http::request::Parts;
use http::{HeaderMap, HeaderName};

use crate::secret::FingerprintMac;
use crate::{Identity, Rejection};

/// The fingerprint of a request under `identity`: HMAC-SHA256 under the fingerprint key.
///
/// # Errors
/// [`Rejection::MalformedBody`] when the identity is made of JSON fields and the body is not
/// JSON.
pub(crate) fn identify(
    mut mac: FingerprintMac,
    identity: &Identity,
    parts: &Parts,
    headers: &[HeaderName],
    body: &[u8],
    trailers: Option<&HeaderMap>,
) -> Result<[u8; 32], Rejection> {
    match identity {
        Identity::JsonFields(pointers) => {
            let document: serde_json::Value =
                serde_json::from_slice(body).map_err(|e| Rejection::MalformedBody {
                    reason: format!(
                        "The JSON body, whose fields identify the request, does not parse: {e}."
                    ),
                })?;
            field(&mut mac, b"tower-idempotency/fingerprint/json-fields/v1");
            target(&mut mac, parts);
            for pointer in pointers {
                field(&mut mac, pointer.as_bytes());
                match document.pointer(pointer) {
                    // Objects serialise with their members sorted (serde_json's map): the same
                    // value, however its sender ordered it.
                    Some(value) => field(&mut mac, value.to_string().as_bytes()),
                    None => mac.update(b"absent"),
                }
            }
            Ok(mac.finalize().into_bytes().into())
        }
        Identity::Key => {
            field(&mut mac, b"tower-idempotency/fingerprint/key/v1");
            Ok(mac.finalize().into_bytes().into())
        }
        // The whole request (and anything a later version adds is the whole request too).
        _ => Ok(fingerprint(mac, parts, headers, body, trailers)),
    }
}

/// The method, and the path and query as the client sent them and as routed.
fn target(mac: &mut FingerprintMac, parts: &Parts) {
    field(mac, parts.method.as_str().as_bytes());
    // As the client sent it (under a nested router the path lacks its prefix, which may hold
    // path parameters), and as routed when that differs (a rewrite inside the router). A
    // routed path starts with '/', a header name (the next field otherwise) never does.
    let sent = crate::key::original_target(parts);
    field(mac, sent.as_bytes());
    let routed = crate::key::target(&parts.uri);
    if routed != sent {
        field(mac, routed.as_bytes());
    }
}

/// Feeds one length-prefixed field, so that field boundaries cannot be forged.
fn field(mac: &mut FingerprintMac, bytes: &[u8]) {
    mac.update(&(bytes.len() as u64).to_be_bytes());
    mac.update(bytes);
}

/// HMAC-SHA256 (under the fingerprint key derived from the server secret) of the method, path
/// and query (as the client sent them, and as routed), the chosen headers (all their values,
/// in order), the body and its trailers, if it had any (the handler gets them too).
pub(crate) fn fingerprint(
    mut mac: FingerprintMac,
    parts: &Parts,
    headers: &[HeaderName],
    body: &[u8],
    trailers: Option<&HeaderMap>,
) -> [u8; 32] {
    field(&mut mac, b"tower-idempotency/fingerprint/v3");
    target(&mut mac, parts);
    for name in headers {
        field(&mut mac, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        mac.update(&(values.iter().count() as u64).to_be_bytes());
        for value in values {
            field(&mut mac, value.as_bytes());
        }
    }
    field(&mut mac, body);
    // After the body's length-prefixed field: a request without trailers hashes as before.
    // By name (the values of one name in their order): a client or proxy that sends the same
    // trailers in another order sends the same request.
    if let Some(trailers) = trailers.filter(|t| !t.is_empty()) {
        field(&mut mac, b"trailers");
        mac.update(&(trailers.len() as u64).to_be_bytes());
        let mut names: Vec<&HeaderName> = trailers.keys().collect();
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        for name in names {
            for value in trailers.get_all(name) {
                field(&mut mac, name.as_str().as_bytes());
                field(&mut mac, value.as_bytes());
            }
        }
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Keys;
    use http::header::CONTENT_TYPE;

    fn fp(keys: &Keys, method: &str, uri: &str, ct: &str, body: &[u8]) -> [u8; 32] {
        let parts = http::Request::builder()
            .method(method)
            .uri(uri)
            .header(CONTENT_TYPE, ct)
            .header("x-ignored", body.len().to_string())
            .body(())
            .unwrap()
            .into_parts()
            .0;
        fingerprint(keys.fingerprinter(), &parts, &[CONTENT_TYPE], body, None)
    }

    #[test]
    fn any_difference_changes_the_fingerprint() {
        let keys = Keys::new(Some(b"a server secret, 32 bytes long.."));
        let base = fp(&keys, "POST", "/a?x=1", "application/json", b"{}");
        assert_eq!(base, fp(&keys, "POST", "/a?x=1", "application/json", b"{}"));
        assert_ne!(base, fp(&keys, "PUT", "/a?x=1", "application/json", b"{}"));
        assert_ne!(base, fp(&keys, "POST", "/a?x=2", "application/json", b"{}"));
        assert_ne!(base, fp(&keys, "POST", "/a?x=1", "text/plain", b"{}"));
        assert_ne!(
            base,
            fp(&keys, "POST", "/a?x=1", "application/json", b"{ }")
        );
        // As the client sent it and as routed: a nested router's stripped path, or a rewrite
        // inside the router, tells requests apart that one of the two alone would not.
        #[cfg(feature = "axum")]
        {
            let routed = |original: &str, uri: &str| {
                let mut parts = http::Request::builder()
                    .method("POST")
                    .uri(uri)
                    .header(CONTENT_TYPE, "application/json")
                    .body(())
                    .unwrap()
                    .into_parts()
                    .0;
                parts
                    .extensions
                    .insert(axum::extract::OriginalUri(original.parse().unwrap()));
                fingerprint(keys.fingerprinter(), &parts, &[CONTENT_TYPE], b"{}", None)
            };
            let plain = fp(&keys, "POST", "/a?x=1", "application/json", b"{}");
            assert_eq!(
                routed("/a?x=1", "/a?x=1"),
                plain,
                "unchanged when not rewritten"
            );
            assert_ne!(routed("/shops/1/a", "/a"), routed("/shops/2/a", "/a"));
            assert_ne!(
                routed("/signup", "/tenants/a/signup"),
                routed("/signup", "/tenants/b/signup")
            );
        }
        // Request trailers (the handler gets them): none and an empty map hash the same,
        // other values differ.
        let with = |trailers: Option<&http::HeaderMap>| {
            let parts = http::Request::post("/a").body(()).unwrap().into_parts().0;
            fingerprint(keys.fingerprinter(), &parts, &[], b"{}", trailers)
        };
        let mut one = http::HeaderMap::new();
        one.insert("x-sum", http::HeaderValue::from_static("1"));
        let mut two = http::HeaderMap::new();
        two.insert("x-sum", http::HeaderValue::from_static("2"));
        assert_eq!(with(None), with(Some(&http::HeaderMap::new())));
        assert_ne!(with(None), with(Some(&one)));
        assert_ne!(with(Some(&one)), with(Some(&two)));
        let mut ab = http::HeaderMap::new();
        ab.insert("x-a", http::HeaderValue::from_static("1"));
        ab.insert("x-b", http::HeaderValue::from_static("2"));
        let mut ba = http::HeaderMap::new();
        ba.insert("x-b", http::HeaderValue::from_static("2"));
        ba.insert("x-a", http::HeaderValue::from_static("1"));
        assert_eq!(
            with(Some(&ab)),
            with(Some(&ba)),
            "the order of names is not the request"
        );
        let other = Keys::new(Some(b"another secret, 32 bytes long..."));
        assert_ne!(
            base,
            fp(&other, "POST", "/a?x=1", "application/json", b"{}"),
            "keyed"
        );
    }

    fn identity_of(identity: &Identity, uri: &str, body: &str) -> Result<[u8; 32], Rejection> {
        let keys = Keys::new(Some(b"a server secret, 32 bytes long.."));
        let parts = http::Request::post(uri)
            .header(CONTENT_TYPE, "application/json")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        identify(
            keys.fingerprinter(),
            identity,
            &parts,
            &[CONTENT_TYPE],
            body.as_bytes(),
            None,
        )
    }

    #[test]
    fn each_identity_compares_what_it_says() {
        let fields = Identity::json_fields(["/amount", "/meta"]).unwrap();
        let a = r#"{"id":"e","amount":5,"attempt":1,"meta":{"a":1,"b":2}}"#;
        let resent = r#"{"attempt":2,"meta":{"b":2,"a":1},"amount":5,"id":"e"}"#;
        let other = r#"{"id":"e","amount":6,"attempt":1,"meta":{"a":1,"b":2}}"#;
        let null = r#"{"id":"e","amount":null,"meta":{"a":1,"b":2}}"#;
        let absent = r#"{"id":"e","meta":{"a":1,"b":2}}"#;
        let f = |uri, body| identity_of(&fields, uri, body).unwrap();
        assert_eq!(
            f("/e", a),
            f("/e", resent),
            "other fields and orders ignored"
        );
        assert_ne!(f("/e", a), f("/e", other));
        assert_ne!(f("/e", null), f("/e", absent), "null is not absent");
        assert_ne!(f("/e", a), f("/f", a), "the path is part of it");
        assert!(matches!(
            identity_of(&fields, "/e", "not json"),
            Err(Rejection::MalformedBody { .. })
        ));
        let k = |uri, body| identity_of(&Identity::Key, uri, body).unwrap();
        assert_eq!(k("/e", a), k("/f", other), "the key alone");
        let whole = |body| identity_of(&Identity::Request, "/e", body).unwrap();
        assert_ne!(whole(a), whole(resent));
        // The three never coincide for one request.
        assert_ne!(whole(a), f("/e", a));
        assert_ne!(whole(a), k("/e", a));
        assert_ne!(f("/e", a), k("/e", a));
    }
}
