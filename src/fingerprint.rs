//! Request fingerprints: a key reused for a different request is refused (422), not replayed.

use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::scope::field;

/// SHA-256 of the method, path and query, the chosen headers (all their values, in order) and
/// the body.
pub(crate) fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    field(&mut hasher, b"tower-idempotency/fingerprint/v1");
    field(&mut hasher, parts.method.as_str().as_bytes());
    let target = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    field(&mut hasher, target.as_bytes());
    for name in headers {
        field(&mut hasher, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        hasher.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            field(&mut hasher, value.as_bytes());
        }
    }
    field(&mut hasher, body);
    hasher.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::CONTENT_TYPE;

    fn fp(method: &str, uri: &str, ct: &str, body: &[u8]) -> [u8; 32] {
        let parts = http::Request::builder()
            .method(method)
            .uri(uri)
            .header(CONTENT_TYPE, ct)
            .header("x-ignored", body.len().to_string())
            .body(())
            .unwrap()
            .into_parts()
            .0;
        fingerprint(&parts, &[CONTENT_TYPE], body)
    }

    #[test]
    fn any_difference_changes_the_fingerprint() {
        let base = fp("POST", "/a?x=1", "application/json", b"{}");
        assert_eq!(base, fp("POST", "/a?x=1", "application/json", b"{}"));
        assert_ne!(base, fp("PUT", "/a?x=1", "application/json", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=2", "application/json", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", "text/plain", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", "application/json", b"{ }"));
    }
}
