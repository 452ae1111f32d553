//! Bodies: reading the request body within limits, and the response body type.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use pin_project_lite::pin_project;

use crate::Rejection;

/// Reads a request body of at most `limit` bytes within `timeout`.
pub(crate) async fn read_request<B>(
    body: B,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Err(_) => Err(Rejection::RequestTimeout { after: timeout }),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Ok(Err(error)) => Err(Rejection::MalformedBody {
            reason: format!("The request body could not be read: {error}."),
        }),
    }
}

pin_project! {
    /// The body of a response from an [`Idempotency`](crate::Idempotency) service: the handler's
    /// own body, a stored body being replayed, a problem document, or (when a response was too
    /// large to store) the part already read followed by the rest of the handler's body.
    #[project = Proj]
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B: Body> {
        Full { data: Option<Bytes> },
        Inner { #[pin] inner: B },
        Prefixed { prefix: Option<Bytes>, inner: Pin<Box<B>> },
        Failed { error: Option<B::Error> },
    }
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "Full",
            Kind::Inner { .. } => "Inner",
            Kind::Prefixed { .. } => "Prefixed",
            Kind::Failed { .. } => "Failed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn failed(error: B::Error) -> Self {
        ResponseBody {
            kind: Kind::Failed { error: Some(error) },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        ResponseBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn inner(inner: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { inner },
        }
    }

    pub(crate) fn prefixed(prefix: Bytes, inner: Pin<Box<B>>) -> Self {
        ResponseBody {
            kind: Kind::Prefixed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                inner,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Inner { inner } => inner.poll_frame(cx),
            KindProj::Prefixed { prefix, inner } => match prefix.take() {
                Some(p) => Poll::Ready(Some(Ok(Frame::data(p)))),
                None => inner.as_mut().poll_frame(cx),
            },
            KindProj::Failed { error } => Poll::Ready(error.take().map(Err)),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner { inner } => inner.is_end_stream(),
            Kind::Prefixed { prefix, inner } => prefix.is_none() && inner.is_end_stream(),
            Kind::Failed { error } => error.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { inner } => inner.size_hint(),
            Kind::Prefixed { prefix, inner } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let hint = inner.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower() + extra);
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper + extra);
                }
                out
            }
            Kind::Failed { .. } => SizeHint::new(),
        }
    }
}

/// The response body read up to a limit: all of it, or what was read before the limit and the
/// rest of the body.
pub(crate) enum Collected<B> {
    Complete(Bytes),
    TooLarge { read: Bytes, rest: Pin<Box<B>> },
}

/// Reads `body` until it ends or more than `limit` bytes arrived. Trailers are not kept.
pub(crate) async fn collect_response<B>(body: B, limit: usize) -> Result<Collected<B>, B::Error>
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        len += data.len();
        chunks.push(data);
        if len > limit {
            return Ok(Collected::TooLarge {
                read: concat(chunks, len),
                rest: body,
            });
        }
    }
    Ok(Collected::Complete(concat(chunks, len)))
}

fn concat(mut chunks: Vec<Bytes>, len: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().expect("one chunk"),
        _ => {
            let mut out = Vec::with_capacity(len);
            for c in chunks {
                out.extend_from_slice(&c);
            }
            Bytes::from(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    #[tokio::test]
    async fn request_bodies_are_limited() {
        let ok = read_request(
            Full::new(Bytes::from_static(b"12345")),
            5,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(ok.unwrap(), Bytes::from_static(b"12345"));
        let big = read_request(
            Full::new(Bytes::from_static(b"123456")),
            5,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(big.unwrap_err(), Rejection::BodyTooLarge { limit: 5 });
        // A streamed body that crosses the limit midway.
        let chunks = futures_stream(vec![b"123".to_vec(), b"456".to_vec()]);
        let midway = read_request(chunks, 5, Duration::from_secs(1)).await;
        assert_eq!(midway.unwrap_err(), Rejection::BodyTooLarge { limit: 5 });
    }

    type Chunks =
        futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>;

    fn futures_stream(chunks: Vec<Vec<u8>>) -> StreamBody<Chunks> {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = chunks
            .into_iter()
            .map(|c| Ok(Frame::data(Bytes::from(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn response_bodies_over_the_limit_keep_the_rest() {
        let body = futures_stream(vec![b"ab".to_vec(), b"cd".to_vec(), b"ef".to_vec()]);
        match collect_response(body, 3).await.unwrap() {
            Collected::TooLarge { read, rest } => {
                assert_eq!(read, Bytes::from_static(b"abcd"));
                let whole = ResponseBody::prefixed(read, rest)
                    .collect()
                    .await
                    .unwrap()
                    .to_bytes();
                assert_eq!(whole, Bytes::from_static(b"abcdef"));
            }
            Collected::Complete(_) => panic!("over the limit"),
        }
        let body = futures_stream(vec![b"ab".to_vec()]);
        assert!(
            matches!(collect_response(body, 3).await.unwrap(), Collected::Complete(b) if b == "ab")
        );
    }
}
