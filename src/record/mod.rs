//! The stored outcome of a request: a versioned binary record, sealed with AES-256-GCM.
//!
//! Nothing of a response reaches the store in clear: the record (status, kept headers, body,
//! trailers, the request fingerprint) is encrypted under a key derived from the raw
//! idempotency key, its scope and the server secret ([`crate::secret`]), and bound to the
//! store name it lives under ([`seal`]). A record that does not open (corrupt, forged, copied
//! under another key, or of an older format version) is reported: the layer answers 500
//! `record-unreadable`, never replays it, and never runs the handler again for it.

mod format;
mod seal;

pub(crate) use format::{Encode, Kind, Record};
pub(crate) use seal::Sealer;

impl Record {
    /// Opens and decodes a stored record.
    pub(crate) fn open(sealer: &Sealer<'_>, stored: &[u8]) -> Result<Record, String> {
        Record::decode(&sealer.open(0, stored)?)
    }
}

impl<K: Fn(&http::HeaderName) -> bool> Encode<'_, K> {
    /// The sealed record.
    pub(crate) fn seal(&self, sealer: &Sealer<'_>) -> Vec<u8> {
        sealer.seal(0, |out, extra| self.write(out, extra))
    }
}
