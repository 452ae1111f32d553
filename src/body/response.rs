//! The response body of an [`Idempotency`](crate::Idempotency) service.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;

use super::BoxError;
use crate::drive::Driving;
use crate::drive::Execution;

/// What the protected execution sends to the client's body, frame by frame.
#[derive(Debug)]
pub(crate) enum Message {
    Frame(Frame<Bytes>),
    /// The body failed: the client sees an aborted body, never a complete short one.
    Error(BoxError),
    /// The body ended (after its outcome was stored).
    End,
}

/// The sending side of a fed body. Sends fail silently once the client went away, or stopped
/// reading for longer than the stall timeout: the execution goes on without it.
#[derive(Debug)]
pub(crate) struct Feed {
    tx: Option<mpsc::Sender<Message>>,
    stall: Option<Duration>,
}

impl Feed {
    /// Frames in flight between the execution and the client: enough to keep both busy, small
    /// enough that the layer's memory stays a few frames.
    const DEPTH: usize = 4;

    /// A body and its feed. With a `stall` timeout, a message that waits that long for room
    /// (the client reads nothing) gives the client up; without, it waits as long as the body
    /// lives (a body that drives its execution: while the client reads nothing, nothing runs).
    pub(crate) fn channel<B>(stall: Option<Duration>) -> (Feed, ResponseBody<B>) {
        let (tx, rx) = mpsc::channel(Self::DEPTH);
        let body = ResponseBody {
            kind: Kind::Fed {
                rx,
                driver: None,
                driving: None,
                storing: false,
                length: None,
                ended: false,
            },
        };
        (
            Feed {
                tx: Some(tx),
                stall,
            },
            body,
        )
    }

    /// From now on waits for the client as long as it takes (no stall timeout).
    pub(crate) fn wait_for_the_client(&mut self) {
        self.stall = None;
    }

    /// Queues a message if there is room at once; gives it back if there is none. (A client
    /// gone away counts as room: the message is dropped.)
    pub(crate) fn try_send(&mut self, message: Message) -> Result<(), Message> {
        let Some(tx) = &self.tx else { return Ok(()) };
        match tx.try_send(message) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(message)) => Err(message),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.tx = None;
                Ok(())
            }
        }
    }

    /// Sends a message; returns whether the client is still there. A client that leaves the
    /// message waiting `stall` for room is given up: dropping the sender ends its body with an
    /// error after what it was sent (never a complete short body), and the execution goes on.
    pub(crate) async fn send(&mut self, message: Message) -> bool {
        let message = match self.try_send(message) {
            Ok(()) => return self.tx.is_some(),
            Err(message) => message,
        };
        let Some(tx) = &self.tx else { return false };
        let sent = match self.stall {
            Some(stall) => tokio::time::timeout(stall, tx.send(message)).await,
            None => Ok(tx.send(message).await),
        };
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(_)) => self.tx = None,
            Err(_) => {
                tracing::warn!(
                    stall = ?self.stall,
                    "idempotency: the client stopped reading the response; it is no longer \
                     sent, and its outcome is still stored"
                );
                self.tx = None;
            }
        }
        self.tx.is_some()
    }
}

