//! A handler's response body held to the length its head announces: what a server sends of it
//! and no more, and an error where a server would have to abort the response.
//!
//! A head that announces `content-length: N` over a body of another length is a handler's
//! mistake, and the client sees the server's way out of it: a longer body is cut at N bytes (a
//! response that looks complete), a shorter one ends in an aborted connection (an incomplete
//! body). The record must be that response, not the handler's body: so that a retry gets what
//! the first client got, byte for byte, and never a complete-looking replay of a response the
//! first client saw break off.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::response::Parts;
use http_body::{Body, Frame, SizeHint};

use super::BoxError;

/// The body length the head of a response announces: 0 for a status without a body (204,
/// 304, 1xx), the `content-length` if it has one, else none (chunked or until the connection
/// ends). (The layer never covers `HEAD` requests.)
pub(crate) fn announced_length(parts: &Parts) -> Option<u64> {
    if bodiless(parts.status) {
        return Some(0);
    }
    // As HTTP servers read it: digits only, and several values only if they agree (else no
    // length at all: nothing is cut, and the server decides what to do with such a head).
    let mut length = None;
    for value in parts.headers.get_all(http::header::CONTENT_LENGTH) {
        let digits = value.as_bytes();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let value: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
        if length.is_some_and(|l| l != value) {
            return None;
        }
        length = Some(value);
    }
    length
}

/// A status whose response has no body, whatever its head says.
fn bodiless(status: http::StatusCode) -> bool {
    status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
}

/// Announces a body that knows its exact length (`hint`), under a head that announces none, with
/// that length, as servers do (axum's routes and hyper write a `content-length` from an exact
/// size hint): the first client gets the head it would get without the layer, the replay the
/// same, and the body is held to it ([`Announced`]) as the server would hold it.
pub(crate) fn announce_exact(parts: &mut Parts, hint: &SizeHint) {
    // A head with a transfer coding announces no length (hyper refuses one next to it).
    // (Without a `content-length`, only a bodiless status announces a length.)
    if let Some(len) = hint.exact()
        && !parts.headers.contains_key(http::header::CONTENT_LENGTH)
        && !parts.headers.contains_key(http::header::TRANSFER_ENCODING)
        && !bodiless(parts.status)
    {
        parts
            .headers
            .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    }
}

pin_project_lite::pin_project! {
    /// `inner`, held to `left` more bytes of data when its head announced a length.
    pub(crate) struct Announced<B> {
        #[pin]
        inner: B,
        left: Option<u64>,
        ended: bool,
    }
}

impl<B> Announced<B> {
    /// How much data is left to send: what the head announces before any is read.
    pub(crate) fn left(&self) -> Option<u64> {
        self.left
    }

    /// `inner` as it is sent in the response whose head is `parts`.
    pub(crate) fn new(inner: B, parts: &Parts) -> Self {
        Announced {
            inner,
            left: announced_length(parts),
            ended: false,
        }
    }
}

impl<B> Body for Announced<B>
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
        let mut this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        if *this.left == Some(0) {
            // All the head announced is out: a server stops here and drops the body. Only
            // trailers ready now still go (HTTP/2 sends them, and nothing follows them); what
            // else the body has or would have later is not waited for, nor an error it ends in.
            *this.ended = true;
            return match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                    Poll::Ready(Some(Ok(super::bytes_frame(frame))))
                }
                _ => Poll::Ready(None),
            };
        }
        let frame = match ready!(this.inner.as_mut().poll_frame(cx)) {
            None => {
                *this.ended = true;
                return Poll::Ready(this.left.map(|left| {
                    Err(format!(
                        "the response body ended {left} bytes short of the content-length its \
                         head announces"
                    )
                    .into())
                }));
            }
            Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
            Some(Ok(frame)) => super::bytes_frame(frame),
        };
        let Some(left) = this.left.as_mut() else {
            return Poll::Ready(Some(Ok(frame)));
        };
        Poll::Ready(Some(Ok(match frame.into_data() {
            Ok(mut data) => {
                if data.len() as u64 > *left {
                    // Beyond the announced length: a server does not send it.
                    data.truncate(*left as usize);
                }
                *left -= data.len() as u64;
                Frame::data(data)
            }
            Err(frame) => frame,
        })))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || (self.left.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.left {
            Some(left) => SizeHint::with_exact(left),
            None => self.inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn parts(status: u16, length: Option<u64>) -> Parts {
        let mut response = http::Response::builder().status(status);
        if let Some(length) = length {
            response = response.header(http::header::CONTENT_LENGTH, length);
        }
        response.body(()).unwrap().into_parts().0
    }

    fn body(chunks: &[&'static str]) -> impl Body<Data = Bytes, Error = BoxError> {
        StreamBody::new(futures_util::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from_static(c.as_bytes()))))
                .collect::<Vec<_>>(),
        ))
    }

    async fn read(b: impl Body<Data = Bytes, Error = BoxError>) -> Result<Bytes, String> {
        b.collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_body_is_held_to_the_announced_length() {
        let exact = Announced::new(body(&["abc", "def"]), &parts(200, Some(6)));
        assert_eq!(read(exact).await.unwrap(), "abcdef");
        // Longer: cut where a server stops sending, what follows never read as data.
        let long = Announced::new(body(&["abc", "def", "ghi"]), &parts(200, Some(4)));
        assert_eq!(read(long).await.unwrap(), "abcd");
        // Shorter: an error where a server aborts the response.
        let short = Announced::new(body(&["abc"]), &parts(200, Some(5)));
        let error = read(short).await.unwrap_err();
        assert!(error.contains("2 bytes short"), "{error}");
        // Not announced: as it comes.
        let chunked = Announced::new(body(&["abc", "def"]), &parts(200, None));
        assert_eq!(read(chunked).await.unwrap(), "abcdef");
        // A status without a body sends none.
        let empty = Announced::new(body(&["abc"]), &parts(204, None));
        assert_eq!(read(empty).await.unwrap(), "");
        // At the announced length the body is not read on: not waited for when it pauses
        // (or never ends), not drained when it has more ready, and an error after it is not
        // the response's (the client has it all).
        use futures_util::StreamExt;
        let then_nothing = futures_util::stream::iter([Ok::<_, BoxError>(Frame::data(
            Bytes::from_static(b"abc"),
        ))])
        .chain(futures_util::stream::pending());
        let paused = Announced::new(StreamBody::new(then_nothing), &parts(200, Some(3)));
        let read_paused = tokio::time::timeout(std::time::Duration::from_secs(5), read(paused));
        assert_eq!(read_paused.await.expect("not waited for").unwrap(), "abc");
        let endless = StreamBody::new(futures_util::stream::repeat_with(|| {
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"x")))
        }));
        let endless = Announced::new(endless, &parts(200, Some(2)));
        assert_eq!(read(endless).await.unwrap(), "xx");
        let failing = StreamBody::new(futures_util::stream::iter([
            Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"abc"))),
            Err("after the end".into()),
        ]));
        let failing = Announced::new(failing, &parts(200, Some(3)));
        assert_eq!(read(failing).await.unwrap(), "abc");
        // A malformed or disputed length cuts nothing.
        for values in [&["+3"][..], &["3", "4"], &["x"]] {
            let mut head = parts(200, None);
            for v in values {
                head.headers
                    .append(http::header::CONTENT_LENGTH, v.parse().unwrap());
            }
            assert_eq!(announced_length(&head), None, "{values:?}");
        }
    }
}
