//! Rejections for people: a request from a browser (one that prefers `text/html` to JSON) gets
//! an HTML page saying what happened, with a way forward, instead of problem+json.
//!
//! The default page is [`default_page`]; replace it with
//! [`html_rejections`](crate::IdempotencyLayerBuilder::html_rejections), or turn pages off with
//! [`no_html_rejections`](crate::IdempotencyLayerBuilder::no_html_rejections). A layer that
//! renders rejections in a format of its own
//! ([`render_rejections`](crate::IdempotencyLayerBuilder::render_rejections)) or as gRPC
//! statuses sends no pages unless `html_rejections` is set too.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, header};

use super::Rejection;

/// What a page for a refusal can say: the rejection and the ways forward the request shows.
///
/// ```
/// use tower_idempotency::problem::html::{Page, default_page};
/// use tower_idempotency::Rejection;
/// let page = Page::new(&Rejection::KeyReused, Some("/signup"), Some("/accounts/7"));
/// let html = default_page(&page);
/// assert!(html.contains(r#"href="/accounts/7""#) && html.contains(r#"href="/signup""#));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Page<'a> {
    rejection: &'a Rejection,
    back: Option<&'a str>,
    earlier: Option<&'a str>,
}

impl<'a> Page<'a> {
    /// A page for `rejection`; `back` is where the person came from, `earlier` where the answer
    /// to the first request with the key points.
    pub fn new(rejection: &'a Rejection, back: Option<&'a str>, earlier: Option<&'a str>) -> Self {
        Page {
            rejection,
            back,
            earlier,
        }
    }

    /// The rejection.
    pub fn rejection(&self) -> &'a Rejection {
        self.rejection
    }

    /// The page the person came from (the path and query of the `Referer`, when it is on the
    /// same host): a fresh form to start again from.
    pub fn back(&self) -> Option<&'a str> {
        self.back
    }

    /// For a key used before with another request (`key-reused`): where the stored answer to
    /// the first one points (its `Location`: the account the first submission created, say).
    pub fn earlier_answer(&self) -> Option<&'a str> {
        self.earlier
    }
}

/// Renders a page for a person's browser.
pub(crate) type RenderHtml = dyn Fn(&Page<'_>) -> String + Send + Sync;

/// The `Location` of the first answer to a key reused with another request, carried to the
/// page in the rejection's extensions.
#[derive(Debug, Clone)]
pub(crate) struct EarlierAnswer(pub(crate) String);

/// What a page needs of the request, taken when the request comes in: `None` when it does not
/// prefer HTML.
#[derive(Debug, Clone)]
pub(crate) struct ForBrowser {
    back: Option<String>,
}

impl ForBrowser {
    /// Whether a request with these headers (and URI) wants pages: its `Accept` ranks
    /// `text/html` above JSON (a browser's navigation; an API client sends `application/json`
    /// or `*/*`, which ranks them equal).
    pub(crate) fn of(headers: &HeaderMap, uri: &http::Uri) -> Option<Self> {
        let accept: Vec<&[u8]> = headers
            .get_all(header::ACCEPT)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        let html = quality(&accept, "text", "html");
        let json = quality(&accept, "application", "problem+json").max(quality(
            &accept,
            "application",
            "json",
        ));
        (html > json).then(|| ForBrowser {
            back: same_host_referer(headers, uri),
        })
    }

    /// `response` (a rejection's, with the [`Rejection`] in its extensions) as a page: the same
    /// status and `Retry-After`, an HTML body; responses that are not rejections unchanged.
    pub(crate) fn render<B>(
        &self,
        render: &RenderHtml,
        response: Response<B>,
        body: impl FnOnce(Bytes) -> B,
    ) -> Response<B> {
        let Some(rejection) = response.extensions().get::<Rejection>() else {
            return response;
        };
        let earlier = response.extensions().get::<EarlierAnswer>();
        let page = Page::new(
            rejection,
            self.back.as_deref(),
            earlier.map(|e| e.0.as_str()),
        );
        let html = render(&page);
        let (mut parts, _) = response.into_parts();
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        parts
            .headers
            .insert(header::VARY, HeaderValue::from_static("accept"));
        Response::from_parts(parts, body(Bytes::from(html)))
    }
}

/// The path and query of the `Referer`, when it names this request's host.
fn same_host_referer(headers: &HeaderMap, uri: &http::Uri) -> Option<String> {
    let referer: http::Uri = headers.get(header::REFERER)?.to_str().ok()?.parse().ok()?;
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(http::uri::Authority::as_str))?;
    let same = referer
        .authority()
        .is_some_and(|a| a.as_str().eq_ignore_ascii_case(host));
    same.then(|| {
        referer
            .path_and_query()
            .map_or("/", http::uri::PathAndQuery::as_str)
            .to_owned()
    })
}

