//! Bodies: the request body handed to the inner service, reading request bodies within limits,
//! and the response body (the handler's own, a stored one being replayed, or one fed by the
//! protected execution running in its own task).

mod announced;
mod request;
mod response;
mod whole;

pub(crate) use announced::{Announced, announce_exact};
pub use request::RequestBody;
pub(crate) use request::{Read, read_request};
pub use response::ResponseBody;
pub(crate) use response::{Feed, Message};
pub(crate) use whole::Whole;

/// The error type of the layer's bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A frame of any body as a frame of `Bytes` (no copy when its data is `Bytes` already).
pub(crate) fn bytes_frame<D: bytes::Buf>(
    frame: http_body::Frame<D>,
) -> http_body::Frame<bytes::Bytes> {
    frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
}
