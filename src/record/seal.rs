//! The AEAD envelope of a stored record part.
//!
//! ```text
//! "TIR" 0x03     magic and format version (in clear)
//! nonce          12 random bytes
//! ciphertext     AES-256-GCM of the plaintext
//! tag            16 bytes
//! ```
//!
//! Associated data: magic and version, the store name of the key, the part's index, and the
//! writer (the fencing token of the execution that wrote a streamed record's parts after its
//! first; 0 for the first part). The key is derived from the raw idempotency key, its scope and
//! the server secret ([`crate::secret`]). A record moved under another name or index, altered
//! in any byte, written without the key, or a part of another execution spliced in fails to
//! open.

use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use bytes::{Bytes, BytesMut};

const MAGIC: &[u8; 3] = b"TIR";
/// The format version this build writes and reads.
pub(crate) const VERSION: u8 = 3;
/// Envelope bytes before the ciphertext.
pub(crate) const HEADER: usize = 4 + 12;
const TAG: usize = 16;

/// The cipher of one record.
pub(crate) struct Sealer<'a> {
    cipher: Aes256Gcm,
    name: &'a str,
}

impl<'a> Sealer<'a> {
    pub(crate) fn new(key: &[u8; 32], name: &'a str) -> Self {
        Sealer {
            cipher: Aes256Gcm::new(key.into()),
            name,
        }
    }

    fn aad(&self, part: u64, writer: u64) -> Vec<u8> {
        let mut aad = Vec::with_capacity(4 + self.name.len() + 16);
        aad.extend_from_slice(MAGIC);
        aad.push(VERSION);
        aad.extend_from_slice(self.name.as_bytes());
        aad.extend_from_slice(&part.to_be_bytes());
        aad.extend_from_slice(&writer.to_be_bytes());
        aad
    }

    /// A buffer for a part's plaintext, to be sealed in place by [`seal_buffer`](Self::seal_buffer):
    /// room for the envelope's header before it and the tag after `capacity` bytes.
    pub(crate) fn buffer(capacity: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + capacity + TAG);
        out.resize(HEADER, 0);
        out
    }

    /// Seals in place a buffer from [`buffer`](Self::buffer) whose plaintext follows the
    /// header: part `part` of writer `writer`.
    pub(crate) fn seal_buffer(&self, part: u64, writer: u64, mut out: Vec<u8>) -> Vec<u8> {
        let mut nonce = [0u8; 12];
        rand::fill(&mut nonce);
        out[..3].copy_from_slice(MAGIC);
        out[3] = VERSION;
        out[4..HEADER].copy_from_slice(&nonce);
        let tag = self
            .cipher
            .encrypt_inout_detached(
                &Nonce::from(nonce),
                &self.aad(part, writer),
                (&mut out[HEADER..]).into(),
            )
            // AES-GCM refuses only messages over 64 GiB.
            .unwrap_or_default();
        out.extend_from_slice(&tag);
        out
    }

    /// Seals part `part` of writer `writer`, whose plaintext `write` appends to the buffer it is
    /// given (reserving the extra bytes it is told, so the sealed part is one allocation).
    pub(crate) fn seal(
        &self,
        part: u64,
        writer: u64,
        write: impl FnOnce(&mut Vec<u8>, usize),
    ) -> Vec<u8> {
        let mut out = Self::buffer(256);
        write(&mut out, TAG);
        self.seal_buffer(part, writer, out)
    }

    /// Opens part `part` of writer `writer`: its plaintext, or why it cannot be read (corrupt,
    /// forged, moved, of another writer, or of another format version).
    pub(crate) fn open(&self, part: u64, writer: u64, sealed: &[u8]) -> Result<Bytes, String> {
        if sealed.len() < 4 || &sealed[..3] != MAGIC {
            return Err("not a tower-idempotency record".into());
        }
        if sealed[3] != VERSION {
            return Err(format!(
                "record format version {} is not supported (this build reads {VERSION})",
                sealed[3]
            ));
        }
        if sealed.len() < HEADER + TAG {
            return Err(format!("truncated record ({} bytes)", sealed.len()));
        }
        let nonce: [u8; 12] = sealed[4..HEADER]
            .try_into()
            .map_err(|_| "truncated nonce")?;
        let (body, tag) = sealed[HEADER..].split_at(sealed.len() - HEADER - TAG);
        let tag: [u8; TAG] = tag.try_into().map_err(|_| "truncated tag")?;
        let mut plain = BytesMut::from(body);
        self.cipher
            .decrypt_inout_detached(
                &Nonce::from(nonce),
                &self.aad(part, writer),
                (&mut plain[..]).into(),
                &Tag::from(tag),
            )
            .map_err(|_| {
                "the record does not authenticate: altered, written by someone without the key, \
                 or stored under another key"
                    .to_owned()
            })?;
        Ok(plain.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(key: &[u8; 32], name: &str, part: u64, plain: &[u8]) -> Vec<u8> {
        Sealer::new(key, name).seal(part, 0, |out, extra| {
            out.reserve(plain.len() + extra);
            out.extend_from_slice(plain);
        })
    }

    #[test]
    fn round_trips_and_hides_the_plaintext() {
        let key = [7u8; 32];
        let plain = b"+15550100 Ada Lovelace";
        let s = sealed(&key, "n1", 0, plain);
        assert!(!s.windows(9).any(|w| w == b"+15550100"), "no plaintext");
        assert_eq!(&Sealer::new(&key, "n1").open(0, 0, &s).unwrap()[..], plain);
        assert_ne!(s, sealed(&key, "n1", 0, plain), "a fresh nonce each time");
    }

    #[test]
    fn moved_altered_or_forged_records_do_not_open() {
        let key = [7u8; 32];
        let s = sealed(&key, "n1", 0, b"record");
        let n1 = Sealer::new(&key, "n1");
        assert!(
            Sealer::new(&key, "n2").open(0, 0, &s).is_err(),
            "another name"
        );
        assert!(n1.open(1, 0, &s).is_err(), "another part");
        assert!(n1.open(0, 9, &s).is_err(), "another writer");
        assert!(
            Sealer::new(&[8u8; 32], "n1").open(0, 0, &s).is_err(),
            "another key"
        );
        for i in 0..s.len() {
            let mut flipped = s.clone();
            flipped[i] ^= 1;
            assert!(n1.open(0, 0, &flipped).is_err(), "byte {i}");
        }
        for len in 0..s.len() {
            assert!(n1.open(0, 0, &s[..len]).is_err(), "{len}");
        }
        let mut old = s.clone();
        old[3] = 2;
        assert!(n1.open(0, 0, &old).unwrap_err().contains("version 2"));
        // Sealed in place from a buffer: the same envelope, bound to its writer.
        let mut buffer = Sealer::buffer(4);
        buffer.extend_from_slice(b"data");
        let in_place = n1.seal_buffer(3, 7, buffer);
        assert_eq!(&n1.open(3, 7, &in_place).unwrap()[..], b"data");
        assert!(n1.open(3, 8, &in_place).is_err(), "another writer's part");
    }
}
