//! Turning a stored record back into a response.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, header};

use crate::Rejection;
use crate::body::ResponseBody;
use crate::complete::joined;
use crate::layer::Config;
use crate::metrics::Event;
use crate::record::{Kind, Record, Sealer};

/// Marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A rejection as a response with the layer's body type, rendered as the layer is configured.
pub(crate) fn problem<B>(config: &Config, rejection: &Rejection) -> Response<ResponseBody<B>> {
    config
        .render(rejection)
        .map(|body| ResponseBody::full(body, None))
}

/// The answer to a request whose key has a stored record.
pub(crate) fn replay<B>(
    config: &Config,
    sealer: &Sealer<'_>,
    stored: &Bytes,
    fingerprint: &[u8; 32],
    request: &http::request::Parts,
) -> (Response<ResponseBody<B>>, Event) {
    let record = match Record::open(sealer, stored) {
        Ok(record) => record,
        Err(reason) => {
            tracing::error!(%reason, "stored idempotency record is unreadable; not running the handler again");
            return (
                problem(config, &Rejection::RecordUnreadable { reason }),
                Event::StoreError,
            );
        }
    };
    if &record.fingerprint != fingerprint {
        return (problem(config, &Rejection::KeyReused), Event::Mismatch);
    }
    // A response negotiated for other request headers (a gzip body for a client that accepts
    // only identity) is not this request's to replay.
    for (name, value) in &record.vary {
        let theirs = joined(&request.headers, name);
        let same = match theirs {
            Some(theirs) => theirs == value,
            None => value.is_empty(),
        };
        if !same {
            let rejection = Rejection::NotAcceptable {
                header: name.as_str().to_owned(),
            };
            return (problem(config, &rejection), Event::Rejected);
        }
    }
    // The header policy in force now applies to what was stored under an earlier one.
    let mut headers = record.headers;
    if headers
        .keys()
        .any(|name| !config.replay_headers.keeps(name))
    {
        let mut kept = http::HeaderMap::with_capacity(headers.len());
        let mut last = None;
        for (name, value) in headers {
            if let Some(name) = name {
                last = Some(name);
            }
            if let Some(name) = &last
                && config.replay_headers.keeps(name)
            {
                kept.append(name.clone(), value);
            }
        }
        headers = kept;
    }
    let mut response = match record.kind {
        Kind::Response => {
            let mut response = Response::new(ResponseBody::full(
                record.body,
                (!record.trailers.is_empty()).then_some(record.trailers),
            ));
            *response.status_mut() = record.status;
            *response.headers_mut() = headers;
            response
        }
        Kind::BodyNotKept => {
            let mut response = problem(
                config,
                &Rejection::ResponseNotStored {
                    status: record.status,
                    limit: config.record_limit,
                },
            );
            // The stored headers (a `Location`, say) still tell the client where the result is.
            for (name, value) in &headers {
                if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
                    response.headers_mut().append(name.clone(), value.clone());
                }
            }
            response
        }
        Kind::Unknown => problem(
            config,
            &Rejection::OutcomeUnknown {
                fence: record.fence,
            },
        ),
    };
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    (response, Event::Replayed)
}
