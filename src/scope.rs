//! Key scoping: which requests share a key, and what the store knows of it.
//!
//! A key is scoped to the method, the matched route (the template, e.g. `/orders/{id}/pay`, or
//! the path when there is no router) and the principal, so that one user can never replay
//! another user's response. The scope and the key derive, under the server secret, the store
//! name and the record key ([`crate::secret`]): no phone number, e-mail or other raw input
//! reaches the store.

use http::request::Parts;

use crate::key::route_template;
use crate::secret::{Derived, Keys};

/// The store name and record key of `key` on this request, for `principal` (`None`: keys are
/// global).
pub(crate) fn derive(
    keys: &Keys,
    parts: &Parts,
    principal: Option<&str>,
    key: &str,
    sealed: bool,
) -> Derived {
    let method = parts.method.as_str().as_bytes();
    let route = route_template(parts).unwrap_or(parts.uri.path()).as_bytes();
    let (scoped, who): (&[u8], &[u8]) = match principal {
        Some(who) => (b"\x01", who.as_bytes()),
        None => (b"\x00", b""),
    };
    let len = |b: &[u8]| (b.len() as u64).to_be_bytes();
    let (l_method, l_route, l_who, l_key) =
        (len(method), len(route), len(who), len(key.as_bytes()));
    // Length-prefixed fields: field boundaries cannot be forged.
    keys.derive(
        &[
            b"tower-idempotency/scope/v3",
            &l_method,
            method,
            &l_route,
            route,
            scoped,
            &l_who,
            who,
            &l_key,
            key.as_bytes(),
        ],
        sealed,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::RouteTemplate;

    fn parts(method: &str, uri: &str) -> Parts {
        http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn scope_separates_methods_routes_and_principals() {
        let keys = Keys::new(Some(b"a server secret, 32 bytes long.."));
        let name = |method, uri, who: Option<&str>, key| {
            derive(&keys, &parts(method, uri), who, key, true).name
        };
        let a = name("POST", "/pay", Some("alice"), "k1");
        assert_eq!(a.len(), 64);
        assert!(
            !a.contains("k1") && !a.contains("alice"),
            "no raw input in the name"
        );
        assert_eq!(a, name("POST", "/pay", Some("alice"), "k1"));
        assert_ne!(a, name("POST", "/pay", Some("bob"), "k1"));
        assert_ne!(a, name("PATCH", "/pay", Some("alice"), "k1"));
        assert_ne!(a, name("POST", "/refund", Some("alice"), "k1"));
        assert_ne!(a, name("POST", "/pay", Some("alice"), "k2"));
        assert_ne!(a, name("POST", "/pay", None, "k1"));
        assert_ne!(
            name("POST", "/pay", Some(""), "k1"),
            name("POST", "/pay", None, "k1")
        );
        // Field boundaries: ("ab", "c") is not ("a", "bc").
        assert_ne!(
            name("POST", "/pay", Some("ab"), "c"),
            name("POST", "/pay", Some("a"), "bc")
        );
        // With a route template, concrete paths of one route share the scope.
        let mut one = parts("POST", "/orders/1/pay");
        let mut two = parts("POST", "/orders/2/pay");
        one.extensions
            .insert(RouteTemplate("/orders/{id}/pay".into()));
        two.extensions
            .insert(RouteTemplate("/orders/{id}/pay".into()));
        assert_eq!(
            derive(&keys, &one, None, "k", true).name,
            derive(&keys, &two, None, "k", true).name
        );
    }
}
