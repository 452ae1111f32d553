//! The AEAD envelope of a stored record part.
//!
//! ```text
//! "TIR" 0x03     magic and format version (in clear)
//! nonce          12 random bytes
//! ciphertext     AES-256-GCM of the plaintext
//! tag            16 bytes
//! ```
//!
//! The in-memory store keeps its parts in clear, in an envelope of the same size that binds
//! them to their index and writer ([`Sealer::plain`]): its records never leave the process,
//! so there is no one to hide them from or to forge them, and a part it hands back is the
//! plaintext itself, not a copy to decrypt. Each opener reads only its own kind of envelope:
//! a part in clear found in Redis is refused like any forged one.
//!
//! ```text
//! "TIR" 0x83     magic and format version (0x80 | the sealed version)
//! writer         8 bytes, big-endian
//! index          4 bytes, big-endian
//! plaintext
//! ```
//!
//! Sealed parts' associated data: magic and version, the store name of the key, the part's
//! index, and the writer (the fencing token of the execution that wrote a streamed record's
//! parts after its first; 0 for the first part). The key is derived from the raw idempotency key, its scope and
//! the server secret ([`crate::secret`]). A sealed record moved under another name or index,
//! altered in any byte, written without the key, or a part of another execution spliced in
//! fails to open. (Two executions of one key never share a fence, even when the record expired
//! in between: Redis starts a record's new counter from the writer's clock, not from 0; the
//! in-memory store's one counter never repeats.)
//!
//! The cipher is ring's AES-256-GCM (the one under rustls): with AES-NI and carry-less
//! multiplication it seals and opens about 2.5 times as fast as RustCrypto's `aes-gcm` on this
//! project's bench machine, which bounds how fast a stored body replays (docs/BENCHMARKS.md,
//! "Sealed records"). The envelope is standard AES-GCM either way: records written with one
//! open with the other.

use bytes::{Buf, Bytes, BytesMut};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};

const MAGIC: &[u8; 3] = b"TIR";
/// The format version this build writes and reads.
pub(crate) const VERSION: u8 = 3;
/// The same version, in clear (the in-memory store's parts).
const PLAIN: u8 = 0x80 | VERSION;
/// Envelope bytes before the ciphertext.
pub(crate) const HEADER: usize = 4 + 12;
const TAG: usize = 16;

/// The cipher of one record (or none, for the in-memory store: [`plain`](Sealer::plain)).
pub(crate) struct Sealer<'a> {
    /// `None`: parts are kept in clear, bound to their index and writer.
    cipher: Option<LessSafeKey>,
    name: &'a str,
}

impl<'a> Sealer<'a> {
    pub(crate) fn new(key: &[u8; 32], name: &'a str) -> Self {
        // ring refuses only a key of the wrong length; this one is 32 bytes by its type.
        let key = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte AES-256 key");
        Sealer {
            cipher: Some(LessSafeKey::new(key)),
            name,
        }
    }

    /// Parts in clear, for a store in this process (see the module docs).
    pub(crate) fn plain(name: &'a str) -> Self {
        Sealer { cipher: None, name }
    }

