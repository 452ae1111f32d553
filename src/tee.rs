//! A final response on its way out: to the client as it comes, into the store as it passes.
//!
//! * A body complete at once (the common case: JSON built in memory, up to 64 KiB) is stored
//!   whole, in one round trip, and sent whole.
//! * Any other body: the head goes to the client as soon as the handler returns it, and every
//!   frame as it arrives (time to first byte is the handler's). On a store that streams
//!   ([`distlock::LockClient::supports_streaming`]) the record is appended as the body passes:
//!   the head first, then the data in chunks of `chunk_size` (sooner when the body pauses, so a
//!   duplicate following the stream sees server-sent events as they happen), then the end with
//!   the trailers. The layer holds at most one chunk of it. On a store that does not stream
//!   (Redlock), the body is kept in memory up to the record limit and stored whole at the end.
//! * Over the record limit, or when the handler said [`KeepBody::No`](crate::KeepBody), the
//!   body is still sent in full, and its outcome (status, headers, `grpc-status` trailer)
//!   stored without it.
//! * A body that fails half-way: the client sees an aborted body; the outcome is unknown. So
//!   does a body that ends short of the `content-length` its head announces (a server aborts
//!   such a response); one longer than announced is cut there, as a server cuts it
//!   ([`Announced`]).

use std::future::poll_fn;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{HeaderMap, Response, StatusCode};
use http_body::{Body, Frame};
use smallvec::SmallVec;
use tokio::sync::oneshot;

use crate::body::{Announced, BoxError, Feed, Message, ResponseBody, Whole};
use crate::complete;
use crate::metrics::Event;
use crate::record::{self, Kind, Sealer};
use crate::run::{Finished, Run};

/// The most read from a body before its head goes out: a body complete within it is stored and
/// sent whole; a longer one is streamed.
const WHOLE_LIMIT: usize = 64 * 1024;

/// How long a paused body may keep data back from the store before it is appended.
const IDLE_FLUSH: Duration = Duration::from_millis(10);

/// The largest piece of data sent to the client at a time (a larger frame is cut, its bytes
/// shared): the stall timeout is how long one piece may wait for room, so a client is given
/// up only when it reads less than this in that time, whatever the handler's frame sizes.
const PIECE: usize = 16 * 1024;

/// Sends the response to the client and stores its outcome; `keep`: whether its body is kept.
pub(crate) async fn tee<B, E>(
    run: Box<Run>,
    mut parts: http::response::Parts,
    body: B,
    keep: bool,
    reply: oneshot::Sender<Finished<B, E>>,
) where
    B: Body,
    B::Error: Into<BoxError>,
{
    crate::body::announce_exact(&mut parts, &body.size_hint());
    // What a server sends of the body: the record is the response the client gets.
    let body = Announced::new(body, &parts);
    let announced = body.left();
    let mut body = pin!(body);
    if run.config.same_transaction {
        // Boxed: the rare case's state is not every request's.
        return Box::pin(after_commit(run, parts, body, keep, reply)).await;
    }
    // Most bodies are one frame: kept inline, not in an allocation.
    let mut early: SmallVec<[Frame<Bytes>; 1]> = SmallVec::new();
    let mut early_len = 0;
    let failed = loop {
        match poll_now(body.as_mut()).await {
            None => break None,
            Some(None) => {
                let (data, trailers) = Whole::from_iter(early).finish();
                let kept = keep && data.len() <= run.config.record_limit;
                let record = complete::whole(
                    &run,
                    parts.status,
                    &parts.headers,
                    kept.then_some(&data[..]),
                    trailers.as_ref(),
                );
                // The response goes out once its record is on its way to the store.
                let respond = move || {
                    let _ = reply.send(Finished::Response(Response::from_parts(
                        parts,
                        ResponseBody::full(data, trailers),
                    )));
                };
                let instead = complete::Instead::ItsHead;
                complete::store_then(run, &record, Event::Executed, instead, respond).await;
                return;
            }
            Some(Some(Ok(frame))) => {
                early_len += frame.data_ref().map_or(0, Bytes::len);
                early.push(frame);
                if early_len > WHOLE_LIMIT {
                    break None;
                }
            }
            Some(Some(Err(error))) => break Some(error),
        }
    };

    // Streamed (the rare case for an API): its own future, boxed, so that every request's
    // execution does not carry its state.
    let early = Early {
        frames: early,
        len: early_len,
        announced,
        failed,
    };
    Box::pin(stream(run, parts, body, keep, reply, early)).await;
}

