//! Turning a stored record back into a response, and choosing what is stored.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response};

use crate::Rejection;
use crate::layer::Config;
use crate::metrics::Outcome;
use crate::record::Record;

/// Marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The answer to a request whose key has a stored record.
pub(crate) fn replay(
    config: &Config,
    stored: &Bytes,
    fingerprint: &[u8; 32],
) -> (Response<Bytes>, Outcome) {
    let record = match Record::decode(stored) {
        Ok(record) => record,
        Err(reason) => {
            tracing::error!(%reason, "stored idempotency record is unreadable; not running the handler again");
            return (
                Rejection::RecordUnreadable { reason }.to_response(),
                Outcome::StoreError,
            );
        }
    };
    if &record.fingerprint != fingerprint {
        return (Rejection::KeyReused.to_response(), Outcome::Mismatch);
    }
    let mut response = match record.body {
        Some(body) => {
            let mut response = Response::new(body);
            *response.status_mut() = record.status;
            *response.headers_mut() = record.headers;
            response
        }
        None => Rejection::ResponseNotStored {
            status: record.status,
            limit: config.record_limit,
        }
        .to_response(),
    };
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    (response, Outcome::Replayed)
}