    /// Sealed under `key`, or in clear without one (the layer derives no record key for the
    /// in-memory store).
    pub(crate) fn of(key: Option<&[u8; 32]>, name: &'a str) -> Self {
        match key {
            Some(key) => Sealer::new(key, name),
            None => Sealer::plain(name),
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
        let mut out = Vec::with_capacity(Sealer::buffer_capacity(capacity));
        out.resize(HEADER, 0);
        out
    }

    /// What a [`buffer`](Self::buffer) for `capacity` bytes of plaintext holds once sealed.
    pub(crate) fn buffer_capacity(capacity: usize) -> usize {
        HEADER + capacity + TAG
    }

    /// Seals in place a buffer from [`buffer`](Self::buffer) whose plaintext follows the
    /// header: part `part` of writer `writer`.
    pub(crate) fn seal_buffer(&self, part: u64, writer: u64, mut out: Vec<u8>) -> Vec<u8> {
        out[..3].copy_from_slice(MAGIC);
        let Some(cipher) = &self.cipher else {
            // An index beyond 32 bits (a record of over four billion parts) gets a version
            // no build reads: it never opens, never as someone else's part.
            out[3] = u32::try_from(part).map_or(0, |_| PLAIN);
            out[4..12].copy_from_slice(&writer.to_be_bytes());
            out[12..HEADER].copy_from_slice(&(part as u32).to_be_bytes());
            return out;
        };
        let mut nonce = [0u8; 12];
        rand::fill(&mut nonce);
        out[3] = VERSION;
        out[4..HEADER].copy_from_slice(&nonce);
        match cipher.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(self.aad(part, writer)),
            &mut out[HEADER..],
        ) {
            Ok(tag) => out.extend_from_slice(tag.as_ref()),
            // AES-GCM refuses only messages over 64 GiB; a part is at most the chunk size. An
            // envelope without its tag never opens: the part reads as corrupt, never as data.
            Err(_) => out.truncate(HEADER),
        }
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

    /// [`open_owned`](Self::open_owned) of a borrowed part (copied).
    #[cfg(test)]
    pub(crate) fn open(&self, part: u64, writer: u64, sealed: &[u8]) -> Result<Bytes, String> {
        self.open_owned(part, writer, Bytes::copy_from_slice(sealed))
    }

    /// Opens part `part` of writer `writer`: its plaintext, or why it cannot be read (corrupt,
    /// forged, moved, of another writer, or of another format version). Opened where it lies
    /// when nothing else holds its bytes (a part just read from Redis), without copying the
    /// body; copied first otherwise. A part in clear (the memory store's) is its plaintext,
    /// shared, once its index and writer are checked.
    pub(crate) fn open_owned(
        &self,
        part: u64,
        writer: u64,
        sealed: Bytes,
    ) -> Result<Bytes, String> {
        let Some(cipher) = &self.cipher else {
            check_plain(&sealed, part, writer)?;
            return Ok(sealed.slice(HEADER..));
        };
        let nonce = check(&sealed)?;
        // The ciphertext and tag; the plaintext is the ciphertext's length, where it was.
        let mut sealed = match sealed.try_into_mut() {
            Ok(mut sealed) => {
                sealed.advance(HEADER);
                sealed
            }
            Err(shared) => BytesMut::from(&shared[HEADER..]),
        };
        let len = cipher
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(self.aad(part, writer)),
                &mut sealed[..],
            )
            .map_err(|_| {
                "the record does not authenticate: altered, written by someone without the key, \
                 or stored under another key"
                    .to_owned()
            })?
            .len();
        sealed.truncate(len);
        Ok(sealed.freeze())
    }
}

/// Checks a part's envelope: magic, `version` (`expected` says which this reader takes, only
/// for the error) and a length of at least `min`.
fn envelope(
    part: &[u8],
    version: u8,
    min: usize,
    expected: impl FnOnce() -> String,
) -> Result<(), String> {
    if part.len() < 4 || &part[..3] != MAGIC {
        return Err("not a tower-idempotency record".into());
    }
    if part[3] != version {
        return Err(format!(
            "record format version {} is not supported{}",
            part[3],
            expected()
        ));
    }
    if part.len() < min {
        return Err(format!("truncated record ({} bytes)", part.len()));
    }
    Ok(())
}

/// Checks a part in clear: its envelope, index and writer.
fn check_plain(part: &[u8], index: u64, writer: u64) -> Result<(), String> {
    envelope(part, PLAIN, HEADER, || {
        format!(" here (this store keeps version {PLAIN})")
    })?;
    let stored_writer = u64::from_be_bytes(part[4..12].try_into().unwrap_or_default());
    let stored_index = u32::from_be_bytes(part[12..HEADER].try_into().unwrap_or_default());
    if stored_writer != writer || u32::try_from(index) != Ok(stored_index) {
        return Err("the part belongs to another index or writer".into());
    }
    Ok(())
}

