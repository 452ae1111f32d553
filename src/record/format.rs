//! The plaintext inside a sealed record part (see [the module docs](super)).
//!
//! Every part starts with its type:
//!
//! ```text
//! 'W' whole record, in one part:   head, body length u32 + body, trailers
//! 'H' head of a streamed record:   head
//! 'C' chunk of a streamed body:    the bytes
//! 'E' end of a streamed record:    kept u8 (0: the body was not kept), body length u64, trailers
//! 'U' end of a streamed record whose outcome is unknown (the body broke off)
//!
//! head:      kind u8 (0 response, 1 body not kept, 2 outcome unknown), fingerprint 32 bytes,
//!            status u16, fence u64, headers, vary
//! headers:   count u16, then per header: name length u16, name, value length u32, value
//! vary:      as headers: for each request header the response varies on, the request's value
//!            (empty when it had none)
//! trailers:  as headers
//! ```
//!
//! Decoding checks every length and value and never panics.

use bytes::{BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const WHOLE: u8 = b'W';
const HEAD: u8 = b'H';
const CHUNK: u8 = b'C';
const END: u8 = b'E';
const UNKNOWN: u8 = b'U';

/// What a record says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A response, replayed as it was.
    Response,
    /// A response whose body was not kept (over the record limit, opted out, or refused or
    /// lost by the store): status, headers and the `grpc-status` trailer only.
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

/// What a record says before its body: the outcome, the request it answers, status, headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) kind: Kind,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) status: StatusCode,
    /// The fencing token of the execution that stored it.
    pub(crate) fence: u64,
    pub(crate) headers: HeaderMap,
    /// The request headers the response varies on, with the values they had.
    pub(crate) vary: HeaderMap,
}

/// A stored outcome in one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) head: Head,
    pub(crate) body: Bytes,
    pub(crate) trailers: HeaderMap,
}

/// One decoded part of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Part {
    Whole(Record),
    Head(Head),
    Chunk(Bytes),
    End {
        kept: bool,
        len: u64,
        trailers: HeaderMap,
    },
    Unknown,
}

/// The head of a response to encode, borrowed from the response being stored.
pub(crate) struct EncodeHead<'a, K: Fn(&HeaderName) -> bool> {
    pub(crate) kind: Kind,
    pub(crate) fingerprint: &'a [u8; 32],
    pub(crate) status: StatusCode,
    pub(crate) fence: u64,
    pub(crate) headers: &'a HeaderMap,
    /// Which headers are kept.
    pub(crate) keep: K,
    pub(crate) vary: &'a HeaderMap,
}

fn kept<'a>(
    headers: &'a HeaderMap,
    keep: &'a impl Fn(&HeaderName) -> bool,
) -> impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)> {
    // Past MAX_HEADER_VALUES (an outcome stored without its body, see `EncodeHead::fits`):
    // whole headers, in order, those whose values still fit.
    let crowded = headers.len() > MAX_HEADER_VALUES;
    let mut room = MAX_HEADER_VALUES;
    let mut current: Option<(&HeaderName, bool)> = None;
    headers.iter().filter(move |(name, _)| {
        if !keep(name) {
            return false;
        }
        if !crowded {
            return true;
        }
        match current {
            Some((seen, take)) if seen == *name => take,
            _ => {
                let count = headers.get_all(*name).iter().count();
                let take = count <= room;
                if take {
                    room -= count;
                }
                current = Some((name, take));
                take
            }
        }
    })
}

fn all(_: &HeaderName) -> bool {
    true
}

fn headers_len<'a>(
    headers: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> (usize, usize) {
    headers.fold((0, 0), |(c, l), (n, v)| {
        (c + 1, l + 6 + n.as_str().len() + v.len())
    })
}

/// The most header values (of a head, its `Vary` headers or its trailers) a record holds.
/// Far above what clients take (hyper's reads 100 by default), far below what a header map
/// holds. A response with more is stored without its body ([`EncodeHead::fits`] tells the
/// writers), and a block is never written with more (what is beyond is left out of such an
/// outcome); one read with more is refused as unreadable.
const MAX_HEADER_VALUES: usize = 8_192;

