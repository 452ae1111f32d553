//! The handler's transaction in same-transaction mode (the Postgres store): see
//! [`same_transaction`](crate::IdempotencyLayerBuilder::same_transaction).

/// The transaction the layer opened for this execution (request extension and axum
/// extractor): run the handler's writes on it (it derefs to a `tokio_postgres::Client` whose
/// transaction is open); the layer stores the outcome in it and commits, or rolls it back.
/// Never commit or roll back yourself.
///
/// ```no_run
/// use tower_idempotency::Transaction;
///
/// async fn signup(tx: Transaction) -> Result<&'static str, String> {
///     tx.execute("INSERT INTO users (phone, name) VALUES ($1, $2)", &[&"+15550100", &"Ada"])
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok("created")
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Transaction(distlock::postgres::Transaction);

impl Transaction {
    pub(crate) fn new(inner: distlock::postgres::Transaction) -> Self {
        Transaction(inner)
    }
}

impl std::ops::Deref for Transaction {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        self.0.client()
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::extract::FromRequestParts;
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::Transaction;

    /// The handler asked for a [`Transaction`] but its layer is not in same-transaction mode
    /// (or does not cover the request).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[non_exhaustive]
    pub struct MissingTransaction;

    impl std::fmt::Display for MissingTransaction {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "this route's handler needs the transaction of an IdempotencyLayer built with \
                 same_transaction(true), and none ran for this request",
            )
        }
    }

    impl std::error::Error for MissingTransaction {}

    impl IntoResponse for MissingTransaction {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for Transaction {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Transaction>().cloned())
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for Transaction {
        type Rejection = MissingTransaction;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<Transaction>()
                .cloned()
                .ok_or(MissingTransaction)
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingTransaction;
