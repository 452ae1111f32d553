//! The plaintext inside a sealed record (see [the module docs](super)).
//!
//! ```text
//! part                       1 byte: 'W' (a whole record in one part)
//! kind                       1 byte: 0 response, 1 response whose body was not kept,
//!                            2 outcome unknown
//! fingerprint                32 bytes
//! status                     u16
//! fence                      u64 (the execution's fencing token)
//! header count               u16, then per header: name length u16, name, value length u32, value
//! body length                u32, then the body
//! trailer count              u16, then the trailers as the headers
//! vary count                 u16, then as the headers: for each request header the response
//!                            varies on, the request's value (empty when it had none)
//! ```
//!
//! Decoding checks every length and value and never panics.

use bytes::{BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// A whole record in one part.
const WHOLE: u8 = b'W';

/// What a record says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A response, replayed as it was.
    Response,
    /// A response whose body was over the storage limit: status and headers only.
    BodyNotKept,
    /// The handler started and its outcome is unknown (panic, error, failed body).
    Unknown,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Response => 0,
            Kind::BodyNotKept => 1,
            Kind::Unknown => 2,
        }
    }

    fn from_code(code: u8) -> Option<Kind> {
        match code {
            0 => Some(Kind::Response),
            1 => Some(Kind::BodyNotKept),
            2 => Some(Kind::Unknown),
            _ => None,
        }
    }
}

/// A stored outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) fingerprint: [u8; 32],
    pub(crate) kind: Kind,
    pub(crate) status: StatusCode,
    pub(crate) fence: u64,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) trailers: HeaderMap,
    /// The request headers the response varies on, with the values they had.
    pub(crate) vary: HeaderMap,
}

/// The parts of a record to encode, borrowed from the response being stored.
pub(crate) struct Encode<'a, K: Fn(&HeaderName) -> bool> {
    pub(crate) fingerprint: &'a [u8; 32],
    pub(crate) kind: Kind,
    pub(crate) status: StatusCode,
    pub(crate) fence: u64,
    pub(crate) headers: &'a HeaderMap,
    /// Which headers are kept.
    pub(crate) keep: K,
    pub(crate) body: &'a [u8],
    pub(crate) trailers: Option<&'a HeaderMap>,
    pub(crate) vary: &'a HeaderMap,
}

fn kept<'a>(
    headers: &'a HeaderMap,
    keep: &'a impl Fn(&HeaderName) -> bool,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> {
    headers
        .iter()
        .filter(move |(name, _)| keep(name))
        .take(u16::MAX as usize)
}

fn headers_len<'a>(
    headers: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> (usize, usize) {
    headers.fold((0, 0), |(c, l), (n, v)| {
        (c + 1, l + 6 + n.as_str().len() + v.len())
    })
}

