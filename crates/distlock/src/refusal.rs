//! Refusals that retrying cannot fix, recognised when a client is prepared: a command the Redis
//! user may not run (ACL) or the server does not offer (disabled or renamed), keys it may not
//! access, and TLS handshakes that fail. They become a [`LockError::Config`] (a [`ConfigError`]
//! inside) that names the cause: apart from `Held` and `Unavailable`, a configuration to fix.

use std::error::Error as _;

use crate::{ConfigError, LockError};

/// The commands the lock sends, for error messages (the full rule set is in the crate docs).
pub(crate) const REQUIRED: &str = "EVALSHA and SCRIPT LOAD (or FCALL, with the function library \
     loaded), and in scripts GET SET DEL PEXPIRE PTTL TYPE HGET HMGET HSET HDEL HEXISTS HINCRBY HSETNX \
     HLEN RPUSH LINDEX LLEN LRANGE PUBLISH (plus SUBSCRIBE for notifications, WAIT for the \
     replica check, ROLE for Sentinel, CLUSTER SLOTS for Cluster)";

/// The refusal `prepare` found without running anything: `command` (on the lock's keys) is
/// not allowed to the Redis user, or (`known` false) not offered by the server.
pub(crate) fn refused_command(store: &str, command: &str, known: bool) -> LockError {
    let (field, reason) = if known {
        (
            "acl",
            format!(
                "the Redis user may not run {command} on the lock's keys; the lock needs \
                 {REQUIRED}"
            ),
        )
    } else {
        (
            "commands",
            format!(
                "the server does not offer {command} (disabled or renamed, as some managed \
                 services do); the lock needs {REQUIRED}"
            ),
        )
    };
    LockError::Config(ConfigError::invalid(field, format!("{store}: {reason}")))
}

/// `error` as a [`LockError::Config`] when it is a refusal of that kind, else unchanged.
pub(crate) fn explain(error: LockError, store: &str) -> LockError {
    let source = match &error {
        LockError::Unavailable { source, .. } | LockError::Redis { source, .. } => source,
        LockError::NoQuorum {
            source: Some(source),
            ..
        } => source,
        _ => return error,
    };
    match refusal(source) {
        Some((field, reason)) => {
            LockError::Config(ConfigError::invalid(field, format!("{store}: {reason}")))
        }
        None => error,
    }
}

/// The text between the first pair of single quotes, upper-cased with `|` as a space:
/// `'script|load'` is `SCRIPT LOAD`.
fn quoted_command(text: &str) -> Option<String> {
    let start = text.find('\'')? + 1;
    let len = text[start..].find('\'')?;
    let name = &text[start..start + len];
    (!name.is_empty()).then(|| name.replace('|', " ").to_uppercase())
}

fn refusal(error: &redis::RedisError) -> Option<(&'static str, String)> {
    let text = error.to_string();
    let detail = error.detail().unwrap_or(&text);
    if error.code() == Some("NOPERM") {
        let reason = match quoted_command(detail) {
            Some(command) => format!(
                "the Redis user may not run {command} ({detail}); the lock needs {REQUIRED}"
            ),
            None if detail.contains("key") => format!(
                "the Redis user may not access the lock's keys ({detail}): give it ~PREFIX:* for \
                 the client's prefix"
            ),
            None if detail.contains("channel") => format!(
                "the Redis user may not use the lock's channels ({detail}): give it &PREFIX:*"
            ),
            None => format!("the Redis user was refused ({detail}); the lock needs {REQUIRED}"),
        };
        return Some(("acl", reason));
    }
    if text.contains("can't run this command or subcommand") {
        return Some((
            "acl",
            format!(
                "the Redis user may not run a command the lock's scripts call ({detail}); the \
                 lock needs {REQUIRED}"
            ),
        ));
    }
    if text.contains("unknown command") || text.contains("unknown subcommand") {
        let command = quoted_command(detail).unwrap_or_else(|| "a command".into());
        return Some((
            "commands",
            format!(
                "the server does not offer {command} (disabled or renamed, as some managed \
                 services do): {detail}; the lock needs {REQUIRED}"
            ),
        ));
    }
    if let Some(tls) = tls_error(error) {
        return Some((
            "tls",
            format!(
                "the TLS handshake failed: {tls} (check the trusted CA, the server's name in \
                 the URL, and the client certificate if the server asks for one)"
            ),
        ));
    }
    None
}

/// The rustls error somewhere in `error`'s chain.
fn tls_error(error: &redis::RedisError) -> Option<String> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = error.source();
    while let Some(current) = next {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(tls) = inner.downcast_ref::<rustls::Error>()
        {
            return Some(tls.to_string());
        }
        next = current.source();
    }
    // Errors shared between the waiters of one reconnection are copies that keep the message
    // and lose the source.
    let text = error.to_string();
    let lower = text.to_lowercase();
    let tls = [
        "peer certificate",
        "certificaterequired",
        "handshake",
        "tls alert",
        "received fatal alert",
    ];
    (error.is_io_error() && tls.iter().any(|t| lower.contains(t))).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::quoted_command;

    #[test]
    fn names_the_refused_command() {
        assert_eq!(
            quoted_command("User locks has no permissions to run the 'script|load' command")
                .as_deref(),
            Some("SCRIPT LOAD")
        );
        assert_eq!(
            quoted_command("unknown command 'evalsha', with args beginning with: ").as_deref(),
            Some("EVALSHA")
        );
        assert_eq!(quoted_command("No permissions to access a key"), None);
    }
}
