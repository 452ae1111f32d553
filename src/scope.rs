//! Key scoping: which requests share a key, and the store name derived from it.
//!
//! A key is scoped to the method, the matched route (the template, e.g. `/orders/{id}/pay`, or
//! the path when there is no router) and an optional principal, so that one user can never
//! replay another user's response. The store name is the SHA-256 of the scope and the key, in
//! hex: no phone number, e-mail or other raw input reaches the store.

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::key::route_template;

/// Derives the principal (user, tenant, API key id) a key belongs to, from the request parts.
pub(crate) type Principal = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Feeds one length-prefixed field, so that field boundaries cannot be forged.
pub(crate) fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 0xf) as usize] as char);
    }
    out
}

/// The store name for `key` on this request: 64 hex digits.
pub(crate) fn store_name(parts: &Parts, principal: Option<&Principal>, key: &str) -> String {
    let mut hasher = Sha256::new();
    field(&mut hasher, b"tower-idempotency/scope/v1");
    field(&mut hasher, parts.method.as_str().as_bytes());
    field(
        &mut hasher,
        route_template(parts).unwrap_or(parts.uri.path()).as_bytes(),
    );
    match principal.and_then(|p| p(parts)) {
        Some(who) => {
            hasher.update([1]);
            field(&mut hasher, who.as_bytes());
        }
        None => hasher.update([0]),
    }
    field(&mut hasher, key.as_bytes());
    let digest: [u8; 32] = hasher.finalize().into();
    hex(&digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::RouteTemplate;

    fn parts(method: &str, uri: &str, auth: Option<&str>) -> Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn scope_separates_methods_routes_and_principals() {
        let user = |p: &Parts| -> Option<String> {
            p.headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let principal: &Principal = &user;
        let a = store_name(&parts("POST", "/pay", Some("alice")), Some(principal), "k1");
        assert_eq!(a.len(), 64);
        assert!(
            !a.contains("k1") && !a.contains("alice"),
            "no raw input in the name"
        );
        assert_eq!(
            a,
            store_name(&parts("POST", "/pay", Some("alice")), Some(principal), "k1")
        );
        assert_ne!(
            a,
            store_name(&parts("POST", "/pay", Some("bob")), Some(principal), "k1")
        );
        assert_ne!(
            a,
            store_name(
                &parts("PATCH", "/pay", Some("alice")),
                Some(principal),
                "k1"
            )
        );
        assert_ne!(
            a,
            store_name(
                &parts("POST", "/refund", Some("alice")),
                Some(principal),
                "k1"
            )
        );
        assert_ne!(
            a,
            store_name(&parts("POST", "/pay", Some("alice")), Some(principal), "k2")
        );
        assert_ne!(
            a,
            store_name(&parts("POST", "/pay", None), Some(principal), "k1")
        );
        // With a route template, concrete paths of one route share the scope.
        let mut one = parts("POST", "/orders/1/pay", None);
        let mut two = parts("POST", "/orders/2/pay", None);
        one.extensions
            .insert(RouteTemplate("/orders/{id}/pay".into()));
        two.extensions
            .insert(RouteTemplate("/orders/{id}/pay".into()));
        assert_eq!(store_name(&one, None, "k"), store_name(&two, None, "k"));
    }
}