fn put_headers<'a>(
    out: &mut Vec<u8>,
    count: usize,
    headers: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) {
    out.put_u16(count as u16);
    for (name, value) in headers {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

impl<K: Fn(&HeaderName) -> bool> Encode<'_, K> {
    /// Appends the plaintext to `out`, reserving `extra` more bytes (for the seal's tag) so
    /// that the record is built in one allocation.
    pub(crate) fn write(&self, out: &mut Vec<u8>, extra: usize) {
        let (count, len) = headers_len(kept(self.headers, &self.keep));
        let all = |_: &HeaderName| true;
        let empty = HeaderMap::new();
        let trailers = self.trailers.unwrap_or(&empty);
        let (t_count, t_len) = headers_len(kept(trailers, &all));
        let (v_count, v_len) = headers_len(kept(self.vary, &all));
        out.reserve(2 + 32 + 2 + 8 + 2 + len + 4 + self.body.len() + 2 + t_len + 2 + v_len + extra);
        out.put_u8(WHOLE);
        out.put_u8(self.kind.code());
        out.put_slice(self.fingerprint);
        out.put_u16(self.status.as_u16());
        out.put_u64(self.fence);
        put_headers(out, count, kept(self.headers, &self.keep));
        out.put_u32(self.body.len() as u32);
        out.put_slice(self.body);
        put_headers(out, t_count, kept(trailers, &all));
        put_headers(out, v_count, kept(self.vary, &all));
    }
}

impl Record {
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        Encode {
            fingerprint: &self.fingerprint,
            kind: self.kind,
            status: self.status,
            fence: self.fence,
            headers: &self.headers,
            keep: |_: &HeaderName| true,
            body: &self.body,
            trailers: Some(&self.trailers),
            vary: &self.vary,
        }
        .write(&mut out, 0);
        out
    }

    /// Decodes a record's plaintext; the body shares `bytes`' buffer.
    pub(crate) fn decode(bytes: &Bytes) -> Result<Record, String> {
        let mut r = Reader { bytes, at: 0 };
        let part = r.u8()?;
        if part != WHOLE {
            return Err(format!("unknown record part {part:#x}"));
        }
        let code = r.u8()?;
        let kind = Kind::from_code(code).ok_or_else(|| format!("unknown record kind {code}"))?;
        let fingerprint: [u8; 32] = r.array()?;
        let status = StatusCode::from_u16(r.u16()?).map_err(|e| format!("status: {e}"))?;
        let fence = r.u64()?;
        let headers = r.headers()?;
        let body_len = r.u32()? as usize;
        let start = r.at;
        r.take(body_len)?;
        let body = bytes.slice(start..start + body_len);
        let trailers = r.headers()?;
        let vary = r.headers()?;
        if r.at != bytes.len() {
            return Err(format!("{} trailing bytes", bytes.len() - r.at));
        }
        Ok(Record {
            fingerprint,
            kind,
            status,
            fence,
            headers,
            body,
            trailers,
            vary,
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

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn headers(&mut self) -> Result<HeaderMap, String> {
        let count = self.u16()?;
        // No capacity from the untrusted count: HeaderMap panics on absurd capacities.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name_len = self.u16()? as usize;
            let name = HeaderName::from_bytes(self.take(name_len)?)
                .map_err(|e| format!("header name: {e}"))?;
            let value_len = self.u32()? as usize;
            let value = HeaderValue::from_bytes(self.take(value_len)?)
                .map_err(|e| format!("header value: {e}"))?;
            headers.append(name, value);
        }
        Ok(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kind: Kind, body: &'static [u8]) -> Record {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("2"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let mut vary = HeaderMap::new();
        vary.insert("accept-encoding", HeaderValue::from_static("gzip"));
        Record {
            fingerprint: [7; 32],
            kind,
            status: StatusCode::CREATED,
            fence: 42,
            headers,
            body: Bytes::from_static(body),
            trailers,
            vary,
        }
    }

    #[test]
    fn round_trips() {
        for (kind, body) in [
            (Kind::Response, &b"{\"id\":1}"[..]),
            (Kind::Response, b""),
            (Kind::BodyNotKept, b""),
            (Kind::Unknown, b""),
        ] {
            let r = sample(kind, body);
            let encoded = Bytes::from(r.encode());
            assert_eq!(Record::decode(&encoded).unwrap(), r);
        }
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let encoded = sample(Kind::Response, b"hello").encode();
        for len in 0..encoded.len() {
            assert!(
                Record::decode(&Bytes::copy_from_slice(&encoded[..len])).is_err(),
                "{len}"
            );
        }
        let mut extra = encoded.clone();
        extra.push(0);
        assert!(Record::decode(&Bytes::from(extra)).is_err());
        // Flip every byte in turn: decoding may succeed or fail, but never panics.
        for i in 0..encoded.len() {
            let mut flipped = encoded.clone();
            flipped[i] ^= 0xff;
            let _ = Record::decode(&Bytes::from(flipped));
        }
        assert!(Record::decode(&Bytes::from_static(b"{\"legacy\":\"json\"}")).is_err());
    }
}
