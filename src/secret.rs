//! The server secret and what is derived from it.
//!
//! * At build: `PRK = HKDF-Extract(salt = "tower-idempotency/v3", ikm = secret)`, and from it a
//!   fingerprint key (`HKDF-Expand(PRK, "fingerprint")`).
//! * Per request, one `HKDF-Expand(PRK, scope ‖ raw key, 64 bytes)`: the first 32 bytes name
//!   the key in the store, the last 32 are the AES-256-GCM key of its record. The record can
//!   only be opened (or forged) with the raw idempotency key, its scope and the secret. (On the
//!   in-memory store, whose records stay in the process unsealed, 32 bytes: the name, the same
//!   as the first 32 of the 64.)
//! * The request fingerprint is an HMAC-SHA256 under the fingerprint key.
//!
//! Without a secret the same derivations run with an empty one: nothing raw reaches the store,
//! but whoever can read the store and guess a key (a phone number is found by enumeration in
//! minutes) can recompute its name, open its record and forge one. With a secret, none of it
//! can be computed without the secret.

use hkdf::Hkdf;
use hmac::{Hmac, KeyInit};
use sha2::Sha256;

/// The fingerprint MAC, keyed once at build and cloned per request.
pub(crate) type FingerprintMac = Hmac<Sha256>;

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// Keys derived from the server secret (or from none).
#[derive(Clone)]
pub(crate) struct Keys {
    hkdf: Hkdf<Sha256>,
    fingerprint: FingerprintMac,
    secret: bool,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("secret", &self.secret)
            .finish_non_exhaustive()
    }
}

/// What one idempotency key, in its scope, derives to.
pub(crate) struct Derived {
    /// The name of the key in the store: 64 hex digits.
    pub(crate) name: String,
    /// The AES-256-GCM key of its record (`None` when none was asked for: a record kept in
    /// clear, by the in-memory store).
    pub(crate) record_key: Option<[u8; 32]>,
}

impl Keys {
    pub(crate) fn new(secret: Option<&[u8]>) -> Self {
        let hkdf = Hkdf::<Sha256>::new(Some(b"tower-idempotency/v3"), secret.unwrap_or_default());
        let mut fingerprint_key = [0u8; 32];
        // 32 bytes is always a valid HKDF-SHA256 output length (at most 255 × 32).
        let _ = hkdf.expand(b"tower-idempotency/fingerprint", &mut fingerprint_key);
        let fingerprint = match FingerprintMac::new_from_slice(&fingerprint_key) {
            Ok(mac) => mac,
            // HMAC takes keys of any length.
            Err(_) => unreachable!("HMAC accepts a 32-byte key"),
        };
        Keys {
            hkdf,
            fingerprint,
            secret: secret.is_some(),
        }
    }

    /// Whether a server secret was set.
    pub(crate) fn has_secret(&self) -> bool {
        self.secret
    }

    /// The store name and (`sealed`) record key of the key whose scope and value are `info`
    /// (fields already length-prefixed by the caller). HKDF's output is a stream: the name is
    /// the same whether the record key is derived after it or not.
    pub(crate) fn derive(&self, info: &[&[u8]], sealed: bool) -> Derived {
        let mut okm = [0u8; 64];
        let len = if sealed { 64 } else { 32 };
        // 32 and 64 bytes are valid HKDF-SHA256 output lengths (at most 255 × 32).
        let _ = self.hkdf.expand_multi_info(info, &mut okm[..len]);
        let record_key = sealed.then(|| {
            let mut key = [0u8; 32];
            key.copy_from_slice(&okm[32..]);
            key
        });
        Derived {
            name: hex(&okm[..32]),
            record_key,
        }
    }

    /// A fresh fingerprint MAC (keyed; feed it the request).
    pub(crate) fn fingerprinter(&self) -> FingerprintMac {
        self.fingerprint.clone()
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    // Pushed as chars (ASCII: one byte each), so the string is never checked again as UTF-8.
    let mut digits = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        digits.push(char::from(DIGITS[usize::from(b >> 4)]));
        digits.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    digits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_changes_every_derivation() {
        let none = Keys::new(None);
        let a = Keys::new(Some(b"0123456789abcdef-a"));
        let b = Keys::new(Some(b"0123456789abcdef-b"));
        let info: &[&[u8]] = &[b"scope", b"+15550100"];
        let (n, ka, kb) = (
            none.derive(info, true),
            a.derive(info, true),
            b.derive(info, true),
        );
        assert_eq!(n.name.len(), 64);
        assert_ne!(n.name, ka.name);
        assert_ne!(ka.name, kb.name);
        assert_ne!(ka.record_key, kb.record_key);
        assert_eq!(ka.name, a.derive(info, true).name, "deterministic");
        assert_ne!(ka.name, a.derive(&[b"scope", b"+15550101"], true).name);
        // The name and the record key are independent halves.
        let record_key = ka.record_key.unwrap();
        assert_ne!(&hex(&record_key), &ka.name);
        // Without the record key, the same name.
        let unsealed = a.derive(info, false);
        assert_eq!(unsealed.name, ka.name);
        assert_eq!(unsealed.record_key, None);
        assert_eq!(hex(&[0x00, 0x7f, 0xab, 0xff]), "007fabff");
    }
}