pin_project! {
    /// The body of a response from an [`Idempotency`](crate::Idempotency) service: the
    /// handler's own body (requests the layer does not protect, retryable responses), a body
    /// fed frame by frame by the protected execution (which the client going away never
    /// cancels), a stored body being replayed, or a problem document.
    ///
    /// A body that fails half-way (the handler's, or a stored one that turns out corrupt) ends
    /// with an error, so the client sees an aborted response, never a complete short one.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Inner { #[pin] inner: B },
        Fed {
            rx: mpsc::Receiver<Message>,
            driver: Option<Execution>,
            // Set with the driver: how this body drives it without waking its own task.
            driving: Option<Driving>,
            // Whether its execution stores the outcome of this response (not a replay's reading).
            storing: bool,
            // The data bytes still to come, when the head announces the body's length.
            length: Option<u64>,
            ended: bool,
        },
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "Full",
            Kind::Inner { .. } => "Inner",
            Kind::Fed { .. } => "Fed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers,
            },
        }
    }

    pub(crate) fn inner(inner: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { inner },
        }
    }

    /// Marks a body whose execution stores the outcome of a response whose head announces
    /// `announced` bytes of body (see [`Announced`](super::Announced)). A server stops reading
    /// a body and drops it right after its trailers, or once it has written the length the head
    /// announces (`content-length`), or at once when the response has no body (204, 304, 1xx,
    /// a `HEAD` request's): from the frame after which it may do so, the execution is never
    /// cancelled (the client has the whole response, so its outcome must be stored).
    pub(crate) fn storing(&mut self, announced: Option<u64>) {
        if let Kind::Fed {
            storing, length, ..
        } = &mut self.kind
        {
            *storing = true;
            *length = announced;
        }
    }

    /// Hands an execution that still feeds this body to the body, which drives it while the
    /// client reads; dropping the body drops it (which detaches or cancels it, as it says).
    /// Returns the execution if this body does not take it (it is whole: its execution has
    /// nothing left to feed it).
    pub(crate) fn drive(&mut self, driver: Execution) -> Option<Execution> {
        match &mut self.kind {
            Kind::Fed {
                driver: slot,
                driving,
                storing,
                length,
                ended: false,
                ..
            } => {
                let driver = slot.insert(driver);
                // Nothing of the body is left for the server to read: it may drop it unread.
                if *storing && *length == Some(0) {
                    driver.detach();
                }
                *driving = Some(Driving::new());
                None
            }
            _ => Some(driver),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Inner { inner } => match inner.poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(super::bytes_frame(frame)))),
            },
            KindProj::Fed {
                rx,
                driver,
                driving,
                storing,
                length,
                ended,
            } => {
                if *ended {
                    return Poll::Ready(None);
                }
                let received = match driving {
                    Some(driving) => {
                        let (done, received) =
                            driving.poll(cx, driver.as_mut(), |cx| rx.poll_recv(cx));
                        if done {
                            *driver = None;
                        }
                        received
                    }
                    None => rx.poll_recv(cx),
                };
                match received {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Some(Message::Frame(frame))) => {
                        if let (Some(left), Some(data)) = (length.as_mut(), frame.data_ref()) {
                            *left = left.saturating_sub(data.len() as u64);
                        }
                        // Possibly the last frame the server reads: what the execution has left
                        // (storing the outcome of a response the client has in full) must not
                        // be cancelled when the server drops this body.
                        if *storing
                            && (frame.is_trailers() || *length == Some(0))
                            && let Some(driver) = driver.as_mut()
                        {
                            driver.detach();
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Message::End)) => {
                        *ended = true;
                        Poll::Ready(None)
                    }
                    Poll::Ready(Some(Message::Error(error))) => {
                        *ended = true;
                        Poll::Ready(Some(Err(error)))
                    }
                    Poll::Ready(None) => {
                        *ended = true;
                        Poll::Ready(Some(Err(
                            "the idempotent execution ended before the response body did".into(),
                        )))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Inner { inner } => inner.is_end_stream(),
            Kind::Fed { ended, .. } => *ended,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, trailers } => {
                let len = data.as_ref().map_or(0, |d| d.len() as u64);
                if trailers.is_some() {
                    // Not exact: HTTP/1.1 carries trailers only in a chunked body, and a server
                    // given an exact length writes a `content-length` instead (and drops them).
                    let mut hint = SizeHint::new();
                    hint.set_lower(len);
                    hint
                } else {
                    SizeHint::with_exact(len)
                }
            }
            Kind::Inner { inner } => inner.size_hint(),
            Kind::Fed { .. } => SizeHint::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};
    use std::future::Future;

    /// A client that reads nothing for the stall timeout is given up: the send returns (the
    /// execution goes on), later sends cost nothing, and the body, if it is ever read, gives
    /// what was queued and then breaks off.
    #[tokio::test]
    async fn a_client_that_reads_nothing_is_given_up_after_the_stall_timeout() {
        let (mut feed, mut body) = Feed::channel::<Empty<Bytes>>(Some(Duration::from_millis(20)));
        let frame = || Message::Frame(Frame::data(Bytes::from_static(b"ab")));
        for _ in 0..Feed::DEPTH {
            assert!(feed.send(frame()).await, "room in the channel");
        }
        let waited = tokio::time::Instant::now();
        assert!(!feed.send(frame()).await, "given up");
        assert!(waited.elapsed() >= Duration::from_millis(20));
        assert!(!feed.send(Message::End).await);
        for _ in 0..Feed::DEPTH {
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), "ab");
        }
        assert!(body.frame().await.unwrap().is_err(), "breaks off");
    }

    #[tokio::test]
    async fn a_fed_body_ends_only_on_its_end_message() {
        let (mut feed, body) = Feed::channel::<Empty<Bytes>>(None);
        tokio::spawn(async move {
            feed.send(Message::Frame(Frame::data(Bytes::from_static(b"ab"))))
                .await;
            feed.send(Message::End).await;
        });
        assert_eq!(body.collect().await.unwrap().to_bytes(), "ab");

        // The sender vanishing without an end is an error, never a complete short body.
        let (mut feed, body) = Feed::channel::<Empty<Bytes>>(None);
        tokio::spawn(async move {
            feed.send(Message::Frame(Frame::data(Bytes::from_static(b"ab"))))
                .await;
        });
        assert!(body.collect().await.is_err());
    }

    /// A waker that counts its wakes.
    struct Count(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A body that drives its own producer reads what the producer sent in the same poll:
    /// waking its task for it would make the runtime reschedule the task as if it had yielded
    /// (on a multi-thread runtime, another worker woken to steal it once per frame). Neither a
    /// frame sent while the body drives the producer, nor room the body makes for a producer
    /// waiting to send, wakes the task polling the body.
    #[test]
    fn a_body_driving_its_producer_does_not_wake_its_own_task() {
        let (mut feed, mut body) = Feed::channel::<Empty<Bytes>>(None);
        let mut step = 0;
        let producer = std::future::poll_fn(move |cx| {
            step += 1;
            match step {
                // Nothing yet: the body's receive is registered with its task.
                1 => Poll::Pending,
                // More than the feed holds: the producer waits for room.
                2 => {
                    for i in 0..Feed::DEPTH {
                        assert!(
                            feed.try_send(Message::Frame(Frame::data(Bytes::from(vec![i as u8]))))
                                .is_ok()
                        );
                    }
                    let mut send = Box::pin(feed.send(Message::End));
                    assert!(send.as_mut().poll(cx).is_pending(), "the feed is full");
                    // Kept pending across polls: its registration stays.
                    std::mem::forget(send);
                    Poll::Pending
                }
                _ => Poll::Pending,
            }
        });
        let _ = body.drive(Execution::cancellable(Box::pin(producer)));
        let count = std::sync::Arc::new(Count(Default::default()));
        let waker = std::task::Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut body = std::pin::Pin::new(&mut body);
        assert!(body.as_mut().poll_frame(&mut cx).is_pending());
        // The producer fills the feed and waits for room; the body reads the first frame,
        // which makes room.
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => assert_eq!(frame.into_data().unwrap(), &[0u8][..]),
            other => panic!("expected the first frame, got {other:?}"),
        }
        assert_eq!(
            count.0.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the body's own task was woken while it was being polled"
        );
    }

    /// A server drops a body it has nothing to read from (a 204's) without polling it: the
    /// execution that stores the response's outcome must go on, even a cancellable one.
    #[tokio::test]
    async fn a_bodiless_response_never_cancels_its_storing() {
        for (status, finishes) in [
            (http::StatusCode::NO_CONTENT, true),
            (http::StatusCode::NOT_MODIFIED, true),
            // A body still to be read: dropped unread, it was abandoned (cancel_on_disconnect).
            (http::StatusCode::OK, false),
        ] {
            let (_feed, mut body) = Feed::channel::<Empty<Bytes>>(None);
            let (parts, ()) = http::Response::builder()
                .status(status)
                .body(())
                .unwrap()
                .into_parts();
            body.storing(crate::body::announced::announced_length(&parts));
            let (stored, was_stored) = tokio::sync::oneshot::channel::<()>();
            let storing = async move {
                tokio::task::yield_now().await;
                let _ = stored.send(());
            };
            let _ = body.drive(Execution::cancellable(Box::pin(storing)));
            drop(body);
            let outcome = tokio::time::timeout(std::time::Duration::from_secs(10), was_stored)
                .await
                .expect("the execution neither ran nor was dropped within 10 s");
            assert_eq!(outcome.is_ok(), finishes, "{status}");
        }
    }

    #[tokio::test]
    async fn full_bodies_carry_their_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let body = ResponseBody::<Empty<Bytes>>::full(Bytes::from_static(b"x"), Some(trailers));
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
        assert_eq!(collected.to_bytes(), "x");
    }
}
