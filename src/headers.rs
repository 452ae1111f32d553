//! Which headers a record keeps: the trailers stored and replayed, a gRPC call's status fields,
//! and the request headers a response varies on (checked before a replay).

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::layer::Config;

/// The request headers a response varies on (its `Vary`), with the values the request had
/// (empty when it had none), among those the layer keeps for the check.
pub(crate) fn negotiated(response: &HeaderMap, request: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for vary in response.get_all(header::VARY) {
        let Ok(vary) = vary.to_str() else { continue };
        for name in vary.split(',').map(str::trim) {
            let Ok(name) = HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) else {
                continue; // `*` and malformed names: nothing to check
            };
            if NEGOTIATED.contains(&name) {
                let value = joined(request, &name).unwrap_or(HeaderValue::from_static(""));
                out.insert(name, value);
            }
        }
    }
    out
}

/// The request headers kept for a `Vary` check at replay: those content negotiation and CORS
/// vary on.
pub(crate) const NEGOTIATED: [HeaderName; 4] = [
    header::ACCEPT,
    header::ACCEPT_ENCODING,
    header::ACCEPT_LANGUAGE,
    header::ORIGIN,
];

/// The request's values of the [`NEGOTIATED`] headers it has, each [`joined`]: one pass over its
/// headers finds which it has, comparing names, where looking each up would hash it.
pub(crate) fn negotiation(request: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in request.keys() {
        if NEGOTIATED.contains(name)
            && !out.contains_key(name)
            && let Some(value) = joined(request, name)
        {
            out.insert(name.clone(), value);
        }
    }
    out
}

/// All values of a header, joined with ", " (one value: no copy).
pub(crate) fn joined(headers: &HeaderMap, name: &HeaderName) -> Option<HeaderValue> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    let rest: Vec<&HeaderValue> = values.collect();
    if rest.is_empty() {
        return Some(first.clone());
    }
    let mut all = first.as_bytes().to_vec();
    for v in rest {
        all.extend_from_slice(b", ");
        all.extend_from_slice(v.as_bytes());
    }
    HeaderValue::from_bytes(&all).ok()
}

/// Whether a trailer is stored and replayed: those the header policy keeps, and a gRPC call's
/// status fields whatever it says (they are the call's outcome).
fn keeps_trailer(config: &Config, name: &HeaderName) -> bool {
    config.replay_headers.keeps(name) || GRPC_STATUS.contains(name)
}

/// The trailers of a response that are stored and replayed (see [`keeps_trailer`]): no copy
/// when all are.
pub(crate) fn kept_trailers<'a>(
    config: &Config,
    trailers: Cow<'a, HeaderMap>,
) -> Cow<'a, HeaderMap> {
    filtered(trailers, |name| keeps_trailer(config, name))
}

/// `headers` without those `keep` refuses (no copy when it keeps them all).
fn filtered<'a>(
    headers: Cow<'a, HeaderMap>,
    keep: impl Fn(&HeaderName) -> bool,
) -> Cow<'a, HeaderMap> {
    if headers.keys().all(&keep) {
        return headers;
    }
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers.iter().filter(|(name, _)| keep(name)) {
        kept.append(name.clone(), value.clone());
    }
    Cow::Owned(kept)
}

/// A gRPC call's status fields, which a rejection of its own replaces.
pub(crate) const GRPC_STATUS: [HeaderName; 3] = [
    HeaderName::from_static("grpc-status"),
    HeaderName::from_static("grpc-message"),
    HeaderName::from_static("grpc-status-details-bin"),
];

/// The header policy in force now applies to what was stored under an earlier one.
pub(crate) fn kept_headers(config: &Config, headers: HeaderMap) -> HeaderMap {
    filtered(Cow::Owned(headers), |name| {
        config.replay_headers.keeps(name)
    })
    .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_joins_each_negotiated_header_as_a_lookup_would() {
        let mut request = HeaderMap::new();
        request.append(header::ACCEPT, HeaderValue::from_static("text/html"));
        request.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        request.append(
            header::ORIGIN,
            HeaderValue::from_static("https://a.example"),
        );
        request.append(
            header::ACCEPT,
            HeaderValue::from_static("application/json;q=0.9"),
        );
        request.append(header::COOKIE, HeaderValue::from_static("a=1"));
        let one_pass = negotiation(&request);
        let mut looked_up = HeaderMap::new();
        for name in NEGOTIATED {
            if let Some(value) = joined(&request, &name) {
                looked_up.insert(name, value);
            }
        }
        assert_eq!(one_pass, looked_up);
        assert_eq!(one_pass.len(), 2, "{one_pass:?}");
        assert_eq!(
            one_pass[header::ACCEPT],
            "text/html, application/json;q=0.9"
        );
        assert!(negotiation(&HeaderMap::new()).is_empty());
    }
}
