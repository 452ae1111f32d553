//! The least-privilege ACL rules for a Redis user of the lock (see [the crate docs](crate#acl)).

/// The commands the lock sends, directly or from its scripts, in `ACL SETUSER` form.
const COMMANDS: &str = "-@all +evalsha +script|load +get +set +del +pexpire +pttl +type +hget \
     +hset +hdel +hexists +hincrby +hlen +publish +subscribe +unsubscribe +wait +role \
     +cluster|slots";

/// The rules of an `ACL SETUSER` line (what follows the user name and its password) that let a
/// Redis user do everything locks under `prefix` need, and nothing else: the commands the lock
/// sends and its scripts call, the keys under `prefix:`, and the release channels under
/// `prefix:`. Glob characters in the prefix are escaped. The same rules serve the
/// `tower-idempotency` layer, whose default prefix is `idem`.
///
/// ```
/// assert_eq!(
///     distlock::acl_rules("myapp"),
///     "resetkeys ~myapp:* resetchannels &myapp:* -@all +evalsha +script|load +get +set +del \
///      +pexpire +pttl +type +hget +hset +hdel +hexists +hincrby +hlen +publish +subscribe \
///      +unsubscribe +wait +role +cluster|slots"
/// );
/// // So a user is created with:
/// // ACL SETUSER locks on >PASSWORD resetkeys ~myapp:* resetchannels &myapp:* -@all +evalsha ...
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
