//! The least-privilege ACL rules for a Redis user of the lock (see [the crate docs](crate#acl)).

/// The commands the lock sends, directly or from its scripts, in `ACL SETUSER` form.
///
/// `FCALL` but not `FUNCTION LOAD`: a user that may load functions may replace any library on
/// the server, including one a more privileged client calls. Such a user runs the scripts as
/// `EVALSHA` unless an administrator loaded the lock's library ([`function_library`]).
const COMMANDS: &str = "-@all +fcall +evalsha +script|load +get +set +del +pexpire +pttl +type \
     +hget +hmget +hset +hdel +hexists +hincrby +hsetnx +hlen +rpush +lindex +llen +lrange +publish \
     +subscribe +unsubscribe +wait +role +cluster|slots";

/// The rules of an `ACL SETUSER` line (what follows the user name and its password) that let a
/// Redis user do everything locks under `prefix` need, and nothing else: the commands the lock
/// sends and its scripts call, the keys under `prefix:`, and the release channels under
/// `prefix:`. Glob characters in the prefix are escaped. The same rules serve the
/// `tower-idempotency` layer, whose default prefix is `idem`.
///
/// ```
/// assert_eq!(
///     distlock::acl_rules("myapp"),
///     "resetkeys ~myapp:* resetchannels &myapp:* -@all +fcall +evalsha +script|load +get +set \
///      +del +pexpire +pttl +type +hget +hmget +hset +hdel +hexists +hincrby +hsetnx +hlen +rpush \
///      +lindex +llen +lrange +publish +subscribe +unsubscribe +wait +role +cluster|slots"
/// );
/// // So a user is created with:
/// // ACL SETUSER locks on >PASSWORD resetkeys ~myapp:* resetchannels &myapp:* -@all +fcall ...
/// assert!(distlock::acl_rules("a*b").contains("~a\\*b:*"));
/// ```
pub fn acl_rules(prefix: &str) -> String {
    let pattern = if prefix.is_empty() {
        // Without a prefix the keys are `{name}`, `{name}:state`, channels `{name}:rel`.
        "{*".to_owned()
    } else {
        format!("{}:*", escape(prefix))
    };
    format!("resetkeys ~{pattern} resetchannels &{pattern} {COMMANDS}")
}

/// The rules of a Redis user for operators ([`LockClient::scan`](crate::LockClient::scan),
/// `tower-idempotency`'s `idempotency` tool): [`acl_rules`] and `SCAN` (the service's own user
/// needs no `SCAN`).
///
/// ```
/// assert!(distlock::operator_acl_rules("idem").ends_with(" +scan"));
/// ```
pub fn operator_acl_rules(prefix: &str) -> String {
    format!("{} +scan", acl_rules(prefix))
}

/// The Redis function library of the lock's scripts (Redis 7+, Valkey), as `FUNCTION LOAD`
/// takes it. A client loads it itself when its user may; for a least-privilege user
/// ([`acl_rules`], which leave `FUNCTION LOAD` out), an administrator loads it once per
/// version of this crate (its name carries the hash of its text), or the user's clients send
/// the same scripts with `EVALSHA` (Redis CPU per call is a little higher; the first call on
/// each connection is refused `FUNCTION LOAD`, which the ACL log shows).
///
/// ```
/// let library = distlock::function_library();
/// assert!(library.starts_with("#!lua name=distlock_"));
/// // As an administrator: redis-cli -x FUNCTION LOAD < library.lua
/// ```
pub fn function_library() -> &'static str {
    &crate::backend::redis::LIBRARY.code
}

/// `text` with the glob characters of ACL patterns escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::COMMANDS;

    const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/backend/redis/scripts");

    /// The commands sent outside the scripts, on the lock's keys: the pipelined acquisition on
    /// one Redis (`SET NX PX`, `HSETNX` and `PEXPIRE` with `fence_ttl`, `HINCRBY`, then `GET`
    /// and `PTTL` when held) and the
    /// plain reads of a completed record's parts (`LRANGE`).
    const PLAIN: [&str; 7] = [
        "SET", "HSETNX", "HINCRBY", "PEXPIRE", "GET", "PTTL", "LRANGE",
    ];

    /// Every command the scripts call (`redis.call` and `redis.pcall`), upper-case, by script.
    fn script_commands() -> Vec<(String, BTreeSet<String>)> {
        let mut scripts = Vec::new();
        for file in std::fs::read_dir(SCRIPTS).expect("the scripts directory") {
            let path = file.expect("a directory entry").path();
            if path.extension().is_none_or(|e| e != "lua") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a readable script");
            let mut commands = BTreeSet::new();
            for call in ["redis.call(", "redis.pcall("] {
                for rest in text.split(call).skip(1) {
                    let command: String = rest
                        .trim_start_matches(['\'', '"'])
                        .chars()
                        .take_while(char::is_ascii_alphabetic)
                        .collect();
                    assert!(
                        !command.is_empty(),
                        "{}: a computed command",
                        path.display()
                    );
                    commands.insert(command.to_ascii_uppercase());
                }
            }
            scripts.push((path.display().to_string(), commands));
        }
        assert!(
            scripts.len() >= 10,
            "found {} scripts in {SCRIPTS}",
            scripts.len()
        );
        scripts
    }

    /// Every command a script calls is in the rules (a script added or changed without its
    /// command here fails for least-privilege users only, at run time).
    #[test]
    fn the_rules_name_every_command_the_scripts_call() {
        let allowed: Vec<&str> = COMMANDS.split_whitespace().collect();
        for (script, commands) in script_commands() {
            for command in commands {
                let rule = format!("+{}", command.to_ascii_lowercase());
                assert!(
                    allowed.contains(&rule.as_str()),
                    "{script} calls {command}, which the ACL rules do not allow"
                );
            }
        }
    }

    /// The crate docs' list of the commands the scripts call, and the list refusals name
    /// (`refusal::REQUIRED`), are exactly what the scripts call.
    #[test]
    fn the_docs_name_every_command_the_scripts_call() {
        let called: BTreeSet<String> = script_commands()
            .into_iter()
            .flat_map(|(_, commands)| commands)
            .collect();
        let docs = include_str!("lib.rs");
        let (_, after) = docs
            .split_once("since Redis checks ACLs inside scripts too: `")
            .expect("the crate docs list what the scripts call");
        let (list, _) = after.split_once('`').expect("a list in backquotes");
        let listed: BTreeSet<String> = list
            .split_whitespace()
            .filter(|w| *w != "//!")
            .map(String::from)
            .collect();
        assert_eq!(listed, called, "the crate docs' list");
        let required: BTreeSet<&str> = crate::refusal::REQUIRED
            .split(|c: char| !c.is_ascii_alphabetic())
            .collect();
        for command in &called {
            assert!(
                required.contains(command.as_str()),
                "refusals do not name {command}"
            );
        }
    }

    /// `prepare()` checks every command the lock sends on its keys (but `PUBLISH`: the
    /// announcements are optional), so that a user refused one is told at startup.
    #[test]
    fn the_prepare_check_covers_every_command_the_lock_sends() {
        let check = std::fs::read_to_string(format!("{SCRIPTS}/check.lua")).expect("check.lua");
        let sent = script_commands()
            .into_iter()
            .flat_map(|(_, commands)| commands)
            .chain(PLAIN.map(String::from))
            .filter(|command| command != "PUBLISH");
        for command in sent {
            assert!(
                check.contains(&format!("{{'{command}', ")),
                "check.lua does not check {command}"
            );
        }
    }
}
