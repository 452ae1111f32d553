//! Turning a stored record back into a response: a whole record at once, a streamed one part by
//! part (never assembled in memory), and a record still being written, joined live.
//!
//! A streamed body that cannot be read to its end (a part missing, altered or of another
//! execution, the writer gone before its end, the store unreachable) breaks off with an error:
//! the client sees an aborted body, never a complete short one.

use std::borrow::Cow;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use distlock::once::{Follower, RecordState};
use distlock::{LockError, Once};
use futures_util::future::Either;
use http::{HeaderMap, HeaderName, HeaderValue, Response, header};
use http_body::Frame;

use crate::Rejection;
use crate::body::{BoxError, Feed, Message, ResponseBody};
use crate::drive::Execution;
use crate::headers::{GRPC_STATUS, joined, kept_headers, kept_trailers};
use crate::layer::Config;
use crate::metrics::Event;
use crate::problem::html::EarlierAnswer;
use crate::record::{Head, Kind, Part, Record, Sealer};

/// Marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Parts read per round trip while replaying or following a streamed record.
const BATCH: usize = 4;

/// What a request knows about the record it replays.
pub(crate) struct Stored<'a> {
    pub(crate) once: &'a Once,
    /// The record key; `None` for records kept in clear (the in-memory store).
    pub(crate) key: Option<&'a [u8; 32]>,
    pub(crate) name: &'a str,
    pub(crate) fingerprint: &'a [u8; 32],
    pub(crate) request: &'a http::request::Parts,
}

fn unreadable<B>(config: &Config, reason: String) -> (Response<ResponseBody<B>>, Event) {
    tracing::error!(%reason, "stored idempotency record is unreadable; not running the handler again");
    (
        config.problem(&Rejection::RecordUnreadable { reason }),
        Event::StoreError,
    )
}

/// The answer to a request whose key has a completed record.
pub(crate) async fn replay<B>(
    config: &Arc<Config>,
    stored: Stored<'_>,
    record: distlock::once::Record,
) -> (Response<ResponseBody<B>>, Event) {
    let sealer = Sealer::of(stored.key, stored.name);
    let parts = record.parts();
    let head = match sealer.open_part(0, 0, record.first()) {
        Ok(Part::Whole(whole)) if parts == 1 => return replay_whole(config, &stored, whole),
        Ok(Part::Head(head)) if parts > 1 => head,
        Ok(_) => {
            return unreadable(
                config,
                format!("a record of {parts} parts starts with the wrong part"),
            );
        }
        Err(reason) => return unreadable(config, reason),
    };
    if let Err(refused) = check(config, &head, &stored) {
        return refused;
    }
    // The end says whether the body was kept, and how the execution ended.
    let end = parts - 1;
    let last = match stored.once.parts(end, 1).await {
        Ok(read) if read.state() == (RecordState::Done { parts }) && read.fence() == head.fence => {
            read.into_parts().into_iter().next()
        }
        // Not the record the look found complete (its part count, its writer's fence): it went
        // (expired at that moment, or lost in a failover to a replica that never had it), or
        // another was stored since. Not a broken record: the retry decides on what the store
        // holds now.
        Ok(read) => {
            tracing::warn!(
                key = stored.name,
                state = ?read.state(),
                "idempotency: a stored record changed between the look and the read"
            );
            let rejection = Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            };
            return (config.problem(&rejection), Event::StoreError);
        }
        Err(LockError::BrokenRecord { detail, .. }) => return unreadable(config, detail),
        Err(error) => {
            tracing::warn!(%error, "idempotency: could not read a stored record");
            let rejection = Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            };
            return (config.problem(&rejection), Event::StoreError);
        }
    };
    let Some(last) = last else {
        return unreadable(config, "the end of a streamed record is missing".into());
    };
    // A body whose length is known is announced: a client without chunked encoding (HTTP/1.0)
    // then tells a body that breaks off from one that ended. (Not with trailers, which only a
    // chunked body carries over HTTP/1.1.)
    let length = match sealer.open_part(end, head.fence, &last) {
        Ok(Part::End {
            kept: true,
            len,
            trailers,
        }) => (trailers.is_empty() && has_body(head.status)).then_some(len),
        Ok(Part::End {
            kept: false,
            trailers,
            ..
        }) => {
            return (not_kept(config, head, &trailers), Event::Replayed);
        }
        Ok(Part::Unknown) => {
            let rejection = Rejection::OutcomeUnknown { fence: head.fence };
            return (replayed(config.problem(&rejection)), Event::Replayed);
        }
        Ok(_) => return unreadable(config, "a streamed record ends with the wrong part".into()),
        Err(reason) => return unreadable(config, reason),
    };
    let source = Source::Stored {
        once: stored.once.clone(),
        parts,
        length,
    };
    let response = streamed(config, head, source, stored.key, stored.name);
    (response, Event::Replayed)
}