/// Whether `headers` fit in a record (see [`MAX_HEADER_VALUES`]): a response's trailers.
pub(crate) fn fits(headers: Option<&HeaderMap>) -> bool {
    headers.is_none_or(|headers| headers.len() <= MAX_HEADER_VALUES)
}

fn put_headers<'a>(
    out: &mut Vec<u8>,
    count: usize,
    headers: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) {
    // At most MAX_HEADER_VALUES (`kept` takes no more): a `u16`.
    let count = count.min(MAX_HEADER_VALUES);
    out.put_u16(count as u16);
    for (name, value) in headers.take(count) {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

impl<K: Fn(&HeaderName) -> bool> EncodeHead<'_, K> {
    /// Whether this head (the headers it keeps, its `Vary` headers) fits in a record: a
    /// response whose head does not is stored without its body, its head cut to what fits.
    pub(crate) fn fits(&self) -> bool {
        self.vary.len() <= MAX_HEADER_VALUES
            && (self.headers.iter())
                .filter(|(name, _)| (self.keep)(name))
                .nth(MAX_HEADER_VALUES)
                .is_none()
    }

    fn len(&self) -> (usize, usize, usize, usize) {
        let (count, len) = headers_len(kept(self.headers, &self.keep));
        let (v_count, v_len) = headers_len(kept(self.vary, &all));
        (count, len, v_count, 1 + 32 + 2 + 8 + 2 + len + 2 + v_len)
    }

    fn put(&self, out: &mut Vec<u8>, count: usize, v_count: usize) {
        out.put_u8(self.kind.code());
        out.put_slice(self.fingerprint);
        out.put_u16(self.status.as_u16());
        out.put_u64(self.fence);
        put_headers(out, count, kept(self.headers, &self.keep));
        put_headers(out, v_count, kept(self.vary, &all));
    }

    /// Appends a whole record (this head, `body`, `trailers`) to `out`, reserving `extra` more
    /// bytes (for the seal's tag) so that the record is built in one allocation.
    pub(crate) fn write_whole(
        &self,
        body: &[u8],
        trailers: Option<&HeaderMap>,
        out: &mut Vec<u8>,
        extra: usize,
    ) {
        let (count, _, v_count, head_len) = self.len();
        let empty = HeaderMap::new();
        let trailers = trailers.unwrap_or(&empty);
        let (t_count, t_len) = headers_len(kept(trailers, &all));
        out.reserve(1 + head_len + 4 + body.len() + 2 + t_len + extra);
        out.put_u8(WHOLE);
        self.put(out, count, v_count);
        out.put_u32(body.len() as u32);
        out.put_slice(body);
        put_headers(out, t_count, kept(trailers, &all));
    }

    /// Appends the head part of a streamed record to `out`.
    pub(crate) fn write_head(&self, out: &mut Vec<u8>, extra: usize) {
        let (count, _, v_count, head_len) = self.len();
        out.reserve(1 + head_len + extra);
        out.put_u8(HEAD);
        self.put(out, count, v_count);
    }
}

/// The first byte of a chunk part (its data follows, to the end of the part).
pub(crate) const CHUNK_TAG: u8 = CHUNK;

/// Appends the end part of a streamed record to `out`.
pub(crate) fn write_end(
    kept_body: bool,
    len: u64,
    trailers: Option<&HeaderMap>,
    out: &mut Vec<u8>,
    extra: usize,
) {
    let empty = HeaderMap::new();
    let trailers = trailers.unwrap_or(&empty);
    let (t_count, t_len) = headers_len(kept(trailers, &all));
    out.reserve(1 + 1 + 8 + 2 + t_len + extra);
    out.put_u8(END);
    out.put_u8(u8::from(kept_body));
    out.put_u64(len);
    put_headers(out, t_count, kept(trailers, &all));
}

/// Appends the end part of a streamed record whose outcome is unknown.
pub(crate) fn write_unknown(out: &mut Vec<u8>, extra: usize) {
    out.reserve(1 + extra);
    out.put_u8(UNKNOWN);
}

impl Part {
    /// Decodes a part's plaintext; chunk data and a whole record's body share `bytes`' buffer.
    pub(crate) fn decode(bytes: &Bytes) -> Result<Part, String> {
        let mut r = Reader { bytes, at: 0 };
        let part = match r.u8()? {
            WHOLE => {
                let head = r.head()?;
                let body_len = r.u32()? as usize;
                let start = r.at;
                r.take(body_len)?;
                let body = bytes.slice(start..start + body_len);
                let trailers = r.headers()?;
                Part::Whole(Record {
                    head,
                    body,
                    trailers,
                })
            }
            HEAD => Part::Head(r.head()?),
            CHUNK => {
                let data = bytes.slice(r.at..);
                r.at = bytes.len();
                Part::Chunk(data)
            }
            END => {
                let kept = match r.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(format!("unknown end flag {other}")),
                };
                let len = r.u64()?;
                let trailers = r.headers()?;
                Part::End {
                    kept,
                    len,
                    trailers,
                }
            }
            UNKNOWN => Part::Unknown,
            other => return Err(format!("unknown record part {other:#x}")),
        };
        if r.at != bytes.len() {
            return Err(format!("{} trailing bytes", bytes.len() - r.at));
        }
        Ok(part)
    }
}