/// What [`tee`] read of a body before it knew the body would be streamed.
struct Early {
    /// The frames read.
    frames: SmallVec<[Frame<Bytes>; 1]>,
    /// Their data, in bytes.
    len: usize,
    /// The length the head announced, before anything was read.
    announced: Option<u64>,
    /// The error that ended the reading, if one did.
    failed: Option<BoxError>,
}

/// The rest of [`tee`] for a body not read whole at once: the head goes out now, the frames as
/// they come.
async fn stream<B, E, A>(
    run: Box<Run>,
    parts: http::response::Parts,
    mut body: Pin<&mut A>,
    mut keep: bool,
    reply: oneshot::Sender<Finished<B, E>>,
    early: Early,
) where
    A: Body<Data = Bytes, Error = BoxError>,
{
    let Early {
        frames: early,
        len: early_len,
        announced,
        failed,
    } = early;
    // Streamed: the head goes out now, the frames as they come.
    let status = parts.status;
    let headers = parts.headers.clone();
    // A detached execution runs at its own pace: a client that stops reading is given up after
    // the stall timeout. A cancellable one is driven by the client's reading; a body that will
    // not be kept (opted out, its head too large, announced over the record limit or over it
    // in what was read already) is never given up (see `Sink::patience`). Whether the head is
    // too large is known only after it is handed over (below): until then, nothing may wait
    // on the feed (`try_send` only).
    let limit = run.config.record_limit as u64;
    let patient = !keep || announced.is_some_and(|len| len > limit) || early_len as u64 > limit;
    let stall = (!patient && !run.config.cancel_on_disconnect).then_some(run.config.stall_timeout);
    let (mut feed, mut live) = Feed::channel(stall);
    live.storing(announced);
    // What was read goes to the client before anything waits on the store; what fits in the
    // feed is queued before the head is handed over, so that the client's first read of the
    // body finds it (the head and the first frames leave in one write, as without the layer).
    let mut to_client = early.iter().flat_map(pieces);
    let mut no_room = None;
    for message in to_client.by_ref() {
        if let Err(message) = feed.try_send(message) {
            // Sent once the head is handed over.
            no_room = Some(message);
            break;
        }
    }
    let _ = reply.send(Finished::Response(Response::from_parts(parts, live)));
    // Let the task that polled for the head hand it over before this execution goes on: a
    // detached execution then seals and stores the record's head in its own task, while (or
    // after) the connection writes the head and what was queued. Not in
    // `cancel_on_disconnect` mode, where the yield would only cost a wake: the body drives this
    // execution before it reads its first frame, so the record's head is stored before the
    // first byte leaves either way (reading queued frames without driving would let hyper
    // drop a body it has written in full, and cancel the execution before its outcome is
    // stored).
    if !run.config.cancel_on_disconnect {
        tokio::task::yield_now().await;
    }
    // Whether the record can hold the head: known after the head went out (nothing waited on
    // the client in between). More header values than a record holds: the outcome is stored
    // without the body, which is then never given up either.
    let vary = crate::headers::negotiated(&headers, &run.negotiated);
    if keep
        && !run
            .head(Kind::Response, status, (&headers, true), &vary)
            .fits()
    {
        keep = false;
        feed.wait_for_the_client();
    }
    for message in no_room.into_iter().chain(to_client) {
        if !feed.send(message).await {
            break;
        }
    }
    let mut sink = Sink::open(&run, status, &headers, &vary, keep).await;
    for frame in early {
        sink.add(&run, frame).await;
    }
    let mut failed: Option<BoxError> = failed;
    while failed.is_none() {
        let next = match poll_now(body.as_mut()).await {
            Some(next) => next,
            None if sink.holds_memory() => {
                // A steady stream is batched; a pause appends what came so far, and gives back
                // the room made for a full chunk.
                match tokio::time::timeout(IDLE_FLUSH, poll_fn(|cx| poll_frame(body.as_mut(), cx)))
                    .await
                {
                    Ok(next) => next,
                    Err(_) => {
                        sink.flush(&run, 0).await;
                        poll_fn(|cx| poll_frame(body.as_mut(), cx)).await
                    }
                }
            }
            None => poll_fn(|cx| poll_frame(body.as_mut(), cx)).await,
        };
        match next {
            None => break,
            Some(Ok(frame)) => {
                sink.patience(&frame, &mut feed);
                forward(&mut feed, &frame).await;
                sink.add(&run, frame).await;
            }
            Some(Err(error)) => failed = Some(error),
        }
    }
    match failed {
        Some(error) => {
            tracing::warn!(%error, "idempotency: the response body failed half-way");
            complete::unknown(run, "the response body failed half-way").await;
            feed.send(Message::Error(error)).await;
        }
        None => {
            sink.finish(run, status, &headers).await;
            feed.send(Message::End).await;
        }
    }
}