/// The answer to a request that joins a record still being written (its head is stored): the
/// head at once, the stored chunks, then the live ones until the end.
pub(crate) async fn join<B>(
    config: &Arc<Config>,
    stored: Stored<'_>,
    writer: u64,
) -> (Response<ResponseBody<B>>, Event) {
    let sealer = Sealer::of(stored.key, stored.name);
    let mut follower = stored.once.follow(0).expect_writer(writer);
    let until =
        tokio::time::Instant::now().into_std() + config.store.client().config().op_timeout();
    let first = match follower.next(1, until).await {
        Ok(read) => read.into_parts().into_iter().next(),
        Err(error) => {
            tracing::warn!(%error, "idempotency: could not follow a response being stored");
            let rejection = Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            };
            return (config.problem(&rejection), Event::StoreError);
        }
    };
    let Some(first) = first else {
        // The writer stopped before or while we looked: nothing to join; the retry decides.
        let rejection = Rejection::Conflict {
            retry_after: config.conflict_retry_after(None),
        };
        return (config.problem(&rejection), Event::Conflict);
    };
    let head = match sealer.open_part(0, 0, &first) {
        Ok(Part::Head(head)) if head.fence == writer => head,
        // The writer's streamed record broke (its parts lost) and it stored in their place, in
        // one part, what it could say (its outcome without its body, or unknown): a complete
        // record, replayed as a retry a moment later would be.
        Ok(Part::Whole(whole)) if whole.head.fence == writer => {
            return replay_whole(config, &stored, whole);
        }
        Ok(_) => {
            return unreadable(
                config,
                "a streamed record starts with the wrong part".into(),
            );
        }
        Err(reason) => return unreadable(config, reason),
    };
    if let Err(refused) = check(config, &head, &stored) {
        return refused;
    }
    let response = streamed(
        config,
        head,
        Source::Live(Box::new(follower)),
        stored.key,
        stored.name,
    );
    (response, Event::Replayed)
}

/// Whether a response of this status has a body to announce (1xx, 204 and 304 have none).
fn has_body(status: http::StatusCode) -> bool {
    !(status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED)
}

/// The fingerprint and `Vary` checks of a stored head against this request.
#[allow(clippy::result_large_err)]
fn check<B>(
    config: &Config,
    head: &Head,
    stored: &Stored<'_>,
) -> Result<(), (Response<ResponseBody<B>>, Event)> {
    if &head.fingerprint != stored.fingerprint {
        let mut refused = config.problem(&Rejection::KeyReused);
        // Where the first answer points (a created account), for a person's page.
        if let Some(location) = (head.headers.get(http::header::LOCATION))
            .filter(|_| config.replay_headers.keeps(&http::header::LOCATION))
            .and_then(|l| l.to_str().ok())
        {
            (refused.extensions_mut()).insert(EarlierAnswer(location.to_owned()));
        }
        return Err((refused, Event::Mismatch));
    }
    // A response negotiated for other request headers (a gzip body for a client that accepts
    // only identity) is not this request's to replay.
    for (name, value) in &head.vary {
        let theirs = joined(&stored.request.headers, name);
        if !suits(config, name, value, theirs.as_ref(), &head.headers) {
            let rejection = Rejection::NotAcceptable {
                header: name.as_str().to_owned(),
            };
            return Err((config.problem(&rejection), Event::Rejected));
        }
    }
    Ok(())
}

