//! Entry points for the fuzz targets in `fuzz/` and the benchmarks in `benches/`: not a stable
//! API.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, StatusCode};

use crate::record::{EncodeHead, Kind, Part, Sealer};
use crate::secret::Keys;

/// Decodes `bytes` as a part's plaintext, and opens them as a sealed part under a fixed key;
/// must never panic, whatever the bytes.
pub fn decode_record(bytes: &[u8]) -> Result<(), String> {
    let sealer = Sealer::new(&[7; 32], "fuzz");
    let _ = sealer.open_part(1, 1, bytes);
    Part::decode(&Bytes::copy_from_slice(bytes)).map(|_| ())
}

/// The fingerprint of a request's parts and body.
pub fn fingerprint(parts: &http::request::Parts, body: &[u8]) -> [u8; 32] {
    let keys = Keys::new(Some(b"fuzzing secret, 32 bytes long..."));
    crate::fingerprint::fingerprint(
        keys.fingerprinter(),
        parts,
        &[http::header::CONTENT_TYPE],
        body,
        None,
    )
}

/// The keys a server secret derives.
#[derive(Debug)]
pub struct ServerKeys(Keys);

/// What a request derives from its key: the store name and the record key.
pub fn derive(keys: &ServerKeys, parts: &http::request::Parts, key: &str) -> ([u8; 32], String) {
    let derived = crate::scope::derive(&keys.0, parts, None, key, crate::scope::Naming::Key, true);
    (derived.record_key.unwrap_or_default(), derived.name)
}

/// Server keys from a secret.
pub fn keys(secret: &[u8]) -> ServerKeys {
    ServerKeys(Keys::new(Some(secret)))
}

fn all(_: &HeaderName) -> bool {
    true
}

fn head(headers: &HeaderMap) -> EncodeHead<'_, fn(&HeaderName) -> bool> {
    EncodeHead {
        kind: Kind::Response,
        fingerprint: &[7; 32],
        status: StatusCode::CREATED,
        fence: 1,
        headers,
        keep: all,
        vary: headers,
    }
}

/// A record of a response with `body`, encoded and sealed (what a completion stores).
pub fn seal(key: &[u8; 32], name: &str, body: &[u8], headers: &HeaderMap) -> Vec<u8> {
    Sealer::new(key, name).seal_whole(&head(headers), body, None)
}

/// The same record encoded without sealing (the cost of the format alone).
pub fn encode_plain(body: &[u8], headers: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::new();
    head(headers).write_whole(body, None, &mut out, 0);
    out
}

/// Opens and decodes a sealed record (what a replay does); returns the body length.
pub fn open(key: &[u8; 32], name: &str, sealed: &[u8]) -> usize {
    match Sealer::new(key, name).open_part(0, 0, sealed) {
        Ok(Part::Whole(record)) => record.body.len(),
        _ => 0,
    }
}

/// A chunk part of a streamed record (part 1 of writer 1) holding `data`, sealed.
pub fn seal_chunk(key: &[u8; 32], name: &str, data: &[u8]) -> Vec<u8> {
    let mut buffer = Sealer::chunk_buffer(data.len());
    buffer.extend_from_slice(data);
    Sealer::new(key, name).seal_chunk(1, 1, buffer)
}

/// Opens and decodes a chunk part from [`seal_chunk`] as a replay does: handed over (opened
/// where it lies when nothing else holds it: a part read from Redis), or, with `copy`,
/// borrowed and copied first (as before); returns the data length.
pub fn open_chunk(key: &[u8; 32], name: &str, sealed: Bytes, copy: bool) -> usize {
    let sealer = Sealer::new(key, name);
    let part = if copy {
        sealer.open_part(1, 1, &sealed)
    } else {
        sealer.open_part_owned(1, 1, sealed)
    };
    match part {
        Ok(Part::Chunk(data)) => data.len(),
        _ => 0,
    }
}

/// Decodes a plain record; returns the body length.
pub fn decode_plain(plain: &[u8]) -> usize {
    match Part::decode(&Bytes::copy_from_slice(plain)) {
        Ok(Part::Whole(record)) => record.body.len(),
        _ => 0,
    }
}