/// Sends a frame to the client, in [`pieces`].
async fn forward(feed: &mut Feed, frame: &Frame<Bytes>) {
    for piece in pieces(frame) {
        if !feed.send(piece).await {
            return;
        }
    }
}

/// A frame for the client (its data shares its bytes with the frame kept for the store), its
/// data in pieces of at most [`PIECE`] bytes.
fn pieces(frame: &Frame<Bytes>) -> impl Iterator<Item = Message> + use<> {
    let mut data = frame.data_ref().cloned();
    let mut trailers = frame.trailers_ref().cloned();
    let mut first = true;
    std::iter::from_fn(move || {
        if let Some(rest) = &mut data {
            // An empty data frame goes as it is, once.
            if rest.is_empty() && !first {
                return None;
            }
            first = false;
            let piece = rest.split_to(rest.len().min(PIECE));
            return Some(Message::Frame(Frame::data(piece)));
        }
        trailers.take().map(|t| Message::Frame(Frame::trailers(t)))
    })
}

/// Where the body goes for the record.
struct Sink {
    mode: Mode,
    keep: bool,
    limit: u64,
    len: u64,
    trailers: Option<HeaderMap>,
}

enum Mode {
    /// Kept in memory up to the limit, stored whole at the end.
    Whole(Whole),
    /// Appended part by part: the chunk being filled (sealed in place when appended).
    Parts { buffer: Vec<u8>, chunk: usize },
    /// No longer kept: over the limit, or an append failed (the record would miss a part).
    Dropped,
}

impl Sink {
    /// Starts keeping the body of a streamed response; on a store that streams, appends its head.
    async fn open(
        run: &Run,
        status: StatusCode,
        headers: &HeaderMap,
        vary: &HeaderMap,
        keep: bool,
    ) -> Sink {
        let config = &run.config;
        let mut sink = Sink {
            // Not kept: nothing of it is, even a body without data (whose outcome would
            // otherwise be stored as a response with an empty body).
            mode: if keep {
                Mode::Whole(Whole::default())
            } else {
                Mode::Dropped
            },
            keep,
            limit: config.record_limit as u64,
            len: 0,
            trailers: None,
        };
        if keep && config.store.client().supports_streaming() {
            let head =
                run.sealer()
                    .seal_head(&run.head(Kind::Response, status, (headers, true), vary));
            // Grown with the data (`Sealer::chunk_room`): a stream idle between two events
            // holds no chunk-sized buffer.
            sink.mode = Mode::Parts {
                buffer: Sealer::chunk_buffer(0),
                chunk: config.chunk_size,
            };
            if let Err(error) = run.guard.append(&head).await {
                tracing::warn!(%error, "idempotency: could not store the response head; its body is not kept");
                sink.mode = Mode::Dropped;
            }
        }
        sink
    }

