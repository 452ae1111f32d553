//! Turning a stored record back into a response.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, header};

use crate::Rejection;
use crate::body::ResponseBody;
use crate::layer::Config;
use crate::metrics::Event;
use crate::record::{Kind, Record, Sealer};

/// Marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A rejection as a response with the layer's body type.
pub(crate) fn problem<B>(rejection: &Rejection) -> Response<ResponseBody<B>> {
    rejection
        .to_response()
        .map(|body| ResponseBody::full(body, None))
}

/// The answer to a request whose key has a stored record.
pub(crate) fn replay<B>(
    config: &Config,
    sealer: &Sealer<'_>,
    stored: &Bytes,
    fingerprint: &[u8; 32],
) -> (Response<ResponseBody<B>>, Event) {
    let record = match Record::open(sealer, stored) {
        Ok(record) => record,
        Err(reason) => {
            tracing::error!(%reason, "stored idempotency record is unreadable; not running the handler again");
            return (
                problem(&Rejection::RecordUnreadable { reason }),
                Event::StoreError,
            );
        }
    };
    if &record.fingerprint != fingerprint {
        return (problem(&Rejection::KeyReused), Event::Mismatch);
    }
    let mut response = match record.kind {
        Kind::Response => {
            let mut response = Response::new(ResponseBody::full(
                record.body,
                (!record.trailers.is_empty()).then_some(record.trailers),
            ));
            *response.status_mut() = record.status;
            *response.headers_mut() = record.headers;
            response
        }
        Kind::BodyNotKept => {
            let mut response = problem(&Rejection::ResponseNotStored {
                status: record.status,
                limit: config.record_limit,
            });
            // The stored headers (a `Location`, say) still tell the client where the result is.
            for (name, value) in &record.headers {
                if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
                    response.headers_mut().append(name.clone(), value.clone());
                }
            }
            response
        }
        Kind::Unknown => problem(&Rejection::OutcomeUnknown {
            fence: record.fence,
        }),
    };
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    (response, Event::Replayed)
}