/// The quality (0 to 1000) an `Accept` header gives `kind/sub`: that of its most specific
/// matching range (RFC 9110, 12.5.1); 0 when no range matches, and so for every type without
/// an `Accept` header (a request without preferences gets JSON).
fn quality(accept: &[&[u8]], kind: &str, sub: &str) -> u16 {
    let mut best: Option<(u8, u16)> = None;
    for value in accept {
        let Ok(value) = std::str::from_utf8(value) else {
            continue;
        };
        for range in value.split(',') {
            let mut params = range.split(';');
            let media = params.next().unwrap_or("").trim();
            let Some((k, s)) = media.split_once('/') else {
                continue;
            };
            let specificity = match (k.trim(), s.trim()) {
                ("*", "*") => 1,
                (k, "*") if k.eq_ignore_ascii_case(kind) => 2,
                (k, s) if k.eq_ignore_ascii_case(kind) && s.eq_ignore_ascii_case(sub) => 3,
                _ => continue,
            };
            let q = params
                .filter_map(|p| p.split_once('='))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
                .map_or(1000, |(_, q)| qvalue(q.trim()));
            if best.is_none_or(|(s, _)| specificity > s) {
                best = Some((specificity, q));
            }
        }
    }
    best.map_or(0, |(_, q)| q)
}

/// A `qvalue` in thousandths (`0.8` is 800); malformed ones count as 0.
fn qvalue(q: &str) -> u16 {
    let (whole, fraction) = q.split_once('.').unwrap_or((q, ""));
    if fraction.len() > 3 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return 0;
    }
    let thousandths = format!("{fraction:0<3}").parse::<u16>().unwrap_or(0);
    match whole {
        "1" if thousandths == 0 => 1000,
        "0" => thousandths,
        _ => 0,
    }
}

/// Text for HTML.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn seconds(after: &Duration) -> u64 {
    after.as_secs().max(1)
}

