//! The stored outcome of a request: versioned binary parts, each sealed with AES-256-GCM on the
//! stores outside the process.
//!
//! Nothing of a response reaches Redis (Cluster, Sentinel, Redlock) in clear: the record (status, kept headers, body,
//! trailers, the request fingerprint) is encrypted under a key derived from the raw
//! idempotency key, its scope and the server secret ([`crate::secret`]), and bound to the
//! store name it lives under, its part index and its writer ([`seal`]). A small response is one
//! part; a streamed one is a head, chunks and an end, appended as the body passes
//! ([`format`]). A part that does not open (corrupt, forged, copied under another key, of
//! another execution, or of an older format version) is reported: the layer answers 500
//! `record-unreadable` (or breaks off a body it was replaying), never replays it, and never
//! runs the handler again for it.
//!
//! The in-memory store is the exception: its records never leave the process, and it keeps
//! them in clear, bound to their index and writer ([`Sealer::plain`]), so that a replay hands
//! out a stored body's chunks as they are instead of a decrypted copy. (What AES-GCM also
//! checked, that no byte was altered and that a part belongs to its store name, guards against
//! whoever can write to Redis; only the layer writes the in-memory store.)

mod format;
mod seal;

pub(crate) use format::{EncodeHead, Head, Kind, Part, Record, fits, write_end, write_unknown};
pub(crate) use seal::Sealer;

use http::{HeaderMap, HeaderName};

/// Where the data starts in a chunk buffer (after the envelope's header and the part's type).
pub(crate) const CHUNK_START: usize = seal::HEADER + 1;

impl Sealer<'_> {
    /// Opens and decodes part `index` of a record; parts after the first belong to `writer`.
    pub(crate) fn open_part(&self, index: u64, writer: u64, sealed: &[u8]) -> Result<Part, String> {
        self.open_part_owned(index, writer, bytes::Bytes::copy_from_slice(sealed))
    }

    /// [`open_part`](Self::open_part) of a part handed over (opened in place when it can be:
    /// [`Sealer::open_owned`]).
    pub(crate) fn open_part_owned(
        &self,
        index: u64,
        writer: u64,
        sealed: bytes::Bytes,
    ) -> Result<Part, String> {
        let writer = if index == 0 { 0 } else { writer };
        Part::decode(&self.open_owned(index, writer, sealed)?)
    }

    /// A record in one part.
    pub(crate) fn seal_whole<K: Fn(&HeaderName) -> bool>(
        &self,
        head: &EncodeHead<'_, K>,
        body: &[u8],
        trailers: Option<&HeaderMap>,
    ) -> Vec<u8> {
        self.seal(0, 0, |out, extra| {
            head.write_whole(body, trailers, out, extra)
        })
    }

    /// The head of a streamed record (its first part).
    pub(crate) fn seal_head<K: Fn(&HeaderName) -> bool>(
        &self,
        head: &EncodeHead<'_, K>,
    ) -> Vec<u8> {
        self.seal(0, 0, |out, extra| head.write_head(out, extra))
    }

    /// A buffer for the data of a chunk part, sealed by [`seal_chunk`](Self::seal_chunk), with
    /// room for `capacity` bytes of data (it grows with [`chunk_room`](Self::chunk_room)).
    pub(crate) fn chunk_buffer(capacity: usize) -> Vec<u8> {
        let mut out = Sealer::buffer(capacity + 1);
        out.push(format::CHUNK_TAG);
        out
    }

    /// Whether a chunk buffer of `capacity` has room for more than an empty chunk.
    pub(crate) fn chunk_holds_room(capacity: usize) -> bool {
        capacity > Sealer::buffer_capacity(1)
    }

    /// Makes room in a chunk buffer for `additional` more bytes of data, a chunk holding at most
    /// `chunk`: the buffer at least doubles, up to what a full chunk and its seal take (a
    /// stream's data grows it a few times at most, and never past a chunk's worth).
    pub(crate) fn chunk_room(buffer: &mut Vec<u8>, additional: usize, chunk: usize) {
        // What the buffer takes sealed: a full chunk's, and once `additional` bytes are in.
        let full = Sealer::buffer_capacity(chunk + 1);
        let needed =
            Sealer::buffer_capacity(buffer.len().saturating_sub(seal::HEADER) + additional);
        if needed > buffer.capacity() {
            let target = needed.max(buffer.capacity().saturating_mul(2)).min(full);
            buffer.reserve_exact(target.max(needed) - buffer.len());
        }
    }

    /// Whether a chunk buffer holds no data yet.
    pub(crate) fn chunk_is_empty(buffer: &[u8]) -> bool {
        buffer.len() <= CHUNK_START
    }

    /// Seals a chunk buffer as part `index` of writer `writer`.
    pub(crate) fn seal_chunk(&self, index: u64, writer: u64, buffer: Vec<u8>) -> Vec<u8> {
        self.seal_buffer(index, writer, buffer)
    }

    /// The end of a streamed record: whether its body was kept, its length, its trailers.
    pub(crate) fn seal_end(
        &self,
        index: u64,
        writer: u64,
        kept: bool,
        len: u64,
        trailers: Option<&HeaderMap>,
    ) -> Vec<u8> {
        self.seal(index, writer, |out, extra| {
            write_end(kept, len, trailers, out, extra)
        })
    }

    /// The end of a streamed record whose outcome is unknown.
    pub(crate) fn seal_unknown(&self, index: u64, writer: u64) -> Vec<u8> {
        self.seal(index, writer, write_unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk buffer grows with its data: it at least doubles (a few reallocations per chunk,
    /// not one per frame), always has room for what is added and for the seal, and never
    /// grows past what a full chunk takes sealed.
    #[test]
    fn a_chunk_buffer_grows_with_its_data_up_to_a_full_chunk() {
        let chunk = 64 * 1024;
        let full = Sealer::chunk_buffer(chunk).capacity();
        for frame in [1, 50, 1000, 16 * 1024, chunk] {
            let mut buffer = Sealer::chunk_buffer(0);
            let mut grown = 0;
            let mut capacity = buffer.capacity();
            while buffer.len() < CHUNK_START + chunk {
                let take = frame.min(CHUNK_START + chunk - buffer.len());
                Sealer::chunk_room(&mut buffer, take, chunk);
                assert!(buffer.capacity() <= full, "{frame}: {}", buffer.capacity());
                buffer.extend_from_slice(&vec![7u8; take]);
                assert!(
                    buffer.capacity() - buffer.len() >= full - CHUNK_START - chunk,
                    "{frame}: room for the seal"
                );
                if buffer.capacity() != capacity {
                    grown += 1;
                    capacity = buffer.capacity();
                }
            }
            assert_eq!(buffer.capacity(), full, "{frame}");
            assert!(grown <= 18, "{frame}: grown {grown} times");
        }
    }
}