/// Checks a sealed part's envelope (magic, version, length): its nonce.
fn check(sealed: &[u8]) -> Result<[u8; 12], String> {
    envelope(sealed, VERSION, HEADER + TAG, || {
        format!(" (this build reads {VERSION})")
    })?;
    sealed[4..HEADER]
        .try_into()
        .map_err(|_| "truncated nonce".to_owned())
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

    /// A part sealed by the previous build (RustCrypto's `aes-gcm`, nonce fixed to 0x11…,
    /// part 2 of writer 9 under "n1"): the envelope is standard AES-256-GCM, so records already
    /// in a store stay readable across the change of cipher implementation.
    #[test]
    fn opens_a_part_sealed_by_the_previous_implementation() {
        const SEALED: &str = "5449520311111111111111111111111189b5318b20d96f051cc0db44c951cb6a\
                              c3db06f9590652c1928219b69993731fdd1f4f7ddb7f";
        let sealed: Vec<u8> = (0..SEALED.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&SEALED[i..i + 2], 16).unwrap())
            .collect();
        let n1 = Sealer::new(&[7u8; 32], "n1");
        assert_eq!(
            &n1.open(2, 9, &sealed).unwrap()[..],
            b"+15550100 Ada Lovelace"
        );
        assert!(n1.open(2, 8, &sealed).is_err(), "bound to its writer");
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

    /// The in-memory store's parts: in clear, handed back as they are (shared, not copied),
    /// bound to their index and writer; and never mistaken for sealed ones, either way (a
    /// part in clear written into Redis does not open there).
    #[test]
    fn parts_in_clear_are_bound_and_never_taken_for_sealed_ones() {
        let plain = Sealer::plain("n1");
        let data = b"+15550100 Ada Lovelace";
        let mut buffer = Sealer::buffer(data.len());
        buffer.extend_from_slice(data);
        let part = Bytes::from(plain.seal_buffer(3, 7, buffer));
        assert_eq!(part.len(), HEADER + data.len(), "no tag");
        let at = part.as_ptr() as usize;
        let opened = plain.open_owned(3, 7, part.clone()).unwrap();
        assert_eq!(&opened[..], data);
        assert_eq!(opened.as_ptr() as usize, at + HEADER, "shared, not copied");
        assert!(
            plain.open_owned(4, 7, part.clone()).is_err(),
            "another index"
        );
        assert!(
            plain.open_owned(3, 8, part.clone()).is_err(),
            "another writer"
        );
        let sealed = Sealer::new(&[7u8; 32], "n1");
        assert!(
            sealed.open_owned(3, 7, part.clone()).is_err(),
            "a part in clear does not open as a sealed one"
        );
        let real = Bytes::from(sealed.seal(3, 7, |out, _| out.extend_from_slice(data)));
        assert!(
            plain.open_owned(3, 7, real).is_err(),
            "nor a sealed part as one in clear"
        );
        for len in 0..HEADER {
            assert!(plain.open_owned(3, 7, part.slice(..len)).is_err(), "{len}");
        }
        // An index beyond 32 bits never opens, not even as another index.
        let far = u64::from(u32::MAX) + 4;
        let part = Bytes::from(plain.seal_buffer(far, 7, Sealer::buffer(0)));
        assert!(plain.open_owned(far, 7, part.clone()).is_err());
        assert!(plain.open_owned(3, 7, part).is_err());
        // The helpers a record is written with, in clear.
        let whole = plain.seal_unknown(2, 9);
        assert!(matches!(
            plain.open_part(2, 9, &whole),
            Ok(crate::record::Part::Unknown)
        ));
    }

    #[test]
    fn a_part_handed_over_is_opened_where_it_lies() {
        let key = [3u8; 32];
        let sealer = Sealer::new(&key, "n1");
        let plain = vec![0x5au8; 4096];
        let part = Bytes::from(sealed(&key, "n1", 4, &plain));
        let at = part.as_ptr() as usize;
        let opened = sealer.open_owned(4, 0, part).unwrap();
        assert_eq!(&opened[..], &plain[..]);
        assert_eq!(
            opened.as_ptr() as usize,
            at + HEADER,
            "opened in the buffer it came in, not copied"
        );
        // A part someone else holds too (the memory store's) is copied, and opens the same.
        let part = Bytes::from(sealed(&key, "n1", 4, &plain));
        let kept = part.clone();
        let opened = sealer.open_owned(4, 0, part).unwrap();
        assert_eq!(&opened[..], &plain[..]);
        assert_ne!(opened.as_ptr(), kept[HEADER..].as_ptr());
        assert_eq!(&kept[..4], b"TIR\x03", "the kept part is left sealed");
        // Bound like `open`: another index or writer does not open.
        let part = Bytes::from(sealed(&key, "n1", 4, &plain));
        assert!(sealer.open_owned(5, 0, part).is_err());
    }
}
