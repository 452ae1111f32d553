//! After the handler: store its outcome atomically with the release of the lease (only if the
//! lease is still ours), or release without storing. A small response is stored whole; a
//! streamed one was appended part by part ([`crate::tee`]) and is ended here.

use std::borrow::Cow;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::Instant;

use distlock::{LockError, LockGuard};
use http::{HeaderMap, HeaderName, StatusCode};
use tracing::Instrument;

use crate::headers;
use crate::live::Live;
use crate::metrics::{Event, count, store_latency};
use crate::outcome::UnknownOutcome;
use crate::record::{self, Kind, Part};
use crate::run::Run;

/// Stores a final response whole (nothing was appended): its status, kept headers, body
/// (`None`: not kept, only the status, headers and `grpc-status` trailer are) and trailers.
pub(crate) async fn response(
    run: Box<Run>,
    status: StatusCode,
    headers: &HeaderMap,
    body: Option<&[u8]>,
    trailers: Option<&HeaderMap>,
) {
    let record = whole(&run, status, headers, body, trailers);
    // A body not kept is what would be stored instead.
    let instead = match body {
        Some(_) => Instead::Head(status, headers, trailers),
        None => Instead::Unknown,
    };
    store(run, &record, Event::Executed, instead).await;
}

/// The sealed record of a final response stored whole (without its body: with its
/// `grpc-status` trailer only, see [`outcome_trailers`]).
pub(crate) fn whole(
    run: &Run,
    status: StatusCode,
    headers: &HeaderMap,
    body: Option<&[u8]>,
    trailers: Option<&HeaderMap>,
) -> Vec<u8> {
    let vary = headers::negotiated(headers, &run.negotiated);
    let mut head = run.head(Kind::Response, status, (headers, false), &vary);
    let kept = stored_trailers(run, trailers);
    let trailers = kept.as_deref();
    // A response with more header values than a record holds is not kept either: a replay
    // must not miss any.
    let body = body.filter(|_| head.fits() && record::fits(trailers));
    let outcome;
    let trailers = match body {
        Some(_) => trailers,
        None => {
            tracing::warn!(
                limit = run.config.record_limit,
                "idempotency: response body not kept (over the storage limit, more header values than a record holds, or the handler said so); storing the outcome without it"
            );
            head.kind = Kind::BodyNotKept;
            outcome = outcome_trailers(trailers);
            outcome.as_ref()
        }
    };
    run.sealer()
        .seal_whole(&head, body.unwrap_or_default(), trailers)
}

/// The trailers stored with a response ([`headers::kept_trailers`]).
fn stored_trailers<'a>(run: &Run, trailers: Option<&'a HeaderMap>) -> Option<Cow<'a, HeaderMap>> {
    Some(headers::kept_trailers(
        &run.config,
        Cow::Borrowed(trailers?),
    ))
}

/// The trailers kept with an outcome stored without its body: `grpc-status` alone (a gRPC
/// call's outcome, which the retry's `response-not-stored` names); nothing else of a body that
/// is not kept stays in the store.
fn outcome_trailers(trailers: Option<&HeaderMap>) -> Option<HeaderMap> {
    let status = trailers?.get(GRPC_STATUS)?;
    let mut kept = HeaderMap::with_capacity(1);
    kept.insert(GRPC_STATUS, status.clone());
    Some(kept)
}

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Ends a streamed record (its head and chunks were appended) of a response with `status` and
/// `headers`: whether the body was kept, its length, its trailers.
pub(crate) async fn end(
    run: Box<Run>,
    status: StatusCode,
    headers: &HeaderMap,
    kept: bool,
    len: u64,
    trailers: Option<&HeaderMap>,
) {
    if !kept {
        tracing::warn!(
            limit = run.config.record_limit,
            len,
            "idempotency: streamed response body not kept (over the storage limit, or a part could not be appended); its outcome is stored without it"
        );
    }
    let index = run.guard.appended();
    let outcome = if kept {
        None
    } else {
        outcome_trailers(trailers)
    };
    let stored = stored_trailers(&run, trailers);
    let ended = if kept {
        stored.as_deref()
    } else {
        outcome.as_ref()
    };
    let record = run
        .sealer()
        .seal_end(index, run.guard.fence(), kept, len, ended);
    // Refused (a part lost behind the record's back): the outcome is still known.
    let instead = Instead::Head(status, headers, trailers);
    store(run, &record, Event::Executed, instead).await;
}