impl Record {
    #[cfg(test)]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        EncodeHead {
            kind: self.head.kind,
            fingerprint: &self.head.fingerprint,
            status: self.head.status,
            fence: self.head.fence,
            headers: &self.head.headers,
            keep: all,
            vary: &self.head.vary,
        }
        .write_whole(&self.body, Some(&self.trailers), &mut out, 0);
        out
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

    fn head(&mut self) -> Result<Head, String> {
        let code = self.u8()?;
        let kind = Kind::from_code(code).ok_or_else(|| format!("unknown record kind {code}"))?;
        let fingerprint: [u8; 32] = self.array()?;
        let status = StatusCode::from_u16(self.u16()?).map_err(|e| format!("status: {e}"))?;
        let fence = self.u64()?;
        let headers = self.headers()?;
        let vary = self.headers()?;
        Ok(Head {
            kind,
            fingerprint,
            status,
            fence,
            headers,
            vary,
        })
    }

    fn headers(&mut self) -> Result<HeaderMap, String> {
        let count = self.u16()?;
        // A replay builds on the map (a header of its own, a map sized from this count when
        // the policy in force drops some), and a header map panics past 24,576 names.
        if usize::from(count) > MAX_HEADER_VALUES {
            return Err(format!(
                "{count} header values, more than a replay carries ({MAX_HEADER_VALUES})"
            ));
        }
        // No capacity from the untrusted count: HeaderMap panics on absurd capacities.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name_len = self.u16()? as usize;
            let name = HeaderName::from_bytes(self.take(name_len)?)
                .map_err(|e| format!("header name: {e}"))?;
            let value_len = self.u32()? as usize;
            let value = HeaderValue::from_bytes(self.take(value_len)?)
                .map_err(|e| format!("header value: {e}"))?;
            headers
                .try_append(name, value)
                .map_err(|_| format!("more headers than a header map holds ({count})"))?;
        }
        Ok(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(kind: Kind) -> Head {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("1"));
        headers.append("x-multi", HeaderValue::from_static("2"));
        let mut vary = HeaderMap::new();
        vary.insert("accept-encoding", HeaderValue::from_static("gzip"));
        Head {
            kind,
            fingerprint: [7; 32],
            status: StatusCode::CREATED,
            fence: 42,
            headers,
            vary,
        }
    }

    fn sample(kind: Kind, body: &'static [u8]) -> Record {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        Record {
            head: head(kind),
            body: Bytes::from_static(body),
            trailers,
        }
    }

    fn encode_head(h: &Head, out: &mut Vec<u8>) {
        EncodeHead {
            kind: h.kind,
            fingerprint: &h.fingerprint,
            status: h.status,
            fence: h.fence,
            headers: &h.headers,
            keep: all,
            vary: &h.vary,
        }
        .write_head(out, 0);
    }

    /// A head naming more distinct headers than a `HeaderMap` holds (about 32,000) is reported,
    /// never a panic (before: `HeaderMap::append` panicked on the record's count).
    #[test]
    fn too_many_headers_are_an_error_not_a_panic() {
        let mut h = head(Kind::Response);
        h.headers.clear();
        h.vary.clear();
        let mut empty = Vec::new();
        encode_head(&h, &mut empty);
        // Tag, kind, fingerprint, status, fence; then the header count.
        let fixed = 1 + 1 + 32 + 2 + 8;
        let mut out = empty[..fixed].to_vec();
        let count: u16 = 40_000;
        out.extend_from_slice(&count.to_be_bytes());
        for i in 0..count {
            let name = format!("x-{i}");
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&0u32.to_be_bytes());
        }
        out.extend_from_slice(&empty[fixed + 2..]);
        let decoded = std::panic::catch_unwind(|| Part::decode(&Bytes::from(out)));
        let Ok(decoded) = decoded else {
            panic!("decoding panicked")
        };
        assert!(decoded.is_err(), "{decoded:?}");
    }

    /// A head with more values than a record holds is written with the whole headers that fit,
    /// in order (what a response stored without its body keeps), and reads back.
    #[test]
    fn a_crowded_head_keeps_the_whole_headers_that_fit() {
        let mut h = head(Kind::BodyNotKept);
        h.headers.clear();
        h.headers
            .insert("location", HeaderValue::from_static("/p/1"));
        for _ in 0..MAX_HEADER_VALUES {
            h.headers.append("x-many", HeaderValue::from_static("1"));
        }
        h.headers.insert("x-last", HeaderValue::from_static("2"));
        let mut out = Vec::new();
        encode_head(&h, &mut out);
        let Part::Head(read) = Part::decode(&Bytes::from(out)).unwrap() else {
            panic!("not a head")
        };
        let names: Vec<_> = read.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["location", "x-last"]);
    }

    #[test]
    fn every_part_round_trips() {
        for (kind, body) in [
            (Kind::Response, &b"{\"id\":1}"[..]),
            (Kind::Response, b""),
            (Kind::BodyNotKept, b""),
            (Kind::Unknown, b""),
        ] {
            let r = sample(kind, body);
            let encoded = Bytes::from(r.encode());
            assert_eq!(Part::decode(&encoded).unwrap(), Part::Whole(r));
        }
        let h = head(Kind::Response);
        let mut out = Vec::new();
        encode_head(&h, &mut out);
        assert_eq!(Part::decode(&Bytes::from(out)).unwrap(), Part::Head(h));
        let chunk = Bytes::from_static(b"C some bytes");
        assert_eq!(
            Part::decode(&chunk).unwrap(),
            Part::Chunk(Bytes::from_static(b" some bytes"))
        );
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let mut out = Vec::new();
        write_end(true, 123, Some(&trailers), &mut out, 0);
        assert_eq!(
            Part::decode(&Bytes::from(out)).unwrap(),
            Part::End {
                kept: true,
                len: 123,
                trailers
            }
        );
        let mut out = Vec::new();
        write_unknown(&mut out, 0);
        assert_eq!(Part::decode(&Bytes::from(out)).unwrap(), Part::Unknown);
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let encoded = sample(Kind::Response, b"hello").encode();
        for len in 0..encoded.len() {
            assert!(
                Part::decode(&Bytes::copy_from_slice(&encoded[..len])).is_err(),
                "{len}"
            );
        }
        let mut extra = encoded.clone();
        extra.push(0);
        assert!(Part::decode(&Bytes::from(extra)).is_err());
        // Flip every byte in turn: decoding may succeed or fail, but never panics.
        for i in 0..encoded.len() {
            let mut flipped = encoded.clone();
            flipped[i] ^= 0xff;
            let _ = Part::decode(&Bytes::from(flipped));
        }
        assert!(Part::decode(&Bytes::from_static(b"{\"legacy\":\"json\"}")).is_err());
    }
}