/// Whether the response stored for a request that sent `stored` as its `name` header (one of
/// the response's `Vary` headers) suits this request, which sent `theirs`: the same list
/// (spacing around its commas aside), or, for `Accept-Encoding`, a response without a content
/// coding that this request does not refuse (RFC 9110, 12.5.3: identity is acceptable unless
/// the request says `identity;q=0`, or `*;q=0` without an entry for `identity`). Only under a
/// header policy that keeps `Content-Encoding`: under one that drops it, a stored head without
/// it says nothing of the body's coding.
fn suits(
    config: &Config,
    name: &HeaderName,
    stored: &HeaderValue,
    theirs: Option<&HeaderValue>,
    response: &HeaderMap,
) -> bool {
    fn listed(value: Option<&HeaderValue>) -> impl Iterator<Item = &[u8]> {
        value
            .map_or(&[][..], HeaderValue::as_bytes)
            .split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|e| !e.is_empty())
    }
    if listed(Some(stored)).eq(listed(theirs)) {
        return true;
    }
    name == header::ACCEPT_ENCODING
        && config.replay_headers.keeps(&header::CONTENT_ENCODING)
        && response
            .get_all(header::CONTENT_ENCODING)
            .iter()
            .flat_map(|c| c.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case(b"identity"))
        && accepts_identity(theirs)
}

/// Whether an `Accept-Encoding` value leaves a response without content coding acceptable.
fn accepts_identity(accept: Option<&HeaderValue>) -> bool {
    let Some(accept) = accept else {
        return true;
    };
    let mut anything_refused = false;
    for element in accept.as_bytes().split(|b| *b == b',') {
        let mut parts = element.split(|b| *b == b';');
        let coding = parts.next().unwrap_or_default().trim_ascii();
        let refused = parts.any(|param| {
            let param = param.trim_ascii();
            param.len() >= 2 && param[..2].eq_ignore_ascii_case(b"q=") && is_zero(&param[2..])
        });
        if coding.eq_ignore_ascii_case(b"identity") {
            return !refused;
        }
        if coding == b"*" {
            anything_refused = refused;
        }
    }
    !anything_refused
}

/// Whether a `qvalue` is zero (`0`, `0.`, `0.0`, up to three decimals).
fn is_zero(q: &[u8]) -> bool {
    match q.trim_ascii().split_first() {
        Some((b'0', rest)) => {
            rest.first().is_none_or(|dot| *dot == b'.') && rest.iter().skip(1).all(|d| *d == b'0')
        }
        _ => false,
    }
}

fn replay_whole<B>(
    config: &Config,
    stored: &Stored<'_>,
    record: Record,
) -> (Response<ResponseBody<B>>, Event) {
    if let Err(refused) = check(config, &record.head, stored) {
        return refused;
    }
    let response = match record.head.kind {
        Kind::Response => {
            let trailers = kept_trailers(config, Cow::Owned(record.trailers)).into_owned();
            let trailers = (!trailers.is_empty()).then_some(trailers);
            let mut response = Response::new(ResponseBody::full(record.body, trailers));
            *response.status_mut() = record.head.status;
            *response.headers_mut() = kept_headers(config, record.head.headers);
            replayed(response)
        }
        Kind::BodyNotKept => not_kept(config, record.head, &record.trailers),
        Kind::Unknown => replayed(config.problem(&Rejection::OutcomeUnknown {
            fence: record.head.fence,
        })),
    };
    (response, Event::Replayed)
}

