//! After the handler: store its response (status, kept headers, body) atomically with the lease
//! release, only if the lease is still ours; or release without storing.

use std::time::Instant;

use bytes::Bytes;
use distlock::LockError;
use http::Response;
use http_body::Body;

use crate::begin::Run;
use crate::body::{Collected, ResponseBody, collect_response};
use crate::metrics::{Outcome, count, store_latency};
use crate::record;
use tracing::Instrument;

pub(crate) async fn complete<B>(run: Box<Run>, response: Response<B>) -> Response<ResponseBody<B>>
where
    B: Body<Data = Bytes>,
{
    let span = run.span.clone();
    store(run, response).instrument(span).await
}

async fn store<B>(run: Box<Run>, response: Response<B>) -> Response<ResponseBody<B>>
where
    B: Body<Data = Bytes>,
{
    let Run {
        guard,
        fingerprint,
        config,
        span: _,
    } = *run;
    let (parts, body) = response.into_parts();
    if !(config.store_if)(parts.status) {
        // Release now, so that a retry right after this response runs the handler again.
        if let Err(error) = guard.abort().await {
            tracing::debug!(%error, "idempotency: release failed; the lease will expire");
        }
        count(Outcome::NotStored);
        return Response::from_parts(parts, ResponseBody::inner(body));
    }
    let (stored_body, live_body) = match collect_response(body, config.record_limit).await {
        Ok(Collected::Complete(bytes)) => (Some(bytes.clone()), ResponseBody::full(bytes)),
        Ok(Collected::TooLarge { read, rest }) => {
            tracing::warn!(
                limit = config.record_limit,
                "idempotency: response body over the storage limit; storing the outcome without it"
            );
            (None, ResponseBody::prefixed(read, rest))
        }
        Err(error) => {
            // The handler's body failed: nothing complete to store. Release and pass the error on.
            let _ = guard.abort().await;
            count(Outcome::NotStored);
            return Response::from_parts(parts, ResponseBody::failed(error));
        }
    };
    let record = record::encode(
        &fingerprint,
        parts.status,
        &parts.headers,
        |name| config.replay_headers.keeps(name),
        stored_body.as_deref(),
    );
    let started = Instant::now();
    let fence = guard.fence();
    let outcome = match guard.complete(&record).await {
        Ok(()) => Outcome::Executed,
        Err(LockError::LeaseLost { reason, .. }) => {
            tracing::warn!(fence, %reason, "idempotency: lease lost while the handler ran; outcome NOT stored");
            Outcome::LeaseLost
        }
        Err(error) => {
            tracing::warn!(fence, %error, "idempotency: could not store the outcome; a retry will run the handler again");
            Outcome::StoreError
        }
    };
    store_latency("complete", started.elapsed());
    count(outcome);
    Response::from_parts(parts, live_body)
}
