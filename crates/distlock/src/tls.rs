//! TLS for `rediss://` connections: which certificate authority to trust and, for mutual TLS,
//! which certificate to present.
//!
//! A `rediss://` URL is all it takes when the server's certificate chains to a root the system
//! trusts (managed services): [`LockClientBuilder::connect`](crate::LockClientBuilder::connect),
//! [`connect_redlock`](crate::LockClientBuilder::connect_redlock),
//! [`connect_cluster`](crate::LockClientBuilder::connect_cluster) and
//! [`sentinel`](crate::LockClientBuilder::sentinel) connect over TLS (rustls, with the `ring`
//! crypto provider unless the process installed another). A private CA, or a client certificate
//! for servers started with `tls-auth-clients yes`, is given with
//! [`LockClientBuilder::tls`](crate::LockClientBuilder::tls).
//!
//! A server whose certificate does not chain to the trusted roots, or whose name does not match
//! the URL's host, fails the handshake: [`LockClient::prepare`](crate::LockClient::prepare)
//! returns a [`LockError::Config`](crate::LockError::Config) naming the TLS failure, and no
//! lock waits on such a connection
//! longer than its command timeout. A server that refuses the client's certificate fails it
//! too, seen as its alert or as a closed connection (TLS 1.3 sends the alert after the client
//! finished its side of the handshake).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::ConfigError;

/// TLS settings for `rediss://` URLs: trusted roots and an optional client certificate.
///
/// ```
/// # fn pem(_: &str) -> Vec<u8> { Vec::new() }
/// let tls = distlock::Tls::new();
/// assert!(!tls.has_roots());
/// // A PEM file that holds no certificate is refused when given, not when connecting:
/// assert!(distlock::Tls::new().root_certificates(b"not a certificate".to_vec()).is_err());
/// ```
#[derive(Clone, Default)]
pub struct Tls {
    roots: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("roots", &self.roots.as_ref().map(|_| "<PEM>"))
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<PEM, redacted>"),
            )
            .finish()
    }
}

impl Tls {
    /// The system's trusted roots, no client certificate.
    ///
    /// ```
    /// let tls = distlock::Tls::new();
    /// # let _ = tls;
    /// ```
    pub fn new() -> Self {
        Tls::default()
    }

    /// Trust these certificate authorities (PEM, one or more certificates) instead of the
    /// system's roots.
    ///
    /// # Errors
    /// If `pem` holds no certificate, or one that cannot be parsed.
    ///
    /// ```
    /// assert!(distlock::Tls::new().root_certificates(Vec::new()).is_err());
    /// ```
    pub fn root_certificates(mut self, pem: impl Into<Vec<u8>>) -> Result<Self, ConfigError> {
        let pem = pem.into();
        certificates("tls roots", &pem)?;
        self.roots = Some(pem);
        Ok(self)
    }

    /// Present this certificate (PEM chain, leaf first) and private key (PEM) to servers that
    /// ask for one (mutual TLS, `tls-auth-clients yes`).
    ///
    /// # Errors
    /// If the chain holds no certificate or the key cannot be parsed.
    ///
    /// ```
    /// assert!(distlock::Tls::new().client_identity(Vec::new(), Vec::new()).is_err());
    /// ```
    pub fn client_identity(
        mut self,
        certificate_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Result<Self, ConfigError> {
        let (cert, key) = (certificate_pem.into(), key_pem.into());
        certificates("tls client certificate", &cert)?;
        PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
            ConfigError::invalid("tls client key", format!("no private key in the PEM: {e}"))
        })?;
        self.identity = Some((cert, key));
        Ok(self)
    }

    /// Whether roots other than the system's are set.
    ///
    /// ```
    /// assert!(!distlock::Tls::new().has_roots());
    /// ```
    pub fn has_roots(&self) -> bool {
        self.roots.is_some()
    }

    pub(crate) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self
                .identity
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.roots.clone(),
        }
    }
}

fn certificates(field: &'static str, pem: &[u8]) -> Result<(), ConfigError> {
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(pem) {
        cert.map_err(|e| ConfigError::invalid(field, format!("unreadable PEM certificate: {e}")))?;
        count += 1;
    }
    if count == 0 {
        return Err(ConfigError::invalid(field, "no certificate in the PEM"));
    }
    Ok(())
}

/// Installs rustls's `ring` provider as the process default unless one is installed already
/// (by the application, or by an earlier call), so that a process whose dependencies enable
/// several providers does not fail to pick one.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: a provider is installed either way.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Whether `info` is a TLS address (`rediss://`).
pub(crate) fn is_tls(info: &redis::ConnectionInfo) -> bool {
    matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. })
}

/// `info` without redis-rs's `CLIENT SETINFO` on connecting: a command outside the lock's ACL
/// rules (Redis 7.0 cannot even name it in a rule), whose refusal Valkey and Redis 7.2+ record
/// in the ACL log on every connection.
pub(crate) fn quiet(info: redis::ConnectionInfo) -> redis::ConnectionInfo {
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    info.set_redis_settings(settings)
}

/// A `redis::Client` for `url`, with `tls` applied to `rediss://` URLs.
pub(crate) fn client(url: &str, tls: Option<&Tls>) -> Result<redis::Client, ConfigError> {
    let shown = crate::redact_url(url);
    let invalid = |e: redis::RedisError| ConfigError::invalid("url", format!("{shown}: {e}"));
    let info = quiet(redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?);
    if !is_tls(&info) {
        if tls.is_some() {
            return Err(ConfigError::invalid(
                "url",
                format!("{shown}: TLS settings were given, but the URL is not rediss://"),
            ));
        }
        return redis::Client::open(info).map_err(invalid);
    }
    ensure_crypto_provider();
    match tls {
        Some(tls) => redis::Client::build_with_tls(info, tls.certificates()).map_err(invalid),
        None => redis::Client::open(info).map_err(invalid),
    }
}