    /// A body no longer kept cannot be replayed: giving its client up would only leave it
    /// without the response (its retry gets 410), so from the frame that puts it over the
    /// record limit (or after an append failed) it is sent as slowly as the client reads, with
    /// no stall timeout.
    fn patience(&self, frame: &Frame<Bytes>, feed: &mut Feed) {
        let len = frame.data_ref().map_or(0, |d| d.len() as u64);
        if matches!(self.mode, Mode::Dropped) || self.len + len > self.limit {
            feed.wait_for_the_client();
        }
    }

    /// Whether the chunk being filled holds data, or room for more than an empty chunk (made
    /// for a full one after the last was appended): what a pause gives back.
    fn holds_memory(&self) -> bool {
        match &self.mode {
            Mode::Parts { buffer, .. } => {
                !Sealer::chunk_is_empty(buffer) || Sealer::chunk_holds_room(buffer.capacity())
            }
            _ => false,
        }
    }

    /// Keeps a frame (appending full chunks on the way).
    async fn add(&mut self, run: &Run, frame: Frame<Bytes>) {
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    self.trailers = Some(trailers);
                }
                return;
            }
        };
        self.len += data.len() as u64;
        if !self.keep || self.len > self.limit {
            self.mode = Mode::Dropped;
            return;
        }
        match &mut self.mode {
            Mode::Whole(whole) => whole.push(Frame::data(data)),
            Mode::Parts { .. } => {
                while !data.is_empty() {
                    let Mode::Parts { buffer, chunk } = &mut self.mode else {
                        return;
                    };
                    let room = (*chunk + crate::record::CHUNK_START).saturating_sub(buffer.len());
                    let take = room.min(data.len());
                    Sealer::chunk_room(buffer, take, *chunk);
                    buffer.extend_from_slice(&data[..take]);
                    data.advance(take);
                    if take == room {
                        // A full chunk: a steady stream, whose next one is likely full too.
                        let next = *chunk;
                        self.flush(run, next).await;
                    }
                }
            }
            Mode::Dropped => {}
        }
    }

    /// Appends the chunk being filled, if it holds data; the next one starts with room for
    /// `next` bytes. With `next` 0 (a pause, the end), an empty chunk gives back its room.
    async fn flush(&mut self, run: &Run, next: usize) {
        let Mode::Parts { buffer, .. } = &mut self.mode else {
            return;
        };
        if Sealer::chunk_is_empty(buffer) {
            if next == 0 && Sealer::chunk_holds_room(buffer.capacity()) {
                *buffer = Sealer::chunk_buffer(0);
            }
            return;
        }
        let full = std::mem::replace(buffer, Sealer::chunk_buffer(next));
        let index = run.guard.appended();
        let sealed = run.sealer().seal_chunk(index, run.guard.fence(), full);
        if let Err(error) = run.guard.append(&sealed).await {
            tracing::warn!(%error, "idempotency: could not append a chunk of the response; its body is not kept");
            self.mode = Mode::Dropped;
        }
    }

    /// Stores the outcome: whole, or the end of what was appended.
    async fn finish(mut self, run: Box<Run>, status: StatusCode, headers: &HeaderMap) {
        self.flush(&run, 0).await;
        let trailers = self.trailers.take();
        match self.mode {
            Mode::Whole(whole) => {
                let (body, _) = whole.finish();
                complete::response(run, status, headers, Some(&body), trailers.as_ref()).await;
            }
            Mode::Parts { .. } => {
                let trailers = trailers.as_ref();
                // More trailer values than a record holds: the body is not kept either.
                let kept = record::fits(trailers);
                complete::end(run, status, headers, kept, self.len, trailers).await;
            }
            // Not kept: its `grpc-status` trailer is (a gRPC call's outcome).
            Mode::Dropped if run.guard.appended() > 0 => {
                let trailers = trailers.as_ref();
                complete::end(run, status, headers, false, self.len, trailers).await;
            }
            Mode::Dropped => {
                complete::response(run, status, headers, None, trailers.as_ref()).await;
            }
        }
    }
}

