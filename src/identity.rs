//! What identifies a request beyond its key: which requests with one key are resends of each
//! other (replayed), and which are different requests (refused with 422 for a
//! [per-request key](crate::key::KeyKind::Request), run for a key that
//! [names a thing](crate::key::KeyKind::Thing)).
//!
//! | identity | two requests with one key are the same request when | for |
//! |---|---|---|
//! | [`Identity::Request`] (default, both kinds) | method, path and query, the [fingerprint headers](crate::IdempotencyLayerBuilder::fingerprint_headers), body and trailers are the same | an API, a signup form: another name with the same phone number is another person |
//! | [`Identity::json_fields`] | method, path and query, and these fields of the JSON body are the same | bodies with fields that change between resends (a timestamp, an attempt count) |
//! | [`Identity::Key`] | always: the key alone identifies the request | a provider's events, whose every delivery serialises the event afresh |
//!
//! Whatever the identity, the key's scope (method, route template, principal) stays part of
//! it. The comparison is an HMAC-SHA256 under a key derived from the server secret: the store
//! never sees the request.

use crate::ConfigError;

/// What identifies a request beyond its key: see the [module docs](self).
///
/// ```
/// use tower_idempotency::{Identity, IdempotencyLayer, Store, key};
/// // A provider's webhook: the event id is the event, however it is serialised.
/// let layer = IdempotencyLayer::builder(Store::memory())
///     .secret("a secret of 32 random bytes.....")?
///     .key(key::json("/id")?)
///     .identity(Identity::Key)
///     .build()?;
/// # Ok::<(), tower_idempotency::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Identity {
    /// The whole request: method, path and query, the fingerprint headers, the body and its
    /// trailers (the default).
    #[default]
    Request,
    /// The method, path and query, and these fields of a JSON body (by JSON pointer): build it
    /// with [`Identity::json_fields`]. A field that is absent is told apart from one that is
    /// `null`; a body that is not JSON is refused (400).
    JsonFields(Vec<String>),
    /// Nothing beyond the key: every request with the key is the same request.
    Key,
}

impl Identity {
    /// The method, path and query, and the given fields of a JSON body.
    ///
    /// # Errors
    /// If no field is given, or a pointer does not start with `/`.
    ///
    /// ```
    /// use tower_idempotency::Identity;
    /// let by_amount = Identity::json_fields(["/amount", "/currency"])?;
    /// assert!(Identity::json_fields(["amount"]).is_err());
    /// # Ok::<(), tower_idempotency::ConfigError>(())
    /// ```
    pub fn json_fields<I, S>(pointers: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let identity = Identity::JsonFields(pointers.into_iter().map(Into::into).collect());
        identity.check()?;
        Ok(identity)
    }

    /// Checks it when the layer is built.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let Identity::JsonFields(pointers) = self else {
            return Ok(());
        };
        if pointers.is_empty() {
            return Err(ConfigError::Invalid {
                field: "identity",
                reason: "no JSON field: name at least one, or use Identity::Key".into(),
            });
        }
        match pointers.iter().find(|p| !p.starts_with('/')) {
            Some(bad) => Err(ConfigError::Invalid {
                field: "identity",
                reason: format!("{bad:?} is not a JSON pointer: it must start with '/'"),
            }),
            None => Ok(()),
        }
    }
}
