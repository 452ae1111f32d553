//! A body read whole: its data in one `Bytes` and its trailers, gathered frame by frame. A
//! body of one data frame (most JSON requests and responses) is kept as it came: no copy and
//! no allocation.

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use smallvec::SmallVec;

/// The frames of a body read whole, as they come.
#[derive(Debug, Default)]
pub(crate) struct Whole {
    chunks: SmallVec<[Bytes; 1]>,
    trailers: Option<HeaderMap>,
    len: usize,
}

impl Whole {
    /// Takes in one frame (data, or trailers).
    pub(crate) fn push(&mut self, frame: Frame<Bytes>) {
        match frame.into_data() {
            Ok(data) => {
                self.len += data.len();
                self.chunks.push(data);
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    // A second trailer section (no protocol sends one) adds to the first.
                    match &mut self.trailers {
                        Some(trailers) => trailers.extend(more),
                        None => self.trailers = Some(more),
                    }
                }
            }
        }
    }

    /// The data, in one piece, and the trailers.
    pub(crate) fn finish(mut self) -> (Bytes, Option<HeaderMap>) {
        let data = match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.pop().unwrap_or_default(),
            _ => {
                let mut out = BytesMut::with_capacity(self.len);
                for chunk in &self.chunks {
                    out.extend_from_slice(chunk);
                }
                out.freeze()
            }
        };
        (data, self.trailers)
    }
}

impl FromIterator<Frame<Bytes>> for Whole {
    fn from_iter<I: IntoIterator<Item = Frame<Bytes>>>(frames: I) -> Self {
        let mut whole = Whole::default();
        for frame in frames {
            whole.push(frame);
        }
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_chunk_is_kept_as_it_came_and_more_are_joined() {
        let one = Bytes::from_static(b"{\"a\":1}");
        let (data, trailers) = Whole::from_iter([Frame::data(one.clone())]).finish();
        assert_eq!(data, one);
        assert_eq!(data.as_ptr(), one.as_ptr(), "one chunk is not copied");
        assert!(trailers.is_none());

        let mut end = HeaderMap::new();
        end.insert("grpc-status", "0".parse().unwrap());
        let whole = Whole::from_iter([
            Frame::data(Bytes::from_static(b"ab")),
            Frame::data(Bytes::new()),
            Frame::data(Bytes::from_static(b"cd")),
            Frame::trailers(end.clone()),
        ]);
        let (data, trailers) = whole.finish();
        assert_eq!(&data[..], b"abcd");
        assert_eq!(trailers.as_ref(), Some(&end));

        let mut more = HeaderMap::new();
        more.insert("grpc-message", "ok".parse().unwrap());
        let (_, trailers) =
            Whole::from_iter([Frame::trailers(end.clone()), Frame::trailers(more.clone())])
                .finish();
        let trailers = trailers.unwrap();
        assert_eq!(trailers.get("grpc-status"), end.get("grpc-status"));
        assert_eq!(trailers.get("grpc-message"), more.get("grpc-message"));

        let (data, trailers) = Whole::default().finish();
        assert!(data.is_empty() && trailers.is_none());
    }
}
