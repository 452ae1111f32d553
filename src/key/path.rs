//! Keys from the matched route's path parameters, and what the layer reads of the route.

use bytes::Bytes;
use http::request::Parts;

use super::{KeyKind, KeySource, check_key};
use crate::Rejection;

/// The key from a path parameter: see [`path`].
#[derive(Debug, Clone)]
pub struct PathKey {
    param: String,
}

/// A parameter of the matched route, e.g. `order_id` in `/orders/{order_id}/pay`,
/// percent-decoded as axum's `Path` decodes it. Under axum the layer takes the parameters the
/// router matched (so nested routers work); with other routers it matches the path against a
/// [`RouteTemplate`] extension.
///
/// ```
/// use tower_idempotency::KeySource;
/// let mut req = http::Request::builder().uri("/orders/42/pay").body(()).unwrap();
/// req.extensions_mut().insert(tower_idempotency::key::RouteTemplate("/orders/{order_id}/pay".into()));
/// let (parts, ()) = req.into_parts();
/// let key = tower_idempotency::key::path("order_id").extract(&parts, &bytes::Bytes::new()).unwrap();
/// assert_eq!(key.as_deref(), Some("42"));
/// ```
pub fn path(param: &str) -> PathKey {
    PathKey {
        param: param.to_owned(),
    }
}

/// The route template of a request (`/orders/{order_id}/pay`), for routers other than axum's.
/// The layer uses it to scope keys per route and to find path parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTemplate(pub String);

/// The route template: axum's `MatchedPath`, else a [`RouteTemplate`] extension.
pub(crate) fn route_template(parts: &Parts) -> Option<&str> {
    template_in(&parts.extensions)
}

/// [`route_template`] from a request's extensions.
pub(crate) fn template_in(extensions: &http::Extensions) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(matched) = extensions.get::<axum::extract::MatchedPath>() {
        return Some(matched.as_str());
    }
    extensions.get::<RouteTemplate>().map(|t| t.0.as_str())
}

/// The path and query the client sent: axum's `OriginalUri` (a nested router sees the path
/// without its prefix, which may hold parameters of its own), else the request's.
pub(crate) fn original_target(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    #[cfg(not(feature = "axum"))]
    let uri = &parts.uri;
    target(uri)
}

/// The path and query of `uri` (the path alone when it has no query).
pub(crate) fn target(uri: &http::Uri) -> &str {
    uri.path_and_query().map_or(uri.path(), |pq| pq.as_str())
}

/// The path parameters the router matched, percent-decoded (collected by the layer from axum).
#[derive(Debug, Clone)]
// Made by the axum integration only.
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) enum PathParams {
    Matched(Vec<(String, String)>),
    /// A parameter was not valid UTF-8 once percent-decoded.
    InvalidUtf8,
}

/// Collects the parameters axum matched (for `Router::nest`ed routes too: the parameters, not
/// the path, which the nested router sees without its prefix).
#[cfg(feature = "axum")]
pub(crate) fn collect_path_params(parts: &mut Parts) {
    use axum::extract::{FromRequestParts, RawPathParams, rejection::RawPathParamsRejection};
    use futures_util::FutureExt;
    if parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .is_none()
    {
        return;
    }
    let params = match RawPathParams::from_request_parts(parts, &()).now_or_never() {
        Some(Ok(params)) => PathParams::Matched(
            params
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        ),
        Some(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => PathParams::InvalidUtf8,
        _ => return,
    };
    parts.extensions.insert(params);
}

fn decode_segment(segment: &str) -> Option<String> {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

impl KeySource for PathKey {
    fn extract(&self, parts: &Parts, _body: &Bytes) -> Result<Option<String>, Rejection> {
        let invalid_utf8 = || Rejection::InvalidKey {
            reason: format!(
                "{} is not valid UTF-8 once percent-decoded.",
                self.describe()
            ),
        };
        match parts.extensions.get::<PathParams>() {
            Some(PathParams::Matched(params)) => {
                return match params.iter().find(|(name, _)| *name == self.param) {
                    Some((_, value)) => check_key(value.clone(), &self.describe()).map(Some),
                    None => Ok(None),
                };
            }
            Some(PathParams::InvalidUtf8) => return Err(invalid_utf8()),
            None => {}
        }
        let Some(template) = route_template(parts) else {
            return Ok(None);
        };
        let mut actual = parts.uri.path().split('/');
        for segment in template.split('/') {
            let value = actual.next();
            let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) else {
                continue;
            };
            if let Some(rest_name) = name.strip_prefix('*') {
                if rest_name == self.param {
                    let rest: Vec<&str> = value.into_iter().chain(actual).collect();
                    let rest = decode_segment(&rest.join("/")).ok_or_else(invalid_utf8)?;
                    return check_key(rest, &self.describe()).map(Some);
                }
                return Ok(None);
            }
            if name == self.param {
                return match value {
                    Some(v) => {
                        let v = decode_segment(v).ok_or_else(invalid_utf8)?;
                        check_key(v, &self.describe()).map(Some)
                    }
                    None => Ok(None),
                };
            }
        }
        Ok(None)
    }

    fn describe(&self) -> String {
        format!("the path parameter {:?}", self.param)
    }

    fn needs_body(&self) -> bool {
        false
    }

    fn kind(&self) -> KeyKind {
        KeyKind::Thing
    }

    fn uses_path_params(&self) -> bool {
        true
    }
}