/// The default page: what happened in a person's words, and the ways forward (the answer to
/// the first submission, the page the person came from).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::problem::html::{Page, default_page};
/// use tower_idempotency::Rejection;
/// let busy = Rejection::Conflict { retry_after: Duration::from_secs(2) };
/// let html = default_page(&Page::new(&busy, None, None));
/// assert!(html.starts_with("<!doctype html>") && html.contains("still being processed"));
/// ```
pub fn default_page(page: &Page<'_>) -> String {
    let rejection = page.rejection();
    let (heading, text) = match rejection {
        Rejection::Conflict { retry_after } => (
            "Your request is still being processed".to_owned(),
            format!(
                "It was sent already and has not finished yet. Wait {} seconds, then reload \
                 this page to see its result; it will not be done twice.",
                seconds(retry_after)
            ),
        ),
        Rejection::KeyReused => (
            "This form was already sent".to_owned(),
            "It was sent before with other values, and that first submission was completed. \
             Nothing was done with what you sent now."
                .to_owned(),
        ),
        Rejection::StoreUnavailable { retry_after } | Rejection::StoreFull { retry_after } => (
            "Please try again in a moment".to_owned(),
            format!(
                "We could not process your request right now, and nothing was done. Try again \
                 in {} seconds.",
                seconds(retry_after)
            ),
        ),
        Rejection::OutcomeUnknown { .. } => (
            "Something went wrong".to_owned(),
            "Your request was started and then failed: it may or may not have been done, so \
             it is not repeated. Check the result before you send it again."
                .to_owned(),
        ),
        other => (other.title().to_owned(), other.detail()),
    };
    let mut links = Vec::new();
    if let Some(earlier) = page.earlier_answer() {
        links.push(format!(
            r#"<a href="{}">See the result of the first submission</a>"#,
            escape(earlier)
        ));
    }
    links.push(format!(
        r#"<a href="{}">Start again from a fresh form</a>"#,
        escape(page.back().unwrap_or("/"))
    ));
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>body {{ font-family: system-ui, sans-serif; max-width: 36rem; margin: 3rem auto; padding: 0 1rem; color: #1d2330; }} a {{ display: inline-block; margin: .4rem 1rem .4rem 0; }}</style>
</head><body>
<h1>{title}</h1>
<p>{text}</p>
<p>{links}</p>
<p><small>{status} {slug}</small></p>
</body></html>
"#,
        title = escape(&heading),
        text = escape(&text),
        links = links.join(" "),
        status = rejection.status().as_u16(),
        slug = rejection.slug(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn wants(accept: &[&str]) -> bool {
        let mut headers = HeaderMap::new();
        for a in accept {
            headers.append(header::ACCEPT, HeaderValue::from_str(a).unwrap());
        }
        ForBrowser::of(&headers, &"/".parse().unwrap()).is_some()
    }

    #[test]
    fn browsers_get_pages_and_api_clients_json() {
        // Chromium's and Firefox's navigations.
        assert!(wants(&[
            "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
        ]));
        assert!(wants(&[
            "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
        ]));
        assert!(wants(&["text/*"]));
        assert!(wants(&["application/json;q=0.5", "text/html"]));
        // API clients, curl, no preference, and ties.
        assert!(!wants(&[]));
        assert!(!wants(&["*/*"]));
        assert!(!wants(&["application/json"]));
        assert!(!wants(&["application/problem+json, text/html"]));
        assert!(!wants(&["text/html;q=0.5, application/json"]));
        assert!(!wants(&["text/html;q=0"]));
        assert!(!wants(&["text/html;q=bogus, */*;q=0.1"]));
        assert_eq!(qvalue("0.8"), 800);
        assert_eq!(qvalue("1.000"), 1000);
        assert_eq!(qvalue("0.0001"), 0);
        assert_eq!(qvalue("2"), 0);
    }

    #[test]
    fn the_way_back_is_only_to_the_same_host() {
        let back = |referer: &str, host: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::REFERER, HeaderValue::from_str(referer).unwrap());
            headers.insert(header::HOST, HeaderValue::from_str(host).unwrap());
            same_host_referer(&headers, &"/".parse().unwrap())
        };
        assert_eq!(
            back("http://shop.test:3000/signup?x=1", "shop.test:3000").as_deref(),
            Some("/signup?x=1")
        );
        assert_eq!(back("https://evil.test/phish", "shop.test"), None);
        assert_eq!(back("not a uri at all", "shop.test"), None);
    }

    #[test]
    fn a_page_escapes_what_it_shows() {
        let rejection = Rejection::MalformedBody {
            reason: "<script>alert(1)</script>".into(),
        };
        let html = default_page(&Page::new(&rejection, Some("/\"><x"), None));
        assert!(
            !html.contains("<script>") && !html.contains("\"><x"),
            "{html}"
        );
        assert!(html.contains("&lt;script&gt;"));
    }

    #[test]
    fn a_rejection_becomes_a_page_and_keeps_its_status() {
        let rejection = Rejection::Conflict {
            retry_after: Duration::from_secs(3),
        };
        let problem = rejection.to_response();
        let browser = ForBrowser {
            back: Some("/".into()),
        };
        let page = browser.render(&default_page, problem, |b| b);
        assert_eq!(page.status(), StatusCode::CONFLICT);
        assert_eq!(page.headers()[header::RETRY_AFTER], "3");
        assert_eq!(
            page.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert!(String::from_utf8_lossy(page.body()).contains("still being processed"));
        // Not a rejection: unchanged.
        let ok = Response::new(Bytes::from_static(b"{}"));
        assert_eq!(browser.render(&default_page, ok, |b| b).body(), "{}");
    }
}
