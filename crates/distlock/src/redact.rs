//! Redis URLs as they can be shown in messages and logs.

/// `url` with its password masked, wherever redis-rs reads one: the userinfo
/// (`redis://user:secret@host`) and a `pass` or `password` query parameter
/// (`redis+unix:///run/redis.sock?pass=secret`).
///
/// ```
/// assert_eq!(
///     distlock::redact_url("redis://app:secret@10.0.0.5:6379/2"),
///     "redis://app:***@10.0.0.5:6379/2"
/// );
/// assert!(!distlock::redact_url("redis+unix:///run/redis.sock?db=1&pass=secret").contains("secret"));
/// assert_eq!(distlock::redact_url("not a url"), "(an unparsable URL)");
/// ```
pub fn redact_url(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return "(an unparsable URL)".to_owned();
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("***"));
    }
    let secret = |name: &str| matches!(name, "pass" | "password");
    if parsed.query_pairs().any(|(name, _)| secret(&name)) {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(name, value)| {
                let value = if secret(&name) {
                    "***".to_owned()
                } else {
                    value.into_owned()
                };
                (name.into_owned(), value)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}
