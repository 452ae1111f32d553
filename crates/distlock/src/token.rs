//! Owner tokens: 128 random bits from a CSPRNG seeded by the operating system.

use std::fmt;
use std::sync::Arc;

use crate::ConfigError;

/// A unique owner token: 128 random bits, written as 32 hex digits.
///
/// Every acquisition gets a fresh token, so a release or renewal can only ever touch the lock it
/// took (article 002's constant value `1` let one caller release another's lock). The bits come
/// from `rand`'s thread-local CSPRNG (ChaCha12, seeded from the operating system's RNG and
/// reseeded periodically): as unpredictable as the OS RNG for this purpose, without a system
/// call per acquisition. (A process that `fork`s without `exec` and takes locks in both parent
/// and child should call `rand::rng().reseed()` in the child.)
///
/// ```
/// let a = distlock::Token::random();
/// let b = distlock::Token::random();
/// assert_ne!(a, b);
/// assert_eq!(a.as_str().len(), 32);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 32]);

impl Token {
    /// Draws a new token.
    ///
    /// # Panics
    /// If the operating system has no usable random source to seed the generator (a lock without
    /// unique tokens is unsafe, so this does not fall back to a weaker source).
    ///
    /// ```
    /// assert!(distlock::Token::random().as_str().chars().all(|c| c.is_ascii_hexdigit()));
    /// ```
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        rand::fill(&mut bytes);
        let mut text = [0u8; 32];
        for (i, b) in bytes.iter().enumerate() {
            text[2 * i] = DIGITS[(b >> 4) as usize];
            text[2 * i + 1] = DIGITS[(b & 0xf) as usize];
        }
        Token(text)
    }

    /// The token text stored in Redis.
    ///
    /// ```
    /// let t = distlock::Token::random();
    /// assert_eq!(t.to_string(), t.as_str());
    /// ```
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

const DIGITS: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.as_str())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The identity of a reentrant lock owner: every acquisition by the same owner id nests.
///
/// Use one id per logical owner (a task, a job run, a request); [`OwnerId::random`] makes a fresh
/// one. Two owners must never share an id, exactly as two holders must never share a token.
///
/// ```
/// let owner = distlock::OwnerId::new("worker-7/job-42")?;
/// assert_eq!(owner.as_str(), "worker-7/job-42");
/// assert!(distlock::OwnerId::new("").is_err());
/// # Ok::<(), distlock::ConfigError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OwnerId(Arc<str>);

impl OwnerId {
    /// An owner id from your own unique identifier (1 to 256 bytes, no control characters).
    ///
    /// ```
    /// assert!(distlock::OwnerId::new("a\nb").is_err());
    /// ```
    pub fn new(id: impl Into<String>) -> Result<Self, ConfigError> {
        let id = id.into();
        if id.is_empty() || id.len() > 256 {
            return Err(ConfigError::invalid(
                "owner",
                format!("an owner id is 1 to 256 bytes, got {}", id.len()),
            ));
        }
        if id.chars().any(char::is_control) {
            return Err(ConfigError::invalid(
                "owner",
                "an owner id must not contain control characters",
            ));
        }
        Ok(OwnerId(id.into()))
    }

    /// A fresh random owner id (a [`Token`]).
    ///
    /// ```
    /// assert_ne!(distlock::OwnerId::random(), distlock::OwnerId::random());
    /// ```
    pub fn random() -> Self {
        OwnerId(Token::random().as_str().into())
    }

    /// The id text.
    ///
    /// ```
    /// assert_eq!(distlock::OwnerId::new("me").unwrap().as_str(), "me");
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_hex_digits() {
        let t = Token::random();
        assert_eq!(t.as_str().len(), 32);
        assert!(t.as_str().bytes().all(|b| DIGITS.contains(&b)));
    }

    #[test]
    fn tokens_do_not_repeat() {
        let set: std::collections::HashSet<_> = (0..10_000).map(|_| Token::random()).collect();
        assert_eq!(set.len(), 10_000);
    }
}