/// (Same-transaction mode) The whole body, its outcome stored with the handler's writes in one
/// commit, and only then sent: a client is never told of work that did not commit. A body
/// that breaks off, or a commit that fails, rolls the writes back: the client is told to retry.
async fn after_commit<A, B, E>(
    run: Box<Run>,
    parts: http::response::Parts,
    mut body: Pin<&mut A>,
    keep: bool,
    reply: oneshot::Sender<Finished<B, E>>,
) where
    A: Body<Data = Bytes, Error = BoxError>,
{
    let config = run.config.clone();
    let refused = || {
        config.problem(&crate::Rejection::StoreUnavailable {
            retry_after: config.retry_after,
        })
    };
    let mut frames = Whole::default();
    loop {
        match poll_fn(|cx| poll_frame(body.as_mut(), cx)).await {
            None => break,
            Some(Ok(frame)) => frames.push(frame),
            Some(Err(error)) => {
                tracing::warn!(%error, "idempotency: the response body broke off");
                complete::unknown(run, "the response body broke off").await;
                let _ = reply.send(Finished::Response(refused()));
                return;
            }
        }
    }
    let (data, trailers) = frames.finish();
    let kept = keep && data.len() <= run.config.record_limit;
    let record = complete::whole(
        &run,
        parts.status,
        &parts.headers,
        kept.then_some(&data[..]),
        trailers.as_ref(),
    );
    let instead = complete::Instead::ItsHead;
    let stored = complete::store_then(run, &record, Event::Executed, instead, || {}).await;
    let response = if stored == Event::Executed {
        Response::from_parts(parts, ResponseBody::full(data, trailers))
    } else {
        refused()
    };
    let _ = reply.send(Finished::Response(response));
}

/// The next frame if the body has one ready now (`Some(None)`: the body ended); `None` when it
/// has nothing ready.
async fn poll_now<B>(mut body: Pin<&mut B>) -> Option<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    poll_fn(|cx| match poll_frame(body.as_mut(), cx) {
        Poll::Ready(frame) => Poll::Ready(Some(frame)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// The next frame of the handler's body (held to its announced length: [`Announced`]). A
/// body that panics is a body that broke off: the outcome is unknown.
fn poll_frame<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body<Data = Bytes, Error = BoxError>,
{
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body.poll_frame(cx)))
        .unwrap_or_else(|_| Poll::Ready(Some(Err("the response body panicked".into()))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};

    /// A large frame reaches the client in pieces of at most `PIECE` bytes (so that the stall
    /// timeout bounds the wait for a piece, not for a whole frame of any size), the same bytes
    /// in order; trailers pass whole.
    #[tokio::test]
    async fn large_frames_reach_the_client_in_pieces() {
        let (mut feed, mut body) = Feed::channel::<Empty<Bytes>>(None);
        let data: Bytes = (0..100 * 1024 + 7).map(|i| i as u8).collect();
        let sent = data.clone();
        tokio::spawn(async move {
            forward(&mut feed, &Frame::data(sent)).await;
            let mut trailers = HeaderMap::new();
            trailers.insert("x-end", "1".parse().unwrap());
            forward(&mut feed, &Frame::trailers(trailers)).await;
            feed.send(Message::End).await;
        });
        let mut received = Vec::new();
        let mut pieces = 0;
        let mut trailers = None;
        while let Some(frame) = body.frame().await {
            match frame.unwrap().into_data() {
                Ok(piece) => {
                    assert!(piece.len() <= PIECE, "a piece of {} bytes", piece.len());
                    pieces += 1;
                    received.extend_from_slice(&piece);
                }
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        assert_eq!(received, data);
        assert_eq!(pieces, data.len().div_ceil(PIECE));
        assert_eq!(trailers.unwrap()["x-end"], "1");
    }
}
