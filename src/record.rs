//! The stored outcome of a request, in a small versioned binary format.
//!
//! ```text
//! "TIR" 0x01                 magic and format version
//! fingerprint                32 bytes
//! flags                      1 byte: bit 0 = the body was too large and is not stored
//! status                     u16
//! header count               u16, then per header: name length u16, name, value length u32, value
//! body length                u32, then the body
//! ```
//!
//! Decoding checks every length and value and never panics: a corrupt record or one from an
//! unknown version is reported (the layer answers 500 `record-unreadable`), never replayed
//! wrongly and never a reason to run the handler again.

use bytes::{BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 3] = b"TIR";
const VERSION: u8 = 1;
const BODY_OMITTED: u8 = 1;

/// A stored response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) fingerprint: [u8; 32],
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    /// `None` when the body was over the storage limit.
    pub(crate) body: Option<Bytes>,
}

/// Encodes a response as a record: the headers `keep` accepts, and the body (`None`: over the
/// storage limit). One allocation, no intermediate header map.
pub(crate) fn encode(
    fingerprint: &[u8; 32],
    status: StatusCode,
    headers: &HeaderMap,
    keep: impl Fn(&HeaderName) -> bool,
    body: Option<&[u8]>,
) -> Vec<u8> {
    let kept = || {
        headers
            .iter()
            .filter(|(name, _)| keep(name))
            .take(u16::MAX as usize)
    };
    let (count, headers_len) = kept().fold((0usize, 0usize), |(c, l), (n, v)| {
        (c + 1, l + 6 + n.as_str().len() + v.len())
    });
    let data = body.unwrap_or_default();
    let mut out = Vec::with_capacity(4 + 32 + 1 + 2 + 2 + headers_len + 4 + data.len());
    out.put_slice(MAGIC);
    out.put_u8(VERSION);
    out.put_slice(fingerprint);
    out.put_u8(if body.is_none() { BODY_OMITTED } else { 0 });
    out.put_u16(status.as_u16());
    out.put_u16(count as u16);
    for (name, value) in kept() {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
    out.put_u32(data.len() as u32);
    out.put_slice(data);
    out
}

impl Record {
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Vec<u8> {
        encode(
            &self.fingerprint,
            self.status,
            &self.headers,
            |_| true,
            self.body.as_deref(),
        )
    }

    /// Decodes a record; the body shares `bytes`' buffer.
    pub(crate) fn decode(bytes: &Bytes) -> Result<Record, String> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(3)? != MAGIC {
            return Err("not a tower-idempotency record".into());
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(format!(
                "record format version {version} is not supported (this build reads {VERSION})"
            ));
        }
        let fingerprint: [u8; 32] = r.take(32)?.try_into().expect("took 32 bytes");
        let flags = r.u8()?;
        if flags & !BODY_OMITTED != 0 {
            return Err(format!("unknown record flags {flags:#x}"));
        }
        let status = StatusCode::from_u16(r.u16()?).map_err(|e| format!("status: {e}"))?;
        let count = r.u16()?;
        // No capacity from the untrusted count: HeaderMap panics on absurd capacities.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name_len = r.u16()? as usize;
            let name = HeaderName::from_bytes(r.take(name_len)?)
                .map_err(|e| format!("header name: {e}"))?;
            let value_len = r.u32()? as usize;
            let value = HeaderValue::from_bytes(r.take(value_len)?)
                .map_err(|e| format!("header value: {e}"))?;
            headers.append(name, value);
        }
        let body_len = r.u32()? as usize;
        let start = r.at;
        r.take(body_len)?;
        if r.at != bytes.len() {
            return Err(format!("{} trailing bytes", bytes.len() - r.at));
        }
        let body = bytes.slice(start..start + body_len);
        Ok(Record {
            fingerprint,
            status,
            headers,
            body: if flags & BODY_OMITTED != 0 {
                None
            } else {
                Some(body)
            },
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.at..end];
                self.at = end;
                Ok(out)
            }
            None => Err(format!("truncated at byte {} (wanted {n} more)", self.at)),
        }
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(body: Option<&'static [u8]>) -> Record {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("2"));
        Record {
            fingerprint: [7; 32],
            status: StatusCode::CREATED,
            headers,
            body: body.map(Bytes::from_static),
        }
    }

    #[test]
    fn round_trips() {
        for body in [Some(&b"{\"id\":1}"[..]), Some(&b""[..]), None] {
            let r = sample(body);
            let encoded = Bytes::from(r.encode());
            assert_eq!(Record::decode(&encoded).unwrap(), r);
        }
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let encoded = sample(Some(b"hello")).encode();
        for len in 0..encoded.len() {
            assert!(
                Record::decode(&Bytes::copy_from_slice(&encoded[..len])).is_err(),
                "{len}"
            );
        }
        let mut extra = encoded.clone();
        extra.push(0);
        assert!(Record::decode(&Bytes::from(extra)).is_err());
        let mut version = encoded.clone();
        version[3] = 9;
        assert!(
            Record::decode(&Bytes::from(version))
                .unwrap_err()
                .contains("version 9")
        );
        // Flip every byte in turn: decoding may succeed or fail, but never panics.
        for i in 0..encoded.len() {
            let mut flipped = encoded.clone();
            flipped[i] ^= 0xff;
            let _ = Record::decode(&Bytes::from(flipped));
        }
        assert!(Record::decode(&Bytes::from_static(b"{\"legacy\":\"json\"}")).is_err());
    }
}
