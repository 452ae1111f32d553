//! Lock names and the Redis keys derived from them.

use std::sync::Arc;

use crate::ConfigError;

/// Longest lock name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// A validated lock name with the keys it maps to.
///
/// Every key of one lock shares the hash tag `{name}`, so every script touches a single hash slot
/// and runs unchanged on Redis Cluster:
///
/// | key | holds |
/// |---|---|
/// | `prefix:{name}` | the lock: the owner token (string) or, for a reentrant lock, a hash |
/// | `prefix:{name}:state` | hash: fencing counter `n`, and for [`Once`](crate::Once) the in-flight tag `m` (once completed, the completing token), a one-part record `d`, the part count `p` of a streamed record |
/// | `prefix:{name}:parts` | ([`Once`](crate::Once) streamed records only) list: the parts, in order |
/// | `prefix:{name}:rel` | pub/sub channel announcing releases (and, for streamed records, progress) |
///
/// ```
/// let name = distlock::LockName::new("locks", "nightly-report")?;
/// assert_eq!(name.lock_key(), "locks:{nightly-report}");
/// assert_eq!(name.state_key(), "locks:{nightly-report}:state");
/// assert!(distlock::LockName::new("locks", "a}b").is_err());
/// # Ok::<(), distlock::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LockName {
    /// `<lock>:state<lock>:parts<lock>:rel` in one allocation: the lock key, the state key (the
    /// lock key and a suffix), the parts key and the channel are slices of it.
    keys: Arc<str>,
    /// Where the lock key ends.
    lock_end: u32,
    /// Where the name starts, inside the braces.
    name_start: u32,
}

const STATE: &str = ":state";
const PARTS: &str = ":parts";
const REL: &str = ":rel";

impl std::fmt::Debug for LockName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LockName").field(&self.lock_key()).finish()
    }
}

impl LockName {
    /// Validates `name` under `prefix`. Names must be non-empty, at most [`MAX_NAME_LEN`] bytes, and
    /// free of `{`, `}` and control characters (braces would change the hash tag); the prefix
    /// follows the same rules but may be empty.
    ///
    /// ```
    /// assert!(distlock::LockName::new("", "job").is_ok());
    /// assert!(distlock::LockName::new("p", "").is_err());
    /// ```
    pub fn new(prefix: &str, name: &str) -> Result<Self, ConfigError> {
        check_part("prefix", prefix, true)?;
        check_part("name", name, false)?;
        let separator = if prefix.is_empty() { "" } else { ":" };
        let lock_len = prefix.len() + separator.len() + name.len() + 2;
        let mut keys = String::with_capacity(3 * lock_len + STATE.len() + PARTS.len() + REL.len());
        for suffix in [STATE, PARTS, REL] {
            keys.push_str(prefix);
            keys.push_str(separator);
            keys.push('{');
            keys.push_str(name);
            keys.push('}');
            keys.push_str(suffix);
        }
        Ok(LockName {
            keys: keys.into(),
            lock_end: lock_len as u32,
            name_start: (prefix.len() + separator.len() + 1) as u32,
        })
    }

    /// The name as given.
    ///
    /// ```
    /// assert_eq!(distlock::LockName::new("p", "job")?.as_str(), "job");
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.keys[self.name_start as usize..self.lock_end as usize - 1]
    }

    /// The key that holds the lock.
    ///
    /// ```
    /// assert_eq!(distlock::LockName::new("p", "job")?.lock_key(), "p:{job}");
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn lock_key(&self) -> &str {
        &self.keys[..self.lock_end as usize]
    }

    /// The key that holds the fencing counter (and [`Once`](crate::Once) records).
    ///
    /// ```
    /// assert_eq!(distlock::LockName::new("p", "job")?.state_key(), "p:{job}:state");
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn state_key(&self) -> &str {
        &self.keys[..self.lock_end as usize + STATE.len()]
    }

    /// The key that holds the parts of a streamed [`Once`](crate::Once) record (see
    /// [`OnceGuard::append`](crate::OnceGuard::append)); a one-part record never creates it.
    ///
    /// ```
    /// assert_eq!(distlock::LockName::new("p", "job")?.parts_key(), "p:{job}:parts");
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn parts_key(&self) -> &str {
        let start = self.lock_end as usize + STATE.len();
        &self.keys[start..start + self.lock_end as usize + PARTS.len()]
    }

    /// The pub/sub channel on which releases of this lock are announced (and the progress of a
    /// streamed [`Once`](crate::Once) record).
    ///
    /// ```
    /// assert_eq!(distlock::LockName::new("p", "job")?.channel(), "p:{job}:rel");
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn channel(&self) -> &str {
        &self.keys[2 * self.lock_end as usize + STATE.len() + PARTS.len()..]
    }
}

/// The pub/sub channel on which the purges of records under `prefix` are announced (the
/// purged name as the message): `prefix:purged`, or `purged` for an empty prefix.
pub(crate) fn purge_channel(prefix: &str) -> String {
    if prefix.is_empty() {
        "purged".to_owned()
    } else {
        format!("{prefix}:purged")
    }
}

impl LockName {
    /// The channel [`purge_channel`] names for this name's prefix.
    pub(crate) fn purge_channel(&self) -> String {
        let prefix = &self.keys[..(self.name_start as usize - 1)];
        purge_channel(prefix.strip_suffix(':').unwrap_or(prefix))
    }
}

fn check_part(field: &'static str, value: &str, may_be_empty: bool) -> Result<(), ConfigError> {
    if value.is_empty() && !may_be_empty {
        return Err(ConfigError::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_NAME_LEN {
        return Err(ConfigError::invalid(
            field,
            format!("{} bytes is over the limit of {MAX_NAME_LEN}", value.len()),
        ));
    }
    // Fast path on bytes, every byte looked at (no early exit, so that it runs as wide as the
    // CPU allows); a 0xC2 byte may start a C1 control (U+0080..U+009F), so check those the
    // slow way.
    let clean = !value.bytes().fold(false, |bad, b| {
        bad | (b < 0x20) | (b == 0x7f) | (b == b'{') | (b == b'}') | (b == 0xc2)
    });
    if clean {
        return Ok(());
    }
    if let Some(c) = value
        .chars()
        .find(|c| matches!(c, '{' | '}') || c.is_control())
    {
        return Err(ConfigError::invalid(
            field,
            format!("{value:?} contains {c:?}; braces would change the Redis Cluster hash tag"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keys_share_the_hash_tag() {
        let n = LockName::new("idem", "ab12").unwrap();
        assert_eq!(n.lock_key(), "idem:{ab12}");
        assert_eq!(n.state_key(), "idem:{ab12}:state");
        assert_eq!(n.parts_key(), "idem:{ab12}:parts");
        assert_eq!(n.channel(), "idem:{ab12}:rel");
        assert_eq!(LockName::new("", "x").unwrap().parts_key(), "{x}:parts");
        for key in [n.lock_key(), n.state_key(), n.parts_key()] {
            let open = key.find('{').unwrap();
            let close = open + key[open..].find('}').unwrap();
            assert_eq!(&key[open + 1..close], "ab12");
        }
    }

    #[test]
    fn refuses_bad_names() {
        for bad in [
            "",
            "a{b",
            "}x",
            "line\nbreak",
            &"x".repeat(MAX_NAME_LEN + 1),
        ] {
            assert!(LockName::new("p", bad).is_err(), "{bad:?}");
        }
        assert!(LockName::new("p{", "ok").is_err());
        assert!(LockName::new("p", "ünïcode ok").is_ok());
    }
}
