//! Who a key belongs to: the principal (user, tenant, API client) that scopes it.
//!
//! Header keys are chosen by clients: without a principal, tenant A's `Idempotency-Key:
//! order-1001` would be replayed to tenant B, and B could squat A's keys. So a layer keyed by a
//! header (or by a closure) needs a principal source, or the explicit statement that its keys
//! are global ([`IdempotencyLayerBuilder::global_keys`](crate::IdempotencyLayerBuilder::global_keys));
//! [`build`](crate::IdempotencyLayerBuilder::build) refuses it otherwise. Keys that name a
//! thing rather than a request (a phone number in a signup form, a payment provider's event
//! id, an order id in the path) are global by nature and need neither.
//!
//! Take the principal from what the authentication layer established, never from the raw
//! credentials: a token that is refreshed changes, the user it names does not.
//!
//! | source | when |
//! |---|---|
//! | [`extension`] | the auth layer puts a typed user, session or tenant into the request extensions |
//! | [`claim`] | the auth layer puts the decoded JWT claims (a `serde_json::Value`) into the extensions |
//! | [`host`] | tenants told apart by host name, sharing routes and a store |
//! | a closure `Fn(&Parts) -> Option<String>` | anything else |
//!
//! A request for which the source finds no principal is refused (500 `principal-missing`): it
//! usually means the idempotency layer runs before the authentication layer.
//!
//! ```
//! # fn main() -> Result<(), tower_idempotency::ConfigError> {
//! use tower_idempotency::{IdempotencyLayer, Store, principal};
//!
//! #[derive(Clone)]
//! struct User { id: u64 }
//!
//! let layer = IdempotencyLayer::builder(Store::memory())
//!     .principal(principal::extension(|user: &User| user.id.to_string()))
//!     .build()?;
//! # Ok(()) }
//! ```

use std::marker::PhantomData;

use http::request::Parts;

/// Derives the principal a request's key belongs to.
pub trait PrincipalSource: Send + Sync + 'static {
    /// The principal, or `None` when the request has none (the layer refuses it).
    fn principal(&self, parts: &Parts) -> Option<String>;

    /// What the principal is taken from, for messages.
    fn describe(&self) -> String {
        "the principal source".to_owned()
    }
}

/// A closure over the request parts is a principal source.
///
/// ```
/// use tower_idempotency::principal::PrincipalSource;
/// let tenant = |parts: &http::request::Parts| {
///     parts.headers.get("x-tenant-id")?.to_str().ok().map(String::from)
/// };
/// let req = http::Request::builder().header("x-tenant-id", "t-9").body(()).unwrap();
/// assert_eq!(tenant.principal(&req.into_parts().0).as_deref(), Some("t-9"));
/// ```
impl<F> PrincipalSource for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// The principal from a typed value in the request extensions: see [`extension`].
pub struct Extension<T, F> {
    read: F,
    _type: PhantomData<fn(&T)>,
}

impl<T, F> std::fmt::Debug for Extension<T, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extension")
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

/// The principal from a value of type `T` that an authentication layer put into the request
/// extensions (a user, a session, an API client), read by `read`.
///
/// ```
/// use tower_idempotency::principal::{self, PrincipalSource};
/// #[derive(Clone)]
/// struct Tenant(String);
/// let source = principal::extension(|t: &Tenant| t.0.clone());
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Tenant("acme".into()));
/// assert_eq!(source.principal(&req.into_parts().0).as_deref(), Some("acme"));
/// ```
pub fn extension<T, F>(read: F) -> Extension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    Extension {
        read,
        _type: PhantomData,
    }
}

impl<T, F> PrincipalSource for Extension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<String> {
        parts.extensions.get::<T>().map(&self.read)
    }

    fn describe(&self) -> String {
        format!("the {} request extension", std::any::type_name::<T>())
    }
}

