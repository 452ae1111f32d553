//! What the example services take from the environment: the store and the server secret.

use tower_idempotency::Store;

/// The Postgres database when `DATABASE_URL` is set (feature `postgres`), else Redis when
/// `REDIS_URL` is, memory otherwise. The Postgres store's table is made if missing.
pub(crate) async fn store() -> Result<Store, String> {
    if let Some(url) = database_url()? {
        #[cfg(feature = "postgres")]
        {
            let store = Store::postgres(&url, "idempotency").map_err(|e| e.to_string())?;
            store.prepare().await.map_err(|e| e.to_string())?;
            return Ok(store);
        }
        #[cfg(not(feature = "postgres"))]
        let _ = url;
    }
    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => Store::redis(&url).map_err(|e| e.to_string()),
        _ => Ok(Store::memory()),
    }
}

/// `DATABASE_URL`, if set; an error if this build cannot use it.
pub(crate) fn database_url() -> Result<Option<String>, String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            if cfg!(feature = "postgres") {
                Ok(Some(url))
            } else {
                Err("DATABASE_URL is set: run with --features postgres".into())
            }
        }
        _ => Ok(None),
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