/// The handler started and its outcome cannot be known (`why`): record it or release the key,
/// as the layer is configured. Never cancelled: a `cancel_on_disconnect` execution, cancelled
/// with its client while the handler runs, records what the handler left in a task of its
/// own (dropped on its way to the store, the record would be lost and the key released, and
/// a retry would run the handler again).
pub(crate) async fn unknown(run: Box<Run>, why: &'static str) {
    run.span.record("outcome", "unknown");
    if run.config.cancel_on_disconnect
        && let Ok(runtime) = tokio::runtime::Handle::try_current()
    {
        let span = run.span.clone();
        // The task is an execution that `Store::drain` waits for, whatever becomes of this one.
        let live = Live::new(&run.config);
        let recording = async move {
            let _live = live;
            unknown_now(run, why).await;
        };
        let _ = runtime.spawn(recording.instrument(span)).await;
        return;
    }
    unknown_now(run, why).await;
}

async fn unknown_now(run: Box<Run>, why: &str) {
    let fence = run.guard.fence();
    if run.config.same_transaction {
        // The handler's writes are rolled back with the transaction: nothing happened, and a
        // retry runs it cleanly.
        tracing::warn!(
            fence,
            why,
            "idempotency: the handler failed; its transaction is rolled back, the key released"
        );
        release(run, Event::NotStored).await;
        return;
    }
    // The fence the handler was given, for a key that names a thing (the record's is the one
    // the outcome-unknown problem names).
    let thing_fence = run.thing.as_ref().map(LockGuard::fence);
    match run.config.unknown_outcome {
        UnknownOutcome::Release => {
            tracing::warn!(
                fence,
                thing_fence,
                why,
                "idempotency: outcome unknown; releasing the key, a retry runs the handler again"
            );
            release(run, Event::Unknown).await;
        }
        UnknownOutcome::Record => {
            tracing::warn!(
                fence,
                thing_fence,
                why,
                "idempotency: outcome unknown; recorded, retries get outcome-unknown"
            );
            let record = match run.guard.appended() {
                0 => run.unknown_whole(),
                index => run.sealer().seal_unknown(index, fence),
            };
            store(run, &record, Event::Unknown, Instead::Unknown).await;
        }
    }
}

/// Releases the key without storing anything (and drops what was appended): a retry runs the
/// handler again.
pub(crate) async fn release(run: Box<Run>, event: Event) {
    if let Err(error) = run.guard.abort().await {
        tracing::debug!(%error, "idempotency: release failed; the lease will expire");
    }
    count(event);
}

/// What is stored in place of a record the store refuses (its parts lost mid-stream, a full
/// in-memory store, a record over the store's part limit, a script error): the handler has
/// answered, so its outcome without the body (status, kept headers, `grpc-status`: a retry gets 410
/// `response-not-stored`) when the response is known; otherwise that the outcome is unknown
/// (with [`UnknownOutcome::Record`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Instead<'a> {
    /// The refused record is a whole response: its head, read back from it.
    ItsHead,
    /// The response's status, headers and trailers (a streamed record, whose head was
    /// appended).
    Head(StatusCode, &'a HeaderMap, Option<&'a HeaderMap>),
    /// No response to tell of (or the refused record already is the outcome without its body).
    Unknown,
}

/// What to store in place of `refused`, and what it tells: the response without its body
/// (executed), or that the outcome is unknown.
fn replacement(run: &Run, refused: &[u8], instead: Instead<'_>) -> Option<(Vec<u8>, Event)> {
    match without_body(run, refused, instead) {
        Some(not_kept) => Some((not_kept, Event::Executed)),
        None if run.config.unknown_outcome == UnknownOutcome::Record => {
            Some((run.unknown_whole(), Event::Unknown))
        }
        None => None,
    }
}

/// The sealed outcome of a response without its body, stored in place of `refused`.
fn without_body(run: &Run, refused: &[u8], instead: Instead<'_>) -> Option<Vec<u8>> {
    let seal = |status, headers: &HeaderMap, vary: &HeaderMap, trailers| {
        run.sealer().seal_whole(
            &run.head(Kind::BodyNotKept, status, (headers, false), vary),
            &[],
            outcome_trailers(trailers).as_ref(),
        )
    };
    match instead {
        Instead::Head(status, headers, trailers) => Some(seal(
            status,
            headers,
            &headers::negotiated(headers, &run.negotiated),
            trailers,
        )),
        // Read back only once the store has refused it: nothing is kept for this meanwhile.
        Instead::ItsHead => match run.sealer().open_part(0, 0, refused) {
            Ok(Part::Whole(record)) if record.head.kind == Kind::Response => Some(seal(
                record.head.status,
                &record.head.headers,
                &record.head.vary,
                Some(&record.trailers),
            )),
            _ => None,
        },
        Instead::Unknown => None,
    }
}