fn replayed<B>(mut response: Response<ResponseBody<B>>) -> Response<ResponseBody<B>> {
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The answer for an outcome stored without its body: never a 2xx with a body the handler did
/// not produce; the stored headers (a `Location`, say) still tell the client where the result is,
/// but not those that described the body ([`DESCRIBE_THE_BODY`]) nor a gRPC status; the
/// response's `grpc-status` (its `trailers`, or its head when it had none) is named.
fn not_kept<B>(config: &Config, head: Head, trailers: &HeaderMap) -> Response<ResponseBody<B>> {
    let grpc_status = [trailers, &head.headers]
        .into_iter()
        .find_map(|headers| headers.get("grpc-status"))
        .and_then(|code| code.to_str().ok()?.parse().ok());
    let mut response = config.problem(&Rejection::ResponseNotStored {
        status: head.status,
        limit: config.record_limit,
        grpc_status,
    });
    for (name, value) in &kept_headers(config, head.headers) {
        // Nor the status a trailers-only gRPC response carried in its head: the rejection's own
        // `grpc-status` must be the only one (a client that reads the last of two would take
        // the stored `0` for a success).
        if !DESCRIBE_THE_BODY.contains(name) && !GRPC_STATUS.contains(name) {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    replayed(response)
}

/// Headers that describe a response's body (its representation), not the resource: they
/// would misdescribe a problem that replaces the body (a client decoding `content-encoding:
/// gzip` fails on plain JSON).
const DESCRIBE_THE_BODY: [HeaderName; 14] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::CONTENT_RANGE,
    header::CONTENT_DISPOSITION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::TRAILER,
    HeaderName::from_static("content-digest"),
    HeaderName::from_static("repr-digest"),
    HeaderName::from_static("digest"),
    HeaderName::from_static("content-md5"),
];

/// Where the parts of a streamed body come from.
enum Source {
    /// A completed record of `parts` parts, whose body's `length` is announced (when known and
    /// announceable: not with trailers, nor on a status without a body).
    Stored {
        once: Once,
        parts: u64,
        length: Option<u64>,
    },
    /// A record still being written, followed live.
    Live(Box<Follower>),
}

impl Source {
    /// The body's length, when it is known and announced: a completed record's; for one being
    /// written, the length its head announced to the first client (kept in the record whatever
    /// the header policy, see `Run::head`), which its writer is held to.
    fn length(&self, head: &Head) -> Option<u64> {
        match self {
            Source::Stored { length, .. } => *length,
            Source::Live(_) if has_body(head.status) => {
                let announced = head.headers.get(header::CONTENT_LENGTH)?;
                announced.to_str().ok()?.parse().ok()
            }
            Source::Live(_) => None,
        }
    }
}

/// A response whose body is read from the store part by part while the client reads it.
fn streamed<B>(
    config: &Arc<Config>,
    head: Head,
    source: Source,
    key: Option<&[u8; 32]>,
    name: &str,
) -> Response<ResponseBody<B>> {
    // Driven by the body: a client that reads nothing holds nothing.
    let (feed, mut body) = Feed::channel(None);
    let length = source.length(&head);
    let reading = read(
        source,
        length,
        feed,
        (config.clone(), key.copied(), name.to_owned()),
        head.fence,
    );
    // The body drives the reading while the client reads; dropping it stops the reading.
    let _ = body.drive(Execution::cancellable(Box::pin(reading)));
    let mut response = Response::new(body);
    *response.status_mut() = head.status;
    *response.headers_mut() = kept_headers(config, head.headers);
    if let Some(length) = length {
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    }
    replayed(response)
}

/// Reads a streamed record's chunks (from part 1) into the client's body, until its end part;
/// anything else breaks the body off with an error.
///
/// A completed record's parts are read with plain list reads (its state was read when it was
/// found done), and its next batch while the current one is opened and sent: the store's round
/// trip overlaps the work on the parts already here. At most two batches and the feed's frames
/// are held at once.
async fn read(
    mut source: Source,
    limit: Option<u64>,
    mut feed: Feed,
    (config, key, name): (Arc<Config>, Option<[u8; 32]>, String),
    writer: u64,
) {
    let sealer = Sealer::of(key.as_ref(), &name);
    let mut next = 1u64;
    let mut len = 0u64;
    // `limit`, the announced length: no chunk may take the body past it (the server would cut
    // the body there, and the client would see a complete response).
    // The next batch of a stored record, read ahead.
    let mut ahead: Option<Result<Vec<bytes::Bytes>, LockError>> = None;
    let outcome: Result<(), BoxError> = loop {
        let (from, parts, state) = match &mut source {
            Source::Stored { once, parts, .. } => {
                if next >= *parts {
                    break Err("the stored record has no end".into());
                }
                let read = match ahead.take() {
                    Some(read) => read,
                    None => once.stored_parts(next, BATCH).await,
                };
                match read {
                    Ok(read) => (next, read, None),
                    Err(error) => {
                        break Err(format!("the stored record could not be read: {error}").into());
                    }
                }
            }
            Source::Live(follower) => {
                let until = tokio::time::Instant::now().into_std() + Duration::from_secs(1);
                match follower.next(BATCH, until).await {
                    Ok(read) => {
                        let state = read.state();
                        (read.from(), read.into_parts(), Some(state))
                    }
                    Err(error) => {
                        break Err(format!(
                            "the response being stored could not be followed: {error}"
                        )
                        .into());
                    }
                }
            }
        };
        if from != next {
            break Err(format!("expected part {next}, the store gave part {from}").into());
        }
        next = from + parts.len() as u64;
        let none_read = parts.is_empty();
        let read_ahead = match &source {
            Source::Stored {
                once, parts: total, ..
            } if !none_read && next < *total => Some(once.stored_parts(next, BATCH)),
            _ => None,
        };
        // The read ahead is polled first, so its command leaves before the parts are opened;
        // a body that ends or breaks off here does not wait for it.
        let ended = match read_ahead {
            None => deliver(&sealer, &mut feed, from, parts, writer, &mut len, limit).await,
            Some(read) => {
                let read = pin!(read);
                let delivered = pin!(deliver(
                    &sealer, &mut feed, from, parts, writer, &mut len, limit
                ));
                match futures_util::future::select(read, delivered).await {
                    Either::Left((read, delivered)) => {
                        ahead = Some(read);
                        delivered.await
                    }
                    Either::Right((None, read)) => {
                        ahead = Some(read.await);
                        None
                    }
                    Either::Right((ended, _)) => ended,
                }
            }
        };
        match ended {
            Some(Ok(trailers)) => {
                let trailers = kept_trailers(&config, Cow::Owned(trailers)).into_owned();
                if !trailers.is_empty() {
                    feed.send(Message::Frame(Frame::trailers(trailers))).await;
                }
                break Ok(());
            }
            Some(Err(error)) => break Err(error),
            None => {}
        }
        match state {
            Some(RecordState::Abandoned) => {
                break Err("the execution stopped before its response ended".into());
            }
            Some(RecordState::Done { parts: done }) if next >= done => {
                break Err("the record ended without its end part".into());
            }
            _ => {}
        }
        if none_read && matches!(source, Source::Stored { .. }) {
            break Err("the stored record is missing parts".into());
        }
    };
    match outcome {
        Ok(()) => {
            feed.send(Message::End).await;
        }
        Err(error) => {
            tracing::warn!(%error, "idempotency: a stored response body broke off");
            feed.send(Message::Error(error)).await;
        }
    }
}

/// Opens parts `from..` and sends their chunks to the client; `len` counts the bytes sent, and
/// never goes past `limit`. Returns the body's end (its trailers) when the end part is among
/// them, an error when a part is not what it must be, and `None` when more parts follow.
async fn deliver(
    sealer: &Sealer<'_>,
    feed: &mut Feed,
    from: u64,
    parts: Vec<bytes::Bytes>,
    writer: u64,
    len: &mut u64,
    limit: Option<u64>,
) -> Option<Result<HeaderMap, BoxError>> {
    for (i, sealed) in parts.into_iter().enumerate() {
        let index = from + i as u64;
        match sealer.open_part_owned(index, writer, sealed) {
            Ok(Part::Chunk(data)) => {
                let after = *len + data.len() as u64;
                if let Some(limit) = limit
                    && after > limit
                {
                    return Some(Err(format!(
                        "the chunks hold more than the record's {limit} bytes"
                    )
                    .into()));
                }
                *len = after;
                feed.send(Message::Frame(Frame::data(data))).await;
            }
            Ok(Part::End {
                kept: true,
                len: stored,
                trailers,
            }) => {
                return Some(if stored == *len {
                    Ok(trailers)
                } else {
                    Err(format!("the record says {stored} bytes, its chunks hold {len}").into())
                });
            }
            Ok(Part::End { kept: false, .. }) => {
                return Some(Err(
                    "the response's body was not kept (over the storage limit, or not storable)"
                        .into(),
                ));
            }
            Ok(Part::Unknown) => {
                return Some(Err("the response broke off: its outcome is unknown".into()));
            }
            Ok(_) => return Some(Err(format!("part {index} is not a chunk").into())),
            Err(reason) => return Some(Err(format!("part {index}: {reason}").into())),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_refused_only_by_a_zero_weight() {
        let accepts = |v: &'static str| accepts_identity(Some(&HeaderValue::from_static(v)));
        for yes in [
            "gzip",
            "",
            "identity",
            "identity;q=0.001",
            "*;q=0, identity",
            "*;q=0.5",
            "IDENTITY ; Q=1",
            "*;q=00",
        ] {
            assert!(accepts(yes), "{yes:?}");
        }
        for no in [
            "identity;q=0",
            "identity; q=0.000",
            "*;q=0",
            "gzip, *;Q=0.",
            " identity ;q=0 ",
        ] {
            assert!(!accepts(no), "{no:?}");
        }
        assert!(accepts_identity(None));
    }

    /// Chunks holding more than the record's end says (a writer's bug: records authenticate,
    /// nothing else can write one) are refused before the first byte past the announced
    /// length: the server would cut the body there, and the client would see a complete
    /// response of other bytes (before: sent, the mismatch found only at the end part).
    #[tokio::test]
    async fn no_chunk_goes_past_the_announced_length() {
        use http_body_util::BodyExt;
        let key = [7u8; 32];
        let sealer = Sealer::new(&key, "name");
        let chunk = |index: u64, data: &[u8]| {
            let mut buffer = Sealer::chunk_buffer(data.len());
            buffer.extend_from_slice(data);
            bytes::Bytes::from(sealer.seal_chunk(index, 9, buffer))
        };
        let parts = vec![
            chunk(1, b"abc"),
            chunk(2, b"defgh"),
            bytes::Bytes::from(sealer.seal_end(3, 9, true, 5, None)),
        ];
        let (mut feed, body) = Feed::channel::<http_body_util::Empty<bytes::Bytes>>(None);
        let mut len = 0;
        let ended = deliver(&sealer, &mut feed, 1, parts.clone(), 9, &mut len, Some(5)).await;
        assert!(matches!(ended, Some(Err(_))), "{ended:?}");
        assert_eq!(len, 3, "only the bytes within the length were sent");
        feed.send(Message::End).await;
        drop(feed);
        let sent = body.collect().await.map(|c| c.to_bytes());
        assert_eq!(sent.ok().as_deref(), Some(&b"abc"[..]));
        // Without a length (trailers), the end part's count still refuses the mismatch.
        let (mut feed, _body) = Feed::channel::<http_body_util::Empty<bytes::Bytes>>(None);
        let mut len = 0;
        let ended = deliver(&sealer, &mut feed, 1, parts, 9, &mut len, None).await;
        assert!(matches!(ended, Some(Err(_))), "{ended:?}");
    }

    #[test]
    fn the_current_header_policy_filters_stored_headers() {
        let layer = crate::IdempotencyLayer::builder(crate::Store::memory())
            .global_keys()
            .replay_headers(
                crate::ReplayHeaders::default_deny()
                    .and_deny(["x-secret"])
                    .unwrap(),
            )
            .build()
            .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        let kept = kept_headers(layer.config(), headers);
        assert!(!kept.contains_key("x-secret"));
        assert_eq!(kept.get_all("x-multi").iter().count(), 2);
    }
}
