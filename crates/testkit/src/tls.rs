//! Certificates for TLS tests: a certificate authority, a server certificate for loopback and a
//! client certificate, generated with rcgen and written as PEM files for `redis-server`.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::HarnessError;

/// A fresh certificate authority with a server certificate (for `127.0.0.1` and `localhost`,
/// also usable as a client certificate, as Redis replication and the cluster bus need) and a
/// client certificate, in PEM files of a temp dir that lives as long as the value.
///
/// ```
/// let ca = testkit::TestCa::new("example").unwrap();
/// assert!(ca.ca_pem().starts_with(b"-----BEGIN CERTIFICATE-----"));
/// assert!(ca.server_cert_path().is_file());
/// // Another CA: a client that trusts it must refuse this one's server.
/// let other = testkit::TestCa::new("other").unwrap();
/// assert_ne!(ca.ca_pem(), other.ca_pem());
/// ```
#[derive(Debug)]
pub struct TestCa {
    dir: tempfile::TempDir,
}

fn harness(what: &str) -> impl FnOnce(rcgen::Error) -> HarnessError + '_ {
    move |e| HarnessError(format!("cannot generate the {what}: {e}"))
}

impl TestCa {
    /// Generates the CA (common name `testkit CA <name>`) and its certificates.
    ///
    /// # Errors
    /// If a key or certificate cannot be generated or written.
    pub fn new(name: &str) -> Result<Self, HarnessError> {
        let dir = tempfile::tempdir()
            .map_err(|e| HarnessError(format!("cannot create a temp dir: {e}")))?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(harness("CA"))?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("testkit CA {name}"));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().map_err(harness("CA key"))?;
        let ca_cert = ca.self_signed(&ca_key).map_err(harness("CA certificate"))?;
        let issuer = Issuer::new(ca, ca_key);

        let leaf = |common: &str, sans: Vec<String>, usages: Vec<ExtendedKeyUsagePurpose>| {
            let mut params = CertificateParams::new(sans).map_err(harness("certificate"))?;
            params.distinguished_name.push(DnType::CommonName, common);
            params.extended_key_usages = usages;
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            let key = KeyPair::generate().map_err(harness("key"))?;
            let cert = params
                .signed_by(&key, &issuer)
                .map_err(harness("certificate"))?;
            Ok::<_, HarnessError>((cert.pem(), key.serialize_pem()))
        };
        let server = leaf(
            "redis-server",
            vec!["127.0.0.1".into(), "localhost".into()],
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )?;
        let client = leaf(
            "testkit client",
            Vec::new(),
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?;
        let files = [
            ("ca.crt", ca_cert.pem()),
            ("server.crt", server.0),
            ("server.key", server.1),
            ("client.crt", client.0),
            ("client.key", client.1),
        ];
        for (file, pem) in files {
            std::fs::write(dir.path().join(file), pem)
                .map_err(|e| HarnessError(format!("cannot write {file}: {e}")))?;
        }
        Ok(TestCa { dir })
    }

    fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(file))
            .unwrap_or_else(|e| panic!("the CA's {file} was written when it was made: {e}"))
    }

    /// The CA certificate (PEM), for a client's trusted roots.
    pub fn ca_pem(&self) -> Vec<u8> {
        self.read("ca.crt")
    }

    /// The client certificate (PEM), for mutual TLS.
    pub fn client_cert_pem(&self) -> Vec<u8> {
        self.read("client.crt")
    }

    /// The client certificate's private key (PEM).
    pub fn client_key_pem(&self) -> Vec<u8> {
        self.read("client.key")
    }

    /// The CA certificate's file.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// The server certificate's file.
    pub fn server_cert_path(&self) -> PathBuf {
        self.dir.path().join("server.crt")
    }

    /// The server key's file.
    pub fn server_key_path(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }

    /// The client certificate's file.
    pub fn client_cert_path(&self) -> PathBuf {
        self.dir.path().join("client.crt")
    }

    /// The client key's file.
    pub fn client_key_path(&self) -> PathBuf {
        self.dir.path().join("client.key")
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `redis-server` arguments serving TLS with these certificates (the server certificate
    /// also as the client certificate of replication and the cluster bus), clients asked for a
    /// certificate when `mutual`. The TLS port itself is given by the harness.
    pub fn server_args(&self, mutual: bool) -> Vec<String> {
        let path = |p: PathBuf| p.display().to_string();
        vec![
            "--tls-cert-file".into(),
            path(self.server_cert_path()),
            "--tls-key-file".into(),
            path(self.server_key_path()),
            "--tls-ca-cert-file".into(),
            path(self.ca_path()),
            "--tls-auth-clients".into(),
            if mutual { "yes" } else { "no" }.into(),
        ]
    }

    /// A `redis::TlsCertificates` trusting this CA, with the client certificate when `mutual`.
    pub fn certificates(&self, mutual: bool) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: mutual.then(|| redis::ClientTlsConfig {
                client_cert: self.client_cert_pem(),
                client_key: self.client_key_pem(),
            }),
            root_cert: Some(self.ca_pem()),
        }
    }
}