/// The principal from a claim of decoded JWT claims: see [`claim`].
#[derive(Debug, Clone)]
pub struct Claim {
    pointer: String,
}

/// The principal from a claim (`"sub"`, or a JSON pointer such as `"/org/id"`) of the decoded
/// token claims that an authentication layer put into the request extensions as a
/// `serde_json::Value` (or `serde_json::Map<String, Value>`). Strings and numbers are accepted.
///
/// ```
/// use tower_idempotency::principal::{self, PrincipalSource};
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(serde_json::json!({"sub": "user-42", "org": {"id": 7}}));
/// let parts = req.into_parts().0;
/// assert_eq!(principal::claim("sub").principal(&parts).as_deref(), Some("user-42"));
/// assert_eq!(principal::claim("/org/id").principal(&parts).as_deref(), Some("7"));
/// ```
pub fn claim(name: &str) -> Claim {
    let pointer = if name.starts_with('/') {
        name.to_owned()
    } else {
        format!("/{}", name.replace('~', "~0").replace('/', "~1"))
    };
    Claim { pointer }
}

impl PrincipalSource for Claim {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let value = match parts.extensions.get::<serde_json::Value>() {
            Some(claims) => claims.pointer(&self.pointer)?,
            None => {
                let map = parts
                    .extensions
                    .get::<serde_json::Map<String, serde_json::Value>>()?;
                let mut segments = self.pointer.split('/').skip(1);
                let first = segments.next()?.replace("~1", "/").replace("~0", "~");
                let rest: String = segments.map(|s| format!("/{s}")).collect();
                let top = map.get(&first)?;
                if rest.is_empty() {
                    top
                } else {
                    top.pointer(&rest)?
                }
            }
        };
        match value {
            serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        format!("the claim {}", self.pointer)
    }
}

/// The principal from the host the request was sent to: see [`host`].
#[derive(Debug, Clone, Copy)]
pub struct Host;

/// The host the request was sent to, lower-cased: HTTP/1.1's `Host` header, or, where there is
/// none, the URI's authority (HTTP/2 and HTTP/3 send `:authority`, which hyper puts in the URI
/// and adds no `Host` for). For tenants told apart by host name that share routes and a store.
///
/// ```
/// use tower_idempotency::principal::{self, PrincipalSource};
/// let h1 = http::Request::builder().header("host", "Shop-A.example").body(()).unwrap();
/// assert_eq!(principal::host().principal(&h1.into_parts().0).as_deref(), Some("shop-a.example"));
/// let h2 = http::Request::builder().uri("https://shop-b.example/pay").body(()).unwrap();
/// assert_eq!(principal::host().principal(&h2.into_parts().0).as_deref(), Some("shop-b.example"));
/// ```
pub fn host() -> Host {
    Host
}

impl PrincipalSource for Host {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let host = match parts.headers.get(http::header::HOST) {
            Some(host) => host.to_str().ok()?,
            None => parts.uri.authority()?.as_str(),
        };
        (!host.is_empty()).then(|| host.to_ascii_lowercase())
    }

    fn describe(&self) -> String {
        "the Host header (or the :authority of HTTP/2)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_from_either_extension_type() {
        let mut req = http::Request::new(());
        let mut map = serde_json::Map::new();
        map.insert("sub".into(), "u-1".into());
        map.insert("tenant/id".into(), 5.into());
        map.insert("empty".into(), "".into());
        req.extensions_mut().insert(map);
        let parts = req.into_parts().0;
        assert_eq!(claim("sub").principal(&parts).as_deref(), Some("u-1"));
        assert_eq!(claim("tenant/id").principal(&parts).as_deref(), Some("5"));
        assert_eq!(
            claim("empty").principal(&parts),
            None,
            "an empty claim is none"
        );
        assert_eq!(claim("missing").principal(&parts), None);
        let none = http::Request::new(()).into_parts().0;
        assert_eq!(claim("sub").principal(&none), None);
    }
}