async fn store(run: Box<Run>, record: &[u8], event: Event, instead: Instead<'_>) {
    store_then(run, record, event, instead, || {}).await;
}

/// Stores `record` (completing the run) and calls `sent` as soon as the store command is on its
/// way (sent to the store, or already answered): the response can go to the client while the
/// store answers, the lease keeping the key until then. A command sent before the response goes
/// out is ahead of any command the client's retry can cause on this instance's connection. On
/// a store whose commands may overtake each other (Postgres: each takes a connection of the
/// pool) the store's answer is waited for first, for up to the command timeout: else a retry,
/// or an operator's look, right after the response could find the key still in flight. A
/// record the store refuses is replaced as `instead` says.
/// Stores `record`, calling `sent` as soon as the store command is on its way; returns what
/// became of it (`event` when it is stored).
pub(crate) async fn store_then(
    mut run: Box<Run>,
    record: &[u8],
    event: Event,
    instead: Instead<'_>,
    sent: impl FnOnce(),
) -> Event {
    let started = Instant::now();
    let fence = run.guard.fence();
    // A one-part record is kept in the replay cache once stored (the epoch: unless a purge is
    // heard before the answer).
    let cache = (run.config.store.cache())
        .filter(|_| run.guard.appended() == 0)
        .map(|cache| (cache, cache.epoch()));
    let stored = {
        let in_order = run.config.store.client().sends_in_order();
        let timeout = run.guard.guard().config().op_timeout();
        let mut completing = pin!(run.guard.try_complete(record));
        let first = if in_order {
            poll_fn(|cx| Poll::Ready(completing.as_mut().poll(cx))).await
        } else {
            match tokio::time::timeout(timeout, completing.as_mut()).await {
                Ok(stored) => Poll::Ready(stored),
                Err(_) => Poll::Pending,
            }
        };
        sent();
        match first {
            Poll::Ready(stored) => stored,
            Poll::Pending => completing.await,
        }
    };
    let event = match stored {
        Ok(()) => {
            if let Some((cache, epoch)) = cache {
                let name = run.guard.guard().name();
                cache.insert(name, record, started, run.config.retention, epoch);
            }
            event
        }
        Err(LockError::LeaseLost { reason, .. }) => {
            tracing::warn!(fence, %reason, "idempotency: lease lost while the handler ran; outcome NOT stored");
            Event::LeaseLost
        }
        // The store answered, and refused this record (its parts were evicted mid-stream, a
        // full memory store, a script error): the handler ran, so store what is known of its
        // outcome rather than release the key for a second run: the response without its
        // body, or that the outcome is unknown (unless unknown outcomes are to release the
        // key: `UnknownOutcome::Release`).
        Err(
            error @ (LockError::BrokenRecord { .. }
            | LockError::Capacity { .. }
            | LockError::TooLarge { .. }
            | LockError::Redis { .. }),
        ) => match replacement(&run, record, instead) {
            // Boxed: the rare case's state is not every request's.
            Some((replacement, replaced)) => {
                match Box::pin(run.guard.complete_whole(&replacement)).await {
                    Ok(()) if replaced == Event::Unknown => {
                        tracing::warn!(fence, %error, "idempotency: the outcome could not be stored; recorded as unknown, retries get outcome-unknown");
                        Event::Unknown
                    }
                    Ok(()) => {
                        tracing::warn!(fence, %error, "idempotency: the response could not be stored; its outcome is stored without its body, retries get response-not-stored");
                        Event::Executed
                    }
                    Err(again) => {
                        tracing::warn!(fence, %error, %again, "idempotency: could not store the outcome; a retry will run the handler again");
                        Event::StoreError
                    }
                }
            }
            None => {
                tracing::warn!(fence, %error, "idempotency: could not store the outcome; a retry will run the handler again");
                Event::StoreError
            }
        },
        Err(error) => {
            tracing::warn!(fence, %error, "idempotency: could not store the outcome; a retry will run the handler again");
            Event::StoreError
        }
    };
    store_latency("complete", started.elapsed());
    count(event);
    event
}
