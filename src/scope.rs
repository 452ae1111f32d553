//! Key scoping: which requests share a key, and what the store knows of it.
//!
//! A key is scoped to the method, the matched route (the template, e.g. `/orders/{id}/pay`, or
//! the path when there is no router) and the principal, so that one user can never replay
//! another user's response. The scope and the key derive, under the server secret, the store
//! name and the record key ([`crate::secret`]): no phone number, e-mail or other raw input
//! reaches the store.
//!
//! A [key that names a thing](crate::key::KeyKind::Thing) derives two names: the thing's lock,
//! which requests about the thing take one at a time, and a record per request identity, so
//! that a different request about the thing runs while an identical resend of an earlier one
//! still finds its outcome. A record's name is the thing's, a dot and 32 hex digits of the
//! request's fingerprint (itself keyed), and its records are sealed with the thing's record key
//! (each bound to its own name): an operator who knows the key finds and opens every record
//! about the thing by the name's prefix.

use http::request::Parts;

use crate::key::route_template;
use crate::secret::{Derived, Keys};

/// What a derivation names.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Naming<'a> {
    /// The record of a per-request key (also its lease).
    Key,
    /// The lock of a thing.
    Thing,
    /// The record of one request about a thing: the thing's name, a dot and a prefix of this
    /// fingerprint.
    Record(&'a [u8; 32]),
}

/// The store name and record key of `key` on this request, for `principal` (`None`: keys are
/// global).
pub(crate) fn derive(
    keys: &Keys,
    parts: &Parts,
    principal: Option<&str>,
    key: &str,
    naming: Naming<'_>,
    sealed: bool,
) -> Derived {
    if let Naming::Record(fingerprint) = naming {
        let thing = derive(keys, parts, principal, key, Naming::Thing, sealed);
        return Derived {
            name: record_name(&thing.name, fingerprint),
            record_key: thing.record_key,
        };
    }
    let method = parts.method.as_str().as_bytes();
    let route = route_template(parts).unwrap_or(parts.uri.path()).as_bytes();
    let (scoped, who): (&[u8], &[u8]) = match principal {
        Some(who) => (b"\x01", who.as_bytes()),
        None => (b"\x00", b""),
    };
    let len = |b: &[u8]| (b.len() as u64).to_be_bytes();
    let (l_method, l_route, l_who, l_key) =
        (len(method), len(route), len(who), len(key.as_bytes()));
    // After the key's length-prefixed field, a thing's name adds one of its own (so it never
    // equals a per-request key's, whose info ends with the key).
    let l_thing = len(b"thing");
    let named: &[&[u8]] = match naming {
        Naming::Thing => &[&l_thing, b"thing"],
        _ => &[],
    };
    // Length-prefixed fields: field boundaries cannot be forged.
    let info: [&[u8]; 10] = [
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
    ];
    let mut all = [&[][..]; 12];
    all[..10].copy_from_slice(&info);
    all[10..10 + named.len()].copy_from_slice(named);
    keys.derive(&all[..10 + named.len()], sealed)
}

/// The name of a record about the thing named `thing`, for a request with `fingerprint`.
pub(crate) fn record_name(thing: &str, fingerprint: &[u8; 32]) -> String {
    format!("{thing}.{}", crate::secret::hex(&fingerprint[..16]))
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
            derive(&keys, &parts(method, uri), who, key, Naming::Key, true).name
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
            derive(&keys, &one, None, "k", Naming::Key, true).name,
            derive(&keys, &two, None, "k", Naming::Key, true).name
        );
    }

    #[test]
    fn a_thing_names_its_lock_and_a_record_per_fingerprint() {
        let keys = Keys::new(Some(b"a server secret, 32 bytes long.."));
        let p = parts("POST", "/signup");
        let named = |naming| derive(&keys, &p, None, "+15550100", naming, true);
        let (key, thing) = (named(Naming::Key), named(Naming::Thing));
        let (a, b) = (
            named(Naming::Record(&[1; 32])),
            named(Naming::Record(&[2; 32])),
        );
        let names = [&key.name, &thing.name, &a.name, &b.name];
        for (i, x) in names.iter().enumerate() {
            for y in &names[i + 1..] {
                assert_ne!(x, y);
            }
        }
        // Found by the thing's name, opened with the thing's key (each bound to its own name).
        assert!(a.name.starts_with(&format!("{}.", thing.name)) && a.name.len() == 64 + 1 + 32);
        assert_eq!(a.record_key, thing.record_key);
        assert_eq!(b.record_key, thing.record_key);
        assert_eq!(
            a.name,
            named(Naming::Record(&[1; 32])).name,
            "deterministic"
        );
        // The per-request name is the one it always was (records stored before still match).
        let info: [&[u8]; 10] = [
            b"tower-idempotency/scope/v3",
            &4u64.to_be_bytes(),
            b"POST",
            &7u64.to_be_bytes(),
            b"/signup",
            b"\x00",
            &0u64.to_be_bytes(),
            b"",
            &9u64.to_be_bytes(),
            b"+15550100",
        ];
        assert_eq!(key.name, keys.derive(&info, true).name);
    }
}
