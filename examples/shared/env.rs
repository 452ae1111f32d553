//! What the example services take from the environment: the store and the server secret.

use tower_idempotency::Store;

/// Redis when `REDIS_URL` is set, memory otherwise.
pub(crate) fn store() -> Result<Store, tower_idempotency::ConfigError> {
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => Store::redis(&url),
        _ => Ok(Store::memory()),
    }
}

/// The server secret: `IDEMPOTENCY_SECRET` (the same on every instance), or, on the in-memory
/// store only, a random one for this process.
pub(crate) fn secret(store: &Store) -> Result<Vec<u8>, String> {
    match std::env::var("IDEMPOTENCY_SECRET") {
        Ok(secret) if !secret.is_empty() => Ok(secret.into_bytes()),
        _ if store.describe().starts_with("memory") => {
            let mut secret = vec![0u8; 32];
            rand::fill(&mut secret[..]);
            println!("IDEMPOTENCY_SECRET is not set: using a random secret for this process");
            Ok(secret)
        }
        _ => Err(
            "set IDEMPOTENCY_SECRET (at least 16 bytes, the same on every instance sharing the store)"
                .into(),
        ),
    }
}
