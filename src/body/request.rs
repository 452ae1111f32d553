//! The request body the inner service receives, and reading a request body within limits.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Limited;
use pin_project_lite::pin_project;

use super::{BoxError, Whole};
use crate::Rejection;

pin_project! {
    /// The request body the inner service receives: the body the layer read (to find the key
    /// and the fingerprint), or the original body when the layer did not need to read it (a
    /// method that is not covered, or no key while keys are optional).
    ///
    /// The layer accepts any [`http_body::Body`] (hyper's `Incoming`, tower-http's `Limited`,
    /// axum's `Body`, ...) and hands this type on; axum routes and tonic services accept it as it
    /// is (`Data = Bytes`, errors boxed).
    ///
    /// ```
    /// use http_body_util::BodyExt;
    /// use tower_idempotency::RequestBody;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let body = RequestBody::new(http_body_util::Full::new(bytes::Bytes::from_static(b"hi")));
    /// assert_eq!(body.collect().await.unwrap().to_bytes(), "hi");
    /// # }
    /// ```
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Original { #[pin] inner: B },
    }
}

impl<B> RequestBody<B> {
    /// Wraps a body the layer did not read.
    pub fn new(inner: B) -> Self {
        RequestBody {
            kind: Kind::Original { inner },
        }
    }

    pub(crate) fn buffered(read: Read) -> Self {
        RequestBody {
            kind: Kind::Buffered {
                data: (!read.data.is_empty()).then_some(read.data),
                trailers: read.trailers,
            },
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Buffered { .. } => "Buffered",
            Kind::Original { .. } => "Original",
        };
        f.debug_struct("RequestBody").field("kind", &kind).finish()
    }
}

impl<B> Body for RequestBody<B>
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
            KindProj::Buffered { data, trailers } => Poll::Ready(match data.take() {
                Some(d) => Some(Ok(Frame::data(d))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Original { inner } => match inner.poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(super::bytes_frame(frame)))),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Original { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Original { inner } => inner.size_hint(),
        }
    }
}

/// A request body read whole: its data, and its trailers (handed on to the handler).
#[derive(Debug, Default)]
pub(crate) struct Read {
    pub(crate) data: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

/// Reads a request body of at most `limit` bytes within `timeout`. A body already there in
/// full (one without content, or one that came with the head: most JSON requests) is read
/// without arming the timer, which a request after an idle pause paid about 9 µs for.
pub(crate) async fn read_request<B>(
    body: B,
    limit: usize,
    timeout: Duration,
) -> Result<Read, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut collect = std::pin::pin!(gather(Limited::new(body, limit)));
    let read = match futures_util::FutureExt::now_or_never(&mut collect) {
        Some(read) => read,
        None => match tokio::time::timeout(timeout, collect).await {
            Ok(read) => read,
            Err(_) => return Err(Rejection::RequestTimeout { after: timeout }),
        },
    };
    match read {
        Ok(whole) => {
            let (data, trailers) = whole.finish();
            Ok(Read { data, trailers })
        }
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(error) => Err(Rejection::MalformedBody {
            reason: format!("The request body could not be read: {error}."),
        }),
    }
}

/// Every frame of `body`.
async fn gather<B>(body: B) -> Result<Whole, BoxError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut whole = Whole::default();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        whole.push(super::bytes_frame(frame.map_err(Into::into)?));
    }
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use http_body_util::{Full, StreamBody};

    type Chunks =
        futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>;

    fn chunks(chunks: Vec<Vec<u8>>) -> StreamBody<Chunks> {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = chunks
            .into_iter()
            .map(|c| Ok(Frame::data(Bytes::from(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn request_bodies_are_limited() {
        let ok = read_request(
            Full::new(Bytes::from_static(b"12345")),
            5,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(ok.unwrap().data, Bytes::from_static(b"12345"));
        let big = read_request(
            Full::new(Bytes::from_static(b"123456")),
            5,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(big.unwrap_err(), Rejection::BodyTooLarge { limit: 5 });
        // A streamed body that crosses the limit midway.
        let midway = read_request(
            chunks(vec![b"123".to_vec(), b"456".to_vec()]),
            5,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(midway.unwrap_err(), Rejection::BodyTooLarge { limit: 5 });
    }

    /// A body still on its way when the read starts: read to its end once it comes (the first
    /// look, without a timer, must not lose its wake-up), and given up after the timeout when
    /// it does not come in time. A body there in full is read without one.
    #[tokio::test]
    async fn a_body_still_coming_is_read_within_the_timeout() {
        let later = |delay: Duration| {
            StreamBody::new(futures_util::stream::once(async move {
                tokio::time::sleep(delay).await;
                Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"late")))
            }))
        };
        let read = read_request(later(Duration::from_millis(50)), 10, Duration::from_secs(1));
        let read = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("the read ends once the body came");
        assert_eq!(read.unwrap().data, Bytes::from_static(b"late"));
        let timeout = Duration::from_millis(100);
        let slow = read_request(later(Duration::from_secs(30)), 10, timeout).await;
        assert_eq!(
            slow.unwrap_err(),
            Rejection::RequestTimeout { after: timeout }
        );
        let whole = read_request(Full::new(Bytes::from_static(b"now")), 10, Duration::ZERO).await;
        assert_eq!(whole.unwrap().data, Bytes::from_static(b"now"));
    }

    #[tokio::test]
    async fn the_inner_service_gets_the_same_bytes_either_way() {
        let read = RequestBody::<Full<Bytes>>::buffered(Read {
            data: Bytes::from_static(b"abc"),
            trailers: None,
        });
        assert_eq!(read.collect().await.unwrap().to_bytes(), "abc");
        let original = RequestBody::new(chunks(vec![b"a".to_vec(), b"bc".to_vec()]));
        assert_eq!(original.collect().await.unwrap().to_bytes(), "abc");
    }
}
